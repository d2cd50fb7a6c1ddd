"""The worker processes of a partitioned run, built by the scheduler (``areno.launch``) by dotted
path (``areno.engine.workers:TrainWorker`` / ``:RolloutWorker``), all ranks of one world.

``TrainWorker``: the recipe's roles on ``FSDP2TrainBackend`` over the training sub-mesh, and the
sending half of the policy stream. ``RolloutWorker``: a ``RolloutEngine`` behind the token-level
HTTP server, and the receiving half (it keeps generating with its current policy until a sync
commits). The controller reaches both through ``engine/remote.py``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import uvicorn

from areno.data.tokenizer import load_pretrained_tokenizer
from areno.engine.api import build_role_backends, resolve_recipe, rollout_engine_config, warm_up_rollout_engine
from areno.engine.cluster import ClusterLayout, build_groups
from areno.engine.config import ArenoConfig, resolve_dtypes
from areno.engine.host import HeapFreezer
from areno.engine.local import export_role
from areno.engine.partitioned import (
    _sync_config,
    advertised_address,
    bind_host,
    collective_timeout,
    init_world,
    kv_tokens_for,
)
from areno.launch.scheduler import free_port
from areno.models.hf_io import load_model, read_config, stop_token_ids
from areno.models.tp_plan import COLWISE, ROWWISE, tp_plan, tp_style
from areno.recipes import TrainingConfig
from areno.recipes.runner import RecipeRunner
from areno.rollout.engine import RolloutEngine
from areno.rollout.server import ServerLimits, check_bind, create_app
from areno.rollout.tp import TensorParallelRolloutEngine, load_tp_model
from areno.sync.base import NamedTensorSource, ShardSpec, engine_receiver
from areno.sync.plan import shard_specs_from_tp_plan
from areno.sync.stream import StreamTransport
from areno.train import FSDP2TrainBackend

logger = logging.getLogger(__name__)


IMAGE_BODY_BYTES = 512 * 2**20
"""Largest request body of a vision-language model's rollout worker: a group's pixels travel in it
(float32 patches, base64), and a few large images pass the default limit."""


def full_meta(
    live: dict[str, torch.Tensor], model_config, tp_size: int
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """Name, full (unsharded) shape and dtype of each of a TP rank's tensors: its shard's shape
    with the split dim (``areno.models.tp_plan``: colwise dim 0, rowwise dim 1) times ``tp_size``."""
    plan, meta = tp_plan(model_config), []
    for name, t in live.items():
        shape = list(t.shape)
        style = tp_style(plan, name)
        dim = 0 if style == COLWISE else 1 if style == ROWWISE and t.dim() > 1 else None
        if dim is not None:
            shape[dim] *= tp_size
        meta.append((name, tuple(shape), t.dtype))
    return meta


def unsynced(freeze_vision: bool) -> tuple[str, ...]:
    """Name prefixes the policy sync leaves out: a frozen vision tower and merger
    (``model.freeze_vision``; the rollout worker loaded the very same ones from the checkpoint)."""
    return ("visual.",) if freeze_vision else ()


def synced_weights(backend: FSDP2TrainBackend) -> Iterator[tuple[str, torch.Tensor]]:
    """What the policy sync sends: the policy's weights, less ``unsynced`` ones."""
    skip = unsynced(backend.cfg.freeze_vision)
    return ((name, t) for name, t in backend.named_weights() if not name.startswith(skip))


def training_rank_runner(recipe: TrainingConfig, backends: dict, cfg: ArenoConfig) -> RecipeRunner:
    """The recipe's runner on a training rank. Every role's collectives run over the one training
    group, so its roles train one after another: roles trained concurrently interleave their
    collectives differently on each rank, and the world breaks."""
    placement = dict.fromkeys(backends, "train")
    return RecipeRunner(recipe, backends, num_minibatches=cfg.train.num_minibatches, placement=placement)


