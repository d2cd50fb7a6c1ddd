"""The training-backend contract (the shared branch of seed 004) and the loss reducer.

Every algorithm trains through these few methods; only the backend knows about devices,
processes, sharding and micro-batches. A specialization supplies three functions to
``train_step``:

- ``forward_fn(model, mb) -> dict[str, Tensor]`` runs the model on one packed micro-batch;
- ``loss_fn(model_output, mb, reducer) -> (loss, metrics)`` reduces per-token or per-sequence
  losses with the ``Reducer``;
- ``denominator_fn(mb) -> float`` is that micro-batch's share of the global normaliser (e.g.
  ``mb.loss_mask_T.sum()`` for a token mean, ``mb.num_seqs`` for a sequence mean).

Because the reducer divides by the denominator summed over *all* micro-batches of *all*
data-parallel ranks, the gradient does not depend on how the batch is packed or split.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from areno.types import TokenBatch

ForwardFn = Callable[[nn.Module, TokenBatch], dict[str, torch.Tensor]]
LossFn = Callable[[dict[str, torch.Tensor], TokenBatch, "Reducer"], tuple[torch.Tensor, dict[str, Any]]]
DenominatorFn = Callable[[TokenBatch], float | torch.Tensor]


class Reducer:
    """``(values * mask).sum() / global_denominator`` with the denominator of the whole step.

    Built by the backend for each ``train_step`` from the sum of ``denominator_fn`` over all
    micro-batches on all data-parallel ranks. A zero denominator (nothing to train on) divides by 1,
    so the loss is 0 rather than NaN.
    """

    def __init__(self, global_denominator: float, gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.global_denominator = float(global_denominator)
        self._divisor = self.global_denominator if self.global_denominator > 0 else 1.0
        self._gather = gather

    def gather(self, values_K: torch.Tensor) -> torch.Tensor:
        """``values_K`` (1-D, detached) of this micro-batch on every data-parallel rank, concatenated: a statistic of the whole micro-batch step, as one process of all the tokens would see it
        (``top_entropy_quantile``'s threshold). A collective: every rank calls it at the same micro-batch (the
        backend runs equal counts, an empty one a dummy). One process: ``values_K`` itself."""
        return values_K if self._gather is None else self._gather(values_K)

    def __call__(self, values: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if mask is not None:
            values = values * mask.to(values.dtype)
        return values.sum() / self._divisor


class TrainBackend(ABC):
    """Distributed set-up, forward/backward over packed micro-batches, optimizer step, weight
    export for policy sync, checkpoints and sleep/wake for one model role."""

    model: nn.Module
    """The (possibly wrapped) ``Decoder``; set by ``initialize``."""

    @abstractmethod
    def initialize(self, model_dir: str | Path, *, wrap_model: Callable[[nn.Module], nn.Module] | None = None) -> None:
        """Load the HF checkpoint in ``model_dir``, apply ``wrap_model`` (a recipe's head), parallelize
        it, build optimizer and schedule."""

    @abstractmethod
    def train_step(
        self, batch: TokenBatch, *, forward_fn: ForwardFn, loss_fn: LossFn, denominator_fn: DenominatorFn
    ) -> dict[str, float]:
        """One optimizer step on the global ``batch`` (every rank passes the same batch).

        Splits it into token-budget micro-batches balanced over data-parallel ranks, runs forward
        and backward on this rank's share, clips the gradient norm and steps optimizer and schedule.
        A non-finite grad norm skips the step (gradients are zeroed) and is counted. Returns
        ``loss`` (global), ``grad_norm``, ``lr``, ``skipped_steps``, ``tokens``, ``mbs``, ``step``
        and the loss_fn metrics summed over micro-batches and ranks (reduce them with the reducer
        to get global means).
        """

    @abstractmethod
    def forward_only(self, batch: TokenBatch, *, forward_fn: ForwardFn) -> dict[str, torch.Tensor]:
        """``forward_fn`` without gradients over the whole batch; outputs (names ending in ``_T``
        per token or ``_B`` per sequence) on CPU, concatenated in batch order, on every rank."""

    @abstractmethod
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (unsharded) HF-named weights, one at a time, adapters merged under LoRA.
        Collective: every rank must iterate it to the end. Tensors may alias the live parameters
        (one process, no LoRA): copy them to keep them past the next step."""

    @abstractmethod
    def save_checkpoint(self, path: str | Path, extra_state: dict[str, Any]) -> None:
        """Model, optimizer, schedule, step, RNG states and ``extra_state`` (e.g. dataloader
        position) under ``path``."""

    @abstractmethod
    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Restore everything ``save_checkpoint`` wrote; returns its ``extra_state``."""

    @abstractmethod
    def export_hf(self, path: str | Path) -> None:
        """Write safetensors + config.json (+ tokenizer files) that ``transformers`` loads."""

    @abstractmethod
    def sleep(self) -> int:
        """Move parameters, gradients and optimizer state off the device; returns bytes freed."""

    @abstractmethod
    def wake(self) -> int:
        """Bring back what ``sleep`` moved; returns bytes restored."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release the model, optimizer and any process group this backend created."""
