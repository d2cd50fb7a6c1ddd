"""DAPO's dynamic sampling samples again until the batch is full (``ActorConfig.dynamic_sampling_max_rounds``):
the rollout filters groups whose rewards are all equal (``WorkflowExecutor``'s ``group_filter``), a synchronous
step runs further rounds for the missing groups, the asynchronous pool generates on, and a run whose groups are
all filtered stops in one line instead of training on nothing."""

from __future__ import annotations

import pytest

from areno.algo.filters import dynamic_sampling_kept
from areno.api.config import load_config
from areno.engine.executor import RolloutPoolBroken, WorkflowExecutor
from areno.engine.staleness import StalenessManager
from areno.errors import ConfigError
from areno.recipes import get_recipe
from areno.types import Trajectory
from tests.helpers.configs import run_to_end, tiny_run_overrides
from tests.helpers.groups import GroupWorkflow, Released, engine, flat, varied


def test_the_pool_fills_its_batch_with_groups_whose_rewards_vary():
    rows = [flat(i) if i % 2 else varied(i) for i in range(40)]
    source = Released(rows)
    staleness = StalenessManager(max_head_offpolicyness=0, batch_size=4, max_concurrent=4)
    with WorkflowExecutor(
        engine(), GroupWorkflow(), source, staleness, group_filter=dynamic_sampling_kept, max_filtered_batches=3
    ) as ex:
        groups = ex.wait_batch(4, timeout=20)
        metrics = ex.metrics()
    assert len(groups) == 4
    assert all(g[0].info["id"] % 2 == 0 for g in groups)  # only the varied groups reach training
    assert metrics["rollout/filtered_groups"] >= 3 and metrics["rollout/filtered_trajectories"] >= 6
    filtered = {i for i in source.released}
    assert filtered and all(i % 2 for i in filtered)  # a filtered sample is done, untrained


def test_the_filter_keeps_the_varied_groups_of_an_episode():
    """An episode of several groups keeps those whose rewards vary; its flat ones are counted."""
    sample = {"id": 0, "rewards": {"a": [1.0, 1.0], "b": [0.0, 0.5]}}
    ex = WorkflowExecutor(engine(), GroupWorkflow(), group_filter=dynamic_sampling_kept, max_filtered_batches=2)
    try:
        (group, part), *rest = ex.rollout_groups([sample, flat(1)])
    finally:
        ex.stop()
    assert not rest  # sample 1 is filtered whole
    assert [t.group_id for t in group] == ["0/b", "0/b"] and part.num_seqs == 2
    counts = ex.metrics()
    assert counts["rollout/filtered_groups"] == 1 and counts["rollout/filtered_trajectories"] == 4


def test_a_synchronous_batch_all_filtered_is_not_a_broken_rollout():
    ex = WorkflowExecutor(engine(), GroupWorkflow(), group_filter=dynamic_sampling_kept, max_filtered_batches=2)
    try:
        assert ex.rollout_groups([flat(0), flat(1)]) == []
    finally:
        ex.stop()


def test_the_pool_stops_when_every_group_is_filtered():
    staleness = StalenessManager(max_head_offpolicyness=0, batch_size=2, max_concurrent=2)
    rows = [flat(i) for i in range(1000)]
    with WorkflowExecutor(
        engine(), GroupWorkflow(), iter(rows), staleness, group_filter=dynamic_sampling_kept, max_filtered_batches=3
    ) as ex:
        with pytest.raises(RolloutPoolBroken, match=r"dynamic sampling kept no group of the last 6 samples.*"):
            ex.wait_batch(2, timeout=20)


def step_rows(cfg):
    """The metrics rows of ``cfg``'s steps (the final evaluation's left out)."""
    return [row for row in run_to_end(cfg) if "rollout/num_seqs" in row]


