"""``ServerRolloutSide``: rollouts from vLLM or SGLang servers (``rollout.backend``).

The servers are the user's (``rollout.servers``) or started here, one per data-parallel rank of
the allocation's inference component (``vllm:d2t1+fsdp:d1``: two servers of TP 1), on the CPU or
on consecutive CUDA devices, logs in ``run_dir/workers/``, stopped at shutdown. At start every
server is checked before training begins: it answers (a ``RunFailure`` with its URL otherwise),
it has the pause API, and it serves a model shaped like the trainer's (``ConfigError`` otherwise).

Requests go through a ``MultiServerRolloutClient`` with least-loaded routing, a ``HealthMonitor``
and the backend's streaming client (``rollout/backends``). A policy sync is a ``DISK`` export
(or, with ``rollout.weight_transfer=nccl``, a broadcast) under the checkpoint's tensor names, the
ones the servers' loaders know (an expert model's per-expert tensors: ``CheckpointNamedSource``):
every server is paused with its requests kept, loads the export, the version moves on, and the
servers resume, so in-flight requests continue under the new policy and their tokens after the
sync carry the new version. A server that cannot be reached at a sync is dropped for the rest of
the run (it would serve an old policy if it came back); a server that answers and refuses the
update stops the run (``RunFailure``), as does losing the last one.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import secrets
import threading
import time
from pathlib import Path

import httpx
import torch

from areno.engine.config import ArenoConfig, resolve_dtypes
from areno.engine.rollout_side import RolloutSide
from areno.engine.seams import SideSetup, WeightKind, WeightUpdate
from areno.errors import ConfigError, RunFailure
from areno.launch.allocation import parse_allocation_mode
from areno.launch.scheduler import free_port
from areno.launch.servers import (
    ServerProcess,
    ServerSpec,
    check_server_install,
    check_tp,
    free_ports,
    start_servers,
)
from areno.models import moe
from areno.models.config import OLMOE, ModelConfig
from areno.models.hf_io import read_config
from areno.rollout.backends.admin import ServerAdmin, admin_for
from areno.rollout.backends.base import StreamActivity
from areno.rollout.backends.nccl import NcclWeightTransfer
from areno.rollout.client import MultiServerRolloutClient
from areno.rollout.health import HealthMonitor
from areno.sync.base import full_tensor
from areno.sync.disk import CheckpointNamedSource, checkpoint_names_differ

logger = logging.getLogger(__name__)

SERVED_NAME = "areno-policy"
_FUSED_EXPERT_CHECKPOINTS = {
    "GptOssForCausalLM": ("gpt-oss", "its fused, interleaved experts"),
    "GraniteMoeForCausalLM": ("GraniteMoE", "its fused experts, block_sparse_moe.input_linear / output_linear"),
}
"""The layouts whose checkpoints store each layer's experts fused, as the servers' loaders take them from disk
but areno's weight updates into them are untested: refused before any server starts (the engine serves them)."""
"""The model's name in the API of the servers areno starts."""
STREAM_QUIET_S = 0.3
"""At a policy sync (servers paused): how long the open streams must have received nothing before the
version moves on, so that tokens generated under the old policy are read and stamped with it."""
STREAM_DRAIN_CAP_S = 10.0
"""The longest that wait lasts (a stream still receiving then is a server that did not pause)."""


def server_ignored_olmoe_keys(model_config: dict) -> list[str]:
    """The keys of an OLMoE ``config.json`` (as ``key=value``) that vLLM's and SGLang's OLMoE ignore, where they
    change what transformers computes: ``clip_qkv``, ``attention_bias``, ``rms_norm_eps`` other than 1e-5 and
    ``norm_topk_prob`` (the released OLMoE checkpoints set none of them); empty for another model."""
    if (model_config.get("architectures") or [None])[0] != OLMOE:
        return []
    config = ModelConfig.from_hf(model_config)
    ignored = {
        "clip_qkv": config.clip_qkv is not None,
        "attention_bias": config.attention_bias,
        "rms_norm_eps": config.rms_norm_eps != 1e-5,
        "norm_topk_prob": config.norm_topk_prob,
    }
    return [f"{key}={getattr(config, key)}" for key, differs in ignored.items() if differs]


