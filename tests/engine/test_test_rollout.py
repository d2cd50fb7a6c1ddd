"""The test rollout reached from the config (``test_rollout`` section): a CPU run's ``test/*``
metrics of checkpoint k equal a direct greedy evaluation of checkpoint k's ``hf/`` export."""

import asyncio
import json
import threading

import pytest
import torch

from areno.api.backend.areno.backend import ArenoBackend
from areno.api.config import load_config
from areno.api.trainer import Trainer
from areno.data.datasets import build_splits
from areno.engine.api import load_tokenizer, resolve_recipe
from areno.engine.local import LocalRolloutSide
from areno.engine.scoring import ascore_row, eval_params
from areno.engine.seams import SideSetup
from areno.engine.test_rollout import TestRolloutManager
from areno.errors import ConfigError
from areno.rewards.loader import load_reward
from tests.helpers.configs import run_to_end, tiny_run_overrides

REWARD = "tests.helpers.rewards:first_char"  # varies with the completion: each checkpoint scores its own


def _config(tmp_path, *extra):
    overrides = tiny_run_overrides(tmp_path, num_eval=6, reward=REWARD)
    return load_config(None, [*overrides, "reward.sandbox=false", "train.eval_interval=0", *extra])


def direct_accuracy(cfg, hf_dir) -> float:
    """Greedy held-out accuracy of a fresh rollout engine loaded from ``hf_dir`` (no hot-load)."""
    tokenizer = load_tokenizer(hf_dir)
    side = LocalRolloutSide(cfg, torch.device("cpu"))
    side.start(SideSetup(recipe=resolve_recipe(cfg), model_dir=hf_dir, tokenizer=tokenizer))
    _, rows = build_splits(cfg.data)
    reward_fn = load_reward(cfg.reward)
    params = eval_params(cfg, 1, None, name="train.eval_samples")  # greedy

    async def score_all():
        return await asyncio.gather(*(ascore_row(side.client, tokenizer, reward_fn, row, cfg, params) for row in rows))

    try:
        trajectories = asyncio.run(score_all())
    finally:
        side.shutdown()
    return sum(t.reward for t in trajectories) / len(trajectories)


def test_test_rollout_accuracy_equals_direct_evaluation_of_the_checkpoint(tmp_path):
    cfg = _config(tmp_path, "train.steps=3", "optim.lr=0.05", "test_rollout.enabled=true", "test_rollout.interval=1")
    rows = run_to_end(cfg)
    test_rows = [r for r in rows if "test/accuracy" in r]
    steps = [int(r["test/step"]) for r in test_rows]
    assert steps and steps[-1] == 3, steps  # the last checkpoint is always waited for
    assert steps == sorted(set(steps)), steps
    for row in test_rows:
        k = int(row["test/step"])
        assert row["step"] == k
        assert row["test/num_prompts"] == 6
        hf_dir = tmp_path / "run" / "checkpoints" / f"step_{k:08d}" / "hf"
        assert row["test/accuracy"] == pytest.approx(direct_accuracy(cfg, hf_dir), abs=1e-12), k
    # the checkpoint was loaded indeed: its score is not the base model's
    assert test_rows[-1]["test/accuracy"] != pytest.approx(direct_accuracy(cfg, tmp_path / "model"))
    # a checkpoint for it at every interval, though train.save_interval is 0
    for k in (1, 2, 3):
        assert (tmp_path / "run" / "checkpoints" / f"step_{k:08d}" / "COMPLETE").is_file()


def test_disabled_by_default_changes_nothing(tmp_path):
    cfg = _config(tmp_path, "train.steps=2")
    assert cfg.test_rollout.enabled is False
    rows = run_to_end(cfg)
    assert not any(key.startswith("test/") for row in rows for key in row)
    names = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert names == ["step_00000002"]  # only train.save_interval's (the end)


@pytest.mark.parametrize(
    "override, message",
    [
        ("test_rollout.enable=true", "enable"),
        ("test_rollout.interval=0", "test_rollout.interval: must be >= 1"),
        ("test_rollout.device=tpu", "test_rollout.device: must be one of auto, cpu, cuda"),
        ("test_rollout.num_prompts=-1", "test_rollout.num_prompts"),
    ],
)
def test_bad_key_is_a_one_line_config_error(tmp_path, override, message):
    with pytest.raises(ConfigError, match=message) as info:
        _config(tmp_path, override)
    assert "\n" not in str(info.value)


def test_partitioned_placement_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="test_rollout.enabled: .*colocated run only") as info:
        _config(tmp_path, "test_rollout.enabled=true", "cluster.train_devices=[0]", "cluster.rollout_devices=[1]")
    assert "\n" not in str(info.value)


