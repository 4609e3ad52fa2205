"""Fidelity of the compute dtypes against the exact fp32 full cache (what `--dtype` chooses).

`specache bench fidelity` compares cache modes within one loaded model; this compares dtypes.
Per document (the summarize prompt, cut to fit the window as `bench fidelity` does) the exact
fp32 model with the full cache generates the reference: N greedy tokens and the distribution
before each. Then, teacher-forced on those tokens (engine.bench.fidelity.forced_logps), each
setting's distributions are compared with it (top-1 agreement, mean KL(ref || setting)):

    fp32          the exact reference path (--dtype float32), full and the default specache
    auto          fp32, prefill linears and attention in bf16 (what --dtype auto picks on a CPU with
                  native bf16: oneDNN bf16 linears, the native bf16 attention kernel)
    bf16          the model in bf16 (--dtype bfloat16): weights, activations, K/V and the store,
                  prefill attention by the same kernel

and bf16 specache is also compared with the bf16 full cache. One model load; the bf16 settings
run last (the model is converted in place).

    python scripts/fidelity_dtype.py [--doc examples/report.pdf ...] [--tokens 64] [--threads N] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.bench.common import default_doc, load_texts
from engine.bench.fidelity import compare_distributions, fit_prompt, forced_logps, free_run
from engine.config import CacheConfig
from engine.inputs.prompts import stop_ids
from engine.model.loading import load_model, prepare_model, resolve_dtype
from engine.plan.profiles import model_defaults


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--doc", action="append", default=None)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_model(None, device="cpu", dtype="float32")
    texts = load_texts(args.doc or [default_doc("report.pdf")])
    full = CacheConfig(mode="full")
    spec = CacheConfig().with_overrides(**model_defaults(lm))
    stops = stop_ids(lm.tokenizer)
    budget = lm.max_context - args.tokens - 4
    rows = []
    for source, text in texts:
        prompt, _ = fit_prompt(lm.tokenizer, text, budget)
        t0 = time.perf_counter()
        with torch.inference_mode():
            ref_tokens, ref, _ = free_run(lm.model, prompt, full, args.tokens, stops)
        print(f"{source}: {len(prompt)} prompt tokens, reference {len(ref_tokens)} tokens "
              f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
        logps = {}
        for setting in ("fp32", "auto", "bf16"):
            if setting == "auto":
                prepare_model(lm.model, resolve_dtype("auto", torch.device("cpu"))[1])
            if setting == "bf16":
                prepare_model(lm.model.to(torch.bfloat16), resolve_dtype("bfloat16", torch.device("cpu"))[1])
            for name, config in (("full", full), ("specache", spec)):
                if setting == "fp32" and name == "full":
                    continue  # the reference itself
                t0 = time.perf_counter()
                logps[(setting, name)] = forced_logps(lm.model, prompt, ref_tokens, config)
                row = {"document": source, "setting": setting, "mode": name, "against": "fp32 full",
                       **compare_distributions(ref, logps[(setting, name)])}
                rows.append(row)
                print(f"  {setting} {name} vs fp32 full: top-1 {row['top1_agreement']:.3f}, "
                      f"KL {row['mean_kl']:.4f} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
        row = {"document": source, "setting": "bf16", "mode": "specache", "against": "bf16 full",
               **compare_distributions(logps[("bf16", "full")], logps[("bf16", "specache")])}
        rows.append(row)
        print(f"  bf16 specache vs bf16 full: top-1 {row['top1_agreement']:.3f}, KL {row['mean_kl']:.4f}",
              file=sys.stderr)
        if len(texts) > 1:  # back to the fp32 reference for the next document
            lm = load_model(None, device="cpu", dtype="float32")
    print("| document | setting | mode | against | top-1 | mean KL | max KL |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {Path(r['document']).name} | {r['setting']} | {r['mode']} | {r['against']} | "
              f"{r['top1_agreement']:.3f} | {r['mean_kl']:.4f} | {r['max_kl']:.3f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"tokens": args.tokens, "spec": spec.__dict__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
