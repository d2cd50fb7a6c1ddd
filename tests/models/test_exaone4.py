"""EXAONE 4.0 (``Exaone4ForCausalLM``: EXAONE-4.0-1.2B and 32B): OLMo 2's norms after each block, in the model
dtype, with per-head q/k norms; where a window is set, windows in the layers ``layer_types`` (or
``sliding_window_pattern``) name and no RoPE in the others (``nope_layers``). A checkpoint transformers saved
loads and computes transformers' log-probs and gradients; the export loads back; the rollout engine decodes it
past its window; GRPO on a tiny one learns; what transformers cannot build, or vLLM builds otherwise, is
refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, Exaone4Config

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

S, F = "sliding_attention", "full_attention"
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8,
}
CASES = {
    # the class's default pattern: layers 0-2 slide over 4 keys, layer 3 attends in full without RoPE
    "pattern": (dict(num_hidden_layers=4, sliding_window=4, sliding_window_pattern=4), (0, 1, 2), (3,)),
    # layer types given, Llama 3's RoPE scaling (EXAONE 4.0's) on the window layers
    "layer_types": (
        dict(num_hidden_layers=3, sliding_window=5, layer_types=[S, F, S], rope_scaling=LLAMA3),
        (0, 2),
        (1,),
    ),
    # no window (EXAONE-4.0-1.2B's layout): every layer turned
    "no_window": (dict(num_hidden_layers=2, sliding_window=None, layer_types=[F, F]), None, ()),
}


def _saved_by_transformers(path, **kw):
    kw = json.loads(json.dumps(kw))  # transformers' config class writes into the RoPE dict it is given
    return saved_by_transformers(Exaone4Config, path, head_dim=12, spread_norms=True, **kw)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_checkpoint_transformers_saved_computes_its_logprobs(case, tmp_path):
    kw, windows, nope = CASES[case]
    ref = _saved_by_transformers(tmp_path / "hf", **kw)
    model, config = load_model(tmp_path / "hf")
    assert (config.norm_layout, config.qk_norm_scope, config.qk_norm) == ("post", "head", True)
    assert (config.window_layers if windows else config.sliding_window, config.nope_layers) == (windows, nope)
    seqs, ids_T, cu_B1 = packed_batch()
    with torch.no_grad():
        ours, _ = packed_logprobs(model.eval(), ids_T, cu_B1, chunk_size=7)
        expected = reference_logprobs(ref, seqs)
        if nope:  # RoPE in the full layers too, or no window: the comparison sees either
            for i in nope:
                model.model.layers[i].self_attn.use_rope = True
            turned, _ = packed_logprobs(model, ids_T, cu_B1, chunk_size=7)
            for i in nope:
                model.model.layers[i].self_attn.use_rope = False
            model.config = config.replace(sliding_window=None, window_layers=None, nope_layers=())
            windowless, _ = packed_logprobs(model, ids_T, cu_B1, chunk_size=7)
            model.config = config
            assert (turned - expected).abs().max().item() > 1e-2
            assert (windowless - expected).abs().max().item() > 1e-2
    assert expected.abs().max() > 1.0
    assert (ours - expected).abs().max().item() <= 1e-4
    assert config.num_params() == sum(p.numel() for p in model.parameters())
    assert_export_reads_back(model, config, seqs, expected, tmp_path / "out")


def test_a_string_pattern_reads_as_documented(tmp_path):
    """``sliding_window_pattern`` "LG" without ``layer_types`` (which transformers' class cannot read): L and G
    repeated from layer 0, the last layer in full; computed as transformers computes those layer types."""
    ref = _saved_by_transformers(tmp_path / "hf", num_hidden_layers=3, sliding_window=4, layer_types=[S, F, F])
    d = json.loads((tmp_path / "hf" / "config.json").read_text())
    del d["layer_types"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**d, "sliding_window_pattern": "LG"}))
    model, config = load_model(tmp_path / "hf")
    assert (config.window_layers, config.nope_layers) == ((0,), (1, 2))
    seqs, ids_T, cu_B1 = packed_batch()
    with torch.no_grad():
        ours, _ = packed_logprobs(model.eval(), ids_T, cu_B1, chunk_size=7)
    assert (ours - reference_logprobs(ref, seqs)).abs().max().item() <= 1e-4
    assert config.to_hf()["layer_types"] == [S, F, F]


def test_its_norms_scale_in_the_model_dtype_as_transformers(tmp_path):
    """In bf16 each norm (after the blocks, per head on q and k, the final one) rounds, then scales, as
    transformers' EXAONE 4 norm does, bit for bit (OLMo 2's order, scaled in float32, differs)."""
    ref = _saved_by_transformers(tmp_path / "hf", **CASES["pattern"][0]).to(torch.bfloat16)
    model, _ = load_model(tmp_path / "hf", dtype=torch.bfloat16)
    torch.manual_seed(0)
    x_TD, x_THD = (torch.randn(9, 48) * 3).to(torch.bfloat16), (torch.randn(9, 4, 12) * 3).to(torch.bfloat16)
    ours, theirs = model.model, ref.model
    for name in ("post_attention_layernorm", "post_feedforward_layernorm"):
        assert torch.equal(getattr(ours.layers[1], name)(x_TD), getattr(theirs.layers[1], name)(x_TD)), name
    assert torch.equal(ours.norm(x_TD), theirs.norm(x_TD))
    assert torch.equal(ours.layers[3].self_attn.q_norm(x_THD), theirs.layers[3].self_attn.q_norm(x_THD))
    norm = theirs.layers[1].post_attention_layernorm
    x32 = x_TD.float()
    fp32_scale = (norm.weight.float() * x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
    assert not torch.equal(fp32_scale, norm(x_TD))


def test_gradients_match_transformers(tmp_path):
    ref = _saved_by_transformers(tmp_path / "hf", **CASES["layer_types"][0])
    model, _ = load_model(tmp_path / "hf")
    assert_gradients_match(
        model,
        ref,
        [
            "model.layers.1.self_attn.q_norm.weight",  # a layer without RoPE
            "model.layers.0.self_attn.k_norm.weight",
            "model.layers.2.self_attn.k_proj.weight",
            "model.layers.1.post_attention_layernorm.weight",
            "model.layers.2.post_feedforward_layernorm.weight",
            "lm_head.weight",
        ],
    )


def test_the_rollout_engine_decodes_what_the_model_computes_past_its_window(tmp_path):
    _saved_by_transformers(tmp_path, **CASES["layer_types"][0])
    assert_engine_decodes_as_recompute(*load_model(tmp_path), decode_steps=3)


def _thirty_two_b() -> dict:
    """A config.json of EXAONE-4.0-32B's shape: a 4,096-token window in three layers of four ("LLLG", the
    layer types given too), Llama 3's RoPE scaling."""
    return {
        "architectures": ["Exaone4ForCausalLM"],
        "model_type": "exaone4",
        "vocab_size": 102400,
        "hidden_size": 5120,
        "intermediate_size": 27392,
        "num_hidden_layers": 64,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "rope_scaling": {**LLAMA3, "factor": 16.0, "original_max_position_embeddings": 8192},
        "sliding_window": 4096,
        "sliding_window_pattern": "LLLG",
        "layer_types": [S if (i + 1) % 4 else F for i in range(64)],
        "tie_word_embeddings": False,
    }


