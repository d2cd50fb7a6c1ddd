"""Policy, KL, value, DPO and reward-model losses against hand-computed examples."""

import math

import pytest
import torch
import torch.nn.functional as F

from areno.algo import (
    aggregation_denominator,
    aggregation_weights_T,
    behaviour_importance_weight_T,
    bradley_terry_loss_B,
    cispo_loss_T,
    decoupled_ppo_loss_T,
    dpo_loss_B,
    entropy_bonus_T,
    gspo_loss_T,
    kl_estimate_T,
    kl_reward_penalty_T,
    loglinear_prox_logprobs_T,
    nll_loss_T,
    off_policy_sequence_mask_T,
    ppo_clip_loss_T,
    sequence_sum_B,
    value_loss_T,
)

L = math.log


def test_ppo_clip_loss_clip_higher_and_dual_clip():
    old = torch.zeros(5)
    logp = torch.tensor([L(1.5), L(1.5), L(0.5), L(0.5), L(4.0)])
    adv = torch.tensor([1.0, 1.0, -1.0, 1.0, -1.0])
    mask = torch.tensor([True, True, True, True, False])
    loss, st = ppo_clip_loss_T(logp, old, adv, mask, eps_low=0.2, eps_high=0.28)
    # t0: -min(1.5, 1.28) = -1.28 (clipped); t2: A<0, -min(-.5, -.8) = .8 (clipped);
    # t3: A>0, ratio .5 -> -min(.5, .8) = -.5 (not clipped); t4 off-mask
    assert loss.tolist() == pytest.approx([-1.28, -1.28, 0.8, -0.5, 0.0], abs=1e-6)
    assert st["clip_frac"].tolist() == [1, 1, 1, 0, 0]
    # dual clip c=3: a negative-advantage token with ratio 4 would lose 4, capped at 3
    loss2, st2 = ppo_clip_loss_T(
        torch.tensor([L(4.0)]), torch.zeros(1), torch.tensor([-1.0]), torch.tensor([True]), dual_clip_c=3.0
    )
    assert loss2.tolist() == pytest.approx([3.0])
    assert st2["dual_clip_frac"].tolist() == [1.0]
    # gradient of a clipped token is 0, of an unclipped one is -A * ratio
    logp.requires_grad_(True)
    ppo_clip_loss_T(logp, old, adv, mask, eps_low=0.2)[0].sum().backward()
    assert logp.grad.tolist() == pytest.approx([0, 0, 0, -0.5, 0], abs=1e-6)


@pytest.mark.parametrize("loss", ["ppo", "dual_clip", "decoupled", "gspo", "cispo"])
def test_a_log_ratio_past_exps_range_gives_finite_losses_and_gradients(loss):
    """float32's exp overflows past ~88.7: an inf ratio made a zero-advantage token's loss NaN (0 * inf) and a
    clipped token's gradient NaN, and so the whole step's. The ratio is taken of the log-ratio clamped at
    LOG_RATIO_MAX (walk12)."""
    logp = torch.tensor([89.0, 89.0, 89.0, 1e-4], requires_grad=True)  # the last inside every clip range
    old = torch.zeros(4)
    adv = torch.tensor([0.0, 1.0, -1.0, 1.0])
    mask = torch.ones(4, dtype=torch.bool)
    cu = torch.tensor([0, 1, 2, 3, 4])
    out = {
        "ppo": lambda: ppo_clip_loss_T(logp, old, adv, mask),
        "dual_clip": lambda: ppo_clip_loss_T(logp, old, adv, mask, dual_clip_c=3.0),
        "decoupled": lambda: decoupled_ppo_loss_T(logp, old, old - 95.0, adv, mask, behav_imp_weight_cap=None),
        "gspo": lambda: gspo_loss_T(logp, old, adv, mask, cu),
        "cispo": lambda: cispo_loss_T(logp, old, adv, mask),
    }[loss]()
    loss_T, stats = out
    loss_T.sum().backward()
    assert torch.isfinite(loss_T).all() and torch.isfinite(logp.grad).all(), (loss_T, logp.grad)
    assert all(torch.isfinite(v).all() for v in stats.values())
    if loss != "cispo":  # a clipped or zero-advantage token has no gradient; the in-range one keeps its own
        assert logp.grad[:2].tolist() == [0.0, 0.0]
        assert logp.grad[3].item() != 0.0


