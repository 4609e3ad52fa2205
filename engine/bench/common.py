"""Shared pieces of the benches: mode labels, progress events, the JSON envelope, atomic
writes, the default documents and small statistics helpers.

Mode labels (``--modes``): ``<mode>[-<opt>...]`` with mode a registered cache policy
(engine/kvcache/registry.py: full, specache, kivi, window, exact) or ``hf`` (stock transformers
``generate`` with DynamicCache, speed and decode benches), options ``<n>b`` guide bits, ``k<n>`` fetched positions, ``g<n>`` group, ``r<n>`` residual
window, ``s<n>`` sinks, ``w<n>`` window tokens, ``c<n>`` prefill chunk, ``current`` /
``o<n>`` outlier key channels (engine/kvcache/outliers.py), ``gamma<n>`` (exact mode's draft tokens per verification; default adaptive), ``speculative`` (prefetch: each pass picks its own fetched set and feeds one token, or the
design's two-token speculative steps), ``both`` / ``spec`` (the fetch set is selected with the
output token's attention as well as the speculative token's, or with the speculative token's
alone), ``resync`` / ``noresync`` (re-sync a missed speculation by prompt lookup, or keep the
paper's chain), ``correct`` / ``nocorrect`` (the output token's own ranking corrects the prefetched
set before it attends, the missing positions fetched then; or the paper's set, the guess's alone);
these last six imply ``speculative``; ``had`` / ``norot`` (the guide's rotation:
Hadamard or none; unset, the default for the bits). Unset options keep the model's defaults
(bits, group, k, and the prefetch for the device: ``engine.plan.profiles.model_defaults``, what
``summarize``/``ask`` use) when the benches pass them, else engine.config.CacheConfig's, so
``specache`` is the setting users get. ``window`` without ``w<n>`` is sized to the device
bytes of specache with the same bits / k / group (``window-1b`` matches ``specache-1b``);
``kivi`` never fetches (k = 0: its ``fixed_settings``; an option only one policy reads, as
``w<n>``, is its ``own_settings``). The options are the settings' declarations (engine.config.Setting:
``label`` for a number, ``words`` for a choice), so a new setting's label option is declared with it.
"""
from __future__ import annotations

import datetime as _dt
import math
import os
import platform
import re
import statistics
import tempfile
from dataclasses import asdict, dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from engine.config import CacheConfig, settings
from engine.errors import BadArgument
from engine.inputs.documents import load_document
from engine.kvcache.registry import POLICIES, names
from engine.model import decode_kernels
from engine.model.linears import SkinnyLinear
from engine.native import calibrate

SCHEMA_VERSION = 1
HF_MODE = "hf"
EXAMPLES = Path(str(files("specache_examples")))  # examples/ of the checkout, or its installed copy



def _label_grammar() -> tuple[list[tuple[re.Pattern, str]], dict[str, tuple[str, object]]]:
    """The label options, from the settings' declarations (engine.config.Setting): a number option per
    setting with a label ("k{}" -> k<n>), a word per value of a setting with words ("had" -> hadamard)."""
    numbers, words = [], {}
    for name, declared in settings().items():
        if declared.label:
            before, _, after = declared.label.partition("{}")
            numbers.append((re.compile(f"{re.escape(before)}(\\d+){re.escape(after)}"), name))
        for word, value in declared.words.items():
            words[word] = (name, value)
    return numbers, words


def option_name(name: str) -> str:
    """How a label writes a setting's option: its number form (k<n>), else the setting's name."""
    declared = settings()[name]
    return declared.label.replace("{}", "<n>") if declared.label else name

@dataclass(frozen=True)
class ModeSpec:
    """One bench column: a label and the cache configuration it stands for (None for hf)."""

    label: str
    mode: str
    config: CacheConfig | None
    options: tuple[str, ...] = ()  # the label's options, e.g. ("1b", "k128")
    cls: type | None = None  # the mode's policy class (engine.kvcache.registry), resolved with the label

    def to_json(self) -> dict:
        return {"label": self.label, "mode": self.mode,
                "config": asdict(self.config) if self.config is not None else None}

    @property
    def is_default_specache(self) -> bool:
        """The plain ``specache`` label: the default setting (the model's, when parsed with defaults)."""
        return self.mode == "specache" and not self.options