def test_a_stuck_evaluation_never_blocks_training(tmp_path, monkeypatch, caplog):
    """The evaluation hangs until the run is over: every step still trains and logs, and the end of
    the run waits only test_rollout.final_timeout_s for it (a warning names the missing step)."""
    gate = threading.Event()
    evaluate = TestRolloutManager._evaluate

    def stuck(self):
        assert gate.wait(60), "the test never released the evaluation"
        return evaluate(self)

    monkeypatch.setattr(TestRolloutManager, "_evaluate", stuck)
    cfg = _config(
        tmp_path,
        "train.steps=3",
        "test_rollout.enabled=true",
        "test_rollout.interval=1",
        "test_rollout.final_timeout_s=0.2",
    )
    trainer = Trainer.init(cfg)
    try:
        trainer.run()
    finally:
        gate.set()
        trainer.shutdown()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "rollout/reward_mean" in r] == [1, 2, 3]
    assert not any("test/accuracy" in r for r in rows)
    assert "checkpoint step 3 not evaluated within test_rollout.final_timeout_s" in caplog.text


def test_reward_errors_of_the_evaluation_are_counted(tmp_path):
    """A reward that raises scores 0 on every held-out row, and test/reward_errors says so."""
    cfg = _config(tmp_path, "train.steps=1", "test_rollout.enabled=true", "reward.fn=tests.helpers.rewards:exploding")
    rows = [r for r in run_to_end(cfg) if "test/accuracy" in r]
    assert [(r["test/step"], r["test/accuracy"], r["test/reward_errors"]) for r in rows] == [(1, 0.0, 6)]


def test_sampled_evaluation_settings_reach_the_test_rollout(tmp_path):
    """train.eval_samples=3: the test rollout scores checkpoint k as `areno eval` does (its mean reward
    and pass@k over the same seeded samples), and logs test/pass@k."""
    from areno.engine.evaluation import EvalOptions, run_eval

    cfg = _config(
        tmp_path, "train.steps=2", "optim.lr=0.05", "test_rollout.enabled=true", "test_rollout.interval=1",
        "train.eval_samples=3", "train.eval_temperature=1.0", f"train.eval_pass_threshold={3 / 7}",
    )  # fmt: skip
    rows = {int(r["test/step"]): r for r in run_to_end(cfg) if "test/accuracy" in r}
    assert 2 in rows
    for step, row in rows.items():
        alone = run_eval(cfg, EvalOptions(checkpoint=str(tmp_path / "run" / "checkpoints" / f"step_{step:08d}")))
        assert row["test/num_prompts"] == 6
        assert row["test/accuracy"] == pytest.approx(alone["metrics"]["eval/accuracy"], abs=1e-12), step
        for k in (1, 2, 3):
            assert row[f"test/pass@{k}"] == pytest.approx(alone["metrics"][f"eval/pass@{k}"], abs=1e-12), (step, k)


def test_the_test_rollout_engine_leaves_the_training_sides_bytes(tmp_path, monkeypatch):
    """walk33/walk34: the test rollout's engine, on the training device, sized its KV pool from 80% of the memory
    free after the run's own engine, which included what the first training step still allocates; it now leaves
    the bytes the backend names (``Backend.device_bytes_to_come``) for that device."""
    asked = []

    def to_come(self, device):
        asked.append(device)
        return 777

    monkeypatch.setattr(ArenoBackend, "device_bytes_to_come", to_come)
    trainer = Trainer.init(_config(tmp_path, "train.steps=1", "test_rollout.enabled=true"))
    try:
        assert asked == [torch.device("cpu")]
        assert trainer.test_rollout.engine.config.kv_reserved_bytes == 777
        engine = trainer.backend.engine
        assert engine.training_bytes_to_come(torch.device("cpu")) == 0  # a CPU side's pool is not from free memory
        monkeypatch.setattr(engine.training, "device_bytes_to_come", lambda: 5)
        assert engine.training_bytes_to_come(torch.device("cpu")) == 5
        assert engine.training_bytes_to_come(torch.device("cuda", 1)) == 0  # another device than the training one
    finally:
        trainer.shutdown()


def test_a_test_rollout_that_fails_to_start_releases_its_reward_workers(tmp_path, monkeypatch):
    """walk35: a failing engine start left the shared reward sandbox held (its workers alive for the process)."""
    from areno.engine.test_rollout import start_test_rollout
    from areno.rewards import sandbox

    def broken(self, setup):
        raise RuntimeError("engine failed to start")

    monkeypatch.setattr(LocalRolloutSide, "start", broken)
    cfg = load_config(None, [*tiny_run_overrides(tmp_path, num_eval=6, reward=REWARD), "reward.sandbox=true"])
    with pytest.raises(RuntimeError, match="engine failed to start"):
        start_test_rollout(cfg, tmp_path / "run")
    assert not sandbox._POOLS and not sandbox._USERS


def test_the_reward_figures_of_the_evaluation_are_logged(tmp_path):
    """walk48: a reward's named figures reached eval/reward/<name>_mean but not the test rollout's metrics."""
    cfg = _config(
        tmp_path, "train.steps=1", "test_rollout.enabled=true", "reward.fn=tests.helpers.rewards:with_figures"
    )
    (row,) = [r for r in run_to_end(cfg) if "test/accuracy" in r]
    assert row["test/reward/double_mean"] == pytest.approx(2 * row["test/accuracy"])
    assert 0.0 <= row["test/reward/high_mean"] <= 1.0
