#!/usr/bin/env python
"""One-call GPU check for specache: correctness on CUDA, then the paper's throughput setting.

Run on a machine with one CUDA GPU, from the repository root, in the project's venv:

    python scripts/gpu_check.py --out "$OUT"                       # every stage, ~6 min on one H200
    python scripts/gpu_check.py --out "$OUT" --stages tests,quick  # some of them, in that order

Stages (each written to OUT/gpu_check.json as it finishes: a killed run keeps the stages before it):

- profile: torch.profiler over 4 decode steps of full and specache at 4k tokens, batch 2: device
  events per step, their device ms against the wall ms of a step, the most frequent kernels and aten ops.
- quick: full (batch 2) and specache (batch 4) at 4k tokens: ms per step, tokens/s and their ratio.
- graphs: full, specache (speculative: the GPU default) and specache with prefetch current at 4k, batch 2,
  eager and replayed as CUDA graphs (SPECACHE_CUDA_GRAPHS=1).
- dynamic: transformers' own decode with its DynamicCache and SDPA at 4k, batch 2 (the baseline).
- variants: specache at 4k, batch 4: 1- and 2-bit, speculative with and without the corrected set,
  prefetch current.
- paper: a randomly initialised model of Llama-3-8B shape (fp16; weights need not be real for timing) at
  --context tokens (32k) under a device budget of --budget-gb (48 GB, the paper's RTX A6000): the
  largest batches the planner allows for full and 1-bit specache (capped by host RAM for the exact
  store), a real chunked prefill of random tokens at that batch (seconds per row), then timed decode
  steps: tokens/s of each and their ratio (paper: 4.6x), the share of fetches complete before the
  attention needed them (paper: 96.8%), the per-step transfer bytes, the pinned host bytes.
- paper-graphs: the paper stage with the decode passes replayed as CUDA graphs.
- exact: greedy full and exact on the tests' tiny random GQA model (fp32), rows of different lengths:
  identical tokens; then exact at 4k, batch 2, with the verification streamed (the store's layers
  copied double-buffered on the side stream) and with a plain compute-stream copy. A random model's
  drafts are seldom accepted: its acceptance is reported, not the speed of a real model's exact mode.
- tests: the CUDA tests (SPECACHE_TEST_DEVICE=cuda: the Triton kernels compiled, the transfer and
  verification streams, the engine's limit tests) under --tests-timeout, their log in OUT/tests.log.

Prints a short table last.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def limit_tests(out: Path, timeout: float) -> dict:
    """The engine's tests that run on CUDA (SPECACHE_TEST_DEVICE=cuda), their output written to
    out/tests.log as they run; stopped after `timeout` seconds. -> pytest's last line and exit code."""
    env = dict(os.environ, SPECACHE_TEST_DEVICE="cuda")
    t = time.perf_counter()
    log = out / "tests.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider",
                                 "tests/test_guide_triton.py", "tests/test_transfer.py", "tests/test_graphs.py",
                                 "tests/test_verify_stream.py", "tests/test_engine.py"],
                                cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, text=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = "timeout"
    lines = [x for x in log.read_text().splitlines() if x.strip()]
    return {"exit_code": code, "summary": lines[-1] if lines else "", "seconds": round(time.perf_counter() - t, 1),
            "failed": [x for x in lines if x.startswith("FAILED")]}


def llama3_8b_shape(context: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=max(context + 1024, 8192), rope_theta=500000.0,
                       bos_token_id=1, eos_token_id=2)


def random_model(config, device):
    """Random fp16 weights (std 0.02, norms 1) without materialising them on the CPU."""
    from transformers import LlamaForCausalLM

    from engine.model.loading import prepare_model

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
    model.half()
    with torch.device(device):  # the rotary buffers were not initialised by to_empty; keep them fp32
        model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    return prepare_model(model)


