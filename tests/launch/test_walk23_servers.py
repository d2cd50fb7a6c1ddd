"""walk23: the inference servers areno starts. Their CUDA_VISIBLE_DEVICES held the logical indices (a driver
limited to GPUs 4-7 started its server on GPUs 0 and 1), and a ``kill -9`` of the run left them running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from areno.errors import ConfigError
from areno.launch.servers import ServerSpec, server_env


def _spec(tmp_path, devices):
    return ServerSpec(
        backend="vllm", model_dir=tmp_path, served_name="p", dtype="bfloat16", tp=2, port=8001, api_key="k",
        devices=devices,
    )  # fmt: skip


def test_a_server_gets_the_physical_ids_of_its_logical_devices(tmp_path):
    assert server_env(_spec(tmp_path, [0, 1]), {"CUDA_VISIBLE_DEVICES": "4,5,6,7"})["CUDA_VISIBLE_DEVICES"] == "4,5"
    assert server_env(_spec(tmp_path, [2, 3]), {"CUDA_VISIBLE_DEVICES": "4,5,6,7"})["CUDA_VISIBLE_DEVICES"] == "6,7"
    assert server_env(_spec(tmp_path, [2, 3]), {})["CUDA_VISIBLE_DEVICES"] == "2,3"  # no list: all devices
    with pytest.raises(ConfigError, match=r"asks for logical device 3 but CUDA_VISIBLE_DEVICES='4,5' has 2"):
        server_env(_spec(tmp_path, [2, 3]), {"CUDA_VISIBLE_DEVICES": "4,5"})


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_server_dies_with_a_killed_run(tmp_path):
    run = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        import areno.launch.servers as servers
        servers.server_command = lambda spec: [sys.executable, "-c", "import time; time.sleep(120)"]
        spec = servers.ServerSpec(backend="vllm", model_dir=Path({str(tmp_path)!r}), served_name="p",
                                  dtype="float32", tp=1, port=1, api_key="k", devices=None)
        server = servers.ServerProcess(spec, Path({str(tmp_path)!r}) / "vllm_0.log")
        print(server.process.pid, flush=True)
        time.sleep(120)
    """)
    driver = subprocess.Popen([sys.executable, "-c", run], stdout=subprocess.PIPE, text=True)
    try:
        server_pid = int(driver.stdout.readline())
        time.sleep(0.5)  # the launcher has asked for the signal and exec'd the server
        assert _alive(server_pid)
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        deadline = time.monotonic() + 10
        while _alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(server_pid), "the server outlived the killed run"
    finally:
        driver.kill()
        driver.wait()
        if _alive(server_pid):
            os.kill(server_pid, signal.SIGKILL)
