"""The fused Triton decode (engine/backends/triton_decode.py) run by Triton's interpreter on the CPU against the
torch code it replaces: SpecacheLayer.attend_decode (its recorded-pass path: region scores, the fetched set's
exact scores, the causal residual window, one softmax, mixed values, the next fetched set from the selecting
token) on a layer assembled from a real Guide and exact buffers. Two rows of different lengths (one whose
group leaves the residual window, so residual positions are candidates); 1- and 2-bit guides, outlier channels
on and off, a rotation, a softcap, 1 to 8 queries per KV head, one or two new tokens.

Tolerances: the guide's dots take fp16 operands (the scaled queries split into two fp16 parts for the keys
(PRECISE), the values dequantized and the probabilities rounded to fp16), so outputs (of order 1 to 3) agree to
3e-3 absolute + 1e-3 relative; with one fp16 part (heads past triton_decode.PRECISE_HEAD) to 1.5e-2 + 1e-2 (the
same kernels with fp32 operands agree to 1e-5: the rest is fp16's rounding). The fetched set agrees up to
ties: the reference's weights of the positions picked are, sorted, its own top-k's to 2e-3."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from engine.kvcache.guide import Guide, GuideSpec
from engine.kvcache.passes import ModelShape
from engine.kvcache.policies.specache import SpecacheLayer

pytest.importorskip("triton")  # (tests/conftest.py has set TRITON_INTERPRET=1)
from engine.backends import triton_decode  # noqa: E402

B, H, D, CAP, GROUP, SINKS, K, W, RESIDUAL = 2, 2, 32, 256, 32, 4, 16, 64, 16
QEND, START = (192, 96), (230, 143)  # row 1's group leaves the window when the step commits


class Store:
    """The host store as attend_decode reads it in a recorded pass: the fetched rows, a prefetch that does
    nothing (the test reads the layer's new fidx / fvalid)."""

    def __init__(self, fk, fv):
        self.fk, self.fv = fk, fv

    def release_prefix(self):  # (no row's prefill copy held: HostStore.read_prefix)
        pass

    def fetched(self, rows):
        return self.fk[rows], self.fv[rows]

    def prefetch(self, rows, idx, fixed=False):
        pass


def exact_kv(gen, outlier_channels: bool):
    """Exact K, V [B, H, CAP + W, D]: keys with a few large channels where outliers are tested."""
    k = torch.randn(B, H, CAP + W, D, generator=gen) * 2
    if outlier_channels:
        k[..., [3, 17]] *= 8
    return k, torch.randn(B, H, CAP + W, D, generator=gen)


def fetched_set(gen):
    """A fetched set: K distinct positions in [SINKS, qend) per row and head, a few slots invalid."""
    idx = torch.zeros(B, H, K, dtype=torch.long)
    for b in range(B):
        for h in range(H):
            idx[b, h] = SINKS + torch.randperm(QEND[b] - SINKS, generator=gen)[:K]
    return idx, torch.rand(B, H, K, generator=gen) > 0.2


def build(bits: int, outliers: int, rotation: str, seed: int) -> tuple[SpecacheLayer, torch.Tensor]:
    """A SpecacheLayer's decode state without its constructor: a real Guide of each row's [0, qend), the sinks,
    a fetched set, the residual windows (slot j at position qend + j). -> (layer, exact keys)."""
    gen = torch.Generator().manual_seed(seed)
    k, v = exact_kv(gen, outliers > 0)
    guide = Guide(B, H, CAP, D, GuideSpec(bits, GROUP, rotation, outliers), torch.device("cpu"))
    for b in range(B):
        guide.add(b, 0, k[b : b + 1, :, : QEND[b]], v[b : b + 1, :, : QEND[b]])
    idx, valid = fetched_set(gen)
    gather = lambda t: torch.gather(t, 2, idx[..., None].expand(-1, -1, -1, D))  # noqa: E731
    layer = object.__new__(SpecacheLayer)
    layer.guide, layer.use_guide, layer.watch, layer.res_in_store = guide, True, None, False
    layer.sinks, layer.topk, layer.residual, layer.group = SINKS, K, RESIDUAL, GROUP
    layer.sink_k, layer.sink_v = k[:, :, :SINKS].clone(), v[:, :, :SINKS].clone()
    layer.res_k = torch.stack([k[b, :, QEND[b] : QEND[b] + W] for b in range(B)])
    layer.res_v = torch.stack([v[b, :, QEND[b] : QEND[b] + W] for b in range(B)])
    layer.fidx, layer.fvalid = idx, valid
    layer.store = Store(gather(k), gather(v))
    layer.qend = torch.tensor(QEND)
    layer.qend_host = list(QEND)
    return layer, k


def buffers(layer: SpecacheLayer) -> triton_decode.DecodeBuffers:
    g = layer.guide
    return triton_decode.DecodeBuffers(g.keys, g.values, g.outliers, g.rotation, layer.sink_k, layer.sink_v,
                                       layer.sinks, layer.store.fk, layer.store.fv, layer.fidx.clone(),
                                       layer.fvalid.clone(), layer.res_k, layer.res_v, layer.qend, RESIDUAL)


def reference(layer: SpecacheLayer, qg, step, scaling, softcap):
    """attend_decode's torch code (the recorded-pass path) -> (output [B, H, G*T, D], candidate weights,
    the next fetched set)."""
    seen = []
    plain = SpecacheLayer.fetch_top

    def keep(cand, bound, rows, now=False, fixed=False):
        seen.append(cand.masked_fill(_outside(cand, bound), -1.0))
        plain(layer, cand, bound, rows, now, fixed)

    layer.fetch_top = keep
    out = SpecacheLayer.attend_decode(layer, qg.reshape(B, -1, step.n_new, D), scaling, step, softcap)
    return out, seen[0], layer.fidx, layer.fvalid


def _outside(cand, bound):
    pos = torch.arange(cand.shape[-1])
    return ((pos[None, :] >= bound[:, None]) | (pos[None, :] < SINKS))[:, None, :]


def step_of(tokens: int, select: int | None):
    start = torch.tensor(START)
    return SimpleNamespace(fixed=True, rows=slice(0, B), n_new=tokens, select=select, start=start, keep=tokens,
                           starts=list(START), positions=lambda: start[:, None] + torch.arange(tokens))


CASES = [  # bits, outliers, rotation, queries per KV head, tokens, softcap, programs a pass aims at (8: splits of
    # several blocks, more positions than the k each split keeps; 256: a split a block), precise key dots
    (1, 0, "none", 1, 1, None, 8, True),
    (2, 0, "none", 4, 2, None, 256, True),
    (1, 4, "none", 3, 2, None, 8, True),
    (2, 2, "hadamard", 8, 2, None, 256, True),
    (1, 0, "hadamard", 2, 1, 30.0, 8, True),
    (2, 2, "none", 4, 2, None, 8, False),
]


def run_both(bits, outliers, rotation, group, tokens, softcap, select, select_both=False):
    """The same pass by the Triton kernels and by attend_decode -> (got, want, picked, cand, idx, valid)."""
    layer, _ = build(bits, outliers, rotation, seed=bits * 100 + group * 10 + tokens)
    layer.shape = ModelShape(1, H * group, H, D)
    layer.config = SimpleNamespace(prefetch="speculative", correct=False, measure_hits=False, select_both=select_both)
    gen = torch.Generator().manual_seed(7 + group)
    qg = torch.randn(B, H, group * tokens, D, generator=gen) * 1.5
    scaling = 1 / math.sqrt(D)
    step = step_of(tokens, select)
    got, picked = triton_decode.decode(buffers(layer), triton_decode.DecodePass(
        qg, step.start, tokens, scaling, max(QEND), softcap=softcap, select=select, select_both=select_both,
        keep=step.keep))
    want, cand, idx, valid = reference(layer, qg, step, scaling, softcap)
    got = got.reshape(B, H * group, tokens, D).transpose(1, 2)  # as ungroup_output lays it out
    return got, want, picked, cand, idx, valid


def assert_same_set(picked, cand, idx, valid):
    """The same number of positions, and the reference's weights of those picked equal to its own top-k's
    (sorted): the same set up to ties; row 0's within its guide region, row 1's reaching into the residual."""
    my_idx, my_valid = picked
    assert torch.equal(my_valid.sum(-1), valid.sum(-1))
    weight_of = lambda i, ok: torch.where(ok, cand.gather(-1, i), 0.0).sort(-1).values  # noqa: E731
    torch.testing.assert_close(weight_of(my_idx, my_valid), weight_of(idx, valid), atol=2e-3, rtol=0)
    assert (my_idx[my_valid] >= SINKS).all()
    assert not ((my_idx[0] >= QEND[0]) & my_valid[0]).any()
    assert ((my_idx[1] >= QEND[1]) & my_valid[1]).any()  # positions of the group leaving the window


@pytest.mark.parametrize("bits,outliers,rotation,group,tokens,softcap,programs,precise", CASES)
def test_fused_triton_decode_equals_the_torch_pass(bits, outliers, rotation, group, tokens, softcap, programs,
                                                   precise, monkeypatch):
    """Output and next fetched set of one pass (selected by the last new token), the interpreter's kernels
    against attend_decode's torch code."""
    monkeypatch.setattr(triton_decode, "PROGRAMS", programs)
    monkeypatch.setattr(triton_decode, "PRECISE_HEAD", 128 if precise else 0)
    assert triton_decode._geometry(buffers(build(1, 0, "none", 0)[0]), SimpleNamespace(
        q=torch.zeros(B, H, 1, D), nq=max(QEND)))["per"] == (96 if programs == 8 else 32)
    got, want, picked, cand, idx, valid = run_both(bits, outliers, rotation, group, tokens, softcap, tokens - 1)
    torch.testing.assert_close(got, want, atol=3e-3 if precise else 1.5e-2, rtol=1e-3 if precise else 1e-2)
    assert_same_set(picked, cand, idx, valid)


def test_selection_by_both_tokens_and_a_pass_that_selects_nothing(monkeypatch):
    """select_both sums both new tokens' probabilities; a pass without a selecting token returns no set (and
    the same output)."""
    monkeypatch.setattr(triton_decode, "PROGRAMS", 8)
    got, want, picked, cand, idx, valid = run_both(2, 2, "none", 4, 2, None, 0, select_both=True)
    torch.testing.assert_close(got, want, atol=3e-3, rtol=1e-3)
    assert_same_set(picked, cand, idx, valid)
    layer, _ = build(2, 2, "none", seed=5)
    qg = torch.randn(B, H, 8, D, generator=torch.Generator().manual_seed(1))
    out, none = triton_decode.decode(buffers(layer), triton_decode.DecodePass(qg, torch.tensor(START), 2, 0.2,
                                                                              max(QEND)))
    assert none is None and out.shape == (B, H, 8, D) and torch.isfinite(out).all()


def test_a_passes_new_keys_and_values_are_written_in_one_launch():
    """triton_decode.write_recent (GuidedLayer.update's writes in the CUDA layout): rows at different positions,
    keys and values strided as the model's projections give them, two new tokens; each into its residual slot
    (position - qend), and a row's tokens below the sinks into the sinks too; nothing else written."""
    gen = torch.Generator().manual_seed(3)
    start, qend, w, s = torch.tensor([2, 40, 77]), torch.tensor([0, 32, 64]), 16, 4
    kv = torch.randn(3, 2, H, D, 2, generator=gen)
    k, v = kv[..., 0].transpose(1, 2), kv[..., 1].transpose(1, 2)  # [3, H, 2, D], not contiguous
    got = [torch.zeros(3, H, n, D) for n in (w, w, s, s)]
    assert triton_decode.write_recent(k, v, start, qend, tuple(got), s)
    want = [torch.zeros(3, H, n, D) for n in (w, w, s, s)]
    for r in range(3):
        for j in range(2):
            pos = int(start[r]) + j
            want[0][r, :, pos - int(qend[r])], want[1][r, :, pos - int(qend[r])] = k[r, :, j], v[r, :, j]
            if pos < s:
                want[2][r, :, pos], want[3][r, :, pos] = k[r, :, j], v[r, :, j]
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert want[2][0, :, 2:].abs().sum() > 0 and want[2][1:].abs().sum() == 0


def drive(layer, steps: int, seed: int, monkeypatch, kernels: bool) -> list:
    """A prompt of 150 tokens into one row and 170 into the other (update, after_step), then `steps` speculative
    decode passes (two new tokens, the second selecting), each committing one -> their outputs and fetched sets;
    through the Triton kernels (kernels) or the torch code."""
    from engine.backends import kernels as table
    from engine.backends.triton_cuda import TritonCUDA, TritonDecode
    from engine.kvcache.passes import Step

    # the CPU's backend: CUDA's (its kernels in the interpreter), or the torch reference (not the native call)
    monkeypatch.setitem(table._CHOSEN, "cpu", TritonCUDA() if kernels else table.REFERENCE)
    calls, call = [], TritonDecode.__call__
    monkeypatch.setattr(TritonDecode, "__call__", lambda *a: calls.append(1) or call(*a))
    gen = torch.Generator().manual_seed(seed)
    lengths = [150, 170]
    for row, n in enumerate(lengths):
        kv = torch.randn(2, 1, H, n, D, generator=gen)
        layer.update(kv[0], kv[1], Step(slice(row, row + 1), torch.tensor([0]), n, n, prefill=True))
    layer.after_step(Step(slice(0, B), torch.tensor(lengths), 1, 1), layer.boundaries(lengths))
    seen = []
    for _ in range(steps):
        step = Step(slice(0, B), torch.tensor(lengths), 2, 1, select=1)
        kv = torch.randn(2, B, H, 2, D, generator=gen)
        layer.update(kv[0], kv[1], step)
        out = layer.attend(torch.randn(B, 2 * H, 2, D, generator=gen), 1 / math.sqrt(D), step)
        lengths = [n + 1 for n in lengths]
        layer.after_step(step, layer.boundaries(lengths))
        seen.append((out, layer.fidx.clone(), layer.fvalid.clone()))
    assert len(calls) == (steps if kernels else 0)
    return seen


def test_a_layer_decodes_through_the_kernels_as_through_torch(monkeypatch):
    """SpecacheLayer.attend_decode with the kernels wired in (the CUDA backend chosen for the CPU: its layout, the
    interpreter running them) against the same layer's torch code: equal outputs each step and nearly the same
    fetched sets, over passes where groups leave the window and the set feeds the next pass."""
    from engine.config import CacheConfig
    from engine.kvcache.transfer import Transfer

    monkeypatch.setenv("SPECACHE_TRITON_DECODE", "1")
    config = CacheConfig(mode="specache", bits=2, group=32, k=16, residual=16, sinks=4, chunk_size=192,
                         correct=False, rotation="hadamard", outliers=2)
    shape = ModelShape(1, 2 * H, H, D)
    layers = [SpecacheLayer(shape, config, B, 512, torch.float32, torch.device("cpu"),
                            Transfer(torch.device("cpu"), residual_in_store=False)) for _ in range(2)]
    got = drive(layers[0], 3, 11, monkeypatch, kernels=True)
    want = drive(layers[1], 3, 11, monkeypatch, kernels=False)
    for (o1, i1, v1), (o2, i2, v2) in zip(got, want):
        torch.testing.assert_close(o1, o2, atol=3e-3, rtol=1e-3)
        same = sum(len(set(i1[r, h][v1[r, h]].tolist()) & set(i2[r, h][v2[r, h]].tolist()))
                   for r in range(B) for h in range(H))
        assert torch.equal(v1.sum(-1), v2.sum(-1)) and v2.sum() > 0 and same >= 0.9 * int(v2.sum())


def mode_layer(mode: str, residual_in_store: bool = False, **settings):
    """A layer of policy `mode` on the CPU (the CUDA layout: residual buffers of its own, unless residual_in_store)."""
    from engine.config import CacheConfig
    from engine.kvcache import registry
    from engine.kvcache.transfer import Transfer

    registry.discover()
    config = CacheConfig(**{"mode": mode, "bits": 2, "group": 32, "k": 16, "residual": 16, "sinks": 4,
                            "chunk_size": 192, "correct": False, **settings})
    return registry.policy(mode)(ModelShape(1, 2 * H, H, D), config, B, 512, torch.float32, torch.device("cpu"),
                                 Transfer(torch.device("cpu"), residual_in_store=residual_in_store))


# (policy, settings, residual window in the store, $SPECACHE_TRITON_DECODE) -> whether the fused kernels take the
# layer's decode passes: only the CUDA layout, the speculative prefetch without the corrected set (or nothing
# fetched: kivi), no hit measurement, a guide (window mode has none), and only when asked for
MODES = [
    ("specache", {}, False, "1", True),
    ("kivi", {"correct": True}, False, "1", True),  # nothing fetched: no set to correct
    ("specache", {"correct": True}, False, "1", False),
    ("specache", {"prefetch": "current"}, False, "1", False),
    ("specache", {"measure_hits": True}, False, "1", False),
    ("specache", {"store_dtype": "fp32"}, True, "1", False),  # the CPU layout: the window is the store's positions
    ("specache", {}, False, None, False),
    ("window", {}, False, "1", False),
]


@pytest.mark.parametrize("mode, settings, in_store, env, takes", MODES)
def test_the_fused_triton_decode_takes_only_the_modes_it_implements(mode, settings, in_store, env, takes,
                                                                    monkeypatch):
    """The CUDA backend chosen from the table for the device its layer is on (here the CPU, standing in),
    engine.kvcache.fused.fused_applies says the Triton call runs a decode pass only in the modes the kernels
    compute; every other mode runs the torch pass."""
    from engine.backends import kernels as table
    from engine.backends.triton_cuda import TritonCUDA
    from engine.kvcache.fused import fused_applies
    from engine.kvcache.passes import Step

    monkeypatch.setitem(table._CHOSEN, "cpu", TritonCUDA())
    if env is None:
        monkeypatch.delenv("SPECACHE_TRITON_DECODE", raising=False)
    else:
        monkeypatch.setenv("SPECACHE_TRITON_DECODE", env)
    layer = mode_layer(mode, in_store, **settings)
    assert layer.res_in_store is in_store
    step = Step(slice(0, B), torch.tensor([150, 170]), 2, 1, select=1)
    assert fused_applies(layer, torch.zeros(B, 2 * H, 2, D), step) is takes


def test_kivi_decodes_through_the_kernels_as_through_torch(monkeypatch):
    """kivi (k = 0: nothing fetched, the guide, sinks and window only) through the fused kernels equals its
    torch pass each step, the fetched set left empty."""
    monkeypatch.setenv("SPECACHE_TRITON_DECODE", "1")
    got = drive(mode_layer("kivi"), 3, 12, monkeypatch, kernels=True)
    want = drive(mode_layer("kivi"), 3, 12, monkeypatch, kernels=False)
    for (o1, _, v1), (o2, _, v2) in zip(got, want):
        torch.testing.assert_close(o1, o2, atol=3e-3, rtol=1e-3)
        assert not v1.any() and not v2.any()
