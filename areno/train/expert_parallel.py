"""Expert parallelism for training: each rank of an expert-parallel (EP) group holds E/ep of every
sparse layer's experts, and tokens travel to the rank holding their expert and back by all-to-all.

``shard_experts(model, ep_mesh)`` makes each ``moe.SparseMoE``'s expert tensors DTensors sharded on
dim 0 over the 1-D ``ep_mesh`` (this rank holds experts ``[rank·E/ep, (rank+1)·E/ep)``; checkpoints,
gradient norms and ``full_tensor()`` exports see the whole tensor) and gives the block an
``AllToAllDispatch``; the
decoder itself stays free of torch.distributed (the block calls what it was given, as the TP
decoder calls its ``tp_reduce``). Every rank routes its own tokens (the router and all dense
weights are replicated, i.e. data parallel); the dispatch sends each (token, expert) pair's
activations to the expert's rank, the experts run grouped there, and the outputs come back to be
weighted and summed. Both all-to-alls are differentiable, so an expert's gradient gathers the
contributions of every rank's tokens: expert gradients need no further reduction inside the EP
group, dense gradients the usual data-parallel one. ``grad_scale`` multiplies the experts' weight
gradients (the FSDP backend scales the loss by the data-parallel size and lets FSDP average the
dense gradients; the experts, outside FSDP, take the average's factor here).

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

    def __init__(self, group: dist.ProcessGroup, num_experts: int, grad_scale: float = 1.0) -> None:
        self.group = group
        self.grad_scale = grad_scale
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
        y_N = y_N * weights_TK.reshape(-1)[order_N, None]
        return x_TD.new_zeros(T, D).index_add_(0, token_N, y_N)

    def _local(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """This rank's experts in the activations' dtype (FSDP's mixed precision does not reach
        them), their gradient scaled by ``grad_scale``."""
        local = local_tensor(weight)
        if self.grad_scale != 1.0:
            local = _ScaleGrad.apply(local, self.grad_scale)
        return local.to(dtype)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times ``scale`` backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


@torch.no_grad()
def shard_experts(model: nn.Module, ep_mesh: DeviceMesh, *, grad_scale: float = 1.0) -> list[nn.Parameter]:
    """Shard every sparse block's experts over the 1-D ``ep_mesh`` (DTensors, ``Shard(0)``) and
    dispatch its tokens over it; returns the expert parameters (FSDP must leave them alone). Call it
    before wrapping the model (FSDP2, compile) and before building the optimizer."""
    from torch.distributed.tensor import Shard, distribute_tensor  # slow to import: only an expert-parallel run

    params: list[nn.Parameter] = []
    for block in moe.sparse_blocks(model):
        block.dispatch = AllToAllDispatch(ep_mesh.get_group(), block.num_experts, grad_scale)
        experts = block.experts
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(experts, name)
            sharded = nn.Parameter(
                distribute_tensor(full.detach(), ep_mesh, [Shard(0)]), requires_grad=full.requires_grad
            )
            setattr(experts, name, sharded)
            params.append(sharded)
    return params
