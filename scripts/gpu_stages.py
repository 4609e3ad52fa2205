#!/usr/bin/env python
"""The GPU stages of scripts/gpu_check.py, each run in a child process of its own:

    python scripts/gpu_stages.py STAGE --out OUT [--context N --budget-gb G --steps S --chunk C --tests-timeout T]

writes OUT/stages/STAGE.json (again after each of its runs, so a stage the watchdog kills keeps what it
finished). scripts/gpu_check.py is the entry point: it budgets the stages, runs each under a timeout and
merges their results; see its docstring for the stages and how to run them in one device lease.

Every timed run carries `context`, `batch`, `ms_per_step`, `tokens_per_s`, `overlap` (the share of
fetches complete before the attention needed them) and, at the planner's batches, `predicted_ms_per_step`
(the planner's roofline step at that batch) and `predicted_ms_with_kernels` (that step plus its kernel launches at
engine/plan/step_costs.KERNEL_LAUNCH_SECONDS each: the launch cost to be measured); gpu_check adds
`speedup_vs_full`.
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


CUDA_TESTS = ("tests/test_triton_decode.py", "tests/test_guide_triton.py", "tests/test_cuda_standin.py",
              "tests/test_transfer.py", "tests/test_graphs.py", "tests/test_verify_stream.py", "tests/test_engine.py")


def limit_tests(out: Path, timeout: float) -> dict:
    """The engine's tests that run on CUDA (SPECACHE_TEST_DEVICE=cuda; the kernels' files first), their
    output written to out/tests.log as they run; stopped after `timeout` seconds. -> pytest's last line,
    its exit code, the tests passed and failed so far (counted from the verbose log: a stopped run
    still says how far it got)."""
    env = dict(os.environ, SPECACHE_TEST_DEVICE="cuda")
    t = time.perf_counter()
    log = out / "tests.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "pytest", "-v", "-rf", "-p", "no:cacheprovider", *CUDA_TESTS],
                                cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, text=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = "timeout"
    lines = [x for x in log.read_text().splitlines() if x.strip()]
    return {"exit_code": code, "summary": lines[-1] if lines else "", "seconds": round(time.perf_counter() - t, 1),
            "passed": sum(" PASSED" in x for x in lines), "skipped": sum(" SKIPPED" in x for x in lines),
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


COPY_ROWS = True  # prefill one row and copy it to the others: a batch of 22 rows of 32k fits in a lease


def prefill_random(engine, cache, batch: int, context: int) -> tuple[list[torch.Tensor], float]:
    """Prefill rows 0..batch-1 of `cache` with `context` random tokens each (seed 0); with COPY_ROWS only
    row 0 is prefilled and copied to the others (a lease has no time for 22 prefills of 32k tokens).
    -> (each row's last logits [V], the prefill seconds of `batch` rows (row 0's times batch when
    copied), the device synchronized)."""
    from engine.generate.steps import sync

    gen = torch.Generator(device="cpu").manual_seed(0)
    t0 = time.perf_counter()
    last = []
    for row in range(batch if not COPY_ROWS else 1):
        ids = torch.randint(10, engine.model.config.vocab_size, (context,), generator=gen).tolist()
        *_, logits = engine.prefill(cache, ids, row)
        last.append(logits)
    sync(engine.device)
    seconds = time.perf_counter() - t0
    for row in range(len(last), batch):  # the rows' contents do not change a step's time
        cache.copy_row(0, row)
        last.append(last[0])
    sync(engine.device)
    return last, seconds * batch if COPY_ROWS else seconds


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
    from engine.kvcache.host_store import overlap_share

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
            "ms_per_step": round(step_ms, 2), "wall_step_ms": round(1000 * wall / steps, 2),
            "tokens_per_s": round(batch * 1000 / step_ms, 2),
            "overlap": overlap_share(stores), "transfer_bytes_per_step": per_step,
            "prefetch_reuse": stats.get("prefetch_reuse"), "guide_kernel": stats.get("guide_kernel"),
            "fetch_path": stats.get("fetch_path"), "graph_replay": stats.get("graphs"), "first_ids": torch.stack(first_ids[:4]).tolist(),
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
            "prefill_seconds_per_row": round(prefill_s / batch, 2), "ms_per_step": round(step_ms, 2),
            "wall_step_ms": round(step_ms, 2), "tokens_per_s": round(batch * 1000 / step_ms, 2),
            "overlap": None}


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
        if "ms_per_step" in eager and "ms_per_step" in graph:
            runs |= {"speedup": round(eager["ms_per_step"] / graph["ms_per_step"], 2),
                     "same_ids": eager["first_ids"] == graph["first_ids"]}
        out[name] = runs
        keep(out)  # a stage stopped by the watchdog keeps the modes it finished
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
        "k": p.mode("specache").k, "exact_transfer_per_row": per_row, "hardware": hw.display_name,
        "bits": bits, "predicted_ms_per_step": {m: round(p.mode(m).step_seconds * 1000, 2) for m in ("full", "specache")},
        "predicted_ms_with_kernels": {m: round((p.mode(m).predicted_step_seconds or p.mode(m).step_seconds) * 1000, 2)
                                      for m in ("full", "specache")}}


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
        out["speedup_specache_vs_full"] = round(runs[1]["tokens_per_s"] / runs[0]["tokens_per_s"], 2)
    return out


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
        run["full_ms_per_token"] = full["ms_per_step"]
        run["exact_vs_full_ms"] = round(run["streamed"]["ms_per_token"] / full["ms_per_step"], 3)
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


def versions() -> dict:
    """What the run ran on: torch, its CUDA, triton, transformers, the GPU and the git commit."""
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True)
    cuda = torch.cuda.is_available()
    props = torch.cuda.get_device_properties(0) if cuda else None
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton_version,
            "transformers": transformers.__version__, "python": sys.version.split()[0],
            "gpu": torch.cuda.get_device_name() if cuda else None,
            "capability": list(torch.cuda.get_device_capability()) if cuda else None,
            "gpu_memory_gib": round(props.total_memory / 2**30, 1) if props else None,
            "commit": commit.stdout.strip() or None, "dirty": bool(dirty.stdout.strip()) if commit.stdout else None}


def paper_run(model, mode: str, bits: int, args) -> dict:
    """One mode at the paper's setting (--context, --budget-gb) at the planner's batch for `bits`, the
    planner's predicted ms per step beside the measured one."""
    planned = plan_batches(args.context, args.budget_gb, bits, args.chunk)
    try:
        run = timed_decode(model, mode, planned[mode], args.context, args.steps, args.chunk, bits, planned["k"])
    except torch.cuda.OutOfMemoryError as exc:
        run = {"mode": mode, "batch": planned[mode], "context": args.context, "error": f"out of memory: {str(exc)[:200]}"}
    run |= {"bits": bits if mode != "full" else None, "predicted_ms_per_step": planned["predicted_ms_per_step"][mode],
            "predicted_ms_with_kernels": planned["predicted_ms_with_kernels"][mode]}
    return {"planned": planned, "runs": [run]}


