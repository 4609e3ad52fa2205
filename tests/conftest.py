"""Shared fixtures: tiny randomly initialised GQA Llama models (fast, real code paths) and the
embedded SmolLM2 (slow tests only)."""
from __future__ import annotations

import os
import shutil

# SPECACHE_TEST_DEVICE=cuda runs the tiny-model engine tests on a GPU (scripts/gpu_check.py does); on the
# CPU the Triton kernels run in Triton's interpreter (read when Triton is first imported: before torch,
# transformers or anything else may import it)
TEST_DEVICE = os.environ.get("SPECACHE_TEST_DEVICE", "cpu")
if TEST_DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from engine.model.loading import prepare_model  # noqa: E402

# The native kernels everywhere they apply (not only where this CPU's calibration found them faster),
# so that every test exercises them; tests/test_calibrate.py tests the calibration itself.
os.environ.setdefault("SPECACHE_NATIVE_CALIBRATE", "0")


# One torch (and so native) thread per test unless SPECACHE_TEST_THREADS says: a CLI run sets torch's global
# count from the free cores it samples, so without this a test's thread count depends on the tests before it and
# on the machine's load; and on a loaded 2-core machine every 2-thread parallel region of a tiny model's op
# waits for a descheduled thread (tests/test_fused.py's kernel tests: 395 s at 2 threads vs 41 s at 1, load 6.7).
# Thread counts are tested on purpose where they matter (test_fused_results_do_not_depend_on_the_thread_count,
# test_quant.py's test_native_threads_and_strided_inputs, tests/test_threads.py).
TEST_THREADS = int(os.environ.get("SPECACHE_TEST_THREADS", "1"))


@pytest.fixture(autouse=True)
def one_thread_per_test():
    torch.set_num_threads(TEST_THREADS)
    yield


def sigint_as_in_a_terminal() -> None:
    """Popen(preexec_fn=...) of a child that a test interrupts: SIGINT back to its default, as a
    terminal's foreground job has it (a suite started in a script's background inherits SIGINT ignored,
    and the child would not see the Ctrl-C the test sends)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def kivi_guide_part(keys, values, qend: int, bits: int, group: int, value_group: int, sinks: int, r=None,
                    outliers: int = 0, chosen_from: int = 0):
    """The KIVI references' guide region: positions [0, qend) of keys / values [b, H_kv, L, D] as
    dequantize(quantize(.)) of K R and V R rotated back by R^T (R [D, D] or None), the first sinks exact.
    With `outliers` channels: per KV head the channels of largest |k| over the first `chosen_from`
    positions are min-max quantized at 4 bits per group of g tokens (fp16 scale and zero) and zeroed
    before the keys are rotated and quantized (outlier_keys_reference), their reconstruction added after R^T.
    -> (keys, values) [b, H_kv, L, D] with the positions from qend on untouched.

    Kept apart from the engine on purpose: the engine's guided attention (engine/kvcache/guided.py's
    torch path, the native fused call) scores the packed codes and mixes exact and guide parts in one
    softmax; this reference dequantizes and attends densely, so a bug in those paths shows as a mismatch.
    Only the quantizer itself (quantize / dequantize, tested on its own in tests/test_quant.py) is shared."""
    from engine.kvcache import quant

    kr, vr = keys[:, :, :qend], values[:, :, :qend]
    if outliers:
        idx, k4 = outlier_keys_reference(kr, outliers, group, chosen_from)
        kr = kr.scatter(-1, idx, 0.0)
    if r is not None:
        kr, vr = kr @ r, vr @ r
    kq = quant.dequantize_keys(quant.quantize_keys(kr, bits, group))
    vq = quant.dequantize_values(quant.quantize_values(vr, bits, value_group))
    if r is not None:
        kq, vq = kq @ r.T, vq @ r.T
    if outliers:  # added: with R the rest's reconstruction is not exactly 0 in those channels
        kq = kq.scatter_add(-1, idx, k4)
    s = min(sinks, qend)
    kq[:, :, :s], vq[:, :, :s] = keys[:, :, :s], values[:, :, :s]
    return torch.cat([kq, keys[:, :, qend:]], dim=2), torch.cat([vq, values[:, :, qend:]], dim=2)


def outlier_keys_reference(k, count: int, group: int, chosen_from: int):
    """k [b, H, n, D] -> (idx [b, H, n, count]: per head the `count` channels of largest |k| over the
    first chosen_from positions, expanded over the positions; their 4-bit min-max reconstruction
    [b, H, n, count], groups of `group` positions, scale (max - min) / 15 and zero min rounded to fp16).
    Written apart from engine/kvcache/outliers.py on purpose: the guide's tests compare the engine's side
    guide with this one."""
    b, h, n, _ = k.shape
    idx = k[:, :, :chosen_from].abs().amax(2).topk(count, -1).indices[:, :, None, :].expand(-1, -1, n, -1)
    x = k.gather(-1, idx).reshape(b, h, n // group, group, count)
    lo, hi = x.amin(3, keepdim=True), x.amax(3, keepdim=True)
    s, z = ((hi - lo) / 15).half().float(), lo.half().float()
    codes = torch.round((x - z) / torch.where(s > 0, s, torch.ones_like(s))).clamp(0, 15)
    return idx, (codes * s + z).reshape(b, h, n, count)


def tiny_config(vocab: int = 320, max_pos: int = 2048, layers: int = 3) -> LlamaConfig:
    """3 layers, 6 query heads sharing 2 KV heads (GQA group 3), head dim 32."""
    return LlamaConfig(vocab_size=vocab, hidden_size=192, intermediate_size=256, num_hidden_layers=layers,
                       num_attention_heads=6, num_key_value_heads=2, head_dim=32,
                       max_position_embeddings=max_pos, bos_token_id=1, eos_token_id=2, pad_token_id=2)


def make_tiny_model(seed: int = 0, **kwargs) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(**kwargs)).eval()
    # larger-than-default weights make the random model's attention peaky, like a trained one
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
    return prepare_model(model)


@pytest.fixture(scope="session")
def tiny_model() -> LlamaForCausalLM:
    return make_tiny_model().to(TEST_DEVICE)


@pytest.fixture(scope="session")
def embedded_dir():
    """The converted embedded model folder (converts once per machine, ~20 s)."""
    from engine.model.loading import resolve_model_dir

    return resolve_model_dir(None)[1]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, embedded_dir):
    """A local HF folder: a tiny random Llama (1024-token window) with the real SmolLM2 tokenizer."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tiny-model")
    tok = AutoTokenizer.from_pretrained(embedded_dir)
    model = make_tiny_model(vocab=len(tok), max_pos=1024, layers=2)
    model.config.bos_token_id, model.config.eos_token_id = tok.bos_token_id, tok.eos_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    for extra in ("chat_template.jinja",):
        if (embedded_dir / extra).exists() and not (out / extra).exists():
            shutil.copy(embedded_dir / extra, out / extra)
    return out


