"""Host memory for an exact store that a device with memory of its own may pin in place: anonymous mappings
(their addresses handed to Streams.pin, engine/backends/streams.py) and the zero tensors in them
(engine/kvcache/host_store.py's HostStore keeps its K and V there)."""
from __future__ import annotations

import mmap

import numpy as np
import torch


class HostMapping(mmap.mmap):
    """Anonymous private memory (as malloc's) that a device with memory of its own may pin in place
    (Streams.pin: page-locked and mapped, so that copies from it run asynchronously and kernels may read
    it). Unpinned before it is unmapped, also when dropped without unpin() (a registration outliving its
    mapping would refuse the next one at that address)."""

    address = nbytes = 0
    pinned = False
    streams = None  # the Streams that pinned it

    def pin(self, streams) -> bool:
        """Page-lock it. -> whether the device did."""
        if not self.pinned:
            self.pinned = streams.pin(self.address, self.nbytes)
            self.streams = streams if self.pinned else None
        return self.pinned

    def unpin(self) -> None:
        if self.pinned:
            self.streams.unpin(self.address)
            self.pinned = False

    def __del__(self) -> None:
        if self.pinned:
            self.streams.synchronize()  # no copy from or to it is in flight
            self.unpin()


def mapped_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, HostMapping | None]:
    """A zero CPU tensor in memory of its own mapping (anonymous mmap: page-aligned, the system's zero
    pages until written, returned to the system when the tensor is freed), and that mapping (None for
    an empty tensor). torch.zeros writes every byte, so a store planned for prompt + max_tokens would be
    resident in full from the start; this one costs resident memory only for the positions a run writes."""
    nbytes = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype), None
    mapping = HostMapping(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(mapping, dtype=torch.uint8).view(dtype).view(shape)
    mapping.address, mapping.nbytes = t.data_ptr(), nbytes
    return t, mapping


def untouched_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """mapped_zeros' tensor."""
    return mapped_zeros(shape, dtype)[0]
