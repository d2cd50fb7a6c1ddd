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
trainer collects them (``rollout/dropped_stale``) and a replacement sample is admitted. Episodes
still running when they fall behind are cancelled at ``set_version`` (``rollout/aborted_stale``),
so no compute is spent finishing a group that would be dropped. Note the consequence for
long-tailed lengths: an episode that needs more than η trainer steps to generate is never trained
on (``bench/async.py`` reports ``long_seqs_trained``); choose η against the longest generations.

Faults: a workflow that raises counts as a failed episode and its sample is retried (at the front
of the queue) up to ``max_retries`` times, then dropped with a warning that names it. Hangs: a
generation request past its deadline (``RolloutRequestTimeout``), an unreachable rollout server and
an episode past ``episode_timeout_s`` are infrastructure faults, not the sample's: they are counted
(``rollout/request_timeouts``, ``rollout/server_errors``, ``rollout/episode_timeouts``) and the
sample re-queued like one whose worker process died. ``ProcessEpisodeRunner(episode_timeout_s=...)``
is the watchdog of rollout worker processes: one holding an episode past the deadline is reported
by name, killed and restarted, and its episodes re-queued.

``rollout_batch(samples)`` is the synchronous (colocated) path: run all episodes of the given
samples concurrently on the same loop and return when every one has finished.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from areno.engine.staleness import StalenessManager
from areno.errors import RunFailure
from areno.types import Trajectory
from areno.workflows.base import RolloutWorkflow, as_group
from areno.workflows.common import describe_sample

if TYPE_CHECKING:
    from areno.rollout.client import RolloutClient
    from areno.rollout.store import ObservationStore

logger = logging.getLogger("areno.engine.executor")


class RolloutPoolBroken(RunFailure):
    """Every recent sample failed all its attempts (``max_consecutive_dropped``): the pool stopped."""


class DatasetExhausted(RuntimeError):
    """The dataset iterator ended and every admitted sample has been collected."""


@dataclass
class _Task:
    index: int
    """Position of the sample in the stream (unique per sample, kept across retries)."""
    sample: dict[str, Any]
    attempts: int = 0
    """Attempts whose workflow raised."""
    lost: int = 0
    """Attempts lost because the rollout worker process running them died."""


@dataclass
class _Finished:
    index: int
    group: list[Trajectory]
    submit_version: int
    finished_at: float = field(default_factory=time.monotonic)


def trained_versions(traj: Trajectory) -> list[int]:
    """Policy versions of the model-generated tokens of a trajectory."""
    return [v for v, m in zip(traj.versions, traj.completion_mask) if m and v >= 0]


