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
    assert json.loads(r.stdout)["cache"]["outliers"] == 2  # the 2-bit default (engine.config.DEFAULT_OUTLIERS)
    r = cli(*args, "--prefetch", "speculative")
    assert r.exit_code == 0, r.stderr
    cache = json.loads(r.stdout)["cache"]
    assert cache["prefetch"] == "speculative" and cache["correct"] is True  # corrected by default
    assert 0 < cache["prefetch_reuse"] <= 1  # the share of the corrected sets the prefetch had brought
    r = cli(*args, "--prefetch", "speculative", "--no-correct", "--rotation", "hadamard")
    assert r.exit_code == 0, r.stderr
    cache = json.loads(r.stdout)["cache"]
    assert cache["correct"] is False and cache["rotation"] == "hadamard" and "prefetch_reuse" not in cache
    r = cli(*args[:-4], "--bits", "1", "--group", "128", "--outliers", "4")
    assert r.exit_code == 0, r.stderr
    cache = json.loads(r.stdout)["cache"]
    assert (cache["bits"], cache["group"], cache["outliers"]) == (1, 128, 4)
    r = cli(*args[:-4], "--bits", "1")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["cache"]["outliers"] == 4  # the 1-bit default


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
    (["summarize", str(DATA / "sample.txt"), "--rotation", "fourier"], 2, "--rotation"),
    (["summarize", str(DATA / "sample.txt"), "--outliers", "17"], 2, "--outliers"),
    (["summarize", str(DATA / "sample.txt"), "--group", "96"], 2, "--group"),
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
    assert r.exit_code == 3  # a path that does not exist: input not found
    assert r.stderr.startswith("error: model not found:") and len(r.stderr.strip().splitlines()) == 1


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


# ---- what a person sees: a terminal, a log, the version, finish_reason ----------------------------

def _run_in_pty(args: list[str], cols: int = 160, rows: int = 60, timeout: float = 240.0) -> tuple[str, str]:
    """Run args with stdout and stderr on one pseudo-terminal of cols x rows; return (the screen's text as
    a terminal emulator (pyte) shows it, the raw bytes decoded)."""
    import fcntl
    import os
    import pty
    import select
    import struct
    import subprocess
    import sys
    import termios
    import time

    import pyte

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": str(cols), "LINES": str(rows)}
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen([sys.executable, "-m", "specache_cli", *args], stdin=subprocess.DEVNULL, stdout=slave,
                            stderr=slave, env=env, cwd=Path(__file__).parent.parent, close_fds=True)
    os.close(slave)
    raw, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            raw += chunk
        elif proc.poll() is not None:
            break
    proc.wait(timeout=30)
    os.close(master)
    assert proc.returncode == 0, raw.decode(errors="replace")[-2000:]
    screen = pyte.Screen(cols, rows)
    stream = pyte.ByteStream(screen)
    stream.feed(raw.replace(b"\r\n", b"\n").replace(b"\n", b"\r\n"))  # the pty's own output mode may vary
    return "\n".join(line.rstrip() for line in screen.display).strip("\n"), raw.decode(errors="replace")


def _render(text: str, cols: int) -> list[str]:
    """text as a terminal of `cols` columns shows it (pyte: wide characters, wrapping, and control
    characters such as a backspace that a random model's tokens may hold), one string per screen line."""
    import pyte

    screen = pyte.Screen(cols, text.count("\n") + len(text) // cols + 2)
    pyte.Stream(screen).feed(text.replace("\n", "\r\n"))
    lines = [line.rstrip() for line in screen.display]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def test_streamed_text_in_a_terminal_reads_like_the_piped_text(tiny_model_dir):
    # the answer streams token by token into a terminal while rich shows the prefill bar on the same
    # terminal; the screen must show the same text as a pipe gets, on as many lines as it has, with
    # the progress display gone (it used to print one token per line through rich's stdout redirect)
    import subprocess
    import sys

    args = ["summarize", str(DATA / "sample.txt"), "--model", str(tiny_model_dir), "--no-store",
            "--max-tokens", "60", "--chunk-size", "64", "--threads", "1"]  # no "machine is busy" note
    piped = subprocess.run([sys.executable, "-m", "specache_cli", *args, "--quiet"], capture_output=True, text=True,
                           cwd=Path(__file__).parent.parent, timeout=240)
    assert piped.returncode == 0, piped.stderr
    text = piped.stdout.removesuffix("\n")
    assert len(text.split()) > 5 and text == text.strip()
    screen, raw = _run_in_pty(args)
    assert "\x1b[" in raw  # rich did draw a live display on the terminal
    lines = screen.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("model ")) + 1
    end = max(i for i, line in enumerate(lines) if line.startswith("single: prefill"))  # timings after the text
    assert lines[start:end] == _render(text, 160), screen
    assert "━" not in screen and "prefill" not in "\n".join(lines[:end])


