"""The planner's budget and time: the device bytes usable, the largest batch, and a roofline estimate of a
decode step, a prefetch and an exact verification cycle (docs/planner.md gives each constant's source)."""
from __future__ import annotations

from dataclasses import replace

from engine.kvcache.policies.exact import expected_tokens
from engine.kvcache.sizes import Sizing, global_part, kv_bytes_per_token
from engine.machine import HOST_RESERVE_FRACTION
from engine.plan.profiles import HardwareProfile, ModelProfile

MIB = 1024**2
GIB = 1024**3

CUDA_RUNTIME_RESERVE_BYTES = 512 * MIB  # CUDA context + cuBLAS/cuDNN handles and workspaces, per process
ALLOCATOR_MARGIN = 0.05  # fraction of device memory lost to caching-allocator rounding and fragmentation
MEMORY_EFFICIENCY = 0.80  # achieved / peak device-memory bandwidth for large streaming reads
MATMUL_EFFICIENCY = 0.60  # achieved / peak dense matmul throughput
SPARSE_TRANSFER_EFFICIENCY = 0.50  # scattered head_dim-row gather over PCIe / contiguous pinned copy
EXACT_ACCEPTANCE = 0.9  # exact mode: share of draft tokens the exact pass accepts (measured, docs/planner.md)
EXACT_GAMMA_MAX = 16  # exact mode: most draft tokens per verification (engine.config.GAMMA_MAX)


def weight_bytes(model: ModelProfile, element_bytes: int = 2) -> int:
    """Model weights, shared by every sequence of a batch: as held when the profile knows it (a GGUF's
    blocks), else parameters x element bytes."""
    if model.held_weight_bytes is not None:
        return model.held_weight_bytes
    return model.parameters * element_bytes


def runtime_reserve_bytes(hardware: HardwareProfile) -> int:
    """Memory the runtime takes before any tensor: CUDA context, or the OS share of RAM on a CPU."""
    if hardware.kind == "cuda":
        return CUDA_RUNTIME_RESERVE_BYTES
    return int(HOST_RESERVE_FRACTION * hardware.device_memory_bytes)


def allocator_margin_bytes(hardware: HardwareProfile) -> int:
    """Planning margin for allocator fragmentation."""
    return int(ALLOCATOR_MARGIN * hardware.device_memory_bytes)


def device_budget_bytes(hardware: HardwareProfile) -> int:
    """Device bytes usable by weights, caches and activations: total (or detected free) less reserve and margin."""
    usable = hardware.device_memory_bytes - runtime_reserve_bytes(hardware)
    if hardware.free_memory_bytes is not None:
        usable = min(usable, hardware.free_memory_bytes)
    return usable - allocator_margin_bytes(hardware)


