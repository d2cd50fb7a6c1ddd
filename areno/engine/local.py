"""The in-process sides: one process holds the training backends and the rollout engine (colocated).

``LocalTrainingSide`` trains the recipe's roles on ``LocalTrainBackend``s under a ``RecipeRunner``;
``LocalRolloutSide`` drives an embedded ``RolloutEngine`` through an ``InProcessRolloutClient``. A
policy sync hands the trained tensors over (``WeightKind.IN_PROCESS``): the in-place transport
copies them into the engine's own, a dtype cast at most. Both sides also speak ``DISK`` (a
safetensors export the engine loads), the way an inference server of another process takes a
policy; the engine uses it only with a rollout side that cannot take tensors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path

import torch

from areno.engine.api import build_role_backends, rollout_engine_config, warm_up_rollout_engine
from areno.engine.config import ArenoConfig, resolve_dtypes
from areno.engine.residency import Phase, Residency
from areno.engine.roles import RoleBackends, place_roles, places_roles
from areno.engine.rollout_side import RolloutSide
from areno.engine.seams import SideSetup, WeightKind, WeightUpdate
from areno.engine.training_side import TrainingSide
from areno.errors import ConfigError
from areno.models.hf_io import load_model, stop_token_ids
from areno.recipes.runner import RecipeRunner
from areno.rollout.client import InProcessRolloutClient, RolloutClient
from areno.rollout.engine import RolloutEngine
from areno.specializations.base import ModelSpecialization
from areno.specializations.preference import RewardModelSpecialization, save_reward_model
from areno.sync.base import NamedTensorSource
from areno.sync.disk import DiskTransport, policy_dir
from areno.sync.inplace import InPlaceTransport
from areno.train import LocalTrainBackend
from areno.train.backend import PackedTrainBackend
from areno.train.offload import StorageOffloader, collect_tensors
from areno.types import TokenBatch


def export_role(backend: PackedTrainBackend, spec: ModelSpecialization, path: str | Path) -> None:
    """Write a role's weights as a Hugging Face model directory: a reward model (a scalar head on the
    decoder, no LM head) as transformers' sequence classifier (``save_reward_model``), any other role
    as its causal LM (``backend.export_hf``). Colocated and partitioned runs export through it alike.
    Collective like ``named_weights``: every training rank calls it; rank 0 writes."""
    if not isinstance(spec, RewardModelSpecialization):
        backend.export_hf(path)
        return
    state = {name: t.detach().cpu() for name, t in backend.named_weights()}
    if backend.is_rank0:
        save_reward_model(state, backend.model_config, path)
    backend.barrier()  # as export_hf: no rank reads the directory before rank 0 wrote it


class LocalTrainingSide(TrainingSide):
    """The recipe's roles on ``LocalTrainBackend``s of this process, on ``device``; ``DISK``
    exports go under ``export_root``."""

    weight_kinds = frozenset({WeightKind.IN_PROCESS, WeightKind.DISK})

    # set in __init__
    config: ArenoConfig
    device: torch.device
    export_root: Path
    # set in start()
    runner: RecipeRunner | None = None
    policy: str
    """The role exported as the policy: the one synced to rollout, else the recipe's first."""
    _source: NamedTensorSource | None
    """The synced role's weights (None: no role syncs to rollout)."""
    _disk: DiskTransport | None
    _placed: RoleBackends | None = None
    """The roles' backends and workers when ``cluster.role_devices`` (or allocation_mode) moves roles apart."""
    asleep: bool = False
    """The roles' gradients and optimizer state wait in host memory (``sleep``; their weights stay)."""

    def __init__(
        self, config: ArenoConfig, device: torch.device, *, export_root: Path, measure_rollout_logprobs: bool = False
    ) -> None:
        """``measure_rollout_logprobs``: log ``rollout/logprob_abs_diff_*`` each step (an extra
        no-grad forward unless the loss recomputes log-probs anyway)."""
        self.config = config
        self.device = device
        self.export_root = export_root
        self.measure_rollout_logprobs = measure_rollout_logprobs

    def start(self, setup: SideSetup) -> None:
        cfg = self.config
        torch.manual_seed(cfg.train.seed)
        device = self.device.type
        new_backend = lambda c: LocalTrainBackend(dataclasses.replace(c, device=device))
        if places_roles(cfg):  # some roles train in worker processes on devices of their own (role_allocation)
            self._placed = place_roles(
                cfg, setup.recipe, setup.model_dir, new_backend, log_dir=self.export_root.parent / "workers"
            )
            backends, placement = self._placed.backends, self._placed.placement
        else:
            backends, placement = build_role_backends(cfg, setup.recipe, setup.model_dir, new_backend), None
        self.runner = RecipeRunner(
            setup.recipe,
            backends,
            num_minibatches=cfg.train.num_minibatches,
            placement=placement,
            measure_rollout_logprobs=self.measure_rollout_logprobs,
        )
        synced = self.runner.roles_to_sync()
        self.policy = synced[0] if synced else setup.recipe.roles[0].name
        self._source = NamedTensorSource(backends[self.policy].named_weights) if synced else None
        self._disk = None
        if synced:  # written as a checkpoint is: an expert model's tensors under their per-expert names
            model_config = backends[self.policy].model_config
            self._disk = DiskTransport(
                self._source, self.export_root, model_dir=setup.model_dir, model_config=model_config
            )

    def step(self, batch: TokenBatch, *, pass_order: list[int] | None, policy_version: int) -> dict[str, float]:
        for role_name in self.runner.roles_to_sync():
            self.runner.versions[role_name] = policy_version
        return self.runner.step(batch, pass_order=pass_order)

    def prepare(self, batch: TokenBatch) -> dict[str, TokenBatch]:
        return self.runner.prepare(batch)

    def reward_scores(self, batch: TokenBatch) -> dict[str, torch.Tensor]:
        return self.runner.reward_scores(batch)

    def publish_weights(self, version: int, kind: WeightKind) -> WeightUpdate | None:
        if self._source is None:
            return None
        if kind is WeightKind.DISK:
            started_at = time.perf_counter()
            stats = self._disk.sync(version)  # complete and renamed into place before it returns
            return WeightUpdate(
                version=version,
                kind=kind,
                path=policy_dir(self.export_root, version),
                sender_metrics=stats.as_metrics(),
                started_at=started_at,
            )
        assert kind is WeightKind.IN_PROCESS, kind
        return WeightUpdate(version=version, kind=kind, source=self._source)

    def save(self, path: Path, extra_state: dict) -> None:
        for role_name in self._changing_roles():
            role_state = self.runner.checkpoint_state(role_name, extra_state)
            self.runner.backends[role_name].save_checkpoint(path / role_name, extra_state=role_state)

    def load(self, path: Path) -> dict:
        state: dict = {}
        followed = self.runner.config.reference_sync
        for role_name, backend in self.runner.backends.items():
            if backend.cfg.trainable:
                state = backend.load_checkpoint(path / role_name)
                self.runner.restore_state(role_name, state)
            elif (path / role_name).is_dir():  # a reference some steps moved, kept where they left it
                backend.load_checkpoint(path / role_name)
            elif followed is not None and followed.target == role_name:
                raise ConfigError(
                    f"{path} holds no weights of role {role_name!r}, which train.algorithm_kwargs.ref_sync_steps "
                    "moves toward the policy: it was written by a run without ref_sync_steps, whose reference stayed "
                    "the initial policy; resume without ref_sync_steps, or start a new run"
                )
        return state

    def _changing_roles(self) -> list[str]:
        """The roles whose weights a checkpoint holds: the trainable ones and a reference that follows the
        policy (``TrainingConfig.reference_sync``), which its initial checkpoint no longer gives."""
        followed = self.runner.config.reference_sync
        return [
            name
            for name, backend in self.runner.backends.items()
            if backend.cfg.trainable or (followed is not None and followed.target == name)
        ]

    def export_hf(self, path: Path) -> None:
        export_role(self.runner.backends[self.policy], self.runner.specs[self.policy], path)

    def _shared_device_backends(self) -> list[LocalTrainBackend]:
        """The roles on the rollout engine's device: those of this process (a role that
        ``cluster.role_devices`` moved has a device of its own and keeps its state there)."""
        return [b for b in self.runner.backends.values() if isinstance(b, LocalTrainBackend)]

    def device_bytes_to_come(self) -> int:
        """Every trainable role's gradients and optimizer state (allocated at its first step, kept
        after) and the largest of the trainable roles' micro-batch activations (the roles train one at a
        time; a frozen role's forwards keep none for a backward)."""
        trainable = [b for b in self._shared_device_backends() if b.cfg.trainable]
        if not trainable or self.device.type != "cuda":
            return 0
        return sum(b.lazy_state_bytes() for b in trainable) + max(b.activation_bytes() for b in trainable)

    def sleep(self) -> int:
        """Move the gradients and optimizer state of the roles on this device to host memory (their
        weights stay: the sync after the rollout reads them); returns the bytes freed on the device
        (0 when already asleep)."""
        if self.asleep:
            return 0
        self.asleep = True
        return sum(backend.sleep() for backend in self._shared_device_backends())

    def wake(self) -> None:
        """Bring back what ``sleep`` moved (the same bytes, the same tensors), lazily: each role's
        optimizer state returns just before its optimizer step (or a checkpoint save or load), after the
        activations of its forwards and backwards are freed (``PackedTrainBackend.wake(lazy=True)``)."""
        if self.asleep:
            for backend in self._shared_device_backends():
                backend.wake(lazy=True)
            self.asleep = False

    def shutdown(self) -> None:
        if self.runner is not None:
            for backend in self.runner.backends.values():
                backend.shutdown()
        if self._placed is not None:
            self._placed.shutdown()
            self._placed = None


