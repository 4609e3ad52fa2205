#!/usr/bin/env python
"""One-call GPU check for specache: correctness on CUDA, then the paper's throughput setting.

Run on a machine with one CUDA GPU, from the repository root, in the project's venv:

    python scripts/gpu_check.py --out "$OUT"          # full run, aims at < 8 min on one H200
    python scripts/gpu_check.py --quick --out "$OUT"  # a minute: small context and batches

1. The engine's limit tests (tests/test_engine.py) on CUDA (SPECACHE_TEST_DEVICE=cuda).
2. A randomly initialised model of Llama-3-8B shape (fp16; weights need not be real for
   timing) at --context tokens under a device-memory budget of --budget-gb (48 GB mirrors
   the paper's RTX A6000): the largest batch the planner allows for the full cache and for
   1-bit SpeCache (capped by host RAM for the exact store), a real chunked prefill of random
   tokens at that batch, then timed decode steps: tokens/s of each, their ratio (paper:
   4.6x), the share of prefetches complete before the attention needed them (paper: 96.8%),
   and the per-step transfer bytes.
3. Exact mode (--cache exact, engine/kvcache/exact.py): greedy full and exact on the project's tiny
   random GQA test model (fp32) for rows of different prompt lengths must give identical tokens;
   then on the big random model at --context, exact's decode ms per token of a row against full's
   at the same batch, with the verification streamed (the store's layers copied double-buffered on
   the side stream) and with a plain compute-stream copy; the share of layers whose copy had
   completed when their attention needed it, and the bytes copied per verification against the
   planner's prediction (exact_cycle: batch x context x K/V bytes per token). A random model's
   drafts are seldom accepted: its acceptance is reported, not the speed of a real model's exact mode.
Prints a short table last and writes gpu_check.json to --out.
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


def limit_tests() -> dict:
    """tests/test_engine.py and tests/test_verify_stream.py on CUDA; returns pytest's summary line and exit code."""
    env = dict(os.environ, SPECACHE_TEST_DEVICE="cuda")
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/test_engine.py", "tests/test_verify_stream.py",
                           "-p", "no:cacheprovider"],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    lines = [x for x in proc.stdout.splitlines() if x.strip()]
    if proc.returncode:
        print(proc.stdout[-4000:], proc.stderr[-2000:], file=sys.stderr)
    return {"exit_code": proc.returncode, "summary": lines[-1] if lines else "", "seconds": time.perf_counter() - t}


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


