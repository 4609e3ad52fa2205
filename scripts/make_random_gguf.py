"""Write a random-weight GGUF with a real model's shapes, Q4_K_M-style (Q4_K linears and token embedding, or Q5_K, Q4_0, Q4_1,
Q8_0, Q5_0, Q5_1 with --linears;
Q6_K output, F32 norms), streamed tensor by tensor (the file is never held in memory). Its weights are
random blocks (finite fp16 scales sized like a trained model's), so its text is noise: it measures
memory and speed, not quality. The tokenizer is the embedded SmolLM2's, padded with reserved tokens to
the vocabulary size.

    .venv/bin/python scripts/make_random_gguf.py /tmp/llama3-8b-random.Q4_K_M.gguf   # Llama-3-8B's shapes
    .venv/bin/python scripts/make_random_gguf.py tiny.gguf --layers 2 --hidden 256 --intermediate 512 \\
        --heads 4 --kv-heads 2 --vocab 49152
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine.model.embedded import find_embedded_gguf  # noqa: E402


def random_blocks(kind: Q, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """rows x k weights of kind as random blocks: codes uniform, scales set so |w| is ~0.02."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (rows * k // block, size), dtype=np.uint8)
    f16 = lambda v: np.full((len(raw), 1), v, dtype=np.float16).view(np.uint8)  # noqa: E731
    if kind in (Q.Q4_K, Q.Q5_K):  # w = d * sc * q - dmin * m, sc and m 6-bit, q 4-bit (Q5_K: 5-bit)
        raw[:, 0:2], raw[:, 2:4] = f16(6e-5), f16(4e-4)
    elif kind == Q.Q6_K:  # w = d * sc * (q - 32), sc int8
        raw[:, 208:210] = f16(1e-5)
    elif kind in (Q.Q4_0, Q.Q8_0):  # w = d * (q - 8), w = d * q (q int8)
        raw[:, 0:2] = f16(4e-3 if kind == Q.Q4_0 else 2e-4)
    elif kind in (Q.Q4_1, Q.Q5_1):  # w = d * q + m
        raw[:, 0:2], raw[:, 2:4] = f16(3e-3 if kind == Q.Q4_1 else 1.5e-3), f16(-0.02)
    elif kind == Q.Q5_0:  # w = d * (q - 16)
        raw[:, 0:2] = f16(2e-3)
    return raw.reshape(rows, -1)


def tokenizer_fields(vocab: int) -> dict:
    """The embedded SmolLM2's tokenizer (tokens, merges, ids, chat template), padded to vocab tokens."""
    reader = gguf.GGUFReader(find_embedded_gguf())

    def value(key):
        f = reader.fields[key]
        return f.contents()

    tokens = list(value("tokenizer.ggml.tokens"))
    types = list(value("tokenizer.ggml.token_type"))
    tokens += [f"<|reserved_{i}|>" for i in range(vocab - len(tokens))]
    types += [gguf.TokenType.USER_DEFINED] * (vocab - len(types))
    return {"tokens": tokens, "types": types, "merges": list(value("tokenizer.ggml.merges")),
            "bos": int(value("tokenizer.ggml.bos_token_id")), "eos": int(value("tokenizer.ggml.eos_token_id")),
            "pre": value("tokenizer.ggml.pre"), "template": value("tokenizer.chat_template")}


def tensor_plan(a) -> list[tuple[str, Q, int, int]]:
    """(name, kind, rows, row length) of every tensor, in the order llama.cpp writes them."""
    head_dim = a.head_dim or a.hidden // a.heads
    lin = Q[a.linears]
    out = [("token_embd.weight", lin, a.vocab, a.hidden)]
    for i in range(a.layers):
        p = f"blk.{i}."
        if a.arch in ("gemma2", "gemma3"):  # tied embedding; four norms a layer (Gemma 3: q / k norms too)
            out += [(p + "attn_norm.weight", Q.F32, 1, a.hidden),
                    (p + "attn_q.weight", lin, a.heads * head_dim, a.hidden),
                    (p + "attn_k.weight", lin, a.kv_heads * head_dim, a.hidden),
                    (p + "attn_v.weight", lin, a.kv_heads * head_dim, a.hidden),
                    (p + "attn_output.weight", lin, a.hidden, a.heads * head_dim)]
            if a.arch == "gemma3":
                out += [(p + "attn_q_norm.weight", Q.F32, 1, head_dim), (p + "attn_k_norm.weight", Q.F32, 1, head_dim)]
            out += [(p + "post_attention_norm.weight", Q.F32, 1, a.hidden), (p + "ffn_norm.weight", Q.F32, 1, a.hidden),
                    (p + "ffn_gate.weight", lin, a.intermediate, a.hidden),
                    (p + "ffn_up.weight", lin, a.intermediate, a.hidden),
                    (p + "ffn_down.weight", Q.Q6_K, a.hidden, a.intermediate),
                    (p + "post_ffw_norm.weight", Q.F32, 1, a.hidden)]
            continue
        if a.arch == "phi3":  # fused qkv and gate_up
            out += [(p + "attn_norm.weight", Q.F32, 1, a.hidden),
                    (p + "attn_qkv.weight", lin, (a.heads + 2 * a.kv_heads) * head_dim, a.hidden),
                    (p + "attn_output.weight", lin, a.hidden, a.heads * head_dim),
                    (p + "ffn_norm.weight", Q.F32, 1, a.hidden),
                    (p + "ffn_up.weight", lin, 2 * a.intermediate, a.hidden),
                    (p + "ffn_down.weight", Q.Q6_K, a.hidden, a.intermediate)]
            continue
        out += [(p + "attn_norm.weight", Q.F32, 1, a.hidden),
                (p + "attn_q.weight", lin, a.hidden, a.hidden),
                (p + "attn_k.weight", lin, a.kv_heads * head_dim, a.hidden),
                (p + "attn_v.weight", lin, a.kv_heads * head_dim, a.hidden),
                (p + "attn_output.weight", lin, a.hidden, a.hidden),
                (p + "ffn_norm.weight", Q.F32, 1, a.hidden),
                (p + "ffn_gate.weight", lin, a.intermediate, a.hidden),
                (p + "ffn_up.weight", lin, a.intermediate, a.hidden),
                (p + "ffn_down.weight", lin, a.hidden, a.intermediate)]
    out.append(("output_norm.weight", Q.F32, 1, a.hidden))
    return out if a.arch in ("gemma2", "gemma3") else out + [("output.weight", Q.Q6_K, a.vocab, a.hidden)]


