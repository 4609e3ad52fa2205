"""`specache bench fidelity` on models with sliding-window layers (on Gemma 3 it once ended in
"probe pass 1 of layer 0 is not the expected one-token pass"): the selection quality is scored on the
layers that fetch, the window layers (which keep their window exact) are left out, and a softcapped
model's attention is capped as the model caps it."""
from __future__ import annotations

import json
import random

import pytest
import torch
from typer.testing import CliRunner

from engine.kvcache.base import sliding_windows
from specache_cli.app import app
from tests.tiny_archs import VOCAB, save_model_dir, tiny_model

EXACT = "specache-k4096"  # k >= every context: every position exact


@pytest.fixture(scope="module")
def words(tmp_path_factory):
    """A document of the tiny word tokenizer's words (so every architecture tokenizes it)."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("doc") / "words.txt"
    path.write_text(" ".join(f"w{rng.randrange(3, VOCAB)}" for _ in range(900)))
    return path


@pytest.mark.parametrize("name", ["gemma3", "gemma2", "mistral-window"])
def test_bench_fidelity_runs_on_a_windowed_model(name, words, tmp_path):
    model = tiny_model(name)
    folder = save_model_dir(model, tmp_path / name)
    windows = sliding_windows(model.config)
    global_layers = [i for i, w in enumerate(windows) if w is None]
    old = torch.get_num_threads()
    try:
        r = CliRunner().invoke(app, ["bench", "fidelity", "--quick", "--model", str(folder), "--doc", str(words),
                                     "--out", str(tmp_path / "out"), "--threads", "1", "--json", "--tokens", "8",
                                     "--modes", f"full,specache,{EXACT},exact"], catch_exceptions=False)
    finally:
        torch.set_num_threads(old)
    assert r.exit_code == 0, r.stderr
    result = json.loads(r.stdout)
    per = result["per_mode"]
    rows = {row["mode"]: row for row in result["rows"]}
    assert per["exact"]["top1_agreement"] == 1.0 and per[EXACT]["top1_agreement"] == 1.0
    assert per[EXACT]["mean_kl"] < 1e-4
    for label in ("specache", EXACT):
        sel = rows[label]["selection"]
        if not global_layers:  # every layer keeps its window: nothing is fetched, nothing to score
            assert sel is None
            continue
        assert [x["layer"] for x in sel["per_layer"]] == global_layers  # the window layers are left out
        assert sel["samples"] > 0
    fetched = per[EXACT]["selection"]["fetched"] if global_layers else None
    if fetched is not None:  # every position fetched: the whole region's mass (softcap applied as the model does)
        assert fetched["recall"] == pytest.approx(1.0) and fetched["coverage"] == pytest.approx(1.0)
