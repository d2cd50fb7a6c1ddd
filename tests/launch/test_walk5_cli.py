"""`areno launch` and `areno doctor` after the audit walk5 (C1, C2, C5, C7, A3's dry run): the
allocation check refuses what `areno train` refuses, with the run's own messages; the storage
check creates nothing; doctor reports the launchers and inference servers with the install hints
the run's errors give; `areno launch slurm-script` prints the job script without submitting it."""

from __future__ import annotations

import json
import os
import sys

import pytest

from areno.api.config import load_config
from areno.cli import main
from areno.errors import ConfigError
from areno.launch.storage import check_shared_storage
from areno.observe import doctor
from areno.observe.doctor import INSTALL_HINTS


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def config_error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["model.path=unused", *overrides])
    return str(info.value)


# -- C1: areno launch allocation refuses what areno train refuses, with its message -----------------

REFUSED_BY_TRAIN = [
    "areno:d1+fsdp:d4e2t2",
    "areno:d1+fsdp:d2c2t2",
    "vllm:d1+fsdp:d2t2",
    "sglang:d1+megatron:d1",
    "areno:d2|fsdp:d2",
]


@pytest.mark.parametrize("mode", REFUSED_BY_TRAIN)
def test_launch_allocation_refuses_what_train_refuses_with_the_same_message(capsys, mode):
    train_says = config_error(f"cluster.allocation_mode='{mode}'")
    code, out, err = run(capsys, "launch", "allocation", mode)
    assert (code, out) == (2, "")
    assert err == f"areno: error: {train_says}\n"


def test_launch_allocation_checks_the_recipe_roles_and_the_layout(capsys):
    code, _, err = run(capsys, "launch", "allocation", "areno:d1|fsdp:d1+fsdp[critic]:d1")
    assert code == 2 and "role 'critic' is not a role of the recipe" in err and "--algorithm grpo" in err
    code, out, _ = run(capsys, "launch", "allocation", "areno:d1|fsdp:d1+fsdp[critic]:d1", "--algorithm", "ppo")
    assert code == 0 and json.loads(out)["device_lists"] == {"rollout": [0], "actor": [0], "critic": [1]}
    critic = ("launch", "allocation", "areno:d1|fsdp:d1+fsdp[critic]:d1", "--algorithm", "ppo", "--devices")
    code, _, err = run(capsys, *critic, "1")  # role placements on --devices GPUs, as on a machine with that many
    assert code == 2 and "cluster.allocation_mode.critic: device 1 does not exist: 1 device(s)" in err
    assert run(capsys, *critic, "2")[0] == 0
    code, _, err = run(capsys, "launch", "allocation", "areno:d1+fsdp:d1", "--algorithm", "sft")
    assert code == 2 and "trains offline on the dataset's rows in this process" in err
    code, out, _ = run(capsys, "launch", "allocation", "areno[rollout]:d2t2+fsdp[actor]:d4", "--devices", "8")
    assert code == 0
    assert json.loads(out)["layout"].startswith("train [4, 5, 6, 7] (mesh rep x shard x tp = (1, 4, 1))")
    code, _, err = run(capsys, "launch", "allocation", "areno:d4+fsdp:d4", "--devices", "4")
    assert code == 2 and "needs 8 devices but only 4 are available" in err


def test_launch_allocation_refuses_a_device_count_below_one(capsys):
    with pytest.raises(SystemExit) as info:
        main(["launch", "allocation", "areno:d1+fsdp:d1", "--devices", "-1"])
    assert info.value.code == 2
    assert "--devices: must be >= 1, got -1" in capsys.readouterr().err


# -- C2: expert and context parallelism blame the right dimension and name the fix ------------------


