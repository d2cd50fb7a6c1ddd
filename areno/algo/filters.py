"""Reward shaping and batch filters applied before advantages: DAPO's dynamic sampling (drop
groups whose rewards have zero variance) and soft overlong punishment.

Legend: B = sequences.
"""

from __future__ import annotations

import torch

from areno.algo.advantages import group_index_B, group_mean_std_B
from areno.types import Trajectory


def dynamic_sampling_keep_B(rewards_B: torch.Tensor, group_B: torch.Tensor, *, atol: float = 1e-6) -> torch.Tensor:
    """bool [B]: keep the sequences of groups whose rewards are not all equal (DAPO dynamic
    sampling). An all-correct or all-wrong group gives zero GRPO advantage and only dilutes the
    batch. The filter only drops; the rollout samples again until the batch is full
    (``dynamic_sampling_kept``)."""
    _, std_B = group_mean_std_B(rewards_B, group_B)
    return std_B > atol


def dynamic_sampling_kept(trajectories: list[Trajectory]) -> list[Trajectory]:
    """The trajectories of a finished episode that dynamic sampling keeps: ``dynamic_sampling_keep_B``
    over their rewards (fp32, as the training batch holds them) and group ids, so the rollout keeps
    exactly what training would."""
    rewards_B = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
    keep_B = dynamic_sampling_keep_B(rewards_B, group_index_B([t.group_id for t in trajectories]))
    return [t for t, keep in zip(trajectories, keep_B.tolist(), strict=True) if keep]


def overlong_penalty_B(
    response_lengths_B: torch.Tensor, *, max_length: int, buffer_length: int, penalty: float = 1.0
) -> torch.Tensor:
    """DAPO soft overlong punishment, added to the reward of each sequence:

    ``0`` if ``L <= L_max - L_buf``; ``(L_max - L_buf - L) / L_buf * penalty`` inside the buffer;
    ``-penalty`` if ``L > L_max``.
    """
    if buffer_length <= 0 or buffer_length > max_length:
        raise ValueError(f"overlong buffer_length must be in (0, max_length={max_length}], got {buffer_length}")
    lengths_B = response_lengths_B.to(torch.float32)
    expected = max_length - buffer_length
    out_B = ((expected - lengths_B) / buffer_length).clamp(max=0.0) * penalty
    return torch.where(lengths_B > max_length, torch.full_like(out_B, -penalty), out_B)
