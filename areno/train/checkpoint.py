"""Checkpoints with ``torch.distributed.checkpoint`` (DCP); works with or without a process group.

Layout of a checkpoint directory:
- DCP files (``.metadata``, ``__*.distcp``): ``model`` and ``optim`` state, sharded as trained
  (each rank writes its shards; a different world size can load them, DCP reshards);
- ``trainer_state.pt`` (rank 0): step, scheduler state, skipped-step count, caller's ``extra``;
- ``rng_rank{r}.pt``: every rank's torch / CUDA / python RNG states, for bit-for-bit resume.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

TRAINER_STATE = "trainer_state.pt"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(
    path: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    trainer_state: dict[str, Any],
) -> None:
    path = Path(path)
    if _rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer if optimizer is not None else [])
    state: dict[str, Any] = {"model": model_sd}
    if optimizer is not None:
        state["optim"] = optim_sd
    dcp.save(state, checkpoint_id=str(path))
    torch.save(rng_state(), path / f"rng_rank{_rank()}.pt")
    if _rank() == 0:
        torch.save(trainer_state, path / TRAINER_STATE)
    _barrier()


def _check_shapes(path: Path, model_sd: dict[str, torch.Tensor]) -> None:
    """One-line error naming the first model tensor the checkpoint lacks or has in another shape."""
    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    for name, tensor in model_sd.items():
        key = f"model.{name}"
        stored = metadata.get(key)
        if not isinstance(stored, TensorStorageMetadata):
            raise ValueError(
                f"checkpoint {path} has no tensor {name!r}: it was saved from a different model "
                f"(or with/without LoRA); load a checkpoint of this model"
            )
        if tuple(stored.size) != tuple(tensor.shape):
            raise ValueError(
                f"checkpoint {path} tensor {name!r} has shape {tuple(stored.size)} but the model's is "
                f"{tuple(tensor.shape)}: it was saved from a different model shape"
            )


def load(
    path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> dict[str, Any]:
    """Restore model, optimizer and this rank's RNG in place; returns the trainer state."""
    path = Path(path)
    if not (path / ".metadata").is_file() or not (path / TRAINER_STATE).is_file():
        raise FileNotFoundError(f"{path} is not an areno checkpoint (no .metadata / {TRAINER_STATE})")
    model_sd, optim_sd = get_state_dict(model, optimizer if optimizer is not None else [])
    _check_shapes(path, model_sd)
    state: dict[str, Any] = {"model": model_sd}
    if optimizer is not None:
        state["optim"] = optim_sd
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        model,
        optimizer if optimizer is not None else [],
        model_state_dict=state["model"],
        optim_state_dict=state.get("optim", {}),
    )
    rng_path = path / f"rng_rank{_rank()}.pt"
    if rng_path.is_file():  # absent when resuming on more ranks than saved: RNG is then re-seeded
        set_rng_state(torch.load(rng_path, weights_only=True))
    return torch.load(path / TRAINER_STATE, weights_only=True)  # never arbitrary pickle
