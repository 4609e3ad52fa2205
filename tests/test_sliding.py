"""The model's sliding-window layers keep only their window (engine/kvcache/sliding.py), and the
planner counts them so: `specache plan` and a built cache agree, layer type by layer type."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import Gemma3TextConfig, MistralConfig
from typer.testing import CliRunner

from engine import native
from engine.backends import kernels
from engine.config import CacheConfig
from engine.generate.steps import prefill
from engine.kvcache import layer_classes, make_cache, sliding
from engine.kvcache.base import ModelShape, Step, grouped_query, masked_attention, ungroup_output
from engine.kvcache.sizes import layer_kv_bytes_per_token, sliding_slots
from engine.kvcache.policies.specache import SpecacheLayer
from engine.kvcache.sliding import SlidingWindowLayer, sliding_kernel
from engine.kvcache.transfer import Transfer
from engine.model.loading import prepare_model
from engine.plan import planner as P
from engine.plan.profiles import load_hardware, load_model_profile, model_profile_from_config
from specache_cli.app import app
from tests.tiny_archs import WINDOW, tiny_config, tiny_model

CONTEXT = 32768
# the two profiles' transformers configs (the shapes that size a cache; a small vocabulary)
CONFIGS = {
    "gemma-3-4b": Gemma3TextConfig(num_hidden_layers=34, hidden_size=2560, intermediate_size=10240,
                                   num_attention_heads=8, num_key_value_heads=4, head_dim=256, sliding_window=1024,
                                   vocab_size=1000),
    "mistral-7b-v0.1": MistralConfig(sliding_window=4096, vocab_size=1000),
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("mode", ["full", "kivi", "specache"])
def test_plan_at_32k_counts_window_layers_as_windows_and_equals_the_built_cache(name, mode):
    """Gemma-3-4B (29 of 34 layers with a 1024 window) and Mistral-7B-v0.1 (all 32 with 4096) at 32k
    tokens on an A6000: the planner's resident device bytes per sequence are what a cache of the
    same settings allocates (built on the meta device: shapes, no memory), and its host bytes what
    the cache's host store holds at 32k tokens; the window layers count W + chunk slots, not 32k."""
    m = load_model_profile(name)
    config = CONFIGS[name]
    derived = model_profile_from_config(config)
    assert (derived.sliding_window, derived.sliding_window_layers) == (m.sliding_window, m.sliding_window_layers)
    plan = P.plan(load_hardware("rtx-a6000"), m, CONTEXT)
    mp = plan.mode(mode)
    cache = make_cache(config, CacheConfig(mode=mode, bits=plan.bits, group=plan.group, k=plan.k), 1, CONTEXT,
                       torch.float16, torch.device("meta"))
    cache.lengths = torch.tensor([CONTEXT])
    parts = {n: b for n, b in mp.device_breakdown.items() if n not in ("decode_working_set", "prefill_activations")}
    per_layer = layer_kv_bytes_per_token(m, 2)
    windows = m.sliding_window_layers * sliding_slots(m.sliding_window, 512, CONTEXT) * per_layer
    assert parts["sliding_window_layers"] == windows
    assert sum(parts.values()) == cache.allocated_device_bytes()
    assert sum(isinstance(x, SlidingWindowLayer) for x in cache.layers) == m.sliding_window_layers
    globals_ = m.layers - m.sliding_window_layers
    if mode != "kivi":
        assert mp.host_bytes_per_sequence == cache.host_bytes() == \
            (CONTEXT * globals_ * per_layer if mode == "specache" else 0)
    held = cache.device_bytes()  # what the layers hold at 32k: each window layer its last W tokens
    window_held = sum(x.device_bytes(cache.lengths) for x in cache.layers if isinstance(x, SlidingWindowLayer))
    assert window_held == m.sliding_window_layers * m.sliding_window * per_layer and held >= window_held
    if mode == "full":
        assert parts["kv_cache"] == CONTEXT * globals_ * per_layer


def test_specache_plan_json_shows_the_window_layers():
    r = CliRunner().invoke(app, ["plan", "--gpu", "rtx-a6000", "--model", "gemma-3-4b", "--context", str(CONTEXT),
                                 "--json"], env={"COLUMNS": "120"})
    assert r.exit_code == 0, r.stderr
    obj = json.loads(r.stdout)
    spec = next(x for x in obj["modes"] if x["mode"] == "specache")
    assert spec["device_breakdown"]["sliding_window_layers"] == 29 * (1024 + 512) * 2 * 4 * 256 * 2
    assert spec["host_bytes_per_sequence"] == CONTEXT * 5 * 2 * 4 * 256 * 2  # only the 5 global layers


