"""Next-token choice, built from transformers' logits processors (the same ones `generate` uses).

A Sampler is made once per job from the GenerationConfig: its LogitsProcessorList turns a step's
logits into scores, then the token is the argmax (temperature 0) or a draw from the scores'
softmax with the job's seeded generator. Processors, in the order transformers' generate applies
them: repetition penalty, no-repeat n-gram (both look back), then, when sampling, temperature,
top-k, top-p, min-p. Every cache mode decodes through the same Sampler, so they apply identically.
One is our own: NoRepeatNGram, transformers' NoRepeatNGramLogitsProcessor's rule (tests/test_sampling.py holds
the two equal) without its ~8 vocabulary-sized tensor ops a step (0.2-0.4 ms on one CPU thread for a 262k
vocabulary: 1-2% of a Gemma 3 270M step).

The step loops hand the Sampler each row's token history (prompt + output so far). The look-back
processors see only the answer: the Sampler remembers each row's history length at its first call
(the prompt) and gives the processors what came after it. A penalty over the prompt would punish
the document's own words, which answers are meant to quote; llama.cpp's `repeat_last_n` window
includes the prompt, ours does not."""
from __future__ import annotations

import torch
from transformers import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from engine.config import GenerationConfig


def argmax_ids(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) (int64; the first of equal maxima, NaN the largest, as torch's). A CPU float tensor takes numpy's
    vectorized argmax: torch's CPU argmax read a 262k vocabulary in ~145 us on one thread, numpy's in ~11 (Zen 4)."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and not x.requires_grad:
        return torch.as_tensor(x.numpy().argmax(-1), dtype=torch.long)
    return x.argmax(-1)


class NoRepeatNGram:
    """No n-gram twice in a row's history: a token that would complete an n-gram already there scores -inf
    (transformers' NoRepeatNGramLogitsProcessor's rule). A pass over each row's ids in Python and a write only
    where a token is banned, into a copy: the caller's logits are left as they are."""

    def __init__(self, n: int):
        self.n = n

    def banned(self, tokens: list[int]) -> list[int]:
        """The tokens that follow an earlier occurrence of the last n - 1 tokens."""
        n, size = self.n, len(tokens)
        if size + 1 < n:
            return []
        last = tokens[size - n + 1:]
        if not last:  # n == 1: every token seen
            return tokens
        first = last[0]
        return [tokens[i + n - 1] for i in range(size - n + 1) if tokens[i] == first and tokens[i:i + n - 1] == last]

    def __call__(self, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = scores
        for row, tokens in enumerate(ids.tolist()):
            banned = [t for t in self.banned(tokens) if t < scores.shape[-1]]
            if banned:
                out = scores.clone() if out is scores else out
                out[row, banned] = -float("inf")
        return out


def build_processors(gen: GenerationConfig) -> LogitsProcessorList:
    """The processors of these settings, in the order transformers' generate applies them (empty when
    every one is off)."""
    processors = LogitsProcessorList()
    if gen.repeat_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(gen.repeat_penalty))
    if gen.no_repeat_ngram > 0:
        processors.append(NoRepeatNGram(gen.no_repeat_ngram))
    if gen.temperature > 0:
        if gen.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(gen.temperature))
        if gen.top_k > 0:
            processors.append(TopKLogitsWarper(gen.top_k))
        if gen.top_p < 1.0:
            processors.append(TopPLogitsWarper(gen.top_p))
        if gen.min_p > 0:
            processors.append(MinPLogitsWarper(gen.min_p))
    return processors


def history_ids(history: list[list[int]], device: torch.device, window: int | None = None) -> torch.Tensor:
    """Rows of token ids as one tensor [B, n] for the processors: each row's last `window` tokens
    (all if None), left-padded with the row's own first token to the longest row (n may be 0)."""
    rows = [h[-window:] if window else h for h in history]
    n = max(map(len, rows), default=0)
    padded = [[(r[0] if r else 0)] * (n - len(r)) + r for r in rows]
    return torch.tensor(padded, dtype=torch.long, device=device).reshape(len(rows), n)


class Sampler:
    """Picks one token per row from logits [B, V]; the same seed gives the same tokens."""

    def __init__(self, gen: GenerationConfig, device: torch.device):
        self.gen = gen
        self.processors = build_processors(gen)
        self.greedy = gen.temperature <= 0
        self.generator = torch.Generator(device=device).manual_seed(gen.seed)
        self.prompt_lengths: list[int] | None = None  # each row's history length at the first call

    def answers(self, history: list[list[int]]) -> list[list[int]]:
        """Each row's tokens after its prompt (the first call's history is the prompt)."""
        if self.prompt_lengths is None or len(self.prompt_lengths) != len(history):
            self.prompt_lengths = [len(h) for h in history]
        return [h[n:] for h, n in zip(history, self.prompt_lengths)]

    def keep_rows(self, source: list[int]) -> None:
        """Rows left the batch: row i is now what row source[i] was (engine.generate.steps.drop_finished)."""
        if self.prompt_lengths is not None:
            self.prompt_lengths = [self.prompt_lengths[s] for s in source]

    def scores(self, logits: torch.Tensor, history: list[list[int]]) -> torch.Tensor:
        """logits [B, V] -> processed scores [B, V] (fp32; -inf where a processor removed a token)."""
        scores = logits.float()
        answers = self.answers(history)
        if len(self.processors):
            ids = history_ids(answers, logits.device)
            for processor in self.processors:  # as LogitsProcessorList does, without its per-call signature check
                scores = processor(ids, scores)
        return scores

    def probs(self, logits: torch.Tensor, history: list[list[int]]) -> torch.Tensor:
        """The distribution a token is drawn from [B, V] (one-hot at the argmax when greedy)."""
        scores = self.scores(logits, history)
        if self.greedy:
            return torch.nn.functional.one_hot(argmax_ids(scores), scores.shape[-1]).float()
        return torch.softmax(scores, dim=-1)

    def draw(self, probs: torch.Tensor) -> torch.Tensor:
        """One token per row from probs [B, V] with the job's generator. -> [B]"""
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)

    def __call__(self, logits: torch.Tensor, history: list[list[int]]) -> torch.Tensor:
        """logits [B, V] -> ids [B] (long)."""
        scores = self.scores(logits, history)
        if self.greedy:
            return argmax_ids(scores)
        return self.draw(torch.softmax(scores, dim=-1))
