"""Pure planning for policy sync: who sends what, in which bucket, to which relay, and which slice
each rollout rank keeps. No torch.distributed here; everything is unit-tested on its own.

- ``assign_rows``: tensors to training DP rows, balanced by bytes (greedy LPT: largest first, each
  to the least-loaded row).
- ``plan_buckets``: per row, tensors packed in source order into buckets of at most
  ``bucket_bytes``; a tensor larger than a bucket is split along dim 0 into row chunks. Buckets get
  one global order (the order in which they become complete while the source is iterated), which
  every rank follows, so collectives match without negotiation.
- ``choose_relays``: for each training row, the rollout rank that receives its buckets, always on a
  different physical device than the sender (overlapping device lists), spread evenly.
- ``shard_specs_from_tp_plan``: a rollout rank's ``ShardSpec`` per tensor from the model's TP plan.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase

import torch

from areno.sync.base import ShardSpec

ALIGN_BYTES = 64
"""Every item starts at a multiple of this offset in its bucket, so byte views reinterpret safely."""

TensorMeta = tuple[str, tuple[int, ...], torch.dtype]


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _align(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def assign_rows(sizes: Sequence[tuple[str, int]], num_rows: int) -> dict[str, int]:
    """Greedy LPT: largest tensor first, each to the row with the fewest bytes so far (ties: the
    lower row). Deterministic, so every rank computes the same assignment."""
    if num_rows <= 0:
        raise ValueError(f"num_rows must be >= 1, got {num_rows}")
    loads = [0] * num_rows
    owner: dict[str, int] = {}
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i][1], i))
    for i in order:
        name, nbytes = sizes[i]
        row = min(range(num_rows), key=lambda r: (loads[r], r))
        owner[name] = row
        loads[row] += nbytes
    return owner


@dataclass(frozen=True)
class BucketItem:
    """Rows ``[row_start, row_end)`` (dim 0) of one tensor, at ``offset`` bytes in its bucket."""

    name: str
    tensor_index: int
    """Position of the tensor in the source order."""
    row_start: int
    row_end: int
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    """Full shape of the tensor (as sent)."""
    dtype: torch.dtype
    """dtype on the wire."""

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        return (self.row_end - self.row_start, *self.shape[1:])


@dataclass(frozen=True)
class Bucket:
    index: int
    """Position in the global order every rank follows."""
    row: int
    """Training DP row that sends it."""
    items: tuple[BucketItem, ...]
    nbytes: int
    """Bytes used, alignment padding included (at most the plan's bucket_bytes)."""

    @property
    def ready_after(self) -> int:
        """Source index of the last tensor it needs: it can be sent once that tensor was read."""
        return self.items[-1].tensor_index


@dataclass(frozen=True)
class SyncPlan:
    buckets: tuple[Bucket, ...]
    owner: Mapping[str, int]
    """Tensor name -> training row that sends it."""
    row_bytes: tuple[int, ...]
    """Payload bytes each row sends."""
    total_bytes: int
    """Payload bytes of the whole policy as sent (wire dtype)."""
    num_tensors: int
    bucket_bytes: int

    @property
    def max_bucket_bytes(self) -> int:
        return max((b.nbytes for b in self.buckets), default=0)


def wire_dtype_for(dtype: torch.dtype, wire_dtype: torch.dtype | None) -> torch.dtype:
    return wire_dtype if wire_dtype is not None and dtype.is_floating_point else dtype


def plan_buckets(
    meta: Sequence[TensorMeta],
    num_rows: int,
    bucket_bytes: int,
    wire_dtype: torch.dtype | None = None,
    *,
    cuts: Mapping[str, Sequence[int]] | None = None,
    direct_bytes: int | None = None,
    float32_names: Collection[str] = (),
) -> SyncPlan:
    """Assign tensors to rows (``assign_rows``) and pack each row's share into bounded buckets.

    ``cuts``: per tensor name, dim-0 indices where a chunk must end (the receivers' dim-0 shard
    boundaries), so no chunk straddles two receivers' slices and each receiver can take a chunk
    it keeps straight into its staging tensor. ``float32_names``: tensors that travel in their own dtype
    whatever ``wire_dtype`` (GLM-4.5's float32 routers, ``moe.float32_names``). ``direct_bytes``: a chunk of at least this many
    bytes gets a bucket of its own (sent from the trained tensor and received in place, no
    packing); smaller ones are packed together. None: chunks are packed as they come.
    """
    if bucket_bytes < ALIGN_BYTES:
        raise ValueError(f"bucket_bytes must be >= {ALIGN_BYTES}, got {bucket_bytes}")
    names = [m[0] for m in meta]
    if len(set(names)) != len(names):
        raise ValueError("weight source yields duplicate tensor names")
    cuts = cuts or {}
    metas = [(n, tuple(s) or (1,), wire_dtype_for(d, None if n in float32_names else wire_dtype)) for n, s, d in meta]
    owner = assign_rows([(n, _nbytes(s, d)) for n, s, d in metas], num_rows)

    # Per row: closed buckets in the order they complete, and the bucket being packed.
    closed: list[list[list[BucketItem]]] = [[] for _ in range(num_rows)]
    packing: list[list[BucketItem]] = [[] for _ in range(num_rows)]
    row_fill = [0] * num_rows
    row_bytes = [0] * num_rows
    for idx, (name, shape, dtype) in enumerate(metas):
        row = owner[name]
        row_nbytes = _nbytes(shape[1:], dtype)
        total = row_nbytes * shape[0]
        row_bytes[row] += total
        if row_nbytes > bucket_bytes:
            raise ValueError(
                f"bucket_bytes={bucket_bytes} is smaller than one row ({row_nbytes} bytes) of {name} "
                f"{tuple(shape)}; raise bucket_bytes"
            )
        bounds = sorted({0, shape[0], *(c for c in cuts.get(name, ()) if 0 < c < shape[0])})
        step = max(bucket_bytes // row_nbytes, 1) if row_nbytes else shape[0]
        chunks = [(r, min(r + step, hi)) for lo, hi in zip(bounds, bounds[1:]) for r in range(lo, hi, step)]
        for r0, r1 in chunks:
            nbytes = row_nbytes * (r1 - r0)
            if direct_bytes is not None and nbytes >= direct_bytes:
                closed[row].append([BucketItem(name, idx, r0, r1, 0, nbytes, shape, dtype)])
                continue
            if packing[row] and row_fill[row] + nbytes > bucket_bytes:
                closed[row].append(packing[row])
                packing[row], row_fill[row] = [], 0
            packing[row].append(BucketItem(name, idx, r0, r1, row_fill[row], nbytes, shape, dtype))
            row_fill[row] = _align(row_fill[row] + nbytes)
    for row in range(num_rows):
        if packing[row]:
            closed[row].append(packing[row])

    # Global order: the order in which buckets become complete while the source is iterated.
    flat = [
        (items[-1].tensor_index, row, seq, items) for row in range(num_rows) for seq, items in enumerate(closed[row])
    ]
    flat.sort(key=lambda x: x[:3])
    buckets = tuple(
        Bucket(k, row, tuple(items), items[-1].offset + items[-1].nbytes) for k, (_, row, _, items) in enumerate(flat)
    )
    return SyncPlan(buckets, owner, tuple(row_bytes), sum(row_bytes), len(metas), bucket_bytes)


def choose_relays(sender_devices: Sequence[str], rollout_devices: Sequence[str]) -> list[int]:
    """For each training row (its sender's physical device), the index of the rollout rank that
    receives its buckets: on a different physical device than the sender, the least-used one
    first (ties: the lower index). Rollout devices must be distinct: the rollout fan-out group
    would otherwise hold one device twice."""
    if not rollout_devices:
        raise ValueError("policy sync needs at least one rollout rank")
    dup = {d for d in rollout_devices if list(rollout_devices).count(d) > 1}
    if dup:
        raise ValueError(f"rollout ranks share devices {sorted(dup)}; give each rollout rank its own device")
    used = [0] * len(rollout_devices)
    relays = []
    for row, dev in enumerate(sender_devices):
        candidates = [j for j, d in enumerate(rollout_devices) if d != dev]
        if not candidates:
            raise ValueError(
                f"training row {row} on device {dev} has no rollout rank on another device "
                f"(rollout devices {list(rollout_devices)}); use the in-place transport when colocated "
                "or give rollout a device the trainer does not use"
            )
        j = min(candidates, key=lambda c: (used[c], c))
        used[j] += 1
        relays.append(j)
    return relays


def _matches(name: str, pattern: str) -> bool:
    """``fnmatch`` on the parameter name, or on its module (``pattern`` naming a module)."""
    return fnmatchcase(name, pattern) or fnmatchcase(name, pattern + ".*")


def shard_specs_from_tp_plan(
    meta: Sequence[TensorMeta],
    tp_plan: Mapping[str, str],
    tp_rank: int,
    tp_size: int,
    dtype: torch.dtype | None = None,
) -> dict[str, ShardSpec]:
    """``ShardSpec`` of every tensor for one rollout TP rank.

    ``tp_plan`` maps Hugging Face name patterns (``fnmatch``; a pattern names a parameter or a
    module, as ``areno.models.tp_plan.tp_plan`` and HF's ``base_model_tp_plan`` do) to a style:
    ``colwise*`` splits the output dim (weight and bias dim 0),
    ``rowwise*`` splits the input dim (weight dim 1; bias replicated), ``vocab``/``embedding*``
    splits dim 0, ``replicate`` keeps everything. Unmatched tensors are replicated. The first
    matching pattern wins. ``dtype`` overrides the receiver dtype (default: the source dtype).
    """
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}")
    specs = {}
    for name, shape, src_dtype in meta:
        style = tp_plan.get(name) or next((s for p, s in tp_plan.items() if _matches(name, p)), "replicate")
        is_bias = name.endswith(".bias")
        if style.startswith("colwise") or style == "vocab" or style.startswith("embedding"):
            dim = 0
        elif style.startswith("rowwise"):
            dim = None if is_bias else 1
        elif style == "replicate":
            dim = None
        else:
            raise ValueError(f"unknown TP style {style!r} for {name}; expected colwise, rowwise, vocab or replicate")
        if dim is not None and dim >= len(shape):
            dim = None if len(shape) == 0 else 0
        if tp_size == 1 or dim is None:
            specs[name] = ShardSpec(name=name, full_shape=shape, dtype=dtype or src_dtype)
            continue
        if shape[dim] % tp_size:
            raise ValueError(f"{name} dim {dim} ({shape[dim]}) is not divisible by rollout TP size {tp_size}")
        length = shape[dim] // tp_size
        specs[name] = ShardSpec(
            name=name, full_shape=shape, dtype=dtype or src_dtype, dim=dim, start=tp_rank * length, length=length
        )
    return specs
