"""Every instruction set level this CPU can execute builds the native kernels and passes their tests
against the torch references (the tests marked `kernels`), so that the AVX2 and plain-C code is
compiled and checked on an AVX-512 machine too (engine/native/simd.h). The main run covers
$SPECACHE_NATIVE_ARCH (native by default); each level here runs those tests again in a child
process built with -march=<level>."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine import native

ROOT = Path(__file__).resolve().parents[1]
LEVELS = [lv for lv in native.runnable_levels() if lv != "x86-64"]  # x86-64 (v1) is v2's code, without popcnt


def test_runnable_levels_follow_the_cpu_flags(monkeypatch):
    monkeypatch.setattr(native.platform, "machine", lambda: "x86_64")
    v3 = set().union(*(native.X86_LEVELS[lv] for lv in ("x86-64-v2", "x86-64-v3")))
    monkeypatch.setattr(native, "cpu_flags", lambda: v3 | {"avx512f"})  # AVX-512F alone is not v4
    assert native.runnable_levels() == ["x86-64", "x86-64-v2", "x86-64-v3"]
    monkeypatch.setattr(native, "cpu_flags", lambda: {"sse2"})
    assert native.runnable_levels() == ["x86-64"]
    monkeypatch.setattr(native.platform, "machine", lambda: "aarch64")
    assert native.runnable_levels() == ["armv8-a"]


def test_the_level_is_part_of_the_library_key(monkeypatch):
    paths = set()
    for level in ("native", "x86-64-v3", "x86-64-v2"):
        monkeypatch.setenv(native.ENV_ARCH, level)
        paths.add(native.library_path())
    assert len(paths) == 3


@pytest.mark.skipif(not native.native_available(), reason="native kernels unavailable here")
@pytest.mark.parametrize("level", LEVELS)
def test_kernel_tests_pass_at_level(level):
    env = dict(os.environ, **{native.ENV_ARCH: level})
    probe = subprocess.run([sys.executable, "-c", "from engine import native; print(native.isa(), native.native_error())"],
                           env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert probe.stdout.split()[0] == native.LEVEL_ISA[level], probe.stdout + probe.stderr
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "kernels",
                          "tests/test_linears.py", "tests/test_quant.py", "tests/test_fused.py",
                          "tests/test_sliding.py", "tests/test_decode_norms.py"],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1], run.stdout[-1000:]
