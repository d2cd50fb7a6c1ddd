"""DAPO's re-sampling rounds (walk45): a later round whose few samples the workflow all rejects is not a broken
rollout, and a run that dynamic sampling leaves nothing to train on because the reward fails names the reward."""

from __future__ import annotations

import re

import pytest

from areno.api.config import load_config
from areno.api.trainer import Trainer
from areno.engine.executor import RolloutPoolBroken
from tests.helpers.configs import run_to_end, tiny_run_overrides


def dapo_config(tmp_path, *extra):
    return load_config(
        None,
        [
            *tiny_run_overrides(tmp_path),
            "train.algorithm=dapo",
            "reward.sandbox=false",
            "train.eval_interval=0",
            "data.num_eval=0",
            "train.steps=1",
            "rollout.n_samples=2",
            *extra,
        ],
    )


def test_a_later_round_whose_samples_are_all_rejected_does_not_stop_the_step(tmp_path):
    """Round 1 keeps one group of two (the other's rewards are equal); round 2's two samples are both
    rejected by the workflow; round 3 fills the batch. The step trains two groups."""
    rows = run_to_end(dapo_config(tmp_path, "rollout.workflow=tests.helpers.workflows:ScriptedDynamicSamplingWorkflow"))
    (row,) = [r for r in rows if "rollout/num_seqs" in r]
    assert row["rollout/sampling_rounds"] == 3
    assert row["rollout/num_seqs"] == 4 and row["rollout/rejected"] == 2 and row["rollout/filtered_groups"] == 1
    assert row["train/policy/dynamic_sampling_dropped_seqs"] == 0


@pytest.mark.parametrize("eta", [0, 1])
@pytest.mark.parametrize(
    ("fault", "named"),
    [
        ("reward.fn=tests.helpers.rewards:exploding", r"RuntimeError: reward bug\): fix reward\.fn$"),
        (
            "rollout.workflow=tests.helpers.workflows:AllRewardsNanWorkflow",
            r"to nan: scored 0\): fix rollout\.workflow",
        ),
    ],
    ids=["reward_fn", "workflow"],
)
def test_a_failing_reward_is_named_not_the_policy(tmp_path, eta, fault, named):
    """Every reward failing scores every group 0, which dynamic sampling filters: the run stops naming the
    failure (as GRPO's RewardsFailing does), not prompts the policy solves or fails alike."""
    cfg = dapo_config(
        tmp_path,
        fault,
        f"rollout.max_head_offpolicyness={eta}",
        "train.algorithm_kwargs={dynamic_sampling_max_rounds: 2}",
    )
    trainer = Trainer.init(cfg)
    try:
        with pytest.raises(RolloutPoolBroken, match=r"dynamic sampling kept no group of .*every reward failed") as info:
            trainer.run()
    finally:
        trainer.shutdown()
    first = str(info.value).split("; the training side")[0]
    assert "rewards were equal" not in first
    assert re.search(named, first), first
