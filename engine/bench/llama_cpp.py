"""llama.cpp beside the engine in `bench long`: node-llama-cpp's prebuilt CPU build run through
scripts/llama_cpp_bench.mjs (as scripts/llama_cpp_side_by_side.sh runs it) on the same GGUF and
the same text. Optional: it runs only where `node` is on PATH, the folder given holds node-llama-cpp
(``npm install node-llama-cpp`` there) and the model is a GGUF file; otherwise `available` says why not.

The script prefills the text's raw tokens (no chat template) and decodes greedily; its peak RSS is the
node process's own (os.wait4's resource usage of that child)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SCRIPT = "llama_cpp_bench.mjs"
REPO_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / SCRIPT


def available(folder: str | Path | None, gguf: Path | None) -> str | None:
    """None when llama.cpp can run from `folder` on `gguf`; else the reason it cannot."""
    if folder is None:
        return "not requested (--llama-cpp DIR: a folder where node-llama-cpp is installed)"
    if shutil.which("node") is None:
        return "node is not on PATH"
    if not (Path(folder) / "node_modules" / "node-llama-cpp").is_dir():
        return f"node-llama-cpp is not installed in {folder} (npm install node-llama-cpp there)"
    if gguf is None:
        return "the model is not a GGUF file (llama.cpp reads GGUF)"
    if not (Path(folder) / SCRIPT).is_file() and not REPO_SCRIPT.is_file():
        return f"no {SCRIPT} in {folder} (copy scripts/{SCRIPT} there)"
    return None


def run_llama_cpp(folder: str | Path, gguf: Path, text: str, tokens: int, threads: int) -> dict:
    """One llama.cpp run: prefill `text`, decode `tokens` tokens with `threads` threads.
    -> prompt tokens, prefill tok/s and seconds, decode ms/token and peak RSS bytes (or an error)."""
    folder = Path(folder)
    script = folder / SCRIPT
    copied = None
    if not script.is_file():  # an ES module resolves node-llama-cpp from its own folder: run a copy there
        fd, name = tempfile.mkstemp(prefix=".specache-", suffix=".mjs", dir=folder)
        os.close(fd)
        copied = script = Path(name)
        shutil.copyfile(REPO_SCRIPT, script)
    try:
        with tempfile.TemporaryDirectory(prefix="specache-llama-cpp-") as tmp:
            (Path(tmp) / "text.txt").write_text(text, encoding="utf-8")
            return _run(folder, [script.name, str(gguf), str(Path(tmp) / "text.txt"), str(tokens), str(threads)],
                        Path(tmp))
    finally:
        if copied is not None:
            copied.unlink(missing_ok=True)


def _run(folder: Path, args: list[str], tmp: Path) -> dict:
    """node ARGS in `folder`, its stdout and stderr to files; its peak RSS from os.wait4."""
    with open(tmp / "out", "wb") as out, open(tmp / "err", "wb") as err:
        proc = subprocess.Popen(["node", *args], cwd=folder, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    stdout = (tmp / "out").read_text(errors="replace").strip().splitlines()
    if proc.returncode != 0 or not stdout:
        tail = (tmp / "err").read_text(errors="replace").strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        return {"error": tail[0][:300]}
    try:
        data = json.loads(stdout[-1])
        return {"prompt_tokens": data["prompt_tokens"], "prefill_seconds": data.get("prefill_s"),
                "prefill_tokens_per_s": data["prefill_tok_s"], "decode_ms_per_token": data["decode_ms_per_token"],
                "decode_steps": data.get("decode_tokens"), "peak_rss_bytes": usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024),
                "build": data.get("build"), "kv": data.get("kv")}
    except (ValueError, KeyError, TypeError) as exc:
        return {"error": f"unreadable output of {args[0]}: {exc}"}
