"""Every Triton kernel of the engine compiled for the GPUs on this machine, without one: sm_80 and sm_90, at the
launch configurations the engine makes (tests/triton_compile_run.py records them from the engine's own
wrappers and compiles them with engine.backends.triton_code.build, in a process of its own: the interpreter the other
tests run the kernels in replaces parts of triton.language). A kernel that cannot compile for a target fails
here. Skipped only where Triton is not installed (the `gpu` extra)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

RUNNER = Path(__file__).resolve().parent / "triton_compile_run.py"
ARCHS = (80, 90)
# kernels that must keep every value in registers: a spill is local memory traffic on every launch (the guide's
# scores and values kernels spill at head_dim 128 and up: their fp32 tiles; the fused decode replaces them)
SPILL_FREE = ("gather-", "decode-")
# ... but for the fused decode at head_dim 256 (Gemma-3-4B), whose split and select kernels spill a few hundred
# bytes on sm_90 (255 registers): at most this many
HEAD_256_SPILL = 512
NO_DOTS = ("decode-top-", "decode-write-")  # fused-decode kernels without a dot (a sort, a copy)


def run_runner(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # (Triton's default, said so it does not warn)
    return subprocess.run([sys.executable, str(RUNNER), *args], capture_output=True, text=True, env=env, timeout=900)


@pytest.fixture(scope="module")
def built() -> list[dict]:
    """What each compile gave (triton_build.Built as dicts), once per test session."""
    done = run_runner()
    if done.returncode:
        pytest.fail(f"a kernel failed to compile for a GPU target:\n{done.stderr[-4000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def test_every_kernel_compiles_for_sm80_and_sm90(built):
    """Each recorded launch gave a cubin for both targets, and every kernel of the engine is among them."""
    labels = {b["label"] for b in built}
    assert sorted((b["label"], b["arch"]) for b in built) == sorted((x, a) for x in labels for a in ARCHS)
    kinds = {x.split("-")[0] for x in labels}
    assert {"scores", "values", "gather", "decode"} <= kinds, kinds
    assert {x.split("-")[1] for x in labels if x.startswith("decode-")} == {"split", "merge", "select", "top",
                                                                                       "write"}
    assert any("-o0" in x for x in labels) and any("-o4" in x for x in labels)  # outlier channels off and on
    merges = [x for x in labels if x.startswith("decode-merge-")]  # with a rotation (and outliers) and without
    assert any(x.endswith("-o0") for x in merges) and any(not x.endswith("-o0") for x in merges)
    assert any("-1b-" in x for x in labels) and any("-2b-" in x for x in labels)
    assert any(x.endswith("-masked") for x in labels)  # the corrected set's gather, too
    assert all(b["registers"] > 0 for b in built)  # ptxas's report was read


def test_shared_memory_within_the_targets_limit(built):
    """Shared memory per block at most what the target lets one block opt in to (sm_80 163 KB, sm_90 227 KB)."""
    assert {b["arch"]: b["shared_limit"] for b in built} == {80: 163 * 1024, 90: 227 * 1024}
    over = [(b["label"], b["arch"], b["shared"]) for b in built if b["shared"] > b["shared_limit"]]
    assert not over


def test_kernels_that_must_not_spill_do_not(built):
    """No spilled bytes, no stack frame and no .local in the PTX for the kernels listed in SPILL_FREE."""
    checked = [b for b in built if b["label"].startswith(SPILL_FREE)]
    assert checked
    allowed = lambda b: HEAD_256_SPILL if b["label"].startswith("decode-") and "-d256-" in b["label"] else 0  # noqa: E731
    spilled = [(b["label"], b["arch"], b["spill_bytes"], b["stack_bytes"]) for b in checked
               if b["spill_bytes"] > allowed(b) or b["ptx_local"] or (b["stack_bytes"] and not allowed(b))]
    assert not spilled


def test_the_fused_decode_uses_the_tensor_cores(built):
    """Every fused-decode kernel that computes scores (not decode-top's sort of the candidate keys nor decode-write's
    copy of the new K/V) has tensor-core MMA in its PTX: mma.sync on sm_80, mma.sync or wgmma on sm_90."""
    fused = [b for b in built if b["label"].startswith("decode-") and not b["label"].startswith(NO_DOTS)]
    assert len({b["label"] for b in fused}) >= 6
    assert all(b["mma"] for b in fused if b["arch"] == 80)
    assert all(b["mma"] or b["wgmma"] for b in fused if b["arch"] == 90)


def test_a_kernel_that_cannot_compile_fails():
    """The compile helper raises on a kernel no target accepts (so the fixture above fails the tests)."""
    done = run_runner("--broken")
    assert done.returncode != 0
    assert "power of 2" in done.stderr
