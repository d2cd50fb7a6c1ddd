"""``RayScheduler``: one placement group per role, one Ray actor per worker.

Works with ``ray.init()`` in-process (``address=None``), a cluster started on this machine with
``ray start --head`` (``address="auto"``) and any other cluster (``host:port`` or
``ray://host:port``). An address that does not answer fails with one line before any worker
starts: one Ray RPC with a short deadline (``ray.init`` itself would retry for a minute, and a
bare TCP connect proves nothing where a proxy accepts every connection).

Each actor runs the same ``WorkerRuntime`` as the subprocess workers. The rendezvous of a world
is the node IP of its rank-0 actor and a port that is free there; Ray assigns GPUs
(``CUDA_VISIBLE_DEVICES``) from the bundle, so a role's ``devices`` only sets how many GPUs
each worker reserves (``len(devices) // n``).

With a ``log_dir`` (the partitioned run's ``run_dir/workers``), each actor sends its stdout and
stderr to ``<log_dir>/<role>-<index>.log``, as the local and SLURM workers do (``kill -USR1``
stacks land there too), after the same header line; the log is truncated when a ``fresh_logs``
scheduler first writes it and appended to after a separator line otherwise; a node that cannot write there keeps Ray's own worker logs
(``<session>/logs/worker-*-<pid>.{out,err}`` on that node), and the launch log names them.

Ray itself is imported when a ``RayScheduler`` is built (``import_ray``), not with this module: it is
a heavy optional dependency, so the scheduler factory imports this module without it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import TYPE_CHECKING, Any

from areno.launch.scheduler import (
    RoleSpec,
    Scheduler,
    SchedulerError,
    WorkerDiedError,
    WorkerHandle,
    _gather,
    _raise_reply,
    _target_name,
    assign_ranks,
    free_port,
    open_worker_log,
    python_path_env,
)
from areno.launch.worker import WorkerRuntime, header_line
from areno.observe.doctor import INSTALL_HINTS

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

logger = logging.getLogger(__name__)

__all__ = ["RayScheduler", "check_ray_address", "import_ray"]


def import_ray() -> ModuleType:
    """The ``ray`` package; a one-line SchedulerError when it does not import here."""
    try:
        import ray  # a heavy optional dependency: imported where a Ray scheduler is built
    except ImportError as e:
        if (e.name or "").split(".")[0] != "ray":
            raise
        raise SchedulerError(
            f"cluster.scheduler=ray needs the ray package, which does not import "
            f"here ({e}); {INSTALL_HINTS['ray']} or use cluster.scheduler=local"
        ) from None
    return ray


class _RayWorkerActor:
    """Hosts one worker object inside a Ray actor process."""

    def __init__(self) -> None:
        self.runtime = WorkerRuntime()

    def node_info(self) -> tuple[str, str, int, int]:
        ray = import_ray()  # inside the actor, where Ray is running
        return socket.gethostname(), ray.util.get_node_ip_address(), free_port(), os.getpid()

    def redirect_output(
        self, path: str, truncate: bool, role: str, index: int, env: dict[str, str]
    ) -> tuple[str | None, str]:
        """Send this process's stdout and stderr (file descriptors 1 and 2) to ``path``, which starts with
        the worker's header line (``open_worker_log``); returns ``(None, "")``, or ``(why not, where Ray's
        own logs of this worker are)``."""
        os.environ.update(env)  # for the header line (rank, run_dir); setup() sets the same values
        try:
            fd = open_worker_log(path, truncate=truncate, header=header_line(role, index))
        except OSError as e:
            return f"{type(e).__name__}: {e}", _ray_log_dir()
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        return None, ""

    def setup(self, env: dict[str, str], cls_path: str, args: tuple, kwargs: dict) -> tuple:
        return self.runtime.handle(("init", cls_path, args, kwargs, env))

    def run(self, target: str | Callable, args: tuple, kwargs: dict) -> tuple:
        return self.runtime.handle(("call", target, args, kwargs))


def _ray_log_dir() -> str:
    """Ray's log directory on this node (its workers' ``worker-*-<pid>.out/.err``)."""
    try:
        node = import_ray()._private.worker.global_worker.node
        return node.get_logs_dir_path()
    except Exception:  # noqa: BLE001 - a private API: name the usual place instead
        return "/tmp/ray/session_latest/logs"


def first_line(text: str, limit: int = 300) -> str:
    """The first line of ``text``, cut at a word boundary (with ``...``) when longer than ``limit``."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    if len(line) <= limit:
        return line
    cut = line[:limit].rsplit(" ", 1)[0] if " " in line[:limit] else line[:limit]
    return cut.rstrip(" ,;:") + " ..."


