"""``TrainingSide``: where the recipe's roles train, seen from ``ArenoEngine``.

Implementations: ``LocalTrainingSide`` (``engine/local.py``: ``LocalTrainBackend``s under a
``RecipeRunner`` in this process) and ``RemoteTrainingSide`` (``engine/remote.py``: the
scheduler's ``TrainWorker``s, FSDP2 over the training sub-mesh). The training backends can also
sleep and wake (free device memory between steps); no engine path uses that yet, so it is not
part of this contract.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

import torch

from areno.engine.seams import SideSetup, WeightKind, WeightUpdate
from areno.types import TokenBatch


class TrainingSide(ABC):
    """Trains the recipe's roles on rollout batches and sends the policy out."""

    weight_kinds: frozenset[WeightKind]
    """The ways this side can send a policy version (``WeightUpdate.kind``)."""

    @abstractmethod
    def start(self, setup: SideSetup) -> None:
        """Load every role's model (the expensive part); the engine starts this side before the
        rollout side."""

    @abstractmethod
    def step(self, batch: TokenBatch, *, pass_order: list[int] | None, policy_version: int) -> dict[str, float]:
        """One training pass of every trainable role (``RecipeRunner.step``); metrics as
        ``role/name``. ``pass_order``: a later pass over the previous batch in this order;
        ``policy_version``: the version the rollout policy carries (the roles synced to rollout
        stamp it on the batch, for the proximal policy's interpolation)."""

    @abstractmethod
    def publish_weights(self, version: int, kind: WeightKind) -> WeightUpdate | None:
        """The sending half of a policy sync: the policy role's weights as ``version``, the
        ``kind`` way (one of ``weight_kinds``). None when no role syncs to the rollout side."""

    def prepare(self, batch: TokenBatch) -> dict[str, TokenBatch]:
        """Each trainable role's prepared batch of ``batch`` with no update (``RecipeRunner.prepare``):
        an offline recipe's held-out evaluation. Offline recipes train colocated, so only the local
        side has it."""
        raise NotImplementedError(f"{type(self).__name__} does not prepare held-out batches")

    def reward_scores(self, batch: TokenBatch) -> dict[str, torch.Tensor]:
        """Each reward model's (``RewardSync`` source's) score of every sequence of ``batch``, float32 [B] on the
        CPU, no update (``RecipeRunner.reward_scores``): a held-out evaluation adds them to its rewards as a
        training step does. Empty for a recipe without one."""
        raise NotImplementedError(f"{type(self).__name__} does not score held-out batches")

    def device_bytes_to_come(self) -> int:
        """Device bytes this side will take beyond what it holds after ``start``, on the device it
        shares with the rollout side: a rollout engine sizing its KV pool from free memory leaves them.
        0 for a side that shares no device."""
        return 0

    @abstractmethod
    def save(self, path: Path, extra_state: dict) -> None:
        """Write each trainable role's state (weights, optimizer, scheduler) under ``path/<role>``
        with ``extra_state`` beside it (``areno.train.checkpoint``'s layout)."""

    @abstractmethod
    def load(self, path: Path) -> dict:
        """Restore what :meth:`save` wrote; returns its ``extra_state``."""

    @abstractmethod
    def export_hf(self, path: Path) -> None:
        """Write the policy role as a Hugging Face checkpoint directory (no tokenizer)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release the backends (and their processes, for a remote side)."""
