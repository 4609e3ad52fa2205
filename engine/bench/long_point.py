"""One point of `bench long` (one cache mode at one context length), run in a child process of its own
(``python -m engine.bench.long_point JOB OUT``, started by engine.bench.speed.run_child) so that the peak
RSS it reports (getrusage ru_maxrss, read right after the timed run) is that point's alone: the model,
a warm-up, and one prompt of that length prefilled and decoded.

The child loads the model, warms up on a short prompt, notes its RSS, then times the prefill of the
summary prompt and `tokens` decode steps (the engine's own step loop, every step timed; the steps run
on past an end-of-text token, as the speed bench's do). The full cache decodes greedily and saves its
tokens and next-token log-probs as the reference; another mode feeds the reference tokens through its
own step loop (teacher forcing, as the fidelity bench does) and compares its log-probs with them:
top-1 agreement and mean KL(full || mode). Last, each pass-key prompt is answered greedily.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from engine.bench.common import ModeSpec, median, parse_mode
from engine.bench.fidelity import compare_distributions
from engine.bench.needle import found
from engine.bench.speed import PROGRESS, _load_average, current_rss_bytes, peak_rss_bytes
from engine.config import CacheConfig, GenerationConfig
from engine.generate.engine import Engine, Finished
from engine.generate.steps import decode_headroom, greedy, sync
from engine.model.files import ModelFiles
from engine.model.loading import load_model
from engine.model.sources import source_from_json

WARMUP_TOKENS = 64


def forced_picker(tokens: list[int]):
    """A step loop's picker that outputs `tokens` in order (teacher forcing), whatever the logits say."""
    it = iter(tokens)
    return lambda logits, _: torch.tensor([next(it, 0)], device=logits.device)


@torch.inference_mode()
def timed_run(model, config: CacheConfig, prompt: list[int], tokens: int, forced: list[int] | None = None) -> dict:
    """Prefill `prompt` and take `tokens` decode steps (greedy, or forced to `forced`), timing each.
    -> prefill seconds, the step times, the tokens output, the log-probs before each, the cache's bytes."""
    engine = Engine(model, config)
    dev = engine.device
    pick = forced_picker(forced) if forced else greedy
    out, logps, times = [], [], []
    with engine.new_cache(1, len(prompt) + tokens + 2 + decode_headroom(engine.policy)) as cache:
        t0 = time.perf_counter()
        *_, last = engine.prefill(cache, prompt, 0)
        sync(dev)
        prefill_s = time.perf_counter() - t0
        loop = engine.steps(cache, last[None], pick, history=[prompt])
        t = time.perf_counter()
        for i, (ids, logits) in enumerate(loop):  # item 0 comes from the prefill logits: no model call
            sync(dev)
            if i:
                times.append(time.perf_counter() - t)
            out.append(int(ids[0]))
            logps.append(torch.log_softmax(logits[0].float(), -1))
            if len(out) >= tokens:
                break
            t = time.perf_counter()
        loop.close()
        stats = cache.stats()
    return {"prefill_seconds": prefill_s, "step_seconds": times, "tokens": out, "logps": torch.stack(logps),
            "device_bytes": stats.get("device_bytes"), "host_bytes": stats.get("host_bytes")}


def answer_passkeys(lm, config: CacheConfig, passkeys: list[dict], max_tokens: int, stops: list[int]) -> list[dict]:
    """Each pass-key prompt answered greedily: the answer and whether it holds the key."""
    gen = GenerationConfig(max_tokens=max_tokens, stop_ids=tuple(stops))
    out = []
    for p in passkeys:
        fin = next(e for e in Engine(lm.model, config).generate([p["ids"]], gen) if isinstance(e, Finished))
        text = lm.tokenizer.decode(fin.tokens[0], skip_special_tokens=True)
        out.append({"depth": p["depth"], "key": p["key"], "prompt_tokens": len(p["ids"]),
                    "needle_depth": p.get("needle_depth"), "output": text, "found": found(p["key"], text)})
    return out


def fidelity(run: dict, job: dict) -> dict:
    """Save this run as the reference (the full cache), or compare it with the saved one."""
    if job.get("save_reference"):
        torch.save({"tokens": run["tokens"], "logps": run["logps"]}, job["save_reference"])
    if not job.get("reference"):
        return {"top1_agreement": None, "mean_kl": None, "max_kl": None, "steps": 0}
    ref = torch.load(job["reference"])
    cmp = compare_distributions(ref["logps"], run["logps"])
    return {k: cmp[k] for k in ("top1_agreement", "mean_kl", "max_kl", "steps")}


def measure_point(job: dict, say) -> dict:
    """The whole point, in this (child) process: load, warm up, the timed run, fidelity, pass-keys."""
    spec: ModeSpec = parse_mode(job["mode"])
    config = CacheConfig(**job["config"]) if job.get("config") else spec.config
    if job.get("threads"):
        torch.set_num_threads(job["threads"])
    lm = load_model(ModelFiles(source_from_json(job["model"])), device=job["device"], dtype=job.get("dtype", "auto"))
    load_start = _load_average()
    prompt = job["prompt"]
    timed_run(lm.model, config, prompt[:WARMUP_TOKENS], 3)  # one-time costs (allocator, kernels) out of the timing
    model_rss = current_rss_bytes()
    run = timed_run(lm.model, config, prompt, job["tokens"], job.get("forced"))
    peak = peak_rss_bytes()  # before the pass-keys: the peak of this point's own run
    ms = [1e3 * s for s in run["step_seconds"]]
    say(f"prefilled {len(prompt)} tokens at {len(prompt) / run['prefill_seconds']:.0f} tok/s, decoded "
        f"{sum(ms) / max(1, len(ms)):.1f} ms/token; answering {len(job['passkeys'])} pass-key prompt(s)")
    point = {"prompt_tokens": len(prompt), "prefill_seconds": run["prefill_seconds"],
             "prefill_tokens_per_s": len(prompt) / run["prefill_seconds"],
             "decode_steps": len(ms), "decode_ms_per_token": sum(ms) / len(ms) if ms else None,
             "decode_ms_step_median": median(ms), "device_bytes": run["device_bytes"], "host_bytes": run["host_bytes"],
             "model_rss_bytes": model_rss, "peak_rss_bytes": peak,
             "peak_above_model_bytes": peak - model_rss if model_rss else None,
             "torch_threads": torch.get_num_threads(), "tokens": run["tokens"], **fidelity(run, job)}
    point["passkeys"] = answer_passkeys(lm, config, job["passkeys"], job["passkey_tokens"], job["stops"])
    point["load_average"] = {"start": load_start, "end": _load_average()}
    return point


def worker_main(job_path: str, out_path: str) -> int:
    """Entry point of the child: measure one point, write its JSON result to out_path."""
    job = json.loads(Path(job_path).read_text())
    point = measure_point(job, lambda m: print(PROGRESS + m, file=sys.stderr, flush=True))
    Path(out_path).write_text(json.dumps(point))
    return 0


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1], sys.argv[2]))
