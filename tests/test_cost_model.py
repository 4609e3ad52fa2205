"""The device-free cost model (engine/backends/costs.py): what a steady decode step asks of a GPU, counted on the
CPU through CUDA's orchestration (the stand-in's streams, the cache in the GPU's layout, the torch decode and
linears: what runs on CUDA), held to budgets per mode, and the planner's kernels per step
(engine/plan/step_costs.py) the same as counted.

What counts (costs.py's docstring): a launch is a dispatched op that computes or copies (views and
allocations launch nothing); device bytes are each launch's tensors' bytes; PCIe bytes are copies between the
pinned host memory the stand-in knows (the exact store, the pinned buffers) and the rest, and reads of host
memory by a kernel; host syncs are values read on the host and host waits on the device.

Budgets, per steady step of two rows (prompts 150 and 190: no quantization boundary moves in the steps):
  - launches per layer and outside the layers: exactly the planner's figures (step_costs.LAUNCHES_*), so the
    planner's kernels per step are the counted ones, and a change that adds kernels to a layer must raise
    its mode's figure there, knowingly;
  - device bytes: between BYTES_FACTOR's bounds times the planner's roofline read for the same shape (the
    torch decode moves the guide's dequantized copy and fp32 scores: more than the roofline's minimum);
  - PCIe bytes (specache): k rows x KV heads x head dim x element bytes x 2 (K and V) x layers x rows, within
    PCIE_FACTOR (the indices, and the speculative mode's corrected set read again from the store, on top);
    none in the other modes;
  - host syncs: one per step (the output tokens), whatever the number of layers."""
from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch

import engine.kvcache
import engine.kvcache.guided
from engine.backends import kernels as backend_table
from engine.backends import triton_decode, triton_guide
from engine.backends.costs import CostCounter, Counts, host_memory
from engine.backends.streams import StandinStreams
from engine.backends.triton_cuda import TritonCUDA
from engine.config import CacheConfig
from engine.generate.engine import Engine
from engine.generate.steps import greedy
from engine.kvcache.fused import fused_applies
from engine.kvcache.registry import POLICIES
from engine.kvcache.sizes import PlanTerms
from engine.kvcache.transfer import Transfer
from engine.native import calibrate
from engine.plan import step_costs
from engine.plan.profiles import model_profile_from_config
from engine.plan.roofline import step_read_bytes, weight_bytes
from tests.conftest import cuda_layout, make_tiny_model

GUIDED = {"group": 32, "residual": 16, "sinks": 4, "chunk_size": 64}
CONFIGS = {
    "full": CacheConfig(mode="full"),
    "kivi": CacheConfig(mode="kivi", **GUIDED),
    "window": CacheConfig(mode="window", **GUIDED),
    "specache-current": CacheConfig(mode="specache", k=16, prefetch="current", **GUIDED),
    "specache-speculative": CacheConfig(mode="specache", k=16, prefetch="speculative", **GUIDED),
}
PROMPTS = (150, 190)
HOST_SYNCS_PER_STEP = 1  # the output tokens (the speculative re-sync's vectors read with them)
# device bytes a step moves beyond the weights / the roofline's cache read (batch x read_per_sequence), tiny
# model in fp32: measured 3.3 (full), 3.7 (kivi), 4.4 (window), 4.7 (specache current), 11.1 (speculative: two
# tokens scored against the guide's dequantized copy in fp32, the corrected set), with ~25% margin; a change
# that moves more bytes must raise its mode's bound here, knowingly
BYTES_FACTOR = {"full": (1.0, 4.0), "kivi": (1.0, 4.6), "window": (1.0, 5.5), "specache-current": (1.0, 5.9),
                "specache-speculative": (1.0, 14.0)}
TOTAL_BYTES_FACTOR = 2.0  # all device bytes of a step / the roofline's read (weights and cache): measured 1.2-1.7
PCIE_FACTOR = (1.0, 2.0)  # counted PCIe bytes / the method's k rows per step (specache)
# the fused Triton decode (speculative, the corrected set off: what it implements): its kernels per layer (split,
# merge, select, top-k, the new K/V's write), and the launches a layer's step may take beyond full's: measured 2 (a
# layer of 41: the model's 33, the 5 kernels, the prefetch's 3 copies: the positions to the host, the worker's K
# and V; full's layer: the model's 33 and 6 of its cache); it was 33 beyond full (72 a layer) with the selection's
# top-k, the fetched-position map, the rotation and the residual writes run as torch ops around the kernels
FUSED_KERNELS_PER_LAYER = 5
FUSED_BEYOND_FULL = 2
STANDIN_BOUND = 20.0  # seconds a stand-in wait may take before it fails (a busy machine)


