"""`cluster.scheduler` / `cluster.scheduler_options` pick the partitioned engine's scheduler; the cluster
section's launch checks."""

import subprocess
import sys

import pytest

from areno.api.config import ConfigError, load_config
from areno.engine.cluster import ClusterLayout, LayoutError, scheduler_for
from areno.launch.scheduler import LocalScheduler, SchedulerError
from areno.recipes import get_recipe
from areno.specializations.base import without_gradient_free
from tests.helpers.configs import tiny_run_overrides

PARTITIONED = ["cluster.train_devices=[0]", "cluster.rollout_devices=[1]"]


def _cluster(*overrides):
    return load_config(None, ["model.path=unused", *overrides]).cluster


def _one_line(exc_info) -> str:
    assert "\n" not in str(exc_info.value)
    return str(exc_info.value)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["cluster.scheduler=k8s", *PARTITIONED], r"^cluster.scheduler: must be one of local, ray, slurm; got 'k8s'$"),
        (
            ["cluster.scheduler=ray"],
            r"^cluster.scheduler: ray starts the workers of a partitioned placement, but this "
            r"run is colocated .* or use local$",
        ),
        (
            ["cluster.scheduler=ray", *PARTITIONED, "cluster.scheduler_options={ray_adress: auto}"],
            r"^cluster.scheduler_options.ray_adress is not a scheduler option \(did you mean ray_address\?\); known: connect_timeout_s, log_dir, "
            r"ray_address, ",
        ),
        (
            [
                "cluster.scheduler=slurm",
                "cluster.allocation_mode=areno:d1+fsdp:d1",
                "cluster.scheduler_options={slurm_cpus_per_task: 0}",
            ],
            r"^cluster.scheduler_options.slurm_cpus_per_task must be >= 1, got 0$",
        ),
        (
            ["cluster.scheduler=ray", *PARTITIONED, "cluster.scheduler_options={ray_placement_strategy: FILL}"],
            r"^cluster.scheduler_options.ray_placement_strategy must be one of PACK, SPREAD, STRICT_PACK, STRICT_SPREAD; "
            r"got 'FILL'$",
        ),
        (
            ["cluster.allocation_mode=areno:d2|fsdp:d2"],
            r"^cluster.allocation_mode: 'areno:d2\|fsdp:d2' asks for 2 devices without a '\+', but a colocated run is "
            r"one process on one device: use d1",
        ),
    ],
)
def test_bad_cluster_config_is_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as info:
        _cluster(*overrides)
    _one_line(info)


def test_scheduler_options_reach_the_config():
    c = _cluster(
        "cluster.scheduler=ray", *PARTITIONED, "cluster.scheduler_options={ray_address: auto, ray_cpus_per_worker: 0.5}"
    )
    assert (c.scheduler, c.scheduler_options) == ("ray", {"ray_address": "auto", "ray_cpus_per_worker": 0.5})


def test_local_is_the_default_and_logs_to_the_run(tmp_path):
    cluster = _cluster(*PARTITIONED)
    layout = ClusterLayout(train_devices=(0,), rollout_devices=(1,))
    with scheduler_for(cluster, layout, log_dir=str(tmp_path / "workers")) as sched:
        assert isinstance(sched, LocalScheduler) and sched.log_dir == tmp_path / "workers"


def test_the_launch_package_imports_without_ray():
    """Ray is imported where a Ray scheduler is built, not by ``areno.launch`` or its factory."""
    code = "import sys, areno.launch, areno.launch.factory; assert 'ray' not in sys.modules, 'ray imported'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_ray_not_installed_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    monkeypatch.delitem(sys.modules, "areno.launch.ray_scheduler", raising=False)
    cluster = _cluster("cluster.scheduler=ray", *PARTITIONED)
    with pytest.raises(
        SchedulerError,
        match=r"^cluster.scheduler=ray needs the ray package, which does not import "
        r"here \(.*\); pip install 'areno\[ray\]' or use cluster.scheduler=local$",
    ) as info:
        scheduler_for(cluster, ClusterLayout(train_devices=(0,), rollout_devices=(1,)), log_dir=str(tmp_path))
    _one_line(info)
    assert isinstance(info.value, ValueError)  # what the CLI prints as one line


