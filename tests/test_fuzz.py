"""Hostile input, hostile flags, a damaged store: every case runs the CLI in a process of its own
and must end with its documented exit code, exactly one `error:` line on stderr (none when it
works), no Python traceback, within a time limit (nothing may hang) and, for the flag cases, under
a memory ceiling (RLIMIT_AS set in the child).

Speed: a fresh interpreter takes seconds to import torch and transformers, so the cases run in
children forked from one "zygote" process that has imported the CLI once (FORK_SERVER below);
each child sets its own environment, working folder, stdin/stdout/stderr and rlimits, then calls
specache_cli.app.main(argv) exactly as the console script does. A few cases also run through a
fresh `python -m specache_cli` to keep the real entry point honest.

No case loads a model unless it says so: the document cases point --model at a stub folder (a
config.json, no weights), so a document that is read without error reaches the model load and
fails there with exit 10 ("reached the model"), in milliseconds.

The corpus is generated here (fpdf2 and pypdf write the PDFs, encrypted ones included); only
examples/report.pdf is read, to damage a real PDF.
"""
from __future__ import annotations

import json
import os
import random
import re
import resource
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parent.parent
EXAMPLES = ROOT / "examples"
GIB = 1 << 30
SMALL_TEXT = ("The committee met on Tuesday to review the budget. It approved the new library and "
              "postponed the bridge repairs until the spring.\n\n") * 6

# The zygote: imports the CLI once, then forks one child per request read from stdin (JSON lines).
FORK_SERVER = textwrap.dedent(r"""
    import json, os, resource, signal, sys, time, traceback
    from specache_cli.app import main

    def child(req):
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        if req.get("as_bytes"):
            resource.setrlimit(resource.RLIMIT_AS, (req["as_bytes"], req["as_bytes"]))
        fds = [os.open(req["stdin"] or os.devnull, os.O_RDONLY),
               os.open(req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600),
               os.open(req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)]
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        sys.stdin = open(0, "r", closefd=False)
        sys.stdout = open(1, "w", closefd=False)
        sys.stderr = open(2, "w", closefd=False)
        code = 1
        try:
            main(req["argv"])
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
            os._exit(code)

    print("ready", flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:
            child(req)
        status, deadline = None, start + req["timeout"]
        while status is None:
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status = st
            elif time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            else:
                time.sleep(0.005)
        rc = None if status is None else os.waitstatus_to_exitcode(status)
        print(json.dumps({"rc": rc, "seconds": time.monotonic() - start}), flush=True)
""")


@dataclass
class Outcome:
    rc: int | None  # None: killed at the time limit (a hang)
    stdout: str
    stderr: str
    seconds: float

    def error_lines(self) -> list[str]:
        return [x for x in self.stderr.splitlines() if x.startswith("error:")]


class ForkServer:
    """Runs specache's main(argv) in forked children of one process that imported it once."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.proc = subprocess.Popen([sys.executable, "-c", FORK_SERVER], cwd=ROOT, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert self.proc.stdout.readline().strip() == "ready"
        self.count = 0

    def run(self, argv: list[str], env: dict[str, str], stdin: Path | None = None, timeout: float = 30,
            as_bytes: int | None = None, cwd: Path | None = None) -> Outcome:
        self.count += 1
        out, err = self.workdir / f"{self.count}.out", self.workdir / f"{self.count}.err"
        req = {"argv": argv, "env": env, "stdin": str(stdin) if stdin else None, "stdout": str(out),
               "stderr": str(err), "timeout": timeout, "as_bytes": as_bytes, "cwd": str(cwd or self.workdir)}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        reply = json.loads(self.proc.stdout.readline())
        return Outcome(reply["rc"], out.read_text(errors="replace"), err.read_text(errors="replace"),
                       reply["seconds"])

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def vm_bytes(pid: int) -> int:
    """The virtual memory size of a process (what RLIMIT_AS limits)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize")


# ---- the generated corpus --------------------------------------------------------------------

def text_pdf(text: str, pages: int = 1) -> bytes:
    from fpdf import FPDF

    pdf = FPDF()
    pdf.set_font("helvetica", size=11)
    for _ in range(pages):
        pdf.add_page()
        pdf.multi_cell(0, 6, text=text)
    return bytes(pdf.output())


