"""The remote sides: the training and rollout workers of a ``PartitionedCluster`` (partitioned).

``RemoteTrainingSide`` calls the scheduler's ``TrainWorker``s; ``RemoteRolloutSide`` reaches the
``RolloutWorker``s' HTTP servers through a ``MultiServerRolloutClient`` steered by a
``HealthMonitor``. A policy sync is a collective (``WeightKind.COLLECTIVE``, the stream
transport): the training ranks start sending, the rollout ranks receive, and the controller waits
for every rank, failing fast on the first error. Each rollout worker pauses its own engine for the
commit, so nothing is paused from here.
"""

from __future__ import annotations

import concurrent.futures
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

    def reward_scores(self, batch: TokenBatch) -> dict[str, torch.Tensor]:
        # every training rank runs the forward (FSDP2 gathers the shards): rank 0's answer
        scores = self.cluster.scheduler.call("train", "reward_scores", pickle.dumps(batch))[0]
        return {name: torch.tensor(values, dtype=torch.float32) for name, values in scores.items()}

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
        """The training roles' checkpoint. DCP's collectives span the world, so the rollout ranks join
        with nothing to write; once a rollout worker is lost (the run then stops) the training ranks
        save on their own instead (``TrainWorker.save_role_alone``): the Trainer's emergency checkpoint."""
        cluster, scheduler = self.cluster, self.cluster.scheduler
        lost = cluster.lost_workers(timeout_s=5)  # a dead worker answers at once; a busy one counts as alive
        if any(role == "train" for role, _ in lost):
            raise cluster._lost_error(lost, in_flight=None)
        if lost:
            # only the training ranks take part; each must be free (not still inside the sync or save the
            # loss broke, waiting for a peer that left it), or the save would wait for it in turn. The
            # rollout workers left have nothing to do once the world is broken: stopped, they release a
            # training rank waiting for them in a collective (the sync's vote) at once.
            cluster.retire("rollout", "was stopped (the run stops)")
            cluster.require_idle("train")
            for role in cluster.gather(scheduler.submit("train", "trainable_roles"), "a checkpoint save")[0]:
                cluster.gather(
                    scheduler.submit("train", "save_role_alone", str(path / role), role, extra_state),
                    "a checkpoint save of the training ranks alone",
                )
            return
        for role in cluster.gather(scheduler.submit("train", "trainable_roles"), "a checkpoint save")[0]:
            cluster.gather(
                scheduler.submit("train", "save_role", str(path / role), role, extra_state)
                + scheduler.submit("rollout", "join_checkpoint", str(path / role), False),
                "a checkpoint save",
            )

    def load(self, path: Path) -> dict:
        scheduler = self.cluster.scheduler
        state: dict = {}
        for role in scheduler.call("train", "trainable_roles")[0]:
            results = self.cluster.gather(
                scheduler.submit("train", "load_role", str(path / role), role)
                + scheduler.submit("rollout", "join_checkpoint", str(path / role), True),
                "a checkpoint load",
            )
            state = results[0]
        return state

    def export_hf(self, path: Path) -> None:
        self.cluster.gather(self.cluster.scheduler.submit("train", "export_hf", str(path)), "the policy's export")

    def shutdown(self) -> None:
        self.cluster.stop("train")


class RemoteRolloutSide(RolloutSide):
    """The cluster's rollout replicas behind one client that routes around unhealthy ones."""

    weight_kinds = frozenset({WeightKind.COLLECTIVE})

    LOST_CHECK_EVERY_S = 1.0
    """``lost_replicas`` asks the workers at most this often (every waiting request calls it)."""
    ENGINE_STATS_TIMEOUT_S = 10.0
    """How long a step waits for the replicas' engine counters (a stalled replica's never come)."""

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
        self._stats_pending: list[concurrent.futures.Future] | None = None
        self._stop_watch = threading.Event()
        self._watcher: threading.Thread | None = None

    def start(self, setup: SideSetup) -> None:
        cluster = self.cluster
        cluster.launch(setup.model_dir)  # a no-op after the training side's
        urls = cluster.replica_urls()
        stall_s = cluster.stall_s
        # checks often enough that a server is marked unhealthy well within the stall deadline
        interval_s = min(5.0, max(stall_s / 6, 0.5)) if stall_s else 5.0
        self.health = HealthMonitor(
            urls, api_key=cluster.api_key, interval_s=interval_s, lost_after_s=stall_s or None
        ).start()
        cluster.watch_health(self.health, urls)
        self._client = MultiServerRolloutClient(
            urls,
            api_key=cluster.api_key,
            request_timeout_s=cluster.config.rollout.request_timeout_s,
            health=self.health,
            lost=self.lost_replicas,
        )
        if stall_s:
            self._watcher = threading.Thread(
                target=self._watch_stalls, args=(interval_s,), name="areno-rollout-stall-watch", daemon=True
            )
            self._watcher.start()

    def _watch_stalls(self, interval_s: float) -> None:
        """Declare stalled replicas lost (``PartitionedCluster.check_stalls``) whatever the run waits on:
        requests in flight to a stopped server, a policy sync, an evaluation."""
        while not self._stop_watch.wait(interval_s):
            try:
                self.cluster.check_stalls()
            except Exception:  # a watcher must not die of a scheduler hiccup: logged, tried again
                logger.exception("rollout stall check failed")

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
        results = _gather(self.cluster, list(update.sending) + receiving, "the policy sync")
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
        if self._stats_pending is None:
            self._stats_pending = self.cluster.scheduler.submit("rollout", "engine_stats")
        futures = self._stats_pending
        _, pending = concurrent.futures.wait(futures, timeout=self.ENGINE_STATS_TIMEOUT_S)
        if pending:  # a stalled replica (check_stalls names it): asked again once this call returns
            logger.debug("rollout engine stats: %d replica(s) did not answer", len(pending))
            self._last_engine_stats = None
            return {}
        self._stats_pending = None
        try:
            stats = [f.result() for f in futures]
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
        self._stop_watch.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            # a stall check under way must not kill workers mid-shutdown
            self._watcher.join(timeout=10)
        if self.health is not None:
            self.health.stop()
        self.cluster.stop("rollout")


def _gather(cluster: PartitionedCluster, futures: list, what: str) -> list:
    """``cluster.gather`` (root cause, stall watch); plain fail-fast for a stand-in cluster without it."""
    gather = getattr(cluster, "gather", None)
    return gather(futures, what) if gather is not None else gather_fail_fast(futures)


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
