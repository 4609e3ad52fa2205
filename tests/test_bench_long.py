"""`specache bench long --quick` through the CLI on the tiny test model (a 1024-token window): the JSON and
Markdown structure, the lengths beyond the window skipped and said so, every point's timing and peak-RSS
fields present (never their values), the full cache against itself, pass-keys at each depth; llama.cpp
skipped with its reason, or run from a folder holding a stand-in script when node is installed."""
from __future__ import annotations

import json
import re
import shutil

import pytest
from typer.testing import CliRunner

from engine.bench.long import PASSKEY_TOKENS, split_lengths
from engine.bench.long_report import PLOT_NAME, long_plot
from specache_cli.app import app

TIMING_FIELDS = ("prefill_seconds", "prefill_tokens_per_s", "decode_ms_per_token", "decode_ms_step_median",
                 "peak_rss_bytes", "model_rss_bytes", "peak_above_model_bytes")


def invoke(model_dir, out, *args):
    r = CliRunner().invoke(app, ["bench", "long", "--quick", "--model", str(model_dir), "--out", str(out),
                                 "--threads", "1", "--json", *args], catch_exceptions=False)
    assert r.exit_code == 0, r.stderr
    result = json.loads(r.stdout)
    assert json.loads((out / "long.json").read_text()) == result  # the file holds the same JSON
    return result, (out / "long.md").read_text(), r.stderr


