"""CUDA's orchestration run on CPU tensors (engine.backends.streams.StandinStreams): the host store's prefetch
(the worker thread's path and the in-place gather from the pinned store), its settles and joins, the
verification stream and graph recording, each through the branches a CUDA device takes. A side stream's
work runs only when something waits for it, so a read that skips its event reads stale rows; every wait is
bounded, so a missed event or signal fails here within seconds instead of hanging a GPU."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from engine.backends.costs import HOST_READS
from engine.backends.streams import SYNC, StandinStreams, SyncStreams, streams_for
from engine.config import CacheConfig, GenerationConfig
from engine.errors import DoesNotFit
from engine.backends import triton_guide
from engine.kvcache.host_store import HostStore, overlap_share
from engine.kvcache.transfer import Transfer
from tests.conftest import cuda_layout

CPU = torch.device("cpu")
BOUND = 1.0  # seconds every stand-in wait may take in these tests before it fails


def standin_store(pinned: bool, batch=2, heads=3, length=50, dim=16, k=8, streams=None):
    """A HostStore under the stand-in, its rows [0, 40) written. -> (store, its K and V [batch, heads, 40, dim])."""
    streams = streams or StandinStreams(wait_seconds=BOUND)
    transfer = Transfer(CPU, streams=streams)
    store = HostStore(batch, heads, length, dim, k, torch.float32, CPU, transfer)
    if pinned:
        transfer.pin_host()
    gen = torch.Generator().manual_seed(batch * 10 + k)
    keys, values = torch.randn(batch, heads, 40, dim, generator=gen), torch.randn(batch, heads, 40, dim, generator=gen)
    for row in range(batch):
        store.write_span(row, 0, keys[row, :, :25], values[row, :, :25])
        store.write_span(row, 25, keys[row, :, 25:], values[row, :, 25:])
    return store, keys, values


def taken(src: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return torch.gather(src, 2, idx[..., None].expand(-1, -1, -1, src.shape[-1]))


@pytest.fixture
def kernel_gather(monkeypatch):
    """The Triton gather on CPU tensors (its interpreter); a failure stays in this test."""
    pytest.importorskip("triton")
    if not triton_guide.interpreted():
        pytest.skip("the gather kernel runs on CPU tensors only in Triton's interpreter (TRITON_INTERPRET=1)")
    monkeypatch.setattr(triton_guide, "FAILED", {})


# --- the stand-in itself -------------------------------------------------------------------------------------


def test_side_stream_work_runs_when_waited_for_and_events_follow_it():
    s = StandinStreams(wait_seconds=BOUND)
    side, done = s.stream(), []
    ready = s.event()
    assert s.launch(side, lambda: done.append(1)) is True and done == []  # queued, not run
    ready.record(side)
    s.launch(side, lambda: done.append(2))
    assert not ready.query() and s.launches == 2
    s.current_stream().wait_event(ready)  # the compute stream is synchronous: the host runs side up to ready
    assert done == [1] and ready.query()
    side.synchronize()
    assert done == [1, 2]
    now = s.event()
    now.record()  # on the compute stream: complete at once
    assert now.query() and s.launch(s.compute, lambda: 7) == 7


def test_a_side_stream_waits_on_another_and_runs_synchronously_inside_its_own_work():
    s = StandinStreams(wait_seconds=BOUND)
    a, b, log = s.stream(), s.stream(), []
    s.launch(a, lambda: log.append("a"))
    b.wait_stream(a)  # b's next work runs after a's
    s.launch(b, lambda: (log.append(s.current_stream().name), s.launch(b, lambda: log.append("nested"))))
    b.synchronize()
    assert log == ["a", b.name, "nested"]


def test_a_missed_event_or_a_held_stream_fails_within_the_bound():
    s = StandinStreams(wait_seconds=0.2)
    never = s.event()
    with pytest.raises(RuntimeError, match="never recorded"):
        s.current_stream().wait_event(never)
    with pytest.raises(RuntimeError, match="never recorded"):
        never.query()
    side = s.stream()
    ready = s.event()
    with s.hold(side):
        s.launch(side, lambda: None)
        ready.record(side)
        with pytest.raises(RuntimeError, match="held back"):
            ready.synchronize()
    ready.synchronize()  # released: runs
    flag = threading.Event()
    with pytest.raises(RuntimeError, match="the thing: no signal after 0.2 s"):
        s.wait_flag(flag, "the thing")


def test_a_held_stream_released_by_another_thread_completes_the_wait():
    s = StandinStreams(wait_seconds=30.0)
    side, done = s.stream(), []
    ready = s.event()
    with s.hold(side):
        s.launch(side, lambda: done.append(1))
        ready.record(side)
        timer = threading.Timer(0.05, s.release, [side])
        timer.start()
        s.current_stream().wait_event(ready)  # blocks until the timer releases it
        timer.join()
    assert done == [1]


def test_a_recording_refuses_host_syncs_and_work_left_on_another_stream():
    s = StandinStreams(wait_seconds=BOUND)
    side = s.stream()
    ev = s.event()
    ev.record(side)
    with pytest.raises(RuntimeError, match="inside a recorded pass"):
        s.capture(lambda: (ev.query(), torch.zeros(1))[1])
    with pytest.raises(RuntimeError, match="work left on stream"):
        s.capture(lambda: (s.launch(side, lambda: None), torch.zeros(1))[1])
    side.synchronize()
    out = torch.zeros(2)

    def joined() -> torch.Tensor:
        s.launch(side, lambda: out.add_(1))
        done = s.event()
        done.record(side)
        s.current_stream().wait_event(done)
        return out.clone()

    graph, first = s.capture(joined)
    assert first.tolist() == [1, 1]
    graph.replay()  # (into the recording's output tensor)
    assert graph.out is first and first.tolist() == [2, 2] and s.graphs == 1 and graph.replays == 1


def test_a_stream_waiting_on_its_own_later_work_is_a_deadlock():
    s = StandinStreams(wait_seconds=BOUND)
    side = s.stream()
    later = s.event()

    def inner() -> None:
        side.wait_event(later)  # (side runs this now: it would wait for work queued behind itself)

    s.launch(side, inner)
    s.launch(side, lambda: None)
    later.record(side)
    with pytest.raises(RuntimeError, match="own later work"):
        side.synchronize()


def test_the_cpu_has_no_streams_and_cuda_gets_its_own():
    assert streams_for(CPU) is SYNC and isinstance(SYNC, SyncStreams) and not SYNC.asynchronous
    with pytest.raises(RuntimeError, match="no streams"):
        SYNC.stream()
    assert SYNC.launch(None, lambda: 3) == 3 and SYNC.pinned_zeros((2,), torch.float16).dtype == torch.float16
    assert not Transfer(CPU).asynchronous and Transfer(CPU).stream is None
    meta = streams_for(torch.device("meta"))
    assert meta is SYNC  # (a meta device, for shapes: nothing queued)


# --- the host store's prefetch -------------------------------------------------------------------------------


def test_the_worker_threads_prefetch_lands_only_when_the_compute_stream_waits():
    """No pinned store: the worker thread gathers into staging and queues the copy on the side stream; the
    fetched set is not written until fetched() makes the compute stream wait for `ready`."""
    store, k, v = standin_store(pinned=False)
    transfer = store.transfer
    assert store.asynchronous and transfer.threaded and not transfer.pinned and store.stage_k.shape == store.fk.shape
    idx = torch.randint(0, 40, (2, 3, 8), generator=torch.Generator().manual_seed(1))
    store.prefetch(slice(0, 2), idx)
    store.wait_issued()
    assert store.pending and not store.fk.any()  # issued, queued on the side stream, not run
    fk, fv = store.fetched(slice(0, 2))
    assert torch.equal(fk, taken(k, idx)) and torch.equal(fv, taken(v, idx))
    assert store.waits == 1 and overlap_share([store]) == 0.0 and transfer._worker is not None
    idx2 = (idx + 3) % 40
    store.prefetch(slice(1, 2), idx2[1:])  # one row of two
    store.settle()  # a row copy's wait: the set is there for the compute stream
    assert torch.equal(store.fk[1], taken(k, idx2)[1]) and torch.equal(store.fk[0], taken(k, idx)[0])
    store.join()
    assert not store.pending
    transfer.close()
    assert transfer._worker is None


def test_a_held_side_stream_is_waited_for_not_read_stale():
    store, k, _ = standin_store(pinned=False)
    idx = torch.randint(0, 40, (2, 3, 8), generator=torch.Generator().manual_seed(2))
    with store.streams.hold(store.transfer.stream):
        store.prefetch(slice(0, 2), idx)
        with pytest.raises(RuntimeError, match="held back"):
            store.fetched(slice(0, 2))
    store.pending = True  # (the failed wait left it set: the set was never read)
    fk, _ = store.fetched(slice(0, 2))
    assert torch.equal(fk, taken(k, idx))
    store.transfer.close()


def test_the_in_place_prefetch_is_fetched_without_a_deadlock(kernel_gather):
    """The pinned store read in place by the gather kernel on the side stream (no worker thread), then the
    next prefetch and the fetch of the set: each returns (a prefetch marked pending but never issued would
    leave the next wait_issued waiting forever on a GPU; here it fails within the bound)."""
    store, k, v = standin_store(pinned=True)
    transfer, streams = store.transfer, store.streams
    assert transfer.pinned and len(streams.pinned) == 2  # K and V mappings
    idx = torch.randint(0, 40, (2, 3, 8), generator=torch.Generator().manual_seed(3))
    store.prefetch(slice(0, 2), idx)
    assert store.in_place == 1 and store.pending and not store.fk.any()  # queued on the side stream
    assert streams.recorded == [(idx.data_ptr(), transfer.stream.name)]  # idx kept alive for the side stream
    fk, fv = store.fetched(slice(0, 2))
    assert torch.equal(fk, taken(k, idx)) and torch.equal(fv, taken(v, idx))
    store.prefetch(slice(0, 2), (idx + 1) % 40)
    store.settle()
    assert torch.equal(store.fk, taken(k, (idx + 1) % 40))
    assert store.in_place == 2 and transfer._worker is None
    transfer.close()
    assert streams.pinned == {}


def test_a_fixed_pass_gathers_on_the_compute_stream_and_corrects_in_place(kernel_gather):
    """A recorded pass's fetches: gather_now on the compute stream; prefetch(fixed) joined back at the pass's
    end; the corrected set read through the kernel's masked gather from the pinned store."""
    store, k, v = standin_store(pinned=True)
    assert store.can_gather_now()
    gen = torch.Generator().manual_seed(4)
    idx = torch.randint(0, 40, (2, 3, 8), generator=gen)
    store.gather_now(slice(0, 2), idx)
    assert torch.equal(store.fk, taken(k, idx))
    nxt = torch.randint(0, 40, (2, 3, 8), generator=gen)
    store.prefetch(slice(0, 2), nxt, fixed=True)
    assert store.streams.recorded == []  # (a recorded pass's idx is the graph's own memory)
    store.join()
    assert not store.pending and torch.equal(store.fv, taken(v, nxt))
    want = torch.where(torch.rand(2, 3, 8, generator=gen) < 0.5, nxt, torch.randint(0, 40, (2, 3, 8), generator=gen))
    valid = torch.ones(2, 3, 8, dtype=torch.bool)
    reused = store.correct(slice(0, 2), want, nxt, valid, 40, fixed=True)
    assert torch.equal(store.fk, taken(k, want)) and torch.equal(store.fv, taken(v, want))
    assert torch.equal(reused, (want[..., :, None] == nxt[..., None, :]).any(-1))
    store.transfer.close()