def triton_run(model, fused: bool, args) -> dict:
    """1-bit specache at the paper's setting and the planner's batch, without the corrected set (the
    fused kernel's contract), through the torch code or the fused Triton decode (SPECACHE_TRITON_DECODE=1),
    both eager (no graph replay)."""
    from engine.config import CacheConfig

    planned = plan_batches(args.context, args.budget_gb, 1, args.chunk)
    config = CacheConfig(mode="specache", bits=1, group=64, k=planned["k"], chunk_size=args.chunk,
                         prefetch="speculative", correct=False)
    os.environ["SPECACHE_TRITON_DECODE"] = "1" if fused else "0"
    os.environ["SPECACHE_CUDA_GRAPHS"] = "0"  # eager both: the kernels compared, not the replay
    try:
        run = timed_decode(model, "specache", planned["specache"], args.context, args.steps, args.chunk, 1,
                           planned["k"], config=config)
    finally:
        os.environ.pop("SPECACHE_TRITON_DECODE", None)
        os.environ.pop("SPECACHE_CUDA_GRAPHS", None)
    run |= {"bits": 1, "correct": False, "decode": "triton" if fused else "torch",
            "predicted_ms_per_step": planned["predicted_ms_per_step"]["specache"],
            "predicted_ms_with_kernels": planned["predicted_ms_with_kernels"]["specache"]}
    return {"planned": planned, "runs": [run]}


