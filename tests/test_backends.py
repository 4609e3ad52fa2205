"""The device kernels' contract (engine.backends.kernels): every hook a backend implements equals the torch
reference on the same inputs; the table chooses per device; a new backend is one module; no engine module
outside engine/backends and the C build hands pointers to a library."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.backends import kernels
from engine.kvcache import quant

ROOT = Path(__file__).resolve().parent.parent


def guide(bits: int = 2, b: int = 2, h: int = 3, n: int = 192, d: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(b, h, n, d, generator=g), torch.randn(b, h, n, d, generator=g)
    return quant.quantize_keys(k, bits, 64), quant.quantize_values(v, bits, 64), g


def case_guide_scores(backend):
    keys, _, g = guide()
    q = torch.randn(2, 3, 4, 64, generator=g)
    return backend.guide_scores(q, keys, 192), quant._torch_scores(q, keys, 192, torch.float32), 1e-4


def case_guide_values(backend):
    _, values, g = guide(bits=1)
    p = torch.softmax(torch.randn(2, 3, 4, 192, generator=g), -1)
    return backend.guide_values(p, values, 192), quant._torch_weighted_values(p, values, 192, torch.float32), 1e-5


def case_rms_norm(backend):
    x, scale, res = torch.randn(3, 96), torch.randn(96), torch.randn(3, 96)
    ref = res + x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * scale
    return backend.rms_norm(x, scale, 1e-6, res), ref, 1e-5


def case_linear(backend):
    x, w, bias = torch.randn(3, 64), torch.randn(40, 64), torch.randn(40)
    return backend.linear(x, w, bias), x @ w.T + bias, 1e-4


def case_pack_weight(backend):
    from engine.model.block_formats import FORMATS
    from engine.model.held_weights import PackedWeight

    w = scaled8(16, 64)
    fmt, data = backend.pack_weight(w, FORMATS)
    return PackedWeight(fmt, data, (16, 64)).torch_rows(0, 16), w, 0.0


def case_unpack_rows(backend):
    from engine.model.block_formats import FORMATS

    w = scaled8(8, 64)
    fmt, data = backend.pack_weight(w, FORMATS)
    return backend.unpack_rows(data, fmt, 2, 6, 64, torch.float32), w[2:6], 0.0


def case_bind_packed(backend):
    from engine.model.block_formats import FORMATS

    w, x = scaled8(24, 64), torch.randn(2, 64)
    fmt, data = backend.pack_weight(w, FORMATS)
    return backend.bind_packed(data, fmt, (24, 64))(x, None), x @ w.T, 1e-4


def case_bind_linear(backend):
    from engine.model.block_formats import FORMATS
    from engine.model.held_weights import PackedWeight

    w, x, bias = scaled8(24, 64), torch.randn(2, 64), torch.randn(24)
    fmt, data = backend.pack_weight(w, FORMATS)
    return backend.bind_linear(PackedWeight(fmt, data, (24, 64)), bias, None)(x), x @ w.T + bias, 1e-4


def case_norm_rope(backend):
    y, scale = torch.randn(1, 2, 2 * 32), torch.randn(32)
    angle = torch.randn(1, 1, 2, 16)
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([-angle.sin(), angle.sin()], -1)
    heads = y.view(1, 2, 2, 32)
    normed = heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + 1e-6) * scale
    half = normed.shape[-1] // 2
    rotated = torch.cat([normed[..., half:], normed[..., :half]], -1)
    ref = (normed * cos[:, 0, :, None] + rotated * sin[:, 0, :, None]).reshape(1, 2, 64)
    got = y.clone()
    return (got if backend.norm_rope(((got, scale),), 32, 1e-6, cos, sin) else None), ref, 1e-4


def case_sliding_attention(backend):
    pytest.skip("held by tests/test_sliding.py: the native window kernel against attend_torch on real layers")


def case_fused_decode(backend):
    pytest.skip("held by tests/test_fused.py (the native call) and tests/test_triton_decode.py (the Triton one): "
                "each against the torch pass on real guided layers")


def case_prefill_attention(backend):
    pytest.skip("held by tests/test_fidelity_windows.py and tests/test_gguf.py: the bf16 prefill against fp32")


def scaled8(n: int, k: int) -> torch.Tensor:
    """A weight [n, k] that is exactly scaled8 blocks: per 32 weights d * q, q int8 with |q| reaching 127."""
    q = torch.randint(-127, 128, (n, k // 32, 32)).float()
    q[..., 0] = 127
    return (q * torch.rand(n, k // 32, 1).half().float()).view(n, k)


CASES = {name.removeprefix("case_"): fn for name, fn in globals().items() if name.startswith("case_")}


def implemented() -> list[tuple[str, str]]:
    return [(cls.name, hook) for kinds in kernels.backends().values() for cls in kinds
            for hook, by in cls().implements().items() if by == cls.name]


def test_every_hook_has_a_conformance_case():
    assert set(CASES) == set(kernels.HOOKS)


@pytest.mark.parametrize("name, hook", implemented())
def test_each_backend_equals_the_reference_per_hook(name, hook):
    backend = kernels.REGISTERED[name]()
    if not backend.available():
        pytest.skip(f"backend {name} is not available here")
    got, ref, tol = CASES[hook](backend)
    assert got is not None, f"{name}.{hook} declined a call it should take"
    assert got.shape == ref.shape and torch.allclose(got, ref, atol=tol, rtol=tol), (got - ref).abs().max()


def test_the_reference_declines_every_hook_and_names_torch():
    ref = kernels.Kernels()
    assert set(ref.implements().values()) == {"torch"}
    assert kernels.backend_for("meta") is kernels.REFERENCE
    assert kernels.describe("meta") == {"name": "torch", "reference_hooks": list(kernels.HOOKS)}


def test_a_cuda_device_gets_the_triton_backend_from_the_table(monkeypatch):
    """The table lists the Triton backend for the device type cuda; a CUDA device (any index) gets it, once, and
    --json's backend and guide_kernel name it; the streams' stand-in (CUDA's orchestration on CPU tensors) asks
    it for the store's gather; without Triton a CUDA device gets the torch reference, said as "torch"."""
    pytest.importorskip("triton")
    from engine.backends.streams import StandinStreams
    from engine.backends.triton_cuda import TritonCUDA
    from engine.kvcache.transfer import Transfer

    monkeypatch.setattr(kernels, "_CHOSEN", {})
    assert [cls.name for cls in kernels.backends()["cuda"]] == ["triton"]
    chosen = kernels.backend_for("cuda")
    assert type(chosen) is TritonCUDA and kernels.backend_for(torch.device("cuda", 1)) is chosen
    described = kernels.describe("cuda")
    assert described["name"] == "triton" and "rms_norm" in described["reference_hooks"]
    assert not {"guide_scores", "guide_values", "fused_decode"} & set(described["reference_hooks"])
    assert quant.guide_kernel(torch.device("cuda")) == "triton"
    transfer = Transfer(torch.device("cpu"), streams=StandinStreams())
    assert transfer.kernels is chosen and Transfer(torch.device("cpu")).kernels is kernels.backend_for("cpu")
    transfer.close()
    monkeypatch.setattr(TritonCUDA, "available", classmethod(lambda cls: False))
    kernels.forget()
    assert kernels.backend_for("cuda") is kernels.REFERENCE and quant.guide_kernel(torch.device("cuda")) == "torch"


PROBE = '''"""A test's backend: the CPU's first choice, with one hook of its own."""
import torch

from engine.backends.kernels import Kernels, register


@register
class Probe(Kernels):
    name = "probe"
    devices = ("cpu",)
    rank = -1
    calls = 0

    def rms_norm(self, x, scale, eps, res):
        type(self).calls += 1
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * scale
        return y if res is None else y + res
'''

PROBE_CHILD = r'''
import json, sys
from typer.testing import CliRunner
import engine
from engine.backends import kernels
from specache_cli.app import app

r = CliRunner().invoke(app, ["summarize", sys.argv[1], "--model", sys.argv[2], "--quiet", "--no-store", "--json",
                             "--max-tokens", "4"], catch_exceptions=False)
print(json.dumps({"engine": engine.__file__, "code": r.exit_code, "cache": json.loads(r.stdout)["cache"],
                  "table": [c.name for c in kernels.backends()["cpu"]]}))
'''


def test_adding_a_backend_is_one_module(tmp_path, tiny_model_dir):
    """A new backend is one new file in engine/backends/: in a copy of the package with that file added, the
    table lists it for the devices it names, in its rank, a run on the CPU takes it, --json names it and
    the hooks it leaves to the reference."""
    copy = tmp_path / "copy"
    ignore = shutil.ignore_patterns("__pycache__", "*.so")
    for package in ("engine", "specache_cli", "profiles"):
        shutil.copytree(ROOT / package, copy / package, ignore=ignore)
    (copy / "engine" / "backends" / "probe.py").write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": str(copy)}
    r = subprocess.run([sys.executable, "-c", PROBE_CHILD, str(ROOT / "tests" / "data" / "sample.txt"),
                        str(tiny_model_dir)], cwd=copy, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["engine"].startswith(str(copy)) and out["code"] == 0
    assert out["table"][0] == "probe"
    backend = out["cache"]["backend"]
    assert backend["name"] == "probe" and "rms_norm" not in backend["reference_hooks"]
    assert "guide_scores" in backend["reference_hooks"]


# the modules outside engine/backends and the C build that hand tensors' pointers to a library: none (the host
# store's mappings moved to engine/backends/host_mapping.py)
POINTERS_OUTSIDE: set[str] = set()


def test_only_the_backends_hand_pointers_to_a_library():
    found = set()
    for path in (ROOT / "engine").rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(("engine/backends/", "engine/native/")):
            continue
        if re.search(r"\bdata_ptr\(|^import ctypes|^from ctypes", path.read_text(), re.M):
            found.add(rel)
    assert found <= POINTERS_OUTSIDE, sorted(found - POINTERS_OUTSIDE)


def test_device_resolution_is_the_backends(monkeypatch):
    """--device is resolved in engine.backends.devices, which the run's checks and the loader ask: auto is CUDA
    only where there is one, a CUDA device asked for without one is one error, a bad name another."""
    from engine.backends import devices
    from engine.errors import BadArgument, ModelLoadError
    from engine.model import loading

    assert loading.pick_device is devices.pick_device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert devices.pick_device("auto") == torch.device("cpu") and devices.pick_device("cpu") == torch.device("cpu")
    for bad, error in (("cuda", ModelLoadError), ("cuda:1", ModelLoadError), ("gpu", BadArgument),
                       ("cuda:x", BadArgument)):
        with pytest.raises(error, match="--device"):
            devices.check_device(bad)
    with pytest.raises(ModelLoadError, match="no CUDA device"):
        devices.pick_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert devices.pick_device("auto") == torch.device("cuda")
    devices.check_device("cuda:0")
    with pytest.raises(BadArgument, match="there are 1 CUDA device"):
        devices.check_device("cuda:1")