def test_progress_in_a_log_is_plain_lines(tiny_model_dir):
    # stderr not a terminal (a batch job's log): one plain line per finished stage, counts and seconds
    r = CliRunner().invoke(app, ["summarize", str(EXAMPLES / "report.pdf"), "--model", str(tiny_model_dir),
                                 "--no-store", "--max-tokens", "4", "--json"])
    assert r.exit_code == 0, r.stderr
    assert "\x1b" not in r.stderr and "\r" not in r.stderr
    lines = r.stderr.splitlines()
    assert any(line.startswith("reading report.pdf: 14/14 pages in ") for line in lines), r.stderr
    sections = [line for line in lines if line.startswith("section ")]
    obj = json.loads(r.stdout)
    assert len(sections) == obj["sections"]
    assert all(" tokens in " in line and line.endswith(" s") for line in sections)
    assert any(line.startswith("combine: ") for line in lines)


def test_log_progress_prints_running_stages_now_and_then():
    from io import StringIO

    from rich.console import Console

    from specache_cli.render import LOG_EVERY, LogProgress

    now = [0.0]
    out = StringIO()
    log = LogProgress(Console(file=out, width=40), clock=lambda: now[0])
    task = log.add_task("prefill", total=9000, unit="tokens")
    log.update(task, completed=512)
    assert out.getvalue() == ""
    now[0] = LOG_EVERY + 1
    log.update(task, completed=1024)
    now[0] = LOG_EVERY + 5
    log.update(task, completed=9000)
    log.update(task, completed=9000)  # printed once
    assert out.getvalue().splitlines() == [f"prefill: 1024/9000 tokens in {LOG_EVERY + 1:.1f} s so far",
                                           f"prefill: 9000/9000 tokens in {LOG_EVERY + 5:.1f} s"]


def test_version():
    r = CliRunner().invoke(app, ["--version"])
    assert r.exit_code == 0
    assert r.stdout.startswith("specache ") and r.stdout.split()[1][0].isdigit()


def test_finish_reason_length_and_the_answer_ends_at_a_sentence(cli):
    r = cli("summarize", str(DATA / "sample.txt"), "--max-tokens", "3", "--json")
    obj = json.loads(r.stdout)
    assert obj["finish_reason"] == "length" and obj["generated_tokens"] == 3


def test_cut_at_sentence():
    from engine.jobs.pipeline import cut_at_sentence

    assert cut_at_sentence("One. Two three") == "One."
    assert cut_at_sentence('He said "go." and then') == 'He said "go."'
    assert cut_at_sentence("no sentence end") == "no sentence end"
    assert cut_at_sentence("Pi is 3.14 and") == "Pi is 3.14 and"
    assert cut_at_sentence("One. Two three", shown=8) == "One. Two three"  # already on the screen: kept


@pytest.mark.parametrize("flag, value", [("--repeat-penalty", "0"), ("--repeat-penalty", "nan"),
                                         ("--no-repeat-ngram", "-1"), ("--top-k", "-2"), ("--min-p", "1.5"),
                                         ("--temperature", "nan")])
def test_bad_decoding_flags(cli, flag, value):
    r = cli("summarize", str(DATA / "sample.txt"), flag, value)
    assert r.exit_code == 2 and r.stderr.startswith("error: ") and flag in r.stderr


