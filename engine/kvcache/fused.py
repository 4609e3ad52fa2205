"""When a decode pass of one guided layer is one native call (CPU; the call's argument block is
engine/backends/native_fused.py's FusedDecode): engine/native/guide_kernels.c
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

import torch

from engine.backends.kernels import backend_for


# The hooks of a guided decode pass whose code the native call reproduces, and the classes whose
# versions of them it reproduces (reproduces(): GuidedLayer and the policies built in). A layer whose
# class takes any of these from another class (a new policy that overrides one) runs the torch code,
# its own hooks included, never the native call in their place.
FUSED_HOOKS = ("attend_decode", "select_current", "correct_fetched", "select_and_prefetch", "own_attention",
               "top_positions", "fetch_top", "count_reuse")
REPRODUCED: set[type] = set()


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


def unfused(cls: type) -> dict:
    """{"fused_decode": why the torch code runs} where cls overrides a hook the fused call reproduces (the
    run's stats: --json and the timing line say so), else {}."""
    own = [name for name in FUSED_HOOKS
           if next((c for c in cls.__mro__ if name in c.__dict__), None) not in REPRODUCED | {None}]
    return {"fused_decode": f"torch: {cls.__name__} overrides {', '.join(own)}"} if own else {}


def fused_applies(layer, q: torch.Tensor, step) -> bool:
    """True when the device's backend runs this decode pass of the layer as one call: a guide, no hit-rate
    measurement, no hook of the pass overridden by a class whose code the call does not reproduce
    (hooks_reproduced), and a pass the backend's call takes (Kernels.fused_takes: the native CPU's, fp32 on the
    CPU with an fp32 or bf16 store; the Triton one's, the CUDA layout and the speculative prefetch)."""
    backend = backend_for(q.device)
    return (layer.use_guide and not layer.config.measure_hits and backend.runs("fused_decode")
            and hooks_reproduced(type(layer)) and backend.fused_takes(layer, q, step))


def fused_write(layer, k: torch.Tensor, v: torch.Tensor, step) -> bool:
    """Whether the device's backend wrote a pass's new K/V into the layer's residual window and sinks in one call
    (Kernels.write_recent: the CUDA layout, where its fused decode takes the layer; the layer's writes otherwise)."""
    if layer.res_in_store:
        return False
    writer = layer.__dict__.get("writer")  # (the device's backend asked once per layer: it costs ~0.6 us a call)
    if writer is None:
        writer = layer.writer = backend_for(k.device).write_recent
    return writer(layer, k, v, step)


def fused_decode(layer):
    """The layer's fused call (its device's backend: engine.backends.native_fused.FusedDecode on the CPU,
    engine.backends.triton_cuda.TritonDecode on CUDA)."""
    return backend_for(layer.sink_k.device).fused_decode(layer)
