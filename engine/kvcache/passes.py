"""What one forward pass does to the cache (Step), the model's shape as the cache sees it, and the
attention pieces the layers share: grouped queries, masks, soft-capping, SDPA with the backends
allowed, the split prefill attention and its merge, row writes and imports. engine.kvcache.base
builds the layer classes and the cache on them (and re-exports these names)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.nn.attention import sdpa_kernel

from engine.backends.kernels import backend_for, sdpa_backends
from engine.backends.native_cpu import bf16_prefill_kernel


@dataclass(frozen=True)
class ModelShape:
    """What the cache needs to know about the model."""

    layers: int
    heads: int  # query heads
    kv_heads: int
    head_dim: int

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @classmethod
    def from_config(cls, config) -> "ModelShape":
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        return cls(config.num_hidden_layers, heads, kv, head_dim)


def sliding_windows(config) -> tuple[int | None, ...]:
    """Each layer's sliding window as the model's attention modules pass it (None: global attention):
    with layer_types (Qwen2/3, Gemma 2/3) the "sliding_attention" layers take config.sliding_window;
    without (Mistral, Phi-3) every layer does. engine.model.attention checks it on every call."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers, window = text.num_hidden_layers, getattr(text, "sliding_window", None)
    types = getattr(text, "layer_types", None)
    if not window:
        return (None,) * layers
    if types is not None:
        return tuple(window if t == "sliding_attention" else None for t in types)
    return (window,) * layers


@dataclass
class Step:
    """What one forward pass does to the cache (shared by all layers during that pass).

    rows: the cache rows the batch occupies (a contiguous slice, so reads are views).
    start: [b] position of each row's first new token (= its committed length).
    n_new: tokens fed per row. keep: how many of them are committed afterwards
    (n_new for prefill; 1 in a speculative step, whose second token is only a probe).
    """

    rows: slice
    start: torch.Tensor  # [b] long
    n_new: int
    keep: int
    select: int | None = None  # index of the new token whose attention row picks the next fetch set
    prefill: bool = False  # prompt tokens: attention over the exact past
    starts: list[int] = field(default_factory=list)  # start as Python ints (read by every layer)
    shared: dict = field(default_factory=dict, repr=False)  # values built once per pass (shared_value)
    # prefill attention may compute in this dtype (bf16: the native kernel; None: the model's, exact);
    # set from the attention module by engine.model.attention (prepare_model's prefill_dtype)
    compute: torch.dtype | None = None
    exact: bool = False  # exact mode's verification: every new token into the store, exact attention over it
    draft: bool = False  # exact mode's draft pass: committed as a draft (KVCache.commit), never into the store
    # fixed shapes: the pass reads positions and lengths only from device tensors (writes at step.positions(),
    # attention over the whole preallocated length with a mask), so that a recorded pass (a CUDA graph) replays
    # right at any length; only for caches whose every layer is `capturable`
    fixed: bool = False

    def __post_init__(self) -> None:
        if not self.starts:
            self.starts = self.start.tolist()

    def shared_value(self, key: tuple, build):
        """A value every layer of this pass needs alike (an attention mask), built by the first that asks."""
        if key not in self.shared:
            self.shared[key] = build()
        return self.shared[key]

    @property
    def aligned(self) -> bool:
        """Every row's new tokens start at the same position."""
        return min(self.starts) == max(self.starts)

    def positions(self) -> torch.Tensor:
        """Absolute positions of the new tokens. -> [b, T]"""
        return self.start[:, None] + torch.arange(self.n_new, device=self.start.device)


