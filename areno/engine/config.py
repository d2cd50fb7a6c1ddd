"""The run's configuration schema: keyword-only dataclasses, one docstring per field, validated at
construction, composed into :class:`ArenoConfig` (the config the engine runs). ``areno.api.config``
loads a YAML file plus dotted overrides into it; an unknown key, a wrong type or an out-of-range
value is a one-line :class:`ConfigError` naming the key before anything expensive starts.

Settings that a component owns are defined once, by its owner, and the sections extend them: the
``rollout`` section is ``RolloutEngineSettings`` (``areno.rollout.config``) plus the rollout pool's
settings; ``optim`` is ``OptimConfig``, ``train`` extends ``TrainStepConfig`` and ``model``
extends ``PrecisionConfig`` (``areno.train.config``). The owners' configs are built from the
sections by ``build_rollout_engine_config`` and ``build_train_backend_config`` (no field copied by
hand); ``auto`` dtypes resolve in ``resolve_dtypes``.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from omegaconf import MISSING

from areno.data.prompts import CHAT_TEMPLATE_MODES
from areno.data.tasks import TASKS
from areno.errors import ConfigError, check_config, check_types, unknown_setting
from areno.launch.allocation import (
    AllocationModeError,
    check_supported,
    inference_backend,
    parse_allocation_mode,
    role_of,
    role_placements,
)
from areno.launch.scheduler import scheduler_config
from areno.models import cpu_gemm
from areno.models.hf_io import read_config
from areno.rewards.sandbox import MAX_TIMEOUT_S
from areno.rollout.config import RolloutEngineConfig, RolloutEngineSettings
from areno.train.config import OptimConfig, PrecisionConfig, TrainBackendConfig, TrainStepConfig, lora_config
from areno.types import MIN_TEMPERATURE

ROLLOUT_BACKENDS = ("areno", "vllm", "sglang")
WEIGHT_TRANSFERS = ("disk", "nccl")
DEFAULT_TRAIN_STEPS = 100
"""``train.steps`` when neither it nor ``train.epochs`` is set."""
"""``rollout.weight_transfer``: how a policy reaches vLLM/SGLang servers."""
"""``rollout.backend``: areno's own engine, or an inference server of another system."""


MANDATORY_HINTS = {"model.path": "a local Hugging Face checkpoint directory, e.g. model.path=/path/to/ckpt"}
"""What each mandatory key (``MISSING`` in the schema) is set to, for the error when it is not."""


