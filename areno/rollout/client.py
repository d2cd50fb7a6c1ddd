"""``RolloutClient``: the one interface workflows use to generate, in process or over HTTP.

``InProcessRolloutClient`` owns a background thread that calls ``engine.step()`` while requests are
unfinished, so many concurrent ``agenerate`` coroutines (from one or several event loops) land in
the same running batch. ``HTTPRolloutClient`` talks to ``areno serve`` (``server.py``) through its
token-level ``/generate`` endpoint. ``MultiServerRolloutClient`` spreads requests round-robin over
several servers and, given a ``HealthMonitor`` (``health.py``, which pings through this module's
``HTTPRolloutClient``; the client needs only a ``ServerHealthView``), routes only to healthy ones;
given ``lost`` (what the partitioned engine knows of its workers' processes), a request that finds
every server gone for good raises ``RolloutServersLost`` at once instead of waiting for a recovery.

Hangs: every request has a deadline (``request_timeout_s``, from ``rollout.request_timeout_s``).
A request past it is aborted (in the engine, or by ``POST /abort`` on the server) and raises
``RolloutRequestTimeout`` naming the server, the request and the fix, so a stalled engine or
server never hangs a rollout worker forever; the workflow executor counts and retries the episode.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import threading
import uuid
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any, Protocol

from areno.errors import RunFailure
from areno.models.vision import ImageInputs
from areno.observe.trace import async_span
from areno.rollout.engine import RolloutEngine, UnknownRequestError
from areno.rollout.requests import CheckedPrompt, routes_from_json
from areno.rollout.wire import decode_arrays
from areno.types import GenerationOutput, SamplingParams

logger = logging.getLogger("areno.rollout.client")


class ServerHealthView(Protocol):
    """What ``MultiServerRolloutClient`` asks of a health source (``health.HealthMonitor`` is one)."""

    def is_healthy(self, url: str) -> bool:
        """Whether requests may go to ``url``."""

    def report_failure(self, url: str, reason: str) -> None:
        """A request to ``url`` got no answer."""

    async def await_healthy(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for any server to be healthy; True if one is."""

    def describe(self) -> dict[str, str]:
        """``url -> state`` in words, for error messages."""


class RolloutRequestTimeout(TimeoutError):
    """A generation request did not finish within its deadline; it was aborted."""

    def __init__(
        self, *, server: str, request_id: str | None, timeout_s: float, prompt_tokens: int, max_new_tokens: int
    ) -> None:
        super().__init__(
            f"rollout request {request_id or '(unnamed)'} to {server} did not finish within {timeout_s:g}s "
            f"(prompt {prompt_tokens} tokens, max_new_tokens {max_new_tokens}) and was aborted: check that "
            f"the server is alive (its /health and log); if generations are legitimately this long, raise "
            f"rollout.request_timeout_s"
        )
        self.server, self.request_id, self.timeout_s = server, request_id, timeout_s


class RolloutServerError(RuntimeError):
    """A rollout server answered with an error status or could not be reached."""

    def __init__(self, message: str, *, server: str, status: int | None = None) -> None:
        super().__init__(message)
        self.server, self.status = server, status
        """HTTP status of the answer; None when there was none (connection refused or reset)."""


class NoHealthyServerError(RunFailure):
    """Every rollout server of a ``MultiServerRolloutClient`` is unhealthy or unreachable."""


def _deadline(timeout_s: float | None) -> float | None:
    """``None`` / 0 mean no deadline."""
    return timeout_s if timeout_s else None


class RolloutServersLost(RunFailure):
    """Every rollout server is gone for good (its worker process died): no recovery can come, so
    the request fails at once; the rollout pool stops on it rather than re-queueing samples."""

    training_side_intact = True
    """The training side is not touched by it: the Trainer saves an emergency checkpoint of the
    step reached before the run stops."""
    in_flight: str | None = None


class RolloutClient(abc.ABC):
    """Generates one completion per call; implementations batch concurrent calls."""

    @abc.abstractmethod
    async def agenerate(
        self, prompt_ids: list[int], sampling_params: SamplingParams, *, request_id: str | None = None
    ) -> GenerationOutput:
        """Generate a completion of ``prompt_ids``; returns when the request finishes or is aborted."""

    async def agenerate_many(self, prompt_ids: list[int], params: list[SamplingParams]) -> list[GenerationOutput]:
        """One completion of ``prompt_ids`` per entry of ``params`` (a GRPO group: the same prompt,
        per-sample seeds), in order. Clients over HTTP send them as one request to one server, so
        the group shares its prompt's KV blocks there, and the in-process client adds them to its
        engine together; this default runs ``agenerate`` per entry.
        The ``areno serve`` clients also take ``images=`` (an ``ImageInputs``), sent with the group."""
        return list(await asyncio.gather(*(self.agenerate(prompt_ids, p) for p in params)))

    async def aclose(self) -> None:
        """Release background resources (threads, connections)."""


