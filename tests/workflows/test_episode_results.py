"""What ``run_episode`` may return, and what becomes of it: a returned list is one group (one shared
``group_id`` where the workflow left the ids out, so GRPO compares its members); anything else than
a Trajectory, a list of them or None is one clear message naming run_episode and the returned type,
warned once, and a run it stops blames the workflow, not the rollout engine."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from areno.algo.advantages import group_index_B, grpo_advantages_B
from areno.cli import main
from areno.engine.executor import RolloutPoolBroken, WorkflowExecutor
from areno.types import SamplingParams, Trajectory
from areno.workflows.base import RolloutWorkflow, WorkflowReturnError, as_group
from tests.helpers.async_fakes import FakeEngine
from tests.helpers.configs import train_args


def _traj(reward: float, group_id: str = "") -> Trajectory:
    return Trajectory(
        prompt_ids=[1], completion_ids=[2], logprobs=[-0.5], versions=[0], reward=reward, group_id=group_id
    )


class NoGroupIds(RolloutWorkflow):
    """A custom workflow's group, as users write it: n completions of one prompt, ``group_id`` left out.
    Rewards differ within a prompt (the row's ``good`` completions score 1)."""

    async def run_episode(self, client, sample):
        group = []
        for i in range(4):
            out = await client.agenerate([3], SamplingParams(max_new_tokens=4, seed=i))
            group.append(
                Trajectory(
                    prompt_ids=[3],
                    completion_ids=out.output_ids,
                    logprobs=out.output_logprobs,
                    versions=out.output_versions,
                    reward=float(i < sample["good"]),
                    info={"id": sample["id"]},
                )
            )
        return group


def test_a_returned_list_is_one_group_even_without_group_ids():
    engine = FakeEngine(lambda ids, params: [5, 6])
    with WorkflowExecutor(engine, NoGroupIds(), max_retries=0) as ex:
        trajs = ex.rollout_batch([{"id": 0, "good": 1}, {"id": 1, "good": 3}])
    ids = [t.group_id for t in trajs]
    assert all(ids) and ids[:4] == [ids[0]] * 4 and ids[4:] == [ids[4]] * 4 and ids[0] != ids[4]
    # so GRPO compares each prompt's completions: the advantages are not all 0
    adv_B = grpo_advantages_B(torch.tensor([t.reward for t in trajs]), group_index_B(ids))
    assert (adv_B[[0, 4, 5, 6]] > 0).all() and (adv_B[[1, 2, 3, 7]] < 0).all()


def test_group_ids_the_workflow_set_are_kept():
    mixed = as_group([_traj(1.0, "mine"), _traj(0.0, "mine"), _traj(0.5)])
    assert [t.group_id for t in mixed][:2] == ["mine", "mine"] and mixed[2].group_id not in ("", "mine")
    # a new id per episode: two episodes' groups never merge
    first, second = as_group([_traj(1.0)]), as_group(_traj(1.0))
    assert first[0].group_id and second[0].group_id and first[0].group_id != second[0].group_id
    assert as_group(None) is None and as_group([]) is None and len(as_group((_traj(0.0), _traj(1.0)))) == 2


@pytest.mark.parametrize(
    ("result", "message"),
    [
        ({"reward": 1.0}, "MyWF.run_episode returned dict; return a Trajectory, a list of Trajectory, or None"),
        (0.5, "MyWF.run_episode returned float; return a Trajectory, a list of Trajectory, or None"),
        ("text", "MyWF.run_episode returned str; return a Trajectory"),
        (
            [_traj(1.0), "x"],
            "MyWF.run_episode returned a list holding str at [1]; return a Trajectory, a list of Trajectory, or None",
        ),
    ],
)
def test_a_wrong_return_type_names_run_episode_the_type_and_the_accepted_ones(result, message):
    with pytest.raises(WorkflowReturnError) as info:
        as_group(result, source="MyWF.run_episode")
    assert str(info.value) == message or str(info.value).startswith(message)


class ReturnsDict(RolloutWorkflow):
    async def run_episode(self, client, sample):
        await asyncio.sleep(0)
        return {"prompt": sample["id"], "reward": 1.0}


def test_a_wrong_return_type_is_warned_once_and_stops_the_batch_naming_the_workflow(caplog):
    with caplog.at_level(logging.DEBUG, logger="areno.engine"):
        with WorkflowExecutor(FakeEngine(lambda ids, params: [5]), ReturnsDict(), max_retries=1) as ex:
            with pytest.raises(RolloutPoolBroken) as info:
                ex.rollout_batch([{"id": i} for i in range(3)])
            m = ex.metrics()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and warnings[0].exc_info is None, [r.getMessage() for r in warnings]
    assert "ReturnsDict.run_episode returned dict; return a Trajectory, a list of Trajectory, or None" in (
        warnings[0].getMessage()
    )
    message = str(info.value)
    assert "(last: WorkflowReturnError: ReturnsDict.run_episode returned dict;" in message
    assert message.endswith("rollout.workflow is failing, not the data or the rollout side; fix its run_episode")
    assert "server log" not in message
    assert m["rollout/dropped_failed"] == 3 and m["rollout/failed_episodes"] == 6  # still retried and counted


def test_a_run_whose_workflow_returns_a_dict_ends_with_one_line_blaming_the_workflow(tmp_path, capsys, caplog):
    with caplog.at_level(logging.WARNING):
        rc = main(
            train_args(
                tmp_path,
                "rollout.workflow=tests.helpers.workflows:DictReturningWorkflow",
                "rollout.max_retries=0",
                "train.eval_interval=0",
            )
        )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and "Traceback" not in "\n".join(err)
    assert err[-1].startswith("areno: error: no trajectories from a rollout batch of 2 samples: 2 dropped")
    assert "DictReturningWorkflow.run_episode returned dict; return a Trajectory" in err[-1]
    assert err[-1].endswith("fix its run_episode")
    warned = [r for r in caplog.records if "returned dict" in r.getMessage()]
    assert len(warned) == 1 and warned[0].exc_info is None  # once, not a traceback per row
