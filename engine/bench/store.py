"""Bench of the persistent document KV store: time to first token of an `ask` whose
document is in the store against a cold `ask`, and the store's on-disk bytes per token against
a 16-bit full cache. Runs in a temporary store folder (the user's store is never touched).
Per mode: a cold ask without a store, a first ask with the store (a miss: prefill + write),
then asks with other questions (hits; the median of three is reported)."""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from engine.config import CacheConfig, GenerationConfig
from engine.docstore.store import DocStore
from engine.generate.engine import Engine, Finished, Tokens
from engine.generate.prefixes import DocStoreUse
from engine.inputs import prompts as P
from engine.kvcache.base import ModelShape
from engine.kvcache.sizes import kv_bytes_per_token
from engine.plan.profiles import model_defaults


def first_token_seconds(lm, cache, gen, text: str, question: str, store) -> tuple[float, object]:
    """Seconds from building an ask prompt to its first generated token, and the Finished event."""

    t0 = time.perf_counter()
    prompt = P.build_prompt(lm.tokenizer, text, P.ASK.format(question=question))
    use = DocStoreUse(store, lm.fingerprint, model_name=lm.name) if store is not None else None
    first = None
    for event in Engine(lm.model, cache, use).generate([prompt.ids], gen, prefixes=[len(prompt.prefix)],
                                                        labels=["bench"]):
        if isinstance(event, Tokens) and first is None:
            first = time.perf_counter() - t0
        elif isinstance(event, Finished):
            return first, event
    raise RuntimeError("generate ended without a result")


def run_store_bench(lm, doc, modes: list[str], max_tokens: int = 8) -> dict:
    """Measure cold vs stored time to first token per cache mode; returns the JSON report."""
    import torch

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
    for mode in modes:
        cache = CacheConfig(mode=mode, **model_defaults(lm))
        gen = GenerationConfig(max_tokens=max_tokens, stop_ids=P.stop_ids(lm.tokenizer))
        with tempfile.TemporaryDirectory(prefix="specache-bench-store-") as tmp:
            store = DocStore(Path(tmp) / "kv")
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
    return report
