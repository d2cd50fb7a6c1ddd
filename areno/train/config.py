"""Configuration of the training backend (one per model role), defined once.

The run's sections extend the parts a user sets: ``OptimConfig`` is the user's ``optim`` section,
``TrainStepConfig`` the backend part of ``train`` and ``PrecisionConfig`` the training part of
``model``; ``TrainBackendConfig`` composes them with what the backend's owner decides (parallelism,
LoRA, the role). Each field has one default and one check; a bad value raises ``ConfigError``
naming the key.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from areno.errors import ConfigError, check_config, check_types

DTYPES = ("float32", "bfloat16")
MAX_LR = 1e37
"""AdamW's first update is lr / (1 - beta1) per weight (10 * lr by default): above this it overflows
float32 and torch fails with a raw RuntimeError."""
SCHEDULES = ("constant", "linear_warmup", "cosine", "linear")
DECAYING_SCHEDULES = ("cosine", "linear")
"""The schedules that decay over the run's optimizer steps (``total_steps``) to ``min_lr_ratio`` * lr."""
COMPILE_SCOPES = ("layers", "model")
"""``compile_scope`` values: each decoder layer, or the whole layer stack as one graph."""
LONG_SEQUENCES = ("error", "truncate")
ATTENTIONS = ("auto", "flex", "varlen")
UNADAPTABLE = "lm_head"
"""The one linear module LoRA cannot wrap: the decoder uses its weight, never calls it
(``Decoder.output_weight``; a tied model has no such module)."""


@dataclass(kw_only=True)
class LoraConfig:
    """Low-rank adapters (through ``peft``) on the decoder's linear layers."""

    rank: int = 8
    """Adapter rank r (> 0); a resumed run keeps it, as its ``target_modules`` (its checkpoints' adapters)."""
    alpha: float = 16.0
    """Scaling numerator: the update is ``alpha / rank * B @ A``."""
    target_modules: tuple[str, ...] | str = ("q_proj", "k_proj", "v_proj", "o_proj")
    """Suffixes of the linear modules that get adapters (HF names, e.g. ``gate_proj``); a string is
    one name or several separated by commas (``q_proj,v_proj``), not PEFT's regular expression.
    ``lm_head`` takes none: the decoder reads its weight directly, so an adapter there never runs. Checked on the
    model built without its weights before anything loads (``areno train --check`` too)."""
    dropout: float = 0.0
    """Dropout on the adapter input, in [0, 1)."""

    def __post_init__(self) -> None:
        check_types(self, "train.lora", LoraConfig)
        if isinstance(self.target_modules, str):
            self.target_modules = [name.strip() for name in self.target_modules.split(",") if name.strip()]
        self.target_modules = tuple(self.target_modules)
        check_config(self.rank > 0, "train.lora.rank", f"must be > 0, got {self.rank}")
        check_config(math.isfinite(self.alpha) and self.alpha > 0, "train.lora.alpha", f"must be > 0, got {self.alpha}")
        check_config(
            bool(self.target_modules),
            "train.lora.target_modules",
            "must name at least one linear module, e.g. [q_proj, v_proj]",
        )
        check_config(
            UNADAPTABLE not in self.target_modules,
            "train.lora.target_modules",
            f"{UNADAPTABLE} cannot take an adapter: the decoder reads {UNADAPTABLE}.weight directly (chunked "
            "log-probs), so the adapter would never run; name the layers' projections (q_proj, k_proj, v_proj, "
            "o_proj, gate_proj, up_proj, down_proj)",
        )
        check_config(0.0 <= self.dropout < 1.0, "train.lora.dropout", f"must be in [0, 1), got {self.dropout}")