def group_min_version(group: list[Trajectory]) -> int | None:
    """Oldest policy version that produced any token of the group (None: no generated tokens)."""
    versions = [min(vs) for vs in map(trained_versions, group) if vs]
    return min(versions) if versions else None


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
    ) -> None:
        """
        Args:
            client: the ``RolloutClient`` episodes generate with (unused with ``runner``).
            workflow: turns a sample into trajectories (unused with ``runner``: its processes
                build their own from a ``WorkerSpec``).
            dataset_iter: samples for the everlasting pool (``start``/``wait_batch``).
            staleness: admission control for the everlasting pool.
            num_workers: concurrent episodes (default ``staleness.max_concurrent``).
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
                that will never come (0: never stop).
        """
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        if max_consecutive_dropped < 0:
            raise ValueError(f"max_consecutive_dropped must be >= 0 (0: never stop), got {max_consecutive_dropped}")
        self.max_consecutive_dropped = max_consecutive_dropped
        self._dropped_in_a_row = 0
        self._last_drop: str = ""
        if episode_timeout_s is not None and episode_timeout_s <= 0:
            raise ValueError(f"episode_timeout_s must be > 0 or None, got {episode_timeout_s}")
        self.episode_timeout_s = episode_timeout_s
        self.client = client
        self.workflow = workflow
        self.staleness = staleness
        self.num_workers = num_workers if num_workers is not None else (staleness.max_concurrent if staleness else 1)
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        self.max_retries = max_retries
        self.store = store
        self.runner = runner
        self._dataset_iter = iter(dataset_iter) if dataset_iter is not None else None
        self._next_index = 0
        self._exhausted = False
        self._pending: collections.deque[_Task] = collections.deque()  # retries first, then prefetched
        self._paused = False
        self._stopping = False
        self._version = staleness.version if staleness else 0
        self._results: collections.deque[_Finished] = collections.deque()
        self._results_cond = threading.Condition()
        self._counts: collections.Counter[str] = collections.Counter()
        self._last_batch: dict[str, float] = {}
        self._busy_s = 0.0
        self._started_at: float | None = None
        self._worker_error: BaseException | None = None
        self.abort_stale = abort_stale
        self._in_flight: dict[int, tuple[asyncio.Future, int]] = {}
        self._aborted: set[int] = set()

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

        self._started_at = time.monotonic()
        self._worker_tasks = asyncio.run_coroutine_threadsafe(aspawn(), loop).result()

    def stop(self) -> None:
        """Cancel the workers and stop the loop thread. Episodes in flight are abandoned."""
        if self._loop is None:
            return
        self._stopping = True
        loop = self._loop

        async def acancel() -> None:
            tasks = self._worker_tasks or []
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(acancel(), loop).result()
        if self.runner is not None:
            self.runner.stop()
        loop.call_soon_threadsafe(loop.stop)
        assert self._thread is not None
        self._thread.join()
        loop.close()
        self._loop = None
        self._worker_tasks = None

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
                self._counts["aborted_stale"] += 1
                attempt.cancel()

    def _notify_loop(self) -> None:
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    # ------------------------------------------------------------------ workers (loop thread)
    def _take_task(self) -> _Task | None:
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
                self._pending.append(_Task(self._next_index, sample))
                self._next_index += 1
        if not self._pending or not self.staleness.try_submit():
            return None
        return self._pending.popleft()

    async def _aworker(self, worker_idx: int) -> None:
        assert self._wake is not None
        while True:
            task = self._take_task()
            if task is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            submit_version = self._version
            t0 = time.monotonic()
            attempt = asyncio.ensure_future(self._aattempt(task))
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
                self._busy_s += time.monotonic() - t0
            assert self.staleness is not None
            if status == "dropped":
                self._dropped_in_a_row += 1
                if 0 < self.max_consecutive_dropped <= self._dropped_in_a_row and self._worker_error is None:
                    self._worker_error = RolloutPoolBroken(
                        f"the last {self._dropped_in_a_row} samples were all dropped after {self.max_retries + 1} "
                        f"attempts each (last: {self._last_drop}): the rollout side is failing, not the data; fix "
                        "the error above (the rollout engine or server log has the cause)"
                    )
                    logger.error("%s", self._worker_error)
            elif status in ("ok", "rejected"):
                self._dropped_in_a_row = 0
            if status == "ok":
                assert group is not None
                self.staleness.on_accept()
                with self._results_cond:
                    self._results.append(_Finished(task.index, group, submit_version))
            else:
                self.staleness.on_reject()
                if status == "retry":
                    self._pending.appendleft(task)
            with self._results_cond:
                self._results_cond.notify_all()
            self._wake.set()

    async def _aattempt(self, task: _Task) -> tuple[str, list[Trajectory] | None]:
        """One attempt at one sample: ``ok`` (group), ``rejected``, ``retry`` or ``dropped``."""
        from httpx import TransportError

        from areno.rollout.client import (
            NoHealthyServerError,
            RolloutRequestTimeout,
            RolloutServerError,
            RolloutServersLost,
        )

        self._counts["episodes_started"] += 1
        try:
            if self.runner is not None:
                group = await self.runner.arun(task.sample)
            else:
                episode = self.workflow.run_episode(self.client, task.sample)
                try:
                    group = as_group(await asyncio.wait_for(episode, self.episode_timeout_s))
                except TimeoutError as exc:
                    if isinstance(exc, RolloutRequestTimeout):
                        raise
                    raise EpisodeTimeout(f"episode ran past episode_timeout_s={self.episode_timeout_s:g}s") from None
        except (asyncio.CancelledError, RolloutServersLost):
            raise  # RolloutServersLost: no server can come back, so no retry can succeed
        except (
            WorkerLost,
            EpisodeTimeout,
            RolloutRequestTimeout,
            RolloutServerError,
            NoHealthyServerError,
            TransportError,
        ) as exc:
            if isinstance(exc, RolloutServerError) and exc.status is not None and exc.status < 500:
                return self._failed(task, exc)  # the server rejected the request: the sample's fault
            # infrastructure, not the sample: re-queue, bounded like failures
            counter = {
                EpisodeTimeout: "episode_timeouts",
                RolloutRequestTimeout: "request_timeouts",
                WorkerLost: "worker_lost",
            }.get(type(exc), "server_errors")
            self._counts[counter] += 1
            task.lost += 1
            self._counts["requeued"] += 1
            if task.lost <= self.max_retries:
                logger.warning("re-queueing dataset %s (%s): %s", describe_sample(task.sample), counter, exc)
                return "retry", None
            self._counts["dropped_failed"] += 1
            self._last_drop = f"{type(exc).__name__}: {exc}"
            logger.warning(
                "dropping dataset %s after %d infrastructure failures (last, %s): %s",
                describe_sample(task.sample),
                task.lost,
                counter,
                exc,
            )
            return "dropped", None
        except Exception as exc:  # noqa: BLE001 - user workflow code: counted, retried, then dropped with a warning
            return self._failed(task, exc)
        if group is None:
            self._counts["rejected"] += 1
            return "rejected", None
        self._counts["accepted"] += 1
        self._counts["trajectories"] += len(group)
        self._counts["reward_errors"] += sum("reward_error" in t.info for t in group)
        return "ok", group

    def _failed(self, task: _Task, exc: BaseException) -> tuple[str, None]:
        """The workflow raised: count, retry up to ``max_retries`` times, then drop with a warning."""
        task.attempts += 1
        self._counts["failed_episodes"] += 1
        what = f"{type(exc).__name__}: {exc}"
        if task.attempts <= self.max_retries:
            logger.warning(
                "episode failed for dataset %s (attempt %d of %d), retrying: %s",
                describe_sample(task.sample),
                task.attempts,
                self.max_retries + 1,
                what,
            )
            return "retry", None
        self._counts["dropped_failed"] += 1
        self._last_drop = what
        logger.warning(
            "dropping dataset %s after %d failed attempts: %s",
            describe_sample(task.sample),
            task.attempts,
            what,
            exc_info=exc,
        )
        return "dropped", None

    # ------------------------------------------------------------------ collection (trainer thread)
    def _drop_stale_locked(self) -> None:
        if self.staleness is None:
            return
        oldest_allowed = self._version - self.staleness.max_head_offpolicyness
        kept: collections.deque[_Finished] = collections.deque()
        for finished in self._results:
            min_version = group_min_version(finished.group)
            if min_version is not None and min_version < oldest_allowed:
                self._counts["dropped_stale"] += 1
                self._counts["dropped_stale_trajectories"] += len(finished.group)
                self.staleness.on_drop_accepted()
                if self.store is not None:
                    from areno.rollout.store import release_refs

                    release_refs([t.info for t in finished.group], self.store)
            else:
                kept.append(finished)
        if len(kept) != len(self._results):
            self._results = kept
            self._notify_loop()

    def _drained_locked(self) -> bool:
        assert self.staleness is not None
        return self._exhausted and not self._pending and self.staleness.running == 0

    def wait_batch(self, batch_size: int, timeout: float | None = None) -> list[list[Trajectory]]:
        """The oldest ``batch_size`` finished groups, waiting up to ``timeout`` seconds.

        Starts the pool on first use. When the dataset is exhausted, returns what is left (fewer
        groups) and then raises ``DatasetExhausted``. Raises ``TimeoutError`` naming the counts.
        """
        from areno.rollout.client import RolloutServersLost

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
        self._record_batch(batch, wait_s=time.monotonic() - t0)
        return [f.group for f in batch]

    def _record_batch(self, batch: list[_Finished], wait_s: float) -> None:
        lags = []
        multi_version = 0
        for finished in batch:
            for traj in finished.group:
                versions = trained_versions(traj)
                if versions:
                    lags.append(self._version - min(versions))
                    multi_version += len(set(versions)) > 1
        self._last_batch = {
            "rollout/wait_s": wait_s,
            "rollout/staleness_mean": sum(lags) / len(lags) if lags else 0.0,
            "rollout/staleness_max": float(max(lags)) if lags else 0.0,
            "rollout/multi_version_frac": multi_version / len(lags) if lags else 0.0,
        }

    def metrics(self) -> dict[str, float]:
        """Cumulative counters (``rollout/<name>``), staleness of the last batch, pool state."""
        out = {f"rollout/{name}": float(value) for name, value in sorted(self._counts.items())}
        for name in (
            "dropped_stale",
            "aborted_stale",
            "failed_episodes",
            "dropped_failed",
            "rejected",
            "reward_errors",
        ):
            out.setdefault(f"rollout/{name}", 0.0)
        out.update(self._last_batch)
        out["rollout/version"] = float(self._version)
        if self.staleness is not None:
            snap = self.staleness.snapshot()
            out["rollout/running"] = float(snap["running"])
            out["rollout/ready"] = float(len(self._results))
        if self._started_at is not None:
            elapsed = max(time.monotonic() - self._started_at, 1e-9)
            out["rollout/worker_busy_frac"] = min(1.0, self._busy_s / (elapsed * self.num_workers))
        return out

    # ------------------------------------------------------------------ colocated path
    def rollout_batch(self, samples: list[dict[str, Any]]) -> list[Trajectory]:
        """Run every sample's episode concurrently and return all trajectories (groups adjacent,
        in sample order). Failed episodes are retried up to ``max_retries``; rejected and finally
        failed samples contribute nothing."""
        loop = self._ensure_loop()
        if threading.current_thread() is self._thread:
            raise RuntimeError("rollout_batch() is synchronous; call it from outside the rollout loop")
        before = dict(self._counts)
        groups = asyncio.run_coroutine_threadsafe(self._arollout_batch(samples), loop).result()
        trajectories = [traj for group in groups if group for traj in group]
        if samples and not trajectories:
            dropped = self._counts["dropped_failed"] - before.get("dropped_failed", 0)
            rejected = self._counts["rejected"] - before.get("rejected", 0)
            last = f" (last: {self._last_drop})" if dropped else ""
            raise RolloutPoolBroken(
                f"no trajectories from a rollout batch of {len(samples)} samples: {dropped} dropped after "
                f"{self.max_retries + 1} attempts each{last}, {rejected} rejected by the workflow; fix the error "
                "above (the rollout engine or server log has the cause)"
            )
        return trajectories

    async def _arollout_batch(self, samples: list[dict[str, Any]]) -> list[list[Trajectory] | None]:
        async def arun(task: _Task) -> list[Trajectory] | None:
            while True:
                t0 = time.monotonic()
                status, group = await self._aattempt(task)
                self._busy_s += time.monotonic() - t0
                if status != "retry":
                    return group

        tasks = [_Task(self._next_index + i, sample) for i, sample in enumerate(samples)]
        self._next_index += len(samples)
        return list(await asyncio.gather(*(arun(t) for t in tasks)))


