"""Tests of engine.inputs.documents on the generated fixtures (scripts/make_fixtures.py)."""
from __future__ import annotations

import io
import logging
import shutil
from pathlib import Path

import pytest

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
from engine.inputs.documents import (
    Document,
    iter_pdf_pages,
    load_corpus,
    load_document,
    normalise_pdf_text,
)

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"
REPORT = ROOT / "examples" / "report.pdf"
REPORT_PAGES = 14
# Federalist No. 2 (Jay), as it reads in examples/texts/federalist.txt
KNOWN_SENTENCE = (
    "It is not yet forgotten that well-grounded apprehensions of imminent danger "
    "induced the people of America to form the memorable Congress of 1774."
)


def flat(text: str) -> str:
    """Whitespace-insensitive view of a text (PDF lines break anywhere)."""
    return " ".join(text.split())


def assert_error(exc: SpecacheError, source: str, *words: str) -> None:
    """A user error message is one line, names the file and says the given words."""
    message = str(exc)
    assert "\n" not in message
    assert source in message
    for word in words:
        assert word in message


@pytest.fixture(scope="module")
def report() -> Document:
    return load_document(str(REPORT))


# ---------------------------------------------------------------- errors


def test_missing_file_is_input_not_found(tmp_path: Path) -> None:
    source = str(tmp_path / "nowhere.pdf")
    with pytest.raises(InputNotFound) as info:
        load_document(source)
    assert_error(info.value, source, "no such file")


def test_directory_is_unsupported(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedInput) as info:
        load_document(str(tmp_path))
    assert_error(info.value, str(tmp_path), ".pdf", ".txt", ".md", ".markdown", '"-"')


def test_unknown_extension_is_unsupported(tmp_path: Path) -> None:
    path = tmp_path / "notes.docx"
    path.write_text("some words")
    with pytest.raises(UnsupportedInput) as info:
        load_document(str(path))
    assert_error(info.value, str(path), ".docx", ".pdf, .txt, .md, .markdown")


def test_binary_text_file_is_unsupported(tmp_path: Path) -> None:
    path = tmp_path / "data.txt"
    path.write_bytes(b"\x00\x01\x02binary\x00\x00\xff" * 50)
    with pytest.raises(UnsupportedInput) as info:
        load_document(str(path))
    assert_error(info.value, str(path), "binary")


def test_corrupt_pdf(caplog: pytest.LogCaptureFixture) -> None:
    source = str(DATA / "corrupt.pdf")
    caplog.set_level(logging.DEBUG)
    level_before = logging.getLogger("pypdf").level
    with pytest.raises(CorruptDocument) as info:
        load_document(source)
    assert_error(info.value, source, "corrupt")
    assert not [r for r in caplog.records if r.name.startswith("pypdf")]
    assert logging.getLogger("pypdf").level == level_before  # restored after the call


def test_pdf_name_without_pdf_content_is_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "fake.pdf"
    path.write_text("just some text, not a PDF")
    with pytest.raises(CorruptDocument) as info:
        load_document(str(path))
    assert_error(info.value, str(path), "%PDF-")


@pytest.mark.parametrize("name, password, error, words", [
    ("encrypted.pdf", None, EncryptedDocument, ("encrypted", "--password")),
    ("encrypted.pdf", "not-the-secret", EncryptedDocument, ("wrong password", "--password")),
    ("scanned.pdf", None, NoExtractableText, ("scanned", "OCR")),
    ("empty.txt", None, EmptyDocument, ("empty",)),
])
def test_a_document_without_readable_text_names_why(name: str, password: str | None, error, words) -> None:
    source = str(DATA / name)
    with pytest.raises(error) as info:
        load_document(source, password=password)
    assert_error(info.value, source, *words)


def test_whitespace_stdin_is_empty() -> None:
    with pytest.raises(EmptyDocument) as info:
        load_document("-", stdin=io.StringIO(" \n\t\n"))
    assert_error(info.value, "-", "empty")


# ---------------------------------------------------------------- successes


