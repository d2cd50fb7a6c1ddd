"""Non-policy-gradient losses: value (clipped), entropy bonus, SFT negative log-likelihood, DPO,
Bradley–Terry reward modelling.

Legend: B = sequences, T = packed tokens. Per-token functions return per-token tensors (0 off the
loss mask); per-sequence (pairwise) functions return per-pair tensors. Reduction is the caller's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from areno.types import sequence_index_T


def value_loss_T(
    values_T: torch.Tensor,
    old_values_T: torch.Tensor,
    returns_T: torch.Tensor,
    loss_mask_T: torch.Tensor,
    *,
    clip_eps: float | None = 0.2,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO value loss: ``0.5 * max((V - R)^2, (clip(V, V_old - eps, V_old + eps) - R)^2)``.

    ``clip_eps=None`` gives the plain ``0.5 (V - R)^2``. Stats: ``value_clip_frac`` (the clipped
    branch was larger).
    """
    err1_T = (values_T - returns_T) ** 2
    clipped_T = torch.zeros_like(err1_T, dtype=torch.bool)
    if clip_eps is None:
        loss_T = 0.5 * err1_T
    else:
        v_clip_T = old_values_T + (values_T - old_values_T).clamp(-clip_eps, clip_eps)
        err2_T = (v_clip_T - returns_T) ** 2
        loss_T = 0.5 * torch.maximum(err1_T, err2_T)
        clipped_T = err2_T > err1_T
    mask_T = loss_mask_T.bool()
    loss_T = torch.where(mask_T, loss_T, torch.zeros_like(loss_T))
    return loss_T, {"value_clip_frac": (clipped_T & mask_T).float().detach()}


def entropy_bonus_T(entropy_T: torch.Tensor, loss_mask_T: torch.Tensor, *, coef: float) -> torch.Tensor:
    """Entropy bonus as a loss term: ``-coef * H_t`` (minimising it raises the entropy)."""
    return torch.where(loss_mask_T.bool(), -coef * entropy_T, torch.zeros_like(entropy_T))


def nll_loss_T(logprobs_T: torch.Tensor, loss_mask_T: torch.Tensor) -> torch.Tensor:
    """Supervised fine-tuning: per-token negative log-likelihood ``-log p(token)``."""
    return torch.where(loss_mask_T.bool(), -logprobs_T, torch.zeros_like(logprobs_T))


def sequence_sum_B(values_T: torch.Tensor, cu_seqlens_B1: torch.Tensor, loss_mask_T: torch.Tensor) -> torch.Tensor:
    """Sum of ``values_T`` over the loss tokens of each sequence (e.g. a sequence log-prob)."""
    seq_T = sequence_index_T(cu_seqlens_B1, values_T.device)
    masked_T = torch.where(loss_mask_T.bool(), values_T, torch.zeros_like(values_T))
    return torch.zeros(cu_seqlens_B1.numel() - 1, dtype=values_T.dtype, device=values_T.device).index_add(
        0, seq_T, masked_T
    )


def dpo_loss_B(
    policy_chosen_logps_B: torch.Tensor,
    policy_rejected_logps_B: torch.Tensor,
    ref_chosen_logps_B: torch.Tensor,
    ref_rejected_logps_B: torch.Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO (Rafailov et al. 2023), one value per preference pair:

    ``h = beta * ((logp_c - ref_c) - (logp_r - ref_r))``,
    ``loss = -(1 - ls) log sigmoid(h) - ls log sigmoid(-h)`` (``ls`` > 0 is conservative DPO /
    cDPO, Mitchell 2023). Sequence log-probs are sums over completion tokens. Stats (per pair):
    ``chosen_reward``, ``rejected_reward`` (``beta * (logp - ref)``) and ``reward_accuracy``.
    """
    chosen_B = beta * (policy_chosen_logps_B - ref_chosen_logps_B.detach())
    rejected_B = beta * (policy_rejected_logps_B - ref_rejected_logps_B.detach())
    h_B = chosen_B - rejected_B
    loss_B = -(1 - label_smoothing) * F.logsigmoid(h_B) - label_smoothing * F.logsigmoid(-h_B)
    stats = {
        "chosen_reward": chosen_B.detach(),
        "rejected_reward": rejected_B.detach(),
        "reward_accuracy": (chosen_B > rejected_B).float().detach(),
    }
    return loss_B, stats


def bradley_terry_loss_B(
    chosen_scores_B: torch.Tensor, rejected_scores_B: torch.Tensor, *, margin: float = 0.0
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Bradley–Terry reward-model loss (Ouyang et al. 2022): ``-log sigmoid(s_c - s_r - margin)``
    per pair (``margin`` as in Llama 2's margin loss). Stats: ``accuracy``, ``margin``."""
    diff_B = chosen_scores_B - rejected_scores_B
    loss_B = -F.logsigmoid(diff_B - margin)
    return loss_B, {"accuracy": (diff_B > 0).float().detach(), "score_margin": diff_B.detach()}
