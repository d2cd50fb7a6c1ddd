"""A scalar head on the decoder (``ScalarHeadModel``: a PPO critic's value head, a reward model's score
head) under LoRA, bf16 autocast and a vision-language decoder; its LoRA adapter export and its
frozen LM head (CPU)."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import load_file

from areno.api.config import load_config
from areno.data.tokenizer import load_pretrained_tokenizer
from areno.models.hf_io import load_model
from areno.specializations.forward import ScalarHeadModel, hidden_states_TD
from areno.train import LocalTrainBackend, LoraConfig, TrainBackendConfig, lora
from areno.types import TokenBatch, Trajectory
from areno.workflows.images import image_prompt
from tests.helpers.configs import role_run_config, run_to_end
from tests.helpers.train import make_model_dir, random_batch
from tests.helpers.vlm import make_vl_dir

VOCAB = 100
LENGTHS = [9, 5, 12, 7]


def _random_head(decoder: torch.nn.Module) -> ScalarHeadModel:
    """A head with non-zero weights, so its output depends on the hidden states."""
    model = ScalarHeadModel(decoder)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        model.score.weight.copy_(torch.randn(model.score.weight.shape, generator=gen) * 0.3)
        model.score.bias.fill_(0.1)
    return model


def _scores(model, mb: TokenBatch) -> dict[str, torch.Tensor]:
    return {"scores_T": model.scores_T(mb)}


def _value_loss(out, mb: TokenBatch, reducer):
    return reducer((out["scores_T"] - 1.0) ** 2, mb.loss_mask_T), {}


def _tokens(mb: TokenBatch) -> float:
    return float(mb.loss_mask_T.sum())


def test_ppo_with_lora_trains_the_critic(tmp_path):
    cfg = role_run_config(tmp_path, "ppo-lora", "train.algorithm=ppo", "train.lora={rank: 4}", steps=2)
    rows = [r for r in run_to_end(cfg) if "train/value/loss" in r]
    assert len(rows) == 2
    # the zero-initialised head used to stay frozen at 0: every adapter's gradient was 0 too
    assert all(r["train/value/grad_norm"] > 0 for r in rows)
    assert rows[-1]["train/value/critic/value_mean"] != 0.0


def test_reward_model_with_lora_learns(tmp_path):
    pairs = tmp_path / "prefs.jsonl"
    pairs.write_text(
        "".join(json.dumps({"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": "9"}) + "\n" for i in range(6))
    )
    cfg = load_config(
        None,
        [
            f"run_dir={tmp_path / 'run'}",
            f"model.path={tmp_path / 'model'}",
            "model.init_tiny={hidden_size: 32, layers: 1, heads: 2, kv_heads: 1, intermediate_size: 64}",
            "train.algorithm=reward_model",
            "data.task=null",
            f"data.train_path={pairs}",
            "rollout.batch_size=3",
            "cluster.device=cpu",
            "cluster.cpu_threads=1",
            "observe.console=false",
            "train.steps=3",
            "train.eval_interval=0",
            "optim.lr=0.01",
            "train.lora={rank: 4}",
        ],
    )
    losses = [r["train/reward/loss"] for r in run_to_end(cfg) if "train/reward/loss" in r]
    assert len(losses) == 3
    assert losses[-1] < losses[0] - 0.02  # a frozen zero head stays at log(2)


def test_lora_adapts_the_decoder_and_trains_the_whole_head(tmp_path):
    backend = LocalTrainBackend(TrainBackendConfig(device="cpu", lora=LoraConfig(rank=4)))
    backend.initialize(make_model_dir(tmp_path / "model", layers=1), wrap_model=ScalarHeadModel)
    trainable = {name for name, p in backend.model.named_parameters() if p.requires_grad}
    assert {"score.weight", "score.bias"} <= trainable
    assert all(".lora_" in name for name in trainable - {"score.weight", "score.bias"})
    out = backend.train_step(
        random_batch(LENGTHS, VOCAB, 0), forward_fn=_scores, loss_fn=_value_loss, denominator_fn=_tokens
    )
    assert out["grad_norm"] > 0


def test_a_wrapped_roles_adapter_has_the_base_models_names_and_its_head_beside_it(tmp_path):
    model_dir = make_model_dir(tmp_path / "model", layers=1)
    adapters = LoraConfig(rank=4)
    bare = LocalTrainBackend(TrainBackendConfig(device="cpu", lora=adapters))
    bare.initialize(model_dir)
    critic = LocalTrainBackend(TrainBackendConfig(device="cpu", lora=adapters))
    critic.initialize(model_dir, wrap_model=_random_head)
    names = [name for name, _ in critic.named_adapter_weights()]
    assert names == [name for name, _ in bare.named_adapter_weights()]
    assert names[0].startswith("base_model.model.model.layers.0.")  # what PEFT loads on the causal LM
    critic.export_adapter(tmp_path / "adapter")
    assert sorted(load_file(tmp_path / "adapter" / "adapter_model.safetensors")) == sorted(names)
    head = load_file(tmp_path / "adapter" / lora.HEAD_FILE)
    assert sorted(head) == ["score.bias", "score.weight"]
    torch.testing.assert_close(head["score.weight"], critic.model.score.weight.detach())
    bare.export_adapter(tmp_path / "policy_adapter")
    assert not (tmp_path / "policy_adapter" / lora.HEAD_FILE).exists()


def test_scores_under_the_local_backends_bf16_autocast_are_float32(tmp_path):
    backend = LocalTrainBackend(TrainBackendConfig(device="cpu", param_dtype="bfloat16", trainable=False))
    backend.initialize(make_model_dir(tmp_path / "model", layers=1), wrap_model=_random_head)

    def scores_and_reference(model, mb):
        hidden_TD = hidden_states_TD(model, mb)  # bf16 under the backend's autocast, as the head reads it
        with torch.autocast("cpu", enabled=False):
            ref_T = F.linear(hidden_TD.double(), model.score.weight.double(), model.score.bias.double())
        return {"scores_T": model.scores_T(mb), "ref_T": ref_T.squeeze(-1)}

    out = backend.forward_only(random_batch(LENGTHS, VOCAB, 0), forward_fn=scores_and_reference)
    assert out["scores_T"].dtype == torch.float32
    # a bf16 head is off by ~1e-3 relative here
    torch.testing.assert_close(out["scores_T"].double(), out["ref_T"], rtol=1e-5, atol=1e-6)


def test_the_critic_freezes_an_untied_lm_head(tmp_path):
    model_dir = make_model_dir(tmp_path / "model", layers=1)
    backend = LocalTrainBackend(TrainBackendConfig(device="cpu"))
    backend.initialize(model_dir, wrap_model=ScalarHeadModel)
    assert not backend.model.decoder.lm_head.weight.requires_grad
    in_optimizer = {id(p) for group in backend.optimizer.param_groups for p in group["params"]}
    assert id(backend.model.decoder.lm_head.weight) not in in_optimizer
    assert id(backend.model.score.weight) in in_optimizer
    tied, _ = load_model(make_model_dir(tmp_path / "tied", layers=1, tie_word_embeddings=True))
    assert ScalarHeadModel(tied).decoder.model.embed_tokens.weight.requires_grad  # the tied head is the embedding


def test_a_critic_saved_with_a_trainable_lm_head_resumes(tmp_path):
    """A checkpoint of an older areno, whose critic kept its LM head in the optimizer, loads and trains on."""
    model_dir = make_model_dir(tmp_path / "model", layers=1)

    def older_critic(decoder):
        model = ScalarHeadModel(decoder)
        model.decoder.lm_head.requires_grad_(True)
        return model

    def step(backend, seed):
        return backend.train_step(
            random_batch(LENGTHS, VOCAB, seed), forward_fn=_scores, loss_fn=_value_loss, denominator_fn=_tokens
        )

    old = LocalTrainBackend(TrainBackendConfig(device="cpu", lr=1e-2))
    old.initialize(model_dir, wrap_model=older_critic)
    step(old, 0)
    old.save_checkpoint(tmp_path / "ckpt", {"pos": 1})
    new = LocalTrainBackend(TrainBackendConfig(device="cpu", lr=1e-2))
    new.initialize(model_dir, wrap_model=ScalarHeadModel)
    assert new.load_checkpoint(tmp_path / "ckpt") == {"pos": 1}
    a, b = step(old, 1), step(new, 1)
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
    for name, p in new.model.named_parameters():
        torch.testing.assert_close(p, dict(old.model.named_parameters())[name], msg=name)


def test_a_vision_language_critic_reads_the_images(tmp_path):
    model_dir = make_vl_dir(tmp_path / "model")
    decoder, _ = load_model(model_dir)
    model = _random_head(decoder)
    pixels = np.zeros((16, 16, 3), dtype=np.uint8)
    pixels[:8, :8, 0] = 200
    prompt_ids, images = image_prompt(
        load_pretrained_tokenizer(model_dir), "count:", [Image.fromarray(pixels)], decoder.vision_config
    )

    def batch(with_image: bool) -> TokenBatch:
        info = {"images": {"pixel_values": images.pixel_values, "grid_thw": images.grid_thw}} if with_image else {}
        traj = Trajectory(
            prompt_ids=prompt_ids, completion_ids=[5, 6, 7], logprobs=[0.0] * 3, versions=[0] * 3, reward=1.0, info=info
        )
        return TokenBatch.from_trajectories([traj])

    with torch.no_grad():
        seen_T, blind_T = model.scores_T(batch(True)), model.scores_T(batch(False))
    assert seen_T.shape == (len(prompt_ids) + 3,)
    assert not torch.allclose(seen_T, blind_T)  # the image reached the decoder through the wrapper


def test_a_wrap_model_that_drops_the_loaded_decoder_is_named(tmp_path):
    backend = LocalTrainBackend(TrainBackendConfig(lr=1e-2, device="cpu"))
    with pytest.raises(ValueError, match="wrap_model returned a Decoder that does not hold the loaded decoder"):
        backend.initialize(make_model_dir(tmp_path / "model", layers=1), wrap_model=copy.deepcopy)
