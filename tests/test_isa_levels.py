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


KERNEL_TESTS = ["tests/test_linears.py", "tests/test_quant.py", "tests/test_fused.py", "tests/test_sliding.py",
                "tests/test_decode_norms.py"]


@pytest.fixture(scope="module")
def level_runs():
    """Every level's library built and probed at once, then every level's kernel tests started at once, each in
    its own child (one thread each: the conftest's default), so that the levels share the cores instead of
    running one after the other. -> {level: (probe's output, the tests' Popen)}, waited on by each level's test."""
    envs = {level: dict(os.environ, **{native.ENV_ARCH: level}) for level in LEVELS}
    probes = {level: subprocess.Popen([sys.executable, "-c", "from engine import native; print(native.isa(), "
                                       "native.native_error())"], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True) for level, env in envs.items()}
    said = {level: "".join(probe.communicate(timeout=600)) for level, probe in probes.items()}
    runs = {level: (said[level], subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                                   "-m", "kernels", *KERNEL_TESTS], env=env, cwd=ROOT,
                                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
            for level, env in envs.items()}
    yield runs
    for _, tests in runs.values():
        if tests.poll() is None:
            tests.kill()
            tests.communicate()


@pytest.mark.skipif(not native.native_available(), reason="native kernels unavailable here")
@pytest.mark.parametrize("level", LEVELS)
def test_kernel_tests_pass_at_level(level, level_runs):
    probe, tests = level_runs[level]
    assert probe.split()[0] == native.LEVEL_ISA[level], probe
    out, err = tests.communicate(timeout=1200)
    assert tests.returncode == 0, out[-4000:] + err[-2000:]
    assert " passed" in out and "skipped" not in out.splitlines()[-1], out[-1000:]