def test_a_window_layer_keeps_only_its_window_and_the_global_layers_their_policy():
    """Gemma 3 (five window layers of six): after a 300-token prefill a window layer holds W + chunk
    slots and its window; its export for the store is the last W positions, which import back."""
    model = prepare_model(tiny_model("gemma3"))
    config = CacheConfig(mode="specache", k=16, group=32, residual=16, chunk_size=64)
    cache = make_cache(tiny_config("gemma3"), config, 2, 400, torch.float32, torch.device("cpu"))
    ids = list(range(3, 303))
    list(prefill(model, cache, ids, 0, 64))
    kinds = [type(x) for x in cache.layers]
    assert kinds == [SlidingWindowLayer] * 5 + [SpecacheLayer]
    assert layer_classes(tiny_config("gemma3"), SpecacheLayer) == [(SlidingWindowLayer, WINDOW)] * 5 + [(SpecacheLayer, None)]
    assert cache.policy_layers == cache.layers[5:]  # the configured policy's layers describe the cache
    ring = cache.layers[0]
    assert ring.capacity == WINDOW + 64 and ring.k.shape[2] == WINDOW + 64
    assert ring.device_bytes(cache.lengths[:1]) == WINDOW * layer_kv_bytes_per_token(cache.shape, 4)
    assert sorted(ring.pos[0].tolist())[-WINDOW:] == list(range(300 - WINDOW, 300))
    state = cache.export_row(0)
    assert state["layers.0.k"].shape[1] == WINDOW and "layers.5.store_k" in state
    cache.import_row(1, state)
    for x in cache.layers[:5]:
        kept = x._kept(300)
        assert torch.equal(x.k[1, :, kept], x.k[0, :, kept]) and torch.equal(x.pos[1, kept], x.pos[0, kept])
    cache.close()


@pytest.mark.parametrize("mode", ["full", "specache"])
def test_the_device_fraction_counts_16_bit_on_both_sides_of_an_fp32_run(mode):
    """An fp32 run (the CPU) holds exact K/V at 4 bytes: its `device_vs_full_fp16` counts them as 16-bit,
    as a GPU would hold them, so a full cache of every token is 1.0 whatever the run's dtype, and a
    guided cache is its fp16 share, not twice it."""
    shape = tiny_config("llama")
    model = prepare_model(tiny_model("llama"))
    config = CacheConfig(mode=mode, k=16, group=32, residual=16, chunk_size=64)
    cache = make_cache(shape, config, 1, 400, torch.float32, torch.device("cpu"))
    list(prefill(model, cache, list(range(3, 303)), 0, 64))
    stats = cache.stats()
    assert stats["device_bytes"] > stats["device_fp16_bytes"]  # fp32 exact parts
    if mode == "full":
        assert stats["device_bytes"] == 2 * stats["device_fp16_bytes"] == 2 * stats["full_fp16_bytes"]
        assert stats["device_vs_full_fp16"] == 1.0
    else:
        exact_fp32 = stats["device_bytes"] - stats["device_fp16_bytes"]  # the exact parts' second half
        assert stats["device_vs_full_fp16"] == round(stats["device_fp16_bytes"] / stats["full_fp16_bytes"], 4)
        assert 0 < exact_fp32 < stats["device_fp16_bytes"] < stats["full_fp16_bytes"]


def filled_window_layer(lengths, window: int, heads: int = 6, kv_heads: int = 2, head_dim: int = 32, seed: int = 0):
    """A window layer of len(lengths) rows, row r holding lengths[r] tokens of random K/V written through
    its own update (prefill chunks of 16: the ring wraps for the longer rows)."""
    g = torch.Generator().manual_seed(seed)
    shape = ModelShape(1, heads, kv_heads, head_dim)
    config = CacheConfig(mode="full", chunk_size=16)
    layer = SlidingWindowLayer.build(shape, config, len(lengths), 400, torch.float32, torch.device("cpu"),
                                     Transfer(torch.device("cpu")), window=window)
    for r, n in enumerate(lengths):
        for p0 in range(0, n, 16):
            t = min(16, n - p0)
            step = Step(slice(r, r + 1), torch.tensor([p0]), t, t, prefill=True)
            layer.update(torch.randn(1, kv_heads, t, head_dim, generator=g), torch.randn(1, kv_heads, t, head_dim,
                                                                                          generator=g), step)
    return layer, g


