"""Advantage estimators: group normalisation (GRPO / Dr.GRPO, or by the batch's std as Lite PPO),
leave-one-out (RLOO), REINFORCE++ (global batch normalisation, with or without a group baseline) and GAE.

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


def grpo_batch_std_advantages_B(rewards_B: torch.Tensor, group_B: torch.Tensor, *, eps: float = 1e-4) -> torch.Tensor:
    """GRPO's group baseline with the batch's reward std, one scalar per sequence:

    ``A_i = (r_i - mean_g(r)) / (std_batch(r) + eps)``: the mean over the sequences of i's group g, the std
    over every sequence of ``rewards_B`` (the rewards', not the centred advantages'). Lite PPO's
    "group-level mean, batch-level std" (Liu et al. 2025, "Tricks or Traps? A Deep Dive into RL for LLM
    Reasoning"; TRL's ``scale_rewards="batch"``): a group whose rewards barely differ is not blown up to unit
    scale, as the group std does. std unbiased (n-1) and eps added to it, as TRL's. The caller passes the
    whole step's batch (areno's ``prepare_batch`` sees it whole, groups of any rollout version alike).
    """
    _, adv_B, _ = _group_moments_B(rewards_B, group_B)
    r_B = rewards_B.to(torch.float64)
    std = r_B.std(unbiased=True) if r_B.numel() > 1 else r_B.new_zeros(())
    denom = std + eps
    # all rewards equal: every numerator is 0; keep it 0 even with eps = 0
    adv_B = adv_B / denom if bool(denom > 0) else torch.zeros_like(adv_B)
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
    environment tokens inside the sequence are skipped, not discounted). Accumulated in float64,
    returned in float32."""
    per_token_T = _token_rewards_T(rewards_B, cu_seqlens_B1, loss_mask_T, token_rewards_T)
    returns_T = torch.zeros_like(per_token_T)
    layout = _loss_token_layout(cu_seqlens_B1, loss_mask_T, per_token_T.device)
    if layout is not None:
        pos_N, k_N, b_N, shape = layout
        r_LB = per_token_T.new_zeros(shape, dtype=torch.float64).index_put_((k_N, b_N), per_token_T[pos_N].double())
        returns_T[pos_N] = _reverse_discounted_sum(r_LB, gamma)[k_N, b_N].to(returns_T.dtype)
    return returns_T


def _loss_token_layout(
    cu_seqlens_B1: torch.Tensor, loss_mask_T: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, int]] | None:
    """The loss tokens laid out so that a recurrence over positions runs for all sequences at once:
    ``(pos_N, k_N, b_N, (Lmax + 1, B))``: the packed position of each loss token, and its cell in a
    zero-padded ``[Lmax + 1, B]`` grid (it is the ``k``-th loss token of sequence ``b``; the extra
    row stays 0 and stands for "after the end" of every sequence). None when there is no loss token."""
    cu = cu_seqlens_B1.to(device=device, dtype=torch.long)
    num_seqs = cu.numel() - 1
    if num_seqs <= 0:
        return None
    start, end = int(cu[0]), int(cu[-1])
    # Only tokens inside [cu[0], cu[-1]) belong to a sequence; a mask longer than that is ignored.
    sel_N = torch.nonzero(loss_mask_T.to(device)[start:end]).flatten()
    if sel_N.numel() == 0:
        return None
    seq_idx = torch.repeat_interleave(torch.arange(num_seqs, device=device), cu[1:] - cu[:-1])
    b_N = seq_idx[sel_N]
    n_B = torch.bincount(b_N, minlength=num_seqs)
    k_N = torch.arange(sel_N.numel(), device=device) - (torch.cumsum(n_B, 0) - n_B)[b_N]
    return sel_N + start, k_N, b_N, (int(n_B.max()) + 1, num_seqs)


def _reverse_discounted_sum(x_LB: torch.Tensor, discount: float) -> torch.Tensor:
    """``y[k] = x[k] + discount * y[k + 1]`` down every column (the padding is 0, so each sequence's
    sum starts from 0 after its last loss token); the same operations, in the same order, as a
    per-token loop."""
    if discount == 1.0:
        # A CPU cumsum adds in sequence order: the same sums as the loop, without one.
        return x_LB.flip(0).cumsum(0).flip(0)
    y_LB = torch.zeros_like(x_LB)
    scaled_B = torch.empty_like(x_LB[0])
    for k in range(x_LB.shape[0] - 2, -1, -1):
        torch.mul(y_LB[k + 1], discount, out=scaled_B)
        torch.add(x_LB[k], scaled_B, out=y_LB[k])
    return y_LB


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
    layout = _loss_token_layout(cu_seqlens_B1, loss_mask_T, per_token_T.device)
    if layout is not None:
        pos_N, k_N, b_N, shape = layout
        grid = per_token_T.new_zeros(shape, dtype=torch.float64)
        r_LB = grid.clone().index_put_((k_N, b_N), per_token_T[pos_N].double())
        v_LB = grid.index_put_((k_N, b_N), values_T.to(per_token_T.device)[pos_N].double())
        # V after the last loss token is the zero padding row (the episode ends); (r + gamma V') - V
        # in float64 is what a per-token loop over Python floats computes. The padding's delta is 0.
        delta_LB = torch.zeros_like(grid)
        delta_LB[:-1] = r_LB[:-1] + gamma * v_LB[1:] - v_LB[:-1]
        adv_T[pos_N] = _reverse_discounted_sum(delta_LB, gamma * lam)[k_N, b_N].to(adv_T.dtype)
    returns_T = torch.where(loss_mask_T.bool(), adv_T + values_T, torch.zeros_like(adv_T))
    return adv_T, returns_T


def gdpo_advantages_B(
    parts_BK: torch.Tensor, weights_K: torch.Tensor, group_B: torch.Tensor, *, eps: float = 1e-4
) -> torch.Tensor:
    """Each reward function normalised in its group, then their weighted sum normalised over the batch, one
    scalar per sequence (GDPO, "group reward-decoupled normalization"; TRL's
    ``multi_objective_aggregation="normalize_then_sum"``):

    ``s_i = sum_k w_k (r_ik - mean_g(r_k)) / (std_g(r_k) + eps)``, ``A_i = (s_i - mean(s)) / (std(s) + eps)``,

    ``parts_BK`` the functions' unweighted scores, the group means and stds over the sequences of i's group g,
    the last mean and std over the whole batch (the caller passes the step's whole batch). A function whose
    scores differ little within a group still moves its advantage as much as one whose scores span a wide
    range, which normalising the weighted sum (``grpo``) loses. Stds unbiased (n-1) with eps added, as TRL's;
    a group or a batch whose values are all equal gives 0."""
    if parts_BK.dim() != 2 or parts_BK.shape[1] != weights_K.numel():
        raise ValueError(f"parts_BK {tuple(parts_BK.shape)} must be [B, K] with K = {weights_K.numel()} weights")
    total_B = torch.zeros(parts_BK.shape[0], dtype=torch.float64)
    for k in range(parts_BK.shape[1]):
        _, dev_B, std_B = _group_moments_B(parts_BK[:, k], group_B)
        denom_B = std_B + eps
        total_B += float(weights_K[k]) * torch.where(denom_B > 0, dev_B / denom_B.clamp(min=1e-30), 0.0)
    centred_B = total_B - total_B.mean() if total_B.numel() else total_B
    std = total_B.std(unbiased=True) if total_B.numel() > 1 else total_B.new_zeros(())
    denom = std + eps
    adv_B = centred_B / denom if bool(denom > 0) else torch.zeros_like(centred_B)
    return adv_B.to(parts_BK.dtype)