# --arch SHAPE: a real model's shapes (overriding --layers ... --vocab)
SHAPES = {
    "gemma2-2b": dict(arch="gemma2", layers=26, hidden=2304, intermediate=9216, heads=8, kv_heads=4, head_dim=256,
                      vocab=256000, window=4096),
    "gemma3-1b": dict(arch="gemma3", layers=26, hidden=1152, intermediate=6912, heads=4, kv_heads=1, head_dim=256,
                      vocab=262144, window=512),
    "phi3-mini": dict(arch="phi3", layers=32, hidden=3072, intermediate=8192, heads=32, kv_heads=32, head_dim=96,
                      vocab=49152, window=2047),  # vocab: SmolLM2's tokenizer has 49152 tokens (Phi-3: 32064)
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--linears", choices=("Q4_K", "Q5_K", "Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1"), default="Q4_K",
                    help="the linears' and the embedding's format (Q5_K: a Q5_K_M-style file; Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q5_1: "
                         "a file of those, with the Q6_K output llama.cpp's quantizer keeps)")
    ap.add_argument("--shape", choices=sorted(SHAPES), help="a real model's shapes: Gemma 2 2B, Gemma 3 1B, Phi-3 mini")
    a = ap.parse_args()
    a.arch, a.head_dim, a.window = "llama", None, None
    for key, value in SHAPES.get(a.shape, {}).items():
        setattr(a, key, value)
    tok = tokenizer_fields(a.vocab)
    w = gguf.GGUFWriter(str(a.out), a.arch)
    w.add_name(f"random-{a.shape or 'llama'}-{a.linears.lower()}_m")
    w.add_block_count(a.layers)
    w.add_context_length(a.context)
    w.add_embedding_length(a.hidden)
    w.add_feed_forward_length(a.intermediate)
    w.add_head_count(a.heads)
    w.add_head_count_kv(a.kv_heads)
    head_dim = a.head_dim or a.hidden // a.heads
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(500000.0 if a.arch == "llama" else 10000.0)
    w.add_layer_norm_rms_eps(1e-5 if a.arch == "llama" else 1e-6)
    if a.arch in ("gemma2", "gemma3"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_sliding_window(a.window)
    w.add_vocab_size(a.vocab)
    w.add_file_type({"Q4_K": gguf.LlamaFileType.MOSTLY_Q4_K_M, "Q5_K": gguf.LlamaFileType.MOSTLY_Q5_K_M,
                     "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
                     "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "Q5_0": gguf.LlamaFileType.MOSTLY_Q5_0,
                     "Q5_1": gguf.LlamaFileType.MOSTLY_Q5_1}[a.linears])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(tok["pre"])
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    w.add_token_merges(tok["merges"])
    w.add_bos_token_id(tok["bos"])
    w.add_eos_token_id(tok["eos"])
    w.add_chat_template(tok["template"])
    plan = tensor_plan(a)
    for name, kind, rows, k in plan:
        if kind == Q.F32:
            w.add_tensor_info(name, (k,), np.dtype(np.float32), k * 4)
        else:
            block, size = gguf.GGML_QUANT_SIZES[kind]
            w.add_tensor_info(name, (rows, k // block * size), np.dtype(np.uint8), rows * k // block * size, kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(a.seed)
    for i, (name, kind, rows, k) in enumerate(plan):
        data = np.ones(k, dtype=np.float32) if kind == Q.F32 else random_blocks(kind, rows, k, rng)
        w.write_tensor_data(data)
        if i % 50 == 0:
            print(f"{i + 1}/{len(plan)} {name}", file=sys.stderr, flush=True)
    w.close()
    print(f"wrote {a.out} ({a.out.stat().st_size / 1e9:.2f} GB)", file=sys.stderr)


if __name__ == "__main__":
    main()
