"""ModelConfig against the config.json of real checkpoints (typed in, nothing downloaded)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoConfig

from areno.models import ModelConfig

QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 896,
    "initializer_range": 0.02,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 24,
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
LLAMA32_1B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "vocab_size": 128256,
}
MISTRAL_7B_V01 = {
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
    "vocab_size": 32000,
}

OLMO2_1B = {
    "architectures": ["Olmo2ForCausalLM"],
    "model_type": "olmo2",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": None,
    "eos_token_id": 100257,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 4096,
    "num_attention_heads": 16,
    "num_hidden_layers": 16,
    "num_key_value_heads": 16,
    "pad_token_id": 100277,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 500000,
    "tie_word_embeddings": False,
    "use_cache": True,
    "vocab_size": 100352,
}
# OLMo 2 32B: grouped k/v heads, so its k norm is narrower than its q norm
OLMO2_32B = {
    **OLMO2_1B,
    "hidden_size": 5120,
    "intermediate_size": 27648,
    "num_attention_heads": 40,
    "num_hidden_layers": 64,
    "num_key_value_heads": 8,
}


@pytest.mark.parametrize(
    "d, n_params",
    [
        (QWEN25_05B, 494_032_768),
        (QWEN3_06B, 596_049_920),
        (LLAMA32_1B, 1_235_814_400),
        (MISTRAL_7B_V01, 7_241_732_096),
        (OLMO2_1B, 1_484_916_736),
        (OLMO2_32B, 32_234_279_936),
    ],
    ids=["qwen2.5-0.5b", "qwen3-0.6b", "llama3.2-1b", "mistral-7b-v0.1", "olmo2-1b", "olmo2-32b"],
)
def test_real_configs(d, n_params, tmp_path):
    config = ModelConfig.from_hf(d)
    assert config.num_params() == n_params
    assert config.head_dim == d.get("head_dim", d["hidden_size"] // d["num_attention_heads"])
    assert config.attention_bias == (d["model_type"] == "qwen2")
    assert config.qk_norm == (d["model_type"] in ("qwen3", "olmo2"))
    assert config.norm_layout == ("post" if d["model_type"] == "olmo2" else "pre")
    assert config.sliding_window == (4096 if d["model_type"] == "mistral" else None)
    # Round trip through our writer and transformers' reader.
    hf = config.to_hf()
    assert ModelConfig.from_hf(hf) == config
    (tmp_path / "config.json").write_text(json.dumps(hf))
    ref = AutoConfig.from_pretrained(tmp_path)
    assert ref.architectures == d["architectures"]
    for key in ("hidden_size", "num_hidden_layers", "num_key_value_heads", "vocab_size", "tie_word_embeddings"):
        assert getattr(ref, key) == d[key], key
    # transformers 5 reads RoPE into rope_parameters, 4.x keeps rope_theta and rope_scaling
    rope = getattr(ref, "rope_parameters", None) or {"rope_theta": ref.rope_theta, **(ref.rope_scaling or {})}
    assert rope["rope_theta"] == float(d["rope_theta"])
    if d.get("rope_scaling"):
        assert rope["rope_type"] == "llama3"
        assert rope["factor"] == 32.0


def test_llama3_eos_list_and_unknown_arch():
    config = ModelConfig.from_hf(LLAMA32_1B)
    assert config.eos_token_ids == (128001, 128008, 128009)
    assert config.to_hf()["eos_token_id"] == [128001, 128008, 128009]
    with pytest.raises(ValueError, match="'GemmaForCausalLM'.*LlamaForCausalLM"):
        ModelConfig.from_hf(QWEN25_05B | {"architectures": ["GemmaForCausalLM"], "model_type": "gemma"})
    with pytest.raises(ValueError, match="qk_norm"):
        ModelConfig.from_hf(QWEN25_05B).replace(qk_norm=True)
