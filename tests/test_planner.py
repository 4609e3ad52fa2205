"""The memory planner and the profiles: every formula alone, the paper validation point, golden
JSON and table output for two profiles, detection without a GPU, and malformed profiles.

Regenerate the golden files after an intended change with: UPDATE_GOLDEN=1 pytest tests/test_planner.py
"""
from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from engine.config import outliers_for
from engine.errors import BadArgument, DoesNotFit, ProfileError
from engine.kvcache import POLICIES
from engine.kvcache import sizes as S
from engine import machine as M
from engine.plan import planner as P
from engine.plan import roofline as R
from engine.plan.profiles import (
    estimate_parameters,
    list_hardware,
    list_models,
    load_hardware,
    load_model_profile,
    match_cuda_device,
    model_profile_from_config,
)
from specache_cli.app import app

GOLDEN = Path(__file__).parent / "golden"
DOCS = Path(__file__).parent.parent / "docs" / "planner.md"
MIB, GIB = 1024**2, 1024**3
MODE_KEYS = {"mode", "max_batch", "k", "device_bytes_per_sequence", "host_bytes_per_sequence",
             "transfer_bytes_per_step", "prefetch_hidden", "predicted_speedup_vs_full"}
GOLDEN_CASES = {  # name -> CLI arguments
    "plan_a6000_mistral7b_32k": ["--gpu", "rtx-a6000", "--model", "mistral-7b", "--context", "32768",
                                 "--bits", "1", "--outliers", "0", "--reference", "paper"],
    "plan_l4_smollm2_8k": ["--gpu", "l4", "--model", "smollm2-135m", "--context", "8192", "--host-ram", "32"],
}


@pytest.fixture(scope="module")
def mistral():
    return load_model_profile("mistral-7b")


@pytest.fixture(scope="module")
def a6000():
    return load_hardware("rtx-a6000")


def run_cli(*args: str, env: dict | None = None):
    return CliRunner().invoke(app, ["plan", *args], env={"COLUMNS": "120", **(env or {})})


# --- formulas ------------------------------------------------------------------------------------

def test_kv_and_guide_sizes(mistral):
    assert S.kv_elements_per_token(mistral) == 2 * 32 * 8 * 128
    assert S.kv_bytes_per_token(mistral) == 128 * 1024  # 128 KiB per token in fp16
    # guide bits per element (docs/planner.md): 1-bit g64 = 1.5 bits (0.094x fp16), g32 = 2, 2-bit g64 = 2.5, g32 = 3
    assert [S.guide_bits_per_element(b, g) for b, g in ((1, 64), (1, 32), (2, 64), (2, 32))] == [1.5, 2, 2.5, 3]
    assert S.guide_bits_per_element(1, 64) / 16 == pytest.approx(0.094, abs=5e-4)
    assert S.guide_bytes(mistral, 32768, 1, 64) == 384 * MIB
    assert S.guide_bytes(mistral, 32768, 2, 32) == 768 * MIB
    assert S.exact_tail_tokens(64, 64) == 127
    assert S.residual_slots(64, 64, 512) == 640  # engine/kvcache/guided.py's preallocated buffer
    assert S.fetch_buffer_bytes(mistral, 64) == 64 * 128 * 1024  # the engine's one fetched set per layer
    assert S.fetch_buffer_bytes(mistral, 64, buffers=S.PAPER_FETCH_BUFFERS) == 2 * 64 * 128 * 1024
    assert R.weight_bytes(mistral) == 2 * 7_241_732_096
    assert S.layer_view_bytes(mistral, 32768) == 128 * MIB
    # head_dim 32 < g 64: value groups are 32 channels (2 bits/element), key groups 64 tokens (1.5)
    narrow = replace(mistral, head_dim=32)
    assert S.guide_bytes(narrow, 64, 1, 64) == 64 * 32 * 8 * 32 * (1.5 + 2) / 8