def parse_mode(label: str, defaults: dict | None = None) -> ModeSpec:
    """``specache-1b-k128`` -> ModeSpec (see the module docstring); defaults: bits/group/k/prefetch of
    the model, and optionally k_for: for each prefetch, the k fields it takes by default (engine.plan.profiles.profile_k:
    k and k_grows; a label that names a prefetch gets its fields)."""
    label = label.strip()
    defaults = dict(defaults or {})
    k_for = defaults.pop("k_for", None)
    parts = label.split("-")
    mode = parts[0].lower()
    if mode == HF_MODE:
        if len(parts) > 1:
            raise BadArgument(f"mode {label!r}: hf takes no options")
        return ModeSpec(label, HF_MODE, None)
    if mode not in POLICIES:
        raise BadArgument(f"mode {label!r}: must start with one of {', '.join(names() + (HF_MODE,))}")
    fields: dict[str, int | bool | str] = {}
    numbers, words = _label_grammar()
    implied: dict = {}
    for opt in parts[1:]:
        word = opt.lower()
        if word in words:
            name, fields[name] = words[word]
            implied.update(settings()[name].implies)
            continue
        match = next(((m, name) for pattern, name in numbers if (m := pattern.fullmatch(word))), None)
        if match is None:
            forms = [option_name(name) for _, name in numbers] + list(words)
            raise BadArgument(f"mode {label!r}: unknown option {opt!r} (use {', '.join(forms)})")
        fields[match[1]] = int(match[0].group(1))
    for name, value in implied.items():  # options of the speculative decoder imply it
        fields.setdefault(name, value)
    policy_fields(label, POLICIES[mode], fields)
    base = CacheConfig(mode=mode).with_overrides(**defaults)
    if k_for and "k" not in fields:
        fields.update(k_for[fields.get("prefetch", base.prefetch)])
    return ModeSpec(label, mode, base.with_overrides(**fields), tuple(parts[1:]), POLICIES[mode])


def policy_fields(label: str, cls: type, fields: dict) -> None:
    """Check a label's options against what its policy declares (engine.kvcache.base.CacheLayer): an
    option only other policies read is refused (w<n>: window's own_settings); a setting the policy
    holds at one value is set to it, another value refused (kivi's fixed_settings: k = 0)."""
    for name in fields:
        owners = [n for n, c in POLICIES.items() if name in c.own_settings]
        if owners and name not in cls.own_settings:
            raise BadArgument(f"mode {label!r}: {option_name(name)} only applies to "
                              f"{', '.join(owners)}")
    for name, value in cls.fixed_settings.items():
        if fields.get(name) not in (None, value):
            held = "never fetches" if name == "k" and not cls.fetches else "holds"  # kivi: "never fetches (k = 0)"
            raise BadArgument(f"mode {label!r}: {cls.policy} {held} ({name} = {value})")
        fields[name] = value


def parse_modes(text: str | Sequence[str], allow_hf: bool = False, defaults: dict | None = None) -> list[ModeSpec]:
    """Comma-separated labels (or a list of them) -> unique ModeSpecs, in order."""
    items = text.split(",") if isinstance(text, str) else [x for t in text for x in t.split(",")]
    specs, seen = [], set()
    for item in items:
        if not item.strip():
            continue
        spec = parse_mode(item, defaults)
        if spec.mode == HF_MODE and not allow_hf:
            raise BadArgument("mode 'hf' (transformers generate) is only measured by `bench speed`")
        if spec.label in seen:
            continue
        seen.add(spec.label)
        specs.append(spec)
    if not specs:
        raise BadArgument("--modes is empty")
    return specs


def parse_ints(text: str, name: str, minimum: int = 1) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BadArgument(f"{name} must be comma-separated integers, not {text!r}") from None
    if not values or any(v < minimum for v in values):
        raise BadArgument(f"{name} must be integers >= {minimum}, not {text!r}")
    return values


def parse_floats(text: str, name: str, lo: float = 0.0, hi: float = 1.0) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BadArgument(f"{name} must be comma-separated numbers, not {text!r}") from None
    if not values or any(not lo <= v <= hi for v in values):
        raise BadArgument(f"{name} must be numbers in [{lo}, {hi}], not {text!r}")
    return values


# ---- events ------------------------------------------------------------------------------

@dataclass
class BenchProgress:
    """A progress line for stderr: `done` of `total` units of work (when known)."""

    message: str
    done: int | None = None
    total: int | None = None


@dataclass
class BenchResult:
    """The final event of a bench generator: the JSON-ready result."""

    data: dict


# ---- environment and envelope ------------------------------------------------------------

def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(lm=None) -> dict:
    """Where the numbers come from: model, library versions, machine."""
    import torch
    import transformers

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu": _cpu_model(),
    }
    env["kernels"] = calibrate.describe()
    env["kernels"]["held_decode_linear"] = decode_kernels.choose()  # a GGUF's decode path: exact, int16 or int8
    if lm is not None:
        env["model"] = {"name": lm.name, "path": str(lm.path), "fingerprint": lm.fingerprint,
                        "max_context": lm.max_context, "dtype": str(lm.dtype).removeprefix("torch."),
                        "device": str(lm.device), "layers": lm.model.config.num_hidden_layers,
                        "heads": lm.model.config.num_attention_heads,
                        "kv_heads": getattr(lm.model.config, "num_key_value_heads", None)
                        or lm.model.config.num_attention_heads}
    return env


