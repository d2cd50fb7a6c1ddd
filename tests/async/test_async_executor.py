import asyncio
import logging
import threading
import time

import pytest

from areno.engine.executor import DatasetExhausted, RolloutPoolBroken, WorkflowExecutor
from areno.engine.staleness import StalenessManager
from areno.types import SamplingParams, Trajectory
from areno.workflows.base import RolloutWorkflow
from tests.helpers.async_fakes import FakeEngine, sync_weights


def length_from_prompt(prompt_ids, params):
    return [5] * prompt_ids[0]  # prompt [n] -> n tokens


class CountingWorkflow(RolloutWorkflow):
    """Sample {"id", "len"} -> one trajectory of `len` tokens; `fail` raises that many times;
    `reject` returns None."""

    def __init__(self):
        self.calls: dict[int, int] = {}

    async def run_episode(self, client, sample):
        self.calls[sample["id"]] = self.calls.get(sample["id"], 0) + 1
        if self.calls[sample["id"]] <= sample.get("fail", 0):
            raise RuntimeError(f"env crashed on {sample['id']}")
        if sample.get("reject"):
            return None
        out = await client.agenerate([sample["len"]], SamplingParams(max_new_tokens=1000))
        return Trajectory(
            prompt_ids=[1],
            completion_ids=out.output_ids,
            logprobs=out.output_logprobs,
            versions=out.output_versions,
            reward=float(sample["id"]),
            group_id=str(sample["id"]),
            info={"id": sample["id"]},
        )


def rows(n, length=3, **extra):
    return [{"id": i, "len": length, **extra} for i in range(n)]


@pytest.mark.parametrize("eta", [0, 2])
def test_everlasting_pool_delivers_every_sample_once_in_version_bounds(eta):
    engine = FakeEngine(length_from_prompt, step_s=0.001)
    staleness = StalenessManager(max_head_offpolicyness=eta, batch_size=4, max_concurrent=8)
    seen = []
    with WorkflowExecutor(engine, CountingWorkflow(), iter(rows(40)), staleness) as ex:
        for step in range(10):
            batch = ex.wait_batch(4, timeout=10)
            assert len(batch) == 4
            for (traj,) in batch:
                assert min(traj.versions) >= step - eta
                seen.append(traj.info["id"])
            assert ex.metrics()["rollout/staleness_max"] <= eta
            sync_weights(ex, engine, step + 1)
    assert sorted(seen) == list(range(40))
    assert ex.metrics()["rollout/dropped_stale"] == 0


def test_pool_keeps_generating_across_steps_bounded_by_eta():
    engine = FakeEngine(length_from_prompt)

    def pool_state(ex):
        m = ex.metrics()
        return m["rollout/accepted"], m["rollout/running"], m["rollout/ready"]

    for eta, expected in [(0, 2), (2, 6)]:
        staleness = StalenessManager(max_head_offpolicyness=eta, batch_size=2, max_concurrent=16)
        requests_before = engine.requests
        with WorkflowExecutor(engine, CountingWorkflow(), iter(rows(100)), staleness, num_workers=16) as ex:
            ex.wait_batch(2, timeout=30)
            # "training": the pool runs ahead, but only (eta+1)*bs samples per version. The whole state
            # is polled: a group is counted accepted a moment before it is ready.
            deadline = time.monotonic() + 30
            while pool_state(ex) != (expected, 0, expected - 2) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert pool_state(ex) == (expected, 0, expected - 2), eta
            # no overshoot: nothing more may start at this version, and nothing more did
            assert staleness.snapshot()["capacity"] == 0
            assert engine.requests - requests_before == expected


