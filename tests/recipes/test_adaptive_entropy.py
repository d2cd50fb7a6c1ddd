"""Adaptive entropy control (Skywork-OR1; TRL's ``use_adaptive_entropy``): ``train.algorithm_kwargs.
entropy_target`` moves the entropy bonus's coefficient by ``entropy_coef_delta`` after each optimizer step, up
where the step's entropy was at or below the target and down otherwise, within its bounds; a step applies the
bonus only while the previous step's entropy was at or below the target. The rule by hand, the loss it
applies, the runner's metrics, the refusals, and a resumed run against an uninterrupted one."""

from __future__ import annotations

import math

import pytest
import torch

from areno.errors import ConfigError
from areno.recipes import get_recipe
from areno.recipes.runner import RecipeRunner
from areno.specializations import ActorConfig, ActorSpecialization
from areno.train import LocalTrainBackend, TrainBackendConfig
from tests.helpers.configs import resumable_run
from tests.helpers.recipes import PlainReducer, group_batch_of, rl_batch_for, tiny_policy_dir


def test_the_coefficient_follows_the_entropy_by_hand():
    spec = ActorSpecialization(
        ActorConfig(entropy_coef=0.01, entropy_target=0.5, entropy_coef_delta=0.02, entropy_coef_max=0.04)
    )
    seen = []
    for entropy in (0.4, 0.3, 0.45, 0.6, 0.7, 0.1):
        out = spec.after_optimizer_step({"actor/entropy": entropy})
        seen.append((out["actor/entropy_coef_applied"], out["actor/entropy_coef"]))
    expected = [
        (0.0, 0.03),  # no measurement before the first step: no bonus; 0.4 <= 0.5: up
        (0.03, 0.04),  # up, capped at the max
        (0.04, 0.04),
        (0.04, 0.02),  # 0.6 > 0.5: down
        (0.0, 0.0),  # the last step's entropy was above the target: no bonus; down to the min
        (0.0, 0.02),  # 0.7 > 0.5 still gates this step; 0.1 <= 0.5: up
    ]
    assert seen == [pytest.approx(e) for e in expected]
    # a step that trained no token (no actor/entropy) leaves the controller where it was
    assert spec.after_optimizer_step({"loss": 0.0}) == {"actor/entropy_coef": 0.02, "actor/entropy_coef_applied": 0.02}
    assert spec.state_dict() == {"entropy_coef": pytest.approx(0.02), "last_entropy": 0.1}


def test_without_a_target_nothing_moves():
    spec = ActorSpecialization(ActorConfig(entropy_coef=0.01))
    assert spec.after_optimizer_step({"actor/entropy": 0.1}) == {} and spec.state_dict() == {}
    assert spec._applied_entropy_coef() == 0.01


def _loss(spec):
    batch = spec.prepare_batch(group_batch_of([("g", 1.0, 2, 3), ("g", 0.0, 2, 4)], seed=3))
    logp = batch.logprobs_T.clone().requires_grad_(True)
    entropy = torch.linspace(0.1, 1.0, batch.num_tokens)
    loss, metrics = spec.compute_loss(
        {"logprobs_T": logp, "entropy_T": entropy}, batch, PlainReducer(spec.denominator(batch))
    )
    mask = batch.loss_mask_T.bool()
    return loss.item(), entropy[mask].mean().item(), metrics


def test_the_loss_applies_the_gated_coefficient():
    spec = ActorSpecialization(ActorConfig(entropy_coef=0.2, entropy_target=0.5))
    assert spec.gradient_free_B is not None and spec._entropy_bonus_possible
    before, mean_entropy, metrics = _loss(spec)  # no measurement yet: no bonus
    assert metrics["actor/entropy"].item() == pytest.approx(mean_entropy)
    spec.after_optimizer_step({"actor/entropy": 0.3})  # at or below the target: 0.2 + 0.005 applies next
    after, _, _ = _loss(spec)
    assert after - before == pytest.approx(-0.205 * mean_entropy, rel=1e-5)


