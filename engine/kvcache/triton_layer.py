"""A guided layer's decode pass on CUDA by the fused Triton kernels (engine/kvcache/triton_decode.py), in place
of GuidedLayer.attend_decode's torch steps, where the pass is what the kernels implement: a guide, the CUDA
layout (the residual window in buffers of its own), the speculative prefetch without the corrected set (the
"current" prefetch and the correction pick a set before attending: the torch code does those), no hit-rate
measurement, no hook of the pass overridden by a policy the kernels do not reproduce (fused.hooks_reproduced),
and a guide the watch has not found lost. Off unless ``$SPECACHE_TRITON_DECODE`` is 1 (the kernels have been
checked against the torch code under Triton's interpreter and compiled for sm_80 / sm_90, not yet timed on a
device); a kernel that fails to launch is said once on stderr and the torch code takes over
(guide_triton.launch, family "decode"). DEVICES: where it applies (CUDA; the tests add the CPU, the kernels
then running in the interpreter)."""
from __future__ import annotations

import os

import torch

from engine.kvcache import guide_triton, triton_decode
from engine.kvcache.base import Step
from engine.kvcache.fused import hooks_reproduced
from engine.kvcache.sizes import quant_boundary

DEVICES = {"cuda"}


def triton_applies(layer, q: torch.Tensor) -> bool:
    """Whether the fused Triton decode runs this layer's decode pass (module docstring)."""
    c = layer.config
    return (q.device.type in DEVICES and os.environ.get("SPECACHE_TRITON_DECODE") == "1" and layer.use_guide
            and not layer.res_in_store and not c.measure_hits and c.prefetch == "speculative"
            and not (c.correct and layer.topk) and guide_triton.available("decode")
            and triton_decode.kernels() is not None and hooks_reproduced(type(layer)))


def buffers(layer) -> triton_decode.DecodeBuffers:
    """The layer's buffers as the kernels read them (all rows; the pass picks its own)."""
    g, store = layer.guide, layer.store
    return triton_decode.DecodeBuffers(g.keys, g.values, g.outliers, g.rotation, layer.sink_k, layer.sink_v,
                                       layer.sinks, store.fk, store.fv, layer.fidx, layer.fvalid, layer.res_k,
                                       layer.res_v, layer.qend)


def triton_attend(layer, qg: torch.Tensor, scaling: float, step: Step, softcap: float | None) -> torch.Tensor | None:
    """qg [b, H_kv, G*T, D] -> fp32 [b, H_kv, G*T, D]; with a selecting token the next fetched set chosen and
    its prefetch started, as select_and_prefetch does. None where a kernel failed (the torch code runs)."""
    rows = step.rows
    if layer.topk:
        layer.store.fetched(rows, step.fixed)  # the compute stream waits for the prefetch
    nq = layer.guide.keys.capacity if step.fixed else max(layer.qend_host[rows])
    selects = step.select is not None and layer.topk > 0
    start = step.start.to(torch.long)
    bound = quant_boundary(start + step.keep, layer.residual, layer.group) if selects else None
    done = triton_decode.decode(buffers(layer), triton_decode.DecodePass(
        qg, start, step.n_new, scaling, nq, rows.start, softcap, step.select if selects else None,
        selects and layer.config.select_both, bound))
    if done is None:
        return None
    out, picked = done
    if picked is not None:
        if not step.fixed:  # groups about to leave the window are candidates: into the store first (the host's
            for i, s in enumerate(step.starts):  # copy; a recorded pass had before_fixed_pass do it)
                layer.flush_to_store(rows.start + i, quant_boundary(s + step.keep, layer.residual, layer.group))
        layer.fidx[rows], layer.fvalid[rows] = picked
        layer.store.prefetch(rows, picked[0], step.fixed)
    return out
