"""Loss aggregation expressed as per-token weights plus an additive global denominator, so that
``(loss_T * weight_T * mask_T).sum() / denominator`` — the backend's Reducer — reproduces each
aggregation exactly for any micro-batching or data-parallel split.

Legend: B = sequences, T = packed tokens.
    token               sum_t loss_t / (number of loss tokens)     (DAPO token-level; GRPO in TRL)
    seq_mean_token_mean mean_b (mean_{t in b} loss_t)               (original GRPO, GSPO)
    seq_mean_token_sum  mean_b (sum_{t in b} loss_t)                (LUSPO: GSPO weighted by length)
    constant            sum_t loss_t / (B * L)                      (Dr.GRPO, L a fixed constant)

Statistics (the ratio, clip fractions, KL, entropy an actor logs) are averages whatever the loss's
normalisation: ``statistics_weights_T`` gives the weights that, divided by the same denominator, make
them the token mean (``token``) or the mean over sequences of each one's token mean
(``seq_mean_token_mean``; ``seq_mean_token_sum``, whose sums are no averages; and ``constant``, whose
``B * L`` is no count of tokens: the statistics are the per-sequence means averaged over its ``B``, not
the loss's sum / (B * L)).
"""

from __future__ import annotations

import torch

from areno.types import sequence_index_T

LOSS_AGGREGATIONS = ("token", "seq_mean_token_mean", "seq_mean_token_sum", "constant")


def _check(mode: str) -> None:
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"loss_aggregation must be one of {LOSS_AGGREGATIONS}, got {mode!r}")


def aggregation_weights_T(loss_mask_T: torch.Tensor, cu_seqlens_B1: torch.Tensor, mode: str) -> torch.Tensor:
    """float32 [T] weight of each token under ``mode`` (0 off the mask)."""
    _check(mode)
    mask_T = loss_mask_T.to(torch.float32)
    if mode != "seq_mean_token_mean":
        return mask_T
    return _per_sequence_mean_weights_T(mask_T, cu_seqlens_B1, 1.0)


def _per_sequence_mean_weights_T(mask_T: torch.Tensor, cu_seqlens_B1: torch.Tensor, scale: float) -> torch.Tensor:
    """``mask_T * scale / |o_b|``, ``|o_b|`` the loss tokens of the token's sequence."""
    device = mask_T.device
    seq_T = sequence_index_T(cu_seqlens_B1, device)
    count_B = torch.zeros(cu_seqlens_B1.numel() - 1, device=device).index_add(0, seq_T, mask_T)
    if scale == 1.0:
        return mask_T / count_B.clamp(min=1)[seq_T]
    return mask_T * (scale / count_B.clamp(min=1))[seq_T]


def statistics_weights_T(
    loss_mask_T: torch.Tensor, cu_seqlens_B1: torch.Tensor, mode: str, *, constant: float = 1.0
) -> torch.Tensor:
    """float32 [T] weights of per-token statistics under loss aggregation ``mode``: with the loss's
    reducer (which divides by ``aggregation_denominator``) the statistic is an average of its values,
    never scaled by the normalisation. ``token``: the token mean (the loss's weights);
    ``seq_mean_token_mean``: the mean over sequences of each one's token mean (the loss's weights);
    ``seq_mean_token_sum``: the same mean over sequences (the loss sums each sequence's tokens);
    ``constant``: the same mean over sequences, each sequence's tokens weighted ``constant / |o_b|`` so
    that the denominator ``B * constant`` divides to it (a token mean would need the step's token count,
    which a micro-batch does not know)."""
    if mode == "seq_mean_token_sum":
        return aggregation_weights_T(loss_mask_T, cu_seqlens_B1, "seq_mean_token_mean")
    if mode != "constant":
        return aggregation_weights_T(loss_mask_T, cu_seqlens_B1, mode)
    return _per_sequence_mean_weights_T(loss_mask_T.to(torch.float32), cu_seqlens_B1, float(constant))


def aggregation_denominator(
    loss_mask_T: torch.Tensor, cu_seqlens_B1: torch.Tensor, mode: str, *, constant: float = 1.0
) -> float:
    """This batch's share of the global denominator (additive over micro-batches and ranks):
    loss tokens, sequences with at least one loss token (both ``seq_mean_*``), or ``B * constant``."""
    _check(mode)
    if mode == "token":
        return float(loss_mask_T.sum())
    loss_mask_T, cu_seqlens_B1 = loss_mask_T.cpu(), cu_seqlens_B1.cpu()
    seqlens_B = cu_seqlens_B1[1:] - cu_seqlens_B1[:-1]
    if mode == "constant":
        return float(seqlens_B.numel()) * constant
    seq_T = torch.repeat_interleave(torch.arange(seqlens_B.numel()), seqlens_B)
    count_B = torch.zeros(seqlens_B.numel()).index_add(0, seq_T, loss_mask_T.to(torch.float32))
    return float((count_B > 0).sum())
