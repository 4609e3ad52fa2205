"""`bench task`: the job-level quality of summarize and ask, per cache mode and per decoding setting.

- ask: the questions of examples/questions.json (short answers copied from the documents), each asked
  against its documents through the real jobs (engine.jobs.pipeline.ask_many: one shared prefill when
  the document fits the window, map-reduce over sections when it does not); a reply is right when one
  of the known answers is contained in it after `normalise`;
- needle: pass keys at several depths (engine.bench.needle) with the same decoding setting;
- summaries: every summary document through engine.jobs.pipeline.summarize (single or map-reduce):
  whether it repeats a 6-gram of words, distinct-2 / distinct-3, its length, whether --max-tokens cut
  it, and ROUGE-L F1 against the full cache's summary with the same decoding setting.

Decoding labels (``--decoding``): ``greedy`` or dash-joined options ``rp<x>`` repeat penalty,
``nr<n>`` no-repeat n-gram, ``t<x>`` temperature, ``k<n>`` top-k, ``p<x>`` top-p, ``m<x>`` min-p,
e.g. ``rp1.1-nr4`` or ``t0.2-p0.9``. Each row of the table is one (decoding, mode).

The document store of the run lives in a temporary folder: each section's KV is prefilled once per
mode and loaded for the other questions and settings (what `ask` does with the user's store).
"""
from __future__ import annotations

import json
import re
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator, Sequence

from engine.bench.common import EXAMPLES, BenchProgress, BenchResult, ModeSpec, envelope, mean
from engine.bench.needle import NeedleGrid, run_needle
from engine.config import GenerationConfig
from engine.docstore.store import DocStore
from engine.errors import BadArgument
from engine.inputs.documents import load_document
from engine.jobs.pipeline import Result, Runner, ask_many, summarize

QUESTIONS_FILE = EXAMPLES / "questions.json"
SUMMARY_DOCS = ("report.pdf", "long-report.pdf", "texts/federalist.txt", "texts/origin-of-species-introduction.txt")
DECODINGS = "greedy,rp1.1,rp1.3,nr4,rp1.1-nr4,t0.2-p0.9"
REPEAT_N = 6  # a summary "loops" when it repeats a 6-gram of words
_DECODING_OPTION = re.compile(r"^(?P<key>rp|nr|t|k|p|m)(?P<val>\d+(?:\.\d+)?)$")
_DECODING_FIELDS = {"rp": ("repeat_penalty", float), "nr": ("no_repeat_ngram", int), "t": ("temperature", float),
                    "k": ("top_k", int), "p": ("top_p", float), "m": ("min_p", float)}


@dataclass(frozen=True)
class Decoding:
    """One decoding setting: a label and its GenerationConfig (max_tokens replaced per job)."""

    label: str
    config: GenerationConfig


def parse_decoding(label: str, seed: int = 0) -> Decoding:
    """``rp1.1-nr4`` -> Decoding (see the module docstring)."""
    label = label.strip()
    if label == "greedy":
        return Decoding(label, GenerationConfig(seed=seed))
    fields: dict = {}
    for opt in label.split("-"):
        m = _DECODING_OPTION.match(opt)
        if not m:
            raise BadArgument(f"decoding {label!r}: unknown option {opt!r} (use greedy or e.g. rp1.1, nr4, t0.2, "
                              "k40, p0.9, m0.05)")
        name, cast = _DECODING_FIELDS[m.group("key")]
        fields[name] = cast(float(m.group("val"))) if cast is int else cast(m.group("val"))
    return Decoding(label, GenerationConfig(seed=seed, **fields))  # validates the values


def parse_decodings(text: str, seed: int = 0) -> list[Decoding]:
    out, seen = [], set()
    for item in text.split(","):
        if item.strip() and item.strip() not in seen:
            seen.add(item.strip())
            out.append(parse_decoding(item, seed))
    if not out:
        raise BadArgument("--decoding is empty")
    return out


# ---- scoring (pure functions) ---------------------------------------------------------------

def normalise(text: str) -> str:
    """Lower case, every run of non-alphanumerics one space: 'October 27, 1787.' -> 'october 27 1787'."""
    return " ".join(re.sub(r"[^0-9a-z]+", " ", text.lower()).split())


def contains_answer(reply: str, answers: Sequence[str]) -> bool:
    """Whether one of the answers appears in the reply as whole words, after normalisation."""
    padded = f" {normalise(reply)} "
    return any(f" {normalise(a)} " in padded for a in answers if normalise(a))


