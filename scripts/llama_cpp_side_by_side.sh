#!/usr/bin/env bash
# llama.cpp and specache on the same GGUF and document, taking turns (this machine is shared: compare within
# one run). Prints one JSON line per run (tool, threads, prompt tokens, prefill tok/s, decode ms/token, peak
# RSS in kB) on stdout.
#
#   scripts/llama_cpp_side_by_side.sh MODEL.gguf DOC.txt [RUNS=3] [THREADS="2 1"] [LLCPP_DIR=/tmp/llcpp]
#
# LLCPP_DIR holds node-llama-cpp and a copy of scripts/llama_cpp_bench.mjs (how to set it up: that file's
# header). llama.cpp prefills the document's raw tokens; specache summarizes it (its prompt adds the
# summary instruction and the chat template), 64 tokens at most either way.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
MODEL=$(realpath "$1") DOC=$(realpath "$2") RUNS=${3:-3} THREADS=${4:-"2 1"} LLCPP=${5:-/tmp/llcpp}
VENV=${SPECACHE_VENV:-$ROOT/.venv}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
for t in $THREADS; do
  for _ in $(seq "$RUNS"); do
    (cd "$LLCPP" && /usr/bin/time -f "%M" -o "$TMP/rss" node llama_cpp_bench.mjs "$MODEL" "$DOC" 64 "$t" > "$TMP/out")
    "$VENV/bin/python" -c "import json,sys; d=json.load(open(sys.argv[1])); print(json.dumps({'tool': 'llama.cpp', 'threads': $t, 'prompt_tokens': d['prompt_tokens'], 'prefill_tok_s': round(d['prefill_tok_s'], 1), 'decode_ms_per_token': round(d['decode_ms_per_token'], 2), 'peak_rss_kb': int(open(sys.argv[2]).read().split()[-1])}))" "$TMP/out" "$TMP/rss"
    /usr/bin/time -f "%M" -o "$TMP/rss" "$VENV/bin/specache" summarize "$DOC" --model "$MODEL" --max-tokens 64 --no-store --json --threads "$t" > "$TMP/out" 2>/dev/null
    "$VENV/bin/python" -c "import json,sys; d=json.load(open(sys.argv[1])); print(json.dumps({'tool': 'specache', 'threads': $t, 'prompt_tokens': d['prompt_tokens'], 'prefill_tok_s': round(d['prompt_tokens'] / d['prefill_seconds'], 1), 'decode_ms_per_token': round(1000 * d['decode_seconds'] / max(1, d['generated_tokens']), 2), 'peak_rss_kb': int(open(sys.argv[2]).read().split()[-1])}))" "$TMP/out" "$TMP/rss"
  done
done
