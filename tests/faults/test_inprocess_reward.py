"""A reward scored in the trainer's process (``reward.sandbox=false``) cannot be stopped, so a call past
``reward.timeout_s`` is named in one error line with what to do (the run had stalled without a word); a
Ctrl-C that interrupts an evaluation's reward in the main thread stops the run (it was scored 0 as the
reward's own error, and the next call stalled again)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from areno.engine.config import RewardSection
from areno.rewards import inprocess
from areno.rewards.inprocess import InProcessReward
from areno.rewards.loader import load_reward
from areno.workflows import common
from tests.helpers.configs import train_args
from tests.helpers.rewards import HOLD_ENV


@pytest.fixture(autouse=True)
def fresh_failures(monkeypatch):
    monkeypatch.setattr(common, "_failed_rewards", {})


def _records(caplog, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == inprocess.__name__ and r.levelno == level]


def _until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_an_in_process_reward_is_loaded_watched_with_its_signature_and_attributes():
    reward = load_reward(RewardSection(fn="tests.helpers.rewards:sevens", sandbox=False, timeout_s=3.0))
    assert isinstance(reward, InProcessReward) and reward.timeout_s == 3.0
    assert reward("p", "777a") == 0.75 and reward.__name__ == "sevens"
    shipped = load_reward(RewardSection(fn="areno.rewards.tasks:exact_match"))  # auto: in-process
    assert isinstance(shipped, InProcessReward) and shipped.areno_sandbox is False


def test_a_call_past_timeout_s_is_named_once_and_its_end_too(caplog):
    release = threading.Event()

    def stuck(prompt, completion, answer=None, **row):
        release.wait(30)
        return 1.0

    reward = InProcessReward(stuck, name="mod:stuck", timeout_s=0.2)
    with caplog.at_level(logging.WARNING, logger=inprocess.__name__):
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            call = pool.submit(asyncio.run, common.acall_reward(reward, "p", "c", None, {}))
            _until(lambda: _records(caplog, logging.ERROR))
            time.sleep(3 * inprocess.WATCH_INTERVAL_S)  # the watch looks again: one line a call, not one a look
            release.set()
            assert call.result(timeout=30) == (1.0, None)
    (line,) = _records(caplog, logging.ERROR)
    assert line.startswith("reward.fn=mod:stuck: a call in-process ran past reward.timeout_s=0.2 (")
    assert "reward.sandbox=true" in line and "raise reward.timeout_s" in line and "Ctrl-C" in line
    (end,) = _records(caplog, logging.WARNING)
    assert end.startswith("reward.fn=mod:stuck: the late call ended after ")
    assert not reward._started and not reward._reported  # nothing left in flight


def test_an_async_reward_is_watched_until_its_awaitable_ends(caplog):
    async def slow(prompt, completion, answer=None, **row):
        await asyncio.sleep(0.2 + 4 * inprocess.WATCH_INTERVAL_S)
        return 0.5

    reward = InProcessReward(slow, name="mod:slow", timeout_s=0.1)
    with caplog.at_level(logging.WARNING, logger=inprocess.__name__):
        assert asyncio.run(common.acall_reward(reward, "p", "c", None, {})) == (0.5, None)
    assert len(_records(caplog, logging.ERROR)) == 1 and len(_records(caplog, logging.WARNING)) == 1
    assert not reward._started


def test_calls_within_timeout_s_are_not_reported(caplog):
    reward = InProcessReward(lambda p, c, a=None, **row: 1.0, name="mod:fast", timeout_s=5.0)
    with caplog.at_level(logging.WARNING, logger=inprocess.__name__):
        assert [asyncio.run(common.acall_reward(reward, "p", "c", None, {})) for _ in range(3)] == [(1.0, None)] * 3
        assert reward.report_overdue() == 0
    assert not _records(caplog, logging.ERROR) and not reward._started


def test_a_keyboard_interrupt_in_the_main_thread_stops_the_caller_elsewhere_it_is_the_rewards_error():
    """Signals reach the main thread only: a KeyboardInterrupt there is the user's Ctrl-C (an evaluation's
    reward runs on it); on the rollout loop's thread only the reward itself can have raised it."""

    def interrupts(prompt, completion, answer=None, **row):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        asyncio.run(common.acall_reward(interrupts, "p", "c", None, {}))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        scored = pool.submit(asyncio.run, common.acall_reward(interrupts, "p", "c", None, {})).result(timeout=30)
    assert scored == (0.0, "KeyboardInterrupt: ")


def test_a_stuck_evaluation_reward_is_named_and_two_ctrl_cs_stop_the_run(tmp_path):
    """The step-0 evaluation scores its rows on the main thread; its reward holds (``held``) until the test
    lets go. Before: no word at all, and the second Ctrl-C's KeyboardInterrupt was scored 0 as the reward's
    error, the next row's call held again, and the run never ended."""
    hold = tmp_path / "hold"
    hold.touch()
    args = train_args(
        tmp_path,
        "train.steps=2",
        "reward.fn=tests.helpers.rewards:held",
        "reward.sandbox=false",
        "reward.timeout_s=0.5",
    )
    err_path = tmp_path / "stderr.txt"
    with err_path.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "areno", *args],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env={**os.environ, HOLD_ENV: str(hold)},
        )
        try:
            _until(lambda: "ran past reward.timeout_s" in err_path.read_text() or proc.poll() is not None, 120)
            assert proc.poll() is None, err_path.read_text()[-2000:]
            proc.send_signal(signal.SIGINT)  # asyncio.run's first: cancels its task, which waits for the reward
            time.sleep(0.5)
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
        finally:
            hold.unlink(missing_ok=True)
            if proc.poll() is None:
                proc.kill()
    text = err_path.read_text()
    assert proc.returncode == 130, text[-2000:]
    line = next(line for line in text.splitlines() if "ran past reward.timeout_s" in line)
    assert "reward.fn=tests.helpers.rewards:held: a call in-process ran past reward.timeout_s=0.5" in line
    assert "reward set to 0" not in text


def test_a_cancelled_task_does_not_go_on_to_call_the_reward():
    """Python 3.11's wait_for returns a generation that finished as its task was cancelled (a stopping pool,
    an evaluation's first failure, Ctrl-C), and the row went on to score: a stuck reward held the shutdown."""
    calls = []

    def reward(prompt, completion, answer=None, **row):
        calls.append(completion)
        return 1.0

    async def cancelled_then_scores():
        asyncio.current_task().cancel()  # what the stopping side does while the row has its generation
        return await common.acall_reward(reward, "p", "c", None, {})

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(cancelled_then_scores())
    assert calls == []


def test_a_generation_that_finishes_as_its_task_is_cancelled_raises_the_cancel():
    """Python 3.11's wait_for returns a result that arrives with the cancel: a cancelled multi-turn episode went
    on to its next turn (``wait_for_result`` is the clients' wait)."""
    from areno.rollout.client import wait_for_result

    async def main():
        done = asyncio.get_running_loop().create_future()
        turns = []

        async def episode():
            out = await wait_for_result(done, 30.0)
            turns.append(out)  # the next turn
            return out

        task = asyncio.ensure_future(episode())
        await asyncio.sleep(0)  # waiting on the generation
        done.set_result("tokens")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return turns

    assert asyncio.run(main()) == []
