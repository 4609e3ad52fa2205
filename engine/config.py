"""Validated configuration dataclasses for the cache engine and for generation."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from engine.errors import BadArgument

SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.manual_seed takes (a negative seed wraps around)
GAMMA_MAX = 16  # exact: most draft tokens per verification
PREFETCH = ("speculative", "current")
GROUPS = (32, 64, 128)  # key quantization groups (tokens); values use gcd(group, head_dim) channels (sizes.value_group)
OUTLIERS_MAX = 16  # outlier key channels per KV head at most (engine/kvcache/outliers.py)
ROTATIONS = ("none", "hadamard", "auto")  # engine/kvcache/rotation.py (which checks it is the same list)
# per guide bits, from `specache bench fidelity` on the three shipped documents (README, Results): Hadamard
# took 1 bit from 0.952 / 0.0168 (top-1 / KL) to 0.981 / 0.0018 and 2 bits at k 128 from 0.974 / 0.0034 to
# 0.978 / 0.0009 (at k 512 0.997 / 0.0004 -> 0.992 / 0.0001: one token in 242, KL 4x lower)
# since issue 38 "auto": the Hadamard per layer unless it measurably errs far more than none on the layer's first
# keys and values (engine/kvcache/rotation.py: Gemma 3's global layers; SmolLM2 and Qwen2 keep it on every layer)
DEFAULT_ROTATION = {1: "auto", 2: "auto"}
# outlier key channels per guide bits, from the same bench (bench-results/fidelity-2bit-k512-outliers.md,
# fidelity-2bit-k128-outliers.md): 2 bits with 2 took k 512 from 0.992 / 9.0e-5 to 0.997 / 8.8e-5 and k 128 (the
# CPU default) from 0.978 / 0.0009 to 0.997 / 0.0008, for ~1% more device bytes; 1 bit with 4 helped at k 512
# (0.981 / 0.0018 -> 0.987 / 0.0015, +2% bytes) but not at k 128 (0.956 / 0.0089 -> 0.952 / 0.0075), so 0
DEFAULT_OUTLIERS = {1: 0, 2: 2}


def outliers_for(bits: int, outliers: int | None) -> int:
    """The outlier key channels a guide of `bits` keeps: `outliers`, else the bits' default (0 for bits that
    have none: a bad --bits is refused by whoever checks it)."""
    return outliers if outliers is not None else DEFAULT_OUTLIERS.get(bits, 0)


@dataclass(frozen=True)
class CacheConfig:
    """How the KV cache is kept.

    mode: the name of a registered cache policy (engine/kvcache/registry.py, the one list of them:
    full, specache, kivi, window, exact, ...). This module sits below the caches, so it cannot check
    the name; `engine.kvcache.registry.policy` does, wherever a mode is turned into a cache, a plan or
    a run (make_cache, the planner, the CLI's flag check, the bench's mode labels).
    """

    mode: str = "specache"
    bits: int = 2  # guide code width
    group: int = 64  # quantization group size g
    k: int = 256  # exact positions fetched per layer per KV head per step
    residual: int = 64  # newest R tokens kept exact on the device
    sinks: int = 4  # first S tokens kept exact on the device
    window: int | None = None  # window mode: exact recent tokens (None: same device bytes as specache)
    chunk_size: int = 512  # prefill chunk, tokens
    measure_hits: bool = False  # specache: measure the prefetch hit rate (costs a full attention per step)
    select_both: bool = False  # specache: select with the output token's attention as well as the speculative one's
    resync: bool = True  # specache: after a missed speculation, guess the next token by prompt lookup
    # specache: speculative = the design's two tokens per step, the next step's set picked by the
    # speculative token; current = one token per step that picks its own set from its guide
    # attention, then attends (the paper's non-speculative baseline: no transfer to hide on a CPU)
    prefetch: str = "speculative"
    # specache, speculative: the output token ranks the guide with its own queries before it attends (as
    # "current" does); the prefetched set keeps the positions it holds, the rest are fetched then (a
    # synchronous fetch of what the speculation missed). False: the paper's set, chosen by the guess alone
    correct: bool = True
    gamma: int | None = None  # exact: draft tokens per verification (None: adapted to the measured acceptance)
    # the guide's orthogonal transform (engine/kvcache/rotation.py): none or hadamard; None: the
    # default for the bits (DEFAULT_ROTATION, chosen from `bench fidelity`; guide_rotation reads it)
    rotation: str | None = None
    # outlier key channels per KV head held at 4 bits beside the guide (engine/kvcache/outliers.py),
    # taken out of the keys before the rotation and the 1/2-bit quantizer see them; None: the default for
    # the bits (DEFAULT_OUTLIERS; guide_outliers reads it)
    outliers: int | None = None

    def __post_init__(self) -> None:
        if self.prefetch not in PREFETCH:
            raise BadArgument(f"--prefetch must be one of {', '.join(PREFETCH)}, not {self.prefetch!r}")
        if self.bits not in (1, 2):
            raise BadArgument(f"--bits must be 1 or 2, not {self.bits}")
        if self.group not in GROUPS:
            raise BadArgument(f"--group must be one of {', '.join(map(str, GROUPS))}, not {self.group}")
        if self.outliers is not None and not 0 <= self.outliers <= OUTLIERS_MAX:
            raise BadArgument(f"--outliers must be in 0..{OUTLIERS_MAX}, not {self.outliers}")
        if self.k < 0:
            raise BadArgument(f"--k must be >= 0, not {self.k}")
        if self.residual < 1:
            raise BadArgument(f"--residual must be >= 1, not {self.residual}")
        if self.sinks < 0:
            raise BadArgument(f"--sinks must be >= 0, not {self.sinks}")
        if self.window is not None and self.window < 1:
            raise BadArgument(f"--window must be >= 1, not {self.window}")
        if self.gamma is not None and not 1 <= self.gamma <= GAMMA_MAX:
            raise BadArgument(f"--gamma must be in 1..{GAMMA_MAX}, not {self.gamma}")
        if self.rotation is not None and self.rotation not in ROTATIONS:
            raise BadArgument(f"--rotation must be one of {', '.join(ROTATIONS)}, not {self.rotation!r}")
        if self.chunk_size < 16:
            raise BadArgument(f"--chunk-size must be >= 16, not {self.chunk_size}")

    @property
    def guide_rotation(self) -> str:
        """The guide's rotation: the one set, else the default for the bits."""
        return self.rotation if self.rotation is not None else DEFAULT_ROTATION[self.bits]

    @property
    def guide_outliers(self) -> int:
        """The guide's outlier key channels: the number set, else the default for the bits."""
        return outliers_for(self.bits, self.outliers)

    def with_overrides(self, **overrides) -> "CacheConfig":
        """A copy with the given fields replaced (None values are ignored)."""
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


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


# What summarize / ask use unless told otherwise: the row of `specache bench task` picked in the README
# ("Results", decoding table). The engine's own GenerationConfig() keeps every processor off.
# no_repeat_ngram 4: in bench-results/task.md it removed the one repeated 6-gram (greedy specache), left the
# full cache's summary unchanged and agreed best with it; repeat_penalty 1.3 rewrote the full cache's summary.
DECODING_DEFAULTS = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repeat_penalty": 1.0,
                     "no_repeat_ngram": 4}
