"""Ernie 4.5 dense (``Ernie4_5ForCausalLM``: ERNIE-4.5-0.3B): Llama's layers with a bias on every projection or
none (``use_bias``), RoPE turning adjacent pairs over the whole head (``rope_interleaved``) in float32
(``rope_in_float32``), tied embeddings. A checkpoint transformers saved loads and computes transformers'
log-probs and gradients; the export loads back; the rollout engine decodes it; GRPO on a tiny one learns;
the flags no other family has are refused elsewhere, and its own without them."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, Ernie4_5Config
from transformers.models.ernie4_5.modeling_ernie4_5 import Ernie4_5RotaryEmbedding, apply_rotary_pos_emb

from areno.models import Decoder, ModelConfig, load_model, tiny_config
from areno.models.decoder import apply_rope
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
    saved_names,
)

SHAPE = dict(head_dim=12, use_bias=True, tie_word_embeddings=True, spread_norms=True, spread_biases=True)


def test_a_checkpoint_transformers_saved_computes_its_logprobs_and_exports_its_names(tmp_path):
    ref = saved_by_transformers(Ernie4_5Config, tmp_path / "hf", **SHAPE)
    model, config = load_model(tmp_path / "hf")
    assert config.architecture == "Ernie4_5ForCausalLM" and config.tie_word_embeddings
    assert (config.rope_interleaved, config.rope_in_float32, config.rotary_dim) == (True, True, 12)
    assert config.attention_bias and config.attention_out_bias and config.mlp_bias
    assert ref.model.layers[0].mlp.down_proj.bias.abs().max() > 0.1
    seqs, ids_T, cu_B1 = packed_batch()
    with torch.no_grad():
        ours, _ = packed_logprobs(model.eval(), ids_T, cu_B1, chunk_size=7)
        expected = reference_logprobs(ref, seqs)
        # rotate-half pairs (i, i + Dh/2) in place of adjacent ones: the comparison sees interleaving missing
        for layer in model.model.layers:
            layer.self_attn.rope_interleaved = False
        halves, _ = packed_logprobs(model, ids_T, cu_B1, chunk_size=7)
        for layer in model.model.layers:
            layer.self_attn.rope_interleaved = True
    assert expected.abs().max() > 1.0
    assert (ours - expected).abs().max().item() <= 1e-4
    assert (halves - expected).abs().max().item() > 1e-2
    assert config.num_params() == sum(p.numel() for p in model.parameters())
    assert_export_reads_back(model, config, seqs, expected, tmp_path / "out")
    assert saved_names(tmp_path / "out") == saved_names(tmp_path / "hf")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["use_bias"] is True


def test_gradients_match_transformers(tmp_path):
    ref = saved_by_transformers(Ernie4_5Config, tmp_path / "hf", **SHAPE)
    model, _ = load_model(tmp_path / "hf")
    assert_gradients_match(
        model,
        ref,
        [
            "model.embed_tokens.weight",  # the tied head's and the lookup's
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.self_attn.k_proj.bias",
            "model.layers.1.self_attn.o_proj.bias",
            "model.layers.0.mlp.down_proj.bias",
            "model.layers.1.post_attention_layernorm.weight",
        ],
    )


def test_rope_turns_adjacent_pairs_in_float32_as_transformers_in_bfloat16():
    """The layer's RoPE of bf16 q equals transformers' Ernie 4.5 function bit for bit (float32 tables, one
    rounding); the same turn by tables rounded to bf16 first (Llama's order) does not."""
    config = tiny_config(VOCAB, arch="ernie4_5", hidden_size=64, heads=4, kv_heads=2, max_position_embeddings=256)
    model = Decoder(config).to(torch.bfloat16)
    torch.manual_seed(0)
    q_THD = torch.randn(40, 4, 16).to(torch.bfloat16)
    pos_T = torch.arange(100, 140)
    cos_TF, sin_TF = model.rope_at(pos_T, torch.device("cpu"), torch.bfloat16)
    assert cos_TF.dtype == torch.float32
    ours = model.model.layers[0].self_attn._turn(q_THD, cos_TF, sin_TF)
    hf = Ernie4_5Config(**{k: v for k, v in config.to_hf().items() if k not in ("architectures", "model_type")})
    cos, sin = Ernie4_5RotaryEmbedding(hf)(q_THD, pos_T[None])
    theirs, _ = apply_rotary_pos_emb(q_THD.transpose(0, 1)[None], q_THD.transpose(0, 1)[None], cos, sin)
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, theirs[0].transpose(0, 1))
    rounded = apply_rope(q_THD, cos_TF.to(torch.bfloat16), sin_TF.to(torch.bfloat16), interleaved=True)
    assert not torch.equal(rounded, ours)


