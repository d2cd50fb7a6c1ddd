"""Bucketed device-to-device policy streaming over torch.distributed (NCCL on GPU, gloo on CPU).

Data path, for every bucket in the plan's global order (``plan.plan_buckets``):

    training row r (its sender rank) --pair group {sender_r, relay_r}--> rollout relay_r
    relay_r --rollout-only group (all rollout ranks)--> every rollout rank
    every rollout rank writes only its ``ShardSpec`` slice of each item into staged tensors

Each training rank iterates the ``WeightSource`` (so DTensor gathers stay collective); the owner row
packs its tensors into one of two bucket buffers and sends it as soon as the plan says the bucket
is complete, so packing bucket k+1 overlaps sending bucket k. Extra memory per rank is two buckets.
Chunks end at the receivers' dim-0 shard boundaries (each rollout rank publishes its own), and a
chunk of at least ``direct_bytes`` travels alone: sent as a view of the trained tensor, received
straight into the staging tensor of the rank that keeps it (no pack or stage copy); only small
tensors and dim-1 (rowwise) slices are copied out of a buffer.

The pieces: this module plans (``StreamGroups``: relays and process groups; ``exchange_plan``:
the bucket plan every rank agrees on) and runs a sync (``StreamTransport``: send or receive, vote,
commit); ``stream_send.BucketSender`` and ``stream_receive.BucketReceiver`` move the buckets;
``buckets`` holds the buffers and the multi-tensor copies in and out of them (one
``torch._foreach_copy_`` per bucket and dtype pair); ``collectives`` posts the collectives, waits
on them (stream-ordered on NCCL, each host wait bounded by the timeout) and times every phase.

Commit (all-or-nothing across ranks): when its part is done, every participant joins one vote,
a tiny all-reduce (done flags, buckets staged) over a control group of all participants: NCCL
when the data plane is NCCL and no two participants share a GPU (``vote_backend``; tens of
microseconds, on a side stream so that a data collective stuck on the current stream cannot hold
it back), gloo otherwise (CPU tensors, so it may span a shared GPU; about a millisecond on a GPU
host). Rollout ranks commit (``ShardReceiver.commit``) only when every participant succeeded, so
the TP shards of one engine never mix versions. A rank that fails still votes (``0``), so the
others abort at once; one that hangs or dies makes the vote time out. Every wait has the configured timeout and a
failure raises ``PolicySyncError`` naming the failed or unresponsive ranks; receivers abort and
keep the old version (a staged receiver; an in-place one is left torn, see ``areno.sync.base``).
After a timeout the process groups may be broken: rebuild the transport (and the world) before
the next sync.

Receivers (``engine_receiver(..., commit=)``): a staged one lets the engine generate during the
whole transfer and pauses it only for the commit's copy (or storage swap); an in-place one
(``LiveReceiver``) pauses it for the whole sync but receives straight into the weights, with no
staging memory and no commit copy. ``SyncStats.generation_paused_s`` reports either honestly.
"""

from __future__ import annotations

import datetime
import pickle
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from areno.sync.base import (
    PolicySyncError,
    PolicySyncTransport,
    ShardReceiver,
    SyncStats,
    WeightSource,
)
from areno.sync.buckets import (
    BucketBuffers,
    BucketPacker,
    BucketStager,
    TensorChunks,
    chunk_views,
    foreach_copy,
    tensor_chunks,
)
from areno.sync.collectives import Collectives
from areno.sync.plan import Bucket, SyncPlan, TensorMeta, choose_relays, plan_buckets
from areno.sync.stream_receive import BucketReceiver
from areno.sync.stream_send import BucketSender

__all__ = [
    # the copies moved to ``buckets``; still importable from here
    "BucketPacker",
    "BucketStager",
    "StreamGroups",
    "StreamSyncConfig",
    "StreamTopology",
    "StreamTransport",
    "TensorChunks",
    "chunk_views",
    "exchange_plan",
    "foreach_copy",
    "tensor_chunks",
    "vote_backend",
]