def timed_decode(model, mode: str, batch: int, context: int, steps: int, chunk: int, bits: int, k: int) -> dict:
    """Prefill `batch` rows of `context` random tokens, then time `steps` decode steps."""
    from engine.config import CacheConfig
    from engine.generate.engine import Engine
    from engine.generate.steps import greedy
    from engine.kvcache.transfer import overlap_share

    config = CacheConfig(mode=mode, bits=bits, group=64, k=k, chunk_size=chunk)
    engine = Engine(model, config)
    cache = engine.new_cache(batch, context + steps + 4)
    last, prefill_s = prefill_random(engine, cache, batch, context)
    steps_it = engine.steps(cache, torch.stack(last), greedy)
    for _ in range(3):  # T1, pre-decoding and one steady step: warm-up
        next(steps_it)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        next(steps_it)
    end.record()
    torch.cuda.synchronize()
    step_ms = start.elapsed_time(end) / steps
    steps_it.close()
    cache.close()
    stores = [layer.store for layer in cache.layers if getattr(layer, "store", None) is not None]
    per_step = 0
    if mode == "specache":
        shape = cache.shape
        per_step = batch * shape.layers * shape.kv_heads * k * shape.head_dim * 2 * 2  # K and V, fp16
    return {"mode": mode, "batch": batch, "context": context, "prefill_seconds": round(prefill_s, 2),
            "step_ms": round(step_ms, 2), "tokens_per_second": round(batch * 1000 / step_ms, 2),
            "overlap_share": overlap_share(stores), "transfer_bytes_per_step": per_step,
            "peak_device_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            "device_bytes": cache.device_bytes(), "host_bytes": cache.host_bytes()}


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
    cache = engine.new_cache(batch, context + (2 * cycles + 2) * (gamma + 1) + decode_headroom(config) + 4)
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

    from engine.plan.planner import detect_hardware, machine_ram_bytes, plan
    from engine.plan.profiles import load_model_profile

    hw = detect_hardware(measure=True)
    budget = int(budget_gb * 1e9)
    hw = replace(hw, device_memory_bytes=budget, free_memory_bytes=budget)
    total_ram, available = machine_ram_bytes()
    p = plan(hw, load_model_profile("llama-3-8b"), context, bits=bits, group=64, host_ram_bytes=int(available * 0.8),
             prefill_chunk=chunk, element_bytes=2)
    exact = p.mode("exact")
    per_row = exact.transfer_bytes_per_step // exact.max_batch if exact.max_batch else 0
    return {m: p.mode(m).max_batch for m in ("full", "specache", "exact")} | {
        "k": p.mode("specache").k, "exact_transfer_per_row": per_row, "hardware": hw.display_name}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-results"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--context", type=int, default=None)
    ap.add_argument("--budget-gb", type=float, default=48.0)
    ap.add_argument("--bits", type=int, default=1)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--skip-exact", action="store_true")
    ap.add_argument("--gamma", type=int, default=4, help="exact mode's draft tokens per verification (timed run)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing to do", file=sys.stderr)
        return 2
    context = args.context or (4096 if args.quick else 32768)
    steps = args.steps or (8 if args.quick else 16)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "context": context,
              "budget_gb": args.budget_gb, "bits": args.bits}
    if not args.skip_tests:
        report["limit_tests"] = limit_tests()
        print("limit tests:", report["limit_tests"]["summary"], file=sys.stderr)
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, args.budget_gb * 1e9 / total))
    batches = plan_batches(context, args.budget_gb, args.bits, args.chunk)
    if args.quick:
        batches |= {"full": min(batches["full"], 2), "specache": min(batches["specache"], 4)}
    report["planned"] = batches
    print("planned batches:", batches, file=sys.stderr)
    model = random_model(llama3_8b_shape(context), torch.device("cuda"))
    runs = []
    for mode in ("full", "specache"):
        try:
            runs.append(timed_decode(model, mode, batches[mode], context, steps, args.chunk, args.bits, batches["k"]))
        except torch.cuda.OutOfMemoryError as exc:
            runs.append({"mode": mode, "batch": batches[mode], "error": f"out of memory: {str(exc)[:200]}"})
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        print(runs[-1], file=sys.stderr)
    report["runs"] = runs
    if not args.skip_exact:
        report["exact"] = exact_section(model, batches, context, runs, args)
    ok = [r for r in runs if "error" not in r]
    if len(ok) == 2:
        report["speedup_specache_vs_full"] = round(ok[1]["tokens_per_second"] / ok[0]["tokens_per_second"], 2)
    tmp = out / "gpu_check.json.tmp"
    tmp.write_text(json.dumps(report, indent=2))
    os.replace(tmp, out / "gpu_check.json")
    print(f"\n{'mode':<10}{'batch':>7}{'step ms':>10}{'tok/s':>10}{'overlap':>9}{'MiB/step':>10}{'peak GiB':>10}")
    for r in runs:
        if "error" in r:
            print(f"{r['mode']:<10}{r['batch']:>7}  {r['error'][:60]}")
            continue
        ov = "-" if r["overlap_share"] is None else f"{r['overlap_share']:.3f}"
        print(f"{r['mode']:<10}{r['batch']:>7}{r['step_ms']:>10.1f}{r['tokens_per_second']:>10.1f}{ov:>9}"
              f"{r['transfer_bytes_per_step'] / 2**20:>10.1f}{r['peak_device_gib']:>10.1f}")
    if "speedup_specache_vs_full" in report:
        print(f"specache / full decode throughput: {report['speedup_specache_vs_full']}x (paper: 4.6x)")
    exact_ok = True
    if "exact" in report:
        exact_ok = print_exact(report["exact"])
    tests_ok = report.get("limit_tests", {}).get("exit_code", 0) == 0
    return 0 if tests_ok and len(ok) == 2 and exact_ok else 1


def exact_section(model, batches: dict, context: int, runs: list[dict], args) -> dict:
    """Exact mode on the GPU: token identity with full (tiny model), then the timed run at full's batch
    (at most 4, 2 with --quick) against full's ms per token at that batch (timed again if the
    full run above had another batch)."""
    out = {"equals_full": exact_equals_full(torch.device("cuda"))}
    print("exact == full:", out["equals_full"], file=sys.stderr)
    batch = max(1, min(batches["full"], 2 if args.quick else 4))
    cycles = 3 if args.quick else 4
    full = next((r for r in runs if r["mode"] == "full" and r["batch"] == batch and "error" not in r), None)
    try:
        if full is None:
            full = timed_decode(model, "full", batch, context, args.steps or 8, args.chunk, args.bits, batches["k"])
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
