"""Which path each decode linear takes on this CPU: the native kernel only where it measured faster
than torch for that shape class, so that the worst case on any CPU is stock torch.

The classes are the weight's form (fp32, affine4, scaled8: engine/native/linear_kernels.c) and the
rows of one call (1, 2-4, 5-8, and 9-64 in calls of 8). A short calibration (about a second, one
thread, the two paths taking turns, best of 5) times a weight bigger than the caches (4096 x 4096,
what a decode step streams from memory) both ways, once per built library: its result is stored
beside the library (``guide-<hash>.calib.json``, written atomically) and read by every later
process. A packed weight's torch path is torch's GEMM on the fp32 weight it stands for; a weight held
only in its blocks (a GGUF model, engine/model/held_weights.py HeldWeight) has no such path and always
decodes on the native kernel (torch would first rebuild it).

``$SPECACHE_NATIVE_CALIBRATE=0`` skips the measurement and takes the native kernel everywhere (the
tests, A/B runs); ``$SPECACHE_NATIVE=0`` takes torch everywhere.
"""
from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from engine import native

ENV = "SPECACHE_NATIVE_CALIBRATE"
FORMS = {0: "fp32", 4: "affine4", 8: "scaled8"}
ROW_CLASSES = ((1, 1), (2, 4), (5, 8), (9, 64))  # inclusive ranges of rows per call
PROBE_ROWS = {(1, 1): 1, (2, 4): 4, (5, 8): 8, (9, 64): 32}  # the rows each class is timed at
SHAPE = (4096, 4096)
VERSION = 1

_lock = threading.Lock()
_table: dict[int, tuple[bool, ...]] | None = None  # form -> native? for rows 0..64
_report: dict | None = None


def enabled() -> bool:
    raw = os.environ.get(ENV)
    return raw is None or raw.strip().lower() not in ("0", "false", "no", "off")


def row_class(rows: int) -> str:
    for lo, hi in ROW_CLASSES:
        if lo <= rows <= hi:
            return f"{lo}-{hi}" if lo != hi else str(lo)
    raise ValueError(f"no row class for {rows} rows")