def test_a_fixed_prefetch_without_the_kernel_refuses():
    """Without the gather kernel a recorded pass cannot fetch: said, not hung."""
    store, _, _ = standin_store(pinned=False)
    assert not store.can_gather_now()
    with pytest.raises(RuntimeError, match="cannot be fixed-shape"):
        store.prefetch(slice(0, 2), torch.zeros(2, 3, 8, dtype=torch.long), fixed=True)


def test_a_gather_kernel_that_does_not_run_stops_a_fixed_pass(kernel_gather, monkeypatch):
    """gather_now in a recorded pass when the kernel refuses (a launch error): said, never a silent stale set."""
    store, _, _ = standin_store(pinned=True)
    monkeypatch.setattr(triton_guide, "gather_rows", lambda *args, **kwargs: False)
    with pytest.raises(RuntimeError, match="in-place gather did not run"):
        store.gather_now(slice(0, 2), torch.zeros(2, 3, 8, dtype=torch.long))
    store.transfer.close()


def test_a_store_dropped_while_pinned_is_unpinned_before_its_memory_goes():
    import gc

    streams = StandinStreams(wait_seconds=BOUND)
    standin_store(pinned=True, streams=streams)
    gc.collect()  # (the store and its Transfer are gone, never closed: each mapping unpins itself)
    assert streams.pinned == {}


