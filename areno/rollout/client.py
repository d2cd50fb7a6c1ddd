"""``RolloutClient``: the one interface workflows use to generate, in process or over HTTP.

``InProcessRolloutClient`` owns a background thread that calls ``engine.step()`` while requests are
unfinished, so many concurrent ``agenerate`` coroutines (from one or several event loops) land in
the same running batch. ``HTTPRolloutClient`` talks to ``areno serve`` (``server.py``) through its
token-level ``/generate`` endpoint.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import threading
from typing import Any

from areno.api.types import GenerationOutput, SamplingParams
from areno.observe.trace import async_span
from areno.rollout.engine import RolloutEngine, UnknownRequestError


class RolloutClient(abc.ABC):
    """Generates one completion per call; implementations batch concurrent calls."""

    @abc.abstractmethod
    async def agenerate(
        self, prompt_ids: list[int], sampling_params: SamplingParams, *, request_id: str | None = None
    ) -> GenerationOutput:
        """Generate a completion of ``prompt_ids``; returns when the request finishes or is aborted."""

    async def aclose(self) -> None:
        """Release background resources (threads, connections)."""


class InProcessRolloutClient(RolloutClient):
    """Drives a ``RolloutEngine`` of this process from a background thread."""

    def __init__(self, engine: RolloutEngine, *, idle_wait_s: float = 0.01) -> None:
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self._pending: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._pending_lock = threading.Lock()
        self._wakeup = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- public ----
    async def agenerate(
        self, prompt_ids: list[int], sampling_params: SamplingParams, *, request_id: str | None = None
    ) -> GenerationOutput:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._ensure_thread()
        with self._pending_lock:
            # add_request validates (ValueError) before the future is registered.
            request_id = self.engine.add_request(prompt_ids, sampling_params, request_id)
            self._pending[request_id] = (loop, future)
        self._wakeup.set()
        try:
            with async_span("rollout_request", "rollout", request_id, prompt_tokens=len(prompt_ids)):
                return await future
        except asyncio.CancelledError:
            self._abort_quietly(request_id)
            raise

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

    # ---- driver thread ----
    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._drive, name="areno-rollout-driver", daemon=True)
            self._thread.start()

    def _drive(self) -> None:
        while not self._stop.is_set():
            if not self.engine.has_unfinished() or self.engine.is_paused or self.engine.is_sleeping:
                self._wakeup.wait(self.idle_wait_s)
                self._wakeup.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - handed to every waiting caller, not hidden
                self._fail_all(exc)
                continue
            for output in outputs:
                self._resolve(output)

    def _resolve(self, output: GenerationOutput) -> None:
        with self._pending_lock:
            entry = self._pending.pop(output.request_id, None)
        if entry is not None:
            loop, future = entry
            loop.call_soon_threadsafe(_set_result, future, output)

    def _fail_all(self, exc: BaseException) -> None:
        with self._pending_lock:
            entries = list(self._pending.items())
            self._pending.clear()
        for request_id, (loop, future) in entries:
            try:
                self.engine.abort(request_id)
            except UnknownRequestError:
                pass
            loop.call_soon_threadsafe(_set_exception, future, exc)

    def _abort_quietly(self, request_id: str) -> None:
        with self._pending_lock:
            self._pending.pop(request_id, None)
        try:
            self.engine.abort(request_id)
        except UnknownRequestError:
            pass  # it finished in the meantime


def _set_result(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


class HTTPRolloutClient(RolloutClient):
    """Talks to an ``areno serve`` server (token ids in, ``GenerationOutput`` out)."""

    def __init__(self, base_url: str, api_key: str | None = None, *, timeout_s: float = 3600.0) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        self._client = httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=timeout_s)

    async def agenerate(
        self, prompt_ids: list[int], sampling_params: SamplingParams, *, request_id: str | None = None
    ) -> GenerationOutput:
        body = {
            "prompt_ids": list(prompt_ids),
            "sampling_params": dataclasses.asdict(sampling_params),
            "request_id": request_id,
        }
        response = await self._client.post("/generate", json=body)
        if response.status_code != 200:
            raise RuntimeError(f"{self.base_url}/generate answered {response.status_code}: {_error_message(response)}")
        return GenerationOutput(**response.json())

    async def aclose(self) -> None:
        await self._client.aclose()


def _error_message(response: Any) -> str:
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response.text
