"""The CUDA backend: the Triton kernels of engine/backends/triton_code behind the Kernels contract, for the
device type cuda (the `gpu` extra; CUDA builds of torch bring Triton). Its hooks:

  guide_scores / guide_values   the guide's math in one launch each (engine/backends/triton_guide.py)
  fused_decode                  a guided layer's decode pass by the fused kernels (engine/backends/triton_decode.py)
  write_recent                  a pass's new K/V into the residual window and sinks, one launch (where fused_decode
                                takes the layer)
  gather_applies / gather_rows  the fetched set's rows read in place from the pinned, mapped host store

A family of kernels whose launch fails is said once on stderr and not used again (triton_guide.launch); `runs`
then says False for its hooks and the torch reference, or the transfer's worker thread, takes over.

The fused decode takes a pass (fused_takes) where it is what the kernels implement: the CUDA layout (the
residual window in buffers of its own), the speculative prefetch without the corrected set (the "current"
prefetch and the correction pick a set before attending: the torch code does those); the caller
(engine.kvcache.fused.fused_applies) has already required a guide, no hit-rate measurement, no hook of the pass
overridden by a policy the kernels do not reproduce, and a guide the watch has not found lost. Off unless
``$SPECACHE_TRITON_DECODE`` is 1 (the kernels have been checked against the torch code under Triton's
interpreter and compiled for sm_80 / sm_90, not yet timed on a device)."""
from __future__ import annotations

import os

import torch
from torch.nn.attention import SDPBackend

from engine.backends import triton_decode, triton_guide
from engine.backends.kernels import Kernels, register

# the kernel family of each hook (triton_guide.FAILED: a family whose launch failed is not used again)
FAMILIES = {"guide_scores": "guide", "guide_values": "guide", "fused_decode": "decode", "gather_applies": "gather",
            "gather_rows": "gather"}


@register
class TritonCUDA(Kernels):
    """The Triton kernels (module docstring)."""

    name = "triton"
    devices = ("cuda",)
    # not cuDNN's, which builds a plan for every new key length (2.2 ms of CPU per call measured on an H200, 69 ms
    # of a 101 ms decode step: the length grows by one each step); flash takes unmasked calls, the
    # memory-efficient kernel masked ones
    sdpa_backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    graph_replay = True  # a decode step of ~1,500 small kernels is bound by their launches (engine.generate.graphs)

    @classmethod
    def available(cls) -> bool:
        return triton_guide.kernels() is not None

    def runs(self, hook: str) -> bool:
        return super().runs(hook) and triton_guide.available(FAMILIES.get(hook, "guide"))

    def guide_scores(self, q, keys, n):
        return triton_guide.guide_scores(q, keys.codes, keys.scale, keys.zero, n, keys.group, keys.bits)

    def guide_values(self, p, values, n):
        return triton_guide.guide_weighted_values(p, values.codes, values.scale, values.zero, n, values.group,
                                                  values.bits)

    def gather_applies(self, src_k, src_v, idx, dst_k, dst_v, only=None) -> bool:
        return triton_guide.gather_applies(src_k, src_v, idx, dst_k, dst_v, only)

    def gather_rows(self, src_k, src_v, idx, dst_k, dst_v, only=None) -> bool:
        return triton_guide.gather_rows(src_k, src_v, idx, dst_k, dst_v, only)

    def fused_takes(self, layer, q, step) -> bool:
        c = layer.config
        return (os.environ.get("SPECACHE_TRITON_DECODE") == "1" and not layer.res_in_store
                and c.prefetch == "speculative" and not (c.correct and layer.topk)
                and triton_decode.kernels() is not None)

    def write_recent(self, layer, k, v, step) -> bool:
        """Where the fused decode takes the layer's passes (fused_takes, the layer's store written as positions
        leave the window: not on update), one launch (triton_decode.write_recent)."""
        if step.prefill or layer.store_on_update or not (self.runs("fused_decode") and self.fused_takes(layer, k, step)):
            return False
        rows = step.rows
        into = (layer.res_k[rows], layer.res_v[rows], layer.sink_k[rows], layer.sink_v[rows])
        return triton_decode.write_recent(k, v, step.start, layer.qend[rows], into, layer.sinks)

    def fused_decode(self, layer):
        return TritonDecode(layer)


class TritonDecode:
    """One guided layer's decode passes by the fused kernels: (qg, scaling, step, softcap) -> the output, or None
    where a kernel failed to launch (the caller's torch pass runs)."""

    def __init__(self, layer):
        self.layer = layer

    def buffers(self) -> triton_decode.DecodeBuffers:
        """The layer's buffers as the kernels read them (all rows; the pass picks its own; read again each pass:
        an auto rotation is decided at the guide's first add)."""
        layer = self.layer
        g, store = layer.guide, layer.store
        return triton_decode.DecodeBuffers(g.keys, g.values, g.outliers, g.rotation, layer.sink_k, layer.sink_v,
                                           layer.sinks, store.fk, store.fv, layer.fidx, layer.fvalid, layer.res_k,
                                           layer.res_v, layer.qend, layer.residual)

    def __call__(self, qg: torch.Tensor, scaling: float, step, softcap: float | None = None) -> torch.Tensor | None:
        """qg [b, H_kv, G*T, D] -> fp32 [b, H_kv, G*T, D]; with a selecting token the next fetched set chosen and
        its prefetch started, as select_and_prefetch does."""
        layer, rows = self.layer, step.rows
        if layer.topk:
            layer.store.fetched(rows, step.fixed)  # the compute stream waits for the prefetch
        nq = layer.guide.keys.capacity if step.fixed else max(layer.qend_host[rows])
        selects = step.select is not None and layer.topk > 0
        done = triton_decode.decode(self.buffers(), triton_decode.DecodePass(
            qg, step.start, step.n_new, scaling, nq, rows.start, softcap, step.select if selects else None,
            selects and layer.config.select_both, step.keep))
        if done is None:
            return None
        out, picked = done
        if picked is not None:
            if not step.fixed:  # groups about to leave the window are candidates: into the store first (the host's
                for i, upto in enumerate(layer.boundaries([s + step.keep for s in step.starts])):  # copy; a
                    layer.flush_to_store(rows.start + i, upto)  # recorded pass had before_fixed_pass do it)
            layer.store.prefetch(rows, picked[0], step.fixed)
        return out
