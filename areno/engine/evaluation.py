"""``areno eval``: score a model or a run's checkpoint on held-out rows, as training scores it.

The rows are the run's held-out split (``data.eval_path`` / ``data.num_eval``, or a shipped task's
eval rows) or its training rows. They are scored as the run's own evaluation scores them
(``engine/scoring.py``): the same rendering, reward, sampling (``train.eval_samples``,
``eval_temperature``, seeds from ``train.seed``) and batches, so evaluating checkpoint k alone gives
the figures the run logged for it. Options override the sampling and the ``pass@k`` threshold.

Generation runs on the run's rollout backend: areno's embedded engine on ``cluster.device``, or
vLLM / SGLang servers that areno starts from the evaluated directory (``rollout.backend``).
Servers the user runs (``rollout.servers``) serve their own weights, so they evaluate ``model.path``
only. Each row's completions and rewards go to a JSON-lines file, the summary beside it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from areno.data.datasets import PAIR_KEYS, build_splits, held_out_files, several_held_out_files, source_names
from areno.engine.api import (
    load_tokenizer,
    prepare_model_dir,
    resolve_device,
    resolve_recipe,
    reward_model_backends,
    trains_on_pairs,
)
from areno.engine.config import ArenoConfig
from areno.engine.host import apply_host_settings
from areno.engine.local import LocalRolloutSide
from areno.engine.rollout_side import RolloutSide
from areno.engine.scoring import (
    MODEL_SCORE_INFO_KEY,
    add_model_scores,
    ascore_rows,
    check_eval_seeds,
    eval_metrics,
    eval_params,
    held_burst,
)
from areno.engine.seams import SideSetup
from areno.engine.servers import ServerRolloutSide
from areno.errors import ConfigError, DataError, ModelDirError
from areno.models.checkpoint_dirs import complete_checkpoints, model_dir_of, newest_checkpoint
from areno.models.hf_io import read_config
from areno.models.vision import VisionConfig
from areno.recipes.runner import reward_model_scores
from areno.rewards.loader import check_reward_started, load_reward, release_reward, start_reward
from areno.specializations.preference import RewardModelSpecialization
from areno.train.checkpoint import read_best
from areno.types import MIN_TEMPERATURE, SamplingParams, Trajectory
from areno.workflows.common import REWARD_FIGURES_KEY

logger = logging.getLogger("areno.eval")

SPLITS = ("eval", "train")
LATEST = "latest"
BEST = "best"
"""``--checkpoint latest``: the newest complete checkpoint of the config's ``run_dir``."""
PROGRESS_EVERY_S = 10.0
"""Seconds between progress lines while rows are scored."""


@dataclasses.dataclass(frozen=True)
class EvalOptions:
    """What ``areno eval`` evaluates and how (its command-line options)."""

    checkpoint: str | None = None
    """A Hugging Face model directory, a checkpoint ``step_N`` directory (its ``hf/`` export), a step of
    the config's ``run_dir`` (``step_120`` or ``120``: ``checkpoints/step_00000120``), a run directory or
    its ``checkpoints/`` (the newest complete checkpoint), ``latest`` (that of the config's
    ``run_dir``) or ``best`` (its best by ``train.best_metric``). None: ``model.path``."""
    samples: int | None = None
    """Completions per row. None: ``train.eval_samples``, as the run evaluates."""
    temperature: float | None = None
    """Sampling temperature. None: ``train.eval_temperature``, as the run evaluates: greedy for one
    sample, else ``rollout.temperature``."""
    split: str = "eval"
    """``eval`` (held-out rows) or ``train``."""
    num_prompts: int = 0
    """Score the first this many rows of the split, which may exceed ``data.num_eval`` (up to the rows
    there are); 0: those the run scores (``data.num_eval`` held-out rows, every training row)."""
    pass_threshold: float | None = None
    """A sample solves its row when its reward is at least this (``pass@k``). None:
    ``train.eval_pass_threshold``."""
    seed: int | None = None
    """Base seed of the sampled requests. None: ``train.seed``."""
    out: str | None = None
    """The per-row JSON-lines file. None: ``default_rows_file``."""

    def __post_init__(self) -> None:
        if self.samples is not None and self.samples < 1:
            raise ConfigError(f"--samples: must be >= 1, got {self.samples}")
        if self.temperature is not None and not (
            self.temperature == 0 or (math.isfinite(self.temperature) and self.temperature >= MIN_TEMPERATURE)
        ):
            raise ConfigError(
                f"--temperature: must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g}, got {self.temperature}"
            )
        if self.split not in SPLITS:
            raise ConfigError(f"--split: must be one of {', '.join(SPLITS)}, got {self.split!r}")
        if self.num_prompts < 0:
            raise ConfigError(f"--num-prompts: must be >= 0 (0: all rows), got {self.num_prompts}")
        if self.pass_threshold is not None and not math.isfinite(self.pass_threshold):
            raise ConfigError(f"--pass-threshold: must be a finite number, got {self.pass_threshold}")


