"""Training metrics: one logger, several sinks (metrics.jsonl, console, TensorBoard, W&B).

Names are namespaced so that every sink and the run report group them the same way:

    rollout/…      what the rollout produced   (rollout/reward_mean, rollout/staleness_mean, …)
    train/…        the optimisation step       (train/loss, train/kl, train/clip_frac, …)
    eval/…         held-out evaluation          (eval/accuracy, …)
    timing/…       wall-clock split, throughput (timing/rollout_s, timing/train_s, timing/sync_s,
                                                 timing/tokens_per_s)
    system/…       memory, utilisation
    policy_sync_*  policy sync, spelled exactly as seed 000 does, with no namespace:
                   policy_sync_time_s, policy_sync_transfer_time_s, policy_sync_bytes,
                   policy_sync_tensors, policy_sync_throughput_gbps

``MetricsLogger.log`` is thread-safe: evaluation threads may log between training steps (with the
step of the policy they evaluated). In a distributed run only one process (rank 0) should own a
logger; other ranks reduce their numbers to it.
"""

from __future__ import annotations

import json
import math
import numbers
import sys
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from areno.errors import ConfigError, DataError, RunFailure

NAMESPACES: tuple[str, ...] = ("rollout/", "train/", "eval/", "test/", "timing/", "system/")
"""Allowed name prefixes (besides ``policy_sync_``)."""
POLICY_SYNC_PREFIX = "policy_sync_"
POLICY_SYNC_KEYS: tuple[str, ...] = (
    "policy_sync_time_s",
    "policy_sync_transfer_time_s",
    "policy_sync_bytes",
    "policy_sync_tensors",
    "policy_sync_throughput_gbps",
)
"""The policy-sync metrics of seed 000, in its spelling."""

REWARD_KEY = "rollout/reward_mean"
REWARD_PARTS_PREFIX = "rollout/reward/"
"""Where a ``reward.fn`` list's functions' mean scores are logged: ``rollout/reward/<name>_mean``."""
SCORED_REWARD_KEY = "rollout/scored_reward_mean"
"""Every scored sample's reward where dynamic sampling filters groups (``REWARD_KEY`` then covers the kept ones,
whose rewards vary by construction): the reward the console, the curve and the report show where it is logged."""
MODEL_REWARD_KEY = "train/reward_model/reward_mean"
"""The reward the step trained on with ``reward.model``: ``reward.fn``'s plus the weighted model score (the rollout's
``REWARD_KEY`` holds ``reward.fn``'s alone): the reward the console, the curve and the report show where logged."""
MODEL_SCORE_KEY = "train/reward_model/score_mean"
"""The reward model's mean score of the step's batch (unweighted): the console's ``model`` part of the reward."""
COMPLETION_LEN_KEY = "rollout/completion_len_mean"
POLICY_LOSS_KEY = "train/policy/loss"
"""The policy's loss (the NLL of ``sft``, the actor loss of an RL recipe): the console's ``loss``;
a recipe without a policy shows its trained role's ``train/<role>/loss`` (``reward_model``)."""
VALUE_LOSS_SUFFIX = "/critic/value_loss"
"""A critic role's value loss (``train/<role>/critic/value_loss``, PPO's value model): the console's ``vloss``."""
CONSECUTIVE_SKIPS_SUFFIX = "/consecutive_skips"
"""A trained role's steps skipped in a row for a non-finite loss or gradient (``train/<role>/consecutive_skips``,
0 after a step that updated): the console's ``skipped``."""
STALENESS_KEY = "rollout/staleness_mean"
"""Mean (current version - token version) over the trained tokens of a step."""
TOKENS_PER_S_KEY = "timing/tokens_per_s"
NUM_TOKENS_KEY = "rollout/num_tokens"
"""Tokens (prompt + completion) in the step's batch; the console derives tokens/s from it when
``timing/tokens_per_s`` is not logged."""

METRICS_FILENAME = "metrics.jsonl"

Number = int | float


_EVAL_FILE_ONLY = ("eval/samples_per_prompt", "eval/completion_tokens_mean", "eval/truncated_fraction")
"""Held-out figures the console line leaves to metrics.jsonl."""


class MissingDependencyError(ImportError):
    """An optional feature was enabled but the package it needs is not installed."""


