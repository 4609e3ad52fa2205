"""The host store and its prefetch (CPU always; CUDA when a GPU is present), and the GPU check
script's CPU-side pieces."""
from __future__ import annotations

import mmap
import sys
from pathlib import Path

import pytest
import torch

from engine.kvcache.host_store import HostStore, overlap_share
from engine.kvcache.transfer import Transfer

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_prefetch_gathers_the_selected_rows(device):
    dev = torch.device(device)
    store = HostStore(batch=2, kv_heads=3, max_len=50, head_dim=8, k_max=5, dtype=torch.float32, device=dev,
                      transfer=Transfer(dev))
    k = torch.randn(2, 3, 40, 8, device=dev)
    v = torch.randn(2, 3, 40, 8, device=dev)
    for row in range(2):
        store.write_span(row, 0, k[row, :, :25], v[row, :, :25])
        store.write_span(row, 25, k[row, :, 25:], v[row, :, 25:])
    idx = torch.randint(0, 40, (2, 3, 5), device=dev)
    store.prefetch(slice(0, 2), idx)
    fk, fv = store.fetched(slice(0, 2))
    want = idx[..., None].expand(-1, -1, -1, 8)
    torch.testing.assert_close(fk, torch.gather(k, 2, want))
    torch.testing.assert_close(fv, torch.gather(v, 2, want))
    rk, _ = store.read(1, 10, 20)
    torch.testing.assert_close(rk, k[1:2, :, 10:20])
    assert store.host_bytes(40) == 2 * 40 * 3 * 8 * 4


def test_overlap_share_is_none_on_the_cpu():
    store = HostStore(1, 1, 8, 8, 2, torch.float32, torch.device("cpu"), Transfer(torch.device("cpu")))
    assert overlap_share([store]) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_store_is_pinned_and_counts_overlap():
    transfer = Transfer(torch.device("cuda"))
    store = HostStore(1, 2, 64, 8, 4, torch.float16, torch.device("cuda"), transfer)
    transfer.pin_host()  # (make_cache pins the store once every layer is built)
    assert store.k.is_pinned() and store.v.is_pinned()
    del store
    import gc

    gc.collect()  # the mapping is unpinned before it is unmapped: a new store at the same address pins again
    for _ in range(3):
        again = Transfer(torch.device("cuda"))
        HostStore(1, 2, 64, 8, 4, torch.float16, torch.device("cuda"), again)
        again.pin_host()
    transfer = Transfer(torch.device("cuda"))
    store = HostStore(1, 2, 64, 8, 4, torch.float16, torch.device("cuda"), transfer)
    transfer.pin_host()
    store.prefetch(slice(0, 1), torch.zeros(1, 2, 4, dtype=torch.long, device="cuda"))
    store.fetched(slice(0, 1))
    assert store.waits == 1 and overlap_share([store]) in (0.0, 1.0)


def test_gpu_check_script_cpu_parts(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent.parent / "scripts"))
    import gpu_stages as gpu_check

    from tests.conftest import tiny_config

    batches = gpu_check.plan_batches(4096, 48, 1, 1024)
    assert batches["full"] >= 1 and batches["specache"] >= 1 and batches["k"] > 0
    model = gpu_check.random_model(tiny_config(), torch.device("cpu"))
    assert next(model.parameters()).dtype == torch.float16
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert batches["exact"] >= 1 and batches["exact_transfer_per_row"] >= 0
    assert set(batches["predicted_ms_per_step"]) == {"full", "specache"}
    assert all(ms > 0 for ms in batches["predicted_ms_per_step"].values())
    if not torch.cuda.is_available():
        sys.argv = ["gpu_stages.py", "quick", "--out", str(tmp_path)]
        assert gpu_check.main() == 2