class LocalRolloutSide(RolloutSide):
    """An embedded ``RolloutEngine`` on ``device``, driven by an ``InProcessRolloutClient``."""

    weight_kinds = frozenset({WeightKind.IN_PROCESS, WeightKind.DISK})

    # set in __init__
    config: ArenoConfig
    device: torch.device
    # set in start()
    tokenizer: object
    engine: RolloutEngine
    _client: InProcessRolloutClient | None = None
    _transport: InPlaceTransport | None = None
    """Built at the first sync, for the training side's tensors; reused by every later sync."""
    weights_offloader: StorageOffloader
    """Holds the engine's weights in host memory while ``sleep(weights=True)`` released them."""

    def __init__(self, config: ArenoConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.weights_offloader = StorageOffloader()

    def start(self, setup: SideSetup) -> None:
        self.tokenizer = setup.tokenizer
        self.engine = self._build_rollout_engine(setup.model_dir, setup.device_bytes_reserved)
        warm_up_rollout_engine(self.engine, self.config)
        # The one driver of the rollout engine: rollouts and evaluation both go through it. A
        # synchronous CPU run steps it from the trainer's thread (one OpenMP team in the process:
        # InProcessRolloutClient); an asynchronous one generates beside training, from its own thread.
        synchronous = self.config.rollout.max_head_offpolicyness == 0
        self._client = InProcessRolloutClient(
            self.engine,
            request_timeout_s=self.config.rollout.request_timeout_s,
            caller_drives=self.device.type == "cpu" and synchronous,
        )

    def _build_rollout_engine(self, model_dir: Path, kv_reserved_bytes: int = 0) -> RolloutEngine:
        dtype_name = resolve_dtypes(self.config, self.device.type).rollout
        dtype = getattr(torch, dtype_name)
        model, model_config = load_model(model_dir, dtype=dtype, device=str(self.device))
        engine_cfg = rollout_engine_config(
            self.config, device=str(self.device), dtype=dtype_name, num_blocks=self.config.rollout.kv_blocks
        )
        engine_cfg = dataclasses.replace(engine_cfg, kv_reserved_bytes=kv_reserved_bytes)
        return RolloutEngine(
            model,
            model_config,
            config=engine_cfg,
            eos_token_ids=stop_token_ids(model_dir, model_config, self.tokenizer),
            tokenizer=self.tokenizer,
        )

    @property
    def client(self) -> RolloutClient:
        assert self._client is not None, "start() the rollout side first"
        return self._client

    @property
    def version(self) -> int:
        return self.engine.version

    def pause(self) -> None:
        self.engine.pause()

    def resume(self) -> None:
        self.engine.resume()
        self.client.wake()

    def update_weights(self, update: WeightUpdate) -> dict[str, float]:
        if update.kind is WeightKind.DISK:
            # read whole and validated before any weight changes (else the engine keeps its version)
            self.engine.update_weights_from_disk(str(update.path), update.version)
            return dict(update.sender_metrics)
        assert update.kind is WeightKind.IN_PROCESS and update.source is not None, update.kind
        if self._transport is None or self._transport.source is not update.source:
            self._transport = InPlaceTransport(
                update.source, self.engine.weight_tensors(), on_commit=self.engine.commit_weights
            )
        return self._transport.sync(update.version).as_metrics()

    def sleep(self, *, weights: bool) -> int:
        """Release the engine's KV cache (``RolloutEngine.sleep``) and, with ``weights``, move its
        weights to host memory; returns the weight bytes freed. Before ``start``: nothing to free."""
        if self._client is None:
            return 0
        self.engine.sleep()
        if not weights or self.weights_offloader.asleep:
            return 0
        return self.weights_offloader.sleep(collect_tensors(self.engine.model, None))

    def wake(self, *, kv_cache: bool) -> None:
        """Bring the weights back (the same bytes at the same tensors) and, with ``kv_cache``,
        re-allocate the KV cache."""
        if self._client is None:
            return
        if self.weights_offloader.asleep:
            self.weights_offloader.wake()
        if kv_cache:
            self.engine.wake()

    def metrics(self) -> dict[str, float]:
        return {}

    def rng_state(self) -> torch.Tensor | None:
        return self.engine.sampler.generator.get_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self.engine.sampler.generator.set_state(state)

    def hold_graph_captures(self) -> contextlib.AbstractContextManager:
        return self.engine.hold_graph_captures()

    def shutdown(self) -> None:
        if self._client is not None:
            self._client.close()
        self.weights_offloader.release()


class SleepResidency(Residency):
    """``cluster.offload=sleep``: each phase keeps on the device only what it uses.

        ROLLOUT  the rollout engine's weights and KV cache, the training weights; gradients and
                 optimizer state asleep in host memory
        TRAIN    the training side, its optimizer state from each role's optimizer step on (forwards
                 and backwards run without it); the engine's weights and KV cache released
        SYNC     the training side and the engine's weights (its KV cache stays released)

    Releases come before wakes, so the device never holds two phases' state at once; sleep and wake
    copy bytes, so a run computes exactly what it computes with ``cluster.offload=none``.
    """

    moves_state = True

    # set in __init__
    training: LocalTrainingSide
    rollout: LocalRolloutSide
    last_freed: dict[str, int]
    """Device bytes freed by the last ``enter``, per side (``training``, ``rollout``)."""

    def __init__(self, training: LocalTrainingSide, rollout: LocalRolloutSide, device: torch.device) -> None:
        super().__init__(device)
        self.training = training
        self.rollout = rollout
        self.last_freed = {}

    def _move(self, phase: Phase) -> None:
        if phase is Phase.ROLLOUT:
            self.last_freed = {"training": self.training.sleep()}
            self.rollout.wake(kv_cache=True)
        elif phase is Phase.TRAIN:
            self.last_freed = {"rollout": self.rollout.sleep(weights=True)}
            self.training.wake()
        else:
            self.last_freed = {"rollout": self.rollout.sleep(weights=False)}
            self.training.wake()
            self.rollout.wake(kv_cache=False)

    def metrics(self) -> dict[str, float]:
        """The base's peak, plus the seconds spent entering the phase and the bytes that freed."""
        if self.phase is None:
            return {}
        out = {**super().metrics(), f"system/{self.phase.value}_offload_switch_s": self._switch_s}
        out.update(
            {f"system/{self.phase.value}_offload_freed_{side}_gib": n / 2**30 for side, n in self.last_freed.items()}
        )
        return out
