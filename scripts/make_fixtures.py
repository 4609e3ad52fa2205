#!/usr/bin/env python3
"""Generate the example documents and test fixtures from the public-domain texts.

Run from anywhere:  python scripts/make_fixtures.py
Needs the dev dependencies (fpdf2, pypdf, Pillow via fpdf2). The output is deterministic:
running it twice gives byte-identical files.

Sources (examples/texts/, public domain, from Project Gutenberg):
  federalist.txt                    The Federalist Papers, Nos. 1-7 and the opening of No. 8
  origin-of-species-introduction.txt  Charles Darwin, On the Origin of Species, Introduction

Writes:
  examples/report.pdf        Federalist Nos. 1-3 (~6.6k tokens, 14 pages)
  examples/long-report.pdf   Federalist Nos. 1-7 + opening of No. 8 (~17.5k tokens, 36 pages)
  tests/data/encrypted.pdf   a short PDF, user password "secret"
  tests/data/scanned.pdf     2 pages of image and shapes only, no text layer
  tests/data/corrupt.pdf     the first 40% of a valid PDF's bytes
  tests/data/empty.txt       whitespace only
  tests/data/short.md        a Markdown excerpt of Darwin's Introduction
  tests/data/sample.txt      the opening paragraphs of Darwin's Introduction
"""
from __future__ import annotations

import io
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from fpdf import FPDF
from PIL import Image, ImageDraw
from pypdf import PdfReader, PdfWriter
from pypdf.generic import ArrayObject, ByteStringObject

ROOT = Path(__file__).resolve().parent.parent
TEXTS = ROOT / "examples" / "texts"
EXAMPLES = ROOT / "examples"
TEST_DATA = ROOT / "tests" / "data"

FIXED_DATE = datetime(2024, 1, 1, tzinfo=timezone.utc)
FIXED_FILE_ID = b"specache-fixture"  # 16 bytes: makes pypdf's encryption output reproducible
ASCII_MAP = {
    "\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"',
    "\u2013": "-", "\u2014": "--", "\u2026": "...", "\u00a0": " ",
}
HEADING_RE = re.compile(r"^FEDERALIST No\. \d+$")
FEDERALIST_CREDIT = (
    "By Alexander Hamilton, John Jay, and James Madison (1787-1788). "
    "Public domain, from Project Gutenberg (EBook #1404)."
)


@dataclass(frozen=True)
class Layout:
    """Page geometry and type sizes of a generated report."""

    font_size: float = 13
    line_height: float = 7.4
    margin: float = 25.0
    paragraph_gap: float = 3.0


@dataclass(frozen=True)
class Source:
    """A source text split into its attribution line and its paragraphs."""

    attribution: str
    paragraphs: list[str]


def to_latin1(text: str) -> str:
    """Replace typographic characters with ASCII so the core Helvetica font can draw them."""
    for char, repl in ASCII_MAP.items():
        text = text.replace(char, repl)
    return text.encode("latin-1", errors="replace").decode("latin-1")


def read_source(path: Path) -> Source:
    """Read a text whose first line is the attribution; reflow its paragraphs to single lines."""
    attribution, _, body = path.read_text(encoding="utf-8").partition("\n")
    blocks = [b for b in re.split(r"\n\s*\n", body) if b.strip()]
    paragraphs = [" ".join(line.strip() for line in b.splitlines()) for b in blocks]
    return Source(attribution.strip(), paragraphs)


def papers_until(paragraphs: list[str], stop_number: int | None) -> list[str]:
    """Paragraphs before the heading 'FEDERALIST No. <stop_number>' (all if None)."""
    if stop_number is None:
        return paragraphs
    stop = f"FEDERALIST No. {stop_number}"
    return paragraphs[: paragraphs.index(stop)] if stop in paragraphs else paragraphs


class ReportPDF(FPDF):
    """FPDF with a running footer 'Title - page N of M'."""

    def __init__(self, running_title: str, layout: Layout) -> None:
        super().__init__(format="A4")
        self.running_title = running_title
        self.layout = layout
        self.set_margins(layout.margin, layout.margin, layout.margin)
        self.set_auto_page_break(True, margin=layout.margin)
        self.set_creation_date(FIXED_DATE)
        self.set_title(running_title)
        self.set_author("Alexander Hamilton, John Jay, and James Madison")
        self.alias_nb_pages()

    def footer(self) -> None:
        self.set_y(-self.layout.margin + 8)
        self.set_font("Helvetica", size=9)
        self.cell(0, 5, f"{self.running_title} - page {self.page_no()} of {{nb}}", align="C")


def write_paragraph(pdf: ReportPDF, text: str) -> None:
    """Write one paragraph, or a paper heading in bold."""
    layout = pdf.layout
    if HEADING_RE.match(text):
        pdf.ln(layout.paragraph_gap * 2)
        pdf.set_font("Helvetica", style="B", size=layout.font_size + 3)
        pdf.multi_cell(0, layout.line_height + 1, text, new_x="LMARGIN", new_y="NEXT")
    else:
        pdf.set_font("Helvetica", size=layout.font_size)
        pdf.multi_cell(0, layout.line_height, to_latin1(text), new_x="LMARGIN", new_y="NEXT")
    pdf.ln(layout.paragraph_gap)


