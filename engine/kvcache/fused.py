"""A decode pass of one guided layer in one native call (CPU): engine/native/guide_kernels.c
``specache_decode_attention`` does what ``GuidedLayer.attend_decode`` and ``select_and_prefetch``
do with ~30 torch ops (guide scores, exact scores at sinks / fetched / residual positions, one
softmax, exact + guide values, top-k selection and the gather of the next fetched set), without
the intermediate tensors; with a guide rotation it rotates the queries in and the guide's value
output back (DecodeArgs.rot), and in the corrected speculative mode (DecodeArgs.correct) the output
token picks its own set first, as prefetch "current" does, counting how much of it the prefetch held
(DecodeArgs.reuse -> SpecacheLayer.count_reuse). Same semantics; results agree to float rounding (the top-k may order
ties differently). The torch path stays the reference, and runs on CUDA, without the native
library, for window mode, and when the prefetch hit rate is measured (GuidedLayer.attend_decode decides). A
softcapped layer (Gemma 2) takes the native call too: it caps every score, exact or the guide's, before the
softmax as the torch path does (DecodeArgs.softcap). A guide's outlier key channels
(engine/kvcache/outliers.py) add their score term in the native call too (DecodeArgs.O).
"""
from __future__ import annotations

import ctypes

import torch

from engine import native
from engine.kvcache.base import Step


# The hooks of a guided decode pass whose code the native call reproduces, and the classes whose
# versions of them it reproduces (reproduces(): GuidedLayer and the policies built in). A layer whose
# class takes any of these from another class (a new policy that overrides one) runs the torch code,
# its own hooks included, never the native call in their place.
FUSED_HOOKS = ("attend_decode", "select_current", "correct_fetched", "select_and_prefetch", "own_attention",
               "top_positions", "fetch_top", "count_reuse")
REPRODUCED: set[type] = set()
# the host store's element types the native call reads (decode_args.h: STORE_F32, STORE_BF16; an fp16 store is
# read by the torch path)
STORE_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def reproduces(cls: type) -> type:
    """Class decorator: the native call reproduces this class's versions of FUSED_HOOKS."""
    REPRODUCED.add(cls)
    return cls


def hooks_reproduced(cls: type) -> bool:
    """Whether every FUSED_HOOKS method of cls comes from a class the native call reproduces."""
    for name in FUSED_HOOKS:
        owner = next((c for c in cls.__mro__ if name in c.__dict__), None)
        if owner is not None and owner not in REPRODUCED:
            return False
    return True


def fused_applies(layer, q: torch.Tensor) -> bool:
    """True when the fused native call can run this layer's decode pass: a guide, fp32 on the CPU (the exact
    store fp32 or bf16), the native library, no hit-rate measurement, and no hook of the pass overridden by a
    class whose code the call does not reproduce (hooks_reproduced)."""
    return (layer.use_guide and q.device.type == "cpu" and q.dtype == torch.float32
            and layer.res_k.dtype == torch.float32 and layer.store.k.dtype in STORE_DTYPES
            and not layer.config.measure_hits and native.lib() is not None
            and hooks_reproduced(type(layer)))


