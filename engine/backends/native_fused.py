"""The native CPU backend's fused decode of a guided layer (engine.kvcache.fused says when it applies): the
argument block of engine/native/guide_kernels.c's specache_decode_attention, its buffers' pointers fixed at
construction and the per-pass fields filled by each call."""
from __future__ import annotations

import ctypes

import torch

from engine import native

# the host store's element types the native call reads (decode_args.h: STORE_F32, STORE_BF16; an fp16 store is
# read by the torch path)
STORE_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


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

    def __call__(self, qg: torch.Tensor, scaling: float, step, softcap: float | None = None) -> torch.Tensor:
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
