"""Memory and throughput planner: from a hardware profile, a model profile and a context length to
the largest batch, the fetch size k and a roofline estimate of a decode step, for the full cache,
KIVI (guide + residual window only), SpeCache and exact mode (SpeCache drafts, the exact store verifies). Every formula and constant is explained in
docs/planner.md; each formula is a small pure function here so it can be tested alone.

The modes are the registered cache policies (engine/kvcache/registry.py) that have a column
(plan_columns), and a column is sized from its policy's declarations, not its name: `guided` (a
guide, residual window and sinks), `fetches` (k fetched positions: fetch buffers, the host store),
`speculates` under the speculative prefetch (two tokens a step, a prefetch that can hide),
`verifies` (draft-and-verify cycles, verification buffers); none of them: the full cache.

Public entry points:
    plan(hardware, model, context, ...) -> Plan            # every column, for `specache plan`
    plan_for_run(model_config, context, mode, ...) -> ModePlan   # --batch auto / --k auto
    detect_hardware() -> HardwareProfile                   # this machine (CUDA, else CPU)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from engine.config import GROUPS, OUTLIERS_MAX, CacheConfig, outliers_for
from engine.errors import BadArgument, DoesNotFit
from engine.machine import HOST_RESERVE_FRACTION, host_usable_bytes, machine_ram_bytes  # noqa: F401 (API)
from engine.kvcache.registry import POLICIES
from engine.kvcache.sizes import (  # noqa: F401  (the size formulas are part of this module's API)
    FETCH_BUFFERS,
    exact_tail_tokens,
    fetch_buffer_bytes,
    global_part,
    guide_bits_per_element,
    guide_bytes,
    guide_capacity,
    kv_bytes_per_token,
    kv_elements_per_token,
    layer_kv_bytes_per_token,
    residual_slots,
    sink_slots,
    sliding_window_bytes,
)
from engine.plan.profiles import (
    HardwareProfile,
    ModelProfile,
    device_prefetch,
    load_hardware,
    match_cuda_device,
    model_profile_from_config,
)

MIB = 1024**2
GIB = 1024**3

# --- constants (docs/planner.md, "Constants", gives the physical meaning and the source of each) ---
CUDA_RUNTIME_RESERVE_BYTES = 512 * MIB  # CUDA context + cuBLAS/cuDNN handles and workspaces, per process
ALLOCATOR_MARGIN = 0.05  # fraction of device memory lost to caching-allocator rounding and fragmentation
MEMORY_EFFICIENCY = 0.80  # achieved / peak device-memory bandwidth for large streaming reads
MATMUL_EFFICIENCY = 0.60  # achieved / peak dense matmul throughput
SPARSE_TRANSFER_EFFICIENCY = 0.50  # scattered head_dim-row gather over PCIe / contiguous pinned copy
PAPER_FETCH_BUFFERS = 2  # the paper's implementation double-buffers the fetched set; the engine keeps one (sizes.py)
SPECULATIVE_TOKENS = 2  # tokens fed per SpeCache step: [T_t, T'_{t+1}]
SCORE_BYTES = 4  # attention scores and probabilities are fp32
SCORE_COPIES = 4  # score-sized buffers alive at once: scores, joined with the residual's, probabilities, guide share
PAST_VIEWS = 2  # prefill of a guided layer: past exact K/V copied from the host store, then joined with the residual
LOGIT_UPCAST_BYTES = 4  # the reference baseline's fp32 copy of the logits
DEFAULT_PREFILL_CHUNK = 512  # engine.config.CacheConfig.chunk_size
EXACT_ACCEPTANCE = 0.9  # exact mode: share of draft tokens the exact pass accepts (measured, docs/planner.md)
EXACT_GAMMA_MAX = 16  # exact mode: most draft tokens per verification (engine.config.GAMMA_MAX)
VERIFY_BUFFERS = 2  # exact mode on a GPU: one layer's exact K/V attended while the next layer's is copied in

REFERENCES = ("engine", "paper")


def plan_columns() -> dict[str, type]:
    """The policies `specache plan` gives a column (every registered one with plan_column; window is
    sized as kivi), by what each adds to an exact cache: nothing (full), a guide (kivi), a fetched set
    (specache), an exact verification (exact); among equals in the registry's order."""
    columns = [(name, cls) for name, cls in POLICIES.items() if cls.plan_column]
    return dict(sorted(columns, key=lambda item: (item[1].guided, item[1].fetches, item[1].verifies)))


