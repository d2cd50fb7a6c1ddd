"""The remote sides: the training and rollout workers of a ``PartitionedCluster`` (partitioned).

``RemoteTrainingSide`` calls the scheduler's ``TrainWorker``s; ``RemoteRolloutSide`` reaches the
``RolloutWorker``s' HTTP servers through a ``MultiServerRolloutClient`` steered by a
``HealthMonitor``. A policy sync is a collective (``WeightKind.COLLECTIVE``, the stream
transport): the training ranks start sending, the rollout ranks receive, and the controller waits
for every rank, failing fast on the first error. Each rollout worker pauses its own engine for the
commit, so nothing is paused from here.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from pathlib import Path

import torch

from areno.engine.partitioned import PartitionedCluster, gather_fail_fast
from areno.engine.rollout_side import RolloutSide
from areno.engine.seams import SideSetup, WeightKind, WeightUpdate
from areno.engine.training_side import TrainingSide
from areno.rollout.client import MultiServerRolloutClient
from areno.rollout.health import HealthMonitor
from areno.types import TokenBatch

logger = logging.getLogger(__name__)


class RemoteTrainingSide(TrainingSide):
    """The cluster's training workers: every call goes to each of them, rank 0 answers."""

    weight_kinds = frozenset({WeightKind.COLLECTIVE})

    def __init__(self, cluster: PartitionedCluster) -> None:
        self.cluster = cluster

    def start(self, setup: SideSetup) -> None:
        self.cluster.launch(setup.model_dir)  # both roles: they form one world

    def step(self, batch: TokenBatch, *, pass_order: list[int] | None, policy_version: int) -> dict[str, float]:
        return self.cluster.scheduler.call("train", "step", pickle.dumps(batch), pass_order, policy_version)[0]

    def publish_weights(self, version: int, kind: WeightKind) -> WeightUpdate | None:
        assert kind is WeightKind.COLLECTIVE, kind
        t0 = time.perf_counter()
        self.cluster.check_workers()  # the sync needs every rank of the world
        check_s = time.perf_counter() - t0
        sending = self.cluster.scheduler.submit("train", "sync", version)
        return WeightUpdate(
            version=version,
            kind=kind,
            sending=tuple(sending),
            sender_metrics={"policy_sync_controller_check_s": check_s},
            started_at=t0,
        )

    def save(self, path: Path, extra_state: dict) -> None:
        self.cluster.check_workers()
        scheduler = self.cluster.scheduler
        for role in scheduler.call("train", "trainable_roles")[0]:
            # DCP's collectives span the world: rollout ranks join with nothing to write
            gather_fail_fast(
                scheduler.submit("train", "save_role", str(path / role), role, extra_state)
                + scheduler.submit("rollout", "join_checkpoint", str(path / role), False)
            )

    def load(self, path: Path) -> dict:
        scheduler = self.cluster.scheduler
        state: dict = {}
        for role in scheduler.call("train", "trainable_roles")[0]:
            results = gather_fail_fast(
                scheduler.submit("train", "load_role", str(path / role), role)
                + scheduler.submit("rollout", "join_checkpoint", str(path / role), True)
            )
            state = results[0]
        return state

    def export_hf(self, path: Path) -> None:
        self.cluster.scheduler.call("train", "export_hf", str(path))

    def shutdown(self) -> None:
        self.cluster.stop("train")


