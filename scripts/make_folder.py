"""Write the embedded SmolLM2's weights (its GGUF dequantized, as --dtype float32 loads them) as a Hugging Face
model folder in bf16 or fp16 safetensors, with its tokenizer and chat template: a 16-bit folder to measure
`--model FOLDER` with (docs/engine.md, "Weights held in their blocks").

    .venv/bin/python scripts/make_folder.py /tmp/smol-bf16 [--dtype bfloat16|float16]
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine.model.linears import SkinnyLinear  # noqa: E402
from engine.model.loading import load_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    args = ap.parse_args()
    lm = load_model(None, device="cpu", dtype="float32", classes="transformers")
    for m in lm.model.modules():
        if isinstance(m, SkinnyLinear):
            m.__class__ = torch.nn.Linear  # plain modules: save_pretrained writes their weights only
    lm.model.to(getattr(torch, args.dtype)).save_pretrained(args.out)
    lm.tokenizer.save_pretrained(args.out)
    shutil.copy(lm.path / "chat_template.jinja", args.out / "chat_template.jinja")
    print(f"wrote {args.out} ({sum(f.stat().st_size for f in args.out.iterdir()) / 1e6:.0f} MB)")


if __name__ == "__main__":
    main()
