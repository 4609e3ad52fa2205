"""`bench speed`: prefill tokens/s and decode ms/token over context lengths x batch sizes, for
each cache mode and for transformers' own `generate` with a DynamicCache (mode ``hf``).

Each mode runs in its own child process (``python -m engine.bench.speed SPEC OUT``) so that
its peak RSS (getrusage ru_maxrss of the child) is its own; the child loads the model, runs
a small warm-up, notes its RSS, then measures every (length, batch) of that mode.

Prompts are windows of the real documents' tokens (equal lengths, so transformers needs no
padding). Per (length, batch): one prefill (timed; rows are prefilled one after the other,
as the engine does), then `warmup` decode steps that are not counted, then `repeats`
segments of `tokens` greedy steps; decode ms/token is the median over the segments of the
mean step time (a step advances every row by one token, so it is also ms per token of one
sequence; tokens/s counts all rows). For ``hf`` a stopping criterion timestamps every
generated token: the first stamp ends the prefill, later gaps are the decode steps.
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Iterator, Sequence

import torch

from engine.bench.common import (HF_MODE, BenchProgress, BenchResult, ModeSpec, encode, envelope, median, parse_mode,
                                 stock_transformers, target)
from engine.config import CacheConfig
from engine.errors import BadArgument, SpecacheError
from engine.generate.engine import Engine
from engine.generate.steps import greedy, sync
from engine.model.files import ModelFiles
from engine.model.loading import load_model
from engine.model.sources import source_from_json

PROGRESS = "@progress "
TARGET_VS_FULL, TARGET_VS_HF = 1.5, 2.5


class WorkerFailed(SpecacheError):
    exit_code = 1
    code = "bench_worker_failed"


# ---- measurement (in whichever process runs the mode) -----------------------------------

def make_prompts(corpus: list[int], length: int, batch: int) -> list[list[int]]:
    """`batch` distinct windows of `length` tokens (the corpus repeated when short)."""
    ids = corpus
    while len(ids) < length * 2:
        ids = ids + corpus
    stride = max(1, (len(ids) - length) // max(batch, 1))
    return [ids[b * stride: b * stride + length] for b in range(batch)]


@torch.inference_mode()
def time_engine(model, config, prompts: list[list[int]], steps: int) -> dict:
    """Prefill seconds and the duration of each decode step (the engine's own step loop)."""

    engine = Engine(model, config)
    dev = engine.device
    cache = engine.new_cache(len(prompts), max(map(len, prompts)) + steps + 4)
    t0 = time.perf_counter()
    lasts = []
    for row, prompt in enumerate(prompts):
        *_, last = engine.prefill(cache, prompt, row)
        lasts.append(last)
    sync(dev)
    prefill_s = time.perf_counter() - t0
    times: list[float] = []
    loop = engine.steps(cache, torch.stack(lasts), greedy, history=prompts)
    t = time.perf_counter()
    for i, _ in enumerate(loop):  # item 0 comes from the prefill logits: no model call
        sync(dev)
        now = time.perf_counter()
        if i:
            times.append(now - t)
        t = now
        if len(times) >= steps:
            break
    loop.close()
    cache.close()
    stats = cache.stats()
    return {"prefill_seconds": prefill_s, "step_seconds": times, "device_bytes": stats.get("device_bytes"),
            "host_bytes": stats.get("host_bytes")}


class _Stamps:
    """A stopping criterion that only records when each token was generated."""

    def __init__(self, device: torch.device):
        self.times: list[float] = []
        self.device = device

    def __call__(self, input_ids, scores, **kwargs):
        sync(self.device)
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@torch.inference_mode()
def time_hf(model, prompts: list[list[int]], steps: int) -> dict:
    """Stock transformers' generate (greedy, DynamicCache, SDPA attention, nn.Linear) on equal-length prompts."""
    from transformers import DynamicCache, StoppingCriteriaList

    dev = next(model.parameters()).device
    ids = torch.tensor(prompts, device=dev)
    stamps = _Stamps(dev)
    cache = DynamicCache(config=model.config)
    with stock_transformers(model):
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps + 1, min_new_tokens=steps + 1,
                       do_sample=False, past_key_values=cache, stopping_criteria=StoppingCriteriaList([stamps]),
                       pad_token_id=model.config.eos_token_id if model.config.pad_token_id is None
                       else model.config.pad_token_id)
    t = stamps.times
    device_bytes = None
    try:
        device_bytes = sum(x.numel() * x.element_size() for layer in cache.layers for x in (layer.keys, layer.values)
                           if isinstance(x, torch.Tensor))
    except Exception:  # the cache layout is transformers' business; bytes are informative only
        pass
    return {"prefill_seconds": t[0] - t0, "step_seconds": [b - a for a, b in zip(t, t[1:])],
            "device_bytes": device_bytes, "host_bytes": 0, "cache_class": type(cache).__name__}


