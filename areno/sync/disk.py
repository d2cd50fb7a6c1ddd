"""Disk policy sync: the policy as Hugging Face safetensors, published atomically, for the
test-rollout group and for remote inference servers.

A version is written into ``<root>/.tmp-policy-v<N>-<pid>/`` (safetensors shards of at most
``max_shard_bytes``, ``model.safetensors.index.json``, the model directory's JSON files such as
``config.json``), fsynced, marked ``COMPLETE`` and renamed to ``<root>/policy-v<N>/``; readers only
ever see complete directories (``latest_policy``). Then every receiver is called with the path and
version — e.g. ``RolloutEngine.update_weights_from_disk`` or a client that tells a remote server to
load it.

The files hold what a checkpoint on disk holds (``hf_io.save_model``), which is what vLLM and SGLang
load: given the policy's ``model_config``, an expert model's fused tensors are written as
transformers' per-expert ones (``CheckpointNamedSource``); a dense model's names are the
checkpoint's already; areno's own ``RolloutEngine.update_weights_from_disk`` stacks the experts back.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from areno.models import moe
from areno.models.config import GPT_OSS, ModelConfig
from areno.models.hf_io import checkpoint_names
from areno.sync.base import PolicySyncTransport, SyncStats, WeightSource, full_tensor

COMPLETE = "COMPLETE"
_DIR_RE = re.compile(r"^policy-v(\d+)$")


def policy_dir(root: str | Path, version: int) -> Path:
    return Path(root) / f"policy-v{version:08d}"


def latest_policy(root: str | Path) -> tuple[Path, int] | None:
    """The newest complete policy directory under ``root`` and its version, or None."""
    best = None
    root = Path(root)
    if not root.is_dir():
        return None
    for p in root.iterdir():
        m = _DIR_RE.match(p.name)
        if m and (p / COMPLETE).exists() and (best is None or int(m.group(1)) > best[1]):
            best = (p, int(m.group(1)))
    return best


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_names_differ(config: ModelConfig) -> bool:
    """Whether a checkpoint of ``config`` stores tensors under other names or layouts than the model holds
    them (experts one by one, gpt-oss's router and expert layouts, a vision-language checkpoint's text model):
    ``CheckpointNamedSource`` renames."""
    return bool(moe.disk_to_memory(config)) or config.container is not None or config.architecture == GPT_OSS


class CheckpointNamedSource(WeightSource):
    """``source`` under the names and layouts of a checkpoint on disk, as ``hf_io.save_model``
    writes them (``moe.to_disk_state``): an expert model's fused tensors (``mlp.experts.gate_up_proj``
    [E, 2I, D], ``mlp.experts.down_proj`` [E, D, I]) as transformers' per-expert ones, Mixtral's router
    under ``block_sparse_moe``; a vision-language checkpoint's text model under its prefix (``vl_text``);
    every other tensor as it comes. What vLLM and SGLang load (their
    loaders know the checkpoint's names only), from disk or over their weight-transfer routes.

    The plan is ``hf_io.checkpoint_names`` run once, on meta tensors shaped as ``source.meta()``: each
    tensor it returns is one of its inputs (renamed at most) or a contiguous slice of one, which each sync cuts
    from the full tensor in the same place. So a sync still gathers and hands over one tensor at a
    time, and the mapping is built once, not per tensor.
    """

    def __init__(self, source: WeightSource, config: ModelConfig) -> None:
        self.source = source
        self.config = config
        self._meta: list[tuple[str, tuple[int, ...], torch.dtype]] | None = None
        self._plan: dict[str, list[tuple[str, tuple[int, ...], int | None]]] = {}
        """Source name -> its ``(disk name, shape, offset)`` in order; offset None: the whole tensor,
        else the slice's first element in the flattened full tensor."""

    def _make_plan(self) -> None:
        inputs = {name: torch.empty(shape, dtype=dtype, device="meta") for name, shape, dtype in self.source.meta()}
        owner = {id(t): name for name, t in inputs.items()}
        self._plan = {name: [] for name in inputs}
        self._meta = []
        for disk, t in checkpoint_names(self.config, inputs).items():
            if id(t) in owner:
                self._plan[owner[id(t)]].append((disk, tuple(t.shape), None))
            else:
                assert t._base is not None and id(t._base) in owner and t.is_contiguous(), disk
                self._plan[owner[id(t._base)]].append((disk, tuple(t.shape), t.storage_offset()))
            self._meta.append((disk, tuple(t.shape), t.dtype))

    def meta(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        if self._meta is None:
            self._make_plan()
        return self._meta

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.meta()
        for name, tensor in self.source.iter_tensors():
            parts = self._plan[name]
            if all(offset is None for _, _, offset in parts):
                yield from ((disk, tensor) for disk, _, _ in parts)
                continue
            flat = full_tensor(tensor).contiguous().view(-1)
            for disk, shape, offset in parts:
                start = offset or 0
                yield disk, flat[start : start + math.prod(shape)].view(shape)


class DiskTransport(PolicySyncTransport):
    """Write the policy as HF safetensors atomically, then notify receivers.

    Every training rank calls ``sync`` (sharded weights are gathered collectively); only the rank
    with ``is_writer=True`` writes and notifies. ``receivers`` are callables ``(path, version)``.
    ``model_config``: the policy's, to write an expert model under its checkpoint names
    (``CheckpointNamedSource``); None writes the source's names as they are.
    """

    name = "disk"

    def __init__(
        self,
        source: WeightSource,
        root: str | Path,
        receivers: Sequence[Callable[[str, int], None]] = (),
        *,
        is_writer: bool = True,
        model_dir: str | Path | None = None,
        model_config: ModelConfig | None = None,
        keep_last: int = 2,
        max_shard_bytes: int = 4 << 30,
    ) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
        # a dense model's names are the checkpoint's already: no second pass over the weights to plan them
        renamed = model_config is not None and checkpoint_names_differ(model_config)
        self.source = CheckpointNamedSource(source, model_config) if renamed else source
        self.root = Path(root)
        self.receivers = list(receivers)
        self.is_writer = is_writer
        self.model_dir = Path(model_dir) if model_dir is not None else None
        self.keep_last = keep_last
        self.max_shard_bytes = max_shard_bytes

    def _sync(self, version: int) -> SyncStats:
        t0 = time.perf_counter()
        tmp = self.root / f".tmp-policy-v{version:08d}-{os.getpid()}"
        if self.is_writer:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        shards: list[dict[str, torch.Tensor]] = [{}]
        fill = 0
        nbytes = 0
        ntensors = 0
        files: list[str] = []
        weight_map: dict[str, str] = {}

        def flush() -> None:
            name = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shards[-1], str(tmp / name), metadata={"format": "pt"})
            files.append(name)
            weight_map.update({k: name for k in shards[-1]})
            shards.append({})

        t_io = time.perf_counter()
        for name, tensor in self.source.iter_tensors():
            full = full_tensor(tensor)
            if not self.is_writer:
                continue
            size = full.numel() * full.element_size()
            if shards[-1] and fill + size > self.max_shard_bytes:
                flush()
                fill = 0
            # A private contiguous CPU copy: safetensors refuses shared storage (tied weights).
            shards[-1][name] = full.detach().to("cpu", copy=True).contiguous()
            fill += size
            nbytes += size
            ntensors += 1
        if self.is_writer:
            if shards[-1] or not files:
                flush()
            # Rename shards to the HF "-of-" convention now that the count is known.
            total = len(files)
            renamed = {}
            for i, f in enumerate(files):
                new = f"model-{i + 1:05d}-of-{total:05d}.safetensors"
                (tmp / f).rename(tmp / new)
                renamed[f] = new
            index = {
                "metadata": {"total_size": nbytes, "policy_version": version},
                "weight_map": {k: renamed[v] for k, v in weight_map.items()},
            }
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
            if self.model_dir is not None:
                for p in self.model_dir.iterdir():
                    meta_file = p.suffix in (".json", ".txt", ".model") and p.name != "model.safetensors.index.json"
                    if p.is_file() and meta_file:
                        shutil.copy2(p, tmp / p.name)
            for p in tmp.iterdir():
                with open(p, "rb+") as fh:
                    os.fsync(fh.fileno())
            (tmp / COMPLETE).write_text(str(version))
            _fsync_dir(tmp)
            final = policy_dir(self.root, version)
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(self.root)
            io_time = time.perf_counter() - t_io
            for receiver in self.receivers:
                receiver(str(final), version)
            self._prune()
        else:
            io_time = time.perf_counter() - t_io
        return SyncStats(
            version=version,
            total_time_s=time.perf_counter() - t0,
            transfer_time_s=io_time,
            bytes=nbytes,
            tensors=ntensors,
        )

    def _prune(self) -> None:
        versions = sorted((int(m.group(1)), p) for p in self.root.iterdir() if (m := _DIR_RE.match(p.name)))
        for _, p in versions[: -self.keep_last]:
            shutil.rmtree(p, ignore_errors=True)
