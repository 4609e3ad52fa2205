"""What one decode step asks of the device, recorded on the CPU with the GPU's layout of the cache (the
residual window in buffers of its own, the torch decode path: what runs on CUDA). On a GPU each op is
a kernel launch and each read of a device value on the host a synchronization, and the decode steps
of the H200 check (bench-results/gpu/) are bound by those, not by the GPU's work. So:

- every steady step issues the same program (the same ops in the same order: what replaying a
  recorded step as a CUDA graph needs), the guide watch's check aside (engine/kvcache/watch.py: one layer
  every few passes, on the host);
- a step reads no device value on the host beyond the output tokens (one tolist per step), and, in
  specache with the corrected speculative set on the CPU, one count per layer (how many fetched rows
  missed; an asynchronous device builds the set at fixed size without it: tests/test_cuda_standin.py);
- ops per layer per step stay within a budget per mode (the GPU profile's 1,498 / 6,044 device events
  per step for 32 layers are what these count, here for the tiny model's head dim and group)."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.config import CacheConfig
from engine.generate.engine import Engine
from engine.generate.steps import greedy
from engine.kvcache.watch import WatchedLayer
from tests.conftest import cuda_layout, make_tiny_model

# ops that make views or allocate (no kernel on a GPU); the rest count as launches
NO_LAUNCH = frozenset({"empty", "empty_like", "view", "_unsafe_view", "reshape", "slice", "select", "unsqueeze", "squeeze", "expand", "transpose",
                   "t", "as_strided", "alias", "permute", "detach", "split", "unbind", "narrow", "lift_fresh",
                   "_reshape_alias", "view_as", "expand_as"})
# launching ops per layer per decode step, measured on main (tiny model, torch path) with a margin: a
# change that adds work to every layer's step must raise its mode's figure here, knowingly
BUDGET = {"full": 40, "kivi": 92, "window": 58, "specache-current": 128, "specache-speculative": 186}
CONFIGS = {
    "full": CacheConfig(mode="full"),
    "kivi": CacheConfig(mode="kivi", group=32, residual=16, sinks=4, chunk_size=64),
    "window": CacheConfig(mode="window", group=32, residual=16, sinks=4, chunk_size=64),
    "specache-current": CacheConfig(mode="specache", k=16, group=32, residual=16, sinks=4, chunk_size=64,
                                    prefetch="current"),
    "specache-speculative": CacheConfig(mode="specache", k=16, group=32, residual=16, sinks=4, chunk_size=64,
                                        prefetch="speculative"),
}


class Recorder(TorchDispatchMode):
    """The ops dispatched while active, and the host reads of tensor values (item, tolist); none while
    `aside` (the guide watch's check: one layer every few passes, not part of the step's program)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.aside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.aside:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def watch_aside(monkeypatch, rec: Recorder) -> None:
    """The guide watch's checks run while `rec` records, their ops left out."""
    check = WatchedLayer.check_guide

    def aside(self, *args):
        rec.aside += 1
        try:
            return check(self, *args)
        finally:
            rec.aside -= 1

    monkeypatch.setattr(WatchedLayer, "check_guide", aside)


def record_steps(monkeypatch, layers: int, config: CacheConfig, steps: int = 3) -> list[list[str]]:
    """Ops of `steps` steady decode steps of two rows (prompts 150 and 190: no quantization boundary moves
    in them), the cache laid out as on a GPU and decoded by the torch path; tolist calls recorded as ops."""
    cuda_layout(monkeypatch)
    model = make_tiny_model(layers=layers)
    engine = Engine(model, config)
    cache = engine.new_cache(2, 400)
    gen = torch.Generator().manual_seed(0)
    last = []
    for row, n in enumerate((150, 190)):
        *_, logits = engine.prefill(cache, torch.randint(3, 300, (n,), generator=gen).tolist(), row)
        last.append(logits)
    it = engine.steps(cache, torch.stack(last), greedy)
    for _ in range(4):  # T1, pre-decoding, two steady steps
        next(it)
    recorded = []
    tolist = torch.Tensor.tolist
    for _ in range(steps):
        with Recorder() as rec:
            watch_aside(monkeypatch, rec)
            monkeypatch.setattr(torch.Tensor, "tolist", lambda self: (rec.ops.append("tolist") if not rec.aside
                                                                      else None) or tolist(self))
            next(it)
            monkeypatch.setattr(torch.Tensor, "tolist", tolist)
        recorded.append(rec.ops)
    it.close()
    cache.close()
    return recorded


def launches(ops: list[str]) -> int:
    return sum(op not in NO_LAUNCH and op != "tolist" for op in ops)


@pytest.mark.parametrize("mode", list(CONFIGS))
def test_a_decode_step_is_one_fixed_program_without_host_reads(monkeypatch, mode):
    steps = record_steps(monkeypatch, 3, CONFIGS[mode])
    kernels = [[op for op in ops if op not in NO_LAUNCH] for ops in steps]
    assert kernels[0] == kernels[1] == kernels[2]  # the same ops in the same order, step after step
    counts = Counter(steps[0])
    assert counts["tolist"] == 1  # the output tokens, for the caller
    reads = counts["item"] + counts["_local_scalar_dense"] + counts["is_nonzero"]
    assert reads == (3 if mode == "specache-speculative" else 0)  # the corrected set's missing rows, per layer


@pytest.mark.parametrize("mode", list(CONFIGS))
def test_decode_ops_per_layer_stay_within_the_budget(monkeypatch, mode):
    one = launches(record_steps(monkeypatch, 1, CONFIGS[mode], steps=1)[0])
    three = launches(record_steps(monkeypatch, 3, CONFIGS[mode], steps=1)[0])
    per_layer = (three - one) / 2
    assert 0 < per_layer <= BUDGET[mode], f"{mode}: {per_layer} launching ops per layer per step"
