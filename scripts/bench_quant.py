"""Micro-benchmark of the guide kernels in engine/quant.py (one layer, decode step).

Times guide_scores (q @ K^T over the packed key guide) and guide_weighted_values
(p @ V over the packed value guide) against dequantize-then-matmul references and a
dense fp32 matmul over already-dequantized data, at SmolLM2-135M sizes (3 KV heads,
head dim 64, GQA group 3 x 2 query tokens -> Q = 6). Prints medians in microseconds.

    python scripts/bench_quant.py [--threads N] [--n 7000] [--batch 1 4] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine import quant  # noqa: E402


def median_us(fn, repeats: int) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave default)")
    ap.add_argument("--n", type=int, default=7000, help="guide tokens (keys: rounded down to g)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--bits", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--groups", type=int, nargs="+", default=[64, 32])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--no-reference", action="store_true", help="skip the slow references")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    h, d, nq = 3, 64, 6
    bf16 = torch.bfloat16
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, H_kv={h} D={d} Q={nq}, "
          f"median of {args.repeats}, microseconds per layer")
    hdr = f"{'kernel':<8} {'bits':>4} {'g':>3} {'B':>2} {'n':>5} | {'reference':>9} {'fast fp32':>9} " \
          f"{'fast bf16':>9} {'dense fp32':>10}"
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
                rows = [
                    ("scores", nk,
                     lambda: quant.guide_scores_reference(q, qk, nk),
                     lambda: quant.guide_scores(q, qk, nk),
                     lambda: quant.guide_scores(q, qk, nk, dtype=bf16),
                     lambda: torch.matmul(q, k.transpose(-1, -2))),
                    ("values", args.n,
                     lambda: quant.guide_weighted_values_reference(p, qv, args.n),
                     lambda: quant.guide_weighted_values(p, qv, args.n),
                     lambda: quant.guide_weighted_values(p, qv, args.n, dtype=bf16),
                     lambda: torch.matmul(p, v)),
                ]
                for name, n, ref, fast, fast_bf16, dense in rows:
                    r = "-" if args.no_reference else f"{median_us(ref, max(3, args.repeats // 3)):9.0f}"
                    print(f"{name:<8} {bits:>4} {g:>3} {b:>2} {n:>5} | {r:>9} "
                          f"{median_us(fast, args.repeats):9.0f} {median_us(fast_bf16, args.repeats):9.0f} "
                          f"{median_us(dense, args.repeats):10.0f}", flush=True)


if __name__ == "__main__":
    main()