def batch_that_fits(available: int, per_sequence: int, shared: int = 0) -> int:
    """Largest B with shared + B x per_sequence <= available (0 when not even one fits)."""
    if per_sequence <= 0:
        raise ValueError("per_sequence must be > 0")
    return max(0, (available - shared) // per_sequence)


def step_read_bytes(model: ModelProfile, batch: int, read_bytes_per_sequence: int, element_bytes: int = 2) -> int:
    """Bytes one decode step reads from device memory in the roofline: the weights once, each sequence's cache."""
    return weight_bytes(model, element_bytes) + batch * read_bytes_per_sequence


def decode_step_seconds(hardware: HardwareProfile, model: ModelProfile, batch: int, queries: int,
                        read_bytes_per_sequence: int, context: int, element_bytes: int = 2) -> float:
    """Roofline time of one decode step: the slower of reading (weights once + each sequence's cache)
    and computing (weight matmuls + attention over the whole context for every query token)."""
    read = step_read_bytes(model, batch, read_bytes_per_sequence, element_bytes)
    attention_flops = 4 * model.heads * model.head_dim * context * model.layers
    flops = batch * queries * (2 * model.parameters + attention_flops)
    read_s = read / (hardware.memory_bandwidth_gbps * 1e9 * MEMORY_EFFICIENCY)
    compute_s = flops / (hardware.matmul_tflops * 1e12 * MATMUL_EFFICIENCY)
    return max(read_s, compute_s)


def transfer_seconds(hardware: HardwareProfile, nbytes: int) -> float:
    """Time to move nbytes of scattered rows host -> device (CPU: the in-RAM gather rate as profiled)."""
    efficiency = SPARSE_TRANSFER_EFFICIENCY if hardware.kind == "cuda" else 1.0
    return nbytes / (hardware.h2d_gbps * 1e9 * efficiency)


def exact_cycle(hw: HardwareProfile, m: ModelProfile, s: Sizing, batch: int, k: int, context: int, eb: int,
                acceptance: float = EXACT_ACCEPTANCE) -> tuple[int, int, float, float, float]:
    """Exact mode at this batch: (gamma, transfer bytes per verification, draft step seconds,
    verify seconds, seconds per output token of a row) for the gamma in 1..16 that maximises
    tokens/s. A draft step is a SpeCache step of one token whose own fetch (k rows per layer and
    KV head) is not hidden; a verification feeds gamma + 1 tokens and reads every exact K/V:
    copied over PCIe (contiguous pinned rows, h2d_gbps) on a GPU, read in place on a CPU or a
    unified-memory device (its read is in the compute roofline)."""
    kvb = kv_bytes_per_token(global_part(m), eb)
    fetch, fetch_s, draft_compute = step_parts(hw, m, s, batch, k, context, eb)
    draft_s = draft_compute + fetch_s
    streamed = hw.kind == "cuda" and not hw.unified_memory
    transfer = batch * context * kvb if streamed else 0
    copy_s = transfer / (hw.h2d_gbps * 1e9) if streamed else 0.0

    def verify_s(gamma: int) -> float:
        return max(decode_step_seconds(hw, m, batch, gamma + 1, context * kvb, context, eb), copy_s)

    best = max(range(1, EXACT_GAMMA_MAX + 1),
               key=lambda g: expected_tokens(acceptance, g) / (g * draft_s + verify_s(g)))
    per_token = (best * draft_s + verify_s(best)) / expected_tokens(acceptance, best)
    return best, transfer, draft_s, verify_s(best), per_token


def max_batch(s: Sizing, available: int) -> tuple[int, int]:
    """(largest batch by device memory, device bytes per sequence reported).

    Prefill and decode working sets never coexist: with rows prefilled one at a time the prefill
    activations are paid once next to B resident sequences; with every row at once, per sequence."""
    state = sum(s.state.values())
    if s.prefill_per_sequence:
        per_seq = state + max(s.decode_working_set, s.prefill_bytes)
        return batch_that_fits(available, per_seq), per_seq
    per_seq = state + s.decode_working_set
    return min(batch_that_fits(available, state, s.prefill_bytes), batch_that_fits(available, per_seq)), per_seq


def step_parts(hw: HardwareProfile, m: ModelProfile, s: Sizing, batch: int, k: int, context: int, eb: int,
          ) -> tuple[int, float, float]:
    """(transfer bytes, transfer seconds, compute seconds) of one decode step at this batch and k."""
    kvb = kv_bytes_per_token(global_part(m), eb)  # only the policy's layers fetch
    transfer = batch * k * kvb
    compute = decode_step_seconds(hw, m, batch, s.queries, s.read_per_sequence, context, eb)
    return transfer, transfer_seconds(hw, transfer), compute


def max_hidden_k(hw: HardwareProfile, m: ModelProfile, s: Sizing, batch: int, k: int, context: int,
                 eb: int) -> int:
    """Largest k (<= context) whose prefetch time still fits inside the step's compute time."""
    kvb = kv_bytes_per_token(global_part(m), eb)

    def hidden(kk: int) -> bool:
        sized = replace(s, read_per_sequence=s.read_per_sequence + (kk - k) * kvb)
        _, t, c = step_parts(hw, m, sized, batch, kk, context, eb)
        return t <= c

    lo, hi = 0, context
    if hidden(hi):
        return hi
    while hi - lo > 1:  # hidden(lo) holds (k = 0 moves nothing), hidden(hi) does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if hidden(mid) else (lo, mid)
    return lo
