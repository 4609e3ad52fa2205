"""Where a long-context decode step's time goes, and how much of the guide a step could skip (issue 51, item 2).

For each context length: a real model prefills that many tokens of examples/texts (joined, repeated to the
length), then takes --steps decode steps with the engine's own loop and the model's default cache settings
(the CLI's: engine.plan.profiles.model_defaults). Every step is timed, and every fused native decode call of a
guided layer (engine/backends/native_fused.py; one per guided layer and step). On the last --sample steps,
each guided layer's call is taken apart outside the timed step:

- the split: the guide's score kernel and its value kernel timed alone on the same guide and queries (the
  native kernels, quant.guide_scores / quant.guide_weighted_values); the call's rest (exact scores of sinks,
  chosen rows and window, the softmax, the top-k, the exact values) is the call's time less those two;
- the guide region's softmax mass, as the call weights it (the guide's scores on [S, n), exact scores at the
  sinks and the window, one softmax; queries scaled and softcapped as the model does): the share of the
  row's mass on the region, and the share of its 32-token blocks that hold 99% / 99.9% of the region's mass;
- what a per-group score bound could prove negligible: each key group's codes lie in [z, z + cmax s] per
  channel (its fp16 scale and zero; cmax = 3 at 2 bits, 1 at 1 bit; the outlier side guide's 4-bit codes
  likewise), so sum_d max(q_d z_d, q_d (z_d + cmax s_d)) bounds every score of the group (rotated queries
  for a rotated guide). Groups sorted by their bound are skipped while g exp(bound - max) summed over the
  skipped stays <= eps times the row's sum of exponentials: the share of groups skipped that way, and the
  same with superblocks of 16 groups (the per-channel min / max over their groups);
- the share of the region's mass the top 10% / 25% groups by bound hold (a Quest-like candidate choice).

Times: each step's wall time and its CPU time (process_time), and each call's and kernel's CPU time of the
calling thread (thread_time): on a machine shared with other work the wall clock counts the waits for a core
(measured here: Qwen2.5-Coder-1.5B at 4k, 970 ms a step by the wall clock, 240 ms of CPU time). Run with
--threads 1 (the native calls then run on the calling thread, so thread_time holds all of their work).
Prints one JSON object (stdout); progress on stderr.

    python scripts/decode_split.py --model /work/models/gemma-3-270m-q4_k_m.gguf --lengths 4096 8192 \
        [--steps 12] [--sample 2] [--threads 2] [--eps 1e-3]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import engine.backends.native_fused as native_fused  # noqa: E402
from engine.config import CacheConfig  # noqa: E402
from engine.generate.engine import Engine  # noqa: E402
from engine.generate.steps import decode_headroom, greedy  # noqa: E402
from engine.kvcache import quant  # noqa: E402
from engine.kvcache.guide import _rows  # noqa: E402
from engine.model.loading import load_model  # noqa: E402
from engine.plan.profiles import model_defaults  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 32  # tokens per block of the mass-concentration figure
SUPER = 16  # key groups per superblock of the two-level bound


def document_ids(tokenizer, length: int) -> list[int]:
    """`length` tokens of examples/texts joined (repeated when short)."""
    text = "\n\n".join(p.read_text() for p in sorted((ROOT / "examples" / "texts").glob("*.txt")))
    ids = tokenizer.encode(text, add_special_tokens=False)
    return (ids * (length // len(ids) + 1))[:length]


class Recorder:
    """Wraps FusedDecode.__call__: times every call, and on sampled steps keeps (layer, queries, scaling,
    step start, softcap) for the analysis after the step."""

    def __init__(self):
        self.calls: list[float] = []
        self.kept: list[tuple] = []
        self.sampling = False
        self.original = native_fused.FusedDecode.__call__

    def install(self) -> None:
        rec, call = self, self.original

        def timed(self, qg, scaling, step, softcap=None):
            t0 = time.thread_time()
            out = call(self, qg, scaling, step, softcap)
            rec.calls.append(time.thread_time() - t0)
            if rec.sampling:
                rec.kept.append((self.layer, qg.clone(), scaling, int(step.start[0]), step.n_new, softcap,
                                 rec.calls[-1]))
            return out

        native_fused.FusedDecode.__call__ = timed

    def remove(self) -> None:
        native_fused.FusedDecode.__call__ = self.original


def median_us(fn, repeats: int = 5) -> float:
    """The median of `repeats` calls of fn, in microseconds of this thread's CPU time (a loaded machine's
    waits do not count)."""
    def once() -> float:
        t0 = time.thread_time()
        fn()
        return time.thread_time() - t0

    return statistics.median(once() for _ in range(repeats)) * 1e6


def guide_queries(layer, q: torch.Tensor) -> torch.Tensor:
    """The queries the main guide's keys take: q R for a rotated guide."""
    rot = layer.guide.rotation
    return q @ rot if rot is not None else q


