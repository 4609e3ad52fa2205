"""End-to-end truth with the embedded SmolLM2-135M-Instruct on real public-domain documents.
Slow (seconds to a minute each); they run in CI too, so keep them few."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from engine.config import CacheConfig, GenerationConfig
from engine.generate.engine import Engine, Finished
from engine.inputs.documents import load_document
from engine.inputs.prompts import SUMMARIZE, build_prompt
from engine.jobs.pipeline import Result, Runner, ask
from specache_cli.app import app

pytestmark = pytest.mark.slow
EXAMPLES = Path(__file__).parent.parent / "examples"


@pytest.fixture(scope="module")
def lm():
    from engine.model.loading import load_model

    return load_model(None, device="cpu")


@pytest.fixture(scope="module")
def report_text():
    return load_document(str(EXAMPLES / "report.pdf")).text


def first_tokens(tokenizer, text: str, n: int) -> str:
    return tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"][:n])


def test_embedded_model_loads_without_converting_once_converted(lm, monkeypatch):
    """The GGUF is converted once (its folder kept, keyed by its content); a later load reads that folder (it
    was asserted as load_seconds < 3, a timing, which a loaded machine broke)."""
    from engine.model import gguf_convert
    from engine.model.loading import load_model

    assert lm.name == "smollm2-135m-instruct"
    assert lm.max_context == 8192
    monkeypatch.setattr(gguf_convert, "convert", lambda *a: pytest.fail("converted again"))
    again = load_model(None, device="cpu")
    assert again.name == lm.name and again.max_context == lm.max_context


def test_summarize_real_pdf_cli():
    r = CliRunner().invoke(app, ["summarize", str(EXAMPLES / "report.pdf"), "--max-tokens", "48", "--json",
                                 "--quiet", "--no-store"])
    assert r.exit_code == 0, r.stderr
    obj = json.loads(r.stdout)
    assert obj["strategy"] == "single" and obj["prompt_tokens"] > 6000
    words = [w for w in obj["text"].split() if w.isalpha()]
    assert len(words) >= 10, obj["text"]


@pytest.mark.parametrize("depth,key", [(0.1, "48213"), (0.5, "90617"), (0.9, "27354")])
def test_ask_finds_planted_passkey(lm, report_text, depth, key):
    paragraphs = first_tokens(lm.tokenizer, report_text, 3000).split("\n\n")
    at = int(len(paragraphs) * depth)
    paragraphs.insert(at, f"The secret passkey is {key}. Remember it, the passkey is {key}.")
    runner = Runner(lm, CacheConfig(), GenerationConfig(max_tokens=16))
    result = [e for e in ask(runner, "\n\n".join(paragraphs), "report", "What is the secret passkey?")
              if isinstance(e, Result)][0]
    assert key in result.text, result.text


def test_specache_with_k_at_least_context_equals_dynamic_cache_on_real_text(lm, report_text):
    """The engine on its own Llama classes (engine.model.llama, what a run loads) against transformers'
    generate on transformers' LlamaForCausalLM with the same weights, DynamicCache and SDPA."""
    from engine.model.llama import CausalLM
    from engine.model.loading import load_model, prepare_model, resolve_dtype

    prompt = build_prompt(lm.tokenizer, first_tokens(lm.tokenizer, report_text, 1500), SUMMARIZE).ids
    stock = prepare_model(load_model(None, device="cpu", classes="transformers").model)
    assert isinstance(lm.model, CausalLM) and not isinstance(stock, CausalLM)
    stock.set_attn_implementation("sdpa")
    with torch.inference_mode():
        ref = stock.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False)
    ref = ref[0, len(prompt):].tolist()
    model = prepare_model(lm.model)  # the exact fp32 path (what --dtype float32 loads); auto may prefill in bf16
    try:
        config = CacheConfig(mode="specache", k=8192, bits=2, group=64, chunk_size=256)
        fin = next(e for e in Engine(model, config).generate([prompt], GenerationConfig(max_tokens=24))
                   if isinstance(e, Finished))
    finally:
        prepare_model(model, resolve_dtype("auto", torch.device("cpu"))[1])
    assert fin.tokens[0] == ref


def test_long_pdf_is_summarized_by_map_reduce():
    r = CliRunner().invoke(app, ["summarize", str(EXAMPLES / "long-report.pdf"), "--max-tokens", "32", "--json",
                                 "--quiet", "--no-store"])
    assert r.exit_code == 0, r.stderr
    obj = json.loads(r.stdout)
    assert obj["strategy"] == "map-reduce"
    assert obj["prompt_tokens"] > 17000 and obj["sections"] >= 3
    assert len(obj["text"].split()) >= 8
