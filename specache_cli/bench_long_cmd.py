"""`specache bench long`: the cache modes (and llama.cpp where node-llama-cpp is installed) at long contexts
of a real text; writes long.json, long.md and long.png (with matplotlib) to --out. Registered on the bench
group by specache_cli/bench_cmd.py; the bench itself is engine/bench/long.py (docs/bench.md)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from engine.bench.common import fmt, parse_floats, parse_ints, parse_modes
from engine.bench.long import DEFAULT_LENGTHS, QUICK_LENGTHS, LlamaCppRun, LongGrid, run_long
from engine.bench.long_report import COLUMNS, PLOT_MISSING, PLOT_NAME, long_markdown, long_plot, table_rows
from engine.bench.speed import ChildModel
from engine.errors import BadArgument
from engine.model.files import ModelFiles
from specache_cli.bench_common import BenchRun, bench_texts, docs_option, drive, print_table
from specache_cli.console import err_console

LONG_MODES = "full,specache"
LONG_DOC = "texts/federalist.txt"


def long_cmd(
    run: BenchRun,
    doc: list[str] = docs_option(LONG_DOC),
    modes: str = typer.Option(LONG_MODES, help="Comma-separated cache modes (docs/bench.md labels); full, when "
                              "listed, is the reference for top-1 / KL."),
    lengths: Optional[str] = typer.Option(None, help="Context lengths in tokens (default "
                                          f"{','.join(map(str, DEFAULT_LENGTHS))}; quick "
                                          f"{','.join(map(str, QUICK_LENGTHS))}); those beyond the model's window "
                                          "minus the answer tokens are skipped."),
    depths: Optional[str] = typer.Option(None, help="Pass-key depths in [0, 1] (default 0.1,0.5,0.9; quick 0.5)."),
    tokens: Optional[int] = typer.Option(None, "--tokens", help="Decode tokens per point, timed and compared with "
                                         "full (default 64; quick 8)."),
    llama_cpp: Optional[Path] = typer.Option(None, "--llama-cpp", help="A folder where node-llama-cpp is installed: "
                                             "llama.cpp runs beside the modes on the model's GGUF (skipped, with a "
                                             "note, without node, the package or a GGUF)."),
    seed: int = typer.Option(0, help="Seed of the pass keys."),
) -> None:
    """Prefill tok/s, decode ms/token, peak RSS, top-1 / KL against full and pass-keys at long contexts."""
    specs = parse_modes(modes)
    length_list = parse_ints(lengths, "--lengths", minimum=256) if lengths else list(
        run.quick_or(QUICK_LENGTHS, DEFAULT_LENGTHS))
    depth_list = parse_floats(depths, "--depths") if depths else run.quick_or([0.5], [0.1, 0.5, 0.9])
    n_tokens = run.pick(tokens, 8, 64)
    if n_tokens < 2:
        raise BadArgument("--tokens must be >= 2")
    texts = bench_texts(doc, LONG_DOC)
    lm, specs = run.load(specs)
    llama = LlamaCppRun(str(llama_cpp) if llama_cpp else None, gguf_of(run.files) if llama_cpp else None,
                        run.threads or os.cpu_count() or 1)
    child = ChildModel(run.files.source.as_json(), run.device, threads=run.threads)
    result = drive(run_long(lm, texts, specs, LongGrid(length_list, depth_list, n_tokens, seed), child, llama,
                            run.quick), run.quiet)
    png = long_plot(result)
    if png is None and not run.quiet:
        err_console.print(f"[dim]{escape(PLOT_MISSING)}[/]", highlight=False, soft_wrap=True)
    result["plot"] = PLOT_NAME if png else None
    run.report("long", result, long_markdown(result, PLOT_NAME if png else None), show_long,
               {PLOT_NAME: png} if png else None)


def gguf_of(files: ModelFiles) -> Path | None:
    """The GGUF file llama.cpp reads: the model's own, as the command resolved it (None: a folder, refused)."""
    return files.source.gguf


def show_long(result: dict) -> None:
    skipped = result["settings"]["skipped"]
    note = f"; skipped {', '.join(str(s['length']) for s in skipped)} (beyond the window)" if skipped else ""
    print_table(f"long contexts ({result['settings']['decode_tokens']} decode tokens per point{note})", COLUMNS,
                table_rows(result), left=1)
    if not result["settings"]["llama_cpp"]["ran"]:
        print(f"llama.cpp: {result['settings']['llama_cpp']['note']}")
    print(f"CPU: {result['environment'].get('cpu', '?')}; wall time {fmt(result['seconds'], 1)} s")
