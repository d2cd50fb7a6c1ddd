"""What a colocated run keeps on the device in each phase of a step, and each phase's peak memory.

A synchronous step passes through three phases: ``ROLLOUT`` (the rollout engine generates or
evaluates), ``TRAIN`` (the training side steps, saves, loads, exports) and ``SYNC`` (the policy goes
from the training side to the rollout engine). ``ArenoEngine`` enters each before it starts it. A
``Residency`` moves what the new phase does not use off the device first, then brings back what it
uses (``cluster.offload=sleep``: ``SleepResidency`` in ``engine/local.py``; the base keeps
everything resident), and on CUDA reports ``torch.cuda.max_memory_allocated`` since the phase began
as ``system/<phase>_peak_memory_gib``, and the run's peak so far as ``system/peak_memory_gib`` (the
phases reset the allocator's peak statistics, so ``max_memory_allocated`` alone no longer spans the run).
"""

from __future__ import annotations

import enum
import time

import torch


class Phase(enum.Enum):
    ROLLOUT = "rollout"
    TRAIN = "train"
    SYNC = "sync"


class Residency:
    """``cluster.offload=none``: nothing moves; only the per-phase peaks are recorded (CUDA)."""

    moves_state: bool = False
    """Whether a phase moves the other side's state off the device (``cluster.offload=sleep``)."""
    # set in __init__
    device: torch.device
    phase: Phase | None = None
    """The phase entered last (None: none yet)."""
    _switch_s: float = 0.0
    """Seconds the last ``enter`` spent moving state."""
    _earlier_peak: int = 0
    """CUDA: the highest ``max_memory_allocated`` of the phases before the current one."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def enter(self, phase: Phase) -> None:
        """Make the device hold what ``phase`` uses; a no-op when it is the current phase."""
        if phase is self.phase:
            return
        started_at = time.perf_counter()
        self._move(phase)
        self._switch_s = time.perf_counter() - started_at
        self.phase = phase
        if self.device.type == "cuda":  # after the move: a peak of this phase, not of the last one
            self._earlier_peak = max(self._earlier_peak, torch.cuda.max_memory_allocated(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)

    def _move(self, phase: Phase) -> None:
        """Release what ``phase`` does not use, then bring back what it does (nothing here)."""

    def metrics(self) -> dict[str, float]:
        """The current phase's figures: its peak device memory so far and the run's (CUDA only)."""
        if self.phase is None or self.device.type != "cuda":
            return {}
        peak = torch.cuda.max_memory_allocated(self.device)
        return {
            f"system/{self.phase.value}_peak_memory_gib": peak / 2**30,
            "system/peak_memory_gib": max(peak, self._earlier_peak) / 2**30,
        }