def dapo_run(tmp_path, name, reward, *extra, steps=2):
    overrides = tiny_run_overrides(tmp_path, run_name=name, reward=f"tests.helpers.rewards:{reward}")
    return load_config(
        None,
        [
            *overrides,
            "train.algorithm=dapo",
            "reward.sandbox=false",
            "train.eval_interval=0",
            f"train.steps={steps}",
            "rollout.batch_size=4",
            *extra,
        ],
    )


@pytest.mark.parametrize("eta", [0, 1])
def test_a_dapo_step_trains_a_full_batch_of_varied_groups(tmp_path, eta):
    rows = step_rows(
        dapo_run(tmp_path, f"full{eta}", "flat_on_odd_prompts", f"rollout.max_head_offpolicyness={eta}", steps=3)
    )
    assert len(rows) == 3
    for row in rows:
        assert row["rollout/num_seqs"] == 16  # 4 groups of 4, every one kept
        assert row["train/policy/dynamic_sampling_dropped_groups"] == 0
    assert rows[-1]["rollout/filtered_groups"] > 0
    # every prompt's score: the filtered groups scored 0, so below the kept groups' mean once one was filtered
    assert all(r["rollout/scored_reward_mean"] <= r["rollout/reward_mean"] + 1e-9 for r in rows)
    assert any(r["rollout/scored_reward_mean"] < r["rollout/reward_mean"] for r in rows)
    if eta == 0:
        assert max(row["rollout/sampling_rounds"] for row in rows) >= 2


def test_one_round_is_the_step_without_resampling(tmp_path):
    """``dynamic_sampling_max_rounds=1``: the batch's flat groups reach training, which drops them."""
    rows = step_rows(
        dapo_run(
            tmp_path,
            "one",
            "flat_on_odd_prompts",
            "train.algorithm_kwargs={dynamic_sampling_max_rounds: 1}",
            steps=3,
        )
    )
    assert all(row["rollout/num_seqs"] == 16 for row in rows)
    assert sum(row["train/policy/dynamic_sampling_dropped_groups"] for row in rows) > 0
    assert "rollout/sampling_rounds" not in rows[0] and "rollout/filtered_groups" not in rows[0]


@pytest.mark.parametrize("eta", [0, 1])
def test_a_run_whose_groups_are_all_flat_stops_in_one_line(tmp_path, eta):
    from areno.api.trainer import Trainer

    cfg = dapo_run(
        tmp_path,
        f"flat{eta}",
        "flat",
        f"rollout.max_head_offpolicyness={eta}",
        "train.algorithm_kwargs={dynamic_sampling_max_rounds: 2}",
    )
    trainer = Trainer.init(cfg)
    try:
        with pytest.raises(RolloutPoolBroken, match=r"dynamic sampling kept no group of .*8 samples.*max_rounds"):
            trainer.run()
    finally:
        trainer.shutdown()


def test_the_rounds_are_refused_without_dynamic_sampling_or_below_one():
    with pytest.raises(ConfigError, match=r"dynamic_sampling_max_rounds.*dynamic sampling is off.*recipes that read"):
        get_recipe("grpo", policy_kwargs={"dynamic_sampling_max_rounds": 3})
    with pytest.raises(ConfigError, match=r"dynamic_sampling_max_rounds must be >= 1 \(1: no re-sampling\), got 0"):
        get_recipe("dapo", policy_kwargs={"dynamic_sampling_max_rounds": 0})
    get_recipe("grpo", policy_kwargs={"dynamic_sampling": True, "dynamic_sampling_max_rounds": 3})


def test_the_scored_reward_mean_counts_the_filtered_groups():
    from areno.engine.api import scored_reward_mean

    kept = [Trajectory(prompt_ids=[1], completion_ids=[2], logprobs=[0.0], versions=[0], reward=r) for r in (0.0, 1.0)]
    assert scored_reward_mean(kept, [1.0, 1.0, float("nan"), 0.0]) == pytest.approx(3 / 5)
