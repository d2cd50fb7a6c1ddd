"""``FSDP2TrainBackend``: PyTorch FSDP2 (``fully_shard``) over a DeviceMesh.

Mesh dimensions ("dp_replicate", "dp_shard", "tp"): FSDP shards parameters, gradients and
optimizer state over dp_shard, replicates over dp_replicate (HSDP) and tensor-parallelizes over tp
(DTensor, the model's TP plan). With ``cp_size`` > 1, runs of cp consecutive dp_shard ranks form
a context-parallel group that shares each micro-batch (``areno.train.context_parallel``): FSDP
still shards over all of dp_shard, data is spread over dp_shard / cp ranks. gloo on CPU, NCCL on
GPU; the process group is created from the usual torchrun environment variables when none exists
yet.

In a world shared with other workers (the partitioned topology: training and rollout ranks in one
world), pass ``mesh`` (a 3-d DeviceMesh over the training ranks, dims ``MESH_DIMS``) and ``group``
(a process group of exactly those ranks); every collective of the backend then stays inside them.

Loss normalisation: each rank's micro-batch losses are divided by the *global* denominator, so the
true gradient is the *sum* over data-parallel ranks; FSDP averages gradients over them, so the loss
is multiplied by the DP size before backward.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from areno.errors import ConfigError
from areno.train.backend import PackedTrainBackend
from areno.train.context_parallel import context_parallel_group, cp_rank_groups
from areno.train.dtensor import is_dtensor
from areno.train.parallelize import parallelize

MESH_DIMS = ("dp_replicate", "dp_shard", "tp")


class FSDP2TrainBackend(PackedTrainBackend):
    """Data-parallel (FSDP / HSDP) and tensor-parallel training backend."""

    mesh: DeviceMesh
    _owns_process_group: bool = False
    _group: dist.ProcessGroup | None = None
    """The training ranks (None: the whole world)."""
    # set in _setup / _parallelize (read once: slicing a DeviceMesh costs host time per call)
    _shard_size: int
    _world_size: int
    _fsdp_modules: list[nn.Module]  # the FSDPModule instances, outermost last
    _grad_sync: bool = True
    """What the FSDP modules' gradient-sync / reshard-after-backward flags were last set to
    (FSDP's default: True)."""

    def __init__(self, cfg, *, mesh: DeviceMesh | None = None, group: dist.ProcessGroup | None = None) -> None:
        super().__init__(cfg)
        if (mesh is None) != (group is None):
            raise ValueError("FSDP2TrainBackend: pass both mesh= and group= (the training ranks) or neither")
        self._given_mesh = mesh
        self._group = group

    def _setup(self) -> None:
        device_type = self.cfg.resolved_device()
        if not dist.is_initialized():
            if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
                raise ValueError(
                    "FSDP2TrainBackend needs a process group or torchrun's RANK/WORLD_SIZE/"
                    "MASTER_ADDR/MASTER_PORT environment; launch with torchrun or use LocalTrainBackend"
                )
            dist.init_process_group(
                "nccl" if device_type == "cuda" else "gloo",
                timeout=datetime.timedelta(seconds=self.cfg.collective_timeout_s),
            )
            self._owns_process_group = True
        world = dist.get_world_size(self._group)
        shape = self.cfg.mesh_shape(world)
        if device_type == "cuda" and self._given_mesh is not None:
            self.device = torch.device("cuda", torch.cuda.current_device())  # the worker picked it
        elif device_type == "cuda":
            local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count()))
            torch.cuda.set_device(local_rank)
            self.device = torch.device("cuda", local_rank)
        else:
            self.device = torch.device("cpu")
        if self._given_mesh is not None:
            if tuple(self._given_mesh.mesh.shape) != tuple(shape) or self._given_mesh.mesh_dim_names != MESH_DIMS:
                raise ValueError(
                    f"FSDP2TrainBackend: mesh {tuple(self._given_mesh.mesh.shape)} "
                    f"{self._given_mesh.mesh_dim_names} != config mesh {shape} {MESH_DIMS}"
                )
            self.mesh = self._given_mesh
        else:
            self.mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
        rep, shard = self.mesh["dp_replicate"], self.mesh["dp_shard"]
        # Context parallelism: runs of cp consecutive shard ranks share each micro-batch (one data rank).
        cp = self._cp_size = self.cfg.cp_size
        if shard.size() % cp:
            raise ConfigError(f"cp_size={cp} must divide the FSDP shard size {shard.size()}; pick a divisor of it")
        self._dp_rank = (rep.get_local_rank() * shard.size() + shard.get_local_rank()) // cp
        self._dp_size = rep.size() * shard.size() // cp
        self._tp_size = self.mesh["tp"].size()
        self._shard_size = shard.size()
        self._world_size = world
        self._cp_group = None
        if cp > 1:
            self._cp_group, _ = context_parallel_group(cp_rank_groups(self.mesh.mesh, cp))

    def _parallelize(self, model: nn.Module) -> nn.Module:
        compute = self.cfg.torch_param_dtype(self.device.type)
        model = parallelize(
            model,
            self.mesh,
            self.cfg,
            param_dtype=compute,
            reduce_dtype=self.cfg.torch_dtype(),
            cp_group=self._cp_group,
            device_type=self.device.type,
        )
        from torch.distributed.fsdp import FSDPModule  # slow to import (sympy): only once a model is sharded

        self._fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        return model

    def _reduction_buffer_bytes(self, trainable_bytes: int) -> int:
        # One FSDP group: at the end of each backward the compute-dtype gradients of every layer
        # (<= half the master bytes) and the master-dtype reduction input (the master bytes) are
        # live at once; per-layer groups hold one layer's.
        return trainable_bytes * 3 // 2 if len(self._fsdp_modules) == 1 else 0

    @property
    def _unsharded(self) -> bool:
        """No parameter sharding (one data-parallel shard: one rank, or replication only)."""
        return self._shard_size == 1

    def _before_backward(self, last: bool) -> None:
        # Unsharded, the accumulated gradient is full-size either way, so micro-batches before the
        # last accumulate locally (in the reduce dtype) and the reduction runs once per step; the
        # compute-dtype weights stay gathered until the last backward frees them (the optimizer
        # then updates the master and the next forward casts afresh). Sharded, every micro-batch
        # reduce-scatters (keeping only a shard of the gradient) and reshards.
        # The flags are set on the FSDP modules directly (not a walk over every module) and only
        # when they change: twice a step, not at every micro-batch.
        if self._unsharded and self._grad_sync != last:
            for module in self._fsdp_modules:
                module.set_requires_gradient_sync(last, recurse=False)
                module.set_reshard_after_backward(last, recurse=False)
            self._grad_sync = last

    @property
    def is_rank0(self) -> bool:
        return dist.get_rank(self._group) == 0

    def _all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._world_size == 1:
            return tensor  # the sum over one rank (and tp = 1): no device round trip
        # Over the whole world, then divided by tp and cp: the TP and CP ranks of one DP rank hold
        # equal values.
        backend_device = self.device if dist.get_backend(self._group) == "nccl" else torch.device("cpu")
        reduced = tensor.to(backend_device)
        dist.all_reduce(reduced, group=self._group)
        return (reduced / (self._tp_size * self._cp_size)).to(tensor.device)

    def _gather_dp(self, obj: Any) -> list[Any]:
        gathered: list[Any] = [None] * dist.get_world_size(self._group)
        dist.all_gather_object(gathered, (self._dp_rank, obj), group=self._group)
        by_rank = dict(gathered)  # TP and CP ranks of one DP rank sent identical outputs
        return [by_rank[r] for r in range(self._dp_size)]

    def _full(self, tensor: torch.Tensor) -> torch.Tensor:
        if not is_dtensor(tensor):
            return tensor
        if tensor.device_mesh.size() == 1:
            # one rank holds it all (a mesh of one never pads a shard): its local tensor is the full
            # value, read without full_tensor's redistribute (host dispatch of a collective of one)
            return tensor.to_local()
        return tensor.full_tensor()

    def _loss_scale(self) -> float:
        return float(self._dp_size)

    def _after_forward_only(self) -> None:
        for module in self._fsdp_modules:
            module.reshard()

    def _barrier(self) -> None:
        dist.barrier(group=self._group)

    def sleep(self) -> int:
        self._after_forward_only()  # only sharded storage may be live when it is moved away
        return super().sleep()

    def shutdown(self) -> None:
        super().shutdown()
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_process_group = False
