"""``GET /health`` reports a dead or stuck engine driver (503 with a reason); validation errors name
the field as the request spells it."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from areno.rollout.server import EngineWatchdog, build_engine, create_app


# ------------------------------------------------------------------------------ the watchdog alone
class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _watchdog(stall_timeout_s: float = 10.0):
    engine = SimpleNamespace(_steps=0, is_paused=False, is_sleeping=False)
    client = SimpleNamespace(num_pending=0, driver_state="idle")
    clock = _Clock()
    return EngineWatchdog(engine, client, stall_timeout_s=stall_timeout_s, clock=clock), engine, client, clock


def test_watchdog_stall_needs_pending_requests_and_no_step_for_the_timeout():
    dog, engine, client, clock = _watchdog()
    assert dog.check() is None
    clock.t += 1000  # idle for long: healthy
    assert dog.check() is None
    client.num_pending, client.driver_state = 2, "alive"
    assert dog.check() is None  # requests arrived just now: the stall is measured from here
    clock.t += 9
    assert dog.check() is None
    engine._steps += 1  # a step: the clock restarts
    clock.t += 9
    assert dog.check() is None
    clock.t += 2
    assert dog.check() is None  # 2 s since the step was first seen
    clock.t += 8.5
    assert dog.check() == (
        "the engine is stuck: no step for 10.5s with 2 request(s) pending (stall_timeout_s=10): restart the server"
    )
    engine._steps += 4
    assert dog.check() is None  # it moved again: healthy again


@pytest.mark.parametrize("state", ["is_paused", "is_sleeping"])
def test_watchdog_paused_or_sleeping_engine_is_not_stuck(state):
    dog, engine, client, clock = _watchdog()
    client.num_pending, client.driver_state = 1, "alive"
    setattr(engine, state, True)
    assert dog.check() is None
    clock.t += 100
    assert dog.check() is None
    setattr(engine, state, False)  # resumed: the stall is measured from the resume
    assert dog.check() is None
    clock.t += 11
    assert "no step for 11.0s" in dog.check()


def test_watchdog_dead_driver_with_pending_requests():
    dog, engine, client, clock = _watchdog()
    client.driver_state = "dead"
    assert dog.check() is None  # nothing pending: the next request starts a new driver
    client.num_pending = 3
    assert dog.check() == (
        "the engine's driver thread died with 3 request(s) pending (see the server log for "
        "its traceback): restart the server"
    )


def test_watchdog_validates_the_timeout():
    with pytest.raises(ValueError, match="stall_timeout_s must be > 0, got 0"):
        _watchdog(0)


# ------------------------------------------------------------------------------ through the app
@pytest.fixture
def engine(tiny_model_dir):
    engine, _ = build_engine(str(tiny_model_dir), device="cpu", num_blocks=64, block_size=8, max_model_len=64)
    return engine


BODY = {"prompt_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True, "temperature": 0.0}}


def _run_app(app, scenario):
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as http:
            try:
                return await scenario(http)
            finally:
                await app.state.client.aclose()

    return asyncio.run(go())


async def _wait_for(event: threading.Event, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not event.is_set():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


def test_health_is_503_while_a_step_hangs_then_200_again(engine):
    """A step that hangs holding the engine lock (a hung forward): /health still answers — it takes
    no lock — and says 503 once no step came for stall_timeout_s; when the step returns, 200."""
    real_step, entered, release = engine.step, threading.Event(), threading.Event()

    def hanging_step():
        with engine._lock:
            entered.set()
            release.wait(30)
        return real_step()

    engine.step = hanging_step
    app = create_app(engine, stall_timeout_s=0.3)

    async def scenario(http):
        assert (await http.get("/health")).json() == {"status": "ok", "paused": False}
        request = asyncio.create_task(http.post("/generate", json=BODY))
        await _wait_for(entered)
        first = await http.get("/health")  # the stall is measured from the first sighting
        await asyncio.sleep(0.45)
        stuck = await http.get("/health")
        engine.step = real_step
        release.set()
        done = await request
        return first, stuck, done, await http.get("/health")

    first, stuck, done, after = _run_app(app, scenario)
    assert first.status_code == 200
    assert stuck.status_code == 503 and stuck.json()["status"] == "unhealthy"
    reason = stuck.json()["reason"]
    assert reason.startswith("the engine is stuck: no step for ") and "with 1 request(s) pending" in reason
    assert stuck.json()["error"]["message"] == reason and "\n" not in reason
    assert done.status_code == 200 and len(done.json()["output_ids"]) == 3
    assert after.status_code == 200 and after.json() == {"status": "ok", "paused": False}


class _DriverKilled(BaseException):
    """Not an ``Exception``: the driver loop does not catch it, so the thread dies."""


def test_health_is_503_when_the_driver_thread_died(engine, monkeypatch):
    died = threading.Event()

    def dying_step():
        raise _DriverKilled("simulated")

    def excepthook(args):  # the thread's death is expected here; record it instead of printing
        assert args.exc_type is _DriverKilled
        died.set()

    monkeypatch.setattr(threading, "excepthook", excepthook)
    engine.step = dying_step
    app = create_app(engine, stall_timeout_s=60)

    async def scenario(http):
        request = asyncio.create_task(http.post("/generate", json=BODY))
        await _wait_for(died)
        health = await http.get("/health")
        request.cancel()
        return health

    health = _run_app(app, scenario)
    assert health.status_code == 503
    assert health.json()["reason"] == (
        "the engine's driver thread died with 1 request(s) pending (see the "
        "server log for its traceback): restart the server"
    )


def test_health_needs_no_api_key_even_when_unhealthy(engine):
    """The health monitor pings without a key; a 503 must reach it, not a 401."""
    from areno.rollout.client import HTTPRolloutClient, RolloutServerError

    app = create_app(engine, api_key="k", stall_timeout_s=60)
    app.state.watchdog.check = lambda: "the engine is stuck: test"

    async def scenario(http):
        client = HTTPRolloutClient("http://test")
        await client._client.aclose()
        client._client = http  # the monitor's health check, over the in-process transport
        with pytest.raises(RolloutServerError, match=r"/health answered 503: the engine is stuck: test"):
            await client.ahealth(5)
        return (await http.get("/version")).status_code

    assert _run_app(app, scenario) == 401


# ------------------------------------------------------------------------------ validation errors
@pytest.mark.parametrize(
    "body, param, accepts",
    [
        ({"prompt": {"text": "hi"}}, "prompt", "str, list[int], list[str], list[list[int]]"),
        ({"prompt": [1, "a"]}, "prompt", "str, list[int], list[str], list[list[int]]"),
        ({"prompt": "hi", "stop": 5}, "stop", "str, list[str]"),
        ({"prompt": "hi", "max_tokens": "ten"}, "max_tokens", None),
    ],
)
def test_validation_error_names_the_field_without_union_member_tags(engine, body, param, accepts):
    from fastapi.testclient import TestClient

    with TestClient(create_app(engine)) as client:
        err = client.post("/v1/completions", json={"model": "m", **body}).json()["error"]
    assert err["param"] == param and err["message"].startswith(f"invalid field '{param}': ")
    if accepts:
        assert err["message"].endswith(f"(it accepts {accepts})")
    else:
        assert "accepts" not in err["message"]
