"""sleep/wake: move the storage of parameters, gradients and optimizer state off the device and back.

Storages are resized in place (``untyped_storage().resize_(0)``) rather than tensors being replaced,
so every reference to a parameter (the optimizer, FSDP's sharded views, peft) stays valid and
``wake`` restores the same bytes at the same tensor identities. On CUDA the host copies are pinned
and the caching allocator is emptied after sleep so that a colocated rollout engine can take the
memory.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from areno.train.dtensor import local_tensor


def collect_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Parameters, their gradients, buffers and optimizer state tensors (local shards)."""
    tensors: list[torch.Tensor] = []
    for p in model.parameters():
        tensors.append(local_tensor(p))
        if p.grad is not None:
            tensors.append(local_tensor(p.grad))
    tensors.extend(local_tensor(b) for b in model.buffers())
    if optimizer is not None:
        for state in optimizer.state.values():
            tensors.extend(local_tensor(v) for v in state.values() if isinstance(v, torch.Tensor))
    return tensors


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
        seen: set[int] = set()
        freed = 0
        for t in tensors:
            storage = t.untyped_storage()
            nbytes = storage.nbytes()
            if nbytes == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
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
