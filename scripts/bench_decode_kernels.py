"""The decode kernels of held GGUF block weights side by side (engine/model/decode_kernels.py): exact, int16 and
int8 on one random [N, K] weight per format, 1 row, 1 thread, G weights/s (medians of --repeats bursts), for each
instruction set level asked (each in a child process built with -march=<level>; `native` is this CPU's own).

    .venv/bin/python scripts/bench_decode_kernels.py --levels native,x86-64-v3 --out bench-results/decode-kernels.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def measure(n: int, k: int, repeats: int, burst: int) -> dict:
    """This process's level: {format: {kernel: G weights/s}}."""
    import torch
    from gguf import GGMLQuantizationType as Q

    from engine import native
    from engine.model import decode_kernels as dk
    from engine.model.gguf_tensors import held_from_raw
    from tests.test_gguf import random_tensor

    torch.set_num_threads(1)
    out = {"isa": native.isa(), "arch": native.arch()}
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(0))
    for name in FORMATS:
        kind = Q[name]
        held = held_from_raw(random_tensor(kind, n, k), kind, n, k)
        calls = {kernel: dk.decode_call(held, None, kernel) for kernel in dk.CHOICES}
        times: dict[str, list[float]] = {kernel: [] for kernel in calls}
        for call in calls.values():
            for _ in range(burst):
                call(x)
        for _ in range(repeats):  # the kernels take turns: a load change hits them alike
            for kernel, call in calls.items():
                t = time.perf_counter()
                for _ in range(burst):
                    call(x)
                times[kernel].append((time.perf_counter() - t) / burst)
        out[name] = {kernel: round(n * k / statistics.median(v) / 1e9, 2) for kernel, v in times.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", default="native", help="comma-separated -march levels (native, x86-64-v3, ...)")
    ap.add_argument("--shape", default="2048,1024", help="N,K of the weight")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--burst", type=int, default=40)
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    n, k = map(int, a.shape.split(","))
    if a.child:
        print(json.dumps(measure(n, k, a.repeats, a.burst)))
        return
    results = []
    for level in a.levels.split(","):
        env = dict(os.environ, SPECACHE_NATIVE_ARCH=level, SPECACHE_NATIVE_THREADS="1")
        run = subprocess.run([sys.executable, __file__, "--child", "--shape", a.shape, "--repeats", str(a.repeats),
                              "--burst", str(a.burst)], env=env, cwd=ROOT, capture_output=True, text=True)
        if run.returncode != 0:
            sys.exit(f"error: level {level}: {run.stderr.strip().splitlines()[-1] if run.stderr.strip() else run.returncode}")
        results.append({"level": level, **json.loads(run.stdout.strip().splitlines()[-1])})
    for r in results:
        print(f"level {r['level']} ({r['isa']}), [{n}, {k}], 1 row, 1 thread, G weights/s: exact / int16 / int8 "
              "(int16 / exact)")
        for name in FORMATS:
            g = r[name]
            print(f"  {name:5} {g['exact']:6.2f} / {g['int16']:6.2f} / {g['int8']:6.2f}  ({g['int16'] / g['exact']:.2f}x)")
    if a.out:
        a.out.write_text(json.dumps({"shape": [n, k], "repeats": a.repeats, "burst": a.burst, "results": results},
                                    indent=1) + "\n")


if __name__ == "__main__":
    main()
