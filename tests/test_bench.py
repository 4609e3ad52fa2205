"""`specache bench needle|fidelity|speed --quick` through the CLI on a tiny random model with the
real tokenizer: the JSON and Markdown structure, the files written, and the values that must hold
exactly (full against itself, specache with k >= context against full)."""
from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

from engine.bench.common import parse_mode, parse_modes, write_atomic
from engine.bench.fidelity import compare_distributions, compare_tokens
from engine.bench.heatmap import heatmap_png
from engine.bench.needle import build_needle_prompt, found, passkey
from engine.config import CacheConfig
from engine.errors import BadArgument
from specache_cli.app import app
from specache_cli.bench_common import BenchRun
from specache_cli.console import guarded
from specache_cli.options import grouped

EXACT = "specache-k4096-speculative"  # k >= every context here: every position exact, output equals full


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors on a shared 2-core machine: OpenMP waits make 2 threads far slower than 1."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def bench(tiny_model_dir, tmp_path_factory):
    runner = CliRunner()
    out = tmp_path_factory.mktemp("bench-results")

    def invoke(name: str, *args: str):
        r = runner.invoke(app, ["bench", name, "--quick", "--model", str(tiny_model_dir), "--out", str(out),
                                "--threads", "1", "--json", *args], catch_exceptions=False)
        assert r.exit_code == 0, r.stderr
        result = json.loads(r.stdout)
        assert json.loads((out / f"{name}.json").read_text()) == result  # the file holds the same JSON
        markdown = (out / f"{name}.md").read_text()
        return result, markdown, r

    invoke.out = out
    invoke.model_dir = tiny_model_dir
    return invoke


def check_envelope(result: dict, bench: str, labels: list[str]) -> None:
    assert result["bench"] == bench and result["schema_version"] == 1 and result["quick"] is True
    assert result["environment"]["model"]["max_context"] == 1024
    assert [m["label"] for m in result["modes"]] == labels
    assert result["seconds"] > 0
    for t in result["targets"]:
        assert {"name", "goal", "measured", "met"} <= set(t)


# ---- needle ------------------------------------------------------------------------------

