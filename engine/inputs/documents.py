"""Document loading: PDF, plain text, Markdown or stdin -> one normalised text.

Every failure is a typed, one-line `SpecacheError` that names the file (see engine/errors.py).
PDFs are read one page at a time (`iter_pdf_pages`) so a caller can show progress.
"""
from __future__ import annotations

import io
import logging
import os
import re
import stat
import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Sequence, TextIO

from engine.errors import (
    BadArgument,
    CorruptDocument,
    EmptyDocument,
    EncryptedDocument,
    InputNotFound,
    NoExtractableText,
    SpecacheError,
    UnsupportedInput,
)

if TYPE_CHECKING:
    from pypdf import PdfReader

STDIN = "-"
SUPPORTED = '.pdf, .txt, .md, .markdown, or "-" for stdin'
TEXT_KINDS = {".txt": "text", ".md": "markdown", ".markdown": "markdown"}
PDF_MAGIC = b"%PDF-"
MAGIC_WINDOW = 1024  # the PDF spec lets the header start anywhere in the first 1 KiB
BINARY_SAMPLE = 8192
WHITESPACE_CONTROLS = (9, 10, 11, 12, 13, 28, 29, 30, 31)  # tab, LF, VT, FF, CR and the separators str.isspace knows
PAGE_SEPARATOR = "\n\n"

OnPage = Callable[[int, int], None]

_SPACE_RUN = re.compile(r"[ \t\f\v\u00a0]+")
_LINE_HYPHEN = re.compile(r"([^\W\d_])-\n[ \t]*([^\W\d_])")
_BLANK_RUN = re.compile(r"\n{3,}")
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


@dataclass(frozen=True)
class Document:
    """A loaded document."""

    source: str  # the path as given, or "-" for stdin
    text: str  # extracted text, pages joined with "\n\n"
    pages: int | None  # PDF page count, None for text files
    kind: str  # "pdf" | "text" | "markdown"


def load_document(
    source: str,
    password: str | None = None,
    on_page: OnPage | None = None,
    stdin: TextIO | None = None,
) -> Document:
    """Load one document from a path or "-" (stdin); `on_page(index, count)` follows PDF pages."""
    if source == STDIN:
        return _load_stdin(stdin if stdin is not None else sys.stdin)
    path = Path(source)
    data = _read_bytes(path, source)
    suffix = path.suffix.lower()
    if _is_pdf(data, suffix):
        return _load_pdf(data, source, password, on_page)
    if suffix == ".pdf":
        raise CorruptDocument(f"{source}: not a valid PDF (no %PDF- header)")
    if suffix not in TEXT_KINDS:
        raise UnsupportedInput(f"{source}: unsupported file type {suffix or '(no extension)'}; supported: {SUPPORTED}")
    return _load_text(data, source, TEXT_KINDS[suffix])


def load_corpus(
    sources: Sequence[str],
    password: str | None = None,
    on_page: OnPage | None = None,
    stdin: TextIO | None = None,
) -> list[Document]:
    """Load several documents, in the order given; stdin ("-") may appear once."""
    if list(sources).count(STDIN) > 1:
        raise BadArgument('standard input ("-") can be given only once')
    return [load_document(s, password=password, on_page=on_page, stdin=stdin) for s in sources]


def iter_pdf_pages(path: Path, password: str | None = None) -> Iterator[tuple[int, int, str]]:
    """Yield (page_index, page_count, page_text) one page at a time (so the CLI can show a progress bar)."""
    label = str(path)
    reader = _open_pdf(_read_bytes(Path(path), label), label, password)
    yield from _pdf_pages(reader, label)


# ---------------------------------------------------------------- text and stdin


def _load_stdin(stream: TextIO) -> Document:
    """Read all of stdin as plain text: its bytes decoded as a file's are (UTF-8 or UTF-16 with a
    BOM, undecodable bytes replaced), so no lone surrogate ever reaches the tokenizer."""
    raw = getattr(stream, "buffer", None)
    if raw is not None:
        data = raw.read()
        if _looks_binary(data):
            raise UnsupportedInput(f"-: standard input looks like binary data, not text; supported: {SUPPORTED}")
        text = decode_text(data)
    else:  # a text stream without bytes underneath (tests): drop what cannot be UTF-8
        text = stream.read().encode("utf-8", errors="replace").decode("utf-8")
    text = normalise_plain_text(text)
    if not text.strip():
        raise EmptyDocument("-: standard input is empty (only whitespace)")
    return Document(source=STDIN, text=text, pages=None, kind="text")


