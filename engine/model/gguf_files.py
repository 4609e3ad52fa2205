"""GGUF files: their config, tokenizer and chat template converted once to a cached folder, and their
tensors read into the blocks the engine computes with, without an fp32 copy.

Block formats (every re-expression is exact: each weight rebuilds to gguf.quants.dequantize's value
bit for bit, tests/test_gguf.py):
  Q4_0 (w = d * (q - 8)), Q4_1 (w = d * q + m), Q8_0 (w = d * q), Q5_0 (w = d * (q - 16)), Q5_1 (w = d * q + m)
                                  -> their own 18-, 20-, 34-, 22-, 24-byte blocks (4.5, 5, 8.5, 5.5, 6 bits; linear_kernels.c
                                     fmt 2, 3, 9, 10, 11), each row's codes then its scales (split_block_rows)
  Q4_K, Q5_K (8 sub-blocks of 32: d * sc, dmin * min, 6-bit sc and min), Q6_K (16 sub-blocks of 16:
  d * sc, q - 32)                 -> their own superblocks (4.5, 5.5, 6.6 bits), read by the native decode
                                     kernel (linear_kernels.c fmt 7, 5, 6; rebuilt natively or by torch for tiles)
  F32, F16, BF16                  -> held as they are
  anything else (Q2_K, Q3_K, IQ*) -> fp32, gguf.quants.dequantize (exact, 32 bits a weight)
Tensors are read with pread, not through the memory map, so the file's pages never count in the
process's resident memory; an untied token embedding stays in the file (rows read on lookup).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
import torch
from filelock import FileLock
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from transformers import AutoConfig, AutoTokenizer, GenerationConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

from engine.errors import ModelLoadError
from engine.model.linears import (FORMATS, MIN_FMTS, Q40_FMT, Q41_FMT, Q4K_FMT, Q50_FMT, Q51_FMT, Q5K_FMT, Q6K_FMT,
                                  Q80_FMT, DenseWeight, KQuantWeight, PackedWeight, Q6KWeight)
from engine.model.sources import GGUF_POINTER
from engine.paths import cache_root

IDENTITY_HEAD = 16 << 20  # bytes hashed at the start of the file (metadata, tokenizer) and
IDENTITY_TAIL = 1 << 20  # at its end, with its size: the file's identity without reading 5 GB
CONVERSION_VERSION = 1  # bump when the converted folder's contents change
# architectures whose GGUF tensors map one to one onto the Hugging Face model's parameters (Q and K
# rows permuted back for llama-style files): held in their blocks. Other architectures transformers
# reads from GGUF load through transformers (dequantized to fp32).
HELD_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")


def identity(path: Path) -> str:
    """A key for the file's contents: its size and hashes of its first 16 MiB and last 1 MiB."""
    size = path.stat().st_size
    h = hashlib.sha256(f"{size}:".encode())
    with open(path, "rb") as f:
        h.update(f.read(IDENTITY_HEAD))
        if size > IDENTITY_HEAD:
            f.seek(max(IDENTITY_HEAD, size - IDENTITY_TAIL))
            h.update(f.read(IDENTITY_TAIL))
    return h.hexdigest()[:20]


def converted_dir(path: Path, name: str) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in name)[:48] or "model"
    return cache_root() / "models" / f"gguf-{safe}-{identity(path)}"


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


# --- config and tokenizer from the header ---------------------------------------------------------
# transformers reads a GGUF's config through the gguf package's reader, which builds numpy views of every
# metadata value (Gemma 3's 262k-token vocabulary: ~15 s), and derives a Gemma tokenizer's ~515k merges in a
# Python loop over the vocabulary (~8 s). For the held architectures the same config and tokenizer are made
# here from read_header(arrays=True) (0.2 s) with transformers' own key tables and tokenizer builders, and the
# merges by the same rule, vectorised (gemma_merges); tests/test_gemma_gguf.py checks they are transformers'.
FAST_CONVERSION = HELD_ARCHITECTURES
GEMMA_TOKENIZERS = ("gemma2", "gemma3")  # the builds whose merges gemma_merges derives (transformers' gemma_tokenizer)
SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                  "pad_token": "padding_token_id"}


