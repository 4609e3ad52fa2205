"""Exact mode's verification stream (engine.kvcache.verify_stream.VerifyStream): on CUDA each layer's exact
K/V are copied from the host store into two device buffers, double-buffered. No GPU here: the staged
path is forced on the CPU (Transfer.stream_verify), where its copies are plain copies, or run with the
streams' stand-in (engine.backends.streams: the copies queued on a side stream, events between them), so
the buffer rotation, the rows with different starts and the reads are checked against the in-place path."""
from __future__ import annotations

import pytest
import torch

import engine.generate.engine as eng
from engine.backends.streams import StandinStreams
from engine.config import CacheConfig
from engine.kvcache import make_cache
from engine.kvcache.host_store import HostStore
from engine.kvcache.transfer import Transfer
from engine.kvcache.verify_stream import VerifyStream, copy_prefix
from tests.conftest import tiny_config
from tests.test_engine import dynamic_cache_greedy, prompts_of, run

TINY = {"k": 16, "residual": 32, "group": 32, "sinks": 4}
CPU = torch.device("cpu")


def stores_of(n_layers: int, batch: int, heads: int, max_len: int, dim: int, transfer: Transfer) -> list[HostStore]:
    stores = []
    for layer in range(n_layers):
        s = HostStore(batch, heads, max_len, dim, 1, torch.float32, CPU, transfer)
        s.k.copy_(torch.randn(s.k.shape))
        s.v.copy_(torch.randn(s.v.shape))
        stores.append(s)
    return stores


@pytest.mark.parametrize("waste,per_pos,streamed", [(0.0, True, False), (1.0, False, False), (0.0, True, True),
                                                     (1.0, False, True)])
