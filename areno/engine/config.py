"""The run's configuration schema: keyword-only dataclasses, one docstring per field, validated at
construction, composed into :class:`ArenoConfig` (the config the engine runs). ``areno.api.config``
loads a YAML file plus dotted overrides into it; an unknown key, a wrong type or an out-of-range
value is a one-line :class:`ConfigError` naming the key before anything expensive starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from areno.errors import ConfigError


def _check(cond: bool, key: str, message: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {message}")


@dataclass(kw_only=True)
class ModelSection:
    path: str = MISSING
    """Local Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer files)."""
    dtype: str = "float32"
    """Training parameter dtype: float32 or bfloat16 (GPU runs keep fp32 master weights)."""
    rollout_dtype: str = "auto"
    """Rollout engine dtype: auto (bfloat16 on CUDA, float32 on CPU), float32 or bfloat16."""
    init_tiny: dict[str, Any] | None = None
    """Demo/tests only: when set and model.path does not exist, create a random model there from
    these `areno.models.hf_io.tiny_config` arguments with a character tokenizer."""

    def __post_init__(self) -> None:
        for key in ("dtype", "rollout_dtype"):
            allowed = ("float32", "bfloat16") + (("auto",) if key == "rollout_dtype" else ())
            _check(getattr(self, key) in allowed, f"model.{key}", f"must be one of {allowed}")


@dataclass(kw_only=True)
class DataSection:
    task: str | None = "arithmetic"
    """Shipped synthetic task (see `areno.data.tasks.TASKS`), or null to read train_path."""
    task_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the task generator (e.g. max_digits)."""
    train_path: str | None = None
    """JSONL or Parquet file of training rows (used when task is null)."""
    eval_path: str | None = None
    """JSONL or Parquet file of held-out rows (used when task is null)."""
    prompt_key: str = "prompt"
    """Field of a data row holding the prompt text."""
    answer_key: str = "answer"
    """Field of a data row holding the reference answer passed to the reward function."""
    num_eval: int = 200
    """Held-out prompts evaluated (greedy) at each evaluation."""
    seed: int = 0
    """Seed of the task generator and of the dataloader shuffle."""

    def __post_init__(self) -> None:
        _check(
            self.task is not None or self.train_path is not None,
            "data",
            "set data.task to a shipped task or data.train_path to a JSONL/Parquet file",
        )
        _check(self.num_eval >= 0, "data.num_eval", f"must be >= 0, got {self.num_eval}")


@dataclass(kw_only=True)
class RewardSection:
    fn: str = "areno.rewards.tasks:exact_match"
    """Dotted path `module:function` of the reward: fn(prompt, completion, answer, **row) -> float."""
    sandbox: bool | None = None
    """Run the reward in worker subprocesses (killed at timeout_s, rlimits, failures scored 0 and
    counted as rollout/reward_failures_<kind>). null = auto: on, except for shipped rewards marked safe
    in-process (exact_match: a string compare, ~100x cheaper in-process; bench/rewards.py).
    User code, code execution and math-verify can hang or crash, and only a process bounds that."""
    timeout_s: float = 10.0
    """Wall-clock limit of one sandboxed reward call (the worker is killed and replaced); a timeout
    or exception gives reward 0 and is counted. In-process rewards cannot be interrupted."""
    memory_mb: int = 2048
    """Address-space limit (RLIMIT_AS) of each reward worker, in MiB; 0 = unlimited."""
    cpu_s: float | None = None
    """CPU-seconds limit (RLIMIT_CPU) of one sandboxed call; null = timeout_s. Raise it for
    multi-threaded rewards."""
    workers: int = 4
    """Reward worker processes (started on first use, reused across calls)."""
    allow_network: bool = True
    """Let reward workers open sockets (LLM-judge rewards need it); false cuts them off (network
    namespace where the kernel allows it). Candidate programs of code execution never have network."""

    def __post_init__(self) -> None:
        _check(":" in self.fn or "." in self.fn, "reward.fn", "must be a dotted path like 'pkg.mod:func'")
        _check(self.timeout_s > 0, "reward.timeout_s", f"must be > 0, got {self.timeout_s}")
        _check(
            self.memory_mb == 0 or self.memory_mb >= 128,
            "reward.memory_mb",
            f"must be 0 (unlimited) or >= 128 (a Python worker needs that much), got {self.memory_mb}",
        )
        _check(self.cpu_s is None or self.cpu_s > 0, "reward.cpu_s", f"must be > 0 or null, got {self.cpu_s}")
        _check(self.workers >= 1, "reward.workers", f"must be >= 1, got {self.workers}")


