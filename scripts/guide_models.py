"""Offline check of the guide on any model (issue 38): what the engine's guide (engine.kvcache.guide.Guide,
the real code) does to one layer's attention, per layer and KV head, against the exact attention.

  capture  the full cache's greedy run over a document (as `bench fidelity`): exact K/V (post-RoPE) per
           global layer (not the model's sliding-window layers) and the query of every decoded position -> .pt
  study    per layer: recall of the exact top-k by the guide's ranking (prefetch "current": the token's own
           attention with guide scores, sinks and residual exact), the exact attention mass that set covers
           (and the exact top-k's, "oracle"), and the relative error of the layer's attention output with
           that set fetched exactly and the guide serving the rest ("out-err"; with exact values: "key-err").
           --center subtracts each channel's mean over the first keys before the guide and adds q . c back;
           --choose spread picks outlier channels by max |k - mean| instead of max |k|.
  keys     per layer and KV head, the channels of largest |k| with their mean and standard deviation

  python scripts/guide_models.py capture --model FILE --doc examples/report.pdf --out /tmp/qwen.pt --tokens 16
  python scripts/guide_models.py study /tmp/qwen.pt --bits 2 --k 128 --outliers 2 --stride 7
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
SINKS, RESIDUAL, FIRST = 4, 64, 448  # the engine's sinks and window; FIRST: the keys a center is taken from


def capture(a) -> None:
    from engine.bench import fidelity
    from engine.config import CacheConfig
    from engine.inputs.documents import load_document
    from engine.inputs.prompts import stop_ids
    from engine.model.loading import load_model

    lm = load_model(a.model, device="cpu")
    budget = lm.max_context - a.tokens - 4
    doc = load_document(a.doc)
    prompt, _ = fidelity.fit_prompt(lm.tokenizer, getattr(doc, "text", doc), min(budget, a.context or budget))
    t0 = time.perf_counter()
    with fidelity.probing(lm.model) as probe:
        ref, _, cache = fidelity.free_run(lm.model, prompt, CacheConfig(mode="full"), a.tokens, stop_ids(lm.tokenizer))
    length = int(cache.lengths[0])
    kept = [i for i, layer in enumerate(cache.layers) if layer.window is None]  # not the model's window layers
    torch.save({"prompt_len": len(prompt), "scaling": probe.scaling, "layers": kept,
                "keys": torch.stack([cache.layers[i].k[0, :, :length].float() for i in kept]),
                "values": torch.stack([cache.layers[i].v[0, :, :length].float() for i in kept]),
                "q": torch.stack([torch.stack([r["q"][:, 0] for r in probe.records[i]]) for i in kept])}, a.out)
    print(f"{a.doc}: {len(prompt)} prompt tokens, {len(ref)} decoded, {time.perf_counter() - t0:.0f} s -> {a.out}",
          file=sys.stderr)


def one_token(a, layer_kv, q, pos, scaling, guide, center):
    """q [H, D] of the token at `pos` -> per KV head (recall, coverage, oracle coverage, out-err, key-err)."""
    keys, values = (t[:, : pos + 1] for t in layer_kv)
    h_kv, d = keys.shape[0], keys.shape[-1]
    qb = a.qb
    qg = q.reshape(h_kv, -1, d)
    exact = (qg @ keys.transpose(-1, -2)) * scaling  # [H_kv, G, pos + 1]
    p_exact = torch.softmax(exact, -1)
    o_exact = p_exact @ values
    g_scores = (guide.scores(qg[None], slice(0, 1), qb)[0] + qg @ center.transpose(-1, -2)) * scaling
    mixed = exact.clone()
    mixed[..., SINKS:qb] = g_scores[..., SINKS:qb]
    kk = min(a.k, qb - SINKS)
    chosen = torch.softmax(mixed, -1)[..., SINKS:qb].sum(1).topk(kk, -1).indices + SINKS  # [H_kv, kk]
    oracle = p_exact[..., SINKS:qb].sum(1).topk(kk, -1).indices + SINKS
    mass = p_exact.sum(1)
    region = mass[:, SINKS:qb].sum(-1)
    recall = torch.tensor([len(set(c.tolist()) & set(o.tolist())) / kk for c, o in zip(chosen, oracle)])
    idx = chosen[:, None, :].expand(-1, mixed.shape[1], -1)
    final = mixed.scatter(-1, idx, exact.gather(-1, idx))
    p = torch.softmax(final, -1)
    guide_p = p[..., :qb].clone()
    guide_p[..., :SINKS] = 0
    guide_p.scatter_(-1, idx, 0.0)
    exact_p = p.clone()
    exact_p[..., :qb] -= guide_p
    out = exact_p @ values + guide.weighted_values(guide_p[None], slice(0, 1), qb)[0]
    err = lambda o: ((o - o_exact).norm(dim=-1) / o_exact.norm(dim=-1)).mean(-1)  # noqa: E731
    return (recall, mass.gather(-1, chosen).sum(-1) / region, mass.gather(-1, oracle).sum(-1) / region,
            err(out), err(p @ values))


def study(a) -> None:
    from engine.kvcache import outliers
    from engine.kvcache.guide import Guide
    from engine.kvcache.sizes import quant_boundary

    if a.choose == "spread":
        outliers.choose_channels = lambda k, count: (k - k.mean(1, keepdim=True)).abs().amax(1).topk(
            count, dim=-1).indices.sort(dim=-1).values
    cap = torch.load(a.capture)
    keys, values, queries, scaling, p0 = cap["keys"], cap["values"], cap["q"], cap["scaling"], cap["prompt_len"]
    layers, h_kv, _, d = keys.shape
    names = ("recall", "coverage", "oracle", "out-err", "key-err")
    every = {n: [] for n in names}
    for layer in (range(layers) if a.layers is None else a.layers):
        rows, built = [], None
        for j in range(0, queries.shape[1], a.stride):
            pos = p0 + j
            a.qb = int(quant_boundary(torch.tensor(pos), RESIDUAL, a.group))
            if built != a.qb:
                k = keys[layer, :, : a.qb][None]
                center = k[:, :, :FIRST].mean(2, keepdim=True) if a.center else torch.zeros_like(k[:, :, :1])
                guide = Guide(1, h_kv, a.qb, d, a.bits, a.group, torch.device("cpu"), a.rotation, a.outliers)
                guide.add(0, 0, k - center, values[layer, :, : a.qb][None])
                built = a.qb
            rows.append(one_token(a, (keys[layer], values[layer]), queries[layer, j], pos, scaling, guide, center[0]))
        means = [torch.stack(col).mean(0) for col in zip(*rows)]
        for n, m in zip(names, means):
            every[n].append(m)
        if a.verbose:
            print(f"layer {layer:2d} " + " ".join(f"{n} {[round(x, 3) for x in m.tolist()]}" for n, m in zip(names, means))
                  + f" max|k| {keys[layer].abs().amax():.0f}")
    m = {n: torch.stack(v) for n, v in every.items()}
    print(f"bits {a.bits} k {a.k} g {a.group} {a.rotation} outliers {a.outliers} center {a.center} choose {a.choose}: "
          + ", ".join(f"{n} {m[n].mean():.4f}" for n in names) + f" (out-err max {m['out-err'].max():.3f})")


def key_stats(a) -> None:
    keys = torch.load(a.capture)["keys"]
    for layer in (range(keys.shape[0]) if a.layers is None else a.layers):
        for h in range(keys.shape[1]):
            k = keys[layer, h]
            mean, std, top = k.mean(0), k.std(0), k.abs().amax(0).topk(6).indices
            print(f"layer {layer} head {h}: " + ", ".join(f"ch {int(i)} mean {mean[i]:.1f} std {std[i]:.1f}" for i in top)
                  + f"; median std {std.median():.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("capture")
    c.add_argument("--model", default=None)
    c.add_argument("--doc", default="examples/report.pdf")
    c.add_argument("--out", required=True)
    c.add_argument("--tokens", type=int, default=16)
    c.add_argument("--context", type=int, default=None)
    s = sub.add_parser("study")
    s.add_argument("capture")
    s.add_argument("--bits", type=int, default=2)
    s.add_argument("--k", type=int, default=128)
    s.add_argument("--group", type=int, default=64)
    s.add_argument("--rotation", default="hadamard")
    s.add_argument("--outliers", type=int, default=0)
    s.add_argument("--center", action="store_true")
    s.add_argument("--choose", choices=("abs", "spread"), default="abs")
    s.add_argument("--layers", type=int, nargs="*", default=None)
    s.add_argument("--stride", type=int, default=4)
    s.add_argument("--verbose", action="store_true")
    k = sub.add_parser("keys")
    k.add_argument("capture")
    k.add_argument("--layers", type=int, nargs="*", default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    {"capture": capture, "study": study, "keys": key_stats}[a.cmd](a)


if __name__ == "__main__":
    main()
