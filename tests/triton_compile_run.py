"""Compiles every Triton kernel of the engine at the launch configurations the engine makes, for sm_80 and
sm_90, and prints what each compile gave as JSON lines (engine.backends.triton_code.build.Built). Run by
tests/test_triton_compile.py in a process of its own, without TRITON_INTERPRET (the interpreter replaces
parts of triton.language in the process that uses it). The configurations are the shipped model profiles'
shapes (head_dim; query heads per KV head times the two tokens of a speculative step; their guide bits and
group, and both bit widths for the shape the paper runs), launched through the engine's own wrappers on CPU
tensors with the kernels swapped for recorders (triton_build.recording), so the arguments are the engine's."""
from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import DEFAULT_OUTLIERS, RESIDUAL, SINKS  # noqa: E402
from engine.backends import triton_decode, triton_guide  # noqa: E402
from engine.backends.triton_code import build as triton_build  # noqa: E402
from engine.kvcache import quant  # noqa: E402
from engine.kvcache.outliers import OutlierKeys  # noqa: E402
from engine.kvcache.sizes import residual_slots, value_group  # noqa: E402
from engine.plan.profiles import list_models  # noqa: E402

ARCHS = (80, 90)
TOKENS = 2  # a speculative step's new tokens (the CUDA default)
CAPACITY = 512  # the guide's tokens in the launches (a runtime argument: the compile does not depend on it)