def _load_text(data: bytes, source: str, kind: str) -> Document:
    """Decode a .txt/.md file; reject binary content and whitespace-only files."""
    if _looks_binary(data):
        raise UnsupportedInput(f"{source}: looks like a binary file, not text; supported: {SUPPORTED}")
    text = normalise_plain_text(decode_text(data))
    if not text.strip():
        raise EmptyDocument(f"{source}: the file is empty (only whitespace)")
    return Document(source=source, text=text, pages=None, kind=kind)


def decode_text(data: bytes) -> str:
    """UTF-8 (BOM tolerated) or UTF-16 with a BOM; undecodable bytes become U+FFFD."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        return data.decode("utf-16", errors="replace")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        return data.decode("utf-8", errors="replace")


def _looks_binary(data: bytes) -> bool:
    """True for NUL bytes or many control bytes in the first few KiB (UTF-16 with a BOM is text)."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        return False
    sample = data[:BINARY_SAMPLE]
    if not sample:
        return False
    if b"\x00" in sample:
        return True
    controls = sum(1 for b in sample if b < 32 and b not in WHITESPACE_CONTROLS)
    return controls / len(sample) > 0.05


def normalise_plain_text(text: str) -> str:
    """Unify line endings and drop trailing spaces; keep indentation (Markdown needs it)."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\x00", "")
    return "\n".join(line.rstrip() for line in text.split("\n")).strip("\n")


# ---------------------------------------------------------------- PDF


def _is_pdf(data: bytes, suffix: str) -> bool:
    """PDF by content: the %PDF- header at the start, or anywhere in the first KiB
    (as the PDF spec allows) unless the name says text, since prose may quote it."""
    if data.lstrip(b" \t\r\n\x00").startswith(PDF_MAGIC):
        return True
    return suffix not in TEXT_KINDS and PDF_MAGIC in data[:MAGIC_WINDOW]


def _load_pdf(data: bytes, source: str, password: str | None, on_page: OnPage | None) -> Document:
    """Extract every page, reporting progress, and refuse PDFs without a text layer."""
    reader = _open_pdf(data, source, password)
    texts: list[str] = []
    count = 0
    for index, count, text in _pdf_pages(reader, source):
        texts.append(text)
        if on_page is not None:
            on_page(index, count)
    if count == 0:
        raise EmptyDocument(f"{source}: the PDF has no pages")
    if not any(t.strip() for t in texts):
        raise NoExtractableText(
            f"{source}: no extractable text in {count} page(s); it looks scanned or image-only, "
            "run OCR on it first (e.g. ocrmypdf)"
        )
    text = PAGE_SEPARATOR.join(t for t in strip_running_lines(texts) if t.strip())
    return Document(source=source, text=text, pages=count, kind="pdf")


def _line_shape(line: str) -> str:
    """A line with its numbers blanked: "Report - page 4 of 14" and "... page 5 of 14" look alike."""
    return re.sub(r"\d+", "#", line.strip().lower())


def strip_running_lines(pages: list[str], edge: int = 2, share: float = 0.5) -> list[str]:
    """Drop running headers and footers: among the first and last `edge` lines of each page, those
    whose shape (numbers blanked) recurs on more than `share` of the pages (3 pages at least).
    A model summarizing the text otherwise reads "page 4 of 14" as content."""
    if len(pages) < 3:
        return pages
    edges = [lines[:edge] + lines[-edge:] for lines in (p.split("\n") for p in pages)]
    counts: dict[str, int] = {}
    for lines in edges:
        for shape in {_line_shape(x) for x in lines if x.strip()}:
            counts[shape] = counts.get(shape, 0) + 1
    running = {shape for shape, n in counts.items() if n > share * len(pages) and n >= 3}
    if not running:
        return pages
    out = []
    for page in pages:
        lines = page.split("\n")
        keep = [i for i, x in enumerate(lines)
                if not ((i < edge or i >= len(lines) - edge) and _line_shape(x) in running)]
        out.append("\n".join(lines[i] for i in keep))
    return out


def _open_pdf(data: bytes, source: str, password: str | None) -> PdfReader:
    """Parse the PDF and decrypt it if needed; map every pypdf failure to a typed error."""
    from pypdf import PdfReader
    from pypdf.errors import DependencyError

    try:
        with _quiet_pypdf():
            reader = PdfReader(io.BytesIO(data), strict=False)
            if reader.is_encrypted:
                _decrypt(reader, source, password)
            len(reader.pages)  # forces the page tree to load, so damage shows here
    except SpecacheError:
        raise
    except DependencyError as exc:  # AES without the 'cryptography' package, wherever pypdf notices
        raise EncryptedDocument(f"{source}: the PDF uses AES encryption, which needs the 'cryptography' "
                                "package (pip install cryptography)") from exc
    except Exception as exc:  # pypdf raises many types on damaged files
        raise _corrupt(source, exc) from exc
    return reader


def _decrypt(reader: PdfReader, source: str, password: str | None) -> None:
    """Try the given password, or the empty one that many 'protected' PDFs use."""
    from pypdf import PasswordType
    from pypdf.errors import DependencyError

    try:
        result = reader.decrypt(password if password is not None else "")
    except DependencyError as exc:
        raise EncryptedDocument(
            f"{source}: the PDF uses AES encryption, which needs the 'cryptography' package "
            "(pip install cryptography); then pass its password with --password"
        ) from exc
    if result != PasswordType.NOT_DECRYPTED:
        return
    if password is None:
        raise EncryptedDocument(f"{source}: the PDF is encrypted; pass its password with --password")
    raise EncryptedDocument(f"{source}: wrong password for the encrypted PDF; pass the right one with --password")


def _pdf_pages(reader: PdfReader, source: str) -> Iterator[tuple[int, int, str]]:
    """Yield (index, count, normalised text) per page; pypdf is silenced only while it works."""
    try:
        with _quiet_pypdf():
            count = len(reader.pages)
    except Exception as exc:
        raise _corrupt(source, exc) from exc
    for index in range(count):
        try:
            with _quiet_pypdf():
                raw = reader.pages[index].extract_text() or ""
        except Exception as exc:
            raise _corrupt(source, exc, page=index + 1) from exc
        yield index, count, normalise_pdf_text(raw)


def normalise_pdf_text(text: str) -> str:
    """Light clean-up of extracted text: collapse space runs, strip line ends,
    join words hyphenated across lines ("exam-\\nple" -> "example"), keep paragraph breaks."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _CONTROL.sub("", text)
    text = _SPACE_RUN.sub(" ", text)
    text = "\n".join(line.strip() for line in text.split("\n"))
    text = _LINE_HYPHEN.sub(_join_hyphenated, text)
    return _BLANK_RUN.sub("\n\n", text).strip()


