"""Trainer: the public coordinator (seed 000) and the outer loop of seed 004.

    for rollout_id in range(start, steps):
        rollout = backend.rollout_batch(rollout_id)
        for pass_idx in range(num_train_passes):        # passes after the first reshuffle
            train(rollout_id, rollout or reshuffle(rollout, base + rollout_id + pass_idx * 100003))
        backend.update_weights()                         # sync_to_rollout roles -> rollout engine
        evaluate / save at their intervals

Resume (``resume=auto|true``): the newest ``checkpoints/step_N`` holding ``COMPLETE`` whose files
match their checksums is loaded (checkpoints are published by one rename, so a killed write is
never loaded; its staging directory is removed with a warning; a damaged one is passed over with a
warning naming the file) and the loop continues at step N + 1. metrics.jsonl is cut
back to the rows of steps <= N first: the steps after N are trained again and log again, so the
file holds every step once. ``ARENO_FAULT`` (``areno.faults``) kills the run at a phase of a
step, for the tests that prove it.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from areno.api.backend.base import Backend, RolloutBatch, resolve_backend
from areno.api.config import ArenoConfig, to_dict, to_yaml
from areno.api.preflight import check_resumed_config, check_run
from areno.api.rundir import RunDirLock, clear_run, set_aside_untrained
from areno.engine.api import check_init_tiny_target
from areno.engine.host import thaw_heap
from areno.engine.test_rollout import TestRolloutManager, start_test_rollout, test_metrics
from areno.errors import ConfigError, RunStopped
from areno.faults import fault_point
from areno.observe.metrics import METRICS_FILENAME, MetricsLogger, WandbConfig
from areno.observe.profile import profiled_step
from areno.observe.session import configure_sessions
from areno.observe.startup import startup_to_first_token_s
from areno.observe.trace import configure_tracing, flush_tracing, merge_traces, span
from areno.train import checkpoint

logger = logging.getLogger(__name__)

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
    """Resolves the backend, runs the loop, writes the run directory."""

    # set in __init__
    config: ArenoConfig
    run_dir: Path
    # set in init()
    lock: RunDirLock
    backend: Backend
    logger: MetricsLogger
    start_rollout_id: int = 0
    test_rollout: TestRolloutManager | None = None
    """The background test rollout (``config.test_rollout.enabled``)."""
    save_on_stop: bool = True
    """A run stopped by a signal saves its step's checkpoint (False: a stage that starts over anyway)."""
    stopped_by: int | None = None
    """The signal that arrived during the last step (the run then ended as it would have): the caller's
    next stage should not start."""
    stage: str | None = None
    """The console's label of this run's steps when it is one stage of several (``"warm start"``)."""

    def __init__(self, config: ArenoConfig) -> None:
        self.config = config
        self.run_dir = Path(config.run_dir)

    @classmethod
    def init(cls, config: ArenoConfig, *, stage: str | None = None) -> Trainer:
        """Resolve the registered backend named by ``config.train.backend`` and initialise it. The
        run directory is locked first (``rundir.RunDirLock``, released by :meth:`shutdown`), then
        what the config can be checked for is checked (``preflight.check_run``), before the run
        directory is written and any model is built. ``stage``: the console's label of the steps
        (``"warm start"``) when this run is one stage of several (``api/pipeline.py``)."""
        backend_cls = resolve_backend(config.train.backend)
        lock = RunDirLock(config.run_dir).acquire()
        try:
            check_run(config)
            check_resumed_config(config)
            check_init_tiny_target(config)  # before _initialize writes run_dir (overwrite may clear it)
            trainer = cls(config)
            trainer.lock = lock
            trainer.stage = stage
            trainer._initialize(backend_cls)
        except BaseException:
            lock.release()
            raise
        return trainer

    def _initialize(self, backend_cls: type[Backend]) -> None:
        config = self.config
        self.run_dir.mkdir(parents=True, exist_ok=True)
        resume_from = self._prepare_resume()  # before the logger opens metrics.jsonl for appending
        self._write_config(resume_from)
        observe = config.observe
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
            wandb=wandb_config(config),
            stage=self.stage,
            start_step=checkpoint_step(resume_from) if resume_from is not None else 0,  # the bar resumes there
            # the steps after the checkpoint run again (metrics.jsonl is cut back alike); a run that
            # starts over (overwrite=true, no checkpoint yet) logs every step again
            purge_step=checkpoint_step(resume_from) + 1 if resume_from is not None else 0,
        )
        if resume_from is not None:
            self._resume(resume_from)
        if config.test_rollout.enabled:
            after = checkpoint_step(resume_from) if resume_from is not None else None
            self.test_rollout = start_test_rollout(config, self.run_dir, after_step=after)

    def rollout_token_batch(self, rollout_id: int) -> RolloutBatch:
        return self.backend.rollout_batch(rollout_id)

    def train(self, rollout_id: int, rollout: RolloutBatch) -> dict[str, float]:
        return self.backend.train(rollout_id, rollout)

    def run(self) -> dict[str, float]:
        """The outer loop; returns the last evaluation metrics. A SIGINT or SIGTERM ends it after the
        step in progress, with that step's checkpoint saved (``RunStopped``); a second one stops at once."""
        with StopSignals(self.run_dir / "checkpoints") as stop:
            metrics = self._run(stop)
            self.stopped_by = stop.signum
            return metrics

    def _run(self, stop: StopSignals) -> dict[str, float]:
        cfg = self.config.train
        last_eval: dict[str, float] = {}
        for rollout_id in range(self.start_rollout_id, cfg.steps):
            t0 = time.perf_counter()
            step = rollout_id + 1
            with profiled_step(self.run_dir, step, self.config.observe.profile_steps):
                with span("rollout", "trainer", rollout_id=rollout_id):
                    rollout = self.rollout_token_batch(rollout_id)
                fault_point("rollout", step)
                t1 = time.perf_counter()
                for pass_idx in range(cfg.num_train_passes):
                    data = rollout if pass_idx == 0 else reshuffle(rollout, pass_seed(cfg.seed, rollout_id, pass_idx))
                    with span("train", "trainer", rollout_id=rollout_id, pass_idx=pass_idx):
                        train_metrics = self.train(rollout_id, data)
                fault_point("train", step)
                t2 = time.perf_counter()
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
            if rollout_id == self.start_rollout_id and startup_s is not None:
                timing["system/startup_to_first_token_s"] = startup_s
            self.logger.log({**rollout.metrics, **train_metrics, **sync_metrics, **timing}, step=step)
            if step == cfg.steps or (cfg.eval_interval and step % cfg.eval_interval == 0):
                last_eval = self._evaluate(step)
            signum = stop.signum  # read once: a signal arriving later in the step stops after the next one
            stopping = signum is not None and step < cfg.steps
            saving = step == cfg.steps or (cfg.save_interval and step % cfg.save_interval == 0) or self._test_due(step)
            if saving or (stopping and self.save_on_stop):
                with span("checkpoint", "trainer", step=step):
                    self.backend.save(self._checkpoint_dir(step), {"rollout_id": rollout_id})
            self._log_test_results()
            if stopping:
                where = f"after step {step} of {cfg.steps} of {self.run_dir}"
                then = (
                    f"its checkpoint in {self._checkpoint_dir(step)}: go on with the same command and resume=auto"
                    if self.save_on_stop
                    else "this stage starts over when the run is started again"
                )
                raise RunStopped(f"stopped by {signal.Signals(signum).name} {where}; {then}", signum)
        self._finish_test_rollout()
        return last_eval

    def _test_due(self, step: int) -> bool:
        """A checkpoint is published for the test rollout at this step (``test_rollout.interval``)."""
        return self.test_rollout is not None and step % self.config.test_rollout.interval == 0

    def _log_test_results(self) -> None:
        """Log the test rollout's finished evaluations (never waits), each at its checkpoint's step."""
        if self.test_rollout is None:
            return
        for ckpt_step, metrics in self.test_rollout.pop_results():
            self.logger.log(test_metrics(ckpt_step, metrics), step=ckpt_step)

    def _finish_test_rollout(self) -> None:
        """Wait (``test_rollout.final_timeout_s``) for the evaluation of the last checkpoint, log it."""
        if self.test_rollout is None or self.config.train.steps <= self.start_rollout_id:
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

    def evaluate_now(self) -> dict[str, float]:
        """Evaluate the current policy and log it at the current step."""
        return self._evaluate(self.start_rollout_id)

    def shutdown(self) -> None:
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

    def _evaluate(self, step: int) -> dict[str, float]:
        with span("evaluate", "trainer", step=step):
            metrics = self.backend.evaluate()
        if metrics:
            self.logger.log(metrics, step=step)
        return metrics

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

    def _write_config(self, resume_from: Path | None) -> None:
        """The resolved config as run_dir/config.yaml; a resumed run whose settings changed keeps the
        previous one beside it as ``config.until_step_N.yaml`` (``resume`` and ``overwrite`` say how
        a run starts, not what it is: a change of those alone keeps no copy)."""
        path, text = self.run_dir / "config.yaml", to_yaml(self.config)
        if resume_from is not None and path.is_file() and _settings(path.read_text()) != _settings(text):
            kept = path.with_name(f"config.until_{resume_from.name}.yaml")
            n = 1
            while kept.exists():  # resumed from this step before: keep every config it ran with
                kept, n = path.with_name(f"config.until_{resume_from.name}.{n}.yaml"), n + 1
            path.replace(kept)
        path.write_text(text)

    def _resume(self, path: Path) -> None:
        state = self.backend.load(path)
        self.start_rollout_id = int(state["rollout_id"]) + 1
        print(json.dumps({"resumed_from": str(path), "next_rollout_id": self.start_rollout_id}), flush=True)


