"""The Engine: one model and the life of its caches. Everything that runs the model (the jobs,
every bench, the GPU check) goes through it:

    prompt ids -> new_cache -> prefill (chunk by chunk, or a document prefix loaded from the store)
               -> decode steps of the cache mode (engine.generate.steps) -> token ids

`generate` is the whole of it for a batch, as a generator of Progress, Tokens and Finished events.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from engine.config import CacheConfig, GenerationConfig
from engine.docstore.store import make_key
from engine.errors import EmptyDocument
from engine.generate.prefixes import DocStoreUse, load_row, prefix_layout, save_row, store_settings
from engine.generate.sampling import Sampler
from engine.generate.steps import Picker, decode_headroom, decoder_for, prefill, sync
from engine.kvcache import KVCache, make_cache, policy


@dataclass
class Progress:
    """Prefill progress: `done` of `total` prompt tokens (all rows together)."""

    done: int
    total: int


@dataclass
class Tokens:
    """One decode step's new token per row (None for rows already finished)."""

    ids: list[int | None]


@dataclass
class Finished:
    """Everything about a finished generation."""

    tokens: list[list[int]]  # generated ids per row (stop token excluded)
    prompt_tokens: list[int]
    prefill_seconds: float
    decode_seconds: float
    steps: int
    cache_stats: dict = field(default_factory=dict)
    store: list[dict | None] = field(default_factory=list)  # per row, with a store: hit, key, bytes, seconds
    # (seconds: loading the entry on a hit, writing it on a miss)

    @property
    def generated_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)