def test_prefill_activations(mistral):
    ctx = 32768
    # paper baseline: the whole prompt at once, fp16 logits of every position plus an fp32 copy
    one_shot = S.prefill_activation_bytes(mistral, ctx, all_logits=True)
    assert one_shot == 2 * ctx * 4096 * 2 + ctx * 32000 * (2 + 4)
    assert one_shot == 6512 * MIB
    # last-position logits: the MLP (gate, up, product) is the peak
    assert S.prefill_activation_bytes(mistral, ctx) == 2 * ctx * 4096 * 2 + 3 * ctx * 14336 * 2
    # a 512-token chunk of a guided layer: two 16-bit copies of the layer's past + the boolean mask
    chunk = S.prefill_activation_bytes(mistral, 512, past_tokens=ctx, past_views=2, mask=True)
    attention = 512 * (2 * 32 + 2 * 8) * 128 * 2 + 2 * 128 * MIB + 4 * 512 * (ctx + 512)
    assert chunk == 2 * 512 * 4096 * 2 + attention
    assert S.causal_mask_bytes(mistral, 512, 1024) == 4 * 512 * 1024


def test_decode_working_set(mistral):
    assert S.decode_working_set_bytes(mistral, 32768, 1, guided=False) == 32000 * 2
    guided = S.decode_working_set_bytes(mistral, 32768, 2, guided=True)
    assert guided == 2 * 32000 * 2 + S.SCORE_COPIES * 2 * 32 * 32768 * 4 + 128 * MIB


def test_budget_and_batch(a6000):
    total = 49140 * MIB
    assert a6000.device_memory_bytes == total
    assert R.device_budget_bytes(a6000) == total - 512 * MIB - int(0.05 * total)
    with_free = replace(a6000, free_memory_bytes=20 * GIB)
    assert R.device_budget_bytes(with_free) == 20 * GIB - int(0.05 * total)
    cpu = load_hardware("cpu")
    assert R.runtime_reserve_bytes(cpu) == int(0.1 * cpu.device_memory_bytes)
    assert R.batch_that_fits(100, 30) == 3
    assert R.batch_that_fits(100, 30, shared=20) == 2
    assert R.batch_that_fits(10, 30) == 0
    assert R.batch_that_fits(-5, 30) == 0
    assert M.host_usable_bytes(100 * GIB) == 90 * GIB


def test_step_times(a6000, mistral):
    weights = R.weight_bytes(mistral)
    # batch 1, one token: memory-bound, weights + one sequence's reads over 80% of 768 GB/s
    t = R.decode_step_seconds(a6000, mistral, 1, 1, 1000, 1024)
    assert t == pytest.approx((weights + 1000) / (768e9 * 0.8))
    # a huge batch: compute-bound at 60% of 154.8 TFLOPS
    t = R.decode_step_seconds(a6000, mistral, 10_000, 2, 0, 1024)
    flops = 10_000 * 2 * (2 * mistral.parameters + 4 * 32 * 128 * 1024 * 32)
    assert t == pytest.approx(flops / (154.8e12 * 0.6))
    assert R.transfer_seconds(a6000, 12 * 10**9) == pytest.approx(1.0)  # 24 GB/s x 0.5 sparse efficiency
    assert R.transfer_seconds(load_hardware("cpu"), 12.5 * 10**9) == pytest.approx(1.0)  # gather rate as profiled


def test_k_max_hidden_is_the_boundary(a6000, mistral):
    p = P.plan(a6000, mistral, 32768)
    sp = p.mode("specache")
    kvb = S.kv_bytes_per_token(mistral)

    def hidden(k: int) -> bool:
        read = S.guide_bytes(mistral, 32768, 1, 64, outliers=outliers_for(1, None)) + (127 + 4 + k) * kvb
        compute = R.decode_step_seconds(a6000, mistral, sp.max_batch, 2, read, 32768)
        return R.transfer_seconds(a6000, sp.max_batch * k * kvb) <= compute

    assert hidden(sp.k_max_hidden) and not hidden(sp.k_max_hidden + 1)
    assert sp.prefetch_hidden == (sp.k <= sp.k_max_hidden)


def test_parameter_formula_matches_every_profile():
    for m in list_models():
        tied = m.name.startswith(("smollm2", "gemma"))  # Gemma ties its embeddings
        bias = m.name.startswith("qwen")
        assert estimate_parameters(m, tied, bias) == m.parameters, m.name


# --- profiles ------------------------------------------------------------------------------------

