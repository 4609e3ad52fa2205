"""A run's model is resolved once and read through one object (engine.model.files.ModelFiles): one window
rule, and the plan in --json names the k the cache fetches."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from engine.model import sources
from engine.model.files import FALLBACK_WINDOW, ModelFiles, context_window, model_files
from specache_cli.app import app

DATA = Path(__file__).parent / "data"


@pytest.fixture
def resolutions(monkeypatch) -> list:
    """Every call of resolve_source, through whichever module imported it."""
    calls, original = [], sources.resolve_source

    def counted(spec):
        calls.append(spec)
        return original(spec)

    for module in list(sys.modules.values()):
        if getattr(module, "resolve_source", None) is original:
            monkeypatch.setattr(module, "resolve_source", counted)
    return calls


@pytest.mark.parametrize("command", [
    ["summarize", str(DATA / "sample.txt"), "--max-tokens", "3"],
    ["ask", "--doc", str(DATA / "sample.txt"), "Why?", "--max-tokens", "3"],
])
def test_the_model_is_resolved_once_per_command(tiny_model_dir, resolutions, command):
    r = CliRunner().invoke(app, [*command, "--model", str(tiny_model_dir), "--quiet", "--no-store", "--json"],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.stderr
    assert resolutions == [str(tiny_model_dir)]


def test_the_embedded_model_is_resolved_once_and_its_window_read_from_its_header(resolutions, monkeypatch):
    files = model_files(None)
    monkeypatch.setattr(ModelFiles, "folder", property(lambda self: pytest.fail("converted to read the window")))
    assert files.window == files.header.fields["llama.context_length"] == 8192
    assert files.is_gguf and resolutions == [None]


@pytest.mark.parametrize("config, window", [
    ({"max_position_embeddings": 1024}, 1024),
    ({"n_positions": 2048}, 2048),
    ({"text_config": {"max_position_embeddings": 512}}, 512),
    ({"max_position_embeddings": 0, "seq_length": 300}, 300),
    ({"max_position_embeddings": True}, FALLBACK_WINDOW),
    ({}, FALLBACK_WINDOW),
])
def test_one_window_rule(config, window):
    assert context_window(config) == window


def test_config_read_once_and_a_bad_one_is_one_error(tmp_path, monkeypatch):
    from engine.errors import ModelLoadError

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 777}))
    files = model_files(str(tmp_path))
    assert files.window == 777
    (tmp_path / "config.json").write_text("{not json")
    assert files.config["max_position_embeddings"] == 777  # read once: the file is not read again
    with pytest.raises(ModelLoadError, match="cannot be read"):
        _ = model_files(str(tmp_path)).config


def test_the_plan_names_the_k_the_cache_fetches(tiny_model_dir):
    """A 1-bit guide doubles the default k (CacheConfig.fetch_k): the plan says the cache's k, not the base."""
    r = CliRunner().invoke(app, ["summarize", str(DATA / "sample.txt"), "--model", str(tiny_model_dir), "--quiet",
                                 "--no-store", "--json", "--max-tokens", "3", "--cache", "specache", "--bits", "1"],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.stderr
    obj = json.loads(r.stdout)
    assert obj["plan"]["k"] == obj["cache"]["k"]


def test_a_model_our_decoders_do_not_run_says_why_once(tiny_model_dir, tmp_path):
    """A Llama folder with an activation our decoders lack loads through transformers' classes, and says so."""
    import shutil

    from engine.model.loading import load_model
    from tests.conftest import make_tiny_model

    for f in tiny_model_dir.iterdir():
        if not f.name.endswith((".safetensors", "config.json")) or f.name.startswith(("tokenizer", "generation")):
            shutil.copy(f, tmp_path / f.name)
    model = make_tiny_model(vocab=len(json.loads((tiny_model_dir / "tokenizer.json").read_text())["model"]["vocab"]),
                            max_pos=1024, layers=1)
    model.config.hidden_act = "gelu"
    model.save_pretrained(tmp_path)
    warnings: list[str] = []
    lm = load_model(str(tmp_path), device="cpu", on_warning=warnings.append)
    assert type(lm.model).__module__.startswith("transformers.")
    assert len(warnings) == 1 and "activation 'gelu'" in warnings[0], warnings
    warnings.clear()
    load_model(str(tiny_model_dir), device="cpu", on_warning=warnings.append)  # our decoders: nothing to say
    assert warnings == []


def test_a_failed_native_build_is_one_warning_naming_the_compilers_error(tiny_model_dir, monkeypatch):
    from engine import native
    from engine.model import loading

    error = ("CalledProcessError: cc -O3 guide_kernels.c: exit 1: In file included from simd.h:3:\n"
             "guide_kernels.c:12:5: error: unknown type name 'v16sf'\n1 error generated.")
    monkeypatch.setattr(native, "lib", lambda: None)
    monkeypatch.setattr(native, "native_error", lambda: error)
    warnings: list[str] = []
    loading.load_model(str(tiny_model_dir), device="cpu", on_warning=warnings.append)
    assert warnings == ["the native CPU kernels are unavailable (guide_kernels.c:12:5: error: unknown type name "
                        "'v16sf'): torch's kernels run instead, slower"]
    monkeypatch.setattr(native, "native_error", lambda: None)  # disabled on purpose (SPECACHE_NATIVE=0): silent
    warnings.clear()
    loading.load_model(str(tiny_model_dir), device="cpu", on_warning=warnings.append)
    assert warnings == []
