"""Does the fast decode path keep a model's greedy tokens? 64 greedy tokens, full cache, on the start and end
windows of each document: the exact decode path (SPECACHE_DECODE_LINEAR=exact: the de-quantized fp32 model's
floats) against a faster one (int16 by default: integer decode linears, native norms and ropes;
engine/model/decode_kernels.py). Prints and writes (--out) the index of the first differing token per window
(64: none).

    .venv/bin/python scripts/decode_path_tokens.py --model FILE.gguf --threads 1 --out result.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from engine.config import CacheConfig, GenerationConfig
from engine.generate.engine import Engine, Finished
from engine.inputs.documents import load_document
from engine.model.loading import load_model, prepare_model

DOCS = ("examples/texts/origin-of-species-introduction.txt", "examples/report.pdf", "examples/texts/federalist.txt")


def greedy(model, prompt: list[int], n: int) -> list[int]:
    gen = Engine(model, CacheConfig(mode="full")).generate([prompt], GenerationConfig(max_tokens=n))
    return next(e for e in gen if isinstance(e, Finished)).tokens[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="the model (default: the embedded one)")
    ap.add_argument("--kernel", default="int16", help="the fast path's decode kernel (int16, int8)")
    ap.add_argument("--window", type=int, default=1500, help="prompt tokens per window")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--doc", action="append", help="documents (default: the three example ones)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    lm = load_model(a.model, device="cpu")
    prefill = lm.model.specache_prefill_dtype
    first_difference = {}
    for doc in a.doc or DOCS:
        ids = lm.tokenizer(load_document(doc).text).input_ids
        for start in sorted({0, max(0, len(ids) - a.window)}):
            prompt = ids[start:start + a.window]
            runs = [greedy(prepare_model(lm.model, prefill, kernel), prompt, a.tokens) for kernel in ("exact", a.kernel)]
            same = next((i for i, (x, y) in enumerate(zip(*runs)) if x != y), min(map(len, runs)))
            first_difference[f"{doc}@{start}"] = same
            print(f"{doc} from token {start}: first difference at {same} of {len(runs[0])}", flush=True)
    result = {"model": lm.name, "kernel": a.kernel, "window": a.window, "tokens": a.tokens,
              "threads": torch.get_num_threads(), "first_difference": first_difference}
    print(json.dumps(result))
    if a.out:
        a.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