@dataclass(kw_only=True)
class RolloutSection:
    batch_size: int = 16
    """Prompts per training step (each expands into n_samples trajectories)."""
    n_samples: int = 8
    """Samples per prompt (one GRPO group)."""
    temperature: float = 1.0
    """Sampling temperature of training rollouts."""
    top_p: float = 1.0
    """Nucleus sampling mass of training rollouts."""
    top_k: int = -1
    """Top-k of training rollouts (-1 disables)."""
    max_new_tokens: int = 32
    """Generation limit per completion."""
    workflow: str = "areno.workflows.rlvr:RLVRWorkflow"
    """Dotted path of the RolloutWorkflow class."""
    workflow_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of the workflow (e.g. max_turns, horizon, gamma)."""
    max_head_offpolicyness: int = 0
    """Staleness bound η: trajectories at most η policy versions behind; 0 is synchronous."""
    max_concurrent: int = 256
    """Episodes in flight at once in the rollout pool."""
    max_retries: int = 1
    """Retries of a sample whose workflow raised, before it is dropped with a warning."""
    max_consecutive_dropped: int = 16
    """This many samples in a row dropped after all their retries stop the run with the last error
    (a broken rollout engine or server, a workflow that always raises); 0 = never stop."""
    kv_blocks: int = 0
    """Rollout engine KV-cache blocks (0 = sized automatically)."""
    max_num_seqs: int = 0
    """Most sequences the rollout engine decodes at once (its running batch; CUDA graphs are captured
    up to this size). 0 = the run's sequences in flight, min(max_concurrent, batch_size x (eta + 1)) x
    n_samples, at least 256 and at most 1024: an asynchronous run keeps several batches in flight, and
    a running batch smaller than that leaves the rest waiting while a decode step of a small model
    costs about the same for twice the rows (bench/LOG.md)."""
    decode_steps: int = 0
    """Decode steps the rollout engine runs per host round trip when every sequence is decoding
    (sampling, stop checks and feedback stay on the device); 0 = the engine's default (8 on CUDA, 1 on
    CPU). 1 returns to the host after every token."""
    decode_attention: str = "auto"
    """Decode attention of the rollout engine: `gather` (copy each sequence's K/V out of the paged
    pool, then SDPA), `paged` (read the pool directly: a Triton kernel on CUDA, a chunked
    online-softmax fallback elsewhere) or `auto` (paged on CUDA with Triton, gather elsewhere)."""
    fused_projections: bool = True
    """Run each layer's q/k/v and gate/up projections of the rollout engine as one GEMM each (the
    parameters become views of one fused weight per group, names unchanged); false keeps five GEMMs."""
    cpu_packed_gemm: bool = True
    """CPU, fp32 rollout: the large GEMMs (fused q/k/v and gate/up, o_proj, down_proj, the output
    projection) multiply with oneDNN-packed copies of their weights, re-packed after each policy
    sync (~1.2-1.4x per decode step measured; one more copy of those weights' memory); false keeps
    `F.linear`. Ignored on GPU."""
    recompute_kv_on_weight_update: bool = False
    """After a policy sync, recompute the K/V of the rollout engine's in-flight requests under the
    new weights (their tokens are kept; every later token is sampled exactly from the new policy).
    False (the default) keeps the old K/V: the context of a request interrupted by a sync stays
    encoded by the previous policy, and the decoupled loss's behaviour log-probs record what was
    sampled either way. Synchronous runs (eta = 0) have nothing in flight at a sync; in asynchronous
    ones recomputing re-prefilled ~15k tokens per sync and cost 25-40% of the trained tokens/s on
    an H200 pair (bench/LOG.md)."""
    cuda_graphs: bool = True
    """CUDA: replay decode steps from captured CUDA graphs (``rollout/cuda_graph.py``); false runs
    every decode step eagerly (slower; for debugging and A/B runs)."""
    mixed_decode_min_rows: int | None = 32
    """A mixed step (prefill chunks beside decode rows) with at least this many sampling rows, no
    prompt half prefilled and no waiting request able to take a free slot goes on with
    ``decode_steps`` - 1 decode steps in the same host round trip, so every round trip gives each
    row ``decode_steps`` tokens even while requests keep arriving (an asynchronous pool); null = a
    mixed step returns to the host after one token."""
    cuda_graph_warmup: bool = True
    """CUDA: capture the decode CUDA graphs of every batch size the run can reach (up to
    ``max_concurrent`` x ``n_samples`` sequences) when the rollout engine starts, for the training
    rollouts' sampling and, when held-out evaluation runs, greedy decoding. Otherwise each graph is
    captured when first needed, in the middle of a run: a capture takes ~0.4 s, during which a
    policy sync waits (bench/LOG.md: 0.5-1.2 s syncs in asynchronous runs)."""
    cuda_stream: bool = False
    """CUDA: the rollout engine runs its steps on a CUDA stream of its own, so that a colocated
    asynchronous trainer's kernels can run beside them instead of queueing behind them on the default
    stream. Experimental (off): not yet measured on a GPU."""
    fused_kernels: bool = True
    """CUDA: fused Triton kernels for RMSNorm, RoPE and SiLU-and-multiply in the rollout engine's
    forwards (a decode step is bound by its kernel count), after a self-check against the eager ops
    at start-up (a mismatch keeps the eager ops and says why). No effect on CPU or in training."""
    request_timeout_s: float = 600.0
    """Deadline of one generation request (in process or to a rollout server); a request past it
    is aborted and raises ``RolloutRequestTimeout`` naming the server and request (0 = no deadline)."""

    def __post_init__(self) -> None:
        for key in ("batch_size", "n_samples", "max_new_tokens", "max_concurrent"):
            _check(getattr(self, key) >= 1, f"rollout.{key}", f"must be >= 1, got {getattr(self, key)}")
        _check(self.temperature >= 0, "rollout.temperature", f"must be >= 0, got {self.temperature}")
        _check(0 < self.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {self.top_p}")
        _check(
            self.max_head_offpolicyness >= 0,
            "rollout.max_head_offpolicyness",
            f"must be >= 0, got {self.max_head_offpolicyness}",
        )
        _check(
            self.decode_attention in ("auto", "gather", "paged"),
            "rollout.decode_attention",
            f"must be auto, gather or paged, got {self.decode_attention!r}",
        )
        _check(self.max_num_seqs >= 0, "rollout.max_num_seqs", f"must be >= 0 (0 = automatic), got {self.max_num_seqs}")
        _check(
            self.decode_steps >= 0,
            "rollout.decode_steps",
            f"must be >= 0 (0 = engine default), got {self.decode_steps}",
        )
        _check(
            self.mixed_decode_min_rows is None or self.mixed_decode_min_rows >= 1,
            "rollout.mixed_decode_min_rows",
            f"must be >= 1 or null (off), got {self.mixed_decode_min_rows}",
        )
        _check(
            self.request_timeout_s >= 0,
            "rollout.request_timeout_s",
            f"must be >= 0 (0 = no deadline), got {self.request_timeout_s}",
        )
        _check(
            self.max_consecutive_dropped >= 0,
            "rollout.max_consecutive_dropped",
            f"must be >= 0 (0 = never stop), got {self.max_consecutive_dropped}",
        )


@dataclass(kw_only=True)
class OptimSection:
    lr: float = 1e-5
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    grad_clip: float = 1.0
    """Max global grad norm (0 disables clipping)."""
    schedule: str = "constant"
    """constant, linear_warmup or cosine."""
    warmup_steps: int = 0
    """Linear warm-up steps."""

    def __post_init__(self) -> None:
        _check(self.lr > 0, "optim.lr", f"must be > 0, got {self.lr}")
        _check(self.grad_clip >= 0, "optim.grad_clip", f"must be >= 0, got {self.grad_clip}")
        allowed = ("constant", "linear_warmup", "cosine")
        _check(self.schedule in allowed, "optim.schedule", f"must be one of {allowed}, got {self.schedule!r}")


@dataclass(kw_only=True)
class WarmStartSection:
    steps: int = 0
    """Supervised (sft recipe) steps on the task's reference answers before RL; 0 skips."""
    batch_size: int = 64
    """Sequences per supervised step."""
    lr: float = 1e-3
    """Learning rate of the supervised stage."""

    def __post_init__(self) -> None:
        _check(self.steps >= 0, "warm_start.steps", f"must be >= 0, got {self.steps}")
        _check(self.batch_size >= 1, "warm_start.batch_size", f"must be >= 1, got {self.batch_size}")
        _check(self.lr > 0, "warm_start.lr", f"must be > 0, got {self.lr}")


@dataclass(kw_only=True)
class ClusterSection:
    allocation_mode: str | None = None
    """Placement string, e.g. `areno[rollout]:d1+fsdp[actor]:d1`; null = colocated on one device."""
    train_devices: list[int] | None = None
    """Logical device indices of training workers (alternative to allocation_mode)."""
    rollout_devices: list[int] | None = None
    """Logical device indices of rollout workers (alternative to allocation_mode)."""
    device: str = "auto"
    """auto (cuda if available), cpu or cuda."""
    scheduler: str = "local"
    """Who starts the workers of a partitioned placement: local (subprocesses on this machine),
    ray (Ray actors, one placement group per role) or slurm (one sbatch job, a step per role).
    Colocated runs are one process: they need local."""
    scheduler_options: dict[str, Any] = field(default_factory=dict)
    """Settings of that scheduler: `areno.launch.SchedulerConfig` fields other than `type`, e.g.
    `{ray_address: auto}` (the `ray start --head` cluster here) or `{slurm_partition: gpu}`."""
    cpu_threads: int = 0
    """torch intra-op threads on CPU (0 = torch's default). Tiny models run fastest with 1."""
    switch_interval_s: float = 0.0
    """Python's thread switch interval (``sys.setswitchinterval``) in each partitioned worker process;
    0 keeps Python's default (5 ms). A rollout worker's sync thread waits for the GIL, held by its
    engine thread through a step's Python, for up to this long at every wake-up (bench/LOG.md:
    an asynchronous run's transfer took 9-15 ms against 1.3 ms while the engine was idle). Experimental."""
    collective_timeout_s: float = 1800.0
    """Timeout of every torch.distributed collective and rendezvous of the partitioned workers'
    world: a rank that stalls longer fails the collective with an error instead of hanging the run."""
    sync_commit: str = "staged"
    """How a partitioned run's rollout workers take a policy sync: `staged` (received into a
    staging copy while generation continues, then copied in; atomic: a failed sync keeps the old
    weights serving; one extra copy of the weights in memory) or `inplace` (received straight into
    the paused engine's weights: the fastest sync and no extra memory, but generation stops for the
    whole sync and a failed sync leaves the engine refusing to generate until the next one)."""

    def __post_init__(self) -> None:
        _check(self.device in ("auto", "cpu", "cuda"), "cluster.device", "must be auto, cpu or cuda")
        _check(
            self.collective_timeout_s > 0,
            "cluster.collective_timeout_s",
            f"must be > 0 seconds, got {self.collective_timeout_s}",
        )
        _check(
            self.scheduler in ("local", "ray", "slurm"),
            "cluster.scheduler",
            f"must be one of local, ray, slurm; got {self.scheduler!r}",
        )
        from areno.launch.scheduler import scheduler_config

        try:
            scheduler_config(self.scheduler, self.scheduler_options)
        except (TypeError, ValueError) as exc:
            raise ConfigError(str(exc)) from None
        partitioned = self.train_devices is not None or "+" in (self.allocation_mode or "")
        _check(
            self.scheduler == "local" or partitioned,
            "cluster.scheduler",
            f"{self.scheduler} starts the workers of a partitioned placement, but this run is colocated "
            "(one process): set cluster.train_devices/rollout_devices or a '+' allocation_mode, or use local",
        )
        _check(self.cpu_threads >= 0, "cluster.cpu_threads", f"must be >= 0, got {self.cpu_threads}")
        _check(
            0 <= self.switch_interval_s <= 1,
            "cluster.switch_interval_s",
            f"must be in [0, 1] seconds (0 = Python's default), got {self.switch_interval_s}",
        )
        _check(
            self.sync_commit in ("staged", "inplace"),
            "cluster.sync_commit",
            f"must be staged or inplace, got {self.sync_commit!r}",
        )
        if self.allocation_mode is not None:
            from areno.launch.allocation import AllocationModeError, check_supported, parse_allocation_mode

            try:
                alloc = parse_allocation_mode(self.allocation_mode)
                check_supported(alloc)
            except AllocationModeError as exc:
                raise ConfigError(f"cluster.allocation_mode: {exc}") from None
            _check(
                len(alloc.groups) > 1 or alloc.world_size == 1,
                "cluster.allocation_mode",
                f"{self.allocation_mode!r} asks for {alloc.world_size} devices without a '+', but a colocated run "
                "is one process on one device: use d1 (e.g. 'areno:d1|fsdp:d1') or '+' to give rollout and "
                "training devices of their own",
            )
        if (self.train_devices is None) != (self.rollout_devices is None):
            raise ConfigError("cluster.train_devices and cluster.rollout_devices must be set together")


@dataclass(kw_only=True)
class TrainSection:
    algorithm: str = "grpo"
    """Registered recipe name (`areno recipes` lists them)."""
    algorithm_kwargs: dict[str, Any] = field(default_factory=dict)
    """Overrides of the recipe's policy-role specialization arguments (e.g. clip_eps, kl_coef)."""
    steps: int = 100
    """Rollout/train iterations (num_rollout)."""
    num_train_passes: int = 1
    """Optimizer passes over each rollout batch; passes after the first reshuffle the data and reuse
    the first pass's proximal / old / reference log-probs."""
    num_minibatches: int = 1
    """Optimizer steps per pass: the batch is cut into this many minibatches of whole sequences,
    all scored by one no-grad forward at the iteration's start (AReaL's ppo_n_minibatches; with the
    decoupled loss the clip against pi_prox acts from the second minibatch)."""
    max_tokens_per_mb: int | None = None
    """Token budget of one packed micro-batch; null = estimated from memory."""
    eval_interval: int = 10
    """Evaluate held-out accuracy every this many steps (0 = only before and after)."""
    save_interval: int = 0
    """Checkpoint every this many steps (0 = only at the end)."""
    seed: int = 0
    """Global seed (model init, sampling, data order)."""
    backend: str = "areno"
    """Registered Backend implementation."""
    max_consecutive_skips: int = 5
    """Stop the run with a one-line error after this many optimizer steps in a row were skipped
    for a non-finite loss or grad norm (0 = never stop; skips are still counted)."""
    long_sequences: str = "error"
    """A sequence longer than max_tokens_per_mb: `error` (one line naming both numbers) or
    `truncate` (train on its first max_tokens_per_mb tokens; the rest leave the loss and are
    counted as train/<role>/truncated_tokens)."""
    compile: bool = False
    """torch.compile the decoder of the trained models (and the fused log-prob kernels);
    the first step pays the compilation."""
    compile_scope: str = "layers"
    """What `compile` compiles: `layers` (each decoder layer, one graph shared by all) or `model`
    (the whole layer stack as one graph: fewer host calls per micro-batch, a longer first step)."""
    attention: str = "auto"
    """CUDA attention of the training forwards over packed sequences: `varlen` (torch's
    variable-length flash kernel, nothing to compile), `flex` (FlexAttention with a document mask,
    compiled at the first step; on the GPU that compile took minutes in a partitioned run beside a
    generating engine) or `auto` (varlen; flex for fp32 or where this torch lacks varlen). CPU
    forwards pick their SDPA variant either way."""

    def __post_init__(self) -> None:
        _check(self.steps >= 0, "train.steps", f"must be >= 0, got {self.steps}")
        _check(
            self.attention in ("auto", "flex", "varlen"),
            "train.attention",
            f"must be auto, flex or varlen, got {self.attention!r}",
        )
        _check(
            self.compile_scope in ("layers", "model"),
            "train.compile_scope",
            f"must be layers or model, got {self.compile_scope!r}",
        )
        _check(self.num_train_passes >= 1, "train.num_train_passes", f"must be >= 1, got {self.num_train_passes}")
        _check(self.num_minibatches >= 1, "train.num_minibatches", f"must be >= 1, got {self.num_minibatches}")
        _check(
            self.max_tokens_per_mb is None or self.max_tokens_per_mb > 0,
            "train.max_tokens_per_mb",
            f"must be > 0 or null, got {self.max_tokens_per_mb}",
        )
        _check(self.eval_interval >= 0, "train.eval_interval", f"must be >= 0, got {self.eval_interval}")
        _check(self.save_interval >= 0, "train.save_interval", f"must be >= 0, got {self.save_interval}")
        _check(
            self.long_sequences in ("error", "truncate"),
            "train.long_sequences",
            f"must be error or truncate, got {self.long_sequences!r}",
        )
        _check(
            self.max_consecutive_skips >= 0,
            "train.max_consecutive_skips",
            f"must be >= 0 (0 = never stop), got {self.max_consecutive_skips}",
        )


@dataclass(kw_only=True)
class ObserveSection:
    tensorboard: bool = False
    """Also write TensorBoard event files to run_dir/tensorboard."""
    wandb_project: str | None = None
    """Log to Weights & Biases under this project (offline when WANDB_MODE=offline)."""
    trace: bool = False
    """Record Chrome/Perfetto performance traces under run_dir/traces."""
    console: bool = True
    """Show the progress bar."""
    sessions: bool = False
    """Record agent episodes (turns, tool calls, rewards) to run_dir/sessions.jsonl."""


@dataclass(kw_only=True)
class ArenoConfig:
    """A whole run. `areno train CONFIG key=value ...`."""

    run_dir: str = "runs/areno"
    """Output directory: resolved config, metrics.jsonl, checkpoints, curves."""
    resume: bool | str = False
    """Continue from the newest completed checkpoint in run_dir/checkpoints: ``auto`` resumes when
    one exists and starts fresh otherwise; ``true`` requires one (an error when there is none);
    ``false`` starts fresh. Rows of metrics.jsonl after the resumed step are dropped, since those
    steps are trained again."""
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    reward: RewardSection = field(default_factory=RewardSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    optim: OptimSection = field(default_factory=OptimSection)
    warm_start: WarmStartSection = field(default_factory=WarmStartSection)
    train: TrainSection = field(default_factory=TrainSection)
    cluster: ClusterSection = field(default_factory=ClusterSection)
    observe: ObserveSection = field(default_factory=ObserveSection)

    def __post_init__(self) -> None:
        if isinstance(self.resume, str) and self.resume.lower() in ("true", "false"):
            self.resume = self.resume.lower() == "true"
        _check(
            isinstance(self.resume, bool) or self.resume == "auto",
            "resume",
            f"must be auto, true or false, got {self.resume!r}",
        )
