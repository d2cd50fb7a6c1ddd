"""One attempt at one sample, and the rollout pool's failure policy (``WorkflowExecutor``'s).

A workflow that raises counts as a failed episode and its sample is retried up to ``max_retries``
times, then dropped with a warning naming it. A workflow that returns something other than a
Trajectory, a list of them or None (``WorkflowReturnError``) fails the same way, but is warned
about once per run, without a traceback: it is the workflow's bug, the same on every row. A
generation request past its deadline (``RolloutRequestTimeout``), an unreachable rollout server, a rollout worker process that died
and an episode past ``episode_timeout_s`` are infrastructure faults, not the sample's: they are
counted (``request_timeouts``, ``server_errors``, ``worker_lost``, ``episode_timeouts``) and the
sample re-queued, bounded the same way. ``RolloutServersLost`` (no server can come back) is
raised: no retry could succeed.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass
from typing import Any

from httpx import TransportError

from areno.engine.episode_processes import ProcessEpisodeRunner, WorkerLost
from areno.rollout.client import (
    NoHealthyServerError,
    RolloutClient,
    RolloutRequestTimeout,
    RolloutServerError,
    RolloutServersLost,
    wait_for_result,
)
from areno.rollout.errors import RequestRejected
from areno.types import Trajectory
from areno.workflows.base import (
    RolloutWorkflow,
    WorkflowReturnError,
    as_group,
    raised_in_workflow,
    run_episode_name,
)
from areno.workflows.common import describe_sample

logger = logging.getLogger(__name__)


class EpisodeTimeout(TimeoutError):
    """An in-process episode ran past the executor's ``episode_timeout_s`` and was cancelled."""


@dataclass
class EpisodeTask:
    index: int
    """Position of the sample in the stream (unique per sample, kept across retries)."""
    sample: dict[str, Any]
    attempts: int = 0
    """Attempts whose workflow raised."""
    lost: int = 0
    """Attempts lost because the rollout worker process running them died."""
    stale: int = 0
    """Attempts aborted or dropped for falling more than η versions behind (the pool re-queues them)."""
    refused: bool = False
    """The rollout engine refused its request (``refused_request``): dropped at once, the row's own fault."""


