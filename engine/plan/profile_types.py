"""The profiles' types: HardwareProfile and ModelProfile, validated frozen dataclasses, and how a
YAML file (profiles/) becomes one (engine.plan.profiles finds, names and derives them)."""
from __future__ import annotations

import typing
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from engine.config import GROUPS, K_CURRENT, CacheConfig
from engine.errors import ProfileError

MIB = 1024**2
KINDS = ("cuda", "cpu")
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
PCIE_GBPS_PER_LANE = {3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}  # GB/s per lane, after line encoding


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
    # the cache defaults by model: a profile's own, else a model without one gets CacheConfig's (engine.config)
    default_bits: int = CacheConfig.bits
    default_group: int = CacheConfig.group
    default_k: int = CacheConfig.k  # with speculative prefetch (the GPU default)
    default_k_current: int | None = K_CURRENT  # with current prefetch (the CPU default); None: default_k
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