def prefill_random(engine, cache, batch: int, context: int) -> tuple[list[torch.Tensor], float]:
    """Prefill rows 0..batch-1 of `cache` with `context` random tokens each (seed 0). -> (each row's
    last logits [V], the seconds it took, the device synchronized)."""
    from engine.generate.steps import sync

    gen = torch.Generator(device="cpu").manual_seed(0)
    t0 = time.perf_counter()
    last = []
    for row in range(batch):
        ids = torch.randint(10, engine.model.config.vocab_size, (context,), generator=gen).tolist()
        *_, logits = engine.prefill(cache, ids, row)
        last.append(logits)
    sync(engine.device)
    return last, time.perf_counter() - t0


def decode_setup(model, mode: str, batch: int, context: int, steps: int, chunk: int, bits: int, k: int,
                 config=None):
    """A cache of `batch` rows prefilled with `context` random tokens, its step loop past the warm-up
    (T1, pre-decoding, one steady step). -> (cache, step iterator, prefill seconds)."""
    from engine.config import CacheConfig
    from engine.generate.engine import Engine
    from engine.generate.steps import greedy

    config = config or CacheConfig(mode=mode, bits=bits, group=64, k=k, chunk_size=chunk)
    engine = Engine(model, config)
    cache = engine.new_cache(batch, context + steps + 8)
    last, prefill_s = prefill_random(engine, cache, batch, context)
    steps_it = engine.steps(cache, torch.stack(last), greedy)
    for _ in range(3):
        next(steps_it)
    torch.cuda.synchronize()
    return cache, steps_it, prefill_s


def timed_decode(model, mode: str, batch: int, context: int, steps: int, chunk: int, bits: int, k: int,
                 config=None) -> dict:
    """Prefill `batch` rows of `context` random tokens, then time `steps` decode steps (config: a CacheConfig
    instead of the one mode, bits, k and chunk make)."""
    from engine.kvcache.transfer import overlap_share

    cache, steps_it, prefill_s = decode_setup(model, mode, batch, context, steps, chunk, bits, k, config)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    wall = time.perf_counter()
    start.record()
    first_ids = []
    for _ in range(steps):
        ids, _ = next(steps_it)
        first_ids.append(ids)
    end.record()
    torch.cuda.synchronize()
    wall = time.perf_counter() - wall
    step_ms = start.elapsed_time(end) / steps
    steps_it.close()
    stats = cache.stats()
    cache.close()
    stores = [layer.store for layer in cache.layers if getattr(layer, "store", None) is not None]
    per_step = 0
    if mode == "specache":
        shape = cache.shape
        per_step = batch * shape.layers * shape.kv_heads * k * shape.head_dim * 2 * 2  # K and V, fp16
    return {"mode": mode, "batch": batch, "context": context, "prefill_seconds": round(prefill_s, 2),
            "prefill_seconds_per_row": round(prefill_s / batch, 2),
            "step_ms": round(step_ms, 2), "wall_step_ms": round(1000 * wall / steps, 2),
            "tokens_per_second": round(batch * 1000 / step_ms, 2),
            "overlap_share": overlap_share(stores), "transfer_bytes_per_step": per_step,
            "prefetch_reuse": stats.get("prefetch_reuse"), "guide_kernel": stats.get("guide_kernel"),
            "fetch_path": stats.get("fetch_path"), "first_ids": torch.stack(first_ids[:4]).tolist(),
            "peak_device_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            "device_bytes": cache.device_bytes(), "host_bytes": cache.host_bytes(),
            "host_bytes_allocated": cache.transfer.host_bytes_allocated()}


