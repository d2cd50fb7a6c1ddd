"""Trainer: the public coordinator (seed 000) and the outer loop of seed 004.

    for rollout_id in range(start, steps):
        rollout = backend.rollout_batch(rollout_id)
        for pass_idx in range(num_train_passes):        # passes after the first reshuffle
            train(rollout_id, rollout or reshuffle(rollout, base + rollout_id + pass_idx * 100003))
        backend.update_weights()                         # sync_to_rollout roles -> rollout engine
        evaluate / save at their intervals

``run()`` again (in a notebook, after raising ``config.train.steps``) goes on from the step reached, as
the same loop would have: the data order, the step numbers, the checkpoints and the learning-rate
schedule are those of one longer run. Settings other than ``train.steps``, ``train.eval_interval`` and
``train.save_interval`` are those the Trainer was built with: a change is refused (``_check_runnable``).

Resume (``resume=auto|true``): the newest ``checkpoints/step_N`` holding ``COMPLETE`` whose files
match their checksums is loaded (checkpoints are published by one rename, so a killed write is
never loaded; its staging directory is removed with a warning; a damaged one is passed over with a
warning naming the file) and the loop continues at step N + 1. metrics.jsonl is cut
back to the rows of steps <= N first: the steps after N are trained again and log again, so the
file holds every step once. ``ARENO_FAULT`` (``areno.faults``) kills the run at a phase of a
step, for the tests that prove it.
"""

from __future__ import annotations

import faulthandler
import gc
import json
import logging
import math
import os
import signal
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any, ClassVar

import torch
import yaml

from areno.api.backend.base import Backend, RolloutBatch, resolve_backend
from areno.api.config import ArenoConfig, checked_config, flat_settings, to_dict, to_yaml
from areno.api.preflight import check_resumed_config, check_run
from areno.api.rundir import RunDirLock, clear_run, set_aside_untrained
from areno.engine.api import check_init_tiny_target
from areno.engine.host import thaw_heap
from areno.engine.partitioned import NO_CHECKPOINT_YET, RESUME_FROM_CHECKPOINT
from areno.engine.test_rollout import TestRolloutManager, start_test_rollout, test_metrics
from areno.errors import ConfigError, RunFailure, RunStopped
from areno.faults import fault_point
from areno.launch.scheduler import kill_local_workers, signal_local_workers
from areno.observe.metrics import (
    METRICS_FILENAME,
    WANDB_ID_FILENAME,
    ConsoleSink,
    MetricsLogger,
    MetricsWriteError,
    WandbConfig,
    resolve_wandb_mode,
)
from areno.observe.profile import profiled_step, profiles_missed
from areno.observe.session import configure_sessions
from areno.observe.startup import startup_to_first_token_s
from areno.observe.trace import configure_tracing, flush_tracing, merge_traces, span
from areno.rewards.combined import part_names
from areno.train import checkpoint
from areno.train.config import DECAYING_SCHEDULES

logger = logging.getLogger(__name__)

CHANGEABLE_BETWEEN_RUNS = ("train.steps", "train.eval_interval", "train.save_interval")
"""The settings a Trainer reads afresh at each ``run()``; the others built its engine, and a change of
one between two ``run()`` calls is refused rather than half taken."""

PASS_SEED_STRIDE = 100003  # prime stride: pass seeds of different rollouts never collide early


def pass_seed(base: int, rollout_id: int, pass_idx: int) -> int:
    """Seed of the reshuffle before pass ``pass_idx`` of rollout ``rollout_id`` (seed 004)."""
    return base + rollout_id + pass_idx * PASS_SEED_STRIDE


