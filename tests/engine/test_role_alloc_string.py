"""Role placements through ``cluster.allocation_mode``: with rollout and the policy colocated in one
group (``areno:d1|fsdp:d1``), the string's other components place recipe roles exactly as
``cluster.role_devices`` does."""

import json
import os

import pytest

from areno.api.trainer import Trainer
from areno.engine.api import resolve_recipe
from areno.engine.partitioned import is_partitioned
from areno.engine.roles import places_roles, role_allocation
from areno.errors import ConfigError
from areno.launch.allocation import parse_allocation_mode, role_placements
from tests.helpers.configs import role_run_config

STRING = "cluster.allocation_mode='areno:d1|fsdp:d1+fsdp[critic]:d1'"
KEYS = "cluster.role_devices={critic: [1]}"


def test_string_places_roles_as_role_devices(tmp_path):
    by_string = role_run_config(tmp_path, "s", "train.algorithm=ppo", STRING)
    by_key = role_run_config(tmp_path, "k", "train.algorithm=ppo", KEYS)
    assert not is_partitioned(by_string) and places_roles(by_string) and places_roles(by_key)
    placed = role_allocation(by_string, resolve_recipe(by_string))
    assert placed == role_allocation(by_key, resolve_recipe(by_key)) == {"policy": (0,), "value": (1,)}
    partitioned = role_run_config(tmp_path, "p", "train.algorithm=ppo", "cluster.allocation_mode='areno:d1+fsdp:d1'")
    assert is_partitioned(partitioned) and not places_roles(partitioned)


def _metrics(cfg) -> list[dict]:
    trainer = Trainer.init(cfg)
    try:
        trainer.run()
        pids = trainer.backend.engine.training._placed.scheduler.call("roles-1", "pid")
    finally:
        trainer.shutdown()
    assert len(pids) == 1 and pids[0] != os.getpid()  # the critic trained in a worker of its own
    lines = (trainer.run_dir / "metrics.jsonl").read_text().splitlines()
    return [m for m in map(json.loads, lines) if "train/policy/loss" in m]


@pytest.mark.slow
def test_ppo_critic_placed_by_string_matches_role_devices(tmp_path):
    steps = ["train.algorithm=ppo", "train.steps=2"]
    by_key = _metrics(role_run_config(tmp_path, "key", *steps, KEYS))
    by_string = _metrics(role_run_config(tmp_path, "string", *steps, STRING))
    assert len(by_key) == len(by_string) == 2
    for a, b in zip(by_key, by_string):
        assert "train/value/loss" in a
        for name, value in a.items():
            if name.startswith(("train/", "rollout/reward")) and isinstance(value, float):
                assert b[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name


def _one_line(info) -> str:
    message = str(info.value)
    assert "\n" not in message
    return message


def test_string_role_placement_errors(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="both place recipe roles: set one") as info:
        role_run_config(tmp_path, "a", "train.algorithm=ppo", STRING, KEYS)
    assert _one_line(info).startswith("cluster.role_devices")
    with pytest.raises(ConfigError, match="give that group d1") as info:
        role_run_config(
            tmp_path, "b", "train.algorithm=ppo", "cluster.allocation_mode='areno:d2|fsdp:d2+fsdp[critic]:d1'"
        )
    with pytest.raises(ConfigError, match="need areno's engine"):
        role_run_config(
            tmp_path, "c", "train.algorithm=ppo", "cluster.allocation_mode='vllm:d1|fsdp:d1+fsdp[critic]:d1'"
        )
    monkeypatch.setattr(os, "cpu_count", lambda: 4)  # the devices of a CPU run: one worker per core it may use
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    cases = [
        ("grpo", "areno:d1|fsdp:d1+fsdp[critic]:d1", "role 'critic' is not a role of the recipe"),
        ("ppo", "areno:d1|fsdp:d1+fsdp[critic]:d4", "device 4 does not exist"),
        ("ppo", "areno:d1|fsdp:d1+fsdp[critic]:d2", "exactly one device"),
        ("ppo", "fsdp[critic]:d1+areno:d1|fsdp:d1", "stays on its device"),
    ]
    for i, (algorithm, mode, message) in enumerate(cases):
        with pytest.raises(ConfigError, match=message) as info:
            Trainer.init(
                role_run_config(tmp_path, f"e{i}", f"train.algorithm={algorithm}", f"cluster.allocation_mode='{mode}'")
            )
        assert _one_line(info).startswith("cluster.allocation_mode")
        assert not (tmp_path / f"e{i}").exists()


def test_role_placements_of_strings():
    colocated = parse_allocation_mode("areno:d1|fsdp:d1|fsdp[ref]:d1+fsdp[critic]:d1|fsdp[rm]:d1")
    assert role_placements(colocated) == {"actor": [0], "ref": [0], "critic": [1], "rm": [1]}
    for partitioned in ("areno:d1+fsdp:d1", "areno:d1+fsdp:d1|fsdp[critic]:d1", "areno:d1|fsdp:d1"):
        assert role_placements(parse_allocation_mode(partitioned)) is None
