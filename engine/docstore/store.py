"""The persistent document KV store: a prefilled prefix's exact cache state on disk, so that a
later `ask` or `summarize` on the same document and model loads it instead of prefilling.

This module knows nothing about models or caches: it stores named tensors under a key, with
the token ids they were computed from, and keeps the folder healthy.

Layout (in `engine.paths.cache_root() / "kv"`):

    <key>.safetensors      one entry; immutable once it has its name
    .part-<key>-<pid>-<r>  a write in progress (renamed to <key>.safetensors when complete)
    .lock                  the store lock (filelock), held to publish, evict and delete entries

Key: sha256 of the model fingerprint, the settings that change the KV (dtype, cache mode, bits,
group, residual window, sinks, ...) and the sha256 of the token ids; see `make_key`.

An entry is a standard safetensors file. Its tensors are `ids` (int64, the prefix's token ids)
plus whatever the caller exports; the header's metadata holds the key's settings, the length,
a label (the document) and one CRC-32 per tensor. A load checks the header, the file size,
every CRC and the token ids; an entry failing any check is reported, deleted and treated as a
miss. Writes go to a .part file (fsynced) that is renamed into place under the lock, so a
reader never sees half an entry, whatever happens to the writer (Ctrl-C, kill, crash).
Least-recently-used eviction keeps the folder under a size cap; a hit refreshes the entry's
mtime, which is what "recently used" means here. The cap is applied each time a command opens
the store (`tidy`), so a lower cap takes effect at once, and unfinished writes of dead writers are
swept then too. Anything else in the folder (a folder named like an entry, a link, a stray file)
is never read, counted or deleted: it is reported once per open and skipped.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Collection, Mapping, Sequence

import torch
from filelock import FileLock

from engine.backends.host_pages import MappedFile
from engine.docstore.entries import FORMAT, KEY_FORMAT, EntryError, parse, read_header, serialized_size, write
from engine.errors import StorageError
from engine.paths import cache_root

SUFFIX = ".safetensors"
PART_PREFIX = ".part-"
STALE_PART_SECONDS = 3600  # a .part file this old whose writer is gone is debris from a killed write
DEFAULT_MAX_GB = 20.0
LOCK_TIMEOUT = 300.0  # seconds; the lock is only held to publish, evict or delete, never while computing
ENV_MAX_GB = "SPECACHE_CACHE_MAX_GB"
KEY_PATTERN = re.compile(r"[0-9a-f]{32}")  # make_key: 32 hex digits of a sha256
LOCK_NAME = ".lock"

def store_dir() -> Path:
    """The store folder under the user cache ($SPECACHE_CACHE_DIR respected)."""

    return cache_root() / "kv"


def max_bytes_from(max_gb: float | None) -> int | None:
    """The size cap in bytes: the flag, else $SPECACHE_CACHE_MAX_GB, else DEFAULT_MAX_GB."""
    if max_gb is None:
        env = os.environ.get(ENV_MAX_GB, "").strip()
        if env:
            try:
                max_gb = float(env)
            except ValueError:
                raise ValueError(f"{ENV_MAX_GB} must be a number of GB, not {env!r}") from None
        else:
            max_gb = DEFAULT_MAX_GB
    if not (math.isfinite(max_gb) and max_gb > 0):
        raise ValueError(f"the store size cap must be a finite number of GB > 0, not {max_gb}")
    return int(max_gb * 1e9)


def check_folder(path: Path) -> None:
    """Raise StorageError when `path` cannot be a folder: it, or the first of its parents that
    exists, is something else (e.g. SPECACHE_CACHE_DIR pointing below a regular file)."""
    path = Path(path)
    for candidate in (path, *path.parents):
        if candidate.exists():
            if not candidate.is_dir():
                raise StorageError(f"{path} cannot be a folder: {candidate} is a file "
                                   f"(check SPECACHE_CACHE_DIR / XDG_CACHE_HOME)")
            return


def ids_digest(ids: Sequence[int]) -> str:
    return hashlib.sha256(torch.tensor(list(ids), dtype=torch.int64).numpy().tobytes()).hexdigest()


def make_key(settings: Mapping[str, object], ids: Sequence[int]) -> str:
    """The entry key: what produced the KV (model fingerprint and KV-changing settings) + the tokens."""
    material = json.dumps({"format": KEY_FORMAT, **settings, "ids_sha256": ids_digest(ids)}, sort_keys=True)
    return hashlib.sha256(material.encode()).hexdigest()[:32]


@dataclass
class EntryInfo:
    """One entry as `specache cache ls` shows it."""

    key: str
    path: Path
    bytes: int
    last_used: float  # mtime: refreshed on every hit
    meta: dict = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return int(self.meta.get("tokens", 0))


@dataclass
class Loaded:
    """A verified entry: its tensors are views of its mapping (pages: MappedFile.place maps its paged rows into
    a host store); close() once they are imported."""

    key: str
    tensors: dict[str, torch.Tensor]
    meta: dict
    bytes: int
    pages: MappedFile | None = None

    def close(self) -> None:
        if self.pages is not None:
            self.pages.close()


class DocStore:
    """Entries on disk under `root` (see the module docstring)."""

    def __init__(self, root: Path | None = None, max_bytes: int | None = None,
                 warn: Callable[[str], None] | None = None, note: Callable[[str], None] | None = None):
        """warn: reports a bad entry or a failed write; note: reports evictions."""
        self.root = Path(root) if root is not None else store_dir()
        self.max_bytes = max_bytes
        self.warn = warn if warn is not None else (lambda message: None)
        self.note = note if note is not None else (lambda message: None)

    # ---- paths and locking ---------------------------------------------------------------
    def path(self, key: str) -> Path:
        return self.root / f"{key}{SUFFIX}"

    def lock(self) -> FileLock:
        self.root.mkdir(parents=True, exist_ok=True)
        return FileLock(str(self.root / LOCK_NAME), timeout=LOCK_TIMEOUT)  # filelock.Timeout is an OSError

    # ---- opening -------------------------------------------------------------------------
    def tidy(self) -> list[EntryInfo]:
        """What a command does when it opens the store: report what does not belong in the folder,
        sweep unfinished writes of dead writers and evict least-recently-used entries down to the cap
        (a lowered --cache-max-gb or SPECACHE_CACHE_MAX_GB applies at once). -> the entries evicted."""
        if not self.root.is_dir():
            return []
        strays = self.strays()
        if strays:
            shown = ", ".join(p.name + ("/" if p.is_dir() else "") for p in strays[:5])
            more = f" and {len(strays) - 5} more" if len(strays) > 5 else ""
            self.warn(f"ignoring {len(strays)} item(s) in the store folder {self.root} that are not store "
                      f"entries: {shown}{more}")
        with self.lock():
            return self._evict_locked(self.max_bytes)

    def _scan(self) -> tuple[list[tuple[Path, os.stat_result]], list[Path], list[Path]]:
        """(entry files with their stat, unfinished writes, strays) in the folder, without following links."""
        entries, parts, strays = [], [], []
        if not self.root.is_dir():
            return entries, parts, strays
        for path in self.root.iterdir():
            try:
                st = path.lstat()
            except FileNotFoundError:
                continue
            regular = stat.S_ISREG(st.st_mode)
            name = path.name
            if name == LOCK_NAME or (name.startswith(LOCK_NAME) and regular):
                continue
            if name.startswith(PART_PREFIX) and regular:
                parts.append(path)
            elif regular and name.endswith(SUFFIX) and KEY_PATTERN.fullmatch(name[: -len(SUFFIX)]):
                entries.append((path, st))
            else:
                strays.append(path)
        return entries, parts, sorted(strays)

    def strays(self) -> list[Path]:
        """Things in the folder that are neither entries, unfinished writes nor the lock (never touched)."""
        return self._scan()[2]

    # ---- reading -------------------------------------------------------------------------
    def load(self, key: str, ids: Sequence[int]) -> Loaded | None:
        """The verified entry for key, mapped (its paged rows are read where they are used: entries.parse; close
        it once imported), or None (a miss). A bad entry is reported, deleted and missed."""
        path = self.path(key)
        try:
            mapped = MappedFile(path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            self.warn(f"store entry {key[:12]} could not be read ({exc}); rebuilding it")
            return None
        try:
            tensors, meta = parse(mapped.buffer, verify=True, mapped=mapped)
            if meta.get("key") != key:
                raise EntryError("the entry's header names another key")
            stored = tensors.get("ids")
            if stored is None or stored.tolist() != list(ids):
                raise EntryError("the stored token ids differ from the document's")
        except EntryError as exc:
            mapped.close()
            self.warn(f"store entry {key[:12]} is corrupt ({exc}); deleted, rebuilding it")
            try:
                self.delete_if_unchanged(path, mapped.stat)
            except OSError as err:  # e.g. a read-only store: the entry stays unused all the same
                self.warn(f"could not delete store entry {key[:12]} ({err})")
            return None
        try:
            os.utime(path)  # least recently used = oldest mtime
        except OSError:
            pass
        return Loaded(key, tensors, meta, mapped.size, mapped)

    def discard(self, key: str, reason: str) -> None:
        """Delete an entry found unusable by its reader (reported on stderr through warn)."""
        self.warn(f"store entry {key[:12]} is unusable ({reason}); deleted, rebuilding it")
        try:
            with self.lock():
                self.path(key).unlink(missing_ok=True)
        except OSError as err:
            self.warn(f"could not delete store entry {key[:12]} ({err})")

    def delete_if_unchanged(self, path: Path, seen: os.stat_result) -> None:
        """Delete a bad entry, unless a writer has replaced it with a new file meanwhile."""
        with self.lock():
            try:
                now = os.stat(path)
                if (now.st_ino, now.st_dev, now.st_mtime_ns) == (seen.st_ino, seen.st_dev, seen.st_mtime_ns):
                    os.unlink(path)
            except FileNotFoundError:
                pass

    # ---- writing -------------------------------------------------------------------------
    def save(self, key: str, ids: Sequence[int], tensors: Mapping[str, torch.Tensor],
             meta: Mapping[str, object] | None = None, paged: Collection[str] = ()) -> int | None:
        """Write an entry atomically; evict least-recently-used entries to stay under the cap. paged: the
        names of tensors [A, n, D] stored page by page, for a load to map in place (entries.py).
        Returns the entry's size in bytes, or None when it was not kept (bigger than the cap)."""
        all_tensors = {"ids": torch.tensor(list(ids), dtype=torch.int64), **tensors}
        header = {**(meta or {}), "key": key, "format": FORMAT, "tokens": len(ids), "created": time.time()}
        if paged:
            header["paged"] = {n: tensors[n].shape[1] for n in paged}
        size = serialized_size(all_tensors, header)
        if self.max_bytes is not None and size > self.max_bytes:
            self.warn(f"not storing {key[:12]}: {size / 1e9:.2f} GB is over the store cap "
                      f"({self.max_bytes / 1e9:.2f} GB; --cache-max-gb or {ENV_MAX_GB})")
            return None
        self.root.mkdir(parents=True, exist_ok=True)
        part = self.root / f"{PART_PREFIX}{key}-{os.getpid()}-{os.urandom(4).hex()}"
        try:
            size = write(part, all_tensors, header)
            with self.lock():
                final = self.path(key)
                if final.exists():  # another process published it first: the same content
                    os.utime(final)
                    return final.stat().st_size
                self._evict_locked(self.max_bytes - size if self.max_bytes is not None else None)
                os.replace(part, final)
                _fsync_dir(self.root)
            return size
        finally:
            try:
                os.unlink(part)
            except FileNotFoundError:
                pass

    # ---- listing and housekeeping --------------------------------------------------------
    def entries(self, with_meta: bool = True) -> list[EntryInfo]:
        """Published entries, least recently used first."""
        out = []
        for path, st in self._scan()[0]:
            meta = {}
            if with_meta:
                try:
                    meta = read_header(path)[1]
                except (OSError, EntryError):
                    meta = {"unreadable": True}
            out.append(EntryInfo(path.name[: -len(SUFFIX)], path, st.st_size, st.st_mtime, meta))
        return sorted(out, key=lambda e: e.last_used)

    def total_bytes(self) -> int:
        return sum(e.bytes for e in self.entries(with_meta=False))

    def remove(self, keys: Sequence[str]) -> int:
        """Delete entries by key; returns the bytes freed."""
        freed = 0
        with self.lock():
            for key in keys:
                try:
                    st = self.path(key).lstat()
                    if stat.S_ISREG(st.st_mode):  # a folder or link named like an entry is not one
                        self.path(key).unlink()
                        freed += st.st_size
                except FileNotFoundError:
                    pass
        return freed

    def clear(self) -> tuple[int, int]:
        """Delete every entry and every unfinished write. -> (entries, bytes freed)."""
        with self.lock():
            entries = self.entries(with_meta=False)
            for e in entries:
                e.path.unlink(missing_ok=True)
            self._sweep_parts(all_parts=True)
        return len(entries), sum(e.bytes for e in entries)

    def evict(self, max_bytes: int | None = None) -> list[EntryInfo]:
        """Delete least-recently-used entries until the store holds at most max_bytes (default: the cap)."""
        with self.lock():
            return self._evict_locked(self.max_bytes if max_bytes is None else max_bytes)

    def _evict_locked(self, budget: int | None) -> list[EntryInfo]:
        self._sweep_parts()
        if budget is None:
            return []
        entries = self.entries(with_meta=False)
        total = sum(e.bytes for e in entries)
        evicted = []
        for e in entries:  # oldest first
            if total <= budget:
                break
            e.path.unlink(missing_ok=True)
            total -= e.bytes
            evicted.append(e)
        if evicted:
            self.note(f"store over its cap: evicted {len(evicted)} least recently used "
                      f"entr{'y' if len(evicted) == 1 else 'ies'} ({sum(e.bytes for e in evicted) / 1e6:.0f} MB)")
        return evicted

    def _sweep_parts(self, all_parts: bool = False) -> None:
        """Remove unfinished writes left by killed writers (all of them when clearing)."""
        now = time.time()
        for part in self._scan()[1]:
            try:
                pid = int(part.name.rsplit("-", 2)[1])
                age = now - part.stat().st_mtime
            except (ValueError, IndexError, FileNotFoundError):
                continue
            if all_parts or not _alive(pid) or age > STALE_PART_SECONDS:
                part.unlink(missing_ok=True)

    def part_files(self) -> list[Path]:
        """Unfinished writes (of live writers, or debris of killed ones not swept yet)."""
        return sorted(self._scan()[1])

    def part_bytes(self) -> int:
        """Bytes the unfinished writes take on disk."""
        total = 0
        for part in self.part_files():
            try:
                total += part.lstat().st_size
            except FileNotFoundError:
                pass
        return total


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