def grouped_query(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[b, H, T, D] -> [b, H_kv, G*T, D]: the query heads sharing a KV head side by side."""
    b, h, t, d = q.shape
    return q.reshape(b, kv_heads, (h // kv_heads) * t, d)


def ungroup_output(o: torch.Tensor, heads: int, t: int) -> torch.Tensor:
    """[b, H_kv, G*T, D] -> [b, T, H, D], the layout transformers' attention modules expect."""
    b, _, _, d = o.shape
    return o.reshape(b, heads, t, d).transpose(1, 2)


def causal_mask(step: Step, group: int, length: int) -> torch.Tensor | None:
    """Boolean mask [b, 1, G*T, length]: query t of row r sees positions <= start_r + t.

    None when every row sees every position (one new token, equal lengths)."""
    if step.n_new == 1 and step.aligned and step.starts[0] + 1 == length and not step.fixed:
        return None
    pos = step.positions()  # [b, T]
    cols = torch.arange(length, device=pos.device)
    allowed = cols[None, None, :] <= pos[:, :, None]  # [b, T, L]
    return allowed.repeat(1, group, 1)[:, None]  # rows ordered (g, t) like grouped_query


def additive_mask(allowed: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """Boolean mask -> 0 where allowed, -inf elsewhere: what scaled_dot_product_attention makes of a
    boolean mask on every call; made once per pass and shared by the layers (Step.shared_value),
    it saves each layer that conversion (a prefill chunk's mask is G*T x past floats)."""
    if allowed is None:
        return None
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def soft_cap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Attention-logit softcapping (Gemma 2): tanh(s / c) * c; positions at -inf (masked) stay there."""
    if softcap is None:
        return scores
    return torch.where(torch.isneginf(scores), scores, torch.tanh(scores / softcap) * softcap)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """torch's scaled_dot_product_attention with the SDPA backends q's device's backend declares
    (engine.backends.kernels.sdpa_backends; torch's own choice where it declares none)."""
    backends = sdpa_backends(q.device.type)
    if backends is None:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    with sdpa_kernel(backends):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def masked_attention(qg: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                     scaling: float, softcap: float | None = None) -> torch.Tensor:
    """Attention of grouped queries qg [b, H_kv, G*T, D] over keys/values [b, H_kv, L, D] with an
    additive mask [b, 1, G*T, L] (or None). Without a softcap one SDPA call; with one, transformers'
    eager order: scores * scaling, softcap, + mask, softmax in fp32. -> [b, H_kv, G*T, D]"""
    if softcap is None:
        return sdpa(qg, keys, values, mask, scaling)
    scores = torch.tanh((qg @ keys.transpose(-1, -2)).float() * (scaling / softcap)) * softcap  # [b, H_kv, GT, L]
    if mask is not None:
        scores = scores + mask
    return torch.softmax(scores, dim=-1).to(values.dtype) @ values


def split_attention_applies(q: torch.Tensor, step: Step) -> bool:
    """Whether a pass can take `split_prefill_attention`: a prefill chunk of one row (or rows that
    start together) on the CPU, where torch's flash kernel returns the log-sum-exp it needs."""
    return step.prefill and q.device.type == "cpu" and step.aligned and step.n_new > 1


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
                    causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's CPU flash attention, which also returns each query's log-sum-exp of scores.
    q [B, H, M, D], k/v [B, H, N, D] (head strides may be 0: a KV head expanded to its group);
    causal: query i sees keys <= i (top-left aligned, M == N). -> out [B, H, M, D], lse [B, H, M] fp32."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=causal, scale=scaling)
    return out, lse


def merge_attention(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Combine attentions of the same queries over disjoint sets of keys into the attention over
    their union: each part's output weighted by exp(its log-sum-exp - the union's). parts: (out
    [..., M, D], lse [..., M] fp32) each -> [..., M, D] in out's dtype (the sum taken in fp32)."""
    if len(parts) == 1:
        return parts[0][0]
    lse = torch.stack([p[1] for p in parts])  # [n, ..., M]
    weights = torch.exp(lse - torch.logsumexp(lse, dim=0))  # [n, ..., M]
    out = parts[0][0].float() * weights[0, ..., None]
    for (o, _), w in zip(parts[1:], weights[1:]):
        out.addcmul_(o.float(), w[..., None])
    return out.to(parts[0][0].dtype)


def split_prefill_attention(q: torch.Tensor, past: list[tuple[torch.Tensor, torch.Tensor]], k_new: torch.Tensor,
                            v_new: torch.Tensor, scaling: float) -> torch.Tensor:
    """Exact attention of a prefill chunk without a mask: each past piece (every key visible to every
    query) by the flash kernel unmasked, the chunk's own block with its causal mask, merged by
    log-sum-exp (`merge_attention`). GQA without repeating K/V: over the past, the G query heads of a
    KV head are stacked as G*T rows against that head; in the block, the KV head is expanded (stride 0)
    to its G query heads. Same result as one masked softmax over [past, chunk] up to float rounding.

    q [b, H, T, D] (new tokens at positions start..start+T-1); past: (k, v) [b, H_kv, n_i, D] pieces
    holding every earlier position once (empty pieces skipped); k_new/v_new [b, H_kv, T, D].
    -> [b, H_kv, G*T, D], rows ordered (g, t) like grouped_query."""
    b, h, t, d = q.shape
    hk = k_new.shape[1]
    g = h // hk
    qg = grouped_query(q, hk).contiguous()  # [b, H_kv, G*T, D]
    parts = [flash_attention(qg, k, v, scaling) for k, v in past if k.shape[2]]
    expand = lambda x: x.reshape(b * hk, 1, t, d).expand(-1, g, -1, -1)  # [b*H_kv, G, T, D]
    out, lse = flash_attention(qg.view(b * hk, g, t, d), expand(k_new), expand(v_new), scaling, causal=True)
    parts.append((out.reshape(b, hk, g * t, d), lse.reshape(b, hk, g * t)))
    return merge_attention(parts)


def native_prefill_attention(q: torch.Tensor, pieces: list[tuple[torch.Tensor, torch.Tensor]], scaling: float,
                             start: int, first: int = 0, window: int = 0) -> torch.Tensor | None:
    """A prefill chunk's attention by the native bf16 kernel (engine/native/attention_kernels.c):
    Q, K, P and V rounded to bf16, products accumulated in fp32, causal (and within a sliding window W:
    query position p sees keys (p - W, p]), GQA by stacking the query heads of a KV head. Not exact: the
    exact path is split_prefill_attention (or the sliding layer's masked one) in fp32.

    q [1, H, T, D] (positions start..start+T-1); pieces: (k, v) [1, H_kv, n_i, D], fp32 or bf16 with
    contiguous rows, holding every position first..start+T-1 once, in order (the chunk's own last).
    -> [1, H_kv, G*T, D] fp32, or None where the kernel does not apply (no native library or no
    AVX512-BF16, other layouts, a window under 64): the caller then takes the exact path."""
    pieces = [(k, v) for k, v in pieces if k.shape[2]]
    b, h, t, d = q.shape
    if b != 1 or not 1 <= len(pieces) <= 3 or d % 32 or d > 256 or 0 < window < 64 or not 0 <= first <= start:
        return None
    dtype = pieces[0][0].dtype
    if dtype not in (torch.float32, torch.bfloat16) or any(x.dtype != dtype or x.stride(-1) != 1
                                                           for k, v in pieces for x in (k, v)) \
            or any(k.stride() != v.stride() for k, v in pieces):  # a piece's K and V: one layout (sr, sh)
        return None
    if sum(k.shape[2] for k, _ in pieces) != start + t - first:
        return None
    qg = grouped_query(q, pieces[0][0].shape[1]).float().contiguous()  # [1, H_kv, G*T, D]
    return backend_for(q.device).prefill_attention(qg, pieces, scaling, start, first, window)


def one_element_type(pieces: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """K/V pieces in one element type a bf16 prefill kernel takes: as they are where they share fp32 or bf16, else
    all rounded to bf16 (a 16-bit exact store beside an fp32 residual window: the kernels round K and V to bf16
    anyway)."""
    kinds = {x.dtype for piece in pieces for x in piece}
    if len(kinds) <= 1 and kinds <= {torch.float32, torch.bfloat16}:
        return pieces
    return [(k.to(torch.bfloat16), v.to(torch.bfloat16)) for k, v in pieces]


def bf16_prefill_attention(q: torch.Tensor, pieces: list[tuple[torch.Tensor, torch.Tensor]], scaling: float,
                           start: int, first: int = 0, window: int = 0) -> torch.Tensor | None:
    """A bf16 prefill chunk's attention, causal (and within a sliding window W: query position p sees keys (p - W,
    p]), by the CPU's kernel (bf16_prefill_kernel): Q, K, P and V rounded to bf16, fp32 sums. q [1, H, T, D]
    (positions start..start+T-1); pieces: (k, v) [1, H_kv, n_i, D] holding positions first..start+T-1 once, in
    order. -> [1, H_kv, G*T, D] fp32, or None where no kernel applies (the caller takes the exact path)."""
    kernel, pieces = bf16_prefill_kernel(), one_element_type(pieces)
    if kernel == "native":
        return native_prefill_attention(q, pieces, scaling, start, first, window)
    if kernel != "torch" or q.shape[0] != 1 or sum(k.shape[2] for k, _ in pieces) != start + q.shape[2] - first:
        return None
    k, v = (torch.cat([p[i] for p in pieces], 2).to(torch.bfloat16) for i in (0, 1))  # [1, H_kv, N, D]
    q16, past = q.to(torch.bfloat16), start - first
    if not window:  # first is 0: the past unmasked, the chunk's block causal
        return split_prefill_attention(q16, [(k[:, :, :past], v[:, :, :past])], k[:, :, past:], v[:, :, past:],
                                       scaling).float()
    kpos, qpos = torch.arange(first, start + q.shape[2]), torch.arange(start, start + q.shape[2])[:, None]
    allowed = (kpos <= qpos) & (kpos > qpos - window)  # [T, N]
    mask = additive_mask(allowed.repeat(q.shape[1] // k.shape[1], 1)[None, None], torch.bfloat16)
    return sdpa(grouped_query(q16, k.shape[1]), k, v, mask, scaling).float()


def write_rows(dst_k: torch.Tensor, dst_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step) -> None:
    """Store new K/V [b, H_kv, T, D] into [B, H_kv, L, D] buffers at each row's positions."""
    b, t = k.shape[0], k.shape[2]
    if (b == 1 or step.aligned) and not step.fixed:
        s = step.starts[0]
        dst_k[step.rows, :, s : s + t] = k
        dst_v[step.rows, :, s : s + t] = v
        return
    rows = torch.arange(step.rows.start, step.rows.start + b, device=k.device)[:, None]  # [b, 1]
    pos = step.positions()  # [b, T]
    dst_k[rows, :, pos] = k.transpose(1, 2)  # advanced dims first: [b, T, H_kv, D]
    dst_v[rows, :, pos] = v.transpose(1, 2)


def import_tensors(dst: dict[str, torch.Tensor], src: dict[str, torch.Tensor], check: bool,
                   strict: bool = False) -> None:
    """Copy src[name] into each view dst[name] after checking shape and dtype (check: only validate;
    strict: src must hold nothing else)."""
    if strict and set(src) != set(dst):
        raise ValueError(f"expected tensors {sorted(dst)}, got {sorted(src)}")
    for name, view in dst.items():
        t = src.get(name)
        if t is None or t.shape != view.shape or t.dtype != view.dtype:
            raise ValueError(f"{name}: expected {tuple(view.shape)} {view.dtype}, got "
                             f"{None if t is None else (tuple(t.shape), t.dtype)}")
        if not check:
            view.copy_(t)