def check_metric_name(name: str) -> None:
    """Raise ValueError unless ``name`` is in one of the known namespaces."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"metric names must be non-empty strings, got {name!r}")
    if name.startswith(POLICY_SYNC_PREFIX):
        return
    if not name.startswith(NAMESPACES) or name.endswith("/"):
        raise ValueError(
            f"metric {name!r} has no namespace: prefix it with one of {', '.join(NAMESPACES)} "
            f"(or name it {POLICY_SYNC_PREFIX}* for policy sync)"
        )


def to_number(name: str, value: Any) -> Number:
    """A plain Python int/float from an int, float, bool, numpy scalar or 0-d tensor."""
    if hasattr(value, "item") and not isinstance(value, numbers.Number):
        value = value.item()  # torch / numpy scalars; raises on tensors with several elements
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise ValueError(f"metric {name!r} must be a real number, got {type(value).__name__}: {value!r}")


class MetricSink(ABC):
    """Where metrics go. ``MetricsLogger`` calls sinks under one lock, so sinks need none."""

    @abstractmethod
    def write(self, metrics: Mapping[str, Number], step: int) -> None:
        """Record ``metrics`` (validated, plain numbers) at training step ``step``."""

    @abstractmethod
    def close(self) -> None:
        """Flush and release resources. Called once."""


class JsonlSink(MetricSink):
    """``run_dir/metrics.jsonl``: one JSON object per ``log`` call with ``step``, wall ``time``
    (Unix seconds) and the metrics. Non-finite floats are written as ``null`` (strict JSON)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / METRICS_FILENAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    def write(self, metrics: Mapping[str, Number], step: int) -> None:
        record: dict[str, Any] = {"step": step, "time": time.time()}
        for key, value in metrics.items():
            record[key] = value if math.isfinite(value) else None
        try:
            self._file.write(json.dumps(record, allow_nan=False) + "\n")
            self._file.flush()
        except OSError as exc:  # a full disk, a file-size limit
            raise MetricsWriteError(
                f"writing {self.path} failed at step {step} ({exc.strerror or exc}): free space on its disk "
                "(resume=auto drops a torn last line)"
            ) from None

    def close(self) -> None:
        try:
            self._file.close()
        except OSError:  # the write that failed said why; the buffer it holds cannot go anywhere
            pass


