"""``EngineWeights``: the rollout engine's live weights and the policy version they hold.

A weight update is validated as a whole before any tensor changes (unknown or repeated name, wrong
shape, wrong dtype: a ``WeightUpdateError`` naming the tensor, the previous version keeps serving).
After any change — copied in (``update``), written in place by a colocated policy sync
(``tensors`` then ``commit``) or read from safetensors (``update_from_disk``) — in-flight requests
keep their tokens: their K/V is recomputed under the new weights (``recompute_kv_on_weight_update``)
or kept but barred from the prefix cache; the prefix cache is cleared either way. ``mark_torn`` (an
in-place sync that failed midway) stops steps and refuses requests until weights are committed again.
"""

from __future__ import annotations

import json
import numbers
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch

from areno.models import gpt_oss, moe, packed_projections, vl_text
from areno.models.config import GPT_OSS
from areno.models.hf_io import beyond_layers, log_skipped_layers, open_safetensors, safetensors_files
from areno.rollout.control import EngineControl
from areno.rollout.errors import WeightUpdateError
from areno.rollout.kv_cache import BlockAllocator
from areno.rollout.scheduler import Scheduler

_RECOMPUTED = "rotary_emb.inv_freq"
"""Buffers the model computes itself; a checkpoint may store them or not."""


