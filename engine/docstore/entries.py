"""The document store's entry format: a safetensors file, written by hand so that a large non-contiguous
tensor (one row of a preallocated cache) is streamed to disk without a contiguous copy, and checksummed on
the way; read back mapped (engine.backends.host_pages.MappedFile) with every size checked, and every CRC but
those of the paged tensors (engine/docstore/store.py keeps the folder).

Format specache-kv-2: the data start on a page (the header padded with spaces) and the paged tensors (a
row's exact K/V [H_kv, n, D], the bulk of an entry) come first, each leading slice padded with zero rows to
whole pages (host_pages.paged_length; the header's shape is the padded one, the metadata's "paged" gives n):
every KV head's rows start on a page of the file, so that a load maps them into the host store in place
(MappedFile.place) instead of reading them. A load does not read them: it checks their place and size, not
their CRC (which the writer records all the same). Entries of specache-kv-1 (no paged tensors, every
tensor checksummed on load) are still read; their rows are copied in as before."""
from __future__ import annotations

import json
import math
import mmap
import os
import struct
import zlib
from pathlib import Path
from typing import Callable, Collection, Iterator, Mapping

import torch

from engine.backends.host_pages import PAGE, MappedFile, paged_length

FORMAT = "specache-kv-2"
READABLE = ("specache-kv-1", FORMAT)  # the formats a load accepts
KEY_FORMAT = "specache-kv-1"  # in every key (store.make_key): kv-2 holds the same state, so kv-1 entries still hit

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


def _padded_shape(t: torch.Tensor) -> list[int]:
    """A paged tensor's shape on disk: [A, n, D] with n rounded up to whole pages per leading slice."""
    if t.dim() != 3 or t.shape[1] == 0:
        raise ValueError(f"a paged tensor is [A, n, D] with n > 0, not {tuple(t.shape)}")
    return [t.shape[0], paged_length(t.shape[1], t.shape[2] * t.element_size()), t.shape[2]]


def _paged_pieces(t: torch.Tensor) -> Iterator[memoryview]:
    """A paged tensor's bytes on disk: each leading slice, then zero rows up to whole pages."""
    pad = (_padded_shape(t)[1] - t.shape[1]) * t.shape[2] * t.element_size()
    for sub in t:
        yield from _pieces(sub)
        if pad:
            yield memoryview(bytes(pad))


def _paged(meta: Mapping[str, object]) -> Collection[str]:
    """The tensors the metadata's "paged" names ({name: its rows n}: stored page by page)."""
    return meta.get("paged") or {}


def _order(tensors: Mapping[str, torch.Tensor], paged: Collection[str]) -> list[str]:
    """The paged tensors first (each a whole number of pages), then the widest elements first: every tensor
    starts aligned to its element size, every paged one on a page."""
    return sorted(tensors, key=lambda n: (n not in paged, -tensors[n].element_size(), n))


def _header_bytes(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, object]) -> tuple[bytes, list[str]]:
    paged = _paged(meta)
    header: dict[str, object] = {}
    offset = 0
    crcs = {}
    for name in _order(tensors, paged):
        t = tensors[name]
        if t.dtype not in _DTYPES:
            raise TypeError(f"tensor {name}: dtype {t.dtype} cannot be stored")
        shape = _padded_shape(t) if name in paged else list(t.shape)
        n = math.prod(shape) * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
        crc = 0
        for piece in (_paged_pieces(t) if name in paged else _pieces(t)):
            crc = zlib.crc32(piece, crc)
        crcs[name] = crc
    header["__metadata__"] = {"specache": json.dumps({**meta, "crc32": crcs}, sort_keys=True)}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % (PAGE if paged else 8))  # the data start on a page (else 8-byte aligned)
    return raw, _order(tensors, paged)