def reshuffle(rollout: RolloutBatch, seed: int) -> RolloutBatch:
    """The same sequences in a new order drawn from ``seed``: a later pass over ``rollout``
    (``pass_order`` = the order, relative to the rollout as generated)."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(rollout.batch.num_seqs, generator=gen).tolist()
    base = rollout.pass_order or list(range(rollout.batch.num_seqs))
    return RolloutBatch(
        trajectories=[rollout.trajectories[i] for i in order],
        batch=rollout.batch.select(order),
        metrics=rollout.metrics,
        pass_order=[base[i] for i in order],
    )


class Trainer:
    """Resolves the backend, runs the loop, writes the run directory. ``Trainer.init(config)`` and
    ``Trainer(config)`` are the same: the run directory locked, the config checked, the engine built.
    :meth:`run` trains to ``config.train.steps`` (called again, it goes on from the step reached);
    :meth:`shutdown` releases it all (a second call does nothing)."""

    _live: ClassVar[weakref.WeakValueDictionary[Path, Trainer]] = weakref.WeakValueDictionary()
    """The Trainers of this process not shut down, by resolved run directory: one per directory."""

    config: ArenoConfig
    run_dir: Path
    lock: RunDirLock
    backend: Backend
    logger: MetricsLogger
    start_rollout_id: int = 0
    """The rollout id of the next step to train (the steps done): the resumed checkpoint's step, then
    the step each ``run()`` reached."""
    test_rollout: TestRolloutManager | None = None
    """The background test rollout (``config.test_rollout.enabled``)."""
    save_on_stop: bool = True
    """A run stopped by a signal saves its step's checkpoint (False: a stage that starts over anyway)."""
    stopped_by: int | None = None
    """The signal that arrived during the last step (the run then ended as it would have): the caller's
    next stage should not start."""
    stage: str | None = None
    """The console's label of this run's steps when it is one stage of several (``"warm start"``)."""

    def __init__(self, config: ArenoConfig, *, stage: str | None = None, warm_start_by_caller: bool = False) -> None:
        """See :meth:`init`."""
        config = checked_config(config, caller="Trainer.init")
        self.config = config
        self.run_dir = Path(config.run_dir)
        self.stage = stage
        self._shut_down = False
        self._failed: str | None = None  # what a run() that raised mid-step left (no run() goes on from it)
        self._ran = False
        self._check_not_live()
        if config.warm_start.steps > 0 and not warm_start_by_caller:
            logger.warning(
                "warm_start.steps=%d: a Trainer trains train.algorithm alone, without the warm start; "
                "areno.api.pipeline.run_pipeline(config) runs both (as areno train does), or set warm_start.steps=0",
                config.warm_start.steps,
            )
        backend_cls = resolve_backend(config.train.backend)
        dump_stacks_on_usr1()
        self.lock = RunDirLock(config.run_dir).acquire()
        try:
            check_run(config)
            check_resumed_config(config)
            check_init_tiny_target(config)  # before _initialize writes run_dir (overwrite may clear it)
            self._initialize(backend_cls)
        except BaseException as exc:
            self._stop_partial_backend()
            self.lock.release()
            if isinstance(exc, KeyboardInterrupt):
                last = checkpoint.latest_complete(self.run_dir / "checkpoints")
                then = f"resume=auto goes on from {last}" if last is not None else "the same command starts it again"
                print(
                    f"areno: interrupted during start-up, before any step: nothing was trained and no checkpoint "
                    f"was written; {then}",
                    file=sys.stderr,
                    flush=True,
                )
            raise
        self._built_with = flat_settings(to_dict(config))  # what the engine was built from (_check_runnable)
        self._written = self._built_with  # what run_dir/config.yaml says
        Trainer._live[self.run_dir.resolve()] = self

    def _stop_partial_backend(self) -> None:
        """The workers and threads of a backend whose start-up failed or was interrupted (best effort)."""
        backend = getattr(self, "backend", None)
        if backend is None:
            return
        try:
            backend.shutdown()
        except Exception as exc:  # noqa: BLE001 - half built: what it started is stopped as far as it goes
            logger.warning("shutting down a backend whose start-up failed: %s", exc)

    @classmethod
    def init(cls, config: ArenoConfig, *, stage: str | None = None, warm_start_by_caller: bool = False) -> Trainer:
        """Resolve the registered backend named by ``config.train.backend`` and initialise it. ``config``
        is an :class:`ArenoConfig` (``load_config(path, overrides)`` reads a YAML file into one), checked
        again as at construction and its paths made absolute (``config.checked_config``). The run
        directory is locked first (``rundir.RunDirLock``, released by :meth:`shutdown`; a second live
        Trainer on it in this process is refused), then what the config can be checked for is checked
        (``preflight.check_run``), before the run directory is written and any model is built.
        ``stage``: the console's label of the steps (``"warm start"``) when this run is one stage of
        several (``api/pipeline.py``). ``warm_start_by_caller``: the caller runs ``config.warm_start``
        (``run_pipeline``); otherwise ``warm_start.steps`` > 0 is warned about, since a Trainer does not."""
        return cls(config, stage=stage, warm_start_by_caller=warm_start_by_caller)

    def _check_not_live(self) -> None:
        """One Trainer per run directory in this process (``RunDirLock`` is re-entrant in a process, for
        the pipeline around its stages' Trainers): two would log into one metrics.jsonl."""
        other = Trainer._live.get(self.run_dir.resolve())
        if other is not None and not other._shut_down:
            raise ConfigError(
                f"run_dir {self.run_dir} is in use by another Trainer of this process that is not shut down: "
                "call its shutdown() first, or use another run_dir"
            )

    def _initialize(self, backend_cls: type[Backend]) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        resume_from = self._prepare_resume()  # before the logger opens metrics.jsonl for appending
        kept = self._write_config(resume_from)
        try:
            self._start(backend_cls, resume_from)
        except BaseException:
            if kept is not None:  # a resume that never ran: config.yaml still says what the run is
                os.replace(kept, self.run_dir / "config.yaml")
            raise

    def _start(self, backend_cls: type[Backend], resume_from: Path | None) -> None:
        """Build the backend and the metrics logger, then load the checkpoint a resumed run goes on from."""
        config = self.config
        observe = config.observe
        if resume_from is not None and (
            missed := profiles_missed(self.run_dir, observe.profile_steps, checkpoint_step(resume_from))
        ):
            logger.warning(
                "observe.profile_steps %s: trained before step %d, where this run resumes, so not profiled: "
                "name steps after it",
                missed,
                checkpoint_step(resume_from),
            )
        configure_tracing(self.run_dir, observe.trace)
        configure_sessions(self.run_dir, observe.sessions)
        # An earlier run of this process (a notebook's, one that raised before its shutdown) may have
        # frozen the heap (cluster.gc_freeze): its cycles become collectable again.
        thaw_heap()
        if config.cluster.device != "cpu" and torch.cuda.is_available():
            # An earlier run of this process may be unreachable but not yet collected (its engine holds
            # reference cycles): its device memory would shrink this run's KV pool and micro-batches.
            gc.collect()
            torch.cuda.empty_cache()
        self.backend = backend_cls()
        self.backend.initialize(config, self.run_dir)
        self.logger = MetricsLogger(
            self.run_dir,
            total_steps=config.train.steps,
            console=observe.console,
            tensorboard=observe.tensorboard,
            wandb=wandb_config(config, self.run_dir, resumed=resume_from is not None),
            stage=self.stage,
            start_step=checkpoint_step(resume_from) if resume_from is not None else 0,  # the bar resumes there
            # the steps after the checkpoint run again (metrics.jsonl is cut back alike); a run that
            # starts over (overwrite=true, no checkpoint yet) logs every step again
            purge_step=checkpoint_step(resume_from) + 1 if resume_from is not None else 0,
            reward_parts=part_names(config.reward.paths()) if config.reward.several() else (),
        )
        if resume_from is not None:
            self._resume(resume_from)
        if config.test_rollout.enabled:
            after = checkpoint_step(resume_from) if resume_from is not None else None
            self.test_rollout = start_test_rollout(
                config, self.run_dir, after_step=after, reserve=self.backend.device_bytes_to_come
            )

    def rollout_token_batch(self, rollout_id: int) -> RolloutBatch:
        return self.backend.rollout_batch(rollout_id)

    def train(self, rollout_id: int, rollout: RolloutBatch) -> dict[str, float]:
        return self.backend.train(rollout_id, rollout)

    def run(self) -> dict[str, float]:
        """The outer loop, from the step reached to ``config.train.steps``; returns the last evaluation
        metrics. Called again after raising ``config.train.steps``, it trains the steps after the one
        reached, as one longer run would have. A SIGINT or SIGTERM ends it after the step in progress,
        with that step's checkpoint saved (``RunStopped``; ``run()`` goes on from there); a second one
        stops at once."""
        if not self._check_runnable():
            return {}
        with StopSignals(self.run_dir / "checkpoints") as stop:
            try:
                metrics = self._run(stop)
            except RunStopped:  # at a step's end: the next run() goes on from there
                raise
            except BaseException as exc:
                self._failed = f"{type(exc).__name__} in step {self.start_rollout_id + 1}"
                if getattr(exc, "training_side_intact", False) and not stop.stopped_now:
                    raise self._after_emergency_save(exc) from exc
                raise
            finally:
                self._ran = True
            self.stopped_by = stop.signum
            return metrics

    def _check_open(self, what: str) -> None:
        if self._shut_down:
            raise RuntimeError(
                f"{what}: this Trainer of {self.run_dir} was shut down: make a new one with Trainer.init(config) "
                "(resume='auto' goes on from its last checkpoint)"
            )

    def _check_runnable(self) -> bool:
        """Before each ``run()``: the config holds values its checks pass and the settings the engine
        was built with (``CHANGEABLE_BETWEEN_RUNS`` aside), and ``train.steps`` reaches at least the step
        trained. False: nothing to train (said in one line). ``run_dir/config.yaml`` follows a change
        of ``train.steps`` or the intervals."""
        self._check_open("run()")
        if self._failed is not None:
            raise RuntimeError(
                f"run(): this Trainer's last run() stopped with {self._failed}, partway through it: shutdown() "
                "and make a new Trainer with resume='auto' (it goes on from the last checkpoint)"
            )
        config = self.config
        config.validate()
        now = flat_settings(to_dict(config))
        for key in sorted(set(now) | set(self._built_with)):
            if key not in CHANGEABLE_BETWEEN_RUNS and now.get(key) != self._built_with.get(key):
                raise ConfigError(
                    f"{key}: changed to {now.get(key)!r} since Trainer.init ({self._built_with.get(key)!r}), but the "
                    f"engine was built with it (only {', '.join(CHANGEABLE_BETWEEN_RUNS)} may change between run() "
                    "calls): shutdown() and make a new Trainer with the change and resume='auto'"
                )
        steps, built, reached = config.train.steps, self._built_with["train.steps"], self.start_rollout_id
        decaying = [k for k, v in now.items() if k.endswith(".schedule") and v in DECAYING_SCHEDULES]
        if steps != built and decaying:
            raise ConfigError(
                f"train.steps: {built} -> {steps}, but {decaying[0]}={now[decaying[0]]} decays over the steps the Trainer was "
                f"built with: shutdown() and make a new Trainer with train.steps={steps} and resume='auto' "
                "(its schedule decays over them)"
            )
        if steps < reached:
            raise ConfigError(
                f"train.steps={steps} but this Trainer already trained {self.run_dir} to step {reached}: set "
                f"train.steps above {reached} to train on"
            )
        if now != self._written:
            checkpoint_dir = self._checkpoint_dir(reached)
            self._write_config(checkpoint_dir if checkpoint_dir.is_dir() else None)
            self._written = now
            for sink in self.logger.sinks:  # the progress line's step/total
                if isinstance(sink, ConsoleSink):
                    sink.total_steps = steps
        if steps == reached and self._ran:
            print(
                f"areno: this Trainer already trained {self.run_dir} to train.steps={steps}: nothing to train; "
                "raise config.train.steps and call run() again to train on",
                flush=True,
            )
        return steps > reached

    def _run(self, stop: StopSignals) -> dict[str, float]:
        cfg = self.config.train
        last_eval: dict[str, float] = {}
        first = self.start_rollout_id
        for rollout_id in range(first, cfg.steps):
            t0 = time.perf_counter()
            step = rollout_id + 1
            # what the training side holds (an emergency checkpoint saves it): the steps trained, and the
            # metrics of one trained but not logged yet
            self._trained_to, self._unlogged = rollout_id, None
            with profiled_step(self.run_dir, step, self.config.observe.profile_steps):
                with span("rollout", "trainer", rollout_id=rollout_id):
                    rollout = self.rollout_token_batch(rollout_id)
                fault_point("rollout", step)
                t1 = time.perf_counter()
                train_metrics: dict[str, float] = {}
                for pass_idx in range(cfg.num_train_passes):
                    data = rollout if pass_idx == 0 else reshuffle(rollout, pass_seed(cfg.seed, rollout_id, pass_idx))
                    with span("train", "trainer", rollout_id=rollout_id, pass_idx=pass_idx):
                        # the last pass's figures, and what only the first reports (the pending policy sync's)
                        train_metrics = {**train_metrics, **self.train(rollout_id, data)}
                fault_point("train", step)
                t2 = time.perf_counter()
                self._trained_to = step
                self._unlogged = {
                    **rollout.metrics,
                    **train_metrics,
                    "timing/rollout_s": t1 - t0,
                    "timing/train_s": t2 - t1,
                }
                with span("policy_sync", "trainer", rollout_id=rollout_id):
                    sync_metrics = self.backend.update_weights()
                fault_point("policy_sync", step)
                t3 = time.perf_counter()
            timing = {
                "timing/rollout_s": t1 - t0,
                "timing/train_s": t2 - t1,
                "timing/sync_s": t3 - t2,
                "timing/tokens_per_s": rollout.batch.num_tokens / max(t3 - t0, 1e-9),
            }
            startup_s = startup_to_first_token_s()  # None when the rollout ran in other processes
            if rollout_id == first and not self._ran and startup_s is not None:  # this Trainer's first step
                timing["system/startup_to_first_token_s"] = startup_s
            self.logger.log({**rollout.metrics, **train_metrics, **sync_metrics, **timing}, step=step)
            self._unlogged = None
            evaluated = step == cfg.steps or bool(cfg.eval_interval and step % cfg.eval_interval == 0)
            if evaluated:
                last_eval = self._evaluate(step)
            signum = stop.signum  # read once: a signal arriving later in the step stops after the next one
            stopping = signum is not None and step < cfg.steps
            saving = step == cfg.steps or (cfg.save_interval and step % cfg.save_interval == 0) or self._test_due(step)
            if saving or (stopping and self.save_on_stop):
                with span("checkpoint", "trainer", step=step):
                    self.backend.save(self._checkpoint_dir(step), {"rollout_id": rollout_id})
                if not stopping and stop.signum is not None and step < cfg.steps:  # a signal during the save
                    stopping, signum = True, stop.signum  # this step's checkpoint is there: stop after it
                if evaluated:
                    self._note_best(step, last_eval)
            self._log_test_results()
            self.start_rollout_id = rollout_id + 1  # the step is done, its checkpoint (if any) saved
            if stopping:
                where = f"after step {step} of {cfg.steps} of {self.run_dir}"
                then = (
                    f"its checkpoint in {self._checkpoint_dir(step)}: go on with the same command and resume=auto"
                    if self.save_on_stop
                    else "this stage starts over when the run is started again"
                )
                raise RunStopped(f"stopped by {signal.Signals(signum).name} {where}; {then}", signum)
        self._finish_test_rollout(first)
        return last_eval

    def _after_emergency_save(self, exc: BaseException) -> BaseException:
        """``exc`` (a failure outside the training side: a rollout worker lost) told again after an emergency
        checkpoint of the step the training side holds, so ``resume=auto`` loses no trained step; or with
        the reason there is none. The checkpoint is that of the last step trained: a failure while that
        step's policy sync was in flight leaves the trained weights whole (a sync only reads them; one
        that failed publishes nothing: the resumed run publishes them), and its metrics, logged first,
        lack only the sync's figures. A training rank still inside the broken sync or save cannot take
        part in another save: then there is none (``RemoteTrainingSide.save`` checks)."""
        step = getattr(self, "_trained_to", self.start_rollout_id)
        path = self._checkpoint_dir(step)
        if step <= 0 or (path / checkpoint.COMPLETE_MARKER).is_file():
            return exc  # nothing trained, or the step's checkpoint is there: no trained step is lost
        try:
            unlogged = getattr(self, "_unlogged", None)
            if unlogged is not None:  # its sync failed: the step's row, so metrics.jsonl has every step
                self._unlogged = None
                try:
                    self.logger.log(unlogged, step=step)
                except MetricsWriteError as err:  # the metrics file is what failed: the weights still save
                    logger.warning("step %d's metrics row is not written: %s", step, err)
            logger.warning("emergency checkpoint of step %d (%s) into %s", step, _first_line(exc), path)
            with span("checkpoint", "trainer", step=step):
                self.backend.save(path, {"rollout_id": step - 1})
        except Exception as err:  # the run fails anyway: with its first cause, and this one said
            trace = None if isinstance(err, RunFailure) else err  # a bug's traceback; a failure's line
            logger.error("emergency checkpoint of step %d failed: %s", step, err, exc_info=trace)
            note = f"no emergency checkpoint of step {step}: {_first_line(err, with_type=False)}"
        else:
            note = (
                f"the training side was intact: saved an emergency checkpoint of step {step} ({path}), which "
                "resume=auto goes on from"
            )
            logger.warning("emergency checkpoint of step %d saved: %s", step, path)
        text = str(exc)
        if checkpoint.latest_complete(self.run_dir / "checkpoints") is not None:
            text = text.replace(NO_CHECKPOINT_YET, RESUME_FROM_CHECKPOINT)
        try:
            told = type(exc)(f"{text}; {note}")
        except Exception:  # noqa: BLE001 - an exception class built otherwise: the note goes to the log only
            return exc
        told.__dict__.update({k: v for k, v in vars(exc).items() if k not in told.__dict__})
        return told

    def _test_due(self, step: int) -> bool:
        """A checkpoint is published for the test rollout at this step (``test_rollout.interval``)."""
        return self.test_rollout is not None and step % self.config.test_rollout.interval == 0

    def _log_test_results(self) -> None:
        """Log the test rollout's finished evaluations (never waits), each at its checkpoint's step."""
        if self.test_rollout is None:
            return
        for ckpt_step, metrics in self.test_rollout.pop_results():
            self.logger.log(test_metrics(ckpt_step, metrics), step=ckpt_step)

    def _finish_test_rollout(self, first: int) -> None:
        """Wait (``test_rollout.final_timeout_s``) for the evaluation of the last checkpoint, log it
        (``first``: the rollout id this ``run()`` started at; one that trained nothing waits for none)."""
        if self.test_rollout is None or self.config.train.steps <= first:
            return
        timeout_s = self.config.test_rollout.final_timeout_s
        if not self.test_rollout.wait_for(self.config.train.steps, timeout_s):
            logger.warning(
                "test rollout: checkpoint step %d not evaluated within test_rollout.final_timeout_s=%g s; "
                "its test/* metrics are missing",
                self.config.train.steps,
                timeout_s,
            )
        self._log_test_results()

    @property
    def best_checkpoint(self) -> dict[str, Any] | None:
        """The best checkpoint by ``train.best_metric`` so far (``{"step", "path", "metric", "value", "mode"}``),
        or None: none set, or no step evaluated and saved yet."""
        return checkpoint.read_best(self.run_dir / "checkpoints") if self.config.train.best_metric else None

    def evaluate_now(self) -> dict[str, float]:
        """Evaluate the current policy and log it at the current step (the steps done)."""
        self._check_open("evaluate_now()")
        metrics = self._evaluate(self.start_rollout_id)
        self._check_best_metric(metrics)
        return metrics

    def shutdown(self) -> None:
        """Stop the engine and its workers, close the logs, release the run directory; a second call
        does nothing."""
        if self._shut_down:
            return
        self._shut_down = True
        try:
            if self.test_rollout is not None:
                self.test_rollout.stop()
            self.logger.close()
            self.backend.shutdown()
            if self.config.cluster.device != "cpu" and torch.cuda.is_initialized():
                # cuBLAS keeps a workspace per stream it ran on, outside any tensor: a finished run
                # gives them back (they come again, lazily, if this process runs more)
                clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
                if clear is not None:
                    clear()
            if self.config.observe.trace:
                flush_tracing()
                merge_traces(self.run_dir)
            # the run's tracing and session recording end with it: processes started later (a test's
            # workers, the next run's servers) neither trace nor record into this run directory
            configure_tracing(None, False)
            configure_sessions(None, False)
        finally:
            self.lock.release()
            Trainer._live.pop(self.run_dir.resolve(), None)

    def _evaluate(self, step: int) -> dict[str, float]:
        with span("evaluate", "trainer", step=step):
            metrics = self.backend.evaluate()
        if metrics:
            self.logger.log(metrics, step=step)
        return metrics

    def _check_best_metric(self, metrics: dict[str, float]) -> None:
        """A ConfigError where the evaluation logs no ``train.best_metric`` (said at step 0's evaluation, or
        after the step's checkpoint is saved: nothing is lost)."""
        key = self.config.train.best_metric
        if key is not None and metrics and key not in metrics:
            figures = ", ".join(k for k in sorted(metrics) if not k.endswith("_s"))
            raise ConfigError(f"train.best_metric={key}: this run's evaluation logs no such figure; it logs {figures}")

    def _note_best(self, step: int, metrics: dict[str, float]) -> None:
        """Step ``step``'s checkpoint becomes the best (``checkpoint.BEST_FILE``) where its evaluation's
        ``train.best_metric`` beats the best so far (a figure that is not finite never does)."""
        cfg = self.config.train
        self._check_best_metric(metrics)
        if cfg.best_metric is None or not metrics:
            return
        value = float(metrics[cfg.best_metric])
        checkpoints_dir = self.run_dir / "checkpoints"
        best = checkpoint.read_best(checkpoints_dir)
        if not math.isfinite(value) or not (self._checkpoint_dir(step) / checkpoint.COMPLETE_MARKER).is_file():
            return
        if best is not None and best["metric"] == cfg.best_metric and best["mode"] == cfg.best_mode:
            if not (value > best["value"] if cfg.best_mode == "max" else value < best["value"]):
                return
        path = self._checkpoint_dir(step)
        checkpoint.write_best(
            checkpoints_dir,
            {"step": step, "path": str(path), "metric": cfg.best_metric, "value": value, "mode": cfg.best_mode},
        )
        logger.info("best checkpoint: step %d, %s=%.4g (%s)", step, cfg.best_metric, value, path)

    def _checkpoint_dir(self, step: int) -> Path:
        return self.run_dir / "checkpoints" / f"step_{step:08d}"

    def _prepare_resume(self) -> Path | None:
        """The checkpoint to resume from under ``config.resume`` (None: start fresh): the newest one
        that verifies (``checkpoint.newest_intact``). Removes what killed checkpoint writes left and
        cuts metrics.jsonl back to the steps that will not run again: those <= N when resuming at
        step N, none when a resumable run starts over. ``resume=false`` reaches here only on an empty
        run_dir or with ``overwrite=true`` (``preflight.check_run``), which deletes the old run."""
        checkpoints_dir = self.run_dir / "checkpoints"
        if self.config.resume is False:
            if self.config.overwrite:
                clear_run(self.run_dir)
            else:  # a run that trained no step was there (preflight.check_run refuses any other)
                set_aside_untrained(self.run_dir)
            return None
        checkpoint.remove_stale(checkpoints_dir)
        latest = checkpoint.newest_intact(checkpoints_dir)  # resume=true: there is one (preflight.check_run)
        self._check_steps_left(latest)  # before metrics.jsonl is cut back or config.yaml rewritten
        truncate_metrics(self.run_dir / METRICS_FILENAME, after_step=checkpoint_step(latest) if latest else -1)
        return latest

    def _check_steps_left(self, resume_from: Path | None) -> None:
        """A resumed run has steps to train: ``train.steps`` below the checkpoint's step is a ConfigError;
        equal to it (the run had finished) is said in one line, and the run trains nothing."""
        if resume_from is None:
            return
        reached, steps = checkpoint_step(resume_from), self.config.train.steps
        if steps < reached:
            raise ConfigError(
                f"train.steps={steps} but the run in {self.run_dir} resumes from step {reached} ({resume_from}): "
                f"set train.steps above {reached} to train on, or start over (resume=false overwrite=true)"
            )
        if steps == reached:
            print(
                f"areno: {self.run_dir} already reached train.steps={steps} ({resume_from}): nothing to train; "
                "raise train.steps to train on",
                flush=True,
            )

    def _write_config(self, resume_from: Path | None) -> Path | None:
        """The resolved config as run_dir/config.yaml; a resumed run whose settings changed keeps the
        previous one beside it as ``config.until_step_N.yaml`` (``resume`` and ``overwrite`` say how
        a run starts, not what it is: a change of those alone keeps no copy), whose path it returns."""
        path, text = self.run_dir / "config.yaml", to_yaml(self.config)
        kept = None
        if resume_from is not None and path.is_file() and _settings(path.read_text()) != _settings(text):
            kept = path.with_name(f"config.until_{resume_from.name}.yaml")
            n = 1
            while kept.exists():  # resumed from this step before: keep every config it ran with
                kept, n = path.with_name(f"config.until_{resume_from.name}.{n}.yaml"), n + 1
            path.replace(kept)
        tmp = path.with_name(path.name + ".tmp")  # whole or absent: a resumed run refuses a torn one
        tmp.write_text(text)
        os.replace(tmp, path)
        return kept

    def _resume(self, path: Path) -> None:
        state = self.backend.load(path)
        self.start_rollout_id = int(state["rollout_id"]) + 1
        print(json.dumps({"resumed_from": str(path), "next_rollout_id": self.start_rollout_id}), flush=True)


