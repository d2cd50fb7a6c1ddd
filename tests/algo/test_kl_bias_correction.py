"""``kl_bias_correction`` (TRL's ``use_bias_correction_kl``): the KL loss term times each token's importance
weight pi_theta / pi_behave. Hand-computed values and gradient, the actor's loss, and the refusals where it
would weight nothing (TRL's own loss code: tests/algo/test_trl_parity.py)."""

import math

import pytest
import torch

from areno.algo import importance_weighted_kl_T, kl_estimate_T
from areno.errors import ConfigError
from areno.recipes import get_recipe
from areno.specializations import ActorConfig, ActorSpecialization
from tests.helpers.recipes import PlainReducer, group_batch_of


def test_each_token_is_weighted_by_its_ratio_to_the_sampler():
    logp = torch.tensor([-1.0, -0.5, -2.0, -0.1], requires_grad=True)
    behave = torch.tensor([-1.2, -0.5, -1.0, -3.0])
    ref = torch.tensor([-1.1, -0.7, -1.5, -0.2])
    mask = torch.tensor([True, True, True, False])
    kl = kl_estimate_T(logp, ref, mask, estimator="k3")
    out = importance_weighted_kl_T(kl, logp, behave, mask)
    expected = [
        (math.exp(r - p) + (p - r) - 1) * math.exp(p - b)
        for p, b, r in zip([-1.0, -0.5, -2.0], [-1.2, -0.5, -1.0], [-1.1, -0.7, -1.5])
    ]
    assert out[:3].tolist() == pytest.approx(expected, rel=1e-5)  # float32 k3 near 0
    assert out[3].item() == 0.0  # off the mask
    # the weight keeps its gradient: d/dp [k3(p) e^(p - b)] = e^(p - b) (k3(p) + 1 - e^(r - p))
    out.sum().backward()
    grads = []
    for p, b, r in zip([-1.0, -0.5, -2.0], [-1.2, -0.5, -1.0], [-1.1, -0.7, -1.5]):
        k3 = math.exp(r - p) + (p - r) - 1
        grads.append(math.exp(p - b) * (k3 + 1 - math.exp(r - p)))
    assert logp.grad[:3].tolist() == pytest.approx(grads, rel=1e-5)
    assert logp.grad[3].item() == 0.0


def test_a_far_off_token_is_clamped_not_inf():
    out = importance_weighted_kl_T(torch.tensor([1.0]), torch.tensor([0.0]), torch.tensor([-200.0]), torch.tensor([1]))
    assert out.item() == pytest.approx(math.exp(20.0))


def _actor_loss(**kwargs):
    batch = group_batch_of([("g", 1.0, 2, 3), ("g", 0.0, 2, 4), ("h", 0.5, 3, 2), ("h", 0.2, 2, 3)], seed=3)
    gen = torch.Generator().manual_seed(4)
    logp = (batch.logprobs_T + 0.3 * torch.randn(batch.num_tokens, generator=gen)).requires_grad_(True)
    batch.extra["ref_logprobs_T"] = batch.logprobs_T + 0.2 * torch.randn(batch.num_tokens, generator=gen)
    spec = ActorSpecialization(ActorConfig(kl_coef=0.5, **kwargs))
    batch = spec.prepare_batch(batch)
    loss, metrics = spec.compute_loss({"logprobs_T": logp}, batch, PlainReducer(spec.denominator(batch)))
    return loss, metrics, logp, batch


def test_the_actor_adds_the_weighted_term():
    plain, plain_metrics, _, _ = _actor_loss()
    weighted, metrics, logp, batch = _actor_loss(kl_bias_correction=True)
    mask = batch.loss_mask_T.bool()
    kl = kl_estimate_T(logp.detach(), batch.extra["ref_logprobs_T"], mask)
    w = torch.exp(logp.detach() - batch.logprobs_T)
    # the loss's token mean moves by kl_coef x mean(k3 (w - 1)) over the loss tokens
    shift = 0.5 * ((kl * (w - 1))[mask]).sum() / mask.sum()
    assert weighted.item() - plain.item() == pytest.approx(shift.item(), rel=1e-4)
    assert metrics["actor/kl"].item() == pytest.approx((kl * w)[mask].mean().item(), rel=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        ({"kl_bias_correction": True}, "kl_coef is 0, so there is no KL term to weight"),
        (
            {"kl_bias_correction": True, "kl_coef": 0.1, "kl_in_reward": True, "advantage_estimator": "reinforce_pp"},
            "the KL is a reward penalty here",
        ),
    ],
)
def test_refused_where_it_weights_nothing(kwargs, why):
    recipe = "grpo" if "kl_in_reward" not in kwargs else "reinforce_pp"
    kwargs = {k: v for k, v in kwargs.items() if recipe == "grpo" or k != "advantage_estimator"}
    with pytest.raises(ConfigError, match=why) as info:
        get_recipe(recipe, policy_kwargs=kwargs)
    assert "kl_bias_correction" in str(info.value) and "\n" not in str(info.value)
