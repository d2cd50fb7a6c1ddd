"""Configuration of the training backend (one per model role)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_DTYPES = ("float32", "bfloat16")
_SCHEDULES = ("constant", "linear_warmup", "cosine")
COMPILE_SCOPES = ("layers", "model")
"""``compile_scope`` values: each decoder layer, or the whole layer stack as one graph."""
_LONG_SEQUENCES = ("error", "truncate")


@dataclass(kw_only=True)
class LoraConfig:
    """Low-rank adapters (through ``peft``) on the decoder's linear layers."""

    rank: int = 8
    """Adapter rank r (> 0)."""
    alpha: float = 16.0
    """Scaling numerator: the update is ``alpha / rank * B @ A``."""
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    """Suffixes of the linear modules that get adapters (HF names, e.g. ``gate_proj``)."""
    dropout: float = 0.0
    """Dropout on the adapter input, in [0, 1)."""

    def __post_init__(self) -> None:
        self.target_modules = tuple(self.target_modules)
        if self.rank <= 0:
            raise ValueError(f"lora.rank must be > 0, got {self.rank}")
        if not self.target_modules:
            raise ValueError("lora.target_modules must name at least one module, e.g. ('q_proj',)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout}")


@dataclass(kw_only=True)
class TrainBackendConfig:
    """Everything the training backend of one model role needs: optimizer, schedule,
    micro-batching, precision, parallelism, LoRA. Validated at construction."""

    lr: float = 1e-5
    """Peak learning rate of AdamW (>= 0)."""
    weight_decay: float = 0.0
    """Decoupled AdamW weight decay (>= 0)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW (beta1, beta2), each in [0, 1)."""
    eps: float = 1e-8
    """AdamW epsilon (> 0)."""
    grad_clip: float | None = 1.0
    """Clip the global gradient L2 norm to this value; None disables clipping (the norm is still
    reported)."""
    lr_schedule: str = "constant"
    """``constant``, ``linear_warmup`` (linear from 0 to lr over warmup_steps, then constant) or
    ``cosine`` (linear warmup, then cosine decay to min_lr_ratio * lr at total_steps)."""
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up (>= 0); used by linear_warmup and cosine."""
    total_steps: int | None = None
    """Optimizer steps of the whole run; required by ``cosine``."""
    min_lr_ratio: float = 0.0
    """Final learning rate of the cosine schedule as a fraction of lr, in [0, 1]."""
    max_tokens_per_mb: int | None = None
    """Token budget of one packed micro-batch. None: on CUDA, a memory estimate from the model
    shape and free device memory; on CPU, 4096."""
    long_sequences: str = "error"
    """What a sequence longer than ``max_tokens_per_mb`` does: ``error`` (a ValueError naming its
    length and the budget) or ``truncate`` (its first ``max_tokens_per_mb`` tokens are trained on,
    the tail is dropped from the loss and counted in ``truncated_tokens``; forward-only outputs
    are 0 there). Splitting one sequence over micro-batches is not offered: the later part would
    have to attend to the earlier part's keys/values across backward passes (context
    parallelism), and per-sequence losses (sequence means, GSPO ratios, DPO sums) do not
    decompose over parts."""
    dtype: str = "float32"
    """Master weights, gradients reductions and optimizer state: ``float32`` or ``bfloat16``."""
    param_dtype: str | None = None
    """Compute dtype of forward/backward: ``float32`` or ``bfloat16``. None: bfloat16 on CUDA,
    float32 on CPU."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward (saves memory, costs ~1/3 compute)."""
    compile: bool = False
    """``torch.compile`` the decoder (see ``compile_scope``)."""
    compile_scope: str = "layers"
    """What ``compile`` compiles: ``layers`` (each decoder layer; one graph shared by all) or
    ``model`` (the whole layer stack as one graph: fewer host calls per micro-batch, longer first
    compile)."""
    collective_timeout_s: float = 1800.0
    """Timeout of the process group this backend creates itself (torchrun launches): a rank that
    stalls longer fails the collective with an error instead of hanging the job."""
    dp_shard_size: int = -1
    """FSDP sharding group size; -1 fills what dp_replicate_size and tp_size leave of the world."""
    dp_replicate_size: int = 1
    """HSDP: number of replicas of the sharded model (1 = plain FSDP)."""
    tp_size: int = 1
    """Tensor-parallel degree (DTensor, using the model's TP plan)."""
    lora: LoraConfig | None = None
    """LoRA adapters; None trains all weights."""
    trainable: bool = True
    """False for frozen roles (reference, reward): no optimizer state is allocated and train_step
    raises."""
    seed: int = 0
    """Seed of torch / python RNGs on every rank."""
    logprob_chunk_size: int = 1024
    """Tokens per chunk when computing log-probs/entropy from hidden states."""
    tp_vocab_parallel: bool = True
    """Under tensor parallelism, shard an untied LM head over the vocabulary and compute
    log-probs/entropy with a distributed log-sum-exp (no rank holds full-vocabulary logits).
    False keeps the head replicated on every TP rank. A tied head (the embedding) is always
    replicated."""
    device: str | None = None
    """``cpu`` or ``cuda``; None picks cuda when available."""

    def __post_init__(self) -> None:
        if isinstance(self.lora, dict):
            self.lora = LoraConfig(**self.lora)
        self.betas = tuple(self.betas)  # type: ignore[assignment]
        if self.lr < 0:
            raise ValueError(f"lr must be >= 0, got {self.lr}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas must be two values in [0, 1), got {self.betas}")
        if self.eps <= 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ValueError(f"grad_clip must be > 0 or None, got {self.grad_clip}")
        if self.compile_scope not in COMPILE_SCOPES:
            raise ValueError(f"compile_scope must be one of {COMPILE_SCOPES}, got {self.compile_scope!r}")
        if self.lr_schedule not in _SCHEDULES:
            raise ValueError(f"lr_schedule must be one of {_SCHEDULES}, got {self.lr_schedule!r}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.lr_schedule == "cosine" and (self.total_steps is None or self.total_steps <= 0):
            raise ValueError("lr_schedule='cosine' needs total_steps > 0 (set total_steps)")
        if self.total_steps is not None and self.total_steps < self.warmup_steps:
            raise ValueError(f"total_steps ({self.total_steps}) must be >= warmup_steps ({self.warmup_steps})")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.max_tokens_per_mb is not None and self.max_tokens_per_mb <= 0:
            raise ValueError(f"max_tokens_per_mb must be > 0 or None, got {self.max_tokens_per_mb}")
        if self.long_sequences not in _LONG_SEQUENCES:
            raise ValueError(f"long_sequences must be one of {_LONG_SEQUENCES}, got {self.long_sequences!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.param_dtype is not None and self.param_dtype not in _DTYPES:
            raise ValueError(f"param_dtype must be one of {_DTYPES} or None, got {self.param_dtype!r}")
        if self.dp_shard_size == 0 or self.dp_shard_size < -1:
            raise ValueError(f"dp_shard_size must be -1 (auto) or >= 1, got {self.dp_shard_size}")
        if self.dp_replicate_size < 1:
            raise ValueError(f"dp_replicate_size must be >= 1, got {self.dp_replicate_size}")
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.logprob_chunk_size <= 0:
            raise ValueError(f"logprob_chunk_size must be > 0, got {self.logprob_chunk_size}")
        if self.collective_timeout_s <= 0:
            raise ValueError(f"collective_timeout_s must be > 0 seconds, got {self.collective_timeout_s}")
        if self.device not in (None, "cpu", "cuda"):
            raise ValueError(f"device must be 'cpu', 'cuda' or None, got {self.device!r}")

    def resolved_device(self) -> str:
        import torch

        if self.device is not None:
            if self.device == "cuda" and not torch.cuda.is_available():
                raise ValueError("device='cuda' but CUDA is not available; set device='cpu'")
            return self.device
        return "cuda" if torch.cuda.is_available() else "cpu"

    def torch_dtype(self) -> torch.dtype:
        """Master-weight dtype as a torch dtype."""
        import torch

        return getattr(torch, self.dtype)

    def torch_param_dtype(self, device: str) -> torch.dtype:
        """Compute dtype as a torch dtype (see ``param_dtype``)."""
        import torch

        return getattr(torch, self.resolved_param_dtype(device))

    def resolved_param_dtype(self, device: str) -> str:
        if self.param_dtype is not None:
            return self.param_dtype
        return "bfloat16" if device == "cuda" else "float32"

    def mesh_shape(self, world_size: int) -> tuple[int, int, int]:
        """(dp_replicate, dp_shard, tp) for ``world_size`` ranks; ValueError if it does not divide."""
        fixed = self.dp_replicate_size * self.tp_size
        shard = self.dp_shard_size
        if shard == -1:
            if world_size % fixed != 0:
                raise ValueError(
                    f"dp_replicate_size ({self.dp_replicate_size}) * tp_size ({self.tp_size}) = "
                    f"{fixed} does not divide the world size {world_size}; pick sizes whose "
                    f"product divides it"
                )
            shard = world_size // fixed
        if fixed * shard != world_size:
            raise ValueError(
                f"mesh dp_replicate_size={self.dp_replicate_size} x dp_shard_size={shard} x "
                f"tp_size={self.tp_size} = {fixed * shard} ranks, but the world size is "
                f"{world_size}; make the product equal the world size (dp_shard_size=-1 fills it)"
            )
        return self.dp_replicate_size, shard, self.tp_size