class EpisodeAttempts:
    """Runs attempts of samples (in this process, or on a ``ProcessEpisodeRunner``) and decides
    what each outcome means for the sample; counts every outcome in ``counts``."""

    def __init__(
        self,
        client: RolloutClient | None,
        workflow: RolloutWorkflow | None,
        *,
        runner: ProcessEpisodeRunner | None,
        max_retries: int,
        episode_timeout_s: float | None,
        counts: collections.Counter[str],
    ) -> None:
        self.client = client
        self.workflow = workflow
        self.runner = runner
        self.max_retries = max_retries
        self.episode_timeout_s = episode_timeout_s
        self.counts = counts
        self.last_drop = ""
        """The error of the last sample dropped after all its attempts."""
        self.workflow_broken = False
        """Whether that error was the workflow's own (``WorkflowReturnError``, or raised in its code), not
        the rollout side's."""
        self.request_refused = False
        """Whether that error was the engine refusing the sample's own request (``refused_request``)."""
        self._warned_return = False
        self._raised_in_code = False

    @property
    def user_workflow(self) -> RolloutWorkflow | None:
        """The user's workflow (the engine wraps it, e.g. in ``LedgerWorkflow``: ``inner``)."""
        workflow = self.workflow
        while workflow is not None and getattr(workflow, "inner", None) is not None:
            workflow = workflow.inner
        return workflow

    @property
    def drop_advice(self) -> str:
        """What a run stopped by dropped samples tells the user to fix, after the last error."""
        if self.request_refused:
            return (
                "the rollout engine refuses these rows' requests, not a failing rollout side: fix or filter the rows "
                "(a prompt longer than rollout.max_model_len, a token outside the vocabulary)"
            )
        if self.workflow_broken:
            workflow = self.user_workflow
            if not self._raised_in_code or workflow is None:  # its return value (WorkflowReturnError)
                return "rollout.workflow is failing, not the data or the rollout side; fix its run_episode"
            return (
                f"rollout.workflow {run_episode_name(workflow)} raised it in its own code, not the data or the "
                "rollout side: fix it"
            )
        return (
            "the rollout side is failing, not the data; fix the error above (the rollout engine or server "
            "log has the cause)"
        )

    async def arun(self, task: EpisodeTask) -> tuple[str, list[Trajectory] | None]:
        """One attempt at one sample: ``ok`` (group), ``rejected``, ``retry`` or ``dropped``."""
        self.counts["episodes_started"] += 1
        try:
            if self.runner is not None:
                group = await self.runner.arun(task.sample)
            else:
                episode = self.workflow.run_episode(self.client, task.sample)
                try:
                    result = await wait_for_result(episode, self.episode_timeout_s)
                    group = as_group(result, source=run_episode_name(self.workflow))
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
            self.counts[counter] += 1
            task.lost += 1
            self.counts["requeued"] += 1
            if task.lost <= self.max_retries:
                unhealthy = _none_healthy(self.client)
                if unhealthy:  # re-sent at once, it would only wait in the client for a server to recover
                    logger.warning(
                        "not re-queueing dataset %s (%s) onto an unhealthy server (%s): it waits for a server to "
                        "answer /health again, at most rollout.request_timeout_s (attempt %d of %d): %s",
                        describe_sample(task.sample),
                        counter,
                        unhealthy,
                        task.lost + 1,
                        self.max_retries + 1,
                        exc,
                    )
                else:
                    logger.warning("re-queueing dataset %s (%s): %s", describe_sample(task.sample), counter, exc)
                return "retry", None
            self.counts["dropped_failed"] += 1
            self.last_drop = f"{type(exc).__name__}: {exc}"
            self.workflow_broken = self.request_refused = False
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
            self.counts["rejected"] += 1
            return "rejected", None
        self.counts["accepted"] += 1
        self.counts["trajectories"] += len(group)
        self.counts["reward_errors"] += sum("reward_error" in t.info for t in group)
        return "ok", group

    def _failed(self, task: EpisodeTask, exc: BaseException) -> tuple[str, None]:
        """The workflow raised: count, retry up to ``max_retries`` times, then drop with a warning."""
        task.attempts += 1
        self.counts["failed_episodes"] += 1
        what = f"{type(exc).__name__}: {exc}"
        if refused_request(exc):  # the same request is refused again on every attempt: no retry
            self.counts["dropped_failed"] += 1
            self.counts["refused_requests"] += 1
            task.refused = True
            self.last_drop = what
            self.workflow_broken, self.request_refused = False, True
            logger.warning(
                "dropping dataset %s: the rollout engine refused its request (not retried; counted in "
                "rollout/refused_requests): %s",
                describe_sample(task.sample),
                what,
            )
            return "dropped", None
        contract = isinstance(exc, WorkflowReturnError)
        if contract:  # the same bug on every row: one warning, no traceback through areno's internals
            level = logging.DEBUG if self._warned_return else logging.WARNING
            self._warned_return = True
            logger.log(
                level,
                "%s (dataset %s; its episodes are retried and dropped like failed ones, counted in "
                "rollout/failed_episodes and rollout/dropped_failed; warned once)",
                exc,
                describe_sample(task.sample),
            )
        if task.attempts <= self.max_retries:
            logger.log(
                logging.DEBUG if contract else logging.WARNING,
                "episode failed for dataset %s (attempt %d of %d), retrying: %s",
                describe_sample(task.sample),
                task.attempts,
                self.max_retries + 1,
                what,
            )
            return "retry", None
        self.counts["dropped_failed"] += 1
        self.last_drop = what
        user = self.user_workflow
        self._raised_in_code = not contract and user is not None and raised_in_workflow(user, exc)
        self.workflow_broken = contract or self._raised_in_code
        self.request_refused = False
        logger.log(
            logging.DEBUG if contract else logging.WARNING,
            "dropping dataset %s after %d failed attempts: %s",
            describe_sample(task.sample),
            task.attempts,
            what,
            exc_info=None if contract else exc,
        )
        return "dropped", None


def refused_request(exc: BaseException) -> bool:
    """Whether ``exc`` is the rollout side refusing a request for what it holds (``RequestRejected`` in
    process, a 4xx other than a timeout or rate limit from a server), which a retry sends again."""
    if isinstance(exc, RequestRejected):
        return True
    status = getattr(exc, "status", None) if isinstance(exc, RolloutServerError) else None
    return status is not None and 400 <= status < 500 and status not in (408, 429)


def _none_healthy(client: Any) -> str | None:
    """When the rollout client routes over servers of which none is healthy now (a
    ``MultiServerRolloutClient`` with a health monitor, possibly wrapped: ``inner``), which; else None."""
    while client is not None and getattr(client, "inner", None) is not None:
        client = client.inner
    health, urls = getattr(client, "health", None), getattr(client, "urls", None)
    if health is None or not urls or any(health.is_healthy(u) for u in urls):
        return None
    if len(urls) == 1:
        return f"{urls[0]} is the only rollout server"
    return f"none of the {len(urls)} rollout servers is healthy"
