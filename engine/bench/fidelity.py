"""`bench fidelity`: how close each cache mode stays to the full 16-bit cache on real documents.

Per document (the model's chat template around a summarization instruction, the document
truncated to fit the window) the full cache generates the reference: greedy tokens F_0..F_{N-1}
and the next-token distribution before each. Then, per mode:

- teacher-forced: engine.generate.engine.Engine.teacher_forced feeds F through the mode's real step loop
  (speculative or one-token steps, per the prefetch); each step's distribution is compared
  with the reference: top-1 agreement and mean KL(full || mode);
- free-running: the mode's own greedy output; length of the prefix identical to F, and the
  share of positions with equal tokens;
- selection quality (specache modes): during the teacher-forced run a probe attention
  function (registered under another name, wrapping the engine's) records, per layer, the
  queries of each pass's output token T_t (position p) and speculative token T'_{t+1} (p+1)
  and the fetched set the engine chose. Against the exact attention of the real next output
  token F_{t+1} at p+1 (its query and the exact keys come from the full-cache reference run),
  summed over the query heads of each KV head, over the guide region [sinks, qend):
  recall = |chosen set ∩ exact top-k| / k and coverage = attention mass on the chosen set /
  mass on the region, for the set the engine fetched and for the top-k of: the guide (1/2-bit
  keys, sinks and residual exact as in engine/kvcache/guided.py) or exact keys, scored with the next
  token's own query, the speculative query, or the current output token's query; next to the
  oracle's (exact top-k) coverage.
"""
from __future__ import annotations

import functools
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator, Sequence

import torch

from engine.bench.common import (
    BenchProgress,
    BenchResult,
    ModeSpec,
    encode,
    envelope,
    mean,
    target,
)
from engine.config import CacheConfig
from engine.errors import BadArgument
from engine.generate.engine import Engine
from engine.generate.steps import decode_headroom, greedy
from engine.inputs.prompts import SUMMARIZE, build_prompt, stop_ids
from engine.kvcache import ModelShape, policy, quant
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
TARGET_TOP1, TARGET_KL, TARGET_COVERAGE = 0.97, 0.02, 0.95


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


# ---- runs --------------------------------------------------------------------------------

@torch.inference_mode()
def free_run(model, prompt: list[int], config: CacheConfig, n: int, stops: Sequence[int]):
    """Greedy decoding in a mode. -> (tokens, log-probs [len, V] before each token, cache)."""
    engine = Engine(model, config)
    with engine.new_cache(1, len(prompt) + n + 2 + decode_headroom(engine.policy)) as cache:
        *_, last = engine.prefill(cache, prompt, 0)
        tokens, logps = [], []
        for ids, logits in engine.steps(cache, last[None], greedy, history=[prompt]):
            t = int(ids[0])
            if t in stops:
                break
            tokens.append(t)
            logps.append(torch.log_softmax(logits[0].float(), -1))
            if len(tokens) >= n:
                break
    return tokens, (torch.stack(logps) if logps else torch.empty(0)), cache


@torch.inference_mode()
def forced_logps(model, prompt: list[int], forced: list[int], config: CacheConfig) -> torch.Tensor:
    return torch.stack([torch.log_softmax(x.float(), -1) for x in Engine(model, config).teacher_forced(prompt, forced)])


def compare_distributions(ref: torch.Tensor, other: torch.Tensor) -> dict:
    """ref/other: log-probs [N, V]. Top-1 agreement and KL(ref || other) per step."""
    n = min(len(ref), len(other))
    ref, other = ref[:n].double(), other[:n].double()
    kl = torch.where(torch.isneginf(ref), 0.0, ref.exp() * (ref - other)).sum(-1).clamp(min=0.0)  # 0 log 0 = 0
    agree = (ref.argmax(-1) == other.argmax(-1)).double()
    return {"steps": n, "top1_agreement": float(agree.mean()) if n else None,
            "mean_kl": float(kl.mean()) if n else None, "max_kl": float(kl.max()) if n else None,
            "first_disagreement": int((agree == 0).nonzero()[0]) if n and bool((agree == 0).any()) else None}


