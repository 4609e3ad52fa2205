"""--workers N on Ray: one local Ray runtime for the module (2 CPUs, no dashboard, a small object
store), 2 actors on the tiny test model. Every document exactly once with the single-process
text; Ctrl-C then --resume; an actor killed by its pid mid-job; bad inputs per document."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import ray
from typer.testing import CliRunner

from engine.jobs.workers import Task, group_size, start_local_ray, summarize_tasks
from specache_cli.app import app
from tests.conftest import sigint_as_in_a_terminal

ROOT = Path(__file__).parent.parent
DATA = Path(__file__).parent / "data"
TEXTS = ROOT / "examples" / "texts"
SIZES = (2400, 600, 1800, 300, 1200, 2000)  # characters: the tiny model's window is 1024 tokens
COMMON = ("--quiet", "--no-store", "--jsonl")


MARK = f"SPECACHE_TEST_WORKERS={os.getpid()}"  # in the environment of this module's Ray processes only


@pytest.fixture(scope="module")
def ray_runtime(monkeypatch_module):
    name, value = MARK.split("=")
    monkeypatch_module.setenv(name, value)  # inherited by the runtime's processes, so kills hit only them
    start_local_ray(ray, num_cpus=2, object_store_mb=200, quiet=True)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def docs(tmp_path_factory) -> list[str]:
    """Six documents of different lengths cut from the examples' texts."""
    text = (TEXTS / "federalist.txt").read_text(encoding="utf-8")
    out, at = [], 0
    folder = tmp_path_factory.mktemp("docs")
    for i, size in enumerate(SIZES):
        cut = text.find("\n\n", at + size)
        path = folder / f"doc{i}.txt"
        path.write_text(text[at:cut].strip() + "\n", encoding="utf-8")
        out.append(str(path))
        at = cut
    return out


@pytest.fixture(scope="module")
def cli(tiny_model_dir):
    runner = CliRunner()

    def invoke(*args):
        return runner.invoke(app, [args[0], "--model", str(tiny_model_dir), *COMMON, *args[1:]],
                             catch_exceptions=False)

    return invoke


@pytest.fixture(scope="module")
def reference(cli, docs) -> dict[str, str]:
    """The single-process run's text per document (greedy)."""
    r = cli("summarize", *docs, "--max-tokens", "24")
    assert r.exit_code == 0, r.stderr
    return {o["source"]: o["text"] for o in map(json.loads, r.stdout.splitlines())}


def lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


def test_tasks_longest_first_in_groups_of_similar_length():
    docs = [("x" * n, f"d{n}") for n in (100, 900, 400, 50, 700, 300, 800)]
    tasks = summarize_tasks(docs, workers=2, batch=None)
    order = [s for t in tasks for _, s in t.docs]
    assert order == ["d900", "d800", "d700", "d400", "d300", "d100", "d50"]
    assert [len(t.docs) for t in tasks] == [2, 2, 2, 1]  # about two tasks per worker
    assert group_size(100, 2, 3) == 3 and group_size(3, 4, None) == 1
    retry = tasks[0].split(iter(range(10, 20)).__next__)
    assert [(t.key, t.attempt, t.docs) for t in retry] == [(10, 2, (tasks[0].docs[0],)), (11, 2, (tasks[0].docs[1],))]
    assert Task(0, "ask", (("t", "s"),), ("a", "b")).units() == [("s", "a"), ("s", "b")]


def test_two_workers_do_every_document_once_with_the_single_process_text(ray_runtime, cli, docs, reference):
    r = cli("summarize", *docs, "--max-tokens", "24", "--workers", "2")
    assert r.exit_code == 0, r.stderr
    got = lines(r.stdout)
    assert sorted(o["source"] for o in got) == sorted(docs)  # each exactly once
    assert {o["source"]: o["text"] for o in got} == reference
    assert all(o["generated_tokens"] >= 1 and o["strategy"] == "single" for o in got)


def test_ask_questions_shared_out_among_workers(ray_runtime, cli, docs):
    questions = ["Who wrote this?", "What is proposed?", "Why a union?", "Which states?", "When?"]
    args = ["ask", "--doc", docs[1], *[a for q in questions for a in ("-q", q)], "--max-tokens", "12"]
    one = cli(*args)
    many = cli(*args, "--workers", "2")
    assert one.exit_code == 0 and many.exit_code == 0, many.stderr
    assert sorted((o["question"], o["text"]) for o in lines(many.stdout)) == \
        sorted((o["question"], o["text"]) for o in lines(one.stdout))


