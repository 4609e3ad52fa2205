"""A run that notices when its guide has lost the model (engine/kvcache/watch.py): quiet on an
intact guide, one warning and the exact store's attention when the guide is made to fail."""
from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig
from engine.generate.engine import Engine
from engine.kvcache import guide as guide_module
from engine.kvcache.watch import GuideWatch, coverage_ratio
from tests.test_engine import prompts_of

FORCED = 24
CONFIG = CacheConfig(mode="specache", bits=2, k=16, group=32, residual=16, prefetch="current")



@pytest.fixture(scope="module")
def reference(tiny_model):
    (prompt,) = prompts_of((300,))
    full = torch.stack(list(Engine(tiny_model, CacheConfig(mode="full")).teacher_forced(prompt, [5] * FORCED)))
    forced = full.argmax(-1).tolist()  # not the greedy chain, but the same tokens for every run
    full = torch.stack(list(Engine(tiny_model, CacheConfig(mode="full")).teacher_forced(prompt, forced)))
    return prompt, forced, full


def watch_stats(model, config, prompt, forced):
    """Run teacher-forced; -> (logits, the cache's guide_check stats)."""
    seen = {}
    real = Engine.new_cache

    def keep(self, *args, **kwargs):
        cache = real(self, *args, **kwargs)
        seen["cache"] = cache
        return cache

    Engine.new_cache = keep
    try:
        logits = torch.stack(list(Engine(model, config).teacher_forced(prompt, forced)))
    finally:
        Engine.new_cache = real
    return logits, seen["cache"].stats()["guide_check"]


@pytest.mark.parametrize("prefetch", ["current", "speculative"])
def test_an_intact_guide_stays_quiet(tiny_model, reference, capsys, prefetch):
    prompt, forced, _ = reference
    _, stats = watch_stats(tiny_model, CacheConfig(**{**CONFIG.__dict__, "prefetch": prefetch}), prompt, forced)
    assert stats["checks"] >= 4 and not stats["lost"] and stats["fallback"] is None
    assert stats["coverage_vs_oracle"] > 0.7
    assert "lost the model" not in capsys.readouterr().err


def test_a_failed_guide_is_noticed_once_and_falls_back_to_exact(tiny_model, reference, capsys, monkeypatch):
    prompt, forced, full = reference
    real_add = guide_module.Guide.add

    def noise(self, row, start, k, v, q=None):  # a guide of keys that have nothing to do with the model's
        real_add(self, row, start, torch.randn_like(k) * 8, v, q)

    monkeypatch.setattr(guide_module.Guide, "add", noise)
    logits, stats = watch_stats(tiny_model, CONFIG, prompt, forced)
    assert stats["lost"] and stats["fallback"] == "exact" and stats["coverage_vs_oracle"] < 0.5
    assert capsys.readouterr().err.count("lost the model") == 1


@pytest.mark.parametrize("prefetch", ["current", "speculative"])
def test_a_lost_guide_attends_exactly(tiny_model, reference, monkeypatch, prefetch):
    """With the watch fired (here before the first decode pass) the guide region is the store's exact K/V:
    the full cache's logits, however bad the guide."""
    prompt, forced, full = reference
    real_add = guide_module.Guide.add
    monkeypatch.setattr(guide_module.Guide, "add", lambda self, row, start, k, v, q=None: real_add(
        self, row, start, torch.randn_like(k) * 8, torch.randn_like(v), q))
    monkeypatch.setattr(GuideWatch, "due", lambda self, layer: setattr(self, "lost", True) or False)
    logits, stats = watch_stats(tiny_model, CacheConfig(**{**CONFIG.__dict__, "prefetch": prefetch}), prompt, forced)
    assert stats["lost"]
    torch.testing.assert_close(logits, full, rtol=1e-3, atol=1e-3)


def test_coverage_ratio_of_guides():
    torch.manual_seed(0)
    exact = torch.randn(2, 3, 200) * 3
    assert coverage_ratio(exact, exact, 10) == pytest.approx(1.0)
    assert coverage_ratio(exact, -exact, 10) < 0.2  # the worst ranking
    assert coverage_ratio(exact, torch.full_like(exact, float("nan")), 10) == 0.0  # non-finite: lost


def test_the_watch_fires_on_the_mean_of_its_window():
    notes = []
    watch = GuideWatch([object()], every=1, threshold=0.5, window=3, notify=notes.append)
    for r in (0.9, 0.1, 0.9, 0.2, 0.3):
        watch.record(r)
    assert watch.lost and len(notes) == 1 and watch.stats()["checks"] == 5
    watch.record(0.0)
    assert len(notes) == 1  # once