def test_builtin_profiles_cover_the_issue():
    hw = {h.name for h in list_hardware()}
    assert {"rtx-a6000", "a100-40gb-pcie", "a100-40gb-sxm", "a100-80gb-pcie", "a100-80gb-sxm", "h100-pcie",
            "h100-sxm", "h200", "l4", "rtx-4090", "rtx-3090", "cpu"} <= hw
    models = {m.name for m in list_models()}
    assert {"llama-2-7b", "llama-2-13b", "llama-3-8b", "llama-3.1-8b", "llama-3-70b", "mistral-7b", "qwen2.5-7b",
            "smollm2-135m"} <= models
    for h in list_hardware():
        assert h.source == f"profiles/hardware/{h.name}.yaml"
        if h.kind == "cuda":
            assert h.h2d_gbps < h.pcie_link_gbps


def test_lookup_by_alias_and_unknown_names():
    assert load_hardware("A6000").name == "rtx-a6000"
    assert load_model_profile("Mistral-7B-Instruct-v0.2").name == "mistral-7b"
    with pytest.raises(BadArgument, match="known: .*rtx-a6000"):
        load_hardware("rtx-9999")
    with pytest.raises(BadArgument, match="known: .*mistral-7b"):
        load_model_profile("gpt-5")


def test_cuda_name_matching_is_whole_word():
    assert match_cuda_device("NVIDIA L4").name == "l4"
    assert match_cuda_device("NVIDIA L40S") is None
    assert match_cuda_device("NVIDIA H100 80GB HBM3").name == "h100-sxm"
    assert match_cuda_device("NVIDIA H100 PCIe").name == "h100-pcie"
    assert match_cuda_device("NVIDIA A100-SXM4-40GB").name == "a100-40gb-sxm"


MISTRAL_CONFIG = {
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
    "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "vocab_size": 32000, "max_position_embeddings": 32768, "tie_word_embeddings": False,
}


def test_model_profile_from_hf_config(tmp_path, mistral):
    model_dir = tmp_path / "My-Mistral"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(MISTRAL_CONFIG))
    for path in (model_dir, model_dir / "config.json"):
        m = load_model_profile(str(path))
        assert m.name == "My-Mistral"
        assert (m.layers, m.heads, m.kv_heads, m.head_dim, m.parameters, m.max_context) == \
            (32, 32, 8, 128, mistral.parameters, 32768)
        assert (m.default_bits, m.default_k, m.default_k_current) == (2, 256, 128)  # CacheConfig's defaults and K_CURRENT
    small = model_profile_from_config({**MISTRAL_CONFIG, "hidden_size": 576, "num_attention_heads": 9,
                                       "num_key_value_heads": 3, "intermediate_size": 1536, "num_hidden_layers": 30,
                                       "vocab_size": 49152, "tie_word_embeddings": True})
    assert small.parameters == load_model_profile("smollm2-135m").parameters
    assert (small.default_bits, small.default_k, small.default_k_current) == (2, 256, 128)


def test_default_k_per_prefetch():
    """The embedded model's profile keeps one k per prefetch mode (they select differently);
    model_defaults gives the device's mode with its k, or the mode asked for with its k."""
    from types import SimpleNamespace

    import torch

    from engine.model.loading import EMBEDDED_NAME
    from engine.plan.profiles import model_defaults

    smol = load_model_profile("smollm2-135m")
    assert smol.default_k_current is not None and smol.default_k_current != smol.default_k
    assert smol.k_for("current") == smol.default_k_current and smol.k_for("speculative") == smol.default_k
    cpu = SimpleNamespace(name=EMBEDDED_NAME, device=torch.device("cpu"))
    assert model_defaults(cpu) == {"bits": smol.default_bits, "group": smol.default_group,
                                   "k": smol.default_k_current, "k_grows": True, "prefetch": "current"}
    assert model_defaults(cpu, "speculative")["k"] == smol.default_k
    gpu = SimpleNamespace(name=EMBEDDED_NAME, device=torch.device("cuda"))
    assert (model_defaults(gpu)["prefetch"], model_defaults(gpu)["k"]) == ("speculative", smol.default_k)
    other = load_model_profile("mistral-7b")  # no k of its own for current: default_k serves both
    assert other.k_for("current") == other.k_for("speculative") == other.default_k


def test_plan_takes_the_k_of_the_devices_prefetch(a6000):
    """specache plan uses the k the engine would use there: current's on a CPU, speculative's on a GPU."""
    smol = load_model_profile("smollm2-135m")
    assert P.plan(load_hardware("cpu"), smol, 4096).k == smol.default_k_current
    assert P.plan(a6000, smol, 4096).k == smol.default_k
    assert P.plan(load_hardware("cpu"), smol, 4096, P.cache_for(smol, load_hardware("cpu"), k=300)).k == 300


