"""Model families: one registry (engine.model.families) read by the loader, the support check, the GGUF
reader and the planner; a new family is one new module."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from engine.model import families
from engine.model.gguf_header import held_architecture

ROOT = Path(__file__).resolve().parent.parent

PROBE = '''"""A test's family: Llama's decoder under another model type, with q/k/v biases assumed by the planner."""
from engine.model.families import ModelFamily, register
from engine.model.llama import NO, STRUCTURE, Family

register(ModelFamily("probe", "Probe (a test's family)", "llama", Family(NO, NO, NO, required=STRUCTURE),
                     ("probe",), qkv_bias=True))
'''

PROBE_CHILD = r'''
import json, shutil, sys
from pathlib import Path
from typer.testing import CliRunner
import engine
from engine.model import families
from engine.model.gguf_header import held_architecture
from engine.model.loading import load_model
from engine.model.llama import CausalLM
from engine.plan.profiles import model_profile_from_config
from specache_cli.app import app

sample, tiny, work = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
probe = work / "probe-model"
shutil.copytree(tiny, probe)
config = json.loads((tiny / "config.json").read_text())
(probe / "config.json").write_text(json.dumps({**config, "model_type": "probe"}))
warnings = []
lm = load_model(str(probe), device="cpu", on_warning=warnings.append)
shape = {k: v for k, v in config.items() if k != "attention_bias"}
texts = {}
for name, folder in (("probe", probe), ("llama", tiny)):
    r = CliRunner().invoke(app, ["summarize", sample, "--model", str(folder), "--quiet", "--no-store", "--json",
                                 "--max-tokens", "6"], catch_exceptions=False)
    texts[name] = json.loads(r.stdout)["text"] if r.exit_code == 0 else r.stderr
print(json.dumps({
    "engine": engine.__file__, "checked": families.checked().get("probe"), "held": held_architecture("probe"),
    "own_class": type(lm.model) is CausalLM, "warnings": warnings, "texts": texts,
    "bias_params": model_profile_from_config({**shape, "model_type": "probe"}).parameters
                   - model_profile_from_config({**shape, "model_type": "llama"}).parameters,
    "per_layer_bias": config["num_hidden_layers"] * (config["num_attention_heads"] + 2 * config["num_key_value_heads"])
                      * (config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]),
}))
'''


def test_every_family_is_checked_and_each_gguf_architecture_is_one_familys():
    found = families.discover()
    assert set(families.checked()) == set(found) >= {"llama", "qwen2", "gemma3_text"}
    archs = families.held_architectures()
    assert len(archs) == len(set(archs)) and held_architecture("qwen2") and not held_architecture("gpt2")
    assert [f.model_type for f in found.values() if f.decoder is None] == ["gemma3"]  # transformers' classes


def test_adding_a_family_is_one_module(tmp_path, tiny_model_dir):
    """A new family is one new file in engine/model/families/: in a copy of the package with that file
    added (nothing else edited), a folder of its model type is supported, built by our decoder without a
    fallback warning, answers as the same weights under Llama's type do, its GGUF architecture is held and
    the planner counts the q/k/v biases it declares."""
    copy = tmp_path / "copy"
    ignore = shutil.ignore_patterns("__pycache__", "*.so")
    for package in ("engine", "specache_cli", "profiles"):
        shutil.copytree(ROOT / package, copy / package, ignore=ignore)
    (copy / "engine" / "model" / "families" / "probe.py").write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": str(copy), "SPECACHE_NATIVE": "0"}
    r = subprocess.run([sys.executable, "-c", PROBE_CHILD, str(ROOT / "tests" / "data" / "sample.txt"),
                        str(tiny_model_dir), str(tmp_path)], cwd=copy, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["engine"].startswith(str(copy))  # the copy's package, with the new file, was the one run
    assert out["checked"] == "Probe (a test's family)" and out["held"] is True
    assert out["own_class"] is True and out["warnings"] == []
    assert out["texts"]["probe"] == out["texts"]["llama"], out["texts"]
    assert out["bias_params"] == out["per_layer_bias"] > 0


def test_the_readme_s_family_table_is_the_registry_s():
    """README.md's table of model families is generated from the registry (families.docs_table): a family
    added or changed without regenerating it fails here, with the table to paste."""
    readme = (ROOT / "README.md").read_text()
    start, end = "<!-- generated from engine/model/families/", "<!-- end of the generated table -->"
    assert readme.count(start) == 1 and readme.count(end) == 1
    found = readme.split(start, 1)[1].split("\n", 1)[1].split(end, 1)[0].strip()
    assert found == families.docs_table(), "README.md's family table is stale; paste:\n" + families.docs_table()


def test_the_tiny_architectures_cover_every_family():
    """tests/tiny_archs.py (the conformance test's models) has a model of every registered family's type."""
    from tests.tiny_archs import ARCHS, tiny_config

    assert {tiny_config(name).model_type for name in ARCHS} == set(families.discover())
