"""OLMo 2 (``Olmo2ForCausalLM``): q/k norms over the whole projections and each block's norm on its
output. A checkpoint transformers saved loads and computes transformers' log-probs and gradients; areno's
export loads back into transformers; tensor parallelism, which would split the q/k norms, is refused; the
rollout engine decodes it; GRPO on a tiny one learns the demo reward."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, Olmo2Config

from areno.models import Decoder, ModelConfig, check_tp_size, load_model, save_model, tiny_config
from areno.models.logprobs import packed_logprobs
from areno.models.tp_plan import tp_plan, tp_style
from tests.helpers.configs import grpo_rewards_on_tiny
from tests.helpers.families import VOCAB, packed_batch, reference_logprobs, saved_by_transformers


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
    save_model(model, config, tmp_path / "out")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        assert (reference_logprobs(back.eval(), seqs) - expected).abs().max().item() <= 1e-5
    assert ModelConfig.from_hf(json.loads((tmp_path / "out" / "config.json").read_text())) == config


def test_gradients_match_transformers(tmp_path):
    ref = _saved_by_transformers(tmp_path / "hf")
    model, _ = load_model(tmp_path / "hf")
    seqs, ids_T, cu_B1 = packed_batch()
    ours, _ = packed_logprobs(model, ids_T, cu_B1, chunk_size=7)
    ours.sum().backward()
    reference_logprobs(ref, seqs, grad=True).sum().backward()
    ref_params = dict(ref.named_parameters())
    names = [
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.1.self_attn.k_norm.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.layers.1.post_feedforward_layernorm.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.norm.weight",
        "lm_head.weight",
    ]
    ours_params = dict(model.named_parameters())
    for name in names:
        g, r = ours_params[name].grad, ref_params[name].grad
        assert r.abs().max() > 0, name
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5, msg=name)


def test_the_other_layouts_are_refused_for_olmo2_and_olmo2s_for_the_others():
    with pytest.raises(ValueError, match="Olmo2ForCausalLM has qk_norm_scope='projection' and norm_layout='post'"):
        tiny_config(VOCAB, arch="olmo2", norm_layout="pre")
    with pytest.raises(ValueError, match="Qwen3ForCausalLM has qk_norm_scope='head'"):
        tiny_config(VOCAB, arch="qwen3", qk_norm_scope="projection")
    with pytest.raises(ValueError, match="only Qwen3, OLMo and Gemma 3 have q/k norms"):
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
    from areno.rollout.engine import RolloutEngine, RolloutEngineConfig
    from areno.types import SamplingParams
    from tests.helpers.rollout import naive_greedy, random_prompts

    _saved_by_transformers(tmp_path)
    model, config = load_model(tmp_path)
    model.eval()
    engine = RolloutEngine(model, config, config=RolloutEngineConfig(block_size=4, num_blocks=64, max_model_len=64))
    prompts = [[t % VOCAB for t in p] for p in random_prompts(3, seed=15, lo=6, hi=14)]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.output_ids == naive_greedy(model, prompt, 10)[0]


def test_grpo_on_a_tiny_olmo2_learns_the_reward(tmp_path):
    rewards = grpo_rewards_on_tiny(
        tmp_path,
        "model.init_tiny={arch: olmo2, hidden_size: 32, layers: 2, heads: 2, kv_heads: 1, intermediate_size: 64}",
    )
    assert len(rewards) == 12
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, rewards
    exported = json.loads((tmp_path / "run" / "checkpoints" / "step_00000012" / "hf" / "config.json").read_text())
    assert exported["architectures"] == ["Olmo2ForCausalLM"]
