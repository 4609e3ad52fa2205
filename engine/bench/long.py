"""`bench long`: the cache modes (and llama.cpp, when it is installed) over long contexts of a real text:
prefill tok/s, decode ms/token, peak RSS, top-1 / KL against the full cache and pass-keys at a few depths,
per context length.

Each (mode, length) point runs in a child process of its own (engine/bench/long_point.py) so its peak
RSS is its own. Per length, the prompt is the summary instruction over the text's first tokens (the
documents joined, repeated when short) in the model's chat template, `length` tokens in all; the full
cache runs first and its greedy tokens are the reference the other modes are teacher-forced on. The
pass-key prompts are the needle bench's (engine/bench/needle.py): a 5-digit key planted at each depth
of a prompt of the same length. A length the model's window cannot hold with the answer tokens is
skipped, and the result says so. llama.cpp (engine/bench/llama_cpp.py) prefills the same text's raw
tokens and decodes as many tokens; it has no reference or pass-key figures.
"""
from __future__ import annotations

import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

from engine.bench.common import BenchProgress, BenchResult, ModeSpec, encode, envelope, target
from engine.bench.llama_cpp import available, run_llama_cpp
from engine.bench.needle import QUESTION, build_needle_prompt, passkey
from engine.bench.speed import ChildModel, run_child
from engine.errors import BadArgument
from engine.inputs.prompts import SUMMARIZE, build_prompt, stop_ids

DEFAULT_LENGTHS = (4096, 8192, 16384, 32768)
QUICK_LENGTHS = (512, 2048, 8192)
PASSKEY_TOKENS = 12
MARGIN = 8  # tokens kept free beyond the answer's (the chat template's closing, rounding of the cut text)
LLAMA_CPP = "llama.cpp"
TARGET_FLAT, TARGET_TOP1, TARGET_KL, TARGET_VS_LLAMA = 1.5, 0.97, 0.02, 4.0


@dataclass(frozen=True)
class LongGrid:
    """The points: context lengths, pass-key depths, decode tokens per point, the keys' seed."""

    lengths: Sequence[int]
    depths: Sequence[float]
    tokens: int = 64
    seed: int = 0


@dataclass(frozen=True)
class LlamaCppRun:
    """llama.cpp beside the modes: the folder where node-llama-cpp is installed (None: not asked for),
    the model's GGUF file (None: it has none) and the threads to give it."""

    folder: str | None
    gguf: Path | None
    threads: int


def split_lengths(lengths: Sequence[int], window: int, tokens: int) -> tuple[list[int], list[dict]]:
    """The lengths that fit the window with the answer tokens, ascending; the others with the reason."""
    limit = window - max(tokens, PASSKEY_TOKENS) - MARGIN
    fit = sorted({n for n in lengths if n <= limit})
    skipped = [{"length": n, "reason": f"beyond the model's window {window} minus {window - limit} answer tokens"}
               for n in lengths if n > limit]
    return fit, skipped


def summary_prompt(tokenizer, corpus: list[int], length: int) -> tuple[list[int], str]:
    """The summary prompt of about `length` tokens over the corpus's first tokens, and its document text."""
    overhead = len(build_prompt(tokenizer, "", SUMMARIZE).ids) + 2
    ids = corpus
    while len(ids) < length:
        ids = ids + corpus
    doc = tokenizer.decode(ids[:max(1, length - overhead)])
    return build_prompt(tokenizer, doc, SUMMARIZE).ids, doc


def passkey_prompts(tokenizer, corpus: list[int], length: int, grid: LongGrid) -> list[dict]:
    """One pass-key prompt of `length` tokens per depth (the key from the seed, length and depth)."""
    out = []
    for depth in grid.depths:
        p = build_needle_prompt(tokenizer, corpus, length, depth, passkey(grid.seed, length, depth, 0))
        out.append({"depth": depth, "key": p["key"], "ids": p["ids"],
                    "needle_depth": round(p["needle_token"] / len(p["ids"]), 4)})
    return out


def order(modes: Sequence[ModeSpec]) -> list[ModeSpec]:
    """The modes with the reference (the first full cache) first."""
    full = next((m for m in modes if m.mode == "full"), None)
    return ([full] if full else []) + [m for m in modes if m is not full]


