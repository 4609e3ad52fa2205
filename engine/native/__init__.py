"""Native CPU kernels, compiled once per machine and loaded with ctypes: the guide kernels and fused decode
attention (``guide_kernels.c``), the decode-step linears (``linear_kernels.c``, exact; ``int8_linear.c``, integer
activations: engine.model.decode_kernels chooses), norms and ropes (``norm_kernels.c``), packing
(``pack_kernels.c``) and the bf16 prefill attention (``attention_kernels.c``).

The sources are compiled with the system compiler (``$CC``, else ``cc``/``gcc``/``clang``), a process per
source side by side, and linked into one ``cache_root()/native/guide-<hash>.so`` (the hash covers the sources,
the compiler and its flags, the instruction set and the machine), written atomically (temporary file, then
``os.replace``), so concurrent first uses are safe. ``$SPECACHE_NATIVE_ARCH`` is the ``-march`` value
(``native``, the default; ``x86-64-v4`` AVX-512, ``x86-64-v3`` AVX2 + FMA, ``x86-64-v2`` SSE4.2, ``armv8-a``
...); every kernel is written once against engine/native/simd.h, one vector type per instruction set
(``isa()`` says which was built). Built lazily by ``native_available()`` / ``lib()`` (``python -m
engine.native``: ahead of time); no torch headers, no ninja.

``SPECACHE_NATIVE=0`` disables the native path and ``SPECACHE_NATIVE_THREADS=N`` sets its thread count (default:
torch's, see ``threads()``); both are read once, at their first use in a process. A build or load failure makes
``native_available()`` False (the callers' torch paths run); the reason is logged once at debug level and kept
in ``native_error()``.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from engine.paths import cache_root

log = logging.getLogger(__name__)
_run = functools.partial(subprocess.run, capture_output=True, text=True, timeout=300)  # a compiler command

SOURCES = tuple(Path(__file__).with_name(name) for name in (  # slowest to compile first (Zen 4: 18, 10, 3 s, < 1 s)
    "int8_linear.c", "linear_kernels.c", "guide_kernels.c", "attention_kernels.c", "norm_kernels.c", "pack_kernels.c"))
HEADERS = tuple(Path(__file__).with_name(name) for name in ("simd.h", "decode_args.h", "block_codes.h", "columns.h"))
ABI_VERSION = 12
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11", "-fvisibility=hidden", "-Wno-psabi")
ENV_DISABLE = "SPECACHE_NATIVE"
ENV_ARCH = "SPECACHE_NATIVE_ARCH"
ENV_THREADS = "SPECACHE_NATIVE_THREADS"

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_error: str | None = None
_threads: int | None = None
_announce = None  # told before build() compiles the library (announcing(): load_model's on_status)

_I64 = ctypes.c_int64
_P = ctypes.c_void_p
# (ptr, sb, sh, sq, codes, c_sb, c_sh, scale, zero, s_sb, s_sh, out, B, H, Q, D, n, g, bits, threads)
_KERNEL_ARGS = [_P, _I64, _I64, _I64, _P, _I64, _I64, _P, _P, _I64, _I64, _P] + [_I64] * 8
# (x, x_stride, rows, weight, N, K, bias, y, y_stride, threads)
_LINEAR_ARGS = [_P, _I64, _I64, _P, _I64, _I64, _P, _P, _I64, _I64]
# (x, x_stride, rows, packed, fmt, N, K, bias, y, y_stride, threads)
_PACKED_LINEAR_ARGS = [_P, _I64, _I64, _P, _I64, _I64, _I64, _P, _P, _I64, _I64]


class DecodeArgs(ctypes.Structure):
    """Mirror of the C struct DecodeArgs (decode_args.h; guide_kernels.c's fused decode attention)."""

    _fields_ = ([(n, _I64) for n in ("B", "H", "G", "T", "D", "S", "K", "bits", "g", "gv", "row0", "select", "keep",
                                     "residual", "nthreads", "select_both", "current")]
                + [("scaling", ctypes.c_float), ("q", _P), ("q_sb", _I64), ("q_sh", _I64), ("start", _P), ("qend", _P),
                   ("sink_k", _P), ("sink_v", _P), ("sk_sb", _I64), ("sk_sh", _I64),
                   ("res_k", _P), ("res_v", _P), ("rk_sb", _I64), ("rk_sh", _I64),
                   ("fk", _P), ("fv", _P), ("fk_sb", _I64), ("fk_sh", _I64),
                   ("fidx", _P), ("fvalid", _P), ("fi_sb", _I64), ("fi_sh", _I64),
                   ("store_k", _P), ("store_v", _P), ("st_sb", _I64), ("st_sh", _I64),
                   ("kc", _P), ("kc_sb", _I64), ("kc_sh", _I64), ("ks", _P), ("kz", _P), ("ks_sb", _I64), ("ks_sh", _I64),
                   ("vc", _P), ("vc_sb", _I64), ("vc_sh", _I64), ("vs", _P), ("vz", _P), ("vs_sb", _I64), ("vs_sh", _I64),
                   ("out", _P), ("rot", _P), ("correct", _I64), ("reuse", _P), ("res_at_qend", _I64),
                   ("O", _I64), ("oidx", _P), ("oi_sb", _I64), ("oi_sh", _I64), ("oc", _P), ("oc_sb", _I64),
                   ("oc_sh", _I64), ("os", _P), ("oz", _P), ("os_sb", _I64), ("os_sh", _I64),
                   ("softcap", ctypes.c_float), ("store_dtype", _I64)])


class SlidingArgs(ctypes.Structure):
    """Mirror of the C struct SlidingArgs (decode_args.h; guide_kernels.c's sliding-window decode attention)."""

    _fields_ = ([(n, _I64) for n in ("B", "H", "G", "T", "D", "C", "W", "row0", "nthreads")]
                + [("scaling", ctypes.c_float), ("softcap", ctypes.c_float), ("q", _P), ("q_sb", _I64), ("q_sh", _I64),
                   ("k", _P), ("v", _P), ("k_sb", _I64), ("k_sh", _I64), ("pos", _P), ("pos_sb", _I64),
                   ("start", _P), ("out", _P)])


class PrefillArgs(ctypes.Structure):
    """Mirror of the C struct PrefillArgs (attention_kernels.c, prefill attention in bf16)."""

    _fields_ = ([(n, _I64) for n in ("H", "G", "T", "D", "start", "npieces", "src_bf16", "nthreads", "first",
                                     "window")]
                + [("scaling", ctypes.c_float), ("q", _P), ("q_sh", _I64), ("k", _P * 3), ("v", _P * 3),
                   ("n", _I64 * 3), ("sr", _I64 * 3), ("sh", _I64 * 3), ("out", _P)])


def disabled() -> bool:
    """True when $SPECACHE_NATIVE is 0/false/no/off."""
    raw = os.environ.get(ENV_DISABLE)
    return raw is not None and raw.strip().lower() in ("0", "false", "no", "off")


_libc: ctypes.CDLL | None | bool = None  # glibc, once looked up (False: not there)


def release_freed_memory() -> None:
    """Hand the memory the C heap holds free back to the system (glibc's malloc_trim; nothing elsewhere).
    glibc keeps freed blocks for reuse, and what a model's conversion or a prefill chunk's transients
    freed otherwise counts in the process's resident memory for the rest of the run, fragmented
    enough that the next chunk grows the heap again (SmolLM2's 2.2k-token summary: 628 -> ~606 MiB peak
    with a trim after each chunk, at no measurable cost)."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL("libc.so.6")
            _libc.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _libc = False
    if _libc:
        _libc.malloc_trim(0)


def threads() -> int:
    """Threads for one kernel call: $SPECACHE_NATIVE_THREADS (read once per process), else torch's
    own thread count, so that the native decode path uses the cores the torch ops of the same
    step use (with 1 native thread against torch's 2, a batch-1 specache step on a 2-core
    machine measured 36.0 ms against 26.9 ms with 2; `--threads` of the benches sets both).
    On a loaded machine fewer threads can be faster: set either."""
    global _threads
    if _threads is None:
        _threads = 0  # 0: follow torch
        raw = os.environ.get(ENV_THREADS)
        if raw:
            try:
                _threads = max(1, int(raw))
            except ValueError:
                pass
    if _threads:
        return _threads
    import torch

    return max(1, torch.get_num_threads())


def arch() -> str:
    """The instruction set the library is built for: $SPECACHE_NATIVE_ARCH (a -march value), else native."""
    raw = os.environ.get(ENV_ARCH, "").strip()
    return raw or "native"


# x86-64 micro-architecture levels and the /proc/cpuinfo flags a CPU needs to execute their code
X86_LEVELS = {
    "x86-64-v2": {"ssse3", "sse4_1", "sse4_2", "popcnt", "cx16"},
    "x86-64-v3": {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "abm"},
    "x86-64-v4": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
}
# the vector code simd.h picks at each level
LEVEL_ISA = {"x86-64": "generic", "x86-64-v2": "generic", "x86-64-v3": "avx2", "x86-64-v4": "avx512", "armv8-a": "neon"}


def cpu_flags() -> set[str]:
    """This CPU's feature flags (/proc/cpuinfo 'flags' on x86, 'Features' on ARM64)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def runnable_levels() -> list[str]:
    """The named -march levels whose code this CPU can execute (besides native)."""
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return ["armv8-a"]
    if machine not in ("x86_64", "amd64"):
        return []
    have, out, need = cpu_flags(), ["x86-64"], set()
    for level, wanted in X86_LEVELS.items():  # each level needs the ones below it too
        need |= wanted
        if not need <= have:
            break
        out.append(level)
    return out


def flags(march: str | None = None) -> tuple[str, ...]:
    """The compiler flags for one instruction set."""
    return (*FLAGS, f"-march={march or arch()}")


def compiler() -> str | None:
    """The C compiler to use: $CC, else the first of cc, gcc, clang on PATH."""
    if os.environ.get("CC"):
        return os.environ["CC"]
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _compiler_id(cc: str) -> str:
    out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30, check=True)
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else cc