def test_a_default_k_grows_on_a_cpu_only(a6000):
    """With the current prefetch (a CPU) the profile's k doubles at 1 bit and is at least the context / K_SHARE
    in whole 32s; a k given is the k; the speculative prefetch (a GPU, where k is what the PCIe hides) keeps the
    profile's."""
    from engine.config import K_SHARE, ONE_BIT_K, CacheConfig

    smol, cpu = load_model_profile("smollm2-135m"), load_hardware("cpu")
    k = smol.default_k_current
    assert P.cache_for(smol, cpu).k_grows and not P.cache_for(smol, a6000).k_grows
    assert P.plan(cpu, smol, k * K_SHARE).k == k  # up to k * K_SHARE tokens: the profile's k
    assert P.plan(cpu, smol, k * K_SHARE + 1).k == k + 32
    assert P.plan(cpu, smol, 8000, P.cache_for(smol, cpu, bits=1)).k == ONE_BIT_K * k
    assert P.plan(cpu, smol, 32768, P.cache_for(smol, cpu, k=100)).k == 100  # --k pins it
    assert P.plan(a6000, smol, 32768).k == smol.default_k
    config = CacheConfig(k=128, k_grows=True)
    assert [config.fetch_k(n) for n in (100, K_SHARE * 128, K_SHARE * 128 + 1)] == [128, 128, 160]
    assert config.with_overrides(bits=1).fetch_k(100) == ONE_BIT_K * 128
    assert config.with_overrides(k=24).fetch_k(10**6) == 24 and config.with_overrides(bits=1).k_grows
    assert CacheConfig(k=0, k_grows=True).fetch_k(10**6) == 0  # kivi's k = 0 stays 0


def test_the_cache_fetches_the_grown_k_and_the_window_matches_it():
    """make_cache builds the specache layers with fetch_k of the cache's length; window mode's default W
    matches specache's device bytes at that k."""
    import torch

    from engine.config import K_SHARE, CacheConfig
    from engine.kvcache import ModelShape, make_cache
    from engine.kvcache.sizes import window_tokens
    from tests.conftest import tiny_config

    cfg, length = tiny_config(), K_SHARE * 32 * 4 + 1  # fetch_k: 5 x 32
    for mode in ("specache", "window"):
        config = CacheConfig(mode=mode, k=32, k_grows=True, group=32)
        with make_cache(cfg, config, 1, length, torch.float32, torch.device("cpu")) as cache:
            layer = cache.policy_layers[0]
            if mode == "specache":
                assert layer.topk == 160
            else:
                shape = ModelShape.from_config(cfg)
                assert layer.residual == window_tokens(shape, length, 2, 32, 160, config.residual, 4)
                assert layer.residual != window_tokens(shape, length, 2, 32, 32, config.residual, 4)


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


GOOD_GPU = """name: test-gpu
display_name: Test GPU
kind: cuda
device_memory_mib: 16384
memory_bandwidth_gbps: 500
matmul_tflops: 100
pcie_gen: 4
pcie_lanes: 16
h2d_gbps: 20
"""


@pytest.mark.parametrize("edit, field, problem", [
    (("memory_bandwidth_gbps: 500", "memory_bandwidth_gbps: fast"), "memory_bandwidth_gbps", "wrong type"),
    (("matmul_tflops: 100\n", ""), "matmul_tflops", "missing"),
    (("h2d_gbps: 20", "h2d_gbps: 20\nh2d_gbs: 3"), "h2d_gbs", "not a known field"),
    (("h2d_gbps: 20", "h2d_gbps: 40"), "h2d_gbps", "exceeds the PCIe link"),
    (("kind: cuda", "kind: tpu"), "kind", "must be one of"),
    (("matmul_tflops: 100", "matmul_tflops: -1"), "matmul_tflops", "must be > 0"),
    (("pcie_lanes: 16", "pcie_lanes: true"), "pcie_lanes", "wrong type"),
])
def test_malformed_hardware_profile(tmp_path, edit, field, problem):
    load_hardware(write(tmp_path, "ok.yaml", GOOD_GPU))  # the unedited profile is valid
    path = write(tmp_path, "bad.yaml", GOOD_GPU.replace(*edit))
    with pytest.raises(ProfileError) as err:
        load_hardware(path)
    message = str(err.value)
    assert message.startswith(f"{path}: field '{field}'") and problem in message and "\n" not in message


