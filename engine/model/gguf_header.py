"""GGUF headers: a file's scalar metadata and tensor table read without mapping the file (read_header, with
the checks that refuse a damaged one in one line), the architectures the engine holds in their blocks, and
what a file's weights take as held, from its header alone (estimate_held_bytes, file_type).

The header's conversion into a model folder is engine.model.gguf_convert's; its tensors are read by
engine.model.gguf_tensors.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

from engine.errors import ModelLoadError
from engine.model import families


def held_architecture(arch: str) -> bool:
    """Whether a GGUF architecture's tensors map one to one onto the Hugging Face model's parameters (Q and
    K rows permuted back for llama-style files) and are held in their blocks: a registered family's
    (engine.model.families). Other architectures transformers reads from GGUF load through transformers
    (dequantized to fp32)."""
    return arch in families.held_architectures()


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ne: tuple[int, ...]  # GGUF's order: the row length first
    kind: Q
    offset: int  # from the start of the file
    n_bytes: int


@dataclass(frozen=True)
class Header:
    """A GGUF file's scalar metadata (arrays, such as the tokenizer's, skipped) and tensor table."""

    fields: dict
    tensors: dict[str, TensorInfo]

    @property
    def arch(self) -> str:
        return str(self.fields.get("general.architecture", ""))


_SCALARS = {V.UINT8: "<B", V.INT8: "<b", V.UINT16: "<H", V.INT16: "<h", V.UINT32: "<I", V.INT32: "<i",
            V.FLOAT32: "<f", V.BOOL: "<?", V.UINT64: "<Q", V.INT64: "<q", V.FLOAT64: "<d"}


def _unpack(f, fmt: str):
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise ValueError("the file ends inside its header")
    return struct.unpack(fmt, data)[0]


def _left(f) -> int:
    """Bytes of the file after the read position."""
    return os.fstat(f.fileno()).st_size - f.tell()


def _string(f) -> str:
    n = _unpack(f, "<Q")
    if n > _left(f):  # a damaged length: never ask for terabytes
        raise ValueError(f"a string of {n} bytes runs past the end of the file")
    return f.read(n).decode("utf-8", errors="replace")


def _value(f, vtype: int, arrays: bool = False):
    """One metadata value. Arrays: skipped (None; strings of arrays without decoding them), or with
    arrays=True read, as a list (strings, nested arrays, booleans) or a list of numbers."""
    vtype = V(vtype)
    if vtype == V.STRING:
        return _string(f)
    if vtype != V.ARRAY:
        return _unpack(f, _SCALARS[vtype])
    itype, count = V(_unpack(f, "<I")), _unpack(f, "<Q")
    if count > _left(f):
        raise ValueError(f"an array of {count} values runs past the end of the file")
    if itype == V.STRING:
        return _read_strings(f, count) if arrays else _skip_strings(f, count)
    if itype == V.ARRAY:
        items = [_value(f, V.ARRAY, arrays) for _ in range(count)]
        return items if arrays else None
    fmt = _SCALARS[itype]
    size = count * struct.calcsize(fmt)
    if not arrays:
        f.seek(size, os.SEEK_CUR)
        return None
    data = f.read(size)
    if len(data) != size:
        raise ValueError("the file ends inside its header")
    return np.frombuffer(data, dtype=np.dtype(fmt)).tolist()


def _read_strings(f, count: int) -> list[str]:
    """count length-prefixed strings (a tokenizer's 262k tokens: one struct.unpack_from each on a buffer)."""
    start, buf, off, out = f.tell(), b"", 0, []
    unpack = struct.Struct("<Q").unpack_from
    for _ in range(count):
        if off + 8 > len(buf) or off + 8 + unpack(buf, off)[0] > len(buf):
            start += off
            f.seek(start)
            n = unpack(f.read(8).ljust(8, b"\0"))[0]
            f.seek(start)
            if n > _left(f):  # a damaged length: never ask for terabytes
                raise ValueError(f"a string of {n} bytes runs past the end of the file")
            buf, off = f.read(max(1 << 20, 8 + n)), 0
            if len(buf) < 8 or 8 + unpack(buf, 0)[0] > len(buf):
                raise ValueError("the file ends inside its header")
        n = unpack(buf, off)[0]
        out.append(buf[off + 8 : off + 8 + n].decode("utf-8", errors="replace"))
        off += 8 + n
    f.seek(start + off)
    return out


def _skip_strings(f, count: int) -> None:
    """Skip count length-prefixed strings (a tokenizer's 262k tokens: one struct.unpack_from each on a
    buffer, not a read and a seek)."""
    start, buf, off = f.tell(), b"", 0
    for _ in range(count):
        if off + 8 > len(buf):
            start += off
            f.seek(start)
            buf, off = f.read(1 << 20), 0
            if len(buf) < 8:
                raise ValueError("the file ends inside its header")
        off += 8 + struct.unpack_from("<Q", buf, off)[0]
    f.seek(start + off)


def read_header(path: Path, arrays: bool = False) -> Header:
    """The header of a GGUF file (format v2/v3), read without mapping the file: the gguf package's
    reader decodes every tokenizer string into numpy views, 7 s for SmolLM2's 49k tokens. arrays: the
    metadata's arrays too (the tokenizer's vocabulary), as lists; else None in their place."""
    try:
        with open(path, "rb", buffering=1 << 20) as f:
            if f.read(4) != b"GGUF":
                raise ValueError("no GGUF magic")
            version = _unpack(f, "<I")
            if version < 2:
                raise ValueError(f"GGUF version {version} is not supported")
            n_tensors, n_fields = _unpack(f, "<Q"), _unpack(f, "<Q")
            if max(n_tensors, n_fields) > _left(f):
                raise ValueError(f"its header counts {n_tensors} tensors and {n_fields} fields, more than it has bytes")
            fields = {}
            for _ in range(n_fields):
                key = _string(f)
                fields[key] = _value(f, _unpack(f, "<I"), arrays)
            infos = []
            for _ in range(n_tensors):
                name = _string(f)
                n_dims = _unpack(f, "<I")
                if not 1 <= n_dims <= 4:
                    raise ValueError(f"tensor {name} has {n_dims} dimensions")
                ne = tuple(_unpack(f, "<Q") for _ in range(n_dims))
                kind = _unpack(f, "<I")
                if kind not in Q._value2member_map_ or Q(kind) not in gguf.GGML_QUANT_SIZES:
                    raise ValueError(f"tensor {name} has the unknown block type {kind}")
                infos.append((name, ne, Q(kind), _unpack(f, "<Q")))
            align = int(fields.get("general.alignment") or gguf.GGUF_DEFAULT_ALIGNMENT)
            start = -(-f.tell() // align) * align
            file_size = os.fstat(f.fileno()).st_size
    except (OSError, ValueError, KeyError, UnicodeDecodeError, struct.error, OverflowError) as exc:
        raise ModelLoadError(f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc})") from None
    tensors = {}
    for name, ne, kind, offset in infos:
        block, size = gguf.GGML_QUANT_SIZES[kind]
        if min(ne) < 1 or ne[0] % block:
            raise ModelLoadError(f"{path} is damaged: tensor {name} has the shape {list(ne)}, not whole {kind.name} "
                                 f"blocks of {block}")
        info = TensorInfo(name, ne, kind, start + offset, int(np.prod(ne, dtype=object)) // block * size)
        if info.offset + info.n_bytes > file_size:
            raise ModelLoadError(f"{path} ends inside tensor {name} (the file has {file_size} bytes, the tensor "
                                 f"needs up to byte {info.offset + info.n_bytes}): a partial download?")
        tensors[name] = info
    return Header(fields, tensors)


def check_architecture(arch: str, path: Path) -> None:
    """Refuse an architecture transformers cannot read from GGUF, in one line."""
    readable = [a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer")]
    if arch not in readable and arch.replace("-", "_") not in readable:
        raise ModelLoadError(f"{path.name}: GGUF architecture {arch!r} cannot be read by transformers "
                             f"(it reads {', '.join(readable)})")


# bytes a weight takes as held (engine.model.gguf_tensors' table): what the planner and `specache models` count
HELD_BYTES_PER_WEIGHT = {Q.Q4_0: 18 / 32, Q.Q4_1: 20 / 32, Q.Q4_K: 144 / 256, Q.Q5_0: 22 / 32, Q.Q8_0: 34 / 32,
                         Q.Q5_1: 24 / 32, Q.Q5_K: 176 / 256, Q.Q6_K: 210 / 256, Q.F16: 2, Q.BF16: 2, Q.F32: 4}


def estimate_held_bytes(header: Header) -> int:
    """The weights of a GGUF file as the engine holds them on the CPU, from its header alone (an
    untied token embedding stays in the file)."""
    untied = "output.weight" in header.tensors
    total = 0
    for t in header.tensors.values():
        if untied and t.name == "token_embd.weight":
            continue
        total += int(int(np.prod(t.ne)) * HELD_BYTES_PER_WEIGHT.get(t.kind, 4))
    return total


def file_type(header: Header) -> str:
    """The file's main weight format: the kind most of its weights are in (Q4_K, Q8_0...)."""
    count: dict[str, int] = {}
    for t in header.tensors.values():
        count[t.kind.name] = count.get(t.kind.name, 0) + int(np.prod(t.ne))
    return max(count, key=count.get) if count else "?"
