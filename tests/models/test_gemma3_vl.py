"""Gemma 3 4B and larger (``Gemma3ForConditionalGeneration``) trained as their text model (``vl_text``): the
checkpoint transformers saves (and the one in transformers' module names) loads and computes the whole
model's text log-probs; a save is the same vision-language checkpoint again, with the vision tower as it
came; the 4B config.json reads as transformers reads it; policy syncs to servers and disk name the text
model as the checkpoint does; a GRPO run from such a checkpoint learns and exports one."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import Gemma3Config, Gemma3ForConditionalGeneration

from areno.errors import ModelDirError
from areno.models import ModelConfig, load_model, save_model
from areno.models.hf_io import read_config
from areno.sync.base import WeightSource
from areno.sync.disk import CheckpointNamedSource
from tests.helpers.families import VOCAB, packed_batch, reference_logprobs

TEXT = dict(
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
    sliding_window=4,
    query_pre_attn_scalar=12,
    max_position_embeddings=256,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    rope_scaling={"rope_type": "linear", "factor": 8.0},
)
VISION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
)


def _saved_vlm(path, vocab: int = VOCAB, **text) -> Gemma3ForConditionalGeneration:
    """A random tiny Gemma3ForConditionalGeneration saved by transformers (norm weights spread, so that a
    norm in the wrong place shows), loaded back in float32 with eager attention."""
    torch.manual_seed(0)
    config = Gemma3Config(
        text_config={**TEXT, "vocab_size": vocab, "initializer_range": 0.2, **text},
        vision_config=VISION,
        mm_tokens_per_image=1,
        image_token_index=vocab - 1,
        boi_token_index=vocab - 3,
        eoi_token_index=vocab - 2,
        eos_token_id=[1, 2],
    )
    model = Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and "language_model" in name:
                p.uniform_(0.3, 1.7)
    model.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": "Gemma3ImageProcessor"}))
    back = Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return back.eval()


def _other_tensors(path) -> dict[str, torch.Tensor]:
    state = load_file(str(path / "model.safetensors"))
    return {k: v for k, v in state.items() if "vision_tower" in k or "multi_modal_projector" in k}


@pytest.mark.parametrize("layout", ["as_saved", "module_names"])
def test_its_text_model_loads_and_computes_the_whole_models_logprobs(layout, tmp_path):
    src = tmp_path / "hf"
    ref = _saved_vlm(src)
    if layout == "module_names":  # transformers 4.52+'s module names: model.language_model., model.vision_tower.
        state = load_file(str(src / "model.safetensors"))
        renamed = {("model." + k.replace("language_model.model.", "language_model.")): v for k, v in state.items()}
        save_file(renamed, str(src / "model.safetensors"), metadata={"format": "pt"})
    model, config = load_model(src)
    assert (
        config.architecture == "Gemma3ForCausalLM" and config.container["architecture"] == ref.config.architectures[0]
    )
    assert config.container["source"] == str(src.resolve())
    assert config.eos_token_id == (1, 2) and config.window_layers == (0, 1) and config.rope_scaling["factor"] == 8.0
    seqs, ids_T, cu_B1 = packed_batch()
    with torch.no_grad():
        ours, _ = packed_logprobs_of(model, ids_T, cu_B1)
        expected = reference_logprobs(ref, seqs)
    assert expected.abs().max() > 1.0
    assert (ours - expected).abs().max().item() <= 1e-4


def packed_logprobs_of(model, ids_T, cu_B1):
    from areno.models.logprobs import packed_logprobs

    return packed_logprobs(model.eval(), ids_T, cu_B1, chunk_size=7)


def test_a_save_is_the_same_vision_language_checkpoint_with_the_new_text_model(tmp_path):
    src, out = tmp_path / "hf", tmp_path / "out"
    _saved_vlm(src)
    model, config = load_model(src)
    with torch.no_grad():  # a trained text model: every weight moved
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    seqs, ids_T, cu_B1 = packed_batch()
    with torch.no_grad():
        ours, _ = packed_logprobs_of(model, ids_T, cu_B1)
    save_model(model, config, out)
    back, info = Gemma3ForConditionalGeneration.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        assert (reference_logprobs(back.eval(), seqs) - ours).abs().max().item() <= 1e-5
    kept, source = _other_tensors(out), _other_tensors(src)
    assert sorted(kept) == sorted(source) and len(kept) > 10
    assert all(torch.equal(kept[k], source[k]) for k in kept)
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == ["Gemma3ForConditionalGeneration"] and "vision_config" in written
    assert (out / "preprocessor_config.json").is_file()
    again = read_config(out)
    assert again.replace(container=None) == config.replace(container=None)
    assert again.container["config"]["vision_config"] == config.container["config"]["vision_config"]
    # a save writes the checkpoint's own names: the text model under language_model.model.
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "language_model.model.layers.0.self_attn.q_proj.weight" in f.keys()


def test_a_save_whose_source_is_gone_names_it(tmp_path):
    src = tmp_path / "hf"
    _saved_vlm(src)
    model, config = load_model(src)
    (src / "model.safetensors").unlink()
    with pytest.raises(ModelDirError, match="copies the vision tower from .*hf, which is no longer readable"):
        save_model(model, config, tmp_path / "out")
    assert not (tmp_path / "out" / "model.safetensors").exists()
    with pytest.raises(ModelDirError, match="needs the checkpoint it came from"):
        save_model(model, config.replace(container={**config.container, "source": None}), tmp_path / "out")


def _four_b() -> dict:
    """google/gemma-3-4b-it's config.json: a sparse text_config over Gemma3TextConfig's defaults."""
    return {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "boi_token_index": 255999,
        "eoi_token_index": 256000,
        "eos_token_id": [1, 106],
        "image_token_index": 262144,
        "initializer_range": 0.02,
        "mm_tokens_per_image": 256,
        "model_type": "gemma3",
        "text_config": {
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "model_type": "gemma3_text",
            "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
        },
        "torch_dtype": "bfloat16",
        "vision_config": {
            "hidden_size": 1152,
            "image_size": 896,
            "intermediate_size": 4304,
            "model_type": "siglip_vision_model",
            "num_attention_heads": 16,
            "num_hidden_layers": 27,
            "patch_size": 14,
            "vision_use_head": False,
        },
    }


def test_the_4b_config_reads_as_transformers_reads_it():
    config = ModelConfig.from_hf(_four_b())
    theirs = Gemma3Config(**{k: v for k, v in _four_b().items() if k != "architectures"})
    text = theirs.text_config
    assert (config.vocab_size, config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (
        text.vocab_size,
        text.hidden_size,
        text.num_attention_heads,
        text.num_key_value_heads,
    )
    assert (config.head_dim, config.query_pre_attn_scalar, config.sliding_window) == (
        text.head_dim,
        text.query_pre_attn_scalar,
        text.sliding_window,
    )
    assert [config.layer_window(i) is not None for i in range(34)] == [
        t == "sliding_attention" for t in text.layer_types
    ]
    rope = text.rope_parameters
    assert config.rope_theta == rope["full_attention"]["rope_theta"] and config.rope_scaling["factor"] == 8.0
    assert config.window_rope["rope_theta"] == rope["sliding_attention"]["rope_theta"]
    assert config.eos_token_id == (1, 106) and config.tie_word_embeddings
    with torch.device("meta"):
        whole = Gemma3ForConditionalGeneration(theirs)
    assert config.num_params() == sum(p.numel() for p in whole.model.language_model.parameters())
    # the config.json a save writes reads back to the same text model and the same container
    again = ModelConfig.from_hf(config.to_hf())
    assert again == config


def test_a_config_without_its_text_part_is_refused():
    d = {k: v for k, v in _four_b().items() if k != "text_config"}
    with pytest.raises(ValueError, match="config.json has no 'text_config' object"):
        ModelConfig.from_hf(d)
    d = {**_four_b(), "text_config": {**_four_b()["text_config"], "model_type": "llama"}}
    with pytest.raises(ValueError, match="text_config.model_type is 'llama', not 'gemma3_text'"):
        ModelConfig.from_hf(d)


class _Source(WeightSource):
    def __init__(self, state):
        self.state = state

    def meta(self):
        return [(n, tuple(t.shape), t.dtype) for n, t in self.state.items()]

    def iter_tensors(self):
        yield from self.state.items()


def test_policy_syncs_name_the_text_model_as_its_checkpoint_does(tmp_path):
    from areno.rollout.weights import read_checkpoint

    src = tmp_path / "hf"
    _saved_vlm(src)
    model, config = load_model(src)
    named = dict(CheckpointNamedSource(_Source(model.state_dict()), config).iter_tensors())
    stored = {k for k, _ in read_checkpoint(src, tied=True, fix="")}
    text = {k for k in stored if k.startswith("language_model.")}
    assert set(named) == text
    # the embedded engine reads a saved checkpoint's text model back (update_weights_from_disk)
    from areno.rollout.engine import RolloutEngine, RolloutEngineConfig

    engine = RolloutEngine(model, config, config=RolloutEngineConfig(block_size=4, num_blocks=16, max_model_len=32))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    engine.update_weights_from_disk(str(src), 1)
    fresh, _ = load_model(src)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))


def test_grpo_from_a_vision_language_checkpoint_learns_and_exports_one(tmp_path):
    from areno.api.config import load_config
    from areno.data.tokenizer import build_char_tokenizer
    from tests.helpers.configs import run_to_end

    src = tmp_path / "model"
    tokenizer = build_char_tokenizer()
    _saved_vlm(
        src,
        vocab=len(tokenizer) + 3,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=8,
        query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention"],
        initializer_range=0.02,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config = json.loads((src / "config.json").read_text())
    config["eos_token_id"] = tokenizer.eos_token_id
    (src / "config.json").write_text(json.dumps(config))
    tokenizer.save_pretrained(str(src))
    cfg = load_config(
        None,
        [
            f"run_dir={tmp_path / 'run'}",
            f"model.path={src}",
            "data.task=arithmetic",
            "data.num_eval=8",
            "rollout.batch_size=4",
            "rollout.n_samples=8",
            "rollout.max_new_tokens=4",
            "cluster.device=cpu",
            "observe.console=false",
            "reward.fn=tests.helpers.rewards:sevens",
            "reward.sandbox=false",
            "optim.lr=0.02",
            "train.steps=12",
            "train.eval_interval=0",
            "train.seed=1",
        ],
    )
    rewards = [r["rollout/reward_mean"] for r in run_to_end(cfg) if "rollout/reward_mean" in r]
    assert len(rewards) == 12
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, rewards
    out = tmp_path / "run" / "checkpoints" / "step_00000012" / "hf"
    back, info = Gemma3ForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    kept, source = _other_tensors(out), _other_tensors(src)
    assert sorted(kept) == sorted(source) and all(torch.equal(kept[k], source[k]) for k in kept)


def test_a_row_with_images_is_refused_by_name(tmp_path):
    from areno.errors import DataError
    from areno.workflows.images import row_images, vision_kwargs
    from areno.workflows.rlvr import RLVRWorkflow

    _saved_vlm(tmp_path / "hf")
    assert vision_kwargs(RLVRWorkflow, tmp_path / "hf", {}) == {}  # no vision tower is read
    with pytest.raises(DataError, match="has images but model.path is a text-only model .*Gemma 3's vision-language"):
        row_images({"prompt": "what is this?", "images": ["x.png"]}, None)


def test_a_lora_adapter_loads_in_peft_on_the_whole_model(tmp_path):
    import peft

    from areno.train import LocalTrainBackend, LoraConfig, TrainBackendConfig
    from tests.helpers.train import nll_forward, nll_loss, random_batch, token_denominator

    src = tmp_path / "hf"
    _saved_vlm(src)
    lora = LoraConfig(rank=4, alpha=8, target_modules=("q_proj", "v_proj", "down_proj"))
    b = LocalTrainBackend(TrainBackendConfig(lr=0.05, device="cpu", grad_clip=None, lora=lora))
    b.initialize(src)
    for s in range(2):
        b.train_step(
            random_batch([9, 14, 5], VOCAB, 20 + s),
            forward_fn=nll_forward,
            loss_fn=nll_loss,
            denominator_fn=token_denominator,
        )
    merged = dict(b.named_weights())
    b.export_adapter(tmp_path / "adapter")
    whole = Gemma3ForConditionalGeneration.from_pretrained(src, dtype=torch.float32, attn_implementation="eager")
    with_adapter = peft.PeftModel.from_pretrained(whole, tmp_path / "adapter").eval()
    adapted = {n for n, _ in with_adapter.named_modules() if n.endswith(".lora_A")}
    assert len(adapted) == 3 * 3 and all(".language_model." in n for n in adapted)  # none on the vision tower
    ours, _ = load_model(src)
    ours.load_state_dict(merged)
    seqs, ids_T, cu_B1 = packed_batch()
    with torch.no_grad():
        got, _ = packed_logprobs_of(ours, ids_T, cu_B1)
        expected = reference_logprobs(with_adapter, seqs)
    assert (got - expected).abs().max().item() <= 1e-4


def test_a_reward_model_trained_from_it_exports_as_a_text_classifier(tmp_path):
    from transformers import AutoModelForSequenceClassification

    from areno.specializations.preference import save_reward_model

    _saved_vlm(tmp_path / "hf")
    model, config = load_model(tmp_path / "hf")
    state = {f"decoder.{k}": v for k, v in model.state_dict().items()}
    state["score.weight"] = torch.randn(1, config.hidden_size)
    out = save_reward_model(state, config, tmp_path / "rm")
    back, info = AutoModelForSequenceClassification.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert torch.equal(back.score.weight, state["score.weight"])
    assert read_config(out).container is None
