"""A reward a workflow sets itself: a number of any real type is taken as a float, anything else (a string,
None, a reward call not awaited) is one line naming run_episode; a NaN or inf is scored 0 and warned about as
a reward function's is, instead of zeroing its group's advantages (GRPO) or the whole batch (rloo). A batch of
which nothing can train (every group one trajectory under a group recipe, no completion token marked) is
warned about once."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch

from areno.api.config import load_config
from areno.api.trainer import Trainer
from areno.engine import api as engine_api
from areno.types import Trajectory
from areno.workflows.base import NONFINITE_REWARD_KEY, WorkflowReturnError, as_group
from tests.helpers.configs import tiny_run_overrides


def _traj(reward) -> Trajectory:
    return Trajectory(prompt_ids=[1], completion_ids=[2], logprobs=[-0.5], versions=[0], reward=reward)


@pytest.mark.parametrize(
    "reward",
    [1, True, np.bool_(True), np.float32(0.5), np.int64(2), np.array(0.5), torch.tensor(0.25), torch.tensor([0.75])],
)
def test_a_real_number_of_any_type_is_taken_as_a_float(reward):
    (traj,) = as_group(_traj(reward), source="W.run_episode")
    assert type(traj.reward) is float and traj.reward == float(reward) and "reward_error" not in traj.info


async def _score():
    return 1.0


@pytest.mark.parametrize(
    "reward, said",
    [
        ("1.0", "W.run_episode set Trajectory.reward to str '1.0', not a number: set a float"),
        (None, "W.run_episode set Trajectory.reward to NoneType None, not a number: set a float"),
        (torch.ones(2), "W.run_episode set Trajectory.reward to Tensor"),
        (
            "coroutine",
            "W.run_episode set Trajectory.reward to a coroutine, not a number: await it "
            "(reward = await self.reward_fn(...))",
        ),
    ],
)
def test_a_reward_that_is_not_a_number_is_one_line_naming_run_episode(reward, said, recwarn):
    reward = _score() if reward == "coroutine" else reward
    with pytest.raises(WorkflowReturnError) as info:
        as_group([_traj(1.0), _traj(reward)], source="W.run_episode")
    assert str(info.value).startswith(said) and "\n" not in str(info.value)
    assert not [w for w in recwarn if "never awaited" in str(w.message)]


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_non_finite_reward_is_scored_0_and_marked(value):
    shared = {"row": 3}
    group = as_group([_traj(value), _traj(0.5)], source="W.run_episode")
    group[1].info = shared
    assert [t.reward for t in group] == [0.0, 0.5]
    assert group[0].info["reward_error"] == f"W.run_episode set Trajectory.reward to {value}: scored 0"
    assert group[0].info[NONFINITE_REWARD_KEY] and NONFINITE_REWARD_KEY not in group[1].info
    metrics = engine_api.rollout_metrics(group, 0)
    assert metrics["rollout/reward_nonfinite"] == 1.0 and metrics["rollout/reward_mean"] == 0.25


def _trainer(tmp_path, workflow: str, *extra: str) -> Trainer:
    cfg = load_config(
        None,
        [
            *tiny_run_overrides(tmp_path),
            f"rollout.workflow=tests.helpers.workflows:{workflow}",
            "train.eval_interval=0",
            *extra,
        ],
    )
    return Trainer.init(cfg)


@pytest.mark.parametrize("algorithm", ["grpo", "rloo"])
def test_a_nan_a_workflow_sets_leaves_its_group_training(tmp_path, caplog, algorithm):
    trainer = _trainer(
        tmp_path,
        "FirstRewardNanWorkflow",
        "reward.fn=tests.helpers.rewards:digit_fraction",
        f"train.algorithm={algorithm}",
    )
    try:
        with caplog.at_level(logging.WARNING):
            rollout = trainer.rollout_token_batch(0)
            metrics = trainer.train(0, rollout)
    finally:
        trainer.shutdown()
    rewards = [t.reward for t in rollout.trajectories]
    assert all(math.isfinite(r) for r in rewards) and rewards[0] == 0.0 and rewards[4] == 0.0
    assert rollout.metrics["rollout/reward_nonfinite"] == 2.0
    assert math.isfinite(metrics["train/policy/loss"]) and metrics["train/policy/grad_norm"] > 0
    said = [r.getMessage() for r in caplog.records if "scored 0" in r.getMessage()]
    assert len(said) == 1 and "FirstRewardNanWorkflow.run_episode set Trajectory.reward to nan: scored 0" in said[0]


@pytest.mark.parametrize(
    "workflow, said",
    [
        ("OneByOneWorkflow", "every group of step 1's rollout batch holds one trajectory: recipe 'grpo' "),
        ("MaskedOutWorkflow", "no trajectory of step 1's rollout batch has a completion token to train"),
    ],
)
def test_a_batch_of_which_nothing_trains_is_warned_about_once(tmp_path, caplog, monkeypatch, workflow, said):
    monkeypatch.setattr(engine_api, "_UNTRAINABLE_WARNED", set())
    trainer = _trainer(tmp_path, workflow, "train.steps=2")
    try:
        with caplog.at_level(logging.WARNING):
            trainer.run()
    finally:
        trainer.shutdown()
    warned = [r.getMessage() for r in caplog.records if said in r.getMessage()]
    assert len(warned) == 1 and f"tests.helpers.workflows:{workflow}" in warned[0], warned


def test_export_policy_takes_a_string_path(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path, "OneByOneWorkflow")
    monkeypatch.chdir(tmp_path)
    try:
        trainer.backend.export_policy("exported")  # as docs/python.md writes it
    finally:
        trainer.shutdown()
    assert (tmp_path / "exported" / "config.json").is_file() and (tmp_path / "exported" / "tokenizer.json").is_file()


def test_a_run_whose_workflow_sets_every_reward_nan_stops_naming_the_workflow(tmp_path):
    trainer = _trainer(tmp_path, "AllRewardsNanWorkflow", "train.steps=3", "reward.sandbox=false")
    try:
        with pytest.raises(engine_api.RewardsFailing) as info:
            trainer.run()
    finally:
        trainer.shutdown()
    message = str(info.value)
    assert message.startswith("every reward of the last 3 rollout batches was NaN or inf (step 3; last: ")
    assert "fix rollout.workflow (tests.helpers.workflows:AllRewardsNanWorkflow)" in message
    assert "reward.fn" not in message and "\n" not in message
