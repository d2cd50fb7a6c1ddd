"""A reward scored in the trainer's process (``reward.sandbox=false``, or a shipped reward marked safe
in-process), watched: nothing can stop a call there (it runs on the rollout loop's thread, or the
evaluation's), so a call past ``reward.timeout_s`` is named in one error line while the run waits for it,
with what to do, instead of a silent stall; its return after that is logged too.

One daemon thread (``areno-reward-watch``) looks at every live ``InProcessReward``'s calls in flight
twice a second; a call costs the wrapper a dict entry (sub-microsecond beside any reward)."""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.5
"""How often the watch thread looks at the calls in flight."""
REPORT_EVERY_S = 60.0
"""The least time between two reports of one reward's late calls."""


class InProcessReward:
    """``fn`` called as it is (same signature and attributes: ``functools.update_wrapper``), each call's
    start noted until it returns (an async reward's until its awaitable does), so the watch thread can
    name a call past ``timeout_s``."""

    def __init__(self, fn: Callable[..., Any], *, name: str, timeout_s: float) -> None:
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.name = name
        self.timeout_s = timeout_s
        self._tokens = itertools.count()
        self._started: dict[int, float] = {}  # token -> time.monotonic() at the call
        self._reported: set[int] = set()
        self._last_report = -float("inf")
        self._lock = threading.Lock()
        _watch(self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        token = next(self._tokens)
        self._started[token] = time.monotonic()
        try:
            value = self.fn(*args, **kwargs)
        except BaseException:
            self._done(token)
            raise
        if inspect.isawaitable(value):
            return self._awaited(token, value)
        self._done(token)
        return value

    async def _awaited(self, token: int, value: Awaitable[Any]) -> Any:
        try:
            return await value
        finally:
            self._done(token)

    def _done(self, token: int) -> None:
        started = self._started.pop(token, None)
        with self._lock:
            reported = token in self._reported
            self._reported.discard(token)
        if reported and started is not None:
            logger.warning("reward.fn=%s: the late call ended after %.1f s", self.name, time.monotonic() - started)

    def overdue(self, now: float) -> list[tuple[int, float]]:
        """The calls in flight past ``timeout_s`` not reported yet, as (token, seconds running); marks them
        reported."""
        late = []
        with self._lock:
            for token, started in list(self._started.items()):
                if now - started > self.timeout_s and token not in self._reported:
                    self._reported.add(token)
                    late.append((token, now - started))
        return late

    def report_overdue(self, now: float | None = None) -> int:
        """One error line for the calls newly past ``timeout_s`` (at most one line a ``REPORT_EVERY_S``: an
        async reward may have many calls in flight); how many there were."""
        now = time.monotonic() if now is None else now
        if now - self._last_report < REPORT_EVERY_S:
            return 0
        late = self.overdue(now)
        if late:
            self._last_report = now
            calls = "a call" if len(late) == 1 else f"{len(late)} calls"
            logger.error(
                "reward.fn=%s: %s in-process ran past reward.timeout_s=%g (%.1f s): an in-process call cannot be "
                "stopped, so the run waits for it; if it hangs, stop the run (a second Ctrl-C stops it at once; "
                "resume=auto goes on from its last checkpoint) and fix the reward or set reward.sandbox=true, "
                "whose workers score a call past reward.timeout_s 0 and go on; if it is just slow, raise "
                "reward.timeout_s",
                self.name,
                calls,
                self.timeout_s,
                max(running for _, running in late),
            )
        return len(late)


_watched: weakref.WeakSet[InProcessReward] = weakref.WeakSet()
_watch_lock = threading.Lock()
_watch_thread: threading.Thread | None = None


def _watch(reward: InProcessReward) -> None:
    global _watch_thread
    with _watch_lock:
        _watched.add(reward)
        if _watch_thread is None or not _watch_thread.is_alive():
            _watch_thread = threading.Thread(target=_watch_loop, name="areno-reward-watch", daemon=True)
            _watch_thread.start()


def _watch_loop() -> None:
    while True:
        time.sleep(WATCH_INTERVAL_S)
        with _watch_lock:  # a reward loaded meanwhile (another thread's) would change the set mid-iteration
            rewards = list(_watched)
        now = time.monotonic()
        for reward in rewards:
            reward.report_overdue(now)
