"""``EngineControl``: the state every part of the rollout engine reads at a step boundary.

One object shared by the engine's collaborators (``stepping.Stepper``, ``weights.EngineWeights``, the
``RolloutEngine`` facade), so that none of them holds another: the step lock, the pause and sleep
flags, the policy version, and the torn-weights reason.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass(eq=False)
class EngineControl:
    lock: threading.RLock = field(default_factory=threading.RLock)
    """The step lock: every public engine method takes it, so weight updates happen between steps."""
    version: int = 0
    """Policy version of the current weights."""
    paused: bool = False
    sleeping: bool = False
    """The KV pool is released (``RolloutEngine.sleep``)."""
    torn: str | None = None
    """Set by ``mark_torn`` (the reason); cleared when weights are committed or loaded."""
