"""Overrides of the tiny CPU run the partitioned, sync and scheduler tests share, and a run to its end."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from areno.api.config import load_config
from areno.api.trainer import Trainer
from areno.observe.metrics import read_metrics


def tiny_run_overrides(
    tmp_path: Path, run_name: str = "run", *, num_eval: int = 4, reward: str = "tests.helpers.rewards:sevens_and_length"
) -> list[str]:
    """A one-layer model made at start-up, the arithmetic task, 2 prompts x 4 samples of 4 tokens, on the CPU."""
    return [
        f"run_dir={tmp_path / run_name}",
        f"model.path={tmp_path / 'model'}",
        "model.init_tiny={hidden_size: 32, layers: 1, heads: 2, kv_heads: 1, intermediate_size: 64}",
        "data.task=arithmetic",
        f"data.num_eval={num_eval}",
        "rollout.batch_size=2",
        "rollout.n_samples=4",
        "rollout.max_new_tokens=4",
        "cluster.device=cpu",
        "cluster.cpu_threads=1",
        "observe.console=false",
        "train.seed=3",
        "optim.lr=0.01",
        f"reward.fn={reward}",
    ]


def tiny_grpo_overrides(tmp_path: Path) -> list[str]:
    """The trainer tests' colocated run: a one-layer model, 4 prompts x 8 samples of 4 tokens, on the CPU."""
    return [
        f"run_dir={tmp_path / 'run'}",
        f"model.path={tmp_path / 'model'}",
        "model.init_tiny={hidden_size: 32, layers: 1, heads: 2, kv_heads: 1, intermediate_size: 64}",
        "data.task=arithmetic",
        "data.num_eval=8",
        "rollout.batch_size=4",
        "rollout.n_samples=8",
        "rollout.max_new_tokens=4",
        "cluster.device=cpu",
        "observe.console=false",
    ]


TINY = "model.init_tiny={hidden_size: 32, layers: 1, heads: 2, kv_heads: 1, intermediate_size: 64}"
"""The one-layer model the CLI tests create at start-up."""


def train_args(tmp_path: Path, *extra: str) -> list[str]:
    """``areno train`` arguments of a tiny CPU run whose model (``tmp_path/model``) is created from init_tiny
    when it starts."""
    return [
        "train",
        f"run_dir={tmp_path / 'run'}",
        f"model.path={tmp_path / 'model'}",
        TINY,
        "data.task=arithmetic",
        "data.num_eval=4",
        "rollout.batch_size=2",
        "rollout.n_samples=2",
        "rollout.max_new_tokens=4",
        "cluster.device=cpu",
        "observe.console=false",
        "train.steps=1",
        *extra,
    ]


def role_run_config(tmp_path: Path, name: str, *extra: str, steps: int = 3):
    """The role-placement tests' run: ``tiny_run_overrides`` without evaluation, ``steps`` steps."""
    overrides = tiny_run_overrides(tmp_path, run_name=name)
    return load_config(
        None, [*overrides, "reward.sandbox=false", "train.eval_interval=0", f"train.steps={steps}", *extra]
    )


def shrunk_example_overrides(tmp_path: Path, algorithm_kwargs: dict) -> list[str]:
    """A shipped example config shrunk to one tiny step: a one-layer model made at start-up, 2 prompts x 2
    samples, 2 held-out rows, with ``algorithm_kwargs`` as ``train.algorithm_kwargs``."""
    return [
        f"run_dir={tmp_path / 'run'}",
        f"model.path={tmp_path / 'model'}",
        "model.init_tiny={hidden_size: 32, layers: 1, heads: 2, kv_heads: 1, intermediate_size: 64}",
        "observe.console=false",
        "rollout.batch_size=2",
        "rollout.n_samples=2",
        "data.num_eval=2",
        "train.steps=1",
        "train.algorithm_kwargs={" + ", ".join(f"{k}: {v}" for k, v in algorithm_kwargs.items()) + "}",
    ]


def resumable_run(tmp_path: Path, name: str, steps: int, algorithm_kwargs: str, *extra: str) -> list[dict]:
    """``tiny_run_overrides``' run ``name`` to ``steps`` with ``resume=auto`` and a checkpoint every 2 steps (run
    again with more steps, it resumes), the reward in process, no evaluation; ``algorithm_kwargs`` is
    ``train.algorithm_kwargs``'s YAML. The rows of its ``metrics.jsonl``."""
    overrides = [
        *tiny_run_overrides(tmp_path, run_name=name),
        f"train.steps={steps}",
        "train.save_interval=2",
        "train.eval_interval=0",
        "reward.sandbox=false",
        "resume=auto",
        f"train.algorithm_kwargs={algorithm_kwargs}",
        *extra,
    ]
    return run_to_end(load_config(None, overrides))


def run_to_end(cfg) -> list[dict]:
    """Run ``cfg`` through ``Trainer`` to its last step; the rows of its ``metrics.jsonl``."""
    trainer = Trainer.init(cfg)
    try:
        trainer.run()
    finally:
        trainer.shutdown()
    return read_metrics(Path(cfg.run_dir))


def grpo_rewards_on_tiny(tmp_path: Path, init_tiny: str, lr: float = 0.02) -> list[float]:
    """Each step's mean reward of a 12-step seeded GRPO run on the demo's digit reward (``sevens``) with the
    tiny model ``init_tiny`` (a ``model.init_tiny={...}`` override; ``model.init_tiny=null``: the checkpoint
    in ``tmp_path / "model"``) at learning rate ``lr``: what a model family's learning test reads."""
    cfg = load_config(
        None,
        [
            *tiny_grpo_overrides(tmp_path),
            init_tiny,
            "reward.fn=tests.helpers.rewards:sevens",
            "reward.sandbox=false",
            f"optim.lr={lr}",
            "train.steps=12",
            "train.eval_interval=0",
            "train.seed=1",
        ],
    )
    return [r["rollout/reward_mean"] for r in run_to_end(cfg) if "rollout/reward_mean" in r]


def cluster_section(**kw):
    """A stand-in ``cluster`` section for ``engine.cluster``'s layout and scheduler functions: every layout
    key at its default (no allocation_mode, devices, TP 1, the Ray scheduler), ``kw`` replacing any."""
    base = dict(
        allocation_mode=None,
        train_devices=None,
        rollout_devices=None,
        train_tp=1,
        train_dp_replicate=1,
        rollout_tp=1,
        scheduler="ray",
        scheduler_options=None,
    )
    return SimpleNamespace(**{**base, **kw})
