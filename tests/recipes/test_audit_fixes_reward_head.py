"""A reward model saved by an older areno, whose score head had a bias. Today's reward head has none
(Bradley-Terry trains no bias), so resuming such a run would drop it and shift every score it exports:
refused at preflight in one line naming the checkpoint and what to do, unless the bias is 0 (dropped
exactly). Its export, a sequence classifier with ``score.bias``, is read with the bias by the scorer
(``aggrevate`` ``q_source=reward_model``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import areno.engine.local
from areno.api.config import load_config
from areno.api.trainer import Trainer
from areno.errors import ModelDirError
from areno.models.decoder import Decoder
from areno.models.hf_io import load_model, read_score_head, tiny_config
from areno.observe.metrics import read_metrics
from areno.specializations import RewardModelSpecialization, ScalarHeadModel, ScalarScorerSpecialization
from areno.specializations.preference import save_reward_model
from areno.types import TokenBatch, Trajectory

torch.set_num_threads(1)

PAIRS = [{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": "9"} for i in range(6)]


def _overrides(tmp_path: Path, steps: int) -> list[str]:
    train = tmp_path / "prefs.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in PAIRS))
    return [
        f"run_dir={tmp_path / 'run'}",
        f"model.path={tmp_path / 'model'}",
        "model.init_tiny={hidden_size: 32, layers: 1, heads: 2, kv_heads: 1, intermediate_size: 64}",
        "train.algorithm=reward_model",
        "data.task=null",
        f"data.train_path={train}",
        "rollout.batch_size=3",
        "cluster.device=cpu",
        "cluster.cpu_threads=1",
        "observe.console=false",
        "train.seed=3",
        f"train.steps={steps}",
        "train.save_interval=1",
        "train.eval_interval=0",
        "resume=auto",
    ]


def _run(cfg) -> None:
    trainer = Trainer.init(cfg)
    try:
        trainer.run()
    finally:
        trainer.shutdown()


def _run_as_an_older_areno(tmp_path: Path, monkeypatch, bias: float) -> Path:
    """One step of reward_model as an older areno ran it: its head with a bias (``bias``), saved in the
    checkpoint and in the sequence-classifier export. Returns the step's checkpoint directory."""

    def wrap_with_bias(self, model):
        scorer = ScalarHeadModel(model)
        with torch.no_grad():
            scorer.score.bias.fill_(bias)
        return scorer

    def export_with_bias(state, config, out_dir):
        out = save_reward_model({k: v for k, v in state.items() if k != "score.bias"}, config, out_dir)
        tensors = load_file(out / "model.safetensors")
        tensors["score.bias"] = state["score.bias"].detach().to("cpu", tensors["score.weight"].dtype).contiguous()
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return out

    with monkeypatch.context() as patch:
        patch.setattr(RewardModelSpecialization, "wrap_model", wrap_with_bias)
        patch.setattr(areno.engine.local, "save_reward_model", export_with_bias)
        _run(load_config(None, _overrides(tmp_path, 1)))
    return tmp_path / "run" / "checkpoints" / "step_00000001"


def test_resuming_a_reward_model_saved_with_a_head_bias_is_refused_naming_the_checkpoint(tmp_path, monkeypatch):
    step = _run_as_an_older_areno(tmp_path, monkeypatch, bias=0.5)
    with pytest.raises(ModelDirError) as info:
        Trainer.init(load_config(None, _overrides(tmp_path, 2)))
    said = str(info.value)
    assert said.startswith(f"resume: {step / 'reward'} holds a reward head bias (0.5), saved by an older areno")
    assert f"model.path={step / 'hf'} keeps its decoder" in said and "\n" not in said
    assert sorted(p.name for p in step.parent.iterdir()) == ["step_00000001"]  # nothing trained or written


def test_a_zero_head_bias_is_dropped_exactly_and_the_run_resumes(tmp_path, monkeypatch):
    _run_as_an_older_areno(tmp_path, monkeypatch, bias=0.0)
    _run(load_config(None, _overrides(tmp_path, 2)))
    assert [r["step"] for r in read_metrics(tmp_path / "run") if "train/reward/loss" in r] == [1, 2]
    assert "score.bias" not in read_score_head(tmp_path / "run" / "checkpoints" / "step_00000002" / "hf")


def test_an_older_export_with_a_head_bias_is_scored_with_its_bias(tmp_path, monkeypatch):
    hf = _run_as_an_older_areno(tmp_path, monkeypatch, bias=0.5) / "hf"
    assert read_score_head(hf)["score.bias"].tolist() == [0.5]
    traj = Trajectory(prompt_ids=[5, 6, 7], completion_ids=[8, 9], logprobs=[0.0] * 2, versions=[0] * 2, reward=0.0)
    batch = TokenBatch.from_trajectories([traj])
    scorer = ScalarScorerSpecialization(head="reward_model", head_path=str(hf))
    model = scorer.wrap_model(load_model(hf, dtype=torch.float32)[0])
    assert model.score.bias.tolist() == [0.5]
    with torch.no_grad():
        q_T = scorer.extract_model_output(model, batch)["q_T"]
        model.score.bias.zero_()
        without_bias_T = scorer.extract_model_output(model, batch)["q_T"]
    torch.testing.assert_close(q_T - without_bias_T, torch.full_like(q_T, 0.5))


def test_a_reward_model_whose_pad_is_its_eos_exports_without_a_pad_id(tmp_path, caplog):
    """walk19: transformers' sequence classifier scores the last token that is not the pad id; with pad = EOS
    (common after fine-tuning) it read the token before the EOS training scored (export loss 0.357 against
    areno's 0.331). The export has no pad id then, so a sequence is scored at its last token, as trained."""
    transformers = pytest.importorskip("transformers")

    config = tiny_config(40, hidden_size=32, layers=1, heads=2, kv_heads=1, intermediate_size=64)
    config = config.replace(pad_token_id=config.eos_token_ids[0])
    torch.manual_seed(0)
    decoder = Decoder(config)
    state = {f"decoder.{k}": v for k, v in decoder.state_dict().items()}
    state["score.weight"] = torch.randn(1, 32)
    with caplog.at_level("WARNING", logger="areno.specializations"):
        out = save_reward_model(state, config, tmp_path / "rm")
    assert json.loads((out / "config.json").read_text())["pad_token_id"] is None
    assert "its pad id is its EOS id" in caplog.text
    ids = torch.tensor([[5, 6, 7, config.eos_token_ids[0]]])
    model = transformers.AutoModelForSequenceClassification.from_pretrained(out).eval()
    with torch.no_grad():
        want = decoder(ids[0], torch.arange(4))[-1] @ state["score.weight"][0]  # the head at the EOS
        assert float(model(ids).logits) == pytest.approx(float(want), rel=1e-4, abs=1e-5)