def test_buffers_rotate_and_hold_each_layers_past(waste, per_pos, streamed):
    """5 layers through 2 buffers: begin copies layers 0 and 1; releasing layer l copies l + 2 into its
    buffer; a layer is readable only while its buffer holds it (in this pass); each buffer holds the
    layer's store rows [0, past); bytes: only the past of the pass's rows (one copy per row and head),
    or whole rows (one copy) when the unused tail is small enough. streamed: the stand-in's side stream
    (the copies run when the attention waits for them; the overlap counted)."""
    streams = StandinStreams(wait_seconds=5.0) if streamed else None
    transfer = Transfer(CPU, stream_verify=True, streams=streams)
    verify = transfer.verify_stream()
    verify.whole_rows_waste = waste
    batch, heads, max_len, dim, past = 3, 2, 40, 8, 17
    stores = stores_of(5, batch, heads, max_len, dim, transfer)
    assert [verify.add(s) for s in stores] == [0, 1, 2, 3, 4]
    assert verify.k is None and verify.bytes_per_row() == 2 * 2 * heads * max_len * dim * 4
    rows = slice(1, 3)
    verify.begin(rows, past)
    assert verify.holds == [(1, 0), (1, 1)]
    with pytest.raises(RuntimeError):
        verify.acquire(2, rows)  # buffer 0 holds layer 0
    with pytest.raises(RuntimeError):
        verify.acquire(0, slice(0, 2))  # other rows than the pass's
    for layer in range(5):
        k, v = verify.acquire(layer, rows)
        assert k.data_ptr() == verify.k[layer % 2].data_ptr()
        assert torch.equal(k[rows, :, :past], stores[layer].k[rows, :, :past])
        assert torch.equal(v[rows, :, :past], stores[layer].v[rows, :, :past])
        verify.release(layer)
        want = (1, layer + 2) if layer + 2 < 5 else None
        assert verify.holds[layer % 2] == want
        with pytest.raises(RuntimeError):
            verify.acquire(layer, rows)  # released
    per_layer = 2 * 2 * heads * (past if per_pos else max_len) * dim * 4  # K and V of 2 rows
    assert verify.copied_bytes == 5 * per_layer
    verify.begin(rows, past)  # a second pass: fresh holds, counted apart
    assert verify.holds == [(2, 0), (2, 1)] and verify.passes == 2
    with pytest.raises(RuntimeError):
        verify.acquire(3, rows)
    share = 0.0 if streamed else None  # (the stand-in runs a copy when it is waited for: never ahead)
    assert verify.stats() == {"verify_copy_bytes": 7 * per_layer // 2, "verify_overlap_share": share}  # 5 + 2 layers
    if streamed:
        assert verify.waits == 5 and streams.launches >= 7 and len(streams.recorded) == 2  # the buffers kept


def test_a_streamed_copy_is_read_only_after_its_attention_waits():
    """With the stand-in's streams a layer's copy is queued behind the release of the buffer's previous reader:
    the buffer holds nothing of it until acquire() waits; a side stream held back fails the wait within its
    bound instead of letting the attention read a buffer being written."""
    streams = StandinStreams(wait_seconds=0.3)
    transfer = Transfer(CPU, stream_verify=True, streams=streams)
    verify = transfer.verify_stream()
    stores = stores_of(3, 1, 2, 16, 4, transfer)
    for s in stores:
        verify.add(s)
    rows = slice(0, 1)
    verify.begin(rows, 10)
    assert not verify.k.any()  # queued, not run
    k, _ = verify.acquire(0, rows)
    assert torch.equal(k[rows, :, :10], stores[0].k[rows, :, :10]) and not verify.k[1].any()  # layer 1 still queued
    with streams.hold(transfer.stream):
        verify.release(0)  # layer 2's copy, behind layer 1's
        with pytest.raises(RuntimeError, match="held back"):
            verify.acquire(1, rows)
    k, _ = verify.acquire(1, rows)
    assert torch.equal(k[rows, :, :10], stores[1].k[rows, :, :10])


def test_copy_prefix_copies_only_the_prefix_per_row_and_head():
    src = torch.randn(2, 3, 10, 4)
    dst = torch.zeros_like(src)
    assert copy_prefix(dst, src, 6, 0.0) == 2 * 3 * 6 * 4 * 4
    assert torch.equal(dst[:, :, :6], src[:, :, :6]) and not dst[:, :, 6:].any()
    assert copy_prefix(dst, src, 0, 0.0) == 0
    assert copy_prefix(dst, src, 9, 0.125) == src.numel() * 4 and torch.equal(dst, src)  # 1 of 10 unused: whole


def prefilled_caches(model, prompts, staged: bool, max_len: int = 400):
    """A batch cache of the prompts, verification staged through the buffers or in place."""
    engine = eng.Engine(model, CacheConfig(mode="exact", gamma=4, chunk_size=64, **TINY))
    cache = engine.new_cache(len(prompts), max_len)
    cache.transfer.stream_verify = staged
    for r, p in enumerate(prompts):
        list(engine.prefill(cache, p, r))
    return cache


def verification_pass(model, cache, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One exact pass of ids [B, T] over the cache (not committed). -> (logits, each layer's attention output)."""
    outs = []
    for layer in cache.layers:
        real = layer.attend
        layer.attend = lambda q, s, step, softcap=None, real=real: outs.append(real(q, s, step, softcap)) or outs[-1]
    try:
        step = cache.begin(slice(0, cache.batch), ids.shape[1], exact=True)
        with torch.inference_mode():
            logits = model(input_ids=ids, position_ids=step.positions(), cache=cache, use_cache=True,
                           kv_cache=cache, logits_to_keep=ids.shape[1]).logits
    finally:
        for layer in cache.layers:
            del layer.attend
    return logits, outs


def test_staged_verification_attends_as_the_in_place_one_bit_for_bit(tiny_model):
    """Rows of 150, 97 and 260 tokens, 5 new tokens each: every layer's attention output (and the
    logits) of the staged pass equal the in-place pass's exactly; the copies moved each layer's K/V
    of the pass's past [0, 260) and nothing else."""
    ps = prompts_of((150, 97, 260), seed=5)
    ids = torch.randint(3, 320, (3, 5), generator=torch.Generator().manual_seed(2)).to(tiny_model.device)
    cuda = tiny_model.device.type == "cuda"  # SPECACHE_TEST_DEVICE=cuda: the side stream and its events
    plain, staged = prefilled_caches(tiny_model, ps, staged=False), prefilled_caches(tiny_model, ps, staged=True)
    with plain, staged:
        staged.transfer.verify.whole_rows_waste = 0.0  # the per-(row, head) copies (the tail is large here)
        want_logits, want = verification_pass(tiny_model, plain, ids)
        got_logits, got = verification_pass(tiny_model, staged, ids)
        assert len(got) == len(want) == tiny_model.config.num_hidden_layers
        for layer, (g, w) in enumerate(zip(got, want)):
            if cuda:  # the plain copy is contiguous, the buffer a strided view: SDPA may pick another kernel
                torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
            else:
                assert torch.equal(g, w), layer
        if cuda:
            assert staged.transfer.verify.waits == len(got) and staged.transfer.verify.k.is_cuda
        else:
            assert torch.equal(got_logits, want_logits)
        shape = staged.shape
        assert staged.transfer.verify.copied_bytes == shape.layers * 2 * 3 * shape.kv_heads * 260 * shape.head_dim * 4
        assert plain.transfer.verify.k is None and plain.transfer.verify.copied_bytes == 0
        # the store got the new tokens in both (the accepted ones are committed from it)
        for a, b in zip(plain.layers, staged.layers):
            assert torch.equal(a.store.k[:, :, :265], b.store.k[:, :, :265])


def test_cpu_default_reads_the_store_in_place(tiny_model):
    """On the CPU, without forcing, an exact run allocates no verification buffer and copies nothing;
    its stats say so (None), and the planned device bytes have no verification buffers."""
    if tiny_model.device.type != "cpu":
        pytest.skip("the CPU default")
    made = []
    ps = prompts_of((90, 70))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(eng, "make_cache", lambda *a, **kw: made.append(make_cache(*a, **kw)) or made[-1])
        res = run(tiny_model, ps, CacheConfig(mode="exact", gamma=4, chunk_size=64, **TINY))
    (cache,) = made
    verify = cache.transfer.verify
    assert not verify.staged and verify.k is None and verify.copied_bytes == 0 and verify.passes == 0
    assert res.cache_stats["verifies"] > 0
    assert res.cache_stats["verify_copy_bytes"] is None and res.cache_stats["verify_overlap_share"] is None
    assert verify.bytes_per_row() == 0
    # (specache with exact mode's store: in the compute dtype, the residual window its positions)
    plain = make_cache(tiny_config(), CacheConfig(mode="specache", store_dtype="fp32", **TINY), 2, 200, torch.float32,
                       CPU)
    exact = make_cache(tiny_config(), CacheConfig(mode="exact", **TINY), 2, 200, torch.float32, CPU)
    assert exact.allocated_device_bytes() == plain.allocated_device_bytes()
    exact.transfer.stream_verify = True  # what CUDA plans: 2 buffer pairs of one layer's K/V
    length = exact.layers[0].store.k.shape[2]  # 200 (on the CPU each head's rows to whole pages: HostStore.place_row)
    assert 200 <= length
    assert exact.allocated_device_bytes() - plain.allocated_device_bytes() == 2 * 2 * 2 * length * 32 * 4


def test_staged_greedy_exact_equals_in_place_and_dynamic_cache(tiny_model):
    """Greedy exact, gamma 4, rows of different prompt lengths: with the verification staged through
    the buffers the tokens are the in-place run's and DynamicCache's; the stats count the copies."""
    ps = prompts_of((150, 97, 260))
    refs = [dynamic_cache_greedy(tiny_model, p) for p in ps]
    config = CacheConfig(mode="exact", gamma=4, chunk_size=64, **TINY)
    plain = run(tiny_model, ps, config)
    made = []

    def staged_cache(*args, **kwargs):
        cache = make_cache(*args, **kwargs)
        cache.transfer.stream_verify = True
        made.append(cache)
        return cache

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(eng, "make_cache", staged_cache)
        staged = run(tiny_model, ps, config)
    assert staged.tokens == plain.tokens == refs
    verify = made[0].transfer.verify
    assert verify.passes == staged.cache_stats["verifies"] > 1
    assert staged.cache_stats["verify_copy_bytes"] == verify.copied_bytes // verify.passes > 0
    share = staged.cache_stats["verify_overlap_share"]
    assert share is None if tiny_model.device.type == "cpu" else 0 <= share <= 1  # measured on CUDA only
    if tiny_model.device.type == "cpu":  # (on CUDA every verification is staged)
        assert plain.cache_stats["verify_copy_bytes"] is None


def test_a_verify_stream_belongs_to_one_transfer():
    t = Transfer(CPU)
    assert t.verify is None and t.verify_bytes_per_row() == 0
    v = t.verify_stream()
    assert isinstance(v, VerifyStream) and t.verify_stream() is v and not v.staged