def check_served_model(backend: str, model_dir: Path, model_config: dict) -> None:
    """A ``ConfigError`` naming the fix when ``backend`` (vllm, sglang) cannot serve the model of ``model_dir``
    (its parsed ``config.json``) as areno trains it: called at start-up before any model loads, and again before
    any server starts (the model may be a warm start's)."""
    if "vision_config" in model_config:  # a vision-language model: before any server starts
        # the text-model ones too: the servers' weight updates of the whole model are untested here
        raise ConfigError(
            f"rollout.backend={backend}: {model_dir} is a vision-language checkpoint, which areno "
            f"trains with its own rollout engine only (its {backend} path sends token ids, and its weight "
            "updates of a vision-language model are untested): use rollout.backend=areno"
        )
    untested = _FUSED_EXPERT_CHECKPOINTS.get((model_config.get("architectures") or [None])[0])
    if untested is not None:
        raise ConfigError(
            f"rollout.backend={backend}: {model_dir} is a {untested[0]} checkpoint, whose weight updates "
            f"into {backend} ({untested[1]}) areno has not tested: use rollout.backend=areno"
        )
    qwen2_moe = "Qwen2MoeForCausalLM" in (model_config.get("architectures") or [])
    if qwen2_moe and not model_config.get("qkv_bias", True):
        raise ConfigError(
            f"rollout.backend={backend}: {model_dir} is a Qwen2-MoE checkpoint with qkv_bias=false, "
            "which vLLM's Qwen2-MoE builds with q/k/v biases all the same (no released one sets it): use "
            "rollout.backend=areno"
        )
    ignored = server_ignored_olmoe_keys(model_config)
    if ignored:
        raise ConfigError(
            f"rollout.backend={backend}: {model_dir} is an OLMoE checkpoint with {', '.join(ignored)}, "
            f"which {backend}'s OLMoE does not compute as transformers does (it clamps nothing, builds no "
            "attention bias, norms with eps 1e-5 and never renormalises the top-k weights): use rollout.backend=areno"
        )


