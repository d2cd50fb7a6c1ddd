"""GLM-4 (``Glm4ForCausalLM``: GLM-4-9B-0414, GLM-4-32B, GLM-Z1): half of each head turned by RoPE, adjacent
dimensions together (``rope_interleaved``); a norm before and after each block under GLM's names; q/k/v
biases; gate/up stored as one tensor. A checkpoint transformers saved loads and computes transformers'
log-probs and gradients; the export stores the names transformers loads; the rollout engine decodes it;
GRPO on a tiny one learns."""

from __future__ import annotations

import json

import torch
from transformers import Glm4Config

from areno.models import ModelConfig, load_model, tiny_config
from areno.models.decoder import apply_rope, eager_rope
from areno.models.logprobs import packed_logprobs
from tests.helpers.families import (
    assert_engine_decodes_as_recompute,
    assert_export_reads_back,
    assert_gradients_match,
    grpo_learns_and_exports,
    packed_batch,
    reference_logprobs,
    saved_by_transformers,
    saved_names,
)

SHAPE = dict(head_dim=12, spread_norms=True)


def test_a_checkpoint_transformers_saved_computes_its_logprobs_and_exports_its_names(tmp_path):
    ref = saved_by_transformers(Glm4Config, tmp_path / "hf", **SHAPE)
    model, config = load_model(tmp_path / "hf")
    assert config.architecture == "Glm4ForCausalLM" and config.norm_layout == "sandwich"
    assert (config.rotary_dim, config.rope_interleaved, config.attention_bias) == (6, True, True)
    assert "model.layers.0.post_self_attn_layernorm.weight" in model.state_dict()
    seqs, ids_T, cu_B1 = packed_batch()
    with torch.no_grad():
        ours, _ = packed_logprobs(model.eval(), ids_T, cu_B1, chunk_size=7)
        expected = reference_logprobs(ref, seqs)
    assert expected.abs().max() > 1.0
    assert (ours - expected).abs().max().item() <= 1e-4
    assert_export_reads_back(model, config, seqs, expected, tmp_path / "out")
    assert saved_names(tmp_path / "out") == saved_names(tmp_path / "hf")  # gate_up_proj packed, as transformers


def test_gradients_match_transformers(tmp_path):
    ref = saved_by_transformers(Glm4Config, tmp_path / "hf", **SHAPE)
    model, _ = load_model(tmp_path / "hf")
    assert_gradients_match(
        model,
        ref,
        [
            "model.embed_tokens.weight",
            "model.layers.0.self_attn.k_proj.weight",
            "model.layers.0.self_attn.q_proj.bias",
            "model.layers.0.post_self_attn_layernorm.weight",
            "model.layers.1.post_mlp_layernorm.weight",
        ],
    )


def test_interleaved_rope_turns_adjacent_pairs():
    """Pairs (0, 1), (2, 3), ... of the turned dimensions rotate by one angle each: the rotate-half form
    over the dimensions laid out evens first, and the unturned rest passes, also under autograd."""
    torch.manual_seed(0)
    x = torch.randn(5, 3, 12, requires_grad=True)
    angle = torch.rand(5, 3) * 6
    cos, sin = angle.cos(), angle.sin()
    got = apply_rope(x, cos, sin, interleaved=True)
    even, odd = x[..., 0:6:2], x[..., 1:6:2]
    c, s = cos[:, None], sin[:, None]
    want = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2)
    torch.testing.assert_close(got[..., :6], want)
    torch.testing.assert_close(got[..., 6:], x[..., 6:])
    half = apply_rope(x, cos, sin)  # rotate-half pairs (0, 3), (1, 4), ...: another rotation
    torch.testing.assert_close(half[..., :6], eager_rope(x[..., :6], cos, sin))
    assert (half - got).abs().max() > 0.1
    got.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_the_rollout_engine_decodes_what_the_model_computes(tmp_path):
    saved_by_transformers(Glm4Config, tmp_path, **SHAPE)
    assert_engine_decodes_as_recompute(*load_model(tmp_path), decode_steps=3)


def test_a_config_without_its_keys_takes_the_classs():
    bare = ModelConfig.from_hf({"architectures": ["Glm4ForCausalLM"], "model_type": "glm4"})
    theirs = Glm4Config()
    assert bare.partial_rotary_factor == theirs.rope_parameters["partial_rotary_factor"] == 0.5
    assert bare.rope_theta == theirs.rope_parameters["rope_theta"]
    assert (bare.hidden_size, bare.num_hidden_layers, bare.vocab_size, bare.head_dim) == (
        theirs.hidden_size,
        theirs.num_hidden_layers,
        theirs.vocab_size,
        theirs.head_dim,
    )
    assert bare.rms_norm_eps == theirs.rms_norm_eps and bare.attention_bias is theirs.attention_bias is True
    tiny = tiny_config(61, arch="glm4")
    assert ModelConfig.from_hf(json.loads(json.dumps(tiny.to_hf()))) == tiny


def test_grpo_on_a_tiny_glm4_learns_the_reward(tmp_path):
    exported = grpo_learns_and_exports(tmp_path, "glm4")
    assert exported["partial_rotary_factor"] == 0.5


def test_lora_takes_the_packed_names_transformers_gives_gate_up():
    """``train.lora.target_modules=gate_up_proj`` (peft's and transformers' name on GLM-4) adapts its parts."""
    from areno.models.decoder import Decoder
    from areno.train.config import LoraConfig
    from areno.train.lora import apply_lora, lora_layers

    model = apply_lora(Decoder(tiny_config(61, arch="glm4")), LoraConfig(target_modules="gate_up_proj,q_proj"))
    adapted = {name.rsplit(".", 1)[-1] for name in lora_layers(model)}
    assert adapted == {"gate_proj", "up_proj", "q_proj"}


def test_window_keys_transformers_ignores_are_ignored():
    d = tiny_config(61, arch="glm4").to_hf()
    for keys in ({"use_sliding_window": True, "sliding_window": 8}, {"layer_types": ["sliding_attention"] * 2}):
        assert ModelConfig.from_hf({**d, **keys}).sliding_window is None