async def agenerate_many(
    client: Any, prompt_ids: list[int], params: list[SamplingParams], *, images: Any = None
) -> list[GenerationOutput]:
    """``client.agenerate_many`` when the client has it, else one ``agenerate`` per entry: workflows
    call this so any object with an ``agenerate`` coroutine keeps working as a client. ``images``
    (a vision-language prompt's ``ImageInputs``) go with each ``agenerate``; the group shares the
    image prefill through the engine's prefix cache; to an ``areno serve`` server (partitioned
    placement) they go with the whole group in one request."""
    if images is not None:
        if isinstance(getattr(client, "inner", client), (HTTPRolloutClient, MultiServerRolloutClient)):
            return await client.agenerate_many(prompt_ids, params, images=images)
        return list(await asyncio.gather(*(client.agenerate(prompt_ids, p, images=images) for p in params)))
    many = getattr(client, "agenerate_many", None)
    if many is not None:
        return await many(prompt_ids, params)
    return list(await asyncio.gather(*(client.agenerate(prompt_ids, p) for p in params)))


class TokenStream:
    """One request of ``InProcessRolloutClient.stream``: iterating it yields ``(output ids, log-probs)``
    so far each time the engine made more of them (after a step, or a round trip of several; a
    slow consumer gets them together), then the ``GenerationOutput``. ``close()`` (also when the
    iteration is cancelled or left early, or the stream is dropped unread) aborts the request if it
    has not finished; past the client's ``request_timeout_s`` it is aborted and
    ``RolloutRequestTimeout`` raised."""

    def __init__(
        self,
        client: InProcessRolloutClient,
        request_id: str,
        future: asyncio.Future,
        progress: asyncio.Queue,
        prompt_tokens: int,
        max_new_tokens: int,
    ) -> None:
        self.client, self.request_id = client, request_id
        self._future, self._progress = future, progress
        self._prompt_tokens, self._max_new_tokens = prompt_tokens, max_new_tokens
        timeout_s = client.request_timeout_s
        self._deadline = None if timeout_s is None else future.get_loop().time() + timeout_s
        # a stream dropped before anyone iterated it (a client gone before its response started): the
        # garbage collector may run this on any thread, holding any lock, so it only names the request
        # for the driver thread to abort between steps (a deque's append takes no lock)
        self._finalizer = weakref.finalize(self, client._orphans.append, request_id)
        self._finalizer.atexit = False

    def __aiter__(self) -> AsyncIterator[tuple[list[int], list[float]] | GenerationOutput]:
        return self._events()

    async def _events(self) -> AsyncIterator[tuple[list[int], list[float]] | GenerationOutput]:
        loop, future, progress = self._future.get_loop(), self._future, self._progress
        ids: list[int] = []
        logprobs: list[float] = []
        try:
            while not future.done():
                get = asyncio.ensure_future(progress.get())
                left = None if self._deadline is None else max(self._deadline - loop.time(), 0.0)
                try:
                    await asyncio.wait((get, future), timeout=left, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    get.cancel()
                if get.done() and not get.cancelled():
                    new_ids, new_lps = get.result()
                    while not progress.empty():
                        more_ids, more_lps = progress.get_nowait()
                        new_ids, new_lps = new_ids + more_ids, new_lps + more_lps
                    ids.extend(new_ids)
                    logprobs.extend(new_lps)
                    if not future.done():
                        yield ids, logprobs  # the running lists: read them, do not keep them
                elif not future.done():
                    assert self.client.request_timeout_s is not None
                    raise RolloutRequestTimeout(
                        server="the in-process rollout engine",
                        request_id=self.request_id,
                        timeout_s=self.client.request_timeout_s,
                        prompt_tokens=self._prompt_tokens,
                        max_new_tokens=self._max_new_tokens,
                    )
            output = future.result()
        finally:
            self.close()
        yield output

    def close(self) -> None:
        """Abort the request unless it finished (idempotent; on the stream's event loop)."""
        self._finalizer.detach()
        with self.client._pending_lock:
            self.client._streams.pop(self.request_id, None)
        if not self._future.done():
            self.client._abort_quietly(self.request_id)
            self._future.cancel()


class InProcessRolloutClient(RolloutClient):
    """Drives a ``RolloutEngine`` of this process from a background thread, or, with
    ``caller_drives``, from the thread that waits for the requests (``drive_until``).

    Why a CPU run wants the caller to drive: GNU OpenMP (PyTorch's CPU thread pool) keeps a team of
    worker threads per thread that ran a parallel op, and once the process's workers outnumber its
    cores every team's waits throttle to a few spins before sleeping in the kernel, so each of a
    decode step's small ops pays a thread wake-up. A rollout engine stepped from a second thread
    beside a trainer that computes on the main thread ran 1.7x slower on two cores for that alone
    (bench/LOG.md); stepped from the main thread, the process has one team."""

    def __init__(
        self,
        engine: RolloutEngine,
        *,
        idle_wait_s: float = 0.01,
        request_timeout_s: float | None = None,
        caller_drives: bool = False,
    ) -> None:
        """``request_timeout_s``: deadline of one ``agenerate`` (None or 0: none); past it the
        request is aborted in the engine and ``RolloutRequestTimeout`` raised. ``caller_drives``: a
        caller in ``drive_until`` steps the engine (``WorkflowExecutor.rollout_batch``, a synchronous
        run's every rollout); requests made while no caller drives start the background thread as
        usual, which ends once the engine is idle (its thread team with it)."""
        if request_timeout_s is not None and request_timeout_s < 0:
            raise ValueError(f"request_timeout_s must be >= 0 or None, got {request_timeout_s}")
        self.engine = engine
        self.caller_drives = caller_drives
        self.idle_wait_s = idle_wait_s
        self.request_timeout_s = _deadline(request_timeout_s)
        self._pending: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._pending_lock = threading.Lock()
        self._wakeup = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._callers = 0
        """Threads in ``drive_until`` (guarded by ``_pending_lock``)."""
        self._orphans: collections.deque[str] = collections.deque()
        """Streamed requests nobody reads any more (dropped unread, or their event loop closed): the
        driver thread aborts them between steps."""
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, list[int]]] = {}
        """``stream`` requests: their loop, their progress queue and ``[tokens already pushed]``
        (guarded by ``_pending_lock``)."""

    # ---- public ----
    async def agenerate(
        self,
        prompt_ids: list[int],
        sampling_params: SamplingParams,
        *,
        request_id: str | None = None,
        images: Any = None,
    ) -> GenerationOutput:
        """``images``: the ``ImageInputs`` of a vision-language prompt (``RolloutEngine.add_request``)."""
        request_id, future = self._add(prompt_ids, sampling_params, request_id, images)
        return await self._await_requests([request_id], future, len(prompt_ids), sampling_params.max_new_tokens)

    def _add(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None,
        images: Any,
        *,
        stream: bool = False,
    ) -> tuple[str, asyncio.Future]:
        """Put one request into the engine; its id and the future its output resolves (``stream``:
        its progress is handed over too, see ``_push_progress``)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._pending_lock:
            # add_request validates (ValueError) before the future is registered.
            request_id = self.engine.add_request(prompt_ids, params, request_id, images=images)
            self._pending[request_id] = (loop, future)
            if stream:
                self._streams[request_id] = (loop, asyncio.Queue(), [0])
        self._ensure_thread()  # after the add: an idle driver thread ending now cannot miss it
        self._wakeup.set()
        return request_id, future

    def stream(
        self,
        prompt_ids: list[int],
        sampling_params: SamplingParams,
        *,
        request_id: str | None = None,
        images: Any = None,
    ) -> TokenStream:
        """``agenerate``, step by step (see ``TokenStream``). The request enters the engine now: one the
        engine refuses raises its ValueError here, before anything is streamed. Call it in the event
        loop that iterates the stream."""
        request_id, future = self._add(prompt_ids, sampling_params, request_id, images, stream=True)
        progress = self._streams[request_id][1]
        return TokenStream(self, request_id, future, progress, len(prompt_ids), sampling_params.max_new_tokens)

    async def agenerate_many(self, prompt_ids: list[int], params: list[SamplingParams]) -> list[GenerationOutput]:
        """The group's requests enter the engine together, in order: added under one lock, the
        driver thread woken once. One ``agenerate`` task per sample added them a loop turn later,
        each waking the driver thread, which then contended with the adds for the GIL."""
        if not params:
            return []
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in params]
        request_ids: list[str] = []
        shared = _checked_prompt(prompt_ids, self.engine)
        try:
            with self._pending_lock:
                for p, future in zip(params, futures):
                    # add_request validates (ValueError) before the future is registered.
                    request_ids.append(self.engine.add_request(shared, p))
                    self._pending[request_ids[-1]] = (loop, future)
        except Exception:
            self._abort_all_quietly(request_ids)  # the group is refused as a whole
            raise
        self._ensure_thread()  # after the adds: a driver thread started now sees the whole group
        self._wakeup.set()
        max_new = max(p.max_new_tokens for p in params)
        gathered = asyncio.gather(*futures)
        gathered.add_done_callback(_retrieve_cancellation)
        return list(await self._await_requests(request_ids, gathered, len(prompt_ids), max_new))

    async def _await_requests(self, request_ids: list[str], done: Any, prompt_tokens: int, max_new_tokens: int) -> Any:
        """Await ``done`` (the requests' future, or their gathered futures) within the deadline; the
        requests are aborted when it passes (``RolloutRequestTimeout``) or the caller is cancelled."""
        try:
            with async_span(
                "rollout_request", "rollout", request_ids[0], prompt_tokens=prompt_tokens, samples=len(request_ids)
            ):
                return await wait_for_result(done, self.request_timeout_s)
        except asyncio.CancelledError:
            self._abort_all_quietly(request_ids)
            raise
        except TimeoutError:
            self._abort_all_quietly(request_ids)
            assert self.request_timeout_s is not None
            raise RolloutRequestTimeout(
                server="the in-process rollout engine",
                request_id=request_ids[0],
                timeout_s=self.request_timeout_s,
                prompt_tokens=prompt_tokens,
                max_new_tokens=max_new_tokens,
            ) from None

    def abort(self, request_id: str) -> GenerationOutput:
        """Abort a request; its ``agenerate`` returns the partial output (finish reason ``abort``)."""
        output = self.engine.abort(request_id)
        self._resolve(output)
        return output

    def wake(self) -> None:
        """Tell the driver thread to look for work now (after ``engine.resume()`` or ``wake()``)."""
        self._wakeup.set()

    def close(self) -> None:
        self._stop.set()
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    @property
    def num_pending(self) -> int:
        with self._pending_lock:
            return len(self._pending)

    def drive_until(self, submit: Callable[[], concurrent.futures.Future]) -> concurrent.futures.Future:
        """``submit()`` (which makes requests from another thread, e.g. an event loop's) and return
        its future once done. With ``caller_drives`` this thread steps the engine meanwhile (the
        background thread stands aside); without, the background thread does and this returns at once."""
        if not self.caller_drives:
            return submit()
        with self._pending_lock:
            self._callers += 1  # before submit(): its requests must not start the background thread
        try:
            done = submit()
            done.add_done_callback(lambda _: self._wakeup.set())
            while not done.done():
                self._drive_once()
        finally:
            with self._pending_lock:
                self._callers -= 1
        self._ensure_thread()  # requests made meanwhile by others still run
        return done

    # ---- driver thread ----
    def _ensure_thread(self) -> None:
        with self._pending_lock:
            if self.caller_drives and (self._callers or not self._has_work_locked()):
                return  # a caller steps the engine (drive_until), or there is nothing to step
            if self._thread is None or not self._thread.is_alive():
                self._stop.clear()
                self._thread = threading.Thread(target=self._drive, name="areno-rollout-driver", daemon=True)
                self._thread.start()

    def _has_work_locked(self) -> bool:
        return bool(self._pending) or self.engine.has_unfinished()

    def _drive(self) -> None:
        while not self._stop.is_set():
            if self.caller_drives:
                with self._pending_lock:  # end when idle or a caller drives: the thread's team goes too
                    if self._callers or not self._has_work_locked():
                        self._thread = None
                        return
            self._drive_once()

    def _drive_once(self) -> None:
        """One engine step, or a short wait for work when there is none to step."""
        while self._orphans:
            request_id = self._orphans.popleft()
            with self._pending_lock:
                self._streams.pop(request_id, None)
            self._abort_quietly(request_id)
        if not self.engine.has_unfinished() or self.engine.is_paused or self.engine.is_sleeping:
            self._wakeup.wait(self.idle_wait_s)
            self._wakeup.clear()
            return
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - handed to every waiting caller, not hidden
            self._fail_all(exc)
            return
        if self._streams:
            self._push_progress()
        if outputs:
            self._resolve(*outputs)

    def _push_progress(self) -> None:
        """Hand each ``stream`` request the tokens it made since the last hand-over."""
        with self._pending_lock:
            streams = dict(self._streams)
        made = self.engine.progress({request_id: pushed[0] for request_id, (_, _, pushed) in streams.items()})
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        for request_id, (ids, logprobs) in made.items():
            loop, queue, pushed = streams[request_id]
            pushed[0] += len(ids)
            by_loop.setdefault(loop, []).append((queue, (ids, logprobs)))
        for loop, items in by_loop.items():  # one wake-up per loop, as _resolve
            if not _hand_over(loop, _put_all, items):  # nobody reads them: stop generating them
                self._orphans.extend(rid for rid, (lp, _, _) in streams.items() if lp is loop)

    def _resolve(self, *outputs: GenerationOutput) -> None:
        """Hand finished requests to their callers: one wake-up per event loop, however many
        finished (a fixed-length batch ends all at once: one write and wake-up each cost the loop
        thread a GIL hand-off per request after the last step)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future, GenerationOutput]]] = {}
        with self._pending_lock:
            for output in outputs:
                entry = self._pending.pop(output.request_id, None)
                if entry is not None:
                    by_loop.setdefault(entry[0], []).append((entry[1], output))
        for loop, results in by_loop.items():
            _hand_over(loop, _set_results, results)

    def _fail_all(self, exc: BaseException) -> None:
        with self._pending_lock:
            entries = list(self._pending.items())
            self._pending.clear()
        for request_id, (loop, future) in entries:
            try:
                self.engine.abort(request_id)
            except UnknownRequestError:
                pass
            _hand_over(loop, _set_exception, future, exc)

    def _abort_quietly(self, request_id: str) -> None:
        with self._pending_lock:
            self._pending.pop(request_id, None)
        try:
            self.engine.abort(request_id)
        except UnknownRequestError:
            pass  # it finished in the meantime

    def _abort_all_quietly(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._abort_quietly(request_id)


async def wait_for_result(awaitable: Any, timeout_s: float | None) -> Any:
    """``asyncio.wait_for``, except that a cancel arriving with the result is not lost: Python 3.11's
    returns the result then, and a cancelled episode (a stale abort, a stopping pool, an evaluation's
    first failure) went on to its next turn or its reward."""
    result = await asyncio.wait_for(awaitable, timeout_s)
    raise_if_cancelled()
    return result


def raise_if_cancelled() -> None:
    """CancelledError when the running task has a cancel pending (see ``wait_for_result``)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def _checked_prompt(prompt_ids: Any, engine: RolloutEngine) -> Any:
    """A group's prompt converted and checked once for all its samples (``CheckedPrompt``), or, where
    that fails or it is not a plain sequence of ids, as given: ``add_request`` then raises its own
    error for it, in its own order (a torn engine's first), as it did when each sample checked it."""
    vocab_size = getattr(engine, "vocab_size", None)
    if vocab_size is None or not isinstance(prompt_ids, Sequence) or isinstance(prompt_ids, (str, bytes)):
        return prompt_ids
    try:
        return CheckedPrompt.of(prompt_ids, vocab_size)
    except Exception:  # noqa: BLE001 - not hidden: add_request raises it again, in its place
        return prompt_ids


def _retrieve_cancellation(gathered: asyncio.Future) -> None:
    # Python 3.11's gather, cancelled through wait_for, ends with a CancelledError set as its exception
    # that nothing reads: every episode cancelled at shutdown or for staleness logged "exception was
    # never retrieved".
    if not gathered.cancelled():
        gathered.exception()


def _set_result(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _hand_over(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> bool:
    """``fn(*args)`` on ``loop``; False when the loop has closed (its callers are gone: the driver
    thread must not end over them)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        return False
    return True


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def _set_results(results: list[tuple[asyncio.Future, Any]]) -> None:
    for future, value in results:
        _set_result(future, value)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


class HTTPRolloutClient(RolloutClient):
    """Talks to an ``areno serve`` server (token ids in, ``GenerationOutput`` out)."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout_s: float | None = 3600.0,
        connect_timeout_s: float = 10.0,
    ) -> None:
        """``timeout_s``: deadline of one whole request (None or 0: none), enforced end to end, not
        per read; past it the request is aborted on the server and ``RolloutRequestTimeout`` raised.
        ``connect_timeout_s``: how long to wait for a TCP connection."""
        import httpx

        if timeout_s is not None and timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0 or None, got {timeout_s}")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        self.timeout_s = _deadline(timeout_s)
        # httpx's own limits are per phase; the end-to-end deadline is asyncio.wait_for below.
        self._client = httpx.AsyncClient(
            base_url=self.base_url, headers=headers, timeout=httpx.Timeout(None, connect=connect_timeout_s)
        )
        self._token_encoding: str | None = "base64"
        """What the token routes are asked for (``_post``); None for a server that predates the field."""

    async def agenerate(
        self,
        prompt_ids: list[int],
        sampling_params: SamplingParams,
        *,
        request_id: str | None = None,
        images: ImageInputs | None = None,
    ) -> GenerationOutput:
        """``images``: a vision-language prompt's pixels, sent in the body (``ImageInputs.to_wire``)."""
        request_id = request_id or f"req-{uuid.uuid4().hex}"  # named, so a timed-out one can be aborted
        body = {
            "prompt_ids": list(prompt_ids),
            "sampling_params": dataclasses.asdict(sampling_params),
            "request_id": request_id,
        }
        if images is not None:
            body["images"] = images.to_wire()
        try:
            response = await wait_for_result(self._post("/generate", body), self.timeout_s)
        except TimeoutError:
            await self._abort_quietly(request_id)
            assert self.timeout_s is not None
            raise RolloutRequestTimeout(
                server=self.base_url,
                request_id=request_id,
                timeout_s=self.timeout_s,
                prompt_tokens=len(prompt_ids),
                max_new_tokens=sampling_params.max_new_tokens,
            ) from None
        # httpx.TransportError (refused, reset) propagates as is: callers that fail over catch it
        if response.status_code != 200:
            raise RolloutServerError(
                f"{self.base_url}/generate answered {response.status_code}: {_error_message(response)}",
                server=self.base_url,
                status=response.status_code,
            )
        return _output_from_json(response.json())

    async def agenerate_many(
        self, prompt_ids: list[int], params: list[SamplingParams], *, images: ImageInputs | None = None
    ) -> list[GenerationOutput]:
        """All of ``params`` in one ``POST /generate_many`` (one HTTP round trip per group; its
        ``images`` once for the group)."""
        if not params:
            return []
        request_ids = [f"req-{uuid.uuid4().hex}" for _ in params]
        body = {
            "prompt_ids": list(prompt_ids),
            "sampling_params": [dataclasses.asdict(p) for p in params],
            "request_ids": request_ids,
        }
        if images is not None:
            body["images"] = images.to_wire()
        try:
            response = await wait_for_result(self._post("/generate_many", body), self.timeout_s)
        except TimeoutError:
            for request_id in request_ids:
                await self._abort_quietly(request_id)
            assert self.timeout_s is not None
            raise RolloutRequestTimeout(
                server=self.base_url,
                request_id=request_ids[0],
                timeout_s=self.timeout_s,
                prompt_tokens=len(prompt_ids),
                max_new_tokens=max(p.max_new_tokens for p in params),
            ) from None
        if response.status_code != 200:
            raise RolloutServerError(
                f"{self.base_url}/generate_many answered {response.status_code}: {_error_message(response)}",
                server=self.base_url,
                status=response.status_code,
            )
        return [_output_from_json(o) for o in response.json()["outputs"]]

    async def _post(self, route: str, body: dict[str, Any]) -> Any:
        """POST a token route, asking for its token-level results as arrays (``wire.py``: a float's JSON text
        costs ~1 us a value beside the server's engine); a server that predates ``token_encoding`` refuses
        the field, and is then asked for plain lists from here on."""
        if self._token_encoding is not None:
            response = await self._client.post(route, json={**body, "token_encoding": self._token_encoding})
            if response.status_code not in (400, 422) or "token_encoding" not in _error_message(response):
                return response
            self._token_encoding = None
        return await self._client.post(route, json=body)

    async def _abort_quietly(self, request_id: str) -> None:
        """Best effort: a stalled server may not answer this either."""
        import httpx

        try:
            await asyncio.wait_for(
                self._client.post("/abort", json={"request_id": request_id}), min(5.0, self.timeout_s or 5.0)
            )
        except (TimeoutError, httpx.HTTPError):
            pass

    async def ahealth(self, timeout_s: float) -> None:
        """``GET /health`` within ``timeout_s``; raises ``RolloutServerError`` or ``TimeoutError``."""
        await get_health(self._client, self.base_url, timeout_s)

    async def aclose(self) -> None:
        await self._client.aclose()


class MultiServerRolloutClient(RolloutClient):
    """Several rollout servers: round-robin over them (``areno serve``), or to the one with the fewest
    requests in flight (``least_loaded``, as vLLM/SGLang servers are used).

    With a ``HealthMonitor`` only servers it holds healthy get requests; one marked unhealthy is
    skipped until its ``/health`` answers again. A server that cannot be reached is reported to the
    monitor and the request goes to the next one; a 4xx (a bad request) is raised at once. When no
    server is healthy the request waits for one to recover, up to its deadline, then raises
    ``NoHealthyServerError`` naming every server. A request that every server has failed
    ``max_failures_per_server`` times (a 5xx from an engine whose steps raise, while its ``/health``
    still answers) raises ``NoHealthyServerError`` with the servers' errors at once, instead of
    going round until the deadline. With ``lost`` (``() -> {url: why}``, the servers that cannot come
    back, e.g. because their worker process died), a request that finds no routable server asks it
    (in a thread) before waiting, and raises ``RolloutServersLost`` with the reasons when every
    server is lost.
    """

    def __init__(
        self,
        urls: list[str],
        *,
        api_key: str | None = None,
        request_timeout_s: float | None = 600.0,
        health: ServerHealthView | None = None,
        max_failures_per_server: int = 3,
        lost: Callable[[], dict[str, str]] | None = None,
        new_client: Callable[[str], Any] | None = None,
        least_loaded: bool = False,
    ) -> None:
        """``new_client(url)``: the client of one server (default: an ``HTTPRolloutClient`` of
        ``areno serve``; inference servers of other systems give theirs, made per event loop);
        it raises ``RolloutServerError`` / ``httpx.TransportError`` / ``RolloutRequestTimeout``
        like ``HTTPRolloutClient``. ``least_loaded``: send each request to the routable server
        with the fewest requests in flight from this client (ties round-robin)."""
        if not urls:
            raise ValueError("MultiServerRolloutClient needs at least one rollout server URL")
        if max_failures_per_server < 1:
            raise ValueError(f"max_failures_per_server must be >= 1, got {max_failures_per_server}")
        self.max_failures_per_server = max_failures_per_server
        self.urls = [u.rstrip("/") for u in urls]
        self.api_key = api_key
        self.request_timeout_s = _deadline(request_timeout_s)
        self.health = health
        self.lost = lost
        self._next = itertools.count()
        self._per_loop: dict[asyncio.AbstractEventLoop, tuple[list[Any], AsyncGenerator[None, None]]] = {}
        """Each event loop's clients (httpx clients belong to one loop), with the generator that closes them."""
        self.requests_per_server = [0] * len(self.urls)
        self.new_client = new_client or (
            lambda url: HTTPRolloutClient(url, self.api_key, timeout_s=self.request_timeout_s)
        )
        self.least_loaded = least_loaded
        self.in_flight = [0] * len(self.urls)
        """Requests of this client under way at each server (all event loops)."""

    async def _aclients(self) -> list[Any]:
        loop = asyncio.get_running_loop()
        entry = self._per_loop.get(loop)
        if entry is None:
            clients = [self.new_client(u) for u in self.urls]
            entry = self._per_loop[loop] = (clients, self._aloop_lifetime(loop, clients))
            # started, the generator is the loop's: its shutdown (the end of an ``asyncio.run``, e.g. an
            # evaluation's) closes it, and so these clients; left open they kept their sockets and the loop
            await anext(entry[1])
        return entry[0]

    async def _aloop_lifetime(self, loop: asyncio.AbstractEventLoop, clients: list[Any]) -> AsyncGenerator[None, None]:
        try:
            yield
        finally:
            del self._per_loop[loop]
            await asyncio.gather(*(client.aclose() for client in clients))

    def _routable(self) -> list[int]:
        first = next(self._next) % len(self.urls)
        order = [(first + k) % len(self.urls) for k in range(len(self.urls))]
        if self.least_loaded:
            order.sort(key=lambda i: self.in_flight[i])  # stable: ties keep the round-robin order
        if self.health is None:
            return order
        return [i for i in order if self.health.is_healthy(self.urls[i])]

    async def agenerate(
        self,
        prompt_ids: list[int],
        sampling_params: SamplingParams,
        *,
        request_id: str | None = None,
        images: ImageInputs | None = None,
    ) -> GenerationOutput:
        extra = {} if images is None else {"images": images}  # other systems' clients take no images
        return await self._route(lambda c: c.agenerate(prompt_ids, sampling_params, request_id=request_id, **extra))

    async def agenerate_many(
        self, prompt_ids: list[int], params: list[SamplingParams], *, images: ImageInputs | None = None
    ) -> list[GenerationOutput]:
        """The whole group to one server (its samples share the prompt's KV blocks there)."""
        if not params:
            return []
        extra = {} if images is None else {"images": images}
        return await self._route(lambda c: c.agenerate_many(prompt_ids, params, **extra))

    async def _route(self, call: Any) -> Any:
        """``call(client)`` on the next healthy server, failing over as the class docstring says."""
        import httpx

        clients = await self._aclients()
        loop = asyncio.get_running_loop()
        deadline = None if self.request_timeout_s is None else loop.time() + self.request_timeout_s
        errors: dict[str, str] = {}
        failures = [0] * len(self.urls)
        while min(failures) < self.max_failures_per_server:
            for i in self._routable():
                self.in_flight[i] += 1
                try:
                    out = await call(clients[i])
                except (RolloutServerError, httpx.TransportError) as exc:
                    if isinstance(exc, RolloutServerError) and exc.status is not None and exc.status < 500:
                        raise  # the request is bad, not the server
                    exc = (
                        RolloutServerError(f"unreachable ({type(exc).__name__}: {exc})", server=self.urls[i])
                        if isinstance(exc, httpx.TransportError)
                        else exc
                    )
                    errors[self.urls[i]] = str(exc)
                    failures[i] += 1
                    if self.health is not None:
                        self.health.report_failure(self.urls[i], str(exc))
                    logger.warning("rollout server %s failed a request (%s); trying the next server", self.urls[i], exc)
                    continue
                except RolloutRequestTimeout as exc:
                    if self.health is not None:
                        self.health.report_failure(self.urls[i], str(exc))
                    raise
                finally:
                    self.in_flight[i] -= 1
                self.requests_per_server[i] += 1
                return out
            # nothing routable (or every server failed this round): wait for a recovery
            left = None if deadline is None else deadline - loop.time()
            if self.health is None or (left is not None and left <= 0):
                break
            if self.lost is not None:
                gone = await asyncio.to_thread(self.lost)
                if all(u in gone for u in self.urls):
                    raise RolloutServersLost(
                        "every rollout server is gone: " + "; ".join(f"{u}: {gone[u]}" for u in self.urls)
                    )
            if not await self.health.await_healthy(min(left, 1.0) if left is not None else 1.0):
                continue
        if min(failures) >= self.max_failures_per_server:
            raise NoHealthyServerError(
                f"every rollout server failed this request {self.max_failures_per_server} times "
                f"({'; '.join(f'{u}: {e}' for u, e in errors.items())}): fix the servers (see their logs)"
            )
        states = self.health.describe() if self.health is not None else errors
        raise NoHealthyServerError(
            f"no rollout server could take the request ({'; '.join(f'{u}: {e}' for u, e in states.items())}): "
            f"start or fix the servers (see their logs)"
        )

    async def aclose(self) -> None:
        """Close this event loop's clients (an ``asyncio.run`` closes them at its end anyway)."""
        entry = self._per_loop.get(asyncio.get_running_loop())
        if entry is not None:
            await entry[1].aclose()


def _output_from_json(fields: dict[str, Any]) -> GenerationOutput:
    """A ``GenerationOutput`` from ``areno serve``'s JSON (routes as ``requests.routes_to_json`` wrote them,
    token-level fields as lists or as ``wire.encode_arrays`` wrote them)."""
    fields = decode_arrays(fields)
    return GenerationOutput(**{**fields, "routes_TLK": routes_from_json(fields.get("routes_TLK"))})


async def get_health(http: Any, base_url: str, timeout_s: float) -> None:
    """``GET /health`` on ``http`` (an ``httpx.AsyncClient`` of ``base_url``) within ``timeout_s``;
    raises ``RolloutServerError`` (no answer, or not 200) or ``TimeoutError``."""
    import httpx

    try:
        response = await asyncio.wait_for(http.get("/health"), timeout_s)
    except httpx.TransportError as exc:
        raise RolloutServerError(f"{type(exc).__name__}: {exc}", server=base_url) from None
    if response.status_code != 200:
        raise RolloutServerError(
            f"/health answered {response.status_code}: {_error_message(response)}",
            server=base_url,
            status=response.status_code,
        )


def _error_message(response: Any) -> str:
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response.text
