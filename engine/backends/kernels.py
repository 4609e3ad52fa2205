"""The device kernels' contract: one `Kernels` class whose methods are the engine's hot spots, implemented
by a backend module each, the backend chosen once per device type from one declared table.

Every hook takes torch tensors and returns the hook's result, or None (False for an in-place hook) where
this backend does not take the call (no library, a layout or dtype it lacks): the caller then runs its
torch code, which is the reference of that hook and lives beside the caller (engine.kvcache.quant's
_torch_scores, a layer's attend_torch, a module's forward). `Kernels` itself is that reference backend:
every hook declines. The hooks:

  guide_scores(q, keys, n)                   q @ K^T over a guide's packed 1/2-bit keys    engine.kvcache.quant
  guide_values(p, values, n)                 p @ V over its packed values                  engine.kvcache.quant
  sliding_attention(layer, qg, scaling, step, softcap)  a window layer's decode pass       engine.kvcache.sliding
  prefill_attention(qg, pieces, ...)         a bf16 prefill chunk's causal attention       engine.kvcache.passes
  rms_norm(x, scale, eps, res)               a decode step's RMSNorm (+ residual)          engine.model.decode_norms
  norm_rope(parts, head_dim, eps, cos, sin)  a step's head norms and rope, in place        engine.model.decode_norms
  linear(x, weight, bias)                    a step's few rows @ an fp32 weight            engine.model.held_weights
  bind_linear(held, bias, bits)              a bound call for a held block weight's rows   engine.model.decode_kernels
  bind_packed(data, fmt, shape)              a packed weight's bound exact call            engine.model.held_weights
  unpack_rows(data, fmt, n0, n1, k, dtype)   a held block weight's rows rebuilt            engine.model.block_formats
  pack_weight(weight, record_bytes)          an fp32 weight repacked as exact blocks       engine.model.held_weights
  fused_decode(layer)                        a guided layer's decode pass as one call      engine.kvcache.fused

Besides the hooks: `runs(hook)` says whether a hook's code runs here now (the backend available, the hook its
own, its kernels not switched off by a failed launch); `fused_takes(layer, q, step)` whether its fused call
takes this pass of this layer (the cache modes, layouts and dtypes its code implements: anything else runs
the torch pass); `gather_applies` / `gather_rows` the device-side gather of exact rows from a pinned, mapped
host store (engine.kvcache.transfer, on an asynchronous device only: not named in `describe`); `write_recent`
a decode pass's new K/V written into a guided layer's residual window and sinks in one call where the fused
decode takes the layer (engine.kvcache.guided's update; not named in `describe`).

A backend is one module of this package whose Kernels subclass is registered (`@register`) with its
`name`, the device types it serves (`devices`) and its `rank` among them; `backends()` is the table they make
(device type -> the backends in rank order), found by importing the package's modules, so a new backend is
one new file. `backend_for(device)` chooses the first available one once per device type and process, and
`describe` names the choice (the cache's stats: the timing line and --json).
"""
from __future__ import annotations

import functools
import importlib
import os
import pkgutil
from typing import ClassVar

import torch

HOOKS = ("guide_scores", "guide_values", "sliding_attention", "prefill_attention", "rms_norm", "norm_rope", "linear",
         "bind_linear", "bind_packed", "unpack_rows", "pack_weight", "fused_decode")
PACKAGE = "engine.backends"
REGISTERED: dict[str, type] = {}  # name -> the registered Kernels subclass
_CHOSEN: dict[str, "Kernels"] = {}
GRAPHS_OVERRIDE = "SPECACHE_CUDA_GRAPHS"  # 1 / 0: decode passes replayed as graphs, or not, whatever the table says