def test_gpu_check_exact_section_runs_on_the_cpu(tiny_model, capsys):
    """The GPU check's exact section on the CPU with the tiny model (the verification staged through
    the buffers is the CPU test mode there): exact == full, the timed run's figures and the summary line."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "scripts"))
    import gpu_stages as gpu_check

    from engine.kvcache import ModelShape
    from engine.kvcache.sizes import kv_bytes_per_token

    assert gpu_check.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert gpu_check.first_difference([1, 2, 3], [1, 5, 3]) == 1 and gpu_check.first_difference([1, 2], [1, 2, 3]) == 2
    eq = gpu_check.exact_equals_full(tiny_model.device, lengths=(60, 130), new=12)
    assert eq["identical"] and eq["first_divergence"] == [None, None] and eq["verifies"] >= 1
    shape = ModelShape.from_config(tiny_model.config)
    per_row = 200 * kv_bytes_per_token(shape, 4)  # fp32
    run = gpu_check.timed_exact(tiny_model, 2, 200, 2, 64, 1, 16, 3, per_row)
    s, p = run["streamed"], run["plain_copy"]
    assert s["verify_copy_bytes"] >= per_row * 2 and 1.0 <= run["copy_vs_planned"] < 1.5
    assert p["verify_copy_bytes"] is None and p["verify_overlap_share"] is None
    assert (s["verify_overlap_share"] is None) == (tiny_model.device.type == "cpu")  # measured on CUDA only
    for seg in (s, p):
        assert seg["ms_per_token"] > 0 and seg["verify_ms"] > 0 and 1 <= seg["tokens_per_verify"] <= 4
    run |= {"full_ms_per_token": 1.0, "exact_vs_full_ms": s["ms_per_token"]}
    assert gpu_check.print_exact({"equals_full": eq, "timed": run})
    assert "exact == full" in capsys.readouterr().out


def test_transfer_worker_runs_jobs_in_order_and_close_ends_it():
    t = Transfer(torch.device("cpu"), threaded=True)
    done: list[int] = []
    for i in range(5):
        t.submit(lambda i=i: done.append(i))
    thread = t._worker.thread
    assert thread.is_alive()
    t.close()
    assert done == [0, 1, 2, 3, 4] and not thread.is_alive()
    t.close()  # idempotent


def test_one_transfer_per_cache_and_twenty_model_calls_leave_no_thread(tiny_model, monkeypatch):
    """Every layer's host store shares its cache's one Transfer (never one per layer), and the Engine
    closes each cache it makes: 20 model calls whose caches each started a worker thread (as a CUDA
    prefetch does) leave no thread behind."""
    import threading

    import engine.generate.engine as eng
    from engine.config import CacheConfig, GenerationConfig
    from engine.kvcache import make_cache

    made = []

    def make_and_start(*args, **kwargs):
        cache = make_cache(*args, **kwargs)
        assert {id(layer.store.transfer) for layer in cache.layers} == {id(cache.transfer)}
        cache.transfer.threaded = True
        cache.transfer.submit(lambda: None)  # starts the worker, as the first CUDA prefetch would
        made.append(cache)
        return cache

    monkeypatch.setattr(eng, "make_cache", make_and_start)
    before = threading.active_count()
    engine = eng.Engine(tiny_model, CacheConfig(mode="specache", k=8, group=32, residual=16, chunk_size=64))
    for i in range(20):
        list(engine.generate([[5 + i, 6, 7, 8] * 20], GenerationConfig(max_tokens=3)))
    assert len(made) == 20 and all(c.transfer._worker is None for c in made)
    assert threading.active_count() == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_model_calls_leave_no_thread():
    import threading

    from engine.config import CacheConfig, GenerationConfig
    from engine.generate.engine import Engine
    from tests.conftest import make_tiny_model

    model = make_tiny_model().to("cuda")
    before = threading.active_count()
    config = CacheConfig(mode="specache", k=8, group=32, residual=16, chunk_size=64, prefetch="speculative")
    engine = Engine(model, config)
    for i in range(20):
        list(engine.generate([[5 + i, 6, 7, 8] * 20], GenerationConfig(max_tokens=3)))
    assert threading.active_count() == before


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the resident set from /proc (Linux)")
def test_the_cpu_store_is_resident_only_where_written():
    """The host store on a CPU is zero pages until written (host_mapping.untouched_zeros): 256 MiB allocated
    costs next to nothing resident, reads as zeros, and the pages written become resident."""
    from engine.backends.host_mapping import untouched_zeros

    def rss_mib() -> int:
        return int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0]) // 1024

    before = rss_mib()
    t = untouched_zeros((2, 4, 1 << 17, 64), torch.float32)  # 256 MiB
    assert t.shape == (2, 4, 1 << 17, 64) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % 64 == 0 and rss_mib() - before < 16
    assert not t[0, 0, :4096].any()  # zeros (and only those pages read)
    t[1].fill_(1.0)  # half of it written: resident
    assert rss_mib() - before > 100 and float(t[1].mean()) == 1.0 and not t[0, 1].any()
    assert untouched_zeros((0, 3), torch.bfloat16).shape == (0, 3)


def test_the_exact_store_takes_the_bytes_the_planner_counts(tiny_model):
    """The exact host store is allocated at exactly the bytes the planner counts for it (context x the
    K/V bytes of a token over the layers, per row: sizes.kv_bytes_per_token at the store's element bytes,
    sizes.store_element_bytes: 2 by default on a CPU, the compute dtype's for exact mode), no rounding (on
    CUDA those bytes are pinned in place: Transfer.pin_host) but, on a CPU, each KV head's rows to whole pages
    (a stored document's rows are mapped there in place: HostStore.place_row; never touched past the length);
    window mode keeps none."""
    from engine.config import CacheConfig
    from engine.kvcache import ModelShape, make_cache
    from engine.kvcache.sizes import kv_bytes_per_token, store_element_bytes

    shape = ModelShape.from_config(tiny_model.config)
    for mode, batch, length, kept in (("specache", 3, 517, None), ("kivi", 2, 300, None), ("exact", 1, 1000, None),
                                      ("specache", 2, 300, "fp32"), ("specache", 1, 300, "fp16")):
        config = CacheConfig(mode=mode, k=16, store_dtype=kept)
        cache = make_cache(tiny_model.config, config, batch, length, torch.float32, torch.device("cpu"))
        element = 4 if mode == "exact" else store_element_bytes(config, True, 4)
        assert element == (4 if mode == "exact" or kept == "fp32" else 2)
        planned, heads = batch * length * kv_bytes_per_token(shape, element), batch * 2 * shape.layers * shape.kv_heads
        assert planned <= cache.transfer.host_bytes_allocated() < planned + heads * mmap.PAGESIZE
        assert cache.host_bytes() == 0  # (nothing committed yet)
    window = make_cache(tiny_model.config, CacheConfig(mode="window"), 2, 300, torch.float32, torch.device("cpu"))
    assert window.transfer.host_bytes_allocated() == 0


def test_a_store_that_cannot_be_pinned_is_refused_before_anything_is_pinned():
    """On CUDA the store is pinned once the cache is built; more than can be pinned (RAM available less the
    planner's reserve) is one DoesNotFit naming both sizes, raised before any memory is locked (checked
    here on the CPU with the streams' stand-in, which counts what is pinned)."""
    from engine.backends.streams import StandinStreams
    from engine.errors import DoesNotFit

    streams = StandinStreams()
    transfer = Transfer(torch.device("cpu"), streams=streams)
    transfer.host_tensor((2, 4, 1024, 64), torch.float16)
    with pytest.raises(DoesNotFit, match=r"needs 0\.0 GiB of pinned RAM and 0\.0 GiB can be pinned"):
        transfer.pin_host(available=1024)
    assert transfer._registered == [] and streams.pinned == {}


def test_sdpa_backends_are_chosen_per_device_from_one_table(monkeypatch):
    """The device's backends in the table (engine.backends.kernels.sdpa_backends) name the SDPA backends its
    attention may use (CUDA's: not cuDNN, which plans each new key length): a declared list is applied (an
    empty one leaves no kernel), and a device whose backends declare none keeps torch's choice."""
    import engine.kvcache.base as base
    from torch.nn.attention import SDPBackend

    from engine.backends import kernels
    from engine.backends.native_cpu import NativeCPU

    assert SDPBackend.CUDNN_ATTENTION not in kernels.sdpa_backends("cuda") and kernels.sdpa_backends("cpu") is None
    q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.3)
    assert torch.equal(base.sdpa(q, k, v, None, 0.3), want)
    try:
        monkeypatch.setattr(NativeCPU, "sdpa_backends", [SDPBackend.MATH])
        kernels.sdpa_backends.cache_clear()
        torch.testing.assert_close(base.sdpa(q, k, v, None, 0.3), want)
        monkeypatch.setattr(NativeCPU, "sdpa_backends", [])
        kernels.sdpa_backends.cache_clear()
        with pytest.raises(RuntimeError):
            base.sdpa(q, k, v, None, 0.3)
    finally:
        monkeypatch.undo()
        kernels.sdpa_backends.cache_clear()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_prefetch_reads_the_pinned_store_in_place():
    """With the store pinned (mapped) and Triton there, a prefetch is one kernel on the side stream reading
    the store where it lies: the fetched set holds the selected rows, no worker thread was started."""
    pytest.importorskip("triton")
    dev = torch.device("cuda")
    transfer = Transfer(dev)
    store = HostStore(2, 3, 50, 64, 8, torch.float16, dev, transfer)
    transfer.pin_host()
    k, v = torch.randn(2, 3, 40, 64, device=dev).half(), torch.randn(2, 3, 40, 64, device=dev).half()
    for row in range(2):
        store.write_span(row, 0, k[row], v[row])
    idx = torch.randint(0, 40, (2, 3, 8), device=dev)
    store.prefetch(slice(0, 2), idx)
    fk, fv = store.fetched(slice(0, 2))
    want = idx[..., None].expand(-1, -1, -1, 64)
    assert torch.equal(fk, torch.gather(k, 2, want)) and torch.equal(fv, torch.gather(v, 2, want))
    assert store.in_place == 1 and transfer._worker is None
    transfer.close()


@pytest.mark.parametrize("kept", [torch.bfloat16, torch.float16])
def test_rows_of_a_16_bit_store_are_fetched_widened(kept):
    """A 16-bit store's rows enter the fp32 fetched set widened, exactly their values: the plain gather and the
    corrected set (rows the prefetch held reused, the others read from the store)."""
    from engine.kvcache.host_memory import corrected_rows, gather_rows

    g = torch.Generator().manual_seed(4)
    store_k, store_v = (torch.randn(2, 3, 50, 8, generator=g).to(kept) for _ in range(2))
    idx = torch.stack([torch.randperm(50, generator=g)[:5] for _ in range(6)]).view(2, 3, 5)
    want = lambda t, at: torch.gather(t, 2, at[..., None].expand(-1, -1, -1, 8)).float()  # noqa: E731
    fk, fv = torch.zeros(2, 3, 5, 8), torch.zeros(2, 3, 5, 8)
    gather_rows(store_k, idx, fk)
    gather_rows(store_v, idx, fv)
    assert torch.equal(fk, want(store_k, idx)) and torch.equal(fv, want(store_v, idx))
    new = torch.cat([idx[..., :2], torch.stack([torch.randperm(50, generator=g)[:3] for _ in range(6)]).view(2, 3, 3)], -1)
    k, v, reused = corrected_rows(fk, fv, store_k, store_v, new, idx, torch.ones_like(idx, dtype=torch.bool), 50)
    assert k.dtype == torch.float32 and bool(reused[..., :2].all())
    assert torch.equal(k, want(store_k, new)) and torch.equal(v, want(store_v, new))