@pytest.mark.parametrize(
    "mode, says",
    [
        (
            "areno:d1+fsdp:d2c2t2",
            "context parallelism c2 and tensor parallelism t2 do not combine on fsdp: use fsdp:d4c2 (the same 4 "
            "devices with context parallelism) or fsdp:d2t2",
        ),
        (
            "areno:d1+fsdp:d4e2t2",
            "expert parallelism e2 and tensor parallelism t2 do not combine on fsdp: use fsdp:d8e2 (the same 8 "
            "devices with expert parallelism) or fsdp:d4t2",
        ),
        (
            "areno:d1+fsdp[critic]:d4c2e2",
            "context parallelism c2 and expert parallelism e2 do not combine on fsdp: use fsdp[critic]:d4c2 "
            "(context parallelism only) or fsdp[critic]:d4e2",
        ),
    ],
)
def test_expert_and_context_errors_name_the_key_the_dimension_and_the_fix(mode, says):
    message = config_error(f"cluster.allocation_mode='{mode}'")
    assert message.startswith(f"cluster.allocation_mode: invalid allocation_mode at column 10: {says}\n  {mode}\n")


@pytest.mark.parametrize("mode", ["areno:d1+fsdp:d2c2", "areno:d1+fsdp:d4e2", "areno:d1t2+fsdp:d2t2"])
def test_the_combinations_that_run_still_parse(capsys, mode):
    assert run(capsys, "launch", "allocation", mode)[0] == 0


# -- C5: areno launch storage creates nothing -------------------------------------------------------


def test_launch_storage_refuses_a_missing_path_and_creates_nothing(capsys, tmp_path):
    typo = tmp_path / "typo_dir" / "sub"
    code, out, err = run(capsys, "launch", "storage", str(typo))
    assert (code, out) == (2, "")
    assert err == (
        f"areno: error: storage path '{typo}' does not exist (its nearest existing directory is '{tmp_path}'): "
        f"create it first (mkdir -p {typo}) or fix the path\n"
    )
    assert not (tmp_path / "typo_dir").exists()
    assert run(capsys, "launch", "storage", "/nonexistent/x")[0] == 2
    assert not os.path.exists("/nonexistent")