def kernel_split(layer, q: torch.Tensor, n: int) -> dict:
    """The guide's score and value kernels alone on this layer's guide (row 0) and queries q [1, H, Q, D]."""
    guide, rows = layer.guide, slice(0, 1)
    keys, values = _rows(guide.keys, rows), _rows(guide.values, rows)
    qg = guide_queries(layer, q)
    p = torch.softmax(torch.randn(q.shape[0], q.shape[1], q.shape[2], n), -1)
    return {"scores_us": median_us(lambda: quant.guide_scores(qg, keys, n)),
            "values_us": median_us(lambda: quant.guide_weighted_values(p, values, n))}


def row_scores(layer, q: torch.Tensor, n: int, end: int, softcap) -> torch.Tensor:
    """Scores [H, Q, end] as the call weights them: the guide's on [0, n) (with its outlier term), exact at
    the sinks and on [n, end); q already scaled."""
    store_k = layer.store.k[0, :, :end].float()  # [H, end, D]
    s = torch.cat([layer.guide.scores(q, slice(0, 1), n)[0], q[0] @ store_k[:, n:].transpose(-1, -2)], -1)
    S = min(layer.sinks, n)
    s[..., :S] = q[0] @ store_k[:, :S].transpose(-1, -2)
    return softcap * torch.tanh(s / softcap) if softcap else s


def key_bounds(layer, q: torch.Tensor, n: int, fold: int = 1) -> torch.Tensor:
    """Per unit of `fold` key groups an upper bound of every guide score in it: [H, Q, ceil(n / g / fold)]
    (q scaled, unrotated): the box of the units' per-channel ranges."""
    guide, j = layer.guide, n // layer.guide.group
    cmax = 3.0 if guide.bits == 2 else 1.0
    z = guide.keys.zero[0, :, :j].float()  # [H, J, D]
    bound = corner_bound(guide_queries(layer, q)[0], *folded(z, z + cmax * guide.keys.scale[0, :, :j].float(), fold))
    side = guide.outliers
    if side is not None:
        qo = q[0].gather(-1, side.idx[0][:, None, :].expand(-1, q.shape[2], -1))  # [H, Q, O]
        oz = side.zero[0, :, :j].float()
        bound = bound + corner_bound(qo, *folded(oz, oz + 15.0 * side.scale[0, :, :j].float(), fold))
    return bound


def folded(lo: torch.Tensor, hi: torch.Tensor, fold: int) -> tuple[torch.Tensor, torch.Tensor]:
    """lo / hi [H, J, C] -> per unit of `fold` groups their min / max [H, ceil(J / fold), C]."""
    pad = -lo.shape[1] % fold
    lo = torch.cat([lo, lo.new_full((lo.shape[0], pad, lo.shape[2]), float("inf"))], 1)
    hi = torch.cat([hi, hi.new_full((hi.shape[0], pad, hi.shape[2]), float("-inf"))], 1)
    shape = (lo.shape[0], -1, fold, lo.shape[2])
    return lo.reshape(shape).amin(2), hi.reshape(shape).amax(2)


