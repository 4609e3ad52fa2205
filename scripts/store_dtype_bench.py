"""The exact store's element type (--store-dtype) side by side in one process: decode time and fidelity.

The full cache generates the reference (N greedy tokens and the distribution before each) on the summarize
prompt of a long document; then specache with each store dtype is teacher-forced on those tokens, the settings'
steps interleaved (one step of each in turn, so that a machine shared with other work slows them alike). Per
setting: prefill seconds, decode ms/token (median and mean of the steps after the first), top-1 agreement and
KL(full || setting). Peak RSS needs a process per setting: `/usr/bin/time -v specache summarize ...
--store-dtype X`.

    python scripts/store_dtype_bench.py [--doc examples/texts/federalist.txt] [--context 7000] [--tokens 64]
        [--threads 2] [--dtypes fp32,bf16,fp16] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.bench.common import load_texts
from engine.bench.fidelity import compare_distributions, fit_prompt, free_run
from engine.config import CacheConfig
from engine.generate.engine import Engine
from engine.inputs.prompts import stop_ids
from engine.model.loading import load_model
from engine.plan.profiles import model_defaults


def interleaved(model, prompt: list[int], forced: list[int], configs: dict[str, CacheConfig]) -> dict:
    """Teacher-force every config on `forced`, one step of each in turn. -> {name: (prefill s, [step s], logps)}."""
    runs = {name: Engine(model, config).teacher_forced(prompt, forced) for name, config in configs.items()}
    out = {name: [0.0, [], []] for name in configs}
    for i in range(len(forced)):
        for name, run in runs.items():
            t0 = time.perf_counter()
            logits = next(run)
            dt = time.perf_counter() - t0
            if i == 0:
                out[name][0] = dt  # the prefill and the first step
            else:
                out[name][1].append(dt)
            out[name][2].append(torch.log_softmax(logits.float(), -1))
    for run in runs.values():
        run.close()
    return {name: (p, steps, torch.stack(logps)) for name, (p, steps, logps) in out.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--doc", default="examples/texts/federalist.txt")
    p.add_argument("--context", type=int, default=7000)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtypes", default="fp32,bf16,fp16")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    lm = load_model(None, device="cpu", dtype="auto")  # what summarize runs: fp32, bf16 prefill where native
    (source, text), = load_texts([args.doc])
    prompt, _ = fit_prompt(lm.tokenizer, text, args.context)
    spec = CacheConfig().with_overrides(**model_defaults(lm))
    with torch.inference_mode():
        ref_tokens, ref, _ = free_run(lm.model, prompt, CacheConfig(mode="full"), args.tokens, stop_ids(lm.tokenizer))
        configs = {d: spec.with_overrides(store_dtype=d) for d in args.dtypes.split(",")}
        runs = interleaved(lm.model, prompt, ref_tokens, configs)
    rows = []
    for name, (prefill, steps, logps) in runs.items():
        rows.append({"store_dtype": name, "prompt_tokens": len(prompt), "prefill_s": round(prefill, 2),
                     "decode_ms_median": round(1e3 * statistics.median(steps), 2),
                     "decode_ms_mean": round(1e3 * statistics.fmean(steps), 2), **compare_distributions(ref, logps)})
    print(f"{Path(source).name}, {len(prompt)} prompt tokens, {len(ref_tokens)} forced, {args.threads} threads")
    print("| store | prefill s | decode ms/token (median) | (mean) | top-1 vs full | mean KL | max KL |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['store_dtype']} | {r['prefill_s']} | {r['decode_ms_median']} | {r['decode_ms_mean']} | "
              f"{r['top1_agreement']:.3f} | {r['mean_kl']:.5f} | {r['max_kl']:.4f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
