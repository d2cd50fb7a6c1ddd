"""The embedded rollout engine, its clients and the rollout pool."""

from areno.rollout.client import HTTPRolloutClient, InProcessRolloutClient, RolloutClient
from areno.rollout.engine import RolloutEngine, RolloutEngineConfig

__all__ = ["HTTPRolloutClient", "InProcessRolloutClient", "RolloutClient", "RolloutEngine", "RolloutEngineConfig"]
