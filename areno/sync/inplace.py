"""Colocated policy sync: the rollout engine reads the trained tensors where they already are.

No transport at all when a destination aliases its source (same storage, dtype and layout); when
the engine keeps another dtype (bf16 inference from fp32 master weights) or its own TP slice of a
full tensor, one copy (a cast) per tensor, batched with ``torch._foreach_copy_``. Every name and
shape is validated before the first write, so a sync either writes everything or nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import torch

from areno.sync.base import PolicySyncTransport, ShardSpec, SyncStats, WeightSource, full_tensor


class InPlaceTransport(PolicySyncTransport):
    """Copy (or alias) trained tensors into the engine's live tensors on the same device.

    ``dest`` maps Hugging Face names to the engine's tensors; ``specs`` (optional) says which slice
    of the full tensor each destination holds (a TP shard), default the whole tensor.
    ``on_commit(version)`` tells the engine its weights are now ``version``.
    """

    name = "inplace"

    def __init__(
        self,
        source: WeightSource,
        dest: Mapping[str, torch.Tensor],
        specs: Mapping[str, ShardSpec] | None = None,
        on_commit: Callable[[int], None] | None = None,
    ) -> None:
        self.source = source
        self.dest = dict(dest)
        self.specs = dict(specs or {})
        self.on_commit = on_commit
        self.version: int | None = None
        """Version of the last completed sync."""
        self._validate()

    def _validate(self) -> None:
        shapes = {n: tuple(s) for n, s, _ in self.source.meta()}
        for name, dst in self.dest.items():
            if name not in shapes:
                raise ValueError(f"engine tensor {name!r} has no trained counterpart; check the weight names")
            spec = self.specs.get(name)
            want = spec.local_shape if spec is not None else shapes[name]
            if tuple(dst.shape) != tuple(want):
                raise ValueError(f"{name}: engine shape {tuple(dst.shape)} != trained slice shape {tuple(want)}")

    def _sync(self, version: int) -> SyncStats:
        cuda = any(t.is_cuda for t in self.dest.values())
        t0 = time.perf_counter()
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        copied = 0
        for name, tensor in self.source.iter_tensors():
            dst = self.dest.get(name)
            if dst is None:
                continue
            part = full_tensor(tensor)
            spec = self.specs.get(name)
            if spec is not None:
                part = spec.take(part)
            if _aliases(dst, part):
                continue
            if part.device != dst.device:
                raise ValueError(
                    f"{name}: trained tensor on {part.device}, engine tensor on {dst.device}; "
                    "the in-place transport needs both on one device (use the stream transport)"
                )
            dsts.append(dst)
            srcs.append(part)
            copied += dst.numel() * dst.element_size()
        if dsts:
            with torch.no_grad():  # engine tensors may be leaf parameters that require grad
                torch._foreach_copy_(dsts, srcs)
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        if self.on_commit is not None:
            self.on_commit(version)
        self.version = version
        total = time.perf_counter() - t0
        return SyncStats(
            version=version, total_time_s=total, transfer_time_s=elapsed, bytes=copied, tensors=len(self.dest)
        )


def _aliases(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """True when ``dst`` already is ``src`` (same memory, dtype and strides): nothing to move."""
    return (
        dst.data_ptr() == src.data_ptr()
        and dst.dtype == src.dtype
        and dst.stride() == src.stride()
        and dst.shape == src.shape
    )
