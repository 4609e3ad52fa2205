"""The host store and its prefetch (CPU always; CUDA when a GPU is present), and the GPU check
script's CPU-side pieces."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from engine.kvcache.transfer import HostStore, Transfer, overlap_share

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
    store = HostStore(1, 2, 64, 8, 4, torch.float16, torch.device("cuda"), Transfer(torch.device("cuda")))
    assert store.k.is_pinned()
    store.prefetch(slice(0, 1), torch.zeros(1, 2, 4, dtype=torch.long, device="cuda"))
    store.fetched(slice(0, 1))
    assert store.waits == 1 and overlap_share([store]) in (0.0, 1.0)


def test_gpu_check_script_cpu_parts():
    sys.path.insert(0, str(Path(__file__).parent.parent / "scripts"))
    import gpu_check

    from tests.conftest import tiny_config

    batches = gpu_check.plan_batches(4096, 48, 1, 1024)
    assert batches["full"] >= 1 and batches["specache"] >= 1 and batches["k"] > 0
    model = gpu_check.random_model(tiny_config(), torch.device("cpu"))
    assert next(model.parameters()).dtype == torch.float16
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    if not torch.cuda.is_available():
        sys.argv = ["gpu_check.py", "--quick"]
        assert gpu_check.main() == 2
