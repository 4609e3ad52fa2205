"""A huge document is tokenized a bounded piece at a time (engine.jobs.pipeline count_tokens,
split_sections): tokenizing 50 MB of text in one call took 7 GB of RAM."""
from __future__ import annotations

import pytest

from engine.jobs import pipeline
from engine.jobs import sections as job_sections


def test_text_pieces_cover_the_text_and_cut_at_breaks():
    text = "".join(f"paragraph {i} " + "word " * (i % 37) + ("\n\n" if i % 3 else "\n") for i in range(3000))
    pieces = list(pipeline.text_pieces(text, 1000))
    assert "".join(pieces) == text and len(pieces) > 10
    assert all(len(p) <= 1000 for p in pieces)
    assert sum(p.endswith("\n\n") for p in pieces[:-1]) >= 0.9 * (len(pieces) - 1)  # at paragraph breaks
    solid = "x" * 5000  # nothing to cut at: cut anywhere
    assert [len(p) for p in pipeline.text_pieces(solid, 1000)] == [1000] * 5


class CountingTokenizer:
    """The real tokenizer, recording the longest text it was given."""

    def __init__(self, tok):
        self.tok, self.longest = tok, 0

    def __call__(self, text, **kw):
        self.longest = max(self.longest, len(text))
        return self.tok(text, **kw)

    def decode(self, ids, **kw):
        return self.tok.decode(ids, **kw)


@pytest.fixture(scope="module")
def tokenizer(embedded_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_dir)


def test_a_long_text_is_counted_and_cut_a_piece_at_a_time(tokenizer, monkeypatch):
    monkeypatch.setattr(job_sections, "COUNT_PIECE_CHARS", 4000)
    paragraphs = [f"Section {i}. " + " ".join(f"word{j % 50}" for j in range(i % 120 + 5)) for i in range(400)]
    text = "\n\n".join(paragraphs)
    whole = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    counting = CountingTokenizer(tokenizer)
    n = pipeline.count_tokens(counting, text)
    pieces = len(list(pipeline.text_pieces(text, 4000)))
    assert counting.longest <= 4000 and pieces > 5
    assert abs(n - whole) <= pieces  # a token or so per cut
    one_paragraph = text.replace("\n\n", " ")  # no break to cut sections at: cut by tokens
    counting = CountingTokenizer(tokenizer)
    sections = pipeline.split_sections(counting, one_paragraph, 500)
    assert counting.longest <= 4000 and len(sections) > 5
    assert all(len(tokenizer(s, add_special_tokens=False)["input_ids"]) <= 500 + 2 for s in sections)
    assert "".join(sections).replace(" ", "") == one_paragraph.replace(" ", "")  # nothing lost