def compare_tokens(ref: list[int], other: list[int]) -> dict:
    prefix = 0
    for a, b in zip(ref, other):
        if a != b:
            break
        prefix += 1
    longest = max(len(ref), len(other)) or 1
    return {"identical_prefix": prefix, "reference_tokens": len(ref), "tokens": len(other),
            "equal_share": sum(a == b for a, b in zip(ref, other)) / longest}


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
            if current:  # pass j feeds forced token j itself and fetches its own set
                if rec["start"] != pos or rec["n_new"] != 1 or "fidx" not in rec:
                    raise RuntimeError(f"probe pass {j} of layer {layer} is not the expected one-token pass")
                q_out, q_spec = recs[j - 1]["q"][:, 0], None
            else:  # pass j feeds [forced token j - 1, speculative guess of j] and fetches for j
                if rec["start"] != pos - 1 or rec["n_new"] != 2 or "fidx" not in rec:
                    raise RuntimeError(f"probe pass {j} of layer {layer} is not the expected speculative pair")
                q_out, q_spec = rec["q"][:, 0], rec["q"][:, 1]
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
            valid = rec["fvalid"] & (rec["fidx"] >= s) & (rec["fidx"] < qb)
            fetched = torch.zeros(oracle.shape[0], qb - s + 1, dtype=torch.bool)  # last column: invalid entries
            fetched.scatter_(-1, torch.where(valid, rec["fidx"] - s, qb - s), True)
            fetched = fetched[:, :-1]
            masks = {
                "oracle": oracle, "fetched": fetched,
                "guide_own": _topk_mask(mass(q_own, kg, upto=pos)[:, s:qb], kk),
                "guide_output": _topk_mask(mass(q_out, kg, upto=pos - 1)[:, s:qb], kk),
                "exact_output": _topk_mask(mass(q_out, keys, upto=pos - 1)[:, s:qb], kk),
            }
            if q_spec is not None:
                masks["guide_spec"] = _topk_mask(mass(q_spec, kg, upto=pos)[:, s:qb], kk)
                masks["exact_spec"] = _topk_mask(mass(q_spec, keys, upto=pos)[:, s:qb], kk)
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


# ---- the bench ---------------------------------------------------------------------------

def fit_prompt(tokenizer, text: str, budget: int, instruction: str = SUMMARIZE) -> tuple[list[int], bool]:
    """The summarization prompt, the document cut (by tokens) so the prompt has at most `budget` tokens."""
    ids = build_prompt(tokenizer, text, instruction).ids
    if len(ids) <= budget:
        return ids, False
    overhead = len(build_prompt(tokenizer, "", instruction).ids)
    doc = encode(tokenizer, text)
    keep = max(1, budget - overhead - 2)
    while True:
        ids = build_prompt(tokenizer, tokenizer.decode(doc[:keep]), instruction).ids
        if len(ids) <= budget or keep <= 1:
            return ids, True
        keep -= max(1, len(ids) - budget)


def run_fidelity(lm, texts: Sequence[tuple[str, str]], modes: Sequence[ModeSpec], tokens: int = 64,
                 context: int | None = None, quick: bool = False) -> Iterator[BenchProgress | BenchResult]:
    t_start = time.perf_counter()
    model, tok = lm.model, lm.tokenizer
    budget = lm.max_context - tokens - 4
    if context is not None:
        budget = min(budget, context)
    stops = stop_ids(tok)
    full_cfg = CacheConfig(mode="full")
    prompts = [(src, *fit_prompt(tok, text, budget)) for src, text in texts]
    for src, prompt, _ in prompts:
        if not prompt:
            raise BadArgument(f"{src}: the model's tokenizer gives no tokens for this document")
    settings = {"documents": [{"source": s, "prompt_tokens": len(p), "truncated": t} for s, p, t in prompts],
                "forced_tokens": tokens, "instruction": SUMMARIZE, "context_budget": budget,
                "selectors": SELECTOR_HELP}
    result = envelope("fidelity", quick, settings, modes, lm)
    rows = []
    total = len(prompts) * (1 + len(modes))
    done = 0
    for src, prompt, _ in prompts:
        t0 = time.perf_counter()
        with probing(model) as probe:
            ref_tokens, ref_logps, cache = free_run(model, prompt, full_cfg, tokens, stops)
        ref_stats = cache.stats()
        n_layers = len(cache.layers)
        length = int(cache.lengths[0])
        ref_keys = [cache.layers[i].k[0, :, :length].float().clone() for i in range(n_layers)]
        ref_queries = [[rec["q"][:, 0] for rec in probe.records[i]] for i in range(n_layers)]
        for i in range(n_layers):
            if [rec["start"] for rec in probe.records[i]] != list(range(len(prompt), len(prompt) + len(ref_queries[i]))):
                raise RuntimeError("the full-cache reference passes are not one token per position")
        scaling = probe.scaling or ModelShape.from_config(model.config).head_dim ** -0.5
        del cache
        done += 1
        yield BenchProgress(f"fidelity {src}: full reference, {len(prompt)} prompt tokens, "
                            f"{len(ref_tokens)} tokens ({time.perf_counter() - t0:.1f} s)", done, total)
        for spec in modes:
            t0 = time.perf_counter()
            cfg = spec.config
            if cfg == full_cfg:  # the reference run is this mode's free run (greedy decoding is deterministic)
                tokens_m, stats = list(ref_tokens), ref_stats
            else:
                tokens_m, _, cache = free_run(model, prompt, cfg, tokens, stops)
                stats = cache.stats()
                del cache
            selection = None
            if ref_tokens:
                if selects(cfg):
                    with probing(model) as probe:
                        logps = forced_logps(model, prompt, ref_tokens, cfg)
                    selection = selection_quality(ref_keys, ref_queries, probe, cfg, len(prompt), scaling,
                                                  ref_tokens)
                    del probe
                else:
                    logps = forced_logps(model, prompt, ref_tokens, cfg)
                forced = compare_distributions(ref_logps, logps)
            else:
                forced = compare_distributions(ref_logps, ref_logps)
            row = {"document": src, "mode": spec.label, "prompt_tokens": len(prompt),
                   "teacher_forced": forced, "free_running": compare_tokens(ref_tokens, tokens_m),
                   "selection": selection, "device_bytes": stats.get("device_bytes"),
                   "device_fp16_bytes": stats.get("device_fp16_bytes"),
                   "host_bytes": stats.get("host_bytes"), "full_fp16_bytes": stats.get("full_fp16_bytes"),
                   # corrected speculative prefetch (free run): the share of each step's set the prefetch had brought
                   "prefetch_reuse": stats.get("prefetch_reuse"),
                   # the free run's check of its guide against the exact store (engine/kvcache/watch.py)
                   "guide_check": stats.get("guide_check"),
                   "reference_text": tok.decode(ref_tokens, skip_special_tokens=True),
                   "text": tok.decode(tokens_m, skip_special_tokens=True),
                   "seconds": round(time.perf_counter() - t0, 2)}
            rows.append(row)
            done += 1
            sel = ""
            if selection:
                f = selection["selectors"]["fetched"]
                sel = f", coverage {f['coverage']:.3f} ({f['coverage_vs_oracle']:.3f} of oracle)"
            if row["prefetch_reuse"] is not None:
                sel += f", prefetch reuse {row['prefetch_reuse']:.3f}"
            if row["guide_check"] and row["guide_check"]["checks"]:
                check = row["guide_check"]
                sel += f", guide check {check['coverage_vs_oracle']:.3f}{' LOST' if check['lost'] else ''}"
            yield BenchProgress(f"fidelity {src} {spec.label}: top-1 {forced['top1_agreement']:.3f}, "
                                f"KL {forced['mean_kl']:.4f}{sel} ({row['seconds']:.1f} s)", done, total)
    result["rows"] = rows
    result["per_mode"] = summarize(rows, modes)
    result["targets"] = targets(result["per_mode"], modes)
    result["seconds"] = round(time.perf_counter() - t_start, 2)
    yield BenchResult(result)


