"""``train.algorithm_kwargs.advantage_estimator=gdpo`` (TRL's ``multi_objective_aggregation="normalize_then_sum"``):
the run gives the policy ``reward.weights``, refuses a single reward function and a weight set by hand, and the
actor's advantages are ``gdpo_advantages_B`` of the batch's per-function scores; end to end a run with two
functions trains on them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from areno.algo.advantages import gdpo_advantages_B, group_index_B
from areno.api.config import load_config
from areno.engine.api import resolve_recipe
from areno.errors import ConfigError
from areno.specializations import ActorConfig, ActorSpecialization
from areno.types import REWARD_PARTS_KEY
from tests.helpers.configs import run_to_end, tiny_run_overrides
from tests.helpers.recipes import completion_positions, rl_batch

LIST = "[tests.helpers.rewards:sevens_and_length,tests.helpers.rewards:first_char]"


def _config(tmp_path, *extra: str):
    return load_config(None, [*tiny_run_overrides(tmp_path), "reward.sandbox=false", *extra])


def test_the_run_gives_the_policy_the_reward_weights(tmp_path):
    gdpo = "train.algorithm_kwargs.advantage_estimator=gdpo"
    weighted = resolve_recipe(_config(tmp_path, gdpo, f"reward.fn={LIST}", "reward.weights=[1,0.25]"))
    assert weighted.policy_role.init_kwargs["reward_weights"] == (1.0, 0.25)
    unweighted = resolve_recipe(_config(tmp_path, gdpo, f"reward.fn={LIST}"))
    assert unweighted.policy_role.init_kwargs["reward_weights"] == (1.0, 1.0)
    assert "reward_weights" not in resolve_recipe(_config(tmp_path, f"reward.fn={LIST}")).policy_role.init_kwargs


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ((), "advantage_estimator=gdpo normalises each function of a reward.fn list on its own, and reward.fn is one"),
        ((f"reward.fn={LIST}", "train.algorithm_kwargs.reward_weights=[1,2]"), "reward_weights: set by the run, not"),
    ],
)
def test_gdpo_without_a_list_or_with_weights_by_hand_is_refused_in_one_line(tmp_path, extra, says):
    with pytest.raises(ConfigError) as info:
        resolve_recipe(_config(tmp_path, "train.algorithm_kwargs.advantage_estimator=gdpo", *extra))
    assert says in str(info.value) and "\n" not in str(info.value)


def test_the_actors_advantages_are_gdpo_of_the_batchs_function_scores():
    batch = rl_batch()  # 6 sequences in groups a, a, b, b, c, c
    parts = torch.tensor([[1, 0], [0, 1], [0.5, 0], [0.5, 1], [1, 1], [1, 0]], dtype=torch.float32)
    batch = dataclasses.replace(batch, extra={**batch.extra, REWARD_PARTS_KEY: parts})
    spec = ActorSpecialization(ActorConfig(advantage_estimator="gdpo", reward_weights=(1.0, 2.0)))
    prepared = spec.prepare_batch(batch)
    expected = gdpo_advantages_B(parts, torch.tensor([1.0, 2.0]), group_index_B(batch.group_ids))
    assert expected.abs().sum() > 0
    for b in range(batch.num_seqs):
        for t in completion_positions(batch, b):
            assert prepared.advantages_T[t].item() == pytest.approx(expected[b].item(), rel=1e-6)
    with pytest.raises(ValueError, match="advantage_estimator=gdpo needs each reward function's score per sequence"):
        spec.prepare_batch(rl_batch())  # no per-function scores (a workflow scoring outside ascore_reward)


def test_a_run_with_gdpo_trains_on_two_functions(tmp_path):
    cfg = _config(
        tmp_path,
        "train.algorithm_kwargs.advantage_estimator=gdpo",
        f"reward.fn={LIST}",
        "reward.weights=[1,0.5]",
        "train.steps=2",
        "train.eval_interval=0",
        "data.num_eval=0",
    )
    rows = [r for r in run_to_end(cfg) if "train/actor/loss" in r or "train/policy/actor/pg_loss" in r]
    assert len(rows) == 2


def test_an_actor_built_by_hand_without_weights_names_them():
    batch = rl_batch()
    batch = dataclasses.replace(batch, extra={**batch.extra, REWARD_PARTS_KEY: torch.ones(batch.num_seqs, 2)})
    with pytest.raises(ValueError, match=r"advantage_estimator=gdpo needs reward_weights, one weight per function"):
        ActorSpecialization(ActorConfig(advantage_estimator="gdpo")).prepare_batch(batch)


@pytest.mark.parametrize("workflow", ["areno.workflows.agent:AgentWorkflow", "areno.workflows.env:EnvWorkflow"])
def test_gdpo_with_a_workflow_that_records_one_reward_is_refused_at_preflight(tmp_path, workflow):
    """An agent's or an environment's trajectories carry one reward, not each function's score: refused before
    any model is made, naming the workflow and grpo."""
    from areno.api.preflight import check_run

    cfg = _config(
        tmp_path, "train.algorithm_kwargs.advantage_estimator=gdpo", f"reward.fn={LIST}", f"rollout.workflow={workflow}"
    )
    with pytest.raises(ConfigError) as info:
        check_run(cfg)
    assert f"rollout.workflow={workflow} records one reward per trajectory" in str(info.value)
    assert "\n" not in str(info.value) and not (tmp_path / "model").exists()
