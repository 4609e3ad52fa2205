"""Selection quality for `bench fidelity` (engine/bench/fidelity.py's docstring gives the method): a
probe attention function that records each pass's queries and fetched set, and the recall and
coverage of the engine's set and of each selector against the exact top-k."""
from __future__ import annotations

import functools
from collections import defaultdict
from contextlib import contextmanager

import torch

from engine.bench.common import mean
from engine.config import CacheConfig
from engine.kvcache import policy, quant
from engine.kvcache.base import soft_cap
from engine.kvcache.sizes import quant_boundary
from engine.model.attention import specache_attention

PROBE_NAME = "specache_bench_probe"
SELECTORS = ("fetched", "guide_own", "guide_spec", "exact_spec", "guide_output", "exact_output")
SELECTOR_HELP = {
    "oracle": "exact top-k of the next token's own attention (upper bound)",
    "fetched": "the set the engine actually fetched (speculative query through the guide)",
    "guide_own": "guide top-k with the next token's own exact query (guide error only)",
    "guide_spec": "guide top-k with the speculative token's query (what the engine ranks)",
    "exact_spec": "exact top-k with the speculative token's query (speculation error only)",
    "guide_output": "guide top-k with the current output token's query (no speculation)",
    "exact_output": "exact top-k with the current output token's query",
}


# ---- probe -------------------------------------------------------------------------------

class Probe:
    """What the probe attention recorded: per layer, one entry per decode pass."""

    current: "Probe | None" = None

    def __init__(self) -> None:
        self.records: dict[int, list[dict]] = defaultdict(list)
        self.cache = None
        self.scaling: float | None = None
        self.softcap: float | None = None  # the model's attention-logit softcap (Gemma 2), applied by _mass
        self.last_ids: torch.Tensor | None = None  # input ids of the current forward pass


def _probe_attention(module, query, key, value, attention_mask, **kwargs):

    out = specache_attention(module, query, key, value, attention_mask, **kwargs)
    probe, cache = Probe.current, kwargs.get("kv_cache")
    if probe is not None and cache is not None and cache.step is not None and not cache.step.prefill:
        step, layer = cache.step, cache.layers[module.layer_idx]
        rec = {"q": query[0].detach().float().clone(), "start": int(step.start[0]), "n_new": step.n_new,
               "ids": probe.last_ids[0].tolist() if probe.last_ids is not None else None}
        own = getattr(getattr(layer, "config", None), "prefetch", None) == "current"  # a pass's set is its own
        if (step.select is not None or own) and getattr(layer, "topk", 0):
            rec["fidx"], rec["fvalid"] = layer.fidx[0].clone(), layer.fvalid[0].clone()
        probe.records[module.layer_idx].append(rec)
        probe.cache = cache
        if probe.scaling is None:
            probe.scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
        probe.softcap = kwargs.get("softcap", probe.softcap)
    return out


@contextmanager
def probing(model):
    """Run the model with the recording attention function; restores the previous one."""
    from transformers import AttentionInterface

    AttentionInterface.register(PROBE_NAME, _probe_attention)
    previous = model.config._attn_implementation
    probe = Probe()
    Probe.current = probe
    model.set_attn_implementation(PROBE_NAME)

    def remember_ids(module, args):
        probe.last_ids = args[0].detach() if args and isinstance(args[0], torch.Tensor) else None

    hook = model.get_input_embeddings().register_forward_pre_hook(remember_ids)
    try:
        yield probe
    finally:
        hook.remove()
        model.set_attn_implementation(previous)
        Probe.current = None


# ---- selection quality -------------------------------------------------------------------

def _mass(q: torch.Tensor, keys: torch.Tensor, scaling: float, upto: int, softcap: float | None = None) -> torch.Tensor:
    """q [H, D], keys [H_kv, L, D] -> attention over positions [0, upto] (scores capped as the model caps
    them), summed over each KV head's query heads and divided by the group size: [H_kv, upto + 1]."""
    h_kv, _, d = keys.shape
    qg = q.reshape(h_kv, -1, d)  # [H_kv, G, D] (query heads of a KV head are consecutive)
    p = torch.softmax(soft_cap((qg @ keys[:, : upto + 1].transpose(-1, -2)) * scaling, softcap), -1)
    return p.mean(1)


def _topk_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    mask = torch.zeros_like(scores, dtype=torch.bool)
    mask.scatter_(-1, scores.topk(k, -1).indices, True)
    return mask


def selects(config: CacheConfig) -> bool:
    """The mode picks a fetched set by its own attention that selection_quality can score: a policy
    that fetches (k > 0) and decodes by it, not one whose drafts an exact pass verifies."""
    cls = policy(config.mode)
    return cls.fetches and not cls.verifies and config.k > 0


def fetching_layer(probe: Probe, layer: int) -> bool:
    """The engine's layer `layer` fetches a set (not one of the model's sliding-window layers)."""
    cache = probe.cache
    return cache is not None and getattr(cache.layers[layer], "topk", 0) > 0