def test_malformed_model_profile_and_yaml(tmp_path):
    good = (Path(__file__).parent.parent / "profiles" / "models" / "mistral-7b.yaml").read_text()
    bad = write(tmp_path, "m.yaml", good.replace("kv_heads: 8", "kv_heads: 5"))
    with pytest.raises(ProfileError, match=r"m\.yaml: field 'kv_heads' \(5\) must divide heads \(32\)"):
        load_model_profile(bad)
    broken = write(tmp_path, "broken.yaml", "name: [unclosed\n")
    with pytest.raises(ProfileError, match=r"broken\.yaml: not valid YAML"):
        load_model_profile(broken)
    zero_k = write(tmp_path, "k.yaml", good + "default_k_current: 0\n")
    with pytest.raises(ProfileError, match=r"k\.yaml: field 'default_k_current' must be > 0, not 0"):
        load_model_profile(zero_k)
    listing = write(tmp_path, "list.yaml", "- 1\n- 2\n")
    with pytest.raises(ProfileError, match=r"list\.yaml: expected a mapping"):
        load_hardware(listing)
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    (cfg / "config.json").write_text(json.dumps({k: v for k, v in MISTRAL_CONFIG.items() if k != "vocab_size"}))
    with pytest.raises(ProfileError, match=r"config\.json: field 'vocab_size' is missing"):
        load_model_profile(str(cfg))


def test_malformed_profile_exit_code(tmp_path):
    path = write(tmp_path, "bad.yaml", GOOD_GPU.replace("matmul_tflops: 100", "matmul_tflops: lots"))
    r = run_cli("--gpu", path, "--model", "mistral-7b", "--context", "1024")
    assert r.exit_code == 11
    assert f"{path}: field 'matmul_tflops'" in r.stderr and r.stdout == ""


# --- the plan ------------------------------------------------------------------------------------

def test_paper_validation_a6000_mistral_32k(a6000, mistral):
    """Paper: full cache batch 3, 1-bit SpeCache about 36 (docs/planner.md, "Validation")."""
    p = P.plan(a6000, mistral, 32768, P.cache_for(mistral, a6000, bits=1, outliers=0), reference="paper")  # the paper's guide
    full, spec = p.mode("full"), p.mode("specache")
    assert 3 * 0.8 <= full.max_batch <= 3 * 1.2
    assert 36 * 0.8 <= spec.max_batch <= 36 * 1.2 and spec.limited_by == "device"
    assert (full.max_batch, spec.max_batch) == (3, 42)
    doc = DOCS.read_text()  # the doc's table shows what the planner gives
    assert "| full cache | 3 | 3 |" in doc and "| SpeCache 1-bit | 36 | 42 |" in doc
    # this engine's own full cache (rows prefilled one at a time in 512-token chunks)
    assert P.plan(a6000, mistral, 32768, P.cache_for(mistral, a6000, bits=1)).mode("full").max_batch == 7
    # a 160 GB host caps the exact store at 36 sequences (the doc's host-RAM paragraph)
    one_bit = P.cache_for(mistral, a6000, bits=1, outliers=0)
    assert P.plan(a6000, mistral, 32768, one_bit, host_ram_bytes=160 * GIB).mode("specache").max_batch == 36


def test_plan_defaults_and_limits(a6000):
    smol = load_model_profile("smollm2-135m")
    p = P.plan(a6000, smol, 4096)
    assert (p.bits, p.k) == (2, 476)  # the model profile's defaults
    assert p.mode("specache").k == 476 and p.mode("kivi").k == 0 and p.mode("full").k == 0
    assert P.plan(a6000, smol, 4096, batch_limit=5).mode("kivi").max_batch == 5
    assert P.plan(a6000, smol, 4096, batch_limit=5).mode("kivi").limited_by == "batch_limit"
    small = P.plan(a6000, smol, 100, P.cache_for(smol, a6000, k=1000))
    assert small.k == 100 and any("exceeds the context" in n for n in small.notes)
    long = P.plan(a6000, smol, 10_000)
    assert any("exceeds" in n and "8192" in n for n in long.notes)
    with pytest.raises(BadArgument, match="--bits"):
        P.plan(a6000, smol, 1024, P.cache_for(smol, a6000, bits=3))
    with pytest.raises(BadArgument, match="--context"):
        P.plan(a6000, smol, 0)


