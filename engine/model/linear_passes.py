"""Which arithmetic a pass's linears take: within prefill_pass() a prompt chunk's many rows may compute
in the model's prefill dtype (bf16), within row_invariant() decode linears take the one-row kernel
whatever their row count (exact mode); and whether this CPU makes that bf16 prefill worth it
(cpu_has_native_bf16). engine.model.linears' SkinnyLinear reads the two context flags.
"""
from __future__ import annotations

import contextvars
import os
from contextlib import contextmanager
from typing import Iterator

import torch

from engine import native

# oneDNN ISA limits (ONEDNN_MAX_CPU_ISA) that still include bf16 dot products or AMX tiles
_BF16_ONEDNN_ISAS = ("ALL", "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX10")


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 dot products or AMX tiles) AND torch may
    use them, so that its bf16 matmuls (oneDNN) run at bf16 speed instead of emulating it. A torch held
    below AVX-512 (ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2: the AVX2 stand-in) emulates bf16
    in a slow scalar loop, as a CPU without the instructions would: there the prefill stays fp32."""
    if not native.cpu_flags() & {"avx512_bf16", "amx_bf16"}:
        return False
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return False
    limit = os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", "ALL")).upper()
    return limit.startswith(_BF16_ONEDNN_ISAS)


# True inside prefill_pass(): a prompt chunk, whose many rows may take the prefill dtype. Context-local,
# like torch.no_grad(); every other pass (decode steps of large batches, exact mode's verification) stays exact.
IN_PREFILL: contextvars.ContextVar[bool] = contextvars.ContextVar("specache_in_prefill", default=False)


# True inside row_invariant(): a decode linear of up to NATIVE_ROWS rows takes the kernel that one row of
# its weight form takes (the calibration's 1-row choice), so each row's result is the one-row step's (the
# native kernel computes every row alone: tests/test_linears.py). Exact mode's drafts and verification.
ROW_INVARIANT: contextvars.ContextVar[bool] = contextvars.ContextVar("specache_row_invariant", default=False)


@contextmanager
def _set_within(var: contextvars.ContextVar[bool]) -> Iterator[None]:
    token = var.set(True)
    try:
        yield
    finally:
        var.reset(token)


def row_invariant():
    """Within: decode linears choose their kernel by the one-row class, whatever their row count."""
    return _set_within(ROW_INVARIANT)


def prefill_pass():
    """Within: linears of many rows compute in their prefill_dtype (engine.generate.steps.prefill)."""
    return _set_within(IN_PREFILL)
