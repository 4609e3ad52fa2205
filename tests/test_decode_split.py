"""scripts/decode_split.py (the long-context decode measurement of issue 51): the per-group score bound it
reports bounds every guide score of the group (rotated and outlier-split guides, 1 and 2 bits), its mass and
skip figures are what they claim on known inputs, and a run on a tiny model gives every figure."""
from __future__ import annotations

import importlib.util
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from engine.config import CacheConfig

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def split():
    spec = importlib.util.spec_from_file_location("decode_split", ROOT / "scripts" / "decode_split.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def sampled_calls(split, model, bits: int, rotation: str, length: int = 1100):
    """The fused calls of the last decode step of a `length`-token random prompt, kept by the recorder."""
    config = CacheConfig(mode="specache", bits=bits, group=32, k=16, prefetch="current", rotation=rotation)
    prompt = torch.randint(3, 300, (length,), generator=torch.Generator().manual_seed(bits)).tolist()
    rec = split.Recorder()
    rec.install()
    try:
        point = split.measure_length(model, config, prompt, Namespace(steps=2, sample=1, eps=1e-3), rec)
    finally:
        rec.remove()
    return point


@pytest.mark.parametrize("bits,rotation", [(2, "hadamard"), (1, "none"), (2, "none")])
def test_group_bound_is_above_every_guide_score_of_its_group(split, tiny_model, bits, rotation, monkeypatch):
    calls = []
    monkeypatch.setattr(split, "analyse", lambda kept, eps: calls.append(kept) or {})
    sampled_calls(split, tiny_model, bits, rotation)
    assert calls, "no fused decode call was recorded"
    for layer, qg, scaling, *_ in calls:
        n, g = int(layer.qend[0]), layer.guide.group
        q = qg[:1].float() * scaling
        scores = layer.guide.scores(q, slice(0, 1), n)[0]  # [H, Q, n]
        top = scores.unflatten(-1, (n // g, g)).amax(-1)
        bound = split.key_bounds(layer, q, n)
        assert (bound >= top - 1e-4 * top.abs().clamp_min(1)).all()
        assert torch.isfinite(bound).all()
        sup = split.key_bounds(layer, q, n, 4)  # a unit of 4 groups bounds each of its groups' bounds
        padded = torch.nn.functional.pad(bound, (0, -bound.shape[-1] % 4), value=float("-inf"))
        assert (sup >= padded.unflatten(-1, (-1, 4)).amax(-1) - 1e-4).all()


def test_blocks_holding_and_skippable_on_known_inputs(split):
    p = torch.zeros(1, 1, 128)  # 4 blocks of 32
    p[..., 5] = 1.0
    assert split.blocks_holding(p, 0.999).item() == 0.25
    p[..., 40] = 1.0
    assert split.blocks_holding(p, 0.999).item() == 0.5
    bound = torch.tensor([[[0.0, -30.0, -30.0, 10.0]]])
    mx, z = torch.tensor([[[10.0]]]), torch.tensor([[[1.0]]])
    assert split.skippable(bound, 64, mx, z, 1e-3).item() == 0.5  # only the two far below the max
    assert split.skippable(bound, 64, mx, z, 0.0).item() == 0.0


def test_a_tiny_model_run_gives_every_figure(split, tiny_model):
    point = sampled_calls(split, tiny_model, 2, "hadamard")
    s = point["sampled"]
    assert point["guided_layers"] == 3 and s["layer_calls"] == 3
    for key in ("region_mass", "blocks_99", "blocks_999", "groups_skippable", "superblocks_skippable",
                "top10pct_groups_mass", "cand25_mass_held"):
        assert 0.0 <= s[key] <= 1.0, key
    assert s["blocks_99"] <= s["blocks_999"]
    assert s["cand10_mass_held"] <= s["cand25_mass_held"] + 1e-6
    assert s["call_us"] > 0 and s["scores_us"] > 0 and s["values_us"] > 0