def encrypted_pdf(algorithm: str, password: str = "s3cret") -> bytes:
    import io

    from pypdf import PdfReader, PdfWriter

    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(text_pdf(SMALL_TEXT))))
    writer.encrypt(user_password=password, owner_password="owner-" + password, algorithm=algorithm)
    buf = io.BytesIO()
    writer.write(buf)
    return buf.getvalue()


def blank_pdf(pages: int) -> bytes:
    import io

    from pypdf import PdfWriter

    writer = PdfWriter()
    for _ in range(pages):
        writer.add_blank_page(width=200, height=200)
    buf = io.BytesIO()
    writer.write(buf)
    return buf.getvalue()


def make_corpus(root: Path) -> dict[str, Path]:
    """Damaged, encrypted, empty and odd inputs, written under root; -> name: path."""
    root.mkdir(parents=True, exist_ok=True)
    real = (EXAMPLES / "report.pdf").read_bytes()
    rng = random.Random(16)
    flipped = bytearray(real)
    for _ in range(400):
        flipped[rng.randrange(len(real) // 4, len(real))] = rng.randrange(256)
    files: dict[str, bytes] = {
        "small.txt": SMALL_TEXT.encode(),
        "empty.txt": b"",
        "spaces.txt": b"  \n\t\n   \r\n",
        "vtab.txt": b"\x0b",  # one vertical tab: whitespace, so empty (exit 8), not binary
        "formfeeds.md": b"\x0c\x0b \x1c\n",
        "nul.txt": b"some text\x00\x00\x00 and NULs" * 20,
        "controls.md": bytes(range(1, 9)) * 50,
        "utf16.txt": ("\ufeff" + SMALL_TEXT).encode("utf-16-le"),
        "latin1.md": ("Caf\u00e9 cr\u00e8me, na\u00efve r\u00e9sum\u00e9. " * 20).encode("latin-1"),
        "bom.txt": b"\xef\xbb\xbf" + SMALL_TEXT.encode(),
        "document.docx": b"PK\x03\x04" + bytes(rng.randrange(256) for _ in range(500)),
        "README": SMALL_TEXT.encode(),
        "image.png": b"\x89PNG\r\n\x1a\n" + bytes(300),
        "zero.pdf": b"",
        "header-only.pdf": b"%PDF-1.7\n",
        "garbage.pdf": b"%PDF-1.4\n" + bytes(rng.randrange(256) for _ in range(4000)),
        "text-named.pdf": SMALL_TEXT.encode(),
        "truncated.pdf": real[: len(real) // 3],
        "no-xref.pdf": real[: real.rfind(b"xref")],
        "bad-startxref.pdf": re.sub(rb"startxref\s+\d+", b"startxref\n999999", real),
        "flipped.pdf": bytes(flipped),
        "blank-page.pdf": blank_pdf(2),
        "no-pages.pdf": blank_pdf(0),
        "text.pdf": text_pdf(SMALL_TEXT, pages=2),
        "rc4.pdf": encrypted_pdf("RC4-128"),
        "aes128.pdf": encrypted_pdf("AES-128"),
        "aes256.pdf": encrypted_pdf("AES-256"),
        "-dash.txt": SMALL_TEXT.encode(),
        "name with spaces [x].txt": SMALL_TEXT.encode(),
        "questions-empty.txt": b"\n  \n",
        "jsonl-dir": None,
    }
    paths = {}
    for name, data in files.items():
        path = root / name
        if data is None:
            path.mkdir(exist_ok=True)
        else:
            path.write_bytes(data)
        paths[name] = path
    paths["folder"] = root / "a-folder.txt"
    paths["folder"].mkdir(exist_ok=True)
    paths["broken-link.txt"] = root / "broken-link.txt"
    if not paths["broken-link.txt"].is_symlink():
        paths["broken-link.txt"].symlink_to(root / "nowhere.txt")
    paths["fifo.txt"] = root / "fifo.txt"
    if not paths["fifo.txt"].exists():
        os.mkfifo(paths["fifo.txt"])
    paths["socket.txt"] = root / "socket.txt"
    if not paths["socket.txt"].exists():
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(paths["socket.txt"]))
        sock.close()
    paths["a-file"] = root / "a-file"
    paths["a-file"].write_text("not a folder")
    return paths


def stub_model(root: Path, window: int = 1024) -> Path:
    """A folder that passes the checks made before a model load (config.json with a window) and
    fails the load itself at once (no weights, no tokenizer): exit 10 means 'reached the model'."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": window}))
    return root


@dataclass
class World:
    server: ForkServer
    files: dict[str, Path]
    stub: Path
    cache: Path
    env: dict[str, str] = field(default_factory=dict)
    base_vm: int = 0

    def run(self, argv, stdin=None, env=None, timeout=30, ceiling=None, cwd=None) -> Outcome:
        return self.server.run([str(a) for a in argv], {**self.env, **(env or {})}, stdin=stdin, timeout=timeout,
                               as_bytes=ceiling, cwd=cwd)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    base = tmp_path_factory.mktemp("fuzz")
    files = make_corpus(base / "corpus")
    server = ForkServer(base)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SPECACHE_", "PYTEST_")) and k not in ("FORCE_COLOR", "CLICOLOR_FORCE")}
    env.update(SPECACHE_CACHE_DIR=str(base / "cache"), COLUMNS="200", OMP_NUM_THREADS="1")
    w = World(server, files, stub_model(base / "stub-model"), base / "cache", env, vm_bytes(server.proc.pid))
    yield w
    server.close()


def assert_one_error(out: Outcome, code: int, needle: str = "") -> None:
    """The documented exit code, exactly one `error:` line (mentioning needle), no traceback."""
    assert out.rc is not None, f"killed after {out.seconds:.0f} s: it hung\n{out.stderr}"
    assert "Traceback" not in out.stderr, out.stderr
    assert out.rc == code, (out.rc, out.stderr[-2000:])
    errors = out.error_lines()
    assert len(errors) == 1, out.stderr
    assert needle.lower() in errors[0].lower(), errors[0]
    assert "\x1b" not in out.stderr  # stderr is a file here: plain text, no colour codes in a log


# ---- documents: (corpus file, extra args, exit code, words the error line must contain) -----------

DOCUMENT_CASES = [
    ("missing.txt", [], 3, "no such file"),
    ("broken-link.txt", [], 3, "broken symbolic link"),
    ("folder", [], 4, "directory"),
    ("fifo.txt", [], 4, "FIFO"),  # with no writer: refused at once, never a hang
    ("socket.txt", [], 4, "socket"),
    ("/dev/zero", [], 4, "device"),  # never ends: refused before reading
    ("/dev/null", [], 4, "device"),
    ("document.docx", [], 4, "unsupported file type .docx"),
    ("README", [], 4, "no extension"),
    ("image.png", [], 4, "unsupported file type .png"),
    ("nul.txt", [], 4, "binary"),
    ("controls.md", [], 4, "binary"),
    ("empty.txt", [], 8, "empty"),
    ("spaces.txt", [], 8, "empty"),
    ("vtab.txt", [], 8, "empty"),
    ("formfeeds.md", [], 8, "empty"),
    ("zero.pdf", [], 5, "not a valid PDF"),
    ("header-only.pdf", [], 5, "corrupt"),
    ("garbage.pdf", [], 5, "corrupt"),
    ("text-named.pdf", [], 5, "not a valid PDF"),
    ("truncated.pdf", [], 5, "corrupt"),
    ("blank-page.pdf", [], 7, "OCR"),
    ("no-pages.pdf", [], 8, "no pages"),
    ("rc4.pdf", [], 6, "--password"),
    ("rc4.pdf", ["--password", "wrong"], 6, "wrong password"),
    ("aes128.pdf", [], 6, "--password"),
    ("aes128.pdf", ["--password", "wrong"], 6, "wrong password"),
    ("aes256.pdf", [], 6, "--password"),
    ("aes256.pdf", ["--password", "wrong"], 6, "wrong password"),
    # read without error: they reach the (stub) model, exit 10
    ("rc4.pdf", ["--password", "s3cret"], 10, "could not load the model"),
    ("aes128.pdf", ["--password", "s3cret"], 10, "could not load the model"),
    ("aes256.pdf", ["--password", "s3cret"], 10, "could not load the model"),
    ("aes256.pdf", ["--password", "owner-s3cret"], 10, "could not load the model"),
    ("text.pdf", ["--password", "unused"], 10, "could not load the model"),
    ("utf16.txt", [], 10, "could not load the model"),
    ("latin1.md", [], 10, "could not load the model"),
    ("bom.txt", [], 10, "could not load the model"),
    ("name with spaces [x].txt", [], 10, "could not load the model"),
    ("no-xref.pdf", [], 5, "corrupt"),
    ("bad-startxref.pdf", [], 10, "could not load the model"),  # pypdf rebuilds the xref table
]


@pytest.mark.parametrize("name,extra,code,needle", DOCUMENT_CASES,
                         ids=[f"{c[0]}{'-' + '-'.join(c[1]) if c[1] else ''}" for c in DOCUMENT_CASES])
def test_document(world, name, extra, code, needle):
    path = name if name.startswith("/") else world.files.get(name, world.files["small.txt"].parent / name)
    if name.startswith("/") and not Path(name).exists():
        pytest.skip(f"{name} does not exist here")
    out = world.run(["summarize", path, "--model", world.stub, "--no-store", "--quiet", *extra], timeout=30)
    assert_one_error(out, code, needle)
    assert out.seconds < 20


def test_damaged_pdf_is_refused_or_read(world):
    """A real PDF with 400 random bytes overwritten: corrupt (5), no text (7) or read (10), nothing else."""
    out = world.run(["summarize", world.files["flipped.pdf"], "--model", world.stub, "--no-store", "--quiet"])
    assert out.rc in (5, 7, 10), out.stderr
    assert_one_error(out, out.rc)


def test_stdin_cases(world, tmp_path):
    empty, binary, odd = tmp_path / "empty", tmp_path / "binary", tmp_path / "odd"
    empty.write_bytes(b" \n\n")
    binary.write_bytes(bytes(range(256)) * 4)
    odd.write_bytes(b"caf\xe9 \xed\xa0\x80 lone surrogate bytes " * 10)  # not UTF-8: replaced, never a crash
    base = ["--model", world.stub, "--no-store", "--quiet"]
    assert_one_error(world.run(["summarize", "-", *base], stdin=empty), 8, "standard input is empty")
    assert_one_error(world.run(["summarize", "-", *base], stdin=binary), 4, "binary")
    assert_one_error(world.run(["summarize", "-", *base], stdin=odd), 10, "could not load the model")
    # stdin can be read once: `summarize - -` and stdin for both --doc and --questions are refused
    assert_one_error(world.run(["summarize", "-", "-", *base], stdin=odd), 2, "only once")
    assert_one_error(world.run(["ask", "--doc", "-", "--questions", "-", *base], stdin=odd), 2, "only once")
    assert_one_error(world.run(["ask", "--doc", "-", "--doc", "-", "q?", *base], stdin=odd), 2, "only once")


def test_file_names_that_look_like_flags(world):
    dash = world.files["-dash.txt"]
    base = ["--model", world.stub, "--no-store", "--quiet"]
    out = world.run(["summarize", "-dash.txt", *base], cwd=dash.parent)
    assert_one_error(out, 2, "put '--' before it")
    out = world.run(["summarize", *base, "--", "-dash.txt"], cwd=dash.parent)
    assert_one_error(out, 10, "could not load the model")
    assert_one_error(world.run(["summarize", "./-dash.txt", *base], cwd=dash.parent), 10, "could not load the model")


def test_a_batch_with_every_bad_file_reports_each_and_exits_13(world):
    names = ["empty.txt", "nul.txt", "fifo.txt", "truncated.pdf", "aes256.pdf", "blank-page.pdf", "folder"]
    out = world.run(["summarize", *(world.files[n] for n in names), "--model", world.stub, "--no-store", "--quiet",
                     "--jsonl"])
    assert out.rc == 13 and "Traceback" not in out.stderr, out.stderr
    assert len(out.error_lines()) == len(names) + 1  # one per document, then the batch's own line
    codes = [json.loads(x)["error"]["exit_code"] for x in out.stdout.splitlines()]
    assert codes == [8, 4, 4, 5, 6, 7, 4]


# ---- flags: refused before the model loads, under a memory ceiling ------------------------------------

FLAG_CASES = [
    (["--dtype", "bogus"], 2, "--dtype"),
    (["--device", "bogus"], 2, "--device"),
    (["--device", "cuda:x"], 2, "--device"),
    (["--temperature", "nan"], 2, "--temperature"),
    (["--temperature", "inf"], 2, "--temperature"),
    (["--temperature", "-1"], 2, "--temperature"),
    (["--top-p", "nan"], 2, "--top-p"),
    (["--top-p", "0"], 2, "--top-p"),
    (["--top-p", "1.5"], 2, "--top-p"),
    (["--cache-max-gb", "inf"], 2, "--cache-max-gb"),
    (["--cache-max-gb", "nan"], 2, "--cache-max-gb"),
    (["--cache-max-gb", "0"], 2, "--cache-max-gb"),
    (["--cache-max-gb", "-3"], 2, "--cache-max-gb"),
    (["--k", "1000000"], 2, "--k 1000000"),
    (["--sinks", "1000000"], 2, "--sinks"),
    (["--residual", "1000000"], 2, "--residual"),
    (["--chunk-size", "1000000"], 2, "--chunk-size"),
    (["--k", "1025"], 2, "window of 1024"),  # the stub model's window
    (["--max-tokens", "100000"], 2, "--max-tokens"),
    (["--max-tokens", "99999999999999999999999"], 2, "--max-tokens"),
    (["--max-tokens", "0"], 2, "--max-tokens"),
    (["--k", "-1"], 2, "--k"),
    (["--sinks", "-5"], 2, "--sinks"),
    (["--residual", "0"], 2, "--residual"),
    (["--chunk-size", "8"], 2, "--chunk-size"),
    (["--bits", "3"], 2, "--bits"),
    (["--group", "48"], 2, "--group"),
    (["--cache", "bogus"], 2, "--cache"),
    (["--prefetch", "bogus"], 2, "--prefetch"),
    (["--strategy", "bogus"], 2, "--strategy"),
    (["--batch", "0"], 2, "--batch"),
    (["--batch", "-1"], 2, "--batch"),
    (["--batch", "abc"], 2, "--batch"),
    (["--batch", "\u0661"], 2, "--batch"),  # an Arabic-Indic digit: str.isdigit, but not a number here
    (["--seed", str(10**30)], 2, "--seed"),
    (["--seed", "1e3"], 2, "--seed"),  # Click's own parse error, through the same one-line path
    (["--k", "abc"], 2, "--k"),
    (["--k", ""], 2, "--k"),
    (["--bogus"], 2, "--bogus"),
    (["--resume", "x.jsonl"], 2, "--jsonl"),
]


@pytest.mark.parametrize("flags,code,needle", FLAG_CASES, ids=[" ".join(c[0]) or "empty" for c in FLAG_CASES])
def test_absurd_flag(world, flags, code, needle):
    """Refused before any model load: fast, and under a ceiling of 1 GiB over the interpreter."""
    out = world.run(["summarize", world.files["small.txt"], "--model", world.stub, "--no-store", *flags],
                    ceiling=world.base_vm + GIB, timeout=30)
    assert_one_error(out, code, needle)
    assert out.seconds < 15


@pytest.mark.parametrize("flags", [["--k", "8193"], ["--sinks", "9000"], ["--chunk-size", "100000"],
                                   ["--residual", "1000000"], ["--max-tokens", "5000"]])
def test_flags_bounded_by_the_embedded_models_window_before_it_loads(world, flags):
    """The embedded model's window (8192) comes from its profile: no conversion, no load."""
    out = world.run(["summarize", world.files["small.txt"], "--no-store", *flags], ceiling=world.base_vm + GIB)
    assert_one_error(out, 2, flags[0])


def test_environment_cases(world):
    small, base = world.files["small.txt"], ["--model", world.stub, "--no-store", "--quiet"]
    for value in ("abc", "nan", "inf", "-1"):
        out = world.run(["summarize", small, "--model", world.stub, "--quiet"], env={"SPECACHE_CACHE_MAX_GB": value})
        assert_one_error(out, 2, "SPECACHE_CACHE_MAX_GB" if value == "abc" else "cap")
    below_file = {"SPECACHE_CACHE_DIR": str(world.files["a-file"] / "cache")}
    assert_one_error(world.run(["summarize", small, "--quiet"], env=below_file), 14, "is a file")
    assert_one_error(world.run(["summarize", small, "--model", world.stub, "--quiet"], env=below_file), 14, "a-file")
    assert_one_error(world.run(["cache", "ls"], env=below_file), 14, "a-file")
    assert_one_error(world.run(["cache", "clear"], env=below_file), 14, "a-file")
    # a --model path that is missing (input not found), a file, or a folder whose config.json is not JSON
    bad = world.files["small.txt"].parent / "bad-model"
    bad.mkdir(exist_ok=True)
    (bad / "config.json").write_text("{not json")
    assert_one_error(world.run(["summarize", small, *base[2:], "--model", world.files["a-file"].parent / "none"]), 3,
                     "not found")
    assert_one_error(world.run(["summarize", small, *base[2:], "--model", world.files["a-file"]]), 10, "no config.json")
    assert_one_error(world.run(["summarize", small, *base[2:], "--model", bad]), 10, "config.json cannot be read")


def test_question_and_resume_cases(world):
    small, base = world.files["small.txt"], ["--model", world.stub, "--no-store", "--quiet"]
    assert_one_error(world.run(["ask", "--doc", small, *base]), 2, "needs a question")
    assert_one_error(world.run(["ask", "--doc", small, "   ", *base]), 2, "empty")
    assert_one_error(world.run(["ask", "--doc", small, "--questions", "nope.txt", *base]), 3, "no such file")
    assert_one_error(world.run(["ask", "--doc", small, "--questions", world.files["questions-empty.txt"], *base]), 2,
                     "no questions")
    assert_one_error(world.run(["ask", "--doc", small, "--questions", world.files["folder"], *base]), 2, "directory")
    assert_one_error(world.run(["ask", "--doc", world.files["fifo.txt"], "q?", *base]), 4, "FIFO")
    assert_one_error(world.run(["ask", "--doc", small, "--questions", world.files["fifo.txt"], *base]), 4, "FIFO")
    assert_one_error(world.run(["ask", "--doc", small, "--questions", world.files["nul.txt"], *base]), 10,
                     "could not load the model")  # NULs in a question are only text
    assert_one_error(world.run(["ask", "--doc", small, "--questions", world.files["latin1.md"], *base]), 2,
                     "cannot be read")
    assert_one_error(world.run(["summarize", small, "--jsonl", "--resume", world.files["fifo.txt"], *base]), 4,
                     "FIFO")
    assert_one_error(world.run(["summarize", small, "--jsonl", "--resume", world.files["jsonl-dir"], *base]), 2,
                     "directory")


def test_usage_errors_are_one_line(world):
    for argv, needle in ((["summarize"], "missing argument"), (["frobnicate"], "no such command"),
                         (["cache", "rm"], "missing argument"), (["summarize", "x.txt", "--k"], "requires an argument"),
                         (["ask", "--doc"], "requires an argument")):
        assert_one_error(world.run(argv), 2, needle)
    # every unknown flag is named at once (Click stops at the first); values, "-", numbers and what
    # follows "--" are not flags
    out = world.run(["summarize", "x.txt", "--foo", "--bar=1", "--k", "5", "-q", "--temperature", "-1", "-",
                     "--", "--later"])
    assert_one_error(out, 2, "no such option: --foo; also unknown: --bar, -q; see specache summarize --help")
    assert_one_error(world.run(["bench", "decode", "--lenght", "5"]), 2, "--length")  # one: Click's suggestion
    for value in ("nan", "inf"):  # plan's --host-ram
        assert_one_error(world.run(["plan", "--gpu", "l4", "--host-ram", value]), 2, "--host-ram")
    help_out = world.run([])  # no arguments: the help (Click's exit 2), no error line, no traceback
    assert help_out.rc == 2 and "Usage" in help_out.stdout + help_out.stderr and "Traceback" not in help_out.stderr


# ---- the store: cap on every open, debris swept, strays skipped ---------------------------------------

def fill_store(root: Path, n: int, size: int = 250_000) -> list[str]:
    from engine.docstore.store import DocStore, make_key

    store = DocStore(root)
    keys = []
    for i in range(n):
        ids = [i + 1] * 10
        keys.append(make_key({"model": "m"}, ids))
        store.save(keys[-1], ids, {"x": torch.randn(size)}, {"label": f"doc{i}.txt"})  # ~1 MB each
        t = time.time() - 100 + i  # entry 0 is the least recently used
        os.utime(store.path(keys[-1]), (t, t))
    return keys


def test_store_hostile_folder(world, tmp_path):
    cache = tmp_path / "cache"
    kv = cache / "kv"
    keys = fill_store(kv, 3)
    env = {"SPECACHE_CACHE_DIR": str(cache)}
    # a folder named like an entry, a stray file, a link, and the debris of a killed writer
    (kv / ("f" * 32 + ".safetensors")).mkdir()
    (kv / ("e" * 32 + ".safetensors") / "inside").mkdir(parents=True)
    (kv / "notes.txt").write_text("mine")
    (kv / ("d" * 32 + ".safetensors")).symlink_to(world.files["small.txt"])
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    part = kv / f".part-{keys[0]}-{dead.stdout.strip()}-abcd1234"
    part.write_bytes(bytes(2_000_000))

    ls = world.run(["cache", "ls", "--json"], env=env)
    assert ls.rc == 0 and "Traceback" not in ls.stderr and not ls.error_lines(), ls.stderr
    assert "ignoring 4 item(s)" in ls.stderr and "warning:" in ls.stderr
    listing = json.loads(ls.stdout)
    assert sorted(e["key"] for e in listing["entries"]) == sorted(keys)
    assert not part.exists() and listing["unfinished_writes"] == 0  # a dead writer's part: swept on open

    # a lower cap applies on open: `cache ls` evicts down to it and reports the real size
    ls = world.run(["cache", "ls", "--json", "--cache-max-gb", "0.0021"], env=env)
    listing = json.loads(ls.stdout)
    assert ls.rc == 0 and [e["key"] for e in listing["entries"]] == keys[1:], ls.stderr
    assert listing["bytes"] <= listing["max_bytes"] == 2_100_000
    ls = world.run(["cache", "ls"], env={**env, "SPECACHE_CACHE_MAX_GB": "0.0011"})
    assert ls.rc == 0 and "1 entry" in ls.stdout and "of 1.1 MB (cap)" in ls.stdout, ls.stdout + ls.stderr

    # rm of a stray's name is "not found"; clear removes entries only, never the strays
    assert_one_error(world.run(["cache", "rm", "ffff"], env=env), 3, "no store entry")
    assert_one_error(world.run(["cache", "rm", "ab"], env=env), 2, "too short")
    clear = world.run(["cache", "clear"], env=env)
    assert clear.rc == 0 and "removed 1 entry" in clear.stdout and not clear.error_lines(), clear.stderr
    assert (kv / ("f" * 32 + ".safetensors")).is_dir() and (kv / "notes.txt").read_text() == "mine"
    assert (kv / ("e" * 32 + ".safetensors") / "inside").is_dir()
    assert world.files["small.txt"].exists()


# ---- the real entry point, and flags that reach a real (tiny) model under a ceiling ------------------------

def fresh(argv: list[str], env: dict[str, str], ceiling: int | None = None, timeout: float = 240,
          stdin: Path | None = None) -> Outcome:
    """`python -m specache_cli ARGV` in a fresh interpreter, optionally under RLIMIT_AS."""
    def limit():
        if ceiling:
            resource.setrlimit(resource.RLIMIT_AS, (ceiling, ceiling))

    start = time.monotonic()
    with open(stdin or os.devnull, "rb") as fin:
        try:
            p = subprocess.run([sys.executable, "-m", "specache_cli", *map(str, argv)], cwd=ROOT, env=env,
                               stdin=fin, capture_output=True, text=True, timeout=timeout, preexec_fn=limit,
                               check=False)
        except subprocess.TimeoutExpired as exc:
            return Outcome(None, exc.stdout or "", exc.stderr or "", time.monotonic() - start)
    return Outcome(p.returncode, p.stdout, p.stderr, time.monotonic() - start)


def test_real_entry_point(world):
    out = fresh(["summarize", world.files["small.txt"], "--k", "abc"], world.env)
    assert_one_error(out, 2, "--k")
    out = fresh(["summarize", world.files["fifo.txt"], "--no-store"], world.env, timeout=60)
    assert_one_error(out, 4, "FIFO")


@pytest.mark.parametrize("flags", [
    ["--k", "1024", "--sinks", "1024", "--residual", "1024", "--chunk-size", "1024"],
    ["--cache", "full", "--chunk-size", "1024", "--batch", "100000"],
    ["--cache", "window", "--sinks", "1000", "--residual", "1000", "--top-p", "1e-9", "--temperature", "1e30"],
])
def test_big_flags_run_under_a_memory_ceiling(world, tiny_model_dir, flags):
    """Flags at the model's window (the tiny model: 1024 tokens) run a real model under RLIMIT_AS: they
    are cut to the longest model call, so memory stays near the default run's."""
    ceiling = 3 * GIB  # such a run works under 2.4 GiB of VM (ulimit -v), torch and transformers included
    env = {k: v for k, v in world.env.items() if k != "SPECACHE_CACHE_DIR"}  # --no-store; native kernels built once
    out = fresh(["ask", "--doc", world.files["small.txt"], "What was approved?", "--model", tiny_model_dir,
                 "--no-store", "--max-tokens", "3", *flags], env, ceiling=ceiling)
    assert out.rc == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and not out.error_lines()
    if "--k" in flags:
        assert "cut to" in out.stderr  # the status line saying the flags were cut


def test_a_full_disk_while_saving_the_store_entry(world, tiny_model_dir, tmp_path):
    """RLIMIT_FSIZE stands in for a full disk (writes past it fail with EFBIG; Python ignores SIGXFSZ):
    the answer still comes, the failed save is one warning, and no entry or temp file is left."""
    cache = tmp_path / "cache"
    native = {k: v for k, v in world.env.items() if k != "SPECACHE_CACHE_DIR"}
    fsize = 200_000  # bytes: the tiny model's store entry for this document is larger

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    p = subprocess.run([sys.executable, "-m", "specache_cli", "ask", "--doc", str(world.files["small.txt"]), "Who met?",
                        "--model", str(tiny_model_dir), "--max-tokens", "3"], cwd=ROOT, capture_output=True, text=True,
                       timeout=240, preexec_fn=limit, env={**native, "SPECACHE_CACHE_DIR": str(cache)}, check=False)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-3000:]
    lines = p.stderr.splitlines()  # (the native build under the same limit fails too: its warning quotes cc1)
    assert "warning: could not save" in p.stderr and not any(line.startswith("error:") for line in lines)
    kv = cache / "kv"
    assert not any(x.name.endswith(".safetensors") or x.name.startswith(".part-") for x in kv.iterdir())


def test_guard_maps_unexpected_failures_to_one_line(capsys, monkeypatch):
    """What reaches a command's guard without being a SpecacheError: the allocator's RuntimeError
    (exit 12), a disk error (exit 14), Ctrl-C (130), anything else (exit 1): one line each."""
    import errno

    import typer

    from specache_cli.console import guarded

    monkeypatch.delenv("SPECACHE_DEBUG", raising=False)
    cases = [
        (RuntimeError("[enforce fail at alloc_cpu.cpp:118] DefaultCPUAllocator: can't allocate memory: you tried "
                      "to allocate 22000000000 bytes"), 12, "out of memory"),
        (MemoryError(), 12, "out of memory"),
        (OSError(errno.ENOSPC, "No space left on device", "/cache/kv/x"), 14, "No space left on device: /cache/kv/x"),
        (NotADirectoryError(errno.ENOTDIR, "Not a directory", "/a/file/models"), 14, "SPECACHE_CACHE_DIR"),
        (KeyboardInterrupt(), 130, "interrupted"),
        (KeyError("bogus"), 1, "internal error (KeyError"),
    ]
    for exc, code, needle in cases:
        def boom(exc=exc):
            raise exc

        with pytest.raises(typer.Exit) as info:
            guarded(boom)()
        assert info.value.exit_code == code
        err = capsys.readouterr().err
        lines = [x for x in err.splitlines() if x.strip()]
        assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], err


