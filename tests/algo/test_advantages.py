"""Advantage estimators against hand-computed examples."""

import math

import pytest
import torch

from areno.algo import (
    broadcast_to_tokens_T,
    dynamic_sampling_keep_B,
    gae_T,
    group_index_B,
    grpo_advantages_B,
    grpo_batch_std_advantages_B,
    masked_whiten_T,
    overlong_penalty_B,
    reinforce_pp_advantages_T,
    rloo_advantages_B,
    sequence_returns_T,
)


def test_group_index_first_seen_order_and_singletons():
    assert group_index_B(["b", "a", "b", "", ""]).tolist() == [0, 1, 0, 2, 3]


def test_grpo_advantages_std_and_dr_grpo():
    rewards_B = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    group_B = torch.tensor([0, 0, 0, 1, 1, 1])
    # group 0: mean 1/3, unbiased std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3)
    std0 = math.sqrt(1 / 3)
    adv = grpo_advantages_B(rewards_B, group_B, eps=0.0)
    expected = [2 / 3 / std0, -1 / 3 / std0, -1 / 3 / std0]
    assert adv[:3].tolist() == pytest.approx(expected, rel=1e-5)
    assert adv[3:].tolist() == [0.0, 0.0, 0.0]  # zero-variance group
    dr = grpo_advantages_B(rewards_B, group_B, scale_by_std=False)
    assert dr.tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3, 0, 0, 0], abs=1e-6)


def test_grpo_batch_std_divides_by_the_std_of_the_whole_batch():
    """Lite PPO / TRL's scale_rewards="batch": the group's mean, the batch's (unbiased) std of the rewards."""
    rewards_B = torch.tensor([1.0, 0.0, 0.2, 1.0, 1.0, 1.0])
    group_B = torch.tensor([0, 0, 1, 1, 2, 2])
    # batch mean 0.7, squared deviations .09 .49 .25 .09 .09 .09 = 1.1, / 5 -> std sqrt(.22)
    std = math.sqrt(0.22)
    adv = grpo_batch_std_advantages_B(rewards_B, group_B, eps=1e-4)
    expected = [0.5 / (std + 1e-4), -0.5 / (std + 1e-4), -0.4 / (std + 1e-4), 0.4 / (std + 1e-4), 0.0, 0.0]
    assert adv.tolist() == pytest.approx(expected, rel=1e-6)
    # every reward equal, or one sequence: no std, every advantage 0 (eps 0 too)
    assert grpo_batch_std_advantages_B(torch.ones(4), torch.tensor([0, 0, 1, 1]), eps=0.0).tolist() == [0.0] * 4
    assert grpo_batch_std_advantages_B(torch.tensor([3.0]), torch.tensor([0])).tolist() == [0.0]


def test_group_statistics_keep_small_differences_of_large_rewards():
    """Rewards of 1000 + 2^-13 steps (exact in float32): a float32 mean, or a variance from the sum of
    squares, loses the steps (walk12: grpo gave [-0.563, 0, 0.563, -0.563]); the estimators subtract
    the group mean in float64 and take the std of the deviations."""
    offsets = [0.0, 2**-13, 2**-12, 0.0]
    group_B = torch.zeros(4, dtype=torch.long)
    for base in (0.0, 1000.0):
        rewards_B = torch.tensor([base + o for o in offsets])
        ref = torch.tensor(offsets, dtype=torch.float64)
        dev = ref - ref.mean()
        torch.testing.assert_close(
            grpo_advantages_B(rewards_B, group_B), (dev / (ref.std() + 1e-4)).float(), rtol=1e-5, atol=1e-7
        )
        torch.testing.assert_close(grpo_advantages_B(rewards_B, group_B, scale_by_std=False), dev.float())
        cu = torch.tensor([0, 2, 4, 6, 8])
        mask = torch.tensor([False, True] * 4)
        baseline = reinforce_pp_advantages_T(rewards_B, cu, mask, group_B=group_B)
        torch.testing.assert_close(baseline[mask], masked_whiten_T(dev.float().repeat_interleave(2), mask)[mask])


def test_rloo_leave_one_out():
    rewards_B = torch.tensor([1.0, 0.0, 0.5, 3.0])
    group_B = torch.tensor([0, 0, 0, 1])
    adv = rloo_advantages_B(rewards_B, group_B)
    # 1 - mean(0, .5) = .75; 0 - mean(1, .5) = -.75; .5 - mean(1, 0) = 0; singleton -> 0
    assert adv.tolist() == pytest.approx([0.75, -0.75, 0.0, 0.0])


