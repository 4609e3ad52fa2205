"""Micro-benchmark of the fused native decode attention (engine/kvcache/fused.py) of one layer.

Builds a randomly initialised 2-layer model of SmolLM2-135M's attention shape (9 query heads,
3 KV heads, head dim 64; --shape qwen: Qwen2.5-Coder-1.5B's, 12 query heads on 2 KV heads of 128), prefills random prompts of --length tokens, decodes --steps tokens
with the engine's real step loop and times every ``specache_decode_attention`` call. Prints the
median microseconds per layer call. With --lib given twice (two builds of the native library,
e.g. before and after a change to guide_kernels.c, built with engine/native's flags), the two
take turns in one process, --rounds times each: an A/B that a noisy shared machine cannot bias.
With --vs-torch the layer's whole decode attention (GuidedLayer.attend_decode) is timed with the
fused call and with the torch path (no native kernel at all), taking turns: the measurement behind
the rule that the fused call is used wherever the library loads (docs/engine.md).

    python scripts/bench_fused.py [--threads 1] [--batch 1] [--length 6400] [--k 128]
                                  [--prefetch current] [--lib A.so --lib B.so] [--rounds 4] [--vs-torch]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import engine.backends.native_fused  # noqa: E402
from engine import native  # noqa: E402
from engine.config import CacheConfig, GenerationConfig  # noqa: E402
from engine.generate.engine import Engine  # noqa: E402
from engine.model.loading import prepare_model  # noqa: E402


# --shape -> (hidden size, query heads, KV heads, head dim) of the model whose attention is timed
SHAPES = {"smollm2": (576, 9, 3, 64), "qwen": (1536, 12, 2, 128)}


def smollm2_shaped(layers: int = 2, shape: str = "smollm2", context: int = 8192):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hidden, heads, kv_heads, head_dim = SHAPES[shape]
    cfg = LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=1536, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=context)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # peaky attention, like a trained model's
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
    return prepare_model(model)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the native kernels follow)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--length", type=int, default=6400, help="prompt tokens per row")
    ap.add_argument("--k", type=int, default=128)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2", help="the attention shape timed")
    ap.add_argument("--prefetch", choices=("current", "speculative"), default="current")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--lib", action="append", default=[], help="a native library build to time (repeat to A/B)")
    ap.add_argument("--vs-torch", action="store_true", help="time attend_decode fused against the torch path")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not native.native_available():
        sys.exit(f"native kernels unavailable: {native.native_error()}")
    libs = {path: native._load(Path(path)) for path in args.lib} or {"built": native.lib()}
    print(f"native kernels: {native.isa()} ({native.ENV_ARCH}={native.arch()}), torch CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}")
    model = smollm2_shaped(shape=args.shape, context=max(8192, args.length + args.steps))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (args.length,), generator=gen).tolist() for _ in range(args.batch)]
    config = CacheConfig(prefetch=args.prefetch, k=args.k)
    times: list[float] = []
    call = engine.backends.native_fused.FusedDecode.__call__

    def timed(self, *a, **kw):
        t0 = time.perf_counter()
        out = call(self, *a, **kw)
        times.append(time.perf_counter() - t0)
        return out

    if args.vs_torch:  # time the whole attend_decode instead, with the library and without it
        import engine.kvcache.guided as guided

        attend = guided.GuidedLayer.attend_decode

        def timed_attend(self, *a, **kw):
            t0 = time.perf_counter()
            out = attend(self, *a, **kw)
            times.append(time.perf_counter() - t0)
            return out

        guided.GuidedLayer.attend_decode = timed_attend
        lib = native.lib()
        libs = {"fused native": lib, "torch": None}
    else:
        engine.backends.native_fused.FusedDecode.__call__ = timed
    results: dict[str, list[float]] = {name: [] for name in libs}
    for _ in range(args.rounds):
        for name, lib in libs.items():
            native._lib = lib
            times.clear()
            for _event in Engine(model, config).generate(prompts, GenerationConfig(max_tokens=args.steps)):
                pass
            results[name].append(statistics.median(times) * 1e6)
    native._lib = next(iter(libs.values()))
    what = "decode attention (attend_decode)" if args.vs_torch else "fused decode attention"
    print(f"{what}, {args.shape} shape, {args.prefetch} k {args.k}, batch {args.batch}, {args.length} tokens, "
          f"{args.threads} thread(s): median us per layer call (each round)")
    for name, values in results.items():
        print(f"  {name}: {statistics.median(values):.0f}  ({' '.join(f'{v:.0f}' for v in values)})")


if __name__ == "__main__":
    main()