class Kernels:
    """The reference backend, and the contract every backend implements (see the module's docstring)."""

    name: ClassVar[str] = "torch"
    devices: ClassVar[tuple[str, ...]] = ()  # device types it serves (the reference serves every one)
    rank: ClassVar[int] = 0  # its place among a device's backends: lowest first
    sdpa_backends: ClassVar[list | None] = None  # torch's SDPA backends its devices' attention may use (None: any)
    graph_replay: ClassVar[bool | None] = None  # its devices' decode passes replayed as graphs by default (None: not said)

    @classmethod
    def available(cls) -> bool:
        """Whether this backend runs in this process (its library built, its compiler present)."""
        return True

    def guide_scores(self, q, keys, n):
        return None

    def guide_values(self, p, values, n):
        return None

    def sliding_attention(self, layer, qg, scaling, step, softcap):
        return None

    def prefill_attention(self, qg, pieces, scaling, start, first, window):
        return None

    def rms_norm(self, x, scale, eps, res):
        return None

    def norm_rope(self, parts, head_dim, eps, cos, sin):
        return False

    def linear(self, x, weight, bias):
        return None

    def bind_linear(self, held, bias, bits):
        return None

    def bind_packed(self, data, fmt, shape):
        return None

    def unpack_rows(self, data, fmt, n0, n1, k, dtype):
        return None

    def pack_weight(self, weight, record_bytes):
        return None

    def fused_decode(self, layer):
        return None

    def fused_takes(self, layer, q, step) -> bool:
        """Whether fused_decode's call computes this decode pass of `layer` (q: its queries, step: the pass)."""
        return False

    def write_recent(self, layer, k, v, step) -> bool:
        """A decode pass's new K/V [b, H_kv, T, D] into `layer`'s residual window and sinks (its own buffers: the
        CUDA layout), every index read on the device. -> False where it does not run (the layer writes them)."""
        return False

    def gather_applies(self, src_k, src_v, idx, dst_k, dst_v, only=None) -> bool:
        """Whether gather_rows runs on these tensors."""
        return False

    def gather_rows(self, src_k, src_v, idx, dst_k, dst_v, only=None) -> bool:
        """dst[b, h, j] = src[b, h, idx[b, h, j]] for K and V on the device (only: those slots alone). -> False
        where it does not run (the caller gathers otherwise)."""
        return False

    def runs(self, hook: str) -> bool:
        """Whether this backend's own code runs `hook` here now."""
        return self.available() and getattr(type(self), hook) is not getattr(Kernels, hook)

    def implements(self) -> dict[str, str]:
        """hook -> the backend whose code runs it: this one's where it defines the hook, else "torch" (found once
        per class: the decode passes ask it per layer)."""
        return hooks_of(type(self))


@functools.cache
def hooks_of(cls: type) -> dict[str, str]:
    """Kernels.implements of a backend class."""
    return {hook: cls.name if getattr(cls, hook) is not getattr(Kernels, hook) else Kernels.name for hook in HOOKS}


REFERENCE = Kernels()


def register(cls: type) -> type:
    """Class decorator: a backend module's Kernels subclass, by its name."""
    if not issubclass(cls, Kernels) or cls.name in REGISTERED:
        raise ValueError(f"backend {cls.name!r}: not a Kernels subclass, or registered twice")
    REGISTERED[cls.name] = cls
    return cls


def backends() -> dict[str, list[type]]:
    """The table: device type -> its backends in rank order, from every module of this package."""
    for module in pkgutil.iter_modules(importlib.import_module(PACKAGE).__path__):
        importlib.import_module(f"{PACKAGE}.{module.name}")
    table: dict[str, list[type]] = {}
    for cls in sorted(REGISTERED.values(), key=lambda c: (c.rank, c.name)):
        for kind in cls.devices:
            table.setdefault(kind, []).append(cls)
    return table


def backend_for(device: torch.device | str) -> Kernels:
    """The device type's backend (the first available one of backends(), chosen once), else the reference."""
    kind = torch.device(device).type
    if kind not in _CHOSEN:
        chosen = next((cls for cls in backends().get(kind, ()) if cls.available()), None)
        if chosen is None:
            return REFERENCE  # (not kept: a library may still come, as a test's stand-in does)
        _CHOSEN[kind] = chosen()
    return _CHOSEN[kind]


def forget() -> None:
    """Choose again on the next backend_for (tests that switch a library off)."""
    _CHOSEN.clear()
    sdpa_backends.cache_clear()
    graph_default.cache_clear()


@functools.cache
def sdpa_backends(kind: str) -> list | None:
    """The SDPA backends torch may use on a device type, in its order of preference: the first of the type's
    backends in the table that declares some (its own library here or not: torch computes the attention), else
    None (torch's own choice)."""
    return next((cls.sdpa_backends for cls in backends().get(kind, ()) if cls.sdpa_backends is not None), None)


@functools.cache
def graph_default(kind: str) -> bool:
    """Whether a device type's decode passes are replayed as graphs by default: the first declaration
    (Kernels.graph_replay) of the type's backends in the table (its own library here or not: the device's
    streams record the graphs), else not."""
    return next((cls.graph_replay for cls in backends().get(kind, ()) if cls.graph_replay is not None), False)


def replays_graphs(kind: str) -> bool:
    """Whether decode passes on a device type are replayed as graphs: $SPECACHE_CUDA_GRAPHS where set (1 on, 0
    off: the override), else the table's default (graph_default). engine.generate.graphs asks it, with the
    streams' capability (Streams.records_graphs) and the cache's (KVCache.capturable)."""
    asked = os.environ.get(GRAPHS_OVERRIDE)
    return asked == "1" if asked is not None else graph_default(kind)


def describe(device: torch.device | str) -> dict:
    """The device's backend and the hooks its torch reference runs instead (the cache's stats: --json)."""
    backend = backend_for(device)
    name = backend.name if backend.available() else Kernels.name
    return {"name": name, "reference_hooks": [hook for hook, by in backend.implements().items()
                                              if by == Kernels.name or name == Kernels.name]}
