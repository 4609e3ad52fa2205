"""What the `specache bench` commands share (specache_cli/bench_cmd.py, bench_task_cmd.py): the bench group, the
common options, the model load, the progress display, where results are written, and the tables."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Callable, ClassVar, Optional

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
from engine.model.files import ModelFiles, model_files
from engine.model.loading import load_model
from engine.plan.profiles import loaded_model_profile, model_defaults, profile_k
from specache_cli.console import err_console, print_warning
from specache_cli.options import MODEL_HELP
from specache_cli.render import emit_json

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

RESULTS = Path("bench-results")  # the committed results (full runs only)
QUICK_RESULTS = RESULTS / "quick"  # where --quick writes by default (ignored by git)
DOCS_HELP = "Document(s) to build prompts from (PDF, .txt, .md); repeat for several."


def docs_option(default: str):
    """--doc of a bench whose prompts come from documents (default examples/<default>)."""
    return typer.Option([], "--doc", "-d", help=f"{DOCS_HELP} Default: examples/{default}.")


@dataclass
class BenchRun:
    """The options every bench command takes, declared once: a command takes `run: BenchRun` and
    specache_cli.options.grouped shows them as its first options (the benches' option group)."""
    PANEL: ClassVar[Optional[str]] = None  # listed with the command's own options

    model: Annotated[Optional[str], typer.Option("--model", "-m", help=MODEL_HELP)] = None
    out: Annotated[Optional[Path], typer.Option(
        "--out", help="Folder for <bench>.json and <bench>.md (default bench-results/; with --quick "
        "bench-results/quick/: a quick run never replaces the committed results).")] = None
    quick: Annotated[bool, typer.Option("--quick", help="A small version that runs in seconds (what the tests "
                                        "run).")] = False
    json_out: Annotated[bool, typer.Option("--json", help="Print the JSON result on stdout instead of the "
                                           "table.")] = False
    device: Annotated[str, typer.Option(help="cpu, cuda or auto.")] = "cpu"
    quiet: Annotated[bool, typer.Option("--quiet", help="No progress on stderr.")] = False
    threads: Annotated[Optional[int], typer.Option(
        "--threads", help="torch CPU threads (default: torch's choice). On a shared machine 1 avoids threads "
        "waiting on each other.")] = None

    def __post_init__(self):
        self.folder = out_dir(self.out, self.quick)  # a bad --out is refused before the model loads
        self._files: ModelFiles | None = None

    @property
    def files(self) -> ModelFiles:
        """--model resolved once for the command (engine.model.files): the load and whatever else reads the model's
        files (bench long's llama.cpp: its GGUF) take this one object."""
        if self._files is None:
            self._files = model_files(self.model, None if self.quiet else progress)
        return self._files

    def quick_or(self, quick, full):
        """A default by the size of the run: its --quick value, else its full-run one."""
        return quick if self.quick else full

    def pick(self, given, quick, full):
        """An option's value: what the user gave, else its --quick or its full-run default."""
        return given if given is not None else self.quick_or(quick, full)

    def model_only(self, classes: str = "auto"):
        """The model of --model, --device and --threads (load_bench_model)."""
        return load_bench_model(self.files, self.device, self.quiet, self.threads, classes)

    def load(self, specs: list, classes: str = "auto"):
        """The model, and the mode labels over its defaults."""
        lm = self.model_only(classes)
        return lm, with_model_defaults(specs, lm)

    def report(self, name: str, result: dict, markdown: str, show: Callable[[dict], None],
               extra: dict[str, bytes] | None = None, footer: str = "") -> None:
        """Write <name>.json and <name>.md (and extra files); then the JSON on stdout with --json, else show()'s
        tables, the result's targets and the footer line."""
        save(self.folder, name, result, markdown, self.quiet, extra)
        if self.json_out:
            emit_json(result, lines=False)
            return
        show(result)
        if "targets" in result:
            print_targets(result["targets"])
        if footer:
            Console(highlight=False, soft_wrap=True).print(footer)


def bench_texts(docs: list[str], default: str):
    return load_texts(docs or [default_doc(default)])


def load_bench_model(model: "str | None | ModelFiles", device: str, quiet: bool, threads: Optional[int],
                     classes: str = "auto"):
    """model: --model, or the command's ModelFiles (BenchRun.files). classes: engine.model.loading.load_model's
    ("transformers" where a bench times the hf baseline in the same process: transformers' generate and module
    code, not engine.model.llama's)."""
    import torch

    if threads is not None:
        if threads < 1:
            raise BadArgument("--threads must be >= 1")
        torch.set_num_threads(threads)

    lm = load_model(model, device=device, on_status=None if quiet else progress, classes=classes,
                    on_warning=print_warning)
    if not quiet:
        progress(f"model {lm.name} on {lm.device} ({lm.dtype}), window {lm.max_context} tokens, loaded in "
                 f"{lm.load_seconds:.1f} s")
    return lm


def progress(message: str) -> None:
    """One dim progress line on stderr."""
    err_console.print(f"[dim]{message}[/]", highlight=False, soft_wrap=True)


def with_model_defaults(specs: list, lm) -> list:
    """The mode labels again (validated before the model load), now over the model's defaults:
    what `summarize` and `ask` would use for it."""
    profile = loaded_model_profile(lm)
    defaults = model_defaults(lm, profile=profile)
    defaults["k_for"] = {p: profile_k(profile, p) for p in PREFETCH}
    return [parse_mode(spec.label, defaults) for spec in specs]


def drive(events, quiet: bool) -> dict:
    """Progress lines to stderr; return the final result."""
    for event in events:
        if isinstance(event, BenchProgress):
            if not quiet:
                count = f"[{event.done}/{event.total}] " if event.total else ""
                progress(f"{count}{event.message}")
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
        progress(f"wrote {', '.join(str(p) for p in paths)}")


def print_table(title: str, columns, rows, left: int = 1) -> None:
    """A table on stdout: the first `left` columns justified left, the others right."""
    table = Table(title=title, title_justify="left")
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i < left else "right")
    for row in rows:
        table.add_row(*row)
    console = Console(highlight=False, soft_wrap=True)
    if not console.is_terminal:  # files and pipes: do not squeeze the table into 80 columns
        console = Console(highlight=False, soft_wrap=True, width=200)
    console.print(table)


def mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def print_targets(targets: list[dict]) -> None:
    status = {True: "[green]met[/]", False: "[red]not met[/]", None: "n/a"}
    print_table("targets", ("target", "goal", "measured", "status"),
                [(t["name"], t["goal"], fmt(t["measured"]), status[t["met"]]) for t in targets], left=4)