def count_steps(layers: int, config: CacheConfig, steps: int = 3, fused: bool = False, warm: int = 4) -> list[Counts]:
    """Counts of `steps` decode steps of two rows after `warm` (T1, the pre-decoding pass and two steady steps),
    with their prompts as history (the speculative re-sync on), through the stand-in. fused: guided layers
    decoded by the fused Triton kernels (in Triton's interpreter; each launch counted as one kernel)."""
    made: list[Transfer] = []
    counters: list[CostCounter] = []  # the counter, once counting starts
    with pytest.MonkeyPatch.context() as mp:
        cuda_layout(mp)
        if fused:  # (after cuda_layout, which turns the fused calls off)
            fused_kernels(mp, counters)
        mp.setattr(engine.kvcache, "Transfer", lambda device: made.append(
            Transfer(device, streams=StandinStreams(wait_seconds=STANDIN_BOUND))) or made[-1])
        mp.setattr(triton_guide, "FAILED", {"gather": "off: the worker thread's copies are counted"})
        mp.setattr(calibrate, "use_native", lambda form, rows: False)  # the torch linears, as on CUDA
        model = make_tiny_model(layers=layers)
        eng = Engine(model, config)
        cache = eng.new_cache(len(PROMPTS), 400)
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in PROMPTS]
        last = [list(eng.prefill(cache, p, row))[-1] for row, p in enumerate(prompts)]
        it = eng.steps(cache, torch.stack(last), greedy, history=prompts)
        for _ in range(warm):
            next(it)
        counter = CostCounter(made[0].streams if made else None)
        counters.append(counter)
        counted = []
        for _ in range(steps):
            with counter:
                next(it)
            counted.append(counter.take())
        it.close()
        cache.close()
    return counted


def fused_kernels(mp: pytest.MonkeyPatch, counters: list[CostCounter]) -> None:
    """The fused Triton decode on CPU tensors, each kernel launch counted as one by the counter in `counters`
    once there is one (its interpreter's own torch ops not counted)."""
    real = triton_decode.launch

    def launch(family, kernel, grid, *args, **meta):
        if not counters:
            return real(family, kernel, grid, *args, **meta)
        counters[0].kernel(f"triton-{family}", args)
        with counters[0].paused():
            return real(family, kernel, grid, *args, **meta)

    mp.setenv("SPECACHE_TRITON_DECODE", "1")
    mp.setitem(backend_table._CHOSEN, "cpu", TritonCUDA())  # (the CPU standing in for CUDA)
    mp.setattr(engine.kvcache.guided, "fused_applies", fused_applies)
    mp.setattr(triton_decode, "launch", launch)


@pytest.fixture(scope="module")
def counted() -> dict[tuple[str, int], list[Counts]]:
    return {(mode, layers): count_steps(layers, config) for mode, config in CONFIGS.items() for layers in (1, 3)}


def per_layer(counted, mode: str, what: str) -> float:
    return (getattr(counted[mode, 3][-1], what) - getattr(counted[mode, 1][-1], what)) / 2


@pytest.mark.parametrize("mode", list(CONFIGS))
def test_a_steady_step_launches_the_planners_kernels(counted, mode):
    steps = counted[mode, 3]
    assert steps[1].ops == steps[2].ops  # a steady step: the same kernels, step after step
    layer = per_layer(counted, mode, "launches")
    outside = counted[mode, 1][-1].launches - layer
    policy, config = POLICIES[CONFIGS[mode].mode], CONFIGS[mode]
    assert (layer, outside) == policy.step_launches(config)  # (the planner's: a change must update the policy's)
    assert step_costs.kernel_launches(policy, config, 3) == steps[-1].launches


@pytest.mark.parametrize("mode", list(CONFIGS))
def test_a_step_syncs_the_host_once_whatever_its_layers(counted, mode):
    for layers in (1, 3):
        for c in counted[mode, layers]:
            assert c.host_syncs == HOST_SYNCS_PER_STEP, c.syncs
            assert c.syncs == ["Tensor.tolist"]


@pytest.mark.parametrize("mode", list(CONFIGS))
def test_device_bytes_are_within_a_stated_factor_of_the_roofline(counted, mode):
    config = CONFIGS[mode]
    profile = model_profile_from_config(make_tiny_model(layers=3).config)
    policy = POLICIES[config.mode]
    column = replace(config, k=config.k if policy.fetches else 0)  # (as the planner's column)
    sizing = policy.plan_sizing(PlanTerms(profile, max(PROMPTS), column, 4, False, False, True))
    roofline = step_read_bytes(profile, len(PROMPTS), sizing.read_per_sequence, 4)
    weights = weight_bytes(profile, 4)
    got = counted[mode, 3][-1].device_bytes
    assert 1.0 <= got / roofline <= TOTAL_BYTES_FACTOR, f"{mode}: {got} bytes, the roofline's {roofline}"
    low, high = BYTES_FACTOR[mode]
    ratio = (got - weights) / (roofline - weights)
    assert low <= ratio <= high, f"{mode}: {ratio:.2f}x the roofline's cache read beyond the weights"


