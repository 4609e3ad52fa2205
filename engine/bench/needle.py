"""`bench needle`: passkey retrieval from real documents.

A grid of context lengths x needle depths, several needles per cell. Each needle is a
sentence carrying a random 5-digit pass key, planted at a sentence boundary near the
requested depth of a prefix of the real document text (the documents are joined, and
repeated if they are too short); the prompt asks for the key with the model's chat template
and greedy decoding runs in the chosen cache mode. A trial succeeds when the key's digits
appear in the answer. The needles of one cell are one batch; keys depend only on the cell
and the needle index, so every mode sees the same prompts.
"""
from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass, replace
from typing import Iterator, Sequence

from engine.bench.common import BenchProgress, BenchResult, ModeSpec, encode, envelope, mean, target
from engine.config import GenerationConfig
from engine.errors import BadArgument
from engine.generate.engine import Engine, Finished
from engine.inputs.prompts import build_prompt, stop_ids

NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? Answer with the number only."
MIN_DOC_TOKENS = 32


def passkey(seed: int, length: int, depth: float, index: int) -> str:
    rng = random.Random(f"{seed}:{length}:{depth:.4f}:{index}")
    return str(rng.randrange(10000, 100000))


def found(key: str, text: str) -> bool:
    """The key's digits appear, in order and together, among the answer's digits."""
    return key in "".join(re.findall(r"\d", text))


def _snap_to_sentence(before: str, after: str, reach: int = 400) -> tuple[str, str]:
    """Move the split back to the end of a sentence or line within `reach` characters."""
    tail = before[-reach:]
    cut = max(tail.rfind(". "), tail.rfind("\n"))
    if cut < 0:
        return before, after
    cut = len(before) - len(tail) + cut + 1
    return before[:cut], before[cut:] + after


def build_needle_prompt(tokenizer, corpus_ids: list[int], length: int, depth: float, key: str,
                        question: str = QUESTION) -> dict:
    """A prompt of about `length` tokens with the needle at about `depth` of the document part."""
    needle = NEEDLE.format(key=key)
    overhead = len(build_prompt(tokenizer, "", question).ids) + len(encode(tokenizer, needle)) + 4
    n_doc = length - overhead
    if n_doc < MIN_DOC_TOKENS:
        raise BadArgument(f"context length {length} is too short for a needle prompt (needs > {overhead + MIN_DOC_TOKENS})")
    ids = corpus_ids
    while len(ids) < n_doc:  # repeat short corpora
        ids = ids + corpus_ids
    at = int(round(depth * n_doc))
    before = tokenizer.decode(ids[:at])
    after = tokenizer.decode(ids[at:n_doc])
    before, after = _snap_to_sentence(before, after)
    doc = f"{before.rstrip()}\n{needle}\n{after.lstrip()}" if before.strip() else f"{needle}\n{after.lstrip()}"
    prompt = build_prompt(tokenizer, doc, question).ids
    head = build_prompt(tokenizer, doc[: len(before.rstrip())], question).prefix
    return {"ids": prompt, "needle_token": len(head), "key": key}


@dataclass(frozen=True)
class NeedleGrid:
    """The needle bench's cells: context lengths x needle depths, `needles` pass keys per cell (from `seed`)."""

    lengths: Sequence[int]
    depths: Sequence[float]
    needles: int
    seed: int = 0


