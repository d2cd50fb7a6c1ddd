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
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from areno.engine.executor import WorkflowExecutor
from areno.rollout.client import RolloutClient
from areno.train.checkpoint import complete_checkpoints
from areno.workflows.base import RolloutWorkflow

logger = logging.getLogger("areno.engine.test_rollout")


class HotLoadable(Protocol):
    def update_weights_from_disk(self, path: str, version: int) -> None: ...


def latest_completed_checkpoint(checkpoint_dir: str | Path) -> tuple[int, Path] | None:
    done = complete_checkpoints(checkpoint_dir)
    return done[-1] if done else None


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
        self.last_step: int | None = None
        self._executor = WorkflowExecutor(client, workflow)
        self._results: list[tuple[int, dict[str, float]]] = []
        self._results_lock = threading.Lock()
        self._failed_steps: set[int] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

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

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception:
                logger.exception(
                    "test rollout: evaluating checkpoint step %s failed; waiting for the next one", self.last_step
                )
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
        if self.on_metrics is not None:
            self.on_metrics(step, metrics)
        return metrics

    def _evaluate(self) -> dict[str, float]:
        t0 = time.perf_counter()
        trajectories = self._executor.rollout_batch(self.eval_samples)
        rewards = [t.reward for t in trajectories]
        return {
            "eval/reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
            "eval/num_trajectories": float(len(trajectories)),
            "eval/reward_errors": float(sum("reward_error" in t.info for t in trajectories)),
            "eval/time_s": time.perf_counter() - t0,
        }

    def pop_results(self) -> list[tuple[int, dict[str, float]]]:
        """Every ``(checkpoint_step, metrics)`` finished since the last call (never blocks on eval)."""
        with self._results_lock:
            out, self._results = self._results, []
        return out
