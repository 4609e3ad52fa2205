"""`specache bench decode`: decode ms per step of several modes measured side by side.

Every mode (and ``hf``: stock transformers, i.e. DynamicCache, SDPA attention and plain
nn.Linear, stepped the way ``generate`` steps it: one forward per token, greedy) gets the same prompts and its own
prefilled cache; then the modes take turns, `burst` steps each, `repeats` times, and the
median of each mode's bursts is reported, in ms per token of a row (a step gives each row one
token; exact mode's step is a whole cycle of drafts and one verification, so its burst's time is
divided by the tokens it gave; its rows carry the cycle figures under "exact"). A load change on a shared machine then hits all
modes alike, which a one-mode-after-another bench (`bench speed`) cannot promise; the
ratios against full and against hf are the point of this bench.
"""
from __future__ import annotations

import statistics
import time
from typing import Iterator, Sequence

import torch

from engine.bench.common import (HF_MODE, BenchProgress, BenchResult, ModeSpec, encode, envelope, stock_transformers,
                                 target)
from engine.bench.speed import make_prompts
from engine.config import GAMMA_MAX
from engine.generate.engine import Engine
from engine.generate.steps import decode_headroom, exact_cycles, greedy, sync

TARGET_VS_FULL = 1.5
TARGET_VS_HF = 2.5
TARGET_EXACT_VS_FULL = 1.3


def engine_steps(model, config, prompts: list[list[int]], extra: int, figures: dict | None = None) -> Iterator[float]:
    """Prefill a cache for `prompts`, then yield after each decode step of the engine's loop the
    tokens it gave each row (1; exact mode: a step is a cycle, its mean new tokens per row, and
    `figures` follows the cache's exact-mode figures)."""
    engine = Engine(model, config)
    exact = engine.policy.verifies  # draft-and-verify cycles (exact)
    room = extra * (GAMMA_MAX + 1) + decode_headroom(engine.policy) if exact else extra
    with engine.new_cache(len(prompts), max(map(len, prompts)) + room + 4) as cache:
        lasts = [list(engine.prefill(cache, p, row))[-1] for row, p in enumerate(prompts)]
        if exact:
            loop = exact_cycles(model, cache, torch.stack(lasts), greedy, history=prompts)
            next(loop)  # the first token comes from the prefill logits (no model call)
            for emitted, _ in loop:
                if figures is not None:
                    figures.update(cache.decode_stats)
                yield sum(map(len, emitted)) / len(prompts)
            return
        loop = engine.steps(cache, torch.stack(lasts), greedy, history=prompts)
        next(loop)
        for _ in loop:
            yield 1.0


def hf_steps(model, prompts: list[list[int]], chunk: int = 512) -> Iterator[float]:
    """Stock transformers (DynamicCache, SDPA, nn.Linear): chunked prefill, then one greedy forward per token."""
    from transformers import DynamicCache

    dev = next(model.parameters()).device
    ids = torch.tensor(prompts, device=dev)
    cache = DynamicCache(config=model.config)
    with stock_transformers(model):
        for s in range(0, ids.shape[1], chunk):
            logits = model(ids[:, s: s + chunk], cache=cache, use_cache=True).logits[:, -1]
    while True:
        token = logits.argmax(-1, keepdim=True)
        with stock_transformers(model):
            logits = model(token, cache=cache, use_cache=True).logits[:, -1]
        yield 1.0


@torch.inference_mode()
def run_decode(lm, texts, modes: Sequence[ModeSpec], length: int, batches: Sequence[int], burst: int, repeats: int,
               quick: bool) -> Iterator[BenchProgress | BenchResult]:
    """Interleaved decode timing per batch size; see the module docstring."""

    corpus = [t for _, text in texts for t in encode(lm.tokenizer, text)]
    settings = {"length": length, "batches": list(batches), "burst": burst, "repeats": repeats,
                "documents": [name for name, _ in texts]}
    result = envelope("decode", quick, settings, modes, lm)
    dev = lm.device
    t_start = time.perf_counter()
    rows = []
    total = len(batches) * (len(modes) + repeats)
    done = 0
    for batch in batches:
        prompts = make_prompts(corpus, length, batch)
        steppers = {}
        figures: dict[str, dict] = {spec.label: {} for spec in modes
                                    if spec.cls is not None and spec.cls.verifies}
        for spec in modes:
            t0 = time.perf_counter()
            it = hf_steps(lm.model, prompts) if spec.mode == HF_MODE else \
                engine_steps(lm.model, spec.config, prompts, burst * repeats + 2, figures.get(spec.label))
            next(it)  # prefill and one step (warm-up)
            steppers[spec.label] = it
            done += 1
            yield BenchProgress(f"decode batch {batch}: {spec.label} prefilled ({time.perf_counter() - t0:.1f} s)",
                                done, total)
        times: dict[str, list[float]] = {label: [] for label in steppers}
        for r in range(repeats):
            for label, it in steppers.items():
                sync(dev)
                t = time.perf_counter()
                tokens = 0.0
                for _ in range(burst):
                    tokens += next(it)
                sync(dev)
                times[label].append((time.perf_counter() - t) / tokens * 1000)  # ms per token of a row
            done += 1
            yield BenchProgress(f"decode batch {batch}: round {r + 1}/{repeats}", done, total)
        for it in steppers.values():
            it.close()
        med = {label: statistics.median(v) for label, v in times.items()}
        full = next((m.label for m in modes if m.mode == "full"), None)
        hf = next((m.label for m in modes if m.mode == HF_MODE), None)
        for spec in modes:
            ms = med[spec.label]
            rows.append({"mode": spec.label, "batch": batch, "ms_per_step": round(ms, 2),
                         "ms_per_step_all": [round(x, 2) for x in times[spec.label]],
                         "tokens_per_s": round(batch * 1000 / ms, 2),
                         "speedup_vs_full": round(med[full] / ms, 3) if full else None,
                         "speedup_vs_hf": round(med[hf] / ms, 3) if hf else None,
                         **({"exact": figures[spec.label]} if spec.label in figures else {})})
    result["rows"] = rows
    result["targets"] = targets(rows, modes, batches)
    result["seconds"] = round(time.perf_counter() - t_start, 2)
    yield BenchResult(result)


def targets(rows: list[dict], modes: Sequence[ModeSpec], batches: Sequence[int]) -> list[dict]:
    out = []
    for exact in (m for m in modes if m.mode == "exact"):  # the target: exact within 1.3x of full per token
        for batch in batches:
            v = next(r for r in rows if r["mode"] == exact.label and r["batch"] == batch)["speedup_vs_full"]
            if v is not None:
                out.append(target(f"{exact.label} decode vs full, batch {batch}", f">= {TARGET_EXACT_VS_FULL}x", v,
                                  v >= TARGET_EXACT_VS_FULL))
    spec = next((m for m in modes if m.is_default_specache), None) or next((m for m in modes if m.mode == "specache"), None)
    if spec is None:
        if out:
            return out
        return [target("specache decode speed-up", "measured", None, None, "no specache mode among --modes")]
    for batch in batches:
        row = next(r for r in rows if r["mode"] == spec.label and r["batch"] == batch)
        for key, goal, name in (("speedup_vs_full", TARGET_VS_FULL, "full"),
                                ("speedup_vs_hf", TARGET_VS_HF, "transformers DynamicCache")):
            v = row[key]
            if v is not None:
                out.append(target(f"{spec.label} decode vs {name}, batch {batch}", f">= {goal}x", v, v >= goal))
    return out
