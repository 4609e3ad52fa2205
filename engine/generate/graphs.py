"""One-token decode passes recorded once and replayed (CUDA graphs, as gpt-fast, vLLM and SGLang decode):
on a GPU a decode step of ~1,500 small kernels is bound by the CPU launching them, not by the GPU (the
H200 check: 7 ms of device time in a 34-80 ms full-cache step). A replay launches the whole pass at once.

A pass can be replayed when it reads positions and lengths only from device tensors (Step.fixed: the
cache writes at step.positions() and attends over its whole preallocated length with a mask), and every
layer of the cache decodes such passes (KVCache.capturable: full, and the guided caches in the CUDA layout
with the current prefetch; a watched layer keeps its queries and its guide check runs after the replay). Per batch size, the
first pass is run eagerly to warm up, then recorded with static input ids; each later pass copies its ids
in, does the cache's host bookkeeping (begin, then commit: the device lengths advance outside the graph),
replays, and hands out a copy of the logits. On by default where the device's backend declares it in the
backends' table (Kernels.graph_replay: the CUDA backend's); `SPECACHE_CUDA_GRAPHS=1` / `0` turns it on / off.
A recording that fails falls back to eager passes for the rest of the run: one note on stderr, and `graphs`
in the cache's --json stats
(`replayed`, or the fallback and its error). The recording is the cache's streams' (engine.backends.streams:
CUDA graphs on CUDA; in the tests, the streams' stand-in on the CPU, or an eager recorder, eager_graph)."""
from __future__ import annotations

import functools
import sys
from typing import Callable

import torch

from engine.backends.kernels import replays_graphs
from engine.backends.streams import Streams
from engine.generate.forward import PassOptions
from engine.kvcache import KVCache


def graphs_wanted(cache: KVCache) -> bool:
    """Replay decode passes as graphs: on for the cache's device type (engine.backends.kernels.replays_graphs: the
    table's declaration, on for CUDA, or SPECACHE_CUDA_GRAPHS), on a device whose streams record graphs, every
    layer capturable."""
    transfer = cache.transfer
    return replays_graphs(transfer.device.type) and transfer.streams.records_graphs and cache.capturable


def record_graph(streams: Streams, run: Callable[[], torch.Tensor]):
    """Warm `run` up on a side stream, then record it (Streams.capture). -> (graph, its output tensor)."""
    side = streams.stream()
    side.wait_stream(streams.current_stream())
    streams.launch(side, run)
    streams.current_stream().wait_stream(side)
    return streams.capture(run)


class EagerGraph:
    """The recorder's stand-in without CUDA: replay() runs the pass again into the same output tensor."""

    def __init__(self, run: Callable[[], torch.Tensor], out: torch.Tensor):
        self.run, self.out = run, out

    def replay(self) -> None:
        self.out.copy_(self.run())


def eager_graph(run: Callable[[], torch.Tensor]):
    out = run()
    return EagerGraph(run, out), out


class DecodeGraphs:
    """forward(model, cache, ids [n, T], rows [0, n), keep, select, logits_to_keep) for the step loops (plain_steps:
    one token; speculative_steps: the output token and the speculative one, keep 1, select 1), replayed
    from one recorded pass per (n, T, keep, select, logits_to_keep)."""

    def __init__(self, model, cache: KVCache, forward, record=None):
        self.model, self.cache, self.forward = model, cache, forward
        self.record = record or functools.partial(record_graph, cache.transfer.streams)
        self.graphs: dict[tuple, tuple[object, torch.Tensor, torch.Tensor]] = {}  # key -> (graph, static ids, logits)
        self.failed: str | None = None  # why a recording failed: every pass eager from then on

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, keep: int | None = None, select: int | None = None,
                 logits_to_keep: int = 1) -> torch.Tensor:
        """ids [n, T] -> logits [n, logits_to_keep, V] (a copy), the pass committed like forward's."""
        n, t = ids.shape
        rows = slice(0, n)
        if not self.cache.capturable or self.failed:  # a guide watch that fired (its layers attend exactly), a
            return self.forward(self.model, self.cache, ids, rows,  # recording that failed: eagerly
                                how=PassOptions(keep=keep, select=select, logits_to_keep=logits_to_keep))
        key = (n, t, keep, select, logits_to_keep)

        def prepare() -> None:  # host bookkeeping of the pass the recording or the replay runs
            self.cache.begin(rows, t, keep, select, fixed=True)
            self.cache.before_fixed_pass()

        if key not in self.graphs:
            prepare()  # (the recording runs the pass once: on CUDA to warm up, on a side stream)
            static = ids.clone()

            def run() -> torch.Tensor:
                out = self.forward(self.model, self.cache, static, rows, how=PassOptions(
                    keep=keep, select=select, logits_to_keep=logits_to_keep, fixed=True, commit=False))
                self.cache.join()  # (a recording may not end with work on another stream)
                return out

            try:
                self.graphs[key] = (*self.record(run), static)
            except Exception as exc:  # noqa: BLE001  (any failure to record: the eager pass is always right)
                self.fall_back(exc)
                return self(ids, keep, select, logits_to_keep)
            self.cache.decode_stats["graphs"] = "replayed"
        graph, out, static = self.graphs[key]
        static.copy_(ids)
        prepare()
        graph.replay()
        if self.cache.watch is not None:  # the guide check of the pass, on the queries it kept
            self.cache.watch.after_fixed_pass(rows)
        self.cache.commit()
        return out.clone()

    def fall_back(self, exc: Exception) -> None:
        """A recording failed: say so once (stderr, the cache's stats), drop the pass begun and what it left
        on the side streams; every pass is eager from here on."""
        self.failed = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
        print(f"specache: note: recording a decode pass as a CUDA graph failed ({self.failed}); decoding eagerly",
              file=sys.stderr, flush=True)
        self.cache.decode_stats["graphs"] = {"replayed": False, "fallback": "eager", "error": self.failed}
        self.cache.step = None
        self.cache.transfer.streams.synchronize()
