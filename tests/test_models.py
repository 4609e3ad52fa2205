"""Naming a model (engine/model/sources.py): a .gguf file, a Hugging Face id in the local cache,
ollama:NAME[:TAG] and a folder resolve without any download; `specache models` lists them; models
that cannot be used are refused in one line with their exit code."""
from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
from typer.testing import CliRunner

from engine.errors import DoesNotFit, InputNotFound, ModelLoadError
from engine.model.embedded import find_embedded_gguf
from engine.model.sources import resolve_source
from engine.kvcache import POLICIES
from engine.plan.planner import check_fits_before_load
from engine.plan.profiles import load_hardware, load_model_profile
from specache_cli.app import app

DATA = Path(__file__).parent / "data"
GIB = 1024**3


def fake_hf_cache(root: Path, model_id: str, folder: Path) -> Path:
    """The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<commit>/<files>}."""
    repo = root / ("models--" + model_id.replace("/", "--"))
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    for f in folder.iterdir():
        (snap / f.name).symlink_to(f)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    return snap


def fake_ollama(root: Path, name: str, tag: str, blob_target: Path) -> Path:
    """ollama's layout: manifests/registry.ollama.ai/library/NAME/TAG naming blobs/sha256-<digest>."""
    digest = "ab" * 32
    manifest = root / "manifests" / "registry.ollama.ai" / "library" / name / tag
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": [
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "cd" * 32, "size": 10},
        {"mediaType": "application/vnd.ollama.image.model", "digest": "sha256:" + digest, "size": 1}]}))
    (root / "blobs").mkdir()
    blob = root / "blobs" / f"sha256-{digest}"
    blob.symlink_to(blob_target)
    return blob


def test_hf_id_resolves_from_the_local_cache(tmp_path, monkeypatch, tiny_model_dir):
    snap = fake_hf_cache(tmp_path / "hub", "someorg/tiny-llama", tiny_model_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    source = resolve_source("someorg/tiny-llama")
    assert (source.kind, source.name, source.folder) == ("hf-cache", "someorg/tiny-llama", snap)
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # HF_HOME/hub when HF_HUB_CACHE is not set
    assert resolve_source("someorg/tiny-llama").folder == snap


def test_hf_id_runs_end_to_end(tmp_path, monkeypatch, tiny_model_dir):
    fake_hf_cache(tmp_path / "hub", "someorg/tiny-llama", tiny_model_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    r = CliRunner().invoke(app, ["summarize", str(DATA / "sample.txt"), "--model", "someorg/tiny-llama",
                                 "--max-tokens", "4", "--json", "--quiet", "--no-store"])
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["model"] == "someorg/tiny-llama"


def test_ollama_name_resolves_to_its_gguf_blob(tmp_path, monkeypatch):
    blob = fake_ollama(tmp_path, "smollm2", "135m", find_embedded_gguf())
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path))
    source = resolve_source("ollama:smollm2:135m")
    assert (source.kind, source.gguf) == ("ollama", blob)
    with pytest.raises(ModelLoadError, match="ollama model smollm2 not found"):
        resolve_source("ollama:smollm2")  # :latest is not there
    listed = CliRunner().invoke(app, ["models", "--json"])
    assert listed.exit_code == 0, listed.stderr
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    row = next(r for r in rows if r["kind"] == "ollama")
    assert row["model"] == "ollama:smollm2:135m" and row["format"] == "GGUF Q4_1"
    assert row["size_bytes"] == find_embedded_gguf().stat().st_size and row["held_bytes"] > 0


def test_models_lists_the_hf_cache_with_sizes(tmp_path, monkeypatch, tiny_model_dir):
    fake_hf_cache(tmp_path / "hub", "someorg/tiny-llama", tiny_model_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "none"))
    r = CliRunner().invoke(app, ["models"])
    assert r.exit_code == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("someorg/tiny-llama"))
    assert "HF cache" in line and ("MB" in line or "kB" in line)


def write_gguf(path: Path, arch: str) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def run_refused(*args: str):
    r = CliRunner().invoke(app, ["summarize", str(DATA / "sample.txt"), *args, "--max-tokens", "4", "--no-store"])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return r.exit_code, lines[0]