def check_prompts(prompts: list[list[int]]) -> None:
    """A batch with no prompt, or a prompt of no tokens: EmptyDocument (the empty-document exit code) rather
    than an error deep in the prefill."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise EmptyDocument("a prompt tokenizes to nothing: there is no token to start from")


class Engine:
    """A model (any transformers causal LM prepared by engine.model.loading.prepare_model) with one
    cache configuration. store: the persistent document store for document prefixes (or None).
    cls: the class of the configured policy, as the run resolved it (default: the one registered for
    config.mode, checked here, before any cache is made: BadArgument for a mode not registered)."""

    def __init__(self, model: torch.nn.Module, config: CacheConfig, store: DocStoreUse | None = None,
                 cls: type | None = None):
        self.policy = cls or policy(config.mode)
        self.model, self.config, self.store = model, config, store
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device

    # ---- the pieces -----------------------------------------------------------------------
    def cache_length(self, context: int) -> int:
        """The tokens a cache is made for, for calls of up to `context` tokens (prompt + answer): what the
        planner sizes and the cache's k grows with (CacheConfig.fetch_k) are this one length."""
        return context + 2 + decode_headroom(self.policy)

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty cache of this engine's mode for `batch` rows of up to `max_len` tokens (close it after)."""
        return make_cache(self.model.config, self.config, batch, max_len, self.dtype, self.device, self.policy)

    def prefill(self, cache: KVCache, prompt: list[int], row: int) -> Iterator[int | torch.Tensor]:
        """Feed one row's prompt in chunks; yields tokens done after each chunk, then the last logits [V]."""
        return prefill(self.model, cache, prompt, row, self.config.chunk_size)

    def steps(self, cache: KVCache, logits: torch.Tensor, pick: Picker, history: list[list[int]] | None = None,
              finished: list[bool] | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The mode's decode loop from the prefill's last logits [B, V]: yields (ids [B], their logits;
        an id of -1: no token for that row at this step, exact mode). finished: the caller's live
        list of rows it no longer needs (they leave the batch: steps.drop_finished; an id of -1 for them)."""
        return decoder_for(cache)(self.model, cache, logits, pick, history=history, finished=finished)

    # ---- a whole batch --------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], gen: GenerationConfig, shared_prefix: int = 0,
                 prefixes: list[int] | None = None, labels: list[str] | None = None,
                 ) -> Iterator[Progress | Tokens | Finished]:
        """Prefill every prompt into one batch cache, then decode all rows together.

        Each prompt's document prefix is filled on its own first (prefix_layout: one shared prefix
        filled once and copied, or one per row), loaded from the store when it is there and saved
        to it after its prefill otherwise; labels name each row's document in the store. A prompt of no
        tokens (a text that tokenizes to nothing) raises EmptyDocument: there is nothing to condition on."""
        check_prompts(prompts)
        max_len = self.cache_length(max(len(p) for p in prompts) + gen.max_tokens)
        with self.new_cache(len(prompts), max_len) as cache:
            t0 = time.perf_counter()
            infos, writing, last = yield from self.fill(cache, prompts, shared_prefix, prefixes, labels)
            sync(self.device)
            t1 = time.perf_counter()
            outputs, steps = yield from self.decode(cache, torch.stack(last), gen, prompts)
            sync(self.device)
            t2 = time.perf_counter()
            # prefill_seconds: loading stored prefixes counts, writing new ones does not (it is in infos)
            yield Finished(outputs, [len(p) for p in prompts], t1 - t0 - writing, t2 - t1, steps, cache.stats(),
                           infos)

    def fill(self, cache: KVCache, prompts: list[list[int]], shared_prefix: int, prefixes: list[int] | None,
             labels: list[str] | None) -> Iterator[Progress]:
        """Prefill (or load) every row; yields Progress; returns (store infos per row, seconds spent
        writing the store, each row's last logits [V])."""
        pre, heads = prefix_layout(prompts, shared_prefix, prefixes)
        store = self.store
        infos: list[dict | None] = [None] * len(prompts)
        keys: dict[int, str] = {}
        if store is not None:
            settings = store_settings(cache, self.dtype, store.model_id,
                                      getattr(self.model, "specache_prefill_dtype", None))
            for r in heads:
                keys[r] = make_key(settings, prompts[r][: pre[r]])
                infos[r] = load_row(store, cache, r, keys[r], prompts[r][: pre[r]])
        loaded = {r for r in heads if infos[r] is not None}
        total = sum(pre[r] for r in heads if r not in loaded) + sum(len(p) - n for p, n in zip(prompts, pre))
        done, writing, last = 0, 0.0, []
        for r in heads:
            if r in loaded:
                continue
            for item in self.prefill(cache, prompts[r][: pre[r]], r):
                if isinstance(item, int):
                    yield Progress(done + item, total)
            done += pre[r]
            if store is not None:
                t = time.perf_counter()
                label = labels[r] if labels and r < len(labels) else ""
                size = save_row(store, cache, r, keys[r], prompts[r][: pre[r]], settings, label)
                infos[r] = {"hit": False, "key": keys[r], "bytes": size, "seconds": time.perf_counter() - t}
                writing += infos[r]["seconds"]
        for row in range(len(prompts)):
            if row not in heads and pre[row]:
                # a document whose exact rows were mapped from the store: mapped again for this row (its pages
                # shared), not copied from row 0 (HostStore.place_row)
                if not (0 in loaded and cache.transfer.placed.nbytes
                        and load_row(store, cache, row, keys[0], prompts[0][: pre[0]]) is not None):
                    cache.copy_row(0, row)
                infos[row] = infos[0]
        for row, prompt in enumerate(prompts):
            for item in self.prefill(cache, prompt[pre[row]:], row):
                if isinstance(item, int):
                    yield Progress(done + item, total)
                else:
                    last.append(item)
            done += len(prompt) - pre[row]
        return infos, writing, last

    def decode(self, cache: KVCache, logits: torch.Tensor, gen: GenerationConfig,
               history: list[list[int]]) -> Iterator[Tokens]:
        """Decode every row until its stop token or gen.max_tokens; yields Tokens per step; returns
        (the generated ids per row, steps)."""
        pick: Picker = Sampler(gen, self.device)
        outputs: list[list[int]] = [[] for _ in history]
        finished = [False] * len(history)
        steps = 0
        for next_ids, _ in self.steps(cache, logits, pick, history=history, finished=finished):
            steps += 1
            emitted: list[int | None] = []
            for r, t in enumerate(next_ids.tolist()):
                if t < 0:  # no token for this row at this step (exact mode)
                    emitted.append(None)
                    continue
                if finished[r] or t in gen.stop_ids:
                    finished[r] = True
                    emitted.append(None)
                    continue
                outputs[r].append(t)
                emitted.append(t)
                if len(outputs[r]) >= gen.max_tokens:
                    finished[r] = True
            yield Tokens(emitted)
            if all(finished):
                break
        return outputs, steps

    @torch.inference_mode()
    def teacher_forced(self, prompt: list[int], forced: list[int]) -> Iterator[torch.Tensor]:
        """Feed `forced` as the output tokens (e.g. the full cache's own output) through the mode's real
        step loop; yield the next-token logits [V] that preceded each forced token."""
        check_prompts([prompt])
        with self.new_cache(1, len(prompt) + len(forced) + 2 + decode_headroom(self.policy)) as cache:
            *_, last = self.prefill(cache, prompt, 0)
            it = iter(forced)  # (exact mode may ask past the end within its last cycle: 0 then)
            pick: Picker = lambda logits, _: torch.tensor([next(it, 0)], device=logits.device)  # noqa: E731
            for i, (_, logits) in enumerate(self.steps(cache, last[None], pick, history=[prompt])):
                yield logits[0]
                if i + 1 == len(forced):
                    return