def test_clamp_to_prompt_cuts_only_what_exceeds_the_longest_call():
    from engine.config import CacheConfig
    from engine.jobs.prepare import clamp_to_prompt

    config, notes = clamp_to_prompt(CacheConfig(k=5000, sinks=4, residual=64, chunk_size=8000), 1000)
    assert (config.k, config.sinks, config.residual, config.chunk_size) == (1000, 4, 64, 1000)
    assert notes == ["--k 5000", "--chunk-size 8000"]
    same, none = clamp_to_prompt(CacheConfig(), 100_000)
    assert same == CacheConfig() and none == []


@pytest.mark.slow
def test_flags_at_the_embedded_models_window_stay_near_the_default_memory(world):
    """The issue's runaway, at the largest values now allowed: --k/--sinks/--residual/--chunk-size
    8192 on a ~540-token document. Cut to the longest call, the run works with 1.9 GiB of address
    space over the imported CLI (measured: 2.29 GiB in all works, RSS 1.30 GB against 1.13 GB by
    default); before the cut it needed 2.58 GB RSS and failed with an allocator traceback under
    2.86 GiB (`ulimit -v 3000000`)."""
    env = {k: v for k, v in world.env.items() if k != "SPECACHE_CACHE_DIR"}  # the converted model
    doc = world.files["small.txt"].parent / "federalist-head.txt"
    doc.write_bytes((EXAMPLES / "texts" / "federalist.txt").read_bytes()[:2500])
    out = fresh(["ask", "--doc", doc, "What is this about?", "--no-store", "--device", "cpu", "--max-tokens", "4",
                 "--k", "8192", "--sinks", "8192", "--residual", "8192", "--chunk-size", "8192"], env,
                ceiling=world.base_vm + int(1.9 * GIB), timeout=600)
    assert out.rc == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "cut to" in out.stderr