class RemoteRolloutSide(RolloutSide):
    """The cluster's rollout replicas behind one client that routes around unhealthy ones."""

    weight_kinds = frozenset({WeightKind.COLLECTIVE})

    LOST_CHECK_EVERY_S = 1.0
    """``lost_replicas`` asks the workers at most this often (every waiting request calls it)."""

    # set in start()
    health: HealthMonitor | None = None
    _client: MultiServerRolloutClient | None = None

    def __init__(self, cluster: PartitionedCluster) -> None:
        self.cluster = cluster
        self._version = 0
        self._last_engine_stats: list[dict[str, float]] | None = None
        self._lost_lock = threading.Lock()
        self._lost_seen: tuple[float, dict[str, str]] = (float("-inf"), {})
        """``lost_replicas``' last answer and when it was taken."""

    def start(self, setup: SideSetup) -> None:
        cluster = self.cluster
        cluster.launch(setup.model_dir)  # a no-op after the training side's
        urls = cluster.replica_urls()
        self.health = HealthMonitor(urls, api_key=cluster.api_key).start()
        self._client = MultiServerRolloutClient(
            urls,
            api_key=cluster.api_key,
            request_timeout_s=cluster.config.rollout.request_timeout_s,
            health=self.health,
            lost=self.lost_replicas,
        )

    @property
    def client(self) -> MultiServerRolloutClient:
        assert self._client is not None, "start() the rollout side first"
        return self._client

    @property
    def version(self) -> int:
        return self._version

    def pause(self) -> None:
        """Nothing: each worker pauses its engine to commit a sync, and requests spread over
        several servers cannot be started as one batch."""

    def resume(self) -> None:
        """Nothing (see :meth:`pause`)."""

    def update_weights(self, update: WeightUpdate) -> dict[str, float]:
        assert update.kind is WeightKind.COLLECTIVE, update.kind
        receiving = self.cluster.scheduler.submit("rollout", "sync", update.version)
        results = gather_fail_fast(list(update.sending) + receiving)
        self._version = update.version  # every rollout engine committed (all-or-nothing)
        sent, received = results[: len(update.sending)], results[len(update.sending) :]
        # a training rank's figures, but generation stopped as long as the slowest rollout commit;
        # where the time went: the training rank's phases, the slowest rollout rank's per phase
        # (policy_sync_rollout_phase_*), and the controller's own (worker check, whole call)
        rollout_phases = {
            k.replace("policy_sync_phase_", "policy_sync_rollout_phase_"): max(r.get(k, 0.0) for r in received)
            for k in received[0]
            if k.startswith("policy_sync_phase_")
        }
        return {
            **sent[0],
            **rollout_phases,
            "policy_sync_generation_paused_s": max(r["policy_sync_generation_paused_s"] for r in received),
            **update.sender_metrics,
            "policy_sync_controller_s": time.perf_counter() - update.started_at,
        }

    def metrics(self) -> dict[str, float]:
        return {**self.health.metrics(), **self._engine_metrics()}

    def _engine_metrics(self) -> dict[str, float]:
        """Per step, from every rollout replica's engine counters (its TP leader's) since the previous step: busy
        fraction (time in steps that ran a batch over wall time; 1 - its idle fraction), generated
        tokens/s, preemptions, KV usage."""
        try:
            stats = self.cluster.scheduler.call("rollout", "engine_stats")
        except Exception as exc:  # noqa: BLE001 - a lost replica is handled by check_workers / the client
            logger.debug("rollout engine stats unavailable: %s", exc)
            self._last_engine_stats = None
            return {}
        n_train = self.cluster.layout.n_train
        now = [stats[r - n_train] for r in self.cluster.layout.replica_leaders()]  # a TP replica counts once
        last, self._last_engine_stats = self._last_engine_stats, now
        if last is None or len(last) != len(now):
            return {}
        return engine_metrics(last, now)

    def rng_state(self) -> torch.Tensor | None:
        return None  # each worker's sampler keeps its own generator

    def set_rng_state(self, state: torch.Tensor) -> None:
        """Nothing to restore (see :meth:`rng_state`)."""

    def lost_replicas(self) -> dict[str, str]:
        """The rollout client's ``lost``: ``url -> why`` for each replica one of whose ranks died
        (a TP replica cannot serve without all of them, and the world cannot take a new process),
        so requests fail with the cause instead of waiting ``rollout.request_timeout_s`` for a
        recovery that cannot come."""
        with self._lost_lock:
            checked_at, lost = self._lost_seen
            if time.monotonic() - checked_at >= self.LOST_CHECK_EVERY_S:
                dead = self.cluster.dead_workers("rollout", timeout_s=5)
                n_train = self.cluster.layout.n_train
                lost = {}
                for url, group in zip(self.client.urls, self.cluster.layout.rollout_tp_groups()):
                    why = next((dead[r - n_train] for r in group if r - n_train in dead), None)
                    if why is not None:
                        lost[url] = why
                self._lost_seen = (time.monotonic(), lost)
            return lost

    def shutdown(self) -> None:
        if self.health is not None:
            self.health.stop()
        self.cluster.stop("rollout")


def engine_metrics(last: list[dict[str, float]], now: list[dict[str, float]]) -> dict[str, float]:
    """The ``rollout/engine_*`` figures between two reads of every replica's ``engine_stats``."""
    busy, tokens, wall = [], 0.0, []
    for a, b in zip(last, now):
        dt = max(b["clock_s"] - a["clock_s"], 1e-9)
        wall.append(dt)
        busy.append((b["busy_s"] - a["busy_s"]) / dt)
        tokens += b["generated_tokens"] - a["generated_tokens"]

    def deltas(key: str) -> list[float]:  # each replica's counter since the previous step
        return [b.get(key, 0) - a.get(key, 0) for a, b in zip(last, now)]

    out = {f"rollout/engine_{i}_busy_frac": v for i, v in enumerate(busy)}
    out.update(
        {
            "rollout/engine_busy_frac": sum(busy) / len(busy),
            "rollout/engine_generated_tokens_per_s": tokens / (sum(wall) / len(wall)),
            "rollout/engine_preemptions": sum(deltas("num_preemptions")),
            # prefill work (prompts, and re-prefill of requests recomputed after a sync) and the
            # engine steps that carried it (prefill and mixed steps run without CUDA graphs)
            "rollout/engine_prefill_tokens": sum(deltas("prefill_tokens")),
            "rollout/engine_mixed_steps": sum(deltas("mixed_steps")),
            "rollout/engine_steps": sum(deltas("steps")),
            # host round trips (a k-step decode loop is one) and decode steps run eagerly because
            # their graph was being captured or captures were held by a policy sync
            "rollout/engine_round_trips": sum(deltas("sampling_round_trips")),
            "rollout/engine_graph_deferred_steps": sum(deltas("cuda_graph_deferred_steps")),
            "rollout/engine_kv_usage_max": max(b["kv_usage"] for b in now),
            # CUDA graphs captured during the step (each a pause of the engine's decode loop)
            "rollout/engine_graph_captures": sum(deltas("cuda_graphs_captured")),
            "rollout/engine_graph_capture_s": max(deltas("cuda_graph_capture_s")),
        }
    )
    return out
