"""Recipe roles on devices of their own in a colocated run (``cluster.role_devices``; seed 004's
role pools).

``role_allocation`` places every role of the recipe (``build_gpu_allocations``): the policy stays
on device 0 with the rollout engine, a role named in ``cluster.role_devices`` moves to its device.
Roles on one device form a *placement*. ``place_roles`` builds the roles of device 0 in this
process and starts one ``RoleWorker`` process per other placement (through the local scheduler; on
a GPU the worker sees only its device), each holding its roles' ``LocalTrainBackend``s. In this
process a ``RemoteRoleBackend`` stands for each moved role, so ``RecipeRunner`` drives every role
alike: the no-grad forwards of a DataSync's source come back as tensors (pickled over the
scheduler's connection) and are injected into the target's batch, and a trainable role's
``train_step`` runs in its worker. Placements train concurrently, the roles of one placement one
after another (``RoleBackends.placement`` is ``RecipeRunner``'s grouping key).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
from pathlib import Path
from typing import Any

import torch

from areno.engine.api import build_role_backends, resolve_device, resolve_recipe
from areno.engine.config import ArenoConfig, build_train_backend_config
from areno.engine.host import HeapFreezer
from areno.engine.partitioned import apply_process_settings
from areno.errors import ConfigError
from areno.launch.allocation import build_gpu_allocations, map_roles, parse_allocation_mode
from areno.launch.factory import scheduler_from_config
from areno.launch.scheduler import (
    RUN_DIR_ENV,
    RoleSpec,
    Scheduler,
    WorkerError,
    log_workers,
    scheduler_config,
    usable_cores,
)
from areno.recipes.config import TrainingConfig
from areno.train import LocalTrainBackend
from areno.train.config import TrainBackendConfig
from areno.types import TokenBatch

logger = logging.getLogger(__name__)

__all__ = [
    "RemoteRoleBackend",
    "RoleBackends",
    "RoleWorker",
    "check_partitioned_roles",
    "place_roles",
    "places_roles",
    "role_allocation",
]


def _policy_role(recipe: TrainingConfig) -> str:
    synced = [r.name for r in recipe.roles if r.sync_to_rollout]
    return synced[0] if synced else recipe.roles[0].name


def _num_devices(config: ArenoConfig) -> int:
    """Devices a placement may name: the visible GPUs, on CPU the cores this process may run on (one
    worker process each; a taskset or cgroup mask has fewer than the machine)."""
    if resolve_device(config.cluster.device).type == "cuda":
        return torch.cuda.device_count()
    return usable_cores()


def role_allocation(config: ArenoConfig, recipe: TrainingConfig) -> dict[str, tuple[int, ...]]:
    """Every recipe role's logical devices; a one-line ``ConfigError`` for a role the recipe does
    not have, overlapping lists, a device that does not exist or a moved policy. The roles are
    placed by ``cluster.role_devices`` or, the same way, by a colocated ``allocation_mode``'s other
    components (``areno:d1|fsdp:d1+fsdp[critic]:d1``)."""
    from_string = config.cluster.string_role_devices()
    return build_gpu_allocations(
        config.cluster.role_devices if from_string is None else from_string,
        [r.name for r in recipe.roles],
        policy_role=_policy_role(recipe),
        num_devices=_num_devices(config),
        key="cluster.role_devices" if from_string is None else "cluster.allocation_mode",
    )


def places_roles(config: ArenoConfig) -> bool:
    """True when the config moves roles apart: ``cluster.role_devices`` or an ``allocation_mode``
    whose role components ``role_allocation`` reads."""
    return bool(config.cluster.role_devices) or config.cluster.string_role_devices() is not None


def check_partitioned_roles(config: ArenoConfig, recipe: TrainingConfig) -> None:
    """A partitioned ``allocation_mode`` trains every role on the training devices: its role
    components (``map_roles``) must name roles of the recipe and may not put them on other devices."""
    mode = config.cluster.allocation_mode
    if not mode or "+" not in mode or config.cluster.string_role_devices() is not None:
        return
    alloc = parse_allocation_mode(mode)
    placed = map_roles(alloc, [r.name for r in recipe.roles])
    lists = alloc.device_lists(alloc.world_size)
    apart = {name: lists[c.role] for name, c in placed.items()}
    if len({tuple(devices) for devices in apart.values()}) > 1:
        raise ConfigError(
            f"cluster.allocation_mode: {mode!r} puts recipe roles on different devices ({apart}); a partitioned "
            f"run trains every role on the training devices: colocate them ('fsdp:d1|fsdp[critic]:d1') or use "
            f"cluster.role_devices in a colocated run"
        )


class RoleWorker:
    """The roles of one placement on ``LocalTrainBackend``s, in a worker process of their own.
    Batches and outputs travel as plain pickles (the scheduler's connection would otherwise pass
    tensors as shared-memory handles)."""

    def __init__(self, config: ArenoConfig, roles: list[str], model_dir: str) -> None:
        apply_process_settings(config)
        device = resolve_device(config.cluster.device).type
        if device == "cuda":
            torch.cuda.set_device(0)  # the scheduler gave this worker exactly its device
        torch.manual_seed(config.train.seed)
        recipe = resolve_recipe(config)
        self.backends = build_role_backends(
            config,
            recipe,
            Path(model_dir),
            lambda c: LocalTrainBackend(dataclasses.replace(c, device=device)),
            only=roles,
        )
        self.specs = {r.name: r.build() for r in recipe.roles if r.name in roles}
        self._heap = HeapFreezer(config.cluster.gc_freeze)

    def pid(self) -> int:
        return os.getpid()

    def forward_only(self, role: str, batch_bytes: bytes) -> bytes:
        spec = self.specs[role]
        out = self.backends[role].forward_only(pickle.loads(batch_bytes), forward_fn=spec.extract_model_output)
        self._heap.after_step()
        return pickle.dumps({k: v.cpu() for k, v in out.items()})

    def train_step(self, role: str, batch_bytes: bytes) -> dict[str, float]:
        spec = self.specs[role]
        metrics = self.backends[role].train_step(
            pickle.loads(batch_bytes),
            forward_fn=spec.extract_model_output,
            loss_fn=spec.compute_loss,
            denominator_fn=spec.step_denominator,
        )
        self._heap.after_step()
        return metrics

    def save_checkpoint(self, role: str, path: str, extra_state_bytes: bytes) -> None:
        self.backends[role].save_checkpoint(path, extra_state=pickle.loads(extra_state_bytes))

    def load_checkpoint(self, role: str, path: str) -> bytes:
        return pickle.dumps(self.backends[role].load_checkpoint(path))

    def load_specialization_state(self, role: str, state_bytes: bytes) -> None:
        self.specs[role].load_state_dict(pickle.loads(state_bytes))

    def shutdown(self) -> None:
        for backend in self.backends.values():
            backend.shutdown()


class RemoteRoleBackend:
    """A role trained by a ``RoleWorker``, seen by ``RecipeRunner`` as a training backend. The
    forward and loss functions passed in are ignored: the worker runs the same recipe role's own
    specialization."""

    def __init__(self, scheduler: Scheduler, worker: str, role: str, cfg: TrainBackendConfig) -> None:
        self.scheduler = scheduler
        self.worker = worker
        """The scheduler role name of the placement's worker."""
        self.role = role
        self.cfg = cfg

    def _call(self, method: str, *args: Any) -> Any:
        return self.scheduler.call(self.worker, method, self.role, *args)[0]

    def forward_only(self, batch: TokenBatch, *, forward_fn: Any = None) -> dict[str, torch.Tensor]:
        return pickle.loads(self._call("forward_only", pickle.dumps(batch)))

    def train_step(self, batch: TokenBatch, **_fns: Any) -> dict[str, float]:
        return self._call("train_step", pickle.dumps(batch))

    def save_checkpoint(self, path: str | Path, extra_state: dict[str, Any]) -> None:
        self._call("save_checkpoint", str(path), pickle.dumps(extra_state))

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        return pickle.loads(self._call("load_checkpoint", str(path)))

    def load_specialization_state(self, state: dict[str, Any]) -> None:
        """The runner's copy of this role's specialization state (an adaptive coefficient) for the worker's."""
        self._call("load_specialization_state", pickle.dumps(state))

    def shutdown(self) -> None:
        """Nothing per role: ``RoleBackends.shutdown`` stops the workers."""