def run_long(lm, texts: Sequence[tuple[str, str]], modes: Sequence[ModeSpec], grid: LongGrid, child: ChildModel,
             llama: LlamaCppRun, quick: bool = False) -> Iterator[BenchProgress | BenchResult]:
    """Yields progress (a line per skipped length and per point), then BenchResult (docs/bench.md)."""
    t_start = time.perf_counter()
    lengths, skipped = split_lengths(grid.lengths, lm.max_context, grid.tokens)
    for s in skipped:
        yield BenchProgress(f"long: {s['length']} tokens skipped: {s['reason']}")
    if not lengths:
        raise BadArgument(f"no --lengths fit the model's window {lm.max_context} with "
                          f"{max(grid.tokens, PASSKEY_TOKENS) + MARGIN} answer tokens")
    corpus = encode(lm.tokenizer, "\n\n".join(t for _, t in texts))
    if not corpus:
        raise BadArgument("the documents have no text")
    why_not = available(llama.folder, llama.gguf)
    if why_not and llama.folder is not None:
        yield BenchProgress(f"long: llama.cpp skipped: {why_not}")
    modes = order(modes)
    settings = {"documents": [s for s, _ in texts], "corpus_tokens": len(corpus), "lengths": lengths,
                "requested_lengths": list(grid.lengths), "skipped": skipped, "depths": list(grid.depths),
                "decode_tokens": grid.tokens, "passkey_tokens": PASSKEY_TOKENS, "seed": grid.seed,
                "instruction": SUMMARIZE, "question": QUESTION, "isolated": True,
                "llama_cpp": {"folder": llama.folder, "ran": why_not is None, "note": why_not,
                              "threads": llama.threads}}
    result = envelope("long", quick, settings, modes, lm)
    with tempfile.TemporaryDirectory(prefix="specache-bench-long-") as tmp:
        run = LongRun(lm, corpus, modes, grid, child, llama if why_not is None else None, Path(tmp),
                      len(lengths) * (len(modes) + (why_not is None)))
        for length in lengths:
            yield from length_points(run, length)
    points = result["points"] = run.points
    result["targets"] = targets(points, modes, lengths, why_not is None)
    result["seconds"] = round(time.perf_counter() - t_start, 2)
    yield BenchResult(result)


@dataclass
class LongRun:
    """What the points of a run share (llama None: llama.cpp does not run), and the points measured so far."""

    lm: object
    corpus: list[int]
    modes: Sequence[ModeSpec]
    grid: LongGrid
    child: ChildModel
    llama: LlamaCppRun | None
    tmp: Path  # where the full cache's reference of each length is kept for the other modes
    total: int  # points in all, for the progress count
    points: list[dict] = field(default_factory=list)


def length_points(run: LongRun, length: int):
    """Every mode's point at one length (each in its own child process), then llama.cpp's; appended to
    run.points. Yields a progress line per point (and the child's own)."""
    lm, modes, grid, child, points, total = run.lm, run.modes, run.grid, run.child, run.points, run.total
    prompt, doc = summary_prompt(lm.tokenizer, run.corpus, length)
    passkeys = passkey_prompts(lm.tokenizer, run.corpus, length, grid)
    reference = run.tmp / f"reference-{length}.pt"
    full = next((m for m in modes if m.mode == "full"), None)
    forced = None
    for spec in modes:
        t0 = time.perf_counter()
        job = {"model": child.source, "device": child.device, "dtype": child.dtype, "threads": child.threads,
               "mode": spec.label, "config": asdict(spec.config), "prompt": prompt, "tokens": grid.tokens,
               "forced": forced if spec is not full else None,
               "save_reference": str(reference) if spec is full else None,
               "reference": str(reference) if full is not None else None,
               "passkeys": passkeys, "passkey_tokens": PASSKEY_TOKENS, "stops": list(stop_ids(lm.tokenizer))}
        point = None
        for item in run_child(job, "engine.bench.long_point"):
            if isinstance(item, str):
                yield BenchProgress(f"long {spec.label} {length} tokens: {item}", len(points), total)
            else:
                point = item
        tokens = point.pop("tokens", None)
        if spec is full:
            forced = tokens
        points.append({"mode": spec.label, "length": length, **point, "seconds": round(time.perf_counter() - t0, 2)})
        yield BenchProgress(point_line(points[-1]), len(points), total)
    if run.llama is not None:
        t0 = time.perf_counter()
        other = run_llama_cpp(run.llama.folder, run.llama.gguf, doc, grid.tokens, run.llama.threads)
        points.append({"mode": LLAMA_CPP, "length": length, **other, "seconds": round(time.perf_counter() - t0, 2)})
        yield BenchProgress(point_line(points[-1]), len(points), total)
    compare_passkeys(points, length, full.label if full else None)