class MetricsWriteError(RunFailure):
    """``metrics.jsonl`` cannot be written: the run stops (its steps would go unrecorded)."""

    training_side_intact = True
    """The steps trained are sound: the Trainer saves an emergency checkpoint of the step reached."""


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The records of ``run_dir/metrics.jsonl`` in file order (a torn last line is skipped)."""
    path = Path(run_dir) / METRICS_FILENAME
    if not path.is_file():
        raise DataError(f"{path} does not exist: is {run_dir} a run directory?")
    return read_jsonl_records(path, what="valid JSON")


def read_jsonl_records(path: Path, *, what: str) -> list[dict[str, Any]]:
    """The JSON lines of ``path`` in file order. A torn last line (the writer was killed mid-line)
    is skipped; any other bad line is a DataError naming the file, the line and ``what`` it
    should have been."""
    records = []
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise DataError(f"{path}:{i + 1} is not {what}: {line[:80]!r}") from None
    return records


def _format_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def _format_number(value: float) -> str:
    """Three significant digits, no exponent between 1e-3 and 1e7 (0.25, 12.3, 2470, 1.2e+07)."""
    if value != value:  # NaN
        return "nan"
    magnitude = abs(value)
    if 100 <= magnitude < 1e7:
        return f"{value:.0f}"
    return f"{value:.3g}"


def step_reward(metrics: Mapping[str, Number]) -> Number | None:
    """The reward shown for a step: ``MODEL_REWARD_KEY`` where logged, else ``SCORED_REWARD_KEY``, else
    ``REWARD_KEY`` (None: none of them)."""
    for key in (MODEL_REWARD_KEY, SCORED_REWARD_KEY):
        if key in metrics:
            return metrics[key]
    return metrics.get(REWARD_KEY)


def step_loss(metrics: Mapping[str, Number]) -> Number | None:
    """The loss the console shows for a step (``POLICY_LOSS_KEY``, else the first ``train/<role>/loss``
    or a backend's own ``train/loss``); None when the step logged none."""
    if POLICY_LOSS_KEY in metrics:
        return metrics[POLICY_LOSS_KEY]
    losses = [k for k in sorted(metrics) if k.startswith("train/") and k.endswith("/loss") and k.count("/") <= 2]
    return metrics[losses[0]] if losses else None


def critic_value_loss(metrics: Mapping[str, Number]) -> Number | None:
    """The value loss the console shows for a step (the first ``train/<role>/critic/value_loss``);
    None when no critic trained."""
    keys = [k for k in sorted(metrics) if k.startswith("train/") and k.endswith(VALUE_LOSS_SUFFIX)]
    return metrics[keys[0]] if keys else None


class ConsoleSink(MetricSink):
    """A progress line: [stage] step/total, reward and completion length (or a loss), a critic's value
    loss, tokens/s, staleness, ETA.

    On a terminal it is a tqdm bar; otherwise (CI, log files) a plain line per step, and eval
    results as their own line. Tokens/s is ``timing/tokens_per_s`` when logged, else
    ``rollout/num_tokens`` divided by the wall time since the previous step. The ETA is the mean
    wall time of this stage's steps after its first (which carries the start-up: model load,
    compilation, the first evaluation) times the steps left; the first step shows none.
    ``reward_parts``: the figure names of a ``reward.fn`` list's functions, whose mean scores follow the
    reward (``reward 1.40 (accuracy 0.50, format 0.90)``; ``kept:`` where dynamic sampling shows the
    scored mean, as the parts are the kept groups').
    """

    def __init__(
        self,
        *,
        total_steps: int | None,
        start_step: int = 0,
        stream: TextIO | None = None,
        use_tqdm: bool | None = None,
        stage: str | None = None,
        reward_parts: Sequence[str] = (),
    ) -> None:
        self.total_steps = total_steps
        self.reward_parts = tuple(reward_parts)
        self.stream = stream if stream is not None else sys.stderr
        self.stage = stage
        isatty = getattr(self.stream, "isatty", lambda: False)()
        self.use_tqdm = isatty if use_tqdm is None else use_tqdm
        self._last_step = start_step
        self._t_last_step = time.monotonic()
        self._first_step: int | None = None
        """The first step this sink printed (at ``_t_first_step``): the ETA counts from there."""
        self._t_first_step = 0.0
        self._bar = None
        if self.use_tqdm:
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=total_steps,
                initial=start_step,
                file=self.stream,
                dynamic_ncols=True,
                unit="step",
                desc=stage or "train",
                # tqdm's own remaining time counts from the bar's start (the start-up): the postfix
                # carries this sink's ETA instead
                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]",
            )

    def summary(self, metrics: Mapping[str, Number], step: int) -> dict[str, str]:
        """The short fields shown for a step (reward, len or loss, vloss, tok/s, stale, skipped, eta)."""
        now = time.monotonic()
        fields: dict[str, str] = {}
        if REWARD_KEY in metrics:
            fields["reward"] = _format_number(step_reward(metrics)) + self._parts(metrics)
            if COMPLETION_LEN_KEY in metrics:
                fields["len"] = _format_number(metrics[COMPLETION_LEN_KEY])
        # a policy-gradient loss reads ~0 on every step (the ratio is 1 and a group's advantages
        # cancel): a rollout's reward and length say more; losses are shown for steps without a reward
        loss = step_loss(metrics) if REWARD_KEY not in metrics else None
        if loss is not None:
            fields["loss"] = _format_number(loss)
        # unlike the policy's, the critic's loss falls as it learns: whether the value model keeps up
        value_loss = critic_value_loss(metrics)
        if value_loss is not None:
            fields["vloss"] = _format_number(value_loss)
        tokens_per_s = metrics.get(TOKENS_PER_S_KEY)
        if tokens_per_s is None and NUM_TOKENS_KEY in metrics and step > self._last_step:
            elapsed = now - self._t_last_step
            if elapsed > 0:
                tokens_per_s = metrics[NUM_TOKENS_KEY] / elapsed
        if tokens_per_s is not None:
            fields["tok/s"] = _format_number(tokens_per_s)
        if STALENESS_KEY in metrics:
            fields["stale"] = _format_number(metrics[STALENESS_KEY])
        # a skipped step's other fields read like any step's: say that nothing was updated
        skips = max(
            (v for k, v in metrics.items() if k.startswith("train/") and k.endswith(CONSECUTIVE_SKIPS_SUFFIX)),
            default=0,
        )
        if skips:
            fields["skipped"] = f"loss/grad NaN or inf, {int(skips)} in a row"
        eta = self.eta_s(step, now)
        if eta is not None:
            fields["eta"] = _format_duration(eta)
        return fields

    def _parts(self, metrics: Mapping[str, Number]) -> str:
        """`` (name mean, ...)`` of the reward's functions logged this step ('' for one function)."""
        parts = [(n, metrics.get(f"{REWARD_PARTS_PREFIX}{n}_mean")) for n in self.reward_parts]
        if any(v is None for _, v in parts):  # a workflow that scores outside ascore_reward logs none
            parts = []
        if MODEL_SCORE_KEY in metrics:  # reward.model's score, unweighted, beside reward.fn's
            parts.append(("model", metrics[MODEL_SCORE_KEY]))
        if not parts:
            return ""
        kept = "kept: " if SCORED_REWARD_KEY in metrics else ""
        return f" ({kept}{', '.join(f'{n} {_format_number(v)}' for n, v in parts)})"

    def eta_s(self, step: int, now: float) -> float | None:
        """Seconds left after ``step`` at time ``now``: the mean time of the steps since the first one
        this sink printed, times the steps left (None: no total, or no step timed yet)."""
        first = self._first_step
        if self.total_steps is None or first is None or not first < step <= self.total_steps:
            return None
        return (now - self._t_first_step) / (step - first) * (self.total_steps - step)

    def write(self, metrics: Mapping[str, Number], step: int) -> None:
        # held-out results (eval/, and test/ logged late at their checkpoint's step) print as one line
        is_step = step > self._last_step or any(not k.startswith(("eval/", "test/")) for k in metrics)
        fields = self.summary(metrics, step)
        eval_fields = {k: v for k, v in metrics.items() if k.startswith(("eval/", "test/"))}
        if self._bar is not None:
            if step > self._last_step:
                self._bar.update(step - self._last_step)
            if eval_fields:
                self._bar.write(self._eval_line(eval_fields, step), file=self.stream)
            if is_step and fields:
                self._bar.set_postfix(fields, refresh=True)
        else:
            if is_step:
                total = f"/{self.total_steps}" if self.total_steps is not None else ""
                stage = f"{self.stage} " if self.stage else ""
                parts = [f"{stage}step {step}{total}"] + [f"{k} {v}" for k, v in fields.items()]
                print(" | ".join(parts), file=self.stream, flush=True)
            if eval_fields:
                print(self._eval_line(eval_fields, step), file=self.stream, flush=True)
        if step > self._last_step:
            self._last_step = step
            self._t_last_step = time.monotonic()
            if self._first_step is None:
                self._first_step, self._t_first_step = step, self._t_last_step

    @staticmethod
    def _eval_line(eval_fields: Mapping[str, Number], step: int) -> str:
        """The held-out figures worth a glance (metrics.jsonl has them all): pass@1 only beside
        other k, reward errors only when there were some."""
        sampled = {k.split("/pass@")[0] for k in eval_fields if "/pass@" in k and not k.endswith("/pass@1")}

        def shown(key: str, value: Number) -> bool:
            if key in _EVAL_FILE_ONLY or (key.endswith("/pass@1") and key.split("/pass@")[0] not in sampled):
                return False
            return not key.endswith("/reward_errors") or value != 0

        body = " ".join(f"{k}={_format_number(v)}" for k, v in sorted(eval_fields.items()) if shown(k, v))
        return f"eval @ step {step}: {body}"

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class TensorBoardSink(MetricSink):
    """Scalars to ``run_dir/tensorboard`` (``tensorboard --logdir RUN_DIR/tensorboard``). ``purge_step``:
    TensorBoard hides the events of earlier writers at this step and later (the steps a resumed run
    trains again), as metrics.jsonl is cut back."""

    def __init__(self, run_dir: Path, *, purge_step: int | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise MissingDependencyError(
                f"TensorBoard logging is enabled but cannot be imported ({e}): "
                "pip install tensorboard, or turn tensorboard off"
            ) from e
        self.log_dir = Path(run_dir) / "tensorboard"
        self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=purge_step)

    def write(self, metrics: Mapping[str, Number], step: int) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step)

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()


