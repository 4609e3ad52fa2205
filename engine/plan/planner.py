"""Memory and throughput planner: from a hardware profile, a model profile, a context length and the
cache's settings to the largest batch, the fetch size k and a roofline estimate of a decode step, for
the full cache, KIVI (guide + residual window only), SpeCache and exact mode (SpeCache drafts, the
exact store verifies). Every formula and constant is explained in docs/planner.md.

The modes are the registered cache policies (engine/kvcache/registry.py) that have a column
(plan_columns). A column's memory is its policy's own rule (`plan_sizing`, a classmethod in the
policy's module on engine.kvcache.sizes' shared terms); its time is the roofline (roofline.py) of
what the sizing reads, with the policy's declarations: `speculates` (two tokens a step, a prefetch
that can hide) and `verifies` (draft-and-verify cycles).

Public entry points:
    plan(hardware, model, context, cache) -> Plan                # every column, for `specache plan`
    plan_for_run(model, context, policy, cache) -> ModePlan      # --batch auto
    check_fits_before_load(...)                                  # a run's settings, before the load
    detect_hardware() -> HardwareProfile                         # this machine (CUDA, else CPU)
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from engine.config import CacheConfig
from engine.errors import BadArgument, DoesNotFit
from engine.kvcache.registry import POLICIES
from engine.kvcache.sizes import PlanTerms, Sizing
from engine.machine import host_usable_bytes
from engine.plan.hardware import detect_hardware
from engine.plan.profiles import HardwareProfile, ModelProfile, model_profile_from_config, profile_defaults
from engine.plan.result import ModePlan, Plan
from engine.plan.step_costs import launch_seconds, launches_per_token
from engine.plan.roofline import (
    EXACT_ACCEPTANCE,
    GIB,
    device_budget_bytes,
    exact_cycle,
    max_batch,
    max_hidden_k,
    step_parts,
    weight_bytes,
)

REFERENCES = ("engine", "paper")


def plan_columns() -> dict[str, type]:
    """The policies `specache plan` gives a column (every registered one with plan_column; window is
    sized as kivi), by what each adds to an exact cache: nothing (full), a guide (kivi), a fetched set
    (specache), an exact verification (exact); among equals in the registry's order."""
    columns = [(name, cls) for name, cls in POLICIES.items() if cls.plan_column]
    return dict(sorted(columns, key=lambda item: (item[1].guided, item[1].fetches, item[1].verifies)))


def speculative(cls: type) -> bool:
    """The policy feeds two tokens a step and fetches the next step's set behind it, under the
    speculative prefetch (the method's, which the planner models; docs/planner.md)."""
    return cls.speculates(CacheConfig(mode=cls.policy, k=1, prefetch="speculative"))


def cache_for(model: ModelProfile, hardware: HardwareProfile, **given) -> CacheConfig:
    """The cache settings of a plan: those given, the others by their default rule (the model
    profile's bits, group and k for the device's prefetch: engine.plan.profiles.profile_defaults)."""
    defaults = profile_defaults(model, hardware.kind, given.get("prefetch"))
    return CacheConfig(**defaults).with_overrides(**given)


def check_plan(context: int, host_ram_bytes: int | None = None, batch_limit: int | None = None,
               reference: str = "engine") -> None:
    """Raise BadArgument on a plan's own setting it cannot plan for (the cache's are CacheConfig's)."""
    if context < 1:
        raise BadArgument(f"--context must be >= 1 token, not {context}")
    if host_ram_bytes is not None and host_ram_bytes <= 0:
        raise BadArgument(f"--host-ram must be > 0, not {host_ram_bytes / GIB:g} GB")
    if batch_limit is not None and batch_limit < 1:
        raise BadArgument(f"batch limit must be >= 1, not {batch_limit}")
    if reference not in REFERENCES:
        raise BadArgument(f"--reference must be one of {', '.join(REFERENCES)}, not {reference!r}")


