"""``LocalTrainBackend``: one process, no ``torch.distributed`` process group (the CPU demo default).

Same micro-batching, loss normalisation, optimizer, checkpoint and sleep/wake code as the FSDP2
backend (``PackedTrainBackend``); parameters are plain tensors on one device. On CUDA with
``param_dtype='bfloat16'`` and fp32 master weights, forward/backward run under bf16 autocast.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack

import torch
from torch import nn

from areno.errors import ConfigError
from areno.train.backend import PackedTrainBackend
from areno.train.parallelize import parallelize


class LocalTrainBackend(PackedTrainBackend):
    """Single-process training backend (CPU or one GPU)."""

    def _setup(self) -> None:
        if self.cfg.dp_shard_size not in (-1, 1) or self.cfg.dp_replicate_size != 1 or self.cfg.tp_size != 1:
            raise ValueError(
                "LocalTrainBackend runs one process: dp_shard_size, dp_replicate_size and tp_size "
                "must be 1 (use FSDP2TrainBackend for parallel training)"
            )
        self.device = torch.device(self.cfg.resolved_device())
        if self.cfg.dtype == "bfloat16" and self.cfg.resolved_param_dtype(self.device.type) == "float32":
            # one process computes in its weights' dtype or narrower (autocast): float32 compute over bf16
            # weights would silently run in bf16
            raise ConfigError(
                "model.compute_dtype=float32 with model.dtype=bfloat16: a one-process training backend computes in "
                "its weights' dtype or narrower, so it would run in bfloat16; set model.dtype=float32 (float32 "
                "weights), or model.compute_dtype=bfloat16"
            )
        self._dp_rank, self._dp_size = 0, 1

    def _parallelize(self, model: nn.Module) -> nn.Module:
        compute = self.cfg.torch_param_dtype(self.device.type)
        return parallelize(model, None, self.cfg, param_dtype=compute, device_type=self.device.type).to(self.device)

    def _autocast(self) -> AbstractContextManager:
        stack = ExitStack()
        stack.enter_context(super()._autocast())
        compute = self.cfg.resolved_param_dtype(self.device.type)
        if compute != self.cfg.dtype and compute == "bfloat16":
            stack.enter_context(torch.autocast(self.device.type, dtype=torch.bfloat16))
        return stack
