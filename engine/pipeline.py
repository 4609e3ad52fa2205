"""Jobs over documents: summarize or ask, single-pass when the document fits the model's
window, map-reduce over window-sized sections when it does not. Generators yield events
(Status, Stage progress, TextDelta) and end with a Result; the CLI renders them."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Iterator

from engine import prompts as P
from engine.config import CacheConfig, GenerationConfig
from engine.decode import Finished, Progress, Tokens, generate
from engine.errors import DocumentTooLong, EmptyDocument
from engine.model import LoadedModel

STRATEGIES = ("auto", "single", "map-reduce")
PART_MAX_TOKENS = (48, 160)  # a section's partial summary or answer: --max-tokens clamped to this range


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

    @property
    def decode_tokens_per_second(self) -> float:
        return self.generated_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def add(self, fin: Finished) -> None:
        self.prompt_tokens += sum(fin.prompt_tokens)
        self.generated_tokens += fin.generated_tokens
        self.prefill_seconds += fin.prefill_seconds
        self.decode_seconds += fin.decode_seconds
        self.calls += 1
        self.cache = fin.cache_stats

    def to_json(self) -> dict:
        out = asdict(self)
        out["decode_tokens_per_second"] = round(self.decode_tokens_per_second, 3)
        out["prefill_seconds"] = round(self.prefill_seconds, 4)
        out["decode_seconds"] = round(self.decode_seconds, 4)
        if self.question is None:
            del out["question"]
        return out


@dataclass
class Runner:
    """Everything a job needs: the model and the engine settings."""

    lm: LoadedModel
    cache: CacheConfig
    gen: GenerationConfig
    strategy: str = "auto"

    def complete(self, prompt: list[int], label: str, max_tokens: int, result: Result,
                 stream: bool) -> Iterator[Status | Stage | TextDelta]:
        """One model call; yields progress (and text deltas if stream); returns the answer text."""
        gen = GenerationConfig(max_tokens, self.gen.temperature, self.gen.top_p, self.gen.seed,
                               P.stop_ids(self.lm.tokenizer))
        ids: list[int] = []
        shown = ""
        for event in generate(self.lm.model, [prompt], self.cache, gen):
            if isinstance(event, Progress):
                yield Stage(label, event.done, event.total)
            elif isinstance(event, Tokens):
                if event.ids[0] is not None:
                    ids.append(event.ids[0])
                    if stream:
                        text = self.lm.tokenizer.decode(ids, skip_special_tokens=True)
                        if len(text) > len(shown) and not text.endswith("\ufffd"):
                            yield TextDelta(text[len(shown):])
                            shown = text
            elif isinstance(event, Finished):
                result.add(event)
        text = self.lm.tokenizer.decode(ids, skip_special_tokens=True)
        if stream and len(text) > len(shown):
            yield TextDelta(text[len(shown):])
        return text.strip()

    @property
    def part_tokens(self) -> int:
        """Most tokens of one section's partial answer: about the final answer's length."""
        lo, hi = PART_MAX_TOKENS
        return min(max(self.gen.max_tokens, lo), hi)

    def budget(self, instruction: str, max_tokens: int) -> int:
        """Document tokens that fit in one call next to the instruction and the answer."""
        return self.lm.max_context - P.overhead_tokens(self.lm.tokenizer, instruction) - max_tokens - 2


def count_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def split_sections(tokenizer, text: str, budget: int) -> list[str]:
    """Cut text into sections of at most `budget` tokens, at paragraph breaks where possible."""
    sections, current, used = [], [], 0
    for para in [p for p in text.split("\n\n") if p.strip()]:
        n = count_tokens(tokenizer, para) + 2
        if n > budget:  # a huge paragraph: cut by tokens
            ids = tokenizer(para, add_special_tokens=False)["input_ids"]
            pieces = [tokenizer.decode(ids[i : i + budget - 2]) for i in range(0, len(ids), budget - 2)]
        else:
            pieces = [para]
        for piece in pieces:
            m = min(n, budget)
            if used + m > budget and current:
                sections.append("\n\n".join(current))
                current, used = [], 0
            current.append(piece)
            used += m
    if current:
        sections.append("\n\n".join(current))
    return sections


def choose_strategy(runner: Runner, doc_tokens: int, instruction: str) -> str:
    fits = doc_tokens <= runner.budget(instruction, runner.gen.max_tokens)
    if runner.strategy == "single" and not fits:
        raise DocumentTooLong(
            f"the document has {doc_tokens} tokens but {runner.lm.name} takes at most "
            f"{runner.budget(instruction, runner.gen.max_tokens)} here; use --strategy auto or map-reduce"
        )
    if runner.strategy == "map-reduce":
        return "map-reduce"
    return "single" if fits else "map-reduce"


def summarize(runner: Runner, text: str, source: str) -> Iterator[Status | Stage | TextDelta | Result]:
    """Summarize one document (single pass or hierarchical map-reduce)."""
    if not text.strip():
        raise EmptyDocument(f"{source}: the document is empty")
    tok = runner.lm.tokenizer
    n = count_tokens(tok, text)
    result = Result("", source, runner.lm.name, choose_strategy(runner, n, P.SUMMARIZE))
    if result.strategy == "single":
        prompt = P.build_prompt(tok, text, P.SUMMARIZE).ids
        result.text = yield from runner.complete(prompt, "prefill", runner.gen.max_tokens, result, stream=True)
        yield result
        return
    notes = text
    level = 0
    while True:
        budget = runner.budget(P.SUMMARIZE_PART, runner.part_tokens)
        sections = split_sections(tok, notes, budget)
        if level == 0:
            result.sections = len(sections)
        yield Status(f"{source}: {n} tokens, over the window; summarizing {len(sections)} sections")
        parts = []
        for i, section in enumerate(sections):
            prompt = P.build_prompt(tok, section, P.SUMMARIZE_PART).ids
            label = f"section {i + 1}/{len(sections)}"
            parts.append((yield from runner.complete(prompt, label, runner.part_tokens, result, stream=False)))
        notes = "\n\n".join(f"Part {i + 1}: {p}" for i, p in enumerate(parts))
        level += 1
        if count_tokens(tok, notes) <= runner.budget(P.SUMMARIZE_REDUCE, runner.gen.max_tokens) or level > 4:
            break
    prompt = P.build_prompt(tok, notes, P.SUMMARIZE_REDUCE).ids
    result.text = yield from runner.complete(prompt, "combine", runner.gen.max_tokens, result, stream=True)
    yield result


def ask(runner: Runner, text: str, source: str, question: str) -> Iterator[Status | Stage | TextDelta | Result]:
    """Answer a question about a document (or corpus); long ones are asked section by section."""
    if not text.strip():
        raise EmptyDocument(f"{source}: the document is empty")
    tok = runner.lm.tokenizer
    instruction = P.ASK.format(question=question)
    n = count_tokens(tok, text)
    result = Result("", source, runner.lm.name, choose_strategy(runner, n, instruction), question=question)
    if result.strategy == "single":
        prompt = P.build_prompt(tok, text, instruction).ids
        result.text = yield from runner.complete(prompt, "prefill", runner.gen.max_tokens, result, stream=True)
        yield result
        return
    sections = split_sections(tok, text, runner.budget(P.ASK_PART.format(question=question), runner.part_tokens))
    result.sections = len(sections)
    yield Status(f"{source}: {n} tokens, over the window; asking {len(sections)} sections")
    found = []
    for i, section in enumerate(sections):
        prompt = P.build_prompt(tok, section, P.ASK_PART.format(question=question)).ids
        answer = yield from runner.complete(prompt, f"section {i + 1}/{len(sections)}", runner.part_tokens, result,
                                           False)
        if P.NOT_FOUND.lower() not in answer.lower() and answer:
            found.append(answer)
    if not found:
        result.text = "The document does not appear to answer this question."
        yield TextDelta(result.text)
    elif len(found) == 1:
        result.text = found[0]
        yield TextDelta(result.text)
    else:
        notes = "\n".join(f"- {a}" for a in found)
        prompt = P.build_prompt(tok, notes, P.ASK_REDUCE.format(question=question)).ids
        result.text = yield from runner.complete(prompt, "combine", runner.gen.max_tokens, result, stream=True)
    yield result