def config_dict(header: Header, vocab_size: int | None) -> dict:
    """The transformers config dict of a held architecture's GGUF, as transformers' legacy GGUF reader makes it
    (its key tables GGUF_CONFIG_MAPPING and GGUF_CONFIG_DEFAULTS_MAPPING; a tied output when the file has no
    output.weight; gemma3 -> gemma3_text; the vocabulary's size where no key gives it)."""
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    arch = header.arch
    named = arch
    if "llama" in arch and header.fields.get("general.name") == "mistral":  # (transformers' test, as it is)
        named = "mistral"
    out: dict = {"tie_word_embeddings": "output.weight" not in header.tensors}
    for key, value in (GGUF_CONFIG_DEFAULTS_MAPPING.get(named) or GGUF_CONFIG_DEFAULTS_MAPPING.get(arch) or {}).items():
        out.setdefault(key, value)
    for key, value in header.fields.items():
        key = key.replace(arch, named)
        prefix, _, rest = key.partition(".")
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        if isinstance(value, str) and arch in value:
            value = value.replace(arch, named)
        renamed = GGUF_CONFIG_MAPPING.get(prefix, {}).get(rest)
        if renamed is not None and renamed != -1:
            out[renamed] = value
    if out.get("model_type") == "gemma3":
        out["model_type"] = "gemma3_text"
    if "vocab_size" not in out and vocab_size is not None:
        out["vocab_size"] = vocab_size
    return out


