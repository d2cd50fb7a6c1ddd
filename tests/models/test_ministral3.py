"""Ministral 3's text model (``Ministral3ForCausalLM``): Mistral's layers with YaRN and queries scaled by their
position past the YaRN context (``query_position_scale``, transformers' ``llama_4_scaling_beta``). A checkpoint
transformers saved loads and computes transformers' log-probs and gradients at positions past the period; the
export loads back; the rollout engine decodes it; GRPO on a tiny one learns; its vision-language checkpoint
(``Mistral3ForConditionalGeneration``) trains its text model."""

from __future__ import annotations

import pytest
import torch
from transformers import Ministral3Config

from areno.models import ModelConfig, load_model
from areno.models.logprobs import packed_logprobs
from tests.helpers.families import (
    assert_engine_decodes_as_recompute,
    assert_export_reads_back,
    assert_gradients_match,
    grpo_learns_and_exports,
    packed_batch,
    reference_logprobs,
    saved_by_transformers,
)

# a period of 4 positions: the batch's sequences (up to 14 tokens) cross it three times
ROPE = {
    "rope_type": "yarn",
    "rope_theta": 1e6,
    "factor": 16.0,
    "original_max_position_embeddings": 4,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "llama_4_scaling_beta": 0.5,
}
SHAPE = dict(head_dim=12, max_position_embeddings=64, rope_parameters=ROPE, sliding_window=None)


def test_a_checkpoint_transformers_saved_computes_its_logprobs(tmp_path):
    ref = saved_by_transformers(Ministral3Config, tmp_path / "hf", **SHAPE)
    model, config = load_model(tmp_path / "hf")
    assert config.architecture == "Ministral3ForCausalLM" and config.query_position_scale == (0.5, 4)
    assert config.rope_scaling["rope_type"] == "yarn" and "llama_4_scaling_beta" not in config.rope_scaling
    seqs, ids_T, cu_B1 = packed_batch()
    with torch.no_grad():
        ours, _ = packed_logprobs(model.eval(), ids_T, cu_B1, chunk_size=7)
        expected = reference_logprobs(ref, seqs)
        unscaled = load_model(tmp_path / "hf")[0]
        unscaled.config = config.replace(query_position_scale=None)
        for layer in unscaled.model.layers:
            layer.self_attn.scaled_queries = False
        without, _ = packed_logprobs(unscaled.eval(), ids_T, cu_B1, chunk_size=7)
    assert (ours - expected).abs().max().item() <= 1e-4
    assert (without - expected).abs().max().item() > 1e-2  # the scale matters at these positions
    assert_export_reads_back(model, config, seqs, expected, tmp_path / "out")


def test_gradients_match_transformers(tmp_path):
    ref = saved_by_transformers(Ministral3Config, tmp_path / "hf", **SHAPE)
    model, _ = load_model(tmp_path / "hf")
    assert_gradients_match(
        model,
        ref,
        ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight"],
    )


def test_the_rollout_engine_decodes_what_the_model_computes(tmp_path):
    saved_by_transformers(Ministral3Config, tmp_path, **SHAPE)
    assert_engine_decodes_as_recompute(*load_model(tmp_path), decode_steps=3)


def test_a_config_without_rope_keys_takes_the_classs_and_a_beta_needs_its_period():
    bare = ModelConfig.from_hf({"architectures": ["Ministral3ForCausalLM"], "model_type": "ministral3"})
    theirs = Ministral3Config()
    assert bare.query_position_scale == (theirs.rope_parameters["llama_4_scaling_beta"], 16384)
    assert bare.rope_theta == theirs.rope_parameters["rope_theta"] and bare.rope_scaling["factor"] == 16.0
    assert (bare.hidden_size, bare.num_hidden_layers, bare.vocab_size) == (4096, 34, 131072)
    d = {
        "architectures": ["Ministral3ForCausalLM"],
        "rope_theta": 1e6,
        "rope_scaling": {"rope_type": "default", "llama_4_scaling_beta": 0.1},
    }
    with pytest.raises(ValueError, match="llama_4_scaling_beta needs the RoPE's original_max_position_embeddings"):
        ModelConfig.from_hf(d)


def test_grpo_on_a_tiny_ministral3_learns_the_reward(tmp_path):
    exported = grpo_learns_and_exports(tmp_path, "ministral3")
    assert exported["rope_scaling"]["llama_4_scaling_beta"] == 0.1
