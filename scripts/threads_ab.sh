#!/bin/bash
# CPU threads A/B (docs/results.md, "CPU threads"): summarize a document with every thread count from 1 to the
# cores, quiet and with one core kept busy by another process, 2 rounds each; prints prefill seconds
# and decode ms per token per run. Usage: scripts/threads_ab.sh [DOC] [MAX_TOKENS]
set -euo pipefail
cd "$(dirname "$0")/.."
doc=${1:-examples/report.pdf}
tokens=${2:-64}
cores=$(nproc)
run() {  # label, threads
  .venv/bin/specache summarize "$doc" --max-tokens "$tokens" --no-store --json --quiet --threads "$2" |
    .venv/bin/python -c "
import json, sys
d = json.load(sys.stdin)
print('$1', 'threads', d['threads'], 'prefill_s', round(d['prefill_seconds'], 2),
      'decode_ms', round(1000 * d['decode_seconds'] / max(d['generated_tokens'], 1), 1))"
}
for cond in quiet busy; do
  busy_pid=""
  if [ "$cond" = busy ]; then
    python3 -c "while 1: pass" &
    busy_pid=$!
  fi
  for round in 1 2; do
    for t in $(seq "$cores" -1 1); do run "$cond round $round" "$t"; done
  done
  if [ -n "$busy_pid" ]; then kill "$busy_pid"; fi
done