WANDB_ID_FILENAME = "wandb_run_id"
"""The run directory's W&B run id: a resumed run logs to the same W&B run."""
WANDB_MODES = ("online", "offline", "disabled")


def resolve_wandb_mode(mode: str | None, environ: Mapping[str, str]) -> str:
    """``observe.wandb_mode``, else the ``WANDB_MODE`` environment variable (``dryrun``, wandb's old
    name of offline, read as offline; empty as unset), else offline."""
    if mode is not None:
        return mode
    env = environ.get("WANDB_MODE", "").strip()
    if not env:
        return "offline"
    if env.lower() == "dryrun":
        return "offline"
    if env.lower() not in WANDB_MODES:
        raise ConfigError(
            f"WANDB_MODE={env}: must be online, offline or disabled: change the variable, or set "
            "observe.wandb_mode (which wins over it)"
        )
    return env.lower()


@dataclass(kw_only=True)
class WandbConfig:
    """Weights & Biases logging. Needs ``pip install 'areno[wandb]'``."""

    project: str = "areno"
    """W&B project name."""
    entity: str | None = None
    """W&B team or user; None uses the account default."""
    name: str | None = None
    """Run name; None uses the run directory's name."""
    mode: str = "offline"
    """``online`` (needs network and a login), ``offline`` (writes under run_dir/wandb, sync later
    with ``wandb sync``) or ``disabled``."""
    tags: tuple[str, ...] = ()
    """Run tags."""
    config: dict[str, Any] = field(default_factory=dict)
    """The run's configuration, shown in the W&B UI."""
    run_id: str | None = None
    """The W&B run to log to (a resumed run's: its steps go on there); None: a new run. The sink
    writes the id it used to ``run_dir/wandb_run_id``."""

    def __post_init__(self) -> None:
        if self.mode not in WANDB_MODES:
            raise ValueError(f"wandb.mode must be online, offline or disabled, got {self.mode!r}")
        if not self.project:
            raise ValueError("wandb.project must be a non-empty string")
        self.tags = tuple(self.tags)