def resolve_checkpoint(spec: str | None, config: ArenoConfig) -> tuple[Path, str]:
    """``(model directory, name)`` of what ``spec`` names (see ``EvalOptions.checkpoint``); the name
    labels the output file (``base``, ``step_00000040`` or the directory's name)."""
    if spec is None:
        return prepare_model_dir(config), "base"
    path = Path(config.run_dir) if spec == LATEST else Path(spec)
    if spec == BEST and not path.is_dir():
        best = read_best(Path(config.run_dir) / "checkpoints")
        if best is None:
            raise ModelDirError(
                f"--checkpoint best: {Path(config.run_dir) / 'checkpoints'} names no best checkpoint: "
                "train.best_metric picks one as the run evaluates and saves; name a step or 'latest'"
            )
        path = Path(config.run_dir) / "checkpoints" / Path(best["path"]).name
    step = re.fullmatch(r"(?:step_)?(\d+)", spec)
    if step is not None and not path.is_dir():  # a step of the config's run: checkpoints/step_00000120
        path = Path(config.run_dir) / "checkpoints" / f"step_{int(step.group(1)):08d}"
    if not path.is_dir():
        steps = [p.name for _, p in complete_checkpoints(Path(config.run_dir) / "checkpoints")]
        there = f"; run_dir's complete checkpoints: {', '.join(steps[-8:])}" if steps else ""
        raise ModelDirError(
            f"--checkpoint: {path} is not a directory: name a Hugging Face checkpoint, a checkpoint step of "
            f"run_dir ({config.run_dir}) such as step_120, a run directory, or 'latest'{there}"
        )
    named = model_dir_of(path, "--checkpoint")
    if named is not None:
        model_dir, checkpoint = named
        return model_dir, _checkpoint_name(checkpoint, config) if checkpoint is not None else model_dir.name
    newest = newest_checkpoint(path)
    if newest is not None:
        return newest / "hf", _checkpoint_name(newest, config)
    raise ModelDirError(
        f"--checkpoint: {path} holds no model (config.json), no checkpoint export (hf/config.json) and no "
        "complete checkpoints/step_N: name a Hugging Face checkpoint, a checkpoint or a run directory"
    )


def _checkpoint_name(path: Path, config: ArenoConfig) -> str:
    """A checkpoint's name in its rows file: ``step_N``, after its run's directory name when that run
    is not the config's (two runs' step_N would write one file)."""
    run = path.parent.parent  # run_dir/checkpoints/step_N
    return path.name if run.resolve() == Path(config.run_dir).resolve() else f"{run.name}-{path.name}"