def test_pause_resume_around_sync_keeps_in_flight_work():
    # both requests stop after 10 tokens until released: the sync lands mid-episode whatever the load
    engine = FakeEngine(length_from_prompt, step_s=0.005, hold_at=10)
    staleness = StalenessManager(max_head_offpolicyness=1, batch_size=2, max_concurrent=2)
    wf = CountingWorkflow()
    with WorkflowExecutor(engine, wf, iter(rows(4, length=40)), staleness) as ex:
        ex.start()
        deadline = time.monotonic() + 30
        while engine.held < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert engine.held == 2 and engine.in_flight == 2
        sync_weights(ex, engine, 1)
        engine.release.set()
        batch = ex.wait_batch(2, timeout=30)
    for (traj,) in batch:
        assert len(traj.completion_ids) == 40  # nothing thrown away
        assert traj.versions == [0] * 10 + [1] * 30
    assert sorted(g[0].info["id"] for g in batch) == [0, 1]
    assert wf.calls[0] == wf.calls[1] == 1  # continued, not restarted
    assert ex.metrics()["rollout/multi_version_frac"] == 1.0


def test_stale_groups_dropped_at_collection_are_generated_again():
    engine = FakeEngine(length_from_prompt)
    staleness = StalenessManager(max_head_offpolicyness=0, batch_size=1, max_concurrent=1)
    with WorkflowExecutor(engine, CountingWorkflow(), iter(rows(10)), staleness) as ex:
        ex.start()
        while ex.metrics()["rollout/ready"] < 1:
            time.sleep(0.005)
        # The trainer moved on twice without collecting (e.g. it trained on other data).
        ex.pause()
        engine.pause()
        for version in (1, 2):
            engine.update_weights(version)
            ex.set_version(version)
        engine.resume()
        # collected while the pool is paused, so that the sample it runs next is certain
        with pytest.raises(TimeoutError):
            ex.wait_batch(1, timeout=0.2)
        ex.resume()
        ((traj,),) = ex.wait_batch(1, timeout=10)
        m = ex.metrics()
    # the dropped sample is generated again first (walk39a: it stayed untrained, pending until a resume)
    assert traj.info["id"] == 0 and set(traj.versions) == {2}
    assert m["rollout/dropped_stale"] == 1 and m["rollout/staleness_max"] == 0


def test_failing_workflow_retried_then_dropped_with_warning(caplog):
    data = rows(6)
    data[2]["fail"] = 2  # succeeds on the 3rd attempt (max_retries=2)
    data[4]["fail"] = 99  # never succeeds: dropped after 3 attempts
    data[5]["reject"] = True
    wf = CountingWorkflow()
    staleness = StalenessManager(max_head_offpolicyness=10, batch_size=4, max_concurrent=4)
    with caplog.at_level(logging.WARNING, logger="areno.engine.executor"):
        with WorkflowExecutor(FakeEngine(length_from_prompt), wf, iter(data), staleness, max_retries=2) as ex:
            batch = ex.wait_batch(4, timeout=10)
            with pytest.raises(DatasetExhausted):
                ex.wait_batch(4, timeout=10)
            m = ex.metrics()
    assert sorted(g[0].info["id"] for g in batch) == [0, 1, 2, 3]
    assert wf.calls[2] == 3 and wf.calls[4] == 3
    assert m["rollout/failed_episodes"] == 5 and m["rollout/dropped_failed"] == 1 and m["rollout/rejected"] == 1
    assert "dropping dataset row id=4 after 3 failed attempts" in caplog.text
    assert "env crashed on 4" in caplog.text


def test_pool_stops_when_every_sample_keeps_failing():
    """A broken rollout side (every episode raises): after max_consecutive_dropped samples in a row
    are dropped, wait_batch raises at once with the last error instead of waiting forever; a
    success in between resets the count."""
    data = rows(200, fail=99)
    for i in (1, 3):
        data[i] = {"id": i, "len": 3}  # two good samples early on: the count restarts after each
    wf = CountingWorkflow()
    staleness = StalenessManager(max_head_offpolicyness=10, batch_size=4, max_concurrent=1)
    t0 = time.monotonic()
    with WorkflowExecutor(
        FakeEngine(length_from_prompt), wf, iter(data), staleness, max_retries=1, max_consecutive_dropped=5
    ) as ex:
        with pytest.raises(
            RolloutPoolBroken,
            match=r"last 5 samples were all dropped after 2 attempts each "
            r"\(last: RuntimeError: env crashed on 8\)",
        ):
            ex.wait_batch(4, timeout=30)
    assert time.monotonic() - t0 < 20
    assert max(wf.calls) == 8  # nothing admitted once the pool is broken
    with pytest.raises(ValueError, match="max_consecutive_dropped"):
        WorkflowExecutor(FakeEngine(length_from_prompt), wf, iter(data), staleness, max_consecutive_dropped=-1)


