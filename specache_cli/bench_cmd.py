"""`specache bench needle|fidelity|speed|decode|store`: run a bench, write <name>.json and <name>.md (and the
needle heatmap PNG) to --out, print a table (or, with --json, the JSON) on stdout and progress on
stderr. The benches themselves live in engine/bench/ (docs/bench.md)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from engine.bench.common import (
    HF_MODE,
    EXAMPLES,
    BenchProgress,
    BenchResult,
    default_doc,
    fmt,
    load_texts,
    native_line,
    parse_floats,
    parse_ints,
    parse_mode,
    parse_modes,
    write_atomic,
)
from engine.bench.decode import run_decode
from engine.bench.fidelity import run_fidelity
from engine.bench.heatmap import needle_heatmap
from engine.bench.needle import run_needle
from engine.bench.report import (
    decode_markdown,
    fidelity_markdown,
    needle_markdown,
    speed_markdown,
)
from engine.bench.speed import run_speed
from engine.bench.store import run_store_bench
from engine.bench.task import (
    COLUMNS,
    DECODINGS,
    QUESTIONS_FILE,
    SUMMARY_DOCS,
    cell,
    load_questions,
    parse_decodings,
    run_task,
    task_markdown,
)
from engine.config import PREFETCH
from engine.errors import BadArgument
from engine.inputs.documents import load_document
from engine.kvcache.registry import names
from engine.model.loading import load_model
from engine.plan.profiles import loaded_model_profile, model_defaults
from specache_cli.console import err_console, guarded
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


def _load_model(model: Optional[str], device: str, quiet: bool, threads: Optional[int], classes: str = "auto"):
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


def _with_model_defaults(specs: list, lm) -> list:
    """The mode labels again (validated before the model load), now over the model's defaults:
    what `summarize` and `ask` would use for it."""
    profile = loaded_model_profile(lm)
    defaults = model_defaults(lm, profile=profile)
    defaults["k_for"] = {p: profile.k_for(p) for p in PREFETCH}
    return [parse_mode(spec.label, defaults) for spec in specs]


def _texts(docs: list[str], default: str):

    return load_texts(docs or [default_doc(default)])


def _drive(events, quiet: bool) -> dict:
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


def _save(out: Path, name: str, result: dict, markdown: str, quiet: bool, extra: dict[str, bytes] | None = None) -> None:
    paths = [write_atomic(out / f"{name}.json", json.dumps(result, indent=2, ensure_ascii=False) + "\n")]
    for fname, data in (extra or {}).items():
        paths.append(write_atomic(out / fname, data))
    paths.append(write_atomic(out / f"{name}.md", markdown))
    if not quiet:
        err_console.print(f"[dim]wrote {', '.join(str(p) for p in paths)}[/]", highlight=False, soft_wrap=True)


def _print(table: Table) -> None:
    console = Console(highlight=False, soft_wrap=True)
    if not console.is_terminal:  # files and pipes: do not squeeze the table into 80 columns
        console = Console(highlight=False, soft_wrap=True, width=200)
    console.print(table)


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


# ---- needle ------------------------------------------------------------------------------

@bench_app.command("needle")
@guarded
def needle_cmd(
    model: Optional[str] = MODEL, out: Path = OUT, quick: bool = QUICK, json_out: bool = JSON, device: str = DEVICE,
    quiet: bool = QUIET, threads: Optional[int] = THREADS,
    doc: list[str] = typer.Option([], "--doc", "-d", help=DOCS_HELP + " Default: examples/long-report.pdf."),
    modes: str = typer.Option(NEEDLE_MODES, help="Comma-separated modes (docs/bench.md: e.g. specache-1b, kivi-2b, window)."),
    lengths: Optional[str] = typer.Option(None, help="Context lengths in tokens (default: 1/4, 1/2, 3/4 of the window; quick: two short ones)."),
    depths: Optional[str] = typer.Option(None, help="Needle depths in [0, 1] (default 0.1,0.5,0.9; quick 0.25,0.75)."),
    needles: Optional[int] = typer.Option(None, help="Needles per cell (default 3; quick 2)."),
    max_tokens: int = typer.Option(12, "--max-tokens", help="Answer tokens."),
    seed: int = typer.Option(0, help="Seed of the pass keys."),
) -> None:
    """Pass-key retrieval over context lengths x needle depths, per cache mode; writes a heatmap PNG."""
    out = out_dir(out, quick)

    specs = parse_modes(modes)
    depth_list = parse_floats(depths, "--depths") if depths else ([0.25, 0.75] if quick else [0.1, 0.5, 0.9])
    n_needles = needles if needles is not None else (2 if quick else 3)
    if n_needles < 1:
        raise BadArgument("--needles must be >= 1")
    if max_tokens < 1:
        raise BadArgument("--max-tokens must be >= 1")
    texts = _texts(doc, "long-report.pdf")
    lm = _load_model(model, device, quiet, threads)
    specs = _with_model_defaults(specs, lm)
    if lengths:
        length_list = parse_ints(lengths, "--lengths", minimum=64)
    else:
        window = min(lm.max_context, 8192) - max_tokens - 2
        length_list = [min(512, window // 3), min(1024, 2 * window // 3)] if quick else \
            [(window * f // 4) // 256 * 256 for f in (1, 2, 3)]
    result = _drive(run_needle(lm, texts, specs, length_list, depth_list, n_needles, max_tokens, seed, quick), quiet)
    png = needle_heatmap(result)
    _save(out, "needle", result, needle_markdown(result, "needle-heatmap.png"), quiet, {"needle-heatmap.png": png})
    if json_out:
        emit_json(result, lines=False)
        return
    table = Table(title=f"pass-key accuracy ({result['settings']['needles_per_cell']} needles x "
                        f"{len(depth_list)} depths per length)", title_justify="left")
    table.add_column("mode")
    table.add_column("overall", justify="right")
    for n in length_list:
        table.add_column(f"{n} tok", justify="right")
    table.add_column("found where full found", justify="right")
    table.add_column(f"device MiB @{length_list[-1]}", justify="right")
    for spec in specs:
        e = result["per_mode"][spec.label]
        table.add_row(spec.label, fmt(e["accuracy"], 2), *[fmt(e["by_length"][str(n)], 2) for n in length_list],
                      fmt(e.get("succeeds_where_full_does"), 2), _mib(e["device_bytes_per_row"][str(length_list[-1])]))
    _print(table)
    _print_targets(result["targets"])


# ---- fidelity ----------------------------------------------------------------------------

@bench_app.command("fidelity")
@guarded
def fidelity_cmd(
    model: Optional[str] = MODEL, out: Path = OUT, quick: bool = QUICK, json_out: bool = JSON, device: str = DEVICE,
    quiet: bool = QUIET, threads: Optional[int] = THREADS,
    doc: list[str] = typer.Option([], "--doc", "-d", help=DOCS_HELP + " Default: examples/report.pdf."),
    modes: Optional[str] = typer.Option(None, help=f"Comma-separated modes (default {FIDELITY_MODES}; quick {FIDELITY_QUICK_MODES})."),
    tokens: Optional[int] = typer.Option(None, "--tokens", help="Reference tokens generated by the full cache and forced (default 64; quick 16)."),
    context: Optional[int] = typer.Option(None, "--context", help="Most prompt tokens (default: what the window allows; quick 600)."),
) -> None:
    """Teacher-forced and free-running agreement with the full cache, and the guide's selection quality."""
    out = out_dir(out, quick)

    specs = parse_modes(modes or (FIDELITY_QUICK_MODES if quick else FIDELITY_MODES))
    n_tokens = tokens if tokens is not None else (16 if quick else 64)
    if n_tokens < 2:
        raise BadArgument("--tokens must be >= 2")
    ctx = context if context is not None else (600 if quick else None)
    if ctx is not None and ctx < 64:
        raise BadArgument("--context must be >= 64")
    texts = _texts(doc, "report.pdf")
    lm = _load_model(model, device, quiet, threads)
    specs = _with_model_defaults(specs, lm)
    result = _drive(run_fidelity(lm, texts, specs, n_tokens, ctx, quick), quiet)
    _save(out, "fidelity", result, fidelity_markdown(result), quiet)
    if json_out:
        emit_json(result, lines=False)
        return
    table = Table(title="fidelity against the full cache", title_justify="left")
    for col in ("mode", "top-1", "mean KL", "identical prefix", "equal tokens", "fetched recall / coverage",
                "oracle coverage", "coverage / oracle", "device MiB"):
        table.add_column(col, justify="left" if col == "mode" else "right")
    for spec in specs:
        e = result["per_mode"][spec.label]
        sel = e.get("selection")
        table.add_row(spec.label, fmt(e["top1_agreement"]), fmt(e["mean_kl"], 4), fmt(e["identical_prefix"], 1),
                      fmt(e["equal_share"]),
                      f"{fmt(sel['fetched']['recall'])} / {fmt(sel['fetched']['coverage'])}" if sel else "-",
                      fmt(sel["oracle"]["coverage"]) if sel else "-",
                      fmt(sel["fetched"]["coverage_vs_oracle"]) if sel else "-", _mib(e["device_bytes"]))
    _print(table)
    _print_targets(result["targets"])


