"""Hardware and model profiles: validated frozen dataclasses loaded from YAML (profiles/) or
from a local Hugging Face config.json.

    load_hardware("rtx-a6000" | "path/to/gpu.yaml") -> HardwareProfile
    load_model_profile("mistral-7b" | "path/to/model.yaml" | "hf/model/dir" | "config.json") -> ModelProfile

A malformed profile raises ProfileError naming the file and the field; an unknown name raises
BadArgument listing the known names.
"""
from __future__ import annotations

import json
import math
import re
import typing
from dataclasses import MISSING, dataclass, fields, replace
from importlib.resources import files
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import yaml

from engine.config import GROUPS
from engine.errors import BadArgument, ProfileError
from engine.kvcache.base import sliding_windows
from engine.model.embedded import EMBEDDED_NAME
from engine.model.gguf_files import ensure_converted, estimate_held_bytes, read_header
from engine.model.linears import held_bytes, held_parameters
from engine.model.sources import OLLAMA_PREFIX, is_gguf_file, resolve_source

MIB = 1024**2
KINDS = ("cuda", "cpu")
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
PCIE_GBPS_PER_LANE = {3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}  # GB/s per lane, after line encoding
# The guide of a model without a profile (issue 38): what held on every real model measured (SmolLM2-135M,
# Qwen2.5-Coder-1.5B, Gemma-3-270M; bench-results/fidelity-models.md): 2 bits (with engine.config's 2 outlier
# channels and Hadamard rotation), k 128 with current prefetch (the CPU's), 256 with speculative. Until then a
# model of 1B parameters or more got 1 bit and k 64: Qwen2.5-Coder-1.5B top-1 0.891 / KL 0.074 on report.pdf.
UNPROFILED_DEFAULTS = {"default_bits": 2, "default_k": 256, "default_k_current": 128}


def _check(ok: bool, source: str, field: str, problem: str) -> None:
    if not ok:
        raise ProfileError(f"{source}: field '{field}' {problem}")


