"""Offline study for issue 26 (phase 1): which guide options rank the exact top-k well at low bits, and
which speculative selection rule covers the next token's own oracle best.

Nothing here changes the engine; it imports engine.* read-only (the model loader, the fidelity bench's
probe and prompt helpers, the quantizers of engine/kvcache/quant.py, the sizing formulas).

  capture  run the full cache (greedy summary, as `bench fidelity`) and the engine's speculative mode
           teacher-forced over it, per document; save exact K/V (post-RoPE) per layer, the exact query
           of every decode position, and the speculative run's queries (output token, speculative
           token), fed ids and fetched sets.  -> <captures>/<doc>.pt
  guide    per guide option x layer x KV head: recall of the exact top-k and attention-mass coverage of
           the chosen set (guide region [S, qend), sinks and residual exact, as engine/kvcache/guided.py
           and the fidelity bench's selection_quality), at several k.
  spec     speculative selection rules from the same captures, against the next token's own oracle.
  e2e      (optional) teacher-forced top-1 / KL of a torch-only reimplementation of guided attention
           (current prefetch) for a few options.

Run:  taskset -c 1 nice -n 10 .venv/bin/python scripts/guide_study.py capture --tokens 128
      taskset -c 1 nice -n 10 .venv/bin/python scripts/guide_study.py guide
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

DOCS = ("examples/report.pdf", "examples/texts/federalist.txt",
        "examples/texts/origin-of-species-introduction.txt")
CAPTURES = Path("/tmp/guide-study-captures")
SINKS, RESIDUAL = 4, 64


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def doc_key(src: str) -> str:
    return Path(src).stem


# ============================================================================ capture

def capture(args) -> None:
    from engine.bench import fidelity
    from engine.config import CacheConfig
    from engine.inputs.documents import load_document
    from engine.inputs.prompts import stop_ids
    from engine.model.loading import load_model

    lm = load_model(args.model, device="cpu")
    model, tok = lm.model, lm.tokenizer
    budget = lm.max_context - args.tokens - 4
    if args.context:
        budget = min(budget, args.context)
    stops = stop_ids(tok)
    CAPTURES.mkdir(parents=True, exist_ok=True)
    rot = model.model.rotary_emb
    for src in args.docs:
        out = CAPTURES / f"{doc_key(src)}.pt"
        if out.exists() and not args.force:
            log(f"{out} exists")
            continue
        doc = load_document(src)
        text = getattr(doc, "text", doc)
        prompt, truncated = fidelity.fit_prompt(tok, text, budget)
        t0 = time.perf_counter()
        with fidelity.probing(model) as probe:
            ref_tokens, ref_logps, cache = fidelity.free_run(model, prompt, CacheConfig(mode="full"), args.tokens,
                                                             stops)
        n_layers = len(cache.layers)
        length = int(cache.lengths[0])
        keys = torch.stack([cache.layers[i].k[0, :, :length].float().clone() for i in range(n_layers)])
        values = torch.stack([cache.layers[i].v[0, :, :length].float().clone() for i in range(n_layers)])
        q_own = torch.stack([torch.stack([r["q"][:, 0] for r in probe.records[i]]) for i in range(n_layers)])
        starts = [r["start"] for r in probe.records[0]]
        assert starts == list(range(len(prompt), len(prompt) + len(starts))), "reference passes"
        scaling = probe.scaling
        del cache, probe
        log(f"{src}: full reference {len(prompt)} prompt tokens, {len(ref_tokens)} tokens, "
            f"{time.perf_counter() - t0:.1f} s")
        # RoPE tables of every position (to undo / redo the rotation of keys offline)
        pos = torch.arange(length)[None]
        cos, sin = rot(keys.new_zeros(1, 1, keys.shape[-1]), pos)
        t0 = time.perf_counter()
        spec_cfg = CacheConfig(mode="specache", bits=2, group=64, k=512, prefetch="speculative")
        with fidelity.probing(model) as probe:
            spec_logps = fidelity.forced_logps(model, prompt, ref_tokens, spec_cfg)
        spec = {"q": [], "ids": [], "start": [], "fidx": [], "fvalid": []}
        for i in range(n_layers):
            recs = probe.records[i]
            spec["q"].append([r["q"] for r in recs])  # per pass [H, T, D]
            spec["fidx"].append(torch.stack([r["fidx"] for r in recs if "fidx" in r]))
            spec["fvalid"].append(torch.stack([r["fvalid"] for r in recs if "fvalid" in r]))
        spec["ids"] = [r["ids"] for r in probe.records[0]]
        spec["start"] = [r["start"] for r in probe.records[0]]
        spec["n_new"] = [r["n_new"] for r in probe.records[0]]
        spec["cmp"] = fidelity.compare_distributions(ref_logps, spec_logps)
        log(f"{src}: speculative run top-1 {spec['cmp']['top1_agreement']:.3f} KL {spec['cmp']['mean_kl']:.4f}, "
            f"{time.perf_counter() - t0:.1f} s")
        torch.save({"source": src, "prompt": prompt, "truncated": truncated, "ref_tokens": ref_tokens,
                    "ref_logps": ref_logps.half(), "keys": keys, "values": values, "q_own": q_own,
                    "scaling": scaling, "cos": cos[0].float(), "sin": sin[0].float(),
                    "spec": spec}, out)
        log(f"saved {out}")


# ============================================================================ guide transforms

def rot_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def rope(x, cos, sin):
    """x [H, L, D] at positions 0..L-1 (cos/sin [L, D])."""
    return x * cos + rot_half(x) * sin


def unrope(x, cos, sin):
    return x * cos - rot_half(x) * sin


def hadamard(n: int) -> torch.Tensor:
    """Normalized Sylvester Hadamard matrix (n a power of 2): orthogonal, symmetric."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    assert h.shape[0] == n, "head_dim must be a power of two"
    return h / math.sqrt(n)


def random_orthogonal(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    q = q * torch.sign(torch.diagonal(r))[None, :]
    return q.float()


def _params(lo, hi, bits):
    """As engine.kvcache.quant._params: min/max -> fp16 (scale, zero); 1 bit: the paper's modified KIVI."""
    rng = hi - lo
    if bits == 1:
        s, z = rng / 2, lo + rng / 4
    else:
        s, z = rng / ((1 << bits) - 1), lo
    return s.half().float(), z.half().float()


def _codes(x, s, z, bits):
    sg = torch.where(s > 0, s, torch.ones_like(s))
    return torch.round((x - z) / sg).clamp_(0, (1 << bits) - 1)


def fake_quant_groups(xg: torch.Tensor, bits: int, method: str = "minmax", iters: int = 4) -> torch.Tensor:
    """Quantize the groups on the last axis of xg and return the dequantized values (fp32).
    minmax: the engine's quantizer (KIVI; 1 bit at min + range/4, min + 3 range/4).
    lsq: start from minmax, then alternate codes <-> least-squares (zero, scale) per group (same storage:
    2 fp16 per group, the same dequantization q * s + z, so the engine's kernels are unchanged)."""
    lo, hi = xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)
    s, z = _params(lo, hi, bits)
    c = _codes(xg, s, z, bits)
    if method == "lsq":
        for _ in range(iters):
            cm, xm = c.mean(-1, keepdim=True), xg.mean(-1, keepdim=True)
            var = ((c - cm) ** 2).mean(-1, keepdim=True)
            cov = ((c - cm) * (xg - xm)).mean(-1, keepdim=True)
            s_new = torch.where(var > 0, cov / var.clamp(min=1e-30), torch.zeros_like(var))
            z_new = xm - s_new * cm
            s, z = s_new.clamp(min=0).half().float(), z_new.half().float()
            c = _codes(xg, s, z, bits)
    elif method != "minmax":
        raise ValueError(method)
    return c * s + z