# ---------------------------------------------------------------------------------------------
# Rollout worker processes: episodes run in child processes that are restarted when they die.
# ---------------------------------------------------------------------------------------------


class WorkerLost(RuntimeError):
    """The rollout worker process running an episode died (or was killed as stalled) before returning it."""


class EpisodeTimeout(TimeoutError):
    """An in-process episode ran past the executor's ``episode_timeout_s`` and was cancelled."""


class RemoteEpisodeError(RuntimeError):
    """The workflow raised inside a rollout worker process (the message carries its error)."""


@dataclass(frozen=True, kw_only=True)
class WorkerSpec:
    """How a rollout worker process builds its workflow and client (everything by dotted path, so
    the spec pickles into a fresh process)."""

    workflow: str
    """Dotted path of a ``RolloutWorkflow`` class or factory (see ``load_workflow``)."""
    workflow_kwargs: dict[str, Any] = field(default_factory=dict)
    client: str = "areno.rollout.client.HTTPRolloutClient"
    """Dotted path of a ``RolloutClient`` class or factory, e.g. an HTTP client of ``areno serve``."""
    client_kwargs: dict[str, Any] = field(default_factory=dict)


def _worker_main(spec: WorkerSpec, conn: Any) -> None:
    """Child process: receive ``(dispatch_id, sample)``, run episodes concurrently, send
    ``(dispatch_id, status, payload)`` back; ``None`` ends the process."""
    from areno.workflows.base import _import_dotted, load_workflow

    async def amain() -> None:
        workflow = load_workflow(spec.workflow, **spec.workflow_kwargs)
        client = _import_dotted(spec.client)(**spec.client_kwargs)
        conn.send((_READY, "ready", None))  # the watchdog's clock starts here, not at the (slow) import
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue = asyncio.Queue()
        loop.add_reader(conn.fileno(), lambda: inbox.put_nowait(_recv_or_none(conn)))
        running: set[asyncio.Task] = set()

        async def arun(dispatch_id: int, sample: dict[str, Any]) -> None:
            try:
                group = as_group(await workflow.run_episode(client, sample))
                conn.send((dispatch_id, "ok", group))
            except Exception as exc:  # noqa: BLE001 - sent to the parent, which counts and retries it
                conn.send((dispatch_id, "error", f"{type(exc).__name__}: {exc}"))

        while (msg := await inbox.get()) is not None:
            task = loop.create_task(arun(*msg))
            running.add(task)
            task.add_done_callback(running.discard)
        loop.remove_reader(conn.fileno())

    asyncio.run(amain())


