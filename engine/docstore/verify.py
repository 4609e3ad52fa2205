"""`specache cache verify`: every CRC of a stored entry checked, the exact rows' included.

A load maps an entry and reads only what a run uses (engine/docstore/store.py DocStore.load), so it cannot
check the CRC of the exact rows; this reads the whole file once (through the page cache: no copy is held) and
checks what a load checks plus those CRCs."""
from __future__ import annotations

from pathlib import Path

from engine.backends.host_pages import MappedFile
from engine.docstore.entries import EntryError, parse


def entry_damage(path: Path, key: str) -> str | None:
    """None when the entry at path is whole (sizes, layout, its key, every tensor's CRC), else what is wrong."""
    try:
        mapped = MappedFile(path)
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    try:
        tensors, meta = parse(mapped.buffer, verify=True)
        del tensors  # views of the mapping
        if meta.get("key") != key:
            return "the entry's header names another key"
    except EntryError as exc:
        return str(exc)
    finally:
        mapped.close()
    return None
