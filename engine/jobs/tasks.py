"""What a job on Ray workers hands out (engine/jobs/workers.py): tasks of documents or questions, longest
first, in groups of similar length that an actor decodes as one batch; a task whose actor died is split
into one task a document (a question for ask) for its retry."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from engine.jobs.pipeline import Failed

CHARS_PER_TOKEN = 4  # the token estimate used to order documents (the driver holds no tokenizer)
DEFAULT_GROUP = 4  # documents handed to an actor at once (decoded together) when --batch is auto


@dataclass(frozen=True)
class Task:
    """Documents handed to one actor at once.

    kind "summarize": docs are (text, source) pairs, summarized together (one decode batch when
    they fit the window). kind "ask": one (text, source) corpus and the questions to answer on it.
    attempt: 1 the first time, 2 for the retry after the actor running it died."""

    key: int
    kind: str
    docs: tuple[tuple[str, str], ...]
    questions: tuple[str, ...] = ()
    attempt: int = 1

    @property
    def tokens(self) -> int:
        """Estimated document tokens (characters / 4), the order documents are handed out in."""
        return sum(estimate_tokens(text) for text, _ in self.docs)

    @property
    def label(self) -> str:
        names = [Path(s).name or s for _, s in self.docs]
        what = names[0] if len(names) == 1 else f"{names[0]} +{len(names) - 1}"
        if self.kind == "ask":
            what += f" ({len(self.questions)} question{'s' * (len(self.questions) != 1)})"
        return what

    def units(self) -> list[tuple[str, str | None]]:
        """(source, question) of every result this task yields."""
        if self.kind == "ask":
            return [(self.docs[0][1], q) for q in self.questions]
        return [(s, None) for _, s in self.docs]

    def split(self, next_key: Callable[[], int]) -> list["Task"]:
        """One task per document (per question for ask), as a retry: a second death then names one."""
        if self.kind == "ask":
            return [Task(next_key(), "ask", self.docs, (q,), attempt=2) for q in self.questions]
        return [Task(next_key(), "summarize", (d,), attempt=2) for d in self.docs]


def estimate_tokens(text: str) -> int:
    return len(text) // CHARS_PER_TOKEN + 1


def group_size(n: int, workers: int, batch: int | None) -> int:
    """Documents per task: --batch when given, else DEFAULT_GROUP, but small enough that every
    worker gets about two tasks (so the last ones to finish are short)."""
    want = batch if batch is not None else DEFAULT_GROUP
    return max(1, min(want, math.ceil(n / (2 * workers))))


def summarize_tasks(docs: Sequence[tuple[str, str]], workers: int, batch: int | None) -> list[Task]:
    """(text, source) documents -> tasks, longest first; each task holds documents of similar length."""
    order = sorted(docs, key=lambda d: estimate_tokens(d[0]), reverse=True)
    size = group_size(len(order), workers, batch)
    return [Task(i, "summarize", tuple(order[j:j + size])) for i, j in enumerate(range(0, len(order), size))]


def ask_tasks(text: str, source: str, questions: Sequence[str], workers: int, batch: int | None) -> list[Task]:
    """Questions on one corpus -> tasks of a few questions each (an actor answers them as one batch
    sharing the corpus prefill; with the store on, the corpus is prefilled once per machine)."""
    size = group_size(len(questions), workers, batch)
    return [Task(i, "ask", ((text, source),), tuple(questions[j:j + size]))
            for i, j in enumerate(range(0, len(questions), size))]


@dataclass
class FailedQuestion(Failed):
    """A question of ask that could not be answered (its error line names the question)."""

    question: str | None = None