class ServerRolloutSide(RolloutSide):
    """vLLM or SGLang servers behind one client (see the module docstring)."""

    weight_kinds = frozenset({WeightKind.DISK})

    # set in __init__
    config: ArenoConfig
    run_dir: Path
    backend: str
    # set in start()
    urls: list[str]
    admin: ServerAdmin
    processes: list[ServerProcess]
    health: HealthMonitor | None = None
    _client: MultiServerRolloutClient | None = None
    nccl: NcclWeightTransfer | None = None
    policy_config: ModelConfig
    """``rollout.weight_transfer=nccl``: the policy's config, whose checkpoint names it is sent under."""
    _checkpoint_named: CheckpointNamedSource | None = None
    """The training side's source under checkpoint names, built at the first NCCL sync."""

    def __init__(self, config: ArenoConfig, run_dir: Path) -> None:
        self.config = config
        self.run_dir = run_dir
        self.backend = config.rollout.backend
        self.processes = []
        self._version = 0
        self.stream_activity = StreamActivity()
        self._lost: dict[str, str] = {}
        """``url -> why`` of the servers dropped for good."""
        self._lock = threading.Lock()
        if config.rollout.weight_transfer == "nccl":
            check_nccl_transfer(config)  # before anything starts
            self.weight_kinds = frozenset({WeightKind.IN_PROCESS})  # the tensors, broadcast from here
        if not config.rollout.servers:
            check_server_install(self.backend)  # before the training side loads anything

    # ------------------------------------------------------------------ start
    def layout(self, num_devices: int = 0) -> tuple[int, int, list[int]]:
        """``(servers, tp, devices)`` areno starts: the allocation's inference component (its
        logical devices among ``num_devices``, in order: server i takes the i-th ``tp`` of them),
        else one server of TP 1 on device 0."""
        mode = self.config.cluster.allocation_mode
        if mode is None:
            return 1, 1, [0]
        alloc = parse_allocation_mode(mode)
        comp = next(c for c in alloc.components if c.kind == "inference")
        devices = alloc.device_lists(num_devices)[comp.role] if num_devices else list(range(comp.world_size))
        return comp.dp, comp.tp, devices

    def start(self, setup: SideSetup) -> None:
        cfg = self.config.rollout
        model_config = json.loads((setup.model_dir / "config.json").read_text())
        check_served_model(self.backend, setup.model_dir, model_config)
        if cfg.servers:
            self.urls = [u.rstrip("/") for u in cfg.servers]
            api_key = cfg.server_api_key
            served = None
        else:
            n, tp, _ = self.layout()
            check_tp(model_config, tp, self.backend)  # before any server starts
            api_key = secrets.token_hex(16)
            served = SERVED_NAME
            self.processes = start_servers(
                self._specs(setup.model_dir, n, tp, api_key),
                self.run_dir / "workers",
                timeout_s=cfg.server_start_timeout_s,
            )
            self.urls = [p.url for p in self.processes]
        self.admin = admin_for(self.backend, api_key=api_key)
        model = served or self.admin.check(self.urls[0], model_config)
        for url in self.urls[1 if served is None else 0 :]:
            self.admin.check(url, model_config)
        if cfg.weight_transfer == "nccl":
            self.policy_config = read_config(setup.model_dir)
            self.nccl = self._start_nccl(setup)
        self.health = HealthMonitor(self.urls, api_key=api_key, interval_s=2.0).start()
        self._client = MultiServerRolloutClient(
            self.urls,
            api_key=api_key,
            request_timeout_s=cfg.request_timeout_s,
            health=_Serving(self.health, self._lost),
            lost=self.lost_servers,
            new_client=lambda url: self.admin.client(
                url,
                model=model,
                version=lambda: self._version,
                timeout_s=cfg.request_timeout_s,
                activity=self.stream_activity,
            ),
            least_loaded=True,
        )

    def _start_nccl(self, setup: SideSetup) -> NcclWeightTransfer:
        """Every server has the weight-transfer routes (ConfigError otherwise) and joins the group."""
        for url in self.urls:
            self.admin.check_weight_transfer(url)
        dtype = resolve_dtypes(self.config, "cuda").rollout
        transfer = NcclWeightTransfer(
            self.admin,
            self.urls,
            self.layout()[1],
            dtype=getattr(torch, dtype),
            device=torch.device("cuda"),  # the current device: the training side's
            master_address="127.0.0.1",  # areno's own servers bind the loopback
            master_port=free_port(),
            float32_names=moe.float32_names(self.policy_config),  # GLM-4.5's routers: vLLM holds them in float32
        )
        transfer.start()
        return transfer

    def _specs(self, model_dir: Path, n: int, tp: int, api_key: str) -> list[ServerSpec]:
        cuda = self.config.cluster.device == "cuda" or (
            self.config.cluster.device == "auto" and torch.cuda.is_available()
        )
        dtype = resolve_dtypes(self.config, "cuda" if cuda else "cpu").rollout
        devices = self.layout(torch.cuda.device_count())[2] if cuda else []
        ports = free_ports(n)
        return [
            ServerSpec(
                backend=self.backend,
                model_dir=model_dir,
                served_name=SERVED_NAME,
                dtype=dtype,
                tp=tp,
                port=ports[i],
                api_key=api_key,
                devices=devices[i * tp : (i + 1) * tp] if cuda else None,
                max_model_len=self.config.rollout.max_model_len or _position_bound(model_dir),
                seed=self.config.train.seed,
                extra_args=list(self.config.rollout.server_args),
                weight_transfer=self.config.rollout.weight_transfer,
            )
            for i in range(n)
        ]

    # ------------------------------------------------------------------ the seam
    @property
    def client(self) -> MultiServerRolloutClient:
        assert self._client is not None, "start() the rollout side first"
        return self._client

    @property
    def version(self) -> int:
        return self._version

    def pause(self) -> None:
        """Nothing: a sync pauses the servers itself (``update_weights``), and requests spread over
        several servers cannot be started as one batch."""

    def resume(self) -> None:
        """Nothing (see :meth:`pause`)."""

    def update_weights(self, update: WeightUpdate) -> dict[str, float]:
        assert update.kind in self.weight_kinds, update.kind
        live = [u for u in self.urls if u not in self._lost]
        if self.nccl is not None and len(live) < len(self.urls):
            raise RunFailure(
                f"{self.backend} servers of the NCCL weight-transfer group are gone ({self._lost}): the group "
                "cannot shrink; rollout.weight_transfer=disk carries on with the servers left"
            )
        t0 = time.perf_counter()
        paused = []
        try:
            for url in live:
                if self._try(url, "pause", self.admin.pause):
                    paused.append(url)
            if not paused:
                raise RunFailure(f"every {self.backend} server is gone: {self._lost}")
            t_load = time.perf_counter()
            if self.nccl is not None:
                self._send_nccl(update, paused)
            else:
                assert update.path is not None
                for url in paused:
                    self.admin.load_weights(url, update.path, update.version)  # a refusal stops the run
            load_s = time.perf_counter() - t_load
            # tokens generated before the pause but not yet read would take the new version
            drain_s = self.stream_activity.wait_quiet(STREAM_QUIET_S, cap_s=STREAM_DRAIN_CAP_S)
            self._version = update.version
        finally:
            for url in paused:
                self._try(url, "resume", self.admin.resume)
        return {
            **update.sender_metrics,
            "policy_sync_load_s": load_s,
            "policy_sync_stream_drain_s": drain_s,
            "policy_sync_generation_paused_s": time.perf_counter() - t0,
            "policy_sync_controller_s": time.perf_counter() - update.started_at,
        }

    def _send_nccl(self, update: WeightUpdate, paused: list[str]) -> None:
        assert self.nccl is not None and update.source is not None
        if len(paused) < len(self.urls):  # one went away while pausing: the broadcast would hang
            raise RunFailure(f"a {self.backend} server of the NCCL weight-transfer group is gone: {self._lost}")
        source = update.source  # a dense model's names are the checkpoint's already
        if checkpoint_names_differ(self.policy_config):  # vLLM loads the checkpoint's names: per-expert tensors
            if self._checkpoint_named is None or self._checkpoint_named.source is not update.source:
                self._checkpoint_named = CheckpointNamedSource(update.source, self.policy_config)
            source = self._checkpoint_named
        meta = [(name, tuple(shape), dtype) for name, shape, dtype in source.meta()]
        self.nccl.send(meta, ((name, full_tensor(t)) for name, t in source.iter_tensors()))
        for url in paused:
            self.admin.reset_prefix_cache(url, update.version)

    def _try(self, url: str, what: str, call) -> bool:
        """``call(url)``; a server that cannot be reached is dropped for the rest of the run."""
        try:
            call(url)
            return True
        except httpx.TransportError as exc:
            with self._lock:
                self._lost[url] = f"unreachable at a policy sync ({what}: {type(exc).__name__})"
            logger.warning("%s server %s dropped: %s", self.backend, url, self._lost[url])
            return False

    def lost_servers(self) -> dict[str, str]:
        """The client's ``lost``: dropped servers, and started servers whose process exited."""
        with self._lock:
            for p in self.processes:
                if not p.alive() and p.url not in self._lost:
                    self._lost[p.url] = f"its process exited with code {p.process.returncode}: see {p.log_path}"
            return dict(self._lost)

    def metrics(self) -> dict[str, float]:
        """The health monitor's figures, a dropped server counted unhealthy, and ``lost_servers``."""
        lost = self.lost_servers()
        healthy = [self.health.is_healthy(u) and u not in lost for u in self.urls]
        return {
            "rollout/healthy_servers": float(sum(healthy)),
            "rollout/unhealthy_servers": float(len(healthy) - sum(healthy)),
            **{f"rollout/server_{i}_healthy": float(h) for i, h in enumerate(healthy)},
            "rollout/lost_servers": float(len(lost)),
        }

    def rng_state(self) -> torch.Tensor | None:
        return None  # the servers' samplers are their own; episodes carry their seeds

    def set_rng_state(self, state: torch.Tensor) -> None:
        """Nothing to restore (see :meth:`rng_state`)."""

    def shutdown(self) -> None:
        if self.health is not None:
            self.health.stop()
        for p in self.processes:
            p.stop()