def gemma_merges(tokens: list[str]) -> list[str]:
    """The merges transformers derives for a Gemma vocabulary (gguf_tokenizer_mapping.gemma_tokenizer, by
    tokenization_utils_base.generate_merges), as "left right" strings: every split of a token into two
    tokens, the tokens in the order of their (last) position in the vocabulary, a token's splits longest
    left part first. tokens: the vocabulary as that builder respells it (no token holds a space)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    words = [tokens[i] for i in sorted(vocab.values())]
    lengths = np.fromiter(map(len, words), dtype=np.int64, count=len(words))
    which, cuts = [], []
    for k in range(1, int(lengths.max(initial=0))):
        longer = np.nonzero(lengths > k)[0]
        hit = np.fromiter((w[:k] in vocab and w[k:] in vocab for w in map(words.__getitem__, longer.tolist())),
                          dtype=bool, count=len(longer))
        which.append(longer[hit])
        cuts.append(np.full(int(hit.sum()), k))
    if not which:
        return []
    which, cuts = np.concatenate(which), np.concatenate(cuts)
    order = np.lexsort((-cuts, which))
    return [f"{words[i][:k]} {words[i][k:]}" for i, k in zip(which[order].tolist(), cuts[order].tolist())]


def gguf_tokenizer(header: Header):
    """A Gemma GGUF's tokenizer as AutoTokenizer.from_pretrained(gguf_file=..., tokenizer_type=...) builds it
    (GemmaTokenizer around transformers' convert_gguf_tokenizer of the file's vocabulary), the merges from
    gemma_merges. header: read with arrays."""
    from transformers import GemmaTokenizer
    from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    meta = header.fields
    grouped = {group: {name: meta[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in meta}
               for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tokenizer, settings = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer.get("tokenizer_type") == "llama":
        settings.setdefault("add_bos_token", True)
    for name, key in SPECIAL_TOKENS.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        settings[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    respelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokenizer["tokens"]]
    if "merges" not in tokenizer and not any(" " in t for t in respelled):
        tokenizer["merges"] = gemma_merges(respelled)
    backend, extra = convert_gguf_tokenizer(header.arch, tokenizer)
    return GemmaTokenizer(tokenizer_object=Given(backend), **settings, **extra)


FRESH: dict[Path, object] = {}  # tokenizer backends converted in this process, by folder (take_fresh)


def take_fresh(folder: Path):
    """The tokenizer backend this process converted into folder, once (the first load then builds its tokenizer
    from it instead of parsing the tokenizer.json just written: Gemma 3's, ~1.5 s), else None."""
    backend = FRESH.pop(Path(folder), None)
    return None if backend is None else Given(backend)


class Given:
    """A built backend handed to a transformers tokenizer as its tokenizer_object, which it deep-copies: the
    copy is the backend itself (a 262k-token BPE: 1.6 s to copy for nothing, the original being dropped)."""

    def __init__(self, backend):
        self.backend = backend

    def __deepcopy__(self, memo):
        return self.backend


def convert(path: Path, dest: Path, on_status: Callable[[str], None] | None = None) -> Path:
    """Write the GGUF's config, tokenizer and chat template to dest (temp folder, then rename), with a
    pointer back to the file the weights are read from."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(dest) + ".lock"):
        if (dest / GGUF_POINTER).is_file():
            return dest  # another process finished it while we waited
        header = read_header(path)
        check_architecture(header.arch, path)
        if on_status:
            on_status(f"reading the config and tokenizer of {path.name} once into {dest}")
        tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=dest.parent))
        try:
            try:
                header = read_header(path, arrays=True) if header.arch in FAST_CONVERSION else None
                if header is not None:  # (config_dict, gguf_tokenizer: the same as transformers' GGUF readers)
                    tokens = header.fields.get("tokenizer.ggml.tokens")
                    config = AutoConfig.for_model(**config_dict(header, len(tokens) if isinstance(tokens, list)
                                                                else None))
                else:
                    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
                if header is not None and header.arch in GEMMA_TOKENIZERS:
                    tok = gguf_tokenizer(header)
                else:
                    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            except (ValueError, KeyError, OSError, NotImplementedError) as exc:
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                raise ModelLoadError(f"{path.name}: transformers cannot read it ({first})") from None
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
                config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
            config.save_pretrained(tmp)
            GenerationConfig.from_model_config(config).save_pretrained(tmp)
            tok.save_pretrained(tmp)
            fresh = tok.backend_tokenizer if header is not None and header.arch in GEMMA_TOKENIZERS else None
            pointer = {"source": str(path.resolve()), "size": path.stat().st_size, "identity": identity(path),
                       "version": CONVERSION_VERSION}
            (tmp / GGUF_POINTER).write_text(json.dumps(pointer, indent=1), encoding="utf-8")
            os.replace(tmp, dest)
            if fresh is not None:  # (the latest only: a process that converts without loading keeps one)
                FRESH.clear()
                FRESH[dest] = fresh
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def ensure_converted(path: Path, name: str, on_status: Callable[[str], None] | None = None) -> Path:
    dest = converted_dir(path, name)
    if not (dest / GGUF_POINTER).is_file():
        return convert(path, dest, on_status)
    repoint(dest / GGUF_POINTER, path)
    return dest


def repoint(pointer: Path, path: Path) -> None:
    """A converted folder is keyed by its GGUF's content (converted_dir), so the same file found at another
    path (the wheel reinstalled in another venv, the file moved) uses it: when the file it names is gone,
    name this one instead (written to a temp file, then renamed), so the folder given as --model still loads."""
    try:
        recorded = json.loads(pointer.read_text(encoding="utf-8"))
        if Path(recorded["source"]).is_file():
            return
        recorded["source"] = str(path.resolve())
        tmp = pointer.with_name(pointer.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(recorded, indent=1), encoding="utf-8")
        os.replace(tmp, pointer)
    except (OSError, ValueError, KeyError, TypeError):
        return  # unreadable: loading from the folder says so (sources.gguf_of_converted); this path still loads


# --- tensors -------------------------------------------------------------------------------------

class TensorFile:
    """The tensors of a GGUF file: names, types and shapes from its header, bytes read on demand."""

    def __init__(self, path: Path):
        self.path = path
        header = read_header(path)
        self.arch, self.fields, self.tensors = header.arch, header.fields, header.tensors

    def raw(self, name: str, r0: int = 0, r1: int | None = None) -> np.ndarray:
        """Rows [r0, r1) of the tensor's bytes, [rows, bytes per row] (read, not mapped)."""
        t = self.tensors[name]
        rows = self.shape(name)[0] if len(t.ne) > 1 else 1
        r1 = rows if r1 is None else r1
        row_bytes = t.n_bytes // rows
        data = bytearray((r1 - r0) * row_bytes)
        with open(self.path, "rb") as f:
            f.seek(t.offset + r0 * row_bytes)
            if f.readinto(data) != len(data):
                raise ModelLoadError(f"{self.path} ends inside tensor {name} (a partial download?)")
        return np.frombuffer(data, dtype=np.uint8).reshape(r1 - r0, -1)

    def row_bytes(self, name: str) -> int:
        return self.tensors[name].n_bytes // max(1, self.shape(name)[0])

    def shape(self, name: str) -> tuple[int, ...]:
        """Rows first, as torch writes it (GGUF lists the row length first)."""
        return tuple(int(s) for s in reversed(self.tensors[name].ne))

    def kind(self, name: str) -> Q:
        return self.tensors[name].kind

    def mapped_rows(self, name: str) -> np.ndarray:
        """The tensor's rows in a read-only memory map (pages are read, and counted, only when touched)."""
        t = self.tensors[name]
        rows = np.memmap(self.path, dtype=np.uint8, mode="r", offset=t.offset, shape=(t.n_bytes,))
        return rows.reshape(self.shape(name)[0], -1)


def held_from_raw(raw: np.ndarray, kind: Q, n: int, k: int):
    """A GGUF tensor's bytes [n rows, ...] -> the held weight [n, k] (see the module's table)."""
    if kind == Q.F32:
        return DenseWeight(torch.from_numpy(raw.view(np.float32).reshape(n, k).copy()))
    if kind == Q.F16:
        return DenseWeight(torch.from_numpy(raw.view(np.float16).reshape(n, k).copy()))
    if kind == Q.BF16:
        return DenseWeight(torch.from_numpy(raw.view(np.int16).reshape(n, k).copy()).view(torch.bfloat16))
    if kind in BLOCK_KINDS:  # the file's own blocks, each row's codes then its scales (fmt 2, 3, 9, 10, 11)
        return PackedWeight(BLOCK_KINDS[kind], torch.from_numpy(split_block_rows(raw, BLOCK_KINDS[kind], n)), (n, k))
    if kind in (Q.Q4_K, Q.Q5_K):
        return KQuantWeight(Q4K_FMT if kind == Q.Q4_K else Q5K_FMT, torch.from_numpy(_owned(raw)), (n, k))
    if kind == Q.Q6_K:
        return Q6KWeight(Q6K_FMT, torch.from_numpy(_owned(raw)), (n, k))
    return DenseWeight(torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, kind)).reshape(n, k)))


