"""Document prefixes of a batch: which rows prefill their document part themselves, which copy a
shared one, and which load it from the persistent document store (engine.docstore) instead."""
from __future__ import annotations

import time
from dataclasses import dataclass, fields

import torch

from engine.docstore.store import DocStore
from engine.kvcache import KVCache
from engine.kvcache.guided_rows import STORE_ROWS


@dataclass
class DocStoreUse:
    """A persistent document store (engine.docstore.store) for the prompts' document prefixes.

    model_id: the model's fingerprint (engine.model.loading.LoadedModel.fingerprint); with the model's
    dtype and the cache settings that change the KV it keys the entries."""

    store: DocStore
    model_id: str
    model_name: str = ""


def prefix_layout(prompts: list[list[int]], shared_prefix: int, prefixes: list[int] | None) -> tuple[list[int], list[int]]:
    """(per row, its document-prefix length (0: none); the rows that fill theirs, the others copy row 0).

    shared_prefix: the prompts' first tokens are identical (one document, several questions): fill
    them once in row 0. prefixes: otherwise each row's own document prefix length."""
    batch = len(prompts)
    if shared_prefix and batch > 1:
        if any(p[:shared_prefix] != prompts[0][:shared_prefix] for p in prompts) or \
                shared_prefix >= min(map(len, prompts)):
            raise ValueError("shared_prefix must be a common prefix shorter than every prompt")
        return [shared_prefix] * batch, [0]
    given = [shared_prefix] if shared_prefix else (prefixes or [0] * batch)
    if len(given) != batch:
        raise ValueError("prefixes must give one length per prompt")
    pre = [n if 0 < n < len(p) else 0 for n, p in zip(given, prompts)]
    return pre, [r for r in range(batch) if pre[r]]


def store_settings(cache: KVCache, dtype: torch.dtype, model_id: str, prefill_dtype: torch.dtype | None = None) -> dict:
    """Everything besides the token ids that a stored row state depends on (prefill_dtype: the
    prefill's compute dtype when it is not the model's, e.g. bf16 prefill of an fp32 model)."""
    shape = cache.shape
    settings = {"model": model_id, "dtype": str(dtype).replace("torch.", ""), "mode": cache.config.mode,
                "layers": shape.layers, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim}
    if prefill_dtype is not None and prefill_dtype != dtype:
        settings["prefill"] = str(prefill_dtype).replace("torch.", "")
    windows = [layer.window for layer in cache.layers]
    if any(w is not None for w in windows):  # the model's sliding-window layers keep only their window
        settings["windows"] = ",".join("-" if w is None else str(w) for w in windows)
    if cache.policy_layers:  # what the policy's layers keep (the window layers: their windows, above)
        settings.update(cache.policy_layers[0].store_key())
    config = cache.config
    for f in fields(config):  # the settings declared `store` (engine.config.Setting), away from their default
        declared = f.metadata.get("setting")
        if declared is not None and declared.store and getattr(config, f.name) != f.default:
            settings.setdefault(f.name, getattr(config, f.name))
    return settings


def load_row(store: DocStoreUse, cache: KVCache, row: int, key: str, ids: list[int]) -> dict | None:
    """Fill a row from the store; its info dict (hit, key, bytes, seconds), or None on a miss."""
    t = time.perf_counter()
    entry = store.store.load(key, ids)
    if entry is None:
        return None
    try:
        cache.import_row(row, entry.tensors, entry.pages)  # (the exact rows mapped in place where they can be)
    except ValueError as exc:
        store.store.discard(key, f"it does not fit this cache ({exc})")
        return None
    finally:
        entry.close()
    return {"hit": True, "key": key, "bytes": entry.bytes, "seconds": time.perf_counter() - t}


def save_row(store: DocStoreUse, cache: KVCache, row: int, key: str, ids: list[int], settings: dict,
             label: str = "") -> int | None:
    """Save a row's state after its prefix into the store (label: what `specache cache ls` shows for
    it, the document); a failing write is reported, not fatal."""
    tensors = cache.export_row(row)
    paged = [n for n in tensors if n.rsplit(".", 1)[-1] in STORE_ROWS]  # (stored page by page: mapped on a load)
    try:
        return store.store.save(key, ids, tensors, {**settings, "label": label, "model_name": store.model_name}, paged)
    except OSError as exc:
        store.store.warn(f"could not save the document's KV to the store ({exc})")
        return None

