"""`specache cache verify`: every CRC of a stored entry checked, the exact rows' included.

A load maps an entry and reads only what a run uses (engine/docstore/store.py DocStore.load), so it cannot
check the CRC of the exact rows; this reads the whole file once (through the page cache: no copy is held) and
checks what a load checks plus those CRCs."""
from __future__ import annotations

import os
from pathlib import Path

from engine.backends.host_pages import MappedFile
from engine.docstore.entries import EntryError, parse


def entry_damage(path: Path, key: str) -> tuple[str | None, os.stat_result | None]:
    """(None when the entry at path is whole: sizes, layout, its key, every tensor's CRC; else what is wrong,
    the file's stat as it was read: DocStore.delete_if_unchanged)."""
    try:
        mapped = MappedFile(path)
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})", None
    try:
        tensors, meta = parse(mapped.buffer, verify=True)
        del tensors  # views of the mapping
        if meta.get("key") != key:
            return "the entry's header names another key", mapped.stat
    except EntryError as exc:
        return str(exc), mapped.stat
    finally:
        mapped.close()
    return None, mapped.stat
