#!/usr/bin/env python
"""Bench of the persistent document KV store (same as `specache bench store`):

    .venv/bin/python scripts/bench_store.py                      # examples/report.pdf, full + specache
    .venv/bin/python scripts/bench_store.py --modes full --json  # JSON on stdout
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--doc", default=str(ROOT / "examples" / "report.pdf"))
    parser.add_argument("--model", default=None, help="local HF folder (default: the embedded model)")
    parser.add_argument("--modes", default="full,specache")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from engine.bench.store import run_store_bench
    from engine.inputs.documents import load_document
    from engine.model.loading import load_model

    report = run_store_bench(load_model(args.model, device=args.device), load_document(args.doc),
                             args.modes.split(","), args.max_tokens)
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