def test_a_32b_shaped_config_reads_as_transformers_does():
    d = _thirty_two_b()
    config = ModelConfig.from_hf(d)
    full = tuple(range(3, 64, 4))
    assert config.nope_layers == full and config.window_layers == tuple(i for i in range(64) if i not in full)
    assert config.rope_scaling["rope_type"] == "llama3" and config.sliding_window == 4096
    theirs = Exaone4Config(**{k: v for k, v in json.loads(json.dumps(d)).items() if k != "architectures"})
    with torch.device("meta"):
        count = sum(p.numel() for p in AutoModelForCausalLM.from_config(theirs).parameters())
    assert config.num_params() == count
    check_tp_size(config, 8)  # per-head q/k norms: each rank's heads norm alone
    bare = ModelConfig.from_hf({"architectures": ["Exaone4ForCausalLM"], "model_type": "exaone4"})
    default = Exaone4Config()
    assert [F if bare.layer_window(i) is None else S for i in range(32)] == default.layer_types
    assert bare.nope_layers == tuple(range(3, 32, 4)) and bare.sliding_window == default.sliding_window == 4096
    assert bare.rope_theta == default.rope_parameters["rope_theta"] and bare.head_dim == 128
    tiny = tiny_config(VOCAB, arch="exaone4", layers=3)
    assert (tiny.window_layers, tiny.nope_layers) == ((0, 1), (2,))
    assert ModelConfig.from_hf(json.loads(json.dumps(tiny.to_hf()))) == tiny


def test_what_transformers_cannot_build_or_vllm_builds_otherwise_is_refused():
    d = _thirty_two_b()
    with pytest.raises(ValueError, match="sliding_attention layers and sliding_window null .* set sliding_window"):
        ModelConfig.from_hf({**d, "sliding_window": None})
    # transformers turns no layer by RoPE here, vLLM every layer
    with pytest.raises(
        ValueError, match="sliding_window=4096 and no sliding_attention layer .* sliding_window to null"
    ):
        ModelConfig.from_hf({**d, "layer_types": [F] * 64})
    no_types = {k: v for k, v in d.items() if k != "layer_types"}
    for pattern in ("LLXG", None, 0):
        with pytest.raises(ValueError, match="sliding_window_pattern=.* give layer_types, or a pattern"):
            ModelConfig.from_hf({**no_types, "sliding_window_pattern": pattern})
    assert ModelConfig.from_hf({**no_types, "sliding_window": None}).nope_layers == ()
    with pytest.raises(ValueError, match=r"nope_layers \[0\] must be its full-attention layers \[1\]"):
        tiny_config(VOCAB, arch="exaone4", nope_layers=(0,))
    with pytest.raises(ValueError, match="Exaone4ForCausalLM has no attention bias"):
        tiny_config(VOCAB, arch="exaone4", attention_bias=True)
    with pytest.raises(ValueError, match="Exaone4ForCausalLM has qk_norm_scope='head' and norm_layout='post'"):
        tiny_config(VOCAB, arch="exaone4", norm_layout="pre")


def test_grpo_on_a_tiny_exaone4_learns_the_reward(tmp_path):
    exported = grpo_learns_and_exports(tmp_path, "exaone4", ", sliding_window: 8")
    assert exported["layer_types"] == [S, F] and exported["sliding_window"] == 8