def _first_line(exc: BaseException, *, with_type: bool = True) -> str:
    lines = str(exc).strip().splitlines()
    first = lines[0] if lines else ""
    return f"{type(exc).__name__}: {first}" if with_type else first


def dump_stacks_on_usr1() -> None:
    """``kill -USR1 <pid>`` of the controller writes every thread's stack to its stderr and passes the
    signal on to its local workers, which write theirs to their logs (``run_dir/workers``), as README
    says for a stalled worker; without it the signal's default action ended the run at once. A handler
    the program set already is left alone. Main thread only (where handlers are set)."""
    usr1 = getattr(signal, "SIGUSR1", None)
    if usr1 is None or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(usr1) not in (signal.SIG_DFL, _forward_usr1):
        return
    signal.signal(usr1, _forward_usr1)  # runs in the main thread once it runs Python again
    # the controller's own stacks at once, whatever its main thread is blocked in; then the handler above.
    # fd 2 itself: sys.stderr's fd may be a capture file (pytest, a notebook) closed and reused later
    faulthandler.register(usr1, file=2, all_threads=True, chain=True)


def _forward_usr1(signum: int, frame: Any) -> None:
    pids = signal_local_workers(signum)
    if pids:
        try:
            os.write(2, f"areno: SIGUSR1 passed to the workers {pids}: their stacks go to their logs\n".encode())
        except OSError:
            pass