def test_encrypted_with_right_password() -> None:
    doc = load_document(str(DATA / "encrypted.pdf"), password="secret")
    assert doc.kind == "pdf" and doc.pages == 1
    assert "AFTER an unequivocal experience" in doc.text


def test_pdf_detected_by_magic_not_extension(tmp_path: Path) -> None:
    path = tmp_path / "download"
    shutil.copy(DATA / "encrypted.pdf", path)
    doc = load_document(str(path), password="secret")
    assert doc.kind == "pdf" and doc.source == str(path)


def test_report_text_and_pages(report: Document) -> None:
    assert report.kind == "pdf"
    assert report.pages == REPORT_PAGES
    assert report.source == str(REPORT)
    assert report.text.startswith("The Federalist Papers")
    assert KNOWN_SENTENCE in flat(report.text)
    assert "  " not in report.text and " \n" not in report.text


def test_on_page_called_once_per_page_in_order() -> None:
    calls: list[tuple[int, int]] = []
    load_document(str(REPORT), on_page=lambda i, n: calls.append((i, n)))
    assert calls == [(i, REPORT_PAGES) for i in range(REPORT_PAGES)]


def test_iter_pdf_pages_yields_each_page() -> None:
    pages = list(iter_pdf_pages(DATA / "encrypted.pdf", password="secret"))
    assert [(i, n) for i, n, _ in pages] == [(0, 1)]
    assert "The Federalist Papers" in pages[0][2]


def test_text_file() -> None:
    source = str(DATA / "sample.txt")
    doc = load_document(source)
    assert doc == Document(source=source, text=doc.text, pages=None, kind="text")
    assert "When on board H.M.S. Beagle, as naturalist" in doc.text


def test_markdown_file_keeps_its_markup() -> None:
    doc = load_document(str(DATA / "short.md"))
    assert doc.kind == "markdown" and doc.pages is None
    assert doc.text.startswith("# On the Origin of Species")
    assert "\n\n## The plan of the work\n\n" in doc.text


def test_text_file_decoding(tmp_path: Path) -> None:
    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\xe9 cr\xe8me\r\nline two  \r\n".encode("latin-1"))
    assert load_document(str(path)).text == "caf\ufffd cr\ufffdme\nline two"
    path.write_bytes("\ufeffna\u00efve".encode("utf-8"))
    assert load_document(str(path)).text == "na\u00efve"


def test_stdin() -> None:
    doc = load_document("-", stdin=io.StringIO("Heresies in either can rarely be cured by persecution.\n"))
    assert doc == Document(source="-", text="Heresies in either can rarely be cured by persecution.",
                           pages=None, kind="text")


def test_corpus_keeps_order() -> None:
    sources = [str(DATA / "short.md"), "-", str(DATA / "encrypted.pdf"), str(DATA / "sample.txt")]
    docs = load_corpus(sources, password="secret", stdin=io.StringIO("from stdin"))
    assert [d.source for d in docs] == sources
    assert [d.kind for d in docs] == ["markdown", "text", "pdf", "text"]


def test_corpus_stops_at_first_bad_document() -> None:
    with pytest.raises(EmptyDocument):
        load_corpus([str(DATA / "sample.txt"), str(DATA / "empty.txt")])


def test_corpus_reads_stdin_once_only() -> None:
    with pytest.raises(BadArgument):
        load_corpus(["-", "-"], stdin=io.StringIO("text"))


# ---------------------------------------------------------------- normalisation


@pytest.mark.parametrize(
    ("raw", "clean"),
    [
        ("an exam-\nple of it", "an example of it"),
        ("well-\nInformed", "well-\nInformed"),
        ("respectable--\nthe honest errors", "respectable--\nthe honest errors"),
        ("spaced    out\t words  \nnext", "spaced out words\nnext"),
        ("para one\n\n\n\npara two", "para one\n\npara two"),
        ("  padded page  \n", "padded page"),
    ],
)
def test_normalise_pdf_text(raw: str, clean: str) -> None:
    assert normalise_pdf_text(raw) == clean


