"""Jobs over documents: summarize or ask, single-pass when the document fits the model's
window, map-reduce over window-sized sections when it does not. Generators yield events
(Status, Stage progress, TextDelta) and end with a Result; the CLI renders them."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterator

from engine.config import CacheConfig, GenerationConfig
from engine.docstore.store import DocStore
from engine.errors import DocumentTooLong, SpecacheError
from engine.generate.engine import Engine, Finished, Progress, Tokens
from engine.generate.prefixes import DocStoreUse
from engine.inputs import prompts as P
from engine.jobs.events import HOLD_TOKENS, Failed, Result, Stage, Status, TextDelta, cut_at_sentence, sentence_end
from engine.jobs.sections import COUNT_PIECE_CHARS, count_tokens, document_tokens, split_sections, text_pieces
from engine.model.loading import LoadedModel
from engine.plan.planner import plan_for_run
from engine.plan.profiles import held_model_profile

STRATEGIES = ("auto", "single", "map-reduce")
PART_MAX_TOKENS = (48, 160)  # a section's partial summary or answer: --max-tokens clamped to this range

__all__ = ["STRATEGIES", "Runner", "Status", "Stage", "TextDelta", "Failed", "Result", "cut_at_sentence",
           "COUNT_PIECE_CHARS", "count_tokens", "text_pieces", "split_sections", "document_tokens", "summarize", "ask",
           "summarize_many", "ask_many"]


@dataclass
class Runner:
    """Everything a job needs: the model and the engine settings."""

    lm: LoadedModel
    cache: CacheConfig
    gen: GenerationConfig
    strategy: str = "auto"
    batch: int | None = None  # rows decoded together; None: ask the memory planner
    plan: dict = field(default_factory=dict)  # what the planner chose, for --json
    store: DocStore | None = None  # the persistent document store (engine.docstore.store); None: --no-store
    policy: type | None = None  # the mode's policy class, as the run resolved it (None: the engine resolves it)

    def __post_init__(self) -> None:
        use = DocStoreUse(self.store, self.lm.fingerprint, self.lm.name) if self.store is not None else None
        self.engine = Engine(self.lm.model, self.cache, use, self.policy)  # runs every model call of the jobs

    def batch_size(self, rows: int, context: int) -> int:
        """How many of `rows` sequences of `context` tokens (prompt + answer) to decode together. The plan
        (--json "plan") names the k the cache will fetch: the one its length grows it to (fetch_k)."""
        policy = self.engine.policy
        length = self.engine.cache_length(context)
        if self.batch is not None:
            self.plan = {"batch": min(self.batch, rows), "chosen_by": "flag"}
        else:
            mp = plan_for_run(held_model_profile(self.lm), length, policy, self.cache, batch_limit=rows,
                              weights_resident=True)
            self.plan = {"batch": max(1, min(mp.max_batch, rows)), "chosen_by": "planner",
                         "max_batch_for_context": mp.max_batch, "context": context}
        if policy.fetches:
            self.plan["k"] = self.cache.fetch_k(length)
        return self.plan["batch"]

    def complete(self, prompt: list[int] | P.Prompt, label: str, max_tokens: int, result: Result,
                 stream: bool) -> Iterator[Status | Stage | TextDelta]:
        """One model call; yields progress (and text deltas if stream); returns the answer text.
        A P.Prompt's document prefix is prefilled first (and taken from / saved to the store)."""
        texts = yield from self.complete_batch([prompt], label, max_tokens, [result], stream=stream)
        return texts[0]

    def complete_batch(self, prompts: list[list[int] | P.Prompt], label: str, max_tokens: int,
                       results: list[Result], shared_prefix: int = 0, stream: bool = False,
                       ) -> Iterator[Status | Stage | TextDelta]:
        """One batched model call; yields progress (and, for a single prompt, text deltas if stream);
        returns the answer texts. shared_prefix: the prompts share that many first tokens (one
        document); otherwise each P.Prompt's own document prefix is its reusable part."""
        gen = replace(self.gen, max_tokens=max_tokens, stop_ids=P.stop_ids(self.lm.tokenizer))
        prefixes = [len(p.prefix) if isinstance(p, P.Prompt) else 0 for p in prompts]
        prompts = [p.ids if isinstance(p, P.Prompt) else p for p in prompts]
        ids: list[list[int]] = [[] for _ in prompts]
        shown = ""
        stream = stream and len(prompts) == 1
        events = self.engine.generate(prompts, gen, shared_prefix=shared_prefix, prefixes=prefixes,
                                      labels=[r.source for r in results])
        for event in events:
            if isinstance(event, Progress):
                yield Stage(label, event.done, event.total)
            elif isinstance(event, Tokens):
                for row, token in enumerate(event.ids):
                    if token is not None:
                        ids[row].append(token)
                if stream and event.ids[0] is not None:
                    text = self.lm.tokenizer.decode(ids[0], skip_special_tokens=True).lstrip()
                    if len(ids[0]) > max_tokens - HOLD_TOKENS:  # near the budget: whole sentences only
                        text = text[: max(len(shown), sentence_end(text, len(shown)))]
                    if len(text) > len(shown) and not text.endswith("\ufffd"):
                        yield TextDelta(text[len(shown):])
                        shown = text
            elif isinstance(event, Finished):
                for row, result in enumerate(results):
                    result.add(event, row)  # a store hit shows in the timing line and in --json "store"
        texts = []
        for row, (result, out) in enumerate(zip(results, ids)):
            text = self.lm.tokenizer.decode(out, skip_special_tokens=True).lstrip()
            result.finish_reason = "length" if len(out) >= max_tokens else "stop"
            if result.finish_reason == "length":
                text = cut_at_sentence(text, len(shown) if stream and row == 0 else 0)
            texts.append(text)
        if stream and len(texts[0]) > len(shown):
            yield TextDelta(texts[0][len(shown):])
        return [t.strip() for t in texts]

    @property
    def part_tokens(self) -> int:
        """Most tokens of one section's partial answer: about the final answer's length."""
        lo, hi = PART_MAX_TOKENS
        return min(max(self.gen.max_tokens, lo), hi)

    def budget(self, instruction: str, max_tokens: int) -> int:
        """Document tokens that fit in one call next to the instruction and the answer."""
        return self.lm.max_context - P.overhead_tokens(self.lm.tokenizer, instruction) - max_tokens - 2


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
    tok = runner.lm.tokenizer
    n = document_tokens(tok, text, source)
    result = Result("", source, runner.lm.name, choose_strategy(runner, n, P.SUMMARIZE))
    if result.strategy == "single":
        prompt = P.build_prompt(tok, text, P.SUMMARIZE)
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
            prompt = P.build_prompt(tok, section, P.SUMMARIZE_PART)
            label = f"section {i + 1}/{len(sections)}"
            parts.append((yield from runner.complete(prompt, label, runner.part_tokens, result, stream=False)))
        notes = "\n\n".join(f"Part {i + 1}: {p}" for i, p in enumerate(parts))
        level += 1
        if count_tokens(tok, notes) <= runner.budget(P.SUMMARIZE_REDUCE, runner.gen.max_tokens) or level > 4:
            break
    prompt = P.build_prompt(tok, notes, P.SUMMARIZE_REDUCE).ids
    result.text = yield from runner.complete(prompt, "combine", runner.gen.max_tokens, result, stream=True)
    yield result