class WandbSink(MetricSink):
    """Metrics to a W&B run. Steps go in a ``step`` field used as every metric's x axis, so
    results logged late (background evaluation) are kept rather than dropped as out of order, and a
    resumed run's rows of the steps it trains again are kept beside the first ones (W&B cannot cut a
    run's history back, as metrics.jsonl and TensorBoard are)."""

    def __init__(self, run_dir: Path, config: WandbConfig) -> None:
        try:
            import wandb
        except ImportError as e:
            raise MissingDependencyError(
                "W&B logging is enabled but wandb is not installed: pip install 'areno[wandb]', or set wandb to None"
            ) from e
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        run_id = config.run_id or uuid.uuid4().hex[:12]
        self._run = wandb.init(
            id=run_id,
            resume="allow",
            project=config.project,
            entity=config.entity,
            name=config.name or run_dir.name,
            dir=str(run_dir),
            mode=config.mode,
            tags=list(config.tags),
            config=dict(config.config),
        )
        (run_dir / WANDB_ID_FILENAME).write_text(run_id + "\n")
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")

    def write(self, metrics: Mapping[str, Number], step: int) -> None:
        self._run.log({**metrics, "step": step})

    def close(self) -> None:
        self._run.finish()


class MetricsLogger:
    """Validates metric names and values once and hands the same record to every sink.

    Thread-safe. ``log`` after ``close`` raises. Usable as a context manager.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        total_steps: int | None,
        console: bool = True,
        tensorboard: bool = False,
        wandb: WandbConfig | None = None,
        start_step: int = 0,
        stage: str | None = None,
        extra_sinks: Sequence[MetricSink] = (),
        purge_step: int | None = None,
        reward_parts: Sequence[str] = (),
    ) -> None:
        """``stage``: the console's label of these steps when the run is one stage of several
        (``"warm start"``: ``warm start step 3/80 | ...``). ``purge_step``: the first step this run
        logs again (a resumed run's checkpoint step + 1, 0 for one that starts over): TensorBoard hides
        what earlier runs logged from it on. ``reward_parts``: the console's (``ConsoleSink``)."""
        if total_steps is not None and total_steps < 0:
            raise ValueError(f"total_steps must be >= 0 or None, got {total_steps}")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._closed = False
        self.sinks: list[MetricSink] = [JsonlSink(self.run_dir)]
        try:
            if console:
                self.sinks.append(
                    ConsoleSink(total_steps=total_steps, start_step=start_step, stage=stage, reward_parts=reward_parts)
                )
            if tensorboard:
                self.sinks.append(TensorBoardSink(self.run_dir, purge_step=purge_step))
            if wandb is not None and wandb.mode != "disabled":
                self.sinks.append(WandbSink(self.run_dir, wandb))
        except BaseException:
            for sink in self.sinks:
                sink.close()
            raise
        self.sinks.extend(extra_sinks)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Record ``metrics`` at training step ``step`` in every sink."""
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        clean: dict[str, Number] = {}
        for name, value in metrics.items():
            check_metric_name(name)
            clean[name] = to_number(name, value)
        if not clean:
            return
        with self._lock:
            if self._closed:
                raise RuntimeError("MetricsLogger.log called after close()")
            for sink in self.sinks:
                sink.write(clean, int(step))

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for sink in self.sinks:
                sink.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