def skinny_torch_linear(flat: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """flat [R <= 8, K] @ weight^T (+ bias) by torch as W @ x^T, what a decode linear falls back to: the
    BLAS's x @ W^T path packs the weight matrix for 2-8 rows, so a 2-row step cost about twice a 1-row
    step that way."""
    y = (weight @ flat.T).T
    return y + bias if bias is not None else y


def _kernel_call(lib, w: torch.Tensor, packed: torch.Tensor | None, form: int) -> Callable[[torch.Tensor], None]:
    """x [R, K] -> y by the native kernel on w (fp32 [N, K]) or its packed bytes, in calls of 8 rows."""
    n, k = w.shape

    def call(x: torch.Tensor) -> None:
        y = torch.empty(x.shape[0], n)
        for s in range(0, x.shape[0], 8):
            r = min(8, x.shape[0] - s)
            xp, yp = x[s:].data_ptr(), y[s:].data_ptr()
            rc = (lib.specache_skinny_linear(xp, k, r, w.data_ptr(), n, k, None, yp, n, native.threads()) if form == 0
                  else lib.specache_packed_linear(xp, k, r, packed.data_ptr(), form, n, k, None, yp, n, native.threads()))
            assert rc == 0

    return call


def _exact_blocks(n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Two fp32 weights [n, k] that are exactly affine4 and scaled8 blocks (linear_kernels.c)."""
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.02 + 1e-3).half().float()
    m = (-torch.rand(n, k // 32, 1, generator=g) * 0.1).half().float()
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    return torch.addcmul(m, d, q).reshape(n, k), (d * (q * 17 - 128).clamp(-127, 127)).reshape(n, k)


def measure(repeats: int = 5, shape: tuple[int, int] = SHAPE) -> dict:
    """Time every (form, row class) both ways on a weight of `shape`; returns the report stored."""
    lib = native.lib()
    n, k = shape
    g = torch.Generator().manual_seed(0)
    w4, w8 = _exact_blocks(n, k, g)
    weights = {0: (w4, None)}
    for form, w, packer in ((4, w4, lib.specache_pack_affine4), (8, w8, lib.specache_pack_scaled8)):
        data = torch.empty(n, k // 32 * (24 if form == 4 else 36), dtype=torch.uint8)
        assert packer(w.data_ptr(), n, k, data.data_ptr()) == 0
        weights[form] = (w, data)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the native kernels follow torch's count (native.threads())
    timings: dict[str, dict[str, float]] = {}
    try:
        with torch.no_grad():
            for form, (w, packed) in weights.items():
                ours = _kernel_call(lib, w, packed, form)
                for cls in ROW_CLASSES:
                    x = torch.randn(PROBE_ROWS[cls], k, generator=g)

                    def theirs(x=x, w=w) -> None:  # what SkinnyLinear falls back to
                        if x.shape[0] <= 8:
                            skinny_torch_linear(x, w, None)
                        else:
                            torch.nn.functional.linear(x, w)

                    t = _race({"native": lambda x=x: ours(x), "torch": theirs}, repeats)
                    timings[f"{FORMS[form]}/{row_class(PROBE_ROWS[cls])}"] = {p: round(v * 1e3, 3) for p, v in t.items()}
    finally:
        torch.set_num_threads(threads)
    return {"version": VERSION, "isa": native.isa(), "torch": torch.__version__, "shape": list(shape),
            "ms": timings, "native": {key: t["native"] < t["torch"] for key, t in timings.items()}}


def _race(ways: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Best time of each way over `repeats` rounds in which the ways take turns (one warm-up each)."""
    for fn in ways.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(repeats):
        for name, fn in ways.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: min(v) for name, v in times.items()}


def report_path() -> Path:
    return native.library_path().with_suffix(".calib.json")


def _load_or_measure() -> dict:
    path = report_path()
    try:
        rep = json.loads(path.read_text())
        if rep.get("version") == VERSION and rep.get("torch") == torch.__version__:
            return rep
    except (OSError, ValueError):
        pass
    rep = measure()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".tmp", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(rep, f, indent=1)
    os.replace(tmp, path)
    return rep


def table_of(rep: dict) -> dict[int, tuple[bool, ...]]:
    """form -> (native? for rows 0..64) from a report's choices."""
    out = {}
    for form, name in FORMS.items():
        row = [False] * 65
        for lo, hi in ROW_CLASSES:
            choice = rep["native"].get(f"{name}/{row_class(lo)}", True)
            for r in range(lo, hi + 1):
                row[r] = choice
        out[form] = tuple(row)
    return out


def report() -> dict | None:
    """The calibration in force (measuring it on first use), None when it is off or there is no library."""
    _ensure()
    return _report


def _ensure() -> dict[int, tuple[bool, ...]]:
    global _table, _report
    if _table is not None:
        return _table
    with _lock:
        if _table is None:
            if native.lib() is None:
                _report, _table = None, {form: (False,) * 65 for form in FORMS}
            elif not enabled():
                _report, _table = None, {form: (True,) * 65 for form in FORMS}
            else:
                _report = _load_or_measure()
                _table = table_of(_report)
    return _table


def use_native(form: int, rows: int) -> bool:
    """Whether a linear of `rows` rows (<= 64) on a weight of this form takes the native kernel."""
    table = _table if _table is not None else _ensure()
    return table[form][rows] if rows <= 64 else False


def paths() -> dict[str, str]:
    """'native' or 'torch' per shape class, for the benches' reports."""
    table = _ensure()
    return {f"{FORMS[form]}/{row_class(lo)}": "native" if table[form][lo] else "torch"
            for form in FORMS for lo, _ in ROW_CLASSES}


def describe() -> dict:
    """Which code the decode step runs on this CPU, for the benches' reports: the native library's
    instruction set and -march, torch's own CPU capability, the decode linears' path per shape class
    (engine/native/calibrate.py) and the guided decode attention's (the fused call wherever the library
    loads: on AVX2 and AVX-512 it measured 9x and more faster than the torch path, scripts/bench_fused.py
    --vs-torch)."""
    have = native.cpu_flags()
    return {"isa": native.isa(), "arch": native.arch(), "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_flags": sorted(have & {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16",
                                        "asimd", "sve", "bf16", "i8mm"}),
            "decode_linears": paths(), "decode_attention": "native" if native.lib() is not None else "torch"}


def describe_line(d: dict | None = None) -> str:
    """describe() in one line."""
    d = d or describe()
    lin = d["decode_linears"]
    natives = [k for k, v in lin.items() if v == "native"]
    torches = [k for k, v in lin.items() if v == "torch"]
    parts = [f"native kernels {d['isa']} (-march={d['arch']})", f"torch CPU capability {d['torch_cpu_capability']}",
             f"decode attention {d['decode_attention']}",
             *([f"GGUF decode path {d['held_decode_linear']}"] if d.get("held_decode_linear") else []),
             "decode linears native for " + (", ".join(natives) or "none")
             + ("; torch for " + ", ".join(torches) if torches else "")]
    return "; ".join(parts)


def _reset_for_tests() -> None:
    global _table, _report
    with _lock:
        _table, _report = None, None
