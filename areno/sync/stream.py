"""Bucketed device-to-device policy streaming over torch.distributed (NCCL on GPU, gloo on CPU).

Data path, for every bucket in the plan's global order (``plan.plan_buckets``):

    training row r (its sender rank) --pair group {sender_r, relay_r}--> rollout relay_r
    relay_r --rollout-only group (all rollout ranks)--> every rollout rank
    every rollout rank writes only its ``ShardSpec`` slice of each item into staged tensors

Each training rank iterates the ``WeightSource`` (so DTensor gathers stay collective); the owner row
packs its tensors into one of two bucket buffers and sends it as soon as the plan says the bucket
is complete, so packing bucket k+1 overlaps sending bucket k. Extra memory per rank is two buckets.

Commit protocol (a small control plane over the distributed store): each rollout rank reports its
progress per bucket and ``staged`` at the end; the coordinator (first sender) waits for all of
them, then writes the decision; rollout ranks commit (``ShardReceiver.commit``) only on ``commit``.
Every wait has the configured timeout; a failure raises ``PolicySyncError`` naming the rollout
ranks that fell behind, and the receivers abort, keeping the old version. After a failure the
process groups may be broken: rebuild the transport (and the world) before the next sync.
"""

from __future__ import annotations

import datetime
import pickle
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from areno.sync.base import (
    PolicySyncError,
    PolicySyncTransport,
    ShardReceiver,
    SyncStats,
    WeightSource,
    full_tensor,
    write_rows,
)
from areno.sync.plan import Bucket, BucketItem, SyncPlan, choose_relays, plan_buckets


