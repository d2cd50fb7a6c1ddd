"""Logged metric values checked against what the step really did (walk44): the figures a researcher
reads to decide whether a run learns must be about the step they are logged with."""

from __future__ import annotations

from areno.api.config import load_config
from tests.helpers.configs import run_to_end, tiny_run_overrides


def test_rollout_version_follows_the_policy_in_a_synchronous_run(tmp_path):
    """``rollout/version`` is the version the step's rollouts were sampled with: step N's is N - 1 in a
    synchronous run (it read 0 at every step: only an asynchronous pool was told of a sync)."""
    overrides = [
        *tiny_run_overrides(tmp_path),
        "reward.sandbox=false",
        "data.num_eval=0",
        "train.eval_interval=0",
        "train.steps=3",
    ]
    rows = run_to_end(load_config(None, overrides))
    steps = [r for r in rows if "rollout/version" in r]
    assert [(r["step"], r["rollout/version"]) for r in steps] == [(1, 0.0), (2, 1.0), (3, 2.0)]


def test_the_rollout_logs_the_rewards_and_lengths_extremes():
    """walk44 P2: reward and completion length min and max beside their mean (the NaN a workflow set left out)."""
    from areno.engine.api import rollout_metrics
    from areno.types import Trajectory

    def traj(reward, n):
        return Trajectory(prompt_ids=[1], completion_ids=[2] * n, logprobs=[0.0] * n, versions=[0] * n, reward=reward)

    m = rollout_metrics([traj(0.5, 3), traj(-1.0, 7), traj(float("nan"), 1), traj(2.0, 4)], version=0)
    assert (m["rollout/reward_min"], m["rollout/reward_max"]) == (-1.0, 2.0)
    assert (m["rollout/completion_len_min"], m["rollout/completion_len_max"]) == (1.0, 7.0)
