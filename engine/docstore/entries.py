"""The document store's entry format: a safetensors file, written by hand so that a large non-contiguous
tensor (one row of a preallocated cache) is streamed to disk without a contiguous copy, and checksummed on
the way; read back with every size and CRC checked (engine/docstore/store.py keeps the folder)."""
from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path
from typing import Callable, Iterator, Mapping

import torch

FORMAT = "specache-kv-1"

_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}
_FROM_CODE = {v: k for k, v in _DTYPES.items()}


class EntryError(Exception):
    """An entry that must not be used (truncated, corrupt, or not what the key promises)."""


def _pieces(t: torch.Tensor) -> Iterator[memoryview]:
    """The tensor's bytes in row-major order, as contiguous pieces, without copying big tensors."""
    if t.is_contiguous() or t.dim() <= 1 or t.numel() * t.element_size() <= 1 << 16:
        yield memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
        return
    for sub in t:
        yield from _pieces(sub)


def _header_bytes(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, object]) -> tuple[bytes, list[str]]:
    # widest elements first: every tensor then starts aligned to its element size
    names = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header: dict[str, object] = {}
    offset = 0
    crcs = {}
    for name in names:
        t = tensors[name]
        if t.dtype not in _DTYPES:
            raise TypeError(f"tensor {name}: dtype {t.dtype} cannot be stored")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
        crc = 0
        for piece in _pieces(t):
            crc = zlib.crc32(piece, crc)
        crcs[name] = crc
    header["__metadata__"] = {"specache": json.dumps({**meta, "crc32": crcs}, sort_keys=True)}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    return raw, names


def serialized_size(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, object]) -> int:
    """Bytes the entry will take (the header estimated without computing checksums)."""
    data = sum(t.numel() * t.element_size() for t in tensors.values())
    header = sum(len(n) + 80 + 12 * t.dim() for n, t in tensors.items()) + len(json.dumps(dict(meta), default=str))
    return 8 + header + 16 * len(tensors) + data


def write(path: Path, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, object],
          on_piece: Callable[[], None] | None = None) -> int:
    """Write a safetensors file (fsynced) at path. -> bytes written."""
    raw, names = _header_bytes(tensors, meta)
    written = 8 + len(raw)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in names:
            for piece in _pieces(tensors[name]):
                f.write(piece)
                written += len(piece)
                if on_piece is not None:
                    on_piece()
        f.flush()
        os.fsync(f.fileno())
    return written


def _split_header(buf: bytes | bytearray, size: int) -> tuple[dict, int]:
    if size < 8:
        raise EntryError("truncated (no header)")
    (n,) = struct.unpack("<Q", bytes(buf[:8]))
    if n > size - 8 or n > 1 << 26:
        raise EntryError("truncated or corrupt header")
    try:
        header = json.loads(bytes(buf[8 : 8 + n]))
        meta = json.loads(header.pop("__metadata__")["specache"])
    except (ValueError, KeyError, TypeError) as exc:
        raise EntryError(f"unreadable header ({type(exc).__name__})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise EntryError("not a specache store entry of this version")
    return {"header": header, "meta": meta}, 8 + n


def read_header(path: Path) -> tuple[dict, dict]:
    """(tensor table, metadata) of an entry, reading only its header."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise EntryError("truncated (no header)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 1 << 26:
            raise EntryError("truncated or corrupt header")
        parsed, _ = _split_header(head + f.read(n), 8 + n)
    return parsed["header"], parsed["meta"]


def parse(buf: bytearray, verify: bool = True) -> tuple[dict[str, torch.Tensor], dict]:
    """Tensors (views into buf) and metadata of a whole entry; checks sizes and, if verify, CRCs."""
    parsed, start = _split_header(buf, len(buf))
    table, meta = parsed["header"], parsed["meta"]
    crcs = meta.get("crc32", {})
    end = start
    tensors = {}
    for name, spec in table.items():
        try:
            dtype = _FROM_CODE[spec["dtype"]]
            a, b = (start + int(x) for x in spec["data_offsets"])
            shape = [int(s) for s in spec["shape"]]
        except (KeyError, TypeError, ValueError):
            raise EntryError(f"bad tensor entry {name!r}") from None
        count = 1
        for s in shape:
            count *= s
        if b > len(buf) or a > b or b - a != count * torch.empty(0, dtype=dtype).element_size():
            raise EntryError(f"truncated (tensor {name!r} ends past the file)" if b > len(buf)
                             else f"inconsistent size of tensor {name!r}")
        view = memoryview(buf)[a:b]
        if verify and (name not in crcs or zlib.crc32(view) != crcs[name]):
            raise EntryError(f"checksum mismatch in tensor {name!r}")
        tensors[name] = (torch.frombuffer(buf, dtype=dtype, count=count, offset=a) if count
                         else torch.empty(0, dtype=dtype)).view(shape)
        end = max(end, b)
    if end != len(buf):
        raise EntryError(f"{len(buf) - end} unexpected trailing bytes")
    if set(crcs) != set(tensors):
        raise EntryError("the tensor list differs from the checksummed one")
    return tensors, meta
