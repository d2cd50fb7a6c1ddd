"""``StreamingServerClient``: one inference server's streamed token-level generation endpoint.

A subclass says what to send (``request_body``) and how one streamed event adds to the output
(``absorb``); this class streams the server-sent events, stamps every new token with the version
``version()`` gives when it arrives, enforces the request's deadline end to end (closing the
stream, which aborts the request on the server) and turns failures into ``RolloutServerError``.
"""

from __future__ import annotations

import abc
import json
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from areno.rollout.client import (
    RolloutClient,
    RolloutRequestTimeout,
    RolloutServerError,
    get_health,
    wait_for_result,
)
from areno.types import GenerationOutput, SamplingParams


@dataclass
class StreamState:
    """What one request has received so far."""

    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None


class StreamActivity:
    """When the streams of a set of clients last received a token, and how many are open.

    A token is stamped with the version served when it *arrives*; a reader that lags (a busy
    host) would stamp tokens generated before a policy sync with the version after it. The
    rollout side waits, with the servers paused, until the open streams have been quiet for a
    while (:meth:`wait_quiet`) before it moves the version on."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = 0
        self._last = 0.0

    def opened(self) -> None:
        with self._lock:
            self._open += 1

    def closed(self) -> None:
        with self._lock:
            self._open -= 1

    def touch(self) -> None:
        with self._lock:
            self._last = time.monotonic()

    def wait_quiet(self, quiet_s: float, cap_s: float) -> float:
        """Block until no stream is open or none received a token for ``quiet_s`` (at most
        ``cap_s``); returns the seconds waited."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < cap_s:
            with self._lock:
                if self._open == 0 or time.monotonic() - self._last >= quiet_s:
                    break
            time.sleep(0.02)
        return time.monotonic() - t0


class StreamingServerClient(RolloutClient):
    """A server's streamed generation endpoint (see the module docstring)."""

    path: str
    """The generation endpoint (``POST``, server-sent events)."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        version: Callable[[], int] = lambda: 0,
        timeout_s: float | None = 3600.0,
        connect_timeout_s: float = 10.0,
        transport: Any = None,
        activity: StreamActivity | None = None,
    ) -> None:
        """``version()``: the policy version the server serves now (the rollout side's).
        ``activity``: shared with the rollout side, which waits on it before a version moves on.
        ``timeout_s``: deadline of one whole request (None or 0: none). ``transport``: an httpx
        transport (tests replay recorded answers through ``httpx.MockTransport``)."""
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        self.version = version
        self.activity = activity or StreamActivity()
        self.timeout_s = timeout_s or None  # 0: no deadline
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(None, connect=connect_timeout_s),
            transport=transport,
        )

    @abc.abstractmethod
    def request_body(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> dict[str, Any]:
        """The JSON body of one streamed generation request."""

    @abc.abstractmethod
    def absorb(self, state: StreamState, event: dict[str, Any]) -> tuple[list[int], list[float]]:
        """Fold one streamed event into ``state`` (text, finish reason); returns the new tokens and
        their log-probs (the caller appends them with their version)."""

    def event_version(self, event: dict[str, Any]) -> int | None:
        """The policy version the server says produced this event's tokens (None: it says none,
        and the tokens take the rollout side's version as they arrive)."""
        return None

    async def agenerate(
        self, prompt_ids: list[int], sampling_params: SamplingParams, *, request_id: str | None = None
    ) -> GenerationOutput:
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        state = StreamState()
        body = self.request_body(list(prompt_ids), sampling_params, request_id)
        self.activity.opened()
        try:
            await wait_for_result(self._astream(body, state), self.timeout_s)
        except TimeoutError:
            assert self.timeout_s is not None
            raise RolloutRequestTimeout(
                server=self.base_url,
                request_id=request_id,
                timeout_s=self.timeout_s,
                prompt_tokens=len(prompt_ids),
                max_new_tokens=sampling_params.max_new_tokens,
            ) from None
        finally:
            self.activity.closed()
        if state.finish_reason is None:  # the stream ended without a last event: the server went away
            raise RolloutServerError(
                f"{self.base_url}{self.path} ended the stream of {request_id} before it finished", server=self.base_url
            )
        return GenerationOutput(
            request_id=request_id,
            prompt_ids=list(prompt_ids),
            output_ids=state.output_ids,
            output_logprobs=state.output_logprobs,
            output_versions=state.output_versions,
            finish_reason=state.finish_reason,
            text=state.text,
        )

    async def _astream(self, body: dict[str, Any], state: StreamState) -> None:
        # closing the stream (a deadline, a cancelled episode) makes the server abort the request
        async with self._client.stream("POST", self.path, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                raise RolloutServerError(
                    f"{self.base_url}{self.path} answered {response.status_code}: {response.text[:500]}",
                    server=self.base_url,
                    status=response.status_code,
                )
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:  # a failure after the stream began (an engine error)
                    raise RolloutServerError(
                        f"{self.base_url}{self.path} failed mid-stream: {event['error']}",
                        server=self.base_url,
                        status=500,
                    )
                ids, logprobs = self.absorb(state, event)
                self.activity.touch()
                version = self.event_version(event)
                if version is None:
                    version = self.version()
                state.output_ids += ids
                state.output_logprobs += logprobs
                state.output_versions += [version] * len(ids)

    async def ahealth(self, timeout_s: float) -> None:
        """``GET /health`` within ``timeout_s``; raises ``RolloutServerError`` or ``TimeoutError``."""
        await get_health(self._client, self.base_url, timeout_s)

    async def aclose(self) -> None:
        await self._client.aclose()
