"""Hardware and model profiles (engine.plan.profile_types: validated frozen dataclasses) found by
name in profiles/, or derived from a YAML file, a local Hugging Face config.json, a GGUF file or a
loaded model.

    load_hardware("rtx-a6000" | "path/to/gpu.yaml") -> HardwareProfile
    load_model_profile("mistral-7b" | "path/to/model.yaml" | "hf/model/dir" | "config.json") -> ModelProfile

A malformed profile raises ProfileError naming the file and the field; an unknown name raises
BadArgument listing the known names.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from importlib.resources import files
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

from engine.errors import BadArgument, ModelLoadError, ProfileError
from engine.kvcache.passes import sliding_windows
from engine.model import families
from engine.model.embedded import EMBEDDED_NAME, EMBEDDED_PROFILE
from engine.model.files import ModelFiles, context_window, model_files
from engine.model.gguf_header import estimate_held_bytes
from engine.model.held_model import held_bytes, held_parameters
from engine.model.sources import OLLAMA_PREFIX, is_gguf_file
from engine.plan.profile_types import (  # noqa: F401  (the types are part of this module's API)
    HardwareProfile,
    ModelProfile,
    hardware_from_yaml,
    model_from_yaml,
)


def estimate_parameters(shape, tied: bool, qkv_bias: bool = False) -> int:
    """Parameter count of a Llama-style decoder (embeddings (+ untied head), attention, gated MLP, norms) of a
    shape with ModelProfile's fields layers, heads, kv_heads, head_dim, hidden_size, intermediate_size and
    vocab_size (a ModelProfile, or the namespace model_profile_from_config builds it from)."""
    hidden, q, kv = shape.hidden_size, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    attn = hidden * q * 2 + hidden * kv * 2 + ((q + 2 * kv) if qkv_bias else 0)
    per_layer = attn + 3 * hidden * shape.intermediate_size + 2 * hidden
    embed = shape.vocab_size * hidden * (1 if tied else 2)
    return shape.layers * per_layer + embed + hidden


def model_profile_from_config(config: Any, name: str | None = None, source: str = "<config>",
                              parameters: int | None = None) -> ModelProfile:
    """A ModelProfile from a Hugging Face config (dict, or an object with to_dict(), e.g. PretrainedConfig).

    parameters: the true count if known (e.g. sum of numel of a loaded model); otherwise estimated. The
    model's window (max_context) by the loader's one rule (engine.model.files.window_rule).
    """
    whole = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    cfg = whole.get("text_config") or whole  # multimodal wrappers keep the LM under text_config
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        layers = int(cfg["num_hidden_layers"])
        intermediate = int(cfg["intermediate_size"])
        vocab = int(cfg["vocab_size"])
    except KeyError as exc:
        raise ProfileError(f"{source}: field '{exc.args[0]}' is missing") from None
    except (TypeError, ValueError) as exc:
        raise ProfileError(f"{source}: a shape field is not an integer ({exc})") from None
    if heads <= 0 or hidden <= 0:
        raise ProfileError(f"{source}: field 'num_attention_heads' must be > 0, not {heads}")
    shape = SimpleNamespace(layers=layers, heads=heads, kv_heads=int(cfg.get("num_key_value_heads") or heads),
                            head_dim=int(cfg.get("head_dim") or hidden // heads), hidden_size=hidden,
                            intermediate_size=intermediate, vocab_size=vocab)
    if parameters is None:
        known = families.family(cfg.get("model_type"))
        parameters = estimate_parameters(shape, bool(cfg.get("tie_word_embeddings", False)),
                                         bool(cfg.get("attention_bias", known is not None and known.qkv_bias)))
    label = name or cfg.get("_name_or_path") or cfg.get("model_type") or "hf-model"
    window, window_layers = sliding_layers(cfg, layers)
    return ModelProfile(
        name=str(label), display_name=str(label), **vars(shape),
        max_context=context_window(whole), parameters=int(parameters),
        sliding_window=window,
        sliding_window_layers=window_layers, source=source)


def sliding_layers(cfg: dict, layers: int) -> tuple[int | None, int]:
    """(the sliding window, how many layers use it) of a Hugging Face config dict, as the model's
    attention modules apply it (engine.kvcache.base.sliding_windows): its layer_types' sliding_attention
    layers; a config without layer_types is normalized by transformers' own config class (Qwen2's
    use_sliding_window / max_window_layers, Gemma 3's pattern), else every layer has the window."""
    window = cfg.get("sliding_window")
    if not window:
        return None, 0
    types = cfg.get("layer_types")
    if types is None and cfg.get("model_type"):
        try:
            from transformers import AutoConfig

            types = getattr(AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items()
                                                                       if k != "model_type"}), "layer_types", None)
        except (ValueError, KeyError, TypeError):
            types = None
    layout = SimpleNamespace(num_hidden_layers=layers, sliding_window=int(window), layer_types=types)
    sliding = [w for w in sliding_windows(layout) if w is not None]  # the engine's rule, on the normalized types
    return (sliding[0], len(sliding)) if sliding else (None, 0)