def words(text: str) -> list[str]:
    return normalise(text).split()


def ngrams(tokens: Sequence[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]


def repeats_ngram(tokens: Sequence[str], n: int = REPEAT_N) -> bool:
    """Whether some n-gram occurs twice."""
    grams = ngrams(tokens, n)
    return len(set(grams)) < len(grams)


def distinct(tokens: Sequence[str], n: int) -> float | None:
    """Distinct-n: unique n-grams / n-grams (None for a text shorter than n)."""
    grams = ngrams(tokens, n)
    return len(set(grams)) / len(grams) if grams else None


def rouge_l(candidate: Sequence[str], reference: Sequence[str]) -> float:
    """ROUGE-L F1 of two word lists (longest common subsequence)."""
    if not candidate or not reference:
        return float(candidate == reference)
    prev = [0] * (len(reference) + 1)
    for a in candidate:
        cur = [0]
        for j, b in enumerate(reference):
            cur.append(prev[j] + 1 if a == b else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    p, r = lcs / len(candidate), lcs / len(reference)
    return 2 * p * r / (p + r)


# ---- the questions ---------------------------------------------------------------------------

def load_questions(path: Path = QUESTIONS_FILE) -> list[dict]:
    """[{q, answers, docs}] from a questions file (see examples/questions.json)."""
    try:
        items = json.loads(Path(path).read_text(encoding="utf-8"))["questions"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BadArgument(f"{path}: not a questions file ({exc})") from None
    for item in items:
        if not (isinstance(item.get("q"), str) and item.get("answers") and item.get("docs")):
            raise BadArgument(f"{path}: each question needs q, answers and docs: {item}")
    return items


def _result(events) -> Iterator[Result]:
    """The Results of a job generator (progress and text events dropped)."""
    for event in events:
        if isinstance(event, Result):
            yield event


# ---- the bench -------------------------------------------------------------------------------

@dataclass(frozen=True)
class TaskSetup:
    """What the task bench asks and summarizes, beyond the modes and decodings: the questions (asked against
    ask_docs, default every document they name), the documents summarized, the needle texts and grid, the
    answer and summary token budgets, the documents' folder, and doc_chars: every document cut to its first
    doc_chars characters (quick runs on a tiny window)."""

    questions: Sequence[dict]
    summary_docs: Sequence[str]
    needle_texts: Sequence[tuple[str, str]]
    needle: NeedleGrid
    answer_tokens: int = 32
    summary_tokens: int = 256
    root: Path = EXAMPLES
    ask_docs: Sequence[str] | None = None
    doc_chars: int | None = None


@dataclass
class _TaskRun:
    """One run_task's state: the model, its scratch document store, the setup, the questions per document
    asked against and every document's text, the progress, and the records so far."""

    lm: object
    store: DocStore
    setup: TaskSetup
    by_doc: dict[str, list[dict]]
    texts: dict[str, str]
    done: int = 0
    total: int = 0
    asks: list[dict] = field(default_factory=list)
    summaries: list[dict] = field(default_factory=list)


def run_task(lm, modes: Sequence[ModeSpec], decodings: Sequence[Decoding], setup: TaskSetup,
             quick: bool = False) -> Iterator[BenchProgress | BenchResult]:
    """Yields progress, then BenchResult: `rows` (one per decoding x mode), `asks`, `summaries`."""
    t_start = time.perf_counter()
    by_doc, texts = _ask_documents(setup)
    grid = setup.needle
    settings = {"questions": len(setup.questions), "asks_per_mode": sum(map(len, by_doc.values())),
                "documents": sorted(texts), "summary_documents": list(setup.summary_docs),
                "decodings": {d.label: _gen_json(d.config) for d in decodings}, "answer_tokens": setup.answer_tokens,
                "summary_tokens": setup.summary_tokens, "needle_lengths": list(grid.lengths),
                "needle_depths": list(grid.depths), "needles_per_cell": grid.needles, "repeat_n": REPEAT_N,
                "doc_chars": setup.doc_chars}
    result = envelope("task", quick, settings, modes, lm)
    rows = []
    with tempfile.TemporaryDirectory(prefix="specache-task-") as store_dir:
        run = _TaskRun(lm, DocStore(Path(store_dir), max_bytes=None), setup, by_doc, texts,
                       total=len(decodings) * len(modes) * (len(by_doc) + len(setup.summary_docs) + 1))
        for dec in decodings:
            needle_acc = yield from _needle(lm, setup.needle_texts, modes, grid, dec)
            run.done += len(modes)
            for spec in modes:
                yield from _asks(run, spec, dec)
                yield from _summaries(run, spec, dec)
            rows += _rows(dec, modes, run.asks, run.summaries, needle_acc)
    result.update({"rows": rows, "asks": run.asks, "summaries": run.summaries,
                   "seconds": round(time.perf_counter() - t_start, 2)})
    yield BenchResult(result)


def _ask_documents(setup: TaskSetup) -> tuple[dict[str, list[dict]], dict[str, str]]:
    """The questions per document asked against, and the text of every document asked or summarized (cut to
    doc_chars, keeping only the questions whose answer is in the part kept)."""
    by_doc: dict[str, list[dict]] = {}
    for item in setup.questions:
        for doc in item["docs"]:
            if setup.ask_docs is not None and doc not in setup.ask_docs:
                continue
            by_doc.setdefault(doc, []).append(item)
    texts = {doc: load_document(str(setup.root / doc)).text[:setup.doc_chars]
             for doc in sorted(set(by_doc) | set(setup.summary_docs))}
    if setup.doc_chars is not None:  # only the questions whose answer is in the part kept
        by_doc = {d: [i for i in items if contains_answer(texts[d], i["answers"])] for d, items in by_doc.items()}
        by_doc = {d: items for d, items in by_doc.items() if items}
    return by_doc, texts


def _asks(run: _TaskRun, spec: ModeSpec, dec: Decoding) -> Iterator[BenchProgress]:
    """Every document's questions with this mode and decoding, into run.asks."""
    for doc, items in run.by_doc.items():
        t0 = time.perf_counter()
        runner = Runner(run.lm, spec.config, replace(dec.config, max_tokens=run.setup.answer_tokens), store=run.store,
                        policy=spec.cls)
        replies = list(_result(ask_many(runner, run.texts[doc], doc, [i["q"] for i in items])))
        for item, reply in zip(items, replies):
            run.asks.append({"decoding": dec.label, "mode": spec.label, "doc": doc, "q": item["q"],
                             "answers": item["answers"], "reply": reply.text, "strategy": reply.strategy,
                             "right": contains_answer(reply.text, item["answers"])})
        run.done += 1
        right = sum(a["right"] for a in run.asks[-len(items):])
        yield BenchProgress(f"ask {dec.label} {spec.label} {doc}: {right}/{len(items)} right "
                            f"({replies[0].strategy}, {time.perf_counter() - t0:.1f} s)", run.done, run.total)


def _summaries(run: _TaskRun, spec: ModeSpec, dec: Decoding) -> Iterator[BenchProgress]:
    """Every summarized document with this mode and decoding, into run.summaries."""
    for doc in run.setup.summary_docs:
        t0 = time.perf_counter()
        runner = Runner(run.lm, spec.config, replace(dec.config, max_tokens=run.setup.summary_tokens),
                        store=run.store, policy=spec.cls)
        res = next(_result(summarize(runner, run.texts[doc], doc)))
        w = words(res.text)
        run.summaries.append({"decoding": dec.label, "mode": spec.label, "doc": doc, "text": res.text,
                              "strategy": res.strategy, "finish_reason": res.finish_reason,
                              "words": len(w), "tokens": res.generated_tokens,
                              "repeats_6gram": repeats_ngram(w), "distinct_2": distinct(w, 2),
                              "distinct_3": distinct(w, 3), "seconds": round(time.perf_counter() - t0, 2)})
        run.done += 1
        yield BenchProgress(f"summary {dec.label} {spec.label} {doc}: {len(w)} words, repeated 6-gram: "
                            f"{'yes' if run.summaries[-1]['repeats_6gram'] else 'no'} "
                            f"({time.perf_counter() - t0:.1f} s)", run.done, run.total)


def _gen_json(gen: GenerationConfig) -> dict:
    return {k: getattr(gen, k) for k in ("temperature", "top_k", "top_p", "min_p", "repeat_penalty",
                                         "no_repeat_ngram", "seed")}


def _needle(lm, texts, modes, grid: NeedleGrid, dec: Decoding):
    """Run the needle bench with this decoding; forward its progress; return accuracy per mode label."""
    if not grid.lengths:
        return {}
    for event in run_needle(lm, texts, modes, grid, decoding=dec.config):
        if isinstance(event, BenchProgress):
            yield BenchProgress(f"{dec.label}: {event.message}")
        elif isinstance(event, BenchResult):
            return {label: e["accuracy"] for label, e in event.data["per_mode"].items()}
    return {}


def _rows(dec: Decoding, modes: Sequence[ModeSpec], asks: list[dict], summaries: list[dict],
          needle_acc: dict) -> list[dict]:
    """One table row per mode for this decoding setting."""
    full = next((m.label for m in modes if m.mode == "full"), None)
    ref = {s["doc"]: words(s["text"]) for s in summaries if s["decoding"] == dec.label and s["mode"] == full}
    rows = []
    for spec in modes:
        mine = [a for a in asks if a["decoding"] == dec.label and a["mode"] == spec.label]
        single = [a["right"] for a in mine if a["strategy"] == "single"]
        mapred = [a["right"] for a in mine if a["strategy"] != "single"]
        sums = [s for s in summaries if s["decoding"] == dec.label and s["mode"] == spec.label]
        rows.append({
            "decoding": dec.label, "mode": spec.label,
            "ask_accuracy": mean([float(r) for r in single + mapred]),
            "ask_single": mean([float(r) for r in single]), "ask_single_n": len(single),
            "ask_map_reduce": mean([float(r) for r in mapred]), "ask_map_reduce_n": len(mapred),
            "needle": needle_acc.get(spec.label),
            "summaries": len(sums),
            "repeated_6gram_share": mean([float(s["repeats_6gram"]) for s in sums]),
            "distinct_2": mean([s["distinct_2"] for s in sums]), "distinct_3": mean([s["distinct_3"] for s in sums]),
            "words": mean([float(s["words"]) for s in sums]),
            "cut_by_length_share": mean([float(s["finish_reason"] == "length") for s in sums]),
            "rouge_l_vs_full": mean([rouge_l(words(s["text"]), ref[s["doc"]]) for s in sums if s["doc"] in ref]),
        })
    return rows


COLUMNS = (("decoding", "decoding"), ("mode", "mode"), ("ask_single", "ask (fits)"),
           ("ask_map_reduce", "ask (map-reduce)"), ("needle", "needle"),
           ("repeated_6gram_share", "summaries with a repeated 6-gram"), ("distinct_2", "distinct-2"),
           ("distinct_3", "distinct-3"), ("words", "summary words"), ("cut_by_length_share", "cut by --max-tokens"),
           ("rouge_l_vs_full", "ROUGE-L vs full"))


def cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.0f}" if abs(value) >= 10 else f"{value:.2f}"
    return str(value)


def task_markdown(result: dict) -> str:
    """The table of rows, then every summary that repeats a 6-gram and every wrong answer."""
    s = result["settings"]
    model = result.get("environment", {}).get("model", "?")
    model = model.get("name", "?") if isinstance(model, dict) else model
    lines = [f"# Task bench: ask, needle, summary health{' (quick)' if result.get('quick') else ''}\n",
             f"- model: {model}; questions: {s['questions']} ({s['asks_per_mode']} asks per mode and "
             f"decoding); summaries of {', '.join(s['summary_documents'])}; needle lengths {s['needle_lengths']} "
             f"depths {s['needle_depths']}; answer tokens {s['answer_tokens']}, summary tokens {s['summary_tokens']}; "
             f"{result.get('seconds', 0):.0f} s\n",
             "| " + " | ".join(h for _, h in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in result["rows"]:
        lines.append("| " + " | ".join(cell(row[k]) for k, _ in COLUMNS) + " |")
    loops = [x for x in result["summaries"] if x["repeats_6gram"]]
    if loops:
        lines.append("\n## Summaries that repeat a 6-gram\n")
        lines += [f"- {x['decoding']} / {x['mode']} / {x['doc']}: {x['text'][:400]!r}" for x in loops]
    wrong = [a for a in result["asks"] if not a["right"]]
    if wrong:
        lines.append("\n## Wrong answers\n")
        lines += [f"- {a['decoding']} / {a['mode']} / {a['doc']}: {a['q']} (want {a['answers'][0]!r}) -> "
                  f"{a['reply'][:160]!r}" for a in wrong]
    return "\n".join(lines) + "\n"
