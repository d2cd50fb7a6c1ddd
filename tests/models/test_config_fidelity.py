"""Every config.json areno accepts computes what transformers computes from it, or is refused by name:
per-layer windows (``layer_types``, Qwen's ``max_window_layers``) computed as transformers does, keys left out (transformers' class
defaults), ``architectures`` against ``model_type``, a tied checkpoint storing another head, RoPE keys
that disagree, the pad row's gradient, and a context past the model's positions."""

from __future__ import annotations

import inspect
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from areno.errors import ModelDirError
from areno.models import ModelConfig, load_model, tiny_config
from areno.models.config import HF_CLASS_DEFAULTS
from areno.models.logprobs import packed_logprobs
from areno.rollout.config import RolloutEngineConfig
from areno.rollout.engine import RolloutEngine

VOCAB = 97


def _hf_dir(path, cls, edit=None, **kw):
    """A random transformers checkpoint of ``cls`` (wide init, so a mismatch shows), ``edit`` applied to
    its config.json."""
    base = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cls(**{**base, **kw})).save_pretrained(path)
    if edit is not None:
        d = json.loads((path / "config.json").read_text())
        edit(d)
        (path / "config.json").write_text(json.dumps(d))
    return path


def _max_diff(path, n=40, **changes) -> float:
    """Most |log-prob difference| between transformers and areno on ``path`` (``changes``: fields of areno's
    config replaced, e.g. ``window=None`` to drop its window and see that the comparison notices)."""
    ids = torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(1))
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    model, config = load_model(path)
    if changes.pop("window", "keep") is None:
        model.config = config.replace(sliding_window=None, window_layers=None)
    with torch.no_grad():
        expected = torch.log_softmax(ref(ids[None]).logits[0], -1)[:-1].gather(1, ids[1:, None])[:, 0]
        ours, _ = packed_logprobs(model, ids, torch.tensor([0, n]))
    return float((ours[1:] - expected).abs().max())


def _config(d: dict) -> ModelConfig:
    return ModelConfig.from_hf(d)


@pytest.mark.parametrize(
    ("layer_types", "window"), [(["full_attention"] * 2, None), (["sliding_attention"] * 2, 8)], ids=["full", "sliding"]
)
def test_mistral_layer_types_choose_the_window_as_transformers(tmp_path, layer_types, window):
    # transformers reads a mistral config.json with layer_types as Ministral's per-layer attention
    path = _hf_dir(tmp_path, MistralConfig, edit=lambda d: d.update(layer_types=layer_types), sliding_window=8)
    assert load_model(path)[1].sliding_window == window
    assert _max_diff(path) < 1e-4


