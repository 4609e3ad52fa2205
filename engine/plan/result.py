"""A plan's result: one ModePlan per column, the Plan, and the documented --json contract."""
from __future__ import annotations

import math
from dataclasses import dataclass

from engine.config import CacheConfig, settings
from engine.kvcache.sizes import FETCH_BUFFERS, PAPER_FETCH_BUFFERS, SPECULATIVE_TOKENS
from engine.machine import HOST_RESERVE_FRACTION, host_usable_bytes
from engine.plan.profiles import HardwareProfile, ModelProfile
from engine.plan.step_costs import KERNEL_LAUNCH_SECONDS
from engine.plan.roofline import (
    ALLOCATOR_MARGIN,
    CUDA_RUNTIME_RESERVE_BYTES,
    MATMUL_EFFICIENCY,
    MEMORY_EFFICIENCY,
    SPARSE_TRANSFER_EFFICIENCY,
    allocator_margin_bytes,
    runtime_reserve_bytes,
    weight_bytes,
)

# the plan's own settings beside the cache's, at their place in --json's "settings" (Setting.plan)
PLAN_SETTINGS = {"reference": 5, "element_bytes": 7}


@dataclass(frozen=True)
class ModePlan:
    """One cache mode's plan. Per-step figures are at max_batch (at batch 1 when nothing fits)."""

    mode: str
    max_batch: int
    limited_by: str  # device | host | batch_limit
    max_batch_device: int
    max_batch_host: int | None
    k: int
    bits: int | None
    group: int | None
    device_bytes_per_sequence: int
    device_breakdown: dict  # per sequence, bytes
    shared_device_bytes: dict  # once per process, bytes
    host_bytes_per_sequence: int
    transfer_bytes_per_step: int
    transfer_seconds_per_step: float
    compute_seconds_per_step: float
    step_seconds: float
    kernels_per_step: float | None  # a GPU's kernels per step (exact: per output token; engine/plan/step_costs.py)
    predicted_step_seconds: float | None  # step_seconds + their launches (step_costs.KERNEL_LAUNCH_SECONDS each)
    prefetch_hidden: bool
    tokens_per_second: float
    predicted_speedup_vs_full: float | None
    k_max_hidden: int | None  # largest k whose prefetch still hides behind the step (specache)
    gamma: int | None = None  # exact: the draft tokens per verification that maximise tokens/s
    acceptance: float | None = None  # exact: the acceptance the prediction assumes
    verify_seconds: float | None = None  # exact: one verification (the slower of its compute and its copy)
    draft_seconds: float | None = None  # exact: one draft step

    @property
    def fits(self) -> bool:
        return self.max_batch >= 1


@dataclass(frozen=True)
class Plan:
    """The plan for one hardware x model x context, one ModePlan per column (plan_columns). cache: the
    settings planned (k cut to the context, outliers resolved for the bits)."""

    hardware: HardwareProfile
    model: ModelProfile
    context: int
    cache: CacheConfig
    reference: str
    element_bytes: int
    device_budget_bytes: int
    host_ram_bytes: int | None
    modes: tuple[ModePlan, ...]
    notes: tuple[str, ...]

    bits = property(lambda self: self.cache.bits)
    group = property(lambda self: self.cache.group)
    residual = property(lambda self: self.cache.residual)
    sinks = property(lambda self: self.cache.sinks)
    k = property(lambda self: self.cache.k)
    prefill_chunk = property(lambda self: self.cache.chunk_size)
    outliers = property(lambda self: self.cache.outliers)

    def planned_settings(self) -> dict:
        """The settings planned, as --json names them: the cache's that the planner reads (Setting.plan
        gives each its place) and the plan's own (PLAN_SETTINGS)."""
        places = [(declared.plan, declared.plan_key or name, getattr(self.cache, name))
                  for name, declared in settings().items() if declared.plan is not None]
        places += [(place, name, getattr(self, name)) for name, place in PLAN_SETTINGS.items()]
        return {name: value for _, name, value in sorted(places, key=lambda item: item[0])}

    def mode(self, name: str) -> ModePlan:
        """The plan of one mode by name."""
        for mode in self.modes:
            if mode.mode == name:
                return mode
        raise KeyError(name)

    def to_json(self) -> dict:
        """The documented --json contract (docs/planner.md, "JSON")."""
        hw, m = self.hardware, self.model
        return {
            "schema": "specache-plan/1",
            "gpu": hw.name,
            "model": m.name,
            "context": self.context,
            "hardware": {
                "name": hw.name, "display_name": hw.display_name, "kind": hw.kind, "source": hw.source,
                "device_memory_bytes": hw.device_memory_bytes, "free_memory_bytes": hw.free_memory_bytes,
                "memory_bandwidth_gbps": hw.memory_bandwidth_gbps, "matmul_tflops": hw.matmul_tflops,
                "compute_dtype": hw.compute_dtype, "pcie_gen": hw.pcie_gen, "pcie_lanes": hw.pcie_lanes,
                "pcie_link_gbps": _round(hw.pcie_link_gbps), "h2d_gbps": hw.h2d_gbps,
            },
            "model_profile": {
                "name": m.name, "display_name": m.display_name, "source": m.source, "layers": m.layers,
                "heads": m.heads, "kv_heads": m.kv_heads, "head_dim": m.head_dim, "hidden_size": m.hidden_size,
                "intermediate_size": m.intermediate_size, "vocab_size": m.vocab_size,
                "max_context": m.max_context, "parameters": m.parameters,
            },
            "settings": self.planned_settings(),
            "budget": {
                "device_memory_bytes": hw.device_memory_bytes,
                "free_memory_bytes": hw.free_memory_bytes,
                "runtime_reserve_bytes": runtime_reserve_bytes(hw),
                "allocator_margin_bytes": allocator_margin_bytes(hw),
                "usable_bytes": self.device_budget_bytes,
                "weights_bytes": weight_bytes(m, self.element_bytes),
            },
            "host": {
                "ram_bytes": self.host_ram_bytes,
                "usable_bytes": None if self.host_ram_bytes is None else host_usable_bytes(self.host_ram_bytes),
                "shared_with_device": hw.unified_memory,
            },
            "constants": constants(),
            "modes": [_mode_json(mode) for mode in self.modes],
            "notes": list(self.notes),
        }


def constants() -> dict:
    """Every planning constant, by name (also in --json)."""
    return {
        "cuda_runtime_reserve_bytes": CUDA_RUNTIME_RESERVE_BYTES, "allocator_margin": ALLOCATOR_MARGIN,
        "host_reserve_fraction": HOST_RESERVE_FRACTION, "memory_efficiency": MEMORY_EFFICIENCY,
        "matmul_efficiency": MATMUL_EFFICIENCY, "sparse_transfer_efficiency": SPARSE_TRANSFER_EFFICIENCY,
        "fetch_buffers": FETCH_BUFFERS, "paper_fetch_buffers": PAPER_FETCH_BUFFERS,
        "speculative_tokens": SPECULATIVE_TOKENS, "kernel_launch_seconds": KERNEL_LAUNCH_SECONDS,
    }


def _round(value: float | None, digits: int = 6) -> float | None:
    """Floats to 6 significant digits so the JSON is stable across platforms."""
    if value is None or value == 0 or not math.isfinite(value):
        return value
    return float(f"{value:.{digits}g}")


def _mode_json(mode: ModePlan) -> dict:
    out = {}
    for key, value in mode.__dict__.items():
        out[key] = _round(value) if isinstance(value, float) else value
    return out