class StopSignals:
    """While entered (in the main thread), the first SIGINT or SIGTERM is noted in ``signum``; a second
    one acts at once as it would have before (KeyboardInterrupt, or termination), after one line naming
    the checkpoint under ``checkpoints_dir`` that ``resume=auto`` goes on from."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, checkpoints_dir: Path | None = None) -> None:
        self.signum: int | None = None
        self.checkpoints_dir = checkpoints_dir
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # only its handlers can be set
            self._previous = {s: signal.signal(s, self._note) for s in self.SIGNALS}
        return self

    def _note(self, signum: int, frame: Any) -> None:
        self.signum = signum
        for s, handler in self._previous.items():  # an ignored signal stays ignored
            signal.signal(s, self._stop_now if handler == signal.SIG_DFL or callable(handler) else handler)
        # os.write: a print could re-enter a stderr write the signal interrupted (a RuntimeError)
        os.write(
            2, f"areno: {signal.Signals(signum).name}: stopping after this step (send it again to stop now)\n".encode()
        )

    def _stop_now(self, signum: int, frame: Any) -> None:
        """The second signal: one line, then the previous handler's action (SIGTERM's default ends the
        process with its exit status and without a word of its own)."""
        last = checkpoint.latest_complete(self.checkpoints_dir) if self.checkpoints_dir is not None else None
        then = f"goes on from {last}" if last is not None else "starts over (no checkpoint was saved)"
        os.write(
            2,
            f"areno: stopped at once by a second {signal.Signals(signum).name}, without a checkpoint of the step "
            f"in progress; the same command with resume=auto {then}\n".encode(),
        )
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


def wandb_config(config: ArenoConfig) -> WandbConfig | None:
    """The W&B run of ``config``'s ``observe.wandb_*`` keys (None: not logging there), carrying the
    resolved config."""
    observe = config.observe
    if not observe.wandb_project:
        return None
    return WandbConfig(
        project=observe.wandb_project,
        entity=observe.wandb_entity,
        name=observe.wandb_name,
        mode=observe.wandb_mode or os.environ.get("WANDB_MODE", "offline"),
        tags=tuple(observe.wandb_tags),
        config=to_dict(config),
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
