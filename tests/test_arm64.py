"""The native kernels on other instruction sets (docs/engine.md, "Portable kernels: the ARM64 check").

tests/native/kernel_check.c compiles the kernel sources (engine/native/*.c) in and checks every
kernel against the torch references stored in tests/data/kernels (scripts/make_kernel_refs.py):
here built natively for each x86-64 level this CPU runs (x86-64: plain C, x86-64-v3: AVX2 + FMA,
x86-64-v4: AVX-512) and cross-compiled for aarch64 (NEON) and run under qemu-aarch64. Without
the cross compiler or qemu the aarch64 test is skipped, except with $CI set (.ci/run installs
them): there a missing tool fails.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from engine import native
from engine.paths import cache_root

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "tests" / "native" / "kernel_check.c"
REFS = sorted((ROOT / "tests" / "data" / "kernels").glob("*.bin"))
FLAGS = tuple(f for f in native.FLAGS if f != "-shared")  # the library's own flags (-O3 -fopenmp ...), as a program
CROSS_CC, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64"
# target -> (-march, what specache_native_isa() must say)
TARGETS = {"x86-64": ("x86-64", "generic"), "x86-64-v3": ("x86-64-v3", "avx2"), "x86-64-v4": ("x86-64-v4", "avx512"),
           "aarch64": ("armv8-a", "neon")}
_V2 = {"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"}
_V3 = _V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
LEVEL_FLAGS = {"x86-64": set(), "x86-64-v3": _V3, "x86-64-v4": _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq",
                                                                        "avx512vl"}}
SUMMARY = re.compile(r"^(\d+) passed, (\d+) failed$")

_spec = importlib.util.spec_from_file_location("make_kernel_refs", ROOT / "scripts" / "make_kernel_refs.py")
refs_script = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(refs_script)  # (for read(); importing it changes nothing)


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def host_cc() -> str | None:
    return shutil.which("gcc") or shutil.which("cc")


def require(*tools: str) -> None:
    """Skip (fail with $CI set) unless every tool is on PATH."""
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        why = f"{', '.join(missing)} not installed (Debian: gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user)"
        if os.environ.get("CI"):
            pytest.fail(f"{why}; .ci/run installs them in CI")
        pytest.skip(why)


def runnable(target: str) -> None:
    """Skip unless this machine can build and run the target (the cross tools: see require)."""
    if target == "aarch64":
        require(CROSS_CC, QEMU)
        return
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"x86-64 levels on a {platform.machine()} host")
    if host_cc() is None:
        if os.environ.get("CI"):
            pytest.fail("no C compiler (gcc / cc)")
        pytest.skip("no C compiler (gcc / cc)")
    lacking = LEVEL_FLAGS[target] - cpu_flags()
    if lacking:
        pytest.skip(f"this CPU cannot run {target} code (no {', '.join(sorted(lacking))})")


class Build:
    """kernel_check.c + the kernel sources compiled for one target, kept in cache_root()/kernel_check/
    <target> under a hash of the sources, the compiler and its flags (like the library itself), so
    that only a change rebuilds (and replaces the earlier build); a build starts at once (the builds
    of a run go on side by side) and result() waits for it."""

    def __init__(self, target: str):
        march, self.isa = TARGETS[target]
        self.target = target
        cc = CROSS_CC if target == "aarch64" else host_cc()
        static = ("-static",) if target == "aarch64" else ()  # no aarch64 loader and libraries to find at run time
        flags = (*FLAGS, f"-march={march}", *static)
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
        h = hashlib.sha256()
        for part in (*(p.read_bytes() for p in (CHECK, *native.SOURCES, *native.HEADERS)), cc.encode(),
                     version.encode(), " ".join(flags).encode()):
            h.update(part)
            h.update(b"\0")
        self.binary = cache_root() / "kernel_check" / target / f"kernel_check-{h.hexdigest()[:20]}"
        self.proc = self._output = None
        if not self.binary.exists():
            self.binary.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=self.binary.name + ".", suffix=".tmp", dir=self.binary.parent)
            os.close(fd)
            self.tmp = Path(tmp)
            self.command = [cc, *flags, "-o", tmp, str(CHECK), *map(str, native.SOURCES), "-lm"]
            self.proc = subprocess.Popen(self.command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         text=True)

    def result(self) -> Path:
        if self.proc is not None and self._output is None:
            self._output = self.proc.communicate(timeout=600)[0]
            if self.proc.returncode == 0:
                os.replace(self.tmp, self.binary)
                for old in self.binary.parent.glob("kernel_check-*"):  # builds of earlier sources
                    if old != self.binary and not old.name.endswith(".tmp"):
                        old.unlink(missing_ok=True)
            else:
                self.tmp.unlink(missing_ok=True)
        assert self.binary.exists(), f"{' '.join(self.command)}\n{self._output}"
        return self.binary

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
            self.tmp.unlink(missing_ok=True)

    def run(self, *files: Path, timeout: int = 300) -> subprocess.CompletedProcess:
        cmd = [str(self.result()), "--isa", self.isa, "--prefill", "0", "--abi", str(native.ABI_VERSION),
               *map(str, files)]
        if self.target == "aarch64":
            cmd.insert(0, shutil.which(QEMU))
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def builds(request):
    """target -> Build, for the targets the selected tests of this module need and this machine runs
    (a test without a target parameter needs x86-64)."""
    wanted = set()
    for item in request.session.items:
        if getattr(item, "module", None) is sys.modules[__name__] and "builds" in getattr(item, "fixturenames", ()):
            callspec = getattr(item, "callspec", None)
            wanted.add(callspec.params.get("target", "x86-64") if callspec else "x86-64")
    started = {}
    for target in TARGETS:
        if target in wanted:
            try:
                runnable(target)
            except (pytest.skip.Exception, pytest.fail.Exception):
                continue  # the test itself says why
            started[target] = Build(target)
    yield started
    for b in started.values():
        b.stop()


def summary(out: str) -> tuple[int, int]:
    lines = out.strip().splitlines()
    match = SUMMARY.match(lines[-1]) if lines else None
    assert match, f"no final 'N passed, M failed' line:\n{out[-3000:]}"
    return int(match[1]), int(match[2])


def reference_outputs() -> int:
    """Reference outputs in the files (each is checked with 1 and 2 threads, at least)."""
    return sum(name.split("/", 1)[1].startswith(("ref_y_", "ref_out")) for f in REFS for name in refs_script.read(f))


@pytest.mark.parametrize("target", list(TARGETS))
def test_kernels_match_the_torch_references(target, builds):
    """Every kernel on every reference case, with 1 and 2 threads: no check fails, and every
    reference output was checked (a check per thread count at least)."""
    runnable(target)
    assert REFS, "no reference files in tests/data/kernels (scripts/make_kernel_refs.py)"
    res = builds[target].run(*REFS)
    out = res.stdout + res.stderr
    passed, failed = summary(res.stdout)
    fails = [line for line in res.stdout.splitlines() if line.startswith("FAIL")]
    assert failed == 0 and res.returncode == 0 and not fails, f"{target}: {failed} failed:\n" + "\n".join(fails)
    for f in REFS:
        assert f"# {f}" in res.stdout, f"{f} was not read:\n{out[-3000:]}"
    assert passed >= 2 * reference_outputs(), out[-3000:]
    assert f'specache_native_isa() is "{TARGETS[target][1]}"' in res.stdout
    if target == "aarch64":  # the AVX512-BF16 prefill kernel is not there on ARM64
        assert "ok   specache_prefill_attention_available() is 0 (expected 0)" in res.stdout


def _changed_copy(src: Path, dst: Path, changes: dict) -> Path:
    """src with fields changed in place: {name: function(numpy view of the field's values)}."""
    data = bytearray(src.read_bytes())
    blobs = refs_script.read(src)
    for field, change in changes.items():
        tag, shape, raw, offset = blobs[field]
        dtype = {"B": np.uint8, "f": np.float32, "q": np.int64}[tag]
        view = np.frombuffer(data, dtype=dtype, count=len(raw) // np.dtype(dtype).itemsize, offset=offset)
        change(view.reshape(shape))
    dst.write_bytes(bytes(data))
    return dst


def test_a_wrong_reference_fails_the_check(builds, tmp_path):
    """The check can fail: one flipped code bit of the expected affine4 packing, one changed torch
    output of the guide scores and of the fused call, a position the fused call chooses made a
    non-candidate. The failing lines name the kernel and the case, the summary counts them, the exit
    status is nonzero, and nothing else fails."""
    runnable("x86-64")
    data = ROOT / "tests" / "data" / "kernels"
    chosen = refs_script.read(data / "fused.bin")["fused:spec_2bit/ref_fidx"]
    p = int(np.frombuffer(chosen[2], np.int64)[0])  # row 0, head 0, slot 0 (torch's choice; the kernel's too)

    def bit(a):
        a.reshape(-1)[4 * 24 + 10] ^= 0x10  # record 4 (row 2, block 0): the code of weight 18 is 1 off

    def more(i, v):
        return lambda a: a.reshape(-1).__setitem__(i, a.reshape(-1)[i] + v)

    def not_a_candidate(a):
        a[0, 0, p] = -1.0

    files = [_changed_copy(data / "linear.bin", tmp_path / "linear.bin", {"packed:affine4/packed": bit}),
             _changed_copy(data / "guide.bin", tmp_path / "guide.bin", {"scores:b1_g64/ref_out_q3": more(7, 0.5)}),
             _changed_copy(data / "fused.bin", tmp_path / "fused.bin",
                           {"fused:spec_2bit/ref_out": more(100, 0.01), "fused:spec_2bit/ref_sel_w": not_a_candidate})]
    res = builds["x86-64"].run(*files)
    fails = [line for line in res.stdout.splitlines() if line.startswith("FAIL")]
    passed, failed = summary(res.stdout)
    assert res.returncode != 0 and failed == len(fails) > 0 and passed > 0

    def failing(*parts):
        return [line for line in fails if all(part in line for part in parts)]

    assert len(failing("packed:affine4 pack_affine4: bytes equal the packing rule's")) == 1, fails
    assert len(failing("packed:affine4 unpack: rebuilds the weight bit for bit")) == 1, fails
    # a packed weight that is not the weight's packing gives neither torch's nor the fp32 kernel's result
    assert failing("packed:affine4 packed_linear(affine4)", "== skinny_linear on its fp32 weight"), fails
    assert failing("packed:affine4 packed_linear(affine4)", "vs torch F.linear", "values off"), fails
    assert len(failing("scores:b1_g64 guide_scores 1 bit, group 64, 3 queries", "expected")) == 2, fails  # 1, 2 threads
    assert len(failing("fused:spec_2bit ", "output vs the torch decode path", "first [100]")) == 2, fails
    assert len(failing("fused:spec_2bit ", "selects a top 16", "is not a candidate")) == 2, fails
    others = [line for line in fails if not line.startswith(("FAIL packed:affine4", "FAIL scores:b1_g64 guide_scores 1 "
                                                             "bit, group 64, 3 queries", "FAIL fused:spec_2bit "))]
    assert not others, others


def test_a_missing_file_fails(builds, tmp_path):
    runnable("x86-64")
    res = builds["x86-64"].run(tmp_path / "nothing.bin")
    assert res.returncode != 0 and summary(res.stdout)[1] == 1 and "cannot open" in res.stdout


def _decode_args_text(path: Path) -> str:
    """The DecodeArgs typedef of a C file, comments and spacing removed."""
    text = path.read_text()
    body = re.search(r"typedef struct \{([^}]*)\} DecodeArgs;", text)
    assert body, f"{path}: no DecodeArgs typedef"
    return " ".join(re.sub(r"/\*.*?\*/", " ", body[1], flags=re.S).split())


def test_the_check_declares_the_kernels_decode_args():
    """kernel_check.c and guide_kernels.c take DecodeArgs from the one header (no copy of their own), and the
    header declares it."""
    header = ROOT / "engine" / "native" / "decode_args.h"
    assert _decode_args_text(header)
    for path in (CHECK, ROOT / "engine" / "native" / "guide_kernels.c"):
        assert re.search(r'#include "[./]*(engine/native/)?decode_args\.h"', path.read_text()), path
        assert not re.search(r"\} DecodeArgs;", path.read_text()), f"{path}: a DecodeArgs of its own"


def test_reference_files_are_what_the_script_makes(tmp_path):
    """scripts/make_kernel_refs.py (seeded) writes the committed files again: the same blobs, the inputs
    byte for byte, the torch outputs to float rounding (matmuls may round differently on another CPU),
    and the files stay small."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_kernel_refs.py"), "--out", str(tmp_path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    made = sorted(tmp_path.glob("*.bin"))
    assert [p.name for p in made] == [p.name for p in REFS]
    assert sum(p.stat().st_size for p in REFS) < 1_200_000  # 1.10 MB: the CPU store pages its KV heads (docstore)
    for new, old in zip(made, REFS):
        a, b = refs_script.read(new), refs_script.read(old)
        assert list(a) == list(b), f"{old.name}: other blobs"
        for name, (tag, shape, raw, _) in a.items():
            otag, oshape, oraw, _ = b[name]
            assert (tag, shape) == (otag, oshape), name
            if not name.split("/", 1)[1].startswith("ref_"):
                assert raw == oraw, f"{old.name} {name}: the input differs"
            elif tag == "f":
                x, y = np.frombuffer(raw, np.float32), np.frombuffer(oraw, np.float32)
                np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5 * float(np.abs(y).max(initial=1.0)), err_msg=name)