def point_line(p: dict) -> str:
    """A point's progress line: its speed, memory, fidelity and pass-keys."""
    if p.get("error"):
        return f"long {p['mode']} {p['length']} tokens: failed: {p['error']}"
    line = (f"long {p['mode']} {p['length']} tokens: prefill {p['prefill_tokens_per_s']:.0f} tok/s, decode "
            f"{p['decode_ms_per_token']:.1f} ms/token, peak RSS {p['peak_rss_bytes'] / 2**20:.0f} MiB")
    if p.get("top1_agreement") is not None:
        line += f", top-1 {p['top1_agreement']:.3f}, KL {p['mean_kl']:.4f}"
    if p.get("passkeys"):
        line += f", pass-keys {sum(k['found'] for k in p['passkeys'])}/{len(p['passkeys'])}"
    return f"{line} ({p['seconds']:.1f} s)"


def compare_passkeys(points: list[dict], length: int, full: str | None) -> None:
    """Each point's pass-keys found, and found where the full cache found them (None without full)."""
    here = [p for p in points if p["length"] == length and "passkeys" in p]
    ref = next((p for p in here if p["mode"] == full), None)
    for p in here:
        p["passkeys_found"] = sum(k["found"] for k in p["passkeys"])
        if ref is None:
            p["found_where_full_found"] = None
            continue
        wins = [mine["found"] for theirs, mine in zip(ref["passkeys"], p["passkeys"]) if theirs["found"]]
        p["found_where_full_found"] = sum(wins) / len(wins) if wins else None


def targets(points: list[dict], modes: Sequence[ModeSpec], lengths: list[int], llama: bool) -> list[dict]:
    """Decode flat in the length, fidelity and pass-keys of the default specache setting; against llama.cpp."""
    spec = next((m for m in modes if m.is_default_specache), None) or next((m for m in modes if m.mode == "specache"),
                                                                             None)
    if spec is None:
        return [target("specache over long contexts", "measured", None, None, "no specache mode among --modes")]
    mine = {p["length"]: p for p in points if p["mode"] == spec.label}
    lo, hi = mine[lengths[0]], mine[lengths[-1]]
    ratio = hi["decode_ms_per_token"] / lo["decode_ms_per_token"] if len(lengths) > 1 else None
    top1 = [p["top1_agreement"] for p in mine.values() if p.get("top1_agreement") is not None]
    kl = [p["mean_kl"] for p in mine.values() if p.get("mean_kl") is not None]
    wins = [p["found_where_full_found"] for p in mine.values() if p.get("found_where_full_found") is not None]
    out = [target(f"{spec.label} decode ms/token at {lengths[-1]} / at {lengths[0]}", f"<= {TARGET_FLAT}x", ratio,
                  None if ratio is None else ratio <= TARGET_FLAT, "" if ratio else "one length only"),
           target(f"{spec.label} top-1 against full (lowest)", f">= {TARGET_TOP1}", min(top1, default=None),
                  min(top1) >= TARGET_TOP1 if top1 else None),
           target(f"{spec.label} mean KL against full (highest)", f"<= {TARGET_KL}", max(kl, default=None),
                  max(kl) <= TARGET_KL if kl else None),
           target(f"{spec.label} pass-keys found where full found them", "1.0", min(wins, default=None),
                  min(wins) >= 1.0 if wins else None, "" if wins else "full found none, or no full mode")]
    other = next((p for p in points if p["mode"] == LLAMA_CPP and p["length"] == lengths[-1]), None)
    if llama and other is not None and not other.get("error"):
        speedup = other["decode_ms_per_token"] / hi["decode_ms_per_token"]
        out.append(target(f"{spec.label} decode vs llama.cpp at {lengths[-1]}", f">= {TARGET_VS_LLAMA}x", speedup,
                          speedup >= TARGET_VS_LLAMA))
        out.append(target(f"{spec.label} peak RSS vs llama.cpp at {lengths[-1]}", "<= 1.0x",
                          hi["peak_rss_bytes"] / other["peak_rss_bytes"], hi["peak_rss_bytes"] <= other["peak_rss_bytes"]))
    return out
