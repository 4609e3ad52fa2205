"""Which models the engine reproduces, and the refusal at load of every other one.

A model is run only when its attention is one the engine was checked to reproduce token for token
against transformers' own eager attention (tests/test_conformance.py: every mode, prompts longer
than the windows): the model families of engine.model.families (families.checked()). Anything else (a
model type not checked, an attention module that bypasses the attention interface, a feature such as
attention sinks that the engine does not implement) is refused with one UnsupportedModel line naming the model type and what
is missing, never run with a different attention."""
from __future__ import annotations

import inspect

import torch

from engine.errors import UnsupportedModel
from engine.model import families

# what is known to be missing for a model type the engine does not run
KNOWN_GAPS: dict[str, str] = {
    "stablelm": "its attention module does not pass the engine's cache to the attention function",
    "gpt_oss": "attention sinks (s_aux)",
    "cohere2": "not checked against transformers' own attention (sliding windows without rope on global layers)",
}


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's self-attention modules, in layer order (those with a layer_idx and a query projection)."""
    found = [m for m in model.modules() if hasattr(m, "layer_idx") and (hasattr(m, "q_proj") or hasattr(m, "qkv_proj"))]
    return sorted(found, key=lambda m: m.layer_idx)


def missing_feature(model_type: str, modules: list[torch.nn.Module]) -> str:
    """Why a model type the engine was not checked on is refused: a known gap, else what its
    attention module's code shows (attention sinks, a call that bypasses the attention interface)."""
    if model_type in KNOWN_GAPS:
        return KNOWN_GAPS[model_type]
    try:
        source = inspect.getsource(type(modules[0]).forward) if modules else ""
    except (OSError, TypeError):
        source = ""
    if "s_aux" in source:
        return "attention sinks (s_aux)"
    if source and "ALL_ATTENTION_FUNCTIONS" not in source:
        return "its attention module bypasses the attention interface"
    return "its attention has not been checked against transformers' own"


def check_supported(model: torch.nn.Module) -> None:
    """Raise UnsupportedModel unless the engine reproduces this model's attention: a checked model
    type (a registered family), one attention module per layer, each using the attention interface."""
    config = model.config
    model_type = getattr(config, "model_type", type(model).__name__)
    modules = attention_modules(model)
    checked = families.checked()
    if model_type not in checked:
        raise UnsupportedModel(f"model type '{model_type}' is not supported: {missing_feature(model_type, modules)} "
                               f"(supported: {', '.join(checked)})")
    layers = config.get_text_config().num_hidden_layers
    if len(modules) != layers or [m.layer_idx for m in modules] != list(range(layers)):
        raise UnsupportedModel(f"model type '{model_type}' is not supported: found {len(modules)} attention "
                               f"modules for {layers} layers")
