"""The KV cache handed to transformers: a list of per-layer objects, one Step shared by all.

transformers calls `cache.update(key_states, value_states, layer_idx)` from each attention
module; our registered attention function (engine.model.attention) then calls
`cache.layers[layer_idx].attend(query, scaling, cache.step)`. Rows of a batch may have
different lengths: each row's committed length lives in `cache.lengths`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers.cache_utils import Cache

from engine import native
from engine.config import CacheConfig
from engine.kvcache.sizes import kv_bytes_per_token
from engine.kvcache.transfer import Transfer


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


# SDPA backends per device type, in torch's order of preference. CUDA leaves out cuDNN's, which builds a
# plan for every new key length (2.2 ms of CPU per call measured on an H200, 69 ms of a 101 ms decode step:
# the length grows by one each step); flash takes unmasked calls, the memory-efficient kernel masked ones.
SDPA_BACKENDS = {"cuda": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]}


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """torch's scaled_dot_product_attention with the backends SDPA_BACKENDS names for q's device (torch's
    own choice where it names none)."""
    backends = SDPA_BACKENDS.get(q.device.type)
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
                             start: int) -> torch.Tensor | None:
    """A prefill chunk's attention by the native bf16 kernel (engine/native/attention_kernels.c):
    Q, K, P and V rounded to bf16, products accumulated in fp32, causal, GQA by stacking the query
    heads of a KV head. Not exact: the exact path is split_prefill_attention in fp32.

    q [1, H, T, D] (positions start..start+T-1); pieces: (k, v) [1, H_kv, n_i, D], fp32 or bf16 with
    contiguous rows, holding every position 0..start+T-1 once, in order (the chunk's own last).
    -> [1, H_kv, G*T, D] fp32, or None where the kernel does not apply (no native library or no
    AVX512-BF16, other layouts): the caller then takes the exact path."""
    lib = native.lib()
    pieces = [(k, v) for k, v in pieces if k.shape[2]]
    b, h, t, d = q.shape
    if lib is None or b != 1 or not 1 <= len(pieces) <= 3 or d % 32 or d > 256 or \
            not lib.specache_prefill_attention_available():
        return None
    dtype = pieces[0][0].dtype
    if dtype not in (torch.float32, torch.bfloat16) or any(x.dtype != dtype or x.stride(-1) != 1
                                                           for k, v in pieces for x in (k, v)) \
            or any(k.stride() != v.stride() for k, v in pieces):  # a piece's K and V: one layout (sr, sh)
        return None
    if sum(k.shape[2] for k, _ in pieces) != start + t:
        return None
    hk = pieces[0][0].shape[1]
    qg = grouped_query(q, hk).float().contiguous()  # [1, H_kv, G*T, D]
    out = torch.empty_like(qg)
    args = native.PrefillArgs(H=hk, G=h // hk, T=t, D=d, start=start, npieces=len(pieces),
                              src_bf16=int(dtype == torch.bfloat16), nthreads=native.threads(), scaling=scaling,
                              q=qg.data_ptr(), q_sh=qg.stride(1), out=out.data_ptr())
    for i, (k, v) in enumerate(pieces):
        args.k[i], args.v[i] = k.data_ptr(), v.data_ptr()
        args.n[i], args.sr[i], args.sh[i] = k.shape[2], k.stride(2), k.stride(1)
    if lib.specache_prefill_attention(args) != 0:
        return None
    return out


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


class CacheLayer:
    """One model layer's K/V (transformers cache_utils style: one class per layer type). The policies
    (engine/kvcache/full.py, specache.py, kivi.py, window.py, exact.py) and the sliding-window layers
    of the model (sliding.py) subclass it; every hook a policy does not need has a default here.
    Buffers are preallocated for `batch` rows of `max_len` tokens.

    A cache holds one such object per model layer, each of its own class (make_cache: the model's
    window layers beside the configured policy's). The ClassVars below are what the rest of the
    engine asks of a policy instead of its name (engine/kvcache/registry.py)."""

    policy: ClassVar[str] = ""  # the --cache name it is registered under (engine.kvcache.registry)
    summary: ClassVar[str] = ""  # a note after its name in --cache's help (registry.describe)
    quantizes: ClassVar[bool] = False  # True: the layer moves a quantization boundary on commits (boundaries/after_step)
    fetches: ClassVar[bool] = False  # True: CacheConfig.k exact positions are fetched per step (k matters)
    verifies: ClassVar[bool] = False  # True: decoded by drafting and one exact verification pass per cycle (exact)
    guided: ClassVar[bool] = False  # True: a low-bit guide / residual window / sinks (the planner sizes them)
    # the planner (engine.plan.planner.plan_columns): plan_column, whether `specache plan` gives it a
    # column of its own, sized from the flags above; plan_mode, the column a run of it is sized by
    # (register: its own name unless it names another, as window names kivi's)
    plan_column: ClassVar[bool] = True
    plan_mode: ClassVar[str] = ""
    fixed_settings: ClassVar[dict] = {}  # CacheConfig fields the policy holds at one value (kivi: k = 0)
    own_settings: ClassVar[tuple[str, ...]] = ()  # CacheConfig fields no other policy reads (window: window)
    window: int | None = None  # the model's sliding window of this layer (None: global attention)
    capturable: ClassVar[bool] = False  # True: decodes Step.fixed passes (engine.generate.graphs replays them)

    @classmethod
    def build(cls, shape: ModelShape, config: CacheConfig, batch: int, max_len: int, dtype: torch.dtype,
              device: torch.device, transfer: Transfer, window: int | None = None) -> "CacheLayer":
        """The layer for one model layer (make_cache); window: the model's sliding window there,
        which only a window layer (sliding.py) takes."""
        if window is not None:
            raise ValueError(f"{cls.__name__} does not keep a sliding window")
        return cls(shape, config, batch, max_len, dtype, device, transfer)

    @classmethod
    def speculates(cls, config: CacheConfig) -> bool:
        """True: decode with the two-token speculative step loop (engine.generate.steps)."""
        return False

    def store_key(self) -> dict:
        """The settings besides the model's and the mode that a stored row of this layer depends on
        (the document store's key, engine.generate.prefixes.store_settings; `specache cache ls`)."""
        return {}

    def update(self, k: torch.Tensor, v: torch.Tensor, step: Step) -> None:
        """Store the new tokens' K/V [b, H_kv, T, D] of this pass."""
        raise NotImplementedError

    def attend(self, q: torch.Tensor, scaling: float, step: Step, softcap: float | None = None) -> torch.Tensor:
        """Attention of the new tokens' queries q [b, H, T, D] over the row's past -> [b, T, H, D]
        (softcap: the model's attention-logit softcapping, tanh(s / c) * c before the mask)."""
        raise NotImplementedError

    def boundaries(self, lengths: list[int]) -> list[int]:
        """Each row's quantized prefix for these committed lengths (quantizing layers only)."""
        return [0] * len(lengths)

    def after_step(self, step: Step, bounds: list[int]) -> None:
        """After a commit moved a boundary to `bounds` (boundaries() of every row's committed length):
        quantize what left the exact window (quantizing layers only)."""

    def before_fixed_pass(self, step: Step) -> None:
        """Host bookkeeping before a recorded pass (engine.generate.graphs; what the pass would do on the
        host inside, e.g. the specache layer's store writes of positions about to leave the window)."""

    def join(self) -> None:
        """The end of a recorded pass: nothing of it left on another stream (the specache prefetch)."""

    def copy_row(self, src: int, dst: int, length: int) -> None:
        """Make row dst hold row src's first `length` tokens (a shared document prefix)."""
        raise NotImplementedError

    def export_row(self, row: int, length: int) -> dict[str, torch.Tensor]:
        """Row `row`'s state after `length` tokens (views), for the document store."""
        raise NotImplementedError

    def import_row(self, row: int, length: int, tensors: dict[str, torch.Tensor], check: bool = False) -> None:
        """Make row `row` hold an export_row() of `length` tokens (check: only validate)."""
        import_tensors(self.export_row(row, length), tensors, check, strict=True)

    def device_bytes(self, lengths: torch.Tensor, element_size: int | None = None) -> int:
        """Bytes held on the compute device for rows of these lengths (exact K/V at `element_size` bytes
        per value when given: 2 counts them as the fp16 a GPU holds, whatever this run's dtype)."""
        raise NotImplementedError

    def host_bytes(self, lengths: torch.Tensor) -> int:
        """Bytes held in the exact host store for rows of these lengths."""
        return 0

    def allocated_device_bytes(self) -> int:
        """Bytes of this layer's preallocated device buffers, per row (what the planner budgets)."""
        raise NotImplementedError

    def run_stats(self, layers: list) -> dict:
        """Settings and measured statistics of these layers (all of this class) for --json."""
        return {}


class KVCache(Cache):
    """transformers Cache whose layers are ours; `step` says what the current forward pass does."""

    def __init__(self, layers: list[CacheLayer], shape: ModelShape, config: CacheConfig, batch: int, max_len: int,
                 device: torch.device, transfer: Transfer):
        super().__init__(layers=layers)
        self.transfer = transfer  # the one prefetch worker / stream of this cache (engine.kvcache.transfer)
        self.shape = shape
        self.config = config
        self.batch = batch
        self.max_len = max_len
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)  # committed tokens per row
        self.lengths_host = [0] * batch  # the same on the host: a pass begins and commits without a device sync
        self.step: Step | None = None
        self._bounds: list[int] | None = None  # the layers' quantization boundaries after the last commit
        self._acting = [layer for layer in layers if layer.quantizes]  # layers that act on a commit
        # the layers of the configured policy (the others: the model's sliding-window layers, sliding.py)
        self.policy_layers = [layer for layer in layers if layer.policy == config.mode]
        self.decode_stats: dict = {}  # what a step loop measured (exact mode: gamma, acceptance), for --json
        self.watch = None  # engine.kvcache.watch.GuideWatch of the fetching layers (make_cache), if any

    def begin(self, rows: slice, n_new: int, keep: int | None = None, select: int | None = None,
              prefill: bool = False, exact: bool = False, draft: bool = False, fixed: bool = False) -> Step:
        """Start a forward pass over `rows` feeding n_new tokens each (exact: a verification pass,
        draft: a draft pass; engine/kvcache/exact.py; fixed: Step.fixed)."""
        start = self.lengths[rows].clone()
        starts = self.lengths_host[rows]
        if max(starts) + n_new > self.max_len:
            raise RuntimeError(f"cache overflow: {max(starts) + n_new} > planned {self.max_len} tokens")
        self.step = Step(rows, start, n_new, n_new if keep is None else keep, select, prefill, starts, exact=exact,
                         draft=draft, fixed=fixed)
        return self.step

    def commit(self, kept: torch.Tensor | None = None, draft: bool = False) -> None:
        """Advance the lengths of the step's rows by the kept tokens; let the layers act on it
        (guided layers quantize the groups that left the residual window). Most decode steps
        move no boundary: then the layers are not called (the boundary rule is the same in every
        layer, so one check per step does).

        kept [b]: tokens kept per row instead of step.keep (a verification accepts a different
        number in each row). draft: only advance the lengths, so the next draft token sees this
        one, and leave every boundary where it is: nothing of a draft is ever quantized; rollback()
        then restores the committed lengths."""
        step = self.step
        self.lengths[step.rows] += step.keep if kept is None else kept.to(self.lengths.device)
        added = [step.keep] * len(step.starts) if kept is None else kept.tolist()
        self.lengths_host[step.rows] = [n + a for n, a in zip(step.starts, added)]
        self.step = None
        if draft or not self._acting:
            return
        bounds = self._acting[0].boundaries(self.lengths_host)
        if bounds == self._bounds:
            return
        for layer in self._acting:
            layer.after_step(step, bounds)
        self._bounds = bounds

    def before_fixed_pass(self) -> None:
        """Before replaying the recorded pass begun (begin(..., fixed=True)): each layer's host bookkeeping."""
        for layer in self.layers:
            layer.before_fixed_pass(self.step)

    def join(self) -> None:
        """At the end of a recorded pass: every layer's side-stream work joined into it."""
        for layer in self.layers:
            layer.join()

    def rollback(self, rows: slice, lengths: torch.Tensor) -> None:
        """Forget the draft commits of `rows`: their lengths go back to `lengths` [b] (what they were
        before drafting). Draft K/V past those lengths are garbage no read sees: a verification pass
        overwrites every position a draft wrote (engine/kvcache/exact.py)."""
        self.lengths[rows] = lengths
        self.lengths_host[rows] = lengths.tolist()

    def copy_row(self, src: int, dst: int) -> None:
        """Row dst starts as a copy of row src (prefill a shared prefix once, then copy it)."""
        length = self.lengths_host[src]
        for layer in self.layers:
            layer.copy_row(src, dst, length)
        self.lengths[dst] = length
        self.lengths_host[dst] = length
        self._bounds = None

    def export_row(self, row: int) -> dict[str, torch.Tensor]:
        """Row `row`'s whole state (its length and every layer's tensors, views into the cache):
        what import_row needs to reproduce it exactly in a fresh cache with the same settings."""
        length = int(self.lengths[row])
        out = {"length": self.lengths[row : row + 1]}
        for i, layer in enumerate(self.layers):
            out.update({f"layers.{i}.{name}": t for name, t in layer.export_row(row, length).items()})
        return out

    def import_row(self, row: int, tensors: dict[str, torch.Tensor]) -> None:
        """Set row `row` (of a fresh cache) to an export_row() state. Raises ValueError, before
        changing anything, when the tensors do not fit this cache (other model or settings)."""
        if "length" not in tensors or tensors["length"].numel() != 1:
            raise ValueError("no length")
        length = int(tensors["length"])
        if not 0 < length < self.max_len:
            raise ValueError(f"length {length} does not fit a cache of {self.max_len} tokens")
        names = {n for n in tensors if n.startswith("layers.")}
        per_layer = []
        for i in range(len(self.layers)):
            prefix = f"layers.{i}."
            per_layer.append({n[len(prefix):]: tensors[n] for n in names if n.startswith(prefix)})
        if sum(map(len, per_layer)) != len(names):
            raise ValueError("tensors of layers this model does not have")
        for check in (True, False):
            for layer, own in zip(self.layers, per_layer):
                layer.import_row(row, length, own, check=check)
        self.lengths[row] = length
        self.lengths_host[row] = length
        self._bounds = None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.layers[layer_idx].update(key_states, value_states, self.step)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.lengths.max())

    def device_bytes(self, element_size: int | None = None) -> int:
        return sum(layer.device_bytes(self.lengths, element_size) for layer in self.layers)

    def host_bytes(self) -> int:
        return sum(layer.host_bytes(self.lengths) for layer in self.layers)

    def stats(self) -> dict:
        """Cache statistics for --json: bytes per tier plus whatever the layers measured."""
        stats = {"mode": self.config.mode, "device_bytes": self.device_bytes(),
                 "device_fp16_bytes": self.device_bytes(2), "host_bytes": self.host_bytes(),
                 "full_fp16_bytes": self.full_fp16_bytes()}
        # both in 16-bit terms: an fp32 run (the CPU) holds its exact parts at twice a GPU's bytes
        stats["device_vs_full_fp16"] = round(stats["device_fp16_bytes"] / max(stats["full_fp16_bytes"], 1), 4)
        if self.policy_layers:
            stats.update(self.policy_layers[0].run_stats(self.policy_layers))
        windows = [layer for layer in self.layers if layer.window is not None]
        if windows:
            stats["sliding_window_layers"] = len(windows)
            stats.update(windows[0].run_stats(windows))  # (the window, and the kernel its decode passes take)
        stats.update(self.decode_stats)
        return stats

    def allocated_device_bytes(self) -> int:
        """Bytes of the preallocated device buffers per row (sizes.py; the planner budgets the same),
        exact mode's verification buffers included where it streams the store (CUDA)."""
        return sum(layer.allocated_device_bytes() for layer in self.layers) + self.transfer.verify_bytes_per_row()

    @property
    def capturable(self) -> bool:
        """Whether every layer decodes fixed-shape passes (Step.fixed), which a CUDA graph can replay."""
        return all(layer.capturable for layer in self.layers)

    def close(self) -> None:
        """Release the transfer resources (worker thread, stream); the cache is not used afterwards."""
        self.transfer.close()

    def __enter__(self) -> "KVCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def full_fp16_bytes(self) -> int:
        """What a full 16-bit cache of the same tokens would hold."""
        return int(self.lengths.sum()) * kv_bytes_per_token(self.shape, 2)
