"""Fault tests of what a hostile reward (or a candidate program of ``code_execution``) can do to the
trainer: forge its reply (a pickle that would run a command in the trainer, garbage, an oversized
frame), return non-finite values, signal the trainer by its parent PID, a known PID or a /proc
scan, and leave ``setsid`` children behind. The attacks live in tests/helpers/rewards.py:hostile.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from areno.rewards.sandbox import RewardFailure, RewardSandbox
from areno.types import Trajectory

REPO = Path(__file__).resolve().parents[2]
HOSTILE = "tests.helpers.rewards:hostile"


@pytest.fixture(scope="module")
def pool():
    with RewardSandbox(HOSTILE, workers=1, timeout_s=10.0) as sandbox:
        yield sandbox


def _failure(pool: RewardSandbox, completion: str) -> RewardFailure:
    with pytest.raises(RewardFailure) as info:
        pool.score("p", completion)
    return info.value


# ------------------------------------------------------------------------------ replies are data
def test_a_pickled_reply_runs_nothing_in_the_trainer(pool, tmp_path):
    marker = tmp_path / "pwned"
    before = pool.metrics()
    try:
        pool.score("p", f"pickle:{marker}")
    except RewardFailure as exc:
        failure = exc
    time.sleep(0.3)
    assert not marker.exists()  # os.system never ran in this process
    assert failure.kind == "malformed" and HOSTILE in str(failure)
    assert pool.metrics()["rollout/reward_failures_malformed"] == before["rollout/reward_failures_malformed"] + 1
    assert pool.score("p", "value:0.5") == 0.5  # a fresh worker serves the next call


@pytest.mark.parametrize("attack", ["garbage", "oversized"])
def test_garbage_or_oversized_replies_are_malformed_failures(pool, attack):
    assert _failure(pool, attack).kind == "malformed"
    assert pool.score("p", "value:1") == 1.0


def test_decode_reply_accepts_only_the_protocol_shapes():
    from areno.rewards._protocol import MalformedReply, decode_reply

    assert decode_reply(b'["ok", 1]') == ["ok", 1.0]
    assert math.isnan(decode_reply(b'["ok", NaN]')[1])
    assert decode_reply(b'["error", "memory", "MemoryError"]') == ["error", "memory", "MemoryError"]
    for bad in (b'["ok", "1"]', b'["ok", true]', b'["ok", 1, 2]', b'["error", "boom", "x"]', b"{}", b"\x80\x04."):
        with pytest.raises(MalformedReply):
            decode_reply(bad)


# -------------------------------------------------------------------------------- non-finite values
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e308", "-1e39"])
def test_non_finite_rewards_are_their_own_failure_kind(pool, value):
    before = pool.metrics()["rollout/reward_failures_nonfinite"]
    failure = _failure(pool, f"value:{value}")
    assert failure.kind == "nonfinite" and "finite" in str(failure)
    assert pool.metrics()["rollout/reward_failures_nonfinite"] == before + 1
    assert pool.score("p", "value:1e30") == 1e30  # large but finite in float32: a reward


def test_acall_reward_scores_non_finite_0_and_warns_once(pool, caplog, monkeypatch):
    from areno.workflows import common

    monkeypatch.setattr(common, "_failed_rewards", {})  # no reward function failed before

    def in_process(prompt, completion, answer, **row):
        return {"x": math.nan, "y": 1e308}[completion]

    with caplog.at_level(logging.WARNING, logger="areno.workflows"):
        results = [
            asyncio.run(common.acall_reward(fn, "p", c, None, {"id": 7}))
            for fn, c in [(in_process, "x"), (in_process, "y"), (pool, "value:inf"), (pool, "value:1e308")]
        ]
    assert [r for r, _ in results] == [0.0, 0.0, 0.0, 0.0]
    assert results[1][1].startswith("NonFiniteReward") and results[3][1].startswith("RewardFailure")
    # once per reward function, with the row
    assert [r.getMessage().split(", fields")[0] for r in caplog.records] == [
        "reward function failed for prompt 'p', completion 'x'",
        "reward function failed for prompt 'p', completion 'value:inf'",
    ]


def test_rollout_metrics_never_null_for_non_finite_rewards():
    from areno.engine.api import rollout_metrics

    def traj(reward: float) -> Trajectory:
        return Trajectory(
            prompt_ids=[1],
            completion_ids=[2, 3],
            logprobs=[0.0, 0.0],
            versions=[0, 0],
            completion_mask=[1, 1],
            reward=reward,
            finish_reason="stop",
            info={},
        )

    metrics = rollout_metrics([traj(1.0), traj(math.nan), traj(3.0), traj(math.inf)], version=0)
    assert metrics["rollout/reward_mean"] == 2.0 and metrics["rollout/reward_nonfinite"] == 2.0
    assert math.isfinite(metrics["rollout/reward_std"])
    assert rollout_metrics([traj(1.0)], 0)["rollout/reward_mean"] == torch.tensor([1.0]).mean().item()


@pytest.mark.parametrize(
    "override, key",
    [
        ("reward.timeout_s=inf", "reward.timeout_s"),
        ("reward.timeout_s=1e308", "reward.timeout_s"),
        ("reward.cpu_s=nan", "reward.cpu_s"),
        ("optim.lr=inf", "optim.lr"),
    ],
)
def test_non_finite_settings_are_one_line_config_errors(override, key):
    from areno.api.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=f"^{key}: ") as info:
        load_config(None, ["model.path=unused", override])
    assert "\n" not in str(info.value)


# ----------------------------------------------------------------------- processes and the trainer
TRAINER = """
import os, sys
from areno.rewards.sandbox import RewardFailure, RewardSandbox
from areno.rewards.code import code_execution