class EngineWeights:
    def __init__(
        self,
        model: torch.nn.Module,
        model_config: Any,
        control: EngineControl,
        scheduler: Scheduler,
        allocator: BlockAllocator,
        *,
        device: torch.device,
        cast_weights: bool,
        recompute_kv: bool,
        shard: Callable[[str, torch.Tensor], torch.Tensor],
    ) -> None:
        """``shard``: the local shard of a full (Hugging Face shaped) tensor (identity at TP=1)."""
        self.model, self.model_config = model, model_config
        self.control, self.scheduler, self.allocator = control, scheduler, allocator
        self.device = device
        self.cast_weights, self.recompute_kv = cast_weights, recompute_kv
        self.shard = shard
        # After ``fuse_projections``: the parameters are views of the fused weights, written in place.
        self.params = dict(model.state_dict(keep_vars=True))

    def tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.params)

    def update(self, items: list[tuple[str, torch.Tensor]], version: int) -> None:
        with self.control.lock:
            targets = self._validate(items)
            with torch.no_grad():
                for param, tensor in targets:
                    param.copy_(tensor, non_blocking=True)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.changed(version)

    def commit(self, version: int) -> None:
        with self.control.lock:
            self.changed(version)

    def mark_torn(self, reason: str) -> None:
        with self.control.lock:
            self.control.torn = reason

    def update_from_disk(self, path: str, version: int, *, names: Iterable[str] | None = None) -> None:
        """``names``: the tensors the files update when they hold only some; None: every parameter.
        A ``version`` older than the served one is refused before any file is read."""
        if not isinstance(version, numbers.Integral) or isinstance(version, bool):
            raise TypeError(f"version must be an integer (the policy version), got {version!r}")
        if version < self.control.version:
            raise WeightUpdateError(
                f"weight update rejected: version {version} is older than the served version {self.control.version}: "
                f"versions only move forward; pass a version >= {self.control.version}"
            )
        fix = f"this engine keeps serving version {self.control.version}; re-export the checkpoint"
        tied = getattr(self.model_config, "tie_word_embeddings", False)
        items = read_checkpoint(path, tied=tied, fix=fix)
        skipped = [name for name, _ in items if beyond_layers(self.model_config, name)]  # GLM-4.5's MTP layers
        if skipped:
            log_skipped_layers(self.model_config, skipped, path)
            items = [(name, t) for name, t in items if not beyond_layers(self.model_config, name)]
        container = getattr(self.model_config, "container", None)
        if container is not None:  # a vision-language checkpoint's text model
            items = [(name, t) for disk, t in items if (name := vl_text.text_name(container, disk)) is not None]
        if vl_text.fused_experts(container):  # stored as held, or transposed
            held = {n: tuple(p.shape) for n, p in self.params.items()}
            items = [(n, vl_text.as_held(container, n, t, held[n]) if n in held else t) for n, t in items]
        elif (
            getattr(self.model_config, "architecture", None) == GPT_OSS
        ):  # gpt-oss: its router's name, its expert layouts
            items = gpt_oss.to_memory_items(items)
        elif getattr(self.model_config, "num_experts", 0):  # a checkpoint stores experts one by one
            items = moe.to_memory_items(self.model_config, items)
        items = packed_projections.to_memory_items(self.model_config, items)  # Phi-3's qkv_proj / gate_up_proj
        self._check_complete(path, {name for name, _ in items}, tied, names, fix)
        self.update(items, version)

    def _check_complete(self, path: str, found: set[str], tied: bool, names: Iterable[str] | None, fix: str) -> None:
        """A file of one tensor must not pass for a policy: the files hold every parameter (the tied
        output projection and rotary buffers excepted), or exactly the declared ``names``."""
        if names is None:
            expected = {n for n in self.params if not n.endswith(_RECOMPUTED) and not (tied and n == "lm_head.weight")}
            what = "the model's"
        else:
            expected, what = set(names), "the declared"
            extra = sorted(found - expected)
            if extra:
                raise WeightUpdateError(
                    f"weight update rejected: {path} holds {extra[0]!r}, which is not among the declared names "
                    f"({len(extra)} such tensors); {fix}"
                )
        missing = sorted(expected - found)
        if missing:
            raise WeightUpdateError(
                f"weight update rejected: {path} lacks {len(missing)} of {what} {len(expected)} tensors "
                f"(first {missing[0]!r}): export every parameter, or name the subset it updates; {fix}"
            )

    def _validate(self, items: list[tuple[str, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        seen: set[str] = set()
        targets = []
        for name, tensor in items:
            param = self.params.get(name)
            if param is None:
                raise WeightUpdateError(
                    f"weight update rejected: unknown tensor {name!r} (expected Hugging Face names)"
                )
            if name in seen:
                raise WeightUpdateError(f"weight update rejected: tensor {name!r} appears twice")
            seen.add(name)
            tensor = self.shard(name, tensor)
            if tuple(tensor.shape) != tuple(param.shape):
                raise WeightUpdateError(
                    f"weight update rejected: {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
                )
            same = tensor.dtype == param.dtype
            castable = self.cast_weights and tensor.dtype.is_floating_point and param.dtype.is_floating_point
            if not (same or castable):
                raise WeightUpdateError(
                    f"weight update rejected: {name!r} has dtype {tensor.dtype}, expected {param.dtype}"
                )
            targets.append((param, tensor))
        return targets

    def changed(self, version: int) -> None:
        """The weights now hold ``version``. Call holding the step lock."""
        if hasattr(self.model, "invalidate_cpu_gemms"):
            self.model.invalidate_cpu_gemms()  # packed copies re-pack at their next use
        if self.recompute_kv:
            self.scheduler.preempt_all()
        else:
            self.scheduler.mark_stale()
        self.allocator.clear_prefix_cache()
        self.control.version = int(version)
        self.control.torn = None


def read_checkpoint(path: str, *, tied: bool, fix: str) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of the Hugging Face safetensors at ``path`` (one file, or a directory: the shards
    its ``model.safetensors.index.json`` lists when it has one, else every ``*.safetensors`` in it),
    read in full before any weight changes. A missing shard, a tensor the index lists that its shard
    lacks, or a truncated/corrupt file raises a one-line ``WeightUpdateError`` ending in ``fix``.
    ``tied``: the model ties its output projection to the embedding (a stored ``lm_head.weight`` is
    skipped)."""
    index: dict[str, str] = {}
    try:
        if os.path.isdir(path):
            files = safetensors_files(path)
            index_path = os.path.join(path, "model.safetensors.index.json")
            if os.path.isfile(index_path):  # valid: safetensors_files checked it
                with open(index_path) as fh:
                    index = json.load(fh)["weight_map"]
        elif os.path.isfile(path):
            files = [path]
        else:
            raise FileNotFoundError(f"no .safetensors file or directory at {path!r}")
        items, found = [], set()
        for file in files:
            with open_safetensors(file, fix=fix) as f:
                for name in f.keys():
                    found.add(name)
                    if name.endswith(_RECOMPUTED) or (tied and name == "lm_head.weight"):
                        continue  # recomputed / tied checkpoints may store the shared matrix twice
                    items.append((name, f.get_tensor(name)))
    except (OSError, ValueError) as exc:
        raise WeightUpdateError(f"weight update rejected: {exc}") from None
    lost = [name for name in index if name not in found]
    if lost:
        raise WeightUpdateError(
            f"weight update rejected: tensor {lost[0]!r} is listed in {path}/model.safetensors"
            f".index.json in {index[lost[0]]} but that shard does not hold it "
            f"({len(lost)} such tensors); {fix}"
        )
    return items
