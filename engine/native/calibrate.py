"""Which path each decode linear takes on this CPU: the native kernel only where it measured faster
than torch for that shape class, so that the worst case on any CPU is stock torch.

The classes are the weight's form (fp32, affine4, scaled8: engine/native/linear_kernels.c) and the
rows of one call (1, 2-4, 5-8, and 9-64 in calls of 8). A short calibration (about a second, one
thread, the two paths taking turns, best of 5) times a weight bigger than the caches (4096 x 4096,
what a decode step streams from memory) both ways, once per built library: its result is stored
beside the library (``guide-<hash>.calib.json``, written atomically) and read by every later
process. A packed weight's torch path is torch's GEMM on the fp32 weight it stands for.

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


def measure(repeats: int = 5, shape: tuple[int, int] = SHAPE) -> dict:
    """Time every (form, row class) both ways on a weight of `shape`; returns the report stored."""
    from engine.model.linears import native_linear, pack_weight, skinny_torch_linear  # (linears imports this module)

    n, k = shape
    g = torch.Generator().manual_seed(0)
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.02 + 1e-3).half().float()
    m = (-torch.rand(n, k // 32, 1, generator=g) * 0.1).half().float()
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    w4 = torch.addcmul(m, d, q).reshape(n, k)
    w8 = (d * (q * 17 - 128).clamp(-127, 127)).reshape(n, k)
    weights = {0: (w4, None), 4: (w4, pack_weight(w4)), 8: (w8, pack_weight(w8))}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the native kernels follow torch's count (native.threads())
    timings: dict[str, dict[str, float]] = {}
    try:
        with torch.no_grad():
            for form, (w, packed) in weights.items():
                for cls in ROW_CLASSES:
                    rows = PROBE_ROWS[cls]
                    x = torch.randn(rows, k, generator=g)

                    def ours(x=x, w=w, packed=packed) -> None:
                        for s in range(0, x.shape[0], 8):
                            part = x[s : s + 8]
                            y = packed(part, None) if packed is not None else native_linear(part, w, None)
                            assert y is not None

                    def theirs(x=x, w=w) -> None:  # what SkinnyLinear falls back to
                        if x.shape[0] <= 8:
                            skinny_torch_linear(x, w, None)
                        else:
                            torch.nn.functional.linear(x, w)

                    t = _race({"native": ours, "torch": theirs}, repeats)
                    timings[f"{FORMS[form]}/{row_class(rows)}"] = {p: round(v * 1e3, 3) for p, v in t.items()}
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


def _reset_for_tests() -> None:
    global _table, _report
    with _lock:
        _table, _report = None, None
