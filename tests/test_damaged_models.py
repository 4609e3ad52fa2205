"""Damaged model files (tests/damaged_models.py writes the corpus): every one gives the model-error exit code
and one `error:` line naming the file, with no traceback and nothing of transformers' loading report, in a
process whose address space is capped (a header that asks for terabytes must fail, not allocate). Two
undamaged models run through the same runner, so a runner that fails everything fails this test."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.errors import ModelLoadError
from engine.paths import cache_root
from tests.damaged_models import folder_cases, gguf_cases, write_tiny_gguf
from tests.tiny_archs import save_model_dir, tiny_model

MEMORY_LIMIT_MB = 4096
RUNNER = r"""
import json, os, resource, sys, tempfile
limit = int(sys.argv[1]) << 20
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
doc, cases = sys.argv[2], json.loads(sys.argv[3])
from specache_cli.app import run
results = {}
for name, path in cases.items():
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush(); sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1); os.dup2(err.fileno(), 2)
        try:
            code = run(["summarize", doc, "--model", path, "--max-tokens", "2", "--no-store", "--quiet"])
        except BaseException as exc:
            code = f"escaped: {type(exc).__name__}: {exc}"
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os.dup2(saved[0], 1); os.dup2(saved[1], 2)
            os.close(saved[0]); os.close(saved[1])
        out.seek(0); err.seek(0)
        results[name] = [code, out.read().decode("utf-8", "replace"), err.read().decode("utf-8", "replace")]
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("damaged")
    cases: dict[str, Path] = {}
    for arch in ("llama", "gemma3-multimodal"):  # our own classes' folder loader; transformers' (multimodal Gemma 3)
        good = save_model_dir(tiny_model(arch), root / f"good-{arch}")
        (root / arch).mkdir()
        found = folder_cases(good, root / arch)
        if arch != "llama":  # the cases that reach transformers' loader: weights it would leave random
            found = {k: found[k] for k in ("missing-tensor", "config-more-layers", "config-wrong-sizes")}
        cases.update({f"{arch}/{k}": v for k, v in found.items()})
        cases[f"good/{arch}"] = good
    (root / "gguf").mkdir()
    good_gguf = write_tiny_gguf(root / "good.gguf")
    cases.update({f"gguf/{k}": v for k, v in gguf_cases(good_gguf, root / "gguf").items()})
    cases["good/gguf"] = good_gguf
    doc = root / "doc.txt"
    doc.write_text("w3 w4 w5 w6 w7 " * 40)
    cache = root / "cache"  # conversions of the GGUFs here; the native library as already built
    cache.mkdir()
    if (cache_root() / "native").is_dir():
        (cache / "native").symlink_to(cache_root() / "native")
    env = {**__import__("os").environ, "SPECACHE_CACHE_DIR": str(cache)}
    out = subprocess.run([sys.executable, "-c", RUNNER, str(MEMORY_LIMIT_MB), str(doc),
                          json.dumps({k: str(v) for k, v in cases.items()})],
                         capture_output=True, text=True, timeout=600, env=env, cwd=Path(__file__).parent.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    return {"paths": cases, "results": json.loads(out.stdout.strip().splitlines()[-1])}


def test_the_corpus_covers_what_the_issue_lists(corpus):
    names = set(corpus["results"])
    for want in ("llama/random-bytes", "llama/header-dtype-unknown", "llama/header-drops-a-tensor", "llama/header-offsets-past-end",
                 "llama/config-wrong-sizes", "llama/missing-tensor", "llama/empty-folder", "gguf/unknown-block-type",
                 "gemma3-multimodal/config-more-layers", "gguf/huge-key-length"):
        assert want in names
    assert sum(n.startswith("llama/truncated") for n in names) >= 4
    assert sum(n.startswith("gguf/truncated") for n in names) >= 5


def test_undamaged_models_run(corpus):
    for name in ("good/llama", "good/gemma3-multimodal", "good/gguf"):
        code, out, err = corpus["results"][name]
        assert code == 0 and "error" not in err, (name, err[-500:])
        assert out.strip() or name == "good/gguf"  # (its word vocabulary may decode two tokens to spaces)


def test_every_damaged_file_is_one_error_line_with_the_model_error_code(corpus):
    wrong = {}
    for name, (code, out, err) in corpus["results"].items():
        if name.startswith("good/"):
            continue
        path = corpus["paths"][name]
        lines = err.strip().splitlines()
        ok = (code == ModelLoadError.exit_code and not out.strip() and len(lines) == 1 and lines[0].startswith("error:")
              and (str(path) in lines[0] or path.name in lines[0]) and "internal error" not in err)
        if not ok:
            wrong[name] = (code, err[-400:])
    assert not wrong, wrong
    assert not any("Traceback" in e or "LOAD REPORT" in e for _, _, e in corpus["results"].values())
