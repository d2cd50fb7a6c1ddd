"""``RolloutSide``: where rollouts are generated, seen from ``ArenoEngine``.

Implementations: ``LocalRolloutSide`` (``engine/local.py``: a ``RolloutEngine`` in this process
driven by an ``InProcessRolloutClient``) and ``RemoteRolloutSide`` (``engine/remote.py``: the
scheduler's rollout workers, each a ``RolloutEngine`` behind the token-level HTTP server, reached
through a ``MultiServerRolloutClient`` that a ``HealthMonitor`` steers). Workflows only ever see
:attr:`RolloutSide.client`.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod

import torch

from areno.engine.seams import SideSetup, WeightKind, WeightUpdate
from areno.rollout.client import RolloutClient


class RolloutSide(ABC):
    """Serves generation requests and takes in each new policy version."""

    weight_kinds: frozenset[WeightKind]
    """The ways this side can receive a policy version (``WeightUpdate.kind``)."""

    @abstractmethod
    def start(self, setup: SideSetup) -> None:
        """Load the rollout model(s) and open the client; after the training side started."""

    @property
    @abstractmethod
    def client(self) -> RolloutClient:
        """What workflows generate with: token ids in; token ids, log-probs and versions out."""

    @property
    @abstractmethod
    def version(self) -> int:
        """The policy version every rollout engine serves (the last update applied everywhere)."""

    @abstractmethod
    def pause(self) -> None:
        """Hold generation at the next step boundary until :meth:`resume` (requests queue, keeping
        their tokens). The engine pauses around an asynchronous sync, and before a burst of
        requests that should start as one batch (a synchronous rollout, an evaluation). A side
        whose engines pause themselves to commit a sync, and which cannot hold requests spread
        over several servers as one batch, does nothing here."""

    @abstractmethod
    def resume(self) -> None:
        """Let generation continue (and the driver look for work at once)."""

    @abstractmethod
    def update_weights(self, update: WeightUpdate) -> dict[str, float]:
        """The receiving half of a policy sync: returns once every engine serves ``update.version``
        (all or nothing: on an error none moved on); the sync's ``policy_sync_*`` figures."""

    @abstractmethod
    def metrics(self) -> dict[str, float]:
        """This side's figures for the step's rollout metrics (replica health, engine counters);
        empty where there are none."""

    @abstractmethod
    def rng_state(self) -> torch.Tensor | None:
        """The sampler's generator state, for a checkpoint (None: this side has none to keep)."""

    @abstractmethod
    def set_rng_state(self, state: torch.Tensor) -> None:
        """Restore :meth:`rng_state` on resume (a side without one ignores it)."""

    def hold_graph_captures(self) -> contextlib.AbstractContextManager:
        """A block in which no decode CUDA graph is captured on a device the training step shares
        (its kernels and synchronisations would invalidate a capture); none by default."""
        return contextlib.nullcontext()

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the client and the engines (or their servers)."""
