"""Chunked prefill and the decoders, as generators that yield progress and tokens.

    prompt ids -> prefill (chunk by chunk into the cache) -> decode
    full / kivi / window, and specache with prefetch "current": one token per step.
    specache: pre-decoding, then two tokens per step [T_t, T'_{t+1}]: the output token,
    attending with the exact K/V fetched for it, and a speculative token whose attention
    row picks (per layer, per KV head) the positions to fetch for the next step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from engine.config import CacheConfig, GenerationConfig
from engine.docstore.store import KVStore, make_key
from engine.generate.sampling import sample
from engine.kvcache import KVCache, make_cache


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


@torch.inference_mode()
def forward(model, cache: KVCache, ids: torch.Tensor, rows: slice, keep: int | None = None,
            select: int | None = None, logits_to_keep: int = 1, is_prefill: bool = False) -> torch.Tensor:
    """Run ids [b, T] through the model against the cache rows; commit `keep` tokens. -> logits [b, n, V]."""
    step = cache.begin(rows, ids.shape[1], keep, select, is_prefill)
    out = model(input_ids=ids, position_ids=step.positions(), cache=cache, use_cache=True,
                kv_cache=cache, logits_to_keep=logits_to_keep)
    cache.commit()
    return out.logits


def prefill(model, cache: KVCache, prompt: list[int], row: int, chunk_size: int) -> Iterator[int | torch.Tensor]:
    """Feed one row's prompt in chunks; yields the tokens done after each chunk, then the last logits [V]."""
    device = cache.lengths.device
    ids = torch.tensor(prompt, dtype=torch.long, device=device)[None]
    logits = None
    for s in range(0, len(prompt), chunk_size):
        logits = forward(model, cache, ids[:, s : s + chunk_size], slice(row, row + 1), is_prefill=True)
        yield min(s + chunk_size, len(prompt))
    yield logits[0, -1]


@dataclass
class StoreUse:
    """A persistent document store (engine.docstore.store) for the prompts' document prefixes.

    model_id: the model's fingerprint (engine.model.LoadedModel.fingerprint); with the model's dtype
    and the cache settings that change the KV it keys the entries. labels: per row, what
    `specache cache ls` shows for an entry (the document)."""

    store: "KVStore"
    model_id: str
    labels: list[str] | None = None
    model_name: str = ""


def store_settings(cache: KVCache, dtype: torch.dtype, model_id: str) -> dict:
    """Everything besides the token ids that a stored row state depends on."""
    shape, config, layer = cache.shape, cache.config, cache.layers[0]
    settings = {"model": model_id, "dtype": str(dtype).replace("torch.", ""), "mode": config.mode,
                "layers": shape.layers, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim}
    if config.mode != "full":
        settings.update(residual=layer.residual, group=layer.group, sinks=layer.sinks,
                        bits=config.bits if layer.guide is not None else None)
    return settings


