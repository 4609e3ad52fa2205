"""A run's model is resolved once and read through one object (engine.model.files.ModelFiles), in a run
prepared once below the CLI (engine.jobs.prepare): its config.json read once per command, one window rule for
the CLI's checks, the planner and the loader, -v saying how the run was prepared (and nothing new without it), a
CLI that imports few engine modules, and the plan in --json naming the k the cache fetches."""
from __future__ import annotations

import ast
import json
import shutil
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from engine.model import sources
from engine.model.files import FALLBACK_WINDOW, ModelFiles, context_window, model_files
from specache_cli.app import app

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).parent / "data"
OPENED: list[str] = []  # every file opened while a test listens (the audit hook below; hooks cannot be removed)
LISTENING = [False]


def _audit(event: str, args: tuple) -> None:
    if LISTENING[0] and event == "open" and isinstance(args[0], (str, Path)):
        OPENED.append(str(args[0]))


sys.addaudithook(_audit)


@pytest.fixture
def opened():
    """The paths of the files this test opens (io.open, os.open: whoever reads them)."""
    OPENED.clear()
    LISTENING[0] = True
    yield OPENED
    LISTENING[0] = False


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
def test_the_model_is_resolved_once_and_its_config_read_once_per_command(tiny_model_dir, resolutions, opened,
                                                                          command):
    r = CliRunner().invoke(app, [*command, "--model", str(tiny_model_dir), "--quiet", "--no-store", "--json"],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.stderr
    assert resolutions == [str(tiny_model_dir)]
    assert opened.count(str(tiny_model_dir / "config.json")) == 1, [p for p in opened if p.endswith("config.json")]


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


def cli(*args: str):
    return CliRunner().invoke(app, list(args), catch_exceptions=False)


def test_the_embedded_model_s_converted_config_is_read_once(embedded_dir, resolutions, opened):
    r = cli("summarize", str(DATA / "sample.txt"), "--max-tokens", "3", "--no-store", "--json", "--quiet")
    assert r.exit_code == 0, r.stderr
    assert resolutions == [None]
    assert opened.count(str(embedded_dir / "config.json")) == 1


@pytest.fixture
def windowless_dir(tiny_model_dir, tmp_path) -> Path:
    """The tiny model with a config.json that names no window (max_position_embeddings removed)."""
    out = tmp_path / "windowless"
    shutil.copytree(tiny_model_dir, out)
    config = json.loads((out / "config.json").read_text())
    del config["max_position_embeddings"]
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_one_window_rule_for_the_cli_the_planner_and_the_loader(windowless_dir):
    """A config without a window key: the CLI's checks, the planner's profile (of the folder, and of the loaded
    model at run time) and the loaded model all take FALLBACK_WINDOW (transformers' LlamaConfig would say 2048)."""
    from engine.jobs.prepare import PreparedRun, RunRequest
    from engine.model.loading import load_model
    from engine.plan.profiles import load_model_profile, loaded_model_profile, model_profile_from_config

    run = PreparedRun(RunRequest(model=str(windowless_dir), device="cpu", store=False))
    lm = load_model(run.files, device="cpu")
    config = json.loads((windowless_dir / "config.json").read_text())
    windows = {"cli": run.window, "loader": lm.max_context,
               "planner (folder)": load_model_profile(str(windowless_dir)).max_context,
               "planner (config)": model_profile_from_config(config).max_context,
               "planner (loaded model)": loaded_model_profile(lm).max_context}
    assert set(windows.values()) == {FALLBACK_WINDOW}, windows
    assert lm.model.config.max_position_embeddings != FALLBACK_WINDOW  # the config class's own default differs


def test_the_cli_refuses_flags_past_the_window_the_rule_gives(windowless_dir):
    r = cli("summarize", str(DATA / "sample.txt"), "--model", str(windowless_dir), "--no-store",
            "--k", str(FALLBACK_WINDOW + 1))
    assert r.exit_code == 2 and f"window of {FALLBACK_WINDOW} tokens" in r.stderr, r.stderr


def test_verbose_says_how_the_run_was_prepared_and_nothing_new_without_it(tiny_model_dir):
    args = ["summarize", str(DATA / "sample.txt"), "--model", str(tiny_model_dir), "--max-tokens", "3", "--no-store",
            "--threads", "1", "--json"]
    plain, verbose = cli(*args), cli(*args, "-v")
    assert plain.exit_code == verbose.exit_code == 0, verbose.stderr
    steps = [line for line in verbose.stderr.splitlines() if line.startswith("-v ")]
    said = " ".join(steps)
    assert f"folder: {tiny_model_dir}" in said and "model type 'llama'" in said
    assert "window: 1024 tokens (config.json's max_position_embeddings)" in said
    assert "threads: 1 " in said and "(--threads)" in said
    assert "defaults: bits " in said and "given: none" in said
    assert "decoder: the engine's CausalLM, weights in float32, not held as stored: its files hold no 16-bit" in said
    assert not [line for line in plain.stderr.splitlines() if line.startswith("-v ")]
    assert len(plain.stderr.splitlines()) == len(verbose.stderr.splitlines()) - len(steps)
    strip = ("prefill_seconds", "decode_seconds", "decode_tokens_per_second")
    assert {k: v for k, v in json.loads(plain.stdout).items() if k not in strip} == \
        {k: v for k, v in json.loads(verbose.stdout).items() if k not in strip}


def test_verbose_names_the_given_settings_a_gguf_window_from_its_header_and_why_it_is_not_held():
    r = cli("summarize", str(DATA / "sample.txt"), "--max-tokens", "3", "--no-store", "--quiet", "-v", "--k", "64",
            "--dtype", "float32")
    assert r.exit_code == 0, r.stderr
    assert "window: 8192 tokens (the GGUF header's llama.context_length)" in r.stderr
    assert "format: GGUF, architecture llama" in r.stderr and "given: k 64" in r.stderr
    assert "not held as stored: --dtype float32 on cpu" in r.stderr


def test_a_worker_s_copy_is_silent_and_keeps_the_resolved_model(tiny_model_dir):
    from engine.jobs.prepare import Notes, PreparedRun, RunRequest

    said: list[str] = []
    run = PreparedRun(RunRequest(model=str(tiny_model_dir), store=False), Notes(status=said.append))
    own = run.for_worker()
    assert own.files.source == run.files.source and own.files.on_status is None
    assert own.notes == Notes() and own.pick_threads is False and run.pick_threads is True


ENGINE_IMPORTS_OF_THE_RUN_COMMANDS = {"engine.errors", "engine.inputs.documents", "engine.jobs.pipeline",
                                      "engine.jobs.prepare", "engine.jobs.workers"}


def test_the_run_commands_do_no_engine_work():
    """specache_cli/run_cmds.py takes the preparation from engine.jobs.prepare: it imports no model, cache,
    planner or store module (before: 14 engine modules)."""
    tree = ast.parse((ROOT / "specache_cli" / "run_cmds.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)} | \
        {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    engine = {m for m in imported if m and m.split(".")[0] == "engine"}
    assert engine <= ENGINE_IMPORTS_OF_THE_RUN_COMMANDS, engine - ENGINE_IMPORTS_OF_THE_RUN_COMMANDS
    assert "torch" not in imported


def test_a_gguf_s_window_from_its_header_agrees_with_its_converted_config():
    files = model_files(None)
    from_header = files.window
    assert files.config["max_position_embeddings"] == from_header
    assert files.window_origin.startswith("config.json's") and files.window == from_header


def test_plan_of_a_gguf_resolves_it_once_and_converts_nothing(resolutions, opened, monkeypatch):
    """`specache plan --model FILE.gguf` takes the model through the run's ModelFiles, its config made from the
    GGUF header (ModelFiles.plan_config): no conversion, no config.json read."""
    gguf = model_files(None).source.gguf
    monkeypatch.setattr(ModelFiles, "folder", property(lambda self: pytest.fail("converted for its config")))
    resolutions.clear()
    opened.clear()
    r = cli("plan", "--gpu", "cpu", "--model", str(gguf), "--json")
    assert r.exit_code == 0, r.stderr
    assert resolutions == [str(gguf)] and not [p for p in opened if p.endswith("config.json")]
    assert json.loads(r.stdout)["model_profile"]["max_context"] == 8192


def test_a_gguf_s_profile_from_its_header_is_its_converted_config_s(tmp_path, monkeypatch):
    """The header's config gives the planner what the converted config.json gives (the embedded Llama and a tiny
    Gemma 3 GGUF); an architecture the header does not give falls back to the conversion."""
    from engine.model.gguf_config import header_config
    from engine.model.gguf_header import Header
    from engine.plan.profiles import model_profile_from_config
    from tests.test_gemma_gguf import write_gemma_gguf

    monkeypatch.setenv("SPECACHE_CACHE_DIR", str(tmp_path / "cache"))  # the tiny Gemma converted here
    for spec in (None, str(write_gemma_gguf(tmp_path / "tiny-gemma3.gguf", "gemma3"))):
        files = model_files(spec)
        made = files.plan_config
        assert files._folder is None  # not converted for it
        assert model_profile_from_config(made) == model_profile_from_config(files.config), spec
        assert files.plan_config is files.config  # once converted and read, the config itself
    header = model_files(None).header
    assert header_config(Header({**header.fields, "general.architecture": "falcon"}, header.tensors)) is None
    skipped = {**header.fields, "llama.attention.head_count_kv": None}  # an array the header skipped
    assert header_config(Header(skipped, header.tensors)) is None


def test_plan_of_a_folder_resolves_it_once_and_reads_its_config_once(tiny_model_dir, resolutions, opened):
    r = cli("plan", "--gpu", "cpu", "--model", str(tiny_model_dir), "--json")
    assert r.exit_code == 0, r.stderr
    assert resolutions == [str(tiny_model_dir)]
    assert opened.count(str(tiny_model_dir / "config.json")) == 1
    assert json.loads(r.stdout)["model_profile"]["max_context"] == 1024


def test_plan_of_a_folder_that_is_no_model_is_a_profile_error(tmp_path):
    r = cli("plan", "--gpu", "cpu", "--model", str(tmp_path))
    assert r.exit_code == 11 and "no config.json" in r.stderr, r.stderr


@pytest.mark.parametrize("command", [
    ["bench", "fidelity", "--quick"],
    ["bench", "long", "--quick", "--lengths", "256", "--depths", "0.5", "--tokens", "2", "--llama-cpp", "."],
])
def test_a_bench_resolves_its_model_once_and_reads_its_config_once(tiny_model_dir, tmp_path, resolutions, opened,
                                                                   command):
    """The benches load through one ModelFiles (BenchRun.files): bench long's llama.cpp takes the same one, and its
    points' child processes the model as resolved here (ModelSource.as_json), resolving nothing again."""
    from engine.model.sources import source_from_json

    for source in (model_files(None).source, model_files(str(tiny_model_dir)).source):
        assert source_from_json(json.loads(json.dumps(source.as_json()))) == source
    resolutions.clear()
    r = cli(*command, "--model", str(tiny_model_dir), "--out", str(tmp_path), "--threads", "1", "--json", "--quiet")
    assert r.exit_code == 0, r.stderr
    assert resolutions == [str(tiny_model_dir)]
    assert opened.count(str(tiny_model_dir / "config.json")) == 1
