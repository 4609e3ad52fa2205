"""The kernels of a decode step, for the planner's roofline: launches per layer and per step of each mode, as
engine.backends.costs counts them on the CPU through the CUDA stand-in (tests/test_cost_model.py counts them
and fails where these figures and the count part), and the time their launches add to a step.

A GPU step is not only bandwidth: every kernel launched costs the device a gap of its own (a replayed CUDA
graph's launch, ~2-4 us; an eager launch, more, unless the host runs ahead). The planner adds launches x
KERNEL_LAUNCH_SECONDS to the roofline step: an assumption, named here once, to be measured on a GPU
(scripts/gpu_check.py prints the planner's prediction beside each measured step)."""
from __future__ import annotations

from engine.kvcache.policies.exact import expected_tokens

KERNEL_LAUNCH_SECONDS = 3e-6  # device time per kernel of a decode step: an assumption, to be measured on a GPU

# launches per layer per decode step of the torch decode (what runs on CUDA; the engine's Llama layer: its
# linears, norms, rotary embedding and the cache's attention), and outside the layers (embedding, final norm,
# lm_head, the output token), counted under the stand-in (tests/test_cost_model.py: steady steps of two rows)
LAUNCHES_PER_LAYER = {"full": 39, "kivi": 77, "window": 54, "specache-current": 103, "specache-speculative": 147}
LAUNCHES_PER_STEP = {"full": 28, "kivi": 20, "window": 20, "specache-current": 20, "specache-speculative": 22}


def counted_mode(mode: str, speculative: bool) -> str:
    """The counted mode a planned column's step runs: specache under its prefetch; exact drafts as specache
    current (a draft step fetches its own set) and verifies as full (kernel_launches_per_token)."""
    if mode in ("specache", "exact"):
        return "specache-speculative" if speculative and mode == "specache" else "specache-current"
    return mode


def kernel_launches(mode: str, layers: int) -> int:
    """Kernels one decode step of a counted mode launches in a model of `layers` layers."""
    return LAUNCHES_PER_LAYER[mode] * layers + LAUNCHES_PER_STEP[mode]


def exact_launches_per_token(layers: int, gamma: int, acceptance: float) -> float:
    """Exact mode's kernels per output token of a row: gamma draft steps and one verification (a full pass)
    per cycle, over the tokens a cycle emits."""
    cycle = gamma * kernel_launches("specache-current", layers) + kernel_launches("full", layers)
    return cycle / expected_tokens(acceptance, gamma)


def launch_seconds(launches: float) -> float:
    """Device time the launches of a step add to its roofline (KERNEL_LAUNCH_SECONDS each)."""
    return launches * KERNEL_LAUNCH_SECONDS