def test_a_runner_logs_the_controller_and_the_backend_forwards_every_sequence(tmp_path):
    """Three steps of grpo on a tiny model, a target far above any entropy: the coefficient climbs by delta
    each step, applied from the second; group c's equal rewards (zero advantage) still train, as the bonus
    reaches them."""
    policy_dir = tiny_policy_dir(tmp_path)
    recipe = get_recipe(
        "grpo", policy_kwargs={"entropy_coef": 0.1, "entropy_target": 100.0, "entropy_coef_delta": 0.05}
    )
    backend = LocalTrainBackend(TrainBackendConfig(lr=1e-2, device="cpu", max_tokens_per_mb=64, seed=0, grad_clip=None))
    backend.initialize(policy_dir)
    runner = RecipeRunner(recipe, {"policy": backend})
    shared = []  # what a role worker's copy of the specialization would be sent (RemoteRoleBackend)
    backend.load_specialization_state = shared.append
    batch = rl_batch_for(policy_dir)
    rows = [runner.step(batch) for _ in range(3)]
    assert [s["entropy_coef"] for s in shared] == pytest.approx([0.15, 0.2, 0.25])
    assert [r["policy/actor/entropy_coef_applied"] for r in rows] == pytest.approx([0.0, 0.15, 0.2])
    assert [r["policy/actor/entropy_coef"] for r in rows] == pytest.approx([0.15, 0.2, 0.25])
    assert all(math.isfinite(r["policy/actor/entropy"]) for r in rows)
    assert all("policy/skipped_zero_grad_seqs" not in r for r in rows)
    state = runner.checkpoint_state("policy", {"data": 1})
    assert state == {
        "data": 1,
        "specialization_state": {"entropy_coef": pytest.approx(0.25), "last_entropy": rows[-1]["policy/actor/entropy"]},
    }


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"entropy_coef_delta": 0.01}, "only adaptive entropy control moves the coefficient"),
        ({"entropy_coef_max": 0.5}, "set entropy_target too"),
        ({"entropy_target": 0.0}, "entropy_target must be > 0"),
        ({"entropy_target": 0.2, "entropy_coef_delta": 0.0}, "entropy_coef_delta must be > 0"),
        ({"entropy_target": 0.2, "entropy_coef_min": 0.5, "entropy_coef_max": 0.1}, "entropy_coef_min must be >= 0"),
    ],
)
def test_settings_that_cannot_apply_are_refused_in_one_line(kwargs, says):
    with pytest.raises(ConfigError) as info:
        get_recipe("grpo", policy_kwargs=kwargs)
    assert says in str(info.value) and "\n" not in str(info.value), str(info.value)


def _run(tmp_path, name: str, steps: int):
    # a target above the tiny model's entropies (~4.6 nats): the coefficient climbs, applied from step 2
    return resumable_run(tmp_path, name, steps, "{entropy_coef: 0.05, entropy_target: 10.0, entropy_coef_delta: 0.02}")


def test_a_resumed_run_goes_on_as_the_uninterrupted_one(tmp_path):
    whole = _run(tmp_path, "whole", 4)
    _run(tmp_path, "parts", 2)
    resumed = _run(tmp_path, "parts", 4)
    keys = ("train/policy/loss", "train/policy/actor/entropy_coef", "train/policy/actor/entropy_coef_applied")
    by_step = {int(r["step"]): r for r in whole if "train/policy/loss" in r}
    assert sorted(by_step) == [1, 2, 3, 4]
    for row in (r for r in resumed if "train/policy/loss" in r):
        for key in keys:
            assert row[key] == by_step[int(row["step"])][key], (row["step"], key)
    # the resumed step 3 applies what step 2 left: the checkpoint kept the coefficient and the last entropy
    applied = [by_step[s]["train/policy/actor/entropy_coef_applied"] for s in (1, 2, 3, 4)]
    assert applied == pytest.approx([0.0, 0.07, 0.09, 0.11])