@dataclass(kw_only=True)
class OptimConfig:
    """AdamW and its learning-rate schedule (the user's ``optim`` section)."""

    lr: float = 1e-5
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.0
    """Decoupled AdamW weight decay, of the weights of two or more dimensions (matrices, embeddings): biases
    and norm scales are not decayed, as in transformers' Trainer and TRL (``decay_biases_and_norms``)."""
    decay_biases_and_norms: bool = False
    """Apply ``weight_decay`` to the one-dimensional parameters too (biases, norm scales), as verl's and
    torchtitan's AdamW do; off, they keep their values' scale (decay would pull a norm's gain to 0). Refused
    where it would decay nothing: a weight decay of 0, or LoRA's adapters alone (matrices)."""
    grad_clip: float | None = 1.0
    """Clip the global gradient L2 norm to this value; 0 or null disables clipping (the norm is still
    reported)."""
    schedule: str = "constant"
    """``constant``, ``linear_warmup`` (linear from 0 to lr over warmup_steps, then constant), ``cosine``
    (linear warm-up, then cosine decay to min_lr_ratio * lr at total_steps) or ``linear`` (linear warm-up,
    then linear decay to min_lr_ratio * lr at total_steps: transformers' and TRL's default)."""
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up; used by linear_warmup, cosine and linear."""
    min_lr_ratio: float = 0.0
    """Final learning rate of the cosine and linear schedules as a fraction of lr, in [0, 1]."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW (beta1, beta2), each in [0, 1) (a tuple once validated)."""
    eps: float = 1e-8
    """AdamW epsilon (> 0)."""

    def __post_init__(self) -> None:
        check_types(self, "optim", OptimConfig)
        # inf passes the range checks and NaN fails them with a misleading message: name it first
        for key in ("lr", "weight_decay", "grad_clip", "min_lr_ratio", "eps"):
            value = getattr(self, key)
            check_config(value is None or math.isfinite(value), f"optim.{key}", f"must be a finite number, got {value}")
        check_config(0 < self.lr <= MAX_LR, "optim.lr", f"must be > 0 and <= {MAX_LR:g}, got {self.lr}")
        check_config(self.weight_decay >= 0, "optim.weight_decay", f"must be >= 0, got {self.weight_decay}")
        check_config(
            self.grad_clip is None or self.grad_clip >= 0,
            "optim.grad_clip",
            f"must be >= 0 (0 disables), got {self.grad_clip}",
        )
        check_config(self.schedule in SCHEDULES, "optim.schedule", f"must be one of {SCHEDULES}, got {self.schedule!r}")
        check_config(self.warmup_steps >= 0, "optim.warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        check_config(
            self.warmup_steps == 0 or self.schedule != "constant",
            "optim.warmup_steps",
            "the constant schedule has no warm-up: set optim.schedule to linear_warmup, cosine or linear",
        )
        check_config(
            0.0 <= self.min_lr_ratio <= 1.0, "optim.min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}"
        )
        check_config(
            self.min_lr_ratio == 0.0 or self.schedule in DECAYING_SCHEDULES,
            "optim.min_lr_ratio",
            f"is the final rate of a decaying schedule, and optim.schedule is {self.schedule}: set it to cosine or "
            "linear",
        )
        self.betas = tuple(self.betas)  # type: ignore[assignment]  # a YAML list
        check_config(
            len(self.betas) == 2 and all(math.isfinite(b) and 0.0 <= b < 1.0 for b in self.betas),
            "optim.betas",
            f"must be two values in [0, 1), e.g. [0.9, 0.999]; got {list(self.betas)}",
        )
        check_config(self.eps > 0, "optim.eps", f"must be > 0, got {self.eps}")


def lora_config(value: LoraConfig | dict | None) -> LoraConfig | None:
    """``train.lora`` as a LoraConfig: a mapping of its keys (built in Python) becomes one; an
    unknown key is a ConfigError naming it."""
    if not isinstance(value, dict):
        return value
    keys = [f.name for f in dataclasses.fields(LoraConfig)]
    unknown = [k for k in value if k not in keys]
    if unknown:
        raise ConfigError(f"train.lora.{unknown[0]}: not a LoRA setting; they are {keys}")
    return LoraConfig(**value)