def test_ctrl_c_leaves_whole_lines_and_resume_finishes_without_duplicates(ray_runtime, cli, docs, reference,
                                                                          tiny_model_dir, tmp_path):
    """A real SIGINT to a real process (joined to this module's runtime) after its first line."""
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "specache_cli", "summarize", *docs, "--model", str(tiny_model_dir), *COMMON,
           "--max-tokens", "24", "--workers", "2", "--batch", "1", "--ray-address", ray_runtime]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=sigint_as_in_a_terminal)
    first = proc.stdout.readline()
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=120)
    out.write_text(first + rest, encoding="utf-8")
    assert proc.returncode == 130, err
    assert "interrupted" in err
    written = lines(out.read_text())  # every line whole
    assert 1 <= len(written) < len(docs), "the interrupt came after the whole job"

    r = cli("summarize", *docs, "--max-tokens", "24", "--workers", "2", "--resume", str(out))
    assert r.exit_code == 0, r.stderr
    both = written + lines(r.stdout)
    assert Counter(o["source"] for o in both) == Counter(docs)
    assert {o["source"]: o["text"] for o in both} == reference


def kill_running_worker(times: int, killed: list[int], stop: threading.Event) -> None:
    """Kill (SIGKILL) a worker of this module's Ray runtime while it runs a task (its process title is
    ray::DocWorker.run), `times` times."""
    while len(killed) < times and not stop.is_set():
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or int(pid) in killed:
                continue
            try:
                title = Path(f"/proc/{pid}/cmdline").read_bytes()
                ours = title.startswith(b"ray::DocWorker.run") and \
                    MARK.encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if ours:
                os.kill(int(pid), signal.SIGKILL)
                killed.append(int(pid))
                break
        time.sleep(0.005)


def test_a_worker_killed_mid_job_is_restarted_and_its_documents_retried(ray_runtime, cli, docs, reference):
    killed: list[int] = []
    stop = threading.Event()
    watcher = threading.Thread(target=kill_running_worker, args=(1, killed, stop), daemon=True)
    watcher.start()
    try:
        r = cli("summarize", *docs, "--max-tokens", "24", "--workers", "2")
    finally:
        stop.set()
        watcher.join()
    assert len(killed) == 1
    assert r.exit_code == 0, r.stderr
    assert "died" in r.stderr and "retried" in r.stderr
    got = lines(r.stdout)
    assert Counter(o["source"] for o in got) == Counter(docs)
    assert {o["source"]: o["text"] for o in got} == reference


def test_a_document_whose_worker_dies_twice_gets_an_error_line(ray_runtime, cli, docs):
    killed: list[int] = []
    stop = threading.Event()
    watcher = threading.Thread(target=kill_running_worker, args=(2, killed, stop), daemon=True)
    watcher.start()
    try:
        r = cli("summarize", docs[0], docs[3], "--max-tokens", "24", "--workers", "1")
    finally:
        stop.set()
        watcher.join()
    assert len(killed) == 2
    assert r.exit_code == 13, r.stderr
    got = lines(r.stdout)
    errors = [o for o in got if "error" in o]
    # one document per task; the longer one goes first, dies, is retried first and dies again
    assert [(o["source"], o["error"]["code"]) for o in errors] == [(docs[0], "worker_died")]
    assert [o["source"] for o in got if "error" not in o] == [docs[3]]


def test_bad_inputs_fail_per_document(ray_runtime, cli, docs, reference, tmp_path):
    """A corrupt file (fails when the driver reads it) and a document too long for --strategy single
    (fails in the worker) get one error line each; the others are done; exit 13."""
    long = tmp_path / "long.txt"
    long.write_text((TEXTS / "federalist.txt").read_text(encoding="utf-8")[:20000], encoding="utf-8")
    corrupt = str(DATA / "corrupt.pdf")
    r = cli("summarize", docs[0], corrupt, docs[1], str(long), "--max-tokens", "24", "--workers", "2",
            "--strategy", "single")
    assert r.exit_code == 13
    got = lines(r.stdout)
    assert sorted((o["source"], o["error"]["code"]) for o in got if "error" in o) == \
        sorted([(corrupt, "corrupt_document"), (str(long), "too_long")])
    assert {o["source"]: o["text"] for o in got if "error" not in o} == {d: reference[d] for d in docs[:2]}
    assert r.stderr.count("error:") == 3  # one per bad document and the batch summary
    assert "2 of 4 documents failed" in r.stderr


def test_workers_without_ray_is_a_clear_error(cli, docs, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    r = cli("summarize", docs[0], "--workers", "2")
    assert r.exit_code == 2
    assert "specache[ray]" in r.stderr and "Traceback" not in r.stderr
    assert cli("summarize", docs[0], "--ray-address", "auto").exit_code == 2  # only with --workers
    assert cli("summarize", docs[0], "--workers", "0").exit_code == 2
