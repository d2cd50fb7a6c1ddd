"""ArenoBackend, registered as ``areno`` (seed 000): one ArenoEngine, colocated by default.

``rollout_batch`` calls ``ArenoEngine.generate_rollout``; ``train`` calls ``ArenoEngine.step``.
Partitioned placements (``cluster.allocation_mode`` / ``train_devices`` + ``rollout_devices``)
give the engine remote sides (``areno.engine.placement.build_engine``); the Trainer does not see
the difference.
"""

from __future__ import annotations

from pathlib import Path

import torch

from areno.api.backend.base import Backend, RolloutBatch, register_backend
from areno.engine.api import ArenoEngine
from areno.engine.config import ArenoConfig
from areno.engine.placement import build_engine


@register_backend("areno")
class ArenoBackend(Backend):
    engine: ArenoEngine

    def initialize(self, config: ArenoConfig, run_dir: Path) -> None:
        self.engine = build_engine(config, run_dir)
        self.engine.initialize()

    def rollout_batch(self, rollout_id: int) -> RolloutBatch:
        return self.engine.generate_rollout(rollout_id)

    def train(self, rollout_id: int, rollout: RolloutBatch) -> dict[str, float]:
        return self.engine.step(rollout)

    def update_weights(self) -> dict[str, float]:
        return self.engine.update_weights()

    def evaluate(self) -> dict[str, float]:
        return self.engine.evaluate()

    def save(self, path: Path, trainer_state: dict) -> None:
        self.engine.save(path, trainer_state)

    def device_bytes_to_come(self, device: torch.device) -> int:
        return self.engine.training_bytes_to_come(device)

    def load(self, path: Path) -> dict:
        return self.engine.load(path)

    def export_policy(self, path: Path | str) -> None:
        """The policy as a Hugging Face checkpoint directory (what `transformers` loads)."""
        self.engine.export_policy(Path(path))

    def shutdown(self) -> None:
        self.engine.shutdown()
