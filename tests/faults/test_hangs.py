"""Hang detection: every rollout request has a deadline and names what hung; a health monitor drops
a dead rollout server from routing and routes back when it recovers; a stalled rollout worker
process is reported by name and restarted."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import pytest
import uvicorn

from areno.engine.episode_processes import ProcessEpisodeRunner, WorkerSpec
from areno.engine.executor import DatasetExhausted, WorkflowExecutor
from areno.engine.staleness import StalenessManager
from areno.launch.scheduler import free_port
from areno.rollout.client import (
    HTTPRolloutClient,
    InProcessRolloutClient,
    MultiServerRolloutClient,
    NoHealthyServerError,
    RolloutRequestTimeout,
    RolloutServersLost,
)
from areno.rollout.health import HealthMonitor
from areno.rollout.server import build_engine, create_app
from areno.types import SamplingParams, Trajectory
from areno.workflows.base import RolloutWorkflow

PARAMS = SamplingParams(max_new_tokens=4, ignore_eos=True, temperature=0.0)


class Server:
    """``areno serve``'s app on a real port in a thread; stop() and start() again on the same port."""

    def __init__(self, model_dir, port: int | None = None) -> None:
        self.engine, self.tokenizer = build_engine(
            str(model_dir), device="cpu", num_blocks=128, block_size=8, max_model_len=64
        )
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.start()

    def start(self) -> None:
        app = create_app(self.engine, tokenizer=self.tokenizer, model_name="tiny")
        self.srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.srv.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.srv.started:
            assert time.monotonic() < deadline, "test server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.srv.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    s = Server(tiny_model_dir)
    yield s
    s.stop()


# ---------------------------------------------------------------------------------- request deadlines
def test_in_process_request_deadline_names_the_request_and_aborts_it(tiny_model_dir):
    engine, _ = build_engine(str(tiny_model_dir), device="cpu", num_blocks=64, block_size=8, max_model_len=64)
    client = InProcessRolloutClient(engine, request_timeout_s=0.3)
    engine.pause()  # a stalled engine: the request never progresses

    async def go():
        t0 = time.monotonic()
        with pytest.raises(RolloutRequestTimeout) as info:
            await client.agenerate([5, 6, 7], PARAMS, request_id="stuck-1")
        return time.monotonic() - t0, str(info.value)

    try:
        elapsed, message = asyncio.run(go())
        assert 0.3 <= elapsed < 30  # the upper bound only absorbs load: no deadline would wait for ever
        assert "rollout request stuck-1 to the in-process rollout engine did not finish within 0.3s" in message
        assert "rollout.request_timeout_s" in message and "\n" not in message
        assert not engine.has_unfinished() and client.num_pending == 0  # aborted, nothing leaks
        engine.resume()
        client.wake()
        out = asyncio.run(client.agenerate([5, 6, 7], PARAMS))  # the engine still serves
        assert len(out.output_ids) == 4
    finally:
        client.close()


def test_stalled_server_request_times_out_named_and_is_aborted(server):
    """The server accepts the request but its engine is stalled: the client gives up at its
    deadline with the server's URL and the request id, aborts it there, and the server keeps
    serving other requests once it recovers."""
    server.engine.pause()

    async def stalled():
        client = HTTPRolloutClient(server.url, timeout_s=0.5)
        try:
            t0 = time.monotonic()
            with pytest.raises(RolloutRequestTimeout) as info:
                await client.agenerate([5, 6, 7], PARAMS, request_id="hung-42")
            return time.monotonic() - t0, str(info.value)
        finally:
            await client.aclose()

    try:
        elapsed, message = asyncio.run(stalled())
    finally:
        server.engine.resume()
    assert 0.5 <= elapsed < 30  # the default deadline is an hour; 30 s only absorbs load
    assert f"rollout request hung-42 to {server.url} did not finish within 0.5s" in message
    deadline = time.monotonic() + 30
    while server.engine.has_unfinished() and time.monotonic() < deadline:  # POST /abort landed
        time.sleep(0.05)
    assert not server.engine.has_unfinished()

    async def healthy():
        client = HTTPRolloutClient(server.url, timeout_s=30)
        try:
            return await client.agenerate([5, 6, 7], PARAMS)
        finally:
            await client.aclose()

    # the driver thread may be idle-waiting; any new request wakes it
    assert len(asyncio.run(healthy()).output_ids) == 4


