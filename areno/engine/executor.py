"""WorkflowExecutor: the everlasting rollout pool.

Long-lived asyncio workers live on an event loop owned by one background thread. Each worker
loops forever: wait for admission (not paused, staleness capacity > 0), take the next sample, run
``workflow.run_episode`` against the rollout client, put the finished group on the results
queue, and start the next sample at once. Nothing is rebuilt between trainer steps: a step takes
the oldest ``batch_size`` finished groups (``wait_batch``) while the workers keep generating for
the steps after it, as far ahead as ``StalenessManager`` allows.

Weight updates: ``pause()`` stops admission (episodes in flight keep running; the rollout engine's
own pause interrupts their requests without losing tokens), the caller swaps weights into the
engine, ``set_version(v)`` records the new policy version, ``resume()`` re-opens admission.
Groups whose oldest token is more than η versions behind the current policy are dropped when the
trainer collects them (``rollout/dropped_stale``). Episodes still running when they fall behind are
cancelled at ``set_version`` (``rollout/aborted_stale``), so no compute is spent finishing a group
that would be dropped. Either way the sample is re-queued at the front and generated again under
the newer policy, at most ``max_retries`` times, then dropped with a warning. Note the consequence
for long-tailed lengths: an episode that needs more than η trainer steps to generate is never
trained on (bench/LOG.md, "Async RL: synchronous ... vs asynchronous"); choose η against the
longest generations.

Every sample taken from a ``SampleSource`` ends trained (the caller's business) or released back to
it: rejected by the workflow, dropped after its attempts, or too stale on every attempt.

Faults (``engine/episodes.py``): a workflow that raises counts as a failed episode and its sample
is retried (at the front of the queue) up to ``max_retries`` times, then dropped with a warning
that names it; hangs and unreachable servers are counted and the sample re-queued.
``ProcessEpisodeRunner`` (``engine/episode_processes.py``) runs episodes in child processes
and is their watchdog: one holding an episode past ``episode_timeout_s`` is reported by name,
killed and restarted, and its episodes re-queued.

``rollout_batch(samples)`` is the synchronous (colocated) path: run all episodes of the given
samples concurrently on the same loop and return when every one has finished; ``rollout_packed``
also packs each group as its episode ends.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from areno.engine.episode_processes import ProcessEpisodeRunner
from areno.engine.episodes import EpisodeAttempts, EpisodeTask
from areno.engine.pool_stats import PoolStats, spans_min_version, version_span
from areno.engine.staleness import StalenessManager
from areno.errors import RunFailure
from areno.rollout.client import RolloutClient, RolloutServersLost
from areno.rollout.store import ObservationStore, release_refs
from areno.types import TokenBatch, Trajectory
from areno.workflows.base import NONFINITE_REWARD_KEY, RolloutWorkflow, run_episode_name
from areno.workflows.common import describe_sample

logger = logging.getLogger(__name__)


class RolloutPoolBroken(RunFailure):
    """Every recent sample failed all its attempts (``max_consecutive_dropped``): the pool stopped."""

    training_side_intact = True
    """The training side is not touched by it: the Trainer saves an emergency checkpoint of the
    step reached before the run stops."""


GroupFilter = Callable[[list[Trajectory]], list[Trajectory]]
"""The trajectories of a finished group to train (``WorkflowExecutor``'s ``group_filter``)."""


class DatasetExhausted(RuntimeError):
    """The dataset iterator ended and every admitted sample has been collected."""


class SampleSource(abc.ABC):
    """The samples of the everlasting pool, told of each one that ends without a group to train
    (``SampleLedger`` keeps the untrained ones for checkpoints; a plain iterator is wrapped in
    ``_Rows``, which keeps nothing)."""

    def __iter__(self) -> SampleSource:
        return self

    @abc.abstractmethod
    def __next__(self) -> dict[str, Any]: ...

    @abc.abstractmethod
    def release(self, sample: dict[str, Any]) -> None:
        """The pool is done with ``sample`` (the object it took from here) and it gave no group:
        rejected by the workflow, dropped after its attempts, filtered, or too stale on every attempt. Told
        once a later group comes (at once for a stale one, or one the engine refused): the samples of a
        streak without groups that stops the pool are never told, so they stay for the resumed run."""


class _Rows(SampleSource):
    def __init__(self, rows: Iterator[dict[str, Any]]) -> None:
        self._rows = iter(rows)

    def __next__(self) -> dict[str, Any]:
        return next(self._rows)

    def release(self, sample: dict[str, Any]) -> None:
        pass


@dataclass
class _Finished:
    task: EpisodeTask
    group: list[Trajectory]
    submit_version: int
    spans: list[tuple[int, int] | None]
    """``version_span`` of each trajectory: scanned once, on the loop as the group finishes, not at
    every wake-up of ``wait_batch`` (which holds the results lock, blocking the loop's appends)."""
    min_version: int | None
    """The group's oldest version (None: no generated tokens), what ``_drop_stale_locked`` compares."""
    finished_at: float = field(default_factory=time.monotonic)


class WorkflowExecutor:
    """The everlasting pool (``start``/``wait_batch``) and the colocated path (``rollout_batch``)."""

    # set in __init__
    client: RolloutClient
    workflow: RolloutWorkflow
    staleness: StalenessManager | None
    num_workers: int
    max_retries: int
    # set when the loop starts
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _wake: asyncio.Event | None = None
    _worker_tasks: list[asyncio.Task] | None = None

    def __init__(
        self,
        client: RolloutClient,
        workflow: RolloutWorkflow,
        dataset_iter: Iterator[dict[str, Any]] | None = None,
        staleness: StalenessManager | None = None,
        *,
        num_workers: int | None = None,
        max_retries: int = 2,
        store: ObservationStore | None = None,
        runner: ProcessEpisodeRunner | None = None,
        abort_stale: bool = True,
        episode_timeout_s: float | None = None,
        max_consecutive_dropped: int = 16,
        group_filter: GroupFilter | None = None,
        max_filtered_batches: int = 0,
    ) -> None:
        """
        Args:
            client: the ``RolloutClient`` episodes generate with (unused with ``runner``).
            workflow: turns a sample into trajectories (unused with ``runner``: its processes
                build their own from a ``WorkerSpec``).
            dataset_iter: samples for the everlasting pool (``start``/``wait_batch``); a
                ``SampleSource`` is told which ones end untrained (of ``rollout_batch``'s, only the refused).
            staleness: admission control for the everlasting pool.
            num_workers: concurrent episodes (default ``staleness.max_concurrent``); a synchronous
                ``rollout_batch`` runs this many at once where it is given, else every episode.
            max_retries: a sample whose workflow raises (or whose worker process dies) is run at
                most ``max_retries + 1`` times, then dropped with a warning.
            store: observation store whose entries referenced by dropped groups are released.
            runner: run episodes in rollout worker processes instead of this process.
            abort_stale: on ``set_version``, cancel running episodes admitted more than η versions
                ago (``rollout/aborted_stale``): their result would be dropped as stale anyway.
            episode_timeout_s: in-process episodes running longer are cancelled (their requests
                aborted), counted in ``rollout/episode_timeouts`` and re-queued (None: no limit).
                With ``runner``, set the runner's own ``episode_timeout_s`` instead: a process
                cannot be interrupted from here, only killed and restarted.
            max_consecutive_dropped: this many samples in a row dropped after all their attempts
                (a broken rollout engine or server, a workflow that always raises) stop the pool:
                ``wait_batch`` raises at once with the last error instead of waiting for groups
                that will never come (0: never stop). So do this many batches' worth of samples in a
                row without a group, rejected or dropped (a workflow that keeps no row): a bound in
                batches, as one that keeps a few rows in many has long runs of rejections. The samples of
                the streak stay unreleased, so a run resumed after the fix generates them again.
            group_filter: the trajectories of each finished group to keep (DAPO's dynamic sampling: those
                of its groups with varied rewards); a group it keeps none of is ``filtered`` (counted in
                ``rollout/filtered_groups``, its sample done untrained) and the pool samples another, as
                for a rejected one.
            max_filtered_batches: this many batches' worth of samples in a row filtered whole stop the
                run (both paths; 0: never): the policy solves, or fails, every prompt alike.
        """
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        if max_consecutive_dropped < 0:
            raise ValueError(f"max_consecutive_dropped must be >= 0 (0: never stop), got {max_consecutive_dropped}")
        self.max_consecutive_dropped = max_consecutive_dropped
        self._dropped_in_a_row = 0
        self._without_group: collections.Counter[str] = collections.Counter()  # since the last group: status -> n
        self._requeues_due = 0  # stale groups the trainer dropped whose samples the loop has yet to queue again
        if max_filtered_batches < 0:
            raise ValueError(f"max_filtered_batches must be >= 0 (0: never stop), got {max_filtered_batches}")
        self.group_filter = group_filter
        self.max_filtered_batches = max_filtered_batches
        self._filtered_in_a_row = 0
        # the pool's samples ended without a group since its last group (filtered, rejected, dropped): let go once
        # a group comes, so the streak that stops the pool stays pending in the source for the resume to generate
        self._streak: list[dict[str, Any]] = []
        self._filtered_rewards: list[float] = []  # of the trajectories filtered since the last take
        self._filtered_rewards_lock = threading.Lock()
        self._filtered_reward_error: str | None = ""  # the streak's last reward error; None: one scored unfailed
        self._filtered_by_workflow = False  # that error is a non-finite reward the workflow set
        if episode_timeout_s is not None and episode_timeout_s <= 0:
            raise ValueError(f"episode_timeout_s must be > 0 or None, got {episode_timeout_s}")
        self.episode_timeout_s = episode_timeout_s
        self.client = client
        self.workflow = workflow
        self.staleness = staleness
        self.num_workers = num_workers if num_workers is not None else (staleness.max_concurrent if staleness else 1)
        # a synchronous batch runs every episode at once unless a number was given (rollout.max_concurrent)
        self._batch_slots = num_workers
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        self.max_retries = max_retries
        self.store = store
        self.runner = runner
        if dataset_iter is not None and not isinstance(dataset_iter, SampleSource):
            dataset_iter = _Rows(dataset_iter)
        self._dataset_iter: SampleSource | None = dataset_iter
        self._next_index = 0
        self._exhausted = False
        self._pending: collections.deque[EpisodeTask] = collections.deque()  # retries first, then prefetched
        self._paused = False
        self._stopping = False
        self._version = staleness.version if staleness else 0
        self._results: collections.deque[_Finished] = collections.deque()
        self._results_cond = threading.Condition()
        self.stats = PoolStats(self.num_workers)
        if group_filter is not None:  # reported from the first step, as 0 until a group is filtered
            self.stats.counts.update(filtered_groups=0, filtered_trajectories=0)
        self._worker_error: BaseException | None = None
        self.abort_stale = abort_stale
        self._in_flight: dict[int, tuple[asyncio.Future, int]] = {}
        self._aborted: set[int] = set()
        self._attempts = EpisodeAttempts(
            client,
            workflow,
            runner=runner,
            max_retries=max_retries,
            episode_timeout_s=episode_timeout_s,
            counts=self.stats.counts,
        )

    # ------------------------------------------------------------------ lifecycle
    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            loop = asyncio.new_event_loop()
            ready = threading.Event()

            def run() -> None:
                asyncio.set_event_loop(loop)
                self._wake = asyncio.Event()
                ready.set()
                loop.run_forever()

            self._thread = threading.Thread(target=run, name="areno-rollout-loop", daemon=True)
            self._thread.start()
            ready.wait()
            self._loop = loop
            if self.runner is not None:
                self.runner.attach(loop)
        return self._loop

    def start(self) -> None:
        """Start the workers of the everlasting pool (idempotent)."""
        if self._worker_tasks is not None:
            return
        if self._dataset_iter is None or self.staleness is None:
            raise ValueError("the everlasting pool needs dataset_iter and staleness; use rollout_batch() otherwise")
        loop = self._ensure_loop()

        def on_done(task: asyncio.Task) -> None:
            if not task.cancelled() and task.exception() is not None:  # e.g. the dataset iterator raised
                if self._worker_error is None:  # the others usually die of the same cause: logged once
                    logger.error("rollout worker %s died: %r", task.get_name(), task.exception())
                    self._worker_error = task.exception()
                else:
                    logger.debug("rollout worker %s died: %r", task.get_name(), task.exception())
                with self._results_cond:
                    self._results_cond.notify_all()

        async def aspawn() -> list[asyncio.Task]:
            tasks = [loop.create_task(self._aworker(i), name=f"rollout-worker-{i}") for i in range(self.num_workers)]
            for task in tasks:
                task.add_done_callback(on_done)
            return tasks

        self.stats.started_at = time.monotonic()
        self._worker_tasks = asyncio.run_coroutine_threadsafe(aspawn(), loop).result()

    stop_timeout_s = 30.0
    """How long ``stop`` waits for the loop thread, which code blocking it (a hanging in-process reward)
    would otherwise hold for ever."""

    def stop(self) -> None:
        """Cancel the workers and stop the loop thread. Episodes in flight are abandoned; a loop thread
        that does not answer within ``stop_timeout_s`` is left to end with the process (a daemon)."""
        if self._loop is None:
            return
        self._stopping = True
        loop, tasks = self._loop, self._worker_tasks or []
        self._loop, self._worker_tasks = None, None

        async def acancel() -> None:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(acancel(), loop).result(timeout=self.stop_timeout_s)
        except concurrent.futures.TimeoutError:
            logger.warning(
                "the rollout loop did not stop within %gs: code running in it blocks (a hanging reward with "
                "reward.sandbox=false, or a workflow that blocks its event loop); left to end with the process",
                self.stop_timeout_s,
            )
            blocked = True
        else:
            blocked = False
        if self.runner is not None:
            self.runner.stop()
        if blocked:
            return
        loop.call_soon_threadsafe(loop.stop)
        assert self._thread is not None
        self._thread.join(timeout=self.stop_timeout_s)
        if not self._thread.is_alive():
            loop.close()

    shutdown = stop

    def __enter__(self) -> WorkflowExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ control (any thread)
    def pause(self) -> None:
        """Stop admitting new episodes (in-flight episodes continue)."""
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        self._notify_loop()

    @property
    def version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        """Record the policy version the rollout engine now serves (after a weight update)."""
        if self.staleness is not None:
            self.staleness.set_version(version)
        self._version = version
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._abort_doomed)
        self._notify_loop()
        with self._results_cond:
            self._results_cond.notify_all()

    def _abort_doomed(self) -> None:
        """Loop thread: cancel running episodes admitted more than η versions ago. Their first token
        is no older than their admission, so they would most likely be dropped at collection;
        cancelling aborts their requests (the client aborts on cancellation) and frees the slot."""
        if self.staleness is None or not self.abort_stale:
            return
        oldest_allowed = self._version - self.staleness.max_head_offpolicyness
        for index, (attempt, submit_version) in list(self._in_flight.items()):
            if submit_version < oldest_allowed and not attempt.done():
                self._aborted.add(index)
                self.stats.counts["aborted_stale"] += 1
                attempt.cancel()

    def _notify_loop(self) -> None:
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    # ------------------------------------------------------------------ workers (loop thread)
    def _take_task(self) -> EpisodeTask | None:
        """Admit the next task if allowed now; None when it must wait."""
        assert self.staleness is not None and self._dataset_iter is not None
        if self._paused or self._stopping or isinstance(self._worker_error, RolloutPoolBroken):
            return None  # a broken pool admits nothing more: the samples stay unread for a fixed run
        if not self._pending and not self._exhausted:
            try:
                sample = next(self._dataset_iter)
            except StopIteration:
                self._exhausted = True
            else:
                self._pending.append(EpisodeTask(self._next_index, sample))
                self._next_index += 1
        if not self._pending or not self.staleness.try_submit():
            return None
        return self._pending.popleft()

    async def _aworker(self, worker_idx: int) -> None:
        assert self._wake is not None
        while True:
            if self._stopping:
                # also when this worker's cancellation was lost (Python 3.11's wait_for returns an
                # episode that finished in the same loop turn): waiting for work would hang stop()
                return
            task = self._take_task()
            if task is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            await self._arun_task(task)
            with self._results_cond:
                self._results_cond.notify_all()
            self._wake.set()

    async def _arun_task(self, task: EpisodeTask) -> None:
        """One attempt at ``task``, its outcome filed. A frame of its own, which ends with the attempt: a
        worker waiting for admission holds no group (the trainer's long since), nor the episode's Task."""
        assert self.staleness is not None
        submit_version = self._version
        t0 = time.monotonic()
        attempt = asyncio.ensure_future(self._attempts.arun(task))
        self._in_flight[task.index] = (attempt, submit_version)
        try:
            status, group = await attempt
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if self._stopping or (me is not None and me.cancelling()) or task.index not in self._aborted:
                raise  # this worker is cancelled (the pool is stopping), not only its episode
            self._aborted.discard(task.index)
            status, group = "aborted_stale", None
        finally:
            self._in_flight.pop(task.index, None)
            self.stats.busy_s += time.monotonic() - t0
        if status == "ok":
            group = self._filtered(group)
            status = "ok" if group else "filtered"
        self._count_outcome(status, pool=True)
        if status == "ok":
            assert group is not None
            if self._worker_error is None:  # a group came, the pool unbroken: the streak was no fault's, let go
                for sample in self._streak:
                    self._release(sample)
                self._streak.clear()
            self.staleness.on_accept()
            spans = [version_span(traj) for traj in group]
            finished = _Finished(task, group, submit_version, spans, spans_min_version(spans))
            with self._results_cond:
                self._results.append(finished)
            return
        # back in the queue before the running count falls, so the trainer never sees the pool drained meanwhile
        if status == "retry":
            self._pending.appendleft(task)
        elif status == "aborted_stale":
            self._requeue_stale(task)
        elif task.refused:  # the row's own fault, not the run's: let go at once (a resume would replay the refusal)
            self._release(task.sample)
        else:  # filtered, rejected, or dropped after its attempts: done, untrained, let go once a group comes
            self._streak.append(task.sample)
        self.staleness.on_reject()

    def _requeue_stale(self, task: EpisodeTask) -> None:
        """Loop thread: ``task``'s episode fell more than η versions behind (aborted, or its group dropped):
        generate it again now, under the newer policy, unless that already happened ``max_retries`` times."""
        assert self.staleness is not None
        task.stale += 1
        if task.stale <= self.max_retries:
            self._pending.appendleft(task)
            return
        self.stats.counts["dropped_stale_samples"] += 1
        logger.log(
            logging.WARNING if self.stats.counts["dropped_stale_samples"] == 1 else logging.DEBUG,
            "dropping dataset %s: its episode fell more than rollout.max_head_offpolicyness=%d versions behind on "
            "all %d attempts (rollout/aborted_stale, rollout/dropped_stale); a larger one lets such long episodes "
            "train (later ones are counted: rollout/dropped_stale_samples)",
            describe_sample(task.sample),
            self.staleness.max_head_offpolicyness,
            task.stale,
        )
        self._release(task.sample)

    def _release(self, sample: dict[str, Any]) -> None:
        if self._dataset_iter is not None:
            self._dataset_iter.release(sample)

    def _filtered(self, group: list[Trajectory] | None) -> list[Trajectory] | None:
        """``group_filter``'s part of a finished group (all of it without a filter); the observations of
        the trajectories left out are released, and they are counted."""
        if self.group_filter is None or not group:
            return group
        kept = self.group_filter(group)
        if len(kept) == len(group):
            return group
        kept_ids = {id(t) for t in kept}
        left_out = [t for t in group if id(t) not in kept_ids]
        if self.store is not None:
            release_refs([t.info for t in left_out], self.store)
        self.stats.counts["filtered_trajectories"] += len(left_out)
        with self._filtered_rewards_lock:
            self._filtered_rewards.extend(t.reward for t in left_out)
        if not kept:
            self.stats.counts["filtered_groups"] += 1
            errors = [t.info.get("reward_error") for t in left_out]
            if self._filtered_reward_error is not None:  # a failing reward scores 0 alike: named, not the policy
                self._filtered_reward_error = errors[-1] if all(errors) else None
                self._filtered_by_workflow = bool(left_out[-1].info.get(NONFINITE_REWARD_KEY))
        return kept

    def take_filtered_rewards(self) -> list[float]:
        """The rewards of the trajectories ``group_filter`` left out since the last call."""
        with self._filtered_rewards_lock:
            out, self._filtered_rewards = self._filtered_rewards, []
        return out

    def filtered_cause(self) -> str:
        """Why the groups filtered since the last kept one were flat, and the fix (the one-line errors of a run
        that dynamic sampling leaves nothing to train on): every reward call failed, or the policy solves, or
        fails, every prompt alike."""
        if self._filtered_reward_error:
            last = next(iter(self._filtered_reward_error.splitlines()), "")
            fix = "rollout.workflow, which set them" if self._filtered_by_workflow else "reward.fn"
            return f"every reward failed and scored 0 (last: {last}): fix {fix}"
        return (
            "every group's rewards were equal (the policy solves, or fails, every prompt alike); use harder or "
            f"easier prompts, or raise train.algorithm_kwargs.dynamic_sampling_max_rounds ({self.max_filtered_batches})"
        )

    # ------------------------------------------------------------------ collection (trainer thread)
    def _drop_stale_locked(self) -> None:
        if self.staleness is None:
            return
        oldest_allowed = self._version - self.staleness.max_head_offpolicyness
        kept: collections.deque[_Finished] = collections.deque()
        for finished in self._results:
            if finished.min_version is not None and finished.min_version < oldest_allowed:
                self.stats.counts["dropped_stale"] += 1
                self.stats.counts["dropped_stale_trajectories"] += len(finished.group)
                self.staleness.on_drop_accepted()
                if self.store is not None:
                    release_refs([t.info for t in finished.group], self.store)
                assert self._loop is not None
                self._requeues_due += 1  # not drained until the loop has queued it again (_drained_locked)
                self._loop.call_soon_threadsafe(self._requeue_due, finished.task)
            else:
                kept.append(finished)
        if len(kept) != len(self._results):
            self._results = kept
            self._notify_loop()

    def _requeue_due(self, task: EpisodeTask) -> None:
        """Loop thread: a group the trainer dropped as stale, its sample queued again (or given up)."""
        self._requeue_stale(task)
        with self._results_cond:
            self._requeues_due -= 1
            self._results_cond.notify_all()

    def _drained_locked(self) -> bool:
        assert self.staleness is not None
        return self._exhausted and not self._pending and self.staleness.running == 0 and not self._requeues_due

    def wait_batch(self, batch_size: int, timeout: float | None = None) -> list[list[Trajectory]]:
        """The oldest ``batch_size`` finished groups, waiting up to ``timeout`` seconds.

        Starts the pool on first use. When the dataset is exhausted, returns what is left (fewer
        groups) and then raises ``DatasetExhausted``. Raises ``TimeoutError`` naming the counts.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.start()
        t0 = time.monotonic()
        deadline = None if timeout is None else t0 + timeout
        with self._results_cond:
            while True:
                if isinstance(self._worker_error, (RolloutPoolBroken, RolloutServersLost)):
                    raise type(self._worker_error)(str(self._worker_error))
                if self._worker_error is not None:
                    raise RuntimeError(
                        f"the rollout pool stopped: a worker died with {self._worker_error!r}"
                    ) from self._worker_error
                self._drop_stale_locked()
                if len(self._results) >= batch_size or (self._results and self._drained_locked()):
                    break
                if self._drained_locked():
                    raise DatasetExhausted("the dataset iterator is exhausted and every sample was collected")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    assert self.staleness is not None
                    raise TimeoutError(
                        f"wait_batch: {len(self._results)} of {batch_size} groups ready after {timeout}s "
                        f"(staleness {self.staleness.snapshot()}, paused={self._paused})"
                    )
                self._results_cond.wait(remaining)
            batch = [self._results.popleft() for _ in range(min(batch_size, len(self._results)))]
        spans = [span for f in batch for span in f.spans]
        self.stats.record_batch(spans, self._version, wait_s=time.monotonic() - t0)
        return [f.group for f in batch]

    def metrics(self) -> dict[str, float]:
        """Cumulative counters (``rollout/<name>``), staleness of the last batch, pool state."""
        ready = len(self._results) if self.staleness is not None else None
        return self.stats.metrics(self._version, self.staleness, ready)

    # ------------------------------------------------------------------ colocated path
    def rollout_batch(self, samples: list[dict[str, Any]]) -> list[Trajectory]:
        """Run every sample's episode concurrently and return all trajectories (groups adjacent,
        in sample order). Failed episodes are retried up to ``max_retries``; rejected and finally
        failed samples (and groups ``group_filter`` keeps nothing of) contribute nothing. The samples are the
        caller's to settle with its source (unlike the pool's, none is released here but one the engine refused:
        a synchronous step marks them all trained once its batch is taken, and one that stops the run leaves them
        pending)."""
        return [t for group, _ in self._rollout(samples, pack=False) for t in group]

    def rollout_packed(self, samples: list[dict[str, Any]]) -> tuple[list[Trajectory], TokenBatch]:
        """``rollout_batch`` and its trajectories packed (what ``TokenBatch.from_trajectories`` makes
        of them). Each group is packed on the loop as its episode ends, while the later groups still
        decode and score their completions, so after the last episode only its own group's packing
        and one concatenation are left."""
        groups = self._rollout(samples, pack=True)
        return [t for group, _ in groups for t in group], TokenBatch.concat([part for _, part in groups])

    def rollout_groups(
        self, samples: list[dict[str, Any]], *, first_round: bool = True
    ) -> list[tuple[list[Trajectory], TokenBatch]]:
        """``rollout_packed`` group by group: each kept group (in sample order) and its packed batch.
        ``first_round=False``: a later round of dynamic sampling's step, whose few samples may all be rejected
        or dropped without the rollout being broken (the step's rounds are judged together)."""
        return self._rollout(samples, pack=True, first_round=first_round)

    def _rollout(
        self, samples: list[dict[str, Any]], *, pack: bool, first_round: bool = True
    ) -> list[tuple[list[Trajectory], TokenBatch | None]]:
        loop = self._ensure_loop()
        if threading.current_thread() is self._thread:
            raise RuntimeError("rollout_batch() is synchronous; call it from outside the rollout loop")
        before = dict(self.stats.counts)

        def submit() -> concurrent.futures.Future:
            return asyncio.run_coroutine_threadsafe(self._arollout_batch(samples, pack), loop)

        drive = getattr(self.client, "drive_until", None)  # an in-process engine, stepped from here
        results = (drive(submit) if drive is not None else submit()).result()
        if isinstance(self._worker_error, RolloutPoolBroken):  # rollout.max_consecutive_dropped samples in a row
            raise RolloutPoolBroken(str(self._worker_error))
        kept = [(group, part) for group, part in results if group]
        filtered = self.stats.counts["filtered_groups"] - before.get("filtered_groups", 0)
        if samples and not kept and not filtered and first_round:

            def since(name: str) -> int:
                return self.stats.counts[name] - before.get(name, 0)

            dropped, refused, rejected = since("dropped_failed"), since("refused_requests"), since("rejected")
            last = f" (last: {self._attempts.last_drop})" if dropped else ""
            raise RolloutPoolBroken(
                f"no trajectories from a rollout batch of {len(samples)} samples: {dropped - refused} dropped after "
                f"{self.max_retries + 1} attempts each, {refused} refused by the rollout engine{last}, {rejected} "
                "rejected by the workflow: "
                f"{self._attempts.drop_advice if dropped else 'rollout.workflow returned None for every sample (see its warnings above)'}"
            )
        return kept

    def _count_outcome(self, status: str, *, pool: bool = False) -> None:
        """Samples in a row without a group (both paths): ``max_consecutive_dropped`` dropped after all their
        attempts break the pool (``_worker_error``), the cause named; in the everlasting pool (``pool``), so do
        as many batches' worth rejected or dropped, and ``max_filtered_batches`` batches' worth filtered (a
        synchronous batch has its own checks: one with no trajectory at all stops the run, as does a step whose
        re-sampling rounds kept no group; its rows finish in any order, so a streak would span batches)."""
        if status == "ok":
            self._dropped_in_a_row = 0
            self._filtered_in_a_row = 0
            self._filtered_reward_error = ""
            self._without_group.clear()
            return
        if status == "filtered":
            if not pool:
                return
            self._filtered_in_a_row += 1
            batch = self.staleness.batch_size if self.staleness is not None else 0
            bound = self.max_filtered_batches * batch
            if self._worker_error is None and bound and self._filtered_in_a_row >= bound:
                self._worker_error = RolloutPoolBroken(
                    f"dynamic sampling kept no group of the last {self._filtered_in_a_row} samples "
                    f"({self.max_filtered_batches} batches' worth in a row stop the run): {self.filtered_cause()}"
                )
                logger.error("%s", self._worker_error)
            return
        if status not in ("rejected", "dropped"):
            return  # retried or re-queued: not over yet
        self._without_group[status] += 1
        self._dropped_in_a_row = self._dropped_in_a_row + 1 if status == "dropped" else 0
        if self._worker_error is not None or self.max_consecutive_dropped == 0:
            return
        if self._dropped_in_a_row >= self.max_consecutive_dropped:
            self._worker_error = RolloutPoolBroken(
                f"the last {self._dropped_in_a_row} samples were all dropped after {self.max_retries + 1} "
                f"attempts each (last: {self._attempts.last_drop}): {self._attempts.drop_advice}"
            )
        elif (
            pool
            and self.staleness is not None
            and sum(self._without_group.values()) >= self.max_consecutive_dropped * self.staleness.batch_size
        ):
            workflow = self._attempts.user_workflow
            name = run_episode_name(workflow) if workflow is not None else "rollout.workflow"
            rejected, dropped = self._without_group["rejected"], self._without_group["dropped"]
            self._worker_error = RolloutPoolBroken(
                f"no group from the last {rejected + dropped} samples: {rejected} rejected by the workflow ({name} "
                f"returned None), {dropped} dropped: fix its filter or the data (rollout.max_consecutive_dropped="
                f"{self.max_consecutive_dropped} batches of samples in a row without a group stop the run)"
            )
        else:
            return
        logger.error("%s", self._worker_error)

    async def _arollout_batch(
        self, samples: list[dict[str, Any]], pack: bool
    ) -> list[tuple[list[Trajectory] | None, TokenBatch | None]]:
        # rollout.max_concurrent episodes in flight, as the pool's
        slots = asyncio.Semaphore(self._batch_slots) if self._batch_slots is not None else contextlib.nullcontext()

        async def arun(task: EpisodeTask) -> tuple[list[Trajectory] | None, TokenBatch | None]:
            async with slots:
                while True:
                    t0 = time.monotonic()
                    status, group = await self._attempts.arun(task)
                    self.stats.busy_s += time.monotonic() - t0
                    if status == "ok":
                        group = self._filtered(group)
                        status = "ok" if group else "filtered"
                    if status != "retry":  # its sample is the caller's to settle with its source
                        self._count_outcome(status)
                        if task.refused:  # but one refused is the row's fault: let go at once, as the pool's
                            self._release(task.sample)
                        return group, TokenBatch.from_trajectories(group) if pack and group else None

        tasks = [EpisodeTask(self._next_index + i, sample) for i, sample in enumerate(samples)]
        self._next_index += len(samples)
        return list(await asyncio.gather(*(arun(t) for t in tasks)))
