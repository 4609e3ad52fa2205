"""`bench task`: the scoring functions, the shipped questions, decoding labels, and `bench task --quick`
through the CLI on the tiny model (it must not write into the committed bench-results/)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from engine.bench.task import (
    QUESTIONS_FILE,
    contains_answer,
    distinct,
    load_questions,
    normalise,
    parse_decoding,
    repeats_ngram,
    rouge_l,
    words,
)
from engine.errors import BadArgument
from engine.inputs.documents import load_document
from specache_cli.app import app
from specache_cli.bench_common import QUICK_RESULTS, RESULTS, out_dir

EXAMPLES = Path(__file__).parent.parent / "examples"


def test_normalised_containment():
    assert normalise("October 27, 1787.") == "october 27 1787"
    assert contains_answer("It was published on October 27, 1787, in New York.", ["October 27, 1787"])
    assert contains_answer("The author is HAMILTON.", ["Hamilton"])
    assert not contains_answer("Majesty", ["Jay"])  # whole words only
    assert not contains_answer("NOT FOUND", ["1844"])


def test_repetition_and_diversity_measures():
    looping = words("the need for a national government to protect the people and the need for a national "
                    "government to protect the people")
    assert repeats_ngram(looping, 6) and not repeats_ngram(words("one two three four five six seven"), 6)
    assert distinct(["a", "b", "a", "b"], 2) == 2 / 3 and distinct(["a"], 2) is None
    assert rouge_l(["a", "b", "c"], ["a", "b", "c"]) == 1.0
    assert rouge_l(["a", "x", "c"], ["a", "b", "c"]) == pytest.approx(2 / 3)
    assert rouge_l(["x"], ["a"]) == 0.0


def test_decoding_labels():
    d = parse_decoding("rp1.1-nr4")
    assert (d.config.repeat_penalty, d.config.no_repeat_ngram, d.config.temperature) == (1.1, 4, 0.0)
    s = parse_decoding("t0.2-p0.9-k40-m0.05", seed=3)
    assert (s.config.temperature, s.config.top_p, s.config.top_k, s.config.min_p, s.config.seed) == (0.2, 0.9, 40,
                                                                                                    0.05, 3)
    assert parse_decoding("greedy").config.processors_off
    for bad in ("rp0", "x3", "nr-1", "p2"):
        with pytest.raises(BadArgument):
            parse_decoding(bad)


def test_the_shipped_questions_are_answered_by_their_documents():
    items = load_questions(QUESTIONS_FILE)
    assert len(items) >= 30
    texts = {}
    for item in items:
        for doc in item["docs"]:
            text = texts.setdefault(doc, load_document(str(EXAMPLES / doc)).text)
            assert contains_answer(text, item["answers"]), (doc, item["q"])
    assert any("long-report.pdf" in i["docs"] and "report.pdf" not in i["docs"] for i in items)  # only map-reduce


def test_quick_runs_never_write_the_committed_results(tmp_path):
    assert out_dir(None, quick=True) == QUICK_RESULTS and out_dir(None, quick=False) == RESULTS
    assert out_dir(tmp_path, quick=True) == tmp_path
    with pytest.raises(BadArgument):
        out_dir(RESULTS, quick=True)
    r = CliRunner().invoke(app, ["bench", "needle", "--quick", "--out", str(EXAMPLES.parent / "bench-results")])
    assert r.exit_code == 2 and "committed" in r.stderr


def test_bench_task_quick(tiny_model_dir, tmp_path):
    r = CliRunner().invoke(app, ["bench", "task", "--quick", "--quiet", "--model", str(tiny_model_dir),
                                 "--out", str(tmp_path), "--json"])
    assert r.exit_code == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["quick"] and (tmp_path / "task.json").is_file() and (tmp_path / "task.md").is_file()
    decodings, modes = result["settings"]["decodings"], [m["label"] for m in result["modes"]]
    assert [(x["decoding"], x["mode"]) for x in result["rows"]] == [(d, m) for d in decodings for m in modes]
    assert result["asks"] and all(a["reply"] is not None for a in result["asks"])
    full = [x for x in result["rows"] if x["mode"] == "full"]
    assert all(x["rouge_l_vs_full"] == 1.0 for x in full)  # full against itself
    assert all(0 <= x["needle"] <= 1 for x in result["rows"])
    md = (tmp_path / "task.md").read_text()
    assert "| decoding | mode |" in md and "ROUGE-L vs full" in md