def with_graphs(run):
    """run() with decode passes replayed as CUDA graphs (SPECACHE_CUDA_GRAPHS=1)."""
    os.environ["SPECACHE_CUDA_GRAPHS"] = "1"
    try:
        return run()
    finally:
        os.environ.pop("SPECACHE_CUDA_GRAPHS", None)


QUICK_CONTEXT = 4096
STAGE_FILE: list[Path] = []  # OUT/stages/STAGE.json of the stage this process runs


def keep(result) -> None:
    """Write the stage's result so far (again at its end; gpu_check reads it even after a kill)."""
    if STAGE_FILE:
        tmp = STAGE_FILE[0].with_suffix(".json.tmp")
        tmp.write_text(json.dumps(result, indent=2))
        os.replace(tmp, STAGE_FILE[0])


def stage_table(args, out: Path) -> dict:
    """Each stage's body by name (scripts/gpu_check.py's STAGES name the same ones)."""
    model = lambda: random_model(llama3_8b_shape(max(args.context, QUICK_CONTEXT)), torch.device("cuda"))  # noqa: E731
    quick = lambda: {"full": 2, "specache": 4, "exact": 2, "exact_transfer_per_row": 0,  # noqa: E731
                     "k": plan_batches(QUICK_CONTEXT, args.budget_gb, 1, args.chunk)["k"]}
    return {
        "versions": versions,
        "tests": lambda: limit_tests(out, args.tests_timeout),
        "graphs": lambda: graphed(model(), QUICK_CONTEXT, 2, 8, args.chunk, quick()["k"], 1),
        "paper-full": lambda: paper_run(model(), "full", 1, args),
        "paper-1bit": lambda: paper_run(model(), "specache", 1, args),
        "paper-2bit": lambda: paper_run(model(), "specache", 2, args),
        "triton-torch": lambda: triton_run(model(), False, args),
        "triton-fused": lambda: triton_run(model(), True, args),
        "paper-graphs": lambda: with_graphs(lambda: paper_run(model(), "specache", 1, args)),
        "profile": lambda: [profiled_decode(m, mode, 2, QUICK_CONTEXT, 4, args.chunk, 1, quick()["k"])
                            for m in [model()] for mode in ("full", "specache")],
        "quick": lambda: compare(model(), QUICK_CONTEXT, quick(), 8, args),
        "dynamic": lambda: dynamic_cache_decode(model(), 2, QUICK_CONTEXT, 8, args.chunk),
        "variants": lambda: variants(model(), QUICK_CONTEXT, 4, 8, args.chunk, quick()["k"]),
        "exact": lambda: exact_section(model(), quick(), QUICK_CONTEXT, [], args),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description="one stage of scripts/gpu_check.py, in this process")
    ap.add_argument("stage")
    ap.add_argument("--out", required=True)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--budget-gb", type=float, default=48.0)
    ap.add_argument("--bits", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--tests-timeout", type=float, default=120.0)
    ap.add_argument("--gamma", type=int, default=4)
    args = ap.parse_args()
    out = Path(args.out)
    (out / "stages").mkdir(parents=True, exist_ok=True)
    table = stage_table(args, out)
    if args.stage not in ("versions", "tests"):
        if not torch.cuda.is_available():
            print(f"gpu_stages {args.stage}: no CUDA device", file=sys.stderr)
            return 2
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.budget_gb * 1e9 / total))  # the budget
    STAGE_FILE.append(out / "stages" / f"{args.stage}.json")
    result = table[args.stage]()
    keep(result)
    print(f"[{args.stage}] {json.dumps(result)[:1500]}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
