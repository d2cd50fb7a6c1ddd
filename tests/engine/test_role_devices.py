"""``cluster.role_devices``: a recipe role on a device of its own (a worker process on CPU) trains
and feeds its DataSync exactly as when every role shares the trainer's process."""

import json
import logging
import os
import signal

import pytest
import torch

from areno.api.trainer import Trainer
from areno.engine.api import prepare_model_dir
from areno.engine.placement import build_engine
from areno.errors import ConfigError, RunFailure
from areno.launch.allocation import build_gpu_allocations
from tests.helpers.configs import role_run_config

STEPS = 3


def _run(cfg) -> list[dict]:
    trainer = Trainer.init(cfg)
    try:
        trainer.run()
        placed = trainer.backend.engine.training._placed if cfg.cluster.role_devices else None
        pids = placed.scheduler.call("roles-1", "pid") if placed is not None else []
    finally:
        trainer.shutdown()
    assert all(pid != os.getpid() for pid in pids)
    lines = (trainer.run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines], pids


@pytest.mark.parametrize(
    ("algorithm", "moved", "key"),
    [
        ("ppo", "critic", "train/value/loss"),
        pytest.param("grpo", "ref", "train/policy/actor/kl", marks=pytest.mark.slow),
    ],
)
def test_role_in_its_own_process_matches_one_process(tmp_path, algorithm, moved, key, caplog):
    with caplog.at_level(logging.INFO, logger="areno.launch.scheduler"):
        _compare(tmp_path, algorithm, moved, key)
    # where to look, as for a partitioned run's workers (walk39b: no line, and "run_dir (none)" in its log)
    log = tmp_path / "apart" / "workers" / "roles-1-0.log"
    assert "worker roles-1[0] (rank 0) pid " in caplog.text and f", log {log}" in caplog.text
    assert f"run_dir {tmp_path / 'apart'} ====" in log.read_text().splitlines()[0]


@pytest.mark.gpu
@pytest.mark.parametrize(("algorithm", "moved"), [("ppo", "critic"), ("grpo", "ref")])
def test_role_on_its_own_gpu_matches_one_gpu(tmp_path, algorithm, moved):
    """The same on two GPUs: the moved role's worker sees only GPU 1."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    key = "train/value/loss" if algorithm == "ppo" else "train/policy/actor/kl"
    _compare(tmp_path, algorithm, moved, key, "cluster.device=cuda", rel=1e-3)


def _compare(tmp_path, algorithm, moved, key, *device, rel=1e-4):
    extra = [f"train.algorithm={algorithm}", *device]
    if algorithm == "grpo":
        extra.append("train.algorithm_kwargs={kl_coef: 0.05}")  # grpo with a reference role
    together, _ = _run(role_run_config(tmp_path, "together", *extra))
    apart, pids = _run(
        role_run_config(tmp_path, "apart", *extra, f"cluster.role_devices={{{moved}: [1]}}", "train.save_interval=2")
    )
    if algorithm == "ppo":  # the worker writes the critic's part of the checkpoint
        assert (max((tmp_path / "apart" / "checkpoints").glob("step_*")) / "value" / ".metadata").is_file()
    assert len(pids) == 1
    steps = [m for m in together if "train/policy/loss" in m]
    assert len(steps) == STEPS and len([m for m in apart if "train/policy/loss" in m]) == STEPS
    for a, b in zip(steps, [m for m in apart if "train/policy/loss" in m]):
        assert key in a
        for name, value in a.items():
            if name.startswith(("train/", "rollout/reward")) and isinstance(value, float):
                assert b[name] == pytest.approx(value, rel=rel, abs=1e-6), name


def test_role_devices_errors_before_start(tmp_path):
    with pytest.raises(ConfigError, match="role 'value' is not a role of the recipe"):
        Trainer.init(role_run_config(tmp_path, "a", "cluster.role_devices={value: [1]}"))
    with pytest.raises(ConfigError, match="does not exist"):
        Trainer.init(
            role_run_config(tmp_path, "b", "train.algorithm=ppo", f"cluster.role_devices={{value: [{os.cpu_count()}]}}")
        )
    with pytest.raises(ConfigError, match="partitioned"):
        role_run_config(
            tmp_path, "c", "cluster.train_devices=[0]", "cluster.rollout_devices=[1]", "cluster.role_devices={ref: [2]}"
        )
    mode = "cluster.allocation_mode='areno:d1+fsdp:d1+fsdp[critic]:d1'"  # partitioned: roles train together
    with pytest.raises(ConfigError, match="puts recipe roles on different devices"):
        Trainer.init(role_run_config(tmp_path, "d", "train.algorithm=ppo", mode))
    with pytest.raises(ConfigError, match="'critic'.* is not a role of the recipe"):
        Trainer.init(role_run_config(tmp_path, "e", mode))
    for name in "abde":
        assert not (tmp_path / name).exists()


def test_a_cpu_placement_counts_the_cores_this_process_may_run_on(tmp_path, monkeypatch):
    """walk33: CPU role devices counted os.cpu_count(), so a process pinned to one core (taskset, a cgroup)
    placed a role worker on a core it cannot run on; they count its affinity mask now, as the launcher does."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    with pytest.raises(ConfigError, match="device 1 does not exist"):
        Trainer.init(role_run_config(tmp_path, "a", "train.algorithm=ppo", "cluster.role_devices={value: [1]}"))


def test_build_gpu_allocations():
    roles = ["policy", "value", "reference"]
    got = build_gpu_allocations({"critic": [1], "reference": [1]}, roles, policy_role="policy", num_devices=2)
    assert got == {"policy": (0,), "value": (1,), "reference": (1,)}
    assert build_gpu_allocations({}, roles, policy_role="policy", num_devices=1) == dict.fromkeys(roles, (0,))
    assert build_gpu_allocations({"ref": 2}, roles, policy_role="policy", num_devices=3)["reference"] == (2,)
    cases = [
        ({"teacher": [1]}, "not a role of the recipe"),
        ({"value": [1, 2], "reference": [2]}, "overlap"),
        ({"value": [5]}, "device 5 does not exist"),
        ({"policy": [1]}, "stays on its device"),
        ({"value": [1, 2]}, "exactly one device"),
        ({"value": []}, "non-empty list"),
        ({"critic": [1], "value": [1]}, "named twice"),
    ]
    for role_devices, message in cases:
        with pytest.raises(ConfigError, match=message) as info:
            build_gpu_allocations(role_devices, roles, policy_role="policy", num_devices=3)
        assert "\n" not in str(info.value) and str(info.value).startswith("cluster.role_devices")


@pytest.mark.slow
def test_lost_role_worker_is_a_run_failure_naming_it(tmp_path):
    """A role's worker that dies mid-run fails the next step with one line naming it and its log."""
    cfg = role_run_config(tmp_path, "lost", "train.algorithm=ppo", "cluster.role_devices={critic: [1]}")
    prepare_model_dir(cfg)
    engine = build_engine(cfg, tmp_path / "lost")
    engine.initialize()
    try:
        scheduler = engine.training._placed.scheduler
        rollout = engine.generate_rollout(0)
        os.kill(scheduler.call("roles-1", "pid")[0], signal.SIGKILL)
        with pytest.raises(RunFailure, match=r"roles-1\[0\].*died during forward_only.*log: .*roles-1-0\.log"):
            engine.step(rollout)
    finally:
        engine.shutdown()
    assert scheduler.roles == []  # the workers are stopped
