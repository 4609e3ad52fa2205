"""Decode passes recorded once and replayed (engine/generate/graphs.py; CUDA graphs on a GPU). On the CPU:
the fixed-shape pass (Step.fixed: positions from device tensors, attention over the whole preallocated
length under a mask) gives full's tokens, and the replay protocol (one recording per batch size, static
ids, the cache's bookkeeping around each replay, the logits copied out) gives the same tokens as eager
decoding, rows leaving the batch included, with an eager stand-in for the recorder."""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import engine.generate.graphs as graphs
import engine.generate.steps as steps
from engine.config import CacheConfig, GenerationConfig
from engine.generate.engine import Engine, Finished
from engine.kvcache import make_cache
from tests.conftest import cuda_layout


def generate(model, prompts, config, max_tokens=12):
    return next(e for e in Engine(model, config).generate(prompts, GenerationConfig(max_tokens=max_tokens))
                if isinstance(e, Finished))


def prompts(lengths, seed=2):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]


def test_a_fixed_shape_pass_gives_the_pass_it_replaces(tiny_model):
    """One decode pass of rows at different lengths, fixed-shape (every position of the buffer, masked past
    each row's own) against the usual one: the same logits and K/V written at the same positions, to the
    rounding of a softmax over more (masked) columns."""
    config = CacheConfig(mode="full", chunk_size=64)
    out = []
    for fixed in (False, True):
        cache = make_cache(tiny_model.config, config, 2, 300, torch.float32, tiny_model.device)
        for row, p in enumerate(prompts((90, 141))):
            list(steps.prefill(tiny_model, cache, p, row, 64))
        ids = torch.tensor([[5], [7]], device=tiny_model.device)
        logits = steps.forward(tiny_model, cache, ids, slice(0, 2), how=steps.PassOptions(fixed=fixed))
        out.append((logits, cache.layers[0].k.clone(), cache.layers[2].k.clone(), cache.lengths_host.copy()))
    torch.testing.assert_close(out[0][0], out[1][0], rtol=1e-5, atol=1e-5)
    assert torch.equal(out[0][1], out[1][1])  # written at the same positions (layer 0: the same floats)
    torch.testing.assert_close(out[0][2], out[1][2], rtol=1e-5, atol=1e-5)  # (a longer masked sum rounds apart)
    assert out[0][3] == out[1][3] == [91, 142]


GUIDED = {"specache": CacheConfig(mode="specache", k=16, group=32, residual=16, sinks=4, chunk_size=64,
                                  prefetch="current"),
          "speculative": CacheConfig(mode="specache", k=16, group=32, residual=16, sinks=4, chunk_size=64,
                                     prefetch="speculative"),
          "kivi": CacheConfig(mode="kivi", group=32, residual=16, sinks=4, chunk_size=64),
          "window": CacheConfig(mode="window", group=32, residual=16, sinks=4, chunk_size=64)}


@pytest.mark.parametrize("mode", ["full", *GUIDED])
def test_replayed_decode_gives_the_eager_tokens(tiny_model, monkeypatch, mode):
    """plain_steps through DecodeGraphs (recorder stand-in: the pass run again) for a batch whose rows stop
    at different steps: each batch size recorded once, the tokens those of eager decoding (guided caches
    in the CUDA layout; their boundaries move during the run)."""
    config = GUIDED.get(mode, CacheConfig(mode="full", chunk_size=64))
    if mode != "full":
        cuda_layout(monkeypatch)
    ps = prompts((60, 133, 97))
    eager = generate(tiny_model, ps, config, max_tokens=24)
    recorded = []

    def record(run):
        recorded.append(1)
        return graphs.eager_graph(run)

    monkeypatch.setattr(steps, "graphs_wanted", lambda cache: cache.capturable)
    monkeypatch.setattr(steps, "DecodeGraphs", functools.partial(graphs.DecodeGraphs, record=record))
    replayed = generate(tiny_model, ps, config, max_tokens=24)
    assert replayed.tokens == eager.tokens
    assert len(recorded) >= 1
    assert len(recorded) == len({len([t for t in eager.tokens if len(t) > i]) for i in range(1, 24)})


