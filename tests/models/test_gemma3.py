"""Gemma 3's text model (``Gemma3ForCausalLM``): norms before and after each block whose weights are offsets
from 1, per-head q/k norms, embeddings scaled by sqrt(hidden_size), the tanh GELU, ``query_pre_attn_scalar``,
and sliding windows in five layers of six that turn at their own RoPE base. A checkpoint transformers saved
loads and computes transformers' log-probs and gradients; the export loads back; the rollout engine decodes
it; GRPO on a tiny one learns; what areno does not compute (soft-capping, bidirectional attention) is refused."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig

from areno.models import Decoder, ModelConfig, load_model, tiny_config
from areno.models.logprobs import packed_logprobs
from areno.models.tp_plan import tp_plan, tp_style
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

SHAPE = dict(num_hidden_layers=3, head_dim=12, sliding_window=4)
CASES = {
    # transformers' own scalar (256, not head_dim: the scores' scale differs) and the layer types given
    "default": dict(SHAPE, layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
    # the older key for the layer types; the 4B+ models' linear RoPE scaling, on the full layer only
    "pattern_linear": dict(
        SHAPE, query_pre_attn_scalar=12, sliding_window_pattern=2, rope_scaling={"rope_type": "linear", "factor": 8.0}
    ),
}


def _saved_by_transformers(path, **kw):
    """Norm weights spread (Gemma's are offsets from 1: a norm that forgot the 1 or sits elsewhere shows)."""
    return saved_by_transformers(Gemma3TextConfig, path, spread_norms=True, **kw)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_checkpoint_transformers_saved_computes_its_logprobs(case, tmp_path):
    ref = _saved_by_transformers(tmp_path / "hf", **CASES[case])
    model, config = load_model(tmp_path / "hf")
    assert (config.norm_layout, config.norm_weight_offset, config.hidden_act) == ("sandwich", 1.0, "gelu_pytorch_tanh")
    assert config.window_layers == {"default": (0, 1), "pattern_linear": (0, 2)}[case]
    assert config.window_rope == {"rope_theta": 10000.0, "rope_scaling": None} and config.rope_theta == 1e6
    seqs, ids_T, cu_B1 = packed_batch()
    with torch.no_grad():
        ours, _ = packed_logprobs(model.eval(), ids_T, cu_B1, chunk_size=7)
        expected = reference_logprobs(ref, seqs)
    assert expected.abs().max() > 1.0
    assert (ours - expected).abs().max().item() <= 1e-4
    tied = {k for k in ref.state_dict() if k == "lm_head.weight"}  # transformers lists the tied head
    assert sorted(model.state_dict()) == sorted(set(ref.state_dict()) - tied)
    assert config.num_params() == sum(p.numel() for p in model.parameters())
    assert_export_reads_back(model, config, seqs, expected, tmp_path / "out")


def test_gradients_match_transformers(tmp_path):
    ref = _saved_by_transformers(tmp_path / "hf", **CASES["pattern_linear"])
    model, _ = load_model(tmp_path / "hf")
    assert_gradients_match(
        model,
        ref,
        [
            "model.embed_tokens.weight",
            "model.layers.0.input_layernorm.weight",
            "model.layers.0.self_attn.q_norm.weight",
            "model.layers.1.self_attn.k_norm.weight",
            "model.layers.1.post_attention_layernorm.weight",
            "model.layers.2.pre_feedforward_layernorm.weight",
            "model.layers.2.post_feedforward_layernorm.weight",
            "model.layers.2.mlp.gate_proj.weight",
            "model.norm.weight",
        ],
    )


def _one_b_shape() -> dict:
    """A config.json of Gemma 3 1B's shape in the keys its checkpoint was written with (transformers 4.50)."""
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": 262144,
        "hidden_size": 1152,
        "intermediate_size": 6912,
        "num_hidden_layers": 26,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 32768,
        "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-6,
        "rope_local_base_freq": 10000,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "bos_token_id": 2,
        "eos_token_id": [1, 106],
        "pad_token_id": 0,
    }


def test_a_1b_shaped_config_reads_as_transformers_does():
    d = _one_b_shape()
    config = ModelConfig.from_hf(d)
    assert config.window_layers == tuple(i for i in range(26) if (i + 1) % 6)
    assert (config.sliding_window, config.rope_theta, config.tie_word_embeddings) == (512, 1e6, True)
    assert config.window_rope == {"rope_theta": 10000.0, "rope_scaling": None}
    theirs = Gemma3TextConfig(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    assert [config.layer_window(i) is not None for i in range(26)] == [
        t == "sliding_attention" for t in theirs.layer_types
    ]
    assert theirs.rope_parameters["sliding_attention"]["rope_theta"] == 10000
    with torch.device("meta"):
        count = sum(p.numel() for p in AutoModelForCausalLM.from_config(theirs).parameters())
    assert config.num_params() == count
    # keys left out take Gemma3TextConfig's defaults: the two RoPE bases, the scalar, the window
    for key in ("rope_local_base_freq", "rope_theta", "query_pre_attn_scalar", "sliding_window", "head_dim"):
        d.pop(key)
    bare, theirs = ModelConfig.from_hf(d), Gemma3TextConfig(**{k: v for k, v in d.items() if k != "architectures"})
    rope = theirs.rope_parameters
    assert bare.rope_theta == rope["full_attention"]["rope_theta"]
    assert bare.window_rope["rope_theta"] == rope["sliding_attention"]["rope_theta"]
    assert (bare.query_pre_attn_scalar, bare.sliding_window, bare.head_dim) == (
        theirs.query_pre_attn_scalar,
        theirs.sliding_window,
        theirs.head_dim,
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0 is not supported .* set it to null"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 is not supported"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention=true .* not supported"),
        ({"hidden_activation": "gelu"}, "hidden_activation='gelu' is not supported for Gemma 3"),
    ],
)
def test_what_areno_does_not_compute_is_refused(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf({**_one_b_shape(), **change})


def test_the_layout_flags_belong_to_gemma3_only():
    with pytest.raises(
        ValueError, match="Gemma3ForCausalLM has norm_weight_offset=1.0, hidden_act='gelu_pytorch_tanh'"
    ):
        tiny_config(VOCAB, arch="gemma3", hidden_act="silu")
    with pytest.raises(ValueError, match="LlamaForCausalLM has norm_weight_offset=0.0"):
        tiny_config(VOCAB, arch="llama", scale_embeddings=True)
    with pytest.raises(ValueError, match="query_pre_attn_scalar=64.0 is only expressible"):
        tiny_config(VOCAB, arch="llama", query_pre_attn_scalar=64.0)
    # tensor parallelism splits heads, whose own q/k norms it keeps whole: every parameter has a style
    config = tiny_config(VOCAB, arch="gemma3")
    plan = tp_plan(config)
    for name, _ in Decoder(config).named_parameters():
        tp_style(plan, name)


def test_the_rollout_engine_decodes_what_the_model_computes(tmp_path):
    _saved_by_transformers(tmp_path, **CASES["pattern_linear"])
    assert_engine_decodes_as_recompute(*load_model(tmp_path), decode_steps=3)


def test_grpo_on_a_tiny_gemma3_learns_the_reward(tmp_path):
    exported = grpo_learns_and_exports(tmp_path, "gemma3", ", sliding_window: 8")
    assert exported["rope_parameters"]["sliding_attention"]["rope_theta"] == 1000.0
