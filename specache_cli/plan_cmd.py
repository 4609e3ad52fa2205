"""`specache plan`: how many sequences fit, which k, and whether the prefetch hides (docs/planner.md)."""
from __future__ import annotations

import math
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from engine.config import CacheConfig
from engine.errors import BadArgument
from engine.kvcache.registry import POLICIES
from engine.model.embedded import EMBEDDED_PROFILE
from engine.plan.hardware import detect_hardware
from engine.plan.planner import REFERENCES, cache_for, check_plan, plan
from engine.plan.profiles import HardwareProfile, load_hardware, load_model_profile
from engine.plan.result import Plan
from engine.plan.roofline import GIB
from specache_cli.console import err_console, guarded
from specache_cli.options import PlanCacheOptions, grouped
from specache_cli.render import emit_json

BREAKDOWN_LABELS = {
    "kv_cache": "  KV cache, 16-bit",
    "guide": "  guide",
    "residual_window": "  exact residual window",
    "sinks": "  sink tokens",
    "fetch_buffers": "  fetch buffers (x2)",
    "host_store": "  exact store (same RAM)",
    "verify_buffers": "  verify buffers (x2 layers)",
    "decode_working_set": "  decode working set",
    "prefill_activations": "  prefill activations",
}


def size(nbytes: int | None) -> str:
    """Bytes in binary units, 3 significant figures."""
    if nbytes is None:
        return "-"
    for unit, scale in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.3g} {unit}" if nbytes / scale < 100 else f"{nbytes / scale:.0f} {unit}"
    return f"{nbytes} B"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds * 1e3 < 1000 else f"{seconds:.3g} s"


def note(text: str) -> None:
    """One note line on stderr (never wrapped)."""
    err_console.print(f"note: {text}", highlight=False, soft_wrap=True)


def _hardware(gpu: str, measure: bool) -> HardwareProfile:
    if gpu.strip().lower() != "auto":
        return load_hardware(gpu)
    hw = detect_hardware(measure=measure)
    if hw.kind == "cpu":
        note(f"no CUDA device found; planning for the CPU with this machine's RAM ({size(hw.device_memory_bytes)}, "
             f"{size(hw.free_memory_bytes)} available) as device memory; the exact store of specache is in the "
             "same RAM and counted in device / sequence")
        return hw
    how = "measured" if measure else "profile figure"
    note(f"detected {hw.source.removeprefix('detected: ')}: {size(hw.device_memory_bytes)} total, "
         f"{size(hw.free_memory_bytes)} free, host->device {hw.h2d_gbps:g} GB/s ({how})")
    if hw.name == "cuda-generic":
        note("unrecognized GPU: memory bandwidth and matmul throughput are conservative placeholders; "
             "pass --gpu NAME or a YAML profile for a better estimate")
    return hw


def render_table(p: Plan) -> Table:
    """The plan as a rich table: one column per mode."""
    hw, m = p.hardware, p.model
    info = p.to_json()
    budget, host_usable = info["budget"], info["host"]["usable_bytes"]
    title = (f"{m.display_name} on {hw.display_name}, {p.context:,} tokens, {p.bits}-bit guide g{p.group}, "
             f"R={p.residual}, S={p.sinks}, reference: {p.reference}")
    caption = (f"device {size(budget['device_memory_bytes'])} - runtime {size(budget['runtime_reserve_bytes'])} "
               f"- margin {size(budget['allocator_margin_bytes'])} -> {size(budget['usable_bytes'])} usable "
               f"(weights {size(budget['weights_bytes'])}); step times are a roofline estimate")
    table = Table(title=title, caption=caption, title_justify="left", caption_justify="left")
    table.add_column("")
    modes = list(p.modes)  # one per policy with a column (engine.plan.planner.plan_columns)
    for mp in modes:
        table.add_column(mp.mode, justify="right")

    def row(label: str, values: list[str]) -> None:
        table.add_row(label, *values)

    row("device / sequence", [size(mp.device_bytes_per_sequence) for mp in modes])
    for key, label in BREAKDOWN_LABELS.items():
        if any(key in mp.device_breakdown for mp in modes):
            row(label, [size(mp.device_breakdown.get(key)) for mp in modes])
    row("shared: weights", [size(mp.shared_device_bytes["weights"]) for mp in modes])
    row("shared: prefill activations", [size(mp.shared_device_bytes.get("prefill_activations")) for mp in modes])
    row("max batch", [f"{mp.max_batch} ({mp.limited_by})" for mp in modes])
    row("k (per layer, KV head)", [str(mp.k) if POLICIES[mp.mode].fetches else "-" for mp in modes])
    cpu = hw.kind == "cpu"
    if not cpu:  # on a CPU the exact store is in the same RAM: counted in "device / sequence" above
        row("host RAM / sequence", [size(mp.host_bytes_per_sequence) for mp in modes])
        row("host RAM at max batch", [_host_cell(mp.host_bytes_per_sequence * mp.max_batch, host_usable)
                                      for mp in modes])
        # on a CPU specache reads its chosen rows in place (--prefetch current): no copy to hide
        row("transfer / step", [f"{size(mp.transfer_bytes_per_step)}, {ms(mp.transfer_seconds_per_step)}"
                                if mp.transfer_bytes_per_step else "-" for mp in modes])
    row("compute / step", [ms(mp.compute_seconds_per_step) for mp in modes])
    if not cpu:  # (a CPU launches no kernels: its fused native decode is one call a layer)
        row("kernels / step", [f"{mp.kernels_per_step:,.0f}" for mp in modes])
        row("predicted step (+ kernels)", [ms(mp.predicted_step_seconds) for mp in modes])
        row("prefetch hidden", [("yes" if mp.prefetch_hidden else f"no (k <= {mp.k_max_hidden} would)")
                                if mp.k_max_hidden is not None else "-" for mp in modes])
    row("exact: gamma at acceptance", [f"{mp.gamma} at {mp.acceptance:g}" if mp.gamma else "-" for mp in modes])
    row("exact: draft step / verify", [f"{ms(mp.draft_seconds)} / {ms(mp.verify_seconds)}" if mp.gamma else "-"
                                       for mp in modes])
    row("decode tokens/s", [f"{mp.tokens_per_second:,.0f}" for mp in modes])
    row("speedup vs full", ["-" if mp.predicted_speedup_vs_full is None else f"{mp.predicted_speedup_vs_full:.2f}x"
                            for mp in modes])
    return table