def test_decoupled_ppo_mask_and_truncate():
    behave = torch.log(torch.tensor([0.5, 0.5, 0.1]))
    prox = torch.log(torch.tensor([0.6, 0.5, 0.6]))  # w = 1.2, 1.0, 6.0
    logp = torch.log(torch.tensor([0.9, 0.55, 0.6]))  # r = 1.5, 1.1, 1.0
    adv = torch.ones(3)
    mask = torch.ones(3, dtype=torch.bool)
    loss, st = decoupled_ppo_loss_T(logp, prox, behave, adv, mask, eps_low=0.2, behav_imp_weight_cap=5.0)
    assert loss.tolist() == pytest.approx([-1.2 * 1.2, -1.0 * 1.1, 0.0], abs=1e-5)
    assert st["behave_over_cap_frac"].tolist() == [0, 0, 1]
    assert st["clip_frac"].tolist() == [1, 0, 0]
    # coupled ratio pi_theta / pi_behave = 1.8, 1.1, 6.0 -> clipped 1, 0, 1
    assert st["coupled_clip_frac"].tolist() == [1, 0, 1]
    loss_t, _ = decoupled_ppo_loss_T(
        logp, prox, behave, adv, mask, eps_low=0.2, behav_imp_weight_cap=5.0, behav_weight_mode="truncate"
    )
    assert loss_t[2].item() == pytest.approx(-5.0 * 1.0, abs=1e-5)
    # with pi_prox = pi_behave it is exactly the coupled PPO loss
    coupled, _ = ppo_clip_loss_T(logp, behave, adv, mask)
    same, _ = decoupled_ppo_loss_T(logp, behave, behave, adv, mask)
    assert torch.allclose(coupled, same)


def _two_sequences():
    """Two sequences of a prompt token then two loss tokens; pi_prox / pi_behave per loss token is 2, 1.5
    (product 3, geometric mean 1.73) and 0.5, 0.8 (product 0.4); the prompt tokens' 10 and 0.1 are no
    loss token's and must not count."""
    behave = torch.zeros(6)
    prox = torch.log(torch.tensor([10.0, 2.0, 1.5, 0.1, 0.5, 0.8]))
    mask = torch.tensor([False, True, True, False, True, True])
    return prox, behave, mask, torch.tensor([0, 3, 6])


@pytest.mark.parametrize(
    ("mode", "cap", "weight_min", "weight", "over", "under"),
    [
        # one weight per sequence: the exp of the SUM of its loss tokens' log-ratios (TRL's), 3 and 0.4
        ("sequence_mask", None, None, [0, 3, 3, 0, 0.4, 0.4], [0] * 6, [0] * 6),
        ("sequence_mask", 2.5, None, [0, 0, 0, 0, 0.4, 0.4], [0, 1, 1, 0, 0, 0], [0] * 6),
        ("sequence_mask", 4.0, 0.5, [0, 3, 3, 0, 0, 0], [0] * 6, [0, 0, 0, 0, 1, 1]),
        ("sequence_truncate", 2.5, 0.5, [0, 2.5, 2.5, 0, 0.5, 0.5], [0, 1, 1, 0, 0, 0], [0, 0, 0, 0, 1, 1]),
        ("sequence_truncate", None, 0.5, [0, 3, 3, 0, 0.5, 0.5], [0] * 6, [0, 0, 0, 0, 1, 1]),
        # per token, with the lower bound: mask drops 2 (> 1.8) and 0.5 (< 0.6), truncate clamps them
        ("mask", 1.8, 0.6, [0, 0, 1.5, 0, 0, 0.8], [0, 1, 0, 0, 0, 0], [0, 0, 0, 0, 1, 0]),
        ("truncate", 1.8, 0.6, [0, 1.8, 1.5, 0, 0.6, 0.8], [0, 1, 0, 0, 0, 0], [0, 0, 0, 0, 1, 0]),
        ("mask", None, 0.6, [0, 2, 1.5, 0, 0, 0.8], [0] * 6, [0, 0, 0, 0, 1, 0]),
    ],
)
def test_behaviour_weight_per_sequence_and_lower_bound(mode, cap, weight_min, weight, over, under):
    prox, behave, mask, cu = _two_sequences()
    w, over_T, under_T = behaviour_importance_weight_T(
        prox, behave, mask, cap=cap, mode=mode, weight_min=weight_min, cu_seqlens_B1=cu
    )
    assert w.tolist() == pytest.approx(weight, rel=1e-5)
    assert over_T.tolist() == over and under_T.tolist() == under