@dataclass(kw_only=True)
class TrainStepConfig:
    """How a training backend runs its steps: micro-batching, compile, attention, seed and the
    non-finite guard (the backend's part of the user's ``train`` section)."""

    max_tokens_per_mb: int | None = None
    """Token budget of one packed micro-batch. null: a memory estimate from the model shape and free
    memory: the device's on CUDA; on CPU a quarter of the host's available memory, kept within 4096-16384
    tokens (fewer, larger micro-batches run faster there)."""
    long_sequences: str = "error"
    """A sequence longer than ``max_tokens_per_mb``: ``error`` (one line naming its length and the
    budget) or ``truncate`` (its first ``max_tokens_per_mb`` tokens are trained on, the tail leaves
    the loss and is counted as ``truncated_tokens``; forward-only outputs are 0 there). Splitting one
    sequence over micro-batches is not offered: the later part would have to attend to the earlier
    part's keys/values across backward passes (context parallelism), and per-sequence losses
    (sequence means, GSPO ratios, DPO sums) do not decompose over parts."""
    compile: bool | str = "auto"
    """``torch.compile`` the decoder (see ``compile_scope``) and the fused log-prob kernels: ``true``,
    ``false`` or ``auto`` (on for CUDA; off on CPU, where a short run does not earn its compile time
    back). The first step of a run pays the compilation; compiled graphs are cached on disk
    (``compile_cache_dir``), so later runs of the same shapes load them instead."""
    compile_scope: str = "layers"
    """What ``compile`` compiles: ``layers`` (each decoder layer; one graph shared by all) or
    ``model`` (the whole layer stack as one graph: fewer host calls per micro-batch, a longer first
    step)."""
    attention: str = "auto"
    """CUDA attention of the training forwards over packed sequences: ``varlen`` (torch's
    variable-length flash kernel, nothing to compile), ``flex`` (FlexAttention with a document mask,
    compiled at the first step, which can take minutes on a GPU) or ``auto`` (varlen; flex for fp32
    inputs, head dims flash lacks, a torch without varlen, or gpt-oss's attention sinks and Gemma 2's
    soft-capped scores, which flash has not: ``varlen`` is refused for them). CPU forwards pick their SDPA variant
    either way (``areno.models.decoder.PackedCausalAttention``)."""
    share_prompts: bool | str = "auto"
    """Compute a run of adjacent sequences' common prompt once in training forwards (a GRPO group's
    samples of one prompt; ``areno.models.prefix_sharing``): the same hidden states, log-probs and
    gradients up to summation order, over fewer tokens. ``true``, ``false`` or ``auto`` (on wherever it
    applies). It applies to a dense decoder (sliding windows included), text-only batches, cp_size=1 and
    an attention other than ``flex``: ``auto`` is off otherwise, ``true`` is refused."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward: the activations of one layer at a time
    instead of all of them (long sequences, large micro-batches), for about a third more compute. The
    default micro-batch budget grows to match."""
    tp_vocab_parallel: bool = True
    """Under tensor parallelism, shard an untied LM head over the vocabulary and compute
    log-probs/entropy with a distributed log-sum-exp (no rank holds full-vocabulary logits).
    false keeps the head replicated on every TP rank. A tied head (the embedding) is always
    replicated."""
    seed: int = 0
    """Seed of the run: model initialisation, the torch / python RNGs of every training rank, the
    rollouts' sampling seeds."""
    max_consecutive_skips: int = 5
    """Stop with a one-line error (``NonFiniteStepError``) after this many optimizer steps in a row
    were skipped for a non-finite loss or grad norm; 0 never stops (skips are still counted)."""
    checkpoint_full_every: int = 0
    """One full checkpoint every this many; those between store only the model and optimizer tensors
    whose content changed since the last full one (plus a reference to it) and load bit-exactly over
    it. 0 or 1: every checkpoint is full. Pays off when much is unchanged (LoRA: frozen base weights);
    with full fine-tuning AdamW changes every tensor every step."""
    moe_rollout_routes: bool = False
    """Mixture-of-experts policies: the rollout engine records each token's top-k expert ids in every
    sparse layer, they travel with the trajectory, and each training step reports
    ``moe_rollout_routing_mismatch``: the fraction of (loss token, sparse layer) pairs whose expert
    set in the training forward differs from the rollout's. areno's own rollout engine only; recording
    routes turns off its decode CUDA graphs and prefix sharing (slower rollouts)."""
    moe_routing_replay: bool = False
    """Routing replay (implies ``moe_rollout_routes``): the training forwards route every token to the
    experts the rollout chose, the gate weights taken from the trainer's own router softmax at those
    experts (renormalised as the layout does), so the router still trains; tokens without a recorded
    route keep the trainer's own top-k. Recording routes turns off the rollout engine's decode CUDA
    graphs and prefix sharing (slower rollouts)."""
    lora: LoraConfig | None = None
    """Low-rank adapters on the trained roles (``train.lora.rank=8`` turns them on with the other
    keys' defaults); null trains all weights. Policy syncs and ``hf/`` exports carry the merged
    weights under the base model's names; checkpoints also hold the adapter in PEFT's layout. The
    supervised warm start (``warm_start``) trains all weights."""

    def __post_init__(self) -> None:
        self.lora = lora_config(self.lora)
        check_config(
            self.max_tokens_per_mb is None or self.max_tokens_per_mb > 0,
            "train.max_tokens_per_mb",
            f"must be > 0 or null, got {self.max_tokens_per_mb}",
        )
        check_config(
            self.long_sequences in LONG_SEQUENCES,
            "train.long_sequences",
            f"must be error or truncate, got {self.long_sequences!r}",
        )
        check_config(
            self.compile in (True, False, "auto"),
            "train.compile",
            f"must be true, false or auto, got {self.compile!r}",
        )
        check_config(
            self.share_prompts in (True, False, "auto"),
            "train.share_prompts",
            f"must be true, false or auto, got {self.share_prompts!r}",
        )
        check_config(
            self.compile_scope in COMPILE_SCOPES,
            "train.compile_scope",
            f"must be layers or model, got {self.compile_scope!r}",
        )
        check_config(
            self.attention in ATTENTIONS, "train.attention", f"must be auto, flex or varlen, got {self.attention!r}"
        )
        check_config(
            self.max_consecutive_skips >= 0,
            "train.max_consecutive_skips",
            f"must be >= 0 (0 = never stop), got {self.max_consecutive_skips}",
        )
        for key in ("moe_rollout_routes", "moe_routing_replay", "activation_checkpointing", "tp_vocab_parallel"):
            value = getattr(self, key)
            check_config(isinstance(value, bool), f"train.{key}", f"must be true or false, got {value!r}")
        check_config(
            self.checkpoint_full_every >= 0,
            "train.checkpoint_full_every",
            f"must be >= 0 (0 = every checkpoint full), got {self.checkpoint_full_every}",
        )


