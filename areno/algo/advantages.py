"""Advantage estimators: group normalisation (GRPO / Dr.GRPO), leave-one-out (RLOO), REINFORCE++
(global batch normalisation, with or without a group baseline) and GAE.

Legend: B = sequences, T = packed tokens, G = groups. Per-token tensors follow the alignment
convention of ``areno/types.py``: position ``t`` scores token ``input_ids_T[t]`` as a target.
All functions are pure and differentiable-free (advantages are constants in the loss).
"""

from __future__ import annotations

import torch

from areno.types import repeat_per_sequence


def group_index_B(group_ids: list[str]) -> torch.Tensor:
    """int64 [B] dense group index (0..G-1, first-seen order) from the string group ids.

    An empty id is its own singleton group (a trajectory that belongs to no group).
    """
    index: dict[str, int] = {}
    out = []
    for i, gid in enumerate(group_ids):
        key = gid if gid else f"\x00singleton-{i}"
        out.append(index.setdefault(key, len(index)))
    return torch.tensor(out, dtype=torch.long)


def _group_stats(values_B: torch.Tensor, group_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group (count_G, sum_G) by scatter-add, in float64."""
    num_groups = int(group_B.max().item()) + 1 if group_B.numel() else 0
    values_B = values_B.to(torch.float64)
    count_G = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_B, torch.ones_like(values_B))
    sum_G = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_B, values_B)
    return count_G, sum_G


def _group_moments_B(values_B: torch.Tensor, group_B: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per sequence, in float64: its group's mean, its value minus that mean, and the group's unbiased
    std (n-1, as torch.std and TRL; 0 for a singleton group). Two passes: rewards far from 0 keep their
    differences, which a float32 mean or a sum of squares loses."""
    count_G, sum_G = _group_stats(values_B, group_B)
    mean_B = (sum_G / count_G)[group_B]
    dev_B = values_B.to(torch.float64) - mean_B
    sq_G = torch.zeros_like(sum_G).index_add_(0, group_B, dev_B**2)
    std_G = (sq_G / (count_G - 1).clamp(min=1)).sqrt()
    return mean_B, dev_B, std_G[group_B]


def group_mean_std_B(values_B: torch.Tensor, group_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence (mean, std) of its group, in ``values_B``'s dtype (``_group_moments_B``)."""
    mean_B, _, std_B = _group_moments_B(values_B, group_B)
    return mean_B.to(values_B.dtype), std_B.to(values_B.dtype)


def grpo_advantages_B(
    rewards_B: torch.Tensor,
    group_B: torch.Tensor,
    *,
    scale_by_std: bool = True,
    eps: float = 1e-4,
) -> torch.Tensor:
    """GRPO group-normalised advantage, one scalar per sequence.

    ``A_i = (r_i - mean_g(r)) / (std_g(r) + eps)`` over the sequences of group g (DeepSeekMath).
    ``scale_by_std=False`` is Dr.GRPO (Liu et al. 2025): ``A_i = r_i - mean_g(r)``, removing the
    difficulty bias of the std. std is the unbiased (n-1) estimate and eps is added to the std
    (not the variance), both as in TRL's GRPOTrainer; the paper does not specify either.
    """
    _, adv_B, std_B = _group_moments_B(rewards_B, group_B)
    if scale_by_std:
        denom_B = std_B + eps
        # A zero-variance group has a zero numerator; keep it 0 even with eps = 0.
        adv_B = torch.where(denom_B > 0, adv_B / denom_B.clamp(min=1e-30), torch.zeros_like(adv_B))
    return adv_B.to(rewards_B.dtype)


def rloo_advantages_B(rewards_B: torch.Tensor, group_B: torch.Tensor) -> torch.Tensor:
    """RLOO leave-one-out advantage (Ahmadian et al. 2024): ``A_i = r_i - mean_{j≠i, j∈g} r_j``.

    Equivalently ``n/(n-1) * (r_i - mean_g r)``. A singleton group (n = 1) has no baseline and
    gets advantage 0 rather than r_i (the estimator is undefined there; 0 avoids an unbaselined
    gradient).
    """
    count_G, sum_G = _group_stats(rewards_B, group_B)
    n_B = count_G[group_B]
    r_B = rewards_B.to(torch.float64)
    baseline_B = (sum_G[group_B] - r_B) / (n_B - 1).clamp(min=1)
    adv_B = torch.where(n_B > 1, r_B - baseline_B, torch.zeros_like(r_B))
    return adv_B.to(rewards_B.dtype)


def masked_whiten_T(
    values_T: torch.Tensor, mask_T: torch.Tensor, *, eps: float = 1e-8, shift_mean: bool = True
) -> torch.Tensor:
    """Normalise over the masked tokens of the whole batch: ``(x - mean) / (std + eps)``
    (std unbiased); entries outside the mask are returned as 0.

    On several data-parallel ranks the caller must pass the global batch (REINFORCE++ normalises
    over the global batch); this function does not all-reduce.
    """
    mask_T = mask_T.bool()
    sel = values_T[mask_T].to(torch.float64)
    if sel.numel() == 0:
        return torch.zeros_like(values_T)
    mean = sel.mean()
    std = sel.std(unbiased=True) if sel.numel() > 1 else torch.zeros((), dtype=torch.float64)
    centred = values_T.to(torch.float64) - mean if shift_mean else values_T.to(torch.float64)
    out = centred / (std + eps)
    return torch.where(mask_T, out, torch.zeros_like(out)).to(values_T.dtype)


def broadcast_to_tokens_T(
    values_B: torch.Tensor, cu_seqlens_B1: torch.Tensor, loss_mask_T: torch.Tensor
) -> torch.Tensor:
    """Repeat a per-sequence value over that sequence's tokens, 0 outside the loss mask."""
    out_T = repeat_per_sequence(values_B, cu_seqlens_B1)
    return torch.where(loss_mask_T.bool(), out_T, torch.zeros_like(out_T))


def sequence_returns_T(
    rewards_B: torch.Tensor,
    cu_seqlens_B1: torch.Tensor,
    loss_mask_T: torch.Tensor,
    *,
    token_rewards_T: torch.Tensor | None = None,
    gamma: float = 1.0,
) -> torch.Tensor:
    """Discounted return-to-go of every loss token: the sequence reward arrives at the last loss
    token of its sequence, ``token_rewards_T`` (e.g. a per-token KL penalty) at every loss token,
    and ``G_t = sum_{k>=t} gamma^(k-t) r_k`` runs over the loss tokens only (prompt or
    environment tokens inside the sequence are skipped, not discounted)."""
    per_token_T = _token_rewards_T(rewards_B, cu_seqlens_B1, loss_mask_T, token_rewards_T)
    returns_T = torch.zeros_like(per_token_T)
    cu = cu_seqlens_B1.tolist()
    for b in range(len(cu) - 1):
        pos = torch.nonzero(loss_mask_T[cu[b] : cu[b + 1]]).flatten() + cu[b]
        running = torch.zeros((), dtype=per_token_T.dtype)
        for t in reversed(pos.tolist()):
            running = per_token_T[t] + gamma * running
            returns_T[t] = running
    return returns_T


def _token_rewards_T(rewards_B, cu_seqlens_B1, loss_mask_T, token_rewards_T):
    """Per-token reward: the sequence reward on its last loss token plus optional per-token
    rewards, 0 outside the loss mask."""
    mask_T = loss_mask_T.bool()
    out_T = torch.zeros(mask_T.shape, dtype=torch.float32)
    if token_rewards_T is not None:
        out_T = torch.where(mask_T, token_rewards_T.to(torch.float32), out_T)
    cu = cu_seqlens_B1.tolist()
    for b in range(len(cu) - 1):
        pos = torch.nonzero(mask_T[cu[b] : cu[b + 1]]).flatten()
        if pos.numel():
            out_T[cu[b] + int(pos[-1])] += rewards_B[b].to(torch.float32)
    return out_T


def reinforce_pp_advantages_T(
    rewards_B: torch.Tensor,
    cu_seqlens_B1: torch.Tensor,
    loss_mask_T: torch.Tensor,
    *,
    token_rewards_T: torch.Tensor | None = None,
    group_B: torch.Tensor | None = None,
    gamma: float = 1.0,
    eps: float = 1e-8,
) -> torch.Tensor:
    """REINFORCE++ (Hu 2025): return-to-go of the (KL-shaped) reward, normalised over all loss
    tokens of the global batch: ``A_t = (G_t - mean_batch G) / std_batch G``.

    With ``group_B`` this is REINFORCE++-baseline: the sequence reward first has its group mean
    subtracted (``r_i - mean_g r``), then the return-to-go is normalised over the batch. No critic
    in either form. ``token_rewards_T`` carries the per-token KL penalty ``-beta * k`` when the KL
    enters as a reward (see ``kl.kl_reward_penalty_T``).
    """
    if group_B is not None:
        rewards_B = _group_moments_B(rewards_B, group_B)[1].to(rewards_B.dtype)
    returns_T = sequence_returns_T(rewards_B, cu_seqlens_B1, loss_mask_T, token_rewards_T=token_rewards_T, gamma=gamma)
    return masked_whiten_T(returns_T, loss_mask_T, eps=eps)


def gae_T(
    rewards_B: torch.Tensor,
    values_T: torch.Tensor,
    cu_seqlens_B1: torch.Tensor,
    loss_mask_T: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    token_rewards_T: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016), per packed sequence.

    ``values_T[t]`` is V of the state just before token t is emitted (so it is aligned like
    ``logprobs_T``). Over the loss tokens ``t_1 < … < t_n`` of one sequence:
    ``delta_k = r_k + gamma V_{k+1} - V_k`` with ``V_{n+1} = 0`` (the episode ends), and
    ``A_k = delta_k + gamma lam A_{k+1}``; returns ``R_k = A_k + V_k`` are the value targets.
    Non-loss tokens inside a sequence (multi-turn environment tokens) are skipped, i.e. the MDP
    step is the next *generated* token. Rewards: the sequence reward on the last loss token plus
    optional ``token_rewards_T`` (KL penalty). Returns ``(advantages_T, returns_T)``, 0 off-mask.
    """
    per_token_T = _token_rewards_T(rewards_B, cu_seqlens_B1, loss_mask_T, token_rewards_T)
    values_T = values_T.detach().to(torch.float32)
    adv_T = torch.zeros_like(per_token_T)
    cu = cu_seqlens_B1.tolist()
    for b in range(len(cu) - 1):
        pos = (torch.nonzero(loss_mask_T[cu[b] : cu[b + 1]]).flatten() + cu[b]).tolist()
        next_value, running = 0.0, 0.0
        for t in reversed(pos):
            delta = float(per_token_T[t]) + gamma * next_value - float(values_T[t])
            running = delta + gamma * lam * running
            adv_T[t] = running
            next_value = float(values_T[t])
    returns_T = torch.where(loss_mask_T.bool(), adv_T + values_T, torch.zeros_like(adv_T))
    return adv_T, returns_T