def test_behaviour_weight_refuses_bad_modes_and_bounds_and_a_sequence_mode_without_cu_seqlens():
    prox, behave, mask, cu = _two_sequences()
    with pytest.raises(ValueError, match="sequence_mask"):
        behaviour_importance_weight_T(prox, behave, mask, mode="sequence")
    with pytest.raises(ValueError, match="behav_imp_weight_min"):
        behaviour_importance_weight_T(prox, behave, mask, cap=2.0, weight_min=2.0)
    with pytest.raises(ValueError, match="cu_seqlens_B1"):
        behaviour_importance_weight_T(prox, behave, mask, mode="sequence_mask")


def test_decoupled_ppo_with_sequence_weights():
    """The sequence weight multiplies each token's clipped loss; the under-min fraction is logged only with
    a lower bound."""
    prox, behave, mask, cu = _two_sequences()
    logp = prox + torch.log(torch.tensor([1.0, 1.1, 1.5, 1.0, 1.0, 0.5]))  # r = 1.1, 1.5 | 1, 0.5
    adv = torch.tensor([0.0, 1.0, 1.0, 0.0, -1.0, -1.0])
    kw = dict(eps_low=0.2, behav_weight_mode="sequence_truncate", cu_seqlens_B1=cu)
    loss, st = decoupled_ppo_loss_T(logp, prox, behave, adv, mask, behav_imp_weight_cap=2.0, **kw)
    # seq 0: w = min(3, 2) = 2: -2 * min(1.1, 1.1), -2 * min(1.5, 1.2); seq 1: w = 0.4, A = -1:
    # -0.4 * min(-1, -1) = 0.4, -0.4 * min(-0.5, -0.8) = 0.32
    assert loss.tolist() == pytest.approx([0, -2.2, -2.4, 0, 0.4, 0.32], rel=1e-5)
    assert st["behave_over_cap_frac"].tolist() == [0, 1, 1, 0, 0, 0] and "behave_under_min_frac" not in st
    _, st = decoupled_ppo_loss_T(logp, prox, behave, adv, mask, behav_imp_weight_min=0.5, **kw)
    assert st["behave_under_min_frac"].tolist() == [0, 0, 0, 0, 1, 1]
    assert st["behave_weight"].tolist() == pytest.approx([0, 3, 3, 0, 0.5, 0.5], rel=1e-5)


def test_off_policy_sequence_mask_drops_far_off_sequences_of_negative_advantage():
    """DeepSeek-V3.2 / TRL: drop where A < 0 and mean over the loss tokens of log pi_behave - log pi_theta > delta
    (kept at equality); the prompt token's large gap is not a loss token's."""
    cu = torch.tensor([0, 3, 6, 9, 12])
    mask = torch.tensor([False, True, True] * 4)
    gap = torch.tensor([5.0, 0.75, 0.5, 5.0, 0.75, 0.5, 5.0, 0.5, 0.5, 5.0, 1.0, 0.25])  # means .625 .625 .5 .625
    logp = -torch.ones(12, requires_grad=True)
    behave = logp.detach() + gap
    adv = torch.tensor([0, -1.0, -1.0, 0, 1.0, 1.0, 0, -1.0, -1.0, 0, 0.5, -0.5])  # seq 3: per-token signs
    drop = off_policy_sequence_mask_T(logp, behave, adv, mask, cu, threshold=0.5)
    assert drop.tolist() == [False, True, True] + [False] * 8 + [True]


def test_loglinear_prox():
    behave = torch.tensor([-2.0, -2.0, -1.0])
    theta = torch.tensor([-1.0, -1.0, -3.0])
    versions = torch.tensor([4, 2, 5])
    prox = loglinear_prox_logprobs_T(behave, theta, versions, torch.ones(3, dtype=torch.bool), prox_version=5)
    # alpha = (5-4)/(6-4) = .5, (5-2)/(6-2) = .75, 0
    assert prox.tolist() == pytest.approx([-1.5, -1.25, -1.0])