def build_report(title: str, subtitle: str, paragraphs: list[str], layout: Layout) -> bytes:
    """Render a titled report PDF and return its bytes."""
    pdf = ReportPDF(title, layout)
    pdf.add_page()
    pdf.set_font("Helvetica", style="B", size=22)
    pdf.multi_cell(0, 11, title, align="C", new_x="LMARGIN", new_y="NEXT")
    pdf.set_font("Helvetica", size=14)
    pdf.multi_cell(0, 8, subtitle, align="C", new_x="LMARGIN", new_y="NEXT")
    pdf.ln(2)
    pdf.set_font("Helvetica", style="I", size=10)
    pdf.multi_cell(0, 5, FEDERALIST_CREDIT, align="C", new_x="LMARGIN", new_y="NEXT")
    pdf.ln(6)
    for paragraph in paragraphs:
        write_paragraph(pdf, paragraph)
    return bytes(pdf.output())


def build_scanned() -> bytes:
    """Two pages holding only an image and drawn shapes: nothing for a text extractor."""
    pdf = FPDF(format="A4")
    pdf.set_creation_date(FIXED_DATE)
    pdf.add_page()
    pdf.image(fake_scan_png(), x=20, y=20, w=170)
    pdf.add_page()
    pdf.set_fill_color(60, 60, 60)
    for row in range(30):
        width = 170 - (row * 37) % 60
        pdf.rect(20, 25 + row * 8, width, 3.5, style="F")
    pdf.set_draw_color(0, 0, 0)
    pdf.rect(15, 15, 180, 267)
    return bytes(pdf.output())


def fake_scan_png() -> io.BytesIO:
    """A grey 'scanned page' made of dark bars where lines of print would be."""
    image = Image.new("L", (850, 1100), color=235)
    draw = ImageDraw.Draw(image)
    for row in range(40):
        length = 760 - (row * 53) % 240
        draw.rectangle((45, 60 + row * 25, 45 + length, 72 + row * 25), fill=40)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", optimize=False)
    buffer.seek(0)
    return buffer


def build_encrypted(plain_pdf: bytes, password: str) -> bytes:
    """Encrypt a PDF (RC4-128, no extra dependency) with a fixed file identifier."""
    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(plain_pdf)))
    writer._ID = ArrayObject((ByteStringObject(FIXED_FILE_ID), ByteStringObject(FIXED_FILE_ID)))
    writer.encrypt(user_password=password, owner_password="owner-" + password, algorithm="RC4-128")
    writer._ID = ArrayObject((ByteStringObject(FIXED_FILE_ID), ByteStringObject(FIXED_FILE_ID)))
    buffer = io.BytesIO()
    writer.write(buffer)
    return buffer.getvalue()


def short_markdown(source: Source) -> str:
    """A Markdown excerpt: heading, attribution and three paragraphs of the Introduction."""
    body = source.paragraphs[5:8]  # "In considering the origin of species..." to "...propagate its new and modified form."
    return "\n\n".join([
        "# On the Origin of Species: Introduction (excerpt)",
        f"*{source.attribution}*",
        "## Why natural selection needs explaining",
        body[0],
        body[1],
        "## The plan of the work",
        body[2],
    ]) + "\n"


def sample_text(source: Source) -> str:
    """Plain text: attribution and the first three paragraphs of the Introduction."""
    return "\n\n".join([source.attribution, *source.paragraphs[1:4]]) + "\n"


def write(path: Path, data: bytes | str) -> None:
    """Write bytes or UTF-8 text, creating the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        path.write_text(data, encoding="utf-8")
    else:
        path.write_bytes(data)
    print(f"wrote {path.relative_to(ROOT)} ({path.stat().st_size} bytes)")


def main() -> None:
    federalist = read_source(TEXTS / "federalist.txt")
    darwin = read_source(TEXTS / "origin-of-species-introduction.txt")
    layout = Layout()
    report = build_report(
        "The Federalist Papers", "Nos. 1-3: Introduction; Dangers from Foreign Force",
        papers_until(federalist.paragraphs, 4), layout,
    )
    long_report = build_report(
        "The Federalist Papers", "Nos. 1-7 and the opening of No. 8",
        papers_until(federalist.paragraphs, None), layout,
    )
    small = build_report(
        "The Federalist Papers", "No. 1 (opening)", federalist.paragraphs[:6], layout,
    )
    write(EXAMPLES / "report.pdf", report)
    write(EXAMPLES / "long-report.pdf", long_report)
    write(TEST_DATA / "encrypted.pdf", build_encrypted(small, "secret"))
    write(TEST_DATA / "scanned.pdf", build_scanned())
    write(TEST_DATA / "corrupt.pdf", report[: int(len(report) * 0.4)])
    write(TEST_DATA / "empty.txt", "  \n\n\t \n   \n")
    write(TEST_DATA / "short.md", short_markdown(darwin))
    write(TEST_DATA / "sample.txt", sample_text(darwin))


if __name__ == "__main__":
    main()