def eval_rows(config: ArenoConfig, split: str, num_prompts: int) -> list[dict[str, Any]]:
    """The rows to score (see the module docstring): the first ``num_prompts`` of the split, or with 0
    those the run scores (``data.num_eval`` held-out rows; every training row). ``num_prompts`` may
    exceed ``data.num_eval``, up to the rows ``data.eval_path`` holds or the task has; a ConfigError
    when the split has fewer, a DataError when it has none. With several held-out files
    (``several_held_out_files``) ``num_prompts`` counts each file's first rows, as ``data.num_eval`` does."""
    return _rows_and_sources(config, split, num_prompts)[0]


def _rows_and_sources(
    config: ArenoConfig, split: str, num_prompts: int
) -> tuple[list[dict[str, Any]], list[tuple[str, int]]]:
    """``eval_rows`` and, with several held-out files, each file's name and rows among them (``eval_sources``)."""
    data = config.data
    if split == "eval" and several_held_out_files(data):
        data = dataclasses.replace(data, num_eval=num_prompts or data.num_eval)
        files = held_out_files(data, prompt_key=data.prompt_key, answer_field=data.answer_key)
        short = next(((path, len(rows)) for path, rows in files if len(rows) < num_prompts), None)
        if short is not None:
            raise ConfigError(
                f"--num-prompts {num_prompts} (each held-out file's): {short[0]} has only {short[1]} rows: pass at "
                f"most {short[1]}"
            )
        return build_splits(data)[1], source_names(files)
    if split == "eval" and num_prompts > data.num_eval:  # build_splits keeps data.num_eval held-out rows
        data = dataclasses.replace(data, num_eval=num_prompts)
    train, held_out = build_splits(data)
    rows = held_out if split == "eval" else train
    if not rows and split == "eval":
        raise DataError(
            "areno eval: the config has no held-out rows: set data.eval_path (a JSON-lines file) or data.num_eval "
            "(a shipped task's), or pass --split train"
        )
    if num_prompts > len(rows):  # build_splits refuses an empty training set
        source = data.eval_path if split == "eval" else data.train_path
        source = f"data.task {data.task}" if data.task is not None else source
        raise ConfigError(
            f"--num-prompts {num_prompts}: {source} has only {len(rows)} {split} rows: pass at most {len(rows)}"
        )
    return (rows[:num_prompts] if num_prompts else rows), []


def _check_generates(config: ArenoConfig, rows: list[dict[str, Any]]) -> None:
    """A ConfigError where a preference recipe's run (``trains_on_pairs``) would be scored by generating:
    its reward model does not generate, and its preference rows have no answer to score against."""
    recipe = resolve_recipe(config)
    if not trains_on_pairs(recipe):
        return
    logged = "the run logs its held-out pair accuracy as eval/accuracy (run_dir/metrics.jsonl)"
    if issubclass(recipe.policy_role.specialization_cls, RewardModelSpecialization):
        raise ConfigError(
            f"areno eval generates completions, but train.algorithm={recipe.name} exports a reward model, which "
            f"does not generate: {logged}"
        )
    key = config.data.answer_key
    bad = next((i for i, row in enumerate(rows) if key not in row and all(k in row for k in PAIR_KEYS)), None)
    if bad is not None:
        raise ConfigError(
            f"areno eval scores the policy's completions against answers, but row {bad} of the rows to score is a "
            f"preference pair (no {key!r}): point data.eval_path at prompt/answer rows; {logged}"
        )


def default_rows_file(
    config: ArenoConfig, name: str, params: SamplingParams, samples: int, options: EvalOptions, num_rows: int
) -> Path:
    """``run_dir/eval/<name>.jsonl``, the split, row count (``num_rows``, those scored), sample count,
    temperature and seed in the name when they are not the greedy held-out default, so evaluations of
    one checkpoint under other settings do not overwrite each other."""
    parts = [name] + ([options.split] if options.split != "eval" else [])
    parts += [f"p{num_rows}"] if options.num_prompts else []
    if params.temperature > 0:
        parts += [f"n{samples}", f"t{params.temperature:g}"]
        parts += [f"s{options.seed}"] if options.seed is not None else []
    return Path(config.run_dir) / "eval" / ("-".join(parts) + ".jsonl")