@dataclass(kw_only=True)
class PrecisionConfig:
    """The training weights' dtype (the training part of the user's ``model`` section)."""

    dtype: str = "float32"
    """Master weights, gradient reductions and optimizer state of training: ``float32`` or
    ``bfloat16``; forwards and backwards compute in ``param_dtype`` (the user's ``model.compute_dtype``)."""
    freeze_vision: bool = False
    """Vision-language models: keep the vision tower and its patch merger fixed (no gradients, no
    optimizer state); the decoder still trains on the tower's features. No effect on text models."""
    fp32_logits: bool = False
    """The LM head's logits in float32 on both sides, the rollout engine's sampler and the trainer's log-probs
    (ScaleRL's FP32 LM head; TRL's ``cast_lm_head_to_fp32``): a bfloat16 product is accumulated and written in
    float32 instead of rounded to bfloat16 (at a logit of 20 that rounding is up to 0.06), so the two sides'
    log-probs differ by the hidden states' own differences only. The head's operands keep the compute dtype
    (the rollout's weights are the trainer's rounded alike). Nothing changes where compute is float32; a device
    without a 16-bit product into float32 (a CPU) multiplies in float32 (the rollout engine keeps a float32
    copy of the head, made again when a policy sync writes it)."""

    def __post_init__(self) -> None:
        check_config(self.dtype in DTYPES, "model.dtype", f"must be one of {DTYPES}, got {self.dtype!r}")


