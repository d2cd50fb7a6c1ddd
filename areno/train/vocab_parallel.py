"""Log-probs and entropy from a vocabulary-sharded LM head (tensor parallelism) without any rank
ever holding full-vocabulary logits.

Under TP the untied ``lm_head.weight`` is a DTensor sharded on dim 0 over the TP ranks: rank r
holds rows ``[r Vs, (r+1) Vs)`` with ``Vs = ceil(V / tp)`` (the last shard shorter when tp does not
divide V). ``areno.models.logprobs.logprobs_from_hidden`` routes a DTensor weight here
(``register_sharded_weight`` below). Per chunk of C tokens each rank computes its logit slice
``z`` [C, Vs] in fp32 (temperature applied) and the TP group combines:

    m   = all_reduce_max(max_v z)                                 (for a stable exp)
    a   = all_reduce_sum(sum_v exp(z - m))
    b   = all_reduce_sum(sum_v exp(z - m) * (z - m))
    z_t = all_reduce_sum(z[target] if the target lies in this shard else 0)
    lse = m + log a,   logprob = z_t - lse,   entropy = log a - b / a

(the shifted entropy has no cancellation against a large lse when it is small). a, b and z_t go
in one all-reduce: two collectives per chunk. Backward recomputes the slice and
uses ``dL/dz_j = g [j = target] - p_j (g + g_H (log p_j + H))`` on the shard, so the weight
gradient of this rank's rows is exact locally and the hidden-state gradient is the sum over ranks
of ``dz @ W_shard`` (one all-reduce per micro-batch). The hidden states are replicated over the TP
ranks (no sequence parallelism), as ``parallelize.apply_tp`` lays the model out. The model's map of its
logits (``eager_ops.LogitMap``) acts on each logit on its own: a divisor alone (Granite's ``logits_scaling``)
is folded into the temperature; a soft-capped head (Gemma 2's ``final_logit_softcapping``) caps each logit of
the slice before the temperature, and backward multiplies ``dL/dz`` by the map's derivative ``(1 - (c /
cap)^2) / divisor`` from the recomputed capped slice.

Legend: T = packed tokens, D = hidden size, V = vocabulary, C = tokens of a chunk, Vs = ceil(V / tp).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from areno.models.eager_ops import LogitMap
from areno.models.logprobs import _ChunkedLogprobs, fp32_logits_enabled, fp32_product, register_sharded_weight
from areno.train.dtensor import is_dtensor


def _slice_logits(
    h_CD: torch.Tensor, w_VsD: torch.Tensor, temperature: float, logit_map: LogitMap | None = None
) -> torch.Tensor:
    if fp32_logits_enabled():  # model.fp32_logits: the shard's product in the hidden states' dtype, fp32 out
        z_CVs = fp32_product(h_CD, w_VsD.to(h_CD.dtype))
    else:
        z_CVs = (h_CD @ w_VsD.t()).float()
    if logit_map is not None:
        z_CVs = logit_map(z_CVs)
    return z_CVs / temperature if temperature != 1.0 else z_CVs


class _VocabParallelLogprobs(torch.autograd.Function):
    """(hidden_TD, shard_VsD, targets_T) -> (logprobs_T, entropy_T) over a vocab-sharded head."""

    @staticmethod
    def forward(ctx, hidden_TD, w_VsD, targets_T, vocab_start, group, temperature, chunk_size, with_entropy, logit_map):
        if logit_map is not None:  # a divisor alone becomes a temperature factor; what is left caps
            temperature, logit_map = logit_map.temperature_form(temperature)
        T, Vs = hidden_TD.shape[0], w_VsD.shape[0]
        local_T = targets_T - vocab_start
        in_shard_T = (local_T >= 0) & (local_T < Vs)
        local_T = torch.where(in_shard_T, local_T, 0)
        logprobs_T = hidden_TD.new_empty(T, dtype=torch.float32)
        lse_T = hidden_TD.new_empty(T, dtype=torch.float32)
        entropy_T = hidden_TD.new_empty(T, dtype=torch.float32)
        for s in range(0, T, chunk_size):
            e = min(s + chunk_size, T)
            z_CVs = _slice_logits(hidden_TD[s:e], w_VsD, temperature, logit_map)
            m_C = z_CVs.amax(dim=-1)
            dist.all_reduce(m_C, op=dist.ReduceOp.MAX, group=group)
            z_t_C = z_CVs.gather(-1, local_T[s:e, None])[:, 0] * in_shard_T[s:e]
            shifted_CVs = z_CVs.sub_(m_C[:, None])  # z is not needed unshifted any more
            exp_CVs = shifted_CVs.exp()
            sums_3C = torch.stack([exp_CVs.sum(-1), exp_CVs.mul_(shifted_CVs).sum(-1), z_t_C])
            dist.all_reduce(sums_3C, group=group)
            a_C, b_C, z_t_C = sums_3C.unbind(0)
            lse_C = m_C + a_C.log()
            lse_T[s:e] = lse_C
            logprobs_T[s:e] = z_t_C - lse_C
            entropy_T[s:e] = a_C.log() - b_C / a_C
        ctx.save_for_backward(hidden_TD, w_VsD, local_T, in_shard_T, lse_T, entropy_T)
        ctx.group, ctx.temperature, ctx.chunk_size, ctx.with_entropy = group, temperature, chunk_size, with_entropy
        ctx.logit_map = logit_map
        if not with_entropy:
            entropy_T = entropy_T[:0]
        return logprobs_T, entropy_T

    @staticmethod
    def backward(ctx, grad_logprobs_T, grad_entropy_T):
        hidden_TD, w_VsD, local_T, in_shard_T, lse_T, entropy_T = ctx.saved_tensors
        tau, chunk_size = ctx.temperature, ctx.chunk_size
        use_entropy = ctx.with_entropy and grad_entropy_T is not None
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        T = hidden_TD.shape[0]
        grad_h_TD = hidden_TD.new_zeros(hidden_TD.shape, dtype=torch.float32) if need_h else None
        grad_w_VsD = torch.zeros_like(w_VsD, dtype=torch.float32) if need_w else None
        for s in range(0, T, chunk_size):
            e = min(s + chunk_size, T)
            z_CVs = _slice_logits(hidden_TD[s:e], w_VsD, tau, ctx.logit_map)
            # the map's derivative at c = tau z, the capped logits
            dcap_CVs = None if ctx.logit_map is None else ctx.logit_map.derivative(z_CVs * tau)
            logp_CVs = z_CVs.sub_(lse_T[s:e, None])
            p_CVs = logp_CVs.exp()
            g_C = grad_logprobs_T[s:e] if grad_logprobs_T is not None else lse_T.new_zeros(e - s)
            if use_entropy:
                coef_CVs = logp_CVs.add_(entropy_T[s:e, None]).mul_(grad_entropy_T[s:e, None]).add_(g_C[:, None])
                grad_z_CVs = p_CVs.mul_(coef_CVs).neg_()
            else:
                grad_z_CVs = p_CVs.mul_(g_C[:, None]).neg_()
            grad_z_CVs.scatter_add_(-1, local_T[s:e, None], (g_C * in_shard_T[s:e])[:, None])
            if tau != 1.0:
                grad_z_CVs /= tau
            if dcap_CVs is not None:
                grad_z_CVs.mul_(dcap_CVs)
            grad_z_CVs = grad_z_CVs.to(hidden_TD.dtype)
            if need_h:
                grad_h_TD[s:e] = (grad_z_CVs @ w_VsD).float()
            if need_w:
                grad_w_VsD += (grad_z_CVs.t() @ hidden_TD[s:e]).float()
        if need_h:
            dist.all_reduce(grad_h_TD, group=ctx.group)  # each rank saw only its vocabulary rows
            grad_h_TD = grad_h_TD.to(hidden_TD.dtype)
        if need_w:
            grad_w_VsD = grad_w_VsD.to(w_VsD.dtype)
        return grad_h_TD, grad_w_VsD, None, None, None, None, None, None, None


def dtensor_logprobs(
    hidden_TD: torch.Tensor,
    weight_VD: torch.Tensor,
    targets_T: torch.Tensor,
    temperature: float,
    chunk_size: int,
    with_entropy: bool,
    logit_map: LogitMap | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``logprobs_from_hidden`` for a DTensor output projection: vocab-parallel when it is sharded
    on dim 0 over one mesh dimension (replicated over any others), else on the local full copy."""
    if is_dtensor(hidden_TD):
        hidden_TD = hidden_TD.full_tensor()
    w_local, vocab_start, group = _vocab_shard(weight_VD)
    if group is None:
        lp, ent = _ChunkedLogprobs.apply(
            hidden_TD, w_local, targets_T, temperature, chunk_size, with_entropy, logit_map
        )
        return lp, (ent if with_entropy else None)
    lp, ent = _VocabParallelLogprobs.apply(
        hidden_TD, w_local, targets_T, vocab_start, group, temperature, chunk_size, with_entropy, logit_map
    )
    return lp, (ent if with_entropy else None)


