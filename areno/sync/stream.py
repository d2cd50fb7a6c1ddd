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

Host cost: packing and staging issue one ``torch._foreach_copy_`` per bucket (per dtype pair),
not one ``copy_`` per tensor; the buffer-slot views of every bucket are built once per transport
(``BucketPacker``, ``BucketStager``); a bucket's chunks are copied together once its last one was
read, so a source that yields fresh tensors (not views of live ones) has those of the bucket being
packed held until then, at most a bucket's worth (a gathered DTensor is copied out at once). On NCCL the per-bucket waits are stream-ordered
(``Work.wait()`` without a timeout: the current stream waits, the host keeps enqueuing), so packing
bucket k+1 is not serialised behind bucket k on the wire; a buffer slot is still reused only after
its collective (the reusing copies are ordered after it on the stream). Before voting, every rank
host-waits on its collectives with the timeout, so a hung peer still ends in ``PolicySyncError``
(polling ``is_completed`` every ~50 us first: NCCL's ``Work.wait(timeout)`` polls once per
millisecond, which would add up to a millisecond to the drain and to an NCCL vote).

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from areno.sync.base import (
    PolicySyncError,
    PolicySyncTransport,
    ShardReceiver,
    ShardSpec,
    SyncStats,
    WeightSource,
    full_tensor,
)
from areno.sync.plan import Bucket, BucketItem, SyncPlan, choose_relays, plan_buckets


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


POLL_S = 1.0
"""Host waits on NCCL works poll ``is_completed`` for up to this long (then ``Work.wait(timeout)``)."""
POLL_INTERVAL_S = 5e-5
"""Sleep between two polls (~50-100 us on Linux; releases the GIL to a generating engine thread)."""

_DONE, _TIMED_OUT, _RAISED = 1, 2, 3
"""Commit-vote states: finished its part / a wait on a peer timed out / raised an error itself."""