def test_no_slurm_controller_is_one_line(tmp_path, monkeypatch):
    """SLURM client tools present but no controller answers (no slurm.conf / slurmctld down)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("sbatch", "srun", "scancel"):
        (bin_dir / tool).write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "squeue").write_text(
        "#!/bin/sh\necho 'squeue: error: resolve_ctls_from_dns_srv: res_nsearch error: Unknown host' >&2\n"
        "echo 'squeue: error: _establish_config_source: failed to fetch config' >&2\nexit 1\n"
    )
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    cluster = _cluster("cluster.scheduler=slurm", *PARTITIONED)
    with pytest.raises(
        SchedulerError,
        match=r"^no SLURM controller answers from this host \(squeue: squeue: error: "
        r"_establish_config_source: failed to fetch config\): cluster.scheduler="
        r"slurm needs slurm.conf \(SLURM_CONF\) and a running slurmctld",
    ) as info:
        scheduler_for(cluster, ClusterLayout(train_devices=(0,), rollout_devices=(1,)), log_dir=str(tmp_path))
    _one_line(info)


@pytest.mark.parametrize("scheduler", ["ray", "slurm"])
def test_shared_gpus_need_the_local_scheduler(tmp_path, scheduler):
    cluster = _cluster(f"cluster.scheduler={scheduler}", "cluster.train_devices=[0]", "cluster.rollout_devices=[0]")
    layout = ClusterLayout(train_devices=(0,), rollout_devices=(0,), cuda=True)
    with pytest.raises(
        LayoutError,
        match=rf"^cluster.scheduler={scheduler} gives each worker GPUs of its own, but "
        r"train and rollout share devices \[0\] \(cluster.train_devices=\[0\] / cluster.rollout_devices=\[0\]\): "
        r"use disjoint cluster.train_devices and cluster.rollout_devices, or cluster.scheduler=local$",
    ):
        scheduler_for(cluster, layout, log_dir=str(tmp_path))


@pytest.mark.slow
def test_partitioned_grpo_step_through_ray(tmp_path):
    """The partitioned engine builds its workers as Ray actors when the config says so."""
    from areno.engine.placement import partitioned_engine
    from areno.launch.ray_scheduler import RayScheduler

    cfg = load_config(
        None,
        [
            *tiny_run_overrides(tmp_path, num_eval=2, reward="tests.helpers.launch_workers:digits"),
            *PARTITIONED,
            "cluster.scheduler=ray",
            "cluster.scheduler_options={ray_cpus_per_worker: 0.5}",
        ],
    )
    engine = partitioned_engine(cfg, tmp_path / "run")
    try:
        engine.initialize()
        scheduler = engine.rollout.cluster.scheduler
        assert isinstance(scheduler, RayScheduler)
        assert [(h.rank, h.role) for h in scheduler.workers("train") + scheduler.workers("rollout")] == [
            (0, "train"),
            (1, "rollout"),
        ]
        rollout = engine.generate_rollout(0)
        metrics = engine.step(rollout)
        engine.update_weights()
        # trained: the batch less its zero-advantage sequences (skip_zero_advantage)
        spec = get_recipe(cfg.train.algorithm).roles[0].build()
        kept, _ = without_gradient_free(spec, spec.prepare_batch(rollout.batch))
        assert metrics["train/policy/tokens"] == kept.num_tokens
        assert scheduler.call("rollout", "version") == [1]
        assert 0.0 <= engine.evaluate()["eval/accuracy"] <= 1.0
    finally:
        engine.shutdown()