def test_only_caches_whose_layers_all_decode_fixed_passes_are_replayed(tiny_model, monkeypatch):
    """Replayable: full; the guided caches in the CUDA layout without a hit count, watched ones until their
    watch fires (exact mode verifies from the store: not)."""
    from engine.kvcache.policies.specache import SpecacheLayer

    cpu = torch.device("cpu")

    def capturable(config):
        return make_cache(tiny_model.config, config, 1, 256, torch.float32, cpu).capturable

    assert capturable(CacheConfig(mode="full"))
    # the CPU layout of a compute-dtype store: the residual window is the store's positions (a 16-bit store's
    # window has buffers of its own, as on CUDA)
    assert not capturable(dataclasses.replace(GUIDED["specache"], store_dtype="fp32"))
    cuda_layout(monkeypatch)
    assert all(capturable(c) for c in GUIDED.values())
    assert capturable(CacheConfig(mode="specache", prefetch="speculative"))  # its corrected set at fixed size
    assert not capturable(CacheConfig(mode="specache", prefetch="current", measure_hits=True))
    assert not capturable(CacheConfig(mode="exact"))
    monkeypatch.setattr(SpecacheLayer, "watches", True)
    watched = make_cache(tiny_model.config, GUIDED["specache"], 1, 256, torch.float32, cpu)
    assert watched.watch is not None and watched.capturable  # its check runs after each replay
    watched.watch.lost = True
    assert not watched.capturable  # a fired watch attends exactly, eagerly
    monkeypatch.setenv("SPECACHE_CUDA_GRAPHS", "1")
    assert not graphs.graphs_wanted(make_cache(tiny_model.config, CacheConfig(mode="full"), 1, 64, torch.float32,
                                               cpu))  # (CUDA only)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_decode_gives_the_eager_tokens(monkeypatch):
    from tests.conftest import make_tiny_model

    model = make_tiny_model().cuda()
    ps = prompts((60, 133, 97))
    config = CacheConfig(mode="full", chunk_size=64)
    eager = generate(model, ps, config, max_tokens=14)
    monkeypatch.setenv("SPECACHE_CUDA_GRAPHS", "1")
    assert generate(model, ps, config, max_tokens=14).tokens == eager.tokens


def test_fixed_passes_at_different_lengths_are_the_same_program(tiny_model, monkeypatch):
    """What a recording holds is the ops, their shapes and the Python numbers they were given: two
    fixed-shape passes at different lengths issue the same ops on tensors of the same shapes with the same
    numbers (the usual pass does not: its attention grows, its writes slice at each row's position); one
    row alone too (its writes would otherwise slice at its position)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Shapes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            outs = out if isinstance(out, (tuple, list)) else (out,)
            self.seen.append((func.overloadpacket.__name__,
                              tuple(tuple(o.shape) for o in outs if isinstance(o, torch.Tensor)),
                              tuple(a for a in args if isinstance(a, int))))  # (a position baked in as an int)
            return out

    def passes(fixed, lengths, config=CacheConfig(mode="full", chunk_size=64), t=1, **kw):
        cache = make_cache(tiny_model.config, config, len(lengths), 300, torch.float32, tiny_model.device)
        for row, p in enumerate(prompts(lengths)):
            list(steps.prefill(tiny_model, cache, p, row, 64))
        seen = []
        for _ in range(2):
            with Shapes() as rec:
                steps.forward(tiny_model, cache, torch.full((len(lengths), t), 5), slice(0, len(lengths)),
                              how=steps.PassOptions(fixed=fixed, **kw))
            seen.append(rec.seen)
        return seen

    for lengths in ((90, 141), (77,)):
        fixed = passes(True, lengths)
        assert fixed[0] == fixed[1]
        usual = passes(False, lengths)
        assert usual[0] != usual[1]
    cuda_layout(monkeypatch)
    for config in GUIDED.values():  # (lengths where no boundary moves in the two passes)
        fixed = passes(True, (90, 141), config)
        assert fixed[0] == fixed[1], config.mode
        assert passes(False, (90, 141), config)[0] != passes(False, (90, 141), config)[1]
    spec = dict(config=GUIDED["speculative"], t=2, keep=1, select=1, logits_to_keep=2)  # its two-token passes
    fixed = passes(True, (90, 141), **spec)
    assert fixed[0] == fixed[1]
    assert "_local_scalar_dense" not in [op for op, *_ in fixed[0]]  # no device value read on the host (.item())
    assert passes(False, (90, 141), **spec)[0] != passes(False, (90, 141), **spec)[1]


def replaying(monkeypatch):
    """steps' decode loop through DecodeGraphs with the eager stand-in recorder, as on CUDA."""
    monkeypatch.setattr(steps, "graphs_wanted", lambda cache: cache.capturable)
    monkeypatch.setattr(steps, "DecodeGraphs", functools.partial(graphs.DecodeGraphs, record=graphs.eager_graph))


