"""The logic both training backends share: micro-batch loop with global loss normalisation,
grad clipping and skip-on-non-finite, forward-only scoring, weight export, checkpoints and
sleep/wake. Subclasses only say how processes and parameters are laid out (``_setup``,
``_parallelize``, collectives, ``_full``).

Legend: B = sequences, T = packed tokens.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import random
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from areno.errors import ConfigError, ModelDirError, UserError
from areno.models import moe, prefix_sharing
from areno.models.config import ModelConfig
from areno.models.decoder import Decoder
from areno.models.hf_io import build_model, load_model, save_state
from areno.models.logprobs import compiled_logprob_kernels, fp32_logits
from areno.models.vision import vision_towers
from areno.observe.trace import span
from areno.train import checkpoint
from areno.train.base import DenominatorFn, ForwardFn, LossFn, Reducer, TrainBackend
from areno.train.config import TrainBackendConfig
from areno.train.dtensor import is_dtensor
from areno.train.lora import (
    adapter_named_weights,
    apply_lora,
    head_named_weights,
    merged_named_weights,
    model_config_of,
    save_adapter,
)
from areno.train.offload import StorageOffloader, available_host_bytes, training_state_tensors
from areno.train.optim import (
    NonFiniteParametersError,
    NonFiniteStepError,
    build_optimizer,
    build_scheduler,
    clip_grads,
    global_grad_norm,
    group_weight_decay,
    nonfinite_parameters,
    trainable_parameters,
)
from areno.train.packing import (
    MICRO_BATCH_ROWS,
    MicroBatchPlan,
    MicroBatchSpec,
    activation_bytes_per_token,
    dummy_batch,
    estimate_max_tokens_per_mb,
    plan_micro_batches,
    truncate_long_sequences,
    untruncate_outputs,
)
from areno.train.parallelize import compile_cache_dir
from areno.types import ROUTES_KEY, TokenBatch, host_to_device

logger = logging.getLogger(__name__)

CPU_TOKENS_PER_MB = (4096, 16384)
"""Bounds of a CPU run's default micro-batch budget: the activations' estimate over 1/``CPU_MEMORY_SHARE``
of the host's available memory (split over the run's training processes), at least the first (what a large
model on a small host keeps), at most the second. Fewer, larger micro-batches cost less on a CPU: each one
casts the weights and adds their gradients again (bench/LOG.md: a cpu12m step 1.05x faster in one
micro-batch than in three)."""
CPU_MEMORY_SHARE = 4
ADAPTER_SUBDIR = "adapter"
"""A LoRA backend's checkpoint directory holds its adapter here, in PEFT's layout."""
# Files copied from the source model directory into an HF export (tokenizer and friends; the source's
# generation config replaces the one save_model derives from config.json, which has one EOS id and no
# sampling defaults).
_TOKENIZER_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)


@contextlib.contextmanager
def dropout_off(model: nn.Module) -> Iterator[None]:
    """Dropout modules in eval mode for a forward without an update (LoRA's ``lora_dropout``): the old
    policy's log-probs and a critic's values are the model's, not one noisy draw of it. Only dropout
    modules change mode, so compiled layers keep their training-mode graphs."""
    active = [m for m in model.modules() if isinstance(m, nn.Dropout) and m.p > 0 and m.training]
    for m in active:
        m.eval()
    try:
        yield
    finally:
        for m in active:
            m.train()


def batch_to_device(batch: TokenBatch, device: torch.device | str) -> TokenBatch:
    """The same batch with every tensor on ``device``, except ``cu_seqlens_B1``, which stays on the
    host (pinned for a CUDA device): sequence bounds are read as Python ints (token counts, longest
    length, output sizes), and reading them from a device tensor would stall the host on the GPU
    once per micro-batch. Code that needs them on the device moves them (``.to(device,
    non_blocking=True)``). No copy here waits for the GPU, so the host prepares micro-batch i+1
    while the GPU still runs micro-batch i."""
    device = torch.device(device)
    moved = {
        f.name: host_to_device(getattr(batch, f.name), device)
        for f in dataclasses.fields(batch)
        if isinstance(getattr(batch, f.name), torch.Tensor) and f.name != "cu_seqlens_B1"
    }
    if device.type == "cuda":
        moved["cu_seqlens_B1"] = batch.cu_seqlens_B1.pin_memory()
    return dataclasses.replace(batch, **moved, extra={k: host_to_device(v, device) for k, v in batch.extra.items()})


def check_full_state(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], *, role: str) -> None:
    """What ``load_state_dict(strict=True)`` into a fresh model checked: the same names, each of its
    shape. A RuntimeError naming the differences otherwise (an export of a damaged or foreign state)."""
    missing = sorted(expected.keys() - state.keys())
    unexpected = sorted(state.keys() - expected.keys())
    shapes = [
        f"{k} {tuple(state[k].shape)} (expected {tuple(v.shape)})"
        for k, v in expected.items()
        if k in state and state[k].shape != v.shape
    ]
    if missing or unexpected or shapes:
        raise RuntimeError(
            f"the {role} role's weights do not match its model config: missing {missing[:4]}, "
            f"unexpected {unexpected[:4]}, wrong shapes {shapes[:4]}"
        )


class PackedTrainBackend(TrainBackend):
    """Shared implementation of ``TrainBackend``; see ``LocalTrainBackend`` / ``FSDP2TrainBackend``."""

    # set in __init__
    cfg: TrainBackendConfig
    # set in initialize()
    model: nn.Module
    model_config: ModelConfig
    _decoder_prefix: str
    """Where ``model`` holds the loaded decoder (``"decoder."`` inside a value head, ``""`` when bare)."""
    _optimizer: torch.optim.Optimizer | None
    _scheduler: torch.optim.lr_scheduler.LRScheduler | None
    _builds_optimizer: bool = False
    """A trainable role whose optimizer is built on first use (``optimizer``)."""
    device: torch.device
    max_tokens_per_mb: int
    _routing: moe.RoutingMonitor
    """Expert models: the router balance loss and the old-policy vs training routing mismatch."""
    _model_dir: Path
    _dp_rank: int
    _dp_size: int
    _cp_size: int = 1
    """Context-parallel ranks sharing each micro-batch (``TrainBackendConfig.cp_size``, the ``c`` of ``cluster.allocation_mode``; the FSDP backend sets it)."""
    # training progress (checkpointed)
    _step: int
    _skipped_steps: int
    _consecutive_skips: int
    # set by each train_step
    _user_loss: str | None = None
    """``<Class>.compute_loss`` of the step's loss when it is not one of areno's (``user_loss_name``)."""

    def __init__(self, cfg: TrainBackendConfig) -> None:
        self.cfg = cfg
        self.optimizer = None
        self.shares_prompts = False
        """Whether the model runs a group's common prompt once (``train.share_prompts``, set by ``initialize``)."""
        self._step = 0
        self._skipped_steps = 0
        self._consecutive_skips = 0
        self._updated = False
        """Whether an optimizer step changed the weights since they were loaded (from ``_weights_from``)."""
        self._weights_from: Path | None = None
        # incremental checkpoints (train.checkpoint_full_every): the last full one and its tensor hashes
        self._ckpt_base: Path | None = None
        self._ckpt_base_hashes: dict[str, str] = {}
        self._saves_since_full = 0
        self._offloader = StorageOffloader()
        self._woken_lazily = False
        """``wake(lazy=True)`` left the optimizer state in host memory; the first reader or writer of it
        (``_restore_parked``) brings it back."""
        self._initialized = False
        self.compile_cache: Path | None = None
        """Inductor's cache directory when this backend compiles (``train.compile``), else None."""
        self._first_step_done = False
        self._plain_params: bool | None = None
        """Whether no parameter is a DTensor (read once, for ``_queues_optimizer_step``)."""

    # ------------------------------------------------------------------ subclass hooks
    def _setup(self) -> None:
        """Set ``device``, ``_dp_rank``, ``_dp_size`` (and any process group / mesh)."""
        raise NotImplementedError

    def _parallelize(self, model: nn.Module) -> nn.Module:
        raise NotImplementedError

    def _all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over data-parallel ranks (each DP rank counted once)."""
        return tensor

    def _gather_dp(self, obj: Any) -> list[Any]:
        """``obj`` of every data-parallel rank, in DP-rank order."""
        return [obj]

    def _gather_token_values(self, values_K: torch.Tensor) -> torch.Tensor:
        """``values_K`` (1-D) of every data-parallel rank's micro-batch, concatenated in rank order
        (``Reducer.gather``); the TP and CP ranks of a data rank compute one loss on its whole micro-batch."""
        return torch.cat(self._gather_dp(values_K.detach().cpu())).to(values_K.device)

    def _full(self, tensor: torch.Tensor) -> torch.Tensor:
        """The full (unsharded) value of a possibly sharded tensor."""
        return tensor

    def _before_backward(self, last: bool) -> None:
        """Called before each micro-batch's backward; ``last`` for this rank's last one of the step
        (FSDP reduces gradients only then when nothing is sharded)."""

    def _loss_scale(self) -> float:
        """Factor on each micro-batch loss before backward (undoes DP gradient averaging)."""
        return 1.0

    def _autocast(self) -> AbstractContextManager:
        """Context of every forward: the compiled log-prob head kernels under ``compile``, float32 logits
        under ``fp32_logits`` (a subclass adds autocast on top)."""
        stack = ExitStack()
        if self.cfg.compile:
            stack.enter_context(compiled_logprob_kernels())
        if self.cfg.fp32_logits:
            stack.enter_context(fp32_logits())
        return stack

    def _after_forward_only(self) -> None:
        """Free anything forward-only left gathered (FSDP's unsharded root)."""

    def _reduction_buffer_bytes(self, trainable_bytes: int) -> int:
        """Device memory the gradient reduction holds beyond the gradients themselves, for
        ``trainable_bytes`` of master-dtype trainable parameters (reserved by the token-budget
        estimate)."""
        return 0

    @property
    def is_rank0(self) -> bool:
        return True

    # ------------------------------------------------------------------ life cycle
    def initialize(self, model_dir: str | Path, *, wrap_model: Callable[[nn.Module], nn.Module] | None = None) -> None:
        """Load ``model_dir``; ``wrap_model`` (e.g. adding a value head) runs right after loading,
        before LoRA, parallelisation and the optimizer, so what it adds is trained (LoRA adapts the
        loaded decoder only: the head trains in full)."""
        cfg = self.cfg
        self._model_dir = self._weights_from = Path(model_dir)
        self._setup()
        # train.compile=auto becomes true or false here, where the device is known
        self.cfg = cfg = dataclasses.replace(cfg, compile=cfg.resolved_compile(self.device.type))
        if cfg.compile:
            self.compile_cache = compile_cache_dir()
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        decoder, self.model_config = load_model(model_dir, dtype=cfg.torch_dtype(), device="cpu")
        container = self.model_config.container
        if container is not None and self.is_rank0:
            logger.info(
                "%s (%s) is a %s: its text model (%s) trains on text prompts; its exports copy the vision tower "
                "and projector from that directory",
                cfg.role_name,
                model_dir,
                container["architecture"],
                self.model_config.architecture,
            )
        model = decoder if wrap_model is None else wrap_model(decoder)
        prefix = next((f"{name}." if name else "" for name, m in model.named_modules() if m is decoder), None)
        if prefix is None:
            raise ValueError(
                f"wrap_model returned a {type(model).__name__} that does not hold the loaded decoder: wrap the "
                "model it is given (as a value head does) rather than copying its weights"
            )
        self._decoder_prefix = prefix
        self.shares_prompts = share_prompts = self._share_prompts(model)
        for module in model.modules():  # wrappers (value heads, LoRA) hold the decoder inside
            if isinstance(module, Decoder):
                module.cuda_attention = cfg.attention
                module.share_prompts = share_prompts
        if cfg.lora is not None:
            if cfg.tp_size > 1:
                raise ConfigError(
                    "train.lora: not supported with tensor parallelism (tp_size > 1); set train.lora=null"
                )
            # the loaded decoder only: what wrap_model added (a fresh value head) trains in full
            apply_lora(decoder, cfg.lora)
        if not cfg.trainable:
            model.requires_grad_(False)
        if cfg.freeze_vision:  # model.freeze_vision: the tower's features stay those of the checkpoint
            for tower in vision_towers(model):
                tower.requires_grad_(False)
        model.train()
        self.model = self._parallelize(model)
        if cfg.trainable:
            trainable_parameters(self.model.parameters())  # none: a one-line error now, not at the first step
            self._builds_optimizer = True
        self.max_tokens_per_mb = cfg.max_tokens_per_mb or self._default_tokens_per_mb()
        if cfg.max_tokens_per_mb is None and self.is_rank0:
            logger.info(
                "training: micro-batches of up to %d tokens (train.max_tokens_per_mb=null: estimated from the %s's "
                "free memory; set it to override)",
                self.max_tokens_per_mb,
                "host" if self.device.type != "cuda" else "device",
            )
        self._routing = moe.RoutingMonitor(self.model)  # expert models: router loss and routing mismatch
        if (cfg.moe_rollout_routes or cfg.moe_routing_replay) and not self._routing:
            key = "train.moe_routing_replay" if cfg.moe_routing_replay else "train.moe_rollout_routes"
            raise ConfigError(
                f"{key}: the model has no mixture-of-experts layers (a dense model routes nothing); set it to false"
            )
        self._routing.replay = cfg.moe_routing_replay
        self._initialized = True

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """AdamW over the trainable parameters (None for a frozen role), built with its schedule on
        first use: constructing a torch optimizer imports torch._dynamo, a slow import that the
        run's first rollout does not need."""
        if self._builds_optimizer:
            self._builds_optimizer = False
            self._optimizer = build_optimizer(self.model.parameters(), self.cfg, self.device.type)
            self._scheduler = build_scheduler(self._optimizer, self.cfg)
        return self._optimizer

    @optimizer.setter
    def optimizer(self, optimizer: torch.optim.Optimizer | None) -> None:
        self._builds_optimizer = False
        self._optimizer, self._scheduler = optimizer, None

    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LRScheduler | None:
        """The learning-rate schedule of ``optimizer`` (built with it)."""
        return self._scheduler if self.optimizer is not None else None

    @scheduler.setter
    def scheduler(self, scheduler: torch.optim.lr_scheduler.LRScheduler | None) -> None:
        self._scheduler = scheduler

    def _default_tokens_per_mb(self) -> int:
        lo, hi = CPU_TOKENS_PER_MB
        if self.device.type != "cuda":
            available = available_host_bytes()
            if available is None:  # no /proc/meminfo
                return lo
            # every training process of a CPU run shares the host's memory (a multi-node run: no larger than this)
            processes = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
            free_bytes = available // (CPU_MEMORY_SHARE * processes)
        else:
            # Adam moments and grads are allocated lazily: reserve them
            free_bytes = torch.cuda.mem_get_info(self.device)[0] - self.lazy_state_bytes()
        tokens = estimate_max_tokens_per_mb(free_bytes=max(free_bytes, 0), **self._activation_shape())
        return tokens if self.device.type == "cuda" else min(hi, max(lo, tokens))

    def _activation_shape(self) -> dict[str, int | bool]:
        mc = self.model_config
        return dict(
            hidden_size=mc.hidden_size,
            intermediate_size=mc.intermediate_size,
            num_layers=mc.num_hidden_layers,
            vocab_size=mc.vocab_size,
            q_kv_dim=(mc.num_attention_heads + 2 * mc.num_key_value_heads) * mc.head_dim,
            compute_bytes=2 if self.cfg.resolved_param_dtype(self.device.type) == "bfloat16" else 4,
            activation_checkpointing=self.cfg.activation_checkpointing,
        )

    def lazy_state_bytes(self) -> int:
        """Device bytes a trainable backend will still allocate at its first step (gradients, AdamW's two
        moments, the gradient reduction's buffers), on this rank: what a resumed checkpoint or an earlier
        step allocated already is not counted; 0 for a frozen one."""
        if not self.cfg.trainable:
            return 0
        params = [p for p in self.model.parameters() if p.requires_grad]
        trainable = sum(p.numel() * p.element_size() for p in params)
        grads = sum(p.numel() * p.element_size() for p in params if p.grad is None)
        optimizer = getattr(self, "_optimizer", None)  # built at first use
        moments = 0 if optimizer is not None and optimizer.state else 2 * trainable
        to_come = (grads + moments) // max(self._dp_size * self._cp_size, 1)
        return to_come + (self._reduction_buffer_bytes(trainable) if grads else 0)

    def activation_bytes(self) -> int:
        """Device bytes of a full micro-batch's activations (``max_tokens_per_mb`` tokens, the estimate
        that sizes the default budget)."""
        return self.max_tokens_per_mb * activation_bytes_per_token(**self._activation_shape())

    def _check_ready(self) -> None:
        if not self._initialized:
            raise RuntimeError("call initialize(model_dir) first")
        if self._offloader.asleep and not self._woken_lazily:
            raise RuntimeError("the backend is asleep; call wake() before using it")

    def _restore_parked(self) -> None:
        """Ready for a use of the optimizer state: bring back what a lazy ``wake`` left in host memory."""
        self._check_ready()
        if self._offloader.asleep:
            self._offloader.wake()
        self._woken_lazily = False

    # ------------------------------------------------------------------ micro-batches
    def plan(self, batch: TokenBatch) -> MicroBatchPlan:
        """Micro-batches of ``batch`` for every rank; where the model runs a group's common prompt once,
        planned to keep groups together (``packing.plan_micro_batches``'s ``shared_B``)."""
        spec = MicroBatchSpec(
            max_tokens_per_mb=self.max_tokens_per_mb,
            dp_size=self._dp_size,
            cp_size=self._cp_size,
            micro_batch_rows=None if self.device.type == "cuda" else MICRO_BATCH_ROWS,
        )
        shared_B = None
        if self.shares_prompts:
            shared_B = prefix_sharing.shared_prompt_tokens(
                batch.input_ids_T.cpu(), batch.cu_seqlens_B1.cpu(), batch.loss_mask_T.cpu()
            )
        return plan_micro_batches(batch.seqlens_B, spec, shared_B)

    def _micro_batches(
        self, batch: TokenBatch, plan: MicroBatchPlan, selected: list[TokenBatch | None] | None = None
    ) -> Iterator[tuple[list[int], TokenBatch]]:
        """This rank's micro-batches on the device; ``selected``: the same ones already selected
        on the host (None where empty)."""
        for m, seq_idx in enumerate(plan.per_rank[self._dp_rank]):
            mb = selected[m] if selected is not None else batch.select(seq_idx) if seq_idx else None
            yield seq_idx, batch_to_device(mb if mb is not None else dummy_batch(batch), self.device)

    # ------------------------------------------------------------------ training
    def train_step(
        self, batch: TokenBatch, *, forward_fn: ForwardFn, loss_fn: LossFn, denominator_fn: DenominatorFn
    ) -> dict[str, float]:
        self._check_ready()
        if self.optimizer is None:
            raise ValueError("train_step on a frozen role (trainable=False); use forward_only")
        if self.cfg.compile and not self._first_step_done:
            t0 = time.perf_counter()
            out = self._train_step(batch, forward_fn=forward_fn, loss_fn=loss_fn, denominator_fn=denominator_fn)
            self._first_step_done = True
            if self.is_rank0:
                logger.info(
                    "training: first training step, its compilation included, took %.1f s (compile cache: %s)",
                    time.perf_counter() - t0,
                    self.compile_cache,
                )
            return out
        return self._train_step(batch, forward_fn=forward_fn, loss_fn=loss_fn, denominator_fn=denominator_fn)

    def _train_step(
        self, batch: TokenBatch, *, forward_fn: ForwardFn, loss_fn: LossFn, denominator_fn: DenominatorFn
    ) -> dict[str, float]:
        self._user_loss = user_loss_name(loss_fn)
        full_tokens = batch.num_tokens
        batch, _ = self._fit_long_sequences(batch)
        plan = self.plan(batch)
        # every micro-batch selected once, for the global denominator and for this rank's loop
        selected = [[batch.select(idx) if idx else None for idx in rank] for rank in plan.per_rank]
        reducer = Reducer(
            sum(float(denominator_fn(mb)) for rank in selected for mb in rank if mb is not None),
            gather=self._gather_token_values if self._dp_size > 1 else None,
        )
        version_B = batch.extra.get("policy_version_B")  # the step's policy version the recipe runner adds
        self._routing.begin_step(int(version_B[0]) if version_B is not None and len(version_B) else None)
        local_selected = selected[self._dp_rank]
        del selected  # the other ranks' micro-batches
        loss_parts, tokens, metric_parts = self._accumulate_gradients(
            batch, plan, local_selected, forward_fn=forward_fn, loss_fn=loss_fn, reducer=reducer
        )
        queued = self._queue_optimizer_step(loss_parts) if self._queues_optimizer_step() else None
        # one host read (per device and dtype) for every loss and metric value (and a queued step's
        # norm and skip flag): the first point where the host waits for the device
        keys = sorted(metric_parts)
        flat = host_floats(loss_parts + [v for key in keys for v in metric_parts[key]] + list(queued or ()))
        loss_sum = 0.0
        for part in flat[: len(loss_parts)]:  # float64 sums in micro-batch order
            loss_sum += part
        metric_sums, at = {}, len(loss_parts)
        for key in keys:
            metric_sums[key], at = sum(flat[at : at + len(metric_parts[key])]), at + len(metric_parts[key])
        stats = torch.tensor([loss_sum, tokens] + [metric_sums[k] for k in keys], dtype=torch.float64)
        stats = self._all_reduce_sum(stats)
        loss = float(stats[0])
        if queued is not None:
            grad_norm, lr = self._finish_queued_step(loss, flat[-2], skipped=flat[-1] != 0.0)
        else:
            grad_norm, lr = self._optimizer_step(loss)
        out = {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "skipped_steps": float(self._skipped_steps),
            "consecutive_skips": float(self._consecutive_skips),
            "tokens": float(stats[1]),
            "mbs": float(plan.n_mbs),
            "truncated_tokens": float(full_tokens - batch.num_tokens),
            "step": float(self._step),
            "loss_denominator": reducer.global_denominator,
        }
        out.update({k: float(v) for k, v in zip(keys, stats[2:].tolist())})
        if self._routing:  # expert models: the fraction of re-forwarded tokens routed otherwise (moe.RoutingMonitor)
            differ, pairs = out.pop("routing_mismatch_pairs"), out.pop("routing_pairs")
            if pairs:
                out["moe_routing_mismatch"] = differ / pairs
            # against the rollout's routes (train.moe_rollout_routes): over the forwards predicting loss tokens
            differ, pairs = out.pop("rollout_routing_mismatch_pairs"), out.pop("rollout_routing_pairs")
            replayed = out.pop("replayed_routing_pairs")
            if pairs:
                out["moe_rollout_routing_mismatch"] = differ / pairs
                if self._routing.replay:
                    out["moe_routing_replayed_fraction"] = replayed / pairs
        return out

    def _accumulate_gradients(
        self,
        batch: TokenBatch,
        plan: MicroBatchPlan,
        selected: list[TokenBatch | None],
        *,
        forward_fn: ForwardFn,
        loss_fn: LossFn,
        reducer: Reducer,
    ) -> tuple[list[torch.Tensor], int, dict[str, list[Any]]]:
        """Forward and backward of this rank's micro-batches (``selected``: already selected on the
        host); returns this rank's per-micro-batch losses (on the device), trained tokens and
        per-micro-batch metric values, none of them read yet."""
        if not all(m.training for m in self.model.modules()):  # reading the flags: a fifth of train()'s time
            self.model.train()
        loss_scale = self._loss_scale()
        # Losses and metrics stay on the device until every micro-batch is queued: no host sync
        # inside the loop, so the CPU prepares micro-batch i+1 while the GPU runs micro-batch i.
        loss_parts: list[torch.Tensor] = []
        metric_parts: dict[str, list[Any]] = {}
        tokens = 0
        n_local = len(plan.per_rank[self._dp_rank])
        # (token, sparse layer) pairs: routed unlike the old-policy forward, compared; routed unlike the
        # rollout, compared; routed as the rollout under replay (moe.RoutingMonitor.compare)
        routing_pairs = [0, 0, 0, 0, 0]
        for i, (seq_idx, mb) in enumerate(self._micro_batches(batch, plan, selected)):
            routes_TLK = mb.extra.get(ROUTES_KEY) if self._routing else None
            # replay spans the backward too: activation checkpointing recomputes the blocks there
            with self._routing.replaying(routes_TLK):
                with span("micro_batch", "train", tokens=mb.num_tokens), self._autocast():
                    with self._routing.compare(
                        mb.input_ids_T, mb.cu_seqlens_B1, routing_pairs, routes_TLK, mb.loss_mask_T
                    ):
                        output = forward_fn(self.model, mb)
                    loss, metrics = _loss_and_metrics(loss_fn(output, mb, reducer), loss_fn)
                    aux = moe.take_aux_loss(self._routing.blocks)
                    if aux is not None:  # the router's balance loss, weighted by this micro-batch's token share
                        aux = aux * (mb.num_tokens / batch.num_tokens)
                        loss, metrics = loss + aux, {**metrics, "router_aux_loss": aux.detach()}
                if not seq_idx:  # dummy micro-batch: keeps collectives in step, contributes nothing
                    loss = loss * 0.0
                    metrics = {key: 0.0 for key in metrics}  # same keys on every rank for the all-reduce
                self._before_backward(last=i == n_local - 1)
                with span("backward", "train", tokens=mb.num_tokens):
                    (loss * loss_scale).backward()
            loss_parts.append(loss.detach())
            tokens += mb.num_tokens if seq_idx else 0
            for key, value in metrics.items():
                metric_parts.setdefault(key, []).append(value.detach() if isinstance(value, torch.Tensor) else value)
        if self._routing:
            metric_parts["routing_mismatch_pairs"] = [routing_pairs[0]]
            metric_parts["routing_pairs"] = [routing_pairs[1]]
            metric_parts["rollout_routing_mismatch_pairs"] = [routing_pairs[2]]
            metric_parts["rollout_routing_pairs"] = [routing_pairs[3]]
            metric_parts["replayed_routing_pairs"] = [routing_pairs[4]]
        return loss_parts, tokens, metric_parts

    def _share_prompts(self, model: nn.Module) -> bool:
        """``train.share_prompts`` resolved for this model and layout; ``true`` where sharing cannot
        apply is a ConfigError naming why."""
        cfg = self.cfg
        why = None
        if cfg.cp_size > 1:
            why = "context parallelism (cp_size > 1), which splits the packed tokens over ranks"
        elif any(isinstance(m, moe.SparseMoE) for m in model.modules()):
            why = (
                "a mixture of experts, whose routing (its records, replay and balance loss) counts each sample's prompt"
            )
        elif vision_towers(model):
            why = "a vision-language model"
        elif cfg.attention == "flex":
            why = "train.attention=flex, whose document mask has no shared prompts"
        if why is not None and cfg.share_prompts is True:
            raise ConfigError(f"train.share_prompts=true: not with {why}; set train.share_prompts=auto or false")
        if why is None and cfg.share_prompts == "auto":
            decoder = next((m for m in model.modules() if isinstance(m, Decoder)), None)
            if decoder is not None and not prefix_sharing.pays_by_default(decoder.config, self.device.type):
                logger.info(
                    "training: prompts not shared (train.share_prompts=auto): on %s this model's shared-prompt "
                    "attention runs per sequence; train.share_prompts=true shares them anyway",
                    self.device.type,
                )
                return False
        return why is None and cfg.resolved_share_prompts()

    def _queues_optimizer_step(self) -> bool:
        """Whether this step's clip and update are queued before the host reads the loss: one CUDA
        process whose fused AdamW skips a step on the device (its ``found_inf``), so the device
        runs the norm, the clip and the update right after the last backward instead of idling
        through two host reads. Sharded (DTensor) or data-parallel runs decide on the host."""
        if self.device.type != "cuda" or self._dp_size != 1 or not self.optimizer.defaults.get("fused"):
            return False
        if self._plain_params is None:
            self._plain_params = not any(is_dtensor(p) for p in self.model.parameters())
        return self._plain_params

    def _queue_optimizer_step(self, loss_parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Grad norm, clip and AdamW queued on the device without a host read: a non-finite loss
        or norm sets the fused update's ``found_inf`` (it then changes no weight, state or step
        count), as ``_optimizer_step`` skips on the host. Returns the norm and the skip flag
        (float32 scalars on the device); ``_finish_queued_step`` completes the step."""
        self._restore_parked()
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0).float()
        loss = torch.stack([part.float() for part in loss_parts]).sum() if loss_parts else norm.new_zeros(())
        found_inf = (~(torch.isfinite(loss) & torch.isfinite(norm))).float()
        if self.cfg.grad_clip:  # clip_grads' coefficient, applied on the device (1 when within the norm)
            torch._foreach_mul_(grads, (self.cfg.grad_clip / (norm + 1e-6)).clamp(max=1.0))
        self.optimizer.found_inf = found_inf
        try:
            with span("optimizer_step", "train"):
                self.optimizer.step()
        finally:
            del self.optimizer.found_inf
        self.optimizer.zero_grad(set_to_none=True)
        return norm, found_inf

    def _finish_queued_step(self, loss: float, grad_norm: float, *, skipped: bool) -> tuple[float, float]:
        """The host's part of a queued step, once its values are read: the schedule, the counters and
        the non-finite checks of ``_optimizer_step``."""
        lr = self.scheduler.get_last_lr()[0]
        if not skipped:
            self.scheduler.step()
        return grad_norm, self._count_step(skipped, loss, grad_norm, lr)

    def _optimizer_step(self, loss: float) -> tuple[float, float]:
        """Clip and step, or skip a step whose (all-reduced) loss or global grad norm is not finite;
        raises ``NonFiniteStepError`` after ``max_consecutive_skips`` skips in a row. Returns the
        grad norm and the learning rate applied (0 when skipped)."""
        # after the last backward: a lazily woken optimizer state never shares the device with activations
        self._restore_parked()
        grad_norm, grad_groups = global_grad_norm(self.model.parameters())
        # The loss is all-reduced and the norm global, so every rank takes the same decision.
        skipped = not (math.isfinite(loss) and math.isfinite(grad_norm))
        if not skipped:
            if self.cfg.grad_clip:
                clip_grads(grad_groups, grad_norm, self.cfg.grad_clip)
            lr = self.scheduler.get_last_lr()[0]
            with span("optimizer_step", "train"):
                self.optimizer.step()
            self.scheduler.step()
        else:  # gradients of a NaN/inf loss (or a NaN/inf norm) are garbage: drop them
            lr = 0.0
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, self._count_step(skipped, loss, grad_norm, lr)

    def _count_step(self, skipped: bool, loss: float, grad_norm: float, lr: float) -> float:
        """Count a taken or skipped step and raise on a diverged model or too many skips in a row;
        returns the learning rate applied (0 when skipped)."""
        if skipped:
            self._skipped_steps += 1
            self._consecutive_skips += 1
        else:
            self._consecutive_skips = 0
        self._step += 1
        if skipped and not self._parameters_finite():  # a diverged model: no later step repairs it
            if not self._updated:  # no update ran since the load: the checkpoint's own weights
                raise ModelDirError(
                    f"{self._weights_from} holds NaN/inf weights (the loss of its first step was NaN/inf and no "
                    "update ran): re-export or re-download the checkpoint"
                )
            raise NonFiniteParametersError(role=self.cfg.role_name, step=self._step, when="the loss became NaN/inf")
        self._updated = self._updated or not skipped
        if 0 < self.cfg.max_consecutive_skips <= self._consecutive_skips:
            error = NonFiniteStepError(
                role=self.cfg.role_name,
                step=self._step,
                consecutive=self._consecutive_skips,
                loss=loss,
                grad_norm=grad_norm,
            )
            if self._user_loss is not None:  # a loss of the user's own: the first suspect
                error.args = (
                    f"{error.args[0]}; the loss is {self._user_loss}'s (not one of areno's): check it and its "
                    "gradient first for NaN/inf (a log or a division of 0)",
                )
            raise error
        return 0.0 if skipped else lr

    @torch.no_grad()
    def forward_only(self, batch: TokenBatch, *, forward_fn: ForwardFn) -> dict[str, torch.Tensor]:
        self._check_ready()
        batch, keep_T = self._fit_long_sequences(batch)
        plan = self.plan(batch)
        local: list[tuple[list[int], dict[str, torch.Tensor]]] = []
        with dropout_off(self.model):
            for seq_idx, mb in self._micro_batches(batch, plan):
                routes_TLK = mb.extra.get(ROUTES_KEY) if self._routing else None
                with self._autocast(), self._routing.reference(mb.input_ids_T, mb.cu_seqlens_B1):
                    with self._routing.replaying(routes_TLK):  # the old-policy forward routes as the rollout too
                        output = forward_fn(self.model, mb)
                if seq_idx:
                    local.append((seq_idx, {k: v.detach().cpu() for k, v in output.items()}))
        self._after_forward_only()
        results = [item for rank_items in self._gather_dp(local) for item in rank_items]
        outputs = _assemble(results, batch)
        return untruncate_outputs(outputs, keep_T) if keep_T is not None else outputs

    def _fit_long_sequences(self, batch: TokenBatch) -> tuple[TokenBatch, torch.Tensor | None]:
        """Apply ``cfg.long_sequences``: truncate to the token budget, or leave the batch for
        ``plan`` to reject (returns the batch and the kept-token mask, None if nothing was cut)."""
        if self.cfg.long_sequences == "truncate":
            return truncate_long_sequences(batch, self.max_tokens_per_mb * self._cp_size)
        return batch, None

    # ------------------------------------------------------------------ weights
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        self._check_ready()
        yield from merged_named_weights(self.model, self._full)

    @torch.no_grad()
    def mix_weights(self, source: Iterable[tuple[str, torch.Tensor]], *, alpha: float) -> None:
        """Each parameter of this role becomes ``alpha * source + (1 - alpha) * itself``, in its own dtype, from
        ``source``'s tensor of the same name (another role's ``named_weights``: Hugging Face names, LoRA merged),
        in place (TRL's ``sync_ref_model`` soft update of its reference). Names ``source`` has beyond this
        role's parameters (buffers) are left alone; a parameter it lacks is a ``ValueError``. Unsharded weights
        only: a frozen role of a colocated run, in this process."""
        self._check_ready()
        self._restore_parked()
        own = dict(self.model.named_parameters())
        assert not any(is_dtensor(p) for p in own.values()), "mix_weights: sharded (FSDP2) weights"
        mixed = set()
        for name, tensor in source:
            param = own.get(name)
            if param is None:
                continue
            param.mul_(1.0 - alpha).add_(tensor.to(device=param.device, dtype=param.dtype), alpha=alpha)
            mixed.add(name)
        missing = sorted(set(own) - mixed)
        if missing:
            raise ValueError(
                f"role {self.cfg.role_name!r}: the weights mixed in have no tensor named {missing[0]!r} "
                f"({len(missing)} of its {len(own)} parameters missing): the two roles are different models"
            )

    def named_adapter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """LoRA only: the full adapter tensors under PEFT's names (``base_model.model.<module>.lora_A.weight``,
        ``...lora_B.weight``; merged weight = W0 + ``cfg.lora.alpha / cfg.lora.rank`` * B @ A) — the
        adapter-only policy-sync payload. Collective like ``named_weights``."""
        self._check_ready()
        if self.cfg.lora is None:
            raise ValueError("named_adapter_weights needs LoRA (set lora=LoraConfig(...)); use named_weights")
        yield from adapter_named_weights(self.model, self._full, decoder_prefix=self._decoder_prefix)

    def export_adapter(self, path: str | Path) -> None:
        """LoRA only: write the adapters in PEFT's layout (``adapter_model.safetensors`` +
        ``adapter_config.json``, base model = the loaded model directory); ``peft.PeftModel.from_pretrained``
        loads it on the base model. A wrapped role's head goes beside it (``lora.HEAD_FILE``).
        Collective; rank 0 writes."""
        state = {name: t.cpu() for name, t in self.named_adapter_weights()}
        head = {
            name: t.cpu() for name, t in head_named_weights(self.model, self._full, decoder_prefix=self._decoder_prefix)
        }
        if self.is_rank0:
            save_adapter(path, state, self.cfg.lora, self._model_dir, head, model_config_of(self.model))
        self._barrier()

    def export_hf(self, path: str | Path) -> None:
        self._check_ready()
        state = {name: t.detach().cpu() for name, t in self.named_weights()}
        if self.is_rank0:
            # checked against a model built on meta, not loaded into one: a full copy of the weights
            # in fresh memory per save (seconds, and twice the model in host memory)
            with torch.device("meta"):
                expected = build_model(self.model_config).state_dict()
            check_full_state(state, expected, role=self.cfg.role_name)
            dtype = next(iter(state.values())).dtype  # one dtype, as the model it was loaded into held
            keep = moe.float32_names(self.model_config)  # but GLM-4.5's routers, float32 as transformers keeps them
            state = {k: t.to(dtype) if t.is_floating_point() and k not in keep else t for k, t in state.items()}
            out = save_state(state, self.model_config, path)
            for name in _TOKENIZER_FILES:
                if (self._model_dir / name).is_file():
                    shutil.copy2(self._model_dir / name, out / name)
        self._barrier()

    def barrier(self) -> None:
        """Wait for every training rank (no-op in one process)."""
        self._barrier()

    def _barrier(self) -> None:
        """Wait for every rank (no-op in one process)."""

    def _parameters_finite(self) -> bool:
        """Whether every rank's parameters are finite (every rank gets the same answer). A pass over
        the weights: run before a save and after a skipped step, not every step."""
        return float(self._all_reduce_sum(nonfinite_parameters(self.model.parameters()))) == 0.0

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: str | Path, extra_state: dict[str, Any]) -> None:
        self._restore_parked()
        if not self._parameters_finite():
            raise NonFiniteParametersError(role=self.cfg.role_name, step=self._step, when="before saving a checkpoint")
        trainer_state = {
            "step": self._step,
            "skipped_steps": self._skipped_steps,
            "consecutive_skips": self._consecutive_skips,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "extra": extra_state,
        }
        every = self.cfg.checkpoint_full_every
        incremental = (
            every > 1
            and self._saves_since_full + 1 < every
            and self._ckpt_base is not None
            and self._ckpt_base.is_dir()
            and bool(self._ckpt_base_hashes)
        )
        trainer_state["saves_since_full"] = self._saves_since_full + 1 if incremental else 0
        if incremental:
            checkpoint.save(
                path,
                self.model,
                self.optimizer,
                trainer_state,
                base=self._ckpt_base,
                base_hashes=self._ckpt_base_hashes,
            )
            self._saves_since_full += 1
        else:
            hashes = checkpoint.save(path, self.model, self.optimizer, trainer_state, record_hashes=every > 1)
            self._ckpt_base, self._ckpt_base_hashes = checkpoint.published_path(path), hashes
            self._saves_since_full = 0
        if self.cfg.lora is not None:  # what `peft` loads on the base model; resume reads the DCP state
            self.export_adapter(Path(path) / ADAPTER_SUBDIR)

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        self._restore_parked()
        state = checkpoint.load(path, self.model, self.optimizer)
        self._weights_from, self._updated = Path(path), False
        self._step = state["step"]
        self._skipped_steps = state["skipped_steps"]
        self._consecutive_skips = state.get("consecutive_skips", 0)  # absent in older checkpoints
        self._ckpt_base = checkpoint.incremental_base(path) if checkpoint.is_incremental(path) else Path(path).resolve()
        self._ckpt_base_hashes = checkpoint.read_hashes(self._ckpt_base)
        self._saves_since_full = state.get("saves_since_full", 0)
        if self.scheduler is not None and state["scheduler"] is not None:
            # the schedule's position; its lr lambdas stay this run's (partials, nothing saved of them), one a
            # group of this run, which may have fewer than the checkpoint's (decay_biases_and_norms turned on:
            # two groups become one); _apply_optim_settings sets the per-group lists at this run's length
            saved = {**state["scheduler"], "lr_lambdas": [None] * len(self.scheduler.lr_lambdas)}
            self.scheduler.load_state_dict(saved)
        if self.scheduler is not None:
            self._apply_optim_settings()
        return state["extra"]

    def _apply_optim_settings(self) -> None:
        """The ``optim`` settings of this run over those the checkpoint restored (its param groups and
        base lr): a resumed run trains at its own lr, betas, eps and weight decay, at the schedule's
        position of the checkpoint's step. Unchanged settings give the checkpoint's values exactly."""
        cfg, scheduler = self.cfg, self.scheduler
        # this run's groups (``param_groups``): a checkpoint of an areno that kept one group restores its lr
        # lists at that length
        scheduler.base_lrs = [cfg.lr] * len(self.optimizer.param_groups)
        for group, lr_lambda in zip(self.optimizer.param_groups, scheduler.lr_lambdas, strict=True):
            decay = group_weight_decay(group, cfg)
            group.update(initial_lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=decay)
            # what LambdaLR.step computes: the lr lambda reads this run's schedule, warm-up and length
            group["lr"] = cfg.lr * lr_lambda(scheduler.last_epoch)
        scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    # ------------------------------------------------------------------ memory
    def sleep(self) -> int:
        self._check_ready()
        if self._woken_lazily:  # woken, never used: the state is still in host memory
            self._woken_lazily = False
            return 0
        return self._offloader.sleep(training_state_tensors(self.model, self.optimizer))

    def wake(self, *, lazy: bool = False) -> int:
        """Bring back what ``sleep`` moved; returns the bytes restored now. ``lazy``: the weights serve
        forwards at once, but the optimizer state stays in host memory until its first use (the next
        optimizer step, after the last backward; a checkpoint save or load), so a training phase never
        holds it together with activations. Parked gradients come back at once (backward adds to them)."""
        if lazy and not any(p.grad is not None for p in self.model.parameters()):
            self._woken_lazily = self._offloader.asleep
            return 0
        self._woken_lazily = False
        return self._offloader.wake()

    def shutdown(self) -> None:
        if self._offloader.asleep:  # the parked gradients and optimizer state go with the backend
            self._offloader.discard()
            for p in self.model.parameters():
                p.grad = None
        self._woken_lazily = False
        self._offloader.release()
        self.optimizer = None
        self._initialized = False


def host_floats(values: list[torch.Tensor | float]) -> list[float]:
    """``[float(v) for v in values]`` (one-element tensors or numbers) with one device-to-host read
    per (device, dtype) group of tensors instead of one per tensor; the same values."""
    out: list[float | None] = [v if not isinstance(v, torch.Tensor) else None for v in values]
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            groups.setdefault((v.device, v.dtype), []).append(i)
    for idx in groups.values():
        read = torch.cat([values[i].reshape(-1) for i in idx]).tolist()
        if len(read) != len(idx):
            raise ValueError(
                f"loss and metric values must be one-element tensors or numbers, got {len(read)} "
                f"elements for {len(idx)} tensors; reduce each metric to a scalar in loss_fn"
            )
        for i, value in zip(idx, read):
            out[i] = value
    return [float(v) for v in out]


def _assemble(results: list[tuple[list[int], dict[str, torch.Tensor]]], batch: TokenBatch) -> dict[str, torch.Tensor]:
    """Put per-micro-batch outputs back in batch order (``_T`` keys per token, ``_B`` per sequence)."""
    if not results:
        return {}
    cu = batch.cu_seqlens_B1.tolist()
    merged: dict[str, torch.Tensor] = {}
    for key, first in results[0][1].items():
        if key.endswith("_T"):
            out = torch.empty((batch.num_tokens, *first.shape[1:]), dtype=first.dtype)
            for seq_idx, outputs in results:
                offset = 0
                for i in seq_idx:
                    n = cu[i + 1] - cu[i]
                    out[cu[i] : cu[i + 1]] = outputs[key][offset : offset + n]
                    offset += n
        elif key.endswith("_B"):
            out = torch.empty((batch.num_seqs, *first.shape[1:]), dtype=first.dtype)
            for seq_idx, outputs in results:
                out[torch.tensor(seq_idx)] = outputs[key]
        else:
            raise ValueError(
                f"forward_fn output {key!r} must end in _T (per token) or _B (per sequence) so "
                f"forward_only can restore batch order"
            )
        merged[key] = out
    return merged


def _loss_and_metrics(result: Any, loss_fn: LossFn) -> tuple[torch.Tensor, dict[str, Any]]:
    """``loss_fn``'s ``(loss, metrics)``, checked against the contract backward and the metric sums rely
    on: anything else is a :class:`UserError` naming the loss function (a user's ``compute_loss`` would
    otherwise fail far from it: unpacking a 0-d tensor, or in torch's backward). The checks read shapes
    and flags only, never a value: no host sync."""
    name = _loss_fn_name(loss_fn)
    pair = isinstance(result, tuple) and len(result) == 2
    if not (pair and isinstance(result[0], torch.Tensor) and isinstance(result[1], dict)):
        got = f"({', '.join(type(x).__name__ for x in result)})" if isinstance(result, tuple) else type(result).__name__
        raise UserError(
            f"{name} returned {got}, expected a tuple (loss, metrics): return the loss reduced with the reducer "
            "(a 0-dim tensor) and a dict of metric tensors, e.g. `return loss, {}`"
        )
    loss, metrics = result
    if loss.ndim != 0:
        raise UserError(
            f"{name} returned a loss of shape {tuple(loss.shape)}, expected a 0-dim tensor: reduce the per-token "
            "losses with the reducer, e.g. `reducer(loss_T, batch.loss_mask_T)`"
        )
    if not loss.requires_grad and torch.is_grad_enabled():
        raise UserError(
            f"{name} returned a loss that does not require grad (detached, a constant, or not computed from "
            "model_output): compute it from model_output's tensors, reduced with the reducer, without "
            ".detach(), .item() or torch.tensor(...)"
        )
    for key, value in metrics.items():
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            raise UserError(
                f"{name} returned metric {key!r} of shape {tuple(value.shape)}, expected a 0-dim tensor or a "
                f"number: reduce it with the reducer, e.g. `reducer(x_T.detach(), batch.loss_mask_T)`"
            )
    return result


def _loss_fn_name(loss_fn: LossFn) -> str:
    """How an error names ``loss_fn``: ``<Class>.compute_loss`` by the class of the specialization it is
    bound to (a subclass that inherits its loss is named itself), else the function's qualified name."""
    owner = getattr(loss_fn, "__self__", None)
    if owner is not None:
        return f"{type(owner).__name__}.{loss_fn.__name__}"
    return getattr(loss_fn, "__qualname__", repr(loss_fn))


def user_loss_name(loss_fn: LossFn) -> str | None:
    """``<Class>.compute_loss`` where ``loss_fn`` is bound to a specialization and its code is not areno's
    (a user's class, or a user's override in a subclass of a built-in; an inherited built-in loss is
    areno's), else None: the first suspect of a NaN/inf loss."""
    owner = getattr(loss_fn, "__self__", None)
    code = getattr(loss_fn, "__func__", loss_fn)
    if owner is None or getattr(code, "__module__", "").split(".")[0] == "areno":
        return None
    return _loss_fn_name(loss_fn)