def test_running_headers_and_footers_are_dropped():
    from engine.inputs.documents import load_document, strip_running_lines

    text = load_document(str(ROOT / "examples" / "report.pdf")).text
    assert "The Federalist Papers - page" not in text  # the fixture's footer on every page
    pages = ["Title\nbody one\nReport - page 1 of 3", "body two\nmore\nReport - page 2 of 3",
             "body three\nReport - page 3 of 3"]
    assert strip_running_lines(pages) == ["Title\nbody one", "body two\nmore", "body three"]
    assert strip_running_lines(pages[:2]) == pages[:2]  # too few pages to tell


# ---------------------------------------------------------------- hostile inputs


def _encrypted(tmp_path: Path, algorithm: str) -> Path:
    """A one-page PDF with text, encrypted with `algorithm` (user password 'pw', owner 'owner')."""
    from pypdf import PdfReader, PdfWriter

    writer = PdfWriter(clone_from=PdfReader(str(DATA / "encrypted.pdf"), password="secret"))
    writer.encrypt(user_password="pw", owner_password="owner", algorithm=algorithm)
    path = tmp_path / f"{algorithm}.pdf"
    writer.write(path)
    return path


@pytest.mark.parametrize("algorithm", ["AES-128", "AES-256", "RC4-128"])
def test_encrypted_pdf_any_cipher(tmp_path: Path, algorithm: str) -> None:
    """AES (what most tools write today) opens with the right password, user's or owner's;
    a missing or wrong one is EncryptedDocument (exit 6), whatever the cipher."""
    path = _encrypted(tmp_path, algorithm)
    for password in ("pw", "owner"):
        assert "AFTER an unequivocal experience" in load_document(str(path), password=password).text
    for password, words in ((None, "--password"), ("wrong", "wrong password")):
        with pytest.raises(EncryptedDocument) as info:
            load_document(str(path), password=password)
        assert_error(info.value, str(path), words)


@pytest.mark.parametrize("data", [b"\x0b", b"\x0c\x0b\r\n \x1c\x1f"])
def test_whitespace_control_characters_are_empty_not_binary(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "vt.txt"
    path.write_bytes(data)
    with pytest.raises(EmptyDocument):
        load_document(str(path))


def test_fifo_is_refused_at_once_not_waited_on(tmp_path: Path) -> None:
    import os
    import threading

    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)
    result: list[BaseException] = []
    reader = threading.Thread(target=lambda: result.append(pytest.raises(UnsupportedInput, load_document,
                                                                         str(fifo)).value), daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert not reader.is_alive(), "load_document blocked on a FIFO with no writer"
    assert_error(result[0], str(fifo), "FIFO")


def test_socket_and_devices_are_refused(tmp_path: Path) -> None:
    import socket

    sock_path = tmp_path / "s.txt"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(sock_path))
    sock.close()
    with pytest.raises(UnsupportedInput, match="socket"):
        load_document(str(sock_path))
    for device in ("/dev/zero", "/dev/null"):
        if Path(device).exists():
            with pytest.raises(UnsupportedInput, match="device"):
                load_document(device)


def test_broken_link_is_not_found(tmp_path: Path) -> None:
    link = tmp_path / "gone.txt"
    link.symlink_to(tmp_path / "nowhere.txt")
    with pytest.raises(InputNotFound, match="broken symbolic link"):
        load_document(str(link))


def test_stdin_bytes_are_decoded_like_a_file() -> None:
    class Stdin(io.TextIOWrapper):
        pass

    undecodable = Stdin(io.BytesIO(b"caf\xe9 \xed\xa0\x80 ok"), encoding="utf-8", errors="surrogateescape")
    text = load_document("-", stdin=undecodable).text
    assert text.startswith("caf\ufffd") and text.endswith(" ok")
    text.encode("utf-8")  # no lone surrogate left: the tokenizer would fail on one
    binary = io.TextIOWrapper(io.BytesIO(bytes(range(256))), encoding="utf-8")
    with pytest.raises(UnsupportedInput, match="binary"):
        load_document("-", stdin=binary)
