"""sleep/wake: move the storage of tensors (optimizer state and gradients, or a model's weights) off the
device and back.

Storages are resized in place (``untyped_storage().resize_(0)``) rather than tensors being replaced,
so every reference to a tensor (the optimizer, FSDP's sharded views, peft) stays valid and
``wake`` restores the same bytes at the same tensor identities. The host copies live in one buffer of
exactly their size, kept for the next sleep; on CUDA it is page-locked with ``cudaHostRegister``
(PyTorch's pinned allocator rounds each block up to a power of two, close to 2x host memory for
a model's tensors), and the caching allocator is emptied after sleep so that a colocated rollout
engine can take the memory. A sleep whose bytes would not fit in the host's available memory is
refused before it copies anything (the kernel's out-of-memory killer would otherwise end the run
without a word).
"""

from __future__ import annotations

import weakref
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


HOST_ALIGN = 4096
"""Byte alignment of each storage's slot in the host buffer (page-aligned copies)."""


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over all of ``storage``'s bytes (copies through it reach the storage)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


def _unregister_host(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # noqa: BLE001 - at interpreter exit CUDA may be gone already; the memory goes with it
        pass


class StorageOffloader:
    """Holds host copies of device storages between ``sleep`` and ``wake``, in one host buffer that
    the next sleep reuses (``release`` gives it back)."""

    def __init__(self) -> None:
        self._saved: list[tuple[torch.UntypedStorage, int, int]] = []
        """(storage, offset in the host buffer, bytes) of each parked storage."""
        self._host: torch.Tensor | None = None
        self._registered = False
        """Whether ``_host`` is page-locked through ``cudaHostRegister``."""

    @property
    def asleep(self) -> bool:
        return bool(self._saved)

    @property
    def held_bytes(self) -> int:
        """Bytes waiting in host memory for ``wake`` (0 when awake)."""
        return sum(nbytes for _, _, nbytes in self._saved)

    @property
    def host_buffer_bytes(self) -> int:
        """Bytes of the host buffer kept for the sleeps (0 before the first and after ``release``)."""
        return self._host.numel() if self._host is not None else 0

    def sleep(self, tensors: Iterable[torch.Tensor]) -> int:
        """Copy each distinct storage to host memory, free it; returns the bytes freed."""
        if self._saved:
            raise RuntimeError("sleep() called twice without wake()")
        storages: dict[int, torch.UntypedStorage] = {}
        for t in tensors:
            storage = t.untyped_storage()
            if storage.nbytes() > 0:
                storages.setdefault(storage.data_ptr(), storage)
        slots, offset = [], 0
        for storage in storages.values():
            slots.append((storage, offset, storage.nbytes()))
            offset += -(-storage.nbytes() // HOST_ALIGN) * HOST_ALIGN
        cuda = any(s.device.type == "cuda" for s in storages.values())
        host = self._host_buffer(offset, storages.values(), pin=cuda)
        for storage, start, nbytes in slots:
            host[start : start + nbytes].copy_(_as_bytes(storage), non_blocking=cuda)
        self._saved = slots
        if cuda:
            torch.cuda.synchronize()
        for storage, _, _ in slots:
            storage.resize_(0)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return self.held_bytes

    def _host_buffer(self, nbytes: int, storages: Iterable[torch.UntypedStorage], *, pin: bool) -> torch.Tensor:
        """The kept host buffer when it is large enough (and pinned as ``pin`` asks), else a new one."""
        if self._host is not None and self._host.numel() >= nbytes and self._registered == pin:
            return self._host
        self.release()
        self._check_host_room(storages)
        host = torch.empty(nbytes, dtype=torch.uint8)
        if pin and nbytes:
            err = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), nbytes, 0)
            if err != 0:  # the copies would still work, synchronously: say so instead of slowing down
                raise RuntimeError(
                    f"cluster.offload=sleep: cudaHostRegister of {nbytes / 2**30:.1f} GiB failed ({err})"
                )
            # an offloader dropped without release() (a backend never shut down) must not free memory
            # that stays registered: a later host tensor there made its device copy fail ("invalid argument")
            self._unregister = weakref.finalize(host, _unregister_host, host.data_ptr())
            self._registered = True
        self._host = host
        return host

    def discard(self) -> None:
        """Forget what ``sleep`` parked (those tensors stay empty) and give the host buffer back: for a
        shutdown, which copied it back to the device only to drop it (out of memory beside an engine)."""
        self._saved = []
        self.release()

    def release(self) -> None:
        """Give the host buffer back (unpinned first); a no-op while asleep or without one."""
        if self._saved or self._host is None:
            return
        if self._registered:
            self._unregister()
            self._registered = False
        self._host = None

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
        cuda = False
        for storage, start, nbytes in self._saved:
            storage.resize_(nbytes)
            cuda = cuda or storage.device.type == "cuda"
            _as_bytes(storage).copy_(self._host[start : start + nbytes], non_blocking=storage.device.type == "cuda")
            restored += nbytes
        if cuda:
            torch.cuda.synchronize()
        self._saved = []
        return restored