def generate(model, prompts: list[list[int]], cache_config: CacheConfig, gen: GenerationConfig,
             shared_prefix: int = 0, prefixes: list[int] | None = None, store: StoreUse | None = None,
             ) -> Iterator[Progress | Tokens | Finished]:
    """Prefill every prompt into one batch cache, then decode all rows together.

    Each prompt's document prefix is prefilled on its own (then the rest of the prompt):
    shared_prefix: the prompts' first tokens are identical (one document, several questions):
    prefill them once into row 0 and copy that row's cache to the other rows.
    prefixes: otherwise, each row's own document prefix length (0: none).
    store: with a document store, a prefix found there is loaded into its row instead of being
    prefilled, and a prefix that was not is saved after its prefill."""
    param = next(model.parameters())
    batch = len(prompts)
    max_len = max(len(p) for p in prompts) + gen.max_tokens + 2
    cache = make_cache(model.config, cache_config, batch, max_len, param.dtype, param.device)
    generator = torch.Generator(device=param.device).manual_seed(gen.seed)

    t0 = time.perf_counter()
    if shared_prefix and batch > 1:
        if any(p[:shared_prefix] != prompts[0][:shared_prefix] for p in prompts) or \
                shared_prefix >= min(map(len, prompts)):
            raise ValueError("shared_prefix must be a common prefix shorter than every prompt")
        pre = [shared_prefix] * batch
        heads = [0]  # rows whose prefix is prefilled or loaded; the others copy row 0
    else:
        given = [shared_prefix] if shared_prefix else (prefixes or [0] * batch)
        if len(given) != batch:
            raise ValueError("prefixes must give one length per prompt")
        pre = [n if 0 < n < len(p) else 0 for n, p in zip(given, prompts)]
        heads = [r for r in range(batch) if pre[r]]
    infos: list[dict | None] = [None] * batch
    keys: dict[int, str] = {}
    loaded: set[int] = set()
    if store is not None:
        settings = store_settings(cache, param.dtype, store.model_id)
        for r in heads:
            ids = prompts[r][: pre[r]]
            keys[r] = make_key(settings, ids)
            t = time.perf_counter()
            entry = store.store.load(keys[r], ids)
            if entry is None:
                continue
            try:
                cache.import_row(r, entry.tensors)
            except ValueError as exc:
                store.store.discard(keys[r], f"it does not fit this cache ({exc})")
                continue
            loaded.add(r)
            infos[r] = {"hit": True, "key": keys[r], "bytes": entry.bytes, "seconds": time.perf_counter() - t}
            del entry
    total = sum(pre[r] for r in heads if r not in loaded) + sum(len(p) - n for p, n in zip(prompts, pre))
    done, last, writing = 0, [], 0.0
    for r in heads:
        if r in loaded:
            continue
        for item in prefill(model, cache, prompts[r][: pre[r]], r, cache_config.chunk_size):
            if isinstance(item, int):
                yield Progress(done + item, total)
        done += pre[r]
        if store is not None:
            t = time.perf_counter()
            size = save_row(store, cache, r, keys[r], prompts[r][: pre[r]], settings)
            infos[r] = {"hit": False, "key": keys[r], "bytes": size, "seconds": time.perf_counter() - t}
            writing += infos[r]["seconds"]
    for row in range(batch):
        if row not in heads and pre[row]:
            cache.copy_row(0, row)
            infos[row] = infos[0]
    for row, prompt in enumerate(prompts):
        for item in prefill(model, cache, prompt[pre[row]:], row, cache_config.chunk_size):
            if isinstance(item, int):
                yield Progress(done + item, total)
            else:
                last.append(item)
        done += len(prompt) - pre[row]
    if param.device.type == "cuda":
        torch.cuda.synchronize()
    t1 = time.perf_counter()

    pick: Picker = lambda logits: sample(logits, gen.temperature, gen.top_p, generator)  # noqa: E731
    outputs: list[list[int]] = [[] for _ in range(batch)]
    finished = [False] * batch
    steps = 0
    for next_ids, _ in decoder_for(cache_config)(model, cache, torch.stack(last), pick, history=prompts):
        steps += 1
        emitted: list[int | None] = []
        for r, t in enumerate(next_ids.tolist()):
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
    if param.device.type == "cuda":
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    # prefill_seconds: loading stored prefixes counts, writing new ones does not (it is in infos)
    yield Finished(outputs, [len(p) for p in prompts], t1 - t0 - writing, t2 - t1, steps, cache.stats(), infos)


def save_row(store: StoreUse, cache: KVCache, row: int, key: str, ids: list[int], settings: dict) -> int | None:
    """Save a row's state after its prefix into the store; a failing write is reported, not fatal."""
    label = store.labels[row] if store.labels and row < len(store.labels) else ""
    try:
        return store.store.save(key, ids, cache.export_row(row), {**settings, "label": label, "model_name": store.model_name})
    except OSError as exc:
        store.store.warn(f"could not save the document's KV to the store ({exc})")
        return None


Picker = Callable[[torch.Tensor], torch.Tensor]  # logits [B, V] -> next ids [B]