def envelope(bench: str, quick: bool, settings: dict, modes: Iterable[ModeSpec], lm=None) -> dict:
    return {"bench": bench, "schema_version": SCHEMA_VERSION,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "quick": quick, "environment": environment(lm), "settings": settings,
            "modes": [m.to_json() for m in modes]}


def target(name: str, goal: str, measured: Any, met: bool | None, note: str = "") -> dict:
    """One line of a bench's 'targets' list (met None: could not be evaluated)."""
    return {"name": name, "goal": goal, "measured": measured, "met": met, "note": note}


# ---- files -------------------------------------------------------------------------------

def write_atomic(path: Path, data: str | bytes) -> Path:
    """Write to a temporary file in the same folder, then os.replace it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600 files; give the usual mode
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def default_doc(name: str) -> str:
    path = EXAMPLES / name
    if not path.is_file():
        raise BadArgument(f"the default document {path} is missing: pass --doc FILE")
    return str(path)


def load_texts(paths: Sequence[str]) -> list[tuple[str, str]]:
    """(source, text) of each document (engine.inputs.documents.load_document)."""

    out = []
    for p in paths:
        doc = load_document(p)
        out.append((doc.source, doc.text))
    return out


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# ---- statistics --------------------------------------------------------------------------

def median(values: Sequence[float]) -> float | None:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(values) if values else None


def mean(values: Sequence[float]) -> float | None:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return sum(values) / len(values) if values else None


def fmt(value: Any, digits: int = 3) -> str:
    """Numbers for tables: None -> '-', floats to `digits` significant-ish places."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value != 0 and abs(value) < 10 ** -(digits):
            return f"{value:.1e}"
        return f"{value:.{digits}f}"
    return str(value)


def md_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A GitHub-flavoured Markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |")
    return "\n".join(lines)


def md_targets(targets: Sequence[dict]) -> str:
    rows = []
    for t in targets:
        met = {True: "met", False: "NOT met", None: "n/a"}[t["met"]]
        rows.append([t["name"], t["goal"], fmt(t["measured"]), met, t.get("note", "")])
    return md_table(["target", "goal", "measured", "status", "note"], rows)


def md_header(title: str, result: dict) -> str:
    env = result["environment"]
    model = env.get("model", {})
    lines = [f"# {title}", "",
             f"- created: {result['created']}{' (quick run)' if result.get('quick') else ''}",
             f"- model: {model.get('name', '?')} ({model.get('dtype', '?')} on {model.get('device', '?')}, "
             f"window {model.get('max_context', '?')} tokens, fingerprint {model.get('fingerprint', '?')})",
             f"- machine: {env['platform']}, {env['cpu_count']} CPUs, torch {env['torch']} "
             f"({env['torch_threads']} threads), transformers {env['transformers']}",
             f"- CPU: {env.get('cpu', '?')}; " + (native_line(env["kernels"]) if env.get("kernels") else "kernels: ?"),
             f"- modes: {', '.join(m['label'] for m in result['modes'])}"]
    if result.get("seconds") is not None:
        lines.append(f"- wall time: {result['seconds']:.1f} s")
    return "\n".join(lines) + "\n"


def native_line(kernels: dict) -> str:
    return calibrate.describe_line(kernels)


class stock_transformers:
    """Run a block as stock transformers would (the ``hf`` baseline): SDPA attention and plain
    nn.Linear modules; the engine's attention function and SkinnyLinears are restored after."""

    def __init__(self, model):

        self.model = model
        self.linears = [m for m in model.modules() if isinstance(m, SkinnyLinear)]

    def __enter__(self):
        self.previous = self.model.config._attn_implementation
        self.model.set_attn_implementation("sdpa")
        self.materialized = [m for m in self.linears if m.weight is None]
        for m in self.materialized:  # held only in its blocks (a GGUF model): transformers would hold it in fp32
            m.weight = torch.nn.Parameter(m.held.rows(0, m.held.shape[0]).float(), requires_grad=False)
        for m in self.linears:
            m.__class__ = torch.nn.Linear

    def __exit__(self, *exc):

        for m in self.linears:
            m.__class__ = SkinnyLinear
        for m in self.materialized:
            m.weight = None
        self.model.set_attn_implementation(self.previous)