attack = sys.argv[1].replace("TRAINER_PID", str(os.getpid()))
pool = RewardSandbox("tests.helpers.rewards:hostile", workers=1, timeout_s=30.0)
assert pool.score("p", "cwd") == 1.0  # the worker runs in its private working directory
print(getattr(pool, "process_isolation", "unknown"), flush=True)
if attack.startswith("program:"):  # a candidate program of code_execution, in process and sandboxed
    program = attack.split(":", 1)[1].replace(";", "\\n")
    print("in-process", code_execution("p", program, "pass"), flush=True)
    with RewardSandbox("areno.rewards.code:code_execution", workers=1, timeout_s=30.0) as code_pool:
        print("sandboxed", code_pool.score("p", program, "pass"), flush=True)
else:
    try:
        print("reward", pool.score("p", attack), flush=True)
    except RewardFailure as exc:
        print("failure", exc.kind, flush=True)
print("alive", pool.score("p", "value:1"), flush=True)
pool.close()
"""


@pytest.mark.parametrize(
    "attack",
    [
        "killparent",
        "kill:TRAINER_PID",
        "killproc:{marker}",
        "program:import os;os.kill(TRAINER_PID, 9)",
        "program:import os;os.kill(os.getppid(), 9);os.killpg(0, 9)",
    ],
)
def test_rewards_and_programs_cannot_kill_the_trainer(attack, tmp_path):
    marker = f"areno-trainer-{uuid.uuid4().hex}"
    script = tmp_path / f"{marker}.py"  # the trainer's command line holds the marker the /proc scan looks for
    script.write_text(TRAINER)
    proc = subprocess.run(
        [sys.executable, str(script), attack.format(marker=marker)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=tmp_path,
    )
    lines = proc.stdout.splitlines()
    if lines and lines[0] == "session":
        pytest.skip("no PID namespaces here: a reward can signal the trainer (see README)")
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert lines[-1] == "alive 1.0"
    if attack.startswith("program:"):
        assert lines[1:3] == ["in-process 0.0", "sandboxed 0.0"]  # the program failed its tests


def _holders(marker: str) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            if marker.encode() in cmdline and stat.rsplit(")", 1)[-1].split()[0] != "Z":
                found.append(int(pid))
    return found


def test_setsid_children_do_not_outlive_the_sandbox():
    marker = f"areno-setsid-{uuid.uuid4().hex}"
    with RewardSandbox(HOSTILE, workers=1, timeout_s=10.0) as sandbox:
        assert sandbox.score("p", f"setsid:{marker}") == 1.0
        deadline = time.monotonic() + 10
        while not _holders(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _holders(marker), "the setsid child did not start"
        isolation = sandbox.process_isolation
    if isolation == "session":
        pytest.skip("no PID namespaces here: setsid children escape the worker's process group (see README)")
    deadline = time.monotonic() + 10
    while _holders(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _holders(marker) == []


def test_workers_report_their_isolation_and_clean_their_directory(pool):
    assert pool.score("p", "cwd") == 1.0
    assert pool.process_isolation in ("pidns", "pidns-hostproc", "session")
    cwd = pool._slots[0]._cwd
    assert cwd is not None and Path(cwd, "probe").exists()
    pool._slots[0].stop()
    assert not Path(cwd).exists()