def test_exhausted_dataset_returns_the_rest_then_raises():
    staleness = StalenessManager(max_head_offpolicyness=5, batch_size=4, max_concurrent=4)
    with WorkflowExecutor(FakeEngine(length_from_prompt), CountingWorkflow(), iter(rows(6)), staleness) as ex:
        assert len(ex.wait_batch(4, timeout=10)) == 4
        assert len(ex.wait_batch(4, timeout=10)) == 2
        with pytest.raises(DatasetExhausted):
            ex.wait_batch(4, timeout=10)


def test_wait_batch_timeout_names_the_state():
    engine = FakeEngine(length_from_prompt)
    staleness = StalenessManager(max_head_offpolicyness=0, batch_size=1, max_concurrent=1)
    with WorkflowExecutor(engine, CountingWorkflow(), iter(rows(10)), staleness) as ex:
        ex.pause()
        with pytest.raises(TimeoutError, match=r"0 of 1 groups ready.*paused=True"):
            ex.wait_batch(1, timeout=0.1)


def test_rollout_batch_runs_all_episodes_concurrently():
    engine = FakeEngine(length_from_prompt, step_s=0.002)
    data = rows(8, length=10)
    data[3]["reject"] = True
    data[5]["fail"] = 1
    with WorkflowExecutor(engine, CountingWorkflow(), max_retries=1) as ex:
        trajs = ex.rollout_batch(data)
        m = ex.metrics()
    assert [t.info["id"] for t in trajs] == [0, 1, 2, 4, 5, 6, 7]
    assert engine.max_in_flight == 7
    assert m["rollout/failed_episodes"] == 1 and m["rollout/rejected"] == 1


def test_a_synchronous_batch_keeps_to_max_concurrent_and_stops_after_consecutive_drops():
    """walk20: rollout_batch started every episode of the batch at once whatever rollout.max_concurrent said,
    and rollout.max_consecutive_dropped counted only in the asynchronous pool: a synchronous run whose
    workflow dropped sample after sample trained on ever smaller batches."""
    engine = FakeEngine(length_from_prompt, step_s=0.002)
    with WorkflowExecutor(engine, CountingWorkflow(), max_retries=0, num_workers=2) as ex:
        assert len(ex.rollout_batch(rows(6, length=10))) == 6
    assert engine.max_in_flight == 2
    failing = rows(6, length=4)
    for row in failing[1:4]:
        row["fail"] = 5  # dropped after its one attempt
    with WorkflowExecutor(
        FakeEngine(length_from_prompt), CountingWorkflow(), max_retries=0, num_workers=1, max_consecutive_dropped=3
    ) as ex:
        with pytest.raises(RolloutPoolBroken, match="the last 3 samples were all dropped"):
            ex.rollout_batch(failing)
    with WorkflowExecutor(  # three in a row: under the bound, the batch trains on the rest
        FakeEngine(length_from_prompt), CountingWorkflow(), max_retries=0, num_workers=1, max_consecutive_dropped=4
    ) as ex:
        assert len(ex.rollout_batch(failing)) == 3


def test_dataset_iterator_error_surfaces_in_wait_batch():
    def broken_rows():
        yield {"id": 0, "len": 2}
        raise OSError("disk gone")

    staleness = StalenessManager(max_head_offpolicyness=0, batch_size=2, max_concurrent=2)
    with WorkflowExecutor(FakeEngine(length_from_prompt), CountingWorkflow(), broken_rows(), staleness) as ex:
        with pytest.raises(RuntimeError, match="disk gone"):
            ex.wait_batch(2, timeout=10)