def _two_seq_batch():
    # seq 0: 5 tokens, prompt 2 (mask F F T T T); seq 1: 4 tokens (F F T T)
    cu = torch.tensor([0, 5, 9])
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 0, 1, 1], dtype=torch.bool)
    return cu, mask


def test_broadcast_and_returns():
    cu, mask = _two_seq_batch()
    out = broadcast_to_tokens_T(torch.tensor([2.0, -1.0]), cu, mask)
    assert out.tolist() == [0, 0, 2, 2, 2, 0, 0, -1, -1]
    kl = torch.tensor([0, 0, -0.1, -0.2, -0.3, 0, 0, -0.1, -0.1])
    ret = sequence_returns_T(torch.tensor([1.0, 0.0]), cu, mask, token_rewards_T=kl, gamma=0.5)
    # seq 0 rewards (-.1, -.2, .7): G2 = .7, G1 = -.2 + .35 = .15, G0 = -.1 + .075 = -.025
    assert ret.tolist() == pytest.approx([0, 0, -0.025, 0.15, 0.7, 0, 0, -0.15, -0.1], abs=1e-6)


def test_masked_whiten_uses_only_masked_tokens():
    x = torch.tensor([100.0, 1.0, 2.0, 3.0])
    m = torch.tensor([False, True, True, True])
    assert masked_whiten_T(x, m, eps=0).tolist() == pytest.approx([0, -1, 0, 1])


def test_reinforce_pp_and_baseline():
    cu, mask = _two_seq_batch()
    rewards = torch.tensor([1.0, 0.0])
    adv = reinforce_pp_advantages_T(rewards, cu, mask, eps=0.0)
    # returns on loss tokens: 1,1,1,0,0 -> mean .6, unbiased std sqrt(1.2/4) = sqrt(.3)
    s = math.sqrt(0.3)
    assert adv.tolist() == pytest.approx([0, 0, 0.4 / s, 0.4 / s, 0.4 / s, 0, 0, -0.6 / s, -0.6 / s], rel=1e-5)
    # baseline variant, both in one group: rewards become .5, -.5 -> returns .5 x3, -.5 x2
    adv_b = reinforce_pp_advantages_T(rewards, cu, mask, group_B=torch.tensor([0, 0]), eps=0.0)
    assert adv_b.tolist() == pytest.approx(adv.tolist(), rel=1e-5)  # a shift does not change whitening
    adv_c = reinforce_pp_advantages_T(
        torch.tensor([1.0, 0.0, 3.0]),
        torch.tensor([0, 2, 4, 6]),
        torch.tensor([0, 1, 0, 1, 0, 1], dtype=torch.bool),
        group_B=torch.tensor([0, 0, 1]),
        eps=0.0,
    )
    # centred rewards .5, -.5, 0 -> mean 0, std sqrt(.5 / 2) = .5
    assert adv_c.tolist() == pytest.approx([0, 1, 0, -1, 0, 0], abs=1e-6)


def test_gae_per_sequence():
    cu, mask = _two_seq_batch()
    values = torch.tensor([9.0, 9.0, 0.5, 0.2, 0.4, 9.0, 9.0, 0.1, 0.3])
    adv, ret = gae_T(torch.tensor([1.0, 0.0]), values, cu, mask, gamma=0.9, lam=0.5)
    # seq 0: d2 = 1 - .4 = .6; d1 = 0 + .9*.4 - .2 = .16; d0 = .9*.2 - .5 = -.32
    a2 = 0.6
    a1 = 0.16 + 0.45 * a2
    a0 = -0.32 + 0.45 * a1
    # seq 1: d1 = 0 - .3; d0 = .9*.3 - .1 = .17
    b1 = -0.3
    b0 = 0.17 + 0.45 * b1
    assert adv.tolist() == pytest.approx([0, 0, a0, a1, a2, 0, 0, b0, b1], abs=1e-6)
    assert ret.tolist() == pytest.approx([0, 0, a0 + 0.5, a1 + 0.2, a2 + 0.4, 0, 0, b0 + 0.1, b1 + 0.3], abs=1e-6)


def test_dynamic_sampling_and_overlong():
    keep = dynamic_sampling_keep_B(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0]), torch.tensor([0, 0, 1, 1, 2, 2]))
    assert keep.tolist() == [False, False, True, True, False, False]
    pen = overlong_penalty_B(torch.tensor([10, 16, 18, 20, 21]), max_length=20, buffer_length=4)
    assert pen.tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0, -1.0])
    with pytest.raises(ValueError, match="buffer_length"):
        overlong_penalty_B(torch.tensor([1]), max_length=4, buffer_length=0)


