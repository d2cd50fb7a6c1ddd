"""Adaptive KL control (Ziegler et al. 2019; verl's ``kl_ctrl.type=adaptive``): ``train.algorithm_kwargs.
kl_target`` multiplies the KL coefficient after each optimizer step by 1 + clip(KL / target - 1, +-0.2) n /
``kl_horizon``. The rule by hand, the loss and the reward penalty it applies, the refusals, ppo_kl's critic
following the moved coefficient, a run's logged coefficient against the rule, and a resumed run against an
uninterrupted one."""

from __future__ import annotations

import pytest
import torch

from areno.algo import gae_T, kl_reward_penalty_T
from areno.api.config import load_config
from areno.api.preflight import check_run
from areno.api.trainer import Trainer
from areno.errors import ConfigError
from areno.recipes import get_recipe
from areno.specializations import ActorConfig, ActorSpecialization
from areno.specializations.base import with_extra
from tests.helpers.configs import resumable_run, tiny_run_overrides
from tests.helpers.recipes import PlainReducer, group_batch_of


def test_the_coefficient_follows_the_kl_by_hand():
    spec = ActorSpecialization(ActorConfig(kl_coef=0.1, kl_target=0.05, kl_horizon=100.0))
    seen = []
    for kl in (0.05, 0.1, 0.0, 0.055):
        seen.append(spec.after_optimizer_step({"actor/kl": kl, "batch_seqs": 10.0})["actor/kl_coef"])
    # e = clip(kl / 0.05 - 1, -0.2, 0.2): 0, 0.2 (capped from 1), -0.2 (capped from -1), 0.1; x (1 + e 10 / 100)
    expected = [0.1, 0.1, 0.1 * 1.02, 0.1 * 1.02 * 0.98]
    assert seen == pytest.approx(expected)
    assert spec.state_dict() == {"kl_coef": pytest.approx(0.1 * 1.02 * 0.98 * 1.01)}
    # a step that trained no token (no actor/kl) leaves it where it was
    assert spec.after_optimizer_step({"loss": 0.0, "batch_seqs": 10.0}) == {"actor/kl_coef": spec._kl_coef}
    fixed = ActorSpecialization(ActorConfig(kl_coef=0.1))
    assert fixed.after_optimizer_step({"actor/kl": 1.0, "batch_seqs": 10.0}) == {} and fixed.state_dict() == {}


def _batch(spec):
    batch = group_batch_of([("g", 1.0, 2, 3), ("g", 0.0, 2, 4)], seed=3)
    ref = batch.logprobs_T - 0.3 * batch.loss_mask_T.float()  # a reference 0.3 nats below the behaviour policy
    return spec.prepare_batch(with_extra(batch, ref_logprobs_T=ref))


def _loss(spec) -> float:
    batch = _batch(spec)
    logp = batch.logprobs_T.clone().requires_grad_(True)
    loss, _ = spec.compute_loss({"logprobs_T": logp}, batch, PlainReducer(spec.denominator(batch)))
    return loss.item()