def _join_hyphenated(match: re.Match[str]) -> str:
    """Join 'exam-\\nple' into 'example' when the next line continues in lower case."""
    before, after = match.group(1), match.group(2)
    if after.islower():
        return before + after
    return match.group(0)


def _corrupt(source: str, exc: BaseException, page: int | None = None) -> CorruptDocument:
    """A one-line CorruptDocument naming the file and the parser's complaint."""
    where = f" (page {page})" if page is not None else ""
    detail = " ".join(str(exc).split()) or type(exc).__name__
    return CorruptDocument(f"{source}: corrupt or unreadable PDF{where}: {detail}")


@contextmanager
def _quiet_pypdf() -> Iterator[None]:
    """Silence pypdf's logger and warnings for the duration of one call; restore afterwards."""
    logger = logging.getLogger("pypdf")
    previous = logger.level
    logger.setLevel(logging.CRITICAL + 1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(previous)


# ---------------------------------------------------------------- files


def read_regular_file(path: str | Path) -> bytes:
    """The bytes of a regular file given by the user (a document, --questions, --resume), with the
    typed errors of documents: a FIFO, socket or device is refused (UnsupportedInput), never read."""
    return _read_bytes(Path(path), str(path))


def _read_bytes(path: Path, source: str) -> bytes:
    """Read a whole regular file, mapping missing paths, folders, FIFOs, sockets, devices and OS
    errors to typed errors. The file is opened without blocking and checked after opening, so a
    FIFO with no writer (or /dev/zero) is refused at once instead of hanging or never ending."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        what = "a broken symbolic link" if path.is_symlink() else "no such file"
        raise InputNotFound(f"{source}: {what}") from None
    except IsADirectoryError:
        raise UnsupportedInput(f"{source}: is a directory; supported inputs: {SUPPORTED}") from None
    except OSError as exc:
        try:
            mode = os.stat(path).st_mode
        except OSError:
            mode = stat.S_IFREG
        if stat.S_ISDIR(mode):
            raise UnsupportedInput(f"{source}: is a directory; supported inputs: {SUPPORTED}") from None
        if not stat.S_ISREG(mode):  # e.g. a socket: open() fails with ENXIO
            raise UnsupportedInput(f"{source}: is {_file_kind(mode)}, not a regular file") from None
        raise InputNotFound(f"{source}: cannot be read ({exc.strerror or exc})") from exc
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise UnsupportedInput(f"{source}: is a directory; supported inputs: {SUPPORTED}")
        if not stat.S_ISREG(mode):
            raise UnsupportedInput(f"{source}: is {_file_kind(mode)}, not a regular file; give a file, "
                                   'or pipe the text to "-" (standard input)')
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    except OSError as exc:
        raise InputNotFound(f"{source}: cannot be read ({exc.strerror or exc})") from exc
    finally:
        os.close(fd)


def _file_kind(mode: int) -> str:
    """'a FIFO (named pipe)', 'a socket', ... for a file that is not regular."""
    for test, name in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"
