"""Offline study for issue 26 (phase 1): which guide options rank the exact top-k well at low bits, and
which speculative selection rule covers the next token's own oracle best.

Nothing here changes the engine; it imports engine.* read-only (the model loader, the fidelity bench's
probe and prompt helpers, the quantizers of engine/kvcache/quant.py, the sizing formulas).

  capture  run the full cache (greedy summary, as `bench fidelity`) and the engine's speculative mode
           teacher-forced over it, per document; save exact K/V (post-RoPE) per layer, the exact query
           of every decode position, and the speculative run's queries (output token, speculative
           token), fed ids and fetched sets.  -> <captures>/<doc>.pt
  guide    per guide option x layer x KV head: recall of the exact top-k and attention-mass coverage of
           the chosen set (guide region [S, qend), sinks and residual exact, as engine/kvcache/guided.py
           and the fidelity bench's selection_quality), at several k.
  spec     speculative selection rules from the same captures, against the next token's own oracle.
  e2e      (optional) teacher-forced top-1 / KL of a torch-only reimplementation of guided attention
           (current prefetch) for a few options.

Run:  taskset -c 1 nice -n 10 .venv/bin/python scripts/guide_study.py capture --tokens 128
      taskset -c 1 nice -n 10 .venv/bin/python scripts/guide_study.py guide
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

DOCS = ("examples/report.pdf", "examples/texts/federalist.txt",
        "examples/texts/origin-of-species-introduction.txt")
CAPTURES = Path("/tmp/guide-study-captures")
SINKS, RESIDUAL = 4, 64


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def doc_key(src: str) -> str:
    return Path(src).stem


# ============================================================================ capture

def capture(args) -> None:
    from engine.bench import fidelity
    from engine.config import CacheConfig
    from engine.inputs.documents import load_document
    from engine.inputs.prompts import stop_ids
    from engine.model.loading import load_model

    lm = load_model(None, device="cpu")
    model, tok = lm.model, lm.tokenizer
    budget = lm.max_context - args.tokens - 4
    if args.context:
        budget = min(budget, args.context)
    stops = stop_ids(tok)
    CAPTURES.mkdir(parents=True, exist_ok=True)
    rot = model.model.rotary_emb
    for src in args.docs:
        out = CAPTURES / f"{doc_key(src)}.pt"
        if out.exists() and not args.force:
            log(f"{out} exists")
            continue
        doc = load_document(src)
        text = getattr(doc, "text", doc)
        prompt, truncated = fidelity.fit_prompt(tok, text, budget)
        t0 = time.perf_counter()
        with fidelity.probing(model) as probe:
            ref_tokens, ref_logps, cache = fidelity.free_run(model, prompt, CacheConfig(mode="full"), args.tokens,
                                                             stops)
        n_layers = len(cache.layers)
        length = int(cache.lengths[0])
        keys = torch.stack([cache.layers[i].k[0, :, :length].float().clone() for i in range(n_layers)])
        values = torch.stack([cache.layers[i].v[0, :, :length].float().clone() for i in range(n_layers)])
        q_own = torch.stack([torch.stack([r["q"][:, 0] for r in probe.records[i]]) for i in range(n_layers)])
        starts = [r["start"] for r in probe.records[0]]
        assert starts == list(range(len(prompt), len(prompt) + len(starts))), "reference passes"
        scaling = probe.scaling
        del cache, probe
        log(f"{src}: full reference {len(prompt)} prompt tokens, {len(ref_tokens)} tokens, "
            f"{time.perf_counter() - t0:.1f} s")
        # RoPE tables of every position (to undo / redo the rotation of keys offline)
        pos = torch.arange(length)[None]
        cos, sin = rot(keys.new_zeros(1, 1, keys.shape[-1]), pos)
        t0 = time.perf_counter()
        spec_cfg = CacheConfig(mode="specache", bits=2, group=64, k=512, prefetch="speculative")
        with fidelity.probing(model) as probe:
            spec_logps = fidelity.forced_logps(model, prompt, ref_tokens, spec_cfg)
        spec = {"q": [], "ids": [], "start": [], "fidx": [], "fvalid": []}
        for i in range(n_layers):
            recs = probe.records[i]
            spec["q"].append([r["q"] for r in recs])  # per pass [H, T, D]
            spec["fidx"].append(torch.stack([r["fidx"] for r in recs if "fidx" in r]))
            spec["fvalid"].append(torch.stack([r["fvalid"] for r in recs if "fvalid" in r]))
        spec["ids"] = [r["ids"] for r in probe.records[0]]
        spec["start"] = [r["start"] for r in probe.records[0]]
        spec["n_new"] = [r["n_new"] for r in probe.records[0]]
        spec["cmp"] = fidelity.compare_distributions(ref_logps, spec_logps)
        log(f"{src}: speculative run top-1 {spec['cmp']['top1_agreement']:.3f} KL {spec['cmp']['mean_kl']:.4f}, "
            f"{time.perf_counter() - t0:.1f} s")
        torch.save({"source": src, "prompt": prompt, "truncated": truncated, "ref_tokens": ref_tokens,
                    "ref_logps": ref_logps.half(), "keys": keys, "values": values, "q_own": q_own,
                    "scaling": scaling, "cos": cos[0].float(), "sin": sin[0].float(),
                    "spec": spec}, out)
        log(f"saved {out}")


# ============================================================================ main

def main() -> None:
    torch.set_num_threads(1)
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("capture")
    c.add_argument("--docs", nargs="+", default=list(DOCS))
    c.add_argument("--tokens", type=int, default=128)
    c.add_argument("--context", type=int, default=None)
    c.add_argument("--force", action="store_true")
    args = ap.parse_args()
    {"capture": capture}[args.cmd](args)


if __name__ == "__main__":
    main()