def test_reads_and_host_waits_go_through_the_streams():
    store, k, _ = standin_store(pinned=False)
    rk, _ = store.read(1, 10, 20)
    assert torch.equal(rk, k[1:2, :, 10:20])
    store.transfer.host_ready()
    assert store.host_bytes(40) == 2 * 40 * 3 * 16 * 4


def test_pinning_more_than_may_be_pinned_is_refused_before_anything_is_pinned():
    streams = StandinStreams(wait_seconds=BOUND)
    transfer = Transfer(CPU, streams=streams)
    transfer.host_tensor((2, 4, 1024, 64), torch.float16)
    with pytest.raises(DoesNotFit, match=r"needs 0\.0 GiB of pinned RAM and 0\.0 GiB can be pinned"):
        transfer.pin_host(available=1024)
    assert streams.pinned == {} and not transfer.pinned
    streams.pin(transfer._mappings[0].address, 1)  # (pinned elsewhere: the device refuses it again)
    with pytest.raises(DoesNotFit, match="pinning 0.0 GiB of the exact host store failed"):
        transfer.pin_host(available=1 << 40)


# --- whole runs: CUDA's orchestration decodes the tokens of the synchronous path -------------------------------


def standin_caches(monkeypatch) -> list[Transfer]:
    """Every cache built from here on in the CUDA layout (tests/conftest.py cuda_layout) with a stand-in of its
    own for its streams. -> the list their Transfers are added to."""
    import engine.kvcache

    cuda_layout(monkeypatch)
    made: list[Transfer] = []

    def transfer(device: torch.device) -> Transfer:
        made.append(Transfer(device, streams=StandinStreams(wait_seconds=STANDIN_RUN_BOUND)))
        return made[-1]

    monkeypatch.setattr(engine.kvcache, "Transfer", transfer)
    return made


