"""The KV cache handed to transformers: a list of per-layer objects, one Step shared by all.

transformers calls `cache.update(key_states, value_states, layer_idx)` from each attention
module; our registered attention function (engine.model.attention) then calls
`cache.layers[layer_idx].attend(query, scaling, cache.step)`. Rows of a batch may have
different lengths: each row's committed length lives in `cache.lengths`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
from transformers.cache_utils import Cache

from engine.backends.host_pages import MappedFile
from engine.backends.kernels import describe
from engine.config import CacheConfig
from engine.kvcache.passes import (  # noqa: F401  (part of this module's API: the layers import them here)
    ModelShape,
    Step,
    additive_mask,
    bf16_prefill_attention,
    causal_mask,
    flash_attention,
    grouped_query,
    import_tensors,
    masked_attention,
    merge_attention,
    native_prefill_attention,
    sdpa,
    sliding_windows,
    soft_cap,
    split_attention_applies,
    split_prefill_attention,
    ungroup_output,
    write_rows,
)
from engine.kvcache.sizes import PlanTerms, Sizing, kv_bytes_per_token
from engine.kvcache.transfer import Transfer


class CacheLayer(ABC):
    """One model layer's K/V (transformers cache_utils style: an abstract class, one subclass per layer
    type; a subclass that leaves an @abstractmethod undefined cannot be registered or built). The policies
    (engine/kvcache/policies/full.py, specache.py, kivi.py, window.py, exact.py) and the sliding-window layers
    of the model (sliding.py) subclass it; every hook a policy does not need has a default here.
    Buffers are preallocated for `batch` rows of `max_len` tokens.

    A cache holds one such object per model layer, each of its own class (make_cache: the model's
    window layers beside the configured policy's). The ClassVars below are what the rest of the
    engine asks of a policy instead of its name (engine/kvcache/registry.py)."""

    policy: ClassVar[str] = ""  # the --cache name it is registered under (engine.kvcache.registry)
    listed: ClassVar[int]  # its place in --cache's list (a policy's own; registry.listed)
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
    # kernels a steady decode step launches on CUDA by the torch code: (per layer, outside the layers), as
    # counted through the CPU's stand-in (tests/test_cost_model.py); the planner's (engine/plan/step_costs.py).
    # verify_launches: a verification pass's (the policies that verify)
    decode_launches: ClassVar[tuple[int, int]] = (0, 0)
    verify_launches: ClassVar[tuple[int, int]] = (0, 0)

    @classmethod
    def build(cls, shape: ModelShape, config: CacheConfig, batch: int, max_len: int, dtype: torch.dtype,
              device: torch.device, transfer: Transfer, window: int | None = None) -> "CacheLayer":
        """The layer for one model layer (make_cache); window: the model's sliding window there,
        which only a window layer (sliding.py) takes."""
        if window is not None:
            raise ValueError(f"{cls.__name__} does not keep a sliding window")
        return cls(shape, config, batch, max_len, dtype, device, transfer)

    @classmethod
    def plan_sizing(cls, terms: PlanTerms) -> Sizing:
        """The policy's memory rule for `specache plan` (engine.kvcache.sizes: PlanTerms in, Sizing out);
        a policy with a plan column must define it (registry.register checks)."""
        raise NotImplementedError(f"{cls.__name__} has no plan_sizing")

    @classmethod
    def speculates(cls, config: CacheConfig) -> bool:
        """True: decode with the two-token speculative step loop (engine.generate.steps)."""
        return False

    @classmethod
    def step_launches(cls, config: CacheConfig) -> tuple[int, int]:
        """(per layer, outside the layers) kernels of a steady decode step under `config` (decode_launches)."""
        return cls.decode_launches

    def store_key(self) -> dict:
        """The settings besides the model's and the mode that a stored row of this layer depends on
        (the document store's key, engine.generate.prefixes.store_settings; `specache cache ls`)."""
        return {}

    @abstractmethod
    def update(self, k: torch.Tensor, v: torch.Tensor, step: Step) -> None:
        """Store the new tokens' K/V [b, H_kv, T, D] of this pass."""

    @abstractmethod
    def attend(self, q: torch.Tensor, scaling: float, step: Step, softcap: float | None = None) -> torch.Tensor:
        """Attention of the new tokens' queries q [b, H, T, D] over the row's past -> [b, T, H, D]
        (softcap: the model's attention-logit softcapping, tanh(s / c) * c before the mask)."""

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

    @abstractmethod
    def copy_row(self, src: int, dst: int, length: int) -> None:
        """Make row dst hold row src's first `length` tokens (a shared document prefix)."""

    @abstractmethod
    def export_row(self, row: int, length: int) -> dict[str, torch.Tensor]:
        """Row `row`'s state after `length` tokens (views), for the document store."""

    def import_row(self, row: int, length: int, tensors: dict[str, torch.Tensor], check: bool = False,
                   pages: MappedFile | None = None) -> None:
        """Make row `row` hold an export_row() of `length` tokens (check: only validate; pages: the mapped store
        entry the tensors are views of, which a layer with a host store maps its rows from: GuidedRows)."""
        import_tensors(self.export_row(row, length), tensors, check, strict=True)

    @abstractmethod
    def device_bytes(self, lengths: torch.Tensor, element_size: int | None = None) -> int:
        """Bytes held on the compute device for rows of these lengths (exact K/V at `element_size` bytes
        per value when given: 2 counts them as the fp16 a GPU holds, whatever this run's dtype)."""

    def host_bytes(self, lengths: torch.Tensor) -> int:
        """Bytes held in the exact host store for rows of these lengths."""
        return 0

    @abstractmethod
    def allocated_device_bytes(self) -> int:
        """Bytes of this layer's preallocated device buffers, per row (what the planner budgets)."""

    def run_stats(self, layers: list) -> dict:
        """Settings and measured statistics of these layers (all of this class) for --json."""
        return {}


class KVCache(Cache):
    """transformers Cache whose layers are ours; `step` says what the current forward pass does."""

    def __init__(self, layers: list[CacheLayer], shape: ModelShape, config: CacheConfig, batch: int, max_len: int,
                 device: torch.device, transfer: Transfer, policy: type[CacheLayer]):
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
        self.policy = policy  # the class of the run's policy (engine.kvcache.registry)
        # the layers of the configured policy (the others: the model's sliding-window layers, sliding.py)
        self.policy_layers = [layer for layer in layers if type(layer) is policy]
        self.decode_stats: dict = {}  # what a step loop measured (exact mode: gamma, acceptance), for --json
        self.watch = None  # engine.kvcache.watch.GuideWatch of the fetching layers (make_cache), if any

    def begin(self, rows: slice, n_new: int, keep: int | None = None, select: int | None = None,
              prefill: bool = False, exact: bool = False, draft: bool = False, fixed: bool = False) -> Step:
        """Start a forward pass over `rows` feeding n_new tokens each (exact: a verification pass,
        draft: a draft pass; engine/kvcache/policies/exact.py; fixed: Step.fixed)."""
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
        overwrites every position a draft wrote (engine/kvcache/policies/exact.py)."""
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

    def import_row(self, row: int, tensors: dict[str, torch.Tensor], pages: MappedFile | None = None) -> None:
        """Set row `row` (of a fresh cache) to an export_row() state. Raises ValueError, before
        changing anything, when the tensors do not fit this cache (other model or settings). pages: the
        mapped store entry the tensors are views of (engine.backends.host_pages.MappedFile), or None."""
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
                layer.import_row(row, length, own, check=check, pages=pages)
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
        if self.transfer.placed.nbytes:  # a stored document's exact rows mapped, not read in (HostStore.place_row)
            stats["host_mapped_bytes"] = self.transfer.placed.nbytes
            stats["host_mapped_resident_bytes"] = self.transfer.placed.resident()
        stats["backend"] = describe(self.lengths.device)
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
        """Release the transfer resources (worker thread, stream) and the watch's host thread; the cache is
        not used afterwards."""
        if self.watch is not None:
            self.watch.close()
        self.transfer.close()

    def __enter__(self) -> "KVCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def full_fp16_bytes(self) -> int:
        """What a full 16-bit cache of the same tokens would hold."""
        return int(self.lengths.sum()) * kv_bytes_per_token(self.shape, 2)