def _check_writable(path: Path) -> None:
    """``path``'s directory made and writable, before any model loads (a ConfigError otherwise)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        probe = path.with_name(path.name + ".probe")
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(
            f"--out: cannot write {path} ({exc.strerror or exc}): name a writable file (default: under run_dir/eval)"
        ) from None


def _rollout_side(config: ArenoConfig, model_dir: Path, out_dir: Path, checkpoint: str | None) -> RolloutSide:
    if config.rollout.backend == "areno":
        device = resolve_device(config.cluster.device)
        apply_host_settings(config.cluster, device.type)
        return LocalRolloutSide(config, device)
    if config.rollout.servers and checkpoint is not None:
        raise ConfigError(
            "--checkpoint: rollout.servers are servers you run, which serve their own weights: evaluate "
            f"{model_dir} by starting them from it, or leave rollout.servers empty so that areno starts them"
        )
    return ServerRolloutSide(config, out_dir)


def run_eval(
    config: ArenoConfig, options: EvalOptions, *, on_progress: Callable[[int, int, float], None] | None = None
) -> dict[str, Any]:
    """Evaluate what ``options`` names under ``config``; writes the rows file and its summary and
    returns the summary (``metrics``, ``model``, ``rows_file``). ``on_progress(done, total,
    accuracy so far)``: called as rows finish (default: a log line every ``PROGRESS_EVERY_S``)."""
    samples = config.train.eval_samples if options.samples is None else options.samples
    temperature = config.train.eval_temperature if options.temperature is None else options.temperature
    threshold = config.train.eval_pass_threshold if options.pass_threshold is None else options.pass_threshold
    params = eval_params(config, samples, temperature, name="--samples")
    if options.seed is not None and params.temperature == 0:
        raise ConfigError(
            "--seed: a greedy evaluation draws nothing: drop --seed, or sample (--samples, --temperature)"
        )
    base_seed = config.train.seed if options.seed is None else options.seed
    # several held-out files: each one's figures too, over the rows kept of it
    rows, sources = _rows_and_sources(config, options.split, options.num_prompts)
    _check_generates(config, rows)
    if params.temperature > 0:
        check_eval_seeds(base_seed, len(rows), samples, name="--seed" if options.seed is not None else "train.seed")
    if options.out:  # before the default model directory may be made from model.init_tiny
        _check_writable(Path(options.out))
    model_dir, name = resolve_checkpoint(options.checkpoint, config)
    out = Path(options.out) if options.out else default_rows_file(config, name, params, samples, options, len(rows))
    if not options.out:
        _check_writable(out)
    side = _rollout_side(config, model_dir, out.parent, options.checkpoint)
    reward_fn = load_reward(config.reward)  # an import error before any model loads
    started = False
    try:
        start_reward(reward_fn)
        tokenizer = load_tokenizer(model_dir)
        vision = read_config(model_dir).vision
        vision = VisionConfig.from_hf(vision) if vision is not None else None
        logger.info("evaluating %s on %d %s rows x %d samples", model_dir, len(rows), options.split, samples)
        t_load = time.perf_counter()
        started = True  # a side that failed half-way started shuts down what it started
        side.start(SideSetup(recipe=resolve_recipe(config), model_dir=model_dir, tokenizer=tokenizer))
        load_s = time.perf_counter() - t_load
        progress = on_progress or _log_progress()
        reward_sum = 0.0

        def on_row(done: int, trajectories: list[Trajectory]) -> None:
            nonlocal reward_sum
            reward_sum += sum(t.reward for t in trajectories)
            progress(done, len(rows), reward_sum / (done * samples))

        check_reward_started(reward_fn)  # a sandbox worker that cannot import it: named before generating
        t0 = time.perf_counter()
        with held_burst(side) as client:  # batches as the run's own evaluation forms them
            scored = asyncio.run(
                ascore_rows(
                    client,
                    tokenizer,
                    reward_fn,
                    rows,
                    config,
                    params,
                    vision,
                    samples=samples,
                    base_seed=base_seed,
                    on_row=on_row,
                )
            )
        elapsed = time.perf_counter() - t0
    finally:
        if started:
            side.shutdown()
        release_reward(reward_fn)
    # after the rollout engine is gone: the reward models load on the device it had
    model_metrics = _add_model_scores(config, model_dir, scored)
    metrics = eval_metrics([[t.reward for t in ts] for ts in scored], scored, threshold, sources) | model_metrics
    metrics["eval/load_s"] = load_s
    metrics["eval/time_s"] = elapsed
    metrics["eval/completion_tokens_per_s"] = sum(len(t.completion_ids) for ts in scored for t in ts) / elapsed
    summary = {
        "model": str(model_dir),
        "split": options.split,
        "samples": samples,
        "temperature": params.temperature,
        "pass_threshold": threshold,
        "rows_file": str(out),
        "metrics": metrics,
    }
    _write(out, rows, scored, config, summary)
    return summary


def _add_model_scores(config: ArenoConfig, model_dir: Path, scored: list[list[Trajectory]]) -> dict[str, float]:
    """``scoring.add_model_scores`` with ``reward.model`` loaded here (a training backend of the frozen role on
    ``cluster.device``, released after): the rewards as the run's own held-out evaluation gives them."""
    recipe = resolve_recipe(config)
    if not recipe.reward_syncs:
        return {}
    backends = reward_model_backends(config, recipe, model_dir, resolve_device(config.cluster.device))
    try:
        return add_model_scores(scored, recipe.reward_syncs, lambda batch: reward_model_scores(recipe, backends, batch))
    finally:
        for backend in backends.values():
            backend.shutdown()