def plain_steps(model, cache: KVCache, logits: torch.Tensor, pick: Picker,
                history: list[list[int]] | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """One token per step. logits [B, V] are the prefill's last logits. Yields (ids [B], the logits they came from)."""
    rows = slice(0, cache.batch)
    while True:
        ids = pick(logits)
        yield ids, logits
        logits = forward(model, cache, ids[:, None], rows)[:, -1]


def speculative_steps(model, cache: KVCache, logits: torch.Tensor, pick: Picker,
                      history: list[list[int]] | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """SpeCache decoding (design page, Algorithms 2 and 3). Yields (output ids [B], their logits) per step.

    history: each row's tokens so far (its prompt). With it and cache.config.resync, a missed
    speculation is re-synced: the speculative token of step t+1 comes from the speculative token
    of step t, so after one wrong guess the next guesses are conditioned on a wrong token; when
    the fed guess differs from the output token the step produced, the next guess is instead the
    token that followed the latest earlier occurrence of that output token in the row (prompt
    lookup; documents are copied from a lot). Which positions are fetched changes, never
    correctness."""
    rows = slice(0, cache.batch)
    out = pick(logits)  # T1
    yield out, logits
    resync = history is not None and cache.config.resync
    follow = [_follow_table(h) for h in history] if resync else None
    prev = [h[-1] if h else None for h in history] if resync else None
    # Pre-decoding: T1 alone against guide + residual; its row picks the first fetch set, its
    # logits give the first speculative token. Nothing is kept: T1 is fed again, exactly, next.
    spec = forward(model, cache, out[:, None], rows, keep=0, select=0)[:, -1].argmax(-1)
    while True:
        pair = torch.stack([out, spec], dim=1)  # [B, 2] = [T_t, T'_{t+1}]
        both = forward(model, cache, pair, rows, keep=1, select=1, logits_to_keep=2)  # [B, 2, V]
        fed = pair[:, 1]
        out = pick(both[:, 0])
        spec = both[:, 1].argmax(-1)
        if follow is not None:
            spec = _resync(follow, prev, pair[:, 0], out, fed, spec)
        yield out, both[:, 0]


def _follow_table(tokens: list[int]) -> dict[int, int]:
    """token -> the token after its latest occurrence."""
    return {a: b for a, b in zip(tokens, tokens[1:])}


def _resync(follow, prev, current: torch.Tensor, out: torch.Tensor, fed: torch.Tensor,
            spec: torch.Tensor) -> torch.Tensor:
    """Record the committed tokens and replace the guesses that followed a missed one (see speculative_steps)."""
    cur, nxt, guessed, new = current.tolist(), out.tolist(), fed.tolist(), spec.tolist()
    for r in range(len(cur)):
        if prev[r] is not None:
            follow[r][prev[r]] = cur[r]
        prev[r] = cur[r]
        if guessed[r] != nxt[r]:
            following = nxt[r] if cur[r] == nxt[r] else follow[r].get(nxt[r])
            if following is not None:
                new[r] = following
    return torch.tensor(new, dtype=spec.dtype, device=spec.device)


def decoder_for(config: CacheConfig):
    """The step loop of a cache mode: speculative for specache with k > 0 (unless its prefetch is
    "current": one token per step, each layer picking its own fetched set), plain otherwise."""
    speculate = config.mode == "specache" and config.k > 0 and config.prefetch == "speculative"
    return speculative_steps if speculate else plain_steps


@torch.inference_mode()
def teacher_forced(model, prompt: list[int], forced: list[int], cache_config: CacheConfig,
                   ) -> Iterator[torch.Tensor]:
    """Feed `forced` as the output tokens (e.g. the full cache's own output) through the mode's real
    step loop; yield the next-token logits [V] that preceded each forced token."""
    param = next(model.parameters())
    cache = make_cache(model.config, cache_config, 1, len(prompt) + len(forced) + 2, param.dtype, param.device)
    *_, last = prefill(model, cache, prompt, 0, cache_config.chunk_size)
    it = iter(forced)
    pick: Picker = lambda logits: torch.tensor([next(it)], device=logits.device)  # noqa: E731
    for i, (_, logits) in enumerate(decoder_for(cache_config)(model, cache, last[None], pick, history=[prompt])):
        yield logits[0]
        if i + 1 == len(forced):
            return