def test_qwen2_windows_start_at_layer_max_window_layers(tmp_path):
    # use_sliding_window with no layer past max_window_layers: every layer attends in full
    path = _hf_dir(tmp_path / "none", Qwen2Config, use_sliding_window=True, sliding_window=8, max_window_layers=2)
    assert load_model(path)[1].sliding_window is None
    assert _max_diff(path) < 1e-4
    # from layer 1 on: layer 0 in full, layer 1 over its last 8 keys, as transformers computes them
    path = _hf_dir(tmp_path / "one", Qwen2Config, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    config = load_model(path)[1]
    assert (config.sliding_window, config.window_layers) == (8, (1,))
    assert _max_diff(path) < 1e-4
    assert _max_diff(path, window=None) > 1e-2  # the window changes the log-probs: the test above sees it
    qwen = tiny_config(VOCAB, layers=2).to_hf() | {"use_sliding_window": True, "sliding_window": 8}
    every = _config({**qwen, "max_window_layers": 0})
    assert (every.sliding_window, every.window_layers) == (8, None)
    assert _config(every.to_hf()) == every and _config(config.to_hf()) == config


def test_qwen3_moe_windows_every_layer():
    # walk32: its config class has no max_window_layers; transformers slides every layer
    d = tiny_config(VOCAB, arch="qwen3_moe", layers=2).to_hf() | {"use_sliding_window": True, "sliding_window": 8}
    config = _config({**d, "max_window_layers": 28})
    assert (config.sliding_window, config.window_layers) == (8, None)


def test_mistral_windows_per_layer_and_inconsistent_layer_types_are_refused(tmp_path):
    types = ["full_attention", "sliding_attention"]
    path = _hf_dir(tmp_path, MistralConfig, edit=lambda d: d.update(layer_types=types), sliding_window=8)
    config = load_model(path)[1]
    assert (config.sliding_window, config.window_layers) == (8, (1,))
    assert _max_diff(path) < 1e-4
    assert _max_diff(path, window=None) > 1e-2
    mistral = tiny_config(VOCAB, arch="mistral", layers=2, sliding_window=8).to_hf()
    with pytest.raises(ValueError, match="layer_types must be a list of num_hidden_layers=2"):
        _config({**mistral, "layer_types": ["full_attention"]})
    with pytest.raises(ValueError, match=r"layer_types \['chunked_attention'\] are not supported"):
        _config({**mistral, "layer_types": ["chunked_attention"] * 2})
    qwen = tiny_config(VOCAB, layers=2).to_hf()
    with pytest.raises(ValueError, match="layer_types has sliding_attention layers but use_sliding_window is false"):
        _config({**qwen, "layer_types": ["sliding_attention"] * 2})
    # a window in some layers only where transformers' class has none per layer
    with pytest.raises(ValueError, match="window_layers .* are only expressible for"):
        tiny_config(VOCAB, arch="phi3", layers=2, sliding_window=8, window_layers=(1,))


@pytest.mark.parametrize("model_type", sorted(HF_CLASS_DEFAULTS))
def test_the_written_out_defaults_are_transformers_class_defaults(model_type):
    cls = CONFIG_MAPPING[model_type]
    params = inspect.signature(cls.__init__).parameters
    for key, value in HF_CLASS_DEFAULTS[model_type].items():
        if key == "rope_scaling":  # gpt-oss's YaRN: what its class builds where rope_parameters is None
            default = cls()
            rope = getattr(default, "rope_parameters", None) or default.rope_scaling  # transformers 5, 4.x
            expected = {k: v for k, v in rope.items() if k != "rope_theta"}
            assert value == expected, (model_type, key)
            continue
        expected = getattr(cls, "default_theta", None) if key == "rope_theta" else params[key].default
        if key == "rope_theta" and expected is None:  # transformers 4.x: an argument
            expected = params[key].default
        if key == "rope_theta" and isinstance(expected, dict):  # Gemma 3: the full layers' and the window layers'
            expected = expected["global"]
        assert value == expected, (model_type, key)


def test_keys_left_out_take_transformers_class_defaults():
    d = tiny_config(VOCAB, arch="mistral", sliding_window=8).to_hf()
    for key in ("sliding_window", "rms_norm_eps"):
        del d[key]
    ours, theirs = _config(d), AutoConfig.for_model(**d)
    assert (ours.sliding_window, ours.rms_norm_eps) == (theirs.sliding_window, theirs.rms_norm_eps) == (4096, 1e-6)
    d = tiny_config(VOCAB, arch="mixtral").to_hf()
    for key in ("rope_theta", "rope_scaling", "rms_norm_eps", "num_experts_per_tok"):
        d.pop(key, None)
    ours, theirs = _config(d), AutoConfig.for_model(**d)
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"] == 1e6
    assert ours.rms_norm_eps == theirs.rms_norm_eps == 1e-5
    assert ours.num_experts_per_tok == theirs.num_experts_per_tok
    d = tiny_config(VOCAB, arch="qwen3_moe", num_experts=8).to_hf()
    del d["num_experts_per_tok"]
    assert _config(d).num_experts_per_tok == AutoConfig.for_model(**d).num_experts_per_tok == 8


def test_architecture_and_model_type_must_agree():
    d = tiny_config(VOCAB, arch="mistral", sliding_window=8).to_hf()
    with pytest.raises(ValueError, match=r"architectures\[0\] 'LlamaForCausalLM' is a 'llama' model but model_type is"):
        _config({**d, "architectures": ["LlamaForCausalLM"]})


def test_a_tied_checkpoint_storing_another_head_is_refused(tmp_path):
    path = _hf_dir(tmp_path, Qwen2Config, tie_word_embeddings=True)
    sd = load_file(path / "model.safetensors")
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()  # the duplicate some checkpoints store
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    assert _max_diff(path) < 1e-4
    sd["lm_head.weight"] = torch.randn_like(sd["lm_head.weight"])
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelDirError, match="stores an lm_head.weight that differs from the embedding: set tie_word"):
        load_model(path)


