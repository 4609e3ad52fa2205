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

import time
from typing import Iterator, Sequence

import torch

from engine.bench.common import BenchProgress, BenchResult, ModeSpec, encode, envelope, mean, target
from engine.bench.selection import SELECTOR_HELP, SELECTORS, probing, selection_quality, selects
from engine.config import CacheConfig
from engine.errors import BadArgument
from engine.generate.engine import Engine
from engine.generate.steps import decode_headroom, greedy
from engine.inputs.prompts import SUMMARIZE, build_prompt, stop_ids
from engine.kvcache import ModelShape

TARGET_TOP1, TARGET_KL, TARGET_COVERAGE = 0.97, 0.02, 0.95


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
        ref = reference(model, prompt, full_cfg, tokens, stops)
        done += 1
        yield BenchProgress(f"fidelity {src}: full reference, {len(prompt)} prompt tokens, "
                            f"{len(ref['tokens'])} tokens ({time.perf_counter() - t0:.1f} s)", done, total)
        for spec in modes:
            t0 = time.perf_counter()
            row = mode_row(lm, src, prompt, spec, ref, full_cfg, tokens, stops)
            row["seconds"] = round(time.perf_counter() - t0, 2)
            rows.append(row)
            done += 1
            forced = row["teacher_forced"]
            yield BenchProgress(f"fidelity {src} {spec.label}: top-1 {forced['top1_agreement']:.3f}, "
                                f"KL {forced['mean_kl']:.4f}{progress_note(row)} ({row['seconds']:.1f} s)",
                                done, total)
    result["rows"] = rows
    result["per_mode"] = summarize(rows, modes)
    result["targets"] = targets(result["per_mode"], modes)
    result["seconds"] = round(time.perf_counter() - t_start, 2)
    yield BenchResult(result)


def reference(model, prompt: list[int], full_cfg: CacheConfig, tokens: int, stops: Sequence[int]) -> dict:
    """The full cache's reference run: its greedy tokens and log-probs, its cache's stats, each layer's
    exact keys and each forced token's exact query (recorded by the probe), the attention scaling."""
    with probing(model) as probe:
        ref_tokens, ref_logps, cache = free_run(model, prompt, full_cfg, tokens, stops)
    n_layers = len(cache.layers)
    length = int(cache.lengths[0])
    ref_keys = [cache.layers[i].k[0, :, :length].float().clone() for i in range(n_layers)]
    ref_queries = [[rec["q"][:, 0] for rec in probe.records[i]] for i in range(n_layers)]
    for i in range(n_layers):
        if [rec["start"] for rec in probe.records[i]] != list(range(len(prompt), len(prompt) + len(ref_queries[i]))):
            raise RuntimeError("the full-cache reference passes are not one token per position")
    return {"tokens": ref_tokens, "logps": ref_logps, "stats": cache.stats(), "keys": ref_keys,
            "queries": ref_queries, "scaling": probe.scaling or ModelShape.from_config(model.config).head_dim ** -0.5}


def mode_row(lm, src: str, prompt: list[int], spec: ModeSpec, ref: dict, full_cfg: CacheConfig, tokens: int,
             stops: Sequence[int]) -> dict:
    """One mode on one document against the reference: its free run, its teacher-forced distributions
    and (a mode that selects) the selection quality of its fetched sets."""
    model, tok = lm.model, lm.tokenizer
    cfg, ref_tokens, ref_logps = spec.config, ref["tokens"], ref["logps"]
    if cfg == full_cfg:  # the reference run is this mode's free run (greedy decoding is deterministic)
        tokens_m, stats = list(ref_tokens), ref["stats"]
    else:
        tokens_m, _, cache = free_run(model, prompt, cfg, tokens, stops)
        stats = cache.stats()
        del cache
    selection = None
    if ref_tokens:
        if selects(cfg):
            with probing(model) as probe:
                logps = forced_logps(model, prompt, ref_tokens, cfg)
            selection = selection_quality(ref["keys"], ref["queries"], probe, cfg, len(prompt), ref["scaling"],
                                          ref_tokens)
            del probe
        else:
            logps = forced_logps(model, prompt, ref_tokens, cfg)
        forced = compare_distributions(ref_logps, logps)
    else:
        forced = compare_distributions(ref_logps, ref_logps)
    return {"document": src, "mode": spec.label, "prompt_tokens": len(prompt),
            "teacher_forced": forced, "free_running": compare_tokens(ref_tokens, tokens_m),
            "selection": selection, "device_bytes": stats.get("device_bytes"),
            "device_fp16_bytes": stats.get("device_fp16_bytes"),
            "host_bytes": stats.get("host_bytes"), "full_fp16_bytes": stats.get("full_fp16_bytes"),
            # corrected speculative prefetch (free run): the share of each step's set the prefetch had brought
            "prefetch_reuse": stats.get("prefetch_reuse"),
            # the free run's check of its guide against the exact store (engine/kvcache/watch.py)
            "guide_check": stats.get("guide_check"),
            "reference_text": tok.decode(ref_tokens, skip_special_tokens=True),
            "text": tok.decode(tokens_m, skip_special_tokens=True)}


def progress_note(row: dict) -> str:
    """A row's selection, prefetch reuse and guide check, for its progress line."""
    sel = ""
    if row["selection"]:
        f = row["selection"]["selectors"]["fetched"]
        sel = f", coverage {f['coverage']:.3f} ({f['coverage_vs_oracle']:.3f} of oracle)"
    if row["prefetch_reuse"] is not None:
        sel += f", prefetch reuse {row['prefetch_reuse']:.3f}"
    if row["guide_check"] and row["guide_check"]["checks"]:
        check = row["guide_check"]
        sel += f", guide check {check['coverage_vs_oracle']:.3f}{' LOST' if check['lost'] else ''}"
    return sel


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
