"""GDPO (TRL's ``multi_objective_aggregation="normalize_then_sum"``): each reward function normalised in its
group, the weighted sum normalised over the batch; the per-function scores carried from the reward to the
batch (``REWARD_PARTS_KEY``)."""

from __future__ import annotations

import math

import pytest
import torch

from areno.algo.advantages import gdpo_advantages_B, group_index_B, grpo_advantages_B
from areno.types import REWARD_PARTS_INFO_KEY, REWARD_PARTS_KEY, TokenBatch, Trajectory


def test_gdpo_against_hand_computed_values():
    # group a: r1 = 1, 0, 0 and r2 all 0 (no signal); group b: r1 = 1, 1, 0 and r2 = 1, 0, 1; weights 1, 0.5
    parts = torch.tensor([[1, 0], [0, 0], [0, 0], [1, 1], [1, 0], [0, 1]], dtype=torch.float32)
    group_B = group_index_B(["a", "a", "a", "b", "b", "b"])
    adv = gdpo_advantages_B(parts, torch.tensor([1.0, 0.5]), group_B, eps=0.0)
    # each function's group z-scores (unbiased std sqrt(1/3)): +-2/sqrt(3), +-1/sqrt(3); the weighted sums
    # 2/sqrt(3), -1/sqrt(3), -1/sqrt(3), sqrt(3)/2, 0, -sqrt(3)/2 have mean 0 and unbiased std sqrt(0.7)
    r = 1 / math.sqrt(2.1)
    expected = torch.tensor([2 * r, -r, -r, math.sqrt(3 / 2.8), 0.0, -math.sqrt(3 / 2.8)])
    torch.testing.assert_close(adv, expected, rtol=1e-6, atol=1e-6)


def test_gdpo_differs_from_normalising_the_weighted_sum():
    """A function with a small spread counts as much as one with a large spread after its own normalisation,
    where grpo of the weighted sum lets the large one dominate."""
    parts = torch.tensor([[0.0, 10.0], [0.1, 0.0], [0.0, 5.0], [0.1, 5.0]])
    group_B = group_index_B(["a"] * 4)
    gdpo = gdpo_advantages_B(parts, torch.tensor([1.0, 1.0]), group_B)
    grpo = grpo_advantages_B(parts.sum(1), group_B)
    assert gdpo[1] > gdpo[2] and grpo[1] < grpo[2]  # sample 1's small function win shows only under gdpo


def test_gdpo_edge_cases():
    group_B = group_index_B(["a", "a", "b"])
    same = torch.ones(3, 2)
    assert torch.equal(gdpo_advantages_B(same, torch.tensor([1.0, 2.0]), group_B), torch.zeros(3))  # no signal
    one = gdpo_advantages_B(torch.tensor([[1.0]]), torch.tensor([1.0]), group_index_B(["a"]))
    assert torch.equal(one, torch.zeros(1))
    with pytest.raises(ValueError, match=r"must be \[B, K\] with K = 3 weights"):
        gdpo_advantages_B(same, torch.ones(3), group_B)


def _trajectory(parts: list[float] | None, n: int = 3) -> Trajectory:
    info = {REWARD_PARTS_INFO_KEY: parts} if parts is not None else {}
    return Trajectory(
        prompt_ids=[1, 2], completion_ids=[3] * n, logprobs=[0.0] * n, versions=[0] * n, reward=0.0, info=info
    )


def test_the_batch_packs_each_sequences_reward_parts_and_keeps_them_through_select_and_concat():
    a = TokenBatch.from_trajectories([_trajectory([1.0, 0.5]), _trajectory([0.0, 0.25], n=2)])
    torch.testing.assert_close(a.extra[REWARD_PARTS_KEY], torch.tensor([[1.0, 0.5], [0.0, 0.25]]))
    torch.testing.assert_close(a.select([1]).extra[REWARD_PARTS_KEY], torch.tensor([[0.0, 0.25]]))
    assert REWARD_PARTS_KEY not in TokenBatch.from_trajectories([_trajectory(None), _trajectory([1.0, 0.0])]).extra
    none = TokenBatch.from_trajectories([_trajectory(None)])
    joined = TokenBatch.concat([a, none])
    assert joined.extra[REWARD_PARTS_KEY].shape == (3, 2) and joined.extra[REWARD_PARTS_KEY][2].isnan().all()