def _reference_returns_and_gae(rewards_B, values_T, cu, mask_T, token_rewards_T, gamma, lam):
    """Per-token loops, one sequence at a time, in Python floats: the sequence reward (float32-added
    to the token reward) on the last loss token, recurrences over the loss tokens only."""
    mask = mask_T.bool()
    per_token = torch.zeros(mask.shape, dtype=torch.float32)
    if token_rewards_T is not None:
        per_token = torch.where(mask, token_rewards_T.float(), per_token)
    returns = [0.0] * mask.numel()
    adv = [0.0] * mask.numel()
    bounds = cu.tolist()
    for b in range(len(bounds) - 1):
        pos = [t for t in range(bounds[b], bounds[b + 1]) if mask[t]]
        if pos:
            per_token[pos[-1]] += rewards_B[b].float()
        ret_run, adv_run, next_value = 0.0, 0.0, 0.0
        for t in reversed(pos):
            r, v = float(per_token[t]), float(values_T[t])
            ret_run = r + gamma * ret_run
            adv_run = r + gamma * next_value - v + gamma * lam * adv_run
            returns[t], adv[t], next_value = ret_run, adv_run, v
    adv_T = torch.tensor(adv, dtype=torch.float32)
    return torch.tensor(returns, dtype=torch.float32), adv_T, torch.where(mask, adv_T + values_T, 0.0)


def _random_packed_batch(gen, num_seqs):
    """Varied lengths (some empty), prompts, gaps in the loss mask (tool outputs between turns), and
    some sequences with no loss token at all."""
    lengths, mask = [], []
    for _ in range(num_seqs):
        n = int(torch.randint(0, 40, (), generator=gen))
        kind = int(torch.randint(0, 4, (), generator=gen))
        if kind == 0:
            m = [False] * n  # no loss token
        elif kind == 1:
            prompt = int(torch.randint(0, n + 1, (), generator=gen))
            m = [i >= prompt for i in range(n)]
        else:
            m = (torch.rand(n, generator=gen) < 0.6).tolist()  # multi-turn: gaps anywhere
        lengths.append(n)
        mask += m
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    T = int(cu[-1])
    return cu, torch.tensor(mask, dtype=torch.bool), torch.randn(num_seqs, generator=gen), torch.randn(T, generator=gen)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.95), (1.0, 0.95), (0.99, 1.0), (0.5, 0.0), (0.0, 0.7)])
@pytest.mark.parametrize("with_token_rewards", [False, True])
def test_returns_and_gae_match_per_token_loop(gamma, lam, with_token_rewards):
    gen = torch.Generator().manual_seed(int(gamma * 100) + int(lam * 10) + with_token_rewards)
    for num_seqs in (1, 3, 17):
        cu, mask, rewards, values = _random_packed_batch(gen, num_seqs)
        kl = -0.1 * torch.rand(mask.numel(), generator=gen) if with_token_rewards else None
        ref_ret, ref_adv, ref_vt = _reference_returns_and_gae(rewards, values, cu, mask, kl, gamma, lam)
        ret = sequence_returns_T(rewards, cu, mask, token_rewards_T=kl, gamma=gamma)
        adv, vt = gae_T(rewards, values, cu, mask, gamma=gamma, lam=lam, token_rewards_T=kl)
        for got, want in ((ret, ref_ret), (adv, ref_adv), (vt, ref_vt)):
            assert got.dtype == torch.float32
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        # an integer 0/1 mask selects the same tokens
        torch.testing.assert_close(sequence_returns_T(rewards, cu, mask.long(), token_rewards_T=kl, gamma=gamma), ret)


def test_returns_and_gae_of_batches_without_loss_tokens():
    for cu, mask in ((torch.tensor([0]), torch.zeros(0, dtype=torch.bool)), (torch.tensor([0, 0, 3]), torch.zeros(3))):
        rewards, values = torch.ones(cu.numel() - 1), torch.ones(mask.numel())
        assert sequence_returns_T(rewards, cu, mask, gamma=0.9).tolist() == [0.0] * mask.numel()
        adv, ret = gae_T(rewards, values, cu, mask, gamma=0.9, lam=0.5)
        assert adv.tolist() == ret.tolist() == [0.0] * mask.numel()
