"""CLI behaviour with Typer's CliRunner on a tiny random model that has the real tokenizer:
the --json contract, streaming, seeds, the long-document strategy and every bad input."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specache_cli.app import app

DATA = Path(__file__).parent / "data"
EXAMPLES = Path(__file__).parent.parent / "examples"
JSON_KEYS = {"text", "source", "model", "strategy", "prompt_tokens", "generated_tokens", "prefill_seconds",
             "decode_seconds", "decode_tokens_per_second", "cache"}


@pytest.fixture(scope="module")
def cli(tiny_model_dir):
    runner = CliRunner()

    def invoke(*args, input=None):
        return runner.invoke(app, [*args], input=input, catch_exceptions=False) if args[0] in ("--help",) else \
            runner.invoke(app, [args[0], "--model", str(tiny_model_dir), "--quiet", "--no-store", *args[1:]], input=input,
                          catch_exceptions=False)

    return invoke


def test_summarize_json_contract(cli):
    r = cli("summarize", str(DATA / "sample.txt"), "--max-tokens", "8", "--json")
    assert r.exit_code == 0, r.stderr
    obj = json.loads(r.stdout)
    assert JSON_KEYS <= set(obj)
    assert obj["source"].endswith("sample.txt")
    assert obj["strategy"] == "single"
    assert obj["generated_tokens"] >= 1 and obj["prompt_tokens"] > 100
    assert {"mode", "device_bytes", "host_bytes", "full_fp16_bytes"} <= set(obj["cache"])


def test_text_output_goes_to_stdout_only(cli):
    r = cli("summarize", str(DATA / "sample.txt"), "--max-tokens", "6")
    assert r.exit_code == 0
    assert r.stdout.strip()
    assert r.stderr == ""  # --quiet: nothing else on stderr


@pytest.mark.parametrize("mode", ["full", "specache", "kivi", "window"])
def test_every_cache_mode_runs(cli, mode):
    r = cli("ask", "--doc", str(DATA / "sample.txt"), "What is this about?", "--cache", mode, "--max-tokens", "5",
            "--json", "--group", "32")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["cache"]["mode"] == mode


def test_prefetch_defaults_to_current_on_the_cpu_and_can_be_speculative(cli):
    args = ("ask", "--doc", str(DATA / "sample.txt"), "What is this about?", "--max-tokens", "5", "--json",
            "--group", "32", "--device", "cpu")
    r = cli(*args)
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["cache"]["prefetch"] == "current"  # the host store is this device's own RAM
    r = cli(*args, "--prefetch", "speculative")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["cache"]["prefetch"] == "speculative"


def test_jsonl_one_line_per_document_and_stdin(cli):
    text = (DATA / "sample.txt").read_text()
    r = cli("summarize", "-", str(DATA / "short.md"), "--max-tokens", "4", "--jsonl", input=text)
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert [json.loads(x)["source"] for x in lines] == ["-", str(DATA / "short.md")]


def test_same_seed_same_output(cli):
    args = ("summarize", str(DATA / "sample.txt"), "--max-tokens", "12", "--temperature", "1.0", "--json")
    a = json.loads(cli(*args, "--seed", "3").stdout)["text"]
    b = json.loads(cli(*args, "--seed", "3").stdout)["text"]
    c = json.loads(cli(*args, "--seed", "4").stdout)["text"]
    assert a == b and a != c


def test_long_document_uses_map_reduce(cli):
    # the tiny model has a 1024-token window: the 6.5k-token report must be summarized in sections
    r = cli("summarize", str(EXAMPLES / "report.pdf"), "--max-tokens", "4", "--json")
    assert r.exit_code == 0, r.stderr
    obj = json.loads(r.stdout)
    assert obj["strategy"] == "map-reduce"
    assert obj["sections"] > 3 and obj["calls"] > obj["sections"]


def test_ask_several_questions(cli):
    r = cli("ask", "--doc", str(DATA / "sample.txt"), "First?", "-q", "Second?", "--max-tokens", "3", "--jsonl")
    assert r.exit_code == 0, r.stderr
    assert [json.loads(x)["question"] for x in r.stdout.strip().splitlines()] == ["First?", "Second?"]


@pytest.mark.parametrize("args,code,needle", [
    (["summarize", "missing.pdf"], 3, "no such file"),
    (["summarize", str(DATA)], 4, ""),
    (["summarize", str(DATA / "corrupt.pdf")], 5, "corrupt"),
    (["summarize", str(DATA / "encrypted.pdf")], 6, "--password"),
    (["summarize", str(DATA / "encrypted.pdf"), "--password", "wrong"], 6, ""),
    (["summarize", str(DATA / "scanned.pdf")], 7, "OCR"),
    (["summarize", str(DATA / "empty.txt")], 8, "empty"),
    (["summarize", str(EXAMPLES / "report.pdf"), "--strategy", "single"], 9, "tokens"),
    (["summarize", str(DATA / "sample.txt"), "--bits", "3"], 2, "--bits"),
    (["summarize", str(DATA / "sample.txt"), "--cache", "nope"], 2, "--cache"),
    (["summarize", str(DATA / "sample.txt"), "--strategy", "nope"], 2, "--strategy"),
    (["summarize", str(DATA / "sample.txt"), "--prefetch", "later"], 2, "--prefetch"),
    (["summarize", str(DATA / "sample.txt"), "--max-tokens", "0"], 2, "--max-tokens"),
    (["ask", "--doc", str(DATA / "sample.txt")], 2, "question"),
])
def test_bad_input_one_line_error_and_exit_code(cli, args, code, needle):
    r = cli(*args)
    assert r.exit_code == code, (r.stdout, r.stderr)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    assert needle.lower() in lines[0].lower()
    assert "Traceback" not in r.stderr


def test_encrypted_pdf_with_password(cli):
    r = cli("summarize", str(DATA / "encrypted.pdf"), "--password", "secret", "--max-tokens", "3", "--json")
    assert r.exit_code == 0, r.stderr


def test_batch_continues_after_a_bad_file(cli):
    r = cli("summarize", str(DATA / "sample.txt"), str(DATA / "corrupt.pdf"), "--max-tokens", "3", "--jsonl")
    assert r.exit_code == 13
    first, second = [json.loads(x) for x in r.stdout.strip().splitlines()]
    assert first["text"] is not None and second["error"]["code"] == "corrupt_document"


def test_batch_continues_after_a_document_the_model_cannot_take(cli):
    """A model-time error (too long for --strategy single) fails that document only, in its place."""
    long_doc = DATA.parent.parent / "examples" / "texts" / "origin-of-species-introduction.txt"  # > 1024 tokens
    r = cli("summarize", str(long_doc), str(DATA / "sample.txt"), "--strategy", "single", "--max-tokens", "3", "--jsonl")
    assert r.exit_code == 13, r.stderr
    first, second = [json.loads(x) for x in r.stdout.strip().splitlines()]
    assert first["error"]["code"] == "too_long" and first["source"].endswith("introduction.txt")
    assert second["source"].endswith("sample.txt") and second["generated_tokens"] >= 1
    single = cli("summarize", str(long_doc), "--strategy", "single", "--max-tokens", "3")
    assert single.exit_code == 9 and single.stderr.startswith("error:")  # one document: its own exit code


def test_missing_model_folder(tmp_path):
    r = CliRunner().invoke(app, ["summarize", str(DATA / "sample.txt"), "--model", str(tmp_path / "no")])
    assert r.exit_code == 10
    assert "model folder not found" in r.stderr


def test_planner_picks_batch_and_reports_it(cli):
    r = cli("summarize", str(DATA / "sample.txt"), str(DATA / "short.md"), "--max-tokens", "4", "--jsonl",
            "--cache", "specache")
    assert r.exit_code == 0, r.stderr
    objs = [json.loads(x) for x in r.stdout.strip().splitlines()]
    assert [o["source"] for o in objs] == [str(DATA / "sample.txt"), str(DATA / "short.md")]
    for o in objs:
        assert o["plan"]["chosen_by"] == "planner" and o["plan"]["batch"] == 2 and o["batch"] == 2
        assert o["plan"]["k"] == o["cache"]["k"]


def test_batch_flag_and_questions_share_one_decode_batch(cli):
    r = cli("ask", "--doc", str(DATA / "sample.txt"), "One?", "-q", "Two?", "-q", "Three?", "--max-tokens", "3",
            "--jsonl", "--batch", "2")
    assert r.exit_code == 0, r.stderr
    objs = [json.loads(x) for x in r.stdout.strip().splitlines()]
    assert [o["batch"] for o in objs] == [2, 2, 1]
    assert all(o["plan"]["chosen_by"] == "flag" for o in objs)
    assert cli("ask", "--doc", str(DATA / "sample.txt"), "x", "--batch", "0").exit_code == 2


def test_batched_answers_equal_one_by_one(cli):
    args = ("ask", "--doc", str(DATA / "sample.txt"), "--max-tokens", "6", "--jsonl", "--cache", "specache")
    together = [json.loads(x)["text"] for x in cli(*args, "A?", "-q", "B?").stdout.strip().splitlines()]
    alone = [json.loads(cli(*args, q).stdout)["text"] for q in ("A?", "B?")]
    assert together == alone
