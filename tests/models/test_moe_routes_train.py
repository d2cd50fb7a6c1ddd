"""The rollout's expert routes through ``Trainer`` on a tiny mixture of experts
(``train.moe_rollout_routes``, ``train.moe_routing_replay``): a synchronous colocated run routes as its
rollout did, an asynchronous one drifts from it (``moe_rollout_routing_mismatch``), replay routes every
compared token as the rollout did, and the keys refuse what cannot record routes."""

from __future__ import annotations

import pytest

from areno.api.config import load_config
from areno.api.preflight import check_run
from areno.api.trainer import Trainer
from areno.errors import ConfigError
from areno.workflows.agent import AgentWorkflow
from areno.workflows.base import declares_no_routes
from areno.workflows.env import EnvWorkflow
from areno.workflows.rlvr import RLVRWorkflow
from tests.helpers.configs import tiny_grpo_overrides
from tests.helpers.moe import MOE_TINY, run_moe
from tests.helpers.workflows import RouteDroppingWorkflow

MISMATCH = "train/policy/moe_rollout_routing_mismatch"
REPLAYED = "train/policy/moe_routing_replayed_fraction"
COMMON = ("reward.fn=tests.helpers.rewards:sevens", "train.eval_interval=0", "train.seed=1", "optim.lr=0.05")


def _steps(rows):
    return [r for r in rows if "train/policy/loss" in r]


def test_synchronous_run_routes_as_its_rollout(tmp_path):
    steps = _steps(run_moe(tmp_path, *COMMON, "train.steps=2", "train.moe_rollout_routes=true"))
    assert [r[MISMATCH] for r in steps] == [0.0, 0.0]  # same weights, same tokens, fp32
    assert all(REPLAYED not in r for r in steps)


def test_asynchronous_run_drifts_and_replay_follows_the_rollout(tmp_path):
    asynchronous = ("train.steps=4", "rollout.max_head_offpolicyness=1")
    steps = _steps(run_moe(tmp_path / "a", *COMMON, *asynchronous, "train.moe_rollout_routes=true"))
    assert max(r[MISMATCH] for r in steps) > 0, [r[MISMATCH] for r in steps]
    steps = _steps(run_moe(tmp_path / "b", *COMMON, *asynchronous, "train.moe_routing_replay=true"))
    assert all(r[REPLAYED] == 1.0 for r in steps)  # the experts used are the rollout's
    assert max(r[MISMATCH] for r in steps) > 0  # while the router's own choice drifted


def test_dense_model_refuses_the_keys(tmp_path):
    cfg = load_config(None, [*tiny_grpo_overrides(tmp_path), "train.moe_routing_replay=true"])
    with pytest.raises(ConfigError, match="train.moe_routing_replay: the model has no mixture-of-experts layers"):
        trainer = Trainer.init(cfg)
        trainer.shutdown()


def test_server_backends_refuse_the_keys(tmp_path):
    with pytest.raises(ConfigError, match="server does not return its expert routes.*rollout.backend=areno"):
        load_config(
            None, [*tiny_grpo_overrides(tmp_path), MOE_TINY, "rollout.backend=vllm", "train.moe_rollout_routes=true"]
        )


def test_a_workflow_that_drops_the_routes_is_refused_at_the_first_step(tmp_path):
    workflow = "rollout.workflow=tests.helpers.workflows:RouteDroppingWorkflow"
    with pytest.raises(
        ConfigError, match=r"train.moe_routing_replay: rollout.workflow=.*RouteDroppingWorkflow returns"
    ):
        run_moe(tmp_path, *COMMON, "train.steps=1", "train.moe_routing_replay=true", workflow)


@pytest.mark.parametrize("key", ["train.moe_routing_replay", "train.moe_rollout_routes"])
def test_a_workflow_class_that_drops_the_routes_is_refused_at_start_up(tmp_path, key):
    workflow = "areno.workflows.agent:AgentWorkflow"
    cfg = load_config(None, [*tiny_grpo_overrides(tmp_path), MOE_TINY, f"{key}=true", f"rollout.workflow={workflow}"])
    with pytest.raises(ConfigError, match=rf"{key}: rollout.workflow={workflow} returns trajectories without"):
        check_run(cfg)  # before any model is built


def test_only_a_class_that_says_so_of_itself_drops_the_routes():
    assert declares_no_routes(AgentWorkflow) and declares_no_routes(EnvWorkflow)
    assert not declares_no_routes(RLVRWorkflow)
    # a subclass that overrides run_episode is checked at its first step instead
    assert not declares_no_routes(RouteDroppingWorkflow) and not declares_no_routes(type("Mine", (AgentWorkflow,), {}))
    assert not declares_no_routes(lambda **kwargs: None)