def _machine_id() -> str:
    """CPU identity for -march=native: architecture, model and feature flags."""
    parts = [platform.system(), platform.machine()]
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            seen = set()
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in ("model name", "flags", "Features", "CPU implementer", "CPU part") and key not in seen:
                    seen.add(key)
                    parts.append(line.strip())
    except OSError:
        parts.append(platform.processor())
    return "\n".join(parts)


def library_path(cc: str | None = None, march: str | None = None) -> Path:
    """Where the shared library for this source, compiler, flags, instruction set and machine lives."""

    cc = cc or compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set $CC or install cc/gcc/clang)")
    h = hashlib.sha256()
    for part in (*(src.read_bytes() for src in (*SOURCES, *HEADERS)), cc.encode(), _compiler_id(cc).encode(),
                 " ".join(flags(march)).encode(), _machine_id().encode()):
        h.update(part)
        h.update(b"\0")
    return cache_root() / "native" / f"guide-{h.hexdigest()[:20]}.so"


@contextmanager
def announcing(on_status):
    """Within it, a build() that compiles (not one that finds the library built) says so first on on_status
    (None: silent)."""
    global _announce
    before, _announce = _announce, on_status
    try:
        yield
    finally:
        _announce = before


def build(force: bool = False, march: str | None = None) -> Path:
    """Compile the kernels for one instruction set (default: arch()) unless already cached, and
    return the library's path. Raises on failure.

    Tries the flags as they are first, then without OpenMP (a compiler without OpenMP
    support still gives a single-threaded library), then, for -march=native only, also without
    it (a compiler that does not know this CPU). The library's name does not depend on which
    variant built, so a failing variant is not retried by every process."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set $CC or install cc/gcc/clang)")
    march = march or arch()
    path = library_path(cc, march)
    if path.exists() and not force:
        return path
    if _announce is not None:  # (within announcing(): a first run's load_model)
        _announce("compiling the native CPU kernels once for this machine (up to a minute)")
    path.parent.mkdir(parents=True, exist_ok=True)
    errors = []
    full = flags(march)
    variants = [full, tuple(f for f in full if f != "-fopenmp")]
    if march == "native":
        variants.append(tuple(f for f in full if not f.startswith(("-fopenmp", "-march="))))
    for opts in variants:
        fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".tmp.so", dir=path.parent)
        os.close(fd)
        try:
            failed = _compile(cc, opts, tmp)
            if failed is None:
                os.replace(tmp, path)
                return path
            errors.append(failed)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise RuntimeError("compiling the native guide kernels failed:\n" + "\n".join(errors))


def _compile(cc: str, opts: tuple[str, ...], out: str) -> str | None:
    """SOURCES compiled to objects side by side (a process each, as many at once as this process has cores), then
    linked into out (2-core Zen 4: ~18 s against ~32 s as one compiler call). None, or the failing step's error."""
    with tempfile.TemporaryDirectory(prefix="objects.", dir=os.path.dirname(out)) as objects:
        outputs = [os.path.join(objects, src.stem + ".o") for src in SOURCES]
        steps = [[cc, *(o for o in opts if o != "-shared"), "-c", str(src), "-o", obj]
                 for src, obj in zip(SOURCES, outputs)]
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        with ThreadPoolExecutor(max_workers=max(1, min(len(steps), cores))) as pool:
            done = list(pool.map(_run, steps))
        failed = next((res for res in done if res.returncode), None) or _run([cc, *opts, "-o", out, *outputs, "-lm"])
    return None if failed.returncode == 0 else \
        f"{cc} {' '.join(opts)}: exit {failed.returncode}: {failed.stderr.strip()[-2000:]}"


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.specache_guide_abi_version.restype = ctypes.c_int
    if lib.specache_guide_abi_version() != ABI_VERSION:
        raise RuntimeError(f"{path}: ABI version {lib.specache_guide_abi_version()}, expected {ABI_VERSION}")
    lib.specache_guide_openmp.restype = ctypes.c_int
    lib.specache_native_isa.restype = ctypes.c_char_p
    for name in ("specache_guide_scores", "specache_guide_weighted_values"):
        fn = getattr(lib, name)
        fn.argtypes = _KERNEL_ARGS
        fn.restype = ctypes.c_int
    lib.specache_decode_attention.argtypes = [ctypes.POINTER(DecodeArgs)]
    lib.specache_decode_attention.restype = ctypes.c_int
    lib.specache_sliding_attention.argtypes = [ctypes.POINTER(SlidingArgs)]
    lib.specache_sliding_attention.restype = ctypes.c_int
    lib.specache_skinny_linear.argtypes = _LINEAR_ARGS
    lib.specache_skinny_linear.restype = ctypes.c_int
    lib.specache_packed_linear.argtypes = _PACKED_LINEAR_ARGS
    lib.specache_packed_linear.restype = ctypes.c_int
    lib.specache_int8_linear.argtypes = _PACKED_LINEAR_ARGS + [_I64]  # (..., bits): int8_linear.c
    lib.specache_int8_linear.restype = ctypes.c_int
    lib.specache_int8_quantize_row.argtypes = [_P, _I64, _I64, _P, _P, _P]  # (x, K, bits, q, d, s)
    lib.specache_int8_quantize_row.restype = ctypes.c_int
    for name in ("specache_pack_affine4", "specache_pack_scaled8"):  # (W, N, K, out)
        fn = getattr(lib, name)
        fn.argtypes = [_P, _I64, _I64, _P]
        fn.restype = ctypes.c_int
    lib.specache_unpack.argtypes = [_P, _I64, _I64, _I64, _I64, _P, _I64, _I64]  # (packed, fmt, n0, n1, K, W, bf16, threads)
    lib.specache_unpack.restype = ctypes.c_int
    lib.specache_prefill_attention.argtypes = [ctypes.POINTER(PrefillArgs)]
    lib.specache_prefill_attention.restype = ctypes.c_int
    lib.specache_prefill_attention_available.restype = ctypes.c_int
    lib.specache_rms_norm.argtypes = [_P, _P, _P, _P, _I64, _I64, ctypes.c_float]  # (x, w, res, out, rows, n, eps)
    lib.specache_rms_norm.restype = ctypes.c_int
    # (x, rows, heads, d, w, eps, cos, sin, cs_rows): norm_kernels.c
    lib.specache_norm_rope.argtypes = [_P, _I64, _I64, _I64, _P, ctypes.c_float, _P, _P, _I64]
    lib.specache_norm_rope.restype = ctypes.c_int
    return lib