class TrainWorker:
    """One training rank: the recipe's roles on FSDP2 over the training sub-mesh, and the sender
    side of the policy stream. Built by the scheduler in its own process."""

    def __init__(self, config: ArenoConfig, layout: ClusterLayout, model_dir: str) -> None:
        self.config = cfg = config
        device_type = init_world(cfg)
        self.groups = build_groups(layout, device_type, collective_timeout(cfg))  # collective: same order on every rank
        torch.manual_seed(cfg.train.seed)
        recipe = resolve_recipe(cfg)
        backends = build_role_backends(
            cfg,
            recipe,
            Path(model_dir),
            lambda c: FSDP2TrainBackend(
                dataclasses.replace(
                    c,
                    device=device_type,
                    tp_size=layout.train_tp,
                    dp_replicate_size=layout.train_dp_replicate,
                    ep_size=layout.train_ep,
                    cp_size=layout.train_cp,
                ),
                mesh=self.groups.train_mesh,
                group=self.groups.train_group,
            ),
        )
        self.runner = training_rank_runner(recipe, backends, cfg)
        self._heap = HeapFreezer(cfg.cluster.gc_freeze)
        synced = self.runner.roles_to_sync()
        self.policy = synced[0] if synced else recipe.roles[0].name
        self.transport = StreamTransport(
            topology=layout.stream_topology(),
            config=_sync_config(cfg, read_config(model_dir)),
            source=NamedTensorSource(partial(synced_weights, backends[self.policy])),
            device=torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else "cpu",
            backend="nccl" if device_type == "cuda" else None,
        )

    def pid(self) -> int:
        return os.getpid()

    def step(self, batch_bytes: bytes, pass_order: list[int] | None, policy_version: int) -> dict[str, float]:
        """``batch_bytes``: a pickled TokenBatch (plain pickle: the scheduler's connection would
        otherwise pass tensors as shared-memory handles, which only work between relatives);
        ``pass_order``, ``policy_version``: as ``TrainingSide.step``."""
        for role_name in self.runner.roles_to_sync():
            self.runner.versions[role_name] = policy_version
        metrics = self.runner.step(pickle.loads(batch_bytes), pass_order=pass_order)
        self._heap.after_step()
        return metrics

    def reward_scores(self, batch_bytes: bytes) -> dict[str, list[float]]:
        """``RecipeRunner.reward_scores`` of a pickled TokenBatch, as plain lists (``step``'s pickling)."""
        return {name: s.tolist() for name, s in self.runner.reward_scores(pickle.loads(batch_bytes)).items()}

    def sync(self, version: int) -> dict[str, float]:
        return self.transport.sync(version).as_metrics()

    def export_hf(self, path: str) -> None:
        export_role(self.runner.backends[self.policy], self.runner.specs[self.policy], path)

    def save_role(self, path: str, role: str, extra_state: dict) -> None:
        self.runner.backends[role].save_checkpoint(path, extra_state=self.runner.checkpoint_state(role, extra_state))

    def save_role_alone(self, path: str, role: str, extra_state: dict) -> None:
        """``save_role`` on the training ranks alone: a rollout worker was lost, so the world's
        collectives (DCP's plan and barriers span the default group) can never complete. The training
        group stands in for the world while it saves (the training ranks are the world's first ranks,
        so every rank number stays the same; DCP reads such a checkpoint back over the whole world, the
        rollout ranks joining with nothing, as it reads one saved by ``save_role``)."""
        group = self.groups.train_group
        world = dist.GroupMember.WORLD
        dist.GroupMember.WORLD = group
        try:
            self.runner.backends[role].save_checkpoint(
                path, extra_state=self.runner.checkpoint_state(role, extra_state)
            )
        finally:
            dist.GroupMember.WORLD = world

    def load_role(self, path: str, role: str) -> dict:
        state = self.runner.backends[role].load_checkpoint(path)
        self.runner.restore_state(role, state)
        return state

    def trainable_roles(self) -> list[str]:
        return [n for n, b in self.runner.backends.items() if b.cfg.trainable]

    def shutdown(self) -> None:
        for backend in self.runner.backends.values():
            backend.shutdown()