# ---- speed -------------------------------------------------------------------------------

@bench_app.command("speed")
@guarded
def speed_cmd(
    model: Optional[str] = MODEL, out: Path = OUT, quick: bool = QUICK, json_out: bool = JSON, device: str = DEVICE,
    quiet: bool = QUIET, threads: Optional[int] = THREADS,
    doc: list[str] = typer.Option([], "--doc", "-d", help=DOCS_HELP + " Default: examples/long-report.pdf."),
    modes: Optional[str] = typer.Option(None, help=f"Comma-separated modes, hf = transformers generate (default {SPEED_MODES}; quick {SPEED_QUICK_MODES})."),
    lengths: Optional[str] = typer.Option(None, help="Context lengths (default 7000 or what the window allows; quick 256)."),
    batches: Optional[str] = typer.Option(None, help="Batch sizes (default 1,4; quick 1,2)."),
    tokens: Optional[int] = typer.Option(None, "--tokens", help="Decode steps per repeat (default 16; quick 4)."),
    repeats: Optional[int] = typer.Option(None, help="Repeated decode segments; the median is reported (default 3; quick 2)."),
    warmup: Optional[int] = typer.Option(None, help="Decode steps not counted (default 2; quick 1)."),
    isolate: bool = typer.Option(True, "--isolate/--in-process", help="Run each mode in a child process (honest peak RSS)."),
) -> None:
    """Prefill tokens/s, decode ms/token and peak RSS per mode, next to transformers' generate."""
    out = out_dir(out, quick)

    specs = parse_modes(modes or (SPEED_QUICK_MODES if quick else SPEED_MODES), allow_hf=True)
    batch_list = parse_ints(batches, "--batches") if batches else ([1, 2] if quick else [1, 4])
    n_tokens = tokens if tokens is not None else (4 if quick else 16)
    n_repeats = repeats if repeats is not None else (2 if quick else 3)
    n_warmup = warmup if warmup is not None else (1 if quick else 2)
    if n_tokens < 1 or n_repeats < 1 or n_warmup < 0:
        raise BadArgument("--tokens and --repeats must be >= 1, --warmup >= 0")
    texts = _texts(doc, "long-report.pdf")
    lm = _load_model(model, device, quiet, threads)
    specs = _with_model_defaults(specs, lm)
    steps = n_warmup + n_tokens * n_repeats
    if lengths:
        length_list = parse_ints(lengths, "--lengths", minimum=16)
    else:
        length_list = [min(256 if quick else 7000, lm.max_context - steps - 4)]
    result = _drive(run_speed(lm, model, texts, specs, length_list, batch_list, n_tokens, n_repeats, n_warmup,
                              isolate, quick, device, threads=threads), quiet)
    _save(out, "speed", result, speed_markdown(result), quiet)
    if json_out:
        emit_json(result, lines=False)
        return
    table = Table(title="speed (decode: median ms per step; a step gives every row one token)", title_justify="left")
    for col in ("mode", "context", "batch", "prefill tok/s", "decode ms/token", "x full", "x hf", "KV device MiB",
                "peak RSS MiB"):
        table.add_column(col, justify="left" if col == "mode" else "right")
    for c in result["comparison"]:
        table.add_row(c["mode"], str(c["length"]), str(c["batch"]), fmt(c["prefill_tokens_per_s"], 0),
                      fmt(c["decode_ms_per_token"], 1), fmt(c["decode_speedup_vs_full"], 2),
                      fmt(c["decode_speedup_vs_hf"], 2), _mib(c["device_bytes"]), _mib(c["peak_rss_bytes"]))
    _print(table)
    _print_targets(result["targets"])