def test_nothing_fits_and_speedup_none():
    p = P.plan(load_hardware("l4"), load_model_profile("llama-3-70b"), 8192)
    assert all(mp.max_batch == 0 for mp in p.modes)
    assert p.mode("specache").predicted_speedup_vs_full is None
    assert any("weights alone" in n for n in p.notes)


def test_cpu_profile_counts_the_exact_store_on_the_device():
    cpu, smol = load_hardware("cpu"), load_model_profile("smollm2-135m")
    plan = P.plan(cpu, smol, 8192)
    sp = plan.mode("specache")
    assert sp.device_breakdown["host_store"] == 8192 * S.kv_bytes_per_token(smol, 2)  # bf16 on the CPU by default
    assert sp.host_bytes_per_sequence == 8192 * S.kv_bytes_per_token(smol, 2)
    assert sp.device_breakdown["residual_window"] > 0  # (the window keeps fp32 buffers of its own)
    assert plan.mode("exact").device_breakdown["host_store"] == 8192 * S.kv_bytes_per_token(smol, 4)  # as full's
    fp32 = P.plan(cpu, smol, 8192, P.cache_for(smol, cpu, store_dtype="fp32")).mode("specache")
    assert fp32.device_breakdown["host_store"] == 8192 * S.kv_bytes_per_token(smol, 4)
    assert fp32.device_breakdown["residual_window"] == 0  # the store's own positions
    assert P.plan(cpu, smol, 8192, host_ram_bytes=GIB).host_ram_bytes is None  # one pool: no separate check


def test_plan_for_run(a6000, mistral):
    mp = P.plan_for_run(MISTRAL_CONFIG, 32768, POLICIES["specache"], hardware=a6000)
    # a config without a profile: CacheConfig's 2-bit guide, k 256 speculative (the GPU's prefetch); with the
    # 1-bit k 64 guide of the first defaults it was (51, 64)
    assert (mp.max_batch, mp.k) == (35, 256)
    assert P.plan_for_run(mistral, 32768, POLICIES["full"], hardware=a6000).max_batch == 7
    # the model already loaded: free memory excludes the weights, which the planner adds back
    loaded = replace(a6000, free_memory_bytes=a6000.device_memory_bytes - 512 * MIB - R.weight_bytes(mistral))
    assert P.plan_for_run(mistral, 32768, POLICIES["full"], hardware=loaded, weights_resident=True).max_batch == 7
    with pytest.raises(DoesNotFit):
        P.plan_for_run(load_model_profile("llama-3-70b"), 8192, POLICIES["specache"], hardware=load_hardware("l4"))
    with pytest.raises(BadArgument, match="not 'nowhere'"):  # a policy sized by no column
        P.plan_for_run(mistral, 1024, type("Unplanned", (), {"plan_mode": "nowhere"}), hardware=a6000)


# --- detection -----------------------------------------------------------------------------------