class StopSignals:
    """While entered (in the main thread), the first SIGINT, SIGTERM or SIGHUP (a closed ssh session) is
    noted in ``signum``; a second one kills the local workers and then acts at once as it would have
    before (KeyboardInterrupt, or termination), after one line naming the checkpoint under
    ``checkpoints_dir`` that ``resume=auto`` goes on from."""

    SIGNALS = tuple(s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None)

    def __init__(self, checkpoints_dir: Path | None = None) -> None:
        self.signum: int | None = None
        self.checkpoints_dir = checkpoints_dir
        self.stopped_now = False
        """A second signal arrived: the run stops at once (no emergency checkpoint either)."""
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # only its handlers can be set
            # a SIGHUP ignored (nohup) stays ignored
            signals = [
                s for s in self.SIGNALS if s != getattr(signal, "SIGHUP", None) or signal.getsignal(s) != signal.SIG_IGN
            ]
            self._previous = {s: signal.signal(s, self._note) for s in signals}
        return self

    def _note(self, signum: int, frame: Any) -> None:
        self.signum = signum
        for s, handler in self._previous.items():  # an ignored signal stays ignored
            signal.signal(s, self._stop_now if handler == signal.SIG_DFL or callable(handler) else handler)
        # os.write: a print could re-enter a stderr write the signal interrupted (a RuntimeError)
        _say(f"areno: {signal.Signals(signum).name}: stopping after this step (send it again to stop now)\n")

    def _stop_now(self, signum: int, frame: Any) -> None:
        """The second signal: one line, then the previous handler's action (SIGTERM's default ends the
        process with its exit status and without a word of its own)."""
        self.stopped_now = True
        last = checkpoint.latest_complete(self.checkpoints_dir) if self.checkpoints_dir is not None else None
        then = f"goes on from {last}" if last is not None else "starts over (no checkpoint was saved)"
        _say(
            f"areno: stopped at once by a second {signal.Signals(signum).name}, without a checkpoint of the step "
            f"in progress; the same command with resume=auto {then}\n"
        )
        # "at once": no worker call is waited for (a stalled worker would hold the teardown), and none
        # outlives this process, which SIGTERM's default action ends before any cleanup runs
        kill_local_workers()
        previous = self._previous[signum]
        if callable(previous):  # SIGINT's: KeyboardInterrupt
            previous(signum, frame)
            return
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def _restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def __exit__(self, *exc: object) -> None:
        self._restore()


