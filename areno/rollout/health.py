"""``HealthMonitor``: pings rollout servers' ``GET /health`` and says which ones to route to.

A background thread checks every server each ``interval_s`` (all at once, each within
``timeout_s``). A server that misses ``max_misses`` checks in a row — no answer in time, a refused
connection, a non-200 answer — is marked unhealthy and a warning names it; requests that fail to
reach it (``report_failure``) count as misses too, so a dead server is dropped from routing at the
first failed request rather than at the next ping. One successful check marks it healthy again
(logged), and ``MultiServerRolloutClient`` routes to it again. ``metrics()`` gives
``rollout/healthy_servers``, ``rollout/unhealthy_servers`` and per-server ``rollout/server_<i>_healthy``
(the order of ``urls``) for the metrics logger.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field

from areno.rollout.client import HTTPRolloutClient, RolloutServerError

logger = logging.getLogger("areno.rollout.health")


@dataclass
class ServerHealth:
    """What the monitor knows about one server."""

    url: str
    healthy: bool = True
    """Routable. Servers start healthy; ``max_misses`` misses in a row mark them unhealthy."""
    misses: int = 0
    """Consecutive failed checks (or reported request failures)."""
    last_error: str | None = None
    last_ok: float | None = None
    """``time.monotonic()`` of the last successful check."""
    checks: int = 0
    transitions: list[tuple[float, bool]] = field(default_factory=list)
    """``(time.monotonic(), healthy)`` at every change, for tests and post-mortems."""


class HealthMonitor:
    """Periodic ``/health`` checks of rollout servers; see the module docstring."""

    def __init__(
        self,
        urls: list[str],
        *,
        interval_s: float = 5.0,
        timeout_s: float = 2.0,
        max_misses: int = 3,
        api_key: str | None = None,
        lost_after_s: float | None = None,
    ) -> None:
        """
        Args:
            urls: base URLs of ``areno serve`` servers (``http://host:port``).
            interval_s: seconds between two rounds of checks.
            timeout_s: how long one ``/health`` may take before it counts as a miss.
            max_misses: consecutive misses that mark a server unhealthy (>= 1).
            api_key: sent as a bearer token (``/health`` itself needs none).
            lost_after_s: what the owner does with a server silent this long (the partitioned engine
                declares its worker lost: ``PartitionedCluster.check_stalls``), said in the warning
                that marks it unhealthy; None: nothing.
        """
        if not urls:
            raise ValueError("HealthMonitor needs at least one server URL")
        if interval_s <= 0 or timeout_s <= 0:
            raise ValueError(f"interval_s and timeout_s must be > 0, got {interval_s}, {timeout_s}")
        if max_misses < 1:
            raise ValueError(f"max_misses must be >= 1, got {max_misses}")
        self.urls = [u.rstrip("/") for u in urls]
        self.interval_s, self.timeout_s, self.max_misses = interval_s, timeout_s, max_misses
        self.api_key = api_key
        self.lost_after_s = lost_after_s
        self._created_at = time.monotonic()
        self._state = {u: ServerHealth(u) for u in self.urls}
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ queries (any thread)
    def is_healthy(self, url: str) -> bool:
        with self._lock:
            return self._state[url.rstrip("/")].healthy

    def healthy_urls(self) -> list[str]:
        with self._lock:
            return [u for u in self.urls if self._state[u].healthy]

    def state(self, url: str) -> ServerHealth:
        with self._lock:
            s = self._state[url.rstrip("/")]
            return ServerHealth(s.url, s.healthy, s.misses, s.last_error, s.last_ok, s.checks, list(s.transitions))

    def silent_for(self, url: str) -> float:
        """Seconds since ``url`` last answered ``/health`` (since the monitor was made, if never)."""
        with self._lock:
            last = self._state[url.rstrip("/")].last_ok
        return time.monotonic() - (last if last is not None else self._created_at)

    def describe(self) -> dict[str, str]:
        """``url -> "healthy"`` or ``"unhealthy after N misses: <last error>"``."""
        with self._lock:
            return {
                u: "healthy" if s.healthy else f"unhealthy after {s.misses} misses: {s.last_error}"
                for u, s in self._state.items()
            }

    def metrics(self) -> dict[str, float]:
        with self._lock:
            healthy = [self._state[u].healthy for u in self.urls]
        out = {
            "rollout/healthy_servers": float(sum(healthy)),
            "rollout/unhealthy_servers": float(len(healthy) - sum(healthy)),
        }
        out.update({f"rollout/server_{i}_healthy": float(h) for i, h in enumerate(healthy)})
        return out

    async def await_healthy(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for any server to be healthy; True if one is."""
        deadline = time.monotonic() + timeout_s
        while not self.healthy_urls():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            await asyncio.sleep(min(left, self.interval_s / 4, 0.25))
        return True

    # ------------------------------------------------------------------ updates
    def report_failure(self, url: str, reason: str) -> None:
        """A request to ``url`` failed to get an answer: count it as a missed check."""
        self._record(url.rstrip("/"), ok=False, error=reason)

    def _record(self, url: str, *, ok: bool, error: str | None = None) -> None:
        with self._changed:
            s = self._state[url]
            s.checks += 1
            if ok:
                s.misses, s.last_ok = 0, time.monotonic()
                if not s.healthy:
                    s.healthy = True
                    s.transitions.append((time.monotonic(), True))
                    logger.warning("rollout server %s is healthy again; routing requests to it", url)
            else:
                s.misses += 1
                s.last_error = error
                if s.healthy and s.misses >= self.max_misses:
                    s.healthy = False
                    s.transitions.append((time.monotonic(), False))
                    logger.warning(
                        "rollout server %s marked unhealthy after %d missed health checks (last: %s); %s",
                        url,
                        s.misses,
                        error,
                        self._meanwhile_locked(url),
                    )
            self._changed.notify_all()

    def _meanwhile_locked(self, url: str) -> str:
        """What happens to requests while ``url`` is unhealthy (under the lock)."""
        others = [u for u in self.urls if u != url and self._state[u].healthy]
        if others:
            then = f"requests go to the {len(others)} other healthy server(s) until it answers /health again"
        else:
            alone = "it is the only rollout server" if len(self.urls) == 1 else "no other rollout server is healthy"
            then = (
                f"{alone}: no request is sent (requests in flight there wait, each up to rollout.request_timeout_s) "
                "until a server answers /health again"
            )
        if self.lost_after_s:
            then += f"; if it gives no answer for {self.lost_after_s:g} s it is declared lost and the run stops"
        return then

    async def acheck_once(self) -> dict[str, bool]:
        """One round: ping every server concurrently; returns ``url -> answered``."""
        clients = [
            HTTPRolloutClient(u, self.api_key, timeout_s=None, connect_timeout_s=self.timeout_s) for u in self.urls
        ]

        async def aping(client: HTTPRolloutClient) -> tuple[str, str | None]:
            try:
                await client.ahealth(self.timeout_s)
            except TimeoutError:
                return client.base_url, f"/health did not answer within {self.timeout_s:g}s"
            except RolloutServerError as exc:
                return client.base_url, str(exc)
            return client.base_url, None

        try:
            results = await asyncio.gather(*(aping(c) for c in clients))
        finally:
            await asyncio.gather(*(c.aclose() for c in clients))
        for url, error in results:
            self._record(url, ok=error is None, error=error)
        return {url: error is None for url, error in results}

    def check_once(self) -> dict[str, bool]:
        """``acheck_once`` from synchronous code (not from inside a running event loop)."""
        return asyncio.run(self.acheck_once())

    # ------------------------------------------------------------------ background thread
    def start(self) -> HealthMonitor:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="areno-rollout-health", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        async def aloop() -> None:
            while not self._stop.is_set():
                t0 = time.monotonic()
                await self.acheck_once()
                while not self._stop.is_set() and time.monotonic() - t0 < self.interval_s:  # noqa: ASYNC110 - a stop flag set from another thread
                    await asyncio.sleep(min(0.05, self.interval_s))

        asyncio.run(aloop())

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + self.timeout_s + 5)
            self._thread = None

    def __enter__(self) -> HealthMonitor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