def _owned(raw: np.ndarray) -> np.ndarray:
    """raw itself when it is a buffer of its own to keep (TensorFile.raw's: writable, contiguous), else a copy
    (a read-only map of the file, a strided view)."""
    return raw if raw.flags.writeable and raw.flags.c_contiguous else raw.copy()


AS_READ = (Q.Q4_K, Q.Q5_K, Q.Q6_K)  # held as the file's bytes: read whole into the held buffer, no chunks


BLOCK_KINDS = {Q.Q4_0: Q40_FMT, Q.Q4_1: Q41_FMT, Q.Q8_0: Q80_FMT, Q.Q5_0: Q50_FMT, Q.Q5_1: Q51_FMT}


def split_block_rows(raw: np.ndarray, fmt: int, n: int) -> np.ndarray:
    """GGUF Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q5_1 bytes [n rows, ...] -> the same bytes, each row as its blocks' codes
    (Q5: the 16 bytes of low nibbles, then the 4 bytes of fifth bits), then their fp16 d, then (Q4_1, Q5_1) their
    fp16 m: linear_kernels.c's layout of fmt 2, 3, 9, 10, 11 (uint8 [n, row bytes])."""
    rec = np.ascontiguousarray(raw).reshape(n, -1, FORMATS[fmt])  # [n, nb, block bytes]
    head = 4 if fmt in MIN_FMTS else 2  # d (and m)
    codes = rec[..., head:] if fmt not in (Q50_FMT, Q51_FMT) else \
        np.concatenate([rec[..., head + 4:], rec[..., head : head + 4]], axis=-1)  # qs, then qh
    parts = [codes, rec[..., 0:2]] + ([rec[..., 2:4]] if head == 4 else [])
    return np.ascontiguousarray(np.concatenate([p.reshape(n, -1) for p in parts], axis=1))


CHUNK_BYTES = 32 << 20  # a large tensor is read and converted this many file bytes at a time


def held_from_file(tensors: TensorFile, name: str, order: np.ndarray | None = None):
    """The tensor's held weight, read and converted CHUNK_BYTES at a time into its final buffers, so a
    large tensor (a 128k-token output layer: 430 MB in Q6_K) never has its unpacked codes all at once.
    order: the rows in this order (the whole tensor is read at once then; Q and K are small)."""
    n, k = tensors.shape(name)
    kind, step = tensors.kind(name), max(1, CHUNK_BYTES // tensors.row_bytes(name))
    if order is not None or step >= n or kind in AS_READ:
        raw = tensors.raw(name)
        return held_from_raw(raw[order] if order is not None else raw, kind, n, k)
    full = None
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        part = held_from_raw(tensors.raw(name, r0, r1), kind, r1 - r0, k)
        parts = _row_tensors(part)
        if full is None:
            full = {f: torch.empty((n, *t.shape[1:]), dtype=t.dtype) for f, t in parts.items()}
        for f, t in parts.items():
            full[f][r0:r1] = t
    has_shape = any(f.name == "shape" for f in dataclasses.fields(part))
    return dataclasses.replace(part, **full, **({"shape": (n, k)} if has_shape else {}))


def _row_tensors(held) -> dict[str, torch.Tensor]:
    """The tensors of a held weight whose first dimension is its rows, by field name."""
    return {f.name: getattr(held, f.name) for f in dataclasses.fields(held)
            if isinstance(getattr(held, f.name), torch.Tensor)}


def dense_from_raw(raw: np.ndarray, kind: Q, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The tensor dequantized (gguf.quants) to dtype: the exact reference (fp32) or a GPU's fp16."""
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, kind)).reshape(shape)).to(dtype)


class MappedRows:
    """A weight left in the GGUF file (an untied token embedding): rows are dequantized from the
    memory map on lookup, so only the pages of the tokens seen are ever read."""

    kind = "in-file"
    nbytes = 0  # not held: the file's pages, read on lookup

    def __init__(self, tensors: TensorFile, name: str):
        self._rows, self._kind = tensors.mapped_rows(name), tensors.kind(name)
        self.shape = tensors.shape(name)

    def rows(self, n0: int, n1: int) -> torch.Tensor:
        block = np.ascontiguousarray(self._rows[n0:n1])
        return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(block, self._kind),
                                                     dtype=np.float32).reshape(n1 - n0, -1))


# bytes a weight takes as held (the table at the top): what the planner and `specache models` count
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