def test_silent_socket_times_out():
    """A peer that accepts TCP connections and never answers (a hung process) cannot hang a worker."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"

    async def go():
        client = HTTPRolloutClient(url, timeout_s=0.4)
        try:
            with pytest.raises(RolloutRequestTimeout, match=f"to {url} did not finish within 0.4s"):
                await client.agenerate([1, 2], PARAMS)
        finally:
            await client.aclose()

    try:
        t0 = time.monotonic()
        asyncio.run(go())
        # the 0.4 s deadline + as long again for the best-effort abort; 30 s only absorbs load
        assert time.monotonic() - t0 < 30
    finally:
        listener.close()


# ---------------------------------------------------------------------------------- health monitor
def test_health_monitor_drops_dead_server_and_routes_back(tiny_model_dir, caplog):
    a, b = Server(tiny_model_dir), Server(tiny_model_dir)
    # a stopped server refuses connections at once; the long timeout keeps two slow pings of the live
    # one (a loaded machine, the GIL shared with both engines) from marking it unhealthy
    monitor = HealthMonitor([a.url, b.url], interval_s=0.1, timeout_s=5, max_misses=2)
    client = MultiServerRolloutClient([a.url, b.url], request_timeout_s=20, health=monitor)

    async def generate(n: int) -> None:
        for _ in range(n):
            assert len((await client.agenerate([5, 6, 7], PARAMS)).output_ids) == 4

    caplog.set_level(logging.WARNING, logger="areno.rollout.health")
    try:
        monitor.start()
        asyncio.run(generate(4))
        assert client.requests_per_server == [2, 2]

        b.stop()  # the server dies
        deadline = time.monotonic() + 30
        while monitor.is_healthy(b.url):
            assert time.monotonic() < deadline, "the dead server was never marked unhealthy"
            time.sleep(0.05)
        assert f"rollout server {b.url} marked unhealthy after 2 missed health checks" in caplog.text
        assert monitor.metrics() == {
            "rollout/healthy_servers": 1.0,
            "rollout/unhealthy_servers": 1.0,
            "rollout/server_0_healthy": 1.0,
            "rollout/server_1_healthy": 0.0,
        }
        before = list(client.requests_per_server)
        asyncio.run(generate(4))
        assert client.requests_per_server == [before[0] + 4, before[1]]  # nothing routed to the dead one

        b.start()  # it comes back on the same port
        deadline = time.monotonic() + 30
        while not monitor.is_healthy(b.url):
            assert time.monotonic() < deadline, "the recovered server was never marked healthy"
            time.sleep(0.05)
        assert f"rollout server {b.url} is healthy again" in caplog.text
        before = list(client.requests_per_server)
        asyncio.run(generate(4))
        assert client.requests_per_server[1] == before[1] + 2  # routed back
    finally:
        monitor.stop()
        a.stop()
        b.stop()


def test_request_to_dead_server_fails_over_without_waiting_for_a_ping(tiny_model_dir):
    """Without a ping in between, a refused connection is reported, and the request is served by
    the next server; with every server down the error names each of them."""
    a = Server(tiny_model_dir)
    dead = f"http://127.0.0.1:{free_port()}"
    monitor = HealthMonitor([dead, a.url], interval_s=60, timeout_s=0.5, max_misses=1)  # never started
    client = MultiServerRolloutClient([dead, a.url], request_timeout_s=2, health=monitor)

    async def go():
        outs = [await client.agenerate([5, 6, 7], PARAMS) for _ in range(3)]
        return outs

    try:
        assert all(len(o.output_ids) == 4 for o in asyncio.run(go()))
        assert not monitor.is_healthy(dead) and client.requests_per_server == [0, 3]
    finally:
        a.stop()
    monitor.report_failure(a.url, "stopped by the test")
    t0 = time.monotonic()
    with pytest.raises(NoHealthyServerError) as info:
        asyncio.run(client.agenerate([5, 6, 7], PARAMS))
    # waits for a recovery up to the 2 s deadline, then names them (not the default 600 s)
    assert time.monotonic() - t0 < 30
    assert dead in str(info.value) and a.url in str(info.value) and "unhealthy after" in str(info.value)


def test_request_fails_at_once_when_every_server_is_lost_for_good():
    """``lost`` says which servers cannot come back (their worker process died): with every server
    lost the request raises RolloutServersLost with the reasons at once; with one still expected
    back it waits for a recovery up to its deadline as before."""
    a, b = (f"http://127.0.0.1:{free_port()}" for _ in range(2))
    monitor = HealthMonitor([a, b], interval_s=60, timeout_s=0.5, max_misses=1)  # never started
    gone = {a: "rollout[0] (pid 11) died", b: "rollout[1] (pid 12) died"}
    asked = []

    def lost():
        asked.append(threading.current_thread() is threading.main_thread())
        return dict(gone)

    client = MultiServerRolloutClient([a, b], request_timeout_s=30, health=monitor, lost=lost)
    t0 = time.monotonic()
    with pytest.raises(RolloutServersLost) as info:
        asyncio.run(client.agenerate([5, 6, 7], PARAMS))
    assert time.monotonic() - t0 < 10
    assert (
        str(info.value) == f"every rollout server is gone: {a}: rollout[0] (pid 11) died; {b}: rollout[1] (pid 12) died"
    )
    assert asked and not any(asked)  # asked off the event loop's thread (it may block on the workers)
    del gone[b]  # b may still come back: wait for it, up to the deadline
    client = MultiServerRolloutClient([a, b], request_timeout_s=1.5, health=monitor, lost=lost)
    t0 = time.monotonic()
    with pytest.raises(NoHealthyServerError):
        asyncio.run(client.agenerate([5, 6, 7], PARAMS))
    assert time.monotonic() - t0 >= 1.4


def test_pool_stops_on_lost_servers_without_retrying():
    """RolloutServersLost is not an episode's failure: the pool stops and wait_batch raises it
    (no retries, no samples dropped one by one)."""

    class LostWorkflow:
        calls = 0

        async def run_episode(self, client, sample):
            LostWorkflow.calls += 1
            raise RolloutServersLost("every rollout server is gone: http://x: rollout[0] (pid 1) died")

    staleness = StalenessManager(max_head_offpolicyness=1, batch_size=2, max_concurrent=2)
    with WorkflowExecutor(None, LostWorkflow(), iter([{"id": i} for i in range(8)]), staleness, max_retries=3) as ex:
        with pytest.raises(RolloutServersLost, match=r"^every rollout server is gone: http://x: rollout\[0\]"):
            ex.wait_batch(2, timeout=30)
        assert ex.metrics()["rollout/dropped_failed"] == 0
    assert LostWorkflow.calls <= 2  # one attempt per pool worker, none retried


def test_server_whose_engine_raises_fails_the_request_fast(tiny_model_dir):
    """An engine whose steps raise answers every request 500 while /health still answers: the
    client stops after max_failures_per_server rounds with the engine's error, not at the deadline."""
    a = Server(tiny_model_dir)

    def broken_step():
        raise RuntimeError("decode kernel exploded")

    a.engine.step = broken_step
    monitor = HealthMonitor([a.url], interval_s=60, timeout_s=0.5, max_misses=100)
    client = MultiServerRolloutClient([a.url], request_timeout_s=60, health=monitor, max_failures_per_server=2)
    t0 = time.monotonic()
    try:
        with pytest.raises(NoHealthyServerError, match="failed this request 2 times") as info:
            asyncio.run(client.agenerate([5, 6, 7], PARAMS))
    finally:
        a.stop()
    assert time.monotonic() - t0 < 20.0 and "decode kernel exploded" in str(info.value)
    with pytest.raises(ValueError, match="max_failures_per_server"):
        MultiServerRolloutClient([a.url], max_failures_per_server=0)


