"""Expert parallelism for training: each rank of an expert-parallel (EP) group holds E/ep of every
sparse layer's experts, and tokens travel to the rank holding their expert and back by all-to-all.

``shard_experts(model, ep_mesh)`` makes each ``moe.SparseMoE``'s expert tensors DTensors sharded on
dim 0 over the mesh's ``ep`` dimension (this rank holds experts ``[r·E/ep, (r+1)·E/ep)``, r its EP
rank; checkpoints, gradient norms and ``full_tensor()`` exports see the whole tensor) and gives the
block an ``AllToAllDispatch``; the decoder itself stays free of torch.distributed (the block calls
what it was given, as the TP decoder calls its ``tp_reduce``). Every rank routes its own tokens
(the router and all dense weights are data parallel); the dispatch sends each (token, expert)
pair's activations to the expert's rank in the EP group, the experts run grouped there, and the
outputs come back to be weighted and summed. Both all-to-alls are differentiable, so an expert's
gradient gathers the contributions of every token of its EP group.

EP smaller than the data-parallel size d (``expert_mesh``: a 2-D mesh ("ep_replicate", "ep") of
d/ep x ep ranks; EP groups are runs of ep consecutive ranks, replicas the ranks at the same place in
each run): the experts are *replicated* over ep_replicate (placements ``[Replicate(), Shard(0)]``)
and their gradients summed over the replicas by an all-reduce in backward. Replicated rather than
FSDP-sharded because the dispatch reads the expert tensors directly, outside any module forward
that FSDP's gather hooks would wrap, and the experts are already split ep ways; an all-reduce moves
the bytes of FSDP's reduce-scatter plus all-gather. ``grad_scale`` multiplies the experts' weight
gradients: the FSDP backend scales the loss by d and lets FSDP average the dense gradients over d
ranks, so the experts, whose gradient is a sum over all d ranks' tokens (ep by the dispatch, d/ep
by the all-reduce), take 1/d.

Legend: T = tokens, D = hidden size, K = top-k, N = T·K (token, expert) pairs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from areno.models import moe
from areno.train.dtensor import local_tensor


class AllToAllDispatch:
    """What a ``SparseMoE`` calls instead of its local experts under expert parallelism."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        num_experts: int,
        grad_scale: float = 1.0,
        replica_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.group = group
        self.grad_scale = grad_scale
        self.replica_group = replica_group
        """The ranks holding copies of this rank's experts (None: no copies): gradients are summed over it."""
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        if num_experts % self.size:
            raise ValueError(f"expert parallel size {self.size} does not divide num_experts={num_experts}")
        self.per_rank = num_experts // self.size

    def __call__(
        self,
        x_TD: torch.Tensor,
        experts_TK: torch.Tensor,
        weights_TK: torch.Tensor,
        gate_up_local: torch.Tensor,
        down_local: torch.Tensor,
    ) -> torch.Tensor:
        T, D = x_TD.shape
        gate_up_local, down_local = (self._local(w, x_TD.dtype) for w in (gate_up_local, down_local))
        flat_N = experts_TK.reshape(-1)
        dest_N = flat_N // self.per_rank
        order_N = torch.argsort(dest_N, stable=True)  # pairs grouped by the rank holding their expert
        token_N = order_N // experts_TK.shape[1]
        send = torch.bincount(dest_N, minlength=self.size)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        send_sizes, recv_sizes = send.tolist(), recv.tolist()
        experts_recv = flat_N.new_empty(sum(recv_sizes))
        dist.all_to_all_single(experts_recv, flat_N[order_N], recv_sizes, send_sizes, group=self.group)
        x_recv = funcol.all_to_all_single_autograd(x_TD[token_N], recv_sizes, send_sizes, self.group)
        ones = x_recv.new_ones(x_recv.shape[0], 1)
        first = self.rank * self.per_rank
        y_recv = moe.grouped_experts(x_recv, experts_recv[:, None], ones, gate_up_local, down_local, first_expert=first)
        y_N = funcol.all_to_all_single_autograd(y_recv, send_sizes, recv_sizes, self.group)
        y_N = (y_N * weights_TK.reshape(-1)[order_N, None]).to(x_TD.dtype)  # float32 weights: rounded once
        return x_TD.new_zeros(T, D).index_add_(0, token_N, y_N)

    def _local(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """This rank's experts in the activations' dtype (FSDP's mixed precision does not reach
        them), their gradient scaled by ``grad_scale`` and summed over the replicas."""
        local = local_tensor(weight)
        if self.grad_scale != 1.0 or self.replica_group is not None:
            local = _ScaleGrad.apply(local, self.grad_scale, self.replica_group)
        return local.to(dtype)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward, the gradient times ``scale``, summed over ``group`` when given
    (in the master dtype, before the cast to the activations'; once per micro-batch, as FSDP
    reduce-scatters the dense gradients)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.scale, ctx.group = scale, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad * ctx.scale
        if ctx.group is not None:
            dist.all_reduce(grad, group=ctx.group)
        return grad, None, None


def expert_rank_groups(ranks: list[int], ep_size: int) -> torch.Tensor:
    """The ("ep_replicate", "ep") layout of data-parallel ``ranks``: row i is the i-th EP group
    (``ep_size`` consecutive ranks, which together hold every expert once), column j the replicas
    of the j-th slice of the experts."""
    if len(ranks) % ep_size:
        raise ValueError(f"expert parallel size {ep_size} does not divide the {len(ranks)} data-parallel ranks")
    return torch.tensor(ranks, dtype=torch.int).reshape(-1, ep_size)


def expert_mesh(ranks: list[int], ep_size: int, device_type: str) -> DeviceMesh:
    """A 2-D DeviceMesh ("ep_replicate", "ep") over ``ranks`` (``expert_rank_groups``). Only the
    members create each group (``use_local_synchronization``), so ranks outside ``ranks``
    (partitioned rollout workers) take no part."""
    layout = expert_rank_groups(ranks, ep_size)
    me = dist.get_rank()
    row, col = (layout == me).nonzero()[0].tolist()
    ep_group = dist.new_group(layout[row].tolist(), use_local_synchronization=True)
    replica_group = dist.new_group(layout[:, col].tolist(), use_local_synchronization=True)
    return DeviceMesh.from_group([replica_group, ep_group], device_type, layout, mesh_dim_names=("ep_replicate", "ep"))


@torch.no_grad()
def shard_experts(model: nn.Module, ep_mesh: DeviceMesh, *, grad_scale: float = 1.0) -> list[nn.Parameter]:
    """Shard every sparse block's experts over ``ep_mesh`` (DTensors, ``Shard(0)``) and dispatch its
    tokens over it; returns the expert parameters (FSDP must leave them alone). ``ep_mesh``: 1-D (the
    EP group) or 2-D ("ep_replicate", "ep") from ``expert_mesh`` (experts replicated over the first
    dimension, gradients summed over it). Call it before wrapping the model (FSDP2, compile) and
    before building the optimizer."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor  # slow to import: only an EP run

    if ep_mesh.ndim == 2:
        ep_group, replica_group = ep_mesh.get_group("ep"), ep_mesh.get_group("ep_replicate")
        placements = [Replicate(), Shard(0)]
    else:
        ep_group, replica_group, placements = ep_mesh.get_group(), None, [Shard(0)]
    params: list[nn.Parameter] = []
    blocks = moe.sparse_blocks(model)
    if any(b.experts.biases is not None or b.experts.glu.limit is not None for b in blocks):
        raise ValueError(
            "expert parallelism of experts with biases and a clamped SwiGLU (gpt-oss) is not supported: "
            "use an allocation_mode without expert parallelism (ep_size=1)"
        )
    for block in blocks:
        block.dispatch = AllToAllDispatch(ep_group, block.num_experts, grad_scale, replica_group)
        experts = block.experts
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(experts, name)
            sharded = nn.Parameter(
                distribute_tensor(full.detach(), ep_mesh, placements), requires_grad=full.requires_grad
            )
            setattr(experts, name, sharded)
            params.append(sharded)
    return params
