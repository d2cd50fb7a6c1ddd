"""The partitioned topology (seed 000): device lists, ranks, process groups, relays, memory check.

Training and rollout workers join ONE torch.distributed world; ranks follow creation order, so
training ranks come first (``0 .. n_train-1``), then rollout ranks. Device lists hold logical
indices within the parent's ``CUDA_VISIBLE_DEVICES`` and may overlap; an overlapping device holds
a training and a rollout worker, so ``validate_memory`` checks before launch that their model,
optimizer, KV-cache and CUDA-context memory fit on it together.

Groups (created by ``build_groups`` on every rank, in the same order, since ``new_group`` is
collective over the world):

- the training mesh ``(dp_replicate, dp_shard, tp)`` over the training ranks, and a group of all
  training ranks (``FSDP2TrainBackend(mesh=, group=)``);
- one rollout TP group per rollout DP replica (consecutive rollout ranks), and one rollout DP
  group per TP position;
- the policy-sync groups belong to ``StreamTransport`` (one pair group per training DP row, a
  rollout fan-out group, a gloo control group); its relays come from ``areno.sync.plan``.

On CPU (gloo) the device lists only count processes: every rank is its own "device".
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from areno.errors import ConfigError
from areno.launch.allocation import parse_allocation_mode
from areno.launch.factory import scheduler_from_config
from areno.launch.scheduler import scheduler_config
from areno.sync.plan import choose_relays
from areno.sync.stream import StreamTopology
from areno.train.fsdp import MESH_DIMS

__all__ = [
    "ClusterLayout",
    "LayoutError",
    "MemoryEstimate",
    "build_groups",
    "estimate_memory",
    "layout_from_config",
    "scheduler_for",
    "validate_memory",
]

GIB = 1 << 30
CONTEXT_BYTES = 768 << 20
"""CUDA context + allocator slack per process (what a process holds before its first tensor)."""


class LayoutError(ConfigError):
    """A partitioned layout that cannot run (bad lists, does not fit in memory)."""


@dataclass(frozen=True, kw_only=True)
class ClusterLayout:
    """Where every worker of the partitioned topology lives and how it is grouped."""

    train_devices: tuple[int, ...]
    """Logical device index of each training rank (one rank per device)."""
    rollout_devices: tuple[int, ...]
    """Logical device index of each rollout rank (one rank per device)."""
    train_tp: int = 1
    """Tensor-parallel size of training (FSDP shards over the rest)."""
    train_dp_replicate: int = 1
    """HSDP replicas of training (``cluster.train_dp_replicate``)."""
    train_ep: int = 1
    """Expert-parallel size of training (the ``e`` of ``cluster.allocation_mode``): it divides the FSDP shard dimension."""
    train_cp: int = 1
    """Context-parallel size of training (the ``c`` of ``cluster.allocation_mode``): runs of cp FSDP shard ranks share each
    micro-batch."""
    rollout_tp: int = 1
    """Tensor-parallel size of one rollout replica; rollout DP = len(rollout_devices) / rollout_tp."""
    cuda: bool = False
    """True: devices are GPUs (overlap shares memory); False: CPU processes under gloo."""
    device_ids: tuple[str, ...] = ()
    """Physical id of each logical device (the parent's CUDA_VISIBLE_DEVICES), for reporting."""
    allocation_mode: str | None = None
    """The ``cluster.allocation_mode`` string the lists and sizes were laid out from, which an error
    names; None: ``cluster.train_devices`` / ``rollout_devices`` and ``cluster.train_tp`` /
    ``rollout_tp`` gave them."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "train_devices", tuple(int(d) for d in self.train_devices))
        object.__setattr__(self, "rollout_devices", tuple(int(d) for d in self.rollout_devices))
        object.__setattr__(self, "device_ids", tuple(str(d) for d in self.device_ids))
        for what, devs in (("train_devices", self.train_devices), ("rollout_devices", self.rollout_devices)):
            given = f"cluster.{what}={list(devs)}"
            if not devs:
                raise LayoutError(f"{given} is empty: give at least one logical device index (e.g. cluster.{what}=[0])")
            if any(d < 0 for d in devs):
                raise LayoutError(f"{given} has a negative index: use logical device indices >= 0")
            if len(set(devs)) != len(devs):
                raise LayoutError(f"{given} repeats a device: one worker per device, so name each device once")
            if self.device_ids and max(devs) >= len(self.device_ids):
                raise LayoutError(
                    f"{self._source(what)} names device {max(devs)} but only {len(self.device_ids)} are visible "
                    f"(CUDA_VISIBLE_DEVICES={','.join(self.device_ids)}): use indices below {len(self.device_ids)}"
                )
        n_train, tp, rep = len(self.train_devices), self.train_tp, self.train_dp_replicate
        if tp < 1 or rep < 1 or n_train % (tp * rep):
            fix = (
                f"make the fsdp component's d a multiple of {rep}, or set cluster.train_dp_replicate to a divisor of it"
                if self.allocation_mode
                else f"give cluster.train_devices a multiple of {tp * rep} devices, or change cluster.train_tp / "
                "cluster.train_dp_replicate"
            )
            raise LayoutError(
                f"{self._source('train_devices')}: {n_train} training devices cannot form train TP {tp} x "
                f"replicate {rep} (cluster.train_dp_replicate={rep}): {fix}"
            )
        if self.train_ep > 1 and rep > 1:
            raise LayoutError(
                f"{self._source('train_devices')}: training expert parallelism e{self.train_ep} with "
                f"cluster.train_dp_replicate={rep}: the experts shard over the whole FSDP group; set "
                "cluster.train_dp_replicate=1"
            )
        if self.train_ep > 1 and (self.train_dp_shard % self.train_ep or tp > 1):
            raise LayoutError(
                f"{self._source('train_devices')}: training expert parallelism e{self.train_ep} must divide the FSDP "
                f"shard size (got {self.train_dp_shard}) with t1 (got t{tp}): the experts are split over groups of "
                f"e shard ranks; use e.g. fsdp:d{2 * self.train_ep}e{self.train_ep}"
            )
        if self.train_cp > 1 and (self.train_dp_shard % self.train_cp or tp > 1 or self.train_ep > 1):
            shard = (
                f" (of cluster.train_dp_replicate={self.train_dp_replicate} replicas)"
                if self.train_dp_replicate > 1
                else ""
            )
            fix = (
                "lower cluster.train_dp_replicate or give training more devices"
                if self.train_dp_replicate > 1 and not (tp > 1 or self.train_ep > 1)
                else f"use e.g. fsdp:d{2 * self.train_cp}c{self.train_cp}"
            )
            raise LayoutError(
                f"{self._source('train_devices')}: training context parallelism c{self.train_cp} must divide the "
                f"FSDP shard size {self.train_dp_shard}{shard} with t1 and e1: {fix}"
            )
        if self.rollout_tp < 1 or len(self.rollout_devices) % self.rollout_tp:
            raise LayoutError(
                f"{self._source('rollout_devices')}: {len(self.rollout_devices)} rollout devices cannot form "
                f"replicas of rollout TP {self.rollout_tp} (cluster.rollout_tp={self.rollout_tp}): give "
                f"cluster.rollout_devices a multiple of {self.rollout_tp} devices, or change cluster.rollout_tp"
            )

    def _source(self, what: str) -> str:
        """The setting an error about device list ``what`` (``train_devices`` / ``rollout_devices``)
        names: the allocation string the list came from, else the list's own key."""
        if self.allocation_mode:
            return f"cluster.allocation_mode={self.allocation_mode!r}"
        return f"cluster.{what}={list(getattr(self, what))}"

    # ------------------------------------------------------------------ ranks
    @property
    def n_train(self) -> int:
        return len(self.train_devices)

    @property
    def n_rollout(self) -> int:
        return len(self.rollout_devices)

    @property
    def world_size(self) -> int:
        return self.n_train + self.n_rollout

    @property
    def train_ranks(self) -> tuple[int, ...]:
        return tuple(range(self.n_train))

    @property
    def rollout_ranks(self) -> tuple[int, ...]:
        return tuple(range(self.n_train, self.world_size))

    @property
    def train_dp_shard(self) -> int:
        return self.n_train // (self.train_tp * self.train_dp_replicate)

    @property
    def train_mesh_shape(self) -> tuple[int, int, int]:
        """(dp_replicate, dp_shard, tp) of the training mesh."""
        return self.train_dp_replicate, self.train_dp_shard, self.train_tp

    def train_mesh_ranks(self) -> list[list[list[int]]]:
        """Training ranks laid out as the mesh (tp fastest, as ``init_device_mesh`` does)."""
        rep, shard, tp = self.train_mesh_shape
        return [[[(r * shard + s) * tp + t for t in range(tp)] for s in range(shard)] for r in range(rep)]

    @property
    def sender_ranks(self) -> tuple[int, ...]:
        """One rank per training DP row (its TP rank 0): the policy-sync senders."""
        return tuple(r for r in self.train_ranks if r % self.train_tp == 0)

    @property
    def rollout_dp(self) -> int:
        return self.n_rollout // self.rollout_tp

    def rollout_tp_groups(self) -> list[tuple[int, ...]]:
        """Rollout ranks of each replica (a TP group), replica by replica."""
        ranks = self.rollout_ranks
        return [tuple(ranks[i * self.rollout_tp : (i + 1) * self.rollout_tp]) for i in range(self.rollout_dp)]

    def rollout_dp_groups(self) -> list[tuple[int, ...]]:
        """Rollout ranks of one TP position across replicas (a DP group)."""
        return [tuple(g[t] for g in self.rollout_tp_groups()) for t in range(self.rollout_tp)]

    def replica_leaders(self) -> list[int]:
        """The rollout rank that serves each replica's requests (its TP rank 0)."""
        return [g[0] for g in self.rollout_tp_groups()]

    def device_of(self, rank: int) -> str:
        """Physical-device key of a rank: ``cuda:<logical>`` on GPU (shared when lists overlap),
        ``rank<r>`` on CPU (every process on its own)."""
        if not self.cuda:
            return f"rank{rank}"
        if rank < self.n_train:
            return f"cuda:{self.train_devices[rank]}"
        return f"cuda:{self.rollout_devices[rank - self.n_train]}"

    def devices_map(self) -> dict[int, str]:
        return {r: self.device_of(r) for r in range(self.world_size)}

    @property
    def overlapping(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.train_devices) & set(self.rollout_devices))) if self.cuda else ()

    def relays(self) -> list[int]:
        """Rollout rank receiving each training row's buckets: on another physical device than the
        sender (``areno.sync.plan.choose_relays``). LayoutError when some row has none."""
        try:
            idx = choose_relays(
                [self.device_of(r) for r in self.sender_ranks], [self.device_of(r) for r in self.rollout_ranks]
            )
        except ValueError as e:
            fix = (
                "give rollout a '+' group of its own (e.g. 'areno:d1+fsdp:d1')"
                if self.allocation_mode
                else "list a device in cluster.rollout_devices that cluster.train_devices does not"
            )
            raise LayoutError(f"{self._places()}: policy sync cannot route: {e}; here: {fix}") from None
        return [self.rollout_ranks[j] for j in idx]

    def _places(self) -> str:
        """The settings that placed the workers, as an error names them."""
        if self.allocation_mode:
            return f"cluster.allocation_mode={self.allocation_mode!r}"
        return (
            f"cluster.train_devices={list(self.train_devices)} / cluster.rollout_devices={list(self.rollout_devices)}"
        )

    def stream_topology(self) -> StreamTopology:
        return StreamTopology(
            train_ranks=self.train_ranks,
            sender_ranks=self.sender_ranks,
            rollout_ranks=self.rollout_ranks,
            devices=self.devices_map(),
        )

    def describe(self) -> str:
        return (
            f"train {list(self.train_devices)} (mesh rep x shard x tp = {self.train_mesh_shape}), "
            f"rollout {list(self.rollout_devices)} (TP {self.rollout_tp} x DP {self.rollout_dp})"
            + (f", shared devices {list(self.overlapping)}" if self.overlapping else "")
        )