class RolloutWorker:
    """One rollout rank: a RolloutEngine served over HTTP on 127.0.0.1 and the receiving side of
    the policy stream (it keeps generating with its current policy until a sync commits)."""

    def __init__(
        self, config: ArenoConfig, layout: ClusterLayout, model_dir: str, *, api_key: str | None = None
    ) -> None:
        """``api_key``: required by the server for every request but /health; a worker that may sit
        on another node than the controller (Ray, SLURM) binds all interfaces and must have one."""
        self.config = cfg = config
        device_type = init_world(cfg)
        self.groups = build_groups(layout, device_type, collective_timeout(cfg))
        device = f"cuda:{torch.cuda.current_device()}" if device_type == "cuda" else "cpu"
        dtype_name = resolve_dtypes(cfg, device_type).rollout
        tokenizer = load_pretrained_tokenizer(model_dir)
        blocks = cfg.rollout.kv_blocks
        if not blocks and layout.overlapping:  # a shared GPU: only the KV memory the check allowed
            positions = read_config(model_dir).max_seq_len
            blocks = -(-kv_tokens_for(cfg, positions) // cfg.rollout.block_size)
        engine_config = rollout_engine_config(cfg, device=device, dtype=dtype_name, num_blocks=blocks)
        tp_group = self.groups.rollout_tp_group
        self.tp_rank = dist.get_rank(tp_group) if layout.rollout_tp > 1 else 0
        # a staged commit is applied by every TP rank at its leader's step boundary (an in-place one
        # pauses the replica for the whole sync: nothing to order)
        self._ordered_commits = cfg.cluster.sync_commit == "staged"
        if layout.rollout_tp > 1:
            model, model_config = load_tp_model(
                model_dir, group=tp_group, dtype=getattr(torch, dtype_name), device=device
            )
            self.engine = TensorParallelRolloutEngine(
                model,
                model_config,
                config=engine_config,
                group=tp_group,
                eos_token_ids=stop_token_ids(model_dir, model_config, tokenizer),
                tokenizer=tokenizer,
            )
        else:
            model, model_config = load_model(model_dir, dtype=getattr(torch, dtype_name), device=device)
            self.engine = RolloutEngine(
                model,
                model_config,
                config=engine_config,
                eos_token_ids=stop_token_ids(model_dir, model_config, tokenizer),
                tokenizer=tokenizer,
            )
        warm_up_rollout_engine(self.engine, cfg)  # SPMD on every TP rank: before lead/follow
        self._receive_stream(layout, device, model_config)
        HeapFreezer(cfg.cluster.gc_freeze).after_step()  # the warm-up stands for a first step here
        self.app = None
        if self.tp_rank == 0:
            if layout.rollout_tp > 1:
                self.engine.lead(self.groups.rollout_command_group, ordered_commits=self._ordered_commits)
            self._serve(tokenizer, api_key, vision=model_config.vision is not None)
        else:  # a TP follower: no server; it takes its leader's requests and steps
            self._follower = threading.Thread(target=self._follow, name="areno-rollout-tp-follower", daemon=True)
            self._follower.start()

    def _follow(self) -> None:
        try:
            self.engine.follow(self.groups.rollout_command_group, ordered_commits=self._ordered_commits)
        except Exception:  # the leader's next collective then times out and names this worker's log
            logger.exception("rollout TP follower %d stopped", self.tp_rank)
            raise

    def _receive_stream(self, layout: ClusterLayout, device: str, model_config) -> None:
        cfg = self.config
        live = self.engine.weight_tensors()
        if layout.rollout_tp > 1:
            # this rank's slice of every full (Hugging Face shaped) tensor, cut as its shards are
            specs = shard_specs_from_tp_plan(
                full_meta(live, model_config, layout.rollout_tp), tp_plan(model_config), self.tp_rank, layout.rollout_tp
            )
        else:
            skip = unsynced(cfg.model.freeze_vision)
            specs = {
                n: ShardSpec(name=n, full_shape=tuple(t.shape), dtype=t.dtype)
                for n, t in live.items()
                if not n.startswith(skip)
            }
        # Asynchronous: a staged commit is applied in the background at the engine's next step
        # boundary, so the sync (and the trainer waiting on it) does not wait for a k-step decode loop.
        self.receiver = engine_receiver(
            self.engine,
            specs,
            commit=cfg.cluster.sync_commit,
            deferred=cfg.rollout.max_head_offpolicyness > 0 and cfg.cluster.sync_commit == "staged",
        )
        self.transport = StreamTransport(
            topology=layout.stream_topology(),
            config=_sync_config(cfg, model_config),
            receiver=self.receiver,
            device=device,
            backend="nccl" if device.startswith("cuda") else None,
        )

    def _serve(self, tokenizer, api_key: str | None, *, vision: bool) -> None:
        """The token-level HTTP server of this engine, on a free port, in a thread. ``vision``: the
        requests carry images' pixels, so the body may be as large as ``IMAGE_BODY_BYTES``."""
        self.host = bind_host(self.config)
        check_bind(self.host, api_key)  # beyond loopback only with a key
        self.advertised = advertised_address(self.host)
        limits = ServerLimits(max_body_bytes=IMAGE_BODY_BYTES) if vision else None
        self.app = create_app(self.engine, tokenizer=tokenizer, api_key=api_key, limits=limits)
        self.port = free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(self.app, host=self.host, port=self.port, log_level="warning", lifespan="on")
        )
        self._thread = threading.Thread(target=self.server.run, name="areno-rollout-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"rollout worker: HTTP server on 127.0.0.1:{self.port} did not start")
            time.sleep(0.02)

    def url(self) -> str:
        """This replica's server ("" on a TP follower: its leader serves the replica)."""
        return f"http://{self.advertised}:{self.port}" if self.app is not None else ""

    def pid(self) -> int:
        return os.getpid()

    def version(self) -> int:
        self.receiver.wait_committed(timeout_s=self.transport.config.timeout_s)  # a deferred commit applying
        return self.engine.version

    def weight_shards(self) -> bytes:
        """This rank's live weights by Hugging Face name (its TP shards), pickled on the CPU: what
        a test compares with the slices of the trained policy."""
        self.receiver.wait_committed(timeout_s=self.transport.config.timeout_s)
        return pickle.dumps({n: t.detach().to("cpu", copy=True) for n, t in self.engine.weight_tensors().items()})

    def engine_stats(self) -> dict[str, float]:
        """The engine's counters (``RolloutEngine.stats``, with the clock its ``busy_s`` was read
        on), for the controller's per-step rollout-engine metrics."""
        return {k: float(v) for k, v in self.engine.stats().items() if isinstance(v, (int, float))}

    def sync(self, version: int) -> dict[str, float]:
        # No CUDA-graph capture beside the sync's NCCL work on this GPU (steps needing a new graph
        # meanwhile run eagerly); an asynchronous run syncs while the engine generates.
        t0 = time.perf_counter()
        with self.engine.hold_graph_captures():
            t1 = time.perf_counter()  # an ongoing capture finished
            metrics = self.transport.sync(version).as_metrics()
        t2 = time.perf_counter()
        if self.app is not None:
            self.app.state.client.wake()
        metrics["policy_sync_phase_hold_captures_s"] = t1 - t0
        metrics["policy_sync_phase_wake_s"] = time.perf_counter() - t2
        return metrics

    def join_checkpoint(self, path: str, load: bool) -> None:
        """Take part in the training checkpoint's world collectives with nothing to write or read:
        the same sequence as ``areno.train.checkpoint.save`` (barrier, DCP save, barrier) / ``load``
        (DCP load), whose DCP plans and barriers span the default group."""
        if load:
            dcp.load({}, checkpoint_id=path)
        else:
            dist.barrier()
            dcp.save({}, checkpoint_id=path)
            dist.barrier()

    def shutdown(self) -> None:
        try:
            self.receiver.wait_committed(timeout_s=10)
        except Exception as exc:  # noqa: BLE001 - shutting down: report, do not mask the caller's error
            logger.warning("rollout worker shutdown: %s", exc)
        if self.app is None:
            self._follower.join(timeout=10)  # released by the leader's stop_followers
            return
        self.server.should_exit = True
        self._thread.join(timeout=10)
        if isinstance(self.engine, TensorParallelRolloutEngine):
            self.engine.stop_followers()
