"""Sizing formulas of the caches, shared by the caches' own accounting (`device_bytes()`) and by the
memory planner (engine/plan/planner.py), so that `specache plan` cannot disagree with the engine.

`shape` is anything with `layers`, `kv_heads` and `head_dim` (engine.kvcache.base.ModelShape, or the
planner's engine.plan.profiles.ModelProfile); `model` is a ModelProfile (heads, hidden and vocabulary
sizes too).

The planner's memory rule of a policy is its `plan_sizing` classmethod (full.py, guided.py,
specache.py, exact.py): a PlanTerms (one column's settings, the model, the context and what the
device is) in, a Sizing out, from the shared terms below; the planner itself has no branch per policy."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from engine.config import DEFAULT_STORE_DTYPE, CacheConfig

# the planner's memory terms (docs/planner.md, "Constants")
PAPER_FETCH_BUFFERS = 2  # the paper's implementation double-buffers the fetched set; the engine keeps one
SPECULATIVE_TOKENS = 2  # tokens fed per SpeCache step: [T_t, T'_{t+1}]
SCORE_BYTES = 4  # attention scores and probabilities are fp32
SCORE_COPIES = 4  # score-sized buffers alive at once: scores, joined with the residual's, probabilities, guide share
PAST_VIEWS = 2  # prefill of a guided layer: past exact K/V copied from the host store, then joined with the residual
LOGIT_UPCAST_BYTES = 4  # the reference baseline's fp32 copy of the logits
VERIFY_BUFFERS = 2  # exact mode on a GPU: one layer's exact K/V attended while the next layer's is copied in
FETCH_BUFFERS = 1  # exact fetched sets per layer on the device (the next set is written after this one was read)
OUTLIER_BITS = 4  # code width of the guide's outlier key channels (engine/kvcache/outliers.py)
OUTLIER_INDEX_BYTES = 8  # one int64 channel index per outlier channel, KV head, layer and row


def kv_elements_per_token(shape) -> int:
    """K and V elements one token adds over all layers: 2 x layers x KV heads x head_dim."""
    return 2 * shape.layers * shape.kv_heads * shape.head_dim


def kv_bytes_per_token(shape, element_bytes: int = 2) -> int:
    """Bytes of exact K and V for one token over all layers."""
    return kv_elements_per_token(shape) * element_bytes


def layer_kv_bytes_per_token(shape, element_bytes: int) -> int:
    """Bytes of exact K and V for one token of one layer."""
    return 2 * shape.kv_heads * shape.head_dim * element_bytes


STORE_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def cpu_store_dtype(config: CacheConfig) -> torch.dtype:
    """The exact host store's element type on a CPU: config.store_dtype, default DEFAULT_STORE_DTYPE."""
    return STORE_TORCH_DTYPES[config.store_dtype or DEFAULT_STORE_DTYPE]


def store_dtype(config: CacheConfig, device_type: str, dtype: torch.dtype) -> torch.dtype:
    """The exact host store's element type: on a CPU, cpu_store_dtype (the store is most of a long document's
    memory there, and only the k rows a step fetches are read back, widened to the compute dtype); elsewhere the
    compute dtype (a GPU's fp16 / bf16 is already 16-bit)."""
    return cpu_store_dtype(config) if device_type == "cpu" else dtype


def store_element_bytes(config: CacheConfig, unified: bool, element_bytes: int) -> int:
    """Bytes of one exact store element: the planner's view of store_dtype (unified: the CPU, where the store
    is the device's memory; element_bytes: the compute dtype's)."""
    return cpu_store_dtype(config).itemsize if unified else element_bytes


def store_at_compute_dtype(t: "PlanTerms") -> "PlanTerms":
    """t with the exact store in the compute dtype (exact mode: its verification attends with the store)."""
    name = next(n for n, d in STORE_TORCH_DTYPES.items() if d.itemsize == t.element_bytes)
    return replace(t, cache=replace(t.cache, store_dtype=name))


def guide_bits_per_element(bits: int, group: int) -> float:
    """Storage per element: `bits` of code plus fp16 scale and zero per `group`."""
    return bits + 32 / group