def speculative(cls: type) -> bool:
    """The policy feeds two tokens a step and fetches the next step's set behind it, under the
    speculative prefetch (the method's, which the planner models; docs/planner.md)."""
    return cls.speculates(CacheConfig(mode=cls.policy, k=1, prefetch="speculative"))


# --- sizes ---------------------------------------------------------------------------------------

# The cache sizes are engine.kvcache.sizes' formulas (one module for the caches and the planner):
# kv_elements_per_token, kv_bytes_per_token, guide_bytes, exact_tail_tokens, residual_slots,
# sink_slots, guide_capacity, fetch_buffer_bytes (imported above).
engine_residual_slots = residual_slots  # the name this module's callers and docs/planner.md use


def weight_bytes(model: ModelProfile, element_bytes: int = 2) -> int:
    """Model weights, shared by every sequence of a batch: as held when the profile knows it (a GGUF's
    blocks), else parameters x element bytes."""
    if model.held_weight_bytes is not None:
        return model.held_weight_bytes
    return model.parameters * element_bytes


def layer_view_bytes(model: ModelProfile, tokens: int, element_bytes: int = 2) -> int:
    """One layer's K and V for `tokens` positions in 16-bit: what one attention call reads at once."""
    return tokens * 2 * model.kv_heads * model.head_dim * element_bytes


def attention_score_bytes(model: ModelProfile, queries: int, tokens: int, copies: int = SCORE_COPIES) -> int:
    """fp32 score-sized buffers of `queries` query tokens x all heads against `tokens` keys."""
    return copies * queries * model.heads * tokens * SCORE_BYTES