@functools.cache
def _settings(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


class ConfigSection:
    """The base of the config sections: assigning an attribute that is not a setting is an
    ``UnknownSettingError`` naming the closest one (``cfg.train.stpes = 1`` would otherwise add an
    attribute the run never reads). Values assigned after construction are checked again by
    :meth:`ArenoConfig.validate`, which ``Trainer.init`` and ``Trainer.run`` call."""

    __slots__ = ()
    _KEY = ""
    """The section's key in a config file (``train``); empty for the whole config."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in _settings(type(self)):
            raise unknown_setting(self._KEY, name, list(_settings(type(self))))
        super().__setattr__(name, value)


def _revalidate(section: Any, key: str) -> None:
    """``section``'s construction checks again (nested dataclasses first: ``train.lora``), and no
    attribute that is not a setting (one set on a dataclass without ``ConfigSection``'s guard)."""
    settings = _settings(type(section))
    extra = [name for name in vars(section) if name not in settings]
    if extra:
        raise unknown_setting(key, extra[0], list(settings))
    for name in settings:
        value = getattr(section, name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            _revalidate(value, f"{key}.{name}")
    post_init = getattr(section, "__post_init__", None)
    if post_init is not None:  # each section's checks are idempotent: they normalise, then check
        post_init()


def _check_finite(section: object, prefix: str) -> None:
    """Every float setting of ``section`` is a finite number: inf passes range checks such as
    ``> 0`` and NaN slips through others, and either then fails at run time (``timeout_s=inf``
    made every sandboxed reward call fail)."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        check_config(
            not isinstance(value, float) or math.isfinite(value),
            f"{prefix}.{f.name}",
            f"must be a finite number, got {value}",
        )


@dataclass(kw_only=True)
class ModelSection(ConfigSection, PrecisionConfig):
    _KEY = "model"

    path: str = MISSING
    """Local Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer files)."""
    rollout_dtype: str = "auto"
    """Rollout engine dtype: auto, float32 or bfloat16. auto: bfloat16 on CUDA; on CPU bfloat16 for a
    model of hidden size 256 or more when the CPU has native bfloat16 (AVX512-BF16, AMX), else float32."""
    compute_dtype: str = "auto"
    """Training forward/backward dtype (autocast over ``dtype``'s master weights): auto, float32 or
    bfloat16; auto as ``rollout_dtype``, and bfloat16 over bfloat16 weights (``dtype``): compute is never
    wider than the weights, and float32 over bfloat16 weights is refused in one process."""
    init_tiny: dict[str, Any] | None = None
    """Demo/tests only: when set and model.path does not exist, create a random model there from
    these `areno.models.hf_io.tiny_config` arguments with a character tokenizer; a tiny model areno
    made there before with other arguments or another ``train.seed`` is made again (a directory holding
    anything else is refused)."""

    def __post_init__(self) -> None:
        check_types(self, "model", ModelSection)
        super().__post_init__()
        allowed = ("auto", "float32", "bfloat16")
        check_config(self.rollout_dtype in allowed, "model.rollout_dtype", f"must be one of {allowed}")
        check_config(self.compute_dtype in allowed, "model.compute_dtype", f"must be one of {allowed}")


@dataclass(kw_only=True)
class DataSection(ConfigSection):
    _KEY = "data"

    task: str | None = "arithmetic"
    """Shipped synthetic task (see `areno.data.tasks.TASKS`), or null to read train_path."""
    task_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the task generator (e.g. max_digits)."""
    train_path: str | list[str] | None = None
    """JSONL, JSON or Parquet file of training rows (needs task=null); a glob pattern (``data/train-*.parquet``,
    a sharded export: its files in name order); or a list of such, their rows in the order given (a mix of
    datasets, shuffled together each epoch)."""
    eval_path: str | list[str] | None = None
    """JSONL, JSON or Parquet file of held-out rows, the first ``num_eval`` of them evaluated (needs task=null);
    or several, as ``train_path`` names them (a list, a glob pattern): each file's first ``num_eval`` rows, with
    the figures of each file beside the whole's (``eval/<file stem>/accuracy``, ``.../pass@k``; e.g. one file
    per benchmark)."""
    prompt_key: str = "prompt"
    """Field of a data row holding the prompt: a string, or a list of {role, content} messages
    (TRL's conversational format; needs a chat template)."""
    answer_key: str = "answer"
    """Field of a data row holding the reference answer passed to the reward function."""
    num_eval: int = 200
    """Held-out prompts evaluated at each evaluation (a task's generated ones, or the first of eval_path's, of
    each of its files with several);
    greedy unless ``train.eval_samples`` > 1."""
    seed: int = 0
    """Seed of the task generator and of the dataloader shuffle (a new one each epoch; a negative seed is
    another order; the main stage after a warm start draws an order of its own, not the warm start's)."""
    shuffle: bool = True
    """Shuffle the training rows each epoch (a new order each, from ``seed``); false: the rows in their file's
    (or task's) order every epoch, e.g. a curriculum of easy rows first (TRL's ``shuffle_dataset=False``)."""
    chat_template: str = "auto"
    """How prompts become token ids, alike in rollouts, evaluation, SFT data and the chat route
    (`areno.data.prompts.render_prompt`): auto = wrapped in the tokenizer's chat template (a string
    prompt as one user message, with the generation prompt) when it has one, except areno's
    character tokenizer of the tiny demo models (trained on raw prompts); always = the template
    (a tokenizer without one is an error at start-up); never = tokenizer.encode(prompt)."""
    system_prompt: str | None = None
    """System message put before every prompt that does not open with one (needs a chat template)."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra variables of the chat template wherever it renders a prompt (rollouts, evaluation, SFT and
    preference data), e.g. ``{enable_thinking: false}`` for Qwen3's non-thinking prompts (needs a chat
    template)."""

    def templating(self) -> dict[str, Any]:
        """The keyword arguments of ``render_prompt`` (and its kin) these settings give."""
        return {
            "chat_template": self.chat_template,
            "system_prompt": self.system_prompt,
            "chat_template_kwargs": dict(self.chat_template_kwargs),
        }

    def __post_init__(self) -> None:
        check_types(self, "data", DataSection)
        check_config(
            self.chat_template in CHAT_TEMPLATE_MODES,
            "data.chat_template",
            f"must be one of {', '.join(CHAT_TEMPLATE_MODES)}, got {self.chat_template!r}",
        )
        check_config(
            self.system_prompt is None or self.chat_template != "never",
            "data.system_prompt",
            "needs a chat template: unset it or set data.chat_template to auto or always",
        )
        check_config(
            not self.chat_template_kwargs or self.chat_template != "never",
            "data.chat_template_kwargs",
            "needs a chat template: unset it or set data.chat_template to auto or always",
        )
        check_config(
            self.task is not None or self.train_path is not None,
            "data",
            "set data.task to a shipped task or data.train_path to a JSONL/Parquet file",
        )
        for key in ("train_path", "eval_path"):
            if isinstance(getattr(self, key), list):
                setattr(self, key, list(getattr(self, key)))  # a YAML list arrives as OmegaConf's ListConfig
                check_config(bool(getattr(self, key)), f"data.{key}", "is an empty list: name at least one file")
        for key in ("train_path", "eval_path"):  # a task makes its own rows: a file beside it would go unread
            if self.task is not None and getattr(self, key) is not None and self.task not in TASKS:
                close = difflib.get_close_matches(str(self.task), [*TASKS, "null"], n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ConfigError(
                    f"data.task: {self.task!r} is not a shipped task{hint}; to read data.{key}, set data.task=null"
                )
            check_config(
                self.task is None or getattr(self, key) is None,
                f"data.{key}",
                f"is set but data.task={self.task!r} generates the rows: set data.task=null to read the file, "
                f"or unset data.{key}",
            )
        check_config(
            self.task is not None or not self.task_kwargs,
            "data.task_kwargs",
            "are arguments of a shipped task's generator, but data.task is null: unset data.task_kwargs "
            "(data.task_kwargs=null on the command line)",
        )
        check_config(self.num_eval >= 0, "data.num_eval", f"must be >= 0, got {self.num_eval}")


FLOAT32_MAX = 3.4028234663852886e38
"""The largest float32: rewards train as float32 tensors."""

DEFAULT_REWARD_FN = "areno.rewards.tasks:exact_match"
"""``reward.fn`` when the config names none and sets no ``reward.model``."""


@dataclass(kw_only=True)
class RewardSection(ConfigSection):
    _KEY = "reward"

    fn: str | list[str] | None = None
    """Dotted path `module:function` (or `./file.py:function`) of the reward: fn(prompt, completion,
    answer, **row) -> float; or a list of such paths (TRL's `reward_funcs`), scored as the weighted sum of
    their scores (`weights`), each function's own score logged as the figure `rollout/reward/<name>_mean`.
    null = `areno.rewards.tasks:exact_match` (exact match against the row's answer), or none with `model`
    set (the model's score is then the whole reward); `[]` = no function (only with `model`)."""
    weights: list[float] | None = None
    """One finite weight per function of `fn`, in its order (TRL's `reward_weights`): the reward is the
    weighted sum of the functions' scores, which the advantage estimator then normalises as any reward
    (TRL's `sum_then_normalize`); null = 1.0 each."""
    sandbox: bool | None = None
    """Run the reward in worker subprocesses (killed at timeout_s, rlimits, failures scored 0 and
    counted as rollout/reward_failures_<kind>). null = auto: on, except for shipped rewards marked safe
    in-process (exact_match: a string compare, ~100x cheaper in-process; bench/rewards.py).
    User code, code execution and math-verify can hang or crash, and only a process bounds that."""
    timeout_s: float = 10.0
    """Wall-clock limit of one sandboxed reward call (the worker is killed and replaced); a timeout
    or exception gives reward 0 and is counted. An in-process call cannot be interrupted: one past
    this limit is reported in an error line naming the fixes, and the run waits for it."""
    memory_mb: int = 2048
    """Address-space limit (RLIMIT_AS) of each reward worker, in MiB; 0 = unlimited."""
    cpu_s: float | None = None
    """CPU-seconds limit (RLIMIT_CPU) of one sandboxed call; null = timeout_s. Raise it for
    multi-threaded rewards."""
    workers: int = 4
    """Reward worker processes (started on first use, reused across calls); with several functions in `fn`,
    each sandboxed function has a pool of its own of this many."""
    allow_network: bool = True
    """Let reward workers open sockets (LLM-judge rewards need it); false cuts them off (network
    namespace where the kernel allows it). Candidate programs of code execution never have network."""
    model: str | None = None
    """A reward model: a local Hugging Face `*ForSequenceClassification` directory with one label (a
    `reward_model` run's `checkpoints/step_N/hf`, or one transformers saved) and the policy's tokenizer. It
    runs on the training devices as the frozen role `reward_model` and scores each prompt + completion at its
    last token; `model_weight` times that score is added to the reward of `fn` before the advantages (TRL's
    reward model in `reward_funcs`). Held-out evaluation adds it the same way (`eval/reward_model/score_mean`)."""
    model_weight: float = 1.0
    """The weight of `model`'s score in the reward (finite, nonzero)."""
    missing_eos_penalty: float | None = None
    """With `model`: subtracted from its score of a completion cut at `rollout.max_new_tokens` (no EOS), which a
    reward model trained on finished answers may score far out of its range (TRL's `missing_eos_penalty`); >= 0,
    null for none."""

    def __post_init__(self) -> None:
        # a function object: the obvious thing to try from Python, which cannot reach sandbox processes
        for key, path in zip(self.fn_keys(), self.paths()):
            if callable(path):
                raise ConfigError(
                    f"{key}: must be a string, got {path!r}: name the function by its path, "
                    "'module:function' or './file.py:function' (reward sandbox processes import it)"
                )
        if isinstance(self.fn, tuple):  # from Python; YAML's list (what config.yaml writes back)
            self.fn = list(self.fn)
        check_types(self, "reward", RewardSection)
        if self.weights is not None:  # an int from Python is the same weight: written back as YAML's float
            self.weights = [float(w) for w in self.weights]
        _check_finite(self, "reward")
        check_config(
            bool(self.paths()) or self.model is not None,
            "reward.fn",
            "names no function: give one path, or a list of them, or set reward.model to score with a reward model",
        )
        check_config(
            self.model is None or bool(str(self.model).strip()),
            "reward.model",
            "is empty: give a reward model's directory, or null for none",
        )
        check_config(
            self.missing_eos_penalty is None or self.model is not None,
            "reward.missing_eos_penalty",
            "lowers reward.model's score of a completion without an EOS, and reward.model is unset: set it, or "
            "drop the key",
        )
        check_config(
            self.missing_eos_penalty is None or 0 <= self.missing_eos_penalty <= FLOAT32_MAX,
            "reward.missing_eos_penalty",
            f"must be a finite number >= 0, got {self.missing_eos_penalty}",
        )
        check_config(
            math.isfinite(self.model_weight) and self.model_weight != 0 and abs(self.model_weight) <= FLOAT32_MAX,
            "reward.model_weight",
            f"must be a finite nonzero number, got {self.model_weight}",
        )
        for key, path in zip(self.fn_keys(), self.paths()):
            check_config(":" in path or "." in path, key, f"must be a dotted path like 'pkg.mod:func', got {path!r}")
        if self.weights is not None:
            check_config(
                len(self.weights) == len(self.paths()),
                "reward.weights",
                f"has {len(self.weights)} values but reward.fn names {len(self.paths())} function(s): give one weight "
                "per function, in reward.fn's order, or null for 1.0 each",
            )
            check_config(  # rewards train as float32: a weight beyond its range made every reward non-finite
                all(math.isfinite(w) and abs(w) <= FLOAT32_MAX for w in self.weights),
                "reward.weights",
                f"must be finite numbers within float32's range (|w| <= {FLOAT32_MAX:.3g}), got {self.weights}",
            )
        # above MAX_TIMEOUT_S the pipe polls overflow (a finite 1e308 fails every call like inf did)
        check_config(
            0 < self.timeout_s <= MAX_TIMEOUT_S,
            "reward.timeout_s",
            f"must be > 0 and <= {MAX_TIMEOUT_S:g}, got {self.timeout_s}",
        )
        check_config(
            self.memory_mb == 0 or self.memory_mb >= 128,
            "reward.memory_mb",
            f"must be 0 (unlimited) or >= 128 (a Python worker needs that much), got {self.memory_mb}",
        )
        check_config(
            self.cpu_s is None or 0 < self.cpu_s <= MAX_TIMEOUT_S,
            "reward.cpu_s",
            f"must be > 0 and <= {MAX_TIMEOUT_S:g}, or null, got {self.cpu_s}",
        )
        check_config(self.workers >= 1, "reward.workers", f"must be >= 1, got {self.workers}")

    def paths(self) -> list[str]:
        """The paths ``fn`` names: its entries when a list, else itself; null: ``DEFAULT_REWARD_FN``, or none with
        ``model`` set (the model's score alone)."""
        if self.fn is None:
            return [] if self.model is not None else [DEFAULT_REWARD_FN]
        return list(self.fn) if isinstance(self.fn, (list, tuple)) else [self.fn]

    def resolve_fn(self) -> None:
        """A null ``fn`` made what it stands for (``paths``): the config written to config.yaml, and a resume's
        comparison with it, then name the function(s) that ran. The whole config does it, not this section,
        whose defaults OmegaConf's schema reads before ``model`` is merged in."""
        if self.fn is None:
            paths = self.paths()
            self.fn = paths[0] if len(paths) == 1 else paths

    def several(self) -> bool:
        """Whether ``fn`` lists more than one function: a failure then costs one function's part, not the reward."""
        return len(self.paths()) > 1

    def fn_keys(self) -> list[str]:
        """The config key of each of ``paths()``, for messages: ``reward.fn``, or ``reward.fn[i]`` of a list."""
        if isinstance(self.fn, (list, tuple)):
            return [f"reward.fn[{i}]" for i in range(len(self.fn))]
        return ["reward.fn"]


@dataclass(kw_only=True)
class RolloutSection(ConfigSection, RolloutEngineSettings):
    """The rollout engine's settings (``RolloutEngineSettings``) and the rollout pool's."""

    _KEY = "rollout"

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
    min_p: float = 0.0
    """Min-p of training rollouts, in [0, 1] (0 disables): after the temperature, drop the tokens less likely
    than ``min_p`` times the most likely one (before top-k / top-p, as vLLM). Log-probs stay those of the
    whole temperature-scaled distribution, as with top-p (refused with vllm, whose log-probs are after it)."""
    repetition_penalty: float = 1.0
    """Repetition penalty of training rollouts, > 0 (1 disables): each token already in the prompt or the
    completion has a positive logit divided by it, a negative one multiplied by it, before the temperature.
    Part of the sampler: log-probs stay those of the unpenalised model, which the trainer recomputes
    (refused with vllm and sglang, whose log-probs are after it)."""
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
    generate_during_train: bool | str = "auto"
    """An asynchronous colocated run (the rollout engine on the trainer's device): the engine keeps
    generating while the trainer steps (true), or takes turns (false): it generates only while the trainer
    waits for a batch (or evaluates), so the device runs one side at a time while the pool still admits
    up to η versions ahead; auto: false on CUDA, true on CPU. On a GPU, taking turns lets the batches
    admitted between waits decode together, many rows per step, where overlapping decodes each batch
    alone beside the trainer's kernels; on CPU the two threads share the cores better than they take
    turns (see docs/performance.md)."""
    max_retries: int = 1
    """Retries of a sample whose workflow raised, before it is dropped with a warning; in an asynchronous
    run also how often a sample whose episode fell more than η versions behind is generated again."""
    max_consecutive_dropped: int = 16
    """This many samples in a row dropped after all their retries stop the run with the last error
    (a broken rollout engine or server, a workflow that always raises); in an asynchronous run, also this
    many batches' worth of samples in a row without a group (rejected by the workflow or dropped: a filter
    that keeps nothing); 0 = never stop."""
    kv_blocks: int = 0
    """KV-cache blocks (of ``block_size`` tokens) of each rollout engine (0 = sized automatically:
    ``kv_memory_fraction`` of the free memory on CUDA, ``cpu_kv_cache_bytes`` on CPU, and on a GPU
    shared with training what the memory check allows; at most twice the blocks of the engine's running
    batch at ``max_model_len``, which a small model on a large GPU would otherwise far exceed)."""
    cuda_graph_warmup: bool = True
    """CUDA: capture the decode CUDA graphs of every batch size the run can reach (its rows in flight,
    ``min(max_concurrent, batch_size x (η + 1))`` x ``n_samples``, or its evaluation's, ``data.num_eval``
    x ``train.eval_samples``) when the rollout engine starts, for the training rollouts' sampling and
    the evaluation's. Otherwise each graph is captured when first needed, in the middle of a run, and a
    policy sync waits for the capture. A tensor-parallel engine captures here only (its ranks must launch
    the same collectives): its steps past the warm-up's shapes, or all of them with this off, run eagerly."""
    request_timeout_s: float = 600.0
    """Deadline of one generation request (in process or to a rollout server); a request past it
    is aborted and raises ``RolloutRequestTimeout`` naming the server and request (0 = no deadline)."""
    backend: str = "areno"
    """Who generates the rollouts: areno (its own engine), vllm or sglang (inference servers behind
    the rollout seam, sent each policy as a safetensors export; see docs/inference_servers.md). An
    ``allocation_mode`` naming vllm or sglang selects the same."""
    servers: list[str] = field(default_factory=list)
    """vllm/sglang: base URLs of servers you started (``http://host:port``), serving model.path;
    empty: areno starts one server per rollout data-parallel rank itself, logs in run_dir/workers/."""
    server_api_key: str | None = None
    """vllm/sglang: the API key of the servers in ``servers`` (areno's own servers get a fresh one)."""
    server_args: list[str] = field(default_factory=list)
    """vllm/sglang: extra command-line arguments of the servers areno starts (e.g. --enforce-eager)."""
    server_start_timeout_s: float = 600.0
    """vllm/sglang: how long a server areno starts may take to answer /health."""
    weight_transfer: str = "disk"
    """vllm/sglang: how a policy sync reaches the servers: disk (a safetensors export they load) or
    nccl (vllm on CUDA only: the trainer joins an NCCL group with the servers' workers through
    vLLM's weight-transfer routes and broadcasts the tensors; see docs/inference_servers.md)."""

    def resolved_generate_during_train(self, device: str) -> bool:
        """Whether an asynchronous colocated run on ``device`` generates while it trains (``auto``: on CPU)."""
        return device != "cuda" if self.generate_during_train == "auto" else bool(self.generate_during_train)

    def __post_init__(self) -> None:
        check_types(self, "rollout", RolloutSection)
        super().__post_init__()
        for key in ("batch_size", "n_samples", "max_new_tokens", "max_concurrent"):
            check_config(getattr(self, key) >= 1, f"rollout.{key}", f"must be >= 1, got {getattr(self, key)}")
        check_config(
            self.temperature == 0 or self.temperature >= MIN_TEMPERATURE,
            "rollout.temperature",
            f"must be 0 (greedy) or >= {MIN_TEMPERATURE:g}, got {self.temperature}",
        )
        check_config(0 < self.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {self.top_p}")
        check_config(
            self.top_k == -1 or self.top_k >= 1, "rollout.top_k", f"must be -1 (off) or >= 1, got {self.top_k}"
        )
        check_config(0 <= self.min_p <= 1, "rollout.min_p", f"must be in [0, 1] (0 = off), got {self.min_p}")
        check_config(
            0 < self.repetition_penalty < math.inf,
            "rollout.repetition_penalty",
            f"must be a finite number > 0 (1 = off), got {self.repetition_penalty}",
        )
        check_config(
            self.max_head_offpolicyness >= 0,
            "rollout.max_head_offpolicyness",
            f"must be >= 0, got {self.max_head_offpolicyness}",
        )
        check_config(
            self.generate_during_train in (True, False, "auto"),
            "rollout.generate_during_train",
            f"must be true, false or auto, got {self.generate_during_train!r}",
        )
        check_config(self.max_retries >= 0, "rollout.max_retries", f"must be >= 0, got {self.max_retries}")
        check_config(self.kv_blocks >= 0, "rollout.kv_blocks", f"must be >= 0 (0 = automatic), got {self.kv_blocks}")
        check_config(
            self.request_timeout_s >= 0,
            "rollout.request_timeout_s",
            f"must be >= 0 (0 = no deadline), got {self.request_timeout_s}",
        )
        check_config(
            self.max_consecutive_dropped >= 0,
            "rollout.max_consecutive_dropped",
            f"must be >= 0 (0 = never stop), got {self.max_consecutive_dropped}",
        )
        check_config(
            self.backend in ROLLOUT_BACKENDS,
            "rollout.backend",
            f"must be one of {', '.join(ROLLOUT_BACKENDS)}, got {self.backend!r}",
        )
        for url in self.servers:
            check_config(
                url.startswith(("http://", "https://")), "rollout.servers", f"{url!r} is not an http(s):// URL"
            )
        check_config(
            self.server_start_timeout_s > 0,
            "rollout.server_start_timeout_s",
            f"must be > 0, got {self.server_start_timeout_s}",
        )
        check_config(
            self.weight_transfer in WEIGHT_TRANSFERS,
            "rollout.weight_transfer",
            f"must be one of {', '.join(WEIGHT_TRANSFERS)}, got {self.weight_transfer!r}",
        )


@dataclass(kw_only=True)
class WarmStartSection(ConfigSection):
    _KEY = "warm_start"

    steps: int = 0
    """Supervised (sft recipe) steps on the task's reference answers before RL; 0 skips."""
    batch_size: int = 64
    """Sequences per supervised step."""
    lr: float = 1e-3
    """Learning rate of the supervised stage."""

    def __post_init__(self) -> None:
        check_types(self, "warm_start", WarmStartSection)
        check_config(self.steps >= 0, "warm_start.steps", f"must be >= 0, got {self.steps}")
        check_config(self.batch_size >= 1, "warm_start.batch_size", f"must be >= 1, got {self.batch_size}")
        check_config(self.lr > 0, "warm_start.lr", f"must be > 0, got {self.lr}")


@dataclass(kw_only=True)
class ClusterSection(ConfigSection):
    _KEY = "cluster"

    allocation_mode: str | None = None
    """Placement string, e.g. `areno[rollout]:d1+fsdp[actor]:d1`; null = colocated on one device."""
    train_devices: list[int] | None = None
    """Logical device indices of training workers (alternative to allocation_mode)."""
    rollout_devices: list[int] | None = None
    """Logical device indices of rollout workers (alternative to allocation_mode)."""
    train_tp: int = 1
    """Tensor-parallel size of training over `train_devices` (FSDP shards over the rest); with
    allocation_mode the `t` of its train component says it instead (`fsdp:d1t2`)."""
    train_dp_replicate: int = 1
    """HSDP: replicas of the FSDP group over a partitioned run's training devices. Each replica shards
    parameters, gradients and optimizer state over devices / (train TP x this) ranks and holds a whole
    copy of that state; gradients are averaged over the replicas. Above 1 where the sharded state fits
    in fewer devices than the run trains on (a node's), so FSDP's gathers stay inside a replica. Not
    with the `e` of an allocation_mode (experts shard over the FSDP group)."""
    rollout_tp: int = 1
    """Tensor-parallel size of one rollout replica over `rollout_devices` (rollout DP = the device
    count / this); with allocation_mode the `t` of its rollout component (`areno:d1t2`). Above 1 in
    an asynchronous run: `sync_commit=staged` only."""
    role_devices: dict[str, list[int]] = field(default_factory=dict)
    """Colocated runs: the device of a recipe role that trains apart from the policy, e.g.
    `{reference: [1]}` or `{value: [1]}` (aliases ref, critic, rm). Such a role runs in a worker
    process of its own on that device (a CPU run: one process per index); roles on one device train
    one after another, roles on different devices concurrently, and the DataSyncs move their
    tensors between the processes. Unnamed roles share device 0 with the policy and the rollout.
    `allocation_mode='areno:d1|fsdp:d1+fsdp[critic]:d1'` says the same (set one of the two)."""
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
    cpu_keep_freed_memory: bool = True
    """CPU runs: the process keeps the memory it frees for its next allocations (glibc's malloc stops
    unmapping large blocks and trimming its heap; `engine/host.py`), as CUDA's caching allocator does.
    A training step's large temporaries then stop page-faulting in fresh at each use; the process's
    resident memory stays at its peak. No effect off glibc or on CUDA."""
    gc_freeze: bool = True
    """Once a process's first step is done (the driver's first policy sync, a training worker's
    first step, a rollout worker's warm-up), Python's garbage collector is run once and every object
    alive then is exempt from its later passes (`gc.freeze`): a full pass otherwise walks the
    hundreds of thousands of objects of imports, model and engine, stopping every thread while it
    does (`engine/host.py`). Frozen objects are still freed when unreferenced; the driver unfreezes
    them at shutdown. A process whose heap other code froze is left as it is. false: the
    collector's defaults."""
    collective_timeout_s: float = 1800.0
    """Timeout of every torch.distributed collective and rendezvous of the partitioned workers'
    world: a rank that stalls longer fails the collective with an error instead of hanging the run.
    The policy sync's own waits: `sync_timeout_s`."""
    sync_timeout_s: float = 600.0
    """Partitioned runs: seconds any wait of a policy sync (a bucket's transfer, a control message
    between its ranks) may take before the sync fails with an error naming the wait (with
    `sync_commit=staged` the rollout side keeps serving the old weights)."""
    worker_stall_s: float = 60.0
    """Partitioned runs: seconds a rollout worker's server may give no `/health` answer (a stopped or
    deadlocked process, a hung kernel, a stuck NFS read) before the worker is declared lost: killed,
    and the run stops naming it after an emergency checkpoint of the training side. 0: never (its
    requests then fail after `rollout.request_timeout_s`, a sync after `sync_timeout_s`, and the run
    stops once no sample comes back, after the same emergency checkpoint). The environment
    variable `ARENO_WORKER_STALL_S`, when set, overrides it (the run logs one line saying so)."""
    sync_bucket_bytes: int = 64 << 20
    """Partitioned runs: bytes per bucket of the policy sync; each rank holds at most two bucket
    buffers, so this bounds the sync's extra memory; larger buckets send fewer messages."""
    sync_commit: str = "staged"
    """How a partitioned run's rollout workers take a policy sync: `staged` (received into a
    staging copy while generation continues, then copied in; atomic: a failed sync keeps the old
    weights serving; one extra copy of the weights in memory) or `inplace` (received straight into
    the paused engine's weights: the fastest sync and no extra memory, but generation stops for the
    whole sync and a failed sync leaves the engine refusing to generate until the next one)."""
    offload: str = "none"
    """What a colocated run keeps on the device between phases: `none` (everything, always) or
    `sleep` (while rolling out, the training gradients and optimizer state wait in host memory, the
    optimizer state until the optimizer step after the next backward; while training, the rollout
    engine's weights and KV cache do; each is brought back before the phase that uses it). Costs host
    copies each step; needs a synchronous colocated run."""

    def string_role_devices(self) -> dict[str, list[int]] | None:
        """The role placements of a colocated ``allocation_mode`` (``role_placements``: rollout and the
        policy in one group, roles in the others), else None."""
        if not self.allocation_mode:
            return None
        try:
            return role_placements(parse_allocation_mode(self.allocation_mode))
        except AllocationModeError:
            return None  # __post_init__ reports the string's mistake

    def asks_partitioned(self) -> bool:
        """Device lists, or a ``+`` allocation_mode that parts rollout from the policy."""
        split = "+" in (self.allocation_mode or "") and self.string_role_devices() is None
        return self.train_devices is not None or self.rollout_devices is not None or split

    def __post_init__(self) -> None:
        check_types(self, "cluster", ClusterSection)
        check_config(self.device in ("auto", "cpu", "cuda"), "cluster.device", "must be auto, cpu or cuda")
        check_config(
            self.offload in ("none", "sleep"), "cluster.offload", f"must be none or sleep, got {self.offload!r}"
        )
        check_config(
            self.collective_timeout_s > 0,
            "cluster.collective_timeout_s",
            f"must be > 0 seconds, got {self.collective_timeout_s}",
        )
        check_config(
            self.sync_timeout_s > 0, "cluster.sync_timeout_s", f"must be > 0 seconds, got {self.sync_timeout_s}"
        )
        check_config(
            self.worker_stall_s >= 0,
            "cluster.worker_stall_s",
            f"must be >= 0 seconds (0: never declare a rollout worker lost), got {self.worker_stall_s}",
        )
        check_config(
            self.sync_bucket_bytes >= 1 << 20,
            "cluster.sync_bucket_bytes",
            f"must be at least 1 MiB (1048576), got {self.sync_bucket_bytes}",
        )
        check_config(
            self.scheduler in ("local", "ray", "slurm"),
            "cluster.scheduler",
            f"must be one of local, ray, slurm; got {self.scheduler!r}",
        )
        try:
            scheduler_config(self.scheduler, self.scheduler_options)
        except (TypeError, ValueError) as exc:
            raise ConfigError(str(exc)) from None
        partitioned = self.asks_partitioned()
        check_config(
            self.scheduler == "local" or partitioned,
            "cluster.scheduler",
            f"{self.scheduler} starts the workers of a partitioned placement, but this run is colocated "
            "(one process): set cluster.train_devices/rollout_devices or a '+' allocation_mode, or use local",
        )
        check_config(self.cpu_threads >= 0, "cluster.cpu_threads", f"must be >= 0, got {self.cpu_threads}")
        check_config(
            self.sync_commit in ("staged", "inplace"),
            "cluster.sync_commit",
            f"must be staged or inplace, got {self.sync_commit!r}",
        )
        if self.allocation_mode is not None:
            try:
                alloc = parse_allocation_mode(self.allocation_mode)
                check_supported(alloc)
            except AllocationModeError as exc:
                raise ConfigError(f"cluster.allocation_mode: {exc}") from None
            check_config(
                len(alloc.groups) > 1 or alloc.world_size == 1,
                "cluster.allocation_mode",
                f"{self.allocation_mode!r} asks for {alloc.world_size} devices without a '+', but a colocated run "
                "is one process on one device: use d1 (e.g. 'areno:d1|fsdp:d1') or '+' to give rollout and "
                "training devices of their own",
            )
            if role_placements(alloc) is not None:  # a colocated run whose other components place roles
                check_config(
                    not self.role_devices,
                    "cluster.role_devices",
                    f"and cluster.allocation_mode {self.allocation_mode!r} both place recipe roles: set one of them",
                )
                check_config(
                    alloc.component("rollout").world_size == 1,
                    "cluster.allocation_mode",
                    f"{self.allocation_mode!r}: rollout and the policy share one group, a colocated run on one device: "
                    "give that group d1 (e.g. 'areno:d1|fsdp:d1+fsdp[critic]:d1')",
                )
                check_config(
                    inference_backend(alloc) == "areno",
                    "cluster.allocation_mode",
                    f"{self.allocation_mode!r}: role placements beside a colocated rollout need areno's engine "
                    "(e.g. 'areno:d1|fsdp:d1+fsdp[critic]:d1')",
                )
        if (self.train_devices is None) != (self.rollout_devices is None):
            raise ConfigError("cluster.train_devices and cluster.rollout_devices must be set together")
        check_config(
            self.offload == "none" or not partitioned,
            "cluster.offload",
            "sleep offloads a colocated run only (rollout and training share one device); this run is partitioned "
            "(cluster.train_devices/rollout_devices or a '+' allocation_mode): use cluster.offload=none",
        )
        check_config(
            self.train_dp_replicate >= 1, "cluster.train_dp_replicate", f"must be >= 1, got {self.train_dp_replicate}"
        )
        check_config(
            self.train_dp_replicate == 1 or partitioned,
            "cluster.train_dp_replicate",
            f"{self.train_dp_replicate} replicates training over several devices, but this run is colocated "
            "(one device): set cluster.train_devices/rollout_devices or a '+' allocation_mode, or leave it at 1",
        )
        for key, size, devices in (
            ("train_tp", self.train_tp, self.train_devices),
            ("rollout_tp", self.rollout_tp, self.rollout_devices),
        ):
            check_config(size >= 1, f"cluster.{key}", f"must be >= 1, got {size}")
            check_config(
                size == 1 or devices is not None,
                f"cluster.{key}",
                f"{size} needs the partitioned placement's device lists (cluster.train_devices/rollout_devices); "
                "with allocation_mode give TP as its t (e.g. 'areno:d1t2+fsdp:d1t2')",
            )
            check_config(
                devices is None or len(devices) % size == 0,
                f"cluster.{key}",
                f"{size} does not divide the {len(devices or [])} devices of its device list; use a divisor",
            )


@dataclass(kw_only=True)
class TrainSection(ConfigSection, TrainStepConfig):
    """The training backends' step settings (``TrainStepConfig``) and the training loop's."""

    _KEY = "train"

    algorithm: str = "grpo"
    """Registered recipe name (`areno recipes` lists them)."""
    algorithm_kwargs: dict[str, Any] = field(default_factory=dict)
    """Overrides of the recipe's policy-role specialization arguments (e.g. clip_eps, kl_coef)."""
    steps: int | None = None
    """Rollout/train iterations (num_rollout). Unset: 100, or as many as ``train.epochs`` takes."""
    epochs: float | None = None
    """Passes over the training rows (TRL's ``num_train_epochs``, verl's ``total_epochs``), in place of
    ``train.steps``: ceil(epochs x training rows / ``rollout.batch_size``) steps, counted when the run reads
    its data (``checked_config``: one line says the count; the run directory's config.yaml records the
    steps). Dynamic sampling's extra rounds draw further rows, so such a run sees more than that."""
    num_train_passes: int = 1
    """Optimizer passes over each rollout batch; passes after the first reshuffle the data and reuse
    the first pass's proximal / old / reference log-probs."""
    num_minibatches: int = 1
    """Optimizer steps per pass: the batch is cut into this many minibatches of whole sequences,
    all scored by one no-grad forward at the iteration's start (AReaL's ppo_n_minibatches; with the
    decoupled loss the clip against pi_prox acts from the second minibatch)."""
    eval_interval: int = 10
    """Evaluate held-out accuracy every this many steps (0 = only before and after)."""
    eval_samples: int = 1
    """Completions per held-out row at each evaluation: 1 is greedy (unless ``eval_temperature`` is
    set); more are sampled (each request seeded from ``train.seed``, the row and the sample, so every
    evaluation draws alike), ``eval/accuracy`` is their mean reward and ``eval/pass@k`` (k = 1, 2,
    4, ..., eval_samples) the unbiased chance that one of k samples solves its row."""
    eval_temperature: float | None = None
    """Sampling temperature of the evaluation. null: greedy for one sample, else
    ``rollout.temperature``."""
    eval_pass_threshold: float = 1.0
    """A sample solves its row (``eval/pass@k``) when its reward is at least this."""
    save_interval: int = 0
    """Checkpoint every this many steps (0 = only at the end)."""
    keep_checkpoints: int = 0
    """Keep only the newest this many checkpoints of the run (and the full ones that incremental ones
    build on), deleting older ones after each save; 0 keeps every one."""
    best_metric: str | None = None
    """An evaluation figure by which the run keeps its best checkpoint (TRL's ``metric_for_best_model``):
    ``eval/accuracy``, ``eval/pass@4``, ``eval/gsm8k/accuracy`` (a name without ``eval/`` is read with it). At
    each step that evaluates and saves, a checkpoint whose figure beats the best so far becomes the best: named
    in ``checkpoints/best.json``, one log line, kept by ``keep_checkpoints``; ``areno eval --checkpoint best``
    scores it. Needs ``eval_interval`` > 0 and a ``save_interval`` that is a multiple of it. null: none."""
    best_mode: str = "max"
    """Whether a higher ``best_metric`` is better (``max``; TRL's ``greater_is_better``) or a lower (``min``)."""
    backend: str = "areno"
    """Registered Backend implementation."""
    role_optim: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Optimizer settings of one recipe role over the `optim` section, e.g. `{value: {lr: 1e-5}}`
    for PPO's critic: a role of the recipe (or its alias: actor, critic, ref, rm) -> `optim` keys.
    Each role trains its own backend and optimizer; unnamed roles take `optim` as it is."""

    def __post_init__(self) -> None:
        self.lora = lora_config(self.lora)  # a mapping from Python, as YAML gives one
        check_types(self, "train", TrainSection)
        super().__post_init__()
        allowed = [f.name for f in dataclasses.fields(OptimConfig)]
        for role, override in self.role_optim.items():
            for key in override:
                check_config(
                    key in allowed, f"train.role_optim.{role}.{key}", f"is not an optim key; they are {allowed}"
                )
            # the values are checked over the optim section they override (ArenoConfig.__post_init__)
        if self.epochs is not None:
            check_config(
                self.steps is None,
                "train.steps",
                f"{self.steps} while train.epochs={self.epochs:g} also sets the run's length: set one of them "
                "(train.steps=null counts the steps from the epochs)",
            )
            check_config(self.epochs > 0, "train.epochs", f"must be > 0 (or null: train.steps), got {self.epochs:g}")
        elif self.steps is None:
            self.steps = DEFAULT_TRAIN_STEPS
        if self.steps is not None:
            check_config(self.steps >= 0, "train.steps", f"must be >= 0, got {self.steps}")
        check_config(self.num_train_passes >= 1, "train.num_train_passes", f"must be >= 1, got {self.num_train_passes}")
        check_config(self.num_minibatches >= 1, "train.num_minibatches", f"must be >= 1, got {self.num_minibatches}")
        check_config(self.eval_interval >= 0, "train.eval_interval", f"must be >= 0, got {self.eval_interval}")
        check_config(self.best_mode in ("max", "min"), "train.best_mode", f"must be max or min, got {self.best_mode!r}")
        if self.best_metric is not None:
            if not self.best_metric.startswith("eval/"):
                self.best_metric = f"eval/{self.best_metric}"
            check_config(
                self.eval_interval > 0 and self.save_interval > 0 and self.save_interval % self.eval_interval == 0,
                "train.best_metric",
                f"compares the evaluations of saved steps: set train.eval_interval > 0 and train.save_interval to a "
                f"multiple of it (got eval_interval={self.eval_interval}, save_interval={self.save_interval})",
            )
        check_config(self.eval_samples >= 1, "train.eval_samples", f"must be >= 1, got {self.eval_samples}")
        check_config(
            self.eval_temperature is None or self.eval_temperature == 0 or self.eval_temperature >= MIN_TEMPERATURE,
            "train.eval_temperature",
            f"must be 0 (greedy), >= {MIN_TEMPERATURE:g} or null, got {self.eval_temperature}",
        )
        check_config(self.save_interval >= 0, "train.save_interval", f"must be >= 0, got {self.save_interval}")
        check_config(
            self.keep_checkpoints >= 0,
            "train.keep_checkpoints",
            f"must be >= 0 (0 keeps all), got {self.keep_checkpoints}",
        )


@dataclass(kw_only=True)
class ObserveSection(ConfigSection):
    _KEY = "observe"

    tensorboard: bool = False
    """Also write TensorBoard event files to run_dir/tensorboard."""
    wandb_project: str | None = None
    """Log to Weights & Biases under this project (`pip install 'areno[wandb]'`); the W&B run carries
    the resolved config. The other `wandb_*` keys need it."""
    wandb_entity: str | None = None
    """W&B team or user; null: the account's default (or WANDB_ENTITY)."""
    wandb_name: str | None = None
    """W&B run name; null: the run directory's name."""
    wandb_tags: list[str] = field(default_factory=list)
    """W&B run tags."""
    wandb_mode: str | None = None
    """`online` (needs network and a login), `offline` (writes under run_dir/wandb; `wandb sync`
    uploads it later) or `disabled`; null: the WANDB_MODE environment variable, else offline. A
    resumed run logs to the same W&B run (its id is kept in run_dir/wandb_run_id)."""
    trace: bool = False
    """Record Chrome/Perfetto performance traces under run_dir/traces."""
    console: bool = True
    """Show the progress bar."""
    sessions: bool = False
    """Record agent episodes (turns, tool calls, rewards) to run_dir/sessions.jsonl: the agent and
    environment workflows record theirs (a workflow of your own, through
    ``areno.observe.session.session``). A resumed run records the episodes of the steps it trains
    again beside the first ones: the file is a log of the episodes that ran."""
    log_completions: int = 0
    """Each step, the first this many trajectories of its batch (prompt, completion, reward, the reward's
    figures, finish reason) appended to run_dir/completions.jsonl, one JSON line each, to read what the policy
    writes as it learns (TRL's ``log_completions``); 0: none. A resumed run appends the steps it trains again."""
    profile_steps: list[int] = field(default_factory=list)
    """Trainer steps (1-based) to run under ``torch.profiler``: a Chrome trace and a table of the
    operators and kernels that took the most time, in run_dir/profile (``observe/profile.py``).
    Colocated and server runs: in a partitioned one the trainer's process only coordinates the workers."""

    def __post_init__(self) -> None:
        check_types(self, "observe", ObserveSection)
        check_config(self.log_completions >= 0, "observe.log_completions", f"must be >= 0, got {self.log_completions}")
        check_config(
            self.wandb_mode in (None, "online", "offline", "disabled"),
            "observe.wandb_mode",
            f"must be online, offline, disabled or null, got {self.wandb_mode!r}",
        )
        for key in ("wandb_entity", "wandb_name", "wandb_tags", "wandb_mode"):
            check_config(
                self.wandb_project is not None or not getattr(self, key),
                f"observe.{key}",
                "applies to W&B logging, which is off: set observe.wandb_project too",
            )


TEST_ROLLOUT_DEVICES = ("auto", "cpu", "cuda")


@dataclass(kw_only=True)
class TestRolloutSection(ConfigSection):
    """The test rollout (``areno.engine.test_rollout``): held-out accuracy of each checkpoint, scored as
    the run's evaluation scores it (greedy, or ``train.eval_samples`` with ``test/pass@k``) in the
    background on a rollout engine of its own while training goes on. It loads the newest complete
    checkpoint's ``hf/`` export (evaluations that fall behind skip to the newest) and logs
    ``test/accuracy``, ``test/num_prompts``, ``test/load_s``, ``test/time_s`` with ``test/step``
    = the checkpoint's step, at that step. Placement: in the trainer's process, on this machine,
    beside a colocated run (a partitioned run is refused)."""

    __test__ = False  # not a pytest test class
    _KEY = "test_rollout"

    enabled: bool = False
    """Run the test rollout."""
    interval: int = 10
    """Publish a checkpoint for it (``checkpoints/step_N``) every this many steps, besides those of
    ``train.save_interval``; the last step's checkpoint is evaluated too."""
    device: str = "auto"
    """Device of its rollout engine: auto (the run's ``cluster.device``), cpu or cuda."""
    num_prompts: int = 0
    """Held-out rows evaluated (the first of the ``data.num_eval`` / ``data.eval_path`` rows, several files' in
    their order); 0 = all. Its ``test/*`` figures are the whole's (no per-file figures, as ``eval/<file>/*``)."""
    final_timeout_s: float = 600.0
    """At the end of the run, wait at most this long for the last checkpoint's evaluation."""

    def __post_init__(self) -> None:
        check_types(self, "test_rollout", TestRolloutSection)
        check_config(self.interval >= 1, "test_rollout.interval", f"must be >= 1, got {self.interval}")
        check_config(
            self.device in TEST_ROLLOUT_DEVICES,
            "test_rollout.device",
            f"must be one of {', '.join(TEST_ROLLOUT_DEVICES)} (an engine in the trainer's process), got {self.device!r}",
        )
        check_config(
            self.num_prompts >= 0, "test_rollout.num_prompts", f"must be >= 0 (0 = all), got {self.num_prompts}"
        )
        check_config(
            self.final_timeout_s >= 0, "test_rollout.final_timeout_s", f"must be >= 0, got {self.final_timeout_s}"
        )


@dataclass(kw_only=True)
class OptimSection(ConfigSection, OptimConfig):
    """The ``optim`` section: ``OptimConfig`` (``areno.train``'s, which a config built in Python may give)
    with the sections' guard against unknown attributes; ``ArenoConfig`` makes one of an OptimConfig."""

    _KEY = "optim"


@dataclass(kw_only=True)
class ArenoConfig(ConfigSection):
    """A whole run. `areno train CONFIG key=value ...`."""

    run_dir: str = "runs/areno"
    """Output directory: resolved config, metrics.jsonl, checkpoints, curves."""
    resume: bool | str = False
    """Continue from the newest completed checkpoint in run_dir/checkpoints: ``auto`` resumes when
    one exists and starts fresh otherwise; ``true`` requires one (an error when there is none);
    ``false`` starts fresh. Rows of metrics.jsonl after the resumed step are dropped, since those
    steps are trained again."""
    overwrite: bool = False
    """With ``resume=false``, start over in a run_dir that already holds a run: its metrics.jsonl,
    checkpoints/, traces, sessions.jsonl, profile/ and W&B run id are deleted first. Without it such a
    run_dir is refused (a second run would append its steps to the first one's metrics)."""
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    reward: RewardSection = field(default_factory=RewardSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    optim: OptimConfig = field(default_factory=OptimConfig)
    warm_start: WarmStartSection = field(default_factory=WarmStartSection)
    train: TrainSection = field(default_factory=TrainSection)
    cluster: ClusterSection = field(default_factory=ClusterSection)
    observe: ObserveSection = field(default_factory=ObserveSection)
    test_rollout: TestRolloutSection = field(default_factory=TestRolloutSection)

    def __post_init__(self) -> None:
        check_types(self, "", ArenoConfig)
        if not isinstance(self.optim, OptimSection):  # an OptimConfig: the same settings, guarded
            self.optim = OptimSection(**fields_of(self.optim, OptimConfig))
        for f in dataclasses.fields(self):  # every section, their owners' settings included
            if dataclasses.is_dataclass(getattr(self, f.name)):
                _check_finite(getattr(self, f.name), f.name)
        if isinstance(self.resume, str) and self.resume.lower() in ("true", "false"):
            self.resume = self.resume.lower() == "true"
        check_config(
            isinstance(self.resume, bool) or self.resume == "auto",
            "resume",
            f"must be auto, true or false, got {self.resume!r}",
        )
        self.rollout.backend = resolve_rollout_backend(self.rollout.backend, self.cluster.allocation_mode)
        self.reward.resolve_fn()
        # with train.epochs the steps are counted from the data (checked_config), then checked again
        last = self.train.steps if self.train.steps is not None else float("inf")
        outside = [s for s in self.observe.profile_steps if not 1 <= s <= last]
        check_config(
            not outside,
            "observe.profile_steps",
            f"steps {outside} are outside this run's 1..{self.train.steps} (train.steps): name steps it runs",
        )
        check_config(
            not (self.observe.profile_steps and self.cluster.asks_partitioned() and self.rollout.backend == "areno"),
            "observe.profile_steps",
            "profiles the trainer's process, which in a partitioned run trains and generates nothing (its workers "
            "do): drop the key, or profile the workers' spans with observe.trace (areno trace)",
        )
        check_config(
            self.rollout.backend == "areno" or self.cluster.offload == "none",
            "cluster.offload",
            f"sleep offloads areno's own rollout engine; a {self.rollout.backend} server manages its own memory "
            "(its --gpu-memory-utilization in rollout.server_args): use cluster.offload=none",
        )
        eval_temperature = self.train.eval_temperature
        eval_temperature = self.rollout.temperature if eval_temperature is None else eval_temperature
        check_config(
            self.train.eval_samples == 1 or eval_temperature > 0,
            "train.eval_samples",
            f"{self.train.eval_samples} samples at temperature 0 repeat one greedy completion: set "
            "train.eval_temperature > 0, or train.eval_samples=1",
        )
        routes_key = "train.moe_routing_replay" if self.train.moe_routing_replay else "train.moe_rollout_routes"
        check_config(
            self.rollout.backend == "areno" or not (self.train.moe_rollout_routes or self.train.moe_routing_replay),
            routes_key,
            f"a {self.rollout.backend} server does not return its expert routes; record them with "
            "rollout.backend=areno, or set it to false",
        )
        check_config(
            self.rollout.weight_transfer == "disk" or self.rollout.backend == "vllm",
            "rollout.weight_transfer",
            f"nccl is implemented for vllm servers, not {self.rollout.backend}: use rollout.weight_transfer=disk",
        )
        check_config(
            self.rollout.weight_transfer == "disk" or not self.rollout.servers,
            "rollout.weight_transfer",
            "nccl is for the vllm servers areno starts (it knows their TP and devices), not rollout.servers: "
            "empty rollout.servers or use rollout.weight_transfer=disk",
        )
        check_config(
            self.rollout.weight_transfer == "disk" or self.cluster.device != "cpu",
            "rollout.weight_transfer",
            "nccl needs CUDA (cluster.device is cpu): use rollout.weight_transfer=disk",
        )
        check_config(
            self.rollout.backend == "areno" or self.cluster.train_devices is None,
            "cluster.train_devices",
            f"a {self.rollout.backend} rollout takes its layout from cluster.allocation_mode "
            f"(e.g. '{self.rollout.backend}:d2t1+fsdp:d1') or rollout.servers, not device lists",
        )
        self._check_rollout_backend_keys()
        partitioned = self.cluster.asks_partitioned()
        check_config(
            not (self.overwrite and self.resume is not False),
            "overwrite",
            f"deletes the run_dir's run to start over, but resume={self.resume} continues it: drop one of them",
        )
        for role, override in self.train.role_optim.items():  # a role's optimizer: optim with its keys replaced
            try:
                OptimConfig(**{**fields_of(self.optim, OptimConfig), **override})
            except ConfigError as e:
                message = str(e)
                key = message.split(":", 1)[0]
                if key.startswith("optim.") and key[len("optim.") :] in override:
                    message = f"train.role_optim.{role}.{message[len('optim.') :]}"
                else:  # a key of the optim section the override does not change, in the role's combination
                    message = f"train.role_optim.{role} (over the optim section): {message}"
                raise ConfigError(message) from None
        optimizer_steps = total_optimizer_steps(self) if self.train.steps is not None else float("inf")
        warmups = {"optim.warmup_steps": self.optim.warmup_steps}
        warmups.update(
            {f"train.role_optim.{r}.warmup_steps": o.get("warmup_steps", 0) for r, o in self.train.role_optim.items()}
        )
        for key, warmup in warmups.items():
            check_config(
                warmup <= optimizer_steps,
                key,
                f"{warmup} is more than the run's {optimizer_steps} optimizer steps (train.steps x "
                "num_train_passes x num_minibatches): the run would end before its learning rate peaks",
            )
        if not partitioned or self.rollout.backend != "areno":  # only a partitioned run's workers sync by stream
            check_unset(
                self.cluster,
                "cluster",
                ("sync_commit", "sync_timeout_s", "sync_bucket_bytes"),
                "applies to the policy sync between a partitioned run's workers, and this run is not one "
                "(set cluster.train_devices/rollout_devices or a '+' allocation_mode): drop the key",
            )
        check_config(
            self.rollout.generate_during_train is not True or self.rollout.max_head_offpolicyness > 0,
            "rollout.generate_during_train",
            "true lets an asynchronous run generate while it trains, and this run is synchronous "
            "(rollout.max_head_offpolicyness=0): drop the key or set max_head_offpolicyness > 0",
        )
        check_config(
            not (self.cluster.role_devices and partitioned),
            "cluster.role_devices",
            "places the roles of a colocated run; this run is partitioned (cluster.train_devices/rollout_devices "
            "or a '+' allocation_mode), where every role trains on the training devices: drop one of them",
        )
        check_config(
            not (self.test_rollout.enabled and partitioned),
            "test_rollout.enabled",
            "the test rollout runs in the trainer's process beside a colocated run only; this run is partitioned "
            "(cluster.train_devices/rollout_devices or a '+' allocation_mode): turn one of them off",
        )
        check_config(
            self.rollout.generate_during_train is not False or (self.rollout.backend == "areno" and not partitioned),
            "rollout.generate_during_train",
            "false has areno's engine on the trainer's device take turns with the training step; this run generates "
            f"{'on its own rollout devices' if partitioned else 'with ' + self.rollout.backend + ' servers'}, "
            "where nothing shares the trainer's device: drop the key",
        )
        check_config(
            self.cluster.offload == "none" or self.rollout.max_head_offpolicyness == 0,
            "cluster.offload",
            "sleep takes turns between rollout and training, but this run generates while it trains "
            "(rollout.max_head_offpolicyness > 0): set rollout.max_head_offpolicyness=0 or cluster.offload=none",
        )

    def validate(self) -> None:
        """Every construction check again, on the values held now: a setting assigned after construction
        (``cfg.rollout.batch_size = "2"``, a notebook's first habit) gets the one-line ConfigError it
        would have got there, and ``model.path`` left unset (a config built in Python without it) the
        one ``load_config`` gives. ``Trainer.init`` and ``Trainer.run`` call it."""
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            if dataclasses.is_dataclass(section):  # a section replaced by something else: __post_init__ says so
                _revalidate(section, f.name)
        self.__post_init__()
        check_config(self.model.path != MISSING, "model.path", f"not set: set it to {MANDATORY_HINTS['model.path']}")

    def _check_rollout_backend_keys(self) -> None:
        """Settings of the other rollout backend are refused, not ignored: areno's engine settings with
        vLLM/SGLang servers, the servers' settings with areno's engine or with servers the user runs."""
        rollout = self.rollout
        if rollout.backend == "areno":
            check_config(  # after the allocation string had its say: it may name vllm or sglang
                not rollout.servers,
                "rollout.servers",
                "lists vLLM/SGLang servers: set rollout.backend to vllm or sglang (or name it in "
                "cluster.allocation_mode), or empty the list",
            )
            check_unset(
                rollout,
                "rollout",
                ("server_api_key", "server_args", "server_start_timeout_s"),
                "configures vLLM/SGLang servers, but rollout.backend is areno (its own engine): "
                "drop the key, or set rollout.backend to vllm or sglang",
            )
            return
        engine_keys = [f.name for f in dataclasses.fields(RolloutEngineSettings) if f.name != "max_model_len"]
        for key in (*engine_keys, "kv_blocks", "cuda_graph_warmup"):
            value = getattr(rollout, key)
            check_config(
                value == field_default(RolloutSection, key),
                f"rollout.{key}",
                f"={value} configures areno's own rollout engine, which a {rollout.backend} rollout does not run: "
                f"drop the key (the servers' own settings go in rollout.server_args)",
            )
        if rollout.backend == "vllm":  # see rollout/backends/vllm.py
            for key, off in (("top_p", 1.0), ("top_k", -1), ("min_p", 0.0)):
                check_config(
                    getattr(rollout, key) == off,
                    f"rollout.{key}",
                    f"vLLM reports log-probs of the truncated distribution, areno's trainer those of the whole "
                    f"one, so the importance ratios would be off: use rollout.{key}={off:g} with vllm",
                )
        check_config(
            not self.model.fp32_logits,
            "model.fp32_logits",
            f"makes areno's own rollout engine sample from float32 logits, and a {rollout.backend} server computes "
            f"its logits itself: use rollout.backend=areno, or model.fp32_logits=false",
        )
        check_config(  # see rollout/backends/vllm.py and sglang.py
            rollout.repetition_penalty == 1.0,
            "rollout.repetition_penalty",
            f"{rollout.backend} reports log-probs of the penalised logits, areno's trainer those of the model's own, "
            "so the importance ratios would be off: use rollout.repetition_penalty=1 with "
            f"{rollout.backend}, or rollout.backend=areno",
        )
        mode = self.cluster.allocation_mode
        component = (
            next((c for c in parse_allocation_mode(mode).components if c.kind == "inference"), None) if mode else None
        )
        if rollout.servers:  # the user's servers: areno starts none
            check_unset(
                rollout,
                "rollout",
                ("max_model_len", "server_args", "server_start_timeout_s"),
                "applies to the servers areno starts, but rollout.servers lists servers you run: "
                "drop the key and set it where you start them",
            )
            check_config(
                component is None or component.dp == len(rollout.servers),
                "cluster.allocation_mode",
                f"={mode!r} places {component.dp if component else 0} {rollout.backend} servers but rollout.servers "
                f"lists {len(rollout.servers)}: make the inference component's d the number of servers you run",
            )
        else:
            check_unset(
                rollout,
                "rollout",
                ("server_api_key",),
                "is the key of servers you run (rollout.servers); the servers areno starts get a fresh one: drop it",
            )
            check_config(
                mode is None or component is not None,
                "cluster.allocation_mode",
                f"={mode!r} names no inference component for the {rollout.backend} servers areno starts: add one "
                f"(e.g. '{rollout.backend}:d1+fsdp:d1')",
            )
        check_config(
            self.cluster.scheduler == "local",
            "cluster.scheduler",
            f"{self.cluster.scheduler}: areno starts {rollout.backend} servers as local processes and trains in "
            "this one: use cluster.scheduler=local",
        )


def check_unset(section: Any, name: str, keys: tuple[str, ...], why: str) -> None:
    """A ConfigError ``<name>.<key>: <why>`` for the first of ``keys`` set away from its default."""
    for key in keys:
        check_config(getattr(section, key) == field_default(type(section), key), f"{name}.{key}", why)


OFFLINE_UNUSED_ROLLOUT_KEYS = (
    "n_samples",
    "workflow",
    "workflow_kwargs",
    "max_head_offpolicyness",
    "generate_during_train",
    "max_retries",
    "max_consecutive_dropped",
)
"""The settings of the rollout pool, which an offline recipe (sft ...) does not have: it reads
``rollout.batch_size`` rows of the dataset per step and generates only to evaluate."""


def has_held_out_rows(data: DataSection) -> bool:
    """Whether a run of ``data`` holds out rows to evaluate: a shipped task's ``num_eval``, or the first
    ``num_eval`` of ``eval_path``'s (a ``train_path`` alone gives none)."""
    return data.num_eval > 0 and (data.task is not None or data.eval_path is not None)


def offline_unused_rollout_keys(config: ArenoConfig, *, generates: bool = True) -> tuple[str, ...]:
    """The ``rollout`` keys an offline recipe never reads under ``config``: the pool's, and the sampling
    ones its evaluations do not take (``scoring.eval_params``: greedy for one sample without
    ``train.eval_temperature``; ``rollout.temperature`` only without ``train.eval_temperature``). A run
    that never ``generates`` builds no rollout engine: every key but ``batch_size``."""
    if not generates:
        return tuple(f.name for f in dataclasses.fields(RolloutSection) if f.name != "batch_size")
    train = config.train
    if train.eval_samples == 1 and not train.eval_temperature:
        return (*OFFLINE_UNUSED_ROLLOUT_KEYS, "temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    if train.eval_temperature is not None:
        return (*OFFLINE_UNUSED_ROLLOUT_KEYS, "temperature")
    return OFFLINE_UNUSED_ROLLOUT_KEYS


def check_offline_rollout(config: ArenoConfig, algorithm: str, *, generates: bool = True) -> None:
    """An offline recipe's run sets none of ``offline_unused_rollout_keys`` away from its default: a
    ConfigError naming the first, rather than a setting silently doing nothing."""
    if generates:
        why = "generates only for its evaluations (train.eval_samples, train.eval_temperature)"
    else:
        why = "generates nothing in this run (no held-out evaluation that samples), so it builds no rollout engine"
    check_unset(
        config.rollout,
        "rollout",
        offline_unused_rollout_keys(config, generates=generates),
        f"train.algorithm={algorithm} trains offline on the dataset's rows (rollout.batch_size a step) and "
        f"{why}: the setting does nothing here: drop it",
    )


def field_default(section: type, key: str) -> Any:
    """The default value of field ``key`` of dataclass ``section``."""
    f = next(f for f in dataclasses.fields(section) if f.name == key)
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def resolve_rollout_backend(backend: str, allocation_mode: str | None) -> str:
    """``rollout.backend``, or the inference backend ``allocation_mode`` names (vllm, sglang) when
    the key is left at areno; a ConfigError when the two name different ones."""
    named = inference_backend(parse_allocation_mode(allocation_mode)) if allocation_mode else None
    if named is None or named == backend:
        return backend
    check_config(
        backend == "areno",  # the default: the allocation string chooses
        "rollout.backend",
        f"is {backend!r} but cluster.allocation_mode {allocation_mode!r} names {named!r}: make them agree",
    )
    return named


class Dtypes(NamedTuple):
    """The dtypes of a run on one device type, ``auto`` resolved."""

    train: str
    """Training master weights (``model.dtype``)."""
    rollout: str
    """The rollout engine's weights and KV cache (``model.rollout_dtype``)."""


def auto_dtype(config: ArenoConfig, device_type: str) -> str:
    """What ``auto`` dtypes are on ``device_type``: bfloat16 on CUDA; on CPU bfloat16 where its GEMMs
    pay (``cpu_gemm.prefers_bf16``: a wide model, native bfloat16), else float32."""
    if device_type == "cuda":
        return "bfloat16"
    return "bfloat16" if cpu_gemm.prefers_bf16(_hidden_size(config)) else "float32"


def _hidden_size(config: ArenoConfig) -> int:
    """The model's hidden size: its config.json, else ``init_tiny``'s (the model is made at start-up)."""
    if (Path(config.model.path) / "config.json").is_file():
        return read_config(config.model.path).hidden_size
    return int((config.model.init_tiny or {}).get("hidden_size", 0))


def resolve_dtypes(config: ArenoConfig, device_type: str) -> Dtypes:
    """The run's dtypes on ``device_type`` (``cuda`` or ``cpu``), ``auto`` resolved (``auto_dtype``)."""
    rollout = config.model.rollout_dtype
    if rollout == "auto":
        rollout = auto_dtype(config, device_type)
    return Dtypes(train=config.model.dtype, rollout=rollout)


def total_optimizer_steps(config: ArenoConfig) -> int:
    """Optimizer steps of the whole run (the cosine schedule's length): steps x passes x
    minibatches, at least 1."""
    t = config.train
    if t.steps is None:  # a config not through checked_config, which counts train.epochs' steps
        raise ValueError("train.steps is unset (train.epochs): areno.api.config.checked_config counts the steps")
    return max(t.steps * t.num_train_passes * t.num_minibatches, 1)


def fields_of(section: object, owner: type) -> dict[str, Any]:
    """The values of ``owner``'s fields in ``section`` (an instance of ``owner`` or a subclass), as
    keyword arguments of a config that extends ``owner`` too."""
    assert isinstance(section, owner), (type(section), owner)
    return {f.name: getattr(section, f.name) for f in dataclasses.fields(owner)}


def build_train_backend_config(config: ArenoConfig, *, role_name: str, trainable: bool) -> TrainBackendConfig:
    """The training backend's config of one recipe role: the ``optim``, ``train`` and ``model``
    sections' training settings, the run's schedule length and the role."""
    step = fields_of(config.train, TrainStepConfig)
    if not trainable:  # a frozen role (reference, reward model) keeps the base weights: no adapters
        step["lora"] = None
    optim = fields_of(config.optim, OptimConfig)
    role_optim = config.train.role_optim  # the role's own name first, else an alias of it
    given = role_name if role_name in role_optim else next((g for g in role_optim if role_of(g) == role_name), None)
    optim.update(role_optim.get(given, {}))
    return TrainBackendConfig(
        **optim,
        **step,
        **fields_of(config.model, PrecisionConfig),
        param_dtype=None if config.model.compute_dtype == "auto" else config.model.compute_dtype,
        cpu_auto_dtype=auto_dtype(config, "cpu") if config.model.compute_dtype == "auto" else "float32",
        total_steps=total_optimizer_steps(config),
        role_name=role_name,
        trainable=trainable,
    )


def build_rollout_engine_config(
    config: ArenoConfig, *, device: str, dtype: str, max_num_seqs: int, num_blocks: int = 0
) -> RolloutEngineConfig:
    """A rollout engine's config: the ``rollout`` section's engine settings, on ``device`` in
    ``dtype``, with the running batch and the KV pool its owner sized (``num_blocks`` 0: automatic)."""
    settings = fields_of(config.rollout, RolloutEngineSettings)
    settings["max_num_seqs"] = max_num_seqs
    settings["record_routes"] = config.train.moe_rollout_routes or config.train.moe_routing_replay
    return RolloutEngineConfig(
        **settings, device=device, dtype=dtype, num_blocks=num_blocks or None, fp32_logits=config.model.fp32_logits
    )