@pytest.mark.parametrize("prox_version", [0, 1, 5])
def test_loglinear_prox_of_a_teacher_token_is_the_current_weights(prox_version):
    """Version -1 (no policy version sampled it: a teacher's) is not a version to interpolate from: the
    training forward's value, as recomputing gives it (it was (v+1)/(v+2) of the way, by the step)."""
    behave = torch.tensor([-2.0, -0.5])
    theta = torch.tensor([-1.0, -3.0])
    versions = torch.tensor([-1, prox_version])
    prox = loglinear_prox_logprobs_T(
        behave, theta, versions, torch.ones(2, dtype=torch.bool), prox_version=prox_version
    )
    assert prox.tolist() == [-1.0, -0.5]


def test_gspo_sequence_ratio():
    cu = torch.tensor([0, 3, 5])
    mask = torch.tensor([False, True, True, False, True])
    old = torch.zeros(5)
    logp = torch.tensor([0.0, 0.2, 0.4, 0.0, -0.1], requires_grad=True)
    adv = torch.tensor([0.0, 1.0, 1.0, 0.0, -2.0])
    loss, st = gspo_loss_T(logp, old, adv, mask, cu, eps_low=0.5, eps_high=0.5)
    s0, s1 = math.exp(0.3), math.exp(-0.1)
    assert loss.tolist() == pytest.approx([0, -s0, -s0, 0, 2 * s1], abs=1e-5)
    loss.sum().backward()
    # d/dlogp_t of -A s_i * exp(logp_t - sg logp_t) = -A s_i
    assert logp.grad.tolist() == pytest.approx([0, -s0, -s0, 0, 2 * s1], abs=1e-5)
    loss2, st2 = gspo_loss_T(logp, old, adv, mask, cu, eps_low=3e-4, eps_high=4e-4)
    assert loss2[1].item() == pytest.approx(-(1 + 4e-4))
    assert st2["clip_frac"].tolist() == [0, 1, 1, 0, 1]


def test_cispo_weight_is_clipped_and_constant():
    logp = torch.tensor([L(2.0), L(0.5)], requires_grad=True)
    old = torch.zeros(2)
    adv = torch.tensor([1.0, 1.0])
    loss, st = cispo_loss_T(logp, old, adv, torch.ones(2, dtype=torch.bool), eps_high=0.28)
    assert loss.tolist() == pytest.approx([-1.28 * L(2.0), -0.5 * L(0.5)], abs=1e-6)
    loss.sum().backward()
    assert logp.grad.tolist() == pytest.approx([-1.28, -0.5])  # clipped token still has a gradient
    assert st["clip_frac"].tolist() == [1.0, 0.0]


def test_kl_estimators():
    logp = torch.tensor([L(0.5), L(0.5)])
    ref = torch.tensor([L(0.25), L(0.25)])
    mask = torch.tensor([True, False])
    # log_ratio = log 2
    assert kl_estimate_T(logp, ref, mask, estimator="k1").tolist() == pytest.approx([L(2), 0])
    assert kl_estimate_T(logp, ref, mask, estimator="k2").tolist() == pytest.approx([0.5 * L(2) ** 2, 0])
    assert kl_estimate_T(logp, ref, mask, estimator="k3").tolist() == pytest.approx([0.5 + L(2) - 1, 0])
    assert kl_reward_penalty_T(logp, ref, mask, coef=0.1).tolist() == pytest.approx([-0.1 * L(2), 0])
    with pytest.raises(ValueError, match="k4"):
        kl_estimate_T(logp, ref, mask, estimator="k4")