# ---- decode (side by side) -----------------------------------------------------------------

@bench_app.command("decode")
@guarded
def decode_cmd(
    model: Optional[str] = MODEL, out: Path = OUT, quick: bool = QUICK, json_out: bool = JSON, device: str = DEVICE,
    quiet: bool = QUIET, threads: Optional[int] = THREADS,
    doc: list[str] = typer.Option([], "--doc", "-d", help=DOCS_HELP + " Default: examples/long-report.pdf."),
    modes: Optional[str] = typer.Option(None, help=f"Comma-separated modes, hf = transformers DynamicCache (default {DECODE_MODES}; quick {DECODE_QUICK_MODES})."),
    length: Optional[int] = typer.Option(None, "--length", help="Context tokens (default 6500 or what the window allows; quick 256)."),
    batches: Optional[str] = typer.Option(None, help="Batch sizes (default 1,4; quick 1,2)."),
    burst: Optional[int] = typer.Option(None, help="Steps per turn of a mode (default 3; quick 2)."),
    repeats: Optional[int] = typer.Option(None, help="Rounds of turns; the median is reported (default 6; quick 2)."),
) -> None:
    """Decode ms/step of the modes taking turns in one process: robust ratios on a shared machine."""
    out = out_dir(out, quick)

    specs = parse_modes(modes or (DECODE_QUICK_MODES if quick else DECODE_MODES), allow_hf=True)
    batch_list = parse_ints(batches, "--batches") if batches else ([1, 2] if quick else [1, 4])
    n_burst = burst if burst is not None else (2 if quick else 3)
    n_repeats = repeats if repeats is not None else (2 if quick else 6)
    if n_burst < 1 or n_repeats < 1:
        raise BadArgument("--burst and --repeats must be >= 1")
    if length is not None and length < 16:
        raise BadArgument("--length must be >= 16")
    texts = _texts(doc, "long-report.pdf")
    lm = _load_model(model, device, quiet, threads, "transformers" if any(s.mode == HF_MODE for s in specs) else "auto")
    specs = _with_model_defaults(specs, lm)
    ctx = min(length or (256 if quick else 6500), lm.max_context - n_burst * n_repeats - 8)
    result = _drive(run_decode(lm, texts, specs, ctx, batch_list, n_burst, n_repeats, quick), quiet)
    _save(out, "decode", result, decode_markdown(result), quiet)
    if json_out:
        emit_json(result, lines=False)
        return
    table = Table(title=f"decode side by side at {ctx} tokens (median ms per step)", title_justify="left")
    for col in ("mode", "batch", "ms/step", "tokens/s", "x full", "x hf"):
        table.add_column(col, justify="left" if col == "mode" else "right")
    for x in result["rows"]:
        table.add_row(x["mode"], str(x["batch"]), fmt(x["ms_per_step"], 1), fmt(x["tokens_per_s"], 1),
                      fmt(x["speedup_vs_full"], 2), fmt(x["speedup_vs_hf"], 2))
    _print(table)
    _print_targets(result["targets"])
    Console(highlight=False, soft_wrap=True).print(
        f"CPU: {result['environment'].get('cpu', '?')}; {native_line(result['environment']['kernels'])}")


