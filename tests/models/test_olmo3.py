"""OLMo 3 (``Olmo3ForCausalLM``): OLMo 2's layers with a sliding window in three layers of four and a RoPE
per layer type (the long-context YaRN on the full-attention layers only). A checkpoint transformers saved
loads and computes transformers' log-probs and gradients; the export loads back; the rollout engine decodes
it; GRPO on a tiny one learns; the legacy keys transformers versions read apart are refused."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Olmo3Config

from areno.models import ModelConfig, check_tp_size, load_model, tiny_config
from areno.models.logprobs import packed_logprobs
from tests.helpers.families import (
    VOCAB,
    assert_engine_decodes_as_recompute,
    assert_export_reads_back,
    assert_gradients_match,
    grpo_learns_and_exports,
    packed_batch,
    reference_logprobs,
    saved_by_transformers,
)

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "attention_factor": 1.2}
CASES = {
    # transformers' default layout: layers 0-2 slide, layer 3 attends in full
    "default": dict(num_hidden_layers=4, sliding_window=4),
    # OLMo 3's long-context RoPE: YaRN on the full layer only
    "yarn_full_only": dict(num_hidden_layers=4, sliding_window=4, max_position_embeddings=256, rope_scaling=YARN),
    # a RoPE per layer type with its own theta, and the layer types given
    "per_type": dict(
        num_hidden_layers=3,
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        },
    ),
}


def _saved_by_transformers(path, **kw):
    return saved_by_transformers(Olmo3Config, path, spread_norms=True, **kw)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_checkpoint_transformers_saved_computes_its_logprobs(case, tmp_path):
    ref = _saved_by_transformers(tmp_path / "hf", **CASES[case])
    model, config = load_model(tmp_path / "hf")
    layers = CASES[case]["num_hidden_layers"]
    assert config.window_layers == {4: (0, 1, 2), 3: (0, 2)}[layers]
    seqs, ids_T, cu_B1 = packed_batch()
    with torch.no_grad():
        ours, _ = packed_logprobs(model.eval(), ids_T, cu_B1, chunk_size=7)
        expected = reference_logprobs(ref, seqs)
        # the windows and the layer-type RoPE change the log-probs: the comparison sees either one missing
        model.config = config.replace(sliding_window=None, window_layers=None, window_rope=None)
        windowless, _ = packed_logprobs(model, ids_T, cu_B1, chunk_size=7)
        model.config = config
    assert (ours - expected).abs().max().item() <= 1e-4
    assert (windowless - expected).abs().max().item() > 1e-2
    if case != "default":
        assert config.window_rope is not None
    assert config.num_params() == sum(p.numel() for p in model.parameters())
    assert_export_reads_back(model, config, seqs, expected, tmp_path / "out")


def test_gradients_match_transformers(tmp_path):
    ref = _saved_by_transformers(tmp_path / "hf", **CASES["yarn_full_only"])
    model, _ = load_model(tmp_path / "hf")
    assert_gradients_match(
        model,
        ref,
        [
            "model.layers.0.self_attn.q_norm.weight",
            "model.layers.3.self_attn.k_proj.weight",
            "model.layers.2.post_feedforward_layernorm.weight",
            "model.layers.3.mlp.up_proj.weight",
            "lm_head.weight",
        ],
    )


def _seven_b_shape() -> dict:
    """A config.json of OLMo 3 7B's shape and RoPE (YaRN x8 over 8,192 positions on the full layers)."""
    return {
        "architectures": ["Olmo3ForCausalLM"],
        "model_type": "olmo3",
        "vocab_size": 100278,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "max_position_embeddings": 65536,
        "rms_norm_eps": 1e-6,
        "rope_theta": 500000,
        "rope_scaling": {**YARN, "factor": 8.0, "original_max_position_embeddings": 8192},
        "sliding_window": 4096,
    }


def test_a_7b_shaped_config_reads_as_transformers_does():
    d = _seven_b_shape()
    config = ModelConfig.from_hf(d)
    assert config.sliding_window == 4096 and config.window_layers == tuple(i for i in range(32) if (i + 1) % 4)
    assert config.rope_scaling["rope_type"] == "yarn"
    assert config.window_rope == {"rope_theta": 500000.0, "rope_scaling": None}
    theirs = Olmo3Config(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    assert theirs.rope_parameters["sliding_attention"]["rope_type"] == "default"
    assert theirs.rope_parameters["full_attention"]["rope_type"] == "yarn"
    with torch.device("meta"):
        count = sum(p.numel() for p in AutoModelForCausalLM.from_config(theirs).parameters())
    assert config.num_params() == count


def test_what_transformers_versions_read_apart_is_refused():
    d = _seven_b_shape()
    # transformers 5 turns the window layers at 500,000 whatever a legacy rope_theta says
    with pytest.raises(ValueError, match="OLMo 3 with rope_theta 10000.0 in legacy keys.*rope_parameters per layer"):
        ModelConfig.from_hf({**d, "rope_theta": 10000.0})
    with pytest.raises(ValueError, match="sliding_attention layers and sliding_window null: set sliding_window"):
        ModelConfig.from_hf({**d, "sliding_window": None})
    # every layer in full: one RoPE, the full layers'
    full = ModelConfig.from_hf({**d, "layer_types": ["full_attention"] * 32})
    assert full.sliding_window is None and full.window_rope is None and full.rope_scaling["factor"] == 8.0
    with pytest.raises(ValueError, match="window_rope .* only expressible for Olmo3ForCausalLM"):
        tiny_config(VOCAB, arch="mistral", sliding_window=8, window_layers=(0,), window_rope={"rope_theta": 5.0})


def test_tensor_parallelism_is_refused_as_for_olmo2():
    with pytest.raises(ValueError, match=r"tp_size=2: Olmo3ForCausalLM normalises q and k over all heads"):
        check_tp_size(tiny_config(VOCAB, arch="olmo3"), 2)


def test_the_rollout_engine_decodes_what_the_model_computes(tmp_path):
    _saved_by_transformers(tmp_path, **CASES["per_type"])
    assert_engine_decodes_as_recompute(*load_model(tmp_path), decode_steps=3)


def test_grpo_on_a_tiny_olmo3_learns_the_reward(tmp_path):
    exported = grpo_learns_and_exports(tmp_path, "olmo3", ", sliding_window: 8")
    assert exported["layer_types"] == ["sliding_attention", "full_attention"] and exported["sliding_window"] == 8