STANDIN_RUN_BOUND = 20.0  # (a whole run's waits: generous, the machine may be busy; a lost signal still fails)
SPECACHE = {"k": 16, "group": 32, "residual": 16, "sinks": 4, "chunk_size": 64}


def generate(model, prompts, config, max_tokens=16):
    from engine.generate.engine import Engine, Finished

    return next(e for e in Engine(model, config).generate(prompts, GenerationConfig(max_tokens=max_tokens))
                if isinstance(e, Finished))


@pytest.mark.parametrize("prefetch,path", [("current", "kernel"), ("speculative", "kernel"), ("current", "thread")])
def test_specache_through_cudas_orchestration_decodes_the_synchronous_tokens(tiny_model, monkeypatch, kernel_gather,
                                                                             prefetch, path):
    """Rows of different lengths, specache in the CUDA layout: with the stand-in's streams (the prefetch read in
    place by the gather kernel, or gathered by the worker thread and copied on the side stream) the tokens are
    those of the synchronous run, and every prefetch was waited for."""
    config = CacheConfig(mode="specache", prefetch=prefetch, **SPECACHE)
    ps = [list(range(3, 3 + n)) for n in (130, 97, 181)]
    cuda_layout(monkeypatch)
    plain = generate(tiny_model, ps, config)
    if path == "thread":
        monkeypatch.setattr(triton_guide, "FAILED", {"gather": "switched off by the test"})
    made = standin_caches(monkeypatch)
    got = generate(tiny_model, ps, config)
    assert got.tokens == plain.tokens
    assert got.cache_stats["fetch_path"] == path
    (transfer,) = made
    assert transfer.streams.launches > 0 and transfer._worker is None and transfer.streams.pinned == {}  # closed


@pytest.mark.parametrize("mode", ["full", "specache", "speculative"])
def test_graph_replay_through_cudas_orchestration_decodes_the_eager_tokens(tiny_model, monkeypatch, kernel_gather,
                                                                          mode):
    """SPECACHE_CUDA_GRAPHS=1 with the stand-in's streams: passes recorded (warmed up on a side stream first,
    then captured: no host sync, the prefetch joined back) and replayed give the eager tokens."""
    config = (CacheConfig(mode="full", chunk_size=64) if mode == "full" else
              CacheConfig(mode="specache", prefetch="current" if mode == "specache" else "speculative", **SPECACHE))
    ps = [list(range(5, 5 + n)) for n in (60, 133, 97)]
    cuda_layout(monkeypatch)
    eager = generate(tiny_model, ps, config, max_tokens=14)
    made = standin_caches(monkeypatch)
    monkeypatch.setenv("SPECACHE_CUDA_GRAPHS", "1")
    replayed = generate(tiny_model, ps, config, max_tokens=14)
    assert replayed.tokens == eager.tokens
    (transfer,) = made
    assert transfer.streams.graphs >= 1


