"""Test rollout: background evaluation on its own engine, fed from checkpoints on disk (seed 003).

``TestRolloutManager`` runs a daemon thread that scans ``checkpoint_dir`` for the newest
*completed* checkpoint — ``step_XXXXXXXX/`` holding the ``COMPLETE`` marker, which the trainer
writes last — hot-loads its weights into a separate rollout engine with
``update_weights_from_disk(path, version=step)``, evaluates held-out samples with a workflow, and
publishes metrics tagged with that checkpoint's step. It never joins the training process groups
and the trainer never waits for it: results are picked up with ``pop_results()`` (non-blocking)
or an ``on_metrics`` callback. A directory without ``COMPLETE`` is never read, so a checkpoint
that is still being written is never loaded. A checkpoint that cannot be loaded (truncated or
missing weights) is logged once by step and skipped (``failed_steps``); an evaluation that raises is
logged; neither stops the thread.

``start_test_rollout`` builds it from a run's config (the ``test_rollout`` section): its own
in-process rollout engine, the held-out rows, the run's reward and the scoring of
``ArenoEngine.evaluate`` (``engine/scoring.py``: greedy, or ``train.eval_samples`` seeded samples a
row with their pass@k, logged as ``test/pass@k``). The trainer publishes a checkpoint every
``test_rollout.interval`` steps, logs ``test_metrics`` of each evaluation when it arrives and, at
the end of the run, waits for the last checkpoint's evaluation (``wait_for``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from areno.data.datasets import build_splits
from areno.engine.api import (
    load_tokenizer,
    prepare_model_dir,
    resolve_device,
    resolve_recipe,
    reward_model_backends,
)
from areno.engine.config import ArenoConfig
from areno.engine.executor import WorkflowExecutor
from areno.engine.local import LocalRolloutSide
from areno.engine.scoring import add_model_scores, ascore_samples, eval_metrics, eval_params
from areno.engine.seams import SideSetup
from areno.errors import ConfigError
from areno.models.checkpoint_dirs import newest_complete
from areno.models.hf_io import read_config
from areno.models.vision import VisionConfig
from areno.recipes.runner import reward_model_scores
from areno.rewards.loader import check_reward_started, load_reward, release_reward, start_reward
from areno.rollout.client import RolloutClient
from areno.types import SamplingParams, Trajectory
from areno.workflows.base import RolloutWorkflow
from areno.workflows.common import reward_figure_means

logger = logging.getLogger("areno.engine.test_rollout")


class HotLoadable(Protocol):
    def update_weights_from_disk(self, path: str, version: int) -> None: ...


def latest_completed_checkpoint(checkpoint_dir: str | Path) -> tuple[int, Path] | None:
    return newest_complete(checkpoint_dir)


class TestRolloutManager:
    """Evaluates the newest completed checkpoint in the background; see the module docstring."""

    __test__ = False  # not a pytest test class

    def __init__(
        self,
        checkpoint_dir: str | Path,
        engine: HotLoadable,
        client: RolloutClient,
        workflow: RolloutWorkflow,
        eval_samples: list[dict[str, Any]],
        *,
        weights_subdir: str = "hf",
        poll_interval_s: float = 5.0,
        on_metrics: Callable[[int, dict[str, float]], None] | None = None,
        pass_threshold: float | None = None,
        score_rewards: Callable[[list[Trajectory]], dict[str, float]] | None = None,
    ) -> None:
        """
        Args:
            checkpoint_dir: directory holding ``step_XXXXXXXX/`` checkpoints.
            engine: the evaluation rollout engine (its own devices or process), hot-loaded by path.
            client: a ``RolloutClient`` that generates with ``engine``.
            workflow: how an eval sample is run and scored (e.g. greedy ``RLVRWorkflow``, n=1).
            eval_samples: held-out rows.
            weights_subdir: where the Hugging Face safetensors live inside a checkpoint ("" = the
                step directory itself).
            poll_interval_s: seconds between scans.
            on_metrics: called from the daemon thread with ``(step, metrics)`` after each evaluation.
            pass_threshold: also report ``eval/pass@k`` over each sample's group of trajectories (a
                trajectory solves its row at this reward or above); None: the mean reward only.
            score_rewards: adds what the run's reward model scores to each evaluated trajectory's reward (in
                place) and returns its figures (``eval/reward_model/*``); None: the reward function's alone.
        """
        if not eval_samples:
            raise ValueError("test rollout needs at least one held-out sample (eval_samples is empty)")
        if poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s must be > 0, got {poll_interval_s}")
        self.checkpoint_dir = Path(checkpoint_dir)
        self.engine = engine
        self.eval_samples = list(eval_samples)
        self.weights_subdir = weights_subdir
        self.poll_interval_s = poll_interval_s
        self.on_metrics = on_metrics
        self.pass_threshold = pass_threshold
        self.score_rewards = score_rewards
        self.last_step: int | None = None
        self.evaluated_step: int | None = None
        """The newest checkpoint step whose evaluation finished (``last_step`` is set when it loads)."""
        self._executor = WorkflowExecutor(client, workflow)
        self._results: list[tuple[int, dict[str, float]]] = []
        self._results_lock = threading.Lock()
        self._failed_steps: set[int] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._done = threading.Condition()  # notified after each checkpoint is evaluated or skipped
        self.on_stop: Callable[[], None] | None = None
        """Called by ``stop()`` after the thread ends (e.g. shut the evaluation engine down)."""

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="areno-test-rollout", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._executor.stop()
        if self.on_stop is not None:
            self.on_stop()

    def wait_for(self, step: int, timeout_s: float) -> bool:
        """Wait until checkpoint ``step`` (or a newer one) is evaluated or skipped as unloadable;
        False when ``timeout_s`` passes first."""

        def done() -> bool:
            evaluated = self.evaluated_step is not None and self.evaluated_step >= step
            return evaluated or any(s >= step for s in self._failed_steps)

        with self._done:
            return self._done.wait_for(done, timeout=timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception:
                logger.exception(
                    "test rollout: evaluating checkpoint step %s failed; waiting for the next one", self.last_step
                )
            with self._done:
                self._done.notify_all()
            self._stop.wait(self.poll_interval_s)

    @property
    def failed_steps(self) -> list[int]:
        """Checkpoint steps that could not be loaded (each reported once, then skipped for good)."""
        return sorted(self._failed_steps)

    # ------------------------------------------------------------------ work
    def poll_once(self) -> dict[str, float] | None:
        """Load and evaluate the newest completed checkpoint if it is new; its metrics, or None."""
        latest = latest_completed_checkpoint(self.checkpoint_dir)
        if latest is None:
            return None
        step, path = latest
        if (self.last_step is not None and step <= self.last_step) or step in self._failed_steps:
            return None
        weights = path / self.weights_subdir if self.weights_subdir else path
        t0 = time.perf_counter()
        try:
            self.engine.update_weights_from_disk(str(weights), version=step)
        except Exception as exc:  # noqa: BLE001 - a bad checkpoint: reported once, skipped, training goes on
            self._failed_steps.add(step)
            logger.error(
                "test rollout: cannot load checkpoint step %d at %s (%s: %s); skipping it, the eval "
                "engine keeps its previous weights",
                step,
                weights,
                type(exc).__name__,
                exc,
            )
            return None
        load_s = time.perf_counter() - t0
        self.last_step = step
        metrics = self._evaluate()
        metrics.update({"eval/checkpoint_step": float(step), "eval/load_s": load_s})
        with self._results_lock:
            self._results.append((step, metrics))
        self.evaluated_step = step
        if self.on_metrics is not None:
            self.on_metrics(step, metrics)
        return metrics

    def _evaluate(self) -> dict[str, float]:
        t0 = time.perf_counter()
        trajectories = self._executor.rollout_batch(self.eval_samples)
        model_metrics = self.score_rewards(trajectories) if self.score_rewards is not None else {}
        rewards = [t.reward for t in trajectories]
        metrics = {
            **model_metrics,
            "eval/reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
            "eval/num_trajectories": float(len(trajectories)),
            "eval/reward_errors": float(sum("reward_error" in t.info for t in trajectories)),
            **reward_figure_means(trajectories, "eval/reward"),
        }
        groups: dict[str, list[Trajectory]] = {}
        for t in trajectories:
            groups.setdefault(t.group_id, []).append(t)
        sizes = {len(g) for g in groups.values()}
        if self.pass_threshold is not None and len(sizes) == 1:  # every row's samples came back
            by_row = list(groups.values())
            scored = eval_metrics([[t.reward for t in g] for g in by_row], by_row, self.pass_threshold)
            metrics.update({k: v for k, v in scored.items() if k.startswith("eval/pass@")})
        metrics["eval/num_rows"] = float(len(groups))  # the rows that came back, also where some lost samples
        return {**metrics, "eval/time_s": time.perf_counter() - t0}

    def pop_results(self) -> list[tuple[int, dict[str, float]]]:
        """Every ``(checkpoint_step, metrics)`` finished since the last call (never blocks on eval)."""
        with self._results_lock:
            out, self._results = self._results, []
        return out


EVAL_ROW_KEY = "_areno_eval_row"
"""The held-out row's index, which ``start_test_rollout`` adds to each row (``EvalWorkflow`` takes it
off before the row is rendered or rewarded): the row's sampled requests are seeded from it."""


class EvalWorkflow(RolloutWorkflow):
    """A held-out row's ``samples`` completions (greedy: one), scored and seeded as
    ``ArenoEngine.evaluate`` scores and seeds them (``scoring.ascore_samples``)."""

    def __init__(
        self,
        tokenizer,
        reward_fn,
        config: ArenoConfig,
        params: SamplingParams,
        vision: Any = None,
        *,
        samples: int = 1,
        base_seed: int = 0,
    ) -> None:
        """``vision``: a vision-language model's ``VisionConfig`` (held-out rows with images)."""
        self.tokenizer = tokenizer
        self.vision = vision
        self.reward_fn = reward_fn
        self.config = config
        self.params = params
        self.samples, self.base_seed = samples, base_seed

    async def run_episode(self, client: RolloutClient, sample: dict[str, Any]) -> list[Trajectory]:
        row = {k: v for k, v in sample.items() if k != EVAL_ROW_KEY}
        return await ascore_samples(
            client,
            self.tokenizer,
            self.reward_fn,
            row,
            self.config,
            self.params,
            self.vision,
            index=sample.get(EVAL_ROW_KEY, 0),
            samples=self.samples,
            base_seed=self.base_seed,
        )


POLL_INTERVAL_S = 0.5
"""Seconds between the test rollout's scans of run_dir/checkpoints."""


def start_test_rollout(
    config: ArenoConfig,
    run_dir: str | Path,
    *,
    after_step: int | None = None,
    reserve: Callable[[torch.device], int] = lambda device: 0,
) -> TestRolloutManager:
    """The running test rollout of a colocated run (``config.test_rollout``, see the module doc): a
    rollout engine of its own on ``test_rollout.device``, started from ``model.path`` and hot-loaded
    from each checkpoint's ``hf/`` export, scoring the held-out rows with the run's reward as the
    run's evaluation does (greedy, or ``train.eval_samples`` seeded samples with their pass@k).
    ``after_step``: checkpoints up to it are not evaluated (a resumed run's were, before it stopped).
    ``reserve``: the device bytes the run's training will still take on a device (``Backend.device_bytes_to_come``),
    which the engine's automatic KV pool leaves free."""
    section = config.test_rollout
    device = resolve_device(config.cluster.device if section.device == "auto" else section.device)
    _, eval_rows = build_splits(config.data)
    if section.num_prompts:
        eval_rows = eval_rows[: section.num_prompts]
    if not eval_rows:
        raise ConfigError(
            "test_rollout.enabled: there are no held-out rows to evaluate: set data.num_eval > 0 (or data.eval_path)"
        )
    reward_fn = load_reward(config.reward)
    side = LocalRolloutSide(config, device)
    recipe = resolve_recipe(config)
    scorers: dict = {}
    try:
        start_reward(reward_fn)
        model_dir = prepare_model_dir(config)
        tokenizer = load_tokenizer(model_dir)
        check_reward_started(reward_fn)  # a sandbox worker that cannot import it: named before an engine starts
        if recipe.reward_syncs:  # loaded before the engine, whose KV pool then leaves them room
            scorers = reward_model_backends(config, recipe, model_dir, device)
        setup = SideSetup(
            recipe=recipe,
            model_dir=model_dir,
            tokenizer=tokenizer,
            device_bytes_reserved=reserve(device),
        )
        side.start(setup)
    except BaseException:
        side.shutdown()  # what it started (nothing before its start)
        _release(scorers)
        release_reward(reward_fn)
        raise
    vision = read_config(model_dir).vision
    samples = config.train.eval_samples
    workflow = EvalWorkflow(
        tokenizer,
        reward_fn,
        config,
        eval_params(config, samples, config.train.eval_temperature, name="train.eval_samples"),
        VisionConfig.from_hf(vision) if vision is not None else None,
        samples=samples,
        base_seed=config.train.seed,
    )
    rows = [{**row, EVAL_ROW_KEY: i} for i, row in enumerate(eval_rows)]
    manager = TestRolloutManager(
        Path(run_dir) / "checkpoints",
        side.engine,
        side.client,
        workflow,
        rows,
        poll_interval_s=POLL_INTERVAL_S,
        pass_threshold=config.train.eval_pass_threshold,
        score_rewards=(
            (lambda ts: add_model_scores([ts], recipe.reward_syncs, lambda b: reward_model_scores(recipe, scorers, b)))
            if scorers
            else None
        ),
    )

    def close() -> None:
        side.shutdown()
        _release(scorers)
        release_reward(reward_fn)

    manager.on_stop = close
    manager.last_step = manager.evaluated_step = after_step
    manager.start()
    return manager


def _release(backends: dict) -> None:
    for backend in backends.values():
        backend.shutdown()


def test_metrics(step: int, metrics: dict[str, float]) -> dict[str, float]:
    """The trainer's ``test/*`` metrics of the evaluation of checkpoint ``step``."""
    passes = {
        f"test/{k[5:]}": v
        for k, v in metrics.items()
        if k.startswith(("eval/pass@", "eval/reward/", "eval/reward_model/"))
    }
    return {
        **passes,
        "test/accuracy": metrics["eval/reward_mean"],
        "test/num_prompts": metrics["eval/num_rows"],
        "test/reward_errors": metrics["eval/reward_errors"],
        "test/load_s": metrics["eval/load_s"],
        "test/time_s": metrics["eval/time_s"],
        "test/step": float(step),
    }


test_metrics.__test__ = False  # not a pytest test function
