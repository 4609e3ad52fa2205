"""A run that notices when its guide has lost the model (a guide made on one model can rank another's keys
badly: bench-results/fidelity-models.md).

Every EVERY decode passes one specache layer (round robin over the cache's fetching layers) checks
its guide against the exact host store for the output token's own queries: over the guide region
[sinks, qend) of one row of the step (the rows take turns), the exact attention (summed over the query
heads of each KV head) that the guide's top-k positions hold, divided by what the exact top-k would hold (1: the guide
ranks as well as exact keys; the share of a random set is about k / region). The ratio is the same
"coverage of the oracle" `specache bench fidelity` reports, for one layer and one token.

When the mean of a row's last WINDOW checks falls below THRESHOLD the guide is lost: one `warning:`
line on stderr, and from then on every watched layer attends its guide region with the exact keys
and values of the host store instead of the guide (the full cache's attention: slower, not wrong);
`--json` says so (GuideWatch.stats under the cache's "guide_check"). A watch that has fired stays so.

On an asynchronous device (CUDA) the check stays off the step's critical path: the device scores the guide
and picks its top-k, and only the query and those positions are copied to the host (no exact keys cross
the bus, no host sync); the exact scores come from the host store itself, on the watch's own host thread,
once the copies have landed (GuideWatch.collect, at the next pass). Its verdict lands a pass or more later.
"""
from __future__ import annotations

import sys
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable

import torch

from engine.kvcache.passes import soft_cap

if TYPE_CHECKING:
    from engine.kvcache.base import Step

EVERY = 4  # decode passes between two checks (one layer each)
WINDOW = 4  # checks averaged
THRESHOLD = 0.5  # guide top-k's exact mass / exact top-k's mass below this: the guide is lost


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


