"""A file's pages as host memory: an entry of the document store (engine/docstore) mapped copy-on-write,
and a stored row's exact K/V placed in the host store's own memory (engine/kvcache/host_store.py HostStore) by
mapping the entry's pages over it (mmap with MAP_FIXED | MAP_PRIVATE) instead of copying them in.

Such a row is read from the page cache where a step reads it (the fetched rows): it costs no anonymous memory,
its first use waits for no copy, and the kernel may drop its pages under memory pressure (they are clean: a
store larger than RAM still works, from the disk). A write into it (a store position rewritten) goes to a
private copy of its page, never to the file, as do the positions after it, which the question's tokens and
the decode write. Linux only (MAP_FIXED through libc); elsewhere placing declines and the caller copies."""
from __future__ import annotations

import ctypes
import math
import mmap
import os
import sys

import torch

PAGE = mmap.PAGESIZE
_MAP_FIXED = 0x10  # <sys/mman.h> on the architectures Linux runs this on (not exposed by the mmap module)
_MADV_DONTNEED = 4


def _libc() -> ctypes.CDLL | None:
    """libc's mmap and mincore, typed; None off Linux."""
    if sys.platform != "linux":
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _libc()


def paged_length(n: int, row_bytes: int) -> int:
    """n rounded up so that n rows of row_bytes each fill whole pages (a host store's length per KV head,
    a stored row's padded length: each head's rows then start on a page)."""
    quantum = PAGE // math.gcd(PAGE, row_bytes)
    return -(-n // quantum) * quantum


def _round_up(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


class PlacedPages:
    """The file pages placed in one cache's host store (MappedFile.place): how many bytes, and how many of
    them are in memory now (mincore: the page cache's, shared with other readers of the file, and the private
    copies of the pages written)."""

    def __init__(self):
        self.spans: list[tuple[int, int]] = []  # (address, bytes)

    def release(self, within: torch.Tensor) -> int:
        """Drop from this process the placed pages inside `within`'s memory that still map the file (madvise
        MADV_DONTNEED on them; a page written since, a private copy now, is kept): a later read maps them again
        from the page cache, the file's bytes. The kernel may keep them cached; this process no longer holds
        them. -> bytes released."""
        lo = within.data_ptr()
        hi = lo + within.numel() * within.element_size()
        done = 0
        for address, nbytes in self.spans:
            if lo <= address and address + nbytes <= hi:
                for start, size in _file_runs(address, nbytes):
                    if _LIBC.madvise(start, size, _MADV_DONTNEED) == 0:
                        done += size
        return done

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.spans)

    def resident(self) -> int:
        """Bytes of the placed pages in memory now (while the host store that holds them is alive)."""
        total = 0
        for address, nbytes in self.spans:
            vec = (ctypes.c_ubyte * (nbytes // PAGE))()
            if _LIBC is not None and _LIBC.mincore(address, nbytes, vec) == 0:
                total += int(torch.frombuffer(vec, dtype=torch.uint8).bitwise_and(1).sum()) * PAGE
        return total


class MappedFile:
    """A whole file mapped copy-on-write (`data`: its bytes, uint8; writing there never reaches the file), with
    its descriptor open until close(), for place(). padded: spans [a, b) of file offsets whose tensors' rows
    end in zero padding up to a page (the writer's promise, engine/docstore/entries.py), where place() may map."""

    fd = -1

    def __init__(self, path: os.PathLike | str):
        self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            self.stat = os.fstat(self.fd)
            self.size = self.stat.st_size
            self.buffer = mmap.mmap(self.fd, 0, access=mmap.ACCESS_COPY) if self.size else bytearray()
        except (OSError, ValueError):
            os.close(self.fd)
            raise
        self.data = torch.frombuffer(self.buffer, dtype=torch.uint8) if self.size else torch.empty(0, dtype=torch.uint8)
        self.address = self.data.data_ptr()
        self.padded: list[tuple[int, int]] = []

    def close(self) -> None:
        """Close the descriptor (the mapping lives on while its tensors do; placed pages keep the file)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        self.close()

    def place(self, src: torch.Tensor, dst: torch.Tensor, placed: PlacedPages) -> bool:
        """Map the file's pages under src [A, n, D] (a view of this file: each src[a] contiguous, on a page, in a
        padded span) over dst [A, L, D] (host memory of a private anonymous mapping of the caller's, each
        dst[a] on a page, L >= n): dst[a, :n] then holds src[a], read from the page cache, and dst[a, n:]
        the file's zero padding up to the page, private anonymous memory after it. Recorded in `placed`.
        -> False where it cannot, dst holding zeros (a fresh row's) (not Linux, another layout, the mapping refused)."""
        spans = self._spans(src, dst)
        if spans is None:
            return False
        done = []
        for address, offset, nbytes in spans:
            got = _LIBC.mmap(address, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | _MAP_FIXED,
                             self.fd, offset)
            if got != address:  # (MAP_FIXED: failed) the old pages may be gone: a fresh row's zeros back
                for address0, nbytes0 in [(address, nbytes)] + done:
                    _zero_pages(address0, nbytes0)
                return False
            done.append((address, nbytes))
        placed.spans += done
        return True

    def _spans(self, src: torch.Tensor, dst: torch.Tensor) -> list[tuple[int, int, int]] | None:
        """(address in dst, file offset, bytes) per leading slice, where place() applies; else None."""
        if _LIBC is None or self.fd < 0 or src.dim() != 3 or dst.dim() != 3 or src.dtype != dst.dtype \
                or dst.device.type != "cpu" or src.shape[0] != dst.shape[0] or src.shape[2] != dst.shape[2] \
                or src.shape[1] > dst.shape[1] or src.numel() == 0:
            return None
        n, d = src.shape[1], src.shape[2]
        if src.stride()[1:] != (d, 1) or dst.stride()[1:] != (d, 1):
            return None
        nbytes = _round_up(n * d * src.element_size())
        room = dst.shape[1] * d * dst.element_size()
        spans = []
        for a in range(src.shape[0]):
            offset, address = src[a].data_ptr() - self.address, dst[a].data_ptr()
            inside = any(lo <= offset and offset + nbytes <= hi for lo, hi in self.padded)
            if not inside or offset % PAGE or address % PAGE or nbytes > room:
                return None
            spans.append((address, offset, nbytes))
        return spans


def _file_runs(address: int, nbytes: int) -> list[tuple[int, int]]:
    """Runs (address, bytes) of the pages in [address, address + nbytes) that are in this process's memory and map
    a file's page (/proc/self/pagemap: bit 63 present, bit 61 a file page; a private copy of a written page is
    anonymous); none where pagemap cannot be read."""
    try:
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(address // PAGE * 8)
            raw = f.read(nbytes // PAGE * 8)
    except OSError:
        return []
    flags = torch.frombuffer(bytearray(raw), dtype=torch.int64) if raw else torch.empty(0, dtype=torch.int64)
    keep = (((flags >> 63) & 1) * ((flags >> 61) & 1)).to(torch.int8)
    edges = torch.diff(keep, prepend=keep.new_zeros(1), append=keep.new_zeros(1))
    starts, ends = (edges == 1).nonzero().flatten().tolist(), (edges == -1).nonzero().flatten().tolist()
    return [(address + a * PAGE, (b - a) * PAGE) for a, b in zip(starts, ends)]


def _zero_pages(address: int, nbytes: int) -> None:
    """Private anonymous zero pages at [address, address + nbytes) (what a host store's memory was)."""
    _LIBC.mmap(address, nbytes, mmap.PROT_READ | mmap.PROT_WRITE,
               mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED, -1, 0)
