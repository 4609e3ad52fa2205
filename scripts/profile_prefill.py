"""Where the time of one prefill goes: a per-component profile of `summarize DOC`'s prefill.

Loads the model, builds the summarize prompt of the document exactly as `specache summarize`
does (document prefix first, then the instruction, chunk by chunk) with the model's default
cache settings for its device, and prefills it `--repeats` times (after a warm-up of two chunks),
timing each component with wall-clock timers around the code that does it:

    linears     every nn.Linear of the decoder layers (q, k, v, o, gate, up, down)
    lm_head     the output projection (the logits)
    attention   the cache layer's attend() (SDPA and whatever gathers its K/V), without the mask
    mask        building the attention masks
    norms       RMSNorm modules
    rotary      the rotary table (rotary_emb) and apply_rotary_pos_emb
    act         the MLP's activation (SiLU)
    embed       the token embedding
    cache write the cache layer's update() (host store, sinks, residual buffer)
    guide quant the cache layer's after_step() (quantizing what left the residual window)
    other       the rest of the forward passes: Python, residual adds, the MLP's product, reshapes

Timers are exclusive (a component nested in another is counted once, in the inner one). The
CPU runs ops synchronously, so wall-clock timers are accurate there; on CUDA the numbers
would need synchronisation and are not meaningful. Prints a table (median over the repeats
of each component's seconds) and, with --json PATH, writes every run.

    python scripts/profile_prefill.py [--doc examples/report.pdf] [--model M] [--mode specache] [--dtype auto]
        [--threads N] [--repeats 3] [--tree PATH] [--json out.json]

--tree PATH imports the engine from another checkout (e.g. `git worktree add /tmp/old fd1b9f2`)
so an old and a new tree can be profiled by the same script, one after the other.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--doc", default="examples/report.pdf")
    p.add_argument("--model", default=None, help="what --model of the CLI takes (default: the embedded model)")
    p.add_argument("--mode", default=None, help="cache mode (default: the engine's default, specache)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--chunk", type=int, default=None, help="prefill chunk size (default: the engine's)")
    p.add_argument("--tree", default=None, help="import the engine from this checkout instead of this one")
    p.add_argument("--json", default=None)
    p.add_argument("--prefill", choices=("auto", "exact", "bf16"), default="auto",
                   help="exact: prefill linears and attention in the model's dtype (torch); bf16: in bf16 "
                        "(oneDNN linears, the native attention kernel); auto: as --dtype picks")
    p.add_argument("--no-components", action="store_true", help="time whole prefills only (no timers)")
    return p.parse_args(argv)


class Timers:
    """Exclusive wall-clock time per component name, with a stack for nesting."""

    def __init__(self):
        self.total: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.stack: list[list] = []  # [name, start, child seconds]

    def enter(self, name: str) -> None:
        self.stack.append([name, time.perf_counter(), 0.0])

    def leave(self) -> None:
        name, t0, child = self.stack.pop()
        dt = time.perf_counter() - t0
        self.total[name] = self.total.get(name, 0.0) + dt - child
        self.calls[name] = self.calls.get(name, 0) + 1
        if self.stack:
            self.stack[-1][2] += dt

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            self.enter(name)
            try:
                return fn(*args, **kwargs)
            finally:
                self.leave()
        timed.__wrapped__ = fn
        return timed

    def hook_module(self, module, name: str) -> None:
        module.register_forward_pre_hook(lambda m, a: self.enter(name))
        module.register_forward_hook(lambda m, a, o: self.leave())


def instrument(model, cache_classes, timers: Timers) -> None:
    """Put the timers around every component (module hooks and patched functions)."""
    import torch
    import transformers.models.llama.modeling_llama as llama

    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, torch.nn.Linear):
            timers.hook_module(module, "lm_head" if leaf == "lm_head" else "linears")
        elif type(module).__name__.endswith("RMSNorm"):
            timers.hook_module(module, "norms")
        elif leaf == "rotary_emb":
            timers.hook_module(module, "rotary")
        elif leaf == "act_fn":
            timers.hook_module(module, "act")
        elif leaf == "embed_tokens":
            timers.hook_module(module, "embed")
    llama.apply_rotary_pos_emb = timers.wrap("rotary", llama.apply_rotary_pos_emb)
    done = set()
    for cls in cache_classes:
        for klass in cls.__mro__:
            for attr, label in (("update", "cache write"), ("attend", "attention"), ("after_step", "guide quant")):
                if attr in vars(klass) and (klass, attr) not in done:
                    setattr(klass, attr, timers.wrap(label, vars(klass)[attr]))
                    done.add((klass, attr))
    # the mask builders, wherever the tree defines them (old and new trees differ)
    for modname in ("engine.kvcache.base", "engine.kvcache.policies.full", "engine.kvcache.guided"):
        mod = sys.modules.get(modname)
        for fn in ("additive_mask", "causal_mask", "chunk_mask", "block_mask", "causal_block_mask"):
            if mod is not None and hasattr(mod, fn) and not hasattr(getattr(mod, fn), "__wrapped__"):
                setattr(mod, fn, timers.wrap("mask", getattr(mod, fn)))


def main(argv=None) -> int:
    args = parse_args(argv)
    root = Path(args.tree).resolve() if args.tree else Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root))
    os.chdir(Path(__file__).resolve().parents[1])  # --doc relative to this checkout
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    import engine
    from engine.config import CacheConfig
    try:
        from engine.generate.steps import prefill
    except ImportError:  # an older tree (--tree): prefill lived in engine.generate.engine
        from engine.generate.engine import prefill
    from engine.inputs import prompts as P
    from engine.inputs.documents import load_document
    from engine.kvcache import make_cache
    from engine.model.loading import load_model
    from engine.plan.profiles import model_defaults

    print(f"engine from {Path(engine.__file__).parent}", file=sys.stderr)
    lm = load_model(args.model, device="cpu", dtype=args.dtype)
    if args.prefill != "auto":
        from engine.model.loading import prepare_model

        prepare_model(lm.model, torch.bfloat16 if args.prefill == "bf16" else None)
    linears = {str(getattr(m, "prefill_dtype", None)) for m in lm.model.modules() if isinstance(m, torch.nn.Linear)}
    attention = {str(getattr(m, "specache_prefill_dtype", None)) for m in lm.model.modules() if hasattr(m, "q_proj")}
    prompt = P.build_prompt(lm.tokenizer, load_document(args.doc).text, P.SUMMARIZE)
    config = CacheConfig().with_overrides(mode=args.mode, chunk_size=args.chunk, **model_defaults(lm))
    param = next(lm.model.parameters())
    print(f"{len(prompt.ids)} prompt tokens ({len(prompt.prefix)} document prefix), {config.mode}, "
          f"{param.dtype} (prefill linears: {', '.join(sorted(linears))}, "
          f"attention: {', '.join(sorted(attention))}), {torch.get_num_threads()} threads, "
          f"chunk {config.chunk_size}", file=sys.stderr)

    def one_prefill(parts=(prompt.prefix, prompt.suffix)) -> float:
        cache = make_cache(lm.model.config, config, 1, len(prompt.ids) + 8, param.dtype, param.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            for part in parts:
                for _ in prefill(lm.model, cache, part, 0, config.chunk_size):
                    pass
        seconds = time.perf_counter() - t0
        close = getattr(cache, "close", None)
        if close:
            close()
        return seconds

    timers = Timers()
    if not args.no_components:
        probe = make_cache(lm.model.config, config, 1, 16, param.dtype, param.device)
        instrument(lm.model, {type(layer) for layer in probe.layers}, timers)
        getattr(probe, "close", lambda: None)()
    one_prefill((prompt.prefix[: 2 * config.chunk_size],))  # warm-up: library, bf16 weight copies, allocator
    runs = []
    for i in range(args.repeats):
        timers.total.clear()
        timers.calls.clear()
        seconds = one_prefill()
        parts = dict(timers.total)
        if parts:
            parts["other"] = seconds - sum(parts.values())
        runs.append({"seconds": seconds, "components": parts, "load": os.getloadavg()})
        print(f"run {i + 1}: {seconds:.2f} s (load {os.getloadavg()[0]:.2f})", file=sys.stderr)
    med = statistics.median(r["seconds"] for r in runs)
    print(f"prefill of {len(prompt.ids)} tokens: median {med:.2f} s ({len(prompt.ids) / med:.0f} tok/s), "
          "runs " + ", ".join(f"{r['seconds']:.2f}" for r in runs))
    if runs[0]["components"]:
        names = sorted(runs[0]["components"], key=lambda n: -runs[0]["components"][n])
        print("| component | seconds | share |\n|---|---|---|")
        for n in names:
            s = statistics.median(r["components"][n] for r in runs)
            print(f"| {n} | {s:.2f} | {s / med:.0%} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"tree": str(root), "tokens": len(prompt.ids), "mode": config.mode,
                                               "dtype": str(param.dtype), "prefill_linears": sorted(linears), "prefill_attention": sorted(attention), "threads": torch.get_num_threads(),
                                               "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