class GuideWatch:
    """The check's state, shared by the fetching layers of one cache (module docstring)."""

    def __init__(self, layers: list, every: int = EVERY, threshold: float = THRESHOLD, window: int = WINDOW,
                 notify: Callable[[str], None] | None = None):
        self.layers = layers
        self.every, self.threshold, self.window = every, threshold, window
        self.notify = notify or _warn
        self.passes = 0  # decode passes seen (counted at the first layer)
        self.ratios: list[float] = []
        self.by_row: dict[int, list[float]] = {}  # each row's checks: one lost document is enough
        self.lost = False
        self.waiting: deque = deque()  # (row, event, check) of asynchronous checks whose copies may be in flight
        self.running: deque[tuple[int, Future]] = deque()  # (row, check) computing on the host thread
        self._host: ThreadPoolExecutor | None = None

    def due(self, layer) -> bool:
        """Called by each watched layer at each of its decode passes: True when it checks this one."""
        if layer is self.layers[0]:
            self.passes += 1
            self.collect()
        if self.lost or self.passes % self.every:
            return False
        return layer is self.layers[(self.passes // self.every) % len(self.layers)]

    def after_fixed_pass(self, rows: slice) -> None:
        """After a recorded (replayed) pass of `rows`: each layer's turn as a pass of its own would take it
        (GuidedLayer.check_kept: the queries the pass kept)."""
        for layer in self.layers:
            layer.check_kept(rows)

    def defer(self, row: int, event, check: Callable[[], float]) -> None:
        """An asynchronous check: check() computes its ratio on the host once `event` (recorded after the
        copies it reads) has completed."""
        self.waiting.append((row, event, check))

    def collect(self, wait: bool = False) -> None:
        """Record the deferred checks that are done, in order (wait: all of them; never inside a recorded
        pass: an event query is a host call)."""
        while self.waiting and (wait or self.waiting[0][1].query()):
            row, event, check = self.waiting.popleft()
            if wait:
                event.synchronize()
            if self._host is None:
                self._host = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specache-watch")
            self.running.append((row, self._host.submit(check)))
        while self.running and (wait or self.running[0][1].done()):
            row, future = self.running.popleft()
            self.record(future.result(), row)

    def close(self) -> None:
        """Finish the deferred checks and stop the host thread."""
        self.collect(wait=True)
        if self._host is not None:
            self._host.shutdown()
            self._host = None

    def record(self, ratio: float, row: int = 0) -> None:
        """One check's ratio on a row; fires (once) when the mean of that row's last `window` checks is below
        the threshold."""
        self.ratios.append(ratio)
        mine = self.by_row.setdefault(row, [])
        mine.append(ratio)
        recent = mine[-self.window:]
        if not self.lost and len(recent) == self.window and sum(recent) / len(recent) < self.threshold:
            self.lost = True
            self.notify(f"the guide has lost the model (its top-k holds {sum(recent) / len(recent):.2f} of the "
                        f"exact top-k's attention over the last {self.window} checks, below {self.threshold}): "
                        "attending exactly from the host store from here on (slower, the full cache's output)")

    def stats(self) -> dict:
        """For --json: the checks made, their mean and lowest ratio, and whether the watch fired."""
        self.collect(wait=True)
        r = self.ratios
        return {"checks": len(r), "coverage_vs_oracle": round(sum(r) / len(r), 4) if r else None,
                "lowest": round(min(r), 4) if r else None, "lost": self.lost,
                "fallback": "exact" if self.lost else None}


def coverage_ratio(exact: torch.Tensor, guide: torch.Tensor, k: int) -> float:
    """exact, guide: scores [H_kv, G, n] of one token's query heads over a region of n positions (scaled and
    capped as the model does). -> the mean over KV heads of the exact attention mass (each query head's
    softmax over the region, summed over the KV head's query heads) on the guide's top-k positions,
    divided by the mass on the exact top-k."""
    return coverage_of_choice(exact, *guide_choice(guide, k))


def guide_choice(guide: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """guide scores [H_kv, G, n] -> (the guide's top-k positions [H_kv, k], whether it scored every position
    finitely: a guide that scores inf or nan has lost the model), on the guide's device."""
    ranked = torch.softmax(guide.float(), -1).sum(1)
    return ranked.topk(k, -1).indices, torch.isfinite(guide).all()


def coverage_of_choice(exact: torch.Tensor, chosen: torch.Tensor, finite: torch.Tensor) -> float:
    """coverage_ratio from the exact scores [H_kv, G, n] and guide_choice's output."""
    if not bool(finite):
        return 0.0
    mass = torch.softmax(exact.float(), -1).sum(1)  # [H_kv, n]
    best = mass.topk(chosen.shape[-1], -1).values.sum(-1)
    return float((mass.gather(-1, chosen).sum(-1) / best.clamp(min=1e-30)).mean())


class WatchedLayer:
    """A guided layer's part of the watch (GuidedLayer mixes it in; self.watch: the cache's GuideWatch)."""

    def attach_watch(self, watch: GuideWatch) -> None:
        """Watched by the cache's `watch`; the buffer a recorded pass keeps its output-token queries in
        (allocated here, not inside the pass: a recording holds the same ops at every pass)."""
        self.watch = watch
        self.kept_q = torch.empty(self.fidx.shape[0], self.shape.kv_heads, self.shape.group, self.store.k.shape[-1],
                                  dtype=torch.float32, device=self.fidx.device)  # [B, H_kv, G, D]

    def watched(self, qg: torch.Tensor, scaling: float, step: Step, softcap: float | None) -> bool:
        """The watch's part of a decode pass: check the guide when it is this layer's turn; True when the
        watch has found the guide lost (the pass then attends its guide region exactly). A recorded pass
        (Step.fixed) only keeps its queries: the check runs after it (check_kept), on the host."""
        if step.fixed:
            self.kept_q[step.rows].copy_(self.output_queries(qg, step))
            self.kept_args = (scaling, softcap)
            return False
        if self.watch.due(self):
            self.check_guide(self.output_queries(qg, step), scaling, step.rows, softcap)
        return self.watch.lost

    def check_kept(self, rows: slice) -> None:
        """After a recorded pass of `rows`: the check it kept the queries for, when it is this layer's turn."""
        if self.watch.due(self):
            self.check_guide(self.kept_q[rows], *self.kept_args[:1], rows, self.kept_args[1])

    def output_queries(self, qg: torch.Tensor, step: Step) -> torch.Tensor:
        """qg [b, H_kv, G*T, D] -> the output token's queries [b, H_kv, G, D]."""
        b, h, g, t = qg.shape[0], self.shape.kv_heads, self.shape.group, step.n_new
        return qg.reshape(b, h, g, t, -1)[:, :, :, 0]

    def check_guide(self, q0s: torch.Tensor, scaling: float, rows: slice, softcap: float | None) -> None:
        """One check (engine/kvcache/watch.py): the output token's queries q0s [b, H_kv, G, D] of one row of
        `rows` (the rows take turns, check by check: a batch's every document is watched), its guide region
        [sinks, qend) scored by the guide and by the exact store; skipped while k covers the region."""
        i = (self.watch.passes // self.watch.every) % (rows.stop - rows.start)
        row = rows.start + i
        qend = self.qend_host[row]
        if qend - self.sinks <= self.topk:
            return
        q0 = q0s[i : i + 1].float()  # [1, H_kv, G, D]
        guide = soft_cap(self.guide.scores(q0, slice(row, row + 1), qend) * scaling, softcap)[0, ..., self.sinks :]
        chosen, finite = guide_choice(guide, self.topk)
        region = (row, slice(self.sinks, qend), scaling, softcap)
        if not self.store.transfer.asynchronous:
            self.watch.record(coverage_of_choice(self.exact_scores(q0, *region), chosen, finite), row)
            return
        streams = self.store.streams  # CUDA: off the critical path (module docstring)
        q_host, chosen_host, finite_host = (streams.pinned_zeros(t.shape, t.dtype) for t in (q0, chosen, finite))
        for host, t in ((q_host, q0), (chosen_host, chosen), (finite_host, finite)):
            host.copy_(t, non_blocking=True)
        landed = streams.event()
        landed.record()  # (after the store's own copies of the region too: they are queued on this stream)
        self.watch.defer(row, landed, lambda: coverage_of_choice(self.exact_scores(q_host, *region),
                                                                 chosen_host, finite_host))

    def exact_scores(self, q0: torch.Tensor, row: int, region: slice, scaling: float,
                     softcap: float | None) -> torch.Tensor:
        """The output token's exact scores [H_kv, G, n] over `region` of `row`, from the host store's keys
        (on the queries' device)."""
        keys = self.store.k[row : row + 1, :, region].to(q0.device).float()
        return soft_cap((q0 @ keys.transpose(-1, -2)) * scaling, softcap)[0]
