"""Sizing formulas of the caches, shared by the caches' own accounting (`device_bytes()`) and by the
memory planner (engine/plan/planner.py), so that `specache plan` cannot disagree with the engine.

`shape` is anything with `layers`, `kv_heads` and `head_dim` (engine.kvcache.base.ModelShape, or the
planner's engine.plan.profiles.ModelProfile)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

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


def quant_boundary(length: torch.Tensor | int, residual: int, group: int) -> torch.Tensor | int:
    """Positions below the returned value are quantized: whole groups that left the residual window
    (a tensor of lengths, or one length as an int: the host's copy, read without a device sync)."""
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
