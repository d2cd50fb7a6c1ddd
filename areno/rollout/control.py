"""``EngineControl``: the state every part of the rollout engine reads at a step boundary.

One object shared by the engine's collaborators (``stepping.Stepper``, ``weights.EngineWeights``, the
``RolloutEngine`` facade), so that none of them holds another: the step lock, the pause and sleep
flags, the policy version, and the torn-weights reason.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


class StepLock:
    """A reentrant lock that counts the threads blocked on it: a step that chains decode round trips
    (``Stepper``) ends at the next one when somebody waits for the engine."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._count_lock = threading.Lock()
        self.waiters = 0

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._lock.acquire(blocking=False):
            return True
        if not blocking:
            return False
        with self._count_lock:
            self.waiters += 1
        try:
            return self._lock.acquire(timeout=timeout)
        finally:
            with self._count_lock:
                self.waiters -= 1

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass(eq=False)
class EngineControl:
    lock: StepLock = field(default_factory=StepLock)
    """The step lock: every public engine method takes it, so weight updates happen between steps."""
    version: int = 0
    """Policy version of the current weights."""
    paused: bool = False
    sleeping: bool = False
    """The KV pool is released (``RolloutEngine.sleep``)."""
    torn: str | None = None
    """Set by ``mark_torn`` (the reason); cleared when weights are committed or loaded."""
