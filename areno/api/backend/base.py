"""The Backend contract (seed 000): the operations the training loop needs, nothing more.

A backend is registered by name with :func:`register_backend`; ``Trainer.init`` resolves the name in
``config.train.backend``. ``areno`` (ArenoBackend) is the built-in implementation: the
``areno.api.backend`` package registers it on import, so this module never imports it back.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

import torch

from areno.engine.config import ArenoConfig
from areno.errors import ConfigError
from areno.types import RolloutBatch


class Backend(ABC):
    """Executes rollout and training for the Trainer."""

    @abstractmethod
    def initialize(self, config: ArenoConfig, run_dir: Path) -> None:
        """Build models, engines and workers (the expensive part; config is already validated)."""

    @abstractmethod
    def rollout_batch(self, rollout_id: int) -> RolloutBatch:
        """Generate the training data of rollout ``rollout_id`` under the current policy."""

    @abstractmethod
    def train(self, rollout_id: int, rollout: RolloutBatch) -> dict[str, float]:
        """One training pass over ``rollout`` (all trainable roles of the recipe)."""

    @abstractmethod
    def update_weights(self) -> dict[str, float]:
        """Publish the trained policy to the rollout side; returns ``policy_sync_*`` metrics."""

    @abstractmethod
    def evaluate(self) -> dict[str, float]:
        """Held-out metrics of the current policy (``eval/…``)."""

    @abstractmethod
    def save(self, path: Path, trainer_state: dict) -> None:
        """Checkpoint everything needed to resume into ``path``."""

    @abstractmethod
    def load(self, path: Path) -> dict:
        """Restore a checkpoint written by :meth:`save`; returns the trainer state."""

    @abstractmethod
    def export_policy(self, path: Path) -> None:
        """Write the policy as a Hugging Face checkpoint directory."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release workers, threads and device memory."""

    def device_bytes_to_come(self, device: torch.device) -> int:
        """Device bytes training will still take on ``device`` after start-up (its gradients, optimizer
        state and activations): what an engine started there later (the test rollout's) leaves free."""
        return 0


BACKENDS: dict[str, type[Backend]] = {}


def register_backend(name: str):
    """Class decorator registering a Backend implementation under ``name``."""

    def wrap(cls: type[Backend]) -> type[Backend]:
        if name in BACKENDS and BACKENDS[name] is not cls:
            raise ValueError(f"backend {name!r} is already registered by {BACKENDS[name].__qualname__}")
        BACKENDS[name] = cls
        return cls

    return wrap


def resolve_backend(name: str) -> type[Backend]:
    """The registered class for ``name``; unknown names list the registered ones."""
    if name not in BACKENDS:
        raise ConfigError(f"train.backend: unknown backend {name!r}; registered backends: {sorted(BACKENDS)}")
    return BACKENDS[name]