def test_the_loss_and_the_reward_penalty_apply_the_moved_coefficient():
    spec = ActorSpecialization(ActorConfig(kl_coef=0.1, kl_target=1.0, kl_horizon=10.0))
    without = ActorSpecialization(ActorConfig())
    kl_term = (_loss(spec) - _loss(without)) / 0.1  # the KL's share of the loss at coefficient 0.1
    spec.after_optimizer_step({"actor/kl": 0.0, "batch_seqs": 10.0})  # x 0.8
    assert _loss(spec) - _loss(without) == pytest.approx(0.08 * kl_term, rel=1e-4)  # float32 sums
    # in the reward: the token rewards carry -coef x k1, so the advantages of a lone group's samples move with it
    in_reward = dict(kl_coef=0.1, kl_in_reward=True, kl_estimator="k1", advantage_estimator="reinforce_pp")
    moved = ActorSpecialization(ActorConfig(**in_reward, kl_target=1.0, kl_horizon=10.0))
    before = _batch(moved).advantages_T.clone()
    moved.after_optimizer_step({"actor/kl": 10.0, "batch_seqs": 10.0})  # x 1.2
    assert not torch.equal(_batch(moved).advantages_T, before)
    assert moved._kl_coef == pytest.approx(0.12)


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"kl_target": 0.1}, "kl_target must be > 0 (the KL adaptive control holds the policy at"),
        ({"kl_coef": 0.1, "kl_target": 0.0}, "kl_target must be > 0"),
        ({"kl_coef": 0.1, "kl_target": 0.1, "kl_horizon": 0.0}, "kl_horizon must be > 0"),
    ],
)
def test_settings_that_cannot_apply_are_refused_in_one_line(kwargs, says):
    with pytest.raises(ConfigError) as info:
        get_recipe("grpo", policy_kwargs=kwargs)
    assert says in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_a_critic_that_takes_the_kl_into_its_returns_follows_the_moved_coefficient(tmp_path):
    """ppo_kl (the KL in the actor's and the critic's rewards): after a step moved the coefficient, the next step's
    critic returns take the moved one, as the policy's advantages do: GAE by hand with that penalty."""
    overrides = [*tiny_run_overrides(tmp_path), "train.algorithm=ppo_kl"]
    cfg = load_config(None, overrides + ["train.algorithm_kwargs={kl_coef: 0.2, kl_target: 0.002, kl_horizon: 20}"])
    check_run(cfg)
    trainer = Trainer.init(cfg)
    try:
        trainer.train(0, trainer.rollout_token_batch(0))
        runner = trainer.backend.engine.training.runner
        batch = trainer.rollout_token_batch(1).batch
        prepared = runner.prepare(batch)
    finally:
        trainer.shutdown()
    coef = runner.specs["policy"]._kl_coef
    critic = runner.specs["value"]
    assert coef != pytest.approx(0.2) and critic.kl_coef == coef
    value = prepared["value"]
    penalty_T = kl_reward_penalty_T(
        value.logprobs_T, value.extra["ref_logprobs_T"], value.loss_mask_T, coef=coef, estimator=critic.kl_estimator
    )
    _, returns_T = gae_T(
        value.rewards_B,
        value.extra["old_values_T"],
        value.cu_seqlens_B1,
        value.loss_mask_T,
        gamma=critic.gamma,
        lam=critic.gae_lambda,
        token_rewards_T=penalty_T,
    )
    torch.testing.assert_close(value.extra["returns_T"], returns_T)


KWARGS = "{kl_coef: 0.2, kl_target: 0.002, kl_horizon: 20}"


def test_a_run_logs_the_rule_and_a_resumed_run_goes_on_as_the_uninterrupted_one(tmp_path):
    whole = resumable_run(tmp_path, "whole", 4, KWARGS)
    resumable_run(tmp_path, "parts", 2, KWARGS)
    resumed = resumable_run(tmp_path, "parts", 4, KWARGS)
    by_step = {int(r["step"]): r for r in whole if "train/policy/loss" in r}
    coefs = [by_step[s]["train/policy/actor/kl_coef"] for s in (1, 2, 3, 4)]
    assert coefs[0] == 0.2
    for s in (1, 2, 3):  # each step's coefficient from the step before: its KL, 2 prompts x 4 samples
        error = min(max(by_step[s]["train/policy/actor/kl"] / 0.002 - 1, -0.2), 0.2)
        assert coefs[s] == pytest.approx(coefs[s - 1] * (1 + error * 8 / 20)), s
    assert len(set(coefs)) > 1
    for row in (r for r in resumed if "train/policy/loss" in r):
        for key in ("train/policy/loss", "train/policy/actor/kl_coef"):
            assert row[key] == by_step[int(row["step"])][key], (row["step"], key)