def _position_bound(model_dir: Path) -> int | None:
    """The context a server must keep within where the model computes fewer positions than its
    ``max_position_embeddings`` as transformers does (LongRoPE: its original context; a server would turn a
    longer sequence by the long factors, which training does not); None: the server's own default."""
    config = read_config(model_dir)
    return config.max_seq_len if config.max_seq_len < config.max_position_embeddings else None


def check_nccl_transfer(config: ArenoConfig) -> None:
    """``rollout.weight_transfer=nccl`` needs CUDA here and vLLM importable in this Python (the
    trainer's half of the group is vLLM's): a ConfigError naming the fix otherwise."""
    if not torch.cuda.is_available() or config.cluster.device == "cpu":
        raise ConfigError("rollout.weight_transfer: nccl needs CUDA, and this run has none: use disk")
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "rollout.weight_transfer: nccl joins vLLM's weight-transfer group from the trainer, and vllm is not "
            "installed here: pip install 'areno[vllm]', or use disk"
        )


class _Serving:
    """The health view the client routes by: healthy and not dropped."""

    def __init__(self, monitor: HealthMonitor, lost: dict[str, str]) -> None:
        self.monitor, self.lost = monitor, lost

    def is_healthy(self, url: str) -> bool:
        return url not in self.lost and self.monitor.is_healthy(url)

    def report_failure(self, url: str, reason: str) -> None:
        self.monitor.report_failure(url, reason)

    async def await_healthy(self, timeout_s: float) -> bool:
        return await self.monitor.await_healthy(timeout_s)

    def describe(self) -> dict[str, str]:
        return {u: f"dropped: {self.lost[u]}" if u in self.lost else s for u, s in self.monitor.describe().items()}
