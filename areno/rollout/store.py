"""Large observations by reference: workflows put big tensors (images, environment states) into an
``ObservationStore`` and pass only a small ``StoreRef`` through the results queue; the trainer
fetches the tensors lazily when it builds a batch (``fetch_refs``), then releases them.

Two implementations of one small contract:
- ``InProcessStore``: a dict behind a lock, for workflows and trainer in one process.
- ``DirectoryStore``: one file per key under a directory (``/dev/shm`` by default, i.e. shared
  memory on Linux), so rollout worker processes and the trainer process share it by path. Writes
  go to a temporary name and are renamed into place, so a reader never sees half a tensor.
"""

from __future__ import annotations

import os
import tempfile
import threading
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file


@dataclass(frozen=True)
class StoreRef:
    """What travels instead of a tensor: the key plus enough metadata to plan a batch."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int

    def fetch(self, store: ObservationStore) -> torch.Tensor:
        return store.get(self.key)


class StoreKeyError(KeyError):
    """A key that is not (or no longer) in the store."""


class ObservationStore(ABC):
    """put/get/delete of tensors by opaque string key."""

    def put(self, tensor: torch.Tensor) -> StoreRef:
        """Store ``tensor`` (copied to CPU, contiguous) and return its reference."""
        tensor = tensor.detach().to("cpu").contiguous()
        key = uuid.uuid4().hex
        self._put(key, tensor)
        return StoreRef(
            key, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."), tensor.numel() * tensor.element_size()
        )

    def get(self, key: str) -> torch.Tensor:
        try:
            return self._get(key)
        except (KeyError, FileNotFoundError):
            raise StoreKeyError(
                f"observation {key!r} is not in the store (already released, or another store)"
            ) from None

    @abstractmethod
    def _put(self, key: str, tensor: torch.Tensor) -> None: ...

    @abstractmethod
    def _get(self, key: str) -> torch.Tensor: ...

    @abstractmethod
    def delete(self, key: str) -> None:
        """Forget ``key`` (no error when already gone)."""

    @abstractmethod
    def __len__(self) -> int: ...


class InProcessStore(ObservationStore):
    """Tensors in a dict, for a workflow and trainer sharing one process."""

    def __init__(self) -> None:
        self._data: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()

    def _put(self, key: str, tensor: torch.Tensor) -> None:
        with self._lock:
            self._data[key] = tensor

    def _get(self, key: str) -> torch.Tensor:
        with self._lock:
            return self._data[key]

    def delete(self, key: str) -> None:
        with self._lock:
            self._data.pop(key, None)

    def __len__(self) -> int:
        return len(self._data)


def _default_root() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


class DirectoryStore(ObservationStore):
    """One safetensors file per key under ``root``; every process given the same ``root`` shares it.

    Picklable (only the path travels), so it can be handed to rollout worker processes.
    """

    def __init__(self, root: str | os.PathLike | None = None) -> None:
        if root is None:
            root = tempfile.mkdtemp(prefix="areno-store-", dir=_default_root())
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        if not key.isalnum():
            raise ValueError(f"store keys are alphanumeric, got {key!r}")
        return self.root / f"{key}.safetensors"

    def _put(self, key: str, tensor: torch.Tensor) -> None:
        final = self._path(key)
        tmp = final.with_suffix(f".tmp{os.getpid()}")
        save_file({"t": tensor}, str(tmp))
        os.replace(tmp, final)

    def _get(self, key: str) -> torch.Tensor:
        return load_file(str(self._path(key)))["t"]

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def __len__(self) -> int:
        return sum(1 for _ in self.root.glob("*.safetensors"))

    def __reduce__(self) -> tuple[Any, ...]:
        return (DirectoryStore, (str(self.root),))


def _walk(obj: Any, fn: Any) -> Any:
    if isinstance(obj, StoreRef):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _walk(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_walk(v, fn) for v in obj)
    return obj


def fetch_refs(obj: Any, store: ObservationStore) -> Any:
    """A copy of ``obj`` (dicts/lists/tuples) with every ``StoreRef`` replaced by its tensor."""
    return _walk(obj, lambda ref: ref.fetch(store))


def release_refs(obj: Any, store: ObservationStore) -> int:
    """Delete every tensor ``obj`` refers to; returns how many references were found."""
    found = []
    _walk(obj, found.append)
    for ref in found:
        store.delete(ref.key)
    return len(found)