def summarize(rows: list[dict], modes: Sequence[ModeSpec]) -> dict:
    """Means over documents per mode."""
    out = {}
    for spec in modes:
        mine = [r for r in rows if r["mode"] == spec.label]
        entry = {
            "top1_agreement": mean([r["teacher_forced"]["top1_agreement"] for r in mine]),
            "mean_kl": mean([r["teacher_forced"]["mean_kl"] for r in mine]),
            "identical_prefix": mean([r["free_running"]["identical_prefix"] for r in mine]),
            "equal_share": mean([r["free_running"]["equal_share"] for r in mine]),
            "device_bytes": mean([r["device_bytes"] for r in mine]),
            # 16-bit both sides (an fp32 CPU run holds its exact parts at twice a GPU's bytes)
            "device_fraction_of_fp16": mean([r["device_fp16_bytes"] / r["full_fp16_bytes"] for r in mine
                                             if r["full_fp16_bytes"]]),
            "prefetch_reuse": mean([r["prefetch_reuse"] for r in mine if r.get("prefetch_reuse") is not None]),
            "guide_check": mean([r["guide_check"]["coverage_vs_oracle"] for r in mine
                                 if r.get("guide_check") and r["guide_check"]["checks"]]),
            "guide_lost": any(r["guide_check"]["lost"] for r in mine if r.get("guide_check")),
        }
        sels = [r["selection"] for r in mine if r["selection"]]
        if sels:
            entry["selection"] = {name: {key: mean([s["selectors"][name][key] for s in sels])
                                         for key in ("recall", "coverage", "coverage_total", "coverage_vs_oracle")}
                                  for name in ("oracle",) + SELECTORS}
            entry["region_mass"] = mean([s["region_mass"] for s in sels])
            entry["speculation_hit_rate"] = mean([s["speculation_hit_rate"] for s in sels])
        out[spec.label] = entry
    return out


def targets(per_mode: dict, modes: Sequence[ModeSpec]) -> list[dict]:
    spec = next((m for m in modes if m.is_default_specache), None)
    if spec is None:
        return [target("default specache setting", "measured", None, None, "not among --modes")]
    e = per_mode[spec.label]
    out = [target(f"{spec.label} teacher-forced top-1 agreement", f">= {TARGET_TOP1}", e["top1_agreement"],
                  None if e["top1_agreement"] is None else e["top1_agreement"] >= TARGET_TOP1),
           target(f"{spec.label} mean KL vs full", f"<= {TARGET_KL}", e["mean_kl"],
                  None if e["mean_kl"] is None else e["mean_kl"] <= TARGET_KL)]
    sel = e.get("selection", {}).get("fetched", {}).get("coverage_vs_oracle")
    out.append(target(f"{spec.label} coverage of the speculatively fetched set", f">= {TARGET_COVERAGE} of oracle",
                      sel, None if sel is None else sel >= TARGET_COVERAGE))
    return out
