"""Context parallelism for training (Ulysses): the ranks of a context-parallel (CP) group share one
packed micro-batch, each running the decoder layers on a contiguous 1/cp of its token stream.

``apply_context_parallel(model, group)`` wraps the ``Decoder``'s ``forward`` in place (names and
parameters unchanged, as activation checkpointing does). The wrapped forward takes the *full*
packed stream (ids, positions, the full stream's ``cu_seqlens``), pads it to a multiple of cp with
one padding sequence, and runs the embedding, the layers and the final norm on this rank's chunk;
attention is ``UlyssesAttention``: an all-to-all turns q/k/v [T/cp, H, Dh] into [T, H/cp, Dh],
the wrapped ``PackedCausalAttention`` (any kernel, varlen included) runs on whole sequences for a
subset of heads, and a second all-to-all turns the output back. The final hidden states are
all-gathered into [T, D], so the LM head, log-probs and loss (the specializations' code, unchanged)
run on the whole micro-batch, identically on every rank of the group.

Gradients: every CP rank computes the same loss from the same gathered states, so the gather's
backward takes this rank's slice of the (identical) incoming gradient times cp — the reduce-scatter
sum without the communication. With the loss scaled by the data-parallel size and FSDP averaging
over all dp·cp ranks, the layers' gradients sum their chunks' contributions and the head's
(computed cp times) counts once. Expects: heads % cp == 0; KV heads are split too when
kv_heads % cp == 0, else repeated to the query heads first (GQA with fewer KV heads than cp).

Legend: T = tokens of the padded stream, C = T / cp, H = heads, Dh = head dim, D = hidden size.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from areno.errors import ConfigError
from areno.models.attention import PackedCausalAttention
from areno.models.decoder import Decoder
from areno.models.moe import sparse_blocks
from areno.models.vision import vision_towers


def padded_tokens(num_tokens: int, cp_size: int) -> int:
    """``num_tokens`` rounded up to a multiple of ``cp_size`` (every rank holds an equal chunk)."""
    return -(-num_tokens // cp_size) * cp_size


def check_context_parallel(model_config, cp_size: int, *, tp_size: int = 1, ep_size: int = 1) -> None:
    """One-line ``ConfigError`` for a model or layout context parallelism does not cover."""
    if cp_size <= 1:
        return
    heads = model_config.num_attention_heads
    if heads % cp_size:
        raise ConfigError(
            f"cp_size={cp_size} must divide the model's attention heads ({heads}); pick a divisor of {heads}"
        )
    if tp_size > 1 or ep_size > 1:
        raise ConfigError(
            f"cp_size={cp_size} is supported with tp_size=1 and ep_size=1 (got tp {tp_size}, ep {ep_size})"
        )
    if getattr(model_config, "attention_sinks", False):
        raise ConfigError(
            f"cp_size={cp_size}: context parallelism of attention with sinks ({model_config.architecture}) is not "
            "supported; use cp_size=1"
        )


class UlyssesAttention:
    """An ``AttentionBackend`` over this rank's chunk [C, H, Dh] of q/k/v that attends over the full
    stream: heads are exchanged for tokens by all-to-all around ``inner`` (prepared for T tokens)."""

    def __init__(self, inner: PackedCausalAttention, group: dist.ProcessGroup, cp_size: int) -> None:
        self.inner = inner
        self.group = group
        self.cp = cp_size

    def _to_heads(self, x_CHD: torch.Tensor) -> torch.Tensor:
        """[C, H, Dh] of every rank -> [T, H/cp, Dh] (this rank's heads, tokens in stream order)."""
        C, H, Dh = x_CHD.shape
        send = x_CHD.reshape(C, self.cp, H // self.cp, Dh).transpose(0, 1).contiguous()
        recv = funcol.all_to_all_single_autograd(send, None, None, self.group)  # [cp (source), C, H/cp, Dh]
        return recv.reshape(self.cp * C, H // self.cp, Dh)

    def _to_tokens(self, x_THD: torch.Tensor) -> torch.Tensor:
        """[T, H/cp, Dh] -> [C, H, Dh] (the inverse of ``_to_heads``)."""
        T, h, Dh = x_THD.shape
        send = x_THD.reshape(self.cp, T // self.cp, h, Dh).contiguous()
        recv = funcol.all_to_all_single_autograd(send, None, None, self.group)  # [cp (head group), C, h, Dh]
        return recv.transpose(0, 1).reshape(T // self.cp, self.cp * h, Dh)

    def __call__(
        self,
        layer_idx: int,
        q_CHD: torch.Tensor,
        k_CHD: torch.Tensor,
        v_CHD: torch.Tensor,
        softcap: float | None = None,
        windowed: bool | None = None,
    ) -> torch.Tensor:
        """``softcap``: Gemma 2's score cap, which acts on each score alone, so each rank's heads take it as they are;
        ``windowed``: as ``PackedCausalAttention``'s."""
        if k_CHD.shape[1] % self.cp:  # fewer (or indivisible) KV heads: give every query head its own
            groups = q_CHD.shape[1] // k_CHD.shape[1]
            k_CHD, v_CHD = k_CHD.repeat_interleave(groups, dim=1), v_CHD.repeat_interleave(groups, dim=1)
        q_THD, k_THD, v_THD = self._to_heads(q_CHD), self._to_heads(k_CHD), self._to_heads(v_CHD)
        out_THD = self.inner(layer_idx, q_THD, k_THD, v_THD, softcap=softcap, windowed=windowed)
        return self._to_tokens(out_THD)


class _GatherTokens(torch.autograd.Function):
    """All-gather of every rank's [C, D] chunk into [T, D]; backward: this rank's slice of the
    gradient times cp (every rank's gradient is the same, so this equals a reduce-scatter's sum)."""

    @staticmethod
    def forward(ctx, x_CD: torch.Tensor, group: dist.ProcessGroup, cp: int, rank: int) -> torch.Tensor:
        ctx.cp, ctx.rank, ctx.C = cp, rank, x_CD.shape[0]
        parts = [torch.empty_like(x_CD) for _ in range(cp)]
        dist.all_gather(parts, x_CD.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad_TD: torch.Tensor):
        C = ctx.C
        return grad_TD[ctx.rank * C : (ctx.rank + 1) * C] * ctx.cp, None, None, None


def _cp_forward(forward, decoder: Decoder, group: dist.ProcessGroup, cp: int, rank: int):
    @functools.wraps(forward)
    def run(input_ids_T: torch.Tensor, position_ids_T: torch.Tensor, attn=None, **kwargs) -> torch.Tensor:
        T = input_ids_T.shape[0]
        if attn is None:
            attn = PackedCausalAttention.for_model(torch.tensor([0, T]), decoder.config)
        if not isinstance(attn, PackedCausalAttention):
            raise TypeError(f"context parallelism needs a PackedCausalAttention, got {type(attn).__name__}")
        Tp = padded_tokens(T, cp)
        cu_B1 = attn.cu_seqlens_B1.cpu()
        if Tp != T:  # one padding sequence at the end: attends only to itself, dropped after the gather
            pad = Tp - T
            input_ids_T = F.pad(input_ids_T, (0, pad))
            position_ids_T = torch.cat([position_ids_T, torch.arange(pad, device=position_ids_T.device)])
            cu_B1 = torch.cat([cu_B1, cu_B1.new_tensor([Tp])])
        full = PackedCausalAttention(
            cu_B1,
            sliding_window=attn.sliding_window,
            impl=attn.impl,
            window_layers=attn.window_layers,
            softcap=attn.softcap,
        )
        dtype = torch.get_autocast_dtype(input_ids_T.device.type) if torch.is_autocast_enabled() else None
        weight = decoder.model.embed_tokens.weight
        # Ulysses: each rank attends over its share of the query heads
        heads = decoder.config.num_attention_heads // cp
        full.prepare(
            Tp, input_ids_T.device, decoder.config.head_dim, dtype or weight.dtype, decoder.cuda_attention, heads
        )
        C = Tp // cp
        chunk = slice(rank * C, (rank + 1) * C)
        hidden_CD = forward(input_ids_T[chunk], position_ids_T[chunk], UlyssesAttention(full, group, cp), **kwargs)
        return _GatherTokens.apply(hidden_CD, group, cp, rank)[:T]

    return run


def cp_rank_groups(mesh_ranks: torch.Tensor, cp_size: int) -> list[list[int]]:
    """The global ranks of every CP group of a (dp_replicate, dp_shard, tp) mesh's rank tensor: runs
    of ``cp_size`` consecutive shard ranks with the same replicate and tp coordinates."""
    return mesh_ranks.transpose(1, 2).reshape(-1, cp_size).tolist()


def context_parallel_group(ranks_of_groups: list[list[int]]) -> tuple[dist.ProcessGroup, int]:
    """This rank's CP process group among ``ranks_of_groups`` (global ranks, each list one group) and
    its rank in it. Only the members create a group (``use_local_synchronization``), so ranks outside
    the training mesh (partitioned rollout workers) take no part."""
    me = dist.get_rank()
    for ranks in ranks_of_groups:
        if me in ranks:
            return dist.new_group(ranks, use_local_synchronization=True), ranks.index(me)
    raise ValueError(f"rank {me} is in no context-parallel group of {ranks_of_groups}")


def apply_context_parallel(
    model: nn.Module, group: dist.ProcessGroup, cp_size: int, *, tp_size: int = 1, ep_size: int = 1
) -> None:
    """Make every forward of ``model``'s ``Decoder`` context-parallel over ``group`` (call before
    compile and FSDP; the decoder may sit inside a wrapper such as a value head)."""
    decoders = [m for m in model.modules() if isinstance(m, Decoder)]
    if len(decoders) != 1:
        raise ConfigError(f"cp_size={cp_size} needs exactly one areno Decoder in the model, found {len(decoders)}")
    decoder = decoders[0]
    if sparse_blocks(model):
        raise ConfigError(
            f"cp_size={cp_size}: mixture-of-experts models are not supported yet; give the fsdp component of cluster.allocation_mode c1"
        )
    if vision_towers(model):
        raise ConfigError(
            f"cp_size={cp_size}: vision-language models are not supported yet; give the fsdp component of cluster.allocation_mode c1"
        )
    check_context_parallel(decoder.config, cp_size, tp_size=tp_size, ep_size=ep_size)
    decoder.forward = _cp_forward(decoder.forward, decoder, group, cp_size, dist.get_rank(group))