def plan(hardware: HardwareProfile, model: ModelProfile, context: int, cache: CacheConfig | None = None, *,
         host_ram_bytes: int | None = None, batch_limit: int | None = None, reference: str = "engine",
         element_bytes: int | None = None) -> Plan:
    """Plan every column for `context` tokens per sequence with the cache settings `cache` (default:
    cache_for the model on this hardware; its mode is not read: every column is planned).

    host_ram_bytes defaults to the RAM detected with the hardware (None: the host check is skipped).
    reference "engine" models this project's engine: rows prefilled one at a time in chunks, so
    prefill activations are paid once. "paper" models the paper's throughput setup: the whole batch
    is prefilled together, the full cache in one forward with fp16 + fp32 logits of every position
    (transformers before 4.45), the guided caches in chunks; prefill activations are paid per sequence.
    """
    cache = cache or cache_for(model, hardware)
    host_ram_bytes = hardware.host_ram_bytes if host_ram_bytes is None else host_ram_bytes
    check_plan(context, host_ram_bytes, batch_limit, reference)
    eb = element_bytes or hardware.element_bytes
    notes: list[str] = []
    if context > model.max_context:
        notes.append(f"context {context} exceeds {model.display_name}'s maximum of {model.max_context} tokens")
    cache = replace(cache, k=cache.fetch_k(context), k_grows=False)  # (a default k grows: at 1 bit, with the context)
    if cache.k > context:
        notes.append(f"k = {cache.k} exceeds the context; every position is fetched (k = {context})")
    cache = replace(cache, k=min(cache.k, context), outliers=cache.guide_outliers)
    budget = device_budget_bytes(hardware)
    available = budget - weight_bytes(model, eb)
    if hardware.unified_memory:
        host_ram_bytes = None  # the exact store lives in the same RAM: counted on the device side
    streams = hardware.kind == "cuda" and not hardware.unified_memory
    modes = []
    for policy in plan_columns().values():
        column = replace(cache, mode=policy.policy, k=cache.k if policy.fetches else 0)
        terms = PlanTerms(model, context, column, eb, reference == "paper", hardware.unified_memory, streams)
        modes.append(_plan_mode(policy, hardware, terms, policy.plan_sizing(terms), available, host_ram_bytes,
                                batch_limit))
    full_tps = modes[0].tokens_per_second
    modes = [replace(mp, predicted_speedup_vs_full=(mp.tokens_per_second / full_tps) if full_tps > 0 else None)
             for mp in modes]
    notes.extend(_mode_notes(modes, available, model, eb))
    if hardware.kind == "cpu":
        notes.append("CPU step times are a roofline; measured CPU decode is dominated by per-layer framework "
                     "overhead (docs/planner.md)")
        notes.append("on a CPU specache runs with --prefetch current by default: the chosen rows are read in place "
                     "from the store, so the transfer row (the speculative prefetch's copy) does not apply")
    return Plan(hardware, model, context, cache, reference, eb, budget, host_ram_bytes, tuple(modes), tuple(notes))


def _plan_mode(policy: type, hw: HardwareProfile, t: PlanTerms, s: Sizing, available: int,
               host_ram_bytes: int | None, batch_limit: int | None) -> ModePlan:
    """One column at the largest batch its memory allows."""
    m, k, context, eb = t.model, t.cache.k, t.context, t.element_bytes
    by_device, per_seq = max_batch(s, max(available, 0))
    by_host = None
    if host_ram_bytes is not None and s.host_per_sequence > 0:
        by_host = host_usable_bytes(host_ram_bytes) // s.host_per_sequence
    limits = {"device": by_device, "host": by_host, "batch_limit": batch_limit}
    limited_by, batch = min(((key, v) for key, v in limits.items() if v is not None), key=lambda kv: kv[1])
    at = max(batch, 1)
    transfer, transfer_s, compute_s = step_parts(hw, m, s, at, k, context, eb)
    step_s = max(compute_s, transfer_s)
    exact = {}
    if policy.verifies:  # per output token of a row; the transfer is one verification's
        gamma, transfer, draft_s, verify_s, step_s = exact_cycle(hw, m, s, at, k, context, eb)
        transfer_s = transfer / (hw.h2d_gbps * 1e9) if transfer else 0.0
        compute_s = step_s
        exact = {"gamma": gamma, "acceptance": EXACT_ACCEPTANCE, "verify_seconds": verify_s,
                 "draft_seconds": draft_s}
    kernels = None  # a GPU's kernels (a CPU runs the fused native decode: step_costs counts the torch one)
    if hw.kind != "cpu":  # (the speculative prefetch where the policy has it, no corrected set: the roofline's step,
        # the fused Triton decode's kernels)
        column = replace(t.cache, prefetch="speculative", correct=False) if speculative(policy) else t.cache
        kernels = launches_per_token(policy, column, m.layers, exact.get("gamma", 0), EXACT_ACCEPTANCE)
    breakdown = {**s.state, "decode_working_set": s.decode_working_set}
    shared = {"weights": weight_bytes(m, eb)}
    (breakdown if s.prefill_per_sequence else shared)["prefill_activations"] = s.prefill_bytes
    guided = policy.guided
    return ModePlan(
        mode=policy.policy, max_batch=batch, limited_by=limited_by, max_batch_device=by_device, max_batch_host=by_host,
        k=k, bits=t.cache.bits if guided else None, group=t.cache.group if guided else None,
        device_bytes_per_sequence=per_seq, device_breakdown=breakdown, shared_device_bytes=shared,
        host_bytes_per_sequence=s.host_per_sequence, transfer_bytes_per_step=transfer,
        transfer_seconds_per_step=transfer_s, compute_seconds_per_step=compute_s, step_seconds=step_s,
        kernels_per_step=kernels, predicted_step_seconds=None if kernels is None else step_s + launch_seconds(kernels),
        prefetch_hidden=transfer_s <= compute_s, tokens_per_second=batch / step_s,
        predicted_speedup_vs_full=None,
        k_max_hidden=max_hidden_k(hw, m, s, at, k, context, eb) if speculative(policy) else None, **exact)


