"""Offline recipes on image rows: a supervised run (and the warm start before RL) and preference recipes put
a row's images into its prompt as rollouts do, and the vision tower trains; a text-only model refuses image
rows in one line."""

from __future__ import annotations

import json
import random

import pytest
import torch

from areno.api.config import load_config
from areno.api.pipeline import run_warm_start
from areno.api.trainer import Trainer
from areno.data.tasks import _count_squares
from areno.engine.api import preference_trajectories, sft_trajectories
from areno.errors import ConfigError, DataError
from areno.models.hf_io import load_model, read_config
from areno.models.vision import ImageInputs, VisionConfig
from areno.workflows.images import image_prompt, row_images
from tests.helpers.configs import tiny_run_overrides
from tests.helpers.vlm import make_vl_dir, vl_overrides

TOWER = "visual.blocks.0.attn.qkv.weight"


def _policy(trainer):
    return trainer.backend.engine.training.runner.backends["policy"]


def _rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [_count_squares(rng) for _ in range(n)]


def test_an_offline_row_takes_its_images_as_a_rollout_does(tmp_path):
    model = make_vl_dir(tmp_path / "model")
    vision = VisionConfig.from_hf(read_config(model).vision)
    trainer = Trainer.init(load_config(None, vl_overrides(tmp_path, 1, **{"train.algorithm": "sft"})))
    tokenizer = trainer.backend.engine.tokenizer
    trainer.shutdown()
    rows = _rows(3)
    for row, traj in zip(rows, sft_trajectories(rows, tokenizer, "prompt", "answer", vision=vision), strict=True):
        ids, inputs = image_prompt(tokenizer, row["prompt"], row_images(row, vision), vision)
        assert traj.prompt_ids == ids and vision.image_token_id in ids  # the rollout's prompt, image tokens expanded
        assert tokenizer.decode(traj.completion_ids) == row["answer"] + tokenizer.eos_token
        assert torch.equal(traj.info["images"]["pixel_values"], inputs.pixel_values)
        assert traj.info["images"]["grid_thw"] == [list(g) for g in inputs.grid_thw]
    pairs = [{"prompt": r["prompt"], "images": r["images"], "chosen": r["answer"], "rejected": "9"} for r in rows]
    trajs = preference_trajectories(pairs, tokenizer, "prompt", vision=vision)
    assert [t.prompt_ids for t in trajs[::2]] == [t.prompt_ids for t in trajs[1::2]]
    assert all(
        torch.equal(
            t.info["images"]["pixel_values"], ImageInputs.from_images(row_images(r, vision), vision).pixel_values
        )
        for t, r in zip(trajs[::2], pairs, strict=True)
    )
    # a text row beside them keeps no images
    (text,) = sft_trajectories([{"prompt": "count:", "answer": "1"}], tokenizer, "prompt", "answer", vision=vision)
    assert "images" not in text.info and vision.image_token_id not in text.prompt_ids


def test_a_supervised_step_on_image_rows_trains_the_vision_tower(tmp_path):
    trainer = Trainer.init(
        load_config(None, vl_overrides(tmp_path, 1, **{"train.algorithm": "sft", "optim.lr": "0.01"}))
    )
    try:
        policy = _policy(trainer)
        before = policy.model.state_dict()[TOWER].clone()
        rollout = trainer.rollout_token_batch(0)
        batch = rollout.batch
        assert len(batch.images_B) == batch.num_seqs == 4
        assert int((batch.input_ids_T == trainer.backend.engine.vision.image_token_id).sum()) > 0
        trainer.train(0, rollout)
        assert not torch.equal(before, policy.model.state_dict()[TOWER])
    finally:
        trainer.shutdown()


def test_the_warm_start_before_rl_trains_the_vision_tower_on_the_rows_images(tmp_path):
    config = load_config(None, vl_overrides(tmp_path, 1, **{"warm_start.steps": "2", "optim.lr": "0.01"}))
    warm = run_warm_start(config)
    before, after = load_model(tmp_path / "model")[0].state_dict(), load_model(warm)[0].state_dict()
    assert not torch.equal(before[TOWER], after[TOWER])


def _pairs_config(tmp_path, algorithm: str):
    pairs = [{"prompt": r["prompt"], "images": r["images"], "chosen": r["answer"], "rejected": "7"} for r in _rows(8)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    extra = {
        "train.algorithm": algorithm,
        "optim.lr": "0.01",
        "data.task": "null",
        "data.train_path": str(tmp_path / "pairs.jsonl"),
        "data.eval_path": "null",
    }
    overrides = vl_overrides(tmp_path, 2, **extra)
    return load_config(None, [o for o in overrides if not o.startswith(("rollout.n_samples", "rollout.max_new"))])


def test_a_reward_model_of_a_vision_language_model_is_refused_before_training(tmp_path):
    # transformers has no sequence classifier of Qwen2.5-VL: its export loaded nowhere
    with pytest.raises(ConfigError) as info:
        Trainer.init(_pairs_config(tmp_path, "reward_model")).shutdown()
    assert str(info.value) == (
        "train.algorithm=reward_model: model.path is a vision-language model, and transformers has no sequence "
        "classifier of one to export the reward model as: train it on a text-only model"
    )
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_dpo_step_on_image_rows_trains_the_vision_tower(tmp_path):
    trainer = Trainer.init(_pairs_config(tmp_path, "dpo"))
    try:
        policy = _policy(trainer)
        before = policy.model.state_dict()[TOWER].clone()
        rollout = trainer.rollout_token_batch(0)
        assert len(rollout.batch.images_B) == rollout.batch.num_seqs == 8  # chosen and rejected of 4 pairs
        trainer.train(0, rollout)
        assert not torch.equal(before, policy.model.state_dict()[TOWER])
    finally:
        trainer.shutdown()


def test_image_rows_on_a_text_model_are_refused_in_one_line(tmp_path):
    rows = _rows(4)
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rows_path = tmp_path / "rows.jsonl"
    given = [o for o in tiny_run_overrides(tmp_path) if not o.startswith(("rollout.n_samples", "rollout.max_new"))]
    overrides = [*given, "train.algorithm=sft", "data.task=null", f"data.train_path={rows_path}"]
    trainer = Trainer.init(load_config(None, overrides))
    try:
        with pytest.raises(DataError, match="has images but model.path is a text-only model") as info:
            trainer.rollout_token_batch(0)
    finally:
        trainer.shutdown()
    assert "\n" not in str(info.value)
