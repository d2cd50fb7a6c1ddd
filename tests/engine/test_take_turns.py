"""``rollout.generate_during_train``: an asynchronous colocated run either keeps its engine generating
beside each training step (the CPU default) or takes turns: the engine generates only while the trainer
waits for a batch, so the device runs one side at a time."""

from __future__ import annotations

import time

import pytest

from areno.api.config import load_config
from areno.api.trainer import Trainer
from areno.errors import ConfigError
from tests.helpers.configs import tiny_run_overrides


def _config(tmp_path, *extra):
    """``tiny_run_overrides`` with groups long enough for a running engine to take steps during training."""
    overrides = tiny_run_overrides(tmp_path, num_eval=0)
    more = ["rollout.n_samples=2", "rollout.max_new_tokens=128", "rollout.max_head_offpolicyness=2", "train.steps=2"]
    return load_config(None, [*overrides, *more, *extra])


def _engine_during_training(tmp_path, *extra, settle_s: float = 0.0) -> tuple[list[tuple[bool, int, int]], list[int]]:
    """Per training step: whether the engine was paused, and its step count when the training step began
    and ended (the step itself lasts long enough for a running engine to take steps); and per step the
    engine steps taken from the batch's hand-over to ``settle_s`` after the policy sync."""
    trainer = Trainer.init(_config(tmp_path, *extra))
    engine = trainer.backend.engine
    steps = lambda: engine.rollout.engine.stats()["steps"]
    seen, outside = [], []
    step = engine.training.step

    def slow_step(*args, **kwargs):
        before = steps()
        time.sleep(0.3)
        seen.append((engine.rollout.engine.is_paused, before, steps()))
        return step(*args, **kwargs)

    engine.training.step = slow_step
    try:
        for rollout_id in range(2):
            batch = trainer.rollout_token_batch(rollout_id)
            handed_over = steps()
            trainer.train(rollout_id, batch)
            trainer.backend.update_weights()
            time.sleep(settle_s)  # a running engine would go on generating after the sync
            outside.append(steps() - handed_over)
            assert engine.rollout.engine.is_paused == engine.taking_turns
    finally:
        trainer.shutdown()
    return seen, outside


def test_taking_turns_generates_only_while_the_trainer_waits(tmp_path):
    seen, outside = _engine_during_training(tmp_path, "rollout.generate_during_train=false", settle_s=0.1)
    assert [(paused, before == after) for paused, before, after in seen] == [(True, True), (True, True)]
    assert outside == [0, 0]  # nothing between the training step and the sync, nor after it


def test_on_cpu_the_engine_generates_beside_training_by_default(tmp_path):
    seen, _ = _engine_during_training(tmp_path)
    assert [paused for paused, _, _ in seen] == [False, False]
    assert any(after > before for _, before, after in seen)  # η = 2 batches ahead: there is work to do


def test_taking_turns_evaluates_and_trains_on(tmp_path):
    """The held-out evaluation of a run taking turns generates (the engine is paused between steps)."""
    overrides = tiny_run_overrides(tmp_path, num_eval=4)
    more = ["rollout.max_head_offpolicyness=1", "train.steps=2", "rollout.generate_during_train=false"]
    trainer = Trainer.init(load_config(None, [*overrides, *more]))
    try:
        assert trainer.backend.engine.taking_turns
        metrics = trainer.backend.engine.evaluate()
        assert metrics["eval/num_prompts"] == 4.0
        assert trainer.backend.engine.rollout.engine.is_paused
        trainer.train(0, trainer.rollout_token_batch(0))
        trainer.backend.update_weights()
        assert trainer.backend.engine.version == 1
    finally:
        trainer.shutdown()


@pytest.mark.parametrize(
    "extra, where",
    [
        (["cluster.train_devices=[0]", "cluster.rollout_devices=[1]"], "on its own rollout devices"),
        (["rollout.backend=vllm"], "with vllm servers"),
    ],
)
def test_taking_turns_without_a_shared_device_is_refused(tmp_path, extra, where):
    with pytest.raises(ConfigError, match=f"rollout.generate_during_train: .*{where}.*drop the key"):
        _config(tmp_path, "rollout.generate_during_train=false", *extra)


def test_auto_takes_turns_on_cuda_and_overlaps_on_cpu(tmp_path):
    rollout = _config(tmp_path).rollout
    assert rollout.generate_during_train == "auto"
    assert rollout.resolved_generate_during_train("cpu") and not rollout.resolved_generate_during_train("cuda")
    with pytest.raises(
        ConfigError, match="rollout.generate_during_train: must be true, false or auto, got 'sometimes'"
    ):
        _config(tmp_path, "rollout.generate_during_train=sometimes")
