"""How far a cache mode's logits are from the full cache's, step by step, on the full cache's own greedy
tokens (teacher forced): step 0 is the prefill's logits. Exact mode and specache with k >= context
should give 0 at step 0 and float rounding (~1e-5) after; a larger step-0 difference means the
prefill itself differs.

    PYTHONPATH=$PWD .venv/bin/python scripts/mode_drift.py [--doc texts/federalist.txt] [--tokens 56]
    SPECACHE_NATIVE_ARCH=x86-64-v2 ... (another build level)
"""
from __future__ import annotations

import argparse

import torch

from engine import native
from engine.bench.common import EXAMPLES, load_texts
from engine.bench.fidelity import fit_prompt
from engine.config import CacheConfig, GenerationConfig
from engine.generate.engine import Engine, Finished
from engine.model.loading import load_model
from engine.plan.profiles import model_defaults


def forced(lm, config: CacheConfig, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    return torch.stack(list(Engine(lm.model, config).teacher_forced(prompt, tokens)))  # [T, V]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--doc", default="texts/federalist.txt", help="a file under examples/")
    ap.add_argument("--tokens", type=int, default=56)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    print("native kernels:", native.isa() if native.lib() else "none (torch only)")
    lm = load_model(None, device="cpu")
    ((_, text),) = load_texts([str(EXAMPLES / args.doc)])
    prompt, _ = fit_prompt(lm.tokenizer, text, args.prompt_tokens)
    full = CacheConfig(mode="full")
    done = next(e for e in Engine(lm.model, full).generate([prompt], GenerationConfig(max_tokens=args.tokens))
                if isinstance(e, Finished))
    tokens = done.tokens[0]
    ref = forced(lm, full, prompt, tokens)
    defaults = model_defaults(lm)
    modes = {"exact": CacheConfig(mode="exact", **defaults),
             "specache k>=context": CacheConfig(mode="specache", **{**defaults, "k": len(prompt) + len(tokens) + 64})}
    for name, config in modes.items():
        d = (forced(lm, config, prompt, tokens) - ref).abs().amax(-1)  # [T] max |logit difference|
        print(f"{name}: step 0 (prefill) {d[0]:.2e}, steps 1.. max {d[1:].max():.2e} (mean {d[1:].mean():.2e}) "
              f"over {len(tokens)} tokens")


if __name__ == "__main__":
    main()
