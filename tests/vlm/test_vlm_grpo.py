"""A tiny Qwen2.5-VL-layout model trained with GRPO on ``count_squares`` (images made in code, the
answer a digit), colocated on the CPU: images go through the workflow, the rollout engine's vision
prefill and the trainer's forward."""

from __future__ import annotations

import pytest

from areno.api.config import load_config
from areno.api.trainer import Trainer
from areno.models.hf_io import load_model
from areno.models.vision import VisionLanguageModel
from areno.specializations.forward import token_logprobs_T
from tests.helpers.vlm import vl_overrides


def test_vlm_grpo_two_steps_train_the_vision_tower(tmp_path):
    import torch

    # a reward that varies within every group of a random model, so both steps have a gradient
    reward = {"optim.lr": "0.01", "reward.fn": "tests.helpers.rewards:first_char"}
    cfg = load_config(None, vl_overrides(tmp_path, 2, **reward))
    trainer = Trainer.init(cfg)
    engine = trainer.backend.engine
    policy = engine.training.runner.backends["policy"]
    try:
        assert isinstance(policy.model, VisionLanguageModel)
        before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
        for rollout_id in range(2):
            rollout = trainer.rollout_token_batch(rollout_id)
            batch = rollout.batch
            assert len(batch.images_B) == batch.num_seqs == 32
            assert all(isinstance(im["pixel_values"], torch.Tensor) for im in batch.images_B)  # fetched
            assert len(engine.store) == 32  # one stored copy per trajectory until the step
            with torch.no_grad():  # the trainer's forward (vision tower included) recomputes them
                recomputed_T = token_logprobs_T(policy.model, batch)["logprobs_T"]
            m = batch.loss_mask_T
            torch.testing.assert_close(recomputed_T[m], batch.logprobs_T[m], atol=1e-5, rtol=0)
            metrics = trainer.train(rollout_id, rollout)
            assert len(engine.store) == 0  # released once trained
            assert abs(metrics["train/policy/actor/ratio"] - 1.0) < 1e-4
            trainer.backend.update_weights()
        after = dict(policy.model.named_parameters())
        assert not torch.equal(before["visual.merger.mlp.2.weight"], after["visual.merger.mlp.2.weight"].detach())
        assert not torch.equal(before["visual.blocks.0.attn.qkv.weight"], after["visual.blocks.0.attn.qkv.weight"])
        synced = engine.rollout.engine.weight_tensors()
        assert torch.equal(synced["visual.merger.mlp.2.weight"], after["visual.merger.mlp.2.weight"].detach())
        assert 0.0 <= trainer.evaluate_now()["eval/accuracy"] <= 1.0
    finally:
        trainer.shutdown()


def test_freeze_vision_keeps_the_tower_and_trains_the_decoder(tmp_path):
    import torch

    reward = {"optim.lr": "0.01", "reward.fn": "tests.helpers.rewards:first_char", "model.freeze_vision": "true"}
    trainer = Trainer.init(load_config(None, vl_overrides(tmp_path, 1, **reward)))
    policy = trainer.backend.engine.training.runner.backends["policy"]
    try:
        before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
        assert not any(p.requires_grad for n, p in policy.model.named_parameters() if n.startswith("visual."))
        trainer.train(0, trainer.rollout_token_batch(0))
        after = {n: p.detach() for n, p in policy.model.named_parameters()}
    finally:
        trainer.shutdown()
    assert all(torch.equal(before[n], after[n]) for n in before if n.startswith("visual."))
    assert not torch.equal(before["model.layers.0.mlp.up_proj.weight"], after["model.layers.0.mlp.up_proj.weight"])


@pytest.mark.slow
def test_vlm_grpo_learns_to_count_squares(tmp_path):
    """150 GRPO steps of a random tiny VLM on count_squares (1-3 squares, answer one digit): greedy
    held-out accuracy goes from 0 to far above the majority answer's share (about 1/3), so the
    policy reads the image."""
    settings = {
        # at 3e-3 some runs learned to 1.0, then fell onto the majority answer for good (no group's
        # rewards differ then); which runs did, the gradients' summation order decided
        "optim.lr": "0.0015",
        "rollout.max_new_tokens": "1",
        "rollout.batch_size": "8",
        "data.num_eval": "48",
    }
    trainer = Trainer.init(load_config(None, vl_overrides(tmp_path, 150, **settings)))
    try:
        before = trainer.evaluate_now()["eval/accuracy"]
        after = trainer.run()["eval/accuracy"]
    finally:
        trainer.shutdown()
    hf = tmp_path / "run" / "checkpoints" / "step_00000150" / "hf"
    assert isinstance(load_model(hf)[0], VisionLanguageModel)  # the export loads as a VLM again
    assert before <= 0.2 and after >= 0.75, (before, after)