def guide_bytes(shape, tokens: int, bits: int, group: int, layers: int | None = None, outliers: int = 0,
                rows: int = 1) -> int:
    """Bytes of the quantized guide of `tokens` tokens (over `rows` rows) and `layers` layers (default
    all): bit-packed codes + fp16 scale and zero per group (keys in groups of g tokens, values in
    groups of value_group(g, head_dim) channels; engine.kvcache.quant), and with `outliers` channels the
    side guide of 4-bit codes + fp16 scale and zero per g tokens, and its channel indices per row
    (engine.kvcache.outliers)."""
    layers = shape.layers if layers is None else layers
    key_bits = guide_bits_per_element(bits, group)
    value_bits = guide_bits_per_element(bits, value_group(group, shape.head_dim))
    total = tokens * layers * shape.kv_heads * shape.head_dim * (key_bits + value_bits) / 8
    if outliers:
        code_bytes = -(-outliers * OUTLIER_BITS // 8)  # per token: the channels' codes packed in bytes
        total += tokens * layers * shape.kv_heads * (code_bytes + outliers * 4 / group)  # + fp16 scale, zero
        total += rows * layers * shape.kv_heads * outliers * OUTLIER_INDEX_BYTES
    return math.ceil(total)


def value_group(group: int, head_dim: int) -> int:
    """Channels per value quantization group: the key group where it divides the head, else their greatest
    common divisor (a head of 96 channels with group 64: groups of 32)."""
    return math.gcd(group, head_dim)


def quant_boundary(length: torch.Tensor | int | list[int], residual: int, group: int) -> torch.Tensor | int | list[int]:
    """Positions below the returned value are quantized: whole groups that left the residual window
    (a tensor of lengths, or one length as an int: the host's copy, read without a device sync; a list: each)."""
    if isinstance(length, list):
        return [quant_boundary(n, residual, group) for n in length]
    if isinstance(length, int):
        return max(length - residual, 0) // group * group
    return ((length - residual).clamp(min=0) // group) * group


def exact_tail_tokens(residual: int, group: int) -> int:
    """Worst-case exact recent tokens: R, plus up to g - 1 more because keys are quantized a full group at a time."""
    return residual + group - 1


def residual_slots(residual: int, group: int, chunk: int) -> int:
    """Exact residual slots a guided layer preallocates per row: the window, a group waiting, a prefill chunk."""
    return residual + group + max(chunk, 2)


def sink_slots(sinks: int) -> int:
    """Exact sink slots a guided layer preallocates per row (at least one, so buffers are never empty)."""
    return max(sinks, 1)


def guide_capacity(max_len: int, group: int) -> int:
    """Tokens a guide preallocates for max_len tokens: whole key groups."""
    return -(-max_len // group) * group


def fetch_buffer_bytes(shape, k: int, element_bytes: int = 2, buffers: int = FETCH_BUFFERS) -> int:
    """Device buffers for the fetched exact K/V: k positions x layers x KV heads x head_dim x (K, V)."""
    return buffers * k * kv_bytes_per_token(shape, element_bytes)


def window_tokens(shape, max_len: int, bits: int, group: int, k: int, residual: int, element_bytes: int) -> int:
    """Recent-window size giving window mode the device bytes of specache at max_len tokens (per layer)."""
    guide = max_len * 2 * shape.kv_heads * shape.head_dim * guide_bits_per_element(bits, group) / 8
    per_token = layer_kv_bytes_per_token(shape, element_bytes)
    return max(1, int((guide + k * per_token) / per_token) + residual)


SLIDING_SLACK_MIN = 17  # exact mode's largest pass: GAMMA_MAX + 1 tokens (engine.config.GAMMA_MAX = 16)


def sliding_slots(window: int, chunk: int, max_len: int) -> int:
    """Ring slots of a sliding-window layer per row: the window plus one pass's new tokens (a prefill
    chunk, or exact mode's largest verification), never more than the planned length."""
    return min(max_len, window + max(chunk, SLIDING_SLACK_MIN))


def sliding_kept_tokens(window: int, length: int) -> int:
    """Positions a sliding-window layer keeps for a row of `length` tokens: the last W."""
    return min(window, length)


@dataclass(frozen=True)
class LayerGroup:
    """Some layers of a model, as the formulas above read a shape: count, KV heads, head_dim."""

    layers: int
    kv_heads: int
    head_dim: int


def global_part(shape) -> LayerGroup:
    """The layers of `shape` that attend over the whole context and so keep the configured policy
    (a planner ModelProfile's sliding_window_layers keep only their window instead)."""
    return LayerGroup(shape.layers - getattr(shape, "sliding_window_layers", 0), shape.kv_heads, shape.head_dim)


def sliding_window_bytes(shape, context: int, chunk: int, element_bytes: int, in_use: bool = False) -> int:
    """Device bytes per sequence of the model's sliding-window layers (shape.sliding_window_layers of
    window shape.sliding_window): their preallocated rings for `context` tokens, or (in_use) the
    window they hold at `context` tokens."""
    n = getattr(shape, "sliding_window_layers", 0)
    if not n:
        return 0
    w = shape.sliding_window
    tokens = sliding_kept_tokens(w, context) if in_use else sliding_slots(w, chunk, context)
    return n * tokens * layer_kv_bytes_per_token(shape, element_bytes)


# --- the planner's memory terms ----------------------------------------------------------------------

def layer_view_bytes(model, tokens: int, element_bytes: int = 2) -> int:
    """One layer's K and V for `tokens` positions in 16-bit: what one attention call reads at once."""
    return tokens * 2 * model.kv_heads * model.head_dim * element_bytes


def attention_score_bytes(model, queries: int, tokens: int, copies: int = SCORE_COPIES) -> int:
    """fp32 score-sized buffers of `queries` query tokens x all heads against `tokens` keys."""
    return copies * queries * model.heads * tokens * SCORE_BYTES


def causal_mask_bytes(model, chunk: int, tokens: int) -> int:
    """Boolean mask of a chunk of queries (grouped: query heads per KV head x chunk) against `tokens` keys."""
    return (model.heads // model.kv_heads) * chunk * tokens


def prefill_activation_bytes(model, chunk: int, element_bytes: int = 2, *, all_logits: bool = False,
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


def decode_working_set_bytes(model, context: int, queries: int, element_bytes: int = 2, *,
                             guided: bool) -> int:
    """Transient bytes per sequence in a decode step: the logits, and for a guide the fp32 score
    buffers plus one layer's codes expanded for the attention matmuls (fp32 K or V of one layer,
    the same bytes as K and V of that layer in 16 bits). The full cache is read in place by a
    fused attention kernel."""
    logits = queries * model.vocab_size * element_bytes
    if not guided:
        return logits
    return logits + attention_score_bytes(model, queries, context) + layer_view_bytes(model, context, 2)


def verify_buffer_bytes(model, context: int, element_bytes: int = 2) -> int:
    """Exact mode on a GPU: device buffers for one verification's exact K/V, per sequence: one
    layer's K and V of the whole context, VERIFY_BUFFERS times (the next layer's is copied in while
    this one is attended)."""
    return VERIFY_BUFFERS * context * kv_bytes_per_token(model, element_bytes) // model.layers


# the parts of a sequence's device bytes, in the order the plan lists them
PARTS = ("kv_cache", "guide", "residual_window", "sinks", "fetch_buffers", "host_store", "verify_buffers",
         "sliding_window_layers")


@dataclass(frozen=True)
class PlanTerms:
    """What one plan column is sized from: the model (a ModelProfile), the context, the column's cache
    settings (k: what it fetches; outliers resolved), the element bytes, the reference (paper: the
    paper's setup, what is in use; else the engine's preallocated buffers), and the device: unified (the
    exact store is device memory: a CPU) and streams (a GPU with its own memory: copies go over PCIe)."""

    model: Any
    context: int
    cache: CacheConfig
    element_bytes: int
    paper: bool
    unified: bool
    streams: bool

    @property
    def layers(self) -> LayerGroup:
        """The layers the policy keeps (the sliding-window layers keep only their window)."""
        return global_part(self.model)

    @property
    def kv_bytes(self) -> int:
        """Exact K/V bytes of one token over the policy's layers."""
        return kv_bytes_per_token(self.layers, self.element_bytes)

    @property
    def store_kv_bytes(self) -> int:
        """Exact K/V bytes of one token in the exact store (store_element_bytes: 16-bit on a CPU by default)."""
        return kv_bytes_per_token(self.layers, store_element_bytes(self.cache, self.unified, self.element_bytes))

    @property
    def residual_in_store(self) -> bool:
        """The residual window is the store's own positions: where the store is the device's memory in the
        compute dtype (else it has buffers of its own, in the compute dtype)."""
        return self.unified and self.store_kv_bytes == self.kv_bytes

    @property
    def chunk(self) -> int:
        return min(self.cache.chunk_size, self.context)

    def windows(self) -> dict:
        """The model's sliding-window layers' part (none without them)."""
        m = self.model
        if not getattr(m, "sliding_window_layers", 0):
            return {}
        return {"sliding_window_layers": sliding_window_bytes(m, self.context, self.cache.chunk_size,
                                                              self.element_bytes, in_use=self.paper)}

    def window_read(self) -> int:
        """Bytes a decode step reads from the sliding-window layers."""
        return sliding_window_bytes(self.model, self.context, self.cache.chunk_size, self.element_bytes, in_use=True)


@dataclass(frozen=True)
class Sizing:
    """How one column occupies the device, before any batch is chosen."""

    state: dict  # resident bytes per sequence, by part (PARTS' order)
    decode_working_set: int  # transient per sequence during decode
    prefill_bytes: int  # transient prefill activations
    prefill_per_sequence: bool  # True: the whole batch prefilled together (paper); False: one row at a time
    host_per_sequence: int = 0
    read_per_sequence: int = 0  # bytes one decode step reads per sequence
    queries: int = 1  # tokens fed per step

    def __post_init__(self) -> None:
        order = {name: i for i, name in enumerate(PARTS)}
        object.__setattr__(self, "state", dict(sorted(self.state.items(), key=lambda kv: order.get(kv[0], len(PARTS)))))

    def adding(self, parts: dict, **changes) -> "Sizing":
        """This sizing with more resident parts and other fields changed."""
        return replace(self, state={**self.state, **parts}, **changes)


def exact_cache_sizing(t: PlanTerms) -> Sizing:
    """Every token's exact K/V on the device (the full cache): prefilled in chunks one row at a time, or
    (paper) the whole batch in one forward with the logits of every position."""
    m, eb, context = t.model, t.element_bytes, t.context
    if t.paper:
        prefill = prefill_activation_bytes(m, context, eb, all_logits=True)
    else:
        prefill = prefill_activation_bytes(m, t.chunk, eb, past_tokens=context, mask=True)
    return Sizing({"kv_cache": context * t.kv_bytes, **t.windows()}, decode_working_set_bytes(m, context, 1, eb,
                  guided=False), prefill, t.paper, 0, context * t.kv_bytes + t.window_read(), 1)


def guided_sizing(t: PlanTerms) -> Sizing:
    """A guide, the residual window and the sinks (what is in use at `context` tokens for the paper,
    the engine's preallocated buffers otherwise: where the exact store is device memory it is counted, in its
    own element type, and the residual window is its positions if that is the compute dtype), read whole
    each step."""
    c, gm, kvb, context = t.cache, t.layers, t.kv_bytes, t.context
    outliers = c.guide_outliers
    if t.paper:
        state = {"guide": guide_bytes(gm, context, c.bits, c.group, outliers=outliers),
                 "residual_window": min(context, exact_tail_tokens(c.residual, c.group)) * kvb,
                 "sinks": min(c.sinks, context) * kvb}
    else:
        state = {"guide": guide_bytes(gm, guide_capacity(context, c.group), c.bits, c.group, outliers=outliers),
                 "residual_window": 0 if t.residual_in_store else
                 residual_slots(c.residual, c.group, c.chunk_size) * kvb,
                 "sinks": sink_slots(c.sinks) * kvb}
        if t.unified:
            state["host_store"] = context * t.store_kv_bytes  # kivi quantizes its groups from one too
    tail = min(context, exact_tail_tokens(c.residual, c.group))
    read = state["guide"] + (tail + min(c.sinks, context)) * kvb + t.window_read()
    prefill = prefill_activation_bytes(t.model, t.chunk, t.element_bytes, past_tokens=context, past_views=PAST_VIEWS,
                                       mask=True)
    if not (t.unified or t.paper):  # the prefilling row's exact K/V stay on the device while its prefill needs it
        prefill += context * t.store_kv_bytes  # (HostStore.read_prefix: one row, every layer)
    return Sizing({**state, **t.windows()}, decode_working_set_bytes(t.model, context, 1, t.element_bytes,
                  guided=True), prefill, t.paper, 0, read, 1)