def dynamic_cache_decode(model, batch: int, context: int, steps: int, chunk: int) -> dict:
    """transformers' own decode with its DynamicCache and SDPA attention (the baseline the full cache is
    measured against): a chunked prefill of `batch` rows of random tokens, then `steps` timed greedy steps."""
    from transformers import DynamicCache

    impl = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        gen = torch.Generator(device="cpu").manual_seed(0)
        ids = torch.randint(10, model.config.vocab_size, (batch, context), generator=gen).cuda()
        cache = DynamicCache()
        t0 = time.perf_counter()
        with torch.inference_mode():
            for s in range(0, context, chunk):
                out = model(input_ids=ids[:, s : s + chunk], past_key_values=cache, use_cache=True, logits_to_keep=1)
            torch.cuda.synchronize()
            prefill_s = time.perf_counter() - t0
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            for _ in range(2):  # warm-up
                nxt = model(input_ids=nxt, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(steps):
                nxt = model(input_ids=nxt, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
            end.record()
            torch.cuda.synchronize()
        step_ms = start.elapsed_time(end) / steps
    finally:
        model.set_attn_implementation(impl)
    return {"mode": "transformers-dynamic", "batch": batch, "context": context, "prefill_seconds": round(prefill_s, 2),
            "prefill_seconds_per_row": round(prefill_s / batch, 2), "step_ms": round(step_ms, 2),
            "wall_step_ms": round(step_ms, 2), "tokens_per_second": round(batch * 1000 / step_ms, 2),
            "overlap_share": None}


def variants(model, context: int, batch: int, steps: int, chunk: int, k: int) -> list[dict]:
    """specache's guide widths and prefetch variants at one batch: 1- and 2-bit, speculative with and
    without the corrected set, and prefetch current."""
    from engine.config import CacheConfig

    runs = []
    for bits, prefetch, correct in ((1, "speculative", True), (1, "speculative", False), (2, "speculative", True),
                                    (2, "current", True)):
        config = CacheConfig(mode="specache", bits=bits, group=64, k=k, chunk_size=chunk, prefetch=prefetch,
                             correct=correct)
        try:
            run = timed_decode(model, "specache", batch, context, steps, chunk, bits, k, config=config)
        except torch.cuda.OutOfMemoryError as exc:
            run = {"mode": "specache", "batch": batch, "error": f"out of memory: {str(exc)[:200]}"}
        runs.append({"bits": bits, "prefetch": prefetch, "correct": correct} | run)
        torch.cuda.empty_cache()
        print(runs[-1], file=sys.stderr, flush=True)
    return runs


def graphed(model, context: int, batch: int, steps: int, chunk: int, k: int, bits: int) -> dict:
    """Each mode's decode eagerly and replayed as CUDA graphs (SPECACHE_CUDA_GRAPHS=1), side by side: the
    full cache, specache with its GPU default (the speculative prefetch: two-token passes, the corrected
    set at fixed size, the prefetch on the side stream joined at the end of each pass) and with prefetch
    current; ms per step of each, and the ids of the first steps equal."""
    from engine.config import CacheConfig

    out = {}
    for name, mode, config in (("full", "full", None), ("specache", "specache", None),
                               ("specache-current", "specache",
                                CacheConfig(mode="specache", bits=bits, group=64, k=k, chunk_size=chunk,
                                            prefetch="current"))):
        runs = {}
        for graphs in ("0", "1"):
            os.environ["SPECACHE_CUDA_GRAPHS"] = graphs
            try:
                runs["graphs" if graphs == "1" else "eager"] = timed_decode(model, mode, batch, context, steps, chunk,
                                                                            bits, k, config=config)
            except Exception as exc:  # noqa: BLE001  (one mode's failure must not lose the others)
                runs["graphs" if graphs == "1" else "eager"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            finally:
                os.environ.pop("SPECACHE_CUDA_GRAPHS", None)
            torch.cuda.empty_cache()
        eager, graph = runs["eager"], runs["graphs"]
        if "step_ms" in eager and "step_ms" in graph:
            runs |= {"speedup": round(eager["step_ms"] / graph["step_ms"], 2),
                     "same_ids": eager["first_ids"] == graph["first_ids"]}
        out[name] = runs
        print(name, runs, file=sys.stderr, flush=True)
    return out


def profiled_decode(model, mode: str, batch: int, context: int, steps: int, chunk: int, bits: int, k: int) -> dict:
    """torch.profiler over `steps` decode steps: device events (kernels, copies, fills) per step, their
    summed device time against the wall time of a step, and the most frequent kernels."""
    from collections import Counter

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cache, steps_it, _ = decode_setup(model, mode, batch, context, steps, chunk, bits, k)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = time.perf_counter()
        for _ in range(steps):
            next(steps_it)
        torch.cuda.synchronize()
        wall = time.perf_counter() - wall
    steps_it.close()
    cache.close()
    device = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    busy_us = sum(e.time_range.elapsed_us() for e in device)
    names = Counter(e.name[:80] for e in device)
    cpu_ops = Counter(e.name for e in prof.events() if e.device_type == DeviceType.CPU and e.name.startswith("aten::"))
    return {"mode": mode, "batch": batch, "context": context, "steps": steps,
            "device_events_per_step": round(len(device) / steps, 1),
            "device_ms_per_step": round(busy_us / 1000 / steps, 2), "wall_ms_per_step": round(1000 * wall / steps, 2),
            "device_busy_share": round(busy_us / 1e6 / wall, 3),
            "top_device_events": [[n, round(c / steps, 1)] for n, c in names.most_common(12)],
            "top_aten_ops_per_step": [[n, round(c / steps, 1)] for n, c in cpu_ops.most_common(15)],
            "local_scalar_dense_per_step": round(cpu_ops.get("aten::_local_scalar_dense", 0) / steps, 1)}


def exact_equals_full(device: torch.device, lengths: tuple[int, ...] = (300, 517, 1000), new: int = 48) -> dict:
    """Greedy full and exact (gamma 4, a small fetched set: the draft is often wrong) on the tests' tiny
    random GQA model (fp32) for rows of these prompt lengths: identical tokens, and where not, each
    row's first differing position."""
    from engine.config import CacheConfig, GenerationConfig
    from engine.generate.engine import Engine, Finished
    from tests.conftest import make_tiny_model

    model = make_tiny_model().to(device)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    out = {}
    for mode, extra in (("full", {}), ("exact", {"gamma": 4, "k": 16, "residual": 32, "group": 32})):
        engine = Engine(model, CacheConfig(mode=mode, chunk_size=256, **extra))
        events = engine.generate(prompts, GenerationConfig(max_tokens=new))
        out[mode] = next(e for e in events if isinstance(e, Finished))
    full, exact = out["full"].tokens, out["exact"].tokens
    first = [first_difference(f, e) for f, e in zip(full, exact)]
    stats = out["exact"].cache_stats
    return {"identical": full == exact, "first_divergence": first, "lengths": list(lengths), "tokens": new,
            **{k: stats.get(k) for k in ("acceptance_rate", "tokens_per_verify", "verifies", "verify_copy_bytes",
                                         "verify_overlap_share")}}


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (the shorter one's end counts); None if equal."""
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return None if a == b else i


def timed_exact(model, batch: int, context: int, cycles: int, chunk: int, bits: int, k: int, gamma: int,
                planned_per_row: int) -> dict:
    """Prefill `batch` rows of `context` random tokens into an exact cache, one warm-up cycle, then
    `cycles` draft-and-verify cycles with the verification streamed through the two buffers, then
    `cycles` with a plain copy of the store on the compute stream (Transfer.stream_verify off).
    planned_per_row: the planner's transfer bytes per verification per row (plan_batches)."""
    from engine.config import CacheConfig
    from engine.generate.engine import Engine
    from engine.generate.steps import decode_headroom, exact_cycles, greedy, sync

    config = CacheConfig(mode="exact", bits=bits, group=64, k=k, chunk_size=chunk, gamma=gamma)
    engine = Engine(model, config)
    device = engine.device
    cache = engine.new_cache(batch, context + (2 * cycles + 2) * (gamma + 1) + decode_headroom(engine.policy) + 4)
    last, prefill_s = prefill_random(engine, cache, batch, context)
    verify = cache.transfer.verify
    it = exact_cycles(model, cache, torch.stack(last), greedy)
    next(it)  # the token from the prefill's logits
    cache.transfer.stream_verify = True
    next(it)  # warm-up cycle (allocates the verification buffers)

    def segment() -> dict:
        counts = (verify.copied_bytes, verify.passes, verify.waits, verify.ready_in_time)
        stats = dict(cache.decode_stats)
        sync(device)
        start, tokens = time.perf_counter(), 0
        for _ in range(cycles):
            emitted, _ = next(it)
            tokens += sum(map(len, emitted))
        sync(device)
        seconds = time.perf_counter() - start
        return segment_figures(seconds, tokens, batch, cycles, stats, cache.decode_stats, counts,
                               (verify.copied_bytes, verify.passes, verify.waits, verify.ready_in_time))

    streamed = segment()
    cache.transfer.stream_verify = False
    plain = segment()
    it.close()
    cache.close()
    copied = streamed["verify_copy_bytes"]
    return {"mode": "exact", "batch": batch, "context": context, "gamma": gamma, "prefill_seconds": round(prefill_s, 2),
            "streamed": streamed, "plain_copy": plain, "acceptance_rate": cache.decode_stats.get("acceptance_rate"),
            "planned_copy_bytes": planned_per_row * batch,
            "copy_vs_planned": round(copied / (planned_per_row * batch), 3) if copied and planned_per_row else None,
            "device_bytes": cache.device_bytes(), "host_bytes": cache.host_bytes()}


def segment_figures(seconds: float, tokens: int, batch: int, cycles: int, before: dict, after: dict,
                    counts0: tuple, counts1: tuple) -> dict:
    """Figures of `cycles` exact cycles: ms per output token of a row, the mean verification ms (from
    the step loop's running means before/after), tokens per row per verification, and from the
    VerifyStream counters (copied bytes, passes, waits, copies complete when needed) the bytes per
    verification and the overlap share (None where nothing was streamed)."""
    def total(stats: dict, key: str) -> float:
        return stats.get(key, 0.0) * stats.get("verifies", 0)

    verifies = after["verifies"] - before.get("verifies", 0)
    copied, passes, waits, ready = (b - a for a, b in zip(counts0, counts1))
    return {"ms_per_token": round(1000 * seconds / max(tokens / batch, 1e-9), 2),
            "verify_ms": round((total(after, "verify_ms") - total(before, "verify_ms")) / max(verifies, 1), 2),
            "tokens_per_verify": round(tokens / batch / max(cycles, 1), 3),
            "verify_copy_bytes": copied // passes if passes else None,
            "verify_overlap_share": round(ready / waits, 4) if waits else None}


def plan_batches(context: int, budget_gb: float, bits: int, chunk: int) -> dict:
    """The planner's largest batches for full and specache under the budget (host RAM checked), and
    its exact row's transfer bytes per verification per row (exact_cycle: context x K/V bytes on a
    discrete GPU, 0 where the store is read in place)."""
    from dataclasses import replace

    from engine.machine import machine_ram_bytes
    from engine.plan.hardware import detect_hardware
    from engine.plan.planner import cache_for, plan
    from engine.plan.profiles import load_model_profile

    hw = detect_hardware(measure=True)
    budget = int(budget_gb * 1e9)
    hw = replace(hw, device_memory_bytes=budget, free_memory_bytes=budget)
    total_ram, available = machine_ram_bytes()
    model = load_model_profile("llama-3-8b")
    p = plan(hw, model, context, cache_for(model, hw, bits=bits, group=64, chunk_size=chunk),
             host_ram_bytes=int(available * 0.8), element_bytes=2)
    exact = p.mode("exact")
    per_row = exact.transfer_bytes_per_step // exact.max_batch if exact.max_batch else 0
    return {m: p.mode(m).max_batch for m in ("full", "specache", "exact")} | {
        "k": p.mode("specache").k, "exact_transfer_per_row": per_row, "hardware": hw.display_name}


STAGES = ("profile", "quick", "graphs", "dynamic", "variants", "paper", "paper-graphs", "exact", "tests")


def with_graphs(run):
    """run() with decode passes replayed as CUDA graphs (SPECACHE_CUDA_GRAPHS=1)."""
    os.environ["SPECACHE_CUDA_GRAPHS"] = "1"
    try:
        return run()
    finally:
        os.environ.pop("SPECACHE_CUDA_GRAPHS", None)


def save(report: dict, out: Path) -> None:
    """Write the report so far (a killed run keeps every stage it finished)."""
    tmp = out / "gpu_check.json.tmp"
    tmp.write_text(json.dumps(report, indent=2))
    os.replace(tmp, out / "gpu_check.json")


def stage(report: dict, out: Path, name: str, run) -> None:
    """Run one stage, keep what it returned (or its error) under report[name], save, say so on stderr."""
    t = time.perf_counter()
    try:
        report[name] = run()
    except Exception as exc:  # a failed stage is a finding: the next ones still run
        import traceback

        report[name] = {"error": f"{type(exc).__name__}: {exc}"[:500], "traceback": traceback.format_exc()[-3000:]}
    report.setdefault("stage_seconds", {})[name] = round(time.perf_counter() - t, 1)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    save(report, out)
    print(f"[{name}] {json.dumps(report[name])[:1500]}", file=sys.stderr, flush=True)


def compare(model, context: int, batches: dict, steps: int, args) -> dict:
    """full and specache timed at the given batches; specache's tokens/s over full's."""
    runs = []
    for mode in ("full", "specache"):
        try:
            runs.append(timed_decode(model, mode, batches[mode], context, steps, args.chunk, args.bits, batches["k"]))
        except torch.cuda.OutOfMemoryError as exc:
            runs.append({"mode": mode, "batch": batches[mode], "error": f"out of memory: {str(exc)[:200]}"})
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        print(runs[-1], file=sys.stderr, flush=True)
    out = {"planned": batches, "runs": runs}
    if all("error" not in r for r in runs):
        out["speedup_specache_vs_full"] = round(runs[1]["tokens_per_second"] / runs[0]["tokens_per_second"], 2)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-results"))
    ap.add_argument("--context", type=int, default=32768, help="the paper stage's context")
    ap.add_argument("--budget-gb", type=float, default=48.0)
    ap.add_argument("--bits", type=int, default=1)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, of {', '.join(STAGES)}")
    ap.add_argument("--tests-timeout", type=float, default=150.0)
    ap.add_argument("--gamma", type=int, default=4, help="exact mode's draft tokens per verification (timed run)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing to do", file=sys.stderr)
        return 2
    stages = [x for x in args.stages.split(",") if x]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "budget_gb": args.budget_gb,
              "bits": args.bits, "stages": stages}
    save(report, out)
    total = torch.cuda.get_device_properties(0).total_memory
    quick_ctx = 4096
    model = random_model(llama3_8b_shape(max(args.context, quick_ctx)), torch.device("cuda"))
    quick = {"full": 2, "specache": 4, "exact": 2,
             "k": plan_batches(quick_ctx, args.budget_gb, args.bits, args.chunk)["k"]}
    runs = {
        "tests": lambda: limit_tests(out, args.tests_timeout),
        "profile": lambda: [profiled_decode(model, mode, 2, quick_ctx, 4, args.chunk, args.bits, quick["k"])
                            for mode in ("full", "specache")],
        "quick": lambda: compare(model, quick_ctx, quick, 8, args),
        "graphs": lambda: graphed(model, quick_ctx, 2, 8, args.chunk, quick["k"], args.bits),
        "paper-graphs": lambda: with_graphs(lambda: compare(
            model, args.context, plan_batches(args.context, args.budget_gb, args.bits, args.chunk), args.steps, args)),
        "dynamic": lambda: dynamic_cache_decode(model, 2, quick_ctx, 8, args.chunk),
        "variants": lambda: variants(model, quick_ctx, 4, 8, args.chunk, quick["k"]),
        "paper": lambda: compare(model, args.context, plan_batches(args.context, args.budget_gb, args.bits, args.chunk),
                                 args.steps, args),
        "exact": lambda: exact_section(model, quick | {"exact_transfer_per_row": 0}, quick_ctx,
                                       report.get("quick", {}).get("runs", []), args),
    }
    for name in stages:
        limit = 1.0 if name == "tests" else min(1.0, args.budget_gb * 1e9 / total)  # the budget: benchmarks only
        torch.cuda.set_per_process_memory_fraction(limit)
        stage(report, out, name, runs[name])
    print_summary(report)
    return 0


def print_summary(report: dict) -> None:
    """A short table of what ran (stdout)."""
    for name in ("quick", "paper"):
        section = report.get(name)
        if not section or "runs" not in section:
            continue
        print(f"\n{name}: {'mode':<10}{'batch':>7}{'step ms':>10}{'wall ms':>10}{'tok/s':>10}{'overlap':>9}"
              f"{'prefill/row s':>15}")
        for r in section["runs"]:
            if "error" in r:
                print(f"{'':<7}{r['mode']:<10}{r['batch']:>7}  {r['error'][:60]}")
                continue
            ov = "-" if r["overlap_share"] is None else f"{r['overlap_share']:.3f}"
            print(f"{'':<7}{r['mode']:<10}{r['batch']:>7}{r['step_ms']:>10.1f}{r['wall_step_ms']:>10.1f}"
                  f"{r['tokens_per_second']:>10.1f}{ov:>9}{r['prefill_seconds_per_row']:>15.2f}")
        if "speedup_specache_vs_full" in section:
            print(f"specache / full decode throughput: {section['speedup_specache_vs_full']}x (paper: 4.6x)")
    for p in report.get("profile", []) if isinstance(report.get("profile"), list) else []:
        print(f"profile {p['mode']} b{p['batch']} at {p['context']}: {p['device_events_per_step']} device events/step,"
              f" {p['device_ms_per_step']} ms device in {p['wall_ms_per_step']} ms wall")
    if isinstance(report.get("exact"), dict) and "equals_full" in report["exact"]:
        print_exact(report["exact"])


def exact_section(model, batches: dict, context: int, runs: list[dict], args) -> dict:
    """Exact mode on the GPU: token identity with full (tiny model), then the timed run at full's batch
    (at most 4, 2 with --quick) against full's ms per token at that batch (timed again if the
    full run above had another batch)."""
    out = {"equals_full": exact_equals_full(torch.device("cuda"))}
    print("exact == full:", out["equals_full"], file=sys.stderr)
    batch = max(1, min(batches["full"], 2))
    cycles = 3
    full = next((r for r in runs if r["mode"] == "full" and r["batch"] == batch and "error" not in r), None)
    try:
        if full is None:
            full = timed_decode(model, "full", batch, context, 8, args.chunk, args.bits, batches["k"])
        run = timed_exact(model, batch, context, cycles, args.chunk, args.bits, batches["k"], args.gamma,
                          batches["exact_transfer_per_row"])
        run["full_ms_per_token"] = full["step_ms"]
        run["exact_vs_full_ms"] = round(run["streamed"]["ms_per_token"] / full["step_ms"], 3)
        out["timed"] = run
    except torch.cuda.OutOfMemoryError as exc:
        out["timed"] = {"batch": batch, "error": f"out of memory: {str(exc)[:200]}"}
    torch.cuda.empty_cache()
    print(out["timed"], file=sys.stderr)
    return out


def print_exact(exact: dict) -> bool:
    """The exact section's lines; -> whether exact gave full's tokens and its timed run ran."""
    eq = exact["equals_full"]
    print(f"exact == full (tiny model, rows {eq['lengths']}, {eq['tokens']} tokens): {eq['identical']}"
          f" (first divergence {eq['first_divergence']}, acceptance {eq['acceptance_rate']})")
    run = exact.get("timed", {})
    if "error" in run:
        print(f"exact timed run, batch {run['batch']}: {run['error'][:80]}")
        return False
    s, p = run["streamed"], run["plain_copy"]
    print(f"exact at {run['context']} tokens, batch {run['batch']}, gamma {run['gamma']}: {s['ms_per_token']} ms/token"
          f" (full {run['full_ms_per_token']}: {run['exact_vs_full_ms']}x), verify {s['verify_ms']} ms streamed /"
          f" {p['verify_ms']} ms plain copy, overlap {s['verify_overlap_share']}, copied"
          f" {(s['verify_copy_bytes'] or 0) / 2**30:.2f} GiB/verify ({run['copy_vs_planned']}x planned),"
          f" acceptance {run['acceptance_rate']}")
    return bool(eq["identical"])


if __name__ == "__main__":
    sys.exit(main())