def _positive(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        _check(value is None or value > 0, obj.source, name, f"must be > 0, not {value}")


@dataclass(frozen=True)
class HardwareProfile:
    """One accelerator (or the CPU) as the planner sees it. Bandwidths in GB/s (1e9 B/s)."""

    name: str
    display_name: str
    kind: str  # "cuda" or "cpu"
    device_memory_bytes: int
    memory_bandwidth_gbps: float  # device memory (HBM/GDDR/DRAM), spec peak
    matmul_tflops: float  # dense matmul peak in compute_dtype (fp16 tensor cores, fp32 accumulate on GPUs)
    h2d_gbps: float  # realistic pinned host-to-device copy rate (measured-typical, or measured here)
    compute_dtype: str = "float16"
    pcie_gen: int | None = None
    pcie_lanes: int | None = None
    free_memory_bytes: int | None = None  # only when detected on this machine
    host_ram_bytes: int | None = None  # only when detected on this machine
    aliases: tuple[str, ...] = ()
    cuda_names: tuple[str, ...] = ()  # substrings of torch.cuda.get_device_name() that identify it
    source: str = "<built-in>"

    def __post_init__(self) -> None:
        _check(self.kind in KINDS, self.source, "kind",
               f"must be one of {', '.join(KINDS)}, not {self.kind!r}")
        _check(self.compute_dtype in DTYPE_BYTES, self.source, "compute_dtype",
               f"must be one of {', '.join(DTYPE_BYTES)}, not {self.compute_dtype!r}")
        _positive(self, "device_memory_bytes", "memory_bandwidth_gbps", "matmul_tflops", "h2d_gbps",
                  "pcie_lanes", "free_memory_bytes", "host_ram_bytes")
        _check(self.pcie_gen is None or self.pcie_gen in PCIE_GBPS_PER_LANE, self.source, "pcie_gen",
               f"must be one of {sorted(PCIE_GBPS_PER_LANE)}, not {self.pcie_gen}")
        _check((self.pcie_gen is None) == (self.pcie_lanes is None), self.source, "pcie_lanes",
               "must be given together with pcie_gen")
        _check(self.kind == "cpu" or self.pcie_gen is not None, self.source, "pcie_gen",
               "is required for a cuda profile")
        link = self.pcie_link_gbps
        if link is not None:
            _check(self.h2d_gbps <= link, self.source, "h2d_gbps",
                   f"{self.h2d_gbps} exceeds the PCIe link's {link:.1f} GB/s")
        _check(self.free_memory_bytes is None or self.free_memory_bytes <= self.device_memory_bytes,
               self.source, "free_memory_bytes", "exceeds device_memory_bytes")

    @property
    def pcie_link_gbps(self) -> float | None:
        """Theoretical one-direction PCIe bandwidth of the host link (None for the CPU)."""
        if self.pcie_gen is None or self.pcie_lanes is None:
            return None
        return PCIE_GBPS_PER_LANE[self.pcie_gen] * self.pcie_lanes

    @property
    def element_bytes(self) -> int:
        """Bytes per weight / K / V element in the compute dtype."""
        return DTYPE_BYTES[self.compute_dtype]

    @property
    def unified_memory(self) -> bool:
        """True when 'device' and host are the same RAM (the CPU profile)."""
        return self.kind == "cpu"


@dataclass(frozen=True)
class ModelProfile:
    """A decoder-only transformer's shape (Llama-style: GQA attention, gated MLP)."""

    name: str
    display_name: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_context: int
    parameters: int
    default_bits: int = 1
    default_group: int = 64
    default_k: int = 64  # with speculative prefetch (the GPU default)
    default_k_current: int | None = None  # with current prefetch (the CPU default); None: default_k
    sliding_window: int | None = None  # the model's sliding window W (Mistral v0.1, Gemma 2/3, ...)
    sliding_window_layers: int = 0  # how many layers attend within it (each keeps only its window)
    hf_id: str = ""
    aliases: tuple[str, ...] = ()
    source: str = "<built-in>"
    # bytes the weights take as the engine holds them (a GGUF's blocks: 4.5-10 bits a weight; fp32
    # norms); None: parameters x the element size of the device's compute dtype
    held_weight_bytes: int | None = None

    def __post_init__(self) -> None:
        _positive(self, "layers", "heads", "kv_heads", "head_dim", "hidden_size", "intermediate_size",
                  "vocab_size", "max_context", "parameters", "default_k")
        _check(self.heads % self.kv_heads == 0, self.source, "kv_heads",
               f"({self.kv_heads}) must divide heads ({self.heads})")
        _check(self.default_k_current is None or self.default_k_current > 0, self.source, "default_k_current",
               f"must be > 0, not {self.default_k_current}")
        _check(self.default_bits in (1, 2), self.source, "default_bits", f"must be 1 or 2, not {self.default_bits}")
        _check(self.default_group in GROUPS, self.source, "default_group",
               f"must be one of {', '.join(map(str, GROUPS))}, not {self.default_group}")
        _check(0 <= self.sliding_window_layers <= self.layers, self.source, "sliding_window_layers",
               f"must be in 0..layers ({self.layers}), not {self.sliding_window_layers}")
        _check(self.sliding_window_layers == 0 or (self.sliding_window or 0) > 0, self.source, "sliding_window",
               "must be > 0 when sliding_window_layers is given")
        embed = self.vocab_size * self.hidden_size
        _check(self.parameters > embed, self.source, "parameters",
               f"({self.parameters}) is smaller than the embedding table alone ({embed})")

    @property
    def global_layers(self) -> int:
        """Layers that attend over the whole context (they keep the configured cache policy)."""
        return self.layers - self.sliding_window_layers

    def k_for(self, prefetch: str) -> int:
        """The default k for a prefetch mode (the two select differently, so they need different k)."""
        return self.default_k_current if prefetch == "current" and self.default_k_current else self.default_k


# --- YAML / dict loading ------------------------------------------------------------------------

def _type_ok(value: Any, hint: Any) -> bool:
    """Whether a YAML value fits a dataclass field's annotation (ints are not bools)."""
    args = typing.get_args(hint)
    if type(None) in args:
        if value is None:
            return True
        hint = next(a for a in args if a is not type(None))
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if typing.get_origin(hint) is tuple:
        return isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)
    return False


def _build(cls: type, data: dict, source: str, renames: dict[str, tuple[str, int]] | None = None):
    """Instantiate a profile dataclass from a mapping, naming the offending field on any problem.

    renames: yaml key -> (field, multiplier), e.g. device_memory_mib -> device_memory_bytes x 2**20.
    """
    if not isinstance(data, dict):
        raise ProfileError(f"{source}: expected a mapping of fields, got {type(data).__name__}")
    renames = renames or {}
    hints = typing.get_type_hints(cls)
    targets = {f for f, _ in renames.values()}
    allowed = ({f.name for f in fields(cls)} - {"source"} - targets) | set(renames)
    values: dict[str, Any] = {}
    for key, value in data.items():
        _check(key in allowed, source, str(key), f"is not a known field (known: {', '.join(sorted(allowed))})")
        field, scale = renames.get(key, (key, 1))
        _check(_type_ok(value, hints[field]), source, key, f"has the wrong type ({type(value).__name__}: {value!r})")
        if value is not None and scale != 1:
            value = int(value * scale)
        values[field] = tuple(value) if isinstance(value, list) else value
    for f in fields(cls):
        if f.name not in values and f.name != "source" and f.default is MISSING and f.default_factory is MISSING:
            yaml_key = next((k for k, (t, _) in renames.items() if t == f.name), f.name)
            raise ProfileError(f"{source}: field '{yaml_key}' is missing")
    return cls(**values, source=source)


HARDWARE_RENAMES = {"device_memory_mib": ("device_memory_bytes", MIB)}


