"""Decoding through transformers' logits processors (engine.generate.sampling): what each setting does,
that the look-back processors see only the answer, and that every cache mode decodes through them alike."""
from __future__ import annotations

import math

import pytest
import torch
from transformers import NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor

from engine.config import CacheConfig, GenerationConfig
from engine.errors import BadArgument
from engine.generate.engine import Engine, Finished
from engine.generate.sampling import NoRepeatNGram, Sampler, argmax_ids, build_processors, history_ids

CPU = torch.device("cpu")


def test_every_processor_off_is_a_plain_argmax():
    gen = GenerationConfig()
    assert len(build_processors(gen)) == 0 and gen.processors_off
    logits = torch.randn(3, 50)
    assert torch.equal(Sampler(gen, CPU)(logits, [[1, 2], [3], [4, 5, 6]]), logits.argmax(-1))


def test_repeat_penalty_sees_the_answer_not_the_prompt():
    logits = torch.zeros(1, 10)
    logits[0, 7] = 2.0  # token 7 leads
    logits[0, 3] = 1.9
    sampler = Sampler(GenerationConfig(repeat_penalty=1.5), CPU)
    prompt = [7, 7, 7, 1]  # 7 is all over the document: no penalty for quoting it
    assert sampler(logits, [prompt]).item() == 7
    assert sampler(logits, [prompt + [7]]).item() == 3  # once in the answer it is penalised
    expected = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([[7]]), logits.clone())
    assert torch.equal(sampler.scores(logits, [prompt + [7]]), expected)


def test_no_repeat_ngram_bans_the_repeat_within_the_answer():
    sampler = Sampler(GenerationConfig(no_repeat_ngram=3), CPU)
    logits = torch.zeros(1, 10)
    logits[0, 7] = 5.0
    prompt = [4, 5, 7]  # the same 3-gram in the prompt does not count
    assert sampler(logits, [prompt]).item() == 7
    answer = [4, 5, 7, 1, 4, 5]
    scores = sampler.scores(logits, [prompt + answer])
    assert scores[0, 7] == -math.inf and sampler(logits, [prompt + answer]).item() != 7


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_our_no_repeat_ngram_equals_transformers(n):
    """NoRepeatNGram (engine.generate.sampling) against transformers' NoRepeatNGramLogitsProcessor: the same
    scores on histories with repeats (a 6-token alphabet), of every length from 0, 1-3 rows, ids past the
    vocabulary; the caller's scores untouched."""
    g = torch.Generator().manual_seed(n)
    ours, theirs = NoRepeatNGram(n), NoRepeatNGramLogitsProcessor(n)
    banned_somewhere = False
    for length in range(0, 30):
        for rows in (1, 3):
            ids = torch.randint(0, 6, (rows, length), generator=g)
            if length > 3:
                ids[0, 2] = 40  # past the 32-token vocabulary
            scores = torch.randn(rows, 32, generator=g)
            before = scores.clone()
            got = ours(ids, scores)
            assert torch.equal(got, theirs(ids, scores.clone())), (length, rows)
            assert torch.equal(scores, before)
            banned_somewhere |= bool(torch.isinf(got).any())
    assert banned_somewhere


def test_argmax_ids_is_torchs_argmax():
    """argmax_ids (numpy's argmax on CPU floats) against torch's: ties to the first maximum, NaN the largest, -inf
    rows, 1-3 dims, a strided view, fp64; bf16 and tensors that need grad take torch's own."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 4, (5, 300), generator=g).float()  # many ties
    x[1, 7] = x[1, 200] = math.nan
    x[2] = -math.inf
    cases = [x, x[0], x.reshape(5, 3, 100), x[:, ::3], x.double(), x.bfloat16(), x.clone().requires_grad_()]
    for case in cases:
        got = argmax_ids(case)
        assert got.dtype == torch.long and torch.equal(got, case.argmax(-1)), case.shape
    with torch.inference_mode():
        assert torch.equal(argmax_ids(x * 1), x.argmax(-1))


def test_top_k_and_min_p_only_when_sampling():
    assert len(build_processors(GenerationConfig(top_k=5, min_p=0.1))) == 0  # greedy: nothing to do
    gen = GenerationConfig(temperature=1.0, top_k=3, seed=3)
    sampler = Sampler(gen, CPU)
    logits = torch.randn(4, 100)
    allowed = logits.topk(3, dim=-1).indices
    for _ in range(20):
        ids = sampler(logits, [[1]] * 4)
        assert all(i in row for i, row in zip(ids.tolist(), allowed.tolist()))
    probs = Sampler(GenerationConfig(temperature=1.0, min_p=0.5), CPU).probs(logits, [[1]] * 4)
    top = torch.softmax(logits, -1).max(-1, keepdim=True).values
    assert torch.all((probs > 0) <= (torch.softmax(logits, -1) >= 0.5 * top))


def test_history_ids_pads_rows_and_takes_empty_answers():
    assert history_ids([[], []], CPU).shape == (2, 0)
    assert history_ids([[5, 6], [7]], CPU).tolist() == [[5, 6], [7, 7]]


@pytest.mark.parametrize("field, value", [("repeat_penalty", 0.0), ("repeat_penalty", float("nan")),
                                          ("no_repeat_ngram", -1), ("top_k", -1), ("min_p", 1.0),
                                          ("temperature", float("nan")), ("top_p", float("nan"))])
def test_bad_settings_are_refused(field, value):
    with pytest.raises(BadArgument):
        GenerationConfig(**{field: value})


def _tokens(model, prompt, config, gen):
    return next(e for e in Engine(model, config).generate([prompt], gen) if isinstance(e, Finished)).tokens[0]


def test_processors_apply_identically_to_every_exact_cache_mode(tiny_model):
    # k >= context and a window covering the context are exact: with the same processors every mode must
    # give the same tokens; the processors must change the greedy output and remove its repeated 3-grams
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 320, (120,), generator=g).tolist()
    plain = GenerationConfig(max_tokens=40)
    gen = GenerationConfig(max_tokens=40, repeat_penalty=1.3, no_repeat_ngram=3)
    configs = [CacheConfig(mode="full", chunk_size=64), CacheConfig(mode="specache", k=512, chunk_size=64),
               CacheConfig(mode="specache", k=512, chunk_size=64, prefetch="current"),
               CacheConfig(mode="window", window=512, chunk_size=64)]
    outs = [_tokens(tiny_model, prompt, c, gen) for c in configs]
    assert all(o == outs[0] for o in outs[1:])
    assert outs[0] != _tokens(tiny_model, prompt, configs[0], plain)
    grams = [tuple(outs[0][i: i + 3]) for i in range(len(outs[0]) - 2)]
    assert len(grams) == len(set(grams))
