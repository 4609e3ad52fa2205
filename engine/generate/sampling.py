"""Next-token choice, built from transformers' logits processors (the same ones `generate` uses).

A Sampler is made once per job from the GenerationConfig: its LogitsProcessorList turns a step's
logits into scores (temperature, top-p, ...), then the token is the argmax (temperature 0) or a
draw from the scores' softmax with the job's seeded generator. The step loops hand it each row's
token history (prompt + output so far) for the processors that look back (repetition controls)."""
from __future__ import annotations

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

from engine.config import GenerationConfig


def build_processors(gen: GenerationConfig) -> LogitsProcessorList:
    """The processors of these settings, in the order transformers' generate applies them."""
    processors = LogitsProcessorList()
    if gen.temperature > 0:
        if gen.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(gen.temperature))
        if gen.top_p < 1.0:
            processors.append(TopPLogitsWarper(gen.top_p))
    return processors


def history_ids(history: list[list[int]], device: torch.device, window: int | None = None) -> torch.Tensor:
    """Rows of token ids as one tensor [B, n] for the processors: each row's last `window` tokens
    (all if None), left-padded with the row's own first token to the longest row."""
    rows = [h[-window:] if window else h for h in history]
    n = max(1, max(map(len, rows)))
    padded = [[(r[0] if r else 0)] * (n - len(r)) + r for r in rows]
    return torch.tensor(padded, dtype=torch.long, device=device)


class Sampler:
    """Picks one token per row from logits [B, V]; the same seed gives the same tokens."""

    def __init__(self, gen: GenerationConfig, device: torch.device):
        self.gen = gen
        self.processors = build_processors(gen)
        self.greedy = gen.temperature <= 0
        self.generator = torch.Generator(device=device).manual_seed(gen.seed)

    def scores(self, logits: torch.Tensor, history: list[list[int]]) -> torch.Tensor:
        """logits [B, V] -> processed scores [B, V] (fp32; -inf where a processor removed a token)."""
        scores = logits.float()
        if len(self.processors):
            scores = self.processors(history_ids(history, logits.device), scores)
        return scores

    def probs(self, logits: torch.Tensor, history: list[list[int]]) -> torch.Tensor:
        """The distribution a token is drawn from [B, V] (one-hot at the argmax when greedy)."""
        scores = self.scores(logits, history)
        if self.greedy:
            return torch.nn.functional.one_hot(scores.argmax(-1), scores.shape[-1]).float()
        return torch.softmax(scores, dim=-1)

    def draw(self, probs: torch.Tensor) -> torch.Tensor:
        """One token per row from probs [B, V] with the job's generator. -> [B]"""
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)

    def __call__(self, logits: torch.Tensor, history: list[list[int]]) -> torch.Tensor:
        """logits [B, V] -> ids [B] (long)."""
        scores = self.scores(logits, history)
        if self.greedy:
            return scores.argmax(dim=-1)
        return self.draw(torch.softmax(scores, dim=-1))