def test_refusals_are_one_line_with_their_exit_code(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    code, line = run_refused("--model", "nosuch/model")
    assert code == ModelLoadError.exit_code
    assert "not in the local Hugging Face cache" in line and "huggingface-cli download nosuch/model" in line
    code, line = run_refused("--model", "ollama:nosuch")
    assert code == ModelLoadError.exit_code and "ollama pull nosuch" in line
    code, line = run_refused("--model", str(tmp_path / "missing.gguf"))
    assert code == InputNotFound.exit_code and "GGUF file not found" in line
    code, line = run_refused("--model", str(write_gguf(tmp_path / "rwkv.gguf", "rwkv6")))
    assert code == ModelLoadError.exit_code and "GGUF architecture 'rwkv6' cannot be read by transformers" in line
    (tmp_path / "notes.txt").write_text("hello")
    code, line = run_refused("--model", str(tmp_path / "notes.txt"))
    assert code == ModelLoadError.exit_code and "neither a GGUF file nor" in line


def test_a_model_that_does_not_fit_is_refused_before_loading():
    cpu = load_hardware("cpu")
    small = type(cpu)(**{**cpu.__dict__, "device_memory_bytes": 8 * GIB, "free_memory_bytes": 8 * GIB,
                         "host_ram_bytes": 8 * GIB})
    llama = load_model_profile("llama-3-8b")
    config = {"hidden_size": llama.hidden_size, "num_attention_heads": llama.heads, "num_hidden_layers": llama.layers,
              "intermediate_size": llama.intermediate_size, "vocab_size": llama.vocab_size,
              "num_key_value_heads": llama.kv_heads, "max_position_embeddings": 8192}
    specache = POLICIES["specache"]
    check_fits_before_load(config, int(5.0 * GIB), 4096, specache, hardware=small)  # Q4_K-sized weights fit
    with pytest.raises(DoesNotFit, match=r"one sequence of 4096 tokens 2.10 GiB"):  # sized with the flags given
        check_fits_before_load(config, int(5.0 * GIB), 4096, specache, {"k": 4096, "store_dtype": "fp32"},
                               hardware=small)
    check_fits_before_load(config, int(5.0 * GIB), 4096, specache, {"k": 4096}, hardware=small)  # a 16-bit store
    with pytest.raises(DoesNotFit, match=r"its weights take 30.00 GiB as held"):
        check_fits_before_load(config, 30 * GIB, 4096, specache, hardware=small)  # fp32 weights do not


@pytest.mark.slow
def test_the_embedded_gguf_named_by_path_or_ollama_gives_the_default_output(tmp_path, monkeypatch):
    fake_ollama(tmp_path / "ollama", "smollm2", "latest", find_embedded_gguf())
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    base = ["summarize", str(DATA / "sample.txt"), "--max-tokens", "24", "--json", "--quiet", "--no-store",
            "--threads", "1"]
    outs = []
    for model in ([], ["--model", str(find_embedded_gguf())], ["--model", "ollama:smollm2"]):
        r = CliRunner().invoke(app, base + model)
        assert r.exit_code == 0, r.stderr
        outs.append(json.loads(r.stdout))
    assert outs[0]["generated_tokens"] >= 8
    assert outs[1]["text"] == outs[0]["text"] and outs[2]["text"] == outs[0]["text"]
    assert outs[1]["generated_tokens"] == outs[0]["generated_tokens"]


def test_planner_counts_a_gguf_as_held():
    from engine.model.held_model import held_bytes
    from engine.model.loading import load_model
    from engine.plan.planner import weight_bytes

    profile = load_model_profile(str(find_embedded_gguf()))  # `specache plan --model FILE.gguf`
    lm = load_model(str(find_embedded_gguf()), device="cpu")
    held = held_bytes(lm.model)
    assert weight_bytes(profile, 2) == held["total"] == profile.held_weight_bytes
    assert set(held["by_format"]) == {"q4_1", "q8_0", "float32"}  # the file's own blocks, no fp32 copy of a linear
    assert held["total"] < 0.2 * profile.parameters * 4  # 135M parameters in 97 MB (the file's bytes), not 540


@pytest.mark.parametrize("dtype,tied", [("bfloat16", False), ("float16", True)])
def test_a_16bit_folder_is_held_as_it_is_and_gives_the_fp32_output(tmp_path, embedded_dir, dtype, tied):
    """A folder of 16-bit safetensors (a Llama here) runs in engine.model.llama's classes with its linears and
    embedding held as they are (2 bytes a weight, no fp32 copy; the memory check counts that), and gives what
    transformers' fp32 load of it gives, token for token (decode and <= 64-row prefill chunks take the native
    kernels, the 16-bit one the fp32 one's result bit for bit)."""
    import shutil

    import torch
    from transformers import AutoTokenizer

    from conftest import make_tiny_model
    from engine.config import CacheConfig, GenerationConfig
    from engine.generate.engine import Engine, Finished
    from engine.model.held_model import held_bytes
    from engine.model.linears import SkinnyLinear
    from engine.model.llama import CausalLM
    from engine.model.loading import estimate_weight_bytes, load_model, prepare_model

    tok = AutoTokenizer.from_pretrained(embedded_dir)
    model = make_tiny_model(vocab=len(tok), max_pos=1024, layers=2)
    if tied:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    model.config.bos_token_id, model.config.eos_token_id = tok.bos_token_id, tok.eos_token_id
    model.to(getattr(torch, dtype)).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    shutil.copy(embedded_dir / "chat_template.jinja", tmp_path / "chat_template.jinja")

    held = load_model(str(tmp_path), device="cpu")
    ref = load_model(str(tmp_path), device="cpu", dtype="float32", classes="transformers")
    assert isinstance(held.model, CausalLM) and not isinstance(ref.model, CausalLM)
    linears = [m for m in held.model.modules() if isinstance(m, SkinnyLinear)]
    assert linears and all(m.weight is None and m.held.kind == dtype for m in linears)
    by = held_bytes(held.model)["by_format"]
    weights = sum(p.numel() for n, p in ref.model.named_parameters() if "norm" not in n)
    assert by[dtype] == 2 * weights and by["float32"] < 0.01 * by[dtype]  # the norms only
    assert estimate_weight_bytes(resolve_source(str(tmp_path))) == pytest.approx(held_bytes(held.model)["total"], rel=0.02)
    assert held.fingerprint.endswith("-held") and not ref.fingerprint.endswith("-held")

    prompt = torch.randint(3, 400, (100,), generator=torch.Generator().manual_seed(1)).tolist()
    runs = []
    for lm in (held, ref):
        engine = Engine(prepare_model(lm.model), CacheConfig(mode="full", chunk_size=32))  # exact fp32 prefill
        runs.append(next(e for e in engine.generate([prompt], GenerationConfig(max_tokens=12))
                         if isinstance(e, Finished)).tokens[0])
    assert runs[0] == runs[1] and len(runs[0]) == 12


def test_a_converted_folder_follows_its_gguf_to_a_new_path(tmp_path):
    """A converted folder is keyed by its GGUF's content: found again at another path (a new venv's copy of
    the wheel) while the path it recorded is gone, the folder names the new path, so it still loads as
    --model; a recorded path that still exists is kept."""
    from engine.model.gguf_convert import repoint
    from engine.model.sources import GGUF_POINTER, gguf_of_converted

    folder = tmp_path / "gguf-m-key"
    folder.mkdir()
    pointer = folder / GGUF_POINTER
    old, new = tmp_path / "old" / "m.gguf", tmp_path / "new" / "m.gguf"
    new.parent.mkdir()
    new.write_bytes(b"GGUF" + bytes(60))
    pointer.write_text(json.dumps({"source": str(old), "size": 64, "identity": "x", "version": 1}))
    with pytest.raises(ModelLoadError, match="which is gone"):
        gguf_of_converted(pointer)
    repoint(pointer, new)
    assert gguf_of_converted(pointer) == new.resolve()
    assert json.loads(pointer.read_text())["identity"] == "x"  # only the path changes
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF" + bytes(60))
    repoint(pointer, other)
    assert gguf_of_converted(pointer) == new.resolve()  # the recorded file exists: kept


def test_a_first_compile_of_the_native_kernels_is_announced(tmp_path, monkeypatch, tiny_model_dir):
    """A first run on a machine compiles the native library (up to a minute on a busy laptop): load_model says so
    on its status line when, and only when, it compiles (a model refused before any kernel runs compiles nothing)."""
    from engine import native
    from engine.model.loading import load_model

    real = native.lib()
    if real is None:
        pytest.skip("no native library here")
    for name in ("_lib", "_error", "_tried"):  # restored after the test: the process keeps its library
        monkeypatch.setattr(native, name, getattr(native, name))
    monkeypatch.setenv("SPECACHE_CACHE_DIR", str(tmp_path / "empty"))  # nothing built there
    cc, log = tmp_path / "cc", tmp_path / "compiles"  # a compiler that writes an empty library and logs the call
    cc.write_text(f'#!/bin/sh\n[ "$1" = --version ] && {{ echo fake-cc; exit 0; }}\n'
                  f'case " $* " in *" -c "*) ;; *) echo x >> "{log}";; esac\n'  # the link: one per build
                  'prev=; for a; do [ "$prev" = -o ] && : > "$a"; prev=$a; done\n')
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setattr(native, "_load", lambda path: real)  # (the empty file is not loaded)
    for first in (True, False):
        native._tried = not first
        said = []
        load_model(str(tiny_model_dir), device="cpu", on_status=said.append)
        assert any("compiling the native CPU kernels" in s for s in said) == first
    assert log.read_text().count("x") == 1
    native._tried, said = False, []
    with native.announcing(said.append):
        native.lib()  # built already: loaded, nothing said
        assert not said
        native._tried = False
        monkeypatch.setenv(native.ENV_DISABLE, "0")
        assert native.lib() is None and not said  # disabled: nothing compiled, nothing said
