"""SAPO's sigmoid gate and VESPO's gamma-shaped sequence weight (TRL's ``loss_type="sapo"`` / ``"vespo"``):
values and gradients against hand computations, the recipes that ship them, and their options refused where
they do nothing."""

from __future__ import annotations

import math

import pytest
import torch

from areno.algo.policy_loss import sapo_loss_T, vespo_loss_T
from areno.errors import ConfigError
from areno.recipes import get_recipe
from areno.specializations import ActorConfig

L = math.log


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_sapo_against_hand_computed_values_and_gradients():
    # ratios 2 (A = +1, tau 1), 0.5 (A = -2, tau 1.05), 1 (A = +0.5); the last token is outside the loss
    logp = torch.tensor([L(2.0), L(0.5), 0.0, 3.0], requires_grad=True)
    old = torch.zeros(4)
    adv = torch.tensor([1.0, -2.0, 0.5, 1.0])
    mask = torch.tensor([True, True, True, False])
    loss, st = sapo_loss_T(logp, old, adv, mask, temperature_pos=1.0, temperature_neg=1.05)
    s0, s1 = sigmoid(1.0 * (2 - 1)), sigmoid(1.05 * (0.5 - 1))
    expected = [-s0 * 4 / 1.0 * 1.0, -s1 * 4 / 1.05 * -2.0, -0.5 * 4 * 0.5, 0.0]
    assert loss.tolist() == pytest.approx(expected, rel=1e-6)
    loss.sum().backward()
    # d/dlogp = -A * 4 s (1 - s) * r (the sigmoid's derivative times tau, over tau, times dr/dlogp = r)
    grads = [-1.0 * 4 * s0 * (1 - s0) * 2.0, 2.0 * 4 * s1 * (1 - s1) * 0.5, -0.5, 0.0]
    assert logp.grad.tolist() == pytest.approx(grads, rel=1e-6)
    assert st["soft_gate"].tolist() == pytest.approx([4 * s0 * (1 - s0), 4 * s1 * (1 - s1), 1.0, 0.0], rel=1e-6)


def test_vespo_against_hand_computed_weights_and_gradients():
    # sequence 0: tokens log-ratios log 2, log 1.5 -> w = 3, A = +1 (k 2, lambda 3); sequence 1: one token of ratio
    # 0.5, A = -1 (k 3, lambda 2); sequence 2: ratio 1, phi(1) = 1
    logp = torch.tensor([L(2.0) - 1.0, L(1.5) - 1.0, L(0.5) - 2.0, -0.5], requires_grad=True)
    old = torch.tensor([-1.0, -1.0, -2.0, -0.5])
    adv = torch.tensor([1.0, 1.0, -1.0, 0.7])
    mask = torch.ones(4, dtype=torch.bool)
    cu = torch.tensor([0, 2, 3, 4])
    loss, st = vespo_loss_T(logp, old, adv, mask, cu, k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0)
    phi0 = math.exp(3 + 2 * L(3.0) - 3 * 3.0)
    phi1 = math.exp(2 + 3 * L(0.5) - 2 * 0.5)
    phis = [phi0, phi0, phi1, 1.0]
    assert st["vespo_weight"].tolist() == pytest.approx(phis, rel=1e-5)
    assert loss.tolist() == pytest.approx(
        [-p * a * lp for p, a, lp in zip(phis, adv.tolist(), logp.tolist())], rel=1e-5
    )
    loss.sum().backward()
    assert logp.grad.tolist() == pytest.approx([-p * a for p, a in zip(phis, adv.tolist())], rel=1e-5)  # phi constant
    assert st["ratio"].tolist() == pytest.approx([3.0, 3.0, 0.5, 1.0], rel=1e-5)


def test_vespo_weight_of_a_far_off_sequence_is_bounded_and_finite():
    logp = torch.tensor([30.0, 30.0])  # each token's log-ratio clamped to 20, the sum to 20: w = e^20
    loss, st = vespo_loss_T(logp, torch.zeros(2), torch.ones(2), torch.ones(2, dtype=torch.bool), torch.tensor([0, 2]))
    assert torch.isfinite(loss).all() and st["vespo_weight"].tolist() == [0.0, 0.0]


@pytest.mark.parametrize(
    ("name", "loss", "aggregation"), [("sapo", "sapo", "seq_mean_token_mean"), ("vespo", "vespo", "token")]
)
def test_the_recipes_ship_trls_defaults(name, loss, aggregation):
    c = get_recipe(name).policy_role.build().config
    assert (c.policy_loss, c.loss_aggregation, c.advantage_estimator) == (loss, aggregation, "grpo")
    assert (c.sapo_temperature_pos, c.sapo_temperature_neg) == (1.0, 1.05)
    assert (c.vespo_k_pos, c.vespo_lambda_pos, c.vespo_k_neg, c.vespo_lambda_neg) == (2.0, 3.0, 3.0, 2.0)


@pytest.mark.parametrize(
    ("name", "kwargs", "says"),
    [
        ("sapo", {"clip_eps": 0.3}, "policy_loss sapo has no clip"),
        ("grpo", {"sapo_temperature_neg": 2.0}, "only policy_loss=sapo reads it"),
        ("sapo", {"vespo_k_neg": 1.0}, "only policy_loss=vespo reads it"),
        ("vespo", {"clip_eps_high": 0.3}, "policy_loss vespo has no clip"),
    ],
)
def test_options_that_do_nothing_are_refused(name, kwargs, says):
    with pytest.raises(ConfigError, match=says):
        get_recipe(name, policy_kwargs=kwargs)


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"sapo_temperature_pos": 0.0}, "ActorConfig.sapo_temperature_pos must be > 0"),
        ({"vespo_lambda_neg": -1.0}, "ActorConfig.vespo_lambda_neg must be > 0"),
        ({"vespo_k_pos": -0.5}, "ActorConfig.vespo_k_pos must be >= 0"),
        ({"policy_loss": "sapo", "use_decoupled_loss": True}, "use_decoupled_loss works with policy_loss='ppo' only"),
    ],
)
def test_bad_values_are_one_line_naming_the_key(kwargs, says):
    with pytest.raises(ConfigError) as info:
        ActorConfig(**kwargs)
    assert says in str(info.value) and "\n" not in str(info.value)