def _mode_notes(modes: list[ModePlan], available: int, m: ModelProfile, eb: int) -> list[str]:
    notes = []
    if available <= 0:
        notes.append(f"the weights alone ({weight_bytes(m, eb) / GIB:.1f} GiB) do not fit on the device")
    for mp in modes:
        if not mp.fits:
            notes.append(f"{mp.mode}: not even one sequence fits ({mp.device_bytes_per_sequence / GIB:.2f} GiB "
                         f"per sequence on the device)")
        elif mp.limited_by == "host":
            notes.append(f"{mp.mode}: host RAM for the exact store limits the batch to {mp.max_batch} "
                         f"(the device alone would fit {mp.max_batch_device})")
        if mp.k_max_hidden is not None and mp.fits and not mp.prefetch_hidden:  # a prefetch that could hide
            notes.append(f"{mp.mode}: the prefetch ({mp.transfer_seconds_per_step * 1e3:.1f} ms) does not hide "
                         f"behind the step ({mp.compute_seconds_per_step * 1e3:.1f} ms); k <= {mp.k_max_hidden} would")
    if modes[0].max_batch == 0:
        notes.append("full cache does not fit: no speedup ratio against it")
    return notes


# --- for the engine: --batch auto, and the check before a model is loaded ---------------------------

def plan_for_run(model: Any, context: int, policy: type, cache: CacheConfig | None = None, *,
                 batch_limit: int | None = None, hardware: HardwareProfile | None = None,
                 weights_resident: bool = False, element_bytes: int | None = None) -> ModePlan:
    """The batch size for a run of `policy` (its layer class) with the settings `cache`: the returned
    ModePlan's max_batch, from the column the policy is sized by (its plan_mode).

    model: a ModelProfile (with the weights as held, when known), a transformers PretrainedConfig or a
    config dict. context: tokens per sequence (prompt + generated). hardware: default detect_hardware().
    weights_resident: the model is already loaded on this device, so the detected free memory already
    excludes the weights. Raises DoesNotFit when not even one sequence fits.
    """
    if policy.plan_mode not in plan_columns():
        raise BadArgument(f"the planner knows cache modes {', '.join(plan_columns())}, not {policy.plan_mode!r}")
    model = model if isinstance(model, ModelProfile) else model_profile_from_config(model)
    hw = hardware or detect_hardware()
    eb = element_bytes or hw.element_bytes
    if weights_resident and hw.free_memory_bytes is not None:
        free = min(hw.device_memory_bytes, hw.free_memory_bytes + weight_bytes(model, eb))
        hw = replace(hw, free_memory_bytes=free)
    result = plan(hw, model, context, cache, batch_limit=batch_limit, element_bytes=eb).mode(policy.plan_mode)
    if not result.fits:
        raise DoesNotFit(f"{policy.plan_mode} cache: one sequence of {context} tokens needs "
                         f"{result.device_bytes_per_sequence / GIB:.2f} GiB on {hw.display_name} "
                         f"beyond the weights, more than is free")
    return result


def check_fits_before_load(model_config: Any, weight_bytes_held: int, context: int, policy: type,
                           given: dict | None = None, *, hardware: HardwareProfile | None = None,
                           name: str = "the model") -> None:
    """Before a model is loaded: refuse (DoesNotFit, one line) when its weights as they will be held plus
    one sequence's cache of `context` tokens, with the settings `given` (the others by their default
    rule), do not fit in this device's usable memory."""
    model = replace(model_profile_from_config(model_config), held_weight_bytes=weight_bytes_held)
    hw = hardware or detect_hardware(measure=False)
    p = plan(hw, model, context, cache_for(model, hw, **(given or {})), batch_limit=1)
    budget, per_seq = p.device_budget_bytes, p.mode(policy.plan_mode).device_bytes_per_sequence
    if weight_bytes_held + per_seq > budget:
        raise DoesNotFit(f"{name} does not fit: its weights take {weight_bytes_held / GIB:.2f} GiB as held and one "
                         f"sequence of {context} tokens {per_seq / GIB:.2f} GiB of cache and activations, "
                         f"{(weight_bytes_held + per_seq) / GIB:.2f} GiB in all; {hw.display_name} has "
                         f"{max(budget, 0) / GIB:.2f} GiB usable now")
