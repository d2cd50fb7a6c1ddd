"""SlurmScheduler: the rendered script, one-line errors, and (slow) a real single-node cluster."""

import textwrap

import pytest

from areno.launch.factory import scheduler_from_config
from areno.launch.scheduler import RoleSpec, SchedulerConfig, SchedulerError, WorkerDiedError
from areno.launch.slurm import SlurmScheduler, render_sbatch
from tests.helpers.launch_workers import local_gradient
from tests.helpers.slurm_cluster import minimal_sbatch, slurm_available, slurm_cluster

EXPECTED = textwrap.dedent(
    """\
    #!/bin/bash
    #SBATCH --job-name=areno
    #SBATCH --output=/shared/job/slurm-%j.out
    #SBATCH --chdir=/src
    #SBATCH --time=02:00:00
    #SBATCH --partition=gpu
    #SBATCH --account=rl
    #SBATCH --ntasks=7
    #SBATCH --cpus-per-task=2
    #SBATCH --gpus=8
    #SBATCH --qos=high
    #SBATCH --exclusive

    set -euo pipefail
    source /opt/venv/bin/activate
    export PYTHONPATH=/src
    export ARENO_RPC_AUTHKEY="$(cat /shared/job/authkey)"
    srun --exact --ntasks=2 --cpus-per-task=2 --gpus-per-task=2 --output=/shared/job/rollout-%t.log env ARENO_RANK_OFFSET=0 ARENO_ROLE=rollout MASTER_PORT=29500 WORLD_SIZE=6 /opt/venv/bin/python -c 'import sys; from areno.launch.worker import main; sys.exit(main())' --connect ctl:5000 --role rollout --slurm &
    srun --exact --ntasks=4 --cpus-per-task=2 --gpus-per-task=1 --output=/shared/job/actor-%t.log env ARENO_RANK_OFFSET=2 ARENO_ROLE=actor MASTER_PORT=29500 OMP_NUM_THREADS=1 WORLD_SIZE=6 X='a b' /opt/venv/bin/python -c 'import sys; from areno.launch.worker import main; sys.exit(main())' --connect ctl:5000 --role actor --slurm &
    srun --exact --ntasks=1 --cpus-per-task=2 --output=/shared/job/ref-%t.log env ARENO_RANK_OFFSET=0 ARENO_ROLE=ref MASTER_PORT=29501 WORLD_SIZE=1 /opt/venv/bin/python -c 'import sys; from areno.launch.worker import main; sys.exit(main())' --connect ctl:5000 --role ref --slurm &
    wait
    """
)


def test_render_one_step_per_role():
    cfg = SchedulerConfig(
        type="slurm",
        slurm_partition="gpu",
        slurm_account="rl",
        slurm_time="02:00:00",
        slurm_cpus_per_task=2,
        slurm_extra_sbatch_lines=("--qos=high", "#SBATCH --exclusive"),
        slurm_setup_lines=("source /opt/venv/bin/activate",),
    )
    specs = [
        # rollout and actor share one torch.distributed world (ranks 0-1 and 2-5); ref has its own
        RoleSpec(role="rollout", worker_cls="m:C", n=2, devices=[0, 1, 2, 3], world="w"),
        RoleSpec(
            role="actor",
            worker_cls="m:C",
            n=4,
            devices=[4, 5, 6, 7],
            env={"OMP_NUM_THREADS": "1", "X": "a b"},
            world="w",
        ),
        RoleSpec(role="ref", worker_cls="m:C", n=1),
    ]
    script = render_sbatch(
        specs,
        cfg=cfg,
        controller="ctl:5000",
        job_dir="/shared/job",
        master_ports={"w": 29500, "role:ref": 29501},
        python="/opt/venv/bin/python",
        pythonpath="/src",
        workdir="/src",
    )
    assert script == EXPECTED


def test_render_minimal():
    script = minimal_sbatch(SchedulerConfig(type="slurm"))
    assert "--partition" not in script and "--account" not in script and "--gpus" not in script
    assert "#SBATCH --time=01:00:00\n" in script and "#SBATCH --ntasks=1\n" in script


def test_sbatch_missing_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SchedulerError, match=r"^'sbatch' not found on PATH: cluster.scheduler=slurm needs") as info:
        scheduler_from_config({"type": "slurm"})
    assert "\n" not in str(info.value)


@pytest.mark.slow
@pytest.mark.skipif(slurm_available() is not None, reason=str(slurm_available()))
def test_real_single_node_cluster(tmp_path, monkeypatch):
    """slurmctld + slurmd started here: two roles in one world, a gloo all-reduce, restart, job failure."""
    with slurm_cluster(tmp_path / "cluster") as env:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        cfg = SchedulerConfig(
            type="slurm",
            log_dir=str(tmp_path / "job"),
            slurm_controller_addr="127.0.0.1",
            connect_timeout_s=120,
            slurm_poll_interval_s=0.5,
        )
        worker, wenv = "tests.helpers.launch_workers:GradWorker", {"OMP_NUM_THREADS": "1"}
        with scheduler_from_config(cfg) as sched:
            assert isinstance(sched, SlurmScheduler)
            handles = sched.create_roles(
                [
                    RoleSpec(role="rollout", worker_cls=worker, n=1, args=(7,), env=wenv, world="w"),
                    RoleSpec(role="actor", worker_cls=worker, n=2, args=(7,), env=wenv, world="w"),
                ]
            )
            assert [h.rank for h in handles["rollout"] + handles["actor"]] == [0, 1, 2]
            assert sched.call("actor", "env", "RANK") == ["1", "2"]
            assert sched.call("actor", "env", "WORLD_SIZE") == ["3", "3"]
            assert sched.call("actor", "env", "SLURM_JOB_ID") == sched.job_ids * 2
            futures = sched.submit("rollout", "init_dist") + sched.submit("actor", "init_dist")
            assert [f.result(timeout=120) for f in futures] == [(0, 3), (1, 3), (2, 3)]
            futures = sched.submit("rollout", "allreduced_gradient") + sched.submit("actor", "allreduced_gradient")
            got = [f.result(timeout=120) for f in futures]
            expected = (local_gradient(7, 0) + local_gradient(7, 1) + local_gradient(7, 2)).tolist()
            assert got[0] == got[1] == got[2]
            assert got[0] == pytest.approx(expected, rel=1e-12)

            pid = sched.call("actor", "pid")[1]
            with pytest.raises(WorkerDiedError, match=r"actor\[1\] .* died during crash"):
                sched.submit_one("actor", 1, "crash").result(timeout=60)
            handle = sched.restart_worker("actor", 1)
            assert handle.pid != pid
            assert sched.submit_one("actor", 1, "count").result() == 1
            assert sched.submit_one("actor", 1, "env", "RANK").result() == "2"
            assert sched.submit_one("actor", 1, "env", "SLURM_JOB_ID").result() == sched.job_ids[0]

        # a job whose workers cannot start ends the wait with the job's state, not a timeout
        with SlurmScheduler(cfg, python="/nonexistent/python") as sched:
            with pytest.raises(WorkerDiedError, match=r"SLURM job \d+ is \w+ before its workers connected; log "):
                sched.create_workers("actor", worker, 1)
            assert sched.roles == []
