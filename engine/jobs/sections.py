"""Token counts of documents and their cut into sections of a token budget (map-reduce: engine/jobs/pipeline.py),
in bounded memory however long the text."""
from __future__ import annotations

from typing import Iterator

from engine.errors import EmptyDocument

COUNT_PIECE_CHARS = 1 << 20  # count_tokens: texts longer than this are tokenized a piece at a time


def count_tokens(tokenizer, text: str) -> int:
    """Tokens of text. A text over COUNT_PIECE_CHARS (~250k tokens: far past any window, so the
    count only sizes the work) is counted in pieces cut at paragraph breaks: tokenizing 50 MB at once
    took 7 GB of RAM. The sum may differ by a token or so per cut from the whole text's count."""
    if len(text) <= COUNT_PIECE_CHARS:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])
    return sum(len(tokenizer(piece, add_special_tokens=False)["input_ids"]) for piece in text_pieces(text))


def text_pieces(text: str, size: int | None = None) -> Iterator[str]:
    """text in consecutive pieces of at most `size` characters (default COUNT_PIECE_CHARS), cut after a
    paragraph break (else a line break, else a space, else anywhere) within the piece's last quarter;
    their concatenation is text."""
    size = size or COUNT_PIECE_CHARS
    start = 0
    while start < len(text):
        end = min(start + size, len(text))
        if end < len(text):
            lo = start + size * 3 // 4
            cut = max(text.rfind("\n\n", lo, end), -1)
            cut = cut + 2 if cut >= 0 else max(text.rfind("\n", lo, end) + 1, text.rfind(" ", lo, end) + 1)
            end = cut if cut > lo else end
        yield text[start:end]
        start = end


def split_sections(tokenizer, text: str, budget: int) -> list[str]:
    """Cut text into sections of at most `budget` tokens, at paragraph breaks where possible."""
    sections, current, used = [], [], 0
    for para in [p for p in text.split("\n\n") if p.strip()]:
        n = count_tokens(tokenizer, para) + 2
        if n > budget:  # a huge paragraph: cut by tokens (tokenized a text piece at a time: bounded memory)
            pieces = [tokenizer.decode(ids[i : i + budget - 2]) for part in text_pieces(para)
                      for ids in [tokenizer(part, add_special_tokens=False)["input_ids"]]
                      for i in range(0, len(ids), budget - 2)]
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


def document_tokens(tokenizer, text: str, source: str) -> int:
    """count_tokens of a document that is not blank; EmptyDocument when it is blank or tokenizes to nothing
    (the tokenizer drops every character of it)."""
    if not text.strip():
        raise EmptyDocument(f"{source}: the document is empty")
    n = count_tokens(tokenizer, text)
    if n == 0:
        raise EmptyDocument(f"{source}: the document tokenizes to nothing (the tokenizer drops all its characters)")
    return n