def causal_mask_bytes(model: ModelProfile, chunk: int, tokens: int) -> int:
    """Boolean mask of a chunk of queries (grouped: query heads per KV head x chunk) against `tokens` keys."""
    return (model.heads // model.kv_heads) * chunk * tokens


def prefill_activation_bytes(model: ModelProfile, chunk: int, element_bytes: int = 2, *, all_logits: bool = False,
                             past_tokens: int = 0, past_views: int = 0, mask: bool = False) -> int:
    """Peak transient bytes of one sequence's prefill forward over `chunk` new tokens after `past_tokens`.

    The residual stream and its normalized copy live through the layer; on top of them the largest
    of: attention (q, k, v and output of the chunk, `past_views` 16-bit copies of this layer's past
    K/V when the cache does not hold them exactly on the device, and an explicit boolean causal mask),
    the gated MLP (gate, up and their product) and the logits (last position only, or every
    position in fp16 plus an fp32 copy as the paper's transformers baseline did).
    """
    eb = element_bytes
    stream = 2 * chunk * model.hidden_size * eb
    attention = (chunk * (2 * model.heads + 2 * model.kv_heads) * model.head_dim * eb
                 + past_views * layer_view_bytes(model, past_tokens, eb)
                 + (causal_mask_bytes(model, chunk, past_tokens + chunk) if mask else 0))
    mlp = 3 * chunk * model.intermediate_size * eb
    logit_rows = chunk if all_logits else 1
    logits = logit_rows * model.vocab_size * (eb + (LOGIT_UPCAST_BYTES if all_logits else 0))
    return stream + max(attention, mlp, logits)


def decode_working_set_bytes(model: ModelProfile, context: int, queries: int, element_bytes: int = 2, *,
                             guided: bool) -> int:
    """Transient bytes per sequence in a decode step: the logits, and for a guide the fp32 score
    buffers plus one layer's codes expanded for the attention matmuls (fp32 K or V of one layer,
    the same bytes as K and V of that layer in 16 bits). The full cache is read in place by a
    fused attention kernel."""
    logits = queries * model.vocab_size * element_bytes
    if not guided:
        return logits
    return logits + attention_score_bytes(model, queries, context) + layer_view_bytes(model, context, 2)


# --- budgets -------------------------------------------------------------------------------------

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


# --- time ----------------------------------------------------------------------------------------

def decode_step_seconds(hardware: HardwareProfile, model: ModelProfile, batch: int, queries: int,
                        read_bytes_per_sequence: int, context: int, element_bytes: int = 2) -> float:
    """Roofline time of one decode step: the slower of reading (weights once + each sequence's cache)
    and computing (weight matmuls + attention over the whole context for every query token)."""
    read = weight_bytes(model, element_bytes) + batch * read_bytes_per_sequence
    attention_flops = 4 * model.heads * model.head_dim * context * model.layers
    flops = batch * queries * (2 * model.parameters + attention_flops)
    read_s = read / (hardware.memory_bandwidth_gbps * 1e9 * MEMORY_EFFICIENCY)
    compute_s = flops / (hardware.matmul_tflops * 1e12 * MATMUL_EFFICIENCY)
    return max(read_s, compute_s)


def transfer_seconds(hardware: HardwareProfile, nbytes: int) -> float:
    """Time to move nbytes of scattered rows host -> device (CPU: the in-RAM gather rate as profiled)."""
    efficiency = SPARSE_TRANSFER_EFFICIENCY if hardware.kind == "cuda" else 1.0
    return nbytes / (hardware.h2d_gbps * 1e9 * efficiency)


# --- the plan ------------------------------------------------------------------------------------

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
    """The plan for one hardware x model x context, one ModePlan per column (plan_columns)."""

    hardware: HardwareProfile
    model: ModelProfile
    context: int
    bits: int
    group: int
    residual: int
    sinks: int
    k: int
    reference: str
    prefill_chunk: int
    element_bytes: int
    device_budget_bytes: int
    host_ram_bytes: int | None
    modes: tuple[ModePlan, ...]
    notes: tuple[str, ...]
    outliers: int = 0  # outlier key channels per KV head beside the guide

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
            "settings": {
                "bits": self.bits, "group": self.group, "residual": self.residual, "sinks": self.sinks,
                "k": self.k, "reference": self.reference, "prefill_chunk": self.prefill_chunk,
                "element_bytes": self.element_bytes, "outliers": self.outliers,
            },
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
        "fetch_buffers": FETCH_BUFFERS, "paper_fetch_buffers": PAPER_FETCH_BUFFERS, "speculative_tokens": SPECULATIVE_TOKENS,
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


@dataclass(frozen=True)
class _Sizing:
    """How one mode occupies the device, before any batch is chosen."""

    state: dict  # resident bytes per sequence, by part
    decode_working_set: int  # transient per sequence during decode
    prefill_bytes: int  # transient prefill activations
    prefill_per_sequence: bool  # True: the whole batch prefilled together (paper); False: one row at a time (engine)
    host_per_sequence: int
    read_per_sequence: int  # bytes one decode step reads per sequence
    queries: int  # tokens fed per step


def _sizing(policy: type, hw: HardwareProfile, m: ModelProfile, context: int, bits: int, group: int, residual: int,
            sinks: int, k: int, reference: str, chunk: int, eb: int, outliers: int = 0) -> _Sizing:
    """How a policy's column occupies the device, from its flags (the module docstring)."""
    gm = global_part(m)  # the layers of the policy; the sliding-window layers keep only their window
    kvb = kv_bytes_per_token(gm, eb)
    paper = reference == "paper"
    windows = {"sliding_window_layers": sliding_window_bytes(m, context, chunk, eb, in_use=paper)} \
        if m.sliding_window_layers else {}
    window_read = m.sliding_window_layers and sliding_window_bytes(m, context, chunk, eb, in_use=True)
    if not policy.guided:  # every token's exact K/V on the device
        one_shot = reference == "paper"  # the whole batch in one forward, as one generate() call does
        if one_shot:
            prefill = prefill_activation_bytes(m, context, eb, all_logits=True)
        else:
            prefill = prefill_activation_bytes(m, min(chunk, context), eb, past_tokens=context, mask=True)
        return _Sizing({"kv_cache": context * kvb, **windows},
                       decode_working_set_bytes(m, context, 1, eb, guided=False), prefill, one_shot, 0,
                       context * kvb + window_read, 1)
    tail = min(context, exact_tail_tokens(residual, group))
    if paper:  # the paper's figures: what is in use at `context` tokens
        state = {"guide": guide_bytes(gm, context, bits, group, outliers=outliers), "residual_window": tail * kvb,
                 "sinks": min(sinks, context) * kvb}
    else:  # the engine's preallocated buffers (engine.kvcache: allocated_device_bytes() equals this); where
        # the exact store is device memory (a CPU) the residual window is the store's positions, no buffer
        state = {"guide": guide_bytes(gm, guide_capacity(context, group), bits, group, outliers=outliers),
                 "residual_window": 0 if hw.unified_memory else residual_slots(residual, group, chunk) * kvb,
                 "sinks": sink_slots(sinks) * kvb}
    queries, read = 1, state["guide"] + (tail + min(sinks, context)) * kvb + window_read
    host = 0
    if policy.fetches:
        state["fetch_buffers"] = fetch_buffer_bytes(gm, k, eb, PAPER_FETCH_BUFFERS if paper else FETCH_BUFFERS)
        queries, read, host = SPECULATIVE_TOKENS if speculative(policy) else 1, read + k * kvb, context * kvb
    if hw.unified_memory and (policy.fetches or not paper):  # the exact store is device memory; the engine's
        state["host_store"] = context * kvb  # kivi quantizes its groups from one too
    if policy.verifies:  # drafts feed one token; a verification streams every layer's exact K/V through
        if hw.kind == "cuda" and not hw.unified_memory and global_part(m).layers:
            state["verify_buffers"] = verify_buffer_bytes(m, context, eb)
    prefill = prefill_activation_bytes(m, min(chunk, context), eb, past_tokens=context, past_views=PAST_VIEWS,
                                       mask=True)
    state.update(windows)
    return _Sizing(state, decode_working_set_bytes(m, context, queries, eb, guided=True),
                   prefill, reference == "paper", host, read, queries)


def verify_buffer_bytes(model: ModelProfile, context: int, element_bytes: int = 2) -> int:
    """Exact mode on a GPU: device buffers for one verification's exact K/V, per sequence: one
    layer's K and V of the whole context, VERIFY_BUFFERS times (the next layer's is copied in while
    this one is attended)."""
    return VERIFY_BUFFERS * context * kv_bytes_per_token(model, element_bytes) // model.layers


def expected_tokens(acceptance: float, gamma: int) -> float:
    """Tokens per row per verification when each draft token is accepted with probability a (the
    accepted run is geometric, cut at gamma) plus the exact token: (1 - a^(gamma+1)) / (1 - a)."""
    if acceptance >= 1:
        return gamma + 1.0
    return (1 - acceptance ** (gamma + 1)) / (1 - acceptance)


def exact_cycle(hw: HardwareProfile, m: ModelProfile, s: _Sizing, batch: int, k: int, context: int, eb: int,
                acceptance: float = EXACT_ACCEPTANCE) -> tuple[int, int, float, float, float]:
    """Exact mode at this batch: (gamma, transfer bytes per verification, draft step seconds,
    verify seconds, seconds per output token of a row) for the gamma in 1..16 that maximises
    tokens/s. A draft step is a SpeCache step of one token whose own fetch (k rows per layer and
    KV head) is not hidden; a verification feeds gamma + 1 tokens and reads every exact K/V:
    copied over PCIe (contiguous pinned rows, h2d_gbps) on a GPU, read in place on a CPU or a
    unified-memory device (its read is in the compute roofline)."""
    kvb = kv_bytes_per_token(global_part(m), eb)
    fetch, fetch_s, draft_compute = _step(hw, m, s, batch, k, context, eb)
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


def _max_batch(s: _Sizing, available: int) -> tuple[int, int]:
    """(largest batch by device memory, device bytes per sequence reported).

    Prefill and decode working sets never coexist: with rows prefilled one at a time the prefill
    activations are paid once next to B resident sequences; with every row at once, per sequence."""
    state = sum(s.state.values())
    if s.prefill_per_sequence:
        per_seq = state + max(s.decode_working_set, s.prefill_bytes)
        return batch_that_fits(available, per_seq), per_seq
    per_seq = state + s.decode_working_set
    return min(batch_that_fits(available, state, s.prefill_bytes), batch_that_fits(available, per_seq)), per_seq


def _step(hw: HardwareProfile, m: ModelProfile, s: _Sizing, batch: int, k: int, context: int, eb: int,
          ) -> tuple[int, float, float]:
    """(transfer bytes, transfer seconds, compute seconds) of one decode step at this batch and k."""
    kvb = kv_bytes_per_token(global_part(m), eb)  # only the policy's layers fetch
    transfer = batch * k * kvb
    compute = decode_step_seconds(hw, m, batch, s.queries, s.read_per_sequence, context, eb)
    return transfer, transfer_seconds(hw, transfer), compute


def max_hidden_k(hw: HardwareProfile, m: ModelProfile, s: _Sizing, batch: int, k: int, context: int,
                 eb: int) -> int:
    """Largest k (<= context) whose prefetch time still fits inside the step's compute time."""
    kvb = kv_bytes_per_token(global_part(m), eb)

    def hidden(kk: int) -> bool:
        sized = replace(s, read_per_sequence=s.read_per_sequence + (kk - k) * kvb)
        _, t, c = _step(hw, m, sized, batch, kk, context, eb)
        return t <= c

    lo, hi = 0, context
    if hidden(hi):
        return hi
    while hi - lo > 1:  # hidden(lo) holds (k = 0 moves nothing), hidden(hi) does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if hidden(mid) else (lo, mid)
    return lo


def check_settings(context: int, bits: int = 1, group: int = 64, residual: int = 64, sinks: int = 4, k: int = 0,
                   host_ram_bytes: int | None = None, batch_limit: int | None = None, reference: str = "engine",
                   prefill_chunk: int = DEFAULT_PREFILL_CHUNK, outliers: int | None = 0) -> None:
    """Raise BadArgument on a setting the planner cannot plan for."""
    if context < 1:
        raise BadArgument(f"--context must be >= 1 token, not {context}")
    if bits not in (1, 2):
        raise BadArgument(f"--bits must be 1 or 2, not {bits}")
    if group not in GROUPS:
        raise BadArgument(f"--group must be one of {', '.join(map(str, GROUPS))}, not {group}")
    if outliers is not None and not 0 <= outliers <= OUTLIERS_MAX:  # None: the default for the bits
        raise BadArgument(f"--outliers must be in 0..{OUTLIERS_MAX}, not {outliers}")
    if residual < 1:
        raise BadArgument(f"--residual must be >= 1, not {residual}")
    if sinks < 0:
        raise BadArgument(f"--sinks must be >= 0, not {sinks}")
    if k < 0:
        raise BadArgument(f"--k must be >= 0, not {k}")
    if host_ram_bytes is not None and host_ram_bytes <= 0:
        raise BadArgument(f"--host-ram must be > 0, not {host_ram_bytes / GIB:g} GB")
    if batch_limit is not None and batch_limit < 1:
        raise BadArgument(f"batch limit must be >= 1, not {batch_limit}")
    if reference not in REFERENCES:
        raise BadArgument(f"--reference must be one of {', '.join(REFERENCES)}, not {reference!r}")
    if prefill_chunk < 16:
        raise BadArgument(f"--prefill-chunk must be >= 16, not {prefill_chunk}")


def plan(hardware: HardwareProfile, model: ModelProfile, context: int, bits: int | None = None,
         group: int | None = None, residual: int = 64, sinks: int = 4, k: int | None = None,
         host_ram_bytes: int | None = None, batch_limit: int | None = None, *, reference: str = "engine",
         prefill_chunk: int = DEFAULT_PREFILL_CHUNK, element_bytes: int | None = None,
         outliers: int | None = None) -> Plan:
    """Plan full cache, KIVI and SpeCache for `context` tokens per sequence.

    bits / group / k default to the model profile's defaults (k: its k for the prefetch the engine
    uses on this device, current on a CPU, speculative on a GPU). host_ram_bytes defaults to the RAM
    detected with the hardware (None: the host check is skipped). reference "engine" models this
    project's engine: rows prefilled one at a time in chunks, so prefill activations are paid once.
    "paper" models the paper's throughput setup: the whole batch is prefilled together, the full
    cache in one forward with fp16 + fp32 logits of every position (transformers before 4.45), the
    guided caches in chunks of prefill_chunk tokens; prefill activations are paid per sequence.
    """
    bits = model.default_bits if bits is None else bits
    group = model.default_group if group is None else group
    outliers = outliers_for(bits, outliers)  # as CacheConfig.guide_outliers
    if k is None:  # the k of the prefetch the engine uses on this device
        k = model.k_for(device_prefetch(hardware.kind))
    host_ram_bytes = hardware.host_ram_bytes if host_ram_bytes is None else host_ram_bytes
    check_settings(context, bits, group, residual, sinks, k, host_ram_bytes, batch_limit, reference, prefill_chunk,
                   outliers)
    eb = element_bytes or hardware.element_bytes
    notes: list[str] = []
    if context > model.max_context:
        notes.append(f"context {context} exceeds {model.display_name}'s maximum of {model.max_context} tokens")
    if k > context:
        notes.append(f"k = {k} exceeds the context; every position is fetched (k = {context})")
        k = context
    budget = device_budget_bytes(hardware)
    available = budget - weight_bytes(model, eb)
    if hardware.unified_memory:
        host_ram_bytes = None  # the exact store lives in the same RAM: counted on the device side
    modes = []
    for policy in plan_columns().values():
        mode_k = k if policy.fetches else 0
        s = _sizing(policy, hardware, model, context, bits, group, residual, sinks, mode_k, reference,
                    prefill_chunk, eb, outliers)
        modes.append(_plan_mode(policy, hardware, model, s, available, context, mode_k, bits, group, eb,
                                host_ram_bytes, batch_limit))
    full_tps = modes[0].tokens_per_second
    modes = [replace(mp, predicted_speedup_vs_full=(mp.tokens_per_second / full_tps) if full_tps > 0 else None)
             for mp in modes]
    notes.extend(_mode_notes(modes, available, model, eb))
    if hardware.kind == "cpu":
        notes.append("CPU step times are a roofline; measured CPU decode is dominated by per-layer framework "
                     "overhead (docs/planner.md)")
        notes.append("on a CPU specache runs with --prefetch current by default: the chosen rows are read in place "
                     "from the store, so the transfer row (the speculative prefetch's copy) does not apply")
    return Plan(hardware, model, context, bits, group, residual, sinks, k, reference, prefill_chunk, eb, budget,
                host_ram_bytes, tuple(modes), tuple(notes), outliers)


def _plan_mode(policy: type, hw: HardwareProfile, m: ModelProfile, s: _Sizing, available: int, context: int, k: int,
               bits: int, group: int, eb: int, host_ram_bytes: int | None, batch_limit: int | None) -> ModePlan:
    by_device, per_seq = _max_batch(s, max(available, 0))
    by_host = None
    if host_ram_bytes is not None and s.host_per_sequence > 0:
        by_host = host_usable_bytes(host_ram_bytes) // s.host_per_sequence
    limits = {"device": by_device, "host": by_host, "batch_limit": batch_limit}
    limited_by, batch = min(((key, v) for key, v in limits.items() if v is not None), key=lambda kv: kv[1])
    at = max(batch, 1)
    transfer, transfer_s, compute_s = _step(hw, m, s, at, k, context, eb)
    step_s = max(compute_s, transfer_s)
    exact = {}
    if policy.verifies:  # per output token of a row; the transfer is one verification's
        gamma, transfer, draft_s, verify_s, step_s = exact_cycle(hw, m, s, at, k, context, eb)
        transfer_s = transfer / (hw.h2d_gbps * 1e9) if transfer else 0.0
        compute_s = step_s
        exact = {"gamma": gamma, "acceptance": EXACT_ACCEPTANCE, "verify_seconds": verify_s,
                 "draft_seconds": draft_s}
    breakdown = dict(s.state)
    breakdown["decode_working_set"] = s.decode_working_set
    shared = {"weights": weight_bytes(m, eb)}
    if s.prefill_per_sequence:
        breakdown["prefill_activations"] = s.prefill_bytes
    else:
        shared["prefill_activations"] = s.prefill_bytes
    guided = policy.guided
    return ModePlan(
        mode=policy.policy, max_batch=batch, limited_by=limited_by, max_batch_device=by_device, max_batch_host=by_host,
        k=k, bits=bits if guided else None, group=group if guided else None,
        device_bytes_per_sequence=per_seq, device_breakdown=breakdown, shared_device_bytes=shared,
        host_bytes_per_sequence=s.host_per_sequence, transfer_bytes_per_step=transfer,
        transfer_seconds_per_step=transfer_s, compute_seconds_per_step=compute_s, step_seconds=step_s,
        prefetch_hidden=transfer_s <= compute_s, tokens_per_second=batch / step_s,
        predicted_speedup_vs_full=None,
        k_max_hidden=max_hidden_k(hw, m, s, at, k, context, eb) if speculative(policy) else None, **exact)


def _mode_notes(modes: list[ModePlan], available: int, m: ModelProfile, eb: int) -> list[str]:
    notes = []
    if available <= 0:
        notes.append(f"the weights alone ({weight_bytes(m, eb) / GIB:.1f} GiB) do not fit on the device")
    for mp in modes:
        if not mp.fits:
            notes.append(f"{mp.mode}: not even one sequence fits ({mp.device_bytes_per_sequence / GIB:.2f} GiB "
                         f"per sequence on the device)")
        elif mp.limited_by == "host":
            notes.append(f"{mp.mode}: host RAM for the exact store limits the batch to {mp.max_batch} "
                         f"(the device alone would fit {mp.max_batch_device})")
        if mp.k_max_hidden is not None and mp.fits and not mp.prefetch_hidden:  # a prefetch that could hide
            notes.append(f"{mp.mode}: the prefetch ({mp.transfer_seconds_per_step * 1e3:.1f} ms) does not hide "
                         f"behind the step ({mp.compute_seconds_per_step * 1e3:.1f} ms); k <= {mp.k_max_hidden} would")
    if modes[0].max_batch == 0:
        notes.append("full cache does not fit: no speedup ratio against it")
    return notes


# --- for the engine: --batch auto / --k auto -------------------------------------------------------

def plan_for_run(model_config: Any, context: int, mode: str = "specache", *, bits: int | None = None,
                 group: int | None = None, k: int | None = None, residual: int = 64, sinks: int = 4,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, batch_limit: int | None = None,
                 hardware: HardwareProfile | None = None, parameters: int | None = None,
                 weights_resident: bool = False, element_bytes: int | None = None,
                 held_weight_bytes: int | None = None, outliers: int | None = None) -> ModePlan:
    """Pick the batch size and k for a run: `plan.max_batch`, `plan.k` of the returned ModePlan.

    model_config: a ModelProfile, a transformers PretrainedConfig or a config dict.
    context: tokens per sequence (prompt + generated). hardware: default detect_hardware().
    weights_resident: the model is already loaded on this device, so the detected free memory
    already excludes the weights. held_weight_bytes: the weights as the loaded model holds them
    (engine.model.linears.held_bytes). Raises DoesNotFit when not even one sequence fits.
    """
    if mode not in plan_columns():
        raise BadArgument(f"the planner knows cache modes {', '.join(plan_columns())}, not {mode!r}")
    model = model_config if isinstance(model_config, ModelProfile) else model_profile_from_config(
        model_config, parameters=parameters)
    if held_weight_bytes is not None:
        model = replace(model, held_weight_bytes=held_weight_bytes)
    hw = hardware or detect_hardware()
    eb = element_bytes or hw.element_bytes
    if weights_resident and hw.free_memory_bytes is not None:
        free = min(hw.device_memory_bytes, hw.free_memory_bytes + weight_bytes(model, eb))
        hw = replace(hw, free_memory_bytes=free)
    result = plan(hw, model, context, bits, group, residual, sinks, k, batch_limit=batch_limit,
                  prefill_chunk=prefill_chunk, element_bytes=eb, outliers=outliers).mode(mode)
    if not result.fits:
        raise DoesNotFit(f"{mode} cache: one sequence of {context} tokens needs "
                         f"{result.device_bytes_per_sequence / GIB:.2f} GiB on {hw.display_name} "
                         f"beyond the weights, more than is free")
    return result


def check_fits_before_load(model_config: Any, weight_bytes_held: int, context: int, mode: str = "specache", *,
                           hardware: HardwareProfile | None = None, name: str = "the model", **settings) -> None:
    """Before a model is loaded: refuse (DoesNotFit, one line) when its weights as they will be held plus
    one sequence's cache of `context` tokens do not fit in this device's usable memory."""
    model = replace(model_profile_from_config(model_config), held_weight_bytes=weight_bytes_held)
    hw = hardware or detect_hardware(measure=False)
    p = plan(hw, model, context, batch_limit=1, element_bytes=settings.pop("element_bytes", None), **settings)
    budget, per_seq = p.device_budget_bytes, p.mode(mode).device_bytes_per_sequence
    if weight_bytes_held + per_seq > budget:
        raise DoesNotFit(f"{name} does not fit: its weights take {weight_bytes_held / GIB:.2f} GiB as held and one "
                         f"sequence of {context} tokens {per_seq / GIB:.2f} GiB of cache and activations, "
                         f"{(weight_bytes_held + per_seq) / GIB:.2f} GiB in all; {hw.display_name} has "
                         f"{max(budget, 0) / GIB:.2f} GiB usable now")


# --- this machine ------------------------------------------------------------------------------

def measure_h2d_bandwidth(nbytes: int = 256 * MIB, repeats: int = 5) -> float:
    """Median pinned host -> device copy rate of the current CUDA device, GB/s (CUDA only)."""
    import torch

    if not torch.cuda.is_available():
        raise BadArgument("measuring host-to-device bandwidth needs a CUDA device")
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)  # warm-up
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return nbytes / sorted(times)[len(times) // 2] / 1e9


def detect_hardware(measure: bool = True) -> HardwareProfile:
    """This machine: the CUDA device 0 (memory from mem_get_info, measured H2D bandwidth), else the CPU
    profile with this machine's RAM as device memory. Unrecognized GPUs get the cuda-generic profile."""
    import torch

    ram_total, ram_available = machine_ram_bytes()
    if not torch.cuda.is_available():
        cpu = load_hardware("cpu")
        return replace(cpu, device_memory_bytes=ram_total, free_memory_bytes=min(ram_available, ram_total),
                       host_ram_bytes=ram_total,
                       source=f"detected: no CUDA device; RAM as device memory ({cpu.source})")
    name = torch.cuda.get_device_name(0)
    free, total = torch.cuda.mem_get_info(0)
    base = match_cuda_device(name) or load_hardware("cuda-generic")
    h2d = base.h2d_gbps
    if measure:
        h2d = round(min(measure_h2d_bandwidth(), base.pcie_link_gbps or math.inf), 2)
    return replace(base, device_memory_bytes=total, free_memory_bytes=free, h2d_gbps=h2d,
                   host_ram_bytes=ram_total, source=f"detected: {name} ({base.source})")
