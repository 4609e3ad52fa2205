"""GGUF tensors: a file's tensors read into the blocks the engine computes with, without an fp32 copy.

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
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from engine.errors import ModelLoadError
from engine.model.block_formats import (FORMATS, MIN_FMTS, Q40_FMT, Q41_FMT, Q4K_FMT, Q50_FMT, Q51_FMT, Q5K_FMT,
                                        Q6K_FMT, Q80_FMT)
from engine.model.gguf_header import read_header
from engine.model.held_weights import DenseWeight, PackedWeight
from engine.model.kquant_weights import KQuantWeight, Q6KWeight


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

