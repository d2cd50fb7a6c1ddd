"""Bucket buffers and the copies in and out of them, for the streaming transport (``stream.py``).

Sender side: ``tensor_chunks`` / ``chunk_views`` cut each source tensor into the items of the plan's
buckets, and ``BucketPacker`` copies a bucket's chunks into its buffer slot. Receiver side:
``BucketStager`` copies the slices a rank keeps out of a received bucket into the receiver's staging
tensors. Both issue one ``torch._foreach_copy_`` per bucket (per dtype pair), not one ``copy_`` per
tensor, and build their buffer-slot views once per transport. ``BucketBuffers`` holds the two bucket
buffers a rank alternates between.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from areno.sync.base import ShardReceiver, ShardSpec
from areno.sync.plan import Bucket, BucketItem


class BucketBuffers:
    """The two bucket buffers of one rank (uint8, on the transport's device), allocated at first
    use with the plan's largest bucket size: packing or receiving bucket k+1 overlaps bucket k."""

    def __init__(self, device: torch.device, max_bucket_bytes: int) -> None:
        self.device = device
        self.size = max(max_bucket_bytes, 1)
        self._buffers: list[torch.Tensor] = []
        self.peak_bytes = 0
        """Largest total bucket-buffer memory this rank held (at most two buckets)."""

    def get(self, slot: int) -> torch.Tensor:
        """Buffer ``slot % 2`` (bucket k of a receiver lands in buffer k % 2)."""
        if not self._buffers:
            self._buffers = [torch.empty(self.size, dtype=torch.uint8, device=self.device) for _ in range(2)]
            self.peak_bytes = 2 * self.size
        return self._buffers[slot % 2]


def foreach_copy(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> int:
    """``dst.copy_(src)`` for every pair, as one ``torch._foreach_copy_`` per (dst dtype, src dtype)
    group (a group of one dtype pair and equal dense layouts takes the fused multi-tensor kernel on
    CUDA; any other pair is still copied, one by one in C++). Returns the number of calls made."""
    if not dsts:
        return 0
    d0, s0 = dsts[0].dtype, srcs[0].dtype
    if all(d.dtype == d0 for d in dsts) and all(s.dtype == s0 for s in srcs):
        torch._foreach_copy_(dsts, srcs)
        return 1
    groups: dict[tuple[torch.dtype, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for d, s in zip(dsts, srcs):
        g = groups.setdefault((d.dtype, s.dtype), ([], []))
        g[0].append(d)
        g[1].append(s)
    for gd, gs in groups.values():
        torch._foreach_copy_(gd, gs)
    return len(groups)


TensorChunks = tuple[list[tuple[int, BucketItem]], tuple[int, ...], tuple[int, ...] | None]
"""One source tensor's items as ``(position in the buckets, item)`` in row order, its shape as sent,
and the rows of each chunk when they cover the tensor back to back (None otherwise)."""


def tensor_chunks(buckets: list[Bucket]) -> dict[int, TensorChunks]:
    """``TensorChunks`` per source tensor index of the items in ``buckets``."""
    by_tensor: dict[int, list[tuple[int, BucketItem]]] = {}
    for pos, bucket in enumerate(buckets):
        for item in bucket.items:
            by_tensor.setdefault(item.tensor_index, []).append((pos, item))
    out = {}
    for idx, entries in by_tensor.items():
        entries.sort(key=lambda e: e[1].row_start)
        items = [i for _, i in entries]
        covers = (
            items[0].row_start == 0
            and items[-1].row_end == items[0].shape[0]
            and all(a.row_end == b.row_start for a, b in zip(items, items[1:]))
        )
        out[idx] = (entries, items[0].shape, tuple(i.row_end - i.row_start for i in items) if covers else None)
    return out


def chunk_views(full: torch.Tensor, chunks: TensorChunks) -> Sequence[torch.Tensor]:
    """The rows of each item of ``chunks`` in ``full`` (viewed as the shape sent): views, one
    ``split`` call for a tensor its items cover (one per item otherwise)."""
    entries, shape, sizes = chunks
    if full.shape != shape:
        full = full.reshape(shape)
    if sizes is None:
        return [full[i.row_start : i.row_end] for _, i in entries]
    return (full,) if len(sizes) == 1 else full.split_with_sizes(sizes)


class BucketPacker:
    """Sender side: per (bucket, buffer slot), the view of every item's place in the slot's buffer
    (``chunk_shape``, wire dtype), built on first use and kept for the transport's life (the
    buffers are allocated once). ``pack`` copies a list of source chunks into them at once."""

    def __init__(self) -> None:
        self._views: dict[tuple[int, int], list[torch.Tensor]] = {}

    def views(self, bucket: Bucket, slot: int, buf: torch.Tensor) -> list[torch.Tensor]:
        key = (bucket.index, slot)
        views = self._views.get(key)
        if views is None:
            views = [buf[i.offset : i.offset + i.nbytes].view(i.dtype).view(i.chunk_shape) for i in bucket.items]
            self._views[key] = views
        return views

    def pack(self, bucket: Bucket, slot: int, buf: torch.Tensor, first: int, chunks: list[torch.Tensor]) -> int:
        """Copy ``chunks`` (items ``first, first + 1, ...`` of ``bucket``, each its rows as sent)
        into the slot's buffer; returns the number of copy calls."""
        return foreach_copy(self.views(bucket, slot, buf)[first : first + len(chunks)], chunks)


_Src = tuple[torch.Tensor | None, int, int]
"""A staged item: its rows in the received buffer (None: none kept here), and the rows [lo, hi)
of the staging tensor they go to."""


class BucketStager:
    """Receiver side: copies the slices this rank keeps out of a received bucket into the
    receiver's staging tensors, one ``torch._foreach_copy_`` per dtype pair per bucket (dim-0
    slices, replicated tensors and dim-1 (rowwise) slices alike).

    The source views (a bucket always lands in the same buffer) are built once per bucket. The
    destination views depend on the staging tensors' storage, which a swap commit trades every
    sync: they are cached per bucket under the staging tensors' data pointers (a cached view keeps
    its storage alive, so an equal pointer is the same memory), at most ``keep`` sets per bucket.
    ``receiver.stage(name)`` is still called for every item each sync (it marks the name written)."""

    def __init__(self, receiver: ShardReceiver, specs: Mapping[str, ShardSpec], keep: int = 2) -> None:
        self.receiver = receiver
        self.specs = specs
        self.keep = keep
        # bucket index -> (names to stage, per name: (source view or None, dest row lo, hi))
        self._src: dict[int, tuple[list[str], list[_Src]]] = {}
        self._dst: dict[int, dict[tuple[int, ...], tuple[list[torch.Tensor], list[torch.Tensor]]]] = {}

    def _sources(self, bucket: Bucket, buf: torch.Tensor) -> tuple[list[str], list[_Src]]:
        cached = self._src.get(bucket.index)
        if cached is not None:
            return cached
        names, srcs = [], []
        for item in bucket.items:
            spec = self.specs.get(item.name)
            if spec is None:
                continue
            rows = buf[item.offset : item.offset + item.nbytes].view(item.dtype).view(item.chunk_shape)
            r0, r1 = item.row_start, item.row_end
            if spec.dim == 0:
                lo, hi = max(r0, spec.start), min(r1, spec.start + spec.length)
                src = (rows[lo - r0 : hi - r0], lo - spec.start, hi - spec.start) if lo < hi else (None, 0, 0)
            elif spec.dim is None:
                src = (rows, r0, r1)
            else:
                src = (rows.narrow(spec.dim, spec.start, spec.length), r0, r1)
            names.append(item.name)
            srcs.append(src)
        self._src[bucket.index] = (names, srcs)
        return names, srcs

    def stage(self, bucket: Bucket, buf: torch.Tensor) -> int:
        """Copy this rank's slices of ``bucket`` (received in ``buf``) into staging; returns the
        number of copy calls."""
        names, srcs = self._sources(bucket, buf)
        stage = self.receiver.stage
        dests = [stage(n) for n in names]
        key = tuple(d.data_ptr() for d in dests)
        cache = self._dst.setdefault(bucket.index, {})
        pairs = cache.get(key)
        if pairs is None:
            dst_views, src_views = [], []
            for dest, (src, lo, hi) in zip(dests, srcs):
                if src is None:
                    continue
                dst_views.append((dest if dest.dim() else dest.view(1))[lo:hi])
                src_views.append(src)
            pairs = (dst_views, src_views)
            if len(cache) >= self.keep:
                del cache[next(iter(cache))]
            cache[key] = pairs
        return foreach_copy(*pairs)
