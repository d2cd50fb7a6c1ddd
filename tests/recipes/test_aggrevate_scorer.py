"""AggreVaTe with Q from a frozen scorer role: a reward model saved by transformers'
AutoModelForSequenceClassification (q_source=reward_model) or an areno critic's value head
(q_source=value_head). Per-token scores equal transformers' hidden states x score weight; the loss
matches a hand computation on a real two-role run; the shipped example runs three passes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from areno.api.config import load_config
from areno.api.trainer import Trainer
from areno.data.tokenizer import build_char_tokenizer
from areno.errors import ConfigError
from areno.models.hf_io import init_model_dir, load_model, tiny_config
from areno.specializations import ScalarHeadModel, ScalarScorerSpecialization
from areno.train import checkpoint
from areno.types import TokenBatch, Trajectory
from tests.helpers.configs import shrunk_example_overrides, tiny_run_overrides
from tests.helpers.recipes import RM_TINY, naive_logprobs, save_reward_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory) -> Path:
    return save_reward_model(tmp_path_factory.mktemp("rm") / "hf")


def _hf_scores_T(model, batch: TokenBatch) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """transformers' last hidden state x score weight at every token, and its pooled logits."""
    scores, pooled = [], []
    bounds = batch.cu_seqlens_B1.tolist()
    with torch.no_grad():
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            out = model(batch.input_ids_T[lo:hi][None], output_hidden_states=True)
            per_token = model.score(out.hidden_states[-1])[0, :, 0]
            scores.append(per_token)
            pooled.append((out.logits[0, 0], per_token[-1]))
    return torch.cat(scores), pooled


def _traj(prompt: list[int], completion: list[int]) -> Trajectory:
    n = len(completion)
    return Trajectory(prompt_ids=prompt, completion_ids=completion, logprobs=[0.0] * n, versions=[0] * n, reward=0.0)


def test_reward_model_head_scores_every_position(rm_dir):
    """q_T[t] = head(h_t) at every token equals transformers' hidden state x score.weight; at the
    last token it is the sequence classifier's logit (transformers pools exactly that position)."""
    batch = TokenBatch.from_trajectories([_traj([5, 6, 7], [8, 9]), _traj([10, 11], [12, 13, 14, 15])])
    decoder = load_model(rm_dir, dtype=torch.float32)[0]
    scorer = ScalarScorerSpecialization(head="reward_model", head_path=str(rm_dir))
    model = scorer.wrap_model(decoder)
    with torch.no_grad():
        q_T = scorer.extract_model_output(model, batch)["q_T"]
    hf = AutoModelForSequenceClassification.from_pretrained(rm_dir, torch_dtype=torch.float32).eval()
    expected_T, pooled = _hf_scores_T(hf, batch)
    assert q_T.shape == (batch.num_tokens,)
    torch.testing.assert_close(q_T, expected_T, rtol=1e-5, atol=1e-5)
    for logit, last_token_score in pooled:
        assert torch.equal(logit, last_token_score)  # transformers' logit is the head at the last token
    last = q_T[batch.cu_seqlens_B1[1:] - 1]
    torch.testing.assert_close(last, torch.stack([p[0] for p in pooled]), rtol=1e-5, atol=1e-5)


def test_scorer_checkpoint_errors(tmp_path, rm_dir):
    """No score head, num_labels != 1, missing path, a tokenizer unlike the policy's: one-line ConfigErrors."""
    tok = build_char_tokenizer()
    causal = init_model_dir(tmp_path / "causal", tiny_config(len(tok), **RM_TINY), tok, seed=1)
    decoder = load_model(causal, dtype=torch.float32)[0]
    with pytest.raises(ConfigError, match="has no score head: save it with transformers' AutoModelForSequence"):
        ScalarScorerSpecialization(head="reward_model", head_path=str(causal)).wrap_model(decoder)
    two = save_reward_model(tmp_path / "two", num_labels=2)
    with pytest.raises(ConfigError, match="num_labels=1"):
        ScalarScorerSpecialization(head="reward_model", head_path=str(two)).wrap_model(decoder)
    with pytest.raises(ConfigError, match="reward_model_path"):
        Trainer.init(
            load_config(
                None,
                tiny_run_overrides(tmp_path)
                + ["train.algorithm=aggrevate", "train.algorithm_kwargs={q_source: reward_model}"],
            )
        )
    other = save_reward_model(
        tmp_path / "other", tokenizer=build_char_tokenizer(extra_tokens=("<x>",), vocab_padding=0)
    )
    overrides = tiny_run_overrides(tmp_path) + [
        "train.algorithm=aggrevate",
        f"train.algorithm_kwargs={{q_source: reward_model, reward_model_path: {other}}}",
    ]
    with pytest.raises(ConfigError, match="tokenizer of .* differs from the policy's"):
        Trainer.init(load_config(None, overrides))