def test_rope_keys_that_disagree_partial_rotary_and_per_layer_parameters_are_refused():
    d = tiny_config(VOCAB, arch="llama").to_hf()
    with pytest.raises(ValueError, match="RoPE theta .* make them agree"):
        _config({**d, "rope_theta": 5e5, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    with pytest.raises(ValueError, match="rope_parameters .* and rope_scaling .* keep one of them"):
        _config(
            {**d, "rope_scaling": {"rope_type": "linear", "factor": 2.0}, "rope_parameters": {"rope_type": "default"}}
        )
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5 is not supported"):
        _config({**d, "partial_rotary_factor": 0.5})
    nested = {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default"},
    }
    with pytest.raises(ValueError, match="rope_parameters per layer type"):
        _config({**d, "rope_scaling": None, "rope_parameters": nested})
    # what transformers also reads: the same theta twice, swish, llama3 without its original length
    assert _config({**d, "rope_theta": 1e4, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert _config({**d, "hidden_act": "swish"})
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    config = _config({**d, "rope_scaling": llama3})
    assert config.rope_scaling["original_max_position_embeddings"] == d["max_position_embeddings"]


def test_llama3_rope_without_its_original_length_matches_transformers(tmp_path):
    llama3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    path = _hf_dir(
        tmp_path,
        LlamaConfig,
        edit=lambda d: d["rope_parameters"].pop("original_max_position_embeddings", None),
        max_position_embeddings=32,
        rope_parameters={**llama3, "rope_theta": 1e4, "original_max_position_embeddings": 32},
    )
    assert _max_diff(path, n=32) < 1e-4


def test_the_pad_rows_embedding_takes_no_gradient_as_in_transformers(tmp_path):
    path = _hf_dir(tmp_path, Qwen2Config, pad_token_id=2, eos_token_id=2)
    seq = torch.tensor([5, 9, 17, 2, 30, 41, 2, 8])  # the pad id as an input (a multi-turn sample)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ref(seq[None], labels=seq[None]).loss.backward()
    model, _ = load_model(path)
    logprobs, _ = packed_logprobs(model, seq, torch.tensor([0, len(seq)]))
    (-logprobs[1:].mean()).backward()
    ours, theirs = model.model.embed_tokens.weight.grad, ref.model.embed_tokens.weight.grad
    assert ours[2].abs().max() == theirs[2].abs().max() == 0
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)


def test_a_context_past_the_models_positions_is_refused(tmp_path):
    path = _hf_dir(tmp_path, LlamaConfig)  # 128 positions
    model, config = load_model(path)
    with pytest.raises(ValueError, match=r"max_model_len=200 exceeds the model's max_position_embeddings=128"):
        RolloutEngine(model, config, config=RolloutEngineConfig(device="cpu", num_blocks=64, max_model_len=200))


@pytest.mark.parametrize(
    ("quantization", "where"),
    [
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "top"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128}, "top"),
        ({"quant_method": "mxfp4"}, "top"),
        ({"quant_method": "fp8"}, "text_config"),  # a vision-language checkpoint's text part
    ],
)
def test_a_quantized_checkpoint_is_refused_by_its_method_before_its_weights(quantization, where, tmp_path):
    from areno.errors import ModelDirError
    from areno.models.hf_io import read_config

    d = tiny_config(VOCAB, arch="qwen3").to_hf()
    if where == "text_config":
        d = {"architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl", "text_config": d}
        d["text_config"]["quantization_config"] = quantization
    else:
        d["quantization_config"] = quantization
    (tmp_path / "config.json").write_text(json.dumps(d))
    method = quantization["quant_method"]
    with pytest.raises(
        ModelDirError, match=f"quantization_config \\({method}\\): .* point model.path at the model's bf16"
    ):
        read_config(tmp_path)
