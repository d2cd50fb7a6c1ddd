"""Rollout worker processes: episodes run in child processes that are restarted when they die.

``ProcessEpisodeRunner`` is what ``WorkflowExecutor(runner=...)`` runs episodes on instead of its
own event loop: each child builds its workflow and client from a ``WorkerSpec`` (dotted paths, so
the spec pickles into a fresh process), a dead or stalled child is restarted and the episodes it
held fail with ``WorkerLost``, which the executor re-queues.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from multiprocessing import connection
from typing import Any

from areno.types import Trajectory
from areno.workflows.base import WorkflowReturnError, _import_dotted, as_group, load_workflow, run_episode_name
from areno.workflows.common import describe_sample

logger = logging.getLogger(__name__)


class WorkerLost(RuntimeError):
    """The rollout worker process running an episode died (or was killed as stalled) before returning it."""


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
    ``(dispatch_id, status, payload)`` back (``ok``: the group; ``contract``: run_episode returned
    the wrong type; ``error``: it raised); ``None`` ends the process."""

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
                group = as_group(await workflow.run_episode(client, sample), source=run_episode_name(workflow))
                conn.send((dispatch_id, "ok", group))
            except WorkflowReturnError as exc:  # the workflow's own bug: the parent warns once and blames it
                conn.send((dispatch_id, "contract", str(exc)))
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
        if num_procs < 1 or episodes_per_proc < 1:
            raise ValueError(f"num_procs and episodes_per_proc must be >= 1, got {num_procs}, {episodes_per_proc}")
        if episode_timeout_s is not None and episode_timeout_s <= 0:
            raise ValueError(f"episode_timeout_s must be > 0 or None, got {episode_timeout_s}")
        self.episode_timeout_s = episode_timeout_s
        self.stalls = 0
        self.spec = spec
        self.num_procs = num_procs
        self.episodes_per_proc = episodes_per_proc
        self._ctx = multiprocessing.get_context(mp_context)
        if mp_context == "forkserver":
            self._ctx.set_forkserver_preload([__name__])  # restarts fork a warm process
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
        """Run one episode in a worker process; raises ``RemoteEpisodeError``, ``WorkerLost``, or
        ``WorkflowReturnError`` (its ``run_episode`` returned something other than trajectories)."""
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
        if status == "contract":
            raise WorkflowReturnError(payload)
        raise RemoteEpisodeError(payload)

    # ---- reader thread: results and deaths ----
    def _read(self) -> None:
        assert self._loop is not None
        while not self._stopping.is_set():
            with self._slots_lock:
                by_conn = {slot.conn: (i, slot) for i, slot in enumerate(self._slots) if slot.alive}
            ready = connection.wait(list(by_conn), timeout=0.1)
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