@pytest.fixture(scope="module")
def quick(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-long")
    return (*invoke(tiny_model_dir, out, "--lengths", "256,512,2048", "--depths", "0.1,0.9"), out)


def test_the_quick_run_skips_the_lengths_beyond_the_window_and_says_so(quick):
    result, md, stderr, _ = quick
    s = result["settings"]
    assert result["bench"] == "long" and result["quick"] is True and result["schema_version"] == 1
    assert result["environment"]["model"]["max_context"] == 1024
    assert s["requested_lengths"] == [256, 512, 2048] and s["lengths"] == [256, 512]
    assert [x["length"] for x in s["skipped"]] == [2048] and "window 1024" in s["skipped"][0]["reason"]
    assert "2048 tokens skipped" in stderr and "2048 tokens (beyond the model's window" in md
    assert [m["label"] for m in result["modes"]] == ["full", "specache"] and s["decode_tokens"] == 8


def test_every_point_has_its_timings_rss_fidelity_and_passkeys(quick):
    result, _, stderr, _ = quick
    points = {(p["mode"], p["length"]): p for p in result["points"]}
    assert set(points) == {(m, n) for m in ("full", "specache") for n in (256, 512)}
    for (mode, length), p in points.items():
        assert all(p[f] is not None for f in TIMING_FIELDS), p
        assert p["peak_rss_bytes"] >= p["model_rss_bytes"] > 10 * 2**20 and p["torch_threads"] == 1
        assert p["decode_steps"] == 7 and abs(p["prompt_tokens"] - length) <= 8  # 8 tokens: the first from the prefill
        assert len(p["load_average"]["start"]) == 3
        assert [k["depth"] for k in p["passkeys"]] == [0.1, 0.9] and p["passkeys_found"] == sum(
            k["found"] for k in p["passkeys"])
        for k in p["passkeys"]:
            assert len(k["key"]) == 5 and abs(k["prompt_tokens"] - length) <= 16 and k["found"] == (k["key"] in
                                                                                                     k["output"])
        assert p["steps"] == 8 and 0.0 <= p["top1_agreement"] <= 1.0 and p["mean_kl"] >= 0.0
        assert re.search(f"long {mode} {length} tokens: prefill \\d+ tok/s, decode .* peak RSS", stderr)  # per point
    for n in (256, 512):
        full = points[("full", n)]
        assert full["top1_agreement"] == 1.0 and full["mean_kl"] == 0.0  # the reference against itself
        assert [k["key"] for k in full["passkeys"]] == [k["key"] for k in points[("specache", n)]["passkeys"]]
    assert points[("specache", 512)]["device_bytes"] < points[("full", 512)]["device_bytes"]
    assert {t["name"].split(" ")[0] for t in result["targets"]} == {"specache"} and len(result["targets"]) == 4


def test_the_report_and_the_plot(quick):
    result, md, _, out = quick
    assert "## Results" in md and "## Targets" in md and "| specache | 512 |" in md
    assert "llama.cpp: not requested" in md
    if long_plot(result) is not None:  # matplotlib installed: the picture is written
        assert result["plot"] == PLOT_NAME and (out / PLOT_NAME).read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
        assert f"]({PLOT_NAME})" in md
    else:
        assert result["plot"] is None and not (out / PLOT_NAME).exists() and "matplotlib is not installed" in md


def test_split_lengths():
    fit, skipped = split_lengths([4096, 512, 8192, 1024], 8192, 64)
    assert fit == [512, 1024, 4096] and [s["length"] for s in skipped] == [8192]
    limit = 1024 - max(4, PASSKEY_TOKENS) - 8  # the pass-key answer is longer than 4 decode tokens
    assert split_lengths([limit], 1024, 4) == ([limit], [])
    assert split_lengths([limit + 1], 1024, 4)[1][0]["length"] == limit + 1


def test_no_length_that_fits_is_refused(tiny_model_dir, tmp_path):
    r = CliRunner().invoke(app, ["bench", "long", "--quick", "--quiet", "--model", str(tiny_model_dir), "--out",
                                 str(tmp_path), "--lengths", "2048,4096"])
    assert r.exit_code == 2 and "no --lengths fit" in r.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_llama_cpp_runs_beside_the_modes_from_its_folder(tiny_model_dir, tmp_path, monkeypatch):
    """A folder with node-llama-cpp in node_modules and a stand-in llama_cpp_bench.mjs (the real one needs the
    package and a real GGUF; the tiny model taken for one here): llama.cpp's point at each length, its peak
    RSS node's own, the targets against it; a model without a GGUF is refused with the reason."""
    from engine.bench.llama_cpp import available

    folder = tmp_path / "llcpp"
    (folder / "node_modules" / "node-llama-cpp").mkdir(parents=True)
    (folder / "llama_cpp_bench.mjs").write_text(
        'import {readFileSync} from "node:fs";\n'
        'const [m, t, n, th] = process.argv.slice(2);\n'
        'const words = readFileSync(t, "utf8").split(/\\s+/).length;\n'
        'console.log(JSON.stringify({build: "stand-in", prompt_tokens: words, prefill_s: 1.5, prefill_tok_s: words / 1.5,'
        ' decode_tokens: Number(n) - 1, decode_ms_per_token: 1e6, threads: Number(th), kv: "f16"}));\n')
    assert "not a GGUF" in available(folder, None) and available(folder, tmp_path / "m.gguf") is None
    assert "node-llama-cpp is not installed" in available(tmp_path, tmp_path / "m.gguf")
    assert "not requested" in available(None, tmp_path / "m.gguf")
    monkeypatch.setattr("specache_cli.bench_long_cmd.gguf_of", lambda files: tmp_path / "m.gguf")
    result, md, stderr = invoke(tiny_model_dir, tmp_path / "out", "--lengths", "256", "--modes", "specache",
                                "--llama-cpp", str(folder))
    assert result["settings"]["llama_cpp"] == {"folder": str(folder), "ran": True, "threads": 1, "note": None}
    llama = next(p for p in result["points"] if p["mode"] == "llama.cpp")
    assert llama["length"] == 256 and llama["decode_ms_per_token"] == 1e6 and llama["decode_steps"] == 7
    assert 100 < llama["prompt_tokens"] < 256 and llama["peak_rss_bytes"] > 2**20  # the words of the text; node's RSS
    speed = next(t for t in result["targets"] if "decode vs llama.cpp" in t["name"])
    assert speed["met"] is True and "| llama.cpp | 256 |" in md and "long llama.cpp 256 tokens" in stderr
    assert result["points"][0]["top1_agreement"] is None  # no full mode: no reference
