"""OLMo 2 (``Olmo2ForCausalLM``): q/k norms over the whole projections and each block's norm on its
output. A checkpoint transformers saved loads and computes transformers' log-probs and gradients; areno's
export loads back into transformers; tensor parallelism, which would split the q/k norms, is refused; the
rollout engine decodes it; GRPO on a tiny one learns the demo reward."""

from __future__ import annotations

import pytest
import torch
from transformers import Olmo2Config

from areno.models import Decoder, check_tp_size, load_model, tiny_config
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


def _saved_by_transformers(path, **kw):
    """Its norm weights spread, so that a norm applied in the wrong place (or the two post-block norms
    swapped) changes the log-probs."""
    return saved_by_transformers(Olmo2Config, path, spread_norms=True, **kw)


@pytest.mark.parametrize("kw", [{}, {"attention_bias": True, "tie_word_embeddings": True}], ids=["plain", "bias_tied"])
def test_a_checkpoint_transformers_saved_computes_its_logprobs(kw, tmp_path):
    ref = _saved_by_transformers(tmp_path / "hf", **kw)
    model, config = load_model(tmp_path / "hf")
    assert (config.qk_norm, config.qk_norm_scope, config.norm_layout) == (True, "projection", "post")
    assert config.attention_bias == config.attention_out_bias == bool(kw)
    seqs, ids_T, cu_B1 = packed_batch()
    with torch.no_grad():
        ours, _ = packed_logprobs(model.eval(), ids_T, cu_B1, chunk_size=7)
        expected = reference_logprobs(ref, seqs)
    assert expected.abs().max() > 1.0
    assert (ours - expected).abs().max().item() <= 1e-4
    ref_sd = {k: v for k, v in ref.state_dict().items() if not (config.tie_word_embeddings and k == "lm_head.weight")}
    assert sorted(model.state_dict()) == sorted(ref_sd)
    assert model.model.layers[0].self_attn.q_norm.weight.shape == (4 * 12,)
    assert config.num_params() == sum(p.numel() for p in model.parameters())
    # areno's export loads back into transformers with the same values
    assert_export_reads_back(model, config, seqs, expected, tmp_path / "out")


def test_gradients_match_transformers(tmp_path):
    ref = _saved_by_transformers(tmp_path / "hf")
    model, _ = load_model(tmp_path / "hf")
    assert_gradients_match(
        model,
        ref,
        [
            "model.layers.0.self_attn.q_norm.weight",
            "model.layers.1.self_attn.k_norm.weight",
            "model.layers.0.post_attention_layernorm.weight",
            "model.layers.1.post_feedforward_layernorm.weight",
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.1.mlp.down_proj.weight",
            "model.norm.weight",
            "lm_head.weight",
        ],
    )


def test_the_other_layouts_are_refused_for_olmo2_and_olmo2s_for_the_others():
    with pytest.raises(ValueError, match="Olmo2ForCausalLM has qk_norm_scope='projection' and norm_layout='post'"):
        tiny_config(VOCAB, arch="olmo2", norm_layout="pre")
    with pytest.raises(ValueError, match="Qwen3ForCausalLM has qk_norm_scope='head'"):
        tiny_config(VOCAB, arch="qwen3", qk_norm_scope="projection")
    with pytest.raises(ValueError, match="only Qwen3, OLMo, Gemma 3 and EXAONE 4 have q/k norms"):
        tiny_config(VOCAB, arch="olmo2", qk_norm=False)


def test_tensor_parallelism_which_would_split_the_qk_norms_is_refused():
    config = tiny_config(VOCAB, arch="olmo2")
    check_tp_size(config, 1)
    with pytest.raises(ValueError, match=r"tp_size=2: Olmo2ForCausalLM normalises q and k over all heads.*tp_size=1"):
        check_tp_size(config, 2)
    plan = tp_plan(config)  # the one-rank plan still names every parameter (policy sync reads it)
    for name, _ in Decoder(config).named_parameters():
        tp_style(plan, name)


def test_the_rollout_engine_decodes_what_the_model_computes(tmp_path):
    _saved_by_transformers(tmp_path)
    assert_engine_decodes_as_recompute(*load_model(tmp_path))


def test_grpo_on_a_tiny_olmo2_learns_the_reward(tmp_path):
    grpo_learns_and_exports(tmp_path, "olmo2")