def _host_cell(needed: int, usable: int | None) -> str:
    if not needed:
        return "-"
    if usable is None:  # no --host-ram for a GPU profile named by --gpu: say how to check it
        return f"{size(needed)} (pass --host-ram to check)"
    return f"{size(needed)} ({'fits' if needed <= usable else 'exceeds'} {size(usable)})"


GPU_HELP = "auto (detect this machine), a profile name (rtx-a6000, h100-sxm, cpu, ...) or a YAML profile path."
MODEL_HELP = ("A model profile name (mistral-7b, llama-3.1-8b, ...), a YAML path, a local Hugging Face model "
              "folder or config.json, a GGUF file, or ollama:NAME[:TAG].")
HOST_HELP = "Host RAM in GB (GiB, as RAM is sold); default: this machine's with --gpu auto, else unchecked."
REFERENCE_HELP = (f"{' or '.join(REFERENCES)}: prefill as this engine runs it (one row at a time), or as the "
                  "paper's setup (whole batch together; full cache in one forward with fp32 logits of every position).")


def plan_cmd(
    context: Optional[int] = typer.Option(None, "--context", "-c",
                                          help="Tokens per sequence, prompt + generated (default: the model's window)."),
    gpu: str = typer.Option("auto", "--gpu", help=GPU_HELP),
    model: str = typer.Option(EMBEDDED_PROFILE, "--model", "-m", help=MODEL_HELP),
    cache: PlanCacheOptions = None,
    host_ram: Optional[float] = typer.Option(None, "--host-ram", help=HOST_HELP),
    reference: str = typer.Option("engine", help=REFERENCE_HELP),
    measure: bool = typer.Option(True, help="With --gpu auto: measure pinned host->device bandwidth."),
    json_out: bool = typer.Option(False, "--json", help="Print the plan as JSON (docs/planner.md, JSON contract)."),
) -> None:
    """Plan batch size and k from first principles for each cache mode with a column: full, kivi,
    specache and exact (specache drafts, the exact store verifies)."""
    if host_ram is not None and not math.isfinite(host_ram):
        raise BadArgument(f"--host-ram must be a finite number of GB, not {host_ram}")
    host_bytes = None if host_ram is None else int(host_ram * GIB)
    profile = load_model_profile(model)
    context = profile.max_context if context is None else context
    given = cache.overrides()
    check_plan(context, host_bytes, None, reference)
    CacheConfig().with_overrides(**given)  # the settings given, checked before the hardware is detected
    hw = _hardware(gpu, measure)
    result = plan(hw, profile, context, cache_for(profile, hw, **given), host_ram_bytes=host_bytes,
                  reference=reference)
    for text in result.notes:
        note(text)
    if json_out:
        emit_json(result.to_json(), lines=False)
        return
    Console(highlight=False, soft_wrap=True).print(render_table(result))


def register(app: typer.Typer) -> None:
    app.command("plan")(guarded(grouped(plan_cmd)))
