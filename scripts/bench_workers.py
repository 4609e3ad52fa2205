#!/usr/bin/env python
"""Documents per minute of a `summarize --jsonl` job with 1 and with N Ray workers (--workers).

The job: --docs documents cut at paragraph breaks from examples/texts/*.txt (real text, sizes
from ~1,500 to ~6,000 characters so longest-first ordering matters), the embedded model,
--max-tokens 32, no document store (every run prefills). Each configuration runs the real CLI
in a fresh process, as a user would; both the wall time of the command (Python start, Ray
start, model load in every actor, the job) and the job's own time (from the CLI's summary
line: first worker ready to last result) are reported, and every run must give every
document exactly once with the same greedy text.

    .venv/bin/python scripts/bench_workers.py                  # 12 documents, 1 and 2 workers
    .venv/bin/python scripts/bench_workers.py --workers 1,2,4 --json
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIZES = (1500, 6000, 2500, 4000, 2000, 5000, 3000, 1800, 4500, 2200, 3500, 2800)  # characters, cycled
SUMMARY = re.compile(r"(\d+) documents \((\d+) failed\) in ([\d.]+) s on (\d+) workers? after ([\d.]+) s of start-up")


def cut_documents(n: int, folder: Path) -> list[str]:
    """n documents cut at paragraph breaks from examples/texts/*.txt (taken in turn, cycled)."""
    texts = [p.read_text(encoding="utf-8") for p in sorted((ROOT / "examples" / "texts").glob("*.txt"))]
    paras = [p.strip() for t in texts for p in t.split("\n\n") if p.strip()]
    out, at = [], 0
    for i in range(n):
        piece = []
        while sum(len(p) + 2 for p in piece) < SIZES[i % len(SIZES)]:
            piece.append(paras[at % len(paras)])
            at += 1
        path = folder / f"part{i + 1:02d}.txt"
        path.write_text("\n\n".join(piece) + "\n", encoding="utf-8")
        out.append(str(path))
    return out


def run(files: list[str], workers: int | None, args) -> dict:
    """One CLI run; its wall time, job time, documents per minute and texts."""
    cmd = [sys.executable, "-m", "specache_cli", "summarize", *files, "--jsonl", "--no-store",
           "--max-tokens", str(args.max_tokens)]
    if args.model:
        cmd += ["--model", args.model]
    if workers is not None:
        cmd += ["--workers", str(workers)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    m = SUMMARY.search(proc.stderr.replace("\n", " "))
    job = float(m.group(3)) if m else None
    return {"workers": workers, "wall_seconds": round(wall, 1), "job_seconds": job,
            "startup_seconds": float(m.group(5)) if m else None,
            "docs_per_minute_wall": round(60 * len(lines) / wall, 2),
            "docs_per_minute_job": round(60 * len(lines) / job, 2) if job else None,
            "generated_tokens": sum(o.get("generated_tokens", 0) for o in lines),
            "texts": {Path(o["source"]).name: o.get("text") for o in lines}, "sources": [o["source"] for o in lines]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=12)
    parser.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--model", default=None, help="local HF folder (default: the embedded model)")
    parser.add_argument("--single", action="store_true", help="also run without --workers (one process)")
    parser.add_argument("--repeat", type=int, default=1, help="run the worker counts this many times, interleaved "
                        "(later rounds in reverse order), and compare the medians: on a shared machine the load "
                        "drifts between runs")
    parser.add_argument("--json", action="store_true", help="the report as JSON on stdout")
    args = parser.parse_args()

    counts = [int(w) for w in args.workers.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        files = cut_documents(args.docs, Path(tmp))
        runs = [run(files, None, args)] if args.single else []
        for r in range(args.repeat):
            runs += [run(files, w, args) for w in (counts if r % 2 == 0 else counts[::-1])]
    for r in runs:
        if sorted(r.pop("sources")) != sorted(files):
            raise SystemExit(f"error: the run with workers={r['workers']} did not give every document exactly once")
    reference = runs[0]["texts"]
    for r in runs:
        r["same_texts_as_first_run"] = r.pop("texts") == reference
    median = {w: {k: statistics.median(r[k] for r in runs if r["workers"] == w)
                  for k in ("docs_per_minute_wall", "docs_per_minute_job")} for w in counts}
    base = median[counts[0]]
    report = {"documents": args.docs, "max_tokens": args.max_tokens, "runs": runs, "median": median,
              "ratio_wall": {str(w): round(m["docs_per_minute_wall"] / base["docs_per_minute_wall"], 2)
                             for w, m in median.items()},
              "ratio_job": {str(w): round(m["docs_per_minute_job"] / base["docs_per_minute_job"], 2)
                            for w, m in median.items()}}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{args.docs} documents from examples/texts, --max-tokens {args.max_tokens}, no store")
    print(f"{'workers':>8} {'wall s':>8} {'job s':>8} {'docs/min wall':>14} {'docs/min job':>13} {'same texts':>11}")
    for r in runs:
        print(f"{r['workers'] or '-':>8} {r['wall_seconds']:>8} {r['job_seconds'] or '-':>8} "
              f"{r['docs_per_minute_wall']:>14} {r['docs_per_minute_job'] or '-':>13} "
              f"{'yes' if r['same_texts_as_first_run'] else 'NO':>11}")
    for w, ratio in report["ratio_wall"].items():
        print(f"workers {w} / workers {counts[0]}: {ratio}x documents per minute (wall, median), "
              f"{report['ratio_job'].get(w, '-')}x (job)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
