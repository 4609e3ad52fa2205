"""Filling a model built without weights: from a GGUF file (its tensors held in their blocks on the CPU, or
dequantized) or from a folder's safetensors (16-bit weights held as they are on the CPU), into engine.model.llama's
decoder classes where they reproduce the model (own_config), else into transformers' (engine.model.loading decides
which and calls these)."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from accelerate import init_empty_weights
from transformers import AutoConfig
from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, Gemma2TensorProcessor, \
    LlamaTensorProcessor, TensorProcessor

from engine.errors import ModelLoadError
from engine.model.file_checks import check_folder_weights, check_tensors_fit
from engine.model.attention import ATTENTION_NAME, register_with_transformers
from engine.model.gguf_header import check_architecture, held_architecture
from engine.model.gguf_tensors import MappedRows, TensorFile, dense_from_raw, held_from_file
from engine.model.held_model import HeldEmbedding
from engine.model.held_weights import DenseWeight
from engine.model.linears import SkinnyLinear
from engine.model import families
from engine.model.gemma import GemmaCausalLM, gemma_config, why_not_gemma
from engine.model.llama import CausalLM, family_config, why_not_own
from engine.native import release_freed_memory


def own_config(folder: Path, gguf: bool = True, config: dict | None = None):
    """The config engine.model.llama runs this folder with (a converted GGUF's, or a folder of safetensors
    files), None when it does not and transformers' classes load it (held_config says why)."""
    return held_config(folder, gguf, config)[0]


def held_config(folder: Path, gguf: bool = True, config: dict | None = None) -> tuple[object | None, str | None]:
    """(own_config's config, None), or (None, why the engine's decoders do not run this folder: a model
    type whose family (engine.model.families) names no decoder of ours, a key or feature they lack
    (why_not_own, why_not_gemma), weights that are not safetensors files). config: its config.json's
    values, if already read."""
    if not gguf and (not any(folder.glob("*.safetensors")) or any(folder.glob("*.bin"))):
        return None, "its weights are not all safetensors files"
    if config is None:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    kind = config.get("model_type")
    decoder = getattr(families.family(kind), "decoder", None)
    if decoder == "gemma":
        own = gemma_config(config)
        why = why_not_gemma(own)
    elif decoder == "llama":
        own = family_config(config)
        why = why_not_own(own)
    else:
        return None, f"model type {kind!r} has no decoder of the engine's own"
    return (own, None) if why is None else (None, why)


def own_model(config) -> CausalLM:
    """Our decoder for own_config's config (build it under `with torch.device("meta")`)."""
    return GemmaCausalLM(config) if families.family(config.model_type).decoder == "gemma" else CausalLM(config)


def load_folder_model(folder: Path, config, dtype: torch.dtype, held: bool) -> torch.nn.Module | None:
    """A folder's safetensors into engine.model.llama's classes: with held, 16-bit linears and embedding stay
    as they are (no fp32 copy; DenseWeight, decoded by the native 16-bit kernel), everything else in dtype.
    None when the files' tensor names are not the model's (transformers' classes load it then)."""
    from safetensors import safe_open

    config.dtype = dtype
    with torch.device("meta"):
        model = own_model(config)
    files = sorted(folder.glob("*.safetensors"))
    found = {n: s for n, s in check_folder_weights(folder).items() if not n.endswith("rotary_emb.inv_freq")}
    expected = {n: tuple(p.shape) for n, p in model.named_parameters()}
    if config.tie_word_embeddings:
        found.pop("lm_head.weight", None)
        expected.pop("lm_head.weight", None)
    if not set(found) & set(expected):
        return None  # named otherwise: transformers' classes rename them
    check_tensors_fit(str(folder), expected, found)
    names = set(found)
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


def transformers_model(folder: Path, dtype: torch.dtype, **kwargs) -> torch.nn.Module:
    """transformers' AutoModelForCausalLM.from_pretrained(folder, **kwargs), with nothing of its loading report
    on the terminal: weights it would leave at their random initialisation (missing, or of another shape
    than config.json gives) raise ModelLoadError naming them."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    register_with_transformers()
    hf_logging.set_verbosity_error()  # its LOAD REPORT table is a warning
    source = folder / kwargs["gguf_file"] if "gguf_file" in kwargs else folder
    try:
        model, info = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=dtype,
                                                           attn_implementation=ATTENTION_NAME,
                                                           output_loading_info=True, **kwargs)
    except RuntimeError as exc:  # size mismatches, after the report
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ModelLoadError(f"{source}: its weights do not fit config.json ({first})") from None
    for what in ("missing_keys", "mismatched_keys"):
        keys = sorted(str(k) for k in info.get(what) or ())
        if keys:
            raise ModelLoadError(f"{source}: {len(keys)} weights {what.split('_')[0]} for config.json's model "
                                 f"({', '.join(keys[:3])}{'...' if len(keys) > 3 else ''})")
    return model


def load_gguf_model(gguf_path: Path, folder: Path, dtype: torch.dtype, held: bool,
                    config=None) -> torch.nn.Module:
    """The model of a GGUF file: built without weights, then filled tensor by tensor from the file;
    held=True keeps the linears and the embedding in their blocks (no fp32 copy). Architectures that are
    not held (gguf_header.held_architecture) load through transformers (dequantized). config: own_config's, to
    build engine.model.llama's model; None: transformers' class."""
    tensors = TensorFile(gguf_path)
    if not held_architecture(tensors.arch):
        check_architecture(tensors.arch, gguf_path)
        return transformers_model(gguf_path.parent, dtype, gguf_file=gguf_path.name)
    if config is not None:
        config.dtype = dtype
        with torch.device("meta"):
            model = own_model(config)
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
        if tensors.shape(gguf_name) != tuple(getattr(module, attr).shape):
            raise ModelLoadError(f"{tensors.path.name}: tensor {gguf_name} has the shape {list(tensors.shape(gguf_name))}, "
                                 f"its header gives the model {list(getattr(module, attr).shape)}")
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
                                   tensors.shape(gguf_name), torch.float32)
            if isinstance(processor, Gemma2TensorProcessor):  # llama.cpp stores Gemma's norms as 1 + w
                value = torch.from_numpy(processor.process(value.numpy(), gguf_name).weights)
            value = value.to(dtype)
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
