"""The rollout side of a streamed policy sync (``stream.py``): receive every bucket (as a row's
relay from its sender, or through the relay's fan-out) and stage this rank's slices of it.

A bucket of one chunk this rank keeps whole is received straight into its staging tensor (no
copy); others land in one of two buffers and ``BucketStager`` copies this rank's slices out. One
bucket of lookahead: bucket k's collectives are posted before bucket k-1 is staged, so staging
overlaps the transfer. The commit (after the vote) stays with the transport.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from areno.sync.base import PolicySyncError, ShardReceiver, ShardSpec
from areno.sync.buckets import BucketBuffers, BucketStager
from areno.sync.collectives import Collectives
from areno.sync.plan import Bucket, SyncPlan


class BucketReceiver:
    """One rollout rank's part of every sync, writing into ``receiver``'s staging tensors.

    ``relays[row]`` receives row ``row`` from ``sender_ranks[row]`` over ``pair_groups[row]``;
    ``fanout[k]``: whether bucket k is then broadcast from its relay over ``rollout_group``."""

    def __init__(
        self,
        *,
        rank: int,
        receiver: ShardReceiver,
        plan: SyncPlan,
        sender_ranks: Sequence[int],
        relays: Sequence[int],
        fanout: Sequence[bool],
        pair_groups: Sequence[dist.ProcessGroup],
        rollout_group: dist.ProcessGroup | None,
        buffers: BucketBuffers,
        collectives: Collectives,
    ) -> None:
        self.rank = rank
        self.receiver = receiver
        self.buckets = plan.buckets
        self.sender_ranks = sender_ranks
        self.relays = relays
        self.fanout = fanout
        self.pair_groups = pair_groups
        self.rollout_group = rollout_group
        self.buffers = buffers
        self.collectives = collectives
        self.stager = BucketStager(receiver, receiver.shard_specs())

    def receive(self) -> float:
        """Receive and stage every bucket; returns the seconds spent posting and waiting on the
        collectives (the transfer time). A ``PolicySyncError`` carries ``buckets_done``."""
        specs = self.receiver.shard_specs()
        c = self.collectives
        transfer = 0.0
        buckets = self.buckets
        fanout: dict[int, dist.Work] = {}
        direct = False  # whether bucket k-1 was received straight into its staging tensor
        for k in range(len(buckets) + 1):
            try:
                recv = None
                direct_prev, direct = direct, False
                if k < len(buckets) and self.rank != self.relays[buckets[k].row] and not self.fanout[k]:
                    direct = True  # bucket k does not come to this rank: nothing to receive or stage
                elif k < len(buckets):
                    bucket = buckets[k]
                    buf = self._direct_dest(bucket, specs)
                    direct = buf is not None
                    if buf is None:
                        buf = self.buffers.get(k)[: bucket.nbytes]
                    relay = self.relays[bucket.row]
                    if self.rank == relay:
                        sender = self.sender_ranks[bucket.row]
                        work, dt = c.post(buf, sender, self.pair_groups[bucket.row])
                        recv = (work, f"receiving bucket {k} from training rank {sender}")
                        transfer += dt
                    else:
                        fanout[k], dt = c.post(buf, relay, self.rollout_group)
                        transfer += dt
                if k > 0:
                    if k - 1 in fanout:
                        transfer += c.timed_wait(
                            fanout.pop(k - 1),
                            f"fan-out of bucket {k - 1} from relay rank {self.relays[buckets[k - 1].row]}",
                            k - 1,
                        )
                    if not direct_prev:
                        t = time.perf_counter()
                        self.stager.stage(buckets[k - 1], self.buffers.get(k - 1)[: buckets[k - 1].nbytes])
                        c.phases["stage"] += time.perf_counter() - t
                if recv is not None:
                    transfer += c.timed_wait(*recv, k)
                    if self.fanout[k]:
                        fanout[k], dt = c.post(buf, self.rank, self.rollout_group)
                        transfer += dt
            except PolicySyncError as e:
                e.buckets_done = max(k - 1, 0)
                raise
        if c.stream_ordered:
            transfer += c.drain()
        return transfer

    def _direct_dest(self, bucket: Bucket, specs: Mapping[str, ShardSpec]) -> torch.Tensor | None:
        """For a bucket of one chunk that this rank keeps whole (replicated, or inside its dim-0
        slice) in the wire dtype: the staging rows themselves, as bytes, so it is received in place."""
        if len(bucket.items) != 1:
            return None
        item = bucket.items[0]
        spec = specs.get(item.name)
        if spec is None or spec.dtype != item.dtype:
            return None
        if spec.dim is None:
            lo = item.row_start
        elif spec.dim == 0 and spec.start <= item.row_start and item.row_end <= spec.start + spec.length:
            lo = item.row_start - spec.start
        else:
            return None
        dest = self.receiver.stage(item.name)
        dest = dest if dest.dim() else dest.view(1)
        rows = dest[lo : lo + item.row_end - item.row_start]
        return rows.reshape(-1).view(torch.uint8) if rows.is_contiguous() else None