def _read_yaml(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "parse error"
        raise ProfileError(f"{path}: not valid YAML{where}: {problem}") from None


def hardware_from_yaml(path: str | Path, source: str | None = None) -> HardwareProfile:
    """Load one hardware profile file (source: how errors and --json name it; default the path)."""
    path = Path(path)
    return _build(HardwareProfile, _read_yaml(path), source or str(path), HARDWARE_RENAMES)


def model_from_yaml(path: str | Path, source: str | None = None) -> ModelProfile:
    """Load one model profile file (source: how errors and --json name it; default the path)."""
    path = Path(path)
    return _build(ModelProfile, _read_yaml(path), source or str(path))


# --- Hugging Face configs ------------------------------------------------------------------------

def estimate_parameters(layers: int, heads: int, kv_heads: int, head_dim: int, hidden: int,
                        intermediate: int, vocab: int, tied: bool, qkv_bias: bool = False) -> int:
    """Parameter count of a Llama-style decoder: embeddings (+ untied head), attention, gated MLP, norms."""
    attn = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    if qkv_bias:
        attn += (heads + 2 * kv_heads) * head_dim
    mlp = 3 * hidden * intermediate
    per_layer = attn + mlp + 2 * hidden
    embed = vocab * hidden * (1 if tied else 2)
    return layers * per_layer + embed + hidden


def model_profile_from_config(config: Any, name: str | None = None, source: str = "<config>",
                              parameters: int | None = None) -> ModelProfile:
    """A ModelProfile from a Hugging Face config (dict, or an object with to_dict(), e.g. PretrainedConfig).

    parameters: the true count if known (e.g. sum of numel of a loaded model); otherwise estimated.
    """
    cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    cfg = cfg.get("text_config") or cfg  # multimodal wrappers keep the LM under text_config
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
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    if parameters is None:
        parameters = estimate_parameters(layers, heads, kv_heads, head_dim, hidden, intermediate, vocab,
                                         bool(cfg.get("tie_word_embeddings", False)),
                                         bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")))
    label = name or cfg.get("_name_or_path") or cfg.get("model_type") or "hf-model"
    window, window_layers = sliding_layers(cfg, layers)
    return ModelProfile(
        name=str(label), display_name=str(label), layers=layers, heads=heads, kv_heads=kv_heads,
        head_dim=head_dim, hidden_size=hidden, intermediate_size=intermediate, vocab_size=vocab,
        max_context=int(cfg.get("max_position_embeddings") or 2048), parameters=int(parameters),
        **UNPROFILED_DEFAULTS, sliding_window=window,
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
    """A model profile by name or alias, a YAML path, a local HF model dir / config.json, or a GGUF
    file (or ollama:NAME[:TAG]), whose weights count as the engine holds them."""
    if name_or_path.startswith(OLLAMA_PREFIX):
        return model_from_gguf(resolve_source(name_or_path).gguf)
    if _looks_like_path(name_or_path):
        path = Path(name_or_path).expanduser()
        if not path.exists():
            raise BadArgument(f"model profile path not found: {path}")
        if path.suffix in (".yaml", ".yml"):
            return model_from_yaml(path)
        if path.is_file() and is_gguf_file(path):
            return model_from_gguf(path)
        return model_from_hf(path)
    return _by_name(name_or_path, list_models(), "model profile")


def model_from_gguf(path: Path) -> ModelProfile:
    """A GGUF file's profile: its config (converted once), its parameters counted from the tensor table
    and its weights' bytes as held on the CPU (engine.model.gguf_files.estimate_held_bytes)."""
    folder = ensure_converted(path, path.stem)
    header = read_header(path)
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    parameters = sum(int(math.prod(t.ne)) for t in header.tensors.values())
    profile = model_profile_from_config(config, name=path.stem, source=str(path), parameters=parameters)
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
    """A loaded model's profile: the embedded model's own, else one derived from its config."""
    if lm.name == EMBEDDED_NAME:
        return load_model_profile("smollm2-135m")
    profile = model_profile_from_config(lm.model.config, name=lm.name, parameters=held_parameters(lm.model))
    return replace(profile, held_weight_bytes=held_bytes(lm.model)["total"])


def profile_defaults(profile: ModelProfile, device_kind: str, prefetch: str | None = None) -> dict:
    """The cache settings whose default is the model profile's (engine.config.Setting.default_rule):
    bits, group and k, and the prefetch for the device kind (device_prefetch). prefetch: the one asked
    for instead (k follows it: the profile keeps one k per prefetch). The one place these defaults
    are chosen: for a run (model_defaults), a plan and a bench."""
    prefetch = prefetch or device_prefetch(device_kind)
    return {"bits": profile.default_bits, "group": profile.default_group, "k": profile.k_for(prefetch),
            "prefetch": prefetch}


def model_defaults(lm, prefetch: str | None = None, profile: ModelProfile | None = None) -> dict:
    """profile_defaults of a loaded model (its profile if there is one, else by size) on its device.
    profile: the model's, if already at hand."""
    return profile_defaults(profile or loaded_model_profile(lm), lm.device.type, prefetch)