def tokens_on_both_classes(stock, own, mode: str) -> None:
    """The engine's attention through a model's transformers class (stock) and our own (own): the same
    greedy tokens in `mode`, two rows of different lengths, chunked prefill (tests/test_llama.py,
    tests/test_gemma.py)."""
    from engine.config import CacheConfig, GenerationConfig
    from engine.generate.engine import Engine, Finished

    prompts = [torch.randint(3, 320, (150,)).tolist(), torch.randint(3, 320, (120,)).tolist()]
    config = CacheConfig(mode=mode, chunk_size=64, **({"k": 24} if mode == "specache" else {}))
    runs = []
    for model in (prepare_model(stock), prepare_model(own)):
        fin = next(e for e in Engine(model, config).generate(prompts, GenerationConfig(max_tokens=12))
                   if isinstance(e, Finished))
        runs.append(fin.tokens)
    assert runs[0] == runs[1] and len(runs[0][0]) == 12


def logits_on_both_classes(stock, own, attention: str) -> torch.Tensor:
    """Both classes with `attention`, on two rows of 90 tokens: logits equal bit for bit, and with
    logits_to_keep=3 too (tests/test_llama.py, tests/test_gemma.py). -> our class's logits."""
    ids = torch.randint(3, 320, (2, 90))
    stock.set_attn_implementation(attention)
    own.set_attn_implementation(attention)
    with torch.inference_mode():
        want, got = stock(input_ids=ids).logits, own(input_ids=ids).logits
        last = own(input_ids=ids, logits_to_keep=3).logits
        assert last.shape[1] == 3 and torch.equal(last, stock(input_ids=ids, logits_to_keep=3).logits)
    assert torch.equal(got, want)
    return got


def cuda_layout(monkeypatch) -> None:
    """Guided layers laid out as on CUDA (residual buffers of their own), decoded by the torch code (not the
    CPU's fused call); the guide watch on (with a stand-in's streams its check is deferred to its host thread)."""
    import engine.kvcache
    import engine.kvcache.guided
    from engine.kvcache.transfer import Transfer

    monkeypatch.setattr(engine.kvcache, "Transfer", lambda device: Transfer(device, residual_in_store=False))
    monkeypatch.setattr(engine.kvcache.guided, "fused_applies", lambda layer, q, step: False)