def selection_quality(ref_keys: list[torch.Tensor], ref_queries: list[list[torch.Tensor]], probe: Probe,
                      config: CacheConfig, prompt_len: int, scaling: float, ref_tokens: list[int]) -> dict | None:
    """See the module docstring. ref_keys[layer] [H_kv, L, D] exact; ref_queries[layer][j] [H, D] is the
    exact query of forced token j at position prompt_len + j. Only the layers that fetch are scored: a
    model's sliding-window layers (engine/kvcache/sliding.py) keep their window exact and fetch nothing."""
    s, r, g, k = config.sinks, config.residual, config.group, config.k
    current = config.prefetch == "current"
    sums: dict[str, list[float]] = defaultdict(list)
    per_layer = []
    mass = functools.partial(_mass, scaling=scaling, softcap=probe.softcap)
    for layer, keys in enumerate(ref_keys):
        if not fetching_layer(probe, layer):
            continue
        recs = probe.records.get(layer, [])
        if recs and not any("fidx" in rec for rec in recs):
            continue  # a sliding-window layer (Gemma 2 / 3, Mistral, Qwen2 windows): it fetches nothing
        guided: dict[int, torch.Tensor] = {}
        layer_cov = defaultdict(list)
        for j in range(1, min(len(ref_queries[layer]), len(recs))):
            pos = prompt_len + j
            rec = recs[j]
            q_out, q_spec = _pass_queries(recs, j, pos, current, layer)
            qb = int(quant_boundary(torch.tensor(pos), r, g))
            if qb - s <= 0:
                continue
            kk = min(k, qb - s)
            if qb not in guided:  # guide keys over [0, qb): dequantized 1/2-bit, sinks exact
                kg = keys.clone()
                kg[:, :qb] = quant.dequantize_keys(quant.quantize_keys(keys[None, :, :qb], config.bits, g))[0]
                kg[:, :s] = keys[:, :s]
                guided = {qb: kg}
            kg = guided[qb]
            q_own = ref_queries[layer][j]
            target = mass(q_own, keys, upto=pos)[:, s:qb]  # [H_kv, n]
            region = target.sum(-1)  # [H_kv]
            total = mass(q_own, keys, upto=pos).sum(-1)
            oracle = _topk_mask(target, kk)
            masks = {"oracle": oracle, "fetched": _fetched_mask(rec, s, qb, oracle.shape[0])}
            for name, (q, past, upto) in {"guide_own": (q_own, kg, pos), "guide_output": (q_out, kg, pos - 1),
                                          "exact_output": (q_out, keys, pos - 1), "guide_spec": (q_spec, kg, pos),
                                          "exact_spec": (q_spec, keys, pos)}.items():
                if q is not None:
                    masks[name] = _topk_mask(mass(q, past, upto=upto)[:, s:qb], kk)
            for name, mask in masks.items():
                cov = ((target * mask).sum(-1) / region.clamp(min=1e-30)).tolist()
                rec_ = ((mask & oracle).sum(-1).double() / kk).tolist()
                sums[f"{name}.coverage"] += cov
                sums[f"{name}.recall"] += rec_
                # share of ALL the token's attention served exactly: sinks + residual + chosen set
                sums[f"{name}.coverage_total"] += ((total - region + (target * mask).sum(-1)) / total).tolist()
                layer_cov[name] += cov
            sums["region_mass"] += (region / total).tolist()
        per_layer.append({"layer": layer, "oracle_coverage": mean(layer_cov["oracle"]),
                          "fetched_coverage": mean(layer_cov["fetched"])})
    if not per_layer:  # every layer is one of the model's windows: no fetched set to score
        return None
    return _selection_summary(sums, per_layer, probe, ref_tokens, k)


def _pass_queries(recs: list[dict], j: int, pos: int, current: bool, layer: int):
    """(the output token's query, the speculative token's or None) of the probe's pass j, checked to be
    the pass the prefetch makes: one token fetching its own set (current), or the speculative pair."""
    rec = recs[j]
    if current:  # pass j feeds forced token j itself and fetches its own set
        if rec["start"] != pos or rec["n_new"] != 1 or "fidx" not in rec:
            raise RuntimeError(f"probe pass {j} of layer {layer} is not the expected one-token pass")
        return recs[j - 1]["q"][:, 0], None
    # pass j feeds [forced token j - 1, speculative guess of j] and fetches for j
    if rec["start"] != pos - 1 or rec["n_new"] != 2 or "fidx" not in rec:
        raise RuntimeError(f"probe pass {j} of layer {layer} is not the expected speculative pair")
    return rec["q"][:, 0], rec["q"][:, 1]


def _fetched_mask(rec: dict, s: int, qb: int, heads: int) -> torch.Tensor:
    """The positions of [s, qb) the pass fetched, per KV head [H_kv, qb - s]."""
    valid = rec["fvalid"] & (rec["fidx"] >= s) & (rec["fidx"] < qb)
    fetched = torch.zeros(heads, qb - s + 1, dtype=torch.bool)  # last column: invalid entries
    fetched.scatter_(-1, torch.where(valid, rec["fidx"] - s, qb - s), True)
    return fetched[:, :-1]


def _selection_summary(sums: dict, per_layer: list[dict], probe: Probe, ref_tokens: list[int], k: int) -> dict:
    """selection_quality's result from its per-sample sums."""
    passes = probe.records.get(0, [])[1:len(ref_tokens)]
    hits = [float(rec["ids"][1] == ref_tokens[j]) for j, rec in enumerate(passes, start=1)
            if rec.get("ids") and len(rec["ids"]) > 1]
    out: dict = {"samples": len(sums.get("oracle.coverage", [])), "k": k,
                 "speculation_hit_rate": mean(hits),
                 "region_mass": mean(sums.get("region_mass", [])), "selectors": {}}
    oracle_cov = mean(sums.get("oracle.coverage", []))
    for name in ("oracle",) + SELECTORS:
        cov = mean(sums.get(f"{name}.coverage", []))
        out["selectors"][name] = {
            "recall": mean(sums.get(f"{name}.recall", [])), "coverage": cov,
            "coverage_total": mean(sums.get(f"{name}.coverage_total", [])),
            "coverage_vs_oracle": (cov / oracle_cov) if cov is not None and oracle_cov else None}
    out["per_layer"] = per_layer
    return out