def _load_average() -> list[float] | None:
    """1/5/15-minute load averages: other work on the machine skews every timing."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def peak_rss_bytes() -> int:
    ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(ru if sys.platform == "darwin" else ru * 1024)


def current_rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class SpeedGrid:
    """What is timed of each mode: every prompt length x batch size, each with `warmup` decode steps not
    counted, then `repeats` segments of `tokens` steps (the median segment is reported)."""

    lengths: Sequence[int]
    batches: Sequence[int]
    tokens: int = 16
    repeats: int = 3
    warmup: int = 2

    @property
    def steps(self) -> int:
        return self.warmup + self.repeats * self.tokens


@dataclass(frozen=True)
class ChildModel:
    """How a mode's child process loads the model (run_speed with isolation): the model as the parent resolved
    it (ModelSource.as_json: the child resolves nothing), the device, the dtype and the torch threads."""

    source: dict
    device: str = "cpu"
    dtype: str = "auto"
    threads: int | None = None


def measure_mode(model, spec: ModeSpec, corpus: list[int], grid: SpeedGrid, on_progress=None) -> list[dict]:
    """Every (length, batch) of one mode. -> list of per-config results."""
    lengths, batches, tokens, repeats, warmup = grid.lengths, grid.batches, grid.tokens, grid.repeats, grid.warmup
    steps = grid.steps
    out = []
    for length in lengths:
        for batch in batches:
            prompts = make_prompts(corpus, length, batch)
            t0 = time.perf_counter()
            raw = time_hf(model, prompts, steps) if spec.mode == HF_MODE else \
                time_engine(model, spec.config, prompts, steps)
            counted = raw.pop("step_seconds")[warmup:]
            segments = [1e3 * sum(counted[i * tokens:(i + 1) * tokens]) / tokens for i in range(repeats)
                        if len(counted) >= (i + 1) * tokens]
            ms = median(segments)
            entry = {"length": length, "batch": batch, "prefill_seconds": raw.pop("prefill_seconds"),
                     "decode_ms_per_token": ms, "decode_ms_segments": segments,
                     "decode_ms_step_median": median([1e3 * x for x in counted]),
                     "decode_tokens_per_s": batch * 1e3 / ms if ms else None, **raw}
            entry["prefill_tokens_per_s"] = length * batch / entry["prefill_seconds"]
            out.append(entry)
            if on_progress:
                on_progress(f"speed {spec.label} {length} tokens x{batch}: prefill "
                            f"{entry['prefill_tokens_per_s']:.0f} tok/s, decode {ms:.1f} ms/token "
                            f"({time.perf_counter() - t0:.1f} s)")
    return out


def warm_up(model, spec: ModeSpec, corpus: list[int]) -> None:
    """A tiny run so one-time costs (allocator, kernels, lazy imports) stay out of the numbers."""
    measure_mode(model, spec, corpus, SpeedGrid([min(64, len(corpus))], [1], tokens=2, repeats=1, warmup=1))


# ---- child process -----------------------------------------------------------------------

def worker_main(spec_path: str, out_path: str) -> int:
    """Entry point of the child: measure one mode, write its JSON result to out_path."""

    job = json.loads(Path(spec_path).read_text())
    spec = parse_mode(job["mode"])
    if job.get("config"):  # the parent's resolved setting (the model's defaults included)
        spec = replace(spec, config=CacheConfig(**job["config"]))
    if job.get("threads"):
        torch.set_num_threads(job["threads"])
    lm = load_model(ModelFiles(source_from_json(job["model"])), device=job["device"], dtype=job["dtype"],  # hf: transformers' own classes
                    classes="transformers" if spec.mode == HF_MODE else "auto")
    corpus = job["corpus"]
    say = lambda m: print(PROGRESS + m, file=sys.stderr, flush=True)  # noqa: E731
    load_start = _load_average()
    warm_up(lm.model, spec, corpus)
    model_rss = current_rss_bytes()
    configs = measure_mode(lm.model, spec, corpus, SpeedGrid(job["lengths"], job["batches"], job["tokens"],
                                                             job["repeats"], job["warmup"]), say)
    peak = peak_rss_bytes()
    result = {"configs": configs, "torch_threads": torch.get_num_threads(),
              "load_average": {"start": load_start, "end": _load_average()}, "rss": {"model_bytes": model_rss, "peak_bytes": peak,
                                          "peak_above_model_bytes": peak - model_rss if model_rss else None,
                                          "isolated": True}}
    Path(out_path).write_text(json.dumps(result))
    return 0


def run_child(job: dict, module: str = "engine.bench.speed") -> Iterator[str | dict]:
    """Run one mode in a child process (`python -m module JOB OUT`: speed's worker_main, or another bench's with
    the same calling convention); yields its progress lines, then its result dict."""
    with tempfile.TemporaryDirectory(prefix="specache-bench-") as tmp:
        spec_path, out_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(job))
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        proc = subprocess.Popen([sys.executable, "-m", module, str(spec_path), str(out_path)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        tail: list[str] = []
        assert proc.stderr is not None
        for line in proc.stderr:
            if line.startswith(PROGRESS):
                yield line[len(PROGRESS):].rstrip("\n")
            else:
                tail = (tail + [line.rstrip("\n")])[-20:]
        rc = proc.wait()
        if rc != 0 or not out_path.is_file():
            last = next((x for x in reversed(tail) if x.strip()), f"exit status {rc}")
            raise WorkerFailed(f"{module.rsplit('.', 1)[-1]} worker for mode {job['mode']} failed: {last}")
        yield json.loads(out_path.read_text())


# ---- the bench ---------------------------------------------------------------------------

def run_speed(lm, texts, modes: Sequence[ModeSpec], grid: SpeedGrid, child: ChildModel | None = None,
              quick: bool = False) -> Iterator[BenchProgress | BenchResult]:
    """Yields progress, then BenchResult (docs/bench.md). child: each mode measured in a child process that
    loads the model itself (honest peak RSS); None: in this process, with lm."""
    t_start = time.perf_counter()
    bad = [n for n in grid.lengths if n + grid.steps + 4 > lm.max_context]
    if bad:
        raise BadArgument(f"--lengths {bad} plus {grid.steps} decode steps exceed the model window {lm.max_context}")
    corpus = encode(lm.tokenizer, "\n\n".join(t for _, t in texts))
    if not corpus:
        raise BadArgument("the speed documents have no text")
    settings = {"documents": [s for s, _ in texts], "lengths": list(grid.lengths), "batches": list(grid.batches),
                "decode_tokens": grid.tokens, "repeats": grid.repeats, "warmup_steps": grid.warmup,
                "isolated": child is not None,
                "prompts": "equal-length windows of the documents' tokens (no chat template)"}
    result = envelope("speed", quick, settings, modes, lm)
    per_mode = []
    for i, spec in enumerate(modes):
        t0 = time.perf_counter()
        yield BenchProgress(f"speed {spec.label}: starting ({'child process' if child else 'in process'})",
                            i, len(modes))
        measured = yield from (_measure_child(child, spec, corpus, grid, i, len(modes)) if child is not None else
                               _measure_here(lm, spec, corpus, grid, i, len(modes)))
        per_mode.append({"label": spec.label, "mode": spec.mode, **measured,
                         "seconds": round(time.perf_counter() - t0, 2)})
        yield BenchProgress(f"speed {spec.label}: done ({time.perf_counter() - t0:.1f} s)", i + 1, len(modes))
    result["per_mode"] = per_mode
    result["comparison"] = compare(per_mode, modes)
    result["targets"] = targets(result["comparison"], modes, grid.lengths, grid.batches)
    result["seconds"] = round(time.perf_counter() - t_start, 2)
    yield BenchResult(result)


def _measure_child(child: ChildModel, spec: ModeSpec, corpus: list[int], grid: SpeedGrid, i: int, n: int):
    """One mode in a child process (run_child): forwards its progress; returns its result."""
    job = {"model": child.source, "device": child.device, "dtype": child.dtype, "mode": spec.label, "corpus": corpus,
           "lengths": list(grid.lengths), "batches": list(grid.batches), "tokens": grid.tokens,
           "repeats": grid.repeats, "warmup": grid.warmup, "threads": child.threads,
           "config": asdict(spec.config) if spec.config is not None else None}
    measured = None
    for item in run_child(job):
        if isinstance(item, str):
            yield BenchProgress(item, i, n)
        else:
            measured = item
    return measured


def _measure_here(lm, spec: ModeSpec, corpus: list[int], grid: SpeedGrid, i: int, n: int):
    """One mode in this process: forwards its progress; returns its result (no RSS figures)."""
    lines: list[str] = []
    load_start = _load_average()
    warm_up(lm.model, spec, corpus)
    configs = measure_mode(lm.model, spec, corpus, grid, lines.append)
    for line in lines:
        yield BenchProgress(line, i, n)
    return {"configs": configs, "torch_threads": torch.get_num_threads(),
            "load_average": {"start": load_start, "end": _load_average()},
            "rss": {"model_bytes": None, "peak_bytes": None, "peak_above_model_bytes": None, "isolated": False}}


def compare(per_mode: list[dict], modes: Sequence[ModeSpec]) -> list[dict]:
    """One row per (length, batch, mode) with ratios against full and against transformers."""
    full = next((m.label for m in modes if m.mode == "full" and m.config.chunk_size == 512), None) or \
        next((m.label for m in modes if m.mode == "full"), None)
    hf = next((m.label for m in modes if m.mode == HF_MODE), None)
    table = {(m["label"], c["length"], c["batch"]): c for m in per_mode for c in m["configs"]}
    rows = []
    for m in per_mode:
        for c in m["configs"]:
            key = (c["length"], c["batch"])
            f, h = table.get((full, *key)), table.get((hf, *key))
            row = {"mode": m["label"], "length": c["length"], "batch": c["batch"],
                   "prefill_tokens_per_s": c["prefill_tokens_per_s"], "decode_ms_per_token": c["decode_ms_per_token"],
                   "decode_tokens_per_s": c["decode_tokens_per_s"], "device_bytes": c.get("device_bytes"),
                   "peak_rss_bytes": m["rss"]["peak_bytes"],
                   "decode_speedup_vs_full": _ratio(f and f["decode_ms_per_token"], c["decode_ms_per_token"]),
                   "decode_speedup_vs_hf": _ratio(h and h["decode_ms_per_token"], c["decode_ms_per_token"]),
                   "prefill_vs_full": _ratio(c["prefill_tokens_per_s"], f and f["prefill_tokens_per_s"])}
            rows.append(row)
    return rows


def _ratio(a, b):
    return a / b if a and b else None


def targets(rows: list[dict], modes: Sequence[ModeSpec], lengths, batches) -> list[dict]:
    spec = next((m for m in modes if m.is_default_specache), None) or next((m for m in modes if m.mode == "specache"), None)
    if spec is None:
        return [target("specache decode speed-up", "measured", None, None, "no specache mode among --modes")]
    longest = max(lengths)
    out = []
    for batch in batches:
        row = next((r for r in rows if r["mode"] == spec.label and r["length"] == longest and r["batch"] == batch), None)
        if row is None:
            continue
        for key, goal, name in (("decode_speedup_vs_full", TARGET_VS_FULL, "full"),
                                ("decode_speedup_vs_hf", TARGET_VS_HF, "transformers generate")):
            v = row[key]
            out.append(target(f"{spec.label} decode vs {name}, {longest} tokens, batch {batch}", f">= {goal}x", v,
                              None if v is None else v >= goal))
    return out


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1], sys.argv[2]))