class StreamTransport(PolicySyncTransport):
    """Streams the policy from training DP rows into rollout TP shards.

    Construct on every rank of the world (it creates process groups, a collective): training ranks
    pass ``source``, rollout ranks pass ``receiver``. ``device`` is where bucket buffers live (the
    rank's CUDA device under NCCL, CPU under gloo). ``store`` is the distributed store shared by all
    ranks (default: the default process group's). ``backend`` is the data-plane backend (default:
    the world's; e.g. ``nccl`` in a gloo world). Call ``sync`` on every training and rollout rank.
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
        self._timeout = datetime.timedelta(seconds=config.timeout_s)
        # Groups get the longer of the two: their own timeout bounds creation; every sync wait is
        # bounded separately by ``timeout_s`` (Work.wait).
        group_timeout = datetime.timedelta(seconds=max(config.timeout_s, config.connect_timeout_s))

        # Relays: each row's rollout rank on another physical device than its sender.
        rollout_devices = [topology.device(r) for r in topology.rollout_ranks]
        relay_idx = choose_relays([topology.device(r) for r in topology.sender_ranks], rollout_devices)
        self.relays = tuple(topology.rollout_ranks[j] for j in relay_idx)

        # Process groups, created in the same order on every rank.
        self.pair_groups = [
            dist.new_group(sorted({s, r}), timeout=group_timeout, backend=backend)
            for s, r in zip(topology.sender_ranks, self.relays)
        ]
        self.rollout_group = (
            dist.new_group(list(topology.rollout_ranks), timeout=group_timeout, backend=backend)
            if len(topology.rollout_ranks) > 1
            else None
        )
        # Control plane: the commit vote (``vote_backend``: NCCL on distinct GPUs, else gloo).
        data_backend = str(backend if backend is not None else dist.get_backend()).lower()
        self.vote_backend = vote_backend(topology, data_backend)
        self.control_group = dist.new_group(topology.participants, timeout=group_timeout, backend=self.vote_backend)
        self._vote_stream: torch.cuda.Stream | None = None  # NCCL vote: its own stream, made on first use

        # Every construction (e.g. a rebuild after a failed sync) gets its own store keys.
        self._gen = (self.store.add("constructed", 1) - 1) // dist.get_world_size()
        self._attempt = 0
        # The plan needs the same tensor list everywhere: the first sender publishes it. Every
        # training rank asks its source (listing a sharded source may be collective).
        if self.is_train:
            meta = source.meta()
            if self.rank == topology.sender_ranks[0]:
                self.store.set(self._key("meta"), pickle.dumps(meta))
        # Every rollout rank publishes which slice of each tensor it keeps: chunks end at the dim-0
        # shard boundaries, and a bucket only its relay keeps needs no fan-out.
        if self.is_rollout:
            kept = {n: (sp.dim, sp.start, sp.length) for n, sp in receiver.shard_specs().items()}
            self.store.set(self._key("kept", self.rank), pickle.dumps(kept))
        self.store.wait([self._key("meta")] + [self._key("kept", r) for r in topology.rollout_ranks], group_timeout)
        self.meta = pickle.loads(self.store.get(self._key("meta")))
        kept_by = {r: pickle.loads(self.store.get(self._key("kept", r))) for r in topology.rollout_ranks}
        cuts: dict[str, set[int]] = {}
        for kept in kept_by.values():
            for name, (dim, start, length) in kept.items():
                if dim == 0:
                    cuts.setdefault(name, set()).update((start, start + length))
        self.plan: SyncPlan = plan_buckets(
            self.meta,
            len(topology.sender_ranks),
            config.bucket_bytes,
            config.wire_dtype,
            cuts={n: sorted(c) for n, c in cuts.items()},
            direct_bytes=config.direct_bytes if config.direct_bytes is not None else config.bucket_bytes // 4,
        )
        self.fanout = tuple(
            (config.fanout_all or bool(_keepers(b, kept_by) - {self.relays[b.row]})) and self.rollout_group is not None
            for b in self.plan.buckets
        )
        """Per bucket: whether it fans out from its relay (False when no other rollout rank keeps
        any of it, e.g. a dim-0 shard chunk of the relay's own slice)."""
        self.wire_bytes = sum(b.nbytes * (1 + f) for b, f in zip(self.plan.buckets, self.fanout))
        """Bytes one sync puts on the data plane: every bucket once to its relay, plus its fan-out."""
        if self.is_rollout:
            self._check_specs()
        self.stream_ordered = "nccl" in data_backend and self.device.type == "cuda"
        """Per-bucket waits only order the current CUDA stream after the collective (NCCL); the host
        waits (with the timeout) once, on all of them, before the vote. Off (gloo): every wait blocks."""
        self._inflight: list[tuple[dist.Work, str, int]] = []
        self._packer = BucketPacker()
        self._stager = BucketStager(receiver, receiver.shard_specs()) if self.is_rollout else None
        self._send_items: dict | None = None  # tensor_chunks of this rank's buckets, built on first send
        self._buffers: list[torch.Tensor] = []
        self.peak_buffer_bytes = 0
        """Largest total bucket-buffer memory this rank held (at most two buckets)."""
        self.last_phases: dict[str, float] = {}
        """Seconds of the last sync by phase on this rank: ``pack`` (copies into bucket buffers),
        ``post`` (posting collectives), ``wait`` (waiting on them), ``stage`` (copying received
        slices into staging), ``vote`` (the commit vote), ``commit`` (the receiver's apply)."""
        self._connect()

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
            self._wait(work, f"connecting NCCL group {ranks}")
        torch.cuda.synchronize(self.device)

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
        return f"{self._gen}/{self._attempt}/{what}" + ("" if rank is None else f"/{rank}")

    def _wait(self, work: dist.Work, what: str, *, poll: bool = False) -> None:
        """Block the host until ``work`` completes, at most ``timeout_s``.

        ``poll`` (NCCL works): ``Work.wait(timeout)`` checks completion once per millisecond
        (ProcessGroupNCCL), so a collective that ends microseconds after the call (the vote, the
        last bucket) would cost up to a millisecond; poll ``is_completed`` every ~50 us first (the
        sleep releases the GIL), for at most ``POLL_S``, then hand the rest of the timeout to it."""
        timeout = self._timeout
        try:
            if poll:
                t0 = time.perf_counter()
                end = t0 + min(POLL_S, timeout.total_seconds())
                while not work.is_completed():
                    if time.perf_counter() >= end:  # still running: the rest of the timeout
                        timeout = max(
                            timeout - datetime.timedelta(seconds=time.perf_counter() - t0),
                            datetime.timedelta(milliseconds=1),
                        )
                        break
                    time.sleep(POLL_INTERVAL_S)
            work.wait(timeout)
        except RuntimeError as e:
            raise PolicySyncError(f"{what}: {e}") from e

    def _order(self, work: dist.Work, what: str, bucket: int) -> None:
        """What comes after this call (buffer reuse, staging, the fan-out) needs ``work`` done.
        Stream-ordered: the current CUDA stream waits for it and the host goes on (checked later by
        ``_drain``); otherwise the host waits, at most ``timeout_s``."""
        if not self.stream_ordered:
            self._wait(work, what)
            return
        try:
            work.wait()
        except RuntimeError as e:
            raise PolicySyncError(f"{what}: {e}") from e
        self._inflight.append((work, what, bucket))

    def _drain(self) -> float:
        """Stream-ordered: host-wait (each at most ``timeout_s``) on every collective of this sync,
        so a rank votes "done" only once its data really moved. Returns the seconds waited."""
        t = time.perf_counter()
        inflight, self._inflight = self._inflight, []
        for work, what, bucket in inflight:
            try:
                self._wait(work, what, poll=True)
            except PolicySyncError as e:
                e.buckets_done = bucket
                raise
        dt = time.perf_counter() - t
        self.last_phases["wait"] += dt
        return dt

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
        self._inflight = []
        self.last_phases = dict.fromkeys(
            ("begin", "pack", "post", "wait", "stage", "vote", "commit", "device_sync"), 0.0
        )
        t0 = time.perf_counter()
        progress, error = 0, None
        try:
            if self.is_train:
                transfer = self._send()
            else:
                t = time.perf_counter()
                self.store.set(self._key("start", self.rank), b"1")
                self.receiver.begin(version)
                self.last_phases["begin"] = time.perf_counter() - t
                transfer = self._receive()
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
        self.last_phases["vote"] = time.perf_counter() - t
        transfer += self.last_phases["vote"]
        if not ok:
            cause = f"{error}; " if error else ""
            message = f"policy sync v{version} failed on rank {self.rank}: {cause}{detail}"
            if self.is_rollout:
                self.receiver.abort(message)
            raise PolicySyncError(message)
        if self.is_rollout:
            t = time.perf_counter()
            self.receiver.commit(version)
            self.last_phases["commit"] = time.perf_counter() - t
        if self.device.type == "cuda":
            t = time.perf_counter()
            torch.cuda.synchronize(self.device)
            self.last_phases["device_sync"] = time.perf_counter() - t
        return SyncStats(
            version=version,
            total_time_s=time.perf_counter() - t0,
            transfer_time_s=transfer,
            bytes=self.plan.total_bytes,
            tensors=self.plan.num_tensors,
            # a training rank does not pause generation; a rollout rank as long as its receiver
            # says (a staged one: the commit; an in-place one: the whole sync)
            generation_paused_s=self.receiver.last_paused_s if self.is_rollout else 0.0,
            phases_s=dict(self.last_phases),
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
        try:
            if self.vote_backend == "nccl":
                if self._vote_stream is None:
                    self._vote_stream = torch.cuda.Stream(self.device)
                with torch.cuda.stream(self._vote_stream):
                    status_dev = status.to(self.device)
                    work = dist.all_reduce(status_dev, group=self.control_group, async_op=True)
                    self._wait(work, "commit vote", poll=True)
                    status = status_dev.cpu()
            else:
                self._wait(dist.all_reduce(status, group=self.control_group, async_op=True), "commit vote")
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

    def _timed_wait(self, work: dist.Work, what: str, bucket: int) -> float:
        t = time.perf_counter()
        self._order(work, what, bucket)
        dt = time.perf_counter() - t
        self.last_phases["wait"] += dt
        return dt

    def _post(self, tensor: torch.Tensor, src: int, group: dist.ProcessGroup) -> tuple[dist.Work, float]:
        t = time.perf_counter()
        work = dist.broadcast(tensor, src=src, group=group, async_op=True)
        dt = time.perf_counter() - t
        self.last_phases["post"] += dt
        return work, dt

    def _send(self) -> float:
        """Training rank: iterate the source; if a sender, send this row's buckets in plan order.

        A bucket of one contiguous chunk in the wire dtype goes out as a view of the trained tensor
        (no copy); any other is packed into one of two buffers while earlier sends are in flight,
        with one multi-tensor copy when its last item was read (a gathered DTensor is copied out at
        once, so it can be freed). A buffer is reused only after its previous send completed (on
        the stream when stream-ordered); at most two sends in flight."""
        ph = self.last_phases
        row = self.topology.sender_ranks.index(self.rank) if self.rank in self.topology.sender_ranks else -1
        my_buckets = [b for b in self.plan.buckets if b.row == row]
        if self._send_items is None:
            self._send_items = tensor_chunks(my_buckets)
        items_by_tensor = self._send_items
        works: dict[int, dist.Work] = {}
        owner: list[int | None] = [None, None]  # per buffer slot: the bucket packed in it last
        slot_of: dict[int, int] = {}
        pending: dict[int, list[torch.Tensor]] = {}  # bucket pos -> chunks read, not yet packed
        packed: dict[int, int] = {}  # bucket pos -> items already packed
        transfer = 0.0

        def what(pos: int) -> str:
            return f"sending bucket {my_buckets[pos].index} to relay rank {self.relays[row]}"

        def flush(pos: int) -> None:
            chunks = pending.pop(pos, None)
            if not chunks:
                return
            t = time.perf_counter()
            slot, first = slot_of[pos], packed.get(pos, 0)
            self._packer.pack(my_buckets[pos], slot, self._buffer(slot), first, chunks)
            packed[pos] = first + len(chunks)
            ph["pack"] += time.perf_counter() - t

        for idx, (name, tensor) in enumerate(self.source.iter_tensors()):
            if idx >= len(self.meta) or name != self.meta[idx][0]:
                raise ValueError(f"weight source order changed at {idx} ({name!r}); rebuild the transport")
            full = full_tensor(tensor)
            entry = items_by_tensor.get(idx)
            pairs = zip(entry[0], chunk_views(full, entry)) if entry is not None else ()
            for (pos, item), chunk in pairs:
                bucket = my_buckets[pos]
                first = item is bucket.items[0]
                if first:  # at most two sends in flight
                    for prev in [p for p in works if p <= pos - 2]:
                        transfer += self._timed_wait(works.pop(prev), what(prev), my_buckets[prev].index)
                if len(bucket.items) == 1 and chunk.dtype == item.dtype and chunk.is_contiguous():
                    # A bucket of one contiguous chunk goes out as it is: no packing copy.
                    works[pos], dt = self._post(chunk.reshape(-1).view(torch.uint8), self.rank, self.pair_groups[row])
                    transfer += dt
                    continue
                if first:
                    # A slot not held by a bucket still being packed; wait for its send if in flight.
                    free = [s for s in (0, 1) if owner[s] is None or owner[s] in works or owner[s] not in slot_of]
                    slot = min(free, key=lambda s: (owner[s] in works, owner[s] or -1))
                    if owner[slot] in works:
                        transfer += self._timed_wait(
                            works.pop(owner[slot]), what(owner[slot]), my_buckets[owner[slot]].index
                        )
                    owner[slot] = pos
                    slot_of[pos] = slot
                pending.setdefault(pos, []).append(chunk)
                if item is bucket.items[-1]:
                    flush(pos)
                    works[pos], dt = self._post(
                        self._buffer(slot_of[pos])[: bucket.nbytes], self.rank, self.pair_groups[row]
                    )
                    transfer += dt
                    del slot_of[pos]  # sent: the slot is free once its work completes
                    packed.pop(pos, None)
            if full is not tensor:  # a gathered copy: pack what it holds now and let it go
                for pos in list(pending):
                    flush(pos)
            del full
        for pos in sorted(works):
            transfer += self._timed_wait(works.pop(pos), what(pos), my_buckets[pos].index)
        if self.stream_ordered:
            transfer += self._drain()
        return transfer

    def _receive(self) -> float:
        """Rollout rank: receive every bucket (as relay, then through the fan-out), stage own slices.

        A bucket of one chunk this rank keeps whole is received straight into its staging tensor
        (no copy); others land in one of two buffers. One bucket of lookahead: bucket k's
        collectives are posted before bucket k-1 is staged, so staging overlaps the transfer."""
        specs = self.receiver.shard_specs()
        ph = self.last_phases
        transfer = 0.0
        buckets = self.plan.buckets
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
                        buf = self._buffer(k)[: bucket.nbytes]
                    relay = self.relays[bucket.row]
                    if self.rank == relay:
                        sender = self.topology.sender_ranks[bucket.row]
                        work, dt = self._post(buf, sender, self.pair_groups[bucket.row])
                        recv = (work, f"receiving bucket {k} from training rank {sender}")
                        transfer += dt
                    else:
                        fanout[k], dt = self._post(buf, relay, self.rollout_group)
                        transfer += dt
                if k > 0:
                    if k - 1 in fanout:
                        transfer += self._timed_wait(
                            fanout.pop(k - 1),
                            f"fan-out of bucket {k - 1} from relay rank {self.relays[buckets[k - 1].row]}",
                            k - 1,
                        )
                    if not direct_prev:
                        t = time.perf_counter()
                        self._stager.stage(buckets[k - 1], self._buffer(k - 1)[: buckets[k - 1].nbytes])
                        ph["stage"] += time.perf_counter() - t
                if recv is not None:
                    transfer += self._timed_wait(*recv, k)
                    if self.fanout[k]:
                        fanout[k], dt = self._post(buf, self.rank, self.rollout_group)
                        transfer += dt
            except PolicySyncError as e:
                e.buckets_done = max(k - 1, 0)
                raise
        if self.stream_ordered:
            transfer += self._drain()
        return transfer

    def _direct_dest(self, bucket: Bucket, specs: Mapping) -> torch.Tensor | None:
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