QUESTION_ALLOWANCE = 96  # tokens kept for the question when cutting a long document into sections for ask


def ask_section_budget(runner: Runner, question: str) -> int:
    """Document tokens per section for asking `question`: the same for every question up to
    QUESTION_ALLOWANCE tokens, so the sections (and their stored KV) are shared by all of them."""
    plain = runner.budget(P.ASK_PART.format(question=""), runner.part_tokens)
    return min(plain - QUESTION_ALLOWANCE, runner.budget(P.ASK_PART.format(question=question), runner.part_tokens))


def ask(runner: Runner, text: str, source: str, question: str) -> Iterator[Status | Stage | TextDelta | Result]:
    """Answer a question about a document (or corpus); long ones are asked section by section."""
    tok = runner.lm.tokenizer
    instruction = P.ASK.format(question=question)
    n = document_tokens(tok, text, source)
    result = Result("", source, runner.lm.name, choose_strategy(runner, n, instruction), question=question)
    if result.strategy == "single":
        prompt = P.build_prompt(tok, text, instruction)
        result.text = yield from runner.complete(prompt, "prefill", runner.gen.max_tokens, result, stream=True)
        yield result
        return
    sections = split_sections(tok, text, ask_section_budget(runner, question))
    result.sections = len(sections)
    yield Status(f"{source}: {n} tokens, over the window; asking {len(sections)} sections")
    found = []
    for i, section in enumerate(sections):
        prompt = P.build_prompt(tok, section, P.ASK_PART.format(question=question))
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