def test_plan_on_a_cpu_has_no_host_or_transfer_rows():
    runner = CliRunner(env={"COLUMNS": "250"})  # table rows on one line each
    r = runner.invoke(app, ["plan", "--gpu", "cpu"])
    assert r.exit_code == 0, r.stderr
    assert "host RAM unknown" not in r.stdout and "transfer / step" not in r.stdout
    assert "prefetch hidden" not in r.stdout and "exact store (same RAM)" in r.stdout
    gpu = runner.invoke(app, ["plan", "--gpu", "rtx-a6000"])
    assert "transfer / step" in gpu.stdout and "pass --host-ram to check" in gpu.stdout


def test_the_timings_line_says_what_the_guide_ran_with(tiny_model_dir):
    """stderr's closing line names the guide's settings (the model's defaults or the flags) and its
    watch, as --json's cache object has them; a mode without a guide says nothing of one."""
    runner = CliRunner()
    base = ["summarize", str(DATA / "sample.txt"), "--model", str(tiny_model_dir), "--no-store", "--max-tokens", "8",
            "--json", "--group", "32"]
    r = runner.invoke(app, base + ["--bits", "1", "--k", "24", "--rotation", "none"])
    assert r.exit_code == 0, r.stderr
    c = json.loads(r.stdout)["cache"]
    assert (c["bits"], c["k"], c["rotation"], c["rotated_layers"]) == (1, 24, "none", 0)
    assert c["guided_layers"] >= 1
    assert f"guide 1-bit, k 24" in r.stderr and "rotation" not in r.stderr.split("guide 1-bit")[1]
    r = runner.invoke(app, base + ["--rotation", "hadamard"])
    c = json.loads(r.stdout)["cache"]
    assert f"rotation hadamard ({c['guided_layers']} of {c['guided_layers']} layers rotated)" in r.stderr
    r = runner.invoke(app, base + ["--cache", "full"])
    assert r.exit_code == 0 and "guide" not in r.stderr.split("single:")[1]


class DroppingTokenizer:
    """A tokenizer that drops every character of a text (its ids: none), around the model's own."""

    def __init__(self, tok):
        self.tok = tok

    def __call__(self, text, **kwargs):
        return {"input_ids": []}

    def __getattr__(self, name):
        return getattr(self.tok, name)


@pytest.mark.parametrize("command", [["summarize"], ["ask", "What is it?", "--doc"]])
def test_a_document_that_tokenizes_to_nothing_is_one_error_line_and_the_empty_document_code(tiny_model_dir,
                                                                                             monkeypatch, command):
    """A text that is not blank but of which the tokenizer keeps nothing: the empty-document exit code (8) and one
    `error:` line naming the file, no traceback (it was an internal error deep in the prefill)."""
    from engine.model import loading

    load = loading.load_model

    def dropping(*args, **kwargs):
        lm = load(*args, **kwargs)
        lm.tokenizer = DroppingTokenizer(lm.tokenizer)
        return lm

    monkeypatch.setattr("engine.jobs.prepare.load_model", dropping)
    r = CliRunner().invoke(app, [*command, str(DATA / "sample.txt"), "--model", str(tiny_model_dir), "--no-store",
                                 "--max-tokens", "4"])
    assert r.exit_code == 8, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "sample.txt" in errors[0] and "tokenizes to nothing" in errors[0], r.stderr
    assert "Traceback" not in r.stderr


def test_an_empty_prompt_is_an_empty_document_not_an_internal_error(tiny_model):
    from engine.config import CacheConfig, GenerationConfig
    from engine.errors import EmptyDocument
    from engine.generate.engine import Engine

    for mode in ("full", "specache"):
        engine = Engine(tiny_model, CacheConfig(mode=mode))
        with pytest.raises(EmptyDocument) as info:
            list(engine.generate([[5, 6, 7], []], GenerationConfig(max_tokens=2)))
        assert info.value.exit_code == 8
        with pytest.raises(EmptyDocument):
            list(engine.teacher_forced([], [5]))