def _log_progress() -> Callable[[int, int, float], None]:
    """A progress line every ``PROGRESS_EVERY_S`` and at the end."""
    last = time.perf_counter()

    def log(done: int, total: int, accuracy: float) -> None:
        nonlocal last
        if time.perf_counter() - last >= PROGRESS_EVERY_S or done == total:
            last = time.perf_counter()
            logger.info("eval: %d/%d rows, accuracy so far %.4f", done, total, accuracy)

    return log


def _write(out: Path, rows: list[dict], scored: list[list[Trajectory]], config: ArenoConfig, summary: dict) -> None:
    """The rows file (one JSON object a row: prompt, answer, completions, rewards, finish reasons, where
    any the reward's named figures, e.g. each score of a ``reward.fn`` list, and reward errors) and ``<stem>.summary.json``, each written whole and renamed into place (in the
    directory ``_check_writable`` made)."""
    answer_key = config.data.answer_key
    lines = []
    for row, trajectories in zip(rows, scored, strict=True):
        record = {
            "prompt": row[config.data.prompt_key],
            "answer": row.get(answer_key),
            "completions": [t.info["completion"] for t in trajectories],
            "rewards": [t.reward for t in trajectories],
            "finish_reasons": [t.info["finish_reason"] for t in trajectories],
        }
        # a reward.fn list's functions' own scores (and any function's named figures), per completion
        figures = [t.info.get(REWARD_FIGURES_KEY, {}) for t in trajectories]
        if any(figures):
            record["reward_figures"] = figures
        model_scores = [t.info.get(MODEL_SCORE_INFO_KEY) for t in trajectories]
        if any(score is not None for score in model_scores):  # reward.model's own score, unweighted
            record["reward_model_scores"] = model_scores
        errors = [t.info.get("reward_error") for t in trajectories]
        if any(errors):
            record["reward_errors"] = errors
        lines.append(json.dumps(record, default=str))
    _write_text(out, "\n".join(lines) + "\n")
    _write_text(summary_path(out), json.dumps(summary, indent=2) + "\n")


def summary_path(rows_file: Path) -> Path:
    return rows_file.with_name(rows_file.stem + ".summary.json")


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