def model_from_hf(path: str | Path) -> ModelProfile:
    """Load a model profile from a local HF model directory or its config.json."""
    path = Path(path)
    config_path = path / "config.json" if path.is_dir() else path
    if not config_path.is_file():
        raise ProfileError(f"{config_path}: no config.json there")
    try:
        cfg = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ProfileError(f"{config_path}: not a readable JSON config ({exc})") from None
    if not isinstance(cfg, dict):
        raise ProfileError(f"{config_path}: expected a JSON object")
    name = config_path.parent.name or "hf-model"
    return model_profile_from_config(cfg, name=name, source=str(config_path))


# --- lookup by name ------------------------------------------------------------------------------

def _profile_files(kind: str) -> Iterator[Path]:
    folder = files("profiles").joinpath(kind)
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".yaml"):
            yield Path(str(entry))


def _all(kind: str, loader) -> list:
    """Built-in profiles are named by their package path (profiles/<kind>/<file>), stable across installs."""
    return [loader(p, f"profiles/{kind}/{p.name}") for p in _profile_files(kind)]


def list_hardware() -> list[HardwareProfile]:
    """Every built-in hardware profile, sorted by file name."""
    return _all("hardware", hardware_from_yaml)


def list_models() -> list[ModelProfile]:
    """Every built-in model profile, sorted by file name."""
    return _all("models", model_from_yaml)