def test_needle_quick(bench):
    labels = ["full", EXACT, "specache-1b", "kivi-1b", "window"]
    result, md, r = bench("needle", "--modes", ",".join(labels))
    check_envelope(result, "needle", labels)
    s = result["settings"]
    assert len(s["lengths"]) == 2 and s["depths"] == [0.25, 0.75] and s["needles_per_cell"] == 2
    assert len(result["cells"]) == len(labels) * 4
    for cell in result["cells"]:
        assert len(cell["trials"]) == 2 and 0.0 <= cell["accuracy"] <= 1.0
        for trial in cell["trials"]:
            assert abs(trial["prompt_tokens"] - cell["length"]) <= 16
            assert trial["found"] == found(trial["key"], trial["output"])
    for lab in labels:
        grid = result["accuracy"][lab]
        assert set(grid) == {str(n) for n in s["lengths"]}
        assert all(set(row) == {"0.25", "0.75"} for row in grid.values())
    per = result["per_mode"]
    assert per["full"]["same_output_as_full"] == 1.0
    assert per[EXACT]["same_output_as_full"] == 1.0  # every position exact: the same answers
    n = str(s["lengths"][-1])
    assert per["kivi-1b"]["device_bytes_per_row"][n] < per["specache-1b"]["device_bytes_per_row"][n] \
        < per["full"]["device_bytes_per_row"][n]
    png = (bench.out / "needle-heatmap.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    assert "## Accuracy per mode" in md and "needle-heatmap.png" in md and "## Targets" in md
    assert all(f"**{lab}**" in md for lab in labels)


def test_needle_prompt_plants_the_key_at_the_depth(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    corpus = tok("The committee met in the spring. " * 200, add_special_tokens=False)["input_ids"]
    key = passkey(0, 600, 0.5, 0)
    assert len(key) == 5 and key == passkey(0, 600, 0.5, 0) != passkey(0, 600, 0.5, 1)
    p = build_needle_prompt(tok, corpus, 600, 0.5, key)
    text = tok.decode(p["ids"])
    assert f"The pass key is {key}." in text and "What is the pass key?" in text
    assert abs(len(p["ids"]) - 600) <= 16
    assert 0.3 < p["needle_token"] / len(p["ids"]) < 0.7
    assert found(key, f"The pass key is {key[:2]} {key[2:]}.") and not found(key, "12345" if key != "12345" else "1")


# ---- fidelity ----------------------------------------------------------------------------

def test_fidelity_quick(bench):
    labels = ["full", "specache-speculative", EXACT, "kivi-1b", "window", "specache"]
    result, md, _ = bench("fidelity", "--modes", ",".join(labels))
    check_envelope(result, "fidelity", labels)
    doc = result["settings"]["documents"][0]
    assert doc["source"].endswith("report.pdf") and doc["truncated"] and doc["prompt_tokens"] <= 600
    per, rows = result["per_mode"], {r["mode"]: r for r in result["rows"]}
    n = rows["full"]["teacher_forced"]["steps"]
    assert n == 16 == rows["full"]["free_running"]["reference_tokens"]

    # full against itself: the same distributions, the same text
    assert per["full"]["top1_agreement"] == 1.0 and per["full"]["mean_kl"] == 0.0
    assert rows["full"]["free_running"]["identical_prefix"] == n and per["full"]["equal_share"] == 1.0
    # k >= context: exact at every position
    assert per[EXACT]["top1_agreement"] == 1.0 and per[EXACT]["mean_kl"] < 1e-4
    assert rows[EXACT]["free_running"]["identical_prefix"] == n
    sel = per[EXACT]["selection"]
    for name in ("oracle", "fetched", "guide_own", "guide_spec", "exact_spec", "guide_output", "exact_output"):
        assert sel[name]["recall"] == pytest.approx(1.0) and sel[name]["coverage"] == pytest.approx(1.0)
        assert sel[name]["coverage_total"] == pytest.approx(1.0)
    # a real setting: coverage of any k-set is at most the oracle's, recall within [0, 1]
    sel = per["specache-speculative"]["selection"]
    oracle = sel["oracle"]["coverage"]
    assert 0 < oracle <= 1.0 + 1e-9 and sel["oracle"]["recall"] == pytest.approx(1.0)
    for name, v in sel.items():
        assert 0.0 <= v["recall"] <= 1.0 + 1e-9 and 0.0 <= v["coverage"] <= oracle + 1e-6, name
        assert v["coverage"] - 1e-6 <= v["coverage_total"] <= sel["oracle"]["coverage_total"] + 1e-6, name
    raw = rows["specache-speculative"]["selection"]
    assert raw["samples"] > 0 and 0.0 <= raw["speculation_hit_rate"] <= 1.0 and 0 < raw["region_mass"] <= 1.0
    assert len(raw["per_layer"]) == 2
    # corrected speculation (the default): the share of the used sets the prefetch had brought; current has none
    assert 0 < per["specache-speculative"]["prefetch_reuse"] <= 1 and per["specache"]["prefetch_reuse"] is None
    assert "Prefetch reuse" in md
    assert per["kivi-1b"].get("selection") is None and rows["window"]["selection"] is None
    # on a CPU the default prefetch is current: each pass fetched its own set (no speculative token)
    assert result["modes"][-1]["config"]["prefetch"] == "current"
    cur = rows["specache"]["selection"]
    assert cur["samples"] > 0 and cur["speculation_hit_rate"] is None
    assert cur["selectors"]["guide_spec"]["coverage"] is None and cur["selectors"]["guide_own"]["coverage"] > 0
    assert 0 < cur["selectors"]["fetched"]["coverage"] <= cur["selectors"]["oracle"]["coverage"] + 1e-6
    assert per["kivi-1b"]["device_bytes"] < per["specache"]["device_bytes"] < per["full"]["device_bytes"]
    assert {t["name"].split(" ")[0] for t in result["targets"]} == {"specache"}
    assert "## Agreement" in md and "## Selection quality" in md and "## Targets" in md


def test_compare_helpers():
    lp = torch.log_softmax(torch.randn(5, 11, generator=torch.Generator().manual_seed(0)), -1)
    same = compare_distributions(lp, lp)
    assert same["top1_agreement"] == 1.0 and same["mean_kl"] == 0.0 and same["first_disagreement"] is None
    other = compare_distributions(lp, lp.flip(-1))
    assert other["mean_kl"] > 0
    assert compare_tokens([1, 2, 3, 4], [1, 2, 9, 4]) == {"identical_prefix": 2, "reference_tokens": 4, "tokens": 4,
                                                          "equal_share": 0.75}
    assert compare_tokens([1, 2], [1, 2, 3, 4])["equal_share"] == 0.5


# ---- speed -------------------------------------------------------------------------------

def test_speed_quick_child_processes(bench):
    result, md, _ = bench("speed")
    labels = ["full", "specache", "hf"]
    check_envelope(result, "speed", labels)
    s = result["settings"]
    assert s["lengths"] == [256] and s["batches"] == [1, 2] and s["isolated"] is True
    for m in result["per_mode"]:
        assert [(c["length"], c["batch"]) for c in m["configs"]] == [(256, 1), (256, 2)]
        for c in m["configs"]:
            assert len(c["decode_ms_segments"]) == s["repeats"] == 2
            assert c["decode_ms_per_token"] > 0 and c["prefill_tokens_per_s"] > 0
            assert c["decode_tokens_per_s"] == pytest.approx(c["batch"] * 1e3 / c["decode_ms_per_token"])
        rss = m["rss"]
        assert rss["isolated"] and rss["peak_bytes"] >= rss["model_bytes"] > 10 * 2**20
        assert m["torch_threads"] == 1 and len(m["load_average"]["start"]) == 3
    rows = {(c["mode"], c["batch"]): c for c in result["comparison"]}
    assert len(rows) == 6
    assert rows[("full", 1)]["decode_speedup_vs_full"] == 1.0 and rows[("hf", 2)]["decode_speedup_vs_hf"] == 1.0
    spec = rows[("specache", 1)]
    assert spec["decode_speedup_vs_full"] == pytest.approx(
        rows[("full", 1)]["decode_ms_per_token"] / spec["decode_ms_per_token"])
    assert len(result["targets"]) == 4  # vs full and vs hf, batch 1 and 2
    assert "## Results" in md and "## Peak RSS per mode" in md


def test_speed_in_process(bench):
    result, _, _ = bench("speed", "--in-process", "--modes", "kivi-1b,window", "--batches", "1", "--lengths", "128")
    assert result["settings"]["isolated"] is False
    assert all(m["rss"]["peak_bytes"] is None and m["torch_threads"] == 1 for m in result["per_mode"])
    assert [c["mode"] for c in result["comparison"]] == ["kivi-1b", "window"]
    assert result["comparison"][0]["decode_speedup_vs_full"] is None  # no full in this run
    assert result["targets"][0]["met"] is None


def test_decode_side_by_side_quick(bench):
    result, markdown, _ = bench("decode", "--modes", "full,specache-k16,hf", "--batches", "1,2", "--length", "200")
    check_envelope(result, "decode", ["full", "specache-k16", "hf"])
    rows = {(x["mode"], x["batch"]): x for x in result["rows"]}
    assert set(rows) == {(m, b) for m in ("full", "specache-k16", "hf") for b in (1, 2)}
    for (mode, batch), x in rows.items():
        assert len(x["ms_per_step_all"]) == 2 and x["ms_per_step"] > 0
        assert x["tokens_per_s"] == pytest.approx(batch * 1000 / x["ms_per_step"], rel=1e-2)
        assert x["speedup_vs_full"] == pytest.approx(rows[("full", batch)]["ms_per_step"] / x["ms_per_step"], rel=1e-2)
    assert rows[("hf", 1)]["speedup_vs_hf"] == 1.0 and rows[("full", 2)]["speedup_vs_full"] == 1.0
    assert [t["goal"] for t in result["targets"]] == [">= 1.5x", ">= 2.5x"] * 2
    assert "| specache-k16 | 2 |" in markdown
    from engine import native

    kernels = result["environment"]["kernels"]  # which code ran: the ISA and each kernel's path
    assert kernels["isa"] == native.isa() and kernels["arch"] == native.arch()
    assert kernels["decode_attention"] in ("native", "torch") and set(kernels["decode_linears"].values()) <= {"native", "torch"}
    assert f"native kernels {native.isa()}" in markdown
    table = CliRunner().invoke(app, ["bench", "decode", "--quick", "--model", str(bench.model_dir), "--out", str(bench.out),
                                     "--threads", "1", "--quiet", "--modes", "full,specache-k16", "--batches", "1",
                                     "--length", "64"], catch_exceptions=False)
    assert table.exit_code == 0 and f"native kernels {native.isa()} (-march={native.arch()})" in table.stdout


# ---- flags and helpers -------------------------------------------------------------------

@pytest.mark.parametrize("args", [
    ["needle", "--modes", "full,bogus"],
    ["needle", "--modes", "hf"],
    ["fidelity", "--modes", "kivi-k64"],
    ["speed", "--batches", "0"],
    ["decode", "--burst", "0"],
    ["decode", "--modes", "full,nope"],
    ["needle", "--depths", "1.5"],
    ["needle", "--lengths", "2000"],  # beyond the tiny model's 1024-token window
])
def test_bad_flags_exit_2(tiny_model_dir, tmp_path, args):
    r = CliRunner().invoke(app, ["bench", *args, "--quick", "--quiet", "--model", str(tiny_model_dir),
                                 "--out", str(tmp_path)])
    assert r.exit_code == 2, r.output
    assert "error:" in r.stderr
    assert not list(tmp_path.iterdir())  # nothing written


def test_mode_labels():
    assert parse_mode("specache").config == CacheConfig(mode="specache")
    s = parse_mode("specache-1b-k128-g32-r32-s2")
    assert (s.config.bits, s.config.k, s.config.group, s.config.residual, s.config.sinks) == (1, 128, 32, 32, 2)
    assert (parse_mode("specache-1b-g128-o4").config.group, parse_mode("specache-1b-g128-o4").config.outliers) == (128, 4)
    assert parse_mode("kivi-2b").config.k == 0 and parse_mode("window-w300").config.window == 300
    assert parse_mode("hf").config is None and parse_mode("specache").is_default_specache
    assert not parse_mode("specache-1b").is_default_specache
    assert parse_mode("specache-both").config.select_both and not parse_mode("specache-spec").config.select_both
    assert parse_mode("specache-resync").config.resync and not parse_mode("specache-noresync").config.resync
    assert parse_mode("specache-current").config.prefetch == "current"
    assert parse_mode("specache-speculative").config.prefetch == "speculative"
    cpu = {"prefetch": "current"}  # a CPU's default; the speculative decoder's own options imply it
    assert parse_mode("specache-noresync", cpu).config.prefetch == "speculative"
    assert parse_mode("specache", cpu).config.prefetch == "current"
    model = {"bits": 2, "group": 64, "k": 512}  # a model profile's defaults (engine.plan.profiles.model_defaults)
    assert parse_mode("specache", model).config.k == 512 and parse_mode("specache", model).is_default_specache
    assert parse_mode("specache-k64", model).config.k == 64 and parse_mode("kivi", model).config.k == 0
    assert parse_mode("specache-1b", {**model, "bits": 2}).config.bits == 1
    # a label that names (or implies) the other prefetch gets that mode's k; an explicit k wins
    per_mode = {**model, "k": 128, "prefetch": "current", "k_for": {"current": {"k": 128}, "speculative": {"k": 512}}}
    assert parse_mode("specache", per_mode).config.k == 128
    assert parse_mode("specache-speculative", per_mode).config.k == 512
    assert parse_mode("specache-noresync", per_mode).config.k == 512
    assert parse_mode("specache-speculative-k64", per_mode).config.k == 64
    assert parse_mode("kivi", per_mode).config.k == 0 and "k_for" in per_mode  # the caller's dict is not changed
    assert [m.label for m in parse_modes("full,specache,full", allow_hf=True)] == ["full", "specache"]
    for bad in ("fast", "specache-3b", "specache-x1", "full-w10", "hf-1b"):
        with pytest.raises(BadArgument):
            parse_mode(bad)


def test_write_atomic_and_png(tmp_path):
    path = write_atomic(tmp_path / "sub" / "a.json", "{}")
    write_atomic(path, b"[]")
    assert path.read_text() == "[]" and [p.name for p in path.parent.iterdir()] == ["a.json"]
    mask = os.umask(0)
    os.umask(mask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~mask
    png = heatmap_png([("a", [[0.0, 0.5], [1.0, None]])], ["r0", "r1"], ["c0", "c1"])
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    assert width > 2 * 36 and height > 2 * 36
    from engine.bench.heatmap import png_bytes

    raw = png_bytes([bytearray(b"\x01\x02\x03" * 2)] * 3, 2, 3)
    idat = raw[raw.index(b"IDAT") + 4: raw.index(b"IEND") - 8]
    assert zlib.decompress(idat) == (b"\x00" + b"\x01\x02\x03" * 2) * 3


def test_bench_store_reports_the_entry_and_the_same_answer(tiny_model_dir, tmp_path):
    from typer.testing import CliRunner

    from transformers import AutoTokenizer

    from specache_cli.app import app as cli_app
    from specache_cli.bench_cmd import QUICK_STORE_CHARS

    data = Path(__file__).parent / "data" / "sample.txt"
    r = CliRunner().invoke(cli_app, ["bench", "store", "--model", str(tiny_model_dir), "--doc", str(data),
                                     "--modes", "full,specache", "--out", str(tmp_path), "--json", "--quiet"])
    assert r.exit_code == 0, r.stderr
    result = json.loads(r.stdout)
    long_doc = tmp_path / "long.txt"  # --quick keeps the first QUICK_STORE_CHARS characters
    long_doc.write_text(data.read_text() * (1 + QUICK_STORE_CHARS // len(data.read_text())) * 2)
    quick = CliRunner().invoke(cli_app, ["bench", "store", "--quick", "--model", str(tiny_model_dir), "--doc",
                                         str(long_doc), "--modes", "full", "--out", str(tmp_path / "q"), "--json",
                                         "--quiet"])
    assert quick.exit_code == 0, quick.stderr
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert json.loads(quick.stdout)["document_tokens"] == \
        len(tokenizer(long_doc.read_text()[:QUICK_STORE_CHARS], add_special_tokens=False)["input_ids"])
    for mode in ("full", "specache"):
        row = result["modes"][mode]
        assert row["same_answer_as_cold"] is True
        assert row["entry_tokens"] > 100 and row["bytes_per_token"] > 0
    assert (tmp_path / "store.json").exists() and (tmp_path / "store.md").exists()
    bad = CliRunner().invoke(cli_app, ["bench", "store", "--modes", "nope", "--quiet"])
    assert bad.exit_code == 2


def test_stock_transformers_switches_the_engine_off_and_back(tiny_model):
    """The hf baseline runs stock transformers: SDPA and plain nn.Linear during the block only."""
    from engine.bench.common import stock_transformers
    from engine.model.linears import SkinnyLinear

    skinny = sum(isinstance(m, SkinnyLinear) for m in tiny_model.modules())
    engine_attn = tiny_model.config._attn_implementation
    assert skinny > 0 and engine_attn == "specache"
    with stock_transformers(tiny_model):
        assert not any(isinstance(m, SkinnyLinear) for m in tiny_model.modules())
        assert tiny_model.config._attn_implementation == "sdpa"
    assert sum(isinstance(m, SkinnyLinear) for m in tiny_model.modules()) == skinny
    assert tiny_model.config._attn_implementation == engine_attn


def test_the_hf_baseline_runs_a_model_whose_weights_are_held_in_blocks(tiny_model):
    """A GGUF model keeps no fp32 weight (engine/model/linears.py); the stock-transformers baseline
    gives it the fp32 weight transformers would hold, and takes it away after."""
    from engine.bench.common import stock_transformers
    from engine.model.held_weights import pack_weight
    from engine.model.linears import SkinnyLinear
    from tests.test_linears import affine4_weight

    lin = next(m for m in tiny_model.modules() if isinstance(m, SkinnyLinear) and m.in_features % 32 == 0)
    w = affine4_weight(*lin.weight.shape)
    held = pack_weight(w)
    if held is None:
        pytest.skip("native kernels unavailable here")
    saved = (lin.weight, lin.held)
    try:
        lin.weight, lin.held = None, held
        x = torch.randn(3, lin.in_features)
        with torch.no_grad(), stock_transformers(tiny_model):
            assert type(lin) is torch.nn.Linear and torch.equal(lin.weight, w)
            torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, w, lin.bias))
        assert type(lin) is SkinnyLinear and lin.weight is None
    finally:
        lin.weight, lin.held = saved


def test_kl_takes_zero_log_zero_as_zero():
    """A token both distributions give probability 0 (log-prob -inf) adds nothing to the KL (it was nan)."""
    ref = torch.log_softmax(torch.tensor([[0.0, 1.0, float("-inf")]]), -1)
    other = torch.log_softmax(torch.tensor([[0.1, 1.0, float("-inf")]]), -1)
    out = compare_distributions(ref, other)
    assert out["mean_kl"] is not None and 0 < out["mean_kl"] < 0.01


def test_the_bench_options_are_one_group_in_front_of_a_commands_own(tmp_path):
    """BenchRun (specache_cli/bench_common.py) through specache_cli.options.grouped: the shared options land on
    it, the command's own reach it by name, --help lists them in the declared order, a bad --out is refused."""
    seen = {}

    def probe(run: BenchRun, doc: list[str] = typer.Option([], "--doc", "-d"),
              count: int = typer.Option(3, "--count")) -> None:
        seen.update(run=run, doc=doc, count=count)

    group = typer.Typer()
    group.command()(guarded(grouped(probe)))
    r = CliRunner().invoke(group, ["--quick", "--threads", "2", "-d", "a.txt", "-d", "b.md", "--count", "5",
                                   "--out", str(tmp_path), "--json"])
    assert r.exit_code == 0, r.output
    run = seen["run"]
    assert (run.quick, run.threads, run.json_out, run.folder, seen["doc"], seen["count"]) == \
        (True, 2, True, tmp_path, ["a.txt", "b.md"], 5)
    assert (run.pick(None, "q", "f"), run.pick(0, "q", "f"), run.quick_or("q", "f")) == ("q", 0, "q")
    text = CliRunner().invoke(group, ["--help"], env={"COLUMNS": "200"}).output
    flags = ["--model", "--out", "--quick", "--json", "--device", "--quiet", "--threads", "--doc", "--count"]
    assert [text.index(f + " ") for f in flags] == sorted(text.index(f + " ") for f in flags)
    refused = CliRunner().invoke(group, ["--quick", "--out", "bench-results"])
    assert refused.exit_code == 2 and "committed results" in refused.output
