"""Vision-language checkpoints trained as their text model (``vl_text``): Gemma 3 4B and larger
(``Gemma3ForConditionalGeneration``), Mistral Small 3.1 / 3.2 (``Mistral3ForConditionalGeneration``) and Qwen3-VL
(``Qwen3VLForConditionalGeneration``). The checkpoint
transformers saves (and Gemma's in transformers' module names) loads and computes the whole model's text
log-probs; a save is the same vision-language checkpoint again, with the vision tower as it came; the
released config.json files read as transformers reads them; policy syncs to servers and disk name the text
model as the checkpoint does; a LoRA adapter loads in PEFT on the whole model; a GRPO run from such a
checkpoint learns and exports one."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import (
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
)

from areno.errors import ModelDirError
from areno.models import ModelConfig, load_model, save_model
from areno.models.hf_io import read_config
from areno.sync.base import WeightSource
from areno.sync.disk import CheckpointNamedSource
from tests.helpers.families import VOCAB, packed_batch, reference_logprobs

TEXT = dict(
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
    max_position_embeddings=256,
)
GEMMA3_TEXT = dict(
    TEXT,
    num_hidden_layers=3,
    sliding_window=4,
    query_pre_attn_scalar=12,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    rope_scaling={"rope_type": "linear", "factor": 8.0},
)
MISTRAL3_TEXT = dict(TEXT, sliding_window=None)
MINISTRAL3_TEXT = dict(
    MISTRAL3_TEXT,
    model_type="ministral3",
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 1e6,
        "factor": 64.0,
        "original_max_position_embeddings": 4,
        "llama_4_scaling_beta": 0.5,
    },
)
QWEN3VL_TEXT = dict(
    TEXT,
    rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [2, 2, 2], "mrope_interleaved": True},
)
VISION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
)
MISTRAL3_VISION = dict(VISION, head_dim=16)
QWEN3VLMOE_TEXT = dict(QWEN3VL_TEXT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=20)
QWEN3VL_VISION = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=48,
    deepstack_visual_indexes=[0],
    patch_size=4,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=16,
)
FAMILIES = ("gemma3", "mistral3", "ministral3", "qwen3vl", "qwen3vlmoe")


def _saved_vlm(path, family: str = "gemma3", vocab: int = VOCAB, **text):
    """A random tiny vision-language model of ``family`` saved by transformers (the text model's norm
    weights spread, so that a norm in the wrong place shows; Qwen3-VL untied), loaded back in float32 with
    eager attention."""
    torch.manual_seed(0)
    ids = dict(
        image_token_id=vocab - 1,
        video_token_id=vocab - 2,
        vision_start_token_id=vocab - 3,
        vision_end_token_id=vocab - 4,
    )
    if family == "gemma3":
        cls = Gemma3ForConditionalGeneration
        config = Gemma3Config(
            text_config={**GEMMA3_TEXT, "vocab_size": vocab, "initializer_range": 0.2, **text},
            vision_config=VISION,
            mm_tokens_per_image=1,
            image_token_index=vocab - 1,
            boi_token_index=vocab - 3,
            eoi_token_index=vocab - 2,
            eos_token_id=[1, 2],
        )
    elif family in ("mistral3", "ministral3"):  # tied: Mistral3Config's default where the top level does not say
        cls = Mistral3ForConditionalGeneration
        base = MISTRAL3_TEXT if family == "mistral3" else MINISTRAL3_TEXT
        config = Mistral3Config(
            text_config={**base, "vocab_size": vocab, "initializer_range": 0.2, **text},
            vision_config=MISTRAL3_VISION,
            image_token_index=vocab - 1,
        )
    else:
        moe = family == "qwen3vlmoe"
        cls = Qwen3VLMoeForConditionalGeneration if moe else Qwen3VLForConditionalGeneration
        config = (Qwen3VLMoeConfig if moe else Qwen3VLConfig)(
            text_config={
                **(QWEN3VLMOE_TEXT if moe else QWEN3VL_TEXT),
                "vocab_size": vocab,
                "initializer_range": 0.2,
                **text,
            },
            vision_config=QWEN3VL_VISION,
            tie_word_embeddings=False,
            **ids,
        )
    model = cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and "language_model" in name:
                p.uniform_(0.3, 1.7)
    model.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": "ImageProcessor"}))
    return cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def _other_tensors(path) -> dict[str, torch.Tensor]:
    state = load_file(str(path / "model.safetensors"))
    return {k: v for k, v in state.items() if "language_model" not in k and not k.startswith("lm_head")}


@pytest.mark.parametrize(
    ("family", "layout"),
    [
        ("gemma3", "as_saved"),
        ("gemma3", "module_names"),
        ("mistral3", "as_saved"),
        ("ministral3", "as_saved"),
        ("qwen3vl", "as_saved"),
        ("qwen3vlmoe", "as_saved"),
        ("qwen3vlmoe", "released"),
    ],
)
def test_its_text_model_loads_and_computes_the_whole_models_logprobs(family, layout, tmp_path):
    src = tmp_path / "hf"
    ref = _saved_vlm(src, family)
    if layout == "released":  # the released Qwen3-VL-MoE files: each layer's experts fused and transposed
        state = load_file(str(src / "model.safetensors"))
        fused = ("experts.gate_up_proj", "experts.down_proj")
        released = {k: v.transpose(1, 2).contiguous() if k.endswith(fused) else v for k, v in state.items()}
        assert any(released[k].shape != state[k].shape for k in state if k.endswith(fused))
        save_file(released, str(src / "model.safetensors"), metadata={"format": "pt"})
    if layout == "module_names":  # transformers 4.52+'s module names: model.language_model., model.vision_tower.
        state = load_file(str(src / "model.safetensors"))
        renamed = {("model." + k.replace("language_model.model.", "language_model.")): v for k, v in state.items()}
        save_file(renamed, str(src / "model.safetensors"), metadata={"format": "pt"})
    model, config = load_model(src)
    assert config.container["architecture"] == type(ref).__name__ and config.container["source"] == str(src.resolve())
    if family == "gemma3":
        assert config.architecture == "Gemma3ForCausalLM" and config.eos_token_id == (1, 2)
        assert config.window_layers == (0, 1) and config.rope_scaling["factor"] == 8.0
    elif family == "ministral3":  # Ministral 3's queries scaled by position (period 4: the batch crosses it)
        assert config.architecture == "Ministral3ForCausalLM" and config.query_position_scale == (0.5, 4)
    elif family == "mistral3":
        assert config.architecture == "MistralForCausalLM" and config.tie_word_embeddings
        assert config.sliding_window is None and config.head_dim == 12
    elif family == "qwen3vlmoe":  # Qwen3-MoE's blocks, the top-k weights always renormalised
        assert config.architecture == "Qwen3MoeForCausalLM" and config.num_experts == 4 and config.norm_topk_prob
    else:  # the multimodal RoPE of text positions: plain RoPE
        assert config.architecture == "Qwen3ForCausalLM" and config.rope_theta == 5e6 and config.rope_scaling is None
        assert not config.tie_word_embeddings and config.qk_norm
    seqs, ids_T, cu_B1 = packed_batch()
    with torch.no_grad():
        ours, _ = packed_logprobs_of(model, ids_T, cu_B1)
        expected = reference_logprobs(ref, seqs)
    assert expected.abs().max() > 1.0
    assert (ours - expected).abs().max().item() <= 1e-4


def packed_logprobs_of(model, ids_T, cu_B1):
    from areno.models.logprobs import packed_logprobs

    return packed_logprobs(model.eval(), ids_T, cu_B1, chunk_size=7)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_save_is_the_same_vision_language_checkpoint_with_the_new_text_model(family, tmp_path):
    src, out = tmp_path / "hf", tmp_path / "out"
    cls = type(_saved_vlm(src, family))
    model, config = load_model(src)
    with torch.no_grad():  # a trained text model: every weight moved
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    seqs, ids_T, cu_B1 = packed_batch()
    with torch.no_grad():
        ours, _ = packed_logprobs_of(model, ids_T, cu_B1)
    save_model(model, config, out)
    back, info = cls.from_pretrained(out, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        assert (reference_logprobs(back.eval(), seqs) - ours).abs().max().item() <= 1e-5
    kept, source = _other_tensors(out), _other_tensors(src)
    assert sorted(kept) == sorted(source) and len(kept) > 10
    assert all(torch.equal(kept[k], source[k]) for k in kept)
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == [cls.__name__] and "vision_config" in written
    assert (out / "preprocessor_config.json").is_file()
    again = read_config(out)
    assert again.replace(container=None) == config.replace(container=None)
    assert again.container["config"]["vision_config"] == config.container["config"]["vision_config"]
    # a save writes the names transformers' save_pretrained writes
    with safe_open(str(out / "model.safetensors"), "pt") as f, safe_open(str(src / "model.safetensors"), "pt") as g:
        assert sorted(f.keys()) == sorted(g.keys())


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
    # a text model that no longer matches the checkpoint's config.json is not written under it
    with pytest.raises(ValueError, match="differs from the text model of the Gemma3ForConditionalGeneration"):
        config.replace(rms_norm_eps=1e-5).to_hf()


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


def _qwen3_vl_2b() -> dict:
    """Qwen/Qwen3-VL-2B-Instruct's config.json (transformers 4.57's keys)."""
    return {
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "image_token_id": 151655,
        "model_type": "qwen3_vl",
        "text_config": {
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 151643,
            "dtype": "bfloat16",
            "eos_token_id": 151645,
            "head_dim": 128,
            "hidden_act": "silu",
            "hidden_size": 2048,
            "initializer_range": 0.02,
            "intermediate_size": 6144,
            "max_position_embeddings": 262144,
            "model_type": "qwen3_vl_text",
            "num_attention_heads": 16,
            "num_hidden_layers": 28,
            "num_key_value_heads": 8,
            "rms_norm_eps": 1e-06,
            "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
            "rope_theta": 5000000,
            "tie_word_embeddings": True,
            "use_cache": True,
            "vocab_size": 151936,
        },
        "tie_word_embeddings": True,
        "video_token_id": 151656,
        "vision_config": {
            "deepstack_visual_indexes": [5, 11, 17],
            "depth": 24,
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_size": 1024,
            "in_channels": 3,
            "initializer_range": 0.02,
            "intermediate_size": 4096,
            "model_type": "qwen3_vl",
            "num_heads": 16,
            "num_position_embeddings": 2304,
            "out_hidden_size": 2048,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        "vision_end_token_id": 151653,
        "vision_start_token_id": 151652,
    }


def test_the_qwen3_vl_2b_config_reads_as_transformers_reads_it():
    config = ModelConfig.from_hf(_qwen3_vl_2b())
    theirs = Qwen3VLConfig(**{k: v for k, v in _qwen3_vl_2b().items() if k != "architectures"})
    text = theirs.text_config
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads"):
        assert getattr(config, key) == getattr(text, key), key
    assert (config.head_dim, config.rope_theta, config.rope_scaling) == (128, text.rope_parameters["rope_theta"], None)
    assert (config.architecture, config.eos_token_id, config.tie_word_embeddings) == ("Qwen3ForCausalLM", 151645, True)
    with torch.device("meta"):
        whole = Qwen3VLForConditionalGeneration(theirs)
    assert config.num_params() == sum(p.numel() for p in whole.model.language_model.parameters())
    assert ModelConfig.from_hf(config.to_hf()) == config


def test_a_config_without_its_text_part_is_refused():
    d = {k: v for k, v in _four_b().items() if k != "text_config"}
    with pytest.raises(ValueError, match="config.json has no 'text_config' object"):
        ModelConfig.from_hf(d)
    d = {**_four_b(), "text_config": {**_four_b()["text_config"], "model_type": "llama"}}
    with pytest.raises(ValueError, match=r"text_config.model_type is 'llama', not one of \['gemma3_text'\]"):
        ModelConfig.from_hf(d)


class _Source(WeightSource):
    def __init__(self, state):
        self.state = state

    def meta(self):
        return [(n, tuple(t.shape), t.dtype) for n, t in self.state.items()]

    def iter_tensors(self):
        yield from self.state.items()


@pytest.mark.parametrize("family", FAMILIES)
def test_policy_syncs_name_the_text_model_as_its_checkpoint_does(family, tmp_path):
    from areno.rollout.weights import read_checkpoint

    src = tmp_path / "hf"
    _saved_vlm(src, family)
    model, config = load_model(src)
    named = dict(CheckpointNamedSource(_Source(model.state_dict()), config).iter_tensors())
    stored = {k for k, _ in read_checkpoint(str(src), tied=config.tie_word_embeddings, fix="")}
    assert set(named) == stored - set(_other_tensors(src)) and len(named) == len(model.state_dict())
    # the embedded engine reads a saved checkpoint's text model back (update_weights_from_disk)
    from areno.rollout.engine import RolloutEngine, RolloutEngineConfig

    engine = RolloutEngine(model, config, config=RolloutEngineConfig(block_size=4, num_blocks=16, max_model_len=32))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    engine.update_weights_from_disk(str(src), 1)
    fresh, _ = load_model(src)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))


# two families' runs in the default suite, the others marked slow: the default run stays under its 10 minutes
@pytest.mark.parametrize(
    "family", [f if f in ("gemma3", "qwen3vlmoe") else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES]
)
def test_grpo_from_a_vision_language_checkpoint_learns_and_exports_one(family, tmp_path):
    from areno.data.tokenizer import build_char_tokenizer
    from tests.helpers.configs import grpo_rewards_on_tiny

    src = tmp_path / "model"
    tokenizer = build_char_tokenizer()
    shape = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1
    )
    if family == "gemma3":
        shape.update(
            head_dim=16, sliding_window=8, query_pre_attn_scalar=16, layer_types=GEMMA3_TEXT["layer_types"][1:]
        )
    cls = type(_saved_vlm(src, family, vocab=len(tokenizer) + 4, initializer_range=0.02, **shape))
    config = json.loads((src / "config.json").read_text())
    config.update({k: getattr(tokenizer, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")})
    (src / "config.json").write_text(json.dumps(config))
    tokenizer.save_pretrained(str(src))
    rewards = grpo_rewards_on_tiny(tmp_path, "model.init_tiny=null")  # the checkpoint at tmp_path / "model"
    assert len(rewards) == 12
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, rewards
    out = tmp_path / "run" / "checkpoints" / "step_00000012" / "hf"
    back, info = cls.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    kept, source = _other_tensors(out), _other_tensors(src)
    assert sorted(kept) == sorted(source) and all(torch.equal(kept[k], source[k]) for k in kept)


def test_a_row_with_images_is_refused_by_name(tmp_path):
    from areno.errors import DataError
    from areno.workflows.images import row_images, vision_kwargs
    from areno.workflows.rlvr import RLVRWorkflow

    _saved_vlm(tmp_path / "hf")
    assert vision_kwargs(RLVRWorkflow, tmp_path / "hf", {}) == {}  # no vision tower is read
    with pytest.raises(
        DataError, match="has images but model.path is a text-only model .*vision-language checkpoints of Gemma 3"
    ):
        row_images({"prompt": "what is this?", "images": ["x.png"]}, None)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_lora_adapter_loads_in_peft_on_the_whole_model(family, tmp_path):
    import peft

    from areno.train import LocalTrainBackend, LoraConfig, TrainBackendConfig
    from tests.helpers.train import nll_forward, nll_loss, random_batch, token_denominator

    src = tmp_path / "hf"
    cls = type(_saved_vlm(src, family))
    layers = cls.from_pretrained(src).config.text_config.num_hidden_layers
    last = "o_proj" if family == "qwen3vlmoe" else "down_proj"  # an expert model's MLPs are fused experts
    lora = LoraConfig(rank=4, alpha=8, target_modules=("q_proj", "v_proj", last))
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
    whole = cls.from_pretrained(src, dtype=torch.float32, attn_implementation="eager")
    with_adapter = peft.PeftModel.from_pretrained(whole, tmp_path / "adapter").eval()
    adapted = {n for n, _ in with_adapter.named_modules() if n.endswith(".lora_A")}
    assert len(adapted) == 3 * layers and all(".language_model." in n for n in adapted)  # none on the vision tower
    ours, _ = load_model(src)
    ours.load_state_dict(merged)
    seqs, ids_T, cu_B1 = packed_batch()
    with torch.no_grad():
        got, _ = packed_logprobs_of(ours, ids_T, cu_B1)
        expected = reference_logprobs(with_adapter, seqs)
    assert (got - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_a_reward_model_trained_from_it_exports_as_a_text_classifier(family, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from areno.specializations.preference import save_reward_model

    _saved_vlm(tmp_path / "hf", family)
    model, config = load_model(tmp_path / "hf")
    state = {f"decoder.{k}": v for k, v in model.state_dict().items()}
    state["score.weight"] = torch.randn(1, config.hidden_size)
    out = save_reward_model(state, config, tmp_path / "rm")
    back, info = AutoModelForSequenceClassification.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert torch.equal(back.score.weight, state["score.weight"])
    assert read_config(out).container is None


def test_a_save_into_its_own_sharded_source_directory_keeps_the_vision_tower(tmp_path):
    src = tmp_path / "hf"
    whole = _saved_vlm(src)
    (src / "model.safetensors").unlink()
    whole.save_pretrained(src, max_shard_size="20KB")  # an index and its shards
    shards = sorted(p.name for p in src.glob("model-*.safetensors"))
    assert len(shards) > 2 and (src / "model.safetensors.index.json").is_file()
    before = {k: v for p in shards for k, v in load_file(str(src / p)).items() if "language_model" not in k}
    model, config = load_model(src)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    save_model(model, config, src)  # over the checkpoint the vision tower is read from
    assert not (src / "model.safetensors.index.json").exists() and not list(src.glob("model-*.safetensors"))
    after = _other_tensors(src)
    assert sorted(after) == sorted(before) and all(torch.equal(after[k], before[k]) for k in after)
    back, _ = load_model(src)
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), model.state_dict().values()))
    assert load_model(src)[1].replace(container=None) == config.replace(container=None)


def test_areno_train_check_names_the_text_model_it_trains(tmp_path, capsys):
    from areno.cli import main as areno_main
    from areno.data.tokenizer import build_char_tokenizer
    from tests.helpers.configs import train_args

    tokenizer = build_char_tokenizer()
    _saved_vlm(tmp_path / "model", "qwen3vl", vocab=len(tokenizer) + 4)
    tokenizer.save_pretrained(str(tmp_path / "model"))
    args = [a for a in train_args(tmp_path) if not a.startswith("model.init_tiny")]
    assert areno_main([args[0], "--check", *args[1:]]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-3].startswith("# model: Qwen3ForCausalLM, ")
    assert lines[-3].endswith("the text model of a Qwen3VLForConditionalGeneration (its vision tower is kept as it is)")