@dataclass(kw_only=True)
class StreamSyncConfig:
    """How the streaming transport moves the policy."""

    bucket_bytes: int = 256 << 20
    """Bytes per bucket; each rank holds at most two bucket buffers."""
    timeout_s: float = 600.0
    """Seconds any wait (collective or control message) may take before the sync raises."""
    wire_dtype: torch.dtype | None = None
    """Cast floating tensors to this dtype before sending (e.g. bf16 when rollout runs bf16)."""

    def __post_init__(self) -> None:
        if self.bucket_bytes < 1024:
            raise ValueError(f"bucket_bytes must be >= 1024, got {self.bucket_bytes}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


@dataclass(frozen=True, kw_only=True)
class StreamTopology:
    """Which global ranks train and which serve rollout, and their physical devices."""

    train_ranks: tuple[int, ...]
    """Every training rank (all iterate the source, so gathers of sharded weights stay collective)."""
    sender_ranks: tuple[int, ...]
    """One rank per training DP row that sends that row's share (a subset of train_ranks)."""
    rollout_ranks: tuple[int, ...]
    """Every rollout rank (all TP and DP ranks of the rollout engine)."""
    devices: Mapping[int, str] = field(default_factory=dict)
    """Global rank -> physical device id (e.g. ``cuda:3`` in one index space for both lists);
    ranks missing here are taken to be on distinct devices."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "train_ranks", tuple(self.train_ranks))
        object.__setattr__(self, "sender_ranks", tuple(self.sender_ranks))
        object.__setattr__(self, "rollout_ranks", tuple(self.rollout_ranks))
        if not self.sender_ranks or not self.rollout_ranks:
            raise ValueError("StreamTopology needs at least one sender rank and one rollout rank")
        if not set(self.sender_ranks) <= set(self.train_ranks):
            raise ValueError(f"sender_ranks {self.sender_ranks} must be training ranks {self.train_ranks}")
        both = set(self.train_ranks) & set(self.rollout_ranks)
        if both:
            raise ValueError(f"ranks {sorted(both)} are both training and rollout ranks; use separate processes")

    def device(self, rank: int) -> str:
        return self.devices.get(rank, f"rank{rank}")


class StreamTransport(PolicySyncTransport):
    """Streams the policy from training DP rows into rollout TP shards.

    Construct on every rank of the world (it creates process groups, a collective): training ranks
    pass ``source``, rollout ranks pass ``receiver``. ``device`` is where bucket buffers live (the
    rank's CUDA device under NCCL, CPU under gloo). ``store`` is the distributed store shared by all
    ranks (default: the default process group's).
    """

    name = "stream"

    def __init__(
        self,
        *,
        topology: StreamTopology,
        config: StreamSyncConfig,
        source: WeightSource | None = None,
        receiver: ShardReceiver | None = None,
        device: torch.device | str = "cpu",
        store: dist.Store | None = None,
        tag: str = "policy",
    ) -> None:
        self.topology = topology
        self.config = config
        self.rank = dist.get_rank()
        self.device = torch.device(device)
        self.source = source
        self.receiver = receiver
        self.is_train = self.rank in topology.train_ranks
        self.is_rollout = self.rank in topology.rollout_ranks
        if self.is_train and source is None:
            raise ValueError(f"rank {self.rank} is a training rank: pass source=")
        if self.is_rollout and receiver is None:
            raise ValueError(f"rank {self.rank} is a rollout rank: pass receiver=")
        base_store = store if store is not None else dist.distributed_c10d._get_default_store()
        self.store = dist.PrefixStore(f"areno_sync/{tag}", base_store)
        self._timeout = datetime.timedelta(seconds=config.timeout_s)

        # Relays: each row's rollout rank on another physical device than its sender.
        rollout_devices = [topology.device(r) for r in topology.rollout_ranks]
        relay_idx = choose_relays([topology.device(r) for r in topology.sender_ranks], rollout_devices)
        self.relays = tuple(topology.rollout_ranks[j] for j in relay_idx)

        # Process groups, created in the same order on every rank.
        self.pair_groups = [
            dist.new_group(sorted({s, r}), timeout=self._timeout)
            for s, r in zip(topology.sender_ranks, self.relays)
        ]
        self.rollout_group = (
            dist.new_group(list(topology.rollout_ranks), timeout=self._timeout)
            if len(topology.rollout_ranks) > 1 else None
        )

        # The plan needs the same tensor list everywhere: the first sender publishes it. Every
        # training rank asks its source (listing a sharded source may be collective).
        if self.is_train:
            meta = source.meta()
            if self.rank == topology.sender_ranks[0]:
                self.store.set("meta", pickle.dumps(meta))
        self.store.wait(["meta"], self._timeout)
        self.meta = pickle.loads(self.store.get("meta"))
        self.plan: SyncPlan = plan_buckets(
            self.meta, len(topology.sender_ranks), config.bucket_bytes, config.wire_dtype
        )
        if self.is_rollout:
            self._check_specs()
        self._buffers: list[torch.Tensor] = []
        self.peak_buffer_bytes = 0
        """Largest total bucket-buffer memory this rank held (at most two buckets)."""
        self._attempt = 0

    # ---------------------------------------------------------------- helpers
    def _check_specs(self) -> None:
        shapes = {n: tuple(s) for n, s, _ in self.meta}
        for name, spec in self.receiver.shard_specs().items():
            if name not in shapes:
                raise ValueError(f"receiver expects {name!r}, which the trainer does not send")
            if tuple(spec.full_shape) != shapes[name]:
                raise ValueError(f"{name}: receiver full shape {spec.full_shape} != trainer shape {shapes[name]}")

    def _buffer(self, slot: int) -> torch.Tensor:
        if not self._buffers:
            size = max(self.plan.max_bucket_bytes, 1)
            self._buffers = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(2)]
            self.peak_buffer_bytes = 2 * size
        return self._buffers[slot % 2]

    def _key(self, what: str, rank: int | None = None) -> str:
        return f"{self._attempt}/{what}" + ("" if rank is None else f"/{rank}")

    def _wait(self, work: dist.Work, what: str) -> None:
        try:
            work.wait(self._timeout)
        except RuntimeError as e:
            raise PolicySyncError(f"{what}: {e}") from e

    def _laggards(self) -> str:
        """Describe how far each rollout rank got, naming the ones furthest behind."""
        progress = {}
        for r in self.topology.rollout_ranks:
            if not self.store.check([self._key("start", r)]):
                progress[r] = -2
            elif self.store.check([self._key("progress", r)]):
                progress[r] = int(self.store.get(self._key("progress", r)))
            else:
                progress[r] = -1
            if self.store.check([self._key("staged", r)]):
                progress[r] = len(self.plan.buckets)
        worst = min(progress.values())
        lagging = [r for r, p in progress.items() if p == worst]
        n = len(self.plan.buckets)
        desc = ", ".join(
            f"rank {r}: " + ("never joined" if p == -2 else f"{p + 1}/{n} buckets") for r, p in progress.items()
        )
        return f"lagging rollout rank(s) {lagging} ({desc})"

    def _fail(self, version: int, cause: str) -> PolicySyncError:
        try:
            where = self._laggards()
        except RuntimeError as e:  # the store itself may be gone with a dead peer
            where = f"store unreachable: {e}"
        return PolicySyncError(f"policy sync v{version} failed on rank {self.rank}: {cause}; {where}")

    # ---------------------------------------------------------------- sync
    def _sync(self, version: int) -> SyncStats:
        self._attempt += 1
        t0 = time.perf_counter()
        if self.is_train:
            transfer = self._send(version)
        elif self.is_rollout:
            transfer = self._receive(version)
        else:
            transfer = 0.0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return SyncStats(
            version=version,
            total_time_s=time.perf_counter() - t0,
            transfer_time_s=transfer,
            bytes=self.plan.total_bytes,
            tensors=self.plan.num_tensors,
        )

    def _send(self, version: int) -> float:
        """Training rank: iterate the source; if a sender, pack and send this row's buckets."""
        row = self.topology.sender_ranks.index(self.rank) if self.rank in self.topology.sender_ranks else -1
        my_buckets = [b for b in self.plan.buckets if b.row == row]
        items_by_tensor: dict[int, list[tuple[int, BucketItem]]] = {}
        for pos, bucket in enumerate(my_buckets):
            for item in bucket.items:
                items_by_tensor.setdefault(item.tensor_index, []).append((pos, item))
        works: dict[int, dist.Work] = {}
        transfer = 0.0
        try:
            for idx, (name, tensor) in enumerate(self.source.iter_tensors()):
                if idx >= len(self.meta) or name != self.meta[idx][0]:
                    raise ValueError(f"weight source order changed at {idx} ({name!r}); rebuild the transport")
                full = full_tensor(tensor)
                for pos, item in items_by_tensor.get(idx, ()):
                    buf = self._buffer(pos)
                    if item is my_buckets[pos].items[0] and pos - 2 in works:
                        t = time.perf_counter()
                        self._wait(works.pop(pos - 2), f"sending bucket {my_buckets[pos - 2].index}")
                        transfer += time.perf_counter() - t
                    chunk = full.reshape(item.shape)[item.row_start : item.row_end]
                    buf[item.offset : item.offset + item.nbytes].view(item.dtype).view(item.chunk_shape).copy_(chunk)
                    if item is my_buckets[pos].items[-1]:
                        t = time.perf_counter()
                        works[pos] = dist.broadcast(
                            buf[: my_buckets[pos].nbytes], src=self.rank, group=self.pair_groups[row], async_op=True
                        )
                        transfer += time.perf_counter() - t
                del full
            for pos in sorted(works):
                t = time.perf_counter()
                self._wait(works.pop(pos), f"sending bucket {my_buckets[pos].index}")
                transfer += time.perf_counter() - t
        except PolicySyncError as e:
            if self.rank == self.topology.sender_ranks[0]:
                self.store.set(self._key("decision"), b"abort")
            raise self._fail(version, str(e)) from e

        # Commit: the coordinator waits for every rollout rank to have staged everything.
        if self.rank == self.topology.sender_ranks[0]:
            staged = [self._key("staged", r) for r in self.topology.rollout_ranks]
            try:
                self.store.wait(staged, self._timeout)
            except RuntimeError as e:
                self.store.set(self._key("decision"), b"abort")
                raise self._fail(version, "rollout ranks did not stage the whole policy in time") from e
            self.store.set(self._key("decision"), b"commit")
            done = [self._key("done", r) for r in self.topology.rollout_ranks]
            try:
                self.store.wait(done, self._timeout)
            except RuntimeError as e:
                raise self._fail(version, "rollout ranks did not confirm the commit in time") from e
            self.store.set(self._key("finished"), b"1")
        else:
            try:
                self.store.wait([self._key("finished")], self._timeout)
            except RuntimeError as e:
                raise self._fail(version, "the coordinator did not confirm the commit in time") from e
        return transfer

    def _receive(self, version: int) -> float:
        """Rollout rank: receive every bucket (as relay, then through the fan-out), stage own slices."""
        self.store.set(self._key("start", self.rank), b"1")
        specs = self.receiver.shard_specs()
        self.receiver.begin(version)
        transfer = 0.0
        try:
            for bucket in self.plan.buckets:
                buf = self._buffer(bucket.index)[: bucket.nbytes]
                relay = self.relays[bucket.row]
                t = time.perf_counter()
                if self.rank == relay:
                    sender = self.topology.sender_ranks[bucket.row]
                    work = dist.broadcast(buf, src=sender, group=self.pair_groups[bucket.row], async_op=True)
                    self._wait(work, f"receiving bucket {bucket.index} from training rank {sender}")
                if self.rollout_group is not None:
                    work = dist.broadcast(buf, src=relay, group=self.rollout_group, async_op=True)
                    self._wait(work, f"fan-out of bucket {bucket.index} from relay rank {relay}")
                transfer += time.perf_counter() - t
                self._stage(bucket, buf, specs)
                self.store.set(self._key("progress", self.rank), str(bucket.index).encode())
            self.store.set(self._key("staged", self.rank), b"1")
            try:
                self.store.wait([self._key("decision")], self._timeout)
            except RuntimeError as e:
                raise PolicySyncError("no commit decision from the coordinator in time") from e
            decision = self.store.get(self._key("decision"))
            if decision != b"commit":
                raise PolicySyncError("the coordinator aborted the sync")
            self.receiver.commit(version)
            self.store.set(self._key("done", self.rank), b"1")
        except PolicySyncError as e:
            self.receiver.abort()
            raise self._fail(version, str(e)) from e
        return transfer

    def _stage(self, bucket: Bucket, buf: torch.Tensor, specs: Mapping) -> None:
        for item in bucket.items:
            spec = specs.get(item.name)
            if spec is None:
                continue
            rows = buf[item.offset : item.offset + item.nbytes].view(item.dtype).view(item.chunk_shape)
            dest = self.receiver.stage(item.name)
            write_rows(spec, dest if dest.dim() else dest.view(1), rows, item.row_start)


def raw_transfer(
    topology: StreamTopology, relays: Sequence[int], pair_groups: Sequence, rollout_group, row_bytes: Sequence[int],
    device: torch.device | str = "cpu",
) -> float:
    """Baseline for benchmarks: move each row's bytes as one message over the same route (sender ->
    relay -> rollout fan-out), no plan, no packing, no slicing. Returns seconds on this rank."""
    rank = dist.get_rank()
    t0 = time.perf_counter()
    for row, (sender, relay) in enumerate(zip(topology.sender_ranks, relays)):
        buf = torch.empty(row_bytes[row], dtype=torch.uint8, device=device)
        if rank in (sender, relay):
            dist.broadcast(buf, src=sender, group=pair_groups[row])
        if rank in topology.rollout_ranks and rollout_group is not None:
            dist.broadcast(buf, src=relay, group=rollout_group)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0
