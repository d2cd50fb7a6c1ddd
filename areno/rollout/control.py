"""``EngineControl``: the state every part of the rollout engine reads at a step boundary.

One object shared by the engine's collaborators (``stepping.Stepper``, ``weights.EngineWeights``, the
``RolloutEngine`` facade), so that none of them holds another: the step lock, the pause and sleep
flags, the policy version, the torn-weights reason and the engine's own CUDA stream.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch


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
    stream: torch.cuda.Stream | None = None
    """The engine's own CUDA stream (``RolloutEngineConfig.cuda_stream``); None: the default stream."""
    stream_waits_default: bool = True
    """The next step first waits for the default stream (weights or KV written there)."""

    def drain_stream(self) -> None:
        """Wait for the engine's own CUDA stream (a step without sampling returns before its kernels
        end): weights or KV written or freed after this see no engine kernel still reading them."""
        if self.stream is not None:
            self.stream.synchronize()