def test_launch_storage_probes_an_existing_directory_and_leaves_it_as_it_was(capsys, tmp_path):
    (tmp_path / "keep").write_text("x")
    code, out, _ = run(capsys, "launch", "storage", str(tmp_path))
    assert code == 0 and json.loads(out) == {"ok": [str(tmp_path)]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep"]
    (tmp_path / "file").write_text("x")
    code, _, err = run(capsys, "launch", "storage", str(tmp_path / "file"))
    assert code == 2 and "is not a directory" in err


def test_the_run_still_creates_its_directory():
    """The run's own probe (``check_shared_storage`` without ``must_exist``) creates a missing run_dir."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        check_shared_storage([os.path.join(tmp, "run")])
        assert os.path.isdir(os.path.join(tmp, "run"))


# -- C7: doctor reports the launchers and servers, with the run's install hints --------------------


def fake_tools(tmp_path, names):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in names:
        (bin_dir / name).write_text("#!/bin/sh\nexit 0\n")
        (bin_dir / name).chmod(0o755)
    return bin_dir


def test_doctor_reports_slurm_tools_and_require_gates_on_them(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(fake_tools(tmp_path, ["sbatch", "squeue", "scancel", "srun"])))
    assert doctor.main(["--json", "--require", "slurm"]) == 0
    (slurm,) = [c for c in json.loads(capsys.readouterr().out)["optional"] if c["name"] == "slurm"]
    assert slurm == {"name": "slurm", "ok": True, "detail": f"sbatch, squeue, scancel, srun in {tmp_path / 'bin'}"}
    (tmp_path / "bin" / "scancel").unlink()
    assert doctor.main(["--require", "slurm"]) == 1
    out, err = capsys.readouterr()
    assert "--  slurm" in out and "scancel not on PATH" in out
    assert "required check(s) failed: slurm" in err


def test_doctor_reports_inference_servers_and_peft(capsys, monkeypatch):
    for module in ("vllm", "sglang"):
        monkeypatch.setitem(sys.modules, module, None)
    assert doctor.main(["--json"]) == 0
    optional = {c["name"]: c for c in json.loads(capsys.readouterr().out)["optional"]}
    assert optional["vllm"]["detail"] == f"not installed (vllm): {INSTALL_HINTS['vllm']} (rollout.backend=vllm)"
    assert optional["sglang"]["detail"].endswith(f"{INSTALL_HINTS['sglang']} (rollout.backend=sglang)")
    assert optional["peft"]["ok"] and optional["peft"]["detail"].startswith("peft ")
    for name in ("vllm", "sglang", "peft", "slurm", "ray"):
        assert name in doctor.check_names()
    assert doctor.main(["--require", "peft"]) == 0


def test_the_install_hints_are_those_the_run_gives(monkeypatch, tmp_path):
    """doctor and the run's own errors quote the same command (one constant for ray)."""
    from areno.engine.cluster import ClusterLayout, scheduler_for

    monkeypatch.setitem(sys.modules, "ray", None)
    monkeypatch.delitem(sys.modules, "areno.launch.ray_scheduler", raising=False)
    cluster = load_config(
        None, ["model.path=unused", "cluster.scheduler=ray", "cluster.train_devices=[0]", "cluster.rollout_devices=[1]"]
    ).cluster
    with pytest.raises(
        ConfigError, match=f"; {INSTALL_HINTS['ray']} or use cluster.scheduler=local$".replace("[", r"\[")
    ):
        scheduler_for(cluster, ClusterLayout(train_devices=(0,), rollout_devices=(1,)), log_dir=str(tmp_path))
    (ray,) = [c for c in doctor.optional_parts() if c.name == "ray"]
    assert ray.detail == f"not installed (ray): {INSTALL_HINTS['ray']}"
    from areno.launch.servers import check_server_install

    for backend in ("vllm", "sglang"):
        monkeypatch.setitem(sys.modules, backend, None)
        monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
        with pytest.raises(ConfigError, match=INSTALL_HINTS[backend].replace("[", r"\[")):
            check_server_install(backend)


# -- A3: the SLURM dry run -------------------------------------------------------------------------

TINY = [
    "model.init_tiny={hidden_size: 32, layers: 1, heads: 4, kv_heads: 2, intermediate_size: 64}",
    "data.task=sort",
    "cluster.device=cpu",
]


def test_slurm_script_prints_the_job_without_submitting_it(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{fake_tools(tmp_path, [])}{os.pathsep}{os.environ['PATH']}")  # no SLURM tools
    code, out, err = run(
        capsys,
        "launch",
        "slurm-script",
        f"model.path={tmp_path / 'model'}",
        f"run_dir={tmp_path / 'run'}",
        *TINY,
        "cluster.allocation_mode='areno:d1+fsdp:d2'",
        "cluster.scheduler_options={slurm_partition: cpu, slurm_time: null}",
    )
    assert code == 0, err
    assert out.startswith("#!/bin/bash\n#SBATCH --job-name=areno\n")
    assert f"#SBATCH --output={tmp_path / 'run' / 'workers'}/slurm-%j.out\n" in out
    assert "#SBATCH --partition=cpu\n#SBATCH --ntasks=3\n" in out and "--time" not in out
    assert out.count("srun --exact") == 2 and "--role train --slurm &" in out and "--role rollout --slurm &" in out
    assert "no --time: the partition's default time limit applies" in err
    assert "add cluster.scheduler=slurm to use it" in err
    assert not (tmp_path / "run").exists()  # nothing written, nothing submitted


def test_slurm_script_of_a_colocated_run_is_refused(capsys, tmp_path):
    code, out, err = run(capsys, "launch", "slurm-script", f"model.path={tmp_path}", *TINY)
    assert (code, out) == (2, "")
    assert err.startswith("areno: error: cluster.allocation_mode: this run is colocated (one process)")


# -- C9: scheduler_options did-you-mean (a change to areno/launch/scheduler.py, not made here) -------


def test_an_unknown_scheduler_option_suggests_the_known_one():
    message = config_error(
        "cluster.scheduler=ray",
        "cluster.train_devices=[0]",
        "cluster.rollout_devices=[1]",
        "cluster.scheduler_options={ray_adress: auto}",
    )
    assert message.startswith(
        "cluster.scheduler_options.ray_adress is not a scheduler option (did you mean ray_address?)"
    )