def test_every_row_of_a_batch_is_watched(tiny_model, reference, capsys, monkeypatch):
    """Two documents decoded together, the guide ruined for the second only: the rows take turns being
    checked and a row's own checks fire the watch (a first-row-only check, or one mean over the rows,
    would stay quiet)."""
    from engine.config import GenerationConfig
    prompt, _, _ = reference
    real_add = guide_module.Guide.add

    def noise_on_row_1(self, row, start, k, v, q=None):
        real_add(self, row, start, torch.randn_like(k) * 8 if row == 1 else k, v, q)

    monkeypatch.setattr(guide_module.Guide, "add", noise_on_row_1)
    events = list(Engine(tiny_model, CONFIG).generate([prompt, prompt[::-1]], GenerationConfig(max_tokens=36)))
    stats = events[-1].cache_stats["guide_check"]
    assert stats["lost"] and stats["checks"] >= 4
    assert capsys.readouterr().err.count("lost the model") == 1


def test_a_replayed_decode_whose_guide_is_lost_goes_on_exactly(tiny_model, reference, capsys, monkeypatch):
    """Under CUDA-graph replay (the eager stand-in recorder, the CUDA layout): a guide of noise fires the
    watch once, in the check after a replayed pass (the passes up to it are eager decoding's); the passes
    after it run eagerly with the exact store's attention: near the full cache's logits from there (the
    tokens decoded under the noisy guide keep their K/V), far from them before."""
    from engine.kvcache.policies.specache import SpecacheLayer
    from tests.conftest import cuda_layout
    from tests.test_graphs import replaying

    prompt, forced, full = reference
    cuda_layout(monkeypatch)
    monkeypatch.setattr(SpecacheLayer, "watches", True)
    real_add = guide_module.Guide.add
    monkeypatch.setattr(guide_module.Guide, "add", lambda self, row, start, k, v, q=None: real_add(
        self, row, start, torch.randn_like(k) * 8, torch.randn_like(v), q))
    torch.manual_seed(0)
    eager, eager_stats = watch_stats(tiny_model, CONFIG, prompt, forced)
    replaying(monkeypatch)
    torch.manual_seed(0)
    logits, stats = watch_stats(tiny_model, CONFIG, prompt, forced)
    assert stats["lost"] and capsys.readouterr().err.count("lost the model") == 2  # (once per run)
    assert stats["checks"] == eager_stats["checks"]
    fired = GuideWatch([None]).every * stats["checks"]  # the decode pass whose check fired (logits[fired])
    assert fired + 2 < FORCED
    torch.testing.assert_close(logits[:fired], eager[:fired], rtol=1e-4, atol=1e-4)
    after = (logits[fired + 1:] - full[fired + 1:]).abs().max()
    assert after < 0.25 * (logits[1:fired] - full[1:fired]).abs().max()


@pytest.mark.parametrize("noise", [False, True])
def test_on_an_asynchronous_device_the_check_runs_on_the_watchs_host_thread(tiny_model, reference, capsys,
                                                                         monkeypatch, noise):
    """Through the stand-in's streams (CUDA's orchestration): the checks and their ratios are the synchronous
    run's, computed on the watch's own host thread from the host store (the pass sends no exact key to the
    device and waits on nothing); a lost guide is still noticed, once."""
    import threading

    from engine.kvcache.watch import WatchedLayer
    from tests.conftest import cuda_layout
    from tests.test_cuda_standin import standin_caches

    prompt, forced, _ = reference
    if noise:
        real_add = guide_module.Guide.add
        monkeypatch.setattr(guide_module.Guide, "add", lambda self, row, start, k, v, q=None: real_add(
            self, row, start, torch.randn(k.shape, generator=torch.Generator().manual_seed(start)) * 8, v, q))
    cuda_layout(monkeypatch)
    _, plain = watch_stats(tiny_model, CONFIG, prompt, forced)
    capsys.readouterr()
    threads = []
    real_scores = WatchedLayer.exact_scores
    monkeypatch.setattr(WatchedLayer, "exact_scores", lambda self, q0, *region: threads.append(
        (threading.current_thread().name, q0.device.type)) or real_scores(self, q0, *region))
    made = standin_caches(monkeypatch)
    _, deferred = watch_stats(tiny_model, CONFIG, prompt, forced)
    assert made and deferred["checks"] >= 4
    assert threads and all(name.startswith("specache-watch") and device == "cpu" for name, device in threads)
    if noise:  # (its verdict lands a pass or more later than the synchronous one's: a check or two more)
        assert plain["lost"] and deferred["lost"] and deferred["fallback"] == "exact"
        assert deferred["coverage_vs_oracle"] < 0.5
    else:
        assert deferred == plain and not deferred["lost"]
    assert capsys.readouterr().err.count("lost the model") == int(noise)