def summarize_many(runner: Runner, docs: list[tuple[str, str]], stream: bool = False,
                   ) -> Iterator[Status | Stage | TextDelta | Result | Failed]:
    """Summarize (text, source) documents, in order; documents that fit the window are decoded
    together in batches of the planner's (or --batch) size, longer ones go through map-reduce.
    A document that cannot be done (empty, too long for --strategy single, a typed error in its
    own map-reduce) yields Failed in its place. stream: yield text deltas when a batch holds a
    single document."""
    tok = runner.lm.tokenizer
    pending: list[tuple[P.Prompt, Result]] = []

    def flush() -> Iterator[Status | Stage | TextDelta | Result]:
        while pending:
            context = max(len(p.ids) for p, _ in pending) + runner.gen.max_tokens
            size = runner.batch_size(len(pending), context)
            group, pending[:] = pending[:size], pending[size:]
            results = [r for _, r in group]
            label = f"batch of {len(group)}" if len(group) > 1 else "prefill"
            texts = yield from runner.complete_batch([p for p, _ in group], label, runner.gen.max_tokens, results,
                                                     stream=stream)
            for text, result in zip(texts, results):
                result.text, result.plan = text, dict(runner.plan)
                yield result

    for text, source in docs:
        try:
            strategy = choose_strategy(runner, document_tokens(tok, text, source), P.SUMMARIZE)
        except SpecacheError as exc:  # this document only; results stay in document order
            yield from flush()
            yield Failed(source, exc)
            continue
        if strategy == "single":
            pending.append((P.build_prompt(tok, text, P.SUMMARIZE), Result("", source, runner.lm.name, "single")))
            continue
        yield from flush()
        try:
            yield from summarize(runner, text, source)
        except SpecacheError as exc:
            yield Failed(source, exc)
    yield from flush()


def ask_many(runner: Runner, text: str, source: str, questions: list[str], stream: bool = False,
             ) -> Iterator[Status | Stage | TextDelta | Result]:
    """Answer several questions about one document: when it fits the window, as decode batches that
    prefill the document once and share it; otherwise one question at a time (map-reduce)."""
    tok = runner.lm.tokenizer
    instructions = [P.ASK.format(question=q) for q in questions]
    n = document_tokens(tok, text, source)
    if any(choose_strategy(runner, n, i) != "single" for i in instructions):
        for q in questions:
            yield from ask(runner, text, source, q)
        return
    prompts = [P.build_prompt(tok, text, i) for i in instructions]
    shared = min(len(p.prefix) for p in prompts)
    todo = list(zip(questions, prompts))
    while todo:
        size = runner.batch_size(len(todo), max(len(p.ids) for _, p in todo) + runner.gen.max_tokens)
        group, todo = todo[:size], todo[size:]
        results = [Result("", source, runner.lm.name, "single", question=q) for q, _ in group]
        label = f"{len(group)} questions" if len(group) > 1 else "prefill"
        texts = yield from runner.complete_batch([p.ids for _, p in group], label, runner.gen.max_tokens, results,
                                                 shared_prefix=shared, stream=stream)
        for answer, result in zip(texts, results):
            result.text, result.plan = answer, dict(runner.plan)
            yield result
