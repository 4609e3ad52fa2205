"""Micro-benchmark of the guide kernels in engine/kvcache/quant.py (one layer, decode step).

Times guide_scores (q @ K^T over the packed key guide) and guide_weighted_values
(p @ V over the packed value guide): the native C kernels (engine.native, if they build),
the torch kernels, optionally the dequantize-then-matmul references, and a dense fp32
matmul over already-dequantized data, at SmolLM2-135M sizes (3 KV heads, head dim 64,
GQA group 3 x 2 query tokens -> Q = 6). Prints medians in microseconds per layer and
the machine's load average (the numbers are only as quiet as the machine).

    python scripts/bench_quant.py [--threads N] [--native-threads N ...] [--n 7000] [--batch 1 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine import native  # noqa: E402
from engine.kvcache import quant  # noqa: E402


def median_us(fn, repeats: int) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave default)")
    ap.add_argument("--native-threads", type=int, nargs="+", default=[1],
                    help="native kernel thread counts to time (SPECACHE_NATIVE_THREADS)")
    ap.add_argument("--n", type=int, default=7000, help="guide tokens (keys: rounded down to g)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--bits", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--groups", type=int, nargs="+", default=[64, 32])
    ap.add_argument("--queries", type=int, default=6, help="Q = GQA group x new tokens")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--reference", action="store_true", help="also time the slow dequantize references")
    ap.add_argument("--bf16", action="store_true", help="also time the torch kernels with bf16 codes")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    h, d, nq = 3, 64, args.queries
    have_native = native.native_available()
    nat_threads = args.native_threads if have_native else []
    print(f"torch {torch.__version__}, torch threads {torch.get_num_threads()}, native "
          f"{'threads ' + ','.join(map(str, nat_threads)) if have_native else 'unavailable: ' + str(native.native_error())}"
          f", H_kv={h} D={d} Q={nq}, median of {args.repeats}, microseconds per layer; load average {load()}")
    cols = [f"native x{t}" for t in nat_threads] + ["torch fp32"] + (["torch bf16"] if args.bf16 else []) \
        + (["reference"] if args.reference else []) + ["dense fp32"]
    hdr = f"{'kernel':<8} {'bits':>4} {'g':>3} {'B':>2} {'n':>5} | " + " ".join(f"{c:>10}" for c in cols)
    print(hdr)
    print("-" * len(hdr))
    for b in args.batch:
        for bits in args.bits:
            for g in args.groups:
                nk = args.n // g * g
                k = torch.randn(b, h, nk, d)
                v = torch.randn(b, h, args.n, d)
                q = torch.randn(b, h, nq, d)
                p = torch.softmax(torch.randn(b, h, nq, args.n), -1)
                qk = quant.quantize_keys(k, bits, g)
                qv = quant.quantize_values(v, bits, g)
                f32 = torch.float32
                rows = [
                    ("scores", nk, lambda: quant.guide_scores(q, qk, nk),
                     lambda dt: quant._torch_scores(q, qk, nk, dt),
                     lambda: quant.guide_scores_reference(q, qk, nk),
                     lambda: torch.matmul(q, k.transpose(-1, -2))),
                    ("values", args.n, lambda: quant.guide_weighted_values(p, qv, args.n),
                     lambda dt: quant._torch_weighted_values(p, qv, args.n, dt),
                     lambda: quant.guide_weighted_values_reference(p, qv, args.n),
                     lambda: torch.matmul(p, v)),
                ]
                for name, n, nat, tor, ref, dense in rows:
                    res = []
                    for t in nat_threads:
                        os.environ[native.ENV_THREADS] = str(t)
                        res.append(median_us(nat, args.repeats))
                    res.append(median_us(lambda: tor(f32), args.repeats))
                    if args.bf16:
                        res.append(median_us(lambda: tor(torch.bfloat16), args.repeats))
                    if args.reference:
                        res.append(median_us(ref, max(3, args.repeats // 3)))
                    res.append(median_us(dense, args.repeats))
                    print(f"{name:<8} {bits:>4} {g:>3} {b:>2} {n:>5} | " + " ".join(f"{x:10.0f}" for x in res),
                          flush=True)
    print(f"load average at the end: {load()}")


if __name__ == "__main__":
    main()
