"""The row state of a guided layer (engine/kvcache/guided.py) as a mixin: copying a row, exporting and importing
it (the document store), and the bytes it takes on the device and the host."""
from __future__ import annotations

import torch

from engine.backends.host_pages import MappedFile
from engine.kvcache.base import import_tensors
from engine.config import CacheConfig
from engine.kvcache.sizes import layer_kv_bytes_per_token, quant_boundary, store_dtype


STORE_ROWS = ("store_k", "store_v")  # a row's exact K/V in its export: paged in the entry, placed on a load


class GuidedRows:
    """GuidedLayer's row copies, exports and byte accounts (its attributes: engine/kvcache/guided.py)."""

    @classmethod
    def exact_store_dtype(cls, config: CacheConfig, device: torch.device, dtype: torch.dtype) -> torch.dtype:
        """The element type of the exact host store (sizes.store_dtype: the setting's on a CPU)."""
        return store_dtype(config, device.type, dtype)

    def residual_kv(self, rows: slice, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first n slots of rows' residual windows, positions [qend, qend + n) of each row
        -> K, V [b, H_kv, n, D] (views, but a copy for several rows whose windows are in the store)."""
        if not self.res_in_store:
            return self.res_k[rows, :, :n], self.res_v[rows, :, :n]
        qends = self.qend_host[rows]
        if len(qends) == 1:
            q = qends[0]
            return self.res_k[rows, :, q : q + n], self.res_v[rows, :, q : q + n]
        # a row's window may run past the store's end where another row needs more slots: zeros there (masked)
        pad = lambda t: torch.nn.functional.pad(t, (0, 0, 0, n - t.shape[1]))  # noqa: E731  [H_kv, n, D]
        return tuple(torch.stack([pad(buf[rows.start + i, :, q : q + n]) for i, q in enumerate(qends)])
                     for buf in (self.res_k, self.res_v))

    def copy_row(self, src: int, dst: int, length: int) -> None:
        """Make row dst a copy of row src's state (its first `length` tokens)."""
        own = (self.sink_k, self.sink_v) + (() if self.res_in_store else (self.res_k, self.res_v))
        for t in (*own, self.qend, self.fidx, self.fvalid):
            t[dst] = t[src]
        self.stored[dst], self.qend_host[dst] = self.stored[src], self.qend_host[src]
        if self.store is not None:
            self.store.settle()  # CUDA: a prefetch into the fetched set may be in flight
            self.store.transfer.host_ready()  # and copies into the pinned store
            self.store.release_prefix()  # (a held row's device copy would no longer be its store's)
            self.store.fk[dst], self.store.fv[dst] = self.store.fk[src], self.store.fv[src]
            self.store.k[dst, :, :length] = self.store.k[src, :, :length]
            self.store.v[dst, :, :length] = self.store.v[src, :, :length]
        if self.guide is not None:
            self.guide.copy_row(src, dst)

    def export_row(self, row: int, length: int) -> dict[str, torch.Tensor]:
        """Row `row`'s state after `length` committed tokens (views): quantized boundary, sinks,
        residual buffer, exact host store and guide. Nothing else depends on the past tokens."""
        qend = self.qend_host[row]
        s = min(self.sinks, length)
        rk, rv = self.residual_kv(slice(row, row + 1), length - qend)
        if self.store is not None:
            self.flush_to_store(row, length)  # (positions enter the store as they leave the window: all of them)
            self.store.transfer.host_ready()  # CUDA: the store's copies are done before the CPU reads it
        out = {"qend": self.qend[row : row + 1], "sink_k": self.sink_k[row, :, :s], "sink_v": self.sink_v[row, :, :s],
               "res_k": rk[0], "res_v": rv[0]}
        if self.store is not None:
            out["store_k"], out["store_v"] = self.store.k[row, :, :length], self.store.v[row, :, :length]
        if self.guide is not None:
            out.update({f"guide.{n}": t for n, t in self.guide.export_row(row, qend).items()})
        return out

    def import_row(self, row: int, length: int, tensors: dict[str, torch.Tensor], check: bool = False,
                   pages: MappedFile | None = None) -> None:
        """Make row `row` (fresh) hold an export_row() of `length` tokens (check: only validate). pages: the mapped
        store entry the tensors are views of (engine.backends.host_pages.MappedFile): the exact rows are mapped
        from it into the store in place where they can be (HostStore.place_row), not copied."""
        qend = int(quant_boundary(torch.tensor(length), self.residual, self.group))
        got = tensors.get("qend")
        if got is None or got.numel() != 1 or int(got) != qend:
            raise ValueError(f"qend: expected {qend} for {length} tokens")
        room = self.res_k.shape[2] - (qend if self.res_in_store else 0)  # slots from the window's start
        if length - qend > room:
            raise ValueError("the residual window does not fit this cache")
        if not check:
            self.qend[row] = qend
            self.qend_host[row] = qend
            self.fvalid[row] = False
            self.stored[row] = length
            if self.store is not None:
                self.store.release_prefix()  # (the row's store is written below, not by write_span)
        s = min(self.sinks, length)
        r0 = qend if self.res_in_store else 0  # (the same memory as the store's positions, written twice alike)
        views = {"sink_k": self.sink_k[row, :, :s], "sink_v": self.sink_v[row, :, :s],
                 "res_k": self.res_k[row, :, r0 : r0 + length - qend], "res_v": self.res_v[row, :, r0 : r0 + length - qend]}
        if self.store is not None:
            views["store_k"], views["store_v"] = self.store.k[row, :, :length], self.store.v[row, :, :length]
        extra = set(tensors) - set(views) - {"qend"}
        if not check and pages is not None and self.store is not None and \
                self.store.place_row(row, tensors["store_k"], tensors["store_v"], pages):
            placed = set(STORE_ROWS) | ({"res_k", "res_v"} if self.res_in_store else set())  # (the store's memory)
            views = {n: t for n, t in views.items() if n not in placed}
        import_tensors(views, tensors, check)
        if self.guide is not None:
            guide = {n[len("guide."):]: t for n, t in tensors.items() if n.startswith("guide.")}
            self.guide.import_row(row, qend, guide, check)
            extra -= {f"guide.{n}" for n in guide}
        if extra:
            raise ValueError(f"unexpected tensors {sorted(extra)}")

    # ---- accounting ----------------------------------------------------------------------
    def device_bytes(self, lengths: torch.Tensor, element_size: int | None = None) -> int:
        per_token = layer_kv_bytes_per_token(self.shape, element_size or self.sink_k.element_size())
        qend = quant_boundary(lengths, self.residual, self.group)
        exact = int((lengths - qend).sum()) + int(torch.minimum(qend, torch.tensor(self.sinks)).sum())
        total = exact * per_token
        if self.guide is not None:
            total += self.guide.bytes(int(qend.sum()), rows=int((qend > 0).sum()))
        if self.topk:  # the fetched set holds at most k exact positions of the guided region
            total += int((qend - self.sinks).clamp(min=0).clamp(max=self.topk).sum()) * per_token
        return total

    def host_bytes(self, lengths: torch.Tensor) -> int:
        return self.store.host_bytes(int(lengths.sum())) if self.store is not None else 0

    def allocated_device_bytes(self) -> int:
        """Preallocated device bytes per row: sinks, residual window, guide and fetched set."""
        tensors = [self.sink_k, self.sink_v] + ([] if self.res_in_store else [self.res_k, self.res_v])
        if self.guide is not None:
            tensors += self.guide.tensors()
        if self.topk:
            tensors += [self.store.fk, self.store.fv]
        return sum(t.numel() * t.element_size() for t in tensors) // self.sink_k.shape[0]

    def store_key(self) -> dict:
        """A stored row depends on the window, the group, the sinks, the guide's width, rotation and outlier
        channels (None: no guide; a guide without a rotation or outliers keeps the key it had before those
        existed) and the store's element type where it is not the compute dtype."""
        key = {"residual": self.residual, "group": self.group, "sinks": self.sinks,
               "bits": self.config.bits if self.guide is not None else None}
        if self.guide is not None and self.guide.rotation is not None:
            key["rotation"] = self.config.guide_rotation
        if self.guide is not None and self.guide.outliers is not None:
            key["outliers"] = self.guide.outlier_count
        if self.store is not None and self.store.k.dtype != self.sink_k.dtype:  # a 16-bit store (an entry of the
            key["store"] = str(self.store.k.dtype).replace("torch.", "")  # compute dtype's keeps its key)
        return key
