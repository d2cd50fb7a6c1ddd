"""ArenoBackend, registered as ``areno`` (seed 000): one colocated ArenoEngine by default.

``rollout_batch`` calls ``ArenoEngine.generate_rollout``; ``train`` calls ``ArenoEngine.step``.
Partitioned placements (``cluster.allocation_mode`` / ``train_devices`` + ``rollout_devices``)
give the engine separate rollout workers; the Trainer does not see the difference.
"""

from __future__ import annotations

from pathlib import Path

from areno.api.backend.base import Backend, RolloutBatch, register_backend
from areno.api.config import ArenoConfig
from areno.engine.api import ArenoEngine
from areno.engine.partitioned import PartitionedArenoEngine, is_partitioned


@register_backend("areno")
class ArenoBackend(Backend):
    engine: ArenoEngine

    def initialize(self, config: ArenoConfig, run_dir: Path) -> None:
        engine_cls = PartitionedArenoEngine if is_partitioned(config) else ArenoEngine
        self.engine = engine_cls(config, run_dir)
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

    def load(self, path: Path) -> dict:
        return self.engine.load(path)

    def export_policy(self, path: Path) -> None:
        """The policy as a Hugging Face checkpoint directory (what `transformers` loads)."""
        self.engine.export_policy(path)

    def shutdown(self) -> None:
        self.engine.shutdown()