@dataclass(kw_only=True)
class TrainBackendConfig(OptimConfig, TrainStepConfig, PrecisionConfig):
    """Everything the training backend of one model role needs: the user's settings (``optim``,
    ``train``, ``model.dtype``; ``train.role_optim`` over ``optim`` for its role) and what the backend's
    owner decides (schedule length, compute dtype, parallelism, the role). Validated at construction."""

    total_steps: int | None = None
    """Optimizer steps of the whole run; required by ``cosine`` (a run: ``total_optimizer_steps``)."""
    param_dtype: str | None = None
    """Compute dtype of forward/backward: ``float32`` or ``bfloat16``. None: bfloat16 on CUDA,
    ``cpu_auto_dtype`` on CPU, and bfloat16 wherever the weights are (``dtype``: nothing computes wider)."""
    cpu_auto_dtype: str = "float32"
    """What ``param_dtype`` None computes in on CPU (the run config's ``model.compute_dtype=auto``
    sets it: bfloat16 for a wide model on a CPU with native bfloat16, ``cpu_gemm.prefers_bf16``)."""
    collective_timeout_s: float = 1800.0
    """Timeout of the process group this backend creates itself (torchrun launches): a rank that
    stalls longer fails the collective with an error instead of hanging the job."""
    dp_shard_size: int = -1
    """FSDP sharding group size; -1 fills what dp_replicate_size and tp_size leave of the world."""
    dp_replicate_size: int = 1
    """HSDP: number of replicas of the sharded model (1 = plain FSDP)."""
    tp_size: int = 1
    """Tensor-parallel degree (DTensor, using the model's TP plan)."""
    ep_size: int = 1
    """Expert-parallel degree of a mixture-of-experts model (``areno.train.expert_parallel``): each
    sparse layer's experts are split over groups of ep_size FSDP shard ranks, tokens dispatched by
    all-to-all inside the group; with ep_size < the shard size the groups hold copies of the experts
    and sum their gradients. > 1 needs the FSDP2 backend with a shard size it divides, no
    replication, tp_size=1, and an expert count it divides."""
    cp_size: int = 1
    """Context-parallel degree (``areno.train.context_parallel``, Ulysses): each micro-batch's packed
    token stream is split over cp ranks of the FSDP shard dimension, which run the decoder layers on
    their chunk (attention over whole sequences by an all-to-all over heads). > 1 needs the FSDP2
    backend, a shard size it divides, a head count it divides, tp_size=1 and ep_size=1."""
    trainable: bool = True
    """False for frozen roles (reference, reward): no optimizer state is allocated and train_step
    raises."""
    role_name: str = ""
    """The model role this backend trains, named in its errors (``NonFiniteStepError``)."""
    device: str | None = None
    """``cpu`` or ``cuda``; None picks cuda when available."""

    def __post_init__(self) -> None:
        OptimConfig.__post_init__(self)
        TrainStepConfig.__post_init__(self)
        PrecisionConfig.__post_init__(self)
        if self.schedule in DECAYING_SCHEDULES and (self.total_steps is None or self.total_steps <= 0):
            raise ValueError(f"schedule={self.schedule!r} needs total_steps > 0 (set total_steps)")
        if self.total_steps is not None and self.total_steps < self.warmup_steps:
            raise ValueError(f"total_steps ({self.total_steps}) must be >= warmup_steps ({self.warmup_steps})")
        if self.param_dtype is not None and self.param_dtype not in DTYPES:
            raise ValueError(f"param_dtype must be one of {DTYPES} or None, got {self.param_dtype!r}")
        if self.dp_shard_size == 0 or self.dp_shard_size < -1:
            raise ValueError(f"dp_shard_size must be -1 (auto) or >= 1, got {self.dp_shard_size}")
        if self.dp_replicate_size < 1:
            raise ValueError(f"dp_replicate_size must be >= 1, got {self.dp_replicate_size}")
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.ep_size < 1:
            raise ValueError(f"ep_size must be >= 1, got {self.ep_size}")
        if self.cp_size < 1:
            raise ValueError(f"cp_size must be >= 1, got {self.cp_size}")
        check_config(
            self.cp_size == 1 or not (self.moe_rollout_routes or self.moe_routing_replay),
            "train.moe_rollout_routes",
            "the rollout's routes are not split over context-parallel ranks: give the fsdp component of cluster.allocation_mode c1 with them",
        )
        if self.collective_timeout_s <= 0:
            raise ValueError(f"collective_timeout_s must be > 0 seconds, got {self.collective_timeout_s}")
        if self.device not in (None, "cpu", "cuda"):
            raise ValueError(f"device must be 'cpu', 'cuda' or None, got {self.device!r}")

    def resolved_device(self) -> str:
        if self.device is not None:
            if self.device == "cuda" and not torch.cuda.is_available():
                raise ValueError("device='cuda' but CUDA is not available; set device='cpu'")
            return self.device
        return "cuda" if torch.cuda.is_available() else "cpu"

    def torch_dtype(self) -> torch.dtype:
        """Master-weight dtype as a torch dtype."""
        return getattr(torch, self.dtype)

    def torch_param_dtype(self, device: str) -> torch.dtype:
        """Compute dtype as a torch dtype (see ``param_dtype``)."""
        return getattr(torch, self.resolved_param_dtype(device))

    def resolved_share_prompts(self) -> bool:
        """Whether to share prompts where it applies (``auto`` and ``true``: yes)."""
        return self.share_prompts is not False

    def resolved_compile(self, device: str) -> bool:
        """Whether to compile on ``device`` (``auto``: on CUDA only)."""
        return device == "cuda" if self.compile == "auto" else bool(self.compile)

    def resolved_param_dtype(self, device: str) -> str:
        if self.param_dtype is not None:
            return self.param_dtype
        return "bfloat16" if device == "cuda" or self.dtype == "bfloat16" else self.cpu_auto_dtype

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
