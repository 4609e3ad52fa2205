#!/usr/bin/env python
"""Decode ms/step of several cache modes measured interleaved (robust on a shared, noisy machine).

    .venv/bin/python scripts/bench_decode_interleaved.py --context 6500 --batch 1 --modes full,specache,kivi

Prefills one cache per mode with the same random tokens, then alternates: 3 steps of each mode,
--repeats times; prints the median ms per step and the ratio full/mode (above 1: faster than full).
`specache bench speed` measures more (prefill, RSS, transformers' generate) but one mode after
another, so load changes on a shared machine skew its ratios."""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from engine.config import CacheConfig
from engine.decode import decoder_for, prefill
from engine.kvcache import make_cache
from engine.model import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=6500)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--modes", default="full,specache,kivi")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(None, device="cpu")
    ids = torch.randint(100, 20000, (args.context,), generator=torch.Generator().manual_seed(0)).tolist()
    steps = {}
    for mode in args.modes.split(","):
        config = CacheConfig(mode=mode)
        cache = make_cache(lm.model.config, config, args.batch, args.context + 8 * args.repeats + 16, lm.dtype, lm.device)
        last = [list(prefill(lm.model, cache, ids, row, config.chunk_size))[-1] for row in range(args.batch)]
        it = decoder_for(config)(lm.model, cache, torch.stack(last), lambda logits: logits.argmax(-1))
        next(it), next(it)  # first token and pre-decoding
        steps[mode] = it
    times = {mode: [] for mode in steps}
    for _ in range(args.repeats):
        for mode, it in steps.items():
            t = time.perf_counter()
            for _ in range(3):
                next(it)
            times[mode].append((time.perf_counter() - t) / 3 * 1000)
    med = {mode: statistics.median(v) for mode, v in times.items()}
    base = med.get("full", next(iter(med.values())))
    result = {"context": args.context, "batch": args.batch, "threads": args.threads,
              "ms_per_step": {m: round(v, 1) for m, v in med.items()},
              "speedup_vs_full": {m: round(base / v, 2) for m, v in med.items()}}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