def layout_from_config(
    cluster: Any,
    *,
    num_devices: int,
    cuda: bool,
    device_ids: tuple[str, ...] = (),
) -> ClusterLayout | None:
    """The partitioned layout the config asks for, or None when it asks for the colocated default.

    ``cluster.allocation_mode`` with a ``+`` (e.g. ``areno[rollout]:d1t2+fsdp[actor]:d1t2``) gives
    the lists, their TP and DP; otherwise ``cluster.train_devices`` and ``cluster.rollout_devices``
    (both needed) do, with ``cluster.train_tp`` / ``cluster.rollout_tp``. ``num_devices``: visible
    GPUs; on CPU (``cuda=False``) every rank is a process of its own, so any count goes."""
    mode, train, rollout = cluster.allocation_mode, cluster.train_devices, cluster.rollout_devices
    train_tp, rollout_tp = cluster.train_tp, cluster.rollout_tp
    train_ep = train_cp = 1  # expert and context parallelism come only with an allocation string (e, c)
    given = f"cluster.allocation_mode={mode!r}"
    if mode and "+" in mode:
        if train is not None or rollout is not None:
            raise LayoutError(
                f"{given} and cluster.train_devices/rollout_devices both place the workers: set one, not both (drop "
                "cluster.train_devices and cluster.rollout_devices: the string gives the device lists)"
            )
        if (train_tp, rollout_tp) != (1, 1):
            sizes = " and ".join(
                f"cluster.{k}={v}" for k, v in (("train_tp", train_tp), ("rollout_tp", rollout_tp)) if v != 1
            )
            raise LayoutError(
                f"{given} sets the TP sizes by each component's t (e.g. 'areno:d1t2+fsdp:d1t2'): drop {sizes} "
                "and write the size into the string"
            )
        alloc = parse_allocation_mode(mode)
        if cuda and alloc.world_size > num_devices:
            raise LayoutError(
                f"{given} needs {alloc.world_size} devices but only {num_devices} are available "
                "(CUDA_VISIBLE_DEVICES): shrink its d/t counts, or make more devices visible"
            )
        train, rollout = alloc.train_rollout_devices(num_devices if cuda else alloc.world_size)
        trains = [c for c in alloc.components if c.kind == "train"]
        ro = alloc.component("rollout")
        train_tp, rollout_tp, train_ep, train_cp = trains[0].tp, ro.tp, trains[0].ep, trains[0].cp
        for c in trains[1:]:
            # the training side has one TP, EP and CP layout for every role it trains
            for letter, first, other in (("t", train_tp, c.tp), ("e", train_ep, c.ep), ("c", train_cp, c.cp)):
                if other != first:
                    raise LayoutError(
                        f"{given}: the train components differ in {letter} ({letter}{first} and {letter}{other}): "
                        f"give every train component the same {letter}"
                    )
    elif mode and (train is not None or rollout is not None):
        raise LayoutError(
            f"{given} is colocated (no '+') and cluster.train_devices/rollout_devices place the workers apart: set "
            "one, not both (drop the lists, or write the placement as a '+' string)"
        )
    elif train is None and rollout is None:
        return None
    elif train is None or rollout is None:
        have, missing = (
            ("train_devices", "rollout_devices") if rollout is None else ("rollout_devices", "train_devices")
        )
        raise LayoutError(
            f"cluster.{have}={list(train if rollout is None else rollout)} without cluster.{missing}: the two lists go "
            f"together, set cluster.{missing} too (or a '+' cluster.allocation_mode instead of both)"
        )
    elif num_devices and max([*train, *rollout]) >= num_devices:  # an allocation string's lists fit (above)
        raise LayoutError(
            f"cluster.train_devices={list(train)} / cluster.rollout_devices={list(rollout)} name device "
            f"{max([*train, *rollout])} but only {num_devices} are visible: use logical indices below {num_devices} "
            "(positions in CUDA_VISIBLE_DEVICES), or make more devices visible"
        )
    return ClusterLayout(
        train_devices=tuple(train),
        rollout_devices=tuple(rollout),
        train_tp=train_tp,
        train_dp_replicate=cluster.train_dp_replicate,
        train_ep=train_ep,
        train_cp=train_cp,
        rollout_tp=rollout_tp,
        cuda=cuda,
        device_ids=device_ids,
        allocation_mode=mode if mode and "+" in mode else None,
    )