def serialized_size(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, object]) -> int:
    """Bytes the entry will take (the header estimated without computing checksums)."""
    paged = _paged(meta)
    data = sum(math.prod(_padded_shape(t) if n in paged else t.shape) * t.element_size() for n, t in tensors.items())
    header = sum(len(n) + 80 + 12 * t.dim() for n, t in tensors.items()) + len(json.dumps(dict(meta), default=str))
    return 8 + header + (PAGE if paged else 0) + 16 * len(tensors) + data  # (PAGE: the data start on a page)


def write(path: Path, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, object],
          on_piece: Callable[[], None] | None = None) -> int:
    """Write a safetensors file (fsynced) at path; meta's "paged" ({name: n}) names the [A, n, D] tensors
    stored page by page (the module docstring). -> bytes written."""
    raw, names = _header_bytes(tensors, meta)
    paged = _paged(meta)
    written = 8 + len(raw)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in names:
            for piece in (_paged_pieces(tensors[name]) if name in paged else _pieces(tensors[name])):
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
    if not isinstance(meta, dict) or meta.get("format") not in READABLE:
        raise EntryError("not a specache store entry of a version this one reads")
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


def _spec(name: str, spec: object, start: int, size: int) -> tuple[torch.dtype, int, int, list[int]]:
    """(dtype, first and end byte in the file, shape) of one tensor of the header, checked against the file."""
    try:
        dtype = _FROM_CODE[spec["dtype"]]
        a, b = (start + int(x) for x in spec["data_offsets"])
        shape = [int(s) for s in spec["shape"]]
    except (KeyError, TypeError, ValueError):
        raise EntryError(f"bad tensor entry {name!r}") from None
    if b > size or a > b or b - a != math.prod(shape) * dtype.itemsize or min(shape, default=0) < 0:
        raise EntryError(f"truncated (tensor {name!r} ends past the file)" if b > size
                         else f"inconsistent size of tensor {name!r}")
    return dtype, a, b, shape


def _paged_rows(meta: dict, name: str, shape: list[int]) -> int | None:
    """A paged tensor's rows n (its first n of shape[1]), None for another tensor."""
    paged = meta.get("paged") or {}
    if not isinstance(paged, dict):
        raise EntryError("bad list of paged tensors")
    n = paged.get(name)
    if n is None:
        return None
    if not (isinstance(n, int) and len(shape) == 3 and 0 < n <= shape[1]):
        raise EntryError(f"bad paged tensor {name!r}")
    return n


def parse(buf: bytearray | mmap.mmap, verify: bool = True,
          mapped: MappedFile | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Tensors (views into buf; a paged tensor as its first n rows) and metadata of a whole entry; checks sizes
    and, if verify, CRCs. mapped: buf is that file's mapping: the paged tensors are not read (their CRCs not
    checked) and their spans are marked padded for MappedFile.place."""
    parsed, start = _split_header(buf, len(buf))
    table, meta = parsed["header"], parsed["meta"]
    crcs = meta.get("crc32", {})
    end = start
    tensors = {}
    for name, spec in table.items():
        dtype, a, b, shape = _spec(name, spec, start, len(buf))
        rows = _paged_rows(meta, name, shape)
        lazy = rows is not None and mapped is not None
        if verify and not lazy and (name not in crcs or zlib.crc32(memoryview(buf)[a:b]) != crcs[name]):
            raise EntryError(f"checksum mismatch in tensor {name!r}")
        count = math.prod(shape)
        t = (torch.frombuffer(buf, dtype=dtype, count=count, offset=a) if count else torch.empty(0, dtype=dtype))
        tensors[name] = t.view(shape) if rows is None else t.view(shape)[:, :rows]
        if lazy:
            mapped.padded.append((a, b))
        end = max(end, b)
    if end != len(buf):
        raise EntryError(f"{len(buf) - end} unexpected trailing bytes")
    if set(crcs) != set(tensors) or not set(meta.get("paged") or {}) <= set(tensors):
        raise EntryError("the tensor list differs from the checksummed one")
    return tensors, meta
