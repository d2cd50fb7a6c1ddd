"""The two seams of ``ArenoEngine``: a training side and a rollout side, and the policy between them.

The engine owns the rollout pool and the data; everything that holds a model sits behind one of
two contracts, each with an in-process implementation (``engine/local.py``: one process,
colocated) and a remote one (``engine/remote.py``: worker processes of a partitioned world):

    TrainingSide   step, the sending half of a policy sync, save/load, export   (training_side.py)
    RolloutSide    the RolloutClient, pause/resume, the receiving half, stats   (rollout_side.py)

A policy sync is one ``WeightUpdate``: the training side makes it for a version, the rollout
side applies it. It travels one of three ways (``WeightKind``); each side names the kinds it
supports, and ``ArenoEngine`` refuses a pairing with none in common at start-up
(``choose_weight_kind``). An inference server of another system plugs in as a rollout side
whose client speaks its protocol (token ids in; token ids, log-probs and versions out) and whose
``update_weights`` loads a ``DISK`` export or joins a ``COLLECTIVE``.
"""

from __future__ import annotations

import enum
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areno.errors import ConfigError
from areno.recipes.config import TrainingConfig
from areno.sync.base import WeightSource


@dataclass(frozen=True)
class SideSetup:
    """What both sides start from, resolved by the engine before any model loads."""

    recipe: TrainingConfig
    model_dir: Path
    tokenizer: Any
    """The checkpoint's Hugging Face tokenizer (``eos_token_id`` set)."""
    device_bytes_reserved: int = 0
    """Rollout side: device bytes the training side sharing its device will take after start-up
    (``TrainingSide.device_bytes_to_come``), which an automatically sized KV pool leaves free."""


class WeightKind(enum.Enum):
    """How a policy version reaches the rollout side."""

    IN_PROCESS = "in_process"
    """The trained tensors themselves, in this process: copied (or aliased) into the engine's."""
    COLLECTIVE = "collective"
    """Streamed over a collective the training ranks have started sending on (by version)."""
    DISK = "disk"
    """A complete Hugging Face safetensors export in a directory the rollout side can read."""


@dataclass(frozen=True, kw_only=True)
class WeightUpdate:
    """One policy version on its way from the training side to the rollout side."""

    version: int
    """The policy version the rollout side serves once the update is applied."""
    kind: WeightKind
    source: WeightSource | None = None
    """``IN_PROCESS``: the trained tensors by Hugging Face name."""
    sending: tuple[Future, ...] = ()
    """``COLLECTIVE``: the training ranks' halves of the sync, under way; each resolves to that
    rank's ``policy_sync_*`` figures. The receiving half waits for them with its own."""
    path: Path | None = None
    """``DISK``: the export's directory."""
    sender_metrics: dict[str, float] = field(default_factory=dict)
    """Figures of the sending half known at hand-off (e.g. the controller's worker check)."""
    started_at: float = field(default_factory=time.perf_counter)
    """``time.perf_counter()`` when the sending half began: the whole sync's clock."""


def choose_weight_kind(sent: frozenset[WeightKind], received: frozenset[WeightKind]) -> WeightKind:
    """The kind a training side that can send ``sent`` and a rollout side that can receive
    ``received`` use (the fastest in common: in-process, then collective, then disk)."""
    for kind in WeightKind:
        if kind in sent and kind in received:
            return kind
    raise ConfigError(
        f"the training side sends the policy as {sorted(k.value for k in sent)} but the rollout side "
        f"receives {sorted(k.value for k in received)}: place them so that one way is common "
        "(colocated: in_process; partitioned: collective)"
    )
