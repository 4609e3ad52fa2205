"""`specache bench task` (job-level quality per cache mode and decoding) and `specache bench heatmap` (the
needle heatmap redrawn from a result); registered on the bench group by specache_cli/bench_cmd.py."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from engine.bench.common import (
    parse_floats,
    parse_ints,
    parse_modes,
    write_atomic,
)
from engine.bench.heatmap import needle_heatmap
from engine.bench.needle import NeedleGrid
from engine.bench.task import (
    COLUMNS,
    DECODINGS,
    QUESTIONS_FILE,
    SUMMARY_DOCS,
    TaskSetup,
    cell,
    load_questions,
    parse_decodings,
    run_task,
    task_markdown,
)
from engine.errors import BadArgument
from specache_cli.bench_common import (
    RESULTS,
    BenchRun,
    bench_texts,
    drive,
    print_table,
)
from specache_cli.console import err_console


TASK_MODES = "full,specache"
# quick: the documents cut to their first 1500 characters (they fit a tiny model's window), the questions
# answered there, one short summary, one needle
TASK_QUICK = {"decodings": "greedy,rp1.3", "questions": 3, "summary_docs": ("texts/origin-of-species-introduction.txt",),
              "lengths": [256], "depths": [0.5], "needles": 1, "answer_tokens": 8, "summary_tokens": 24,
              "doc_chars": 1500}


def task_cmd(
    run: BenchRun,
    modes: str = typer.Option(TASK_MODES, help="Comma-separated cache modes (docs/bench.md labels)."),
    decoding: Optional[str] = typer.Option(None, "--decoding", help=f"Comma-separated decoding settings: greedy or "
                                           f"e.g. rp1.1, nr4, rp1.1-nr4, t0.2-p0.9 (default {DECODINGS}; quick "
                                           f"{TASK_QUICK['decodings']})."),
    questions: Path = typer.Option(QUESTIONS_FILE, "--questions", help="The questions file (examples/questions.json)."),
    summaries: Optional[str] = typer.Option(None, "--summaries", help="Comma-separated documents under examples/ "
                                            f"to summarize (default {','.join(SUMMARY_DOCS)})."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Ask only the first N questions (quick: 3)."),
    ask_docs: Optional[str] = typer.Option(None, "--ask-docs", help="Comma-separated documents to ask against "
                                           "(default: every document the questions name)."),
    lengths: Optional[str] = typer.Option(None, help="Needle context lengths (default 2048,6144; quick 256; "
                                          "0: no needle)."),
    depths: Optional[str] = typer.Option(None, help="Needle depths (default 0.1,0.5,0.9; quick 0.5)."),
    needles: Optional[int] = typer.Option(None, help="Needles per cell (default 2; quick 1)."),
    seed: int = typer.Option(0, help="Sampling seed of the sampled decodings."),
) -> None:
    """Job-level quality: ask accuracy (fits / map-reduce), needle, summary health, per mode and decoding."""
    specs = parse_modes(modes)
    decs = parse_decodings(run.pick(decoding, TASK_QUICK["decodings"], DECODINGS), seed)
    items = load_questions(questions)
    n = run.pick(limit, TASK_QUICK["questions"], None)
    if n is not None:
        if n < 1:
            raise BadArgument("--limit must be >= 1")
        items = items[:n]
    docs = [d.strip() for d in summaries.split(",") if d.strip()] if summaries is not None else \
        list(run.quick_or(TASK_QUICK["summary_docs"], SUMMARY_DOCS))
    if lengths == "0":
        length_list = []
    else:
        length_list = parse_ints(lengths, "--lengths", minimum=64) if lengths else \
            run.quick_or(TASK_QUICK["lengths"], [2048, 6144])
    depth_list = parse_floats(depths, "--depths") if depths else run.quick_or(TASK_QUICK["depths"], [0.1, 0.5, 0.9])
    n_needles = run.pick(needles, TASK_QUICK["needles"], 2)
    if n_needles < 1:
        raise BadArgument("--needles must be >= 1")
    asked_docs = [d.strip() for d in ask_docs.split(",") if d.strip()] if ask_docs is not None else None
    texts = bench_texts([], "long-report.pdf")
    lm, specs = run.load(specs)
    length_list = [n for n in length_list if n <= lm.max_context - 16]
    setup = TaskSetup(items, docs, texts, NeedleGrid(length_list, depth_list, n_needles),
                      answer_tokens=run.quick_or(TASK_QUICK["answer_tokens"], 32),
                      summary_tokens=run.quick_or(TASK_QUICK["summary_tokens"], 256),
                      ask_docs=asked_docs, doc_chars=run.quick_or(TASK_QUICK["doc_chars"], None))
    result = drive(run_task(lm, specs, decs, setup, quick=run.quick), run.quiet)
    run.report("task", result, task_markdown(result), show_task)


def show_task(result: dict) -> None:
    print_table("task quality per decoding and cache mode", [head for _, head in COLUMNS],
                [[cell(row[k]) for k, _ in COLUMNS] for row in result["rows"]], left=2)


def heatmap_cmd(
    source: Path = typer.Argument(RESULTS / "needle.json", help="A needle bench JSON result."),
    png: Optional[Path] = typer.Option(None, "--png", help="Where to write (default: needle-heatmap.png next to it)."),
) -> None:
    """Redraw the needle heatmap PNG from a needle JSON result (the committed picture comes from the committed JSON)."""
    try:
        result = json.loads(Path(source).read_text(encoding="utf-8"))
        data = needle_heatmap(result)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BadArgument(f"{source}: not a needle bench result ({exc})") from None
    target = png or Path(source).with_name("needle-heatmap.png")
    write_atomic(target, data)
    err_console.print(f"[dim]wrote {target}[/]", highlight=False, soft_wrap=True)
