"""Validated configuration dataclasses for the cache engine and for generation."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace

from engine.errors import BadArgument

SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.manual_seed takes (a negative seed wraps around)
GAMMA_MAX = 16  # exact: most draft tokens per verification
PREFETCH = ("speculative", "current")
GROUPS = (32, 64, 128)  # key quantization groups (tokens); values use gcd(group, head_dim) channels (sizes.value_group)
OUTLIERS_MAX = 16  # outlier key channels per KV head at most (engine/kvcache/outliers.py)
ROTATIONS = ("none", "hadamard", "auto")  # engine/kvcache/rotation.py (which checks it is the same list)
# per guide bits, chosen by `specache bench fidelity` on the three shipped documents (docs/results.md, "Guide
# rotation and corrected speculation" and "The defaults on other real models"; bench-results/fidelity-models.md).
# "auto": the Hadamard per layer unless it measurably errs far more than none on the layer's first keys and values
# (engine/kvcache/rotation.py)
DEFAULT_ROTATION = {1: "auto", 2: "auto"}
# outlier key channels per guide bits, from the same bench (docs/results.md, "Outliers as the 2-bit default" and "The
# defaults on other real models"; bench-results/fidelity-2bit-k512-outliers.md, fidelity-2bit-k128-outliers.md)
DEFAULT_OUTLIERS = {1: 4, 2: 2}
RESIDUAL = 64  # newest tokens kept exact on the device (the residual window R)
SINKS = 4  # first tokens kept exact on the device (the attention sinks S)
CHUNK_SIZE = 512  # prefill chunk, tokens
STORE_DTYPES = ("bf16", "fp16", "fp32")  # the exact store's element types on a CPU (engine.kvcache.sizes.store_dtype)
DEFAULT_STORE_DTYPE = "bf16"  # half the fp32 store's bytes; widening it is a 16-bit shift on every instruction set
# With the current prefetch (a CPU: the fetched set is read in place from RAM, nothing crosses a bus), a k left to
# the model profile's default adapts (CacheConfig.k_grows, fetch_k): doubled for a 1-bit guide (ONE_BIT_K), and at
# least the cache's length / K_SHARE in whole 32s; documents under K_SHARE x k tokens (4k at k 128) keep the
# profile's k. Measured: docs/results.md, "A default k that adapts" (bench-results/fidelity-models.md).
ONE_BIT_K = 2
K_SHARE = 32
# k with the current prefetch for a model without a profile (CacheConfig's k is the speculative prefetch's):
# the model defaults are CacheConfig's field defaults and this, declared here once (engine.plan.profile_types'
# ModelProfile takes them as its own defaults; a profile in profiles/models/ declares its own)
K_CURRENT = 128


def outliers_for(bits: int, outliers: int | None) -> int:
    """The outlier key channels a guide of `bits` keeps: `outliers`, else the bits' default (0 for bits that
    have none: a bad --bits is refused by whoever checks it)."""
    return outliers if outliers is not None else DEFAULT_OUTLIERS.get(bits, 0)


@dataclass(frozen=True)
class Setting:
    """One cache setting, declared once on its CacheConfig field (`metadata["setting"]`): everything
    else derives from this: the flags of summarize / ask / plan (specache_cli/options.py), the run's
    overrides, the bench label grammar (engine/bench/common.py), the validation below, the plan's
    settings and the document store's key.

    help: the flag's help (its default rule is appended: `full_help`). flag: the CLI flag (default --name
    with dashes); aliases: more names for it (`specache plan`'s). default_rule: how an unset value is
    chosen, in words ("the model profile's": engine.plan.profiles.profile_defaults gives it). choices /
    low / high: the values allowed (None always is for a field whose default is None). cli: a flag of
    summarize and ask; switch: a bool flag without a --no- form (given: True, absent: unset). tokens: a
    size in tokens (no more than the model's window; cut to the longest call). label: the bench label of
    an int (a format: "k{}" or "{}b"); words: the bench label words of a choice ({"had": "hadamard"});
    implies: settings such a label word implies. plan: the setting's place in `specache plan`'s settings
    (None: the planner does not read it); plan_key: its name there. store: a stored row
    depends on it beyond what the policies' store_key reports (engine.generate.prefixes)."""

    help: str
    flag: str = ""
    aliases: tuple[str, ...] = ()
    default_rule: str = ""
    choices: tuple = ()
    low: int | None = None
    high: int | None = None
    cli: bool = True
    switch: bool = False
    tokens: bool = False
    label: str = ""
    words: dict = field(default_factory=dict)
    implies: dict = field(default_factory=dict)
    plan: int | None = None
    plan_key: str = ""
    store: bool = False

    def check(self, value) -> None:
        """BadArgument (exit 2) for a value outside the declared choices or bounds (None is unset)."""
        if value is None:
            return
        if self.choices and value not in self.choices:
            if all(isinstance(c, str) for c in self.choices):
                allowed, shown = f"one of {', '.join(self.choices)}", repr(value)
            else:
                allowed = " or ".join(map(str, self.choices)) if len(self.choices) == 2 else \
                    f"one of {', '.join(map(str, self.choices))}"
                shown = value
            raise BadArgument(f"{self.flag} must be {allowed}, not {shown}")
        if self.low is not None and self.high is not None and not self.low <= value <= self.high:
            raise BadArgument(f"{self.flag} must be in {self.low}..{self.high}, not {value}")
        if self.low is not None and value < self.low:
            raise BadArgument(f"{self.flag} must be >= {self.low}, not {value}")

    @property
    def full_help(self) -> str:
        """The help with its default rule."""
        return f"{self.help} (default: {self.default_rule})." if self.default_rule else f"{self.help}."


def setting(default, help: str, **declared):
    """A CacheConfig field declared as a setting (Setting gives the meaning of each keyword)."""
    return field(default=default, metadata={"setting": Setting(help, **declared)})


@dataclass(frozen=True)
class CacheConfig:
    """How the KV cache is kept: one field per setting, each declared once (Setting).

    mode: the name of a registered cache policy (engine/kvcache/registry.py, the one list of them:
    full, specache, kivi, window, exact, ...). This module sits below the caches, so it cannot check
    the name; `engine.kvcache.registry.policy` does, wherever a mode is turned into a cache, a plan or
    a run (make_cache, the planner, the CLI's flag check, the bench's mode labels).
    """

    mode: str = "specache"
    bits: int = setting(2, "Guide code width, 1 or 2", default_rule="the model profile's", choices=(1, 2), label="{}b",
                        plan=0)
    group: int = setting(64, "Quantization group size: 32, 64 or 128 tokens of a key channel (values: gcd(group, "
                         "head_dim) channels of a token)", default_rule="the model profile's", choices=GROUPS,
                         label="g{}", plan=1)
    k: int = setting(256, "Exact positions fetched per layer and KV head each step", default_rule="the model profile's",
                     low=0, tokens=True, label="k{}", plan=4)
    k_grows: bool = setting(False, "specache: k is the profile's default with the current prefetch: x ONE_BIT_K at "
                            "1 bit and at least the cache's length / K_SHARE (a k given sets it off)",
                            default_rule="on with the current prefetch when k is the profile's", cli=False)
    residual: int = setting(RESIDUAL, "Newest tokens R kept exact on the device", default_rule=str(RESIDUAL), low=1,
                            tokens=True, label="r{}", plan=2)
    sinks: int = setting(SINKS, "First tokens S kept exact on the device", default_rule=str(SINKS), low=0, tokens=True,
                         label="s{}", plan=3)
    window: int | None = setting(None, "window mode: exact recent tokens", default_rule="the device bytes of specache",
                                 low=1, cli=False, label="w{}")
    chunk_size: int = setting(CHUNK_SIZE, "Prefill chunk size in tokens", default_rule=str(CHUNK_SIZE),
                              aliases=("--prefill-chunk",), low=16, tokens=True, label="c{}", plan=6,
                              plan_key="prefill_chunk")
    measure_hits: bool = setting(False, "specache: measure the prefetch hit rate (costs a full attention per step)",
                                 flag="--hit-rate", switch=True)
    select_both: bool = setting(False, "specache: select with the output token's attention as well as the "
                                "speculative one's", cli=False, words={"both": True, "spec": False},
                                implies={"prefetch": "speculative"})
    resync: bool = setting(True, "specache: after a missed speculation, guess the next token by prompt lookup",
                           cli=False, words={"resync": True, "noresync": False}, implies={"prefetch": "speculative"})
    prefetch: str = setting("speculative", "specache: speculative (two tokens per step, the next step's exact K/V "
                            "fetched while this one computes) or current (one token per step fetches its own from "
                            "its guide attention, then attends: the paper's non-speculative baseline)",
                            default_rule="speculative on a GPU, current on a CPU, where there is no transfer to hide",
                            choices=PREFETCH, words={p: p for p in PREFETCH})
    correct: bool = setting(True, "specache, speculative prefetch: the output token ranks the guide with its own "
                            "queries before it attends and fetches what the prefetch missed (default); --no-correct: "
                            "the paper's set, chosen by the speculative guess alone (no fetch on the critical path)",
                            words={"correct": True, "nocorrect": False}, implies={"prefetch": "speculative"})
    gamma: int | None = setting(None, "exact: draft tokens per verification, 1..16", low=1, high=GAMMA_MAX,
                                default_rule="adapted to the measured acceptance", label="gamma{}")
    rotation: str | None = setting(None, "Guide transform: none, hadamard (K, V and the queries rotated before the "
                                   "guide quantizes them; exact parts untouched) or auto (per layer: the Hadamard "
                                   "unless it measurably errs more on the layer's first keys)", default_rule="auto",
                                   choices=ROTATIONS, words={"had": "hadamard", "norot": "none"})
    outliers: int | None = setting(None, "Outlier key channels per KV head held at 4 bits beside the guide, 0..16 "
                                   "(taken out of the keys before they are rotated and quantized)",
                                   default_rule="2 with 2-bit guides, 4 with 1-bit, as `bench fidelity` chose",
                                   low=0, high=OUTLIERS_MAX, label="o{}", plan=8)
    store_dtype: str | None = setting(None, "Element type of the exact K/V store on a CPU: bf16, fp16 or fp32 (a "
                                      "16-bit store is widened to the compute dtype for the rows a step reads; exact "
                                      "mode and a GPU keep the compute dtype)", default_rule=f"{DEFAULT_STORE_DTYPE}",
                                      choices=STORE_DTYPES, words={d: d for d in STORE_DTYPES})

    def __post_init__(self) -> None:
        for name, declared in settings().items():
            declared.check(getattr(self, name))

    @property
    def guide_rotation(self) -> str:
        """The guide's rotation: the one set, else the default for the bits."""
        return self.rotation if self.rotation is not None else DEFAULT_ROTATION[self.bits]

    @property
    def guide_outliers(self) -> int:
        """The guide's outlier key channels: the number set, else the default for the bits."""
        return outliers_for(self.bits, self.outliers)

    def fetch_k(self, length: int) -> int:
        """The k a cache of `length` tokens fetches: k as set, or where it grows (k_grows) ONE_BIT_K times k
        for a 1-bit guide and at least length / K_SHARE in whole 32s; a k of 0 (kivi) stays 0."""
        if not self.k_grows or not self.k:
            return self.k
        return max(self.k * (ONE_BIT_K if self.bits == 1 else 1), -(-length // (K_SHARE * 32)) * 32)

    def with_overrides(self, **overrides) -> "CacheConfig":
        """A copy with the given fields replaced (None values are ignored); a k given is the k (k_grows off)
        unless k_grows is given with it."""
        given = {k: v for k, v in overrides.items() if v is not None}
        if "k" in given:
            given.setdefault("k_grows", False)
        return replace(self, **given)


@dataclass(frozen=True)
class GenerationConfig:
    """Decoding settings. temperature 0 means greedy. Every processor is off by default here (the engine's
    exactness tests run with these); the CLI's defaults are DECODING_DEFAULTS, chosen by `specache bench task`.

    repeat_penalty: transformers' RepetitionPenaltyLogitsProcessor over the answer so far (1 = off);
    no_repeat_ngram: NoRepeatNGramLogitsProcessor size over the answer so far (0 = off);
    top_k (0 = off), top_p (1 = off), min_p (0 = off): only when sampling (temperature > 0)."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop_ids: tuple[int, ...] = field(default_factory=tuple)
    repeat_penalty: float = 1.0
    no_repeat_ngram: int = 0
    top_k: int = 0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise BadArgument(f"--max-tokens must be >= 1, not {self.max_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise BadArgument(f"--temperature must be a finite number >= 0, not {self.temperature}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise BadArgument(f"--top-p must be in (0, 1], not {self.top_p}")
        if not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise BadArgument(f"--seed must be in [-2**63, 2**64 - 1], not {self.seed}")
        if not (math.isfinite(self.repeat_penalty) and self.repeat_penalty > 0):
            raise BadArgument(f"--repeat-penalty must be a number > 0 (1 is off), not {self.repeat_penalty}")
        if self.no_repeat_ngram < 0:
            raise BadArgument(f"--no-repeat-ngram must be >= 0 (0 is off), not {self.no_repeat_ngram}")
        if self.top_k < 0:
            raise BadArgument(f"--top-k must be >= 0 (0 is off), not {self.top_k}")
        if not 0 <= self.min_p < 1:
            raise BadArgument(f"--min-p must be in [0, 1) (0 is off), not {self.min_p}")

    @property
    def processors_off(self) -> bool:
        """Greedy with nothing that changes the argmax: the tokens equal a plain argmax decode."""
        return self.temperature == 0 and self.repeat_penalty == 1.0 and self.no_repeat_ngram == 0


# What summarize / ask use unless told otherwise: the row of `specache bench task` picked in docs/results.md
# ("Task quality", decoding table). The engine's own GenerationConfig() keeps every processor off.
# no_repeat_ngram 4: in bench-results/task.md it removed the one repeated 6-gram (greedy specache), left the
# full cache's summary unchanged and agreed best with it; repeat_penalty 1.3 rewrote the full cache's summary.
DECODING_DEFAULTS = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repeat_penalty": 1.0,
                     "no_repeat_ngram": 4}


def settings(config: type | None = None) -> dict[str, Setting]:
    """The declared settings of a cache config class (CacheConfig), by field name, in field order; each
    with its flag filled in (--name with dashes unless it names one)."""
    out = {}
    for f in fields(config or CacheConfig):
        declared = f.metadata.get("setting")
        if declared is not None:
            out[f.name] = declared if declared.flag else replace(declared, flag="--" + f.name.replace("_", "-"))
    return out