def test_a_watched_cache_replays_with_its_guide_checks_after_each_pass(tiny_model, monkeypatch):
    """The default specache (watched) in the CUDA layout, replayed: the same tokens as eager decoding and
    the same guide checks (the replay keeps each pass's queries; the checks run after it, in the order an
    eager pass runs them), two rows taking turns."""
    from engine.kvcache.policies.specache import SpecacheLayer

    cuda_layout(monkeypatch)
    monkeypatch.setattr(SpecacheLayer, "watches", True)
    ps = prompts((160, 233))
    eager = generate(tiny_model, ps, GUIDED["specache"], max_tokens=20)
    replaying(monkeypatch)
    replayed = generate(tiny_model, ps, GUIDED["specache"], max_tokens=20)
    assert replayed.tokens == eager.tokens
    a, b = eager.cache_stats["guide_check"], replayed.cache_stats["guide_check"]
    assert a["checks"] == b["checks"] >= 4 and not b["lost"]
    assert b["coverage_vs_oracle"] == pytest.approx(a["coverage_vs_oracle"], abs=1e-4)



def test_graphs_are_recorded_where_the_cache_streams_record_them(tiny_model, monkeypatch):
    """SPECACHE_CUDA_GRAPHS=1 replays where the cache's streams record graphs (CUDA's, or their stand-in: not the
    CPU's), and a recording is warmed up on a side stream first, then captured (record_graph): with the
    stand-in the warm-up runs when the compute stream waits for it, before the capture."""
    import engine.kvcache
    from engine.backends.streams import StandinStreams
    from engine.kvcache.transfer import Transfer

    streams = StandinStreams(wait_seconds=5.0)
    monkeypatch.setattr(engine.kvcache, "Transfer", lambda device: Transfer(device, streams=streams))
    monkeypatch.setenv("SPECACHE_CUDA_GRAPHS", "1")
    cache = make_cache(tiny_model.config, CacheConfig(mode="full"), 1, 64, torch.float32, torch.device("cpu"))
    assert graphs.graphs_wanted(cache)
    seen = []

    def run() -> torch.Tensor:
        seen.append((streams.current_stream().name, streams.capturing))
        return torch.ones(2)

    graph, out = graphs.record_graph(streams, run)
    assert seen == [("side1", 0), ("compute", 1)] and out.tolist() == [1, 1] and streams.graphs == 1
    graph.replay()
    assert seen[-1] == ("compute", 1) and graph.replays == 1
    decode = graphs.DecodeGraphs(tiny_model, cache, steps.forward)
    assert decode.record.func is graphs.record_graph and decode.record.args == (streams,)