def test_detect_without_cuda(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    hw = P.detect_hardware()
    total, _ = M.machine_ram_bytes()
    assert hw.kind == "cpu" and hw.name == "cpu"
    assert hw.device_memory_bytes == total == hw.host_ram_bytes
    assert 0 < hw.free_memory_bytes <= total
    assert hw.source.startswith("detected: no CUDA device")
    r = run_cli("--gpu", "auto", "--model", "smollm2-135m", "--context", "2048", "--json")
    assert r.exit_code == 0, r.stderr
    assert "no CUDA device found" in r.stderr
    out = json.loads(r.stdout)
    assert out["gpu"] == "cpu" and out["hardware"]["device_memory_bytes"] == total


def test_detect_cuda_is_mocked_without_a_gpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA RTX A6000")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=0: (40 * GIB, 47 * GIB))
    hw = P.detect_hardware(measure=False)
    assert hw.name == "rtx-a6000" and hw.device_memory_bytes == 47 * GIB and hw.free_memory_bytes == 40 * GIB
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA Mystery 9000")
    assert P.detect_hardware(measure=False).name == "cuda-generic"


# --- CLI: golden JSON and table ------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
def test_golden_json_and_table(name):
    args = GOLDEN_CASES[name]
    r_json, r_table = run_cli(*args, "--json"), run_cli(*args)
    assert r_json.exit_code == 0 and r_table.exit_code == 0, r_json.stderr + r_table.stderr
    got_json = json.loads(r_json.stdout)
    json_path, table_path = GOLDEN / f"{name}.json", GOLDEN / f"{name}.txt"
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.mkdir(exist_ok=True)
        json_path.write_text(json.dumps(got_json, indent=2) + "\n")
        table_path.write_text(r_table.stdout)
    assert got_json == json.loads(json_path.read_text())
    assert r_table.stdout == table_path.read_text()


def test_json_contract():
    r = run_cli(*GOLDEN_CASES["plan_a6000_mistral7b_32k"], "--json")
    out = json.loads(r.stdout)
    assert {"gpu", "model", "context", "modes"} <= set(out)
    assert (out["gpu"], out["model"], out["context"]) == ("rtx-a6000", "mistral-7b", 32768)
    assert [m["mode"] for m in out["modes"]] == ["full", "kivi", "specache", "exact"]
    for mode in out["modes"]:
        assert MODE_KEYS <= set(mode)
        assert isinstance(mode["prefetch_hidden"], bool) and isinstance(mode["max_batch"], int)


@pytest.mark.parametrize("args, message", [
    (["--context", "0"], "--context must be >= 1"),
    (["--context", "1024", "--bits", "3"], "--bits must be 1 or 2"),
    (["--context", "1024", "--group", "48"], "--group must be one of 32, 64, 128"),
    (["--context", "1024", "--host-ram", "0"], "--host-ram must be > 0"),
    (["--context", "1024", "--reference", "vllm"], "--reference must be one of"),
    (["--context", "1024", "--gpu", "tpu-v9"], "unknown hardware profile"),
])
def test_bad_flags(args, message):
    r = run_cli("--gpu", "rtx-a6000", *args) if "--gpu" not in args else run_cli(*args)
    assert r.exit_code == 2
    assert message in r.stderr and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1


# --- the planner and the engine share engine.kvcache.sizes ------------------------------------------

@pytest.mark.parametrize("mode,bits,group,k,sinks,outliers", [("full", 2, 64, 0, 4, 0), ("kivi", 1, 32, 0, 0, 0),
                                                             ("specache", 2, 64, 48, 4, 0), ("specache", 1, 32, 16, 2, 0),
                                                             ("specache", 1, 128, 16, 4, 4), ("kivi", 2, 64, 0, 4, 3),
                                                             ("specache", 2, 64, 48, 4, None)])  # None: the default
def test_planner_bytes_per_sequence_equal_the_built_cache(mode, bits, group, k, sinks, outliers):
    """The planner's device bytes per sequence are what a built cache of the same settings allocates
    (tiny GQA model, fp32, a context of whole 64-token blocks), part by part on the device; on a CPU,
    where the host store is device memory too, the planner's host_store part is the store's bytes."""
    import torch

    from engine.config import CacheConfig
    from engine.kvcache import make_cache
    from tests.conftest import tiny_config

    config, context, chunk, residual = tiny_config(), 640, 128, 32
    hw = load_hardware("cpu")
    model = model_profile_from_config(config)
    settings = CacheConfig(bits=bits, group=group, k=k, residual=residual, sinks=sinks, chunk_size=chunk,
                           outliers=outliers)
    mp = P.plan(hw, model, context, settings, element_bytes=4).mode(mode)
    cache = make_cache(config, CacheConfig(mode=mode, bits=bits, group=group, k=k, residual=residual, sinks=sinks,
                                           chunk_size=chunk, outliers=outliers), 2, context, torch.float32,
                       torch.device("cpu"))
    parts = {n: b for n, b in mp.device_breakdown.items() if n not in ("decode_working_set", "prefill_activations")}
    host = parts.pop("host_store", 0)  # the resident state; the transient working sets are the model's
    assert sum(parts.values()) == cache.allocated_device_bytes()
    stores = [layer.store for layer in cache.layers if getattr(layer, "store", None) is not None]
    assert host == (sum((s.k.numel() + s.v.numel()) * s.k.element_size() for s in stores) // 2 if mode != "full" else 0)
    assert all(s.k.dtype == torch.bfloat16 for s in stores)  # (the CPU's default: the planner counts 2 bytes)
