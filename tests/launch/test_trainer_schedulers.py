"""The same tiny GRPO run through the LocalScheduler and the RayScheduler gives identical metrics.

The drift this test once allowed (step-2 losses ~1e-8 apart, grad_norm a few % apart) was not the
scheduler: which requests shared a rollout-engine step depended on thread timing (the engine's
driver thread admitted requests as they arrived), requests without a seed shared one sampling
generator, and on CPU a row's log-probs change in their last bits with the batch it sits in, so
two LocalScheduler runs differed as much (bench/LOG.md). Synchronous rollouts now start the
engine on the whole burst with per-episode seeds (``areno.engine.ledger.SeedingClient``), and the
runs agree bit for bit. Evaluation holds its burst the same way.
"""

import pytest

from tests.helpers.launch_workers import runtime_info

WORKER = "tests.helpers.launch_workers:TrainerWorker"
ENV = {"OMP_NUM_THREADS": "1"}


def _overrides(root):
    return [
        f"run_dir={root / 'run'}",
        f"model.path={root / 'model'}",
        "model.init_tiny={hidden_size: 32, layers: 1, heads: 2, kv_heads: 1, intermediate_size: 64}",
        "data.task=arithmetic",
        "data.num_eval=16",
        "rollout.batch_size=4",
        "rollout.n_samples=4",
        "rollout.max_new_tokens=4",
        "cluster.device=cpu",
        "observe.console=false",
        "train.steps=3",
        "train.eval_interval=0",
        "train.seed=3",
        "optim.lr=0.02",
        "reward.fn=tests.helpers.launch_workers:digits",
    ]


def _deterministic(rows):
    """Drop wall-clock figures; everything else must match bit for bit."""
    return [
        {k: v for k, v in r.items() if not any(w in k for w in ("time", "timing", "_s", "throughput", "per_s"))}
        for r in rows
    ]


def _run(sched, root):
    from areno.launch.storage import check_shared_storage

    sched.create_workers("trainer", WORKER, 1, env=ENV, args=(_overrides(root),))
    check_shared_storage([str(root)], sched)
    info = sched.call("trainer", runtime_info)[0]
    return info, _deterministic(sched.call("trainer", "run")[0])


@pytest.mark.slow
def test_same_grpo_through_local_and_ray(tmp_path):
    from areno.launch.ray_scheduler import RayScheduler
    from areno.launch.scheduler import LocalScheduler

    with LocalScheduler(log_dir=str(tmp_path / "logs")) as sched:
        local_info, local = _run(sched, tmp_path / "local")
    with RayScheduler(cpus_per_worker=1, num_cpus=2) as sched:
        ray_info, ray_rows = _run(sched, tmp_path / "ray")

    assert local_info == ray_info  # same intra/inter-op threads, OMP/MKL env, CPU kernels
    steps = [r for r in local if "rollout/reward_mean" in r]
    assert len(steps) == 3 and all("train/policy/loss" in r for r in steps)
    assert "eval/accuracy" in local[-1]
    assert local == ray_rows  # every step, every metric, bit for bit
    # the runs learned something (otherwise identical metrics would prove little)
    assert len({r["rollout/reward_mean"] for r in steps}) > 1
    assert all(r["train/policy/grad_norm"] > 0 for r in steps)