def scheduler_for(cluster: Any, layout: ClusterLayout, *, log_dir: str) -> Any:
    """The ``Scheduler`` that ``cluster.scheduler`` names (local, ray, slurm) with
    ``cluster.scheduler_options``; worker logs and job files go to ``log_dir`` unless the options
    name one. One-line errors before any worker starts: Ray not installed or its address silent,
    SLURM tools or controller missing, and overlapping device lists outside ``local`` (Ray and
    SLURM give every worker GPUs of its own, so one GPU cannot hold a training and a rollout rank)."""
    options = {"log_dir": log_dir, **dict(cluster.scheduler_options or {})}
    cfg = scheduler_config(cluster.scheduler, options)
    if cfg.type != "local" and layout.overlapping:
        disjoint = (
            "a '+' between rollout and training in cluster.allocation_mode"
            if layout.allocation_mode
            else "disjoint cluster.train_devices and cluster.rollout_devices"
        )
        raise LayoutError(
            f"cluster.scheduler={cfg.type} gives each worker GPUs of its own, but train and rollout share devices "
            f"{list(layout.overlapping)} ({layout._places()}): use {disjoint}, or cluster.scheduler=local"
        )
    return scheduler_from_config(cfg)


# ---------------------------------------------------------------------- memory
@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Bytes a layout needs on each logical device, by component."""

    per_device: dict[int, dict[str, int]] = field(default_factory=dict)

    def total(self, device: int) -> int:
        return sum(self.per_device.get(device, {}).values())


_DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


def _param_count(model_config: Any) -> int:
    h, i, L = model_config.hidden_size, model_config.intermediate_size, model_config.num_hidden_layers
    heads = model_config.num_attention_heads
    kv = getattr(model_config, "num_key_value_heads", None) or heads
    hd = getattr(model_config, "head_dim", None) or h // heads
    v = model_config.vocab_size
    attn = h * heads * hd * 2 + h * kv * hd * 2
    embed = v * h * (1 if getattr(model_config, "tie_word_embeddings", False) else 2)
    experts = getattr(model_config, "num_experts", 0)
    if not experts:
        return L * (attn + 3 * h * i + 2 * h) + embed + h
    # an expert layer holds every expert's SwiGLU, the router and any shared experts; the others keep a dense MLP
    sparse = sum(model_config.is_moe_layer(k) for k in range(L))
    experts += model_config.n_shared_experts  # one expert's width each, without a router row (GLM-4.5)
    expert_mlp = experts * 3 * h * model_config.moe_intermediate_size + h * model_config.num_experts
    shared = model_config.shared_expert_intermediate_size  # Qwen2-MoE's, and its gate
    expert_mlp += 3 * h * shared + h if shared else 0
    return L * (attn + 2 * h) + sparse * expert_mlp + (L - sparse) * 3 * h * i + embed + h


def estimate_memory(
    layout: ClusterLayout,
    model_config: Any,
    *,
    train_dtype: str = "float32",
    rollout_dtype: str = "bfloat16",
    kv_tokens: int,
    context_bytes: int = CONTEXT_BYTES,
) -> MemoryEstimate:
    """Per-device bytes: training model + gradients + AdamW state (two fp32 moments, plus an fp32
    master copy when training in 16-bit), sharded over the training mesh; rollout weights split
    over rollout TP; the KV cache for ``kv_tokens`` tokens (split over TP by KV heads); one
    CUDA context per process on the device."""
    p = _param_count(model_config)
    tb = _DTYPE_BYTES[train_dtype]
    rb = _DTYPE_BYTES[rollout_dtype]
    train_per_param = tb + tb + 8 + (4 if tb < 4 else 0)
    train_bytes = math.ceil(p * train_per_param / layout.n_train)  # FSDP x TP shard everything
    heads = model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    hd = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    kv_per_token = 2 * model_config.num_hidden_layers * kv_heads * hd * rb
    rollout_weights = math.ceil(p * rb / layout.rollout_tp)
    kv_bytes = math.ceil(kv_tokens * kv_per_token / layout.rollout_tp)
    out: dict[int, dict[str, int]] = {}
    for d in layout.train_devices:
        out.setdefault(d, {}).update({"train_model_grad_optim": train_bytes, "train_context": context_bytes})
    for d in layout.rollout_devices:
        out.setdefault(d, {}).update(
            {"rollout_weights": rollout_weights, "rollout_kv": kv_bytes, "rollout_context": context_bytes}
        )
    return MemoryEstimate(per_device=out)


def validate_memory(layout: ClusterLayout, estimate: MemoryEstimate, capacity: dict[int, int] | int) -> None:
    """LayoutError (one line) for the first device whose estimate exceeds its capacity."""
    for d in sorted(estimate.per_device):
        cap = capacity if isinstance(capacity, int) else capacity[d]
        need = estimate.total(d)
        if need > cap:
            parts = ", ".join(f"{k} {v / GIB:.2f}" for k, v in estimate.per_device[d].items())
            shared = " (shared by a training and a rollout worker)" if d in layout.overlapping else ""
            raise LayoutError(
                f"device {d}{shared} needs ~{need / GIB:.2f} GiB ({parts} GiB) but has {cap / GIB:.2f} GiB "
                f"({layout._places()}): give train and rollout devices of their own or more training devices "
                "there, or lower rollout.kv_blocks (or rollout.max_concurrent)"
            )


HOST_MEMORY_SHARE = 0.9
"""Of the host's available memory, what the training processes' whole-model loads may take together."""


def validate_host_memory(layout: ClusterLayout, model_config: Any, train_dtype: str, available: int | None) -> None:
    """LayoutError (one line) when the training processes of one host cannot all load the model: each
    reads the whole checkpoint into host memory in ``train_dtype`` before sharding it, so a 7B model
    over 8 local ranks needs 224 GiB at once (the kernel's OOM killer otherwise ends a worker without a
    message). ``available``: the host's ``MemAvailable`` (None: not checked)."""
    if available is None:
        return
    per_rank = _param_count(model_config) * _DTYPE_BYTES[train_dtype]
    need = layout.n_train * per_rank
    if need > HOST_MEMORY_SHARE * available:
        raise LayoutError(
            f"host memory: each of the {layout.n_train} training processes loads the whole model into host memory "
            f"before sharding it (~{per_rank / GIB:.2f} GiB in {train_dtype}): ~{need / GIB:.2f} GiB at once, "
            f"against {available / GIB:.2f} GiB available ({layout._places()}): fewer training devices on this "
            "host, model.dtype=bfloat16, or a host with more memory"
        )


