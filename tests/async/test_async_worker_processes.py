"""Rollout worker processes: a killed worker is restarted and its in-flight samples re-queued."""

import logging
import time

import pytest

from areno.engine.episode_processes import ProcessEpisodeRunner, WorkerSpec
from areno.engine.executor import DatasetExhausted, RolloutPoolBroken, WorkflowExecutor
from areno.engine.staleness import StalenessManager

SPEC = WorkerSpec(
    workflow="tests.helpers.async_fakes.LengthWorkflow",
    client="tests.helpers.async_fakes.make_engine",
    client_kwargs={"step_s": 0.01},
)


def test_killed_worker_restarted_and_nothing_lost_or_duplicated(caplog):
    num = 24
    data = [{"id": i, "len": 20} for i in range(num)]
    data[5]["raise"] = True  # a workflow error inside a process is counted and retried like in-process
    runner = ProcessEpisodeRunner(SPEC, num_procs=2, episodes_per_proc=3)
    staleness = StalenessManager(max_head_offpolicyness=100, batch_size=4, max_concurrent=6)
    groups = []
    with caplog.at_level(logging.WARNING, logger="areno.engine.executor"):
        with WorkflowExecutor(None, None, iter(data), staleness, runner=runner, max_retries=1) as ex:
            ex.start()
            deadline = time.monotonic() + 120
            while runner.inflight_per_proc()[0] < 3 and time.monotonic() < deadline:
                time.sleep(0.01)  # wait until process 0 holds in-flight episodes
            first_pid = runner.pids[0]
            runner.kill(0)
            while len(groups) < num - 1:
                groups += ex.wait_batch(4, timeout=120)
            with pytest.raises(DatasetExhausted):  # nothing left over: no duplicates queued
                ex.wait_batch(4, timeout=120)
            m = ex.metrics()
            pids_after = runner.pids
    ids = sorted(g[0].info["id"] for g in groups)
    assert ids == [i for i in range(num) if i != 5]  # each sample exactly once, none lost
    assert runner.restarts == 1 and pids_after[0] != first_pid
    assert m["rollout/requeued"] >= 1 and m["rollout/failed_episodes"] == 2 and m["rollout/dropped_failed"] == 1
    assert "died with exit code -9" in caplog.text and "env crashed on 5" in caplog.text
    assert any(g[0].info["pid"] == pids_after[0] for g in groups)  # the restarted process did work


def test_a_wrong_return_type_in_a_worker_process_is_warned_once_and_blames_the_workflow(caplog):
    """As in process (tests/workflows/test_episode_results.py): the message names the workflow class,
    is warned once without a traceback, and the run it stops blames the workflow, not the rollout side."""
    spec = WorkerSpec(
        workflow="tests.helpers.workflows.DictReturningWorkflow", client="tests.helpers.async_fakes.make_engine"
    )
    runner = ProcessEpisodeRunner(spec, num_procs=1)
    with caplog.at_level(logging.DEBUG, logger="areno.engine"):
        with WorkflowExecutor(None, None, runner=runner, max_retries=1) as ex:
            with pytest.raises(RolloutPoolBroken) as info:
                ex.rollout_batch([{"id": i} for i in range(3)])
            m = ex.metrics()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and warnings[0].exc_info is None, [r.getMessage() for r in warnings]
    assert "DictReturningWorkflow.run_episode returned dict; return a Trajectory" in warnings[0].getMessage()
    message = str(info.value)
    assert "(last: WorkflowReturnError: DictReturningWorkflow.run_episode returned dict;" in message
    assert message.endswith("rollout.workflow is failing, not the data or the rollout side; fix its run_episode")
    assert m["rollout/dropped_failed"] == 3 and m["rollout/failed_episodes"] == 6