_READY = -1
"""Dispatch id of the message a worker process sends once its workflow and client are built."""


def _recv_or_none(conn: Any) -> Any:
    try:
        return conn.recv()
    except (EOFError, OSError):  # the parent went away: end the worker
        return None


@dataclass
class _Slot:
    proc: Any
    conn: Any
    generation: int
    inflight: dict[int, asyncio.Future] = field(default_factory=dict)
    started: dict[int, tuple[float, str]] = field(default_factory=dict)
    """dispatch id -> (time.monotonic() when sent, the sample's description), for the watchdog."""
    alive: bool = True
    ready_at: float | None = None
    """When the process reported its workflow and client built (episodes queue until then)."""
    stalled: str | None = None
    """Why the watchdog killed it (None: it died by itself)."""


class ProcessEpisodeRunner:
    """Runs episodes in ``num_procs`` child processes, each with up to ``episodes_per_proc`` in
    flight. A process that dies is restarted and every episode it held fails with ``WorkerLost``,
    which the executor re-queues: each sample still yields exactly one group (a result that arrives
    from a process already declared dead is ignored, so nothing is counted twice).

    Watchdog: with ``episode_timeout_s`` a process holding an episode longer than that is stalled
    (a hung tool, a blocked event loop, a deadlock): it is reported by name (index, pid, the
    sample), killed and restarted like a dead one, so its episodes are re-queued.

    Pass it to ``WorkflowExecutor(runner=...)``; the executor attaches it to its event loop.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        *,
        num_procs: int,
        episodes_per_proc: int = 8,
        mp_context: str = "forkserver",
        episode_timeout_s: float | None = None,
    ) -> None:
        import multiprocessing as mp

        if num_procs < 1 or episodes_per_proc < 1:
            raise ValueError(f"num_procs and episodes_per_proc must be >= 1, got {num_procs}, {episodes_per_proc}")
        if episode_timeout_s is not None and episode_timeout_s <= 0:
            raise ValueError(f"episode_timeout_s must be > 0 or None, got {episode_timeout_s}")
        self.episode_timeout_s = episode_timeout_s
        self.stalls = 0
        self.spec = spec
        self.num_procs = num_procs
        self.episodes_per_proc = episodes_per_proc
        self._ctx = mp.get_context(mp_context)
        if mp_context == "forkserver":
            self._ctx.set_forkserver_preload(["areno.engine.executor"])  # restarts fork a warm process
        self._slots: list[_Slot] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._free: asyncio.Event | None = None
        self._next_dispatch = 0
        self._reader: threading.Thread | None = None
        self._stopping = threading.Event()
        self._slots_lock = threading.Lock()
        self.restarts = 0

    def _spawn(self, generation: int) -> _Slot:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(
            target=_worker_main, args=(self.spec, child_conn), daemon=True, name="areno-rollout-worker"
        )
        proc.start()
        child_conn.close()  # so the parent sees EOF when the child dies
        return _Slot(proc, parent_conn, generation)

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the processes and the result reader; futures resolve on ``loop``."""
        if self._loop is not None:
            return
        self._loop = loop
        self._slots = [self._spawn(0) for _ in range(self.num_procs)]
        self._free = asyncio.Event()
        loop.call_soon_threadsafe(self._free.set)
        self._reader = threading.Thread(target=self._read, name="areno-rollout-results", daemon=True)
        self._reader.start()

    @property
    def pids(self) -> list[int]:
        return [slot.proc.pid for slot in self._slots]

    def inflight_per_proc(self) -> list[int]:
        return [len(slot.inflight) for slot in self._slots]

    async def arun(self, sample: dict[str, Any]) -> list[Trajectory] | None:
        """Run one episode in a worker process; raises ``RemoteEpisodeError`` or ``WorkerLost``."""
        assert self._loop is not None and self._free is not None, "attach() the runner to a loop first"
        while True:
            candidates = [i for i, s in enumerate(self._slots) if s.alive and len(s.inflight) < self.episodes_per_proc]
            if candidates:
                break
            self._free.clear()
            await self._free.wait()
        idx = min(candidates, key=lambda i: len(self._slots[i].inflight))
        slot = self._slots[idx]
        dispatch_id = self._next_dispatch
        self._next_dispatch += 1
        future = self._loop.create_future()
        slot.inflight[dispatch_id] = future
        slot.started[dispatch_id] = (time.monotonic(), describe_sample(sample))
        try:
            slot.conn.send((dispatch_id, sample))
        except (BrokenPipeError, OSError):
            pass  # the process just died; the reader declares it and fails this future
        try:
            status, payload = await future
        finally:
            slot.inflight.pop(dispatch_id, None)
            slot.started.pop(dispatch_id, None)
            self._free.set()
        if status == "ok":
            return payload
        if status == "lost":
            raise WorkerLost(payload)
        raise RemoteEpisodeError(payload)

    # ---- reader thread: results and deaths ----
    def _read(self) -> None:
        from multiprocessing.connection import wait

        assert self._loop is not None
        while not self._stopping.is_set():
            with self._slots_lock:
                by_conn = {slot.conn: (i, slot) for i, slot in enumerate(self._slots) if slot.alive}
            ready = wait(list(by_conn), timeout=0.1)
            for conn in ready:
                idx, slot = by_conn[conn]
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    slot.alive = False
                    self._loop.call_soon_threadsafe(self._on_death, idx, slot.generation)
                    continue
                if msg[0] == _READY:
                    slot.ready_at = time.monotonic()
                    continue
                self._loop.call_soon_threadsafe(self._on_result, slot, *msg)
            # a process killed before it ever wrote may still be caught by EOF above; poll too
            with self._slots_lock:
                for idx, slot in enumerate(self._slots):
                    if slot.alive and not slot.proc.is_alive():
                        slot.alive = False
                        self._loop.call_soon_threadsafe(self._on_death, idx, slot.generation)
                    elif slot.alive and slot.stalled is None:
                        self._check_stalled(idx, slot)

    def _check_stalled(self, idx: int, slot: _Slot) -> None:
        """Reader thread: kill a process holding an episode past ``episode_timeout_s``; its death
        is then handled like any other (restart, episodes re-queued)."""
        if self.episode_timeout_s is None or slot.ready_at is None:
            return
        now = time.monotonic()
        ages = [(now - max(t0, slot.ready_at), what) for t0, what in list(slot.started.values())]
        overdue = [(age, what) for age, what in ages if age > self.episode_timeout_s]
        if not overdue:
            return
        age, what = max(overdue)
        slot.stalled = (
            f"stalled: an episode of dataset {what} ran {age:.1f}s, past episode_timeout_s={self.episode_timeout_s:g}s"
        )
        logger.warning(
            "rollout worker process %d (pid %s) %s; killing and restarting it", idx, slot.proc.pid, slot.stalled
        )
        self.stalls += 1
        slot.proc.kill()

    def _on_result(self, slot: _Slot, dispatch_id: int, status: str, payload: Any) -> None:
        future = slot.inflight.get(dispatch_id)
        if future is not None and not future.done():
            future.set_result((status, payload))

    def _on_death(self, idx: int, generation: int) -> None:
        slot = self._slots[idx]
        if slot.generation != generation or self._stopping.is_set():
            return
        slot.proc.join(timeout=5)  # EOF can arrive before the process is reaped
        exitcode = slot.proc.exitcode
        why = slot.stalled or f"died with exit code {exitcode}"
        logger.warning(
            "rollout worker process %d (pid %s) %s; restarting it and re-queueing its %d in-flight samples",
            idx,
            slot.proc.pid,
            why,
            len(slot.inflight),
        )
        for future in list(slot.inflight.values()):
            if not future.done():
                future.set_result(("lost", f"rollout worker process {idx} (pid {slot.proc.pid}) {why}"))
        slot.inflight.clear()
        slot.started.clear()
        slot.conn.close()
        with self._slots_lock:
            self._slots[idx] = self._spawn(generation + 1)
        self.restarts += 1
        assert self._free is not None
        self._free.set()

    def kill(self, idx: int) -> None:
        """SIGKILL one worker process (fault injection for tests)."""
        import os
        import signal

        os.kill(self._slots[idx].proc.pid, signal.SIGKILL)

    def stop(self) -> None:
        self._stopping.set()
        if self._reader is not None:
            self._reader.join()
        for slot in self._slots:
            try:
                slot.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for slot in self._slots:
            slot.proc.join(timeout=5)
            if slot.proc.is_alive():
                slot.proc.kill()
                slot.proc.join()
            slot.conn.close()
        self._slots = []
