"""sleep/wake: move the storage of tensors (optimizer state and gradients, or a model's weights) off the
device and back.

Storages are resized in place (``untyped_storage().resize_(0)``) rather than tensors being replaced,
so every reference to a tensor (the optimizer, FSDP's sharded views, peft) stays valid and
``wake`` restores the same bytes at the same tensor identities. On CUDA the host copies are pinned
and the caching allocator is emptied after sleep so that a colocated rollout engine can take the
memory. A sleep whose bytes would not fit in the host's available memory is refused before it
copies anything (the kernel's out-of-memory killer would otherwise end the run without a word).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from areno.errors import ConfigError
from areno.train.dtensor import local_tensor


def collect_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Parameters, buffers, gradients and optimizer state tensors (local shards)."""
    tensors = [local_tensor(p) for p in model.parameters()]
    tensors.extend(local_tensor(b) for b in model.buffers())
    return tensors + training_state_tensors(model, optimizer)


def training_state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Gradients and optimizer state tensors (local shards): what a training side parks in host memory
    while the rollout runs; its weights stay (the sync after the rollout reads them)."""
    tensors = [local_tensor(p.grad) for p in model.parameters() if p.grad is not None]
    if optimizer is not None:
        for state in optimizer.state.values():
            tensors.extend(local_tensor(v) for v in state.values() if isinstance(v, torch.Tensor))
    return tensors


def available_host_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` (None where there is none: not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class StorageOffloader:
    """Holds host copies of device storages between ``sleep`` and ``wake``."""

    def __init__(self) -> None:
        self._saved: list[tuple[torch.UntypedStorage, torch.UntypedStorage]] = []

    @property
    def asleep(self) -> bool:
        return bool(self._saved)

    @property
    def held_bytes(self) -> int:
        """Bytes waiting in host memory for ``wake`` (0 when awake)."""
        return sum(host.nbytes() for _, host in self._saved)

    def sleep(self, tensors: Iterable[torch.Tensor]) -> int:
        """Copy each distinct storage to host memory, free it; returns the bytes freed."""
        if self._saved:
            raise RuntimeError("sleep() called twice without wake()")
        storages: dict[int, torch.UntypedStorage] = {}
        for t in tensors:
            storage = t.untyped_storage()
            if storage.nbytes() > 0:
                storages.setdefault(storage.data_ptr(), storage)
        self._check_host_room(storages.values())
        freed = 0
        for storage in storages.values():
            nbytes = storage.nbytes()
            pin = storage.device.type == "cuda"
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin).untyped_storage()
            host.copy_(storage, non_blocking=pin)
            self._saved.append((storage, host))
            freed += nbytes
        if any(s.device.type == "cuda" for s, _ in self._saved):
            torch.cuda.synchronize()
        for storage, _ in self._saved:
            storage.resize_(0)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return freed

    @staticmethod
    def _check_host_room(storages: Iterable[torch.UntypedStorage]) -> None:
        device_bytes = sum(s.nbytes() for s in storages if s.device.type != "cpu")
        available = available_host_bytes()
        if available is not None and device_bytes > 0.9 * available:
            raise ConfigError(
                f"cluster.offload=sleep: parking {device_bytes / 2**30:.1f} GiB of training state in host memory "
                f"needs more than the {available / 2**30:.1f} GiB available: use cluster.offload=none, a smaller "
                "model, or a host with more memory"
            )

    def wake(self) -> int:
        """Reallocate every storage and copy its bytes back; returns the bytes restored."""
        restored = 0
        for storage, host in self._saved:
            storage.resize_(host.nbytes())
            storage.copy_(host, non_blocking=storage.device.type == "cuda")
            restored += host.nbytes()
        if any(s.device.type == "cuda" for s, _ in self._saved):
            torch.cuda.synchronize()
        self._saved = []
        return restored