def test_running_episodes_that_fall_behind_are_aborted_and_generated_again():
    engine = FakeEngine(length_from_prompt, step_s=0.002)
    data = rows(10, length=2)
    data[0]["len"] = 10_000  # would run for ~20 s
    staleness = StalenessManager(max_head_offpolicyness=1, batch_size=1, max_concurrent=2)
    seen = []
    with WorkflowExecutor(engine, CountingWorkflow(), iter(data), staleness) as ex:
        for step in range(4):
            seen += [g[0].info["id"] for g in ex.wait_batch(1, timeout=10)]
            sync_weights(ex, engine, step + 1)
        deadline = time.monotonic() + 10
        while engine.cancelled < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        # the long request was aborted (it would have run for 20 s) at version 2, re-queued, aborted again at 4
        assert engine.cancelled == 2
        m = ex.metrics()
    assert 0 not in seen and m["rollout/aborted_stale"] == 2


def _pool_with_long_episodes_in_flight(workflow, eta):
    """A started pool of 500-token episodes, returned once the engine has one in flight."""
    engine = FakeEngine(length_from_prompt, step_s=0.001)
    staleness = StalenessManager(max_head_offpolicyness=eta, batch_size=2, max_concurrent=4)
    ex = WorkflowExecutor(engine, workflow, iter(rows(100, length=500)), staleness)
    ex.start()
    while engine.in_flight == 0:
        time.sleep(0.001)
    return ex


def test_stop_right_after_an_abort_does_not_hang():
    # Regression: an episode aborted as stale at the same moment as stop() swallowed the worker's
    # own cancellation and stop() waited forever.
    for _ in range(20):
        ex = _pool_with_long_episodes_in_flight(CountingWorkflow(), eta=0)
        ex.set_version(1)  # dooms every running episode...
        ex.stop()  # ...while the pool stops: must return


class CancelSwallowingWorkflow(CountingWorkflow):
    """An episode that returns a trajectory when cancelled, as Python 3.11's ``asyncio.wait_for``
    can when the episode finishes in the same loop turn as the cancellation (the cancel is lost)."""

    async def run_episode(self, client, sample):
        try:
            return await super().run_episode(client, sample)
        except asyncio.CancelledError:
            return Trajectory(prompt_ids=[1], completion_ids=[5], logprobs=[0.0], versions=[0], reward=0.0)


def test_stop_ends_workers_whose_cancellation_was_lost():
    # Regression: a worker whose cancellation was swallowed went back to waiting for work, and
    # stop() waited for it forever (seen once at the end of a CPU bench run).
    ex = _pool_with_long_episodes_in_flight(CancelSwallowingWorkflow(), eta=1)
    stopper = threading.Thread(target=ex.stop, daemon=True)
    stopper.start()
    stopper.join(timeout=20)
    assert not stopper.is_alive(), "stop() hung on a worker whose cancellation was lost"


def test_stop_returns_when_code_blocks_the_loop(caplog):
    """walk31: a hanging in-process reward blocks the rollout loop's thread; stopping the pool (a second
    Ctrl-C, a failed run's shutdown) waited for it for ever."""
    entered, release = threading.Event(), threading.Event()

    class Blocking(RolloutWorkflow):
        async def run_episode(self, client, sample):
            entered.set()
            release.wait(60)  # blocks the event loop, as a hanging synchronous reward does

    staleness = StalenessManager(max_head_offpolicyness=1, batch_size=1, max_concurrent=1)
    ex = WorkflowExecutor(FakeEngine(length_from_prompt), Blocking(), iter(rows(4)), staleness)
    ex.stop_timeout_s = 0.5
    ex.start()
    assert entered.wait(30)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="areno.engine.executor"):
        ex.stop()
    # waiting for the blocked loop would take the 60 s of release.wait; 30 s only absorbs load
    assert time.monotonic() - t0 < 30
    assert "the rollout loop did not stop within 0.5s" in caplog.text
    release.set()