def test_health_monitor_validation():
    with pytest.raises(ValueError, match="max_misses must be >= 1"):
        HealthMonitor(["http://x"], max_misses=0)
    with pytest.raises(ValueError, match="at least one"):
        HealthMonitor([])


# ---------------------------------------------------------------------------------- stalled workers
@pytest.mark.slow
def test_stalled_worker_process_is_named_killed_restarted_and_nothing_lost(tmp_path, caplog):
    num = 12
    data = [{"id": i, "len": 3} for i in range(num)]
    data[4]["stall_marker"] = str(tmp_path / "stalled")
    spec = WorkerSpec(workflow="tests.helpers.workflows.StallOnceWorkflow", client="tests.helpers.workflows.EchoClient")
    runner = ProcessEpisodeRunner(spec, num_procs=2, episodes_per_proc=2, episode_timeout_s=1.5)
    staleness = StalenessManager(max_head_offpolicyness=100, batch_size=4, max_concurrent=4)
    groups = []
    with caplog.at_level(logging.WARNING, logger="areno.engine.executor"):
        with WorkflowExecutor(None, None, iter(data), staleness, runner=runner, max_retries=1) as ex:
            t0 = time.monotonic()
            while len(groups) < num:
                groups += ex.wait_batch(4, timeout=120)
            elapsed = time.monotonic() - t0
            with pytest.raises(DatasetExhausted):
                ex.wait_batch(4, timeout=60)
            m = ex.metrics()
    stalled_pid = int((tmp_path / "stalled").read_text())
    assert sorted(g[0].info["id"] for g in groups) == list(range(num))  # each sample once, none lost
    assert runner.stalls == 1 and runner.restarts == 1 and m["rollout/worker_lost"] >= 1
    assert f"(pid {stalled_pid}) stalled: an episode of dataset" in caplog.text
    assert "past episode_timeout_s=1.5s; killing and restarting it" in caplog.text
    assert elapsed < 60


