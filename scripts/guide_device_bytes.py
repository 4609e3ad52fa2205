"""Device bytes of guided settings against the plain guide at k 512 (no outlier channels) of the same bits, at
fixed lengths: the engine's own GuidedLayer.device_bytes (exact tail + sinks + fetched set + guide) of a cache
built for SmolLM2's shape, with 16-bit exact parts (as on a GPU) and 32-bit ones (what `bench fidelity` measures
on a CPU).

    python scripts/guide_device_bytes.py [--lengths 2232,6421,8058] [--bits 1|2]
"""
from __future__ import annotations

import argparse

import torch
from transformers import LlamaConfig

from engine.config import RESIDUAL, SINKS, CacheConfig
from engine.kvcache import make_cache

SHAPE = LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    head_dim=64, intermediate_size=1536, vocab_size=64)  # SmolLM2-135M's KV shape
SETTINGS = {"o4-k512": dict(k=512, outliers=4), "o4-k472": dict(k=472, outliers=4),
            "o4-k440": dict(k=440, outliers=4), "o2-k476": dict(k=476, outliers=2),
            "g128-k512": dict(k=512, group=128), "g128-o4-k512": dict(k=512, group=128, outliers=4),
            "o4-k496-r16": dict(k=496, outliers=4, residual=16), "o4-k456-r48": dict(k=456, outliers=4, residual=48)}
SETTINGS_2BIT = {"o2-k512 (the default)": dict(k=512, outliers=2), "o2-k476": dict(k=476, outliers=2),
                 "o0-k560-r16": dict(k=560, residual=16)}


def device_bytes(length: int, k: int, group: int = 64, outliers: int = 0, element_bytes: int = 2, bits: int = 1,
                 residual: int = RESIDUAL, sinks: int = SINKS) -> int:
    """One row of `length` tokens: the sum of the built cache's layers' device_bytes."""
    config = CacheConfig(mode="specache", bits=bits, group=group, k=k, residual=residual, sinks=sinks,
                         outliers=outliers, prefetch="current")
    dtype = torch.float16 if element_bytes == 2 else torch.float32
    cache = make_cache(SHAPE, config, 1, length, dtype, torch.device("cpu"))
    try:
        return sum(layer.device_bytes(torch.tensor([length])) for layer in cache.layers)
    finally:
        cache.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="2232,6421,8058")
    ap.add_argument("--bits", type=int, default=1, choices=(1, 2))
    args = ap.parse_args()
    settings = SETTINGS if args.bits == 1 else SETTINGS_2BIT
    for length in map(int, args.lengths.split(",")):
        base = {eb: device_bytes(length, 512, element_bytes=eb, bits=args.bits) for eb in (2, 4)}
        print(f"{length} tokens: " + " | ".join(
            f"{name} fp16 {device_bytes(length, element_bytes=2, bits=args.bits, **kw) / base[2]:.3f} "
            f"fp32 {device_bytes(length, element_bytes=4, bits=args.bits, **kw) / base[4]:.3f}"
            for name, kw in settings.items()))


if __name__ == "__main__":
    main()