@torch.no_grad()
def dtensor_argmax(hidden_TD: torch.Tensor, weight_VD: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """``argmax_from_hidden`` for a DTensor output projection: each rank's best id in its shard,
    then the largest value over ranks (all-reduce max) and, among ranks that hold it, the smallest
    id (all-reduce min) — ``torch.argmax``'s first-maximum rule."""
    if is_dtensor(hidden_TD):
        hidden_TD = hidden_TD.full_tensor()
    w_local, vocab_start, group = _vocab_shard(weight_VD)
    T, vocab = hidden_TD.shape[0], weight_VD.shape[0]
    out_T = torch.empty(T, dtype=torch.long, device=hidden_TD.device)
    for s in range(0, T, chunk_size):
        e = min(s + chunk_size, T)
        best, idx_C = (hidden_TD[s:e] @ w_local.t()).max(-1)
        best_C, idx_C = best.float(), idx_C + vocab_start
        if group is None:
            out_T[s:e] = idx_C
            continue
        top_C = best_C.clone()
        dist.all_reduce(top_C, op=dist.ReduceOp.MAX, group=group)
        cand_C = torch.where(best_C == top_C, idx_C, vocab)
        dist.all_reduce(cand_C, op=dist.ReduceOp.MIN, group=group)
        out_T[s:e] = cand_C
    return out_T


def _vocab_shard(weight_VD: torch.Tensor) -> tuple[torch.Tensor, int, dist.ProcessGroup | None]:
    """(local rows, first vocabulary id of them, group of the sharded mesh dimension or None when
    the weight is replicated); ValueError for any other layout."""
    from torch.distributed.tensor import Replicate, Shard  # slow to import: only once a DTensor exists

    placements = weight_VD.placements
    shard_dims = [i for i, p in enumerate(placements) if isinstance(p, Shard)]
    if (
        any(not isinstance(p, (Shard, Replicate)) for p in placements)
        or any(placements[i].dim != 0 for i in shard_dims)
        or len(shard_dims) > 1
    ):
        raise ValueError(
            f"log-probs need the LM head replicated or sharded over the vocabulary (dim 0) on one mesh "
            f"dimension; got placements {placements}"
        )
    w_local = weight_VD.to_local()  # differentiable: the gradient comes back with the same placements
    if not shard_dims:
        return w_local, 0, None
    mesh_dim = shard_dims[0]
    vocab, shards = weight_VD.shape[0], weight_VD.device_mesh.size(mesh_dim)
    # DTensor shards like torch.chunk: ceil(V / shards) rows per rank, the last one shorter.
    rows = -(-vocab // shards)
    if rows * (shards - 1) >= vocab:
        raise ValueError(
            f"vocab_size={vocab} leaves an empty LM-head shard over {shards} ranks; set train.tp_vocab_parallel=false"
        )
    vocab_start = weight_VD.device_mesh.get_local_rank(mesh_dim) * rows
    assert w_local.shape[0] == max(0, min(rows, vocab - vocab_start)), (w_local.shape, vocab, shards)
    return w_local, vocab_start, weight_VD.device_mesh.get_group(mesh_dim)


register_sharded_weight(is_dtensor, dtensor_logprobs, dtensor_argmax)