def _print_targets(targets: list[dict]) -> None:
    table = Table(title="targets", title_justify="left")
    for col in ("target", "goal", "measured", "status"):
        table.add_column(col)
    for t in targets:
        status = {True: "[green]met[/]", False: "[red]not met[/]", None: "n/a"}[t["met"]]
        table.add_row(t["name"], t["goal"], fmt(t["measured"]), status)
    _print(table)


# ---- store -------------------------------------------------------------------------------

@bench_app.command("store")
@guarded
def store_cmd(
    model: Optional[str] = MODEL, out: Path = OUT, json_out: bool = JSON, device: str = DEVICE,
    quiet: bool = QUIET, threads: Optional[int] = THREADS,
    doc: str = typer.Option("", "--doc", "-d", help="Document (default: examples/report.pdf)."),
    modes: str = typer.Option("full,specache", help="Comma-separated cache modes."),
    max_tokens: int = typer.Option(8, "--max-tokens", help="Answer tokens per ask."),
) -> None:
    """Time to first token of an ask on a stored document against a cold one; on-disk bytes per token."""
    out = out_dir(out, False)

    mode_list = [m.strip() for m in modes.split(",") if m.strip()]
    known = names()  # the registered policies (engine.kvcache.registry; tests/test_layout.py)
    if not mode_list or any(m not in known for m in mode_list):
        raise BadArgument(f"--modes must list cache modes ({', '.join(known)}), not {modes!r}")
    document = load_document(doc or str(default_doc("report.pdf")))
    lm = _load_model(model, device, quiet, threads)
    result = run_store_bench(lm, document, mode_list, max_tokens)
    lines = [f"# Document store: time to first token\n\n- model: {result['model']} ({result['dtype']} on "
             f"{result['device']})\n- document: {result['document']} ({result['document_tokens']} tokens)\n",
             "| mode | cold TTFT s | hit TTFT s | cold / hit | bytes per token | vs fp16 | hit answer = cold |",
             "|---|---|---|---|---|---|---|"]
    for mode, r in result["modes"].items():
        lines.append(f"| {mode} | {r['cold_ttft_s']} | {r['hit_ttft_s']} | {r['cold_over_hit']} | "
                     f"{r['bytes_per_token']} | {r['vs_fp16']} | {r['same_answer_as_cold']} |")
    _save(out, "store", result, "\n".join(lines) + "\n", quiet)
    if json_out:
        emit_json(result, lines=False)
        return
    table = Table(title="document store (time to first token)", title_justify="left")
    for col in ("mode", "cold s", "hit s", "cold / hit", "B/token", "vs fp16"):
        table.add_column(col, justify="left" if col == "mode" else "right")
    for mode, r in result["modes"].items():
        table.add_row(mode, fmt(r["cold_ttft_s"], 2), fmt(r["hit_ttft_s"], 3), fmt(r["cold_over_hit"], 1),
                      fmt(r["bytes_per_token"], 0), fmt(r["vs_fp16"], 2))
    _print(table)