def lib() -> ctypes.CDLL | None:
    """The loaded library (building it on first use), or None if disabled or unavailable."""
    global _lib, _tried, _error
    if _tried:  # decided once per process (this is called for every linear of every decode step)
        return _lib
    with _lock:
        if not _tried and disabled():
            _lib, _tried = None, True
        if not _tried:
            try:
                import torch  # noqa: F401  (load torch's OpenMP runtime first: the kernels then share it)

                _lib = _load(build())
            except Exception as exc:  # any failure: fall back to the torch kernels
                _lib, _error = None, f"{type(exc).__name__}: {exc}"
                log.debug("native guide kernels unavailable, using torch: %s", _error)
            _tried = True
    return _lib


def native_available() -> bool:
    """True when the native kernels are enabled and loaded (builds them on first call)."""
    return lib() is not None


def native_error() -> str | None:
    """Why the library could not be built or loaded (None if it was, or was not tried)."""
    return _error


def isa() -> str:
    """The vector instruction set the loaded library's kernels use (simd.h): avx512, avx2, neon,
    generic (plain C, no fused multiply-add), or "torch" when there is no library."""
    lb = lib()
    return lb.specache_native_isa().decode() if lb is not None else "torch"


def openmp() -> bool:
    """True when the loaded library was built with OpenMP (multi-threaded kernels possible)."""
    lb = lib()
    return bool(lb is not None and lb.specache_guide_openmp())


def _reset_for_tests() -> None:
    """Forget the loaded library so that the next call tries again (tests only)."""
    global _lib, _tried, _error, _threads
    with _lock:
        _lib, _tried, _error, _threads = None, False, None, None