class FusedDecode:
    """The native argument block of one GuidedLayer: buffer pointers fixed at construction, the
    per-pass fields (rows, queries, output) filled by ``__call__``."""

    def __init__(self, layer):
        self.layer = layer
        a = native.DecodeArgs()
        guide, store = layer.guide, layer.store
        a.H, a.G, a.D = layer.shape.kv_heads, layer.shape.group, layer.shape.head_dim
        a.S, a.K = layer.sinks, layer.topk
        a.bits, a.g, a.gv = guide.bits, guide.keys.group, guide.values.group
        a.residual, a.nthreads = layer.residual, native.threads()
        a.select_both = int(layer.config.select_both)
        a.current = int(layer.config.prefetch == "current")
        a.correct = int(layer.config.prefetch == "speculative" and layer.config.correct and layer.topk > 0)
        a.qend = layer.qend.data_ptr()
        self._pair(a, ("sink_k", "sink_v", "sk"), layer.sink_k, layer.sink_v)
        self._pair(a, ("res_k", "res_v", "rk"), layer.res_k, layer.res_v)  # the store itself where res_in_store
        a.res_at_qend = int(layer.res_in_store)
        self._pair(a, ("fk", "fv", "fk"), store.fk, store.fv)
        self._pair(a, ("store_k", "store_v", "st"), store.k, store.v)
        a.store_dtype = STORE_DTYPES[store.k.dtype]  # a 16-bit store's rows are widened as they are read
        a.fidx, a.fvalid = layer.fidx.data_ptr(), layer.fvalid.data_ptr()
        a.fi_sb, a.fi_sh = layer.fidx.stride(0), layer.fidx.stride(1)
        keys, values = guide.keys, guide.values
        a.kc, a.kc_sb, a.kc_sh = keys.codes.data_ptr(), keys.codes.stride(0), keys.codes.stride(1)
        a.ks, a.kz, a.ks_sb, a.ks_sh = keys.scale.data_ptr(), keys.zero.data_ptr(), keys.scale.stride(0), keys.scale.stride(1)
        a.vc, a.vc_sb, a.vc_sh = values.codes.data_ptr(), values.codes.stride(0), values.codes.stride(1)
        a.vs, a.vz = values.scale.data_ptr(), values.zero.data_ptr()
        a.vs_sb, a.vs_sh = values.scale.stride(0), values.scale.stride(1)
        a.rot = guide.rotation.data_ptr() if guide.rotation is not None else None  # the Guide keeps it alive
        side = guide.outliers  # engine/kvcache/outliers.py: its score term, or O = 0
        if side is not None:
            a.O, a.oidx, a.oi_sb, a.oi_sh = side.count, side.idx.data_ptr(), side.idx.stride(0), side.idx.stride(1)
            a.oc, a.oc_sb, a.oc_sh = side.codes.data_ptr(), side.codes.stride(0), side.codes.stride(1)
            a.os, a.oz, a.os_sb, a.os_sh = side.scale.data_ptr(), side.zero.data_ptr(), side.scale.stride(0), \
                side.scale.stride(1)
        for t in (layer.fidx, layer.fvalid, store.fk, store.fv, store.k, store.v, layer.sink_k, layer.res_k,
                  keys.codes, keys.scale, values.codes, values.scale, *(side.tensors() if side is not None else ())):
            if not t.is_contiguous():
                raise ValueError("fused decode needs contiguous cache buffers")
        if layer.fidx.dtype != torch.long or layer.fvalid.dtype != torch.bool:
            raise ValueError("fused decode needs int64 fidx and bool fvalid")
        self.args = a

    @staticmethod
    def _pair(a, names: tuple[str, str, str], k: torch.Tensor, v: torch.Tensor) -> None:
        """Pointers of a K/V buffer pair [rows, H, L, D] (same strides) and their row/head strides."""
        if k.stride() != v.stride():
            raise ValueError("fused decode needs K and V buffers of the same layout")
        setattr(a, names[0], k.data_ptr())
        setattr(a, names[1], v.data_ptr())
        setattr(a, names[2] + "_sb", k.stride(0))
        setattr(a, names[2] + "_sh", k.stride(1))

    def __call__(self, qg: torch.Tensor, scaling: float, step: Step, softcap: float | None = None) -> torch.Tensor:
        """qg [b, H_kv, G*T, D] fp32 -> out [b, H_kv, G*T, D]; updates the fetched set when step.select
        (softcap: the model's attention-logit softcapping, or None)."""
        if softcap is not None and not softcap > 0:
            raise ValueError(f"a softcap must be positive, got {softcap}")
        a = self.args
        b, _, nq, d = qg.shape
        if qg.stride(3) != 1 or qg.stride(2) != d:
            qg = qg.contiguous()
        start = step.start if step.start.dtype == torch.long and step.start.is_contiguous() else \
            step.start.to(torch.long).contiguous()
        out = torch.empty(b, a.H, nq, d, dtype=torch.float32)
        a.B, a.T, a.row0, a.keep = b, step.n_new, step.rows.start, step.keep
        rot = self.layer.guide.rotation  # an auto rotation is decided at the guide's first add
        a.rot = rot.data_ptr() if rot is not None else None
        a.select = -1 if step.select is None else step.select
        a.scaling = scaling
        a.softcap = softcap or 0.0
        a.q, a.q_sb, a.q_sh = qg.data_ptr(), qg.stride(0), qg.stride(1)
        a.start, a.out = start.data_ptr(), out.data_ptr()
        reuse = torch.zeros(b, a.H, 2, dtype=torch.long) if a.correct and step.n_new > 1 else None
        a.reuse = reuse.data_ptr() if reuse is not None else None
        if step.select is not None:  # where the residual window has buffers of its own, the positions leaving it
            self.layer.before_fixed_pass(step)  # are candidates of the next set: into the store first (as the torch
        rc = native.lib().specache_decode_attention(ctypes.byref(a))  # path's select_and_prefetch)
        if rc != 0:
            raise RuntimeError(f"native decode attention failed (rc {rc})")
        if reuse is not None:
            hit, total = reuse.sum(dim=(0, 1)).tolist()
            self.layer.count_reuse(hit, total)
        return out