class HangOnceWorkflow(RolloutWorkflow):
    """In process: the first attempt at sample 1 never finishes (an await that never returns)."""

    def __init__(self) -> None:
        self.hung = False

    async def run_episode(self, client, sample):
        if sample["id"] == 1 and not self.hung:
            self.hung = True
            await asyncio.Event().wait()
        return Trajectory(
            prompt_ids=[1],
            completion_ids=[5],
            logprobs=[-0.5],
            versions=[0],
            reward=float(sample["id"]),
            info={"id": sample["id"]},
        )


def test_in_process_episode_timeout_requeues_the_sample(caplog):
    staleness = StalenessManager(max_head_offpolicyness=100, batch_size=2, max_concurrent=2)
    data = [{"id": i} for i in range(4)]
    with caplog.at_level(logging.WARNING, logger="areno.engine.executor"):
        with WorkflowExecutor(
            None, HangOnceWorkflow(), iter(data), staleness, max_retries=1, episode_timeout_s=0.5
        ) as ex:
            groups = ex.wait_batch(2, timeout=30) + ex.wait_batch(2, timeout=30)
            m = ex.metrics()
    assert sorted(g[0].info["id"] for g in groups) == [0, 1, 2, 3]
    assert m["rollout/episode_timeouts"] == 1 and m["rollout/dropped_failed"] == 0
    assert "re-queueing dataset" in caplog.text and "episode_timeout_s=0.5s" in caplog.text


@pytest.mark.slow
def test_request_timeouts_in_a_rollout_are_requeued_not_dropped(tiny_model_dir):
    """Colocated path: the engine stalls for longer than one request deadline; the episode's
    timeout is counted and the sample re-run once the engine is back, so no prompt is lost."""
    from areno.data.tokenizer import build_char_tokenizer
    from areno.workflows.rlvr import RLVRWorkflow

    engine, _ = build_engine(str(tiny_model_dir), device="cpu", num_blocks=64, block_size=8, max_model_len=64)
    client = InProcessRolloutClient(engine, request_timeout_s=0.5)
    workflow = RLVRWorkflow(
        tokenizer=build_char_tokenizer(),
        reward_fn=lambda p, c, a, **kw: 1.0,
        n_samples=2,
        sampling_params=SamplingParams(max_new_tokens=3, ignore_eos=True),
    )
    engine.pause()
    threading.Timer(0.8, lambda: (engine.resume(), client.wake())).start()  # back after the first deadline
    ex = WorkflowExecutor(client, workflow, max_retries=3)
    try:
        trajs = ex.rollout_batch([{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}])
        m = ex.metrics()
    finally:
        ex.stop()
        client.close()
    assert len(trajs) == 4 and m["rollout/request_timeouts"] >= 1 and m["rollout/dropped_failed"] == 0


# ---------------------------------------------------------------------------------- scheduler calls
@pytest.mark.slow
def test_stalled_scheduler_worker_is_named_and_restarted_where_alone(tmp_path):
    from areno.launch.scheduler import LocalScheduler
    from areno.launch.watchdog import WorkerTimeoutError, call_with_timeout

    worker = "tests.helpers.launch_workers:GradWorker"
    with LocalScheduler(log_dir=str(tmp_path)) as sched:
        sched.create_workers("solo", worker, 1, env={"OMP_NUM_THREADS": "1"}, args=(0,))
        sched.create_workers("pair", worker, 2, env={"OMP_NUM_THREADS": "1"}, args=(0,))
        assert call_with_timeout(sched, "solo", "count", timeout_s=30) == [1]
        old_pid = sched.workers("solo")[0].pid

        t0 = time.monotonic()
        with pytest.raises(WorkerTimeoutError) as info:
            call_with_timeout(sched, "solo", time.sleep, 600, timeout_s=1.0, restart=True)
        assert time.monotonic() - t0 < 30
        message = str(info.value)
        assert f"solo[0] (pid {old_pid} on " in message and "within 1s (stalled)" in message
        assert "restarted 1 worker(s)" in message and info.value.restarted[0].pid != old_pid
        assert call_with_timeout(sched, "solo", "count", timeout_s=30) == [1]  # a fresh worker answers

        with pytest.raises(WorkerTimeoutError, match=r"pair\[0\].*pair\[1\].*share a torch.distributed world of 2"):
            call_with_timeout(sched, "pair", time.sleep, 600, timeout_s=1.0, restart=True)
