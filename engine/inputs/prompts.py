"""Prompts built with the model's chat template. The document always comes first, then the
instruction or question, so the tokens of the document prefix are the same for every job on
that document (and can be prefilled once)."""
from __future__ import annotations

from dataclasses import dataclass

SYSTEM = "You are a careful assistant. You read documents and answer only from what they say."
DOC_MARK = "\x00DOCUMENT\x00"

SUMMARIZE = "Summarize the document above in one short paragraph of three to five sentences covering its main points."
SUMMARIZE_PART = "Summarize this part of a longer document in two or three sentences, keeping names, numbers and key facts."
SUMMARIZE_REDUCE = ("The text above is a list of summaries of consecutive parts of one document. "
                    "Write a single summary of the whole document in one short paragraph of three to five sentences.")
ASK = "Question: {question}\nAnswer the question using the document above. Reply briefly, quoting the exact words or numbers from the document."
ASK_PART = ("Question: {question}\nIf this part of a document answers the question, reply briefly with the answer, "
            "quoting the exact words or numbers. Otherwise reply exactly: NOT FOUND")
ASK_REDUCE = ("Question: {question}\nThe text above lists answers found in different parts of one document. "
              "Give the final answer briefly, quoting the exact words or numbers.")
NOT_FOUND = "NOT FOUND"


@dataclass(frozen=True)
class Prompt:
    """Token ids of a prompt, split where the reusable document prefix ends."""

    prefix: list[int]  # system + document
    suffix: list[int]  # instruction + assistant turn header

    @property
    def ids(self) -> list[int]:
        return self.prefix + self.suffix


def build_prompt(tokenizer, document: str, instruction: str) -> Prompt:
    """Render [system, user: document + instruction] with the chat template, split at the document's end."""
    user = DOC_MARK + "\n\n" + instruction
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
            tokenize=False, add_generation_prompt=True,
        )
    else:  # base models without a template
        text = f"{SYSTEM}\n\n{user}\n\nAnswer: "
    head, tail = text.split(DOC_MARK, 1)
    encode = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    bos = [tokenizer.bos_token_id] if _wants_bos(tokenizer, text) else []
    return Prompt(bos + encode(head + document), encode(tail))


def _wants_bos(tokenizer, text: str) -> bool:
    """Whether the template relies on the tokenizer to add BOS (Llama-style) and it is not in the text."""
    bos = getattr(tokenizer, "bos_token", None)
    return bool(bos) and getattr(tokenizer, "add_bos_token", False) and not text.startswith(bos)


def overhead_tokens(tokenizer, instruction: str) -> int:
    """Prompt tokens around an empty document."""
    return len(build_prompt(tokenizer, "", instruction).ids)


def stop_ids(tokenizer) -> tuple[int, ...]:
    """Token ids that end an answer: EOS and the chat template's end-of-turn marker."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    for marker in ("<|im_end|>", "<|eot_id|>", "<|end|>", "</s>", "<|endoftext|>"):
        tid = tokenizer.convert_tokens_to_ids(marker)
        if isinstance(tid, int) and tid != getattr(tokenizer, "unk_token_id", None) and tid >= 0:
            ids.add(tid)
    return tuple(sorted(ids))