def test_the_rollout_engine_decodes_what_the_model_computes(tmp_path):
    saved_by_transformers(Ernie4_5Config, tmp_path, **SHAPE)
    assert_engine_decodes_as_recompute(*load_model(tmp_path), decode_steps=3)


def _point_three_b() -> dict:
    """A config.json of ERNIE-4.5-0.3B's shape."""
    return {
        "architectures": ["Ernie4_5ForCausalLM"],
        "model_type": "ernie4_5",
        "vocab_size": 103424,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 18,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000,
        "use_bias": False,
        "tie_word_embeddings": True,
    }


def test_a_config_without_its_keys_takes_the_classs_and_a_real_shape_counts_its_parameters():
    bare = ModelConfig.from_hf({"architectures": ["Ernie4_5ForCausalLM"], "model_type": "ernie4_5"})
    theirs = Ernie4_5Config()
    assert bare.rope_theta == theirs.rope_parameters["rope_theta"] == 5e5
    assert (bare.hidden_size, bare.num_hidden_layers, bare.vocab_size, bare.head_dim) == (
        theirs.hidden_size,
        theirs.num_hidden_layers,
        theirs.vocab_size,
        theirs.head_dim,
    )
    assert bare.tie_word_embeddings is theirs.tie_word_embeddings is True
    assert bare.pad_token_id == theirs.pad_token_id == 0 and bare.attention_bias is theirs.use_bias is False
    tiny = tiny_config(VOCAB, arch="ernie4_5")
    assert ModelConfig.from_hf(json.loads(json.dumps(tiny.to_hf()))) == tiny
    d = _point_three_b()
    config = ModelConfig.from_hf(d)
    with torch.device("meta"):
        ref = AutoModelForCausalLM.from_config(Ernie4_5Config(**{k: v for k, v in d.items() if k != "architectures"}))
    assert config.num_params() == sum(p.numel() for p in ref.parameters())


def test_its_flags_are_its_own_and_required():
    with pytest.raises(ValueError, match="rope_in_float32=True is impossible for LlamaForCausalLM"):
        tiny_config(VOCAB, arch="llama", rope_in_float32=True)
    with pytest.raises(ValueError, match="rope_interleaved=False is impossible for Ernie4_5ForCausalLM"):
        tiny_config(VOCAB, arch="ernie4_5", rope_interleaved=False)
    with pytest.raises(ValueError, match="rope_in_float32=False is impossible for Ernie4_5ForCausalLM"):
        tiny_config(VOCAB, arch="ernie4_5", rope_in_float32=False)
    with pytest.raises(ValueError, match=r"biases every projection or none \(use_bias\)"):
        tiny_config(VOCAB, arch="ernie4_5", mlp_bias=False)
    with pytest.raises(ValueError, match="biases q/k/v/o together"):
        tiny_config(VOCAB, arch="ernie4_5", attention_out_bias=False)
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5 is not supported for Ernie4_5ForCausalLM"):
        ModelConfig.from_hf({**_point_three_b(), "partial_rotary_factor": 0.5})


def test_grpo_on_a_tiny_ernie4_5_learns_the_reward(tmp_path):
    exported = grpo_learns_and_exports(tmp_path, "ernie4_5")
    assert exported["use_bias"] is True and exported["tie_word_embeddings"] is True