def run_needle(lm, texts: Sequence[tuple[str, str]], modes: Sequence[ModeSpec], grid: NeedleGrid,
               max_tokens: int = 12, quick: bool = False,
               decoding: GenerationConfig | None = None) -> Iterator[BenchProgress | BenchResult]:
    """Yields progress, then BenchResult (see docs/bench.md for the JSON layout). decoding: the processors
    to decode with (default: greedy, every processor off); its max_tokens and stop ids are replaced."""
    t_start = time.perf_counter()
    lengths, depths, needles, seed = grid.lengths, grid.depths, grid.needles, grid.seed
    tok, model = lm.tokenizer, lm.model
    limit = lm.max_context - max_tokens - 2
    bad = [n for n in lengths if n > limit]
    if bad:
        raise BadArgument(f"--lengths {bad} exceed the model window {lm.max_context} minus {max_tokens + 2} answer tokens")
    corpus_ids = encode(tok, "\n\n".join(t for _, t in texts))
    if not corpus_ids:
        raise BadArgument("the needle documents have no text")
    gen = replace(decoding or GenerationConfig(), max_tokens=max_tokens, stop_ids=stop_ids(tok))

    prompts = {}  # (length, depth) -> list of prompt dicts, the same for every mode
    for length in lengths:
        for depth in depths:
            prompts[(length, depth)] = [build_needle_prompt(tok, corpus_ids, length, depth,
                                                            passkey(seed, length, depth, i)) for i in range(needles)]
    settings = {"documents": [s for s, _ in texts], "corpus_tokens": len(corpus_ids), "lengths": list(lengths),
                "depths": list(depths), "needles_per_cell": needles, "max_tokens": max_tokens, "seed": seed,
                "needle": NEEDLE, "question": QUESTION}
    result = envelope("needle", quick, settings, modes, lm)

    cells, total, done = [], len(modes) * len(prompts), 0
    for spec in modes:
        for (length, depth), items in prompts.items():
            t0 = time.perf_counter()
            fin = next(e for e in Engine(model, spec.config).generate([p["ids"] for p in items], gen)
                       if isinstance(e, Finished))
            trials = []
            for p, out in zip(items, fin.tokens):
                text = tok.decode(out, skip_special_tokens=True)
                trials.append({"key": p["key"], "prompt_tokens": len(p["ids"]), "needle_token": p["needle_token"],
                               "needle_depth": round(p["needle_token"] / len(p["ids"]), 4),
                               "output": text, "output_ids": out, "found": found(p["key"], text)})
            acc = sum(t["found"] for t in trials) / len(trials)
            rows = len(items)
            cells.append({"mode": spec.label, "length": length, "depth": depth, "accuracy": acc, "trials": trials,
                          "device_bytes_per_row": fin.cache_stats.get("device_bytes", 0) // rows,
                          "host_bytes_per_row": fin.cache_stats.get("host_bytes", 0) // rows,
                          "full_fp16_bytes_per_row": fin.cache_stats.get("full_fp16_bytes", 0) // rows,
                          "seconds": round(time.perf_counter() - t0, 3)})
            done += 1
            yield BenchProgress(f"needle {spec.label} {length} tokens depth {depth:g}: "
                                f"{sum(t['found'] for t in trials)}/{rows} found "
                                f"({time.perf_counter() - t0:.1f} s)", done, total)

    result["cells"] = cells
    result.update(summarize(cells, modes, lengths, depths))
    result["seconds"] = round(time.perf_counter() - t_start, 2)
    yield BenchResult(result)


def summarize(cells: list[dict], modes: Sequence[ModeSpec], lengths, depths) -> dict:
    """Accuracy grids, per-mode totals, agreement with full, the issue's targets."""
    by = {(c["mode"], c["length"], c["depth"]): c for c in cells}
    labels = [m.label for m in modes]
    grid = {lab: {str(n): {f"{d:g}": by[(lab, n, d)]["accuracy"] for d in depths} for n in lengths} for lab in labels}
    full = next((m.label for m in modes if m.mode == "full"), None)
    per_mode = {}
    for lab in labels:
        trials = [t for c in cells if c["mode"] == lab for t in c["trials"]]
        entry = {"accuracy": mean([float(t["found"]) for t in trials]), "trials": len(trials),
                 "by_length": {str(n): mean([by[(lab, n, d)]["accuracy"] for d in depths]) for n in lengths},
                 "device_bytes_per_row": {str(n): by[(lab, n, depths[0])]["device_bytes_per_row"] for n in lengths}}
        if full is not None:
            pairs = [(tf, tm) for n in lengths for d in depths
                     for tf, tm in zip(by[(full, n, d)]["trials"], by[(lab, n, d)]["trials"])]
            wins = [tm["found"] for tf, tm in pairs if tf["found"]]
            entry["succeeds_where_full_does"] = mean([float(w) for w in wins]) if wins else None
            entry["full_successes"] = len(wins)
            entry["same_output_as_full"] = mean([float(tf["output_ids"] == tm["output_ids"]) for tf, tm in pairs])
        per_mode[lab] = entry
    return {"accuracy": grid, "per_mode": per_mode, "targets": targets(per_mode, modes)}


def targets(per_mode: dict, modes: Sequence[ModeSpec]) -> list[dict]:
    out = []

    def find(mode: str, bits: int) -> ModeSpec | None:
        return next((m for m in modes if m.mode == mode and m.config.bits == bits), None)

    s1, k1 = find("specache", 1), find("kivi", 1)
    if s1 is not None:
        w = per_mode[s1.label].get("succeeds_where_full_does")
        out.append(target(f"{s1.label} succeeds wherever full does", "1.0 of full's successes", w,
                          None if w is None else w >= 1.0,
                          f"full found {per_mode[s1.label].get('full_successes', 0)} keys"))
    if s1 is not None and k1 is not None:
        a, b = per_mode[s1.label]["accuracy"], per_mode[k1.label]["accuracy"]
        out.append(target(f"{k1.label} (no fetch) measurably worse than {s1.label}", "accuracy gap > 0",
                          round(a - b, 4), a - b > 0, f"{s1.label} {a:.3f} vs {k1.label} {b:.3f}"))
    return out