@pytest.mark.kernels
@pytest.mark.skipif(sliding_kernel(torch.device("cpu")) != "native", reason="native kernels unavailable here")
@pytest.mark.parametrize("rows,new", [(slice(0, 3), 1), (slice(0, 3), 2), (slice(1, 3), 3)])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_the_native_sliding_kernel_equals_the_torch_reference(rows, new, softcap):
    """A decode pass's attention over the rings of rows of different lengths (one shorter than the window,
    two whose rings wrapped), 1-3 new tokens, with and without a softcap: the C kernel against attend_torch."""
    lengths = [30, 7, 61]
    layer, g = filled_window_layer(lengths, window=24)
    b = rows.stop - rows.start
    start = torch.tensor(lengths[rows])
    step = Step(rows, start, new, 1, select=0)
    layer.update(torch.randn(b, 2, new, 32, generator=g), torch.randn(b, 2, new, 32, generator=g), step)
    q = torch.randn(b, 6, new, 32, generator=g) * 2
    got = layer.attend(q, 0.3, step, softcap)
    want = layer.attend_torch(q, 0.3, step, softcap)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the window matters: the same queries over every written slot give another output
    wide = masked_attention(grouped_query(q, 2), layer.k[rows], layer.v[rows], None, 0.3, softcap)
    assert (ungroup_output(wide, 6, new) - want).abs().max() > 1e-2


@pytest.mark.parametrize("kernel", ["native", "torch"])
@pytest.mark.parametrize("window,chunks,head_dim", [(64, [100, 37, 100, 5, 64], 32), (96, [70, 70, 70], 64),
                                                    (200, [50, 120, 120, 120, 60], 32)])
def test_a_bf16_prefill_chunk_of_a_window_layer_takes_the_bf16_kernel_within_bf16_rounding(window, chunks, head_dim,
                                                                                          kernel, monkeypatch):
    """A bf16 prefill (what --dtype auto takes on a CPU with native bf16): the window layer's chunks go to the CPU's
    bf16 kernel (the native one, or torch's flash kernel on bf16, AMX's) over the ring's slots in position order
    (one or two pieces: the ring wraps), and land within bf16 rounding of the masked fp32 reference, for chunks
    longer than the window, a 5-token chunk, a window longer than the first chunks, and head sizes 32 / 64. A
    wrong window edge or slot is off by far more."""
    from engine.kvcache import passes

    lib = native.lib()
    if kernel == "native" and (lib is None or not lib.specache_prefill_attention_available()):
        pytest.skip("no native library with AVX512-BF16 on this machine")
    monkeypatch.setattr(passes, "bf16_prefill_kernel", lambda: kernel)
    g = torch.Generator().manual_seed(window)
    shape = ModelShape(1, 6, 2, head_dim)
    layer = SlidingWindowLayer.build(shape, CacheConfig(mode="full", chunk_size=max(chunks)), 1, 600, torch.float32,
                                     torch.device("cpu"), Transfer(torch.device("cpu")), window=window)
    at, took = 0, 0
    for t in chunks:
        step = Step(slice(0, 1), torch.tensor([at]), t, t, prefill=True, compute=torch.bfloat16)
        layer.update(torch.randn(1, 2, t, head_dim, generator=g), torch.randn(1, 2, t, head_dim, generator=g), step)
        q = torch.randn(1, 6, t, head_dim, generator=g) * 2
        took += layer.attend_prefill_bf16(q, 0.2, step) is not None
        got = layer.attend(q, 0.2, step)
        want = layer.attend_torch(q, 0.2, step)
        torch.testing.assert_close(got, want, rtol=0, atol=4e-2)
        assert (got - want).abs().mean() < 4e-3
        first = max(0, at - window + 1)
        if at + t - window > first:  # the window matters here: causal attention over the same slots is far off
            slots = torch.arange(first, at + t) % layer.capacity
            allowed = torch.arange(first, at + t)[None, :] <= at + torch.arange(t)[:, None]  # [t, n]
            mask = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf")).repeat(3, 1)[None, None]
            wide = masked_attention(grouped_query(q, 2), layer.k[:, :, slots], layer.v[:, :, slots], mask, 0.2)
            assert (ungroup_output(wide, 6, t) - want).abs().max() > 0.1
        at += t
    assert took == len(chunks)
    assert at > layer.capacity  # the ring wrapped


def test_the_sliding_kernel_is_chosen_per_device_from_the_table(monkeypatch):
    """The backends' table names the CPU's; a device it does not name, and a CPU without the library, take torch."""
    assert sliding.sliding_kernel(torch.device("meta")) == "torch"
    monkeypatch.setattr(native, "lib", lambda: None)
    assert sliding.sliding_kernel(torch.device("cpu")) == "torch"
    monkeypatch.setattr(native, "lib", lambda: object())
    assert sliding.sliding_kernel(torch.device("cpu")) == "native"
    monkeypatch.setattr(kernels, "backends", lambda: {})  # a table that names no backend for the CPU
    monkeypatch.setattr(kernels, "_CHOSEN", {})
    assert sliding.sliding_kernel(torch.device("cpu")) == "torch"