def _say(text: str) -> None:
    """One line to stderr from a signal handler; nothing when stderr is gone (a SIGHUP's closed terminal)."""
    try:
        os.write(2, text.encode())
    except OSError:
        pass


def wandb_config(config: ArenoConfig, run_dir: Path, *, resumed: bool) -> WandbConfig | None:
    """The W&B run of ``config``'s ``observe.wandb_*`` keys (None: not logging there), carrying the
    resolved config; a resumed run goes on in the W&B run its directory names."""
    observe = config.observe
    if not observe.wandb_project:
        return None
    id_file = run_dir / WANDB_ID_FILENAME
    return WandbConfig(
        project=observe.wandb_project,
        entity=observe.wandb_entity,
        name=observe.wandb_name,
        mode=resolve_wandb_mode(observe.wandb_mode, os.environ),
        tags=tuple(observe.wandb_tags),
        config=to_dict(config),
        run_id=id_file.read_text().strip() or None if resumed and id_file.is_file() else None,
    )


def _settings(config_yaml: str) -> dict[str, Any]:
    """A config.yaml's settings less ``resume`` and ``overwrite`` (how the run started)."""
    return {k: v for k, v in (yaml.safe_load(config_yaml) or {}).items() if k not in ("resume", "overwrite")}


def checkpoint_step(path: Path) -> int:
    """N of a ``step_N`` checkpoint directory."""
    return int(Path(path).name.removeprefix("step_"))


def truncate_metrics(path: Path, *, after_step: int) -> int:
    """Drop the rows of ``path`` logged for steps > ``after_step`` (and a torn last line), atomically.
    Returns the number of rows dropped."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # the process was killed while writing this line
            dropped += 1
            continue
        if int(row.get("step", 0)) > after_step:
            dropped += 1
        else:
            kept.append(line)
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        os.replace(tmp, path)
        if after_step < 0:  # resume=auto over a run killed before its first checkpoint
            logger.info("resume: no complete checkpoint: starting over (dropped the %d rows of %s)", dropped, path)
        else:
            logger.info(
                "resume: dropped %d rows of %s logged after step %d (those steps run again)", dropped, path, after_step
            )
    return dropped
