#!/usr/bin/env python
"""Bench of the persistent document KV store: time to first token of an `ask` whose document
is in the store (a second question on the same document) against a cold `ask` (the document
prefilled), and the store's on-disk bytes per token against a 16-bit full cache.

    .venv/bin/python scripts/bench_store.py                      # examples/report.pdf, full + specache
    .venv/bin/python scripts/bench_store.py --modes full --json  # JSON on stdout

Runs in a temporary store folder (the user's store is never touched). Per mode: a cold ask
without a store, then a first ask with the store (a miss: prefill + write), then a second ask
with other questions (hits; the median of three is reported). Time to first token = from building the prompt (tokenizing the
document) to the first generated token, model already loaded and document already read (the
same for every run).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def first_token_seconds(lm, cache, gen, text: str, question: str, store) -> tuple[float, object]:
    """Seconds from building an ask prompt to its first generated token, and the Finished event."""
    from engine import prompts as P
    from engine.decode import Finished, StoreUse, Tokens, generate

    t0 = time.perf_counter()
    prompt = P.build_prompt(lm.tokenizer, text, P.ASK.format(question=question))
    use = StoreUse(store, lm.fingerprint, labels=["bench"], model_name=lm.name) if store is not None else None
    first = None
    for event in generate(lm.model, [prompt.ids], cache, gen, prefixes=[len(prompt.prefix)], store=use):
        if isinstance(event, Tokens) and first is None:
            first = time.perf_counter() - t0
        elif isinstance(event, Finished):
            return first, event
    raise RuntimeError("generate ended without a result")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--doc", default=str(ROOT / "examples" / "report.pdf"))
    parser.add_argument("--model", default=None, help="local HF folder (default: the embedded model)")
    parser.add_argument("--modes", default="full,specache")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import torch

    from engine import prompts as P
    from engine.config import CacheConfig, GenerationConfig
    from engine.documents import load_document
    from engine.kvcache import ModelShape, kv_bytes_per_token
    from engine.model import load_model
    from engine.store import KVStore
    from specache_cli.run_cmds import model_defaults

    lm = load_model(args.model, device=args.device)
    doc = load_document(args.doc)
    shape = ModelShape.from_config(lm.model.config)
    fp16_per_token = kv_bytes_per_token(shape, 2)
    n_tokens = len(lm.tokenizer(doc.text, add_special_tokens=False)["input_ids"])
    print(f"model {lm.name} on {lm.device} ({lm.dtype}); {doc.source}: {n_tokens} tokens; "
          f"torch threads {torch.get_num_threads()}", file=sys.stderr)
    report = {"model": lm.name, "device": str(lm.device), "dtype": str(lm.dtype).replace("torch.", ""),
              "document": doc.source, "document_tokens": n_tokens, "fp16_bytes_per_token": fp16_per_token,
              "modes": {}}
    questions = ("What does the author fear most?", "What is the main recommendation?", "Who wrote the report?",
                 "Which numbers does the report give?")
    for mode in args.modes.split(","):
        cache = CacheConfig(mode=mode, **model_defaults(lm))
        gen = GenerationConfig(max_tokens=args.max_tokens, stop_ids=P.stop_ids(lm.tokenizer))
        with tempfile.TemporaryDirectory(prefix="specache-bench-store-") as tmp:
            store = KVStore(Path(tmp) / "kv")
            cold, cold_fin = first_token_seconds(lm, cache, gen, doc.text, questions[1], None)
            miss, miss_fin = first_token_seconds(lm, cache, gen, doc.text, questions[0], store)
            hits = [first_token_seconds(lm, cache, gen, doc.text, q, store) for q in questions[1:]]
            entry = store.entries()[0]
        hit_fin = hits[0][1]  # the cold run's question
        hit = statistics.median(h for h, _ in hits)
        write_s, load_s = miss_fin.store[0]["seconds"], statistics.median(f.store[0]["seconds"] for _, f in hits)
        assert all(f.store[0]["hit"] for _, f in hits)
        row = {"cold_ttft_s": round(cold, 3), "miss_ttft_s": round(miss, 3), "store_write_s": round(write_s, 3),
               "hit_ttft_s": round(hit, 3), "hit_ttft_runs_s": [round(h, 3) for h, _ in hits], "hit_load_s": round(load_s, 3), "cold_over_hit": round(cold / hit, 1),
               "cold_prefill_s": round(cold_fin.prefill_seconds, 3), "hit_prefill_s": round(statistics.median(f.prefill_seconds for _, f in hits), 3),
               "load_average": [round(x, 2) for x in os.getloadavg()],
               "entry_tokens": entry.tokens, "entry_bytes": entry.bytes,
               "bytes_per_token": round(entry.bytes / entry.tokens, 1),
               "vs_fp16": round(entry.bytes / entry.tokens / fp16_per_token, 3),
               "same_answer_as_cold": hit_fin.tokens == cold_fin.tokens,
               "cache": {k: v for k, v in hit_fin.cache_stats.items() if k in ("bits", "group", "k", "residual", "sinks")}}
        print(f"{mode}: cold {cold:.2f} s, miss (prefill + write {write_s:.2f} s) {miss:.2f} s, hit {hit:.3f} s "
              f"(load {load_s:.3f} s) -> {cold / hit:.1f}x; entry {entry.bytes / 1e6:.1f} MB for {entry.tokens} tokens "
              f"= {entry.bytes / entry.tokens:.0f} B/token ({row['vs_fp16']}x fp16's {fp16_per_token} B/token); "
              f"hit answer == cold answer: {row['same_answer_as_cold']}", file=sys.stderr)
        report["modes"][mode] = row
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
