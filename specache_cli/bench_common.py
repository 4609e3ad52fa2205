"""What the `specache bench` commands share (specache_cli/bench_cmd.py, bench_task_cmd.py): the bench group, the
common options, the model load, the progress display, where results are written, and the tables."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from engine.bench.common import (
    EXAMPLES,
    BenchProgress,
    BenchResult,
    default_doc,
    fmt,
    load_texts,
    parse_mode,
    write_atomic,
)
from engine.config import PREFETCH
from engine.errors import BadArgument
from engine.model.loading import load_model
from engine.plan.profiles import loaded_model_profile, model_defaults, profile_k
from specache_cli.console import err_console
from specache_cli.options import MODEL_HELP

bench_app = typer.Typer(name="bench", help="Benchmarks: needle retrieval, fidelity to the full cache, speed, decode "
                        "side by side.",
                        no_args_is_help=True)

NEEDLE_MODES = "full,specache-2b,specache-1b,kivi-2b,kivi-1b,window"
FIDELITY_MODES = "full,specache,specache-1b,kivi-2b,kivi-1b,window"
FIDELITY_QUICK_MODES = "full,specache,specache-1b,kivi-1b,window"
SPEED_MODES = "full,specache,specache-1b,kivi-1b,window,hf"
SPEED_QUICK_MODES = "full,specache,hf"
DECODE_MODES = "full,specache,kivi,hf"
DECODE_QUICK_MODES = "full,specache,hf"

MODEL = typer.Option(None, "--model", "-m", help=MODEL_HELP)
RESULTS = Path("bench-results")  # the committed results (full runs only)
QUICK_RESULTS = RESULTS / "quick"  # where --quick writes by default (ignored by git)
OUT = typer.Option(None, "--out", help="Folder for <bench>.json and <bench>.md (default bench-results/; with "
                   "--quick bench-results/quick/: a quick run never replaces the committed results).")
QUICK = typer.Option(False, "--quick", help="A small version that runs in seconds (what the tests run).")
JSON = typer.Option(False, "--json", help="Print the JSON result on stdout instead of the table.")
DEVICE = typer.Option("cpu", help="cpu, cuda or auto.")
QUIET = typer.Option(False, "--quiet", help="No progress on stderr.")
THREADS = typer.Option(None, "--threads", help="torch CPU threads (default: torch's choice). On a shared machine 1 "
                       "avoids threads waiting on each other.")
DOCS_HELP = "Document(s) to build prompts from (PDF, .txt, .md); repeat for several."


def load_bench_model(model: Optional[str], device: str, quiet: bool, threads: Optional[int], classes: str = "auto"):
    """classes: engine.model.loading.load_model's ("transformers" where a bench times the hf baseline in
    the same process: transformers' generate and module code, not engine.model.llama's)."""
    import torch

    if threads is not None:
        if threads < 1:
            raise BadArgument("--threads must be >= 1")
        torch.set_num_threads(threads)

    status = None if quiet else (lambda m: err_console.print(f"[dim]{m}[/]", highlight=False, soft_wrap=True))
    lm = load_model(model, device=device, on_status=status, classes=classes)
    if not quiet:
        err_console.print(f"[dim]model {lm.name} on {lm.device} ({lm.dtype}), window {lm.max_context} tokens, "
                          f"loaded in {lm.load_seconds:.1f} s[/]", highlight=False, soft_wrap=True)
    return lm


def with_model_defaults(specs: list, lm) -> list:
    """The mode labels again (validated before the model load), now over the model's defaults:
    what `summarize` and `ask` would use for it."""
    profile = loaded_model_profile(lm)
    defaults = model_defaults(lm, profile=profile)
    defaults["k_for"] = {p: profile_k(profile, p) for p in PREFETCH}
    return [parse_mode(spec.label, defaults) for spec in specs]


def bench_texts(docs: list[str], default: str):

    return load_texts(docs or [default_doc(default)])


def drive(events, quiet: bool) -> dict:
    """Progress lines to stderr; return the final result."""
    for event in events:
        if isinstance(event, BenchProgress):
            if not quiet:
                count = f"[{event.done}/{event.total}] " if event.total else ""
                err_console.print(f"[dim]{count}{event.message}[/]", highlight=False, soft_wrap=True)
        elif isinstance(event, BenchResult):
            return event.data
    raise RuntimeError("the bench ended without a result")


def out_dir(out: Optional[Path], quick: bool) -> Path:
    """Where a bench writes: --out, else bench-results/ (bench-results/quick/ for --quick). A quick run
    into the committed bench-results/ itself is refused: its small numbers would replace the real ones."""
    if out is None:
        return QUICK_RESULTS if quick else RESULTS
    if quick and Path(out).resolve() in {RESULTS.resolve(), (EXAMPLES.parent / "bench-results").resolve()}:
        raise BadArgument(f"--quick would overwrite the committed results in {out}; use another --out "
                          f"(default {QUICK_RESULTS})")
    return Path(out)


def save(out: Path, name: str, result: dict, markdown: str, quiet: bool, extra: dict[str, bytes] | None = None) -> None:
    paths = [write_atomic(out / f"{name}.json", json.dumps(result, indent=2, ensure_ascii=False) + "\n")]
    for fname, data in (extra or {}).items():
        paths.append(write_atomic(out / fname, data))
    paths.append(write_atomic(out / f"{name}.md", markdown))
    if not quiet:
        err_console.print(f"[dim]wrote {', '.join(str(p) for p in paths)}[/]", highlight=False, soft_wrap=True)


def print_table(table: Table) -> None:
    console = Console(highlight=False, soft_wrap=True)
    if not console.is_terminal:  # files and pipes: do not squeeze the table into 80 columns
        console = Console(highlight=False, soft_wrap=True, width=200)
    console.print(table)


def mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def print_targets(targets: list[dict]) -> None:
    table = Table(title="targets", title_justify="left")
    for col in ("target", "goal", "measured", "status"):
        table.add_column(col)
    for t in targets:
        status = {True: "[green]met[/]", False: "[red]not met[/]", None: "n/a"}[t["met"]]
        table.add_row(t["name"], t["goal"], fmt(t["measured"]), status)
    print_table(table)