def test_exact_mode_verifies_through_the_streamed_buffers(tiny_model, monkeypatch):
    """Exact mode with the stand-in's streams: each layer's copy queued on the side stream, waited for by its
    attention; the tokens those of the synchronous run, and the overlap measured."""
    config = CacheConfig(mode="exact", gamma=4, chunk_size=64, k=16, residual=32, group=32, sinks=4)
    ps = [list(range(7, 7 + n)) for n in (150, 97)]
    plain = generate(tiny_model, ps, config, max_tokens=12)
    made = standin_caches(monkeypatch)
    got = generate(tiny_model, ps, config, max_tokens=12)
    assert got.tokens == plain.tokens
    (transfer,) = made
    assert transfer.stream_verify and transfer.verify.passes == got.cache_stats["verifies"] > 0
    assert transfer.verify.waits > 0 and got.cache_stats["verify_overlap_share"] is not None
    assert transfer.streams.launches >= 2 * transfer.verify.passes


@pytest.mark.parametrize("mode", ["specache", "exact"])
def test_a_rows_prefill_attends_its_exact_prefix_on_the_device_not_over_the_bus(tiny_model, monkeypatch, mode):
    """CUDA's orchestration: rows prefilled in several chunks attend their exact prefix from the device copy that
    write_span keeps while they are prefilled (HostStore.read_prefix), so nothing is read back from the host store
    (before: the whole prefix, once a chunk and layer); the tokens are the synchronous run's, and the copy goes
    back at the first decode pass."""
    config = (CacheConfig(mode="specache", prefetch="current", **SPECACHE) if mode == "specache" else
              CacheConfig(mode="exact", gamma=4, chunk_size=64, k=16, residual=32, group=32, sinks=4))
    ps = [list(range(3, 3 + n)) for n in (300, 170)]
    cuda_layout(monkeypatch)
    plain = generate(tiny_model, ps, config, max_tokens=8)
    made = standin_caches(monkeypatch)
    reads, released = [], []
    real_read, real_release = HostStore.read, HostStore.release_prefix
    monkeypatch.setattr(HostStore, "read", lambda self, row, start, end: reads.append((row, start, end)) or
                        real_read(self, row, start, end))
    monkeypatch.setattr(HostStore, "release_prefix", lambda self: released.append(self) or real_release(self))
    got = generate(tiny_model, ps, config, max_tokens=8)
    assert got.tokens == plain.tokens and made
    assert reads == []
    assert len(set(map(id, released))) == tiny_model.config.num_hidden_layers