def shapes() -> list[tuple[int, int, int, int, int]]:
    """(head_dim, queries per KV head, bits, group, k) of every shipped profile, the Llama-3-8B shape at 1 and 2
    bits, each once."""
    out = set()
    for p in list_models():
        out.add((p.head_dim, p.heads // p.kv_heads * TOKENS, p.default_bits, p.default_group, p.default_k))
        if p.name == "llama-3-8b":
            out.add((p.head_dim, p.heads // p.kv_heads * TOKENS, 3 - p.default_bits, p.default_group, p.default_k))
    return sorted(out)


def guide_launches(d: int, nq: int, bits: int, group: int, k: int) -> list[triton_build.Launch]:
    """The guide kernels' launches (scores, weighted values, the gather of the fetched set and of the corrected
    slots) for one shape, recorded from the wrappers of engine/backends/triton_guide.py."""
    into: list[triton_build.Launch] = []
    tag = f"d{d}-q{nq}-{bits}b-g{group}"
    keys = quant.empty_keys(2, 2, CAPACITY, d, bits, group, "cpu")
    values = quant.empty_values(2, 2, CAPACITY, d, bits, value_group(group, d), "cpu")
    store = torch.zeros(2, 2, CAPACITY, d, dtype=torch.bfloat16)
    fetched = torch.zeros(2, 2, k, d, dtype=torch.bfloat16)
    idx = torch.zeros(2, 2, k, dtype=torch.long)
    with triton_build.recording(triton_guide, (f"scores-{tag}", f"values-{tag}", f"gather-d{d}-k{k}"), into):
        triton_guide.guide_scores(torch.zeros(2, 2, nq, d), keys.codes, keys.scale, keys.zero, CAPACITY, group, bits)
        triton_guide.guide_weighted_values(torch.zeros(2, 2, nq, CAPACITY), values.codes, values.scale, values.zero,
                                           CAPACITY, values.group, bits)
        triton_guide.gather_rows(store, store, idx, fetched, fetched)
        triton_guide.gather_rows(store, store, idx, fetched, fetched, only=torch.zeros(2, 2, k, dtype=torch.bool))
    return into


def decode_buffers(d: int, bits: int, group: int, k: int, outliers: int) -> triton_decode.DecodeBuffers:
    """A guided layer's buffers on the engine's CUDA types (bf16 exact K/V), 2 rows of 2 KV heads; with outlier
    channels also a rotation (the bits' defaults: both on)."""
    exact = lambda n: torch.zeros(2, 2, n, d, dtype=torch.bfloat16)  # noqa: E731
    side = OutlierKeys.empty(2, 2, CAPACITY, outliers, group, "cpu") if outliers else None
    return triton_decode.DecodeBuffers(
        quant.empty_keys(2, 2, CAPACITY, d, bits, group, "cpu"),
        quant.empty_values(2, 2, CAPACITY, d, bits, value_group(group, d), "cpu"), side,
        torch.eye(d) if outliers else None, exact(SINKS),
        exact(SINKS), SINKS, exact(k), exact(k), torch.zeros(2, 2, k, dtype=torch.long),
        torch.zeros(2, 2, k, dtype=torch.bool), exact(residual_slots(RESIDUAL, group, 2)),
        exact(residual_slots(RESIDUAL, group, 2)), torch.full((2,), CAPACITY, dtype=torch.long), RESIDUAL)


def decode_launches(d: int, nq: int, bits: int, group: int, k: int) -> list[triton_build.Launch]:
    """The fused decode's launches (split, merge, select, top, and the new K/V's write) for one shape, with the
    bits' default outlier channels and a rotation and without, recorded from engine/backends/triton_decode.py's
    decode and write_recent."""
    into: list[triton_build.Launch] = []
    for outliers in sorted({0, DEFAULT_OUTLIERS[bits]}):
        tag = f"d{d}-q{nq}-{bits}b-g{group}-o{outliers}"
        labels = (f"decode-split-{tag}", f"decode-merge-{tag}", f"decode-select-{tag}", f"decode-top-{tag}")
        start = torch.full((2,), CAPACITY + 10, dtype=torch.long)
        step = triton_decode.DecodePass(torch.zeros(2, 2, nq, d), start, TOKENS, d ** -0.5, CAPACITY, select=1,
                                        keep=TOKENS)
        buf = decode_buffers(d, bits, group, k, outliers)
        with triton_build.recording(triton_decode, labels + (f"decode-write-{tag}",), into):
            triton_decode.decode(buf, step)
            new = torch.zeros(2, 2, TOKENS, d).transpose(1, 2).contiguous().transpose(1, 2)  # (strided, as in a step)
            triton_decode.write_recent(new, new, start, buf.qend, (buf.res_k, buf.res_v, buf.sink_k, buf.sink_v),
                                       SINKS)
    return into


def launches() -> list[triton_build.Launch]:
    """Every launch of every shape, each distinct specialization once (shapes that differ only in runtime
    arguments compile to the same kernel)."""
    seen: dict[str, triton_build.Launch] = {}
    target = triton_build.GPUTarget("cuda", 90, 32)
    for shape in shapes():
        for launch in guide_launches(*shape) + decode_launches(*shape):
            fn = triton_build.jit_function(launch.kernel)
            _, signature, constexprs, attrs = triton_build.specialization(fn, launch, target)
            if launch.meta.get("MASKED"):
                launch = replace(launch, label=launch.label + "-masked")
            seen.setdefault(f"{fn.__name__}{signature}{constexprs}{attrs}", launch)
    return list(seen.values())


@triton.jit
def broken_kernel(x_ptr, BLOCK: tl.constexpr):
    """A kernel no target can compile at BLOCK 12 (a range whose length is not a power of two): --broken
    compiles it."""
    offs = tl.arange(0, BLOCK)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    x = tl.load(x_ptr + offs)
    tl.store(x_ptr + offs, tl.dot(x, x))


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("run without TRITON_INTERPRET: the interpreter's patches break compiling")
    if sys.argv[1:] == ["--broken"]:
        triton_build.compile_launch(triton_build.Launch("broken", broken_kernel, (torch.zeros(64),), {"BLOCK": 12}), 80)
        return
    for launch in launches():
        for arch in ARCHS:
            print(json.dumps(triton_build.compile_launch(launch, arch).as_dict()), flush=True)


if __name__ == "__main__":
    main()
