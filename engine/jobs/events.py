"""What the jobs over documents yield (engine/jobs/pipeline.py): Status, Stage progress, TextDelta of the
answer being streamed, a Result (the --json contract) or a Failed document; and the cut of an answer that
the token budget ended, at its last complete sentence."""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

import torch

from engine.errors import SpecacheError
from engine.generate.engine import Finished
from engine.generate.steps import merge_exact_stats

# while streaming, the last HOLD_TOKENS of the --max-tokens budget are shown a sentence at a time, so an
# answer cut by the budget can end at its last complete sentence without unprinting anything
HOLD_TOKENS = 64
SENTENCE_END = re.compile(r"""[.!?]["')\]”’]*(?=\s|$)""")


def sentence_end(text: str, start: int = 0) -> int:
    """The length of text up to its last complete sentence (after `start`), or 0 when there is none."""
    ends = [m.end() for m in SENTENCE_END.finditer(text, start)]
    return ends[-1] if ends else 0


def cut_at_sentence(text: str, shown: int = 0) -> str:
    """An answer cut by the token budget: up to its last complete sentence when there is one at or after
    the `shown` characters already streamed; else the whole text (nothing to cut, or it was printed)."""
    end = sentence_end(text)
    return text[:end] if end and end >= shown else text


@dataclass
class Status:
    message: str


@dataclass
class Stage:
    """Prefill progress of one model call (label says which)."""

    label: str
    done: int
    total: int


@dataclass
class TextDelta:
    """New text of the final answer, for streaming to stdout."""

    text: str


@dataclass
class Failed:
    """A document of a multi-document run that could not be done (the others go on)."""

    source: str
    error: SpecacheError


@dataclass
class Result:
    """One answer; `to_json` is the documented --json contract."""

    text: str
    source: str
    model: str
    strategy: str
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    calls: int = 0
    question: str | None = None
    sections: int = 1
    cache: dict = field(default_factory=dict)
    # "stop": the model ended its answer; "length": --max-tokens ended it (the text then ends at its last
    # complete sentence when it has one)
    finish_reason: str = "stop"

    @property
    def decode_tokens_per_second(self) -> float:
        return self.generated_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    batch: int = 1  # rows decoded together in this result's (last) model call
    threads: int = field(default_factory=torch.get_num_threads)  # torch CPU threads of the process that ran it

    def add(self, fin: Finished, row: int = 0) -> None:
        """Account one model call (row `row` of its batch; times are the batch's)."""
        self.prompt_tokens += fin.prompt_tokens[row]
        self.generated_tokens += len(fin.tokens[row])
        self.prefill_seconds += fin.prefill_seconds
        self.decode_seconds += fin.decode_seconds
        self.calls += 1
        self.batch = len(fin.tokens)
        self.cache = merge_exact_stats(self.cache, fin.cache_stats)  # exact mode: figures over every call
        self.add_store(fin.store[row] if fin.store else None)

    plan: dict = field(default_factory=dict)
    # the document store, None without one: hit (every entry was), key (the first), bytes, seconds (load on a
    # hit, write on a miss), entries and hits (several for map-reduce sections)
    store: dict | None = None

    def add_store(self, info: dict | None) -> None:
        """Account one call's use of the document store (several for map-reduce sections)."""
        if info is None:
            return
        if self.store is None:
            self.store = {"hit": info["hit"], "key": info["key"], "bytes": info["bytes"],
                          "seconds": round(info["seconds"], 4), "entries": 1, "hits": int(info["hit"])}
            return
        self.store["hit"] = self.store["hit"] and info["hit"]
        self.store["bytes"] = (self.store["bytes"] or 0) + (info["bytes"] or 0)
        self.store["seconds"] = round(self.store["seconds"] + info["seconds"], 4)
        self.store["entries"] += 1
        self.store["hits"] += int(info["hit"])

    def to_json(self) -> dict:
        out = asdict(self)
        out["decode_tokens_per_second"] = round(self.decode_tokens_per_second, 3)
        out["prefill_seconds"] = round(self.prefill_seconds, 4)
        out["decode_seconds"] = round(self.decode_seconds, 4)
        if self.question is None:
            del out["question"]
        return out