def _run_one_step(tmp_path: Path, algorithm_kwargs: str):
    overrides = tiny_run_overrides(tmp_path) + [
        "train.algorithm=aggrevate",
        f"train.algorithm_kwargs={algorithm_kwargs}",
    ]
    trainer = Trainer.init(load_config(None, overrides))
    try:
        rollout = trainer.rollout_token_batch(0)
        student = load_model(tmp_path / "model", dtype=torch.float32)[0]  # the weights before the step
        metrics = trainer.train(0, rollout)
    finally:
        trainer.shutdown()
    return rollout.batch, student, metrics


def _expected_loss(q_T: torch.Tensor, s_T: torch.Tensor, mask_T: torch.Tensor) -> float:
    q = q_T[mask_T].double()
    adv = (q - q.mean()) / (q.std() + 1e-8)  # whitened over the loss tokens (unbiased std)
    return float(-(adv * s_T[mask_T].double()).sum() / mask_T.sum())


def test_aggrevate_reward_model_q_on_a_two_role_run(tmp_path, rm_dir):
    """loss = sum_t -whiten(Q)_t log pi(a_t | s_t) / #loss tokens with Q_t = transformers' head(h_t)."""
    batch, student, metrics = _run_one_step(tmp_path, f"{{q_source: reward_model, reward_model_path: {rm_dir}}}")
    hf = AutoModelForSequenceClassification.from_pretrained(rm_dir, torch_dtype=torch.float32).eval()
    q_T, _ = _hf_scores_T(hf, batch)
    with torch.no_grad():
        s_T = naive_logprobs(student, batch)
    mask = batch.loss_mask_T.bool()
    assert metrics["train/policy/loss_denominator"] == float(mask.sum())
    assert metrics["train/policy/loss"] == pytest.approx(_expected_loss(q_T, s_T, mask), rel=1e-4, abs=1e-6)


def test_aggrevate_value_head_q_on_a_two_role_run(tmp_path):
    """q_source=value_head reads the critic of a real PPO run's checkpoint (checkpoints/step_N/value):
    Q_t = that critic's head at h_t; the loss by hand as above."""
    ppo = load_config(None, tiny_run_overrides(tmp_path, "ppo") + ["train.algorithm=ppo", "train.steps=1"])
    trainer = Trainer.init(ppo)
    try:
        trainer.run()
    finally:
        trainer.shutdown()
    critic_dir = tmp_path / "ppo" / "checkpoints" / "step_00000001" / "value"
    critic = ScalarHeadModel(load_model(tmp_path / "model", dtype=torch.float32)[0])
    checkpoint.load(critic_dir, critic, None)
    assert critic.score.weight.abs().sum() > 0  # trained away from the zero init
    batch, student, metrics = _run_one_step(tmp_path, f"{{q_source: value_head, value_head_path: {critic_dir}}}")
    with torch.no_grad():
        q_T = critic.scores_T(batch)
        s_T = naive_logprobs(student, batch)
    mask = batch.loss_mask_T.bool()
    assert metrics["train/policy/loss"] == pytest.approx(_expected_loss(q_T, s_T, mask), rel=1e-4, abs=1e-6)


def test_aggrevate_rm_example_runs_three_passes(tmp_path, rm_dir):
    """The shipped example, shrunk: one rollout trained on three times (train.num_train_passes: 3)."""
    path = ROOT / "examples" / "aggrevate_rm.yaml"
    overrides = shrunk_example_overrides(tmp_path, {"q_source": "reward_model", "reward_model_path": rm_dir})
    cfg = load_config(path, overrides)
    assert cfg.train.num_train_passes == 3 and cfg.train.algorithm_kwargs["q_source"] == "reward_model"
    trainer = Trainer.init(cfg)
    passes = []
    train = trainer.train
    trainer.train = lambda rollout_id, rollout: passes.append(train(rollout_id, rollout)) or passes[-1]
    try:
        trainer.run()
    finally:
        trainer.shutdown()
    assert len(passes) == 3
    assert all(p["train/policy/loss"] == p["train/policy/loss"] for p in passes)  # finite, not NaN