@pytest.mark.parametrize("mode", list(CONFIGS))
def test_pcie_bytes_are_the_methods_k_rows(counted, mode):
    config = CONFIGS[mode]
    got = counted[mode, 3][-1].pcie_bytes
    if not POLICIES[config.mode].fetches:
        assert got == 0
        return
    model = make_tiny_model(layers=3).config
    rows = config.k * model.num_key_value_heads * model.head_dim * 4 * 2 * 3 * len(PROMPTS)  # fp32 fetched set
    low, high = PCIE_FACTOR
    assert low <= got / rows <= high, f"{mode}: {got} PCIe bytes per step, the method's {rows}"



def test_a_layer_that_reads_a_value_on_the_host_breaks_the_sync_budget(monkeypatch):
    """What the budget above guards: a host read added to every layer's step is counted once per layer."""
    from engine.kvcache.guided import GuidedLayer

    real = GuidedLayer.attend_decode

    def reading(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        out.sum().item()  # (a per-layer sync, as a branch on a device value would be)
        return out

    monkeypatch.setattr(GuidedLayer, "attend_decode", reading)
    (c,) = count_steps(3, CONFIGS["kivi"], steps=1)
    assert c.host_syncs == HOST_SYNCS_PER_STEP + 3 and c.syncs.count("Tensor.item") == 3


# --- the counter itself ---------------------------------------------------------------------------------------


def test_views_launch_nothing_and_ops_count_their_tensors_bytes():
    x = torch.ones(4, 8)
    with CostCounter() as counter:
        y = x.view(8, 4).t()[1:]  # views
        z = x * 2  # reads 128 bytes, writes 128
        z.add_(1)  # in place: reads and writes z (its output is z itself)
    c = counter.take()
    assert (c.launches, c.device_bytes, c.pcie_bytes, c.host_syncs) == (2, 3 * 128, 0, 0) and y.shape == (3, 8)
    assert dict(c.ops) == {"mul": 1, "add_": 1}
    z * 2  # outside: nothing counted
    assert counter.take().launches == 0


def test_copies_to_and_from_host_memory_cross_pcie_and_host_work_launches_nothing():
    streams = StandinStreams(wait_seconds=1.0)
    staged, other = streams.pinned_zeros((4, 16), torch.float32), streams.pinned_zeros((4, 16), torch.float32)
    device = torch.ones(4, 16)
    store = torch.arange(640, dtype=torch.float32).view(40, 16)
    assert streams.pin(store.data_ptr(), store.numel() * 4)
    with CostCounter(streams) as counter:
        device.copy_(staged, non_blocking=True)  # host -> device: 256 bytes over PCIe, 256 written on the device
        other.copy_(staged)  # host -> host: the host's work
        rows = torch.index_select(store, 0, torch.tensor([3, 7]))  # a kernel reading 2 rows of the mapped store
    c = counter.take()
    assert c.launches == 2 and c.pcie_bytes == 256 + 2 * 64 and dict(c.pcie) == {"copy_": 256, "index_select": 128}
    is_host = host_memory(streams)
    assert is_host(staged[1:]) and is_host(store[5]) and not is_host(device) and rows.shape == (2, 16)
    address = staged.data_ptr()
    del staged
    assert address not in streams.buffers  # (a freed buffer's memory is no longer the host's)


def test_host_syncs_are_value_reads_and_waits_of_the_counting_thread():
    streams = StandinStreams(wait_seconds=1.0)
    side, x = streams.stream(), torch.ones(3)
    ready = streams.event()
    streams.launch(side, lambda: x.add_(1))
    ready.record(side)
    with CostCounter(streams) as counter:
        assert not ready.query()  # a query waits for nothing
        worker = threading.Thread(target=ready.synchronize)  # another thread's wait holds up no step
        worker.start()
        worker.join()
        streams.synchronize()
        x.sum().item()
        x.tolist()
    c = counter.take()
    assert c.syncs == ["synchronize()", "Tensor.item", "Tensor.tolist"] and c.host_syncs == 3
    assert streams.sync_observer is None  # (released with the counter)


@pytest.mark.slow  # (the interpreter: ~30 s of CPU)
def test_the_fused_triton_decode_launches_five_kernels_a_layer_and_few_ops_around_them(counted):
    """The first two-token step after the pre-decoding pass, with one and two layers (the interpreter takes
    seconds a pass): the launches of a layer's step."""
    if not triton_guide.interpreted() or triton_decode.kernels() is None:
        pytest.skip("the fused Triton decode runs on CPU tensors only in Triton's interpreter (TRITON_INTERPRET=1)")
    config = replace(CONFIGS["specache-speculative"], correct=False)
    one, two = (count_steps(n, config, steps=1, fused=True, warm=2)[0] for n in (1, 2))
    assert two.ops["triton-decode"] - one.ops["triton-decode"] == FUSED_KERNELS_PER_LAYER
    layer = two.launches - one.launches
    policy = POLICIES["specache"]
    assert (layer, one.launches - layer) == policy.step_launches(config) == policy.fused_launches  # (the planner's)
    speculative = per_layer(counted, "specache-speculative", "launches")
    assert layer <= POLICIES["full"].decode_launches[0] + FUSED_BEYOND_FULL < speculative, layer
    assert two.host_syncs == HOST_SYNCS_PER_STEP and two.syncs == ["Tensor.tolist"]
