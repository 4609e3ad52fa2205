"""The kernels of a decode step, for the planner's roofline: each policy declares the kernels a steady step of it
launches on CUDA (CacheLayer.decode_launches / step_launches: per layer and outside the layers, as
engine.backends.costs counts them on the CPU through the CUDA stand-in; tests/test_cost_model.py counts them and
fails where a declaration and the count part), and the time their launches add to a step.

A GPU step is not only bandwidth: every kernel launched costs the device a gap of its own (a replayed CUDA
graph's launch, ~2-4 us; an eager launch, more, unless the host runs ahead). The planner adds launches x
KERNEL_LAUNCH_SECONDS to the roofline step: an assumption, named here once, to be measured on a GPU
(scripts/gpu_check.py times the steps the planner predicts)."""
from __future__ import annotations

from dataclasses import replace

from engine.config import CacheConfig
from engine.kvcache.policies.exact import expected_tokens

KERNEL_LAUNCH_SECONDS = 3e-6  # device time per kernel of a decode step: an assumption, to be measured on a GPU


def kernel_launches(policy: type, config: CacheConfig, layers: int) -> int:
    """Kernels one steady decode step of `policy` under `config` launches in a model of `layers` layers."""
    per_layer, outside = policy.step_launches(config)
    return per_layer * layers + outside


def launches_per_token(policy: type, config: CacheConfig, layers: int, gamma: int = 0,
                       acceptance: float = 0.0) -> float:
    """Kernels per output token of a row: a step's; for a policy that verifies, a cycle's (gamma draft steps,
    each picking its own set, and one verification) over the tokens a cycle emits."""
    if not policy.verifies:
        return kernel_launches(policy, config, layers)
    per_layer, outside = policy.verify_launches
    cycle = gamma * kernel_launches(policy, replace(config, prefetch="current"), layers) + per_layer * layers + outside
    return cycle / expected_tokens(acceptance, gamma)


def launch_seconds(launches: float) -> float:
    """Device time the launches of a step add to its roofline (KERNEL_LAUNCH_SECONDS each)."""
    return launches * KERNEL_LAUNCH_SECONDS