def _host_port(address: str) -> tuple[str, int]:
    hostport = address.removeprefix("ray://")
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(
            f"cluster.scheduler_options.ray_address {address!r} must be 'auto', 'host:port' or 'ray://host:port'"
        )
    return host, int(port)


def check_ray_address(address: str, timeout_s: float) -> str:
    """Resolve ``auto`` and check that the address accepts TCP connections; returns the address."""
    if address == "auto":
        current = "/tmp/ray/ray_current_cluster"
        if os.environ.get("RAY_ADDRESS"):
            address = os.environ["RAY_ADDRESS"]
        elif os.path.exists(current):
            address = open(current).read().strip()
        else:
            raise SchedulerError(
                "cluster.scheduler_options.ray_address='auto' but no Ray cluster runs on this machine; start one with "
                "`ray start --head` or give host:port"
            )
    _host_port(address)
    _ping(address, timeout_s)
    return address


def _ping(address: str, timeout_s: float) -> None:
    """One Ray RPC with a deadline: ``ClusterInfo(PING)`` for Ray Client addresses, ``GetClusterId``
    for GCS addresses. A bare TCP connect is not enough: proxies accept any connection."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc, ray_client_pb2, ray_client_pb2_grpc

    target = address.removeprefix("ray://")
    answered = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)  # a Ray server, token auth
    with grpc.insecure_channel(target) as channel:
        try:
            if address.startswith("ray://"):
                ray_client_pb2_grpc.RayletDriverStub(channel).ClusterInfo(
                    ray_client_pb2.ClusterInfoRequest(type=ray_client_pb2.ClusterInfoType.PING), timeout=timeout_s
                )
            else:
                gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(
                    gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s
                )
        except grpc.RpcError as e:
            if e.code() in answered:
                return
            detail = first_line(e.details() or "")
            raise SchedulerError(
                f"Ray address {address!r} does not answer ({e.code().name}: {detail}; within {timeout_s:g}s); "
                f"start the cluster (`ray start --head`) or fix cluster.scheduler_options.ray_address"
            ) from None


@dataclass(kw_only=True)
class _RayWorker:
    spec: RoleSpec
    handle: WorkerHandle
    bundle: int
    env: dict[str, str] = field(default_factory=dict)
    actor: Any = None
    executor: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(max_workers=1)
    )


class RayScheduler(Scheduler):
    """Workers as Ray actors, one placement group per role."""

    fresh_logs: bool = False
    """Truncate each worker's log the first time an actor writes to it (a run that starts over); False
    appends, after a separator line (a resumed run, a restarted worker). Every actor writes a header
    line, as a local worker does."""

    def __init__(
        self,
        *,
        address: str | None = None,
        connect_timeout_s: float = 10.0,
        placement_strategy: str = "PACK",
        cpus_per_worker: float = 1.0,
        placement_timeout_s: float = 60.0,
        num_cpus: int | None = None,
        log_dir: str | None = None,
    ) -> None:
        """``num_cpus`` only applies when Ray is started in-process (``address=None``); ``log_dir``:
        where each worker's output goes (``<role>-<index>.log``); None leaves it in Ray's logs."""
        if not cpus_per_worker > 0:  # a worker without GPUs would get an empty bundle, which Ray refuses
            raise SchedulerError(
                f"cluster.scheduler_options.ray_cpus_per_worker: must be > 0 (a fraction such as 0.5 lets workers "
                f"share a CPU), got {cpus_per_worker}"
            )
        self._ray = ray = import_ray()
        self.log_dir = log_dir
        self._truncated: set[str] = set()
        self.placement_strategy = placement_strategy
        self.cpus_per_worker = cpus_per_worker
        self.placement_timeout_s = placement_timeout_s
        self._owns_ray = False
        runtime_env = {"env_vars": {"PYTHONPATH": python_path_env()}}
        if address is not None:
            address = check_ray_address(address, connect_timeout_s)
        if not ray.is_initialized():
            try:
                ray.init(
                    address=address,
                    num_cpus=num_cpus if address is None else None,
                    runtime_env=runtime_env,
                    include_dashboard=False,
                    log_to_driver=False,
                    configure_logging=False,
                )
            except ConnectionError as e:
                raise SchedulerError(
                    f"cannot join the Ray cluster at {address!r}: {str(e).splitlines()[0]}; a cluster with token "
                    f"authentication needs RAY_AUTH_MODE=token and its token (RAY_AUTH_TOKEN or ~/.ray/auth_token)"
                ) from None
            self._owns_ray = True
        self._actor_cls = ray.remote(_RayWorkerActor)
        self._workers: dict[str, list[_RayWorker]] = {}
        self._pgs: dict[str, PlacementGroup] = {}
        self._closed = False

    @property
    def roles(self) -> list[str]:
        return list(self._workers)

    def workers(self, role: str) -> list[WorkerHandle]:
        return [w.handle for w in self._role(role)]

    def _role(self, role: str) -> list[_RayWorker]:
        if role not in self._workers:
            raise KeyError(f"no role {role!r}; created roles: {list(self._workers)}")
        return self._workers[role]

    def _bundle(self, spec: RoleSpec) -> dict[str, float]:
        bundle = {"CPU": self.cpus_per_worker}
        if spec.devices is not None:
            bundle["GPU"] = len(spec.devices) // spec.n
        return {k: v for k, v in bundle.items() if v}

    def _placement_group(self, spec: RoleSpec) -> PlacementGroup:
        ray = self._ray
        bundles = [self._bundle(spec) for _ in range(spec.n)]
        name = f"areno-{spec.role}-{time.time_ns()}"
        pg = ray.util.placement_group(bundles, strategy=self.placement_strategy, name=name)
        try:
            ray.get(pg.ready(), timeout=self.placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(pg)
            raise SchedulerError(
                f"placement group of role {spec.role!r} ({spec.n} x {bundles[0]}) not ready within "
                f"{self.placement_timeout_s:g}s; the cluster has {ray.available_resources()} free"
            ) from None
        return pg

    def _new_actor(self, w: _RayWorker) -> Any:
        bundle = self._bundle(w.spec)
        return self._actor_cls.options(
            num_cpus=bundle.get("CPU", 0),
            num_gpus=bundle.get("GPU", 0),
            scheduling_strategy=self._ray.util.scheduling_strategies.PlacementGroupSchedulingStrategy(
                placement_group=self._pgs[w.spec.role], placement_group_bundle_index=w.bundle
            ),
        ).remote()

    def create_roles(self, specs: Sequence[RoleSpec]) -> dict[str, list[WorkerHandle]]:
        for spec in specs:
            if spec.role in self._workers:
                raise ValueError(f"role {spec.role!r} already exists; shut it down or pick another name")
        ranks = assign_ranks(specs)
        new: list[_RayWorker] = []
        try:
            for spec in specs:
                self._pgs[spec.role] = self._placement_group(spec)
                self._workers[spec.role] = []
                for i in range(spec.n):
                    rank, world_size, _ = ranks[(spec.role, i)]
                    devices = spec.worker_devices(i)
                    handle = WorkerHandle(
                        role=spec.role,
                        index=i,
                        rank=rank,
                        world_size=world_size,
                        pid=None,
                        host="",
                        devices=tuple(devices) if devices is not None else None,
                    )
                    w = _RayWorker(spec=spec, handle=handle, bundle=i)
                    w.actor = self._new_actor(w)
                    self._workers[spec.role].append(w)
                    new.append(w)
            infos = self._ray.get([w.actor.node_info.remote() for w in new])
            self._prepare_env(new, infos, ranks)
            self._redirect_logs(new)
            self._setup(new)
        except BaseException:
            for spec in specs:
                self._remove_role(spec.role)
            raise
        return {spec.role: self.workers(spec.role) for spec in specs}

    def _prepare_env(self, workers: list[_RayWorker], infos: list[tuple], ranks: dict) -> None:
        by_world: dict[str, list[tuple[int, _RayWorker, tuple]]] = {}
        for w, info in zip(workers, infos):
            rank, _, world = ranks[(w.handle.role, w.handle.index)]
            by_world.setdefault(world, []).append((rank, w, info))
        for members in by_world.values():
            members.sort(key=lambda m: m[0])
            _, _, (_, master_ip, master_port, _) = members[0]
            per_node: dict[str, int] = {}
            for rank, w, (host, ip, _, pid) in members:
                local_rank = per_node.get(ip, 0)
                per_node[ip] = local_rank + 1
                w.env = {
                    **w.spec.env,
                    "MASTER_ADDR": master_ip,
                    "MASTER_PORT": str(master_port),
                    "RANK": str(rank),
                    "WORLD_SIZE": str(w.handle.world_size),
                    "LOCAL_RANK": str(local_rank),
                    "ARENO_ROLE": w.handle.role,
                    "ARENO_ROLE_INDEX": str(w.handle.index),
                }
                w.handle = replace(w.handle, pid=pid, host=host)
            for _, w, (_, ip, _, _) in members:
                w.env["LOCAL_WORLD_SIZE"] = str(per_node[ip])

    def _redirect_logs(self, workers: list[_RayWorker]) -> None:
        """Each worker's output to ``log_dir/<role>-<index>.log`` (its handle's ``log_path``), or,
        where its node cannot write there, a warning naming Ray's log directory on that node."""
        if self.log_dir is None:
            return
        paths = [os.path.join(self.log_dir, f"{w.handle.role}-{w.handle.index}.log") for w in workers]
        truncate = [self.fresh_logs and p not in self._truncated for p in paths]
        self._truncated.update(p for p, t in zip(paths, truncate) if t)  # a restarted worker appends
        replies = self._ray.get(
            [
                w.actor.redirect_output.remote(p, t, w.handle.role, w.handle.index, w.env)
                for w, p, t in zip(workers, paths, truncate)
            ]
        )
        for w, path, (problem, ray_logs) in zip(workers, paths, replies):
            if problem is None:
                w.handle = replace(w.handle, log_path=path)
                continue
            w.handle = replace(w.handle, log_path=f"{ray_logs}/worker-*-{w.handle.pid}.err on {w.handle.host}")
            logger.warning(
                "%s (pid %s on %s) cannot write its log %s (%s): its output stays in Ray's logs, %s",
                w.handle.name,
                w.handle.pid,
                w.handle.host,
                path,
                problem,
                w.handle.log_path,
            )

    def _setup(self, workers: list[_RayWorker]) -> None:
        futures = [w.executor.submit(self._setup_one, w) for w in workers]
        _gather(futures)

    def _setup_one(self, w: _RayWorker) -> None:
        ref = w.actor.setup.remote(w.env, w.spec.worker_cls, w.spec.args, w.spec.kwargs)
        self._get(w, ref, "constructor")

    def _get(self, w: _RayWorker, ref: Any, what: str) -> Any:
        try:
            reply = self._ray.get(ref)
        except self._ray.exceptions.RayActorError as e:
            log = f"; log: {w.handle.log_path}" if w.handle.log_path else ""
            raise WorkerDiedError(
                f"{w.handle.name} (pid {w.handle.pid} on {w.handle.host}) died during {what} ({type(e).__name__}){log}"
            ) from None
        return _raise_reply(w.handle, what, reply)

    def submit_one(
        self, role: str, index: int, target: str | Callable, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future:
        w = self._role(role)[index]
        return w.executor.submit(lambda: self._get(w, w.actor.run.remote(target, args, kwargs), _target_name(target)))

    def restart_worker(self, role: str, index: int) -> WorkerHandle:
        old = self._role(role)[index]
        self._ray.kill(old.actor, no_restart=True)
        old.executor.shutdown(wait=False, cancel_futures=True)
        w = _RayWorker(spec=old.spec, handle=old.handle, bundle=old.bundle, env=old.env)
        w.actor = self._new_actor(w)
        host, _, _, pid = self._ray.get(w.actor.node_info.remote())
        w.handle = replace(w.handle, pid=pid, host=host)
        self._workers[role][index] = w
        self._redirect_logs([w])
        self._setup_one(w)
        return w.handle

    def kill_worker(self, role: str, index: int) -> None:
        """``ray.kill`` of the worker's actor: Ray ends its process without asking it (SIGKILL where it
        does not exit at once: a stopped or deadlocked one too); its calls fail with ``WorkerDiedError``."""
        w = self._role(role)[index]
        self._ray.kill(w.actor, no_restart=True)

    def _remove_role(self, role: str) -> None:
        for w in self._workers.pop(role, []):
            if w.actor is not None:
                self._ray.kill(w.actor, no_restart=True)
            w.executor.shutdown(wait=False, cancel_futures=True)
        pg = self._pgs.pop(role, None)
        if pg is not None:
            self._ray.util.remove_placement_group(pg)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for role in list(self._workers):
            self._remove_role(role)
        if self._owns_ray:
            self._ray.shutdown()