def _expected_loss_gradient(estimator: str, student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """E_{x ~ pi}[grad kl_estimate(log pi(x), log q(x))], the sampled tokens held fixed: every token of the
    vocabulary as a sample, weighted by its (detached) probability under the student."""
    theta = student.clone().requires_grad_(True)
    logp, logq = F.log_softmax(theta, -1), F.log_softmax(teacher, -1)
    loss_V = kl_estimate_T(logp, logq, torch.ones_like(logp, dtype=torch.bool), estimator=estimator)
    (logp.exp().detach() * loss_V).sum().backward()
    return theta.grad


def test_each_kl_estimator_as_a_loss_follows_the_gradient_it_is_documented_to():
    """As a loss on the policy's own samples, k2's expected gradient is the reverse KL(pi || q)'s, k3's the
    forward KL(q || pi)'s, k1's zero (``areno.algo.kl``): why opd differentiates k2 and no loss takes k1."""
    g = torch.Generator().manual_seed(0)
    student, teacher = (
        torch.randn(6, generator=g, dtype=torch.float64),
        torch.randn(6, generator=g, dtype=torch.float64),
    )

    def grad_of(kl) -> torch.Tensor:
        theta = student.clone().requires_grad_(True)
        kl(F.log_softmax(theta, -1), F.log_softmax(teacher, -1)).backward()
        return theta.grad

    reverse = grad_of(lambda lp, lq: (lp.exp() * (lp - lq)).sum())
    forward = grad_of(lambda lp, lq: (lq.exp() * (lq - lp)).sum())
    assert (reverse - forward).abs().max() > 0.05  # the two directions differ here
    torch.testing.assert_close(_expected_loss_gradient("k2", student, teacher), reverse)
    torch.testing.assert_close(_expected_loss_gradient("k3", student, teacher), forward)
    torch.testing.assert_close(_expected_loss_gradient("k1", student, teacher), torch.zeros(6, dtype=torch.float64))


def test_value_entropy_nll():
    v = torch.tensor([1.0, 0.0, 2.0])
    old = torch.tensor([0.5, 0.5, 2.0])
    ret = torch.tensor([0.0, 1.0, 3.0])
    mask = torch.tensor([True, True, False])
    loss, st = value_loss_T(v, old, ret, mask, clip_eps=0.2)
    # t0: max(1, (.7-0)^2=.49) -> .5; t1: max(1, (.3-1)^2=.49) -> .5
    assert loss.tolist() == pytest.approx([0.5, 0.5, 0.0])
    loss2, st2 = value_loss_T(torch.tensor([0.5]), torch.tensor([1.0]), torch.tensor([0.0]), torch.tensor([True]))
    # clipped value .8 -> .5*max(.25, .64) = .32
    assert loss2.tolist() == pytest.approx([0.32])
    assert st2["value_clip_frac"].tolist() == [1.0]
    assert entropy_bonus_T(torch.tensor([2.0, 3.0]), torch.tensor([True, False]), coef=0.01).tolist() == pytest.approx(
        [-0.02, 0]
    )
    assert nll_loss_T(torch.tensor([-1.5, -2.0]), torch.tensor([True, False])).tolist() == [1.5, 0.0]


def test_dpo_and_bradley_terry():
    pc, pr, rc, rr = (torch.tensor([x]) for x in (-1.0, -3.0, -2.0, -2.5))
    loss, st = dpo_loss_B(pc, pr, rc, rr, beta=0.5)
    h = 0.5 * ((-1 + 2) - (-3 + 2.5))  # .75
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-h)))
    assert st["chosen_reward"].item() == pytest.approx(0.5)
    loss_ls, _ = dpo_loss_B(pc, pr, rc, rr, beta=0.5, label_smoothing=0.1)
    assert loss_ls.item() == pytest.approx(0.9 * math.log(1 + math.exp(-h)) + 0.1 * math.log(1 + math.exp(h)))
    bt, st = bradley_terry_loss_B(torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0]))
    assert bt.tolist() == pytest.approx(
        [-F.logsigmoid(torch.tensor(1.0)).item(), -F.logsigmoid(torch.tensor(-1.0)).item()]
    )
    assert st["accuracy"].tolist() == [1.0, 0.0]


def test_sequence_sum_and_aggregation():
    cu = torch.tensor([0, 3, 7])
    mask = torch.tensor([0, 1, 1, 0, 1, 1, 1], dtype=torch.bool)
    vals = torch.arange(7, dtype=torch.float32)
    assert sequence_sum_B(vals, cu, mask).tolist() == [3.0, 15.0]
    loss = torch.tensor([0, 1.0, 3.0, 0, 2.0, 2.0, 8.0])
    for mode, expected in (("token", 16 / 5), ("seq_mean_token_mean", (2 + 4) / 2), ("constant", 16 / (2 * 10))):
        w = aggregation_weights_T(mask, cu, mode)
        denom = aggregation_denominator(mask, cu, mode, constant=10)
        assert (loss * w).sum().item() / denom == pytest.approx(expected)
    with pytest.raises(ValueError, match="loss_aggregation"):
        aggregation_weights_T(mask, cu, "sum")