class HostReads(torch.overrides.TorchFunctionMode):
    """Counts the tensor values read on the host (what syncs a device), by where they were read."""

    def __init__(self):
        super().__init__()
        self.where: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            import traceback

            frame = next(f for f in reversed(traceback.extract_stack()[:-1]) if "/engine/" in f.filename)
            self.where.append(f"{Path(frame.filename).name}:{frame.name}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("graphs", ["1", "0"])
def test_a_speculative_step_reads_only_its_output_tokens_on_the_host(tiny_model, monkeypatch, kernel_gather, graphs):
    """specache's GPU default (the speculative prefetch, the corrected set) through the stand-in, replayed as
    graphs and eager: a steady decode step (a recorded pass refuses every host read and sync; the bookkeeping
    around it and the eager pass counted here) reads on the host once: in one go the four id vectors the
    re-sync of guesses compares, the output tokens (steps' history) among them; no layer reads a value (the
    corrected set is built at fixed size on an asynchronous device)."""
    from engine.generate.engine import Engine
    from engine.generate.steps import greedy

    config = CacheConfig(mode="specache", prefetch="speculative", **SPECACHE)
    cuda_layout(monkeypatch)
    made = standin_caches(monkeypatch)
    monkeypatch.setenv("SPECACHE_CUDA_GRAPHS", graphs)
    engine = Engine(tiny_model, config)
    cache = engine.new_cache(3, 300)
    prompts = [list(range(5, 5 + n)) for n in (60, 133, 97)]
    last = [list(engine.prefill(cache, p, row))[-1] for row, p in enumerate(prompts)]
    steps = engine.steps(cache, torch.stack(last), greedy, history=[list(p) for p in prompts])
    for _ in range(4):  # T1, pre-decoding, the recording
        next(steps)
    reads = HostReads()
    with reads:
        for _ in range(3):
            next(steps)
    steps.close()
    cache.close()
    assert (made[0].streams.graphs >= 1) == (graphs == "1")
    assert reads.where == ["steps.py:_resync"] * 3  # (before: the output tokens read again apart, rows.py:_append)


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_recording_that_fails_falls_back_to_eager_passes_said_once(tiny_model, monkeypatch, kernel_gather, capfd,
                                                                     when):
    """The speculative specache with graph replay on, its stand-in's capture raising before it records or after
    it ran the pass: the run goes on eagerly with the eager tokens, one note on stderr, `graphs` in the
    cache's stats says so; no second recording is tried."""
    config = CacheConfig(mode="specache", prefetch="speculative", **SPECACHE)
    ps = [list(range(5, 5 + n)) for n in (60, 133, 97)]
    cuda_layout(monkeypatch)
    eager = generate(tiny_model, ps, config, max_tokens=10)
    made = standin_caches(monkeypatch)
    tries = []

    def failing(self, run):
        tries.append(1)
        if when == "after":
            with self.recording():
                run()
        raise RuntimeError("operation not permitted when stream is capturing\n(more)")

    monkeypatch.setattr(StandinStreams, "capture", failing)
    monkeypatch.setenv("SPECACHE_CUDA_GRAPHS", "1")
    capfd.readouterr()
    got = generate(tiny_model, ps, config, max_tokens=10)
    err = capfd.readouterr().err
    assert got.tokens == eager.tokens and len(tries) == 1
    assert err.count("decoding eagerly") == 1 and "operation not permitted" in err and "(more)" not in err
    assert got.cache_stats["graphs"] == {"replayed": False, "fallback": "eager",
                                         "error": "RuntimeError: operation not permitted when stream is capturing"}
    assert made[0].streams.graphs == 0


def test_graph_replay_is_the_default_on_cuda_only(monkeypatch):
    """Graph replay is the CUDA backend's declaration in the backends' table (Kernels.graph_replay), read once per
    device type: unset, SPECACHE_CUDA_GRAPHS follows it (CUDA's on; the CPU's, and the stand-in's on CPU tensors,
    off); 0 and 1 rule; a CUDA backend declaring it off turns it off; the env var is read in that one place."""
    from types import SimpleNamespace

    from engine.backends import kernels
    from engine.backends.streams import CudaStreams
    from engine.generate.graphs import graphs_wanted

    def cache(streams, kind):
        return SimpleNamespace(transfer=SimpleNamespace(streams=streams, device=torch.device(kind)), capturable=True)

    cuda = CudaStreams.__new__(CudaStreams)  # (its attributes only: no device here)
    monkeypatch.delenv("SPECACHE_CUDA_GRAPHS", raising=False)
    assert graphs_wanted(cache(cuda, "cuda")) and not graphs_wanted(cache(StandinStreams(), "cpu"))
    assert not graphs_wanted(cache(SYNC, "cpu"))
    monkeypatch.setenv("SPECACHE_CUDA_GRAPHS", "0")
    assert not graphs_wanted(cache(cuda, "cuda"))
    monkeypatch.setenv("SPECACHE_CUDA_GRAPHS", "1")
    assert graphs_wanted(cache(StandinStreams(), "cpu")) and not graphs_wanted(cache(SYNC, "cpu"))
    monkeypatch.delenv("SPECACHE_CUDA_GRAPHS")
    declared = kernels.backends()["cuda"][0]
    assert declared.graph_replay is True and kernels.graph_default("cpu") is False
    monkeypatch.setattr(declared, "graph_replay", False)
    kernels.forget()
    try:
        assert not graphs_wanted(cache(cuda, "cuda"))
    finally:
        monkeypatch.undo()
        kernels.forget()
    root = Path(__file__).resolve().parent.parent / "engine"
    readers = {p.relative_to(root).as_posix() for p in root.rglob("*.py") if '"SPECACHE_CUDA_GRAPHS"' in p.read_text()}
    assert readers == {"backends/kernels.py"}