def fake_quant(x: torch.Tensor, bits: int, group: int, along: str, method: str = "minmax") -> torch.Tensor:
    """x [H, L, D] -> dequantized copy. along='tokens': per-channel groups of `group` tokens (the guide's
    keys; the last L % group tokens are left exact, never in the guide); along='channels': per-token groups
    of `group` channels (the guide's values)."""
    h, n, d = x.shape
    out = x.clone()
    if along == "tokens":
        m = n // group * group
        xg = x[:, :m].reshape(h, m // group, group, d).transpose(2, 3)
        out[:, :m] = fake_quant_groups(xg, bits, method).transpose(2, 3).reshape(h, m, d)
    else:
        g = min(group, d)
        out = fake_quant_groups(x.reshape(h, n, d // g, g), bits, method).reshape(h, n, d)
    return out


def _fake_quant_bits(x, bits, group):
    """Uniform min-max quantization at any width (outlier channels at 4 or 8 bits), per channel in token groups."""
    h, n, d = x.shape
    m = n // group * group
    out = x.clone()
    xg = x[:, :m].reshape(h, m // group, group, d)
    lo, hi = xg.amin(2, keepdim=True), xg.amax(2, keepdim=True)
    s = ((hi - lo) / ((1 << bits) - 1)).half().float()
    z = lo.half().float()
    out[:, :m] = (_codes(xg, s, z, bits) * s + z).reshape(h, m, d)
    return out


@dataclass(frozen=True)
class Option:
    """One guide option for the keys (values only matter end to end; `vbits` counts their bytes)."""

    name: str
    bits: int
    group: int = 64  # key group (tokens, or channels with along='channels')
    along: str = "tokens"
    rotation: str | None = None  # hadamard | random (applied to k and q; post- or pre-RoPE space)
    pre_rope: bool = False  # quantize the keys before RoPE, rotate the dequantized keys
    outliers: int = 0  # channels per KV head kept exact (fp16), by largest |k| of the prompt
    outlier_bits: int = 16  # 16: exact fp16; 8 / 4: those channels quantized per channel at that width
    method: str = "minmax"
    vbits: int | None = None  # value bits (None: = bits)
    vrotation: str | None = None  # values rotated per token before quantizing (output rotated back)
    vmethod: str = "minmax"
    vgroup: int = 64  # value group (channels of one token)
    note: str = ""

    def key_bits_per_token(self, d: int) -> float:
        """Key guide bits per token per KV head (codes + fp16 scale and zero, + exact outlier channels)."""
        per_el = self.bits + 32 / (self.group if self.along == "tokens" else min(self.group, d))
        ob = 16 if self.outlier_bits == 16 else self.outlier_bits + 32 / self.group
        return (d - self.outliers) * per_el + ob * self.outliers

    def bytes_per_token(self, d: int) -> float:
        """Guide bytes per token per KV head, K + V (values per token in groups of min(64, d) channels,
        engine.kvcache.sizes.guide_bytes with g = 64)."""
        vb = self.bits if self.vbits is None else self.vbits
        return (self.key_bits_per_token(d) + d * (vb + 32 / min(self.vgroup, d))) / 8

    def guide_values(self, v, mats) -> torch.Tensor:
        """Dequantized value guide [H, L, D] in the model's coordinates (a rotation R: quantize v R per
        token, use v_hat R^T; the engine would apply R^T once to the guide part of the output)."""
        vb = self.bits if self.vbits is None else self.vbits
        r = mats[self.vrotation] if self.vrotation else None
        x = v @ r if r is not None else v
        xq = fake_quant(x, vb, self.vgroup, "channels", self.vmethod)
        return xq @ r.T if r is not None else xq

    def guide_keys(self, k_post, k_pre, cos, sin, mats) -> torch.Tensor:
        """The keys the guide scores against, in post-RoPE coordinates [H, L, D] (q @ k_hat^T is what the
        engine would compute on the transformed q and packed codes: an orthogonal R gives
        (q R)(k_hat_R)^T = q (k_hat_R R^T)^T)."""
        x = k_pre if self.pre_rope else k_post
        r = mats[self.rotation] if self.rotation else None
        if r is not None:
            x = x @ r
        xq = fake_quant(x, self.bits, self.group, self.along, self.method)
        if self.outliers:
            src = x  # channels judged in the quantized space
            idx = src.abs().amax(1).topk(self.outliers, -1).indices  # [H, n]
            sel = torch.zeros(x.shape[0], x.shape[-1], dtype=torch.bool)
            sel.scatter_(-1, idx, True)
            keep = x if self.outlier_bits == 16 else _fake_quant_bits(x, self.outlier_bits, self.group)
            xq = torch.where(sel[:, None, :], keep, xq)
        if r is not None:
            xq = xq @ r.T
        if self.pre_rope:
            xq = rope(xq, cos, sin)
        return xq


def e2e_options() -> list[Option]:
    """Key and value options together, for the end-to-end runs."""
    return [
        Option("k1-vhad", 1, vrotation="hadamard", note="today's 1-bit keys, Hadamard-rotated 1-bit values"),
        Option("k1-v2", 1, vbits=2, note="today's 1-bit keys, 2-bit values"),
        Option("klsq1-vhad", 1, method="lsq", vrotation="hadamard", note="encoder-only key change + rotated values"),
        Option("kout4-vhad", 1, outliers=4, outlier_bits=4, group=128, method="lsq", vrotation="hadamard",
               note="outlier4-int4-g128-lsq-1b keys, Hadamard 1-bit values"),
        Option("kpre-out4-vhad", 1, pre_rope=True, outliers=4, outlier_bits=4, group=128, method="lsq",
               vrotation="hadamard", note="prerope-outlier4-int4-g128-lsq-1b keys, Hadamard 1-bit values"),
        Option("kout4n-vhad", 1, outliers=4, outlier_bits=4, group=128, vrotation="hadamard",
               note="outlier4-int4-g128-1b keys (min-max), Hadamard 1-bit values"),
        Option("kpre-vhad", 1, pre_rope=True, vrotation="hadamard", note="prerope-1b keys, Hadamard 1-bit values"),
        Option("kpre-out4n-vhad", 1, pre_rope=True, outliers=4, outlier_bits=4, group=128, vrotation="hadamard",
               note="prerope-outlier4-int4-g128-1b keys (min-max), Hadamard 1-bit values"),
        Option("khad-vhad", 1, rotation="hadamard", vrotation="hadamard",
               note="Hadamard-rotated 1-bit keys and values (a transform of q, k, v: kernels unchanged)"),
        Option("k2-vhad", 2, vrotation="hadamard", note="2-bit keys, Hadamard-rotated 2-bit values"),
        Option("khad2-vhad", 2, rotation="hadamard", vrotation="hadamard",
               note="Hadamard-rotated 2-bit keys and values (kernels unchanged)"),
        Option("klsq2-vhad", 2, method="lsq", vrotation="hadamard", note="2-bit lsq keys, Hadamard 2-bit values"),
    ]


def options() -> list[Option]:
    out = []
    for b in (1, 2):
        out += [
            Option(f"base-{b}b", b, note="today: per-channel keys post-RoPE, g64, min-max"),
            Option(f"g32-{b}b", b, group=32),
            Option(f"g128-{b}b", b, group=128),
            Option(f"hadamard-{b}b", b, rotation="hadamard"),
            Option(f"randorth-{b}b", b, rotation="random"),
            Option(f"pertoken-{b}b", b, along="channels"),
            Option(f"hadamard-pertoken-{b}b", b, along="channels", rotation="hadamard"),
            Option(f"prerope-{b}b", b, pre_rope=True),
            Option(f"prerope-g128-{b}b", b, pre_rope=True, group=128),
            Option(f"prerope-hadamard-{b}b", b, pre_rope=True, rotation="hadamard"),
            Option(f"outlier1-{b}b", b, outliers=1),
            Option(f"outlier2-{b}b", b, outliers=2),
            Option(f"outlier4-{b}b", b, outliers=4),
            Option(f"prerope-outlier2-{b}b", b, pre_rope=True, outliers=2),
            Option(f"lsq-{b}b", b, method="lsq"),
            Option(f"prerope-lsq-{b}b", b, pre_rope=True, method="lsq"),
            Option(f"hadamard-lsq-{b}b", b, rotation="hadamard", method="lsq"),
            Option(f"outlier2-lsq-{b}b", b, outliers=2, method="lsq"),
            Option(f"outlier1-g128-{b}b", b, outliers=1, group=128),
            Option(f"outlier2-int8-g128-{b}b", b, outliers=2, outlier_bits=8, group=128),
            Option(f"outlier4-int4-g128-{b}b", b, outliers=4, outlier_bits=4, group=128),
            Option(f"outlier4-int8-{b}b", b, outliers=4, outlier_bits=8),
            Option(f"outlier4-int4-g128-lsq-{b}b", b, outliers=4, outlier_bits=4, group=128, method="lsq"),
            Option(f"outlier8-int2-g128-{b}b", b, outliers=8, outlier_bits=2, group=128),
            Option(f"outlier16-int2-g128-{b}b", b, outliers=16, outlier_bits=2, group=128),
        ]
    out = [o for o in out if not o.outliers or o.outlier_bits > o.bits]
    out += [  # combinations at <= today's 1-bit guide bytes (second pass)
        Option("prerope-outlier4-int4-g128-lsq-1b", 1, pre_rope=True, outliers=4, outlier_bits=4, group=128, method="lsq"),
        Option("prerope-outlier4-int4-g128-1b", 1, pre_rope=True, outliers=4, outlier_bits=4, group=128),
        Option("prerope-hadamard-lsq-1b", 1, pre_rope=True, rotation="hadamard", method="lsq"),
        Option("outlier16-int2-g128-lsq-1b", 1, outliers=16, outlier_bits=2, group=128, method="lsq"),
        Option("prerope-outlier16-int2-g128-1b", 1, pre_rope=True, outliers=16, outlier_bits=2, group=128),
    ]
    out.append(Option("k2v1", 2, vbits=1, note="2-bit keys (ranking = base-2b), 1-bit values"))
    return out


# ============================================================================ ranking quality

def quant_boundary(n: torch.Tensor, residual: int, group: int) -> torch.Tensor:
    return ((n - residual).clamp(min=0) // group) * group


class LayerEval:
    """One layer of one document: exact target attention of a set of queries, and the quality of the
    top-k that a guide (or any score) picks. Queries q [N, H, D] at positions pos [N] (each sees [0, pos])."""

    def __init__(self, keys, q, pos, scaling, sinks=SINKS, residual=RESIDUAL, group=64):
        self.h_kv, self.length, d = keys.shape
        n, h, _ = q.shape
        self.g = h // self.h_kv
        self.q = q.reshape(n, self.h_kv, self.g, d).permute(1, 2, 0, 3)  # [H_kv, G, N, D]
        self.pos, self.scaling, self.sinks = pos, scaling, sinks
        col = torch.arange(self.length)
        self.causal = col[None, :] <= pos[:, None]  # [N, L]
        self.exact = self.scores(keys)
        self.target = self.softmax(self.exact)  # [H_kv, N, L]
        self.residual = residual
        self.regions = {}
        self.set_group(group)

    def set_group(self, group):
        if group not in self.regions:
            qb = quant_boundary(self.pos, self.residual, group)
            col = torch.arange(self.length)
            self.regions[group] = (col[None, :] >= self.sinks) & (col[None, :] < qb[:, None])
        self.region = self.regions[group]

    def scores(self, keys):
        return torch.einsum("hgnd,hld->hgnl", self.q, keys) * self.scaling

    def softmax(self, s):
        return torch.softmax(s.masked_fill(~self.causal, float("-inf")), -1).mean(1)

    def guide_probs(self, guide_keys, exact=None):
        """The selecting attention as the engine computes it: guide scores over the guide region, exact at
        sinks and the residual window, one softmax, averaged over each KV head's query heads."""
        exact = self.exact if exact is None else exact
        return self.softmax(torch.where(self.region, self.scores(guide_keys), exact))

    def evaluate(self, sel_probs, ks, target=None):
        """Top-k of sel_probs [H_kv, N, L] in the region vs the exact top-k of the target.
        -> {k: (recall [H_kv, N], coverage [H_kv, N])}"""
        target = self.target if target is None else target
        t = target.masked_fill(~self.region, -1.0)
        kmax = max(ks)
        o_idx = t.topk(kmax, -1).indices
        s_idx = sel_probs.masked_fill(~self.region, -1.0).topk(kmax, -1).indices
        mass = target.masked_fill(~self.region, 0.0)
        region = mass.sum(-1).clamp(min=1e-30)
        out = {}
        for k in ks:
            om = torch.zeros_like(t, dtype=torch.bool).scatter_(-1, o_idx[..., :k], True)
            sm = torch.zeros_like(t, dtype=torch.bool).scatter_(-1, s_idx[..., :k], True)
            recall = (om & sm).sum(-1).double() / k
            cov = (mass * sm).sum(-1) / region
            out[k] = (recall, cov, (mass * om).sum(-1) / region)
        return out


def captures(args):
    """(path, capture) of every stored capture, or of the documents named by --docs."""
    for path in sorted(CAPTURES.glob("*.pt")):
        if not args.docs or path.stem in args.docs:
            yield path, load_capture(path)


def rotations(d: int) -> dict[str, torch.Tensor]:
    """The orthogonal transforms the options name: a Hadamard and a fixed random one of size d."""
    return {"hadamard": hadamard(d), "random": random_orthogonal(d, 0)}


def load_capture(path: Path) -> dict:
    return torch.load(path, weights_only=False)


def layer_inputs(cap, layer, first=1, stride=1):
    """keys post/pre RoPE [H_kv, L, D], own queries [N, H, D] and positions of forced tokens first.. ."""
    k_post = cap["keys"][layer]
    cos, sin = cap["cos"], cap["sin"]
    k_pre = unrope(k_post, cos, sin)
    q = cap["q_own"][layer]
    idx = torch.arange(first, q.shape[0], stride)
    pos = len(cap["prompt"]) + idx
    return k_post, k_pre, cos, sin, q[idx], pos


def check_quantizer(cap) -> None:
    """fake_quant equals the engine's quantize/dequantize at 1 and 2 bits (keys and values)."""
    from engine.kvcache import quant
    k = cap["keys"][3][:, :1024]
    for b in (1, 2):
        ours = fake_quant(k, b, 64, "tokens")
        theirs = quant.dequantize_keys(quant.quantize_keys(k[None], b, 64))[0]
        assert torch.allclose(ours, theirs, atol=1e-6), f"keys {b} bit: {(ours - theirs).abs().max()}"
        ours = fake_quant(k, b, 64, "channels")
        theirs = quant.dequantize_values(quant.quantize_values(k[None], b, 64))[0]
        assert torch.allclose(ours, theirs, atol=1e-6), f"values {b} bit: {(ours - theirs).abs().max()}"
    k_pre = unrope(cap["keys"][3], cap["cos"], cap["sin"])
    assert torch.allclose(rope(k_pre, cap["cos"], cap["sin"]), cap["keys"][3], atol=1e-4), "RoPE round trip"
    log("quantizer and RoPE checks: equal to engine.kvcache.quant")


def guide_study(args) -> None:
    opts = [o for o in options() if not args.options or o.name in args.options or
            any(o.name.startswith(p) for p in args.options)]
    ks = sorted(args.k)
    d = 64
    mats = rotations(d)
    results = {"settings": {"k": ks, "sinks": SINKS, "residual": RESIDUAL, "stride": args.stride,
                            "layers": args.layers}, "options": {}, "docs": {}}
    per = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))  # opt -> k -> metric -> [doc means]
    per_layer = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))  # opt -> k -> layer -> [cov]
    for path, cap in captures(args):
        check_quantizer(cap)
        n_layers = cap["keys"].shape[0]
        layers = args.layers or list(range(n_layers))
        acc = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
        t0 = time.perf_counter()
        for layer in layers:
            k_post, k_pre, cos, sin, q, pos = layer_inputs(cap, layer, stride=args.stride)
            ev = LayerEval(k_post, q, pos, cap["scaling"])
            o = None
            for opt in opts:
                ev.set_group(opt.group if opt.along == "tokens" else 64)
                kg = opt.guide_keys(k_post, k_pre, cos, sin, mats)
                res = ev.evaluate(ev.guide_probs(kg), ks)
                for k, (rec, cov, orc) in res.items():
                    acc[opt.name][k]["recall"].append(rec.flatten())
                    acc[opt.name][k]["coverage"].append(cov.flatten())
                    acc[opt.name][k]["oracle"].append(orc.flatten())
                    per_layer[opt.name][k][layer].append(float(cov.mean()))
            log(f"{path.stem} layer {layer} done ({time.perf_counter() - t0:.0f} s)")
        results["docs"][path.stem] = {"prompt_tokens": len(cap["prompt"]), "forced": len(cap["ref_tokens"])}
        for name, by_k in acc.items():
            for k, m in by_k.items():
                for metric, xs in m.items():
                    per[name][k][metric].append(float(torch.cat(xs).mean()))
    for opt in opts:
        if opt.name not in per:
            continue
        results["options"][opt.name] = {
            "option": opt.__dict__, "bytes_per_token_per_kv_head": opt.bytes_per_token(d),
            "bytes_vs_1bit": opt.bytes_per_token(d) / Option("x", 1).bytes_per_token(d),
            "k": {str(k): {metric: {"mean": sum(v) / len(v), "per_doc": v} for metric, v in per[opt.name][k].items()}
                  for k in ks},
            "per_layer_coverage": {str(k): {str(l): sum(v) / len(v) for l, v in sorted(per_layer[opt.name][k].items())}
                                   for k in ks}}
    out = Path(args.out)
    out.write_text(json.dumps(results, indent=1))
    log(f"wrote {out}")
    kshow = ks
    print("| option | bytes vs 1b | " + " | ".join(f"k{k} recall / coverage" for k in kshow) + " |")
    for name, r in results["options"].items():
        cells = [f"{r['k'][str(k)]['recall']['mean']:.3f} / {r['k'][str(k)]['coverage']['mean']:.3f}" for k in kshow]
        print(f"| {name} | {r['bytes_vs_1bit']:.3f} | " + " | ".join(cells) + " |")
    print("oracle coverage: " + ", ".join(
        f"k{k} {next(iter(results['options'].values()))['k'][str(k)]['oracle']['mean']:.3f}" for k in kshow))


# ============================================================================ value guide

def value_options() -> list[Option]:
    out = []
    for b in (1, 2):
        out += [Option(f"v-base-{b}b", 1, vbits=b), Option(f"v-lsq-{b}b", 1, vbits=b, vmethod="lsq"),
                Option(f"v-hadamard-{b}b", 1, vbits=b, vrotation="hadamard"),
                Option(f"v-randorth-{b}b", 1, vbits=b, vrotation="random"),
                Option(f"v-hadamard-lsq-{b}b", 1, vbits=b, vrotation="hadamard", vmethod="lsq"),
                Option(f"v-g32-{b}b", 1, vbits=b, vgroup=32),
                Option(f"v-hadamard-g32-{b}b", 1, vbits=b, vgroup=32, vrotation="hadamard")]
    return out


def value_study(args) -> None:
    """Error of the attention output from the guide's values: with the exact top-k fetched (oracle set),
    sinks and residual exact, the rest of the region read from the value guide:
    || sum_{i in region, not chosen} p_i (v_hat_i - v_i) || / || sum_i p_i v_i ||, per query head."""
    opts = value_options()
    mats = rotations(64)
    acc = defaultdict(list)
    for path, cap in captures(args):
        local = defaultdict(list)
        for layer in (args.layers or range(cap["keys"].shape[0])):
            k_post, k_pre, cos, sin, q, pos = layer_inputs(cap, layer, stride=args.stride)
            v = cap["values"][layer]
            ev = LayerEval(k_post, q, pos, cap["scaling"])
            p = torch.softmax(ev.exact.masked_fill(~ev.causal, float("-inf")), -1)  # [H_kv, G, N, L]
            out = torch.einsum("hgnl,hld->hgnd", p, v)
            norm = out.norm(dim=-1).clamp(min=1e-30)
            t = ev.target.masked_fill(~ev.region, -1.0)
            chosen = torch.zeros_like(ev.region[None].expand(ev.h_kv, -1, -1)).scatter_(-1, t.topk(args.k, -1).indices, True)
            guide_part = (ev.region[None] & ~chosen)[:, None]  # [H_kv, 1, N, L]
            pg = p * guide_part
            for opt in opts:
                err = torch.einsum("hgnl,hld->hgnd", pg, opt.guide_values(v, mats) - v).norm(dim=-1) / norm
                local[opt.name].append(err.flatten())
        for name, xs in local.items():
            acc[name].append(float(torch.cat(xs).mean()))
        log(f"{path.stem} done")
    res = {o.name: {"relative_output_error": sum(acc[o.name]) / len(acc[o.name]), "per_doc": acc[o.name],
                    "value_bits_per_element": (o.vbits + 32 / o.vgroup)} for o in opts}
    Path(args.out).write_text(json.dumps(res, indent=1))
    print("| value option | bits / element | relative output error |")
    for name, r in res.items():
        print(f"| {name} | {r['value_bits_per_element']:.2f} | {r['relative_output_error']:.4f} |")


# ============================================================================ speculative selection

def probs_for(q, causal_pos, region, keys, guide_keys, scaling, h_kv):
    """Selecting attention of queries q [N, H, D] at positions causal_pos [N]: guide scores over region
    [N, L], exact elsewhere; softmax; mean over each KV head's query heads -> [H_kv, N, L]."""
    n, h, d = q.shape
    qg = q.reshape(n, h_kv, h // h_kv, d).permute(1, 2, 0, 3)
    ex = torch.einsum("hgnd,hld->hgnl", qg, keys)
    gs = torch.einsum("hgnd,hld->hgnl", qg, guide_keys)
    col = torch.arange(keys.shape[1])
    causal = col[None, :] <= causal_pos[:, None]
    s = torch.where(region, gs, ex) * scaling
    return torch.softmax(s.masked_fill(~causal, float("-inf")), -1).mean(1)


def topk_mask(scores, region, k):
    idx = scores.masked_fill(~region, -1.0).topk(k, -1).indices
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, idx, True)


def split_mask(first, second, region, k, n_first):
    """n_first of first's top positions, the rest of the budget from second's ranking (no duplicates)."""
    m = topk_mask(first, region, n_first)
    return m | topk_mask(second.masked_fill(m, -1.0), region & ~m, k - n_first)


RULES = ("spec", "out", "both", "both_w25", "both_w75", "max", "split50", "split75", "ema50", "prevout",
         "adaptive", "exact_spec", "own")


def rule_masks(p_spec, p_out, p_own, p_exact_spec, region, k, hits_prev):
    """Every rule's chosen set [H_kv, N, L] for the step whose target is the next token's own attention."""
    both = p_spec + p_out
    prev_both = torch.cat([torch.zeros_like(both[:, :1]), both[:, :-1]], 1)
    ema = both.clone()
    for j in range(1, ema.shape[1]):
        ema[:, j] += 0.5 * ema[:, j - 1]
    prev_out = torch.cat([torch.zeros_like(p_out[:, :1]), p_out[:, :-1]], 1)
    adaptive = torch.where(hits_prev[None, :, None], p_spec, both)
    scores = {"spec": p_spec, "out": p_out, "both": both, "both_w25": 0.25 * p_spec + 0.75 * p_out,
              "both_w75": 0.75 * p_spec + 0.25 * p_out, "max": torch.maximum(p_spec, p_out), "ema50": ema,
              "prevout": p_spec + p_out + prev_out, "adaptive": adaptive, "exact_spec": p_exact_spec,
              "own": p_own}
    masks = {name: topk_mask(x, region, k) for name, x in scores.items()}
    masks["split50"] = split_mask(p_spec, p_out, region, k, k // 2)
    masks["split75"] = split_mask(p_spec, p_out, region, k, 3 * k // 4)
    return masks


def spec_study(args) -> None:
    names = args.options
    opts = {o.name: o for o in options()}
    mats = rotations(64)
    ks = sorted(args.k)
    acc = defaultdict(lambda: defaultdict(list))  # (opt, k, rule, metric) -> [doc means]
    docs = {}
    for path, cap in captures(args):
        sp = cap["spec"]
        p_len, ref = len(cap["prompt"]), cap["ref_tokens"]
        n_pass = len(sp["start"])
        js = [j for j in range(1, min(n_pass, len(ref))) if sp["start"][j] == p_len + j - 1 and sp["n_new"][j] == 2]
        hit = torch.tensor([sp["ids"][j][1] == ref[j] for j in js])
        hits_prev = torch.tensor([j >= 2 and sp["ids"][j - 1][1] == ref[j - 1] for j in js])
        docs[path.stem] = {"passes": len(js), "speculation_hit_rate": float(hit.double().mean()),
                           "engine_run": sp["cmp"]}
        local = defaultdict(list)
        t0 = time.perf_counter()
        layers = args.layers or list(range(cap["keys"].shape[0]))
        for layer in layers:
            keys = cap["keys"][layer]
            k_pre = unrope(keys, cap["cos"], cap["sin"])
            jt = torch.tensor(js)
            pos = p_len + jt
            q_own = cap["q_own"][layer][jt]
            q_out = torch.stack([sp["q"][layer][j][:, 0] for j in js]).float()
            q_spec = torch.stack([sp["q"][layer][j][:, 1] for j in js]).float()
            h_kv = keys.shape[0]
            col = torch.arange(keys.shape[1])
            region = (col[None, :] >= SINKS) & (col[None, :] < quant_boundary(pos, RESIDUAL, 64)[:, None])
            target = probs_for(q_own, pos, region, keys, keys, cap["scaling"], h_kv)
            mass = target.masked_fill(~region, 0.0)
            total = mass.sum(-1).clamp(min=1e-30)
            p_exact_spec = probs_for(q_spec, pos, region, keys, keys, cap["scaling"], h_kv)
            for name in names:
                kg = opts[name].guide_keys(keys, k_pre, cap["cos"], cap["sin"], mats)
                p_spec = probs_for(q_spec, pos, region, keys, kg, cap["scaling"], h_kv)
                p_out = probs_for(q_out, pos - 1, region, keys, kg, cap["scaling"], h_kv)
                p_own = probs_for(q_own, pos, region, keys, kg, cap["scaling"], h_kv)
                for k in ks:
                    oracle = topk_mask(target, region, k)
                    for rule, m in rule_masks(p_spec, p_out, p_own, p_exact_spec, region, k, hits_prev).items():
                        cov = (mass * m).sum(-1) / total  # [H_kv, N]
                        rec = (m & oracle).sum(-1).double() / k
                        local[(name, k, rule, "coverage")].append(cov)
                        local[(name, k, rule, "recall")].append(rec)
                    local[(name, k, "oracle", "coverage")].append((mass * oracle).sum(-1) / total)
            log(f"{path.stem} layer {layer} ({time.perf_counter() - t0:.0f} s)")
        for key, xs in local.items():
            x = torch.stack(xs).double()  # [layers, H_kv, N]
            acc[key]["all"].append(float(x.mean()))
            if key[3] == "coverage":
                acc[key]["hit"].append(float(x[:, :, hit].mean()) if hit.any() else float("nan"))
                acc[key]["miss"].append(float(x[:, :, ~hit].mean()) if (~hit).any() else float("nan"))
    out = {"docs": docs, "k": ks, "options": names, "rules": {}}
    for (name, k, rule, metric), v in acc.items():
        out["rules"].setdefault(name, {}).setdefault(str(k), {}).setdefault(rule, {})[metric] = {
            part: {"mean": sum(x) / len(x), "per_doc": x} for part, x in v.items()}
    Path(args.out).write_text(json.dumps(out, indent=1))
    log(f"wrote {args.out}")
    print(json.dumps(docs, indent=1))
    for name in names:
        for k in ks:
            r = out["rules"][name][str(k)]
            orc = r["oracle"]["coverage"]["all"]["mean"]
            print(f"\n{name} k{k} (oracle coverage {orc:.3f})")
            print("| rule | recall | coverage | / oracle | coverage when the guess is right / wrong |")
            for rule in RULES:
                c, rc = r[rule]["coverage"], r[rule]["recall"]["all"]["mean"]
                print(f"| {rule} | {rc:.3f} | {c['all']['mean']:.3f} | {c['all']['mean'] / orc:.3f} | "
                      f"{c['hit']['mean']:.3f} / {c['miss']['mean']:.3f} |")


# ---- speculative selection with the engine's feedback: the queries see exact scores at the set in use

SEQ_RULES = ("spec", "both", "both_w75", "adaptive", "out")


def seq_select(ex_spec, gs_spec, ex_out, gs_out, region, k, rule, hits_prev, sinks=SINKS):
    """Step by step as the engine does it: at pass j the output and speculative tokens attend with exact
    scores at the set chosen at pass j - 1 (and sinks, residual), guide scores elsewhere in the region;
    the rule picks pass j's set from their probabilities. ex_*/gs_* [H_kv, G, N, L] (scaled scores,
    causal -inf already applied); region [N, L]. -> chosen masks [H_kv, N, L]."""
    h, g, n, l = ex_spec.shape
    prev = torch.zeros(h, l, dtype=torch.bool)
    out = torch.zeros(h, n, l, dtype=torch.bool)
    for j in range(n):
        use_guide = region[j][None, :] & ~prev  # [H_kv, L]
        ps = torch.softmax(torch.where(use_guide[:, None], gs_spec[:, :, j], ex_spec[:, :, j]), -1).mean(1)
        po = torch.softmax(torch.where(use_guide[:, None], gs_out[:, :, j], ex_out[:, :, j]), -1).mean(1)
        if rule == "spec" or (rule == "adaptive" and bool(hits_prev[j])):
            sc = ps
        elif rule == "out":
            sc = po
        elif rule == "both_w75":
            sc = 0.75 * ps + 0.25 * po
        else:
            sc = ps + po
        idx = sc.masked_fill(~region[j][None, :], -1.0).topk(k, -1).indices
        m = torch.zeros(h, l, dtype=torch.bool).scatter_(-1, idx, True)
        out[:, j] = m
        prev = m
    return out


def spec_seq_study(args) -> None:
    opts = {o.name: o for o in options()}
    mats = rotations(64)
    acc = defaultdict(list)
    for path, cap in captures(args):
        sp = cap["spec"]
        p_len, ref = len(cap["prompt"]), cap["ref_tokens"]
        js = [j for j in range(1, min(len(sp["start"]), len(ref))) if sp["start"][j] == p_len + j - 1
              and sp["n_new"][j] == 2]
        hits_prev = torch.tensor([j >= 2 and sp["ids"][j - 1][1] == ref[j - 1] for j in js])
        local = defaultdict(list)
        t0 = time.perf_counter()
        for layer in (args.layers or range(cap["keys"].shape[0])):
            keys = cap["keys"][layer]
            k_pre = unrope(keys, cap["cos"], cap["sin"])
            jt = torch.tensor(js)
            pos = p_len + jt
            h_kv, length, d = keys.shape
            col = torch.arange(length)
            region = (col[None, :] >= SINKS) & (col[None, :] < quant_boundary(pos, RESIDUAL, 64)[:, None])
            target = probs_for(cap["q_own"][layer][jt], pos, region, keys, keys, cap["scaling"], h_kv)
            mass = target.masked_fill(~region, 0.0)
            total = mass.sum(-1).clamp(min=1e-30)

            def scores(q, causal_pos, kk):
                n, hq, _ = q.shape
                qg = q.reshape(n, h_kv, hq // h_kv, d).permute(1, 2, 0, 3)
                sc = torch.einsum("hgnd,hld->hgnl", qg, kk) * cap["scaling"]
                return sc.masked_fill(~(col[None, :] <= causal_pos[:, None]), float("-inf"))

            q_out = torch.stack([sp["q"][layer][j][:, 0] for j in js]).float()
            q_spec = torch.stack([sp["q"][layer][j][:, 1] for j in js]).float()
            ex_s, ex_o = scores(q_spec, pos, keys), scores(q_out, pos - 1, keys)
            for name in args.options:
                kg = opts[name].guide_keys(keys, k_pre, cap["cos"], cap["sin"], mats)
                gs_s, gs_o = scores(q_spec, pos, kg), scores(q_out, pos - 1, kg)
                p_own = probs_for(cap["q_own"][layer][jt], pos, region, keys, kg, cap["scaling"], h_kv)
                for k in args.k:
                    oracle = topk_mask(target, region, k)
                    own = topk_mask(p_own, region, k)  # what prefetch current would fetch at that step
                    local[(name, k, "oracle")].append((mass * oracle).sum(-1) / total)
                    local[(name, k, "own")].append((mass * own).sum(-1) / total)
                    for rule in SEQ_RULES:
                        m = seq_select(ex_s, gs_s, ex_o, gs_o, region, k, rule, hits_prev)
                        local[(name, k, rule)].append((mass * m).sum(-1) / total)
                        local[(name, k, rule + ".recall")].append((m & oracle).sum(-1).double() / k)
                        local[(name, k, rule + ".own_in_prefetch")].append((m & own).sum(-1).double() / k)
            log(f"{path.stem} layer {layer} ({time.perf_counter() - t0:.0f} s)")
        for key, xs in local.items():
            acc[key].append(float(torch.stack(xs).double().mean()))
    out = {"k": args.k, "options": args.options, "coverage": {}}
    for (name, k, rule), v in acc.items():
        out["coverage"].setdefault(name, {}).setdefault(str(k), {})[rule] = {"mean": sum(v) / len(v), "per_doc": v}
    Path(args.out).write_text(json.dumps(out, indent=1))
    for name in args.options:
        for k in args.k:
            r = out["coverage"][name][str(k)]
            print(f"{name} k{k}: oracle {r['oracle']['mean']:.3f}, own (current) {r['own']['mean']:.3f}")
            for rule in SEQ_RULES:
                print(f"  {rule}: coverage {r[rule]['mean']:.3f}, recall {r[rule + '.recall']['mean']:.3f}, "
                      f"own top-k already prefetched {r[rule + '.own_in_prefetch']['mean']:.3f}")


# ============================================================================ end to end (optional)

E2E_NAME = "guide_study_e2e"


class E2E:
    """Per batch row, a guide option (None: exact); the attention function below reads it."""

    rows: list = []
    k: int = 512
    mats: dict = {}
    cos = sin = None
    guides: dict = {}  # (layer, row) -> (qb, K_hat [H_kv, qb, D], V_hat [H_kv, qb, D])
    stats: dict = {}


def _guided_decode(q, keys, values, opt, layer, row, p, scaling):
    """Current prefetch, mirroring engine/kvcache/guided.py: one new token at position p; q [H, 1, D];
    keys/values [H_kv, p + 1, D] exact (post-RoPE). Guide over [S, qb); the token's guide attention
    (sinks and residual exact) picks the top-k per KV head, then one softmax with exact scores at sinks,
    the chosen set and the residual, guide scores elsewhere; values likewise."""
    h_kv, n, d = keys.shape
    qb = int(quant_boundary(torch.tensor(p), RESIDUAL, opt.group if opt.along == "tokens" else 64))
    qg = q[:, 0].reshape(h_kv, -1, d)  # [H_kv, G, D]
    exact = torch.einsum("hgd,hld->hgl", qg, keys) * scaling
    if qb <= SINKS:
        pr = torch.softmax(exact, -1)
        return torch.einsum("hgl,hld->hgd", pr, values).reshape(-1, d)
    cached = E2E.guides.get((layer, row))
    if cached is None or cached[0] != qb:
        kk = keys[:, :qb]
        k_pre = unrope(kk, E2E.cos[:qb], E2E.sin[:qb])
        k_hat = opt.guide_keys(kk, k_pre, E2E.cos[:qb], E2E.sin[:qb], E2E.mats)
        v_hat = opt.guide_values(values[:, :qb], E2E.mats)
        cached = (qb, k_hat, v_hat)
        E2E.guides[(layer, row)] = cached
    _, k_hat, v_hat = cached
    col = torch.arange(n)
    region = (col >= SINKS) & (col < qb)
    gs = torch.einsum("hgd,hld->hgl", qg, k_hat) * scaling
    gsc = torch.cat([gs, exact[..., qb:]], -1)
    sel_scores = torch.where(region, gsc, exact)
    sel = torch.softmax(sel_scores, -1).mean(1).masked_fill(~region, -1.0)  # [H_kv, n]
    kk = min(E2E.k, qb - SINKS)
    chosen = torch.zeros(h_kv, n, dtype=torch.bool)
    if kk > 0:
        chosen.scatter_(-1, sel.topk(kk, -1).indices, True)
    use_guide = region[None, :] & ~chosen  # [H_kv, n]
    scores = torch.where(use_guide[:, None, :], gsc, exact)
    pr = torch.softmax(scores, -1)
    v_mix = torch.where(use_guide[..., None], torch.cat([v_hat, values[:, qb:]], 1), values)
    return torch.einsum("hgl,hld->hgd", pr, v_mix).reshape(-1, d)


def _e2e_attention(module, query, key, value, attention_mask, scaling=None, kv_cache=None, **kwargs):
    from engine.model.attention import specache_attention
    step = kv_cache.step
    if step.prefill or step.n_new != 1:
        return specache_attention(module, query, key, value, attention_mask, scaling=scaling, kv_cache=kv_cache,
                                  **kwargs)
    layer = kv_cache.layers[module.layer_idx]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    b = query.shape[0]
    outs = []
    for i in range(b):
        r = step.rows.start + i
        p = step.starts[i]
        keys, values = layer.k[r, :, : p + 1].float(), layer.v[r, :, : p + 1].float()
        opt = E2E.rows[r]
        q = query[i].float()
        if opt is None:
            h_kv, _, d = keys.shape
            qg = q[:, 0].reshape(h_kv, -1, d)
            pr = torch.softmax(torch.einsum("hgd,hld->hgl", qg, keys) * scale, -1)
            o = torch.einsum("hgl,hld->hgd", pr, values).reshape(-1, d)
        else:
            o = _guided_decode(q, keys, values, opt, module.layer_idx, r, p, scale)
        outs.append(o)
    out = torch.stack(outs)[:, None].to(query.dtype)  # [b, T=1, H, D]
    return out, None


def e2e_study(args) -> None:
    from transformers import AttentionInterface
    from engine.bench import fidelity
    from engine.config import CacheConfig
    from engine.generate.engine import Engine
    from engine.model.loading import load_model

    opts = {o.name: o for o in options() + e2e_options()}
    names = args.options
    lm = load_model(None, device="cpu")
    model = lm.model
    AttentionInterface.register(E2E_NAME, _e2e_attention)
    model.set_attn_implementation(E2E_NAME)
    E2E.mats = rotations(64)
    E2E.k = args.k
    results = {"k": args.k, "options": names, "docs": {}}
    for path, cap in captures(args):
        prompt, forced = cap["prompt"], cap["ref_tokens"][: args.tokens]
        ref = cap["ref_logps"].float()[: len(forced)]
        E2E.rows = [None] + [opts[n] for n in names]
        E2E.guides = {}
        B = len(E2E.rows)
        t0 = time.perf_counter()
        eng = Engine(model, CacheConfig(mode="full"))
        logps = [[] for _ in range(B)]
        with torch.inference_mode(), eng.new_cache(B, len(prompt) + len(forced) + 4) as cache:
            *_, last = eng.prefill(cache, prompt, 0)
            for r in range(1, B):
                cache.copy_row(0, r)
            n_pos = len(prompt) + len(forced) + 4
            cos, sin = model.model.rotary_emb(torch.zeros(1, 1, 64), torch.arange(n_pos)[None])
            E2E.cos, E2E.sin = cos[0].float(), sin[0].float()
            it = iter(forced)
            pick = lambda logits, _: torch.full((B,), next(it, 0), dtype=torch.long)  # noqa: E731
            for i, (_, logits) in enumerate(eng.steps(cache, last[None].expand(B, -1).contiguous(), pick,
                                                      history=[list(prompt) for _ in range(B)])):
                for r in range(B):  # the logits before forced token i (the first: the prefill's)
                    logps[r].append(torch.log_softmax(logits[r].float(), -1))
                if i + 1 >= len(forced):
                    break
        doc = {}
        for r, name in enumerate(["exact"] + names):
            doc[name] = fidelity.compare_distributions(ref, torch.stack(logps[r]))
        results["docs"][path.stem] = doc
        log(f"{path.stem}: " + ", ".join(f"{n} {v['top1_agreement']:.3f}/{v['mean_kl']:.4f}" for n, v in doc.items())
            + f" ({time.perf_counter() - t0:.0f} s)")
    mean = {}
    for name in ["exact"] + names:
        xs = [d[name] for d in results["docs"].values()]
        mean[name] = {"top1_agreement": sum(x["top1_agreement"] for x in xs) / len(xs),
                      "mean_kl": sum(x["mean_kl"] for x in xs) / len(xs)}
    results["mean"] = mean
    Path(args.out).write_text(json.dumps(results, indent=1))
    for name, v in mean.items():
        print(f"| {name} | {v['top1_agreement']:.3f} | {v['mean_kl']:.4f} |")


# ============================================================================ report

def device_bytes(opt: Option, tokens: int, k: int, element_bytes: int, layers=30, kv_heads=3, d=64, chunk=512) -> int:
    """One sequence's device bytes as engine/kvcache/sizes.py counts them for the planner (guide over the
    guide capacity, the fetched set, the residual slots and the sinks), with this option's guide bytes."""
    from engine.kvcache.sizes import guide_capacity, residual_slots, sink_slots
    g = opt.group if opt.along == "tokens" else 64
    per_layer_token = 2 * kv_heads * d * element_bytes
    guide = guide_capacity(tokens, g) * kv_heads * opt.bytes_per_token(d)
    exact = (k + residual_slots(RESIDUAL, g, chunk) + sink_slots(SINKS)) * per_layer_token
    return int(layers * (guide + exact))


def report(args) -> None:
    guide = json.loads(Path(args.guide[0]).read_text())
    for extra in args.guide[1:]:  # further passes over the same documents (more options)
        guide["options"].update(json.loads(Path(extra).read_text())["options"])
    seq = json.loads(Path(args.spec_seq).read_text()) if args.spec_seq and Path(args.spec_seq).exists() else None
    spec = json.loads(Path(args.spec).read_text()) if args.spec and Path(args.spec).exists() else None
    e2e_by_k = {}
    for f in args.e2e:  # rounds of `e2e` over the same documents: one table per k
        if not Path(f).exists():
            continue
        r = json.loads(Path(f).read_text())
        e2e = e2e_by_k.get(r["k"])
        if e2e is None:
            e2e_by_k[r["k"]] = r
            continue
        for doc, rows in r["docs"].items():
            e2e["docs"].setdefault(doc, {}).update({n: v for n, v in rows.items() if n != "exact"})
        e2e["mean"].update({n: v for n, v in r["mean"].items() if n != "exact"})
    values = json.loads(Path(args.values).read_text()) if args.values and Path(args.values).exists() else None
    opts = {o.name: o for o in options() + e2e_options()}
    base1 = opts["base-1b"]
    lines = ["# Guide options and speculative selection: an offline study (issue 26, phase 1)", "",
             "`scripts/guide_study.py` (capture, guide, values, spec, spec-seq, e2e, report); numbers in "
             "guide-study.json.", ""]
    if args.preface:
        lines += [Path(args.preface).read_text().rstrip(), ""]
    docs = guide["docs"]
    lines += ["Documents (the fidelity bench's three, full-cache greedy summary teacher-forced): " +
              "; ".join(f"{k} ({v['prompt_tokens']} prompt tokens, {v['forced']} forced tokens)" for k, v in docs.items()),
              f"Layers: all 30, KV heads: 3, forced positions: every {guide['settings']['stride']} from the second; "
              f"sinks {SINKS}, residual {RESIDUAL}, guide region [S, qend) as in engine/kvcache/guided.py. "
              "Recall = |chosen ∩ exact top-k| / k; coverage = the token's exact attention mass on the chosen set / "
              "its mass on the guide region (the fidelity bench's guide_own). Means over (layer, KV head, position) "
              "per document, then over documents.", ""]
    ks = guide["settings"]["k"]
    lines += ["## Guide options (the token's own query, `--prefetch current`)", "",
              "| option | guide bytes / token / KV head | vs today's 1-bit | device vs 1b, fp16 exact (GPU) | fp32 exact (CPU bench) | " +
              " | ".join(f"k{k} recall / coverage" for k in ks) + " |",
              "|---|---|---|---|---|" + "---|" * len(ks)]
    for name, r in guide["options"].items():
        o = opts[name]
        dev = device_bytes(o, 6549, 512, 2) / device_bytes(base1, 6549, 512, 2)
        dev32 = device_bytes(o, 6549, 512, 4) / device_bytes(base1, 6549, 512, 4)
        cells = [f"{r['k'][str(k)]['recall']['mean']:.3f} / {r['k'][str(k)]['coverage']['mean']:.3f}" for k in ks]
        lines.append(f"| {name} | {o.bytes_per_token(64):.1f} | {o.bytes_per_token(64) / base1.bytes_per_token(64):.3f} | "
                     f"{dev:.3f} | {dev32:.3f} | " + " | ".join(cells) + " |")
    first = next(iter(guide["options"].values()))
    lines += ["", "Oracle (exact top-k) coverage: " + ", ".join(f"k{k} {first['k'][str(k)]['oracle']['mean']:.3f}" for k in ks), ""]
    lines += ["Per document (k512 coverage):", "", "| option | " + " | ".join(docs) + " |", "|---|" + "---|" * len(docs)]
    for name, r in guide["options"].items():
        lines.append(f"| {name} | " + " | ".join(f"{x:.3f}" for x in r["k"]["512"]["coverage"]["per_doc"]) + " |")
    if values:
        lines += ["", "## Value guide options", "",
                  "Relative error of the attention output from the values read from the guide: the exact top-512 "
                  "fetched (oracle set), sinks and residual exact, the rest of the guide region from the value guide; "
                  "|| sum p_i (v_hat_i - v_i) || / || sum p_i v_i || per query head and position (keys exact, so "
                  "this isolates the values). Rotations are applied per token before quantizing and undone on the "
                  "output (free: fold R^T into the guide part's output, or into o_proj for the whole output).", "",
                  "| value option | bits / element | relative output error | per document |", "|---|---|---|---|"]
        for name, r in values.items():
            lines.append(f"| {name} | {r['value_bits_per_element']:.2f} | {r['relative_output_error']:.4f} | "
                         + " / ".join(f"{x:.4f}" for x in r["per_doc"]) + " |")
    if spec:
        lines += ["", "## Speculative selection (`--prefetch speculative`)", "",
                  "Queries of the engine's own speculative run (2-bit, k 512, re-sync on, teacher-forced): the output "
                  "token T_t (position p-1) and the speculative token T'_{t+1} (p); target: the next output token's "
                  "own exact attention at p. Speculation hit rate per document: " +
                  ", ".join(f"{k} {v['speculation_hit_rate']:.3f} ({v['passes']} passes)" for k, v in spec["docs"].items()), ""]
        for name in spec["options"]:
            for k in spec["k"]:
                r = spec["rules"][name][str(k)]
                orc = r["oracle"]["coverage"]["all"]["mean"]
                lines += [f"{name}, k{k} (oracle coverage {orc:.3f}):", "",
                          "| rule | recall | coverage | coverage / oracle | coverage, guess right / wrong |",
                          "|---|---|---|---|---|"]
                for rule in RULES:
                    c, rc = r[rule]["coverage"], r[rule]["recall"]["all"]["mean"]
                    lines.append(f"| {rule} | {rc:.3f} | {c['all']['mean']:.3f} | {c['all']['mean'] / orc:.3f} | "
                                 f"{c['hit']['mean']:.3f} / {c['miss']['mean']:.3f} |")
                lines.append("")
    if seq:
        lines += ["## Speculative selection, step by step as the engine runs it", "",
                  "As above, but each pass's two queries see exact scores at the set chosen by the previous pass "
                  "(the engine's feedback), so each rule is simulated over the whole run. `own top-k prefetched`: "
                  "share of the set that `--prefetch current` would pick at that step (the token's own query through "
                  "the guide) that the rule had already fetched.", "",
                  "| guide | k | rule | coverage | recall | own top-k prefetched |", "|---|---|---|---|---|---|"]
        for name in seq["options"]:
            for k in seq["k"]:
                r = seq["coverage"][name][str(k)]
                lines.append(f"| {name} | {k} | oracle | {r['oracle']['mean']:.3f} | 1.000 | - |")
                lines.append(f"| {name} | {k} | own (current) | {r['own']['mean']:.3f} | - | 1.000 |")
                for rule in SEQ_RULES:
                    lines.append(f"| {name} | {k} | {rule} | {r[rule]['mean']:.3f} | {r[rule + '.recall']['mean']:.3f} | "
                                 f"{r[rule + '.own_in_prefetch']['mean']:.3f} |")
        lines.append("")
    for _, e2e in sorted(e2e_by_k.items(), reverse=True):
        notes = {o.name: o.note for o in options() + e2e_options() if o.note}
        lines += ["## End to end (torch reimplementation, `--prefetch current`, k %d)" % e2e["k"], "",
                  "Teacher-forced over the full cache's greedy summary; rows of one batch share one prefill "
                  "(engine `full` cache, exact prefill), each row's decode attention reimplements "
                  "engine/kvcache/guided.py's current prefetch with its own guide (`exact`: the same code with "
                  "no guide, a check: KL 0). Top-1 agreement / mean KL(full || row) per document.", ""] + \
                 [f"- `{n}`: {notes[n]}" for n in e2e["mean"] if n in notes] + ["",
                  "| option | guide bytes vs 1b | device vs 1b k512 (fp16, 6.5k) | top-1 | mean KL | " +
                  " | ".join(e2e["docs"]) + " |", "|---|---|---|---|---|" + "---|" * len(e2e["docs"])]
        for name, v in e2e["mean"].items():
            per = [f"{d[name]['top1_agreement']:.3f} / {d[name]['mean_kl']:.4f}" for d in e2e["docs"].values()]
            o = opts.get(name)
            gb = f"{o.bytes_per_token(64) / base1.bytes_per_token(64):.3f}" if o else "-"
            dv = f"{device_bytes(o, 6549, e2e['k'], 2) / device_bytes(base1, 6549, 512, 2):.3f}" if o else "-"
            lines.append(f"| {name} | {gb} | {dv} | {v['top1_agreement']:.3f} | {v['mean_kl']:.4f} | " + " | ".join(per) + " |")
        lines.append("")
    Path(args.md).write_text("\n".join(lines) + "\n")
    Path(args.json).write_text(json.dumps({"guide": guide, "values": values, "spec": spec, "spec_seq": seq,
                                           "e2e": {str(k): v for k, v in e2e_by_k.items()}}, indent=1))
    log(f"wrote {args.md}, {args.json}")


# ============================================================================ main

def main() -> None:
    torch.set_num_threads(1)
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("capture")
    c.add_argument("--docs", nargs="+", default=list(DOCS))
    c.add_argument("--tokens", type=int, default=128)
    c.add_argument("--context", type=int, default=None)
    c.add_argument("--force", action="store_true")
    c.add_argument("--model", default=None, help="default: the embedded model")
    c.add_argument("--captures", default=None)
    g = sub.add_parser("guide")
    g.add_argument("--docs", nargs="*", default=None, help="capture stems")
    g.add_argument("--captures", default=None)
    g.add_argument("--layers", nargs="*", type=int, default=None)
    g.add_argument("--options", nargs="*", default=None, help="names or name prefixes")
    g.add_argument("--k", nargs="+", type=int, default=[128, 256, 512])
    g.add_argument("--stride", type=int, default=1, help="every n-th forced position")
    g.add_argument("--out", default="/tmp/guide-study-guide.json")
    sp = sub.add_parser("spec")
    sp.add_argument("--docs", nargs="*", default=None)
    sp.add_argument("--captures", default=None)
    sp.add_argument("--layers", nargs="*", type=int, default=None)
    sp.add_argument("--options", nargs="+", default=["base-2b", "base-1b"])
    sp.add_argument("--k", nargs="+", type=int, default=[256, 512])
    sp.add_argument("--out", default="/tmp/guide-study-spec.json")
    e = sub.add_parser("e2e")
    e.add_argument("--docs", nargs="*", default=None)
    e.add_argument("--captures", default=None)
    e.add_argument("--options", nargs="+", default=["base-2b", "base-1b"])
    e.add_argument("--k", type=int, default=512)
    e.add_argument("--tokens", type=int, default=128)
    e.add_argument("--out", default="/tmp/guide-study-e2e.json")
    rp = sub.add_parser("report")
    rp.add_argument("--guide", nargs="+", default=["/tmp/guide-all.json", "/tmp/guide-combo.json"])
    rp.add_argument("--spec-seq", default="/tmp/spec-seq.json")
    rp.add_argument("--spec", default="/tmp/spec-all.json")
    rp.add_argument("--e2e", nargs="*", default=["/tmp/e2e-round1.json", "/tmp/e2e-round2.json",
                                                 "/tmp/e2e-round3.json", "/tmp/e2e-round4.json", "/tmp/e2e-k128.json"])
    rp.add_argument("--values", default="/tmp/guide-study-values.json")
    rp.add_argument("--preface", default=None, help="markdown put after the title (findings)")
    rp.add_argument("--md", default="bench-results/guide-study.md")
    rp.add_argument("--json", default="bench-results/guide-study.json")
    rp.add_argument("--captures", default=None)
    sq = sub.add_parser("spec-seq")
    sq.add_argument("--docs", nargs="*", default=None)
    sq.add_argument("--captures", default=None)
    sq.add_argument("--layers", nargs="*", type=int, default=None)
    sq.add_argument("--options", nargs="+", default=["base-2b", "base-1b"])
    sq.add_argument("--k", nargs="+", type=int, default=[512])
    sq.add_argument("--out", default="/tmp/guide-study-spec-seq.json")
    vs = sub.add_parser("values")
    vs.add_argument("--docs", nargs="*", default=None)
    vs.add_argument("--captures", default=None)
    vs.add_argument("--layers", nargs="*", type=int, default=None)
    vs.add_argument("--k", type=int, default=512)
    vs.add_argument("--stride", type=int, default=2)
    vs.add_argument("--out", default="/tmp/guide-study-values.json")
    args = ap.parse_args()
    global CAPTURES
    if args.captures:
        CAPTURES = Path(args.captures)
    {"capture": capture, "guide": guide_study, "spec": spec_study, "values": value_study, "spec-seq": spec_seq_study, "e2e": e2e_study, "report": report}[args.cmd](args)


if __name__ == "__main__":
    main()
