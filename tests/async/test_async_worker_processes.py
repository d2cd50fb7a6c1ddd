"""Rollout worker processes: a killed worker is restarted and its in-flight samples re-queued."""

import logging
import time

import pytest

from areno.engine.episode_processes import ProcessEpisodeRunner, WorkerSpec
from areno.engine.executor import DatasetExhausted, WorkflowExecutor
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