# ---- task ----------------------------------------------------------------------------------

TASK_MODES = "full,specache"
# quick: the documents cut to their first 1500 characters (they fit a tiny model's window), the questions
# answered there, one short summary, one needle
TASK_QUICK = {"decodings": "greedy,rp1.3", "questions": 3, "summary_docs": ("texts/origin-of-species-introduction.txt",),
              "lengths": [256], "depths": [0.5], "needles": 1, "answer_tokens": 8, "summary_tokens": 24,
              "doc_chars": 1500}


@bench_app.command("task")
@guarded
def task_cmd(
    model: Optional[str] = MODEL, out: Path = OUT, quick: bool = QUICK, json_out: bool = JSON, device: str = DEVICE,
    quiet: bool = QUIET, threads: Optional[int] = THREADS,
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
    out = out_dir(out, quick)
    specs = parse_modes(modes)
    decs = parse_decodings(decoding or (TASK_QUICK["decodings"] if quick else DECODINGS), seed)
    items = load_questions(questions)
    n = limit if limit is not None else (TASK_QUICK["questions"] if quick else None)
    if n is not None:
        if n < 1:
            raise BadArgument("--limit must be >= 1")
        items = items[:n]
    docs = [d.strip() for d in summaries.split(",") if d.strip()] if summaries is not None else \
        list(TASK_QUICK["summary_docs"] if quick else SUMMARY_DOCS)
    if lengths == "0":
        length_list = []
    else:
        length_list = parse_ints(lengths, "--lengths", minimum=64) if lengths else (TASK_QUICK["lengths"] if quick
                                                                                     else [2048, 6144])
    depth_list = parse_floats(depths, "--depths") if depths else (TASK_QUICK["depths"] if quick else [0.1, 0.5, 0.9])
    n_needles = needles if needles is not None else (TASK_QUICK["needles"] if quick else 2)
    if n_needles < 1:
        raise BadArgument("--needles must be >= 1")
    asked_docs = [d.strip() for d in ask_docs.split(",") if d.strip()] if ask_docs is not None else None
    texts = _texts([], "long-report.pdf")
    lm = _load_model(model, device, quiet, threads)
    specs = _with_model_defaults(specs, lm)
    length_list = [n for n in length_list if n <= lm.max_context - 16]
    result = _drive(run_task(lm, specs, decs, items, docs, texts, length_list, depth_list, n_needles,
                             answer_tokens=TASK_QUICK["answer_tokens"] if quick else 32,
                             summary_tokens=TASK_QUICK["summary_tokens"] if quick else 256, quick=quick,
                             ask_docs=asked_docs, doc_chars=TASK_QUICK["doc_chars"] if quick else None), quiet)
    _save(out, "task", result, task_markdown(result), quiet)
    if json_out:
        emit_json(result, lines=False)
        return
    table = Table(title="task quality per decoding and cache mode", title_justify="left")
    for key, head in COLUMNS:
        table.add_column(head, justify="left" if key in ("decoding", "mode") else "right")
    for row in result["rows"]:
        table.add_row(*[cell(row[k]) for k, _ in COLUMNS])
    _print(table)


# ---- heatmap -------------------------------------------------------------------------------

@bench_app.command("heatmap")
@guarded
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


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")