@dataclass(kw_only=True)
class StreamSyncConfig:
    """How the streaming transport moves the policy."""

    bucket_bytes: int = 256 << 20
    """Bytes per bucket; each rank holds at most two bucket buffers."""
    timeout_s: float = 600.0
    """Seconds any wait (collective or control message) may take before the sync raises."""
    connect_timeout_s: float = 300.0
    """Seconds to wait for every rank while the transport's process groups are created."""
    wire_dtype: torch.dtype | None = None
    """Cast floating tensors to this dtype before sending (e.g. bf16 when rollout runs bf16)."""
    float32_names: frozenset[str] = frozenset()
    """Tensors sent in their own dtype whatever ``wire_dtype``: those the model keeps in float32 in a bf16
    engine (GLM-4.5's routers, ``moe.float32_names``), which a bf16 wire would round."""
    direct_bytes: int | None = None
    """A chunk of at least this many bytes travels as its own message: sent from the trained
    tensor without packing and, where a receiver keeps it whole, received straight into its
    staging tensor. Smaller chunks are packed together (fewer messages: on a loaded CPU host each
    gloo message costs ~1-2 ms of hand-offs, more than packing a few MB). None: a quarter of
    ``bucket_bytes``; above ``bucket_bytes``: pack everything."""

    fanout_all: bool = False
    """Fan every bucket out to all rollout ranks, even one that only its relay keeps (moves the
    same bytes as a plain relay + broadcast; for benchmarks)."""

    def __post_init__(self) -> None:
        if self.bucket_bytes < 1024:
            raise ValueError(f"bucket_bytes must be >= 1024, got {self.bucket_bytes}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.connect_timeout_s <= 0:
            raise ValueError(f"connect_timeout_s must be > 0, got {self.connect_timeout_s}")
        if self.direct_bytes is not None and self.direct_bytes <= 0:
            raise ValueError(f"direct_bytes must be > 0 or None, got {self.direct_bytes}")


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

    @property
    def participants(self) -> list[int]:
        """Every training and rollout rank, sorted."""
        return sorted(self.train_ranks + self.rollout_ranks)


def vote_backend(topology: StreamTopology, data_backend: str) -> str:
    """Backend of the commit vote's group: ``nccl`` when the data plane is NCCL and no two
    participants share a physical device (an NCCL communicator must never hold a GPU twice),
    ``gloo`` otherwise. A pure function of what every rank knows, so all create the same group."""
    devices = [topology.device(r) for r in topology.participants]
    return "nccl" if "nccl" in data_backend.lower() and len(set(devices)) == len(devices) else "gloo"


def _keepers(bucket: Bucket, kept_by: Mapping[int, Mapping[str, tuple[int | None, int, int]]]) -> set[int]:
    """Rollout ranks that keep any part of ``bucket`` (``kept_by``: rank -> name -> (dim, start, length))."""
    ranks = set()
    for rank, kept in kept_by.items():
        for item in bucket.items:
            if item.name not in kept:
                continue
            dim, start, length = kept[item.name]
            if dim != 0 or (item.row_start < start + length and start < item.row_end):
                ranks.add(rank)
                break
    return ranks


@dataclass(frozen=True, kw_only=True)
class StreamGroups:
    """The route of a streamed sync: each training row's relay (a rollout rank on another physical
    device than its sender) and the process groups, created in the same order on every rank."""

    relays: tuple[int, ...]
    """Per training row, the rollout rank that receives it from the row's sender."""
    pair_groups: tuple[dist.ProcessGroup, ...]
    """Per training row, the group {sender, relay} its buckets travel over."""
    rollout_group: dist.ProcessGroup | None
    """All rollout ranks (the relays' fan-out); None with a single rollout rank."""
    control_group: dist.ProcessGroup
    """All participants: the commit vote."""
    vote_backend: str
    """The control group's backend (``vote_backend``)."""

    @classmethod
    def create(cls, topology: StreamTopology, backend: str | None, timeout: datetime.timedelta) -> StreamGroups:
        """Create the groups (a collective over the world); ``backend``: the data plane's (default:
        the world's)."""
        rollout_devices = [topology.device(r) for r in topology.rollout_ranks]
        relay_idx = choose_relays([topology.device(r) for r in topology.sender_ranks], rollout_devices)
        relays = tuple(topology.rollout_ranks[j] for j in relay_idx)
        pair_groups = tuple(
            dist.new_group(sorted({s, r}), timeout=timeout, backend=backend)
            for s, r in zip(topology.sender_ranks, relays)
        )
        rollout_group = (
            dist.new_group(list(topology.rollout_ranks), timeout=timeout, backend=backend)
            if len(topology.rollout_ranks) > 1
            else None
        )
        # Control plane: the commit vote (``vote_backend``: NCCL on distinct GPUs, else gloo).
        vote = vote_backend(topology, data_backend(backend))
        control_group = dist.new_group(topology.participants, timeout=timeout, backend=vote)
        return cls(
            relays=relays,
            pair_groups=pair_groups,
            rollout_group=rollout_group,
            control_group=control_group,
            vote_backend=vote,
        )


def stream_group_timeout(config: StreamSyncConfig, backend: str | None) -> datetime.timedelta:
    """The sync's process groups' timeout. Their own timeout bounds creation, and every sync wait is
    bounded by ``timeout_s`` on the host (Work.wait), counted from the wait. Under NCCL the watchdog
    counts the group's timeout from when a bucket was enqueued, earlier, and tears the process down:
    its groups get twice the sync's timeout plus the connect time, so that PolicySyncError (naming the
    ranks that did not answer, the receivers' weights kept) comes first."""
    base = max(config.timeout_s, config.connect_timeout_s)
    if "nccl" in data_backend(backend):
        base = 2 * config.timeout_s + config.connect_timeout_s
    return datetime.timedelta(seconds=base)


def data_backend(backend: str | None) -> str:
    """The data plane's backend name, lower case (``backend``, else the world's)."""
    return str(backend if backend is not None else dist.get_backend()).lower()


def exchange_plan(
    *,
    store: dist.Store,
    key: Callable[..., str],
    topology: StreamTopology,
    config: StreamSyncConfig,
    groups: StreamGroups,
    source: WeightSource | None,
    receiver: ShardReceiver | None,
    timeout: datetime.timedelta,
) -> tuple[list[TensorMeta], SyncPlan, tuple[bool, ...]]:
    """The tensor list, the bucket plan and, per bucket, whether it fans out from its relay: the
    same on every rank, from what the ranks publish in ``store`` (under ``key(what, rank)``).

    The plan needs the same tensor list everywhere: the first sender publishes it (every training
    rank asks its source: listing a sharded source may be collective). Every rollout rank publishes
    which slice of each tensor it keeps: chunks end at the dim-0 shard boundaries, and a bucket only
    its relay keeps needs no fan-out (False, e.g. a dim-0 shard chunk of the relay's own slice)."""
    rank = dist.get_rank()
    if source is not None:
        meta = source.meta()
        if rank == topology.sender_ranks[0]:
            store.set(key("meta"), pickle.dumps(meta))
    if receiver is not None:
        kept = {n: (sp.dim, sp.start, sp.length) for n, sp in receiver.shard_specs().items()}
        store.set(key("kept", rank), pickle.dumps(kept))
    store.wait([key("meta")] + [key("kept", r) for r in topology.rollout_ranks], timeout)
    meta = pickle.loads(store.get(key("meta")))
    kept_by = {r: pickle.loads(store.get(key("kept", r))) for r in topology.rollout_ranks}
    cuts: dict[str, set[int]] = {}
    for kept in kept_by.values():
        for name, (dim, start, length) in kept.items():
            if dim == 0:
                cuts.setdefault(name, set()).update((start, start + length))
    plan = plan_buckets(
        meta,
        len(topology.sender_ranks),
        config.bucket_bytes,
        config.wire_dtype,
        cuts={n: sorted(c) for n, c in cuts.items()},
        direct_bytes=config.direct_bytes if config.direct_bytes is not None else config.bucket_bytes // 4,
        float32_names=config.float32_names,
    )
    fanout = tuple(
        (config.fanout_all or bool(_keepers(b, kept_by) - {groups.relays[b.row]})) and groups.rollout_group is not None
        for b in plan.buckets
    )
    return meta, plan, fanout


_DONE, _TIMED_OUT, _RAISED = 1, 2, 3
"""Commit-vote states: finished its part / a wait on a peer timed out / raised an error itself."""


class StreamTransport(PolicySyncTransport):
    """Streams the policy from training DP rows into rollout TP shards.

    Construct on every rank of the world (it creates process groups, a collective): training ranks
    pass ``source``, rollout ranks pass ``receiver``. ``device`` is where bucket buffers live (the
    rank's CUDA device under NCCL, CPU under gloo). ``store`` is the distributed store shared by all
    ranks (default: the default process group's). ``backend`` is the data-plane backend (default:
    the world's; e.g. ``nccl`` in a gloo world). Call ``sync`` on every training and rollout rank.

    A sync: each training rank sends (``BucketSender``), each rollout rank receives and stages
    (``BucketReceiver``), then all vote and the rollout ranks commit; ``collectives`` times it.
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
        backend: str | None = None,
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
        plan_timeout = datetime.timedelta(seconds=max(config.timeout_s, config.connect_timeout_s))
        groups = StreamGroups.create(topology, backend, stream_group_timeout(config, backend))
        self.relays = groups.relays
        """Per training row, its relay rollout rank."""
        self.pair_groups = groups.pair_groups
        self.rollout_group = groups.rollout_group
        self.control_group = groups.control_group
        self.vote_backend = groups.vote_backend
        """The commit vote's backend (``nccl`` on distinct GPUs under NCCL, else ``gloo``)."""
        # Every construction (e.g. a rebuild after a failed sync) gets its own store keys.
        self._gen = (self.store.add("constructed", 1) - 1) // dist.get_world_size()
        self._attempt = 0
        self.meta, self.plan, self.fanout = exchange_plan(
            store=self.store,
            key=self._key,
            topology=topology,
            config=config,
            groups=groups,
            source=source if self.is_train else None,
            receiver=receiver if self.is_rollout else None,
            timeout=plan_timeout,
        )
        self.wire_bytes = sum(b.nbytes * (1 + f) for b, f in zip(self.plan.buckets, self.fanout))
        """Bytes one sync puts on the data plane: every bucket once to its relay, plus its fan-out."""
        if self.is_rollout:
            self._check_specs()
        stream_ordered = "nccl" in data_backend(backend) and self.device.type == "cuda"
        self.collectives = Collectives(timeout_s=config.timeout_s, stream_ordered=stream_ordered)
        self.buffers = BucketBuffers(self.device, self.plan.max_bucket_bytes)
        self.sender = self._sender() if self.is_train else None
        self.bucket_receiver = self._bucket_receiver() if self.is_rollout else None
        self._vote_stream: torch.cuda.Stream | None = None  # NCCL vote: its own stream, made on first use
        self._connect()

    def _sender(self) -> BucketSender:
        senders = self.topology.sender_ranks
        row = senders.index(self.rank) if self.rank in senders else -1
        return BucketSender(
            rank=self.rank,
            row=row,
            relay=self.relays[row] if row >= 0 else None,
            group=self.pair_groups[row] if row >= 0 else None,
            plan=self.plan,
            meta=self.meta,
            buffers=self.buffers,
            collectives=self.collectives,
        )

    def _bucket_receiver(self) -> BucketReceiver:
        return BucketReceiver(
            rank=self.rank,
            receiver=self.receiver,
            plan=self.plan,
            sender_ranks=self.topology.sender_ranks,
            relays=self.relays,
            fanout=self.fanout,
            pair_groups=self.pair_groups,
            rollout_group=self.rollout_group,
            buffers=self.buffers,
            collectives=self.collectives,
        )

    # ---------------------------------------------------------------- what callers read
    @property
    def last_phases(self) -> dict[str, float]:
        """Seconds of the last sync by phase on this rank (``collectives.PHASES``)."""
        return self.collectives.phases

    @property
    def peak_buffer_bytes(self) -> int:
        """Largest total bucket-buffer memory this rank held (at most two buckets)."""
        return self.buffers.peak_bytes

    # ---------------------------------------------------------------- helpers
    def _connect(self) -> None:
        """CUDA: build every NCCL communicator this rank belongs to, and its peer connections, now —
        one tiny collective per group, in creation order (the same on every rank, so no two ranks
        wait on each other's later group) — instead of lazily inside the first sync. In an
        asynchronous run that first sync overlaps generation, and communicator set-up (device
        allocations, peer mappings) would then run beside the engine's CUDA-graph captures and
        replays on the same GPU. All participants are past the constructor's rendezvous here."""
        if self.device.type != "cuda":
            return
        groups = [*self.pair_groups, self.rollout_group]
        if self.vote_backend == "nccl":
            groups.append(self.control_group)
        for group in groups:
            if group is None:
                continue
            ranks = dist.get_process_group_ranks(group)
            if self.rank not in ranks or dist.get_backend(group) != "nccl":
                continue
            probe = torch.zeros(1, device=self.device)
            if group is self.control_group:
                work = dist.all_reduce(probe, group=group, async_op=True)
            else:
                work = dist.broadcast(probe, src=min(ranks), group=group, async_op=True)
            self.collectives.wait(work, f"connecting NCCL group {ranks}")
        torch.cuda.synchronize(self.device)

    def _check_specs(self) -> None:
        shapes = {n: tuple(s) for n, s, _ in self.meta}
        for name, spec in self.receiver.shard_specs().items():
            if name not in shapes:
                raise ValueError(f"receiver expects {name!r}, which the trainer does not send")
            if tuple(spec.full_shape) != shapes[name]:
                raise ValueError(f"{name}: receiver full shape {spec.full_shape} != trainer shape {shapes[name]}")

    def _key(self, what: str, rank: int | None = None) -> str:
        return f"{self._gen}/{self._attempt}/{what}" + ("" if rank is None else f"/{rank}")

    def _missing(self) -> str:
        """After a vote timed out: the ranks that never reached it (from the store)."""
        try:
            participants = self.topology.participants
            missing = [r for r in participants if not self.store.check([self._key("arrived", r)])]
            never = [
                r for r in missing if r in self.topology.rollout_ranks and not self.store.check([self._key("start", r)])
            ]
        except RuntimeError as e:  # the store may be gone with a dead peer
            return f"store unreachable: {e}"
        return f"unresponsive rank(s) {missing}" + "".join(f" (rank {r}: never joined)" for r in never)

    # ---------------------------------------------------------------- sync
    def _sync(self, version: int) -> SyncStats:
        assert self.is_train or self.is_rollout, f"rank {self.rank} takes no part in this policy sync"
        self._attempt += 1
        self.collectives.start()
        phases = self.collectives.phases
        t0 = time.perf_counter()
        progress, error = 0, None
        try:
            if self.is_train:
                transfer = self.sender.send(self.source)
            else:
                t = time.perf_counter()
                self.store.set(self._key("start", self.rank), b"1")
                self.receiver.begin(version)
                phases["begin"] = time.perf_counter() - t
                transfer = self.bucket_receiver.receive()
            progress = len(self.plan.buckets)
        except PolicySyncError as e:
            transfer, error = 0.0, str(e)
            progress = getattr(e, "buckets_done", 0)
        except Exception as e:
            self._vote(state=_RAISED, progress=0)  # the others learn who failed; then surface the bug
            if self.is_rollout:
                self.receiver.abort(f"policy sync v{version}: rank {self.rank} raised {type(e).__name__}: {e}")
            raise
        t = time.perf_counter()
        ok, detail = self._vote(state=_DONE if error is None else _TIMED_OUT, progress=progress)
        phases["vote"] = time.perf_counter() - t
        transfer += phases["vote"]
        if not ok:
            cause = f"{error}; " if error else ""
            message = f"policy sync v{version} failed on rank {self.rank}: {cause}{detail}"
            if self.is_rollout:
                self.receiver.abort(message)
            raise PolicySyncError(message)
        if self.is_rollout:
            t = time.perf_counter()
            self.receiver.commit(version)
            phases["commit"] = time.perf_counter() - t
        if self.device.type == "cuda":
            t = time.perf_counter()
            torch.cuda.synchronize(self.device)
            phases["device_sync"] = time.perf_counter() - t
        return SyncStats(
            version=version,
            total_time_s=time.perf_counter() - t0,
            transfer_time_s=transfer,
            bytes=self.plan.total_bytes,
            tensors=self.plan.num_tensors,
            # a training rank does not pause generation; a rollout rank as long as its receiver
            # says (a staged one: the commit; an in-place one: the whole sync)
            generation_paused_s=self.receiver.last_paused_s if self.is_rollout else 0.0,
            phases_s=dict(phases),
        )

    def _vote(self, *, state: int, progress: int) -> tuple[bool, str]:
        """All participants agree whether every one of them has its part (all-or-nothing commit).

        One all-reduce over the control group of all participants (``vote_backend``): row 0 =
        each rank's state (done / a wait timed out / raised), row 1 = buckets each rollout rank
        staged. Ranks that raised are the cause; timed-out ones waited on them. On NCCL the vote
        runs on its own stream (the current one may wait on a data collective that never ends)
        and is host-waited with the timeout like every other wait."""
        self.store.set(self._key("arrived", self.rank), b"1")
        status = torch.zeros(2, dist.get_world_size(), dtype=torch.int64)
        status[0, self.rank] = state
        status[1, self.rank] = progress
        control = self.control_group
        try:
            if self.vote_backend == "nccl":
                if self._vote_stream is None:
                    self._vote_stream = torch.cuda.Stream(self.device)
                with torch.cuda.stream(self._vote_stream):
                    status_dev = status.to(self.device)
                    work = dist.all_reduce(status_dev, group=control, async_op=True)
                    self.collectives.wait(work, "commit vote", poll=True)
                    status = status_dev.cpu()
            else:
                self.collectives.wait(dist.all_reduce(status, group=control, async_op=True), "commit vote")
        except PolicySyncError as e:
            return False, f"{e}; {self._missing()}"
        participants = self.topology.participants
        raised = [r for r in participants if status[0, r] == _RAISED]
        waited = [r for r in participants if status[0, r] == _TIMED_OUT]
        if not raised and not waited:
            return True, ""
        n = len(self.plan.buckets)
        desc = ", ".join(
            f"rank {r}: {int(status[1, r])}/{n} buckets" for r in raised + waited if r in self.topology.rollout_ranks
        )
        parts = ([f"failed rank(s) {raised}"] if raised else []) + ([f"timed out: {waited}"] if waited else [])
        return False, "; ".join(parts) + (f" ({desc})" if desc else "")