def _norm(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-")


def _by_name(name: str, profiles: list, what: str):
    wanted = _norm(name)
    for profile in profiles:
        if wanted in (_norm(profile.name), *map(_norm, profile.aliases)):
            return profile
    known = ", ".join(p.name for p in profiles)
    raise BadArgument(f"unknown {what} {name!r}; known: {known} (or a path to a profile file)")


def _looks_like_path(name: str) -> bool:
    return name.endswith((".yaml", ".yml", ".json")) or "/" in name or Path(name).exists()


def load_hardware(name_or_path: str) -> HardwareProfile:
    """A hardware profile by name or alias (e.g. 'rtx-a6000', 'a6000') or from a YAML path."""
    if _looks_like_path(name_or_path):
        path = Path(name_or_path).expanduser()
        if not path.is_file():
            raise BadArgument(f"hardware profile file not found: {path}")
        return hardware_from_yaml(path)
    return _by_name(name_or_path, list_hardware(), "hardware profile")


def load_model_profile(name_or_path: str) -> ModelProfile:
    """A model profile by name or alias, a YAML path, a config.json, or a model as --model names it (a local HF
    model folder, a GGUF file, ollama:NAME[:TAG]: resolved once, engine.model.files), whose weights count as the
    engine holds them."""
    if name_or_path.startswith(OLLAMA_PREFIX):
        return model_from_files(model_files(name_or_path))
    if _looks_like_path(name_or_path):
        path = Path(name_or_path).expanduser()
        if not path.exists():
            raise BadArgument(f"model profile path not found: {path}")
        if path.suffix in (".yaml", ".yml"):
            return model_from_yaml(path)
        if path.is_dir():
            return model_from_files(folder_files(path))
        if is_gguf_file(path):
            return model_from_files(model_files(str(path)))
        return model_from_hf(path)
    return _by_name(name_or_path, list_models(), "model profile")


def folder_files(path: Path) -> ModelFiles:
    """A model folder resolved as --model resolves it; a folder that is not one is a ProfileError (the planner's
    exit code), its config read (once) here."""
    try:
        files = model_files(str(path))
        _ = files.plan_config
    except ModelLoadError as exc:
        raise ProfileError(str(exc)) from None
    return files


def model_from_files(files: ModelFiles) -> ModelProfile:
    """The profile of a model as engine.model.files resolved it (once): a GGUF's (model_from_gguf), or a folder's
    from its config.json (read once)."""
    if files.is_gguf:
        return model_from_gguf(files)
    return model_profile_from_config(files.config, name=files.name, source=str(files.folder / "config.json"))


def model_from_gguf(files: ModelFiles) -> ModelProfile:
    """A GGUF's profile: its config (from its header where it gives it, else converted once: ModelFiles.plan_config),
    its parameters counted from the tensor table and its weights' bytes as held on the CPU
    (engine.model.gguf_header.estimate_held_bytes)."""
    path, header = files.source.gguf, files.header
    parameters = sum(int(math.prod(t.ne)) for t in header.tensors.values())
    profile = model_profile_from_config(files.plan_config, name=path.stem, source=str(path), parameters=parameters)
    return replace(profile, held_weight_bytes=estimate_held_bytes(header))


def match_cuda_device(device_name: str) -> HardwareProfile | None:
    """The built-in profile whose cuda_names match torch.cuda.get_device_name() (whole words), if any."""
    for profile in list_hardware():
        for pattern in profile.cuda_names:
            if re.search(rf"(?<![\w-]){re.escape(pattern)}(?![\w-])", device_name, flags=re.IGNORECASE):
                return profile
    return None


def device_prefetch(kind: str) -> str:
    """The prefetch the engine uses on a device kind ("cpu" or "cuda"): speculative on a GPU, where
    the fetch crosses PCIe and must overlap the step (the method as designed); current on a CPU,
    where the host store is the device's own RAM, so there is no transfer to hide and the
    speculative token only costs (docs/engine.md)."""
    return "current" if kind == "cpu" else "speculative"


def loaded_model_profile(lm) -> ModelProfile:
    """A loaded model's profile: the embedded model's own, else one derived from its config, with the window
    the loader found (LoadedModel.max_context: a config object fills in its class's default where config.json
    names none)."""
    return load_model_profile(EMBEDDED_PROFILE) if lm.name == EMBEDDED_NAME else held_model_profile(lm)


def held_model_profile(lm) -> ModelProfile:
    """A loaded model's profile derived from its config: its parameters and weight bytes as held, and the
    window the loader found."""
    profile = model_profile_from_config(lm.model.config, name=lm.name, parameters=held_parameters(lm.model))
    return replace(profile, held_weight_bytes=held_bytes(lm.model)["total"], max_context=lm.max_context)


def profile_defaults(profile: ModelProfile, device_kind: str, prefetch: str | None = None) -> dict:
    """The cache settings whose default is the model profile's (engine.config.Setting.default_rule):
    bits, group and k, and the prefetch for the device kind (device_prefetch). prefetch: the one asked
    for instead (k follows it: the profile keeps one k per prefetch). The one place these defaults
    are chosen: for a run (model_defaults), a plan and a bench."""
    prefetch = prefetch or device_prefetch(device_kind)
    return {"bits": profile.default_bits, "group": profile.default_group, **profile_k(profile, prefetch),
            "prefetch": prefetch}


def profile_k(profile: ModelProfile, prefetch: str) -> dict:
    """k by default for a prefetch: the profile's; with the current prefetch (a CPU: the set is read in place) it
    grows at 1 bit and with the context (CacheConfig.k_grows)."""
    return {"k": profile.k_for(prefetch), "k_grows": prefetch == "current"}


def model_defaults(lm, prefetch: str | None = None, profile: ModelProfile | None = None) -> dict:
    """profile_defaults of a loaded model (its profile if there is one, else by size) on its device.
    profile: the model's, if already at hand."""
    return profile_defaults(profile or loaded_model_profile(lm), lm.device.type, prefetch)
