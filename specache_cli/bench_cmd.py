"""`specache bench needle|fidelity|speed|decode|store`: run a bench, write <name>.json and <name>.md (and the
needle heatmap PNG) to --out, print a table (or, with --json, the JSON) on stdout and progress on
stderr. The benches themselves live in engine/bench/ (docs/bench.md)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from engine.bench.common import (
    HF_MODE,
    default_doc,
    fmt,
    native_line,
    parse_floats,
    parse_ints,
    parse_modes,
)
from engine.bench.decode import run_decode
from engine.bench.fidelity import run_fidelity
from engine.bench.heatmap import needle_heatmap
from engine.bench.needle import NeedleGrid, run_needle
from engine.bench.report import (
    decode_markdown,
    fidelity_markdown,
    needle_markdown,
    speed_markdown,
)
from engine.bench.speed import ChildModel, SpeedGrid, run_speed
from engine.bench.store import run_store_bench
from engine.errors import BadArgument
from engine.inputs.documents import load_document
from engine.kvcache.registry import names
from specache_cli.bench_common import (
    DECODE_MODES,
    DECODE_QUICK_MODES,
    DEVICE,
    DOCS_HELP,
    FIDELITY_MODES,
    FIDELITY_QUICK_MODES,
    JSON,
    MODEL,
    NEEDLE_MODES,
    OUT,
    QUICK,
    QUIET,
    SPEED_MODES,
    SPEED_QUICK_MODES,
    THREADS,
    bench_app,
    bench_texts,
    drive,
    load_bench_model,
    mib,
    out_dir,
    print_table,
    print_targets,
    save,
    with_model_defaults,
)
from specache_cli.bench_task_cmd import heatmap_cmd, task_cmd
from specache_cli.console import guarded
from specache_cli.render import emit_json


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
    texts = bench_texts(doc, "long-report.pdf")
    lm = load_bench_model(model, device, quiet, threads)
    specs = with_model_defaults(specs, lm)
    if lengths:
        length_list = parse_ints(lengths, "--lengths", minimum=64)
    else:
        window = min(lm.max_context, 8192) - max_tokens - 2
        length_list = [min(512, window // 3), min(1024, 2 * window // 3)] if quick else \
            [(window * f // 4) // 256 * 256 for f in (1, 2, 3)]
    result = drive(run_needle(lm, texts, specs, NeedleGrid(length_list, depth_list, n_needles, seed), max_tokens, quick),
                    quiet)
    png = needle_heatmap(result)
    save(out, "needle", result, needle_markdown(result, "needle-heatmap.png"), quiet, {"needle-heatmap.png": png})
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
                      fmt(e.get("succeeds_where_full_does"), 2), mib(e["device_bytes_per_row"][str(length_list[-1])]))
    print_table(table)
    print_targets(result["targets"])


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
    texts = bench_texts(doc, "report.pdf")
    lm = load_bench_model(model, device, quiet, threads)
    specs = with_model_defaults(specs, lm)
    result = drive(run_fidelity(lm, texts, specs, n_tokens, ctx, quick), quiet)
    save(out, "fidelity", result, fidelity_markdown(result), quiet)
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
                      fmt(sel["fetched"]["coverage_vs_oracle"]) if sel else "-", mib(e["device_bytes"]))
    print_table(table)
    print_targets(result["targets"])


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
    texts = bench_texts(doc, "long-report.pdf")
    lm = load_bench_model(model, device, quiet, threads)
    specs = with_model_defaults(specs, lm)
    steps = n_warmup + n_tokens * n_repeats
    if lengths:
        length_list = parse_ints(lengths, "--lengths", minimum=16)
    else:
        length_list = [min(256 if quick else 7000, lm.max_context - steps - 4)]
    grid = SpeedGrid(length_list, batch_list, n_tokens, n_repeats, n_warmup)
    child = ChildModel(model, device, threads=threads) if isolate else None
    result = drive(run_speed(lm, texts, specs, grid, child, quick), quiet)
    save(out, "speed", result, speed_markdown(result), quiet)
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
                      fmt(c["decode_speedup_vs_hf"], 2), mib(c["device_bytes"]), mib(c["peak_rss_bytes"]))
    print_table(table)
    print_targets(result["targets"])


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
    texts = bench_texts(doc, "long-report.pdf")
    lm = load_bench_model(model, device, quiet, threads, "transformers" if any(s.mode == HF_MODE for s in specs) else "auto")
    specs = with_model_defaults(specs, lm)
    ctx = min(length or (256 if quick else 6500), lm.max_context - n_burst * n_repeats - 8)
    result = drive(run_decode(lm, texts, specs, ctx, batch_list, n_burst, n_repeats, quick), quiet)
    save(out, "decode", result, decode_markdown(result), quiet)
    if json_out:
        emit_json(result, lines=False)
        return
    table = Table(title=f"decode side by side at {ctx} tokens (median ms per step)", title_justify="left")
    for col in ("mode", "batch", "ms/step", "tokens/s", "x full", "x hf"):
        table.add_column(col, justify="left" if col == "mode" else "right")
    for x in result["rows"]:
        table.add_row(x["mode"], str(x["batch"]), fmt(x["ms_per_step"], 1), fmt(x["tokens_per_s"], 1),
                      fmt(x["speedup_vs_full"], 2), fmt(x["speedup_vs_hf"], 2))
    print_table(table)
    print_targets(result["targets"])
    Console(highlight=False, soft_wrap=True).print(
        f"CPU: {result['environment'].get('cpu', '?')}; {native_line(result['environment']['kernels'])}")


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
    lm = load_bench_model(model, device, quiet, threads)
    result = run_store_bench(lm, document, mode_list, max_tokens)
    lines = [f"# Document store: time to first token\n\n- model: {result['model']} ({result['dtype']} on "
             f"{result['device']})\n- document: {result['document']} ({result['document_tokens']} tokens)\n",
             "| mode | cold TTFT s | hit TTFT s | cold / hit | bytes per token | vs fp16 | hit answer = cold |",
             "|---|---|---|---|---|---|---|"]
    for mode, r in result["modes"].items():
        lines.append(f"| {mode} | {r['cold_ttft_s']} | {r['hit_ttft_s']} | {r['cold_over_hit']} | "
                     f"{r['bytes_per_token']} | {r['vs_fp16']} | {r['same_answer_as_cold']} |")
    save(out, "store", result, "\n".join(lines) + "\n", quiet)
    if json_out:
        emit_json(result, lines=False)
        return
    table = Table(title="document store (time to first token)", title_justify="left")
    for col in ("mode", "cold s", "hit s", "cold / hit", "B/token", "vs fp16"):
        table.add_column(col, justify="left" if col == "mode" else "right")
    for mode, r in result["modes"].items():
        table.add_row(mode, fmt(r["cold_ttft_s"], 2), fmt(r["hit_ttft_s"], 3), fmt(r["cold_over_hit"], 1),
                      fmt(r["bytes_per_token"], 0), fmt(r["vs_fp16"], 2))
    print_table(table)


bench_app.command("task")(guarded(task_cmd))
bench_app.command("heatmap")(guarded(heatmap_cmd))


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")