@dataclasses.dataclass
class RoleBackends:
    """Every role's training backend, where it runs, and the workers to stop."""

    backends: dict[str, Any]
    placement: dict[str, tuple[int, ...]]
    """Role -> its devices: roles with equal lists train one after another."""
    scheduler: Scheduler | None = None

    def shutdown(self) -> None:
        """Stop the workers (their backends first); the caller shuts down this process's backends."""
        if self.scheduler is None:
            return
        scheduler, self.scheduler = self.scheduler, None
        for worker in scheduler.roles:
            try:
                scheduler.call(worker, "shutdown")
            except WorkerError as exc:  # a worker that died: the others still stop
                logger.warning("role worker %s did not shut down cleanly: %s", worker, str(exc).splitlines()[0])
        scheduler.shutdown()


def place_roles(
    config: ArenoConfig, recipe: TrainingConfig, model_dir: Path, new_backend: Any, *, log_dir: Path
) -> RoleBackends:
    """The recipe's backends: device 0's roles by ``new_backend`` here, each other placement's in
    one ``RoleWorker`` (worker logs under ``log_dir``)."""
    allocation = role_allocation(config, recipe)
    local = [name for name, devices in allocation.items() if devices == (0,)]
    backends = build_role_backends(config, recipe, model_dir, new_backend, only=local)
    placements: dict[tuple[int, ...], list[str]] = {}
    for name, devices in allocation.items():
        if devices != (0,):
            placements.setdefault(devices, []).append(name)
    if not placements:
        return RoleBackends(backends=backends, placement=allocation)
    options = dict(config.cluster.scheduler_options)
    options.setdefault("log_dir", str(log_dir))
    scheduler = scheduler_from_config(scheduler_config("local", options))
    cuda = resolve_device(config.cluster.device).type == "cuda"
    specs = {f"roles-{'-'.join(map(str, devices))}": (devices, names) for devices, names in sorted(placements.items())}
    try:
        scheduler.create_roles(
            [
                RoleSpec(
                    role=worker,
                    worker_cls="areno.engine.roles:RoleWorker",
                    n=1,
                    args=(config, names, str(model_dir)),
                    devices=list(devices) if cuda else None,
                    env={RUN_DIR_ENV: str(config.run_dir)} if config.run_dir else {},  # its log's header
                )
                for worker, (devices, names) in specs.items()
            ]
        )
    except BaseException:
        scheduler.shutdown()
        raise
    log_workers(scheduler)
    roles = {r.name: r for r in recipe.roles}
    for worker, (_, names) in specs.items():
        for name in names:
            cfg = build_train_backend_config(config, role_name=name, trainable=roles[name].trainable)
            backends[name] = RemoteRoleBackend(scheduler, worker, name, cfg)
    ordered = {r.name: backends[r.name] for r in recipe.roles}
    return RoleBackends(backends=ordered, placement=allocation, scheduler=scheduler)