def corner_bound(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """max over the box [lo, hi] of q . k: q [H, Q, D], lo / hi [H, J, D] -> [H, Q, J]."""
    return torch.maximum(q[:, :, None] * lo[:, None], q[:, :, None] * hi[:, None]).sum(-1)


def skippable(bound: torch.Tensor, size: int, mx: torch.Tensor, z: torch.Tensor, eps: float) -> torch.Tensor:
    """Share of the units (bound [H, Q, J], `size` tokens each) that can be skipped with their bounded mass
    size * exp(bound - mx) summed at most eps * z (mx, z [H, Q, 1]: the row's max and sum of exp(s - mx))."""
    mass = (size * torch.exp(bound - mx)).sort(-1).values.cumsum(-1)
    return (mass <= eps * z).float().mean(-1)


def blocks_holding(p: torch.Tensor, share: float) -> torch.Tensor:
    """Share of 32-token blocks of p [H, Q, m] (m % 32 == 0) that hold `share` of its mass, fewest first."""
    blocks = p.reshape(*p.shape[:-1], -1, BLOCK).sum(-1).sort(-1, descending=True).values
    held = blocks.cumsum(-1) / blocks.sum(-1, keepdim=True).clamp_min(1e-30)
    return ((held < share).sum(-1) + 1).clamp_max(blocks.shape[-1]).float() / blocks.shape[-1]


def top_groups_mass(bound: torch.Tensor, p_region: torch.Tensor, g: int, share: float) -> torch.Tensor:
    """The region's mass in the top `share` of key groups by bound (bound [H, Q, J], p_region [H, Q, J*g])."""
    per_group = p_region.reshape(*p_region.shape[:-1], -1, g).sum(-1)
    top = bound.topk(max(1, int(share * bound.shape[-1])), -1).indices
    return per_group.gather(-1, top).sum(-1) / per_group.sum(-1).clamp_min(1e-30)


def group_estimate(layer, q: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each key group's estimated log-sum-exp of scores and mean value, from its exact keys' per-channel mean mu
    and variance var (what a summary built when the group enters the guide would hold): log g + q . mu +
    q^2 . var / 2 (a Gaussian's), [H, Q, J]; the group's mean value [H, J, D]."""
    g = layer.guide.group
    j = n // g
    k = layer.store.k[0, :, : j * g].float().unflatten(1, (j, g))  # [H, J, g, D]
    v = layer.store.v[0, :, : j * g].float().unflatten(1, (j, g))
    mu, var = k.mean(2), k.var(2, unbiased=False)
    qh = q[0]  # [H, Q, D]
    est = qh @ mu.transpose(-1, -2) + 0.5 * (qh * qh) @ var.transpose(-1, -2) + torch.log(torch.tensor(float(g)))
    return est, v.mean(2)


def approx_error(layer, q: torch.Tensor, s: torch.Tensor, n: int, end: int, share: float) -> dict:
    """The attention output (exact values) with the guide's scores everywhere (o_a) against the candidate scheme
    (o_b): the top `share` of key groups by group_estimate keep their tokens' guide scores, every other group
    is one term of its estimated log-sum-exp and mean value; sinks and window exact in both. Relative L2 error
    of o_b to o_a, the true mass (under the guide's scores) of the groups kept, and, for scale, o_a's own error
    against exact attention."""
    g, S = layer.guide.group, min(layer.sinks, n)
    j = n // g
    vals = layer.store.v[0, :, :end].float()  # [H, end, D]
    p = torch.softmax(s, -1)
    o_a = p @ vals
    est, vbar = group_estimate(layer, q, n)
    keep = torch.zeros_like(est, dtype=torch.bool).scatter_(-1, est.topk(max(1, int(share * j)), -1).indices, True)
    tok_keep = keep.repeat_interleave(g, -1)  # [H, Q, n]
    tok_keep[..., :S] = True
    logits = torch.cat([s[..., :n].masked_fill(~tok_keep, float("-inf")), s[..., n:],
                        est.masked_fill(keep, float("-inf"))], -1)
    w = torch.softmax(logits, -1)
    o_b = w[..., :end] @ vals + w[..., end:] @ vbar
    exact = torch.softmax(q[0] @ layer.store.k[0, :, :end].float().transpose(-1, -2), -1) @ vals
    rel = lambda a, b: ((a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-30)).mean()  # noqa: E731
    held = (p[..., :n] * tok_keep).sum(-1) / p[..., :n].sum(-1).clamp_min(1e-30)
    return {f"cand{int(share * 100)}_err": rel(o_b, o_a), f"cand{int(share * 100)}_mass_held": held.mean(),
            "guide_vs_exact_err": rel(o_a, exact)}


def analyse(kept: tuple, eps: float) -> dict:
    """One sampled call: its time split, the region's mass concentration, what the bounds could skip."""
    layer, qg, scaling, start, t, softcap, call_s = kept
    n, g = int(layer.qend[0]), layer.guide.group
    q = qg[:1].float() * scaling  # row 0, [1, H, Q, D]
    if n < SUPER * g:
        return {}
    s = row_scores(layer, q, n, start + t, softcap)
    mx = s.amax(-1, keepdim=True)
    e = torch.exp(s - mx)
    z = e.sum(-1, keepdim=True)
    p = e / z
    S = min(layer.sinks, n)
    region = p[..., :n].clone()
    region[..., :S] = 0.0
    bound, sup = key_bounds(layer, q, n), key_bounds(layer, q, n, SUPER)
    if softcap:
        bound, sup = softcap * torch.tanh(bound / softcap), softcap * torch.tanh(sup / softcap)
    out = {"n": n, "call_us": call_s * 1e6, **kernel_split(layer, q, n),
           "region_mass": region.sum(-1), "blocks_99": blocks_holding(region[..., n % BLOCK:], 0.99),
           "blocks_999": blocks_holding(region[..., n % BLOCK:], 0.999),
           "groups_skippable": skippable(bound, g, mx, z, eps),
           "superblocks_skippable": skippable(sup, SUPER * g, mx, z, eps),
           "top10pct_groups_mass": top_groups_mass(bound, region, g, 0.10),
           "top25pct_groups_mass": top_groups_mass(bound, region, g, 0.25),
           **approx_error(layer, q, s, n, start + t, 0.10), **approx_error(layer, q, s, n, start + t, 0.25)}
    return {k: float(v.mean()) if torch.is_tensor(v) else v for k, v in out.items()}


def summarise(rows: list[dict]) -> dict:
    """Means over the sampled layer calls (the times: medians)."""
    rows = [r for r in rows if r]
    if not rows:
        return {}
    out = {k: statistics.mean(r[k] for r in rows) for k in rows[0] if not k.endswith("_us")}
    out.update({k: statistics.median(r[k] for r in rows) for k in rows[0] if k.endswith("_us")})
    out["rest_us"] = out["call_us"] - out["scores_us"] - out["values_us"]
    out["layer_calls"] = len(rows)
    return out


@torch.inference_mode()
def measure_length(model, config: CacheConfig, prompt: list[int], args, rec: Recorder) -> dict:
    """Prefill `prompt`, take args.steps steps; the step times, the calls' sums, the sampled analysis (the last
    args.sample steps', args.eps: the mass a skip may drop)."""
    length = len(prompt)
    engine = Engine(model, config)
    steps, cpu, per_step_calls, analysed = [], [], [], []
    with engine.new_cache(1, length + args.steps + 2 + decode_headroom(engine.policy)) as cache:
        t0 = time.perf_counter()
        *_, last = engine.prefill(cache, prompt, 0)
        prefill_s = time.perf_counter() - t0
        loop = engine.steps(cache, last[None], greedy, history=[prompt])
        next(loop)  # the prefill's token: no model call
        for i in range(args.steps):
            rec.calls.clear()
            rec.sampling = i >= args.steps - args.sample
            t, c = time.perf_counter(), time.process_time()
            next(loop)
            steps.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
            per_step_calls.append(sum(rec.calls))
            analysed += [analyse(k, args.eps) for k in rec.kept]
            rec.kept.clear()
        loop.close()
    rec.sampling = False
    return {"length": length, "prefill_s": prefill_s, "k": config.fetch_k(length),
            "step_ms_median": statistics.median(steps) * 1e3, "step_cpu_ms_median": statistics.median(cpu) * 1e3,
            "fused_calls_ms_median": statistics.median(per_step_calls) * 1e3,
            "guided_layers": len(rec.calls), "sampled": summarise(analysed)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a .gguf, folder or id (default: the embedded model)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--sample", type=int, default=2, help="last steps whose layer calls are analysed")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eps", type=float, default=1e-3, help="mass a skip may drop, relative to the row's")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(args.model)
    config = CacheConfig(mode="specache", **model_defaults(lm))
    rec = Recorder()
    rec.install()
    points = []
    for length in args.lengths:
        print(f"{length} tokens ...", file=sys.stderr, flush=True)
        points.append(measure_length(lm.model, config, document_ids(lm.tokenizer, length), args, rec))
        print(json.dumps(points[-1]), file=sys.stderr, flush=True)
    rec.remove()
    print(json.dumps({"model": lm.name, "threads": args.threads, "eps": args.eps, "block": BLOCK,
                      "superblock_groups": SUPER, "config": {"bits": config.bits, "group": config.group,
                      "k": config.k, "prefetch": config.prefetch}, "points": points}, indent=1))


if __name__ == "__main__":
    main()
