"""The training side of a streamed policy sync (``stream.py``): iterate the weight source and send
this rank's row of buckets to its relay.

Every training rank iterates the ``WeightSource`` (so DTensor gathers stay collective); the owner
row packs its tensors into one of two bucket buffers and sends it as soon as the plan says the
bucket is complete, so packing bucket k+1 overlaps sending bucket k. A bucket of one contiguous
chunk in the wire dtype goes out as a view of the trained tensor (no copy). A bucket's chunks are
copied together once its last one was read, so a source that yields fresh tensors (not views of
live ones) has those of the bucket being packed held until then, at most a bucket's worth (a
gathered DTensor is copied out at once, so it can be freed). A buffer is reused only after its
previous send completed (on the stream when stream-ordered); at most two sends in flight.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from areno.sync.base import WeightSource, full_tensor
from areno.sync.buckets import BucketBuffers, BucketPacker, chunk_views, tensor_chunks
from areno.sync.collectives import Collectives
from areno.sync.plan import BucketItem, SyncPlan, TensorMeta


class BucketSender:
    """One training rank's part of every sync: ``row`` is its training DP row when it sends one
    (``-1``: it only iterates the source), ``relay`` the rollout rank it sends to over ``group``."""

    def __init__(
        self,
        *,
        rank: int,
        row: int,
        relay: int | None,
        group: dist.ProcessGroup | None,
        plan: SyncPlan,
        meta: Sequence[TensorMeta],
        buffers: BucketBuffers,
        collectives: Collectives,
    ) -> None:
        self.rank = rank
        self.relay = relay
        self.group = group
        self.meta = meta
        self.buckets = [b for b in plan.buckets if b.row == row]
        self.buffers = buffers
        self.collectives = collectives
        self.packer = BucketPacker()
        self._chunks: dict | None = None  # tensor_chunks of this rank's buckets, built at the first send
        # per sync: bucket position -> its send in flight; per buffer slot, the bucket packed in it
        # last; bucket position -> its slot, its chunks read but not yet packed, its items packed
        self._works: dict[int, dist.Work] = {}
        self._owner: list[int | None] = [None, None]
        self._slot_of: dict[int, int] = {}
        self._pending: dict[int, list[torch.Tensor]] = {}
        self._packed: dict[int, int] = {}
        self._transfer = 0.0

    def send(self, source: WeightSource) -> float:
        """Iterate ``source`` and send this rank's buckets in plan order; returns the seconds spent
        posting and waiting on the sends (the transfer time)."""
        if self._chunks is None:
            self._chunks = tensor_chunks(self.buckets)
        self._works, self._owner, self._slot_of, self._pending, self._packed = {}, [None, None], {}, {}, {}
        self._transfer = 0.0
        for idx, (name, tensor) in enumerate(source.iter_tensors()):
            if idx >= len(self.meta) or name != self.meta[idx][0]:
                raise ValueError(f"weight source order changed at {idx} ({name!r}); rebuild the transport")
            full = full_tensor(tensor)
            entry = self._chunks.get(idx)
            if entry is not None:
                for (pos, item), chunk in zip(entry[0], chunk_views(full, entry)):
                    self._add(pos, item, chunk)
            if full is not tensor:  # a gathered copy: pack what it holds now and let it go
                for pos in list(self._pending):
                    self._flush(pos)
            del full
        for pos in sorted(self._works):
            self._transfer += self._wait_send(pos)
        if self.collectives.stream_ordered:
            self._transfer += self.collectives.drain()
        return self._transfer

    def _add(self, pos: int, item: BucketItem, chunk: torch.Tensor) -> None:
        """Chunk ``item`` of the bucket at ``pos`` was read: send it alone, or pack it and send the
        bucket once its last item is in."""
        bucket = self.buckets[pos]
        first = item is bucket.items[0]
        if first:  # at most two sends in flight
            for prev in [p for p in self._works if p <= pos - 2]:
                self._transfer += self._wait_send(prev)
        if len(bucket.items) == 1 and chunk.dtype == item.dtype and chunk.is_contiguous():
            # A bucket of one contiguous chunk goes out as it is: no packing copy.
            self._post(pos, chunk.reshape(-1).view(torch.uint8))
            return
        if first:
            self._claim_slot(pos)
        self._pending.setdefault(pos, []).append(chunk)
        if item is bucket.items[-1]:
            self._flush(pos)
            self._post(pos, self.buffers.get(self._slot_of[pos])[: bucket.nbytes])
            del self._slot_of[pos]  # sent: the slot is free once its work completes
            self._packed.pop(pos, None)

    def _claim_slot(self, pos: int) -> None:
        """A buffer slot for the bucket at ``pos``: one not held by a bucket still being packed;
        wait for its previous send if that is in flight."""
        owner, works = self._owner, self._works
        free = [s for s in (0, 1) if owner[s] is None or owner[s] in works or owner[s] not in self._slot_of]
        slot = min(free, key=lambda s: (owner[s] in works, owner[s] or -1))
        if owner[slot] in works:
            self._transfer += self._wait_send(owner[slot])
        owner[slot] = pos
        self._slot_of[pos] = slot

    def _flush(self, pos: int) -> None:
        """Pack the chunks read for the bucket at ``pos`` into its slot (one multi-tensor copy)."""
        chunks = self._pending.pop(pos, None)
        if not chunks:
            return
        t = time.perf_counter()
        slot, first = self._slot_of[pos], self._packed.get(pos, 0)
        self.packer.pack(self.buckets[pos], slot, self.buffers.get(slot), first, chunks)
        self._packed[pos] = first + len(chunks)
        self.collectives.phases["pack"] += time.perf_counter() - t

    def _post(self, pos: int, payload: torch.Tensor) -> None:
        self._works[pos], dt = self.collectives.post(payload, self.rank, self.group)
        self._transfer += dt

    def _wait_send(self, pos: int) -> float:
        index = self.buckets[pos].index
        return self.collectives.timed_wait(
            self._works.pop(pos), f"sending bucket {index} to relay rank {self.relay}", index
        )
