"""areno's Python API (docs/python.md): a run's config (``ArenoConfig`` from its sections, or
``load_config(path, overrides)``), the ``Trainer`` that runs it, and ``run_pipeline`` (a warm start,
then the recipe, as ``areno train`` runs them)."""

from areno.api.config import (
    ArenoConfig,
    ClusterSection,
    DataSection,
    ModelSection,
    ObserveSection,
    OptimConfig,
    RewardSection,
    RolloutSection,
    TestRolloutSection,
    TrainSection,
    WarmStartSection,
    load_config,
    to_yaml,
)
from areno.api.pipeline import run_pipeline
from areno.api.trainer import Trainer

__all__ = [
    "ArenoConfig",
    "ClusterSection",
    "DataSection",
    "ModelSection",
    "ObserveSection",
    "OptimConfig",
    "RewardSection",
    "RolloutSection",
    "TestRolloutSection",
    "Trainer",
    "TrainSection",
    "WarmStartSection",
    "load_config",
    "run_pipeline",
    "to_yaml",
]