# ---------------------------------------------------------------------- groups
@dataclass
class Groups:
    """This rank's handles (None where it is not a member)."""

    train_group: Any = None
    train_mesh: Any = None
    rollout_tp_group: Any = None
    rollout_dp_group: Any = None
    rollout_group: Any = None
    rollout_command_group: Any = None
    """Gloo group of this rank's rollout TP replica (TP > 1 only): the leader's requests reach the
    other TP ranks over it (``TensorParallelRolloutEngine.follow``)."""


def _group_options(backend: str, timeout: datetime.timedelta) -> Any:
    """Process-group options carrying ``timeout``: DeviceMesh passes a dimension's options' ``_timeout``
    to the ``new_group`` it makes (else that group gets the backend's default)."""
    options = dist.ProcessGroupNCCL.Options() if backend == "nccl" else dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    return options


COMMAND_TIMEOUT = datetime.timedelta(days=365)
"""A TP follower waits on the command group while its replica is idle: for as long as the run."""


def build_groups(layout: ClusterLayout, device_type: str, timeout: datetime.timedelta) -> Groups:
    """Create every process group of the layout; call on EVERY rank of the world, same order.
    ``timeout``: of every collective in them (``cluster.collective_timeout_s``; a subgroup does not
    inherit the world's, torch gives it its backend's default)."""
    rank = dist.get_rank()
    # NCCL subgroups in a gloo world on GPU (members of each group sit on distinct GPUs)
    backend = "nccl" if device_type == "cuda" else "gloo"
    g = Groups()
    train_group = dist.new_group(list(layout.train_ranks), backend=backend, timeout=timeout)
    # DeviceMesh creates its per-dimension groups with new_group: every rank must take part.
    mesh_ranks = torch.tensor(layout.train_mesh_ranks())
    try:
        mesh = DeviceMesh(
            device_type,
            mesh_ranks,
            mesh_dim_names=MESH_DIMS,
            backend_override=tuple((backend, _group_options(backend, timeout)) for _ in MESH_DIMS),
        )
    except TypeError:
        raise LayoutError(
            f"torch {torch.__version__}: DeviceMesh has no backend_override, which the "
            "partitioned topology needs (its groups' backend and timeout); upgrade torch"
        ) from None
    if rank in layout.train_ranks:
        g.train_group, g.train_mesh = train_group, mesh
    rollout_group = dist.new_group(list(layout.rollout_ranks), backend=backend, timeout=timeout)
    for ranks in layout.rollout_tp_groups():
        pg = dist.new_group(list(ranks), backend=backend, timeout=timeout)
        if rank in ranks:
            g.rollout_tp_group = pg
    for ranks in layout.rollout_dp_groups():
        pg = dist.new_group(list(ranks), backend=backend, timeout=timeout)
        if rank in ranks:
            g.rollout_dp_group = pg
    if layout.rollout_tp > 1:
        for ranks in layout.rollout_tp_groups():
            pg = dist.new_group(list(ranks), backend="gloo", timeout=COMMAND_TIMEOUT)
            if rank in ranks:
                g.rollout_command_group = pg
    if rank in layout.rollout_ranks:
        g.rollout_group = rollout_group
    return g
