"""The TP plan covers every parameter, and a model split by it computes what the full model does."""

from __future__ import annotations

import pytest
import torch

from areno.models import Decoder, PackedCausalAttention, tiny_config
from areno.models.tp_plan import check_tp_size, shard_tensor, tp_plan, tp_style

VOCAB = 40


@pytest.mark.parametrize(
    "kw",
    [dict(arch="qwen2"), dict(arch="qwen3", tie_word_embeddings=True),
     dict(arch="llama", attention_bias=True, attention_out_bias=True, mlp_bias=True), dict(arch="mistral")],
)
def test_plan_covers_every_parameter(kw):
    config = tiny_config(VOCAB, **kw)
    plan = tp_plan(config)
    styles = {name: tp_style(plan, name) for name, _ in Decoder(config).named_parameters()}
    assert styles["model.layers.1.self_attn.q_proj.weight"] == "colwise"
    assert styles["model.layers.0.mlp.down_proj.weight"] == "rowwise"
    assert ("lm_head.weight" in styles) == (not config.tie_word_embeddings)
    with pytest.raises(ValueError, match="not covered"):
        tp_style(plan, "model.layers.0.self_attn.rotary.weight")


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_tp2_split_by_plan_equals_full_model(arch):
    """Each rank holds its shards in a Decoder of 1/tp heads and MLP width; summing the rowwise
    partial outputs (the all-reduce) and concatenating vocab shards reproduces the full logits."""
    torch.manual_seed(0)
    tp = 2
    full_cfg = tiny_config(VOCAB, arch=arch, heads=4, kv_heads=2, initializer_range=0.2)
    check_tp_size(full_cfg, tp)
    full = Decoder(full_cfg).eval()
    plan = tp_plan(full_cfg)
    shard_cfg = full_cfg.replace(num_attention_heads=2, num_key_value_heads=1,
                                 intermediate_size=full_cfg.intermediate_size // tp)
    ranks = []
    for r in range(tp):
        m = Decoder(shard_cfg).eval()
        m.lm_head = torch.nn.Linear(full_cfg.hidden_size, VOCAB // tp, bias=False)  # vocab-parallel
        sd = {n: shard_tensor(t, tp_style(plan, n), r, tp) for n, t in full.state_dict().items()}
        m.load_state_dict(sd)
        ranks.append(m)

    ids_T = torch.randint(0, VOCAB, (11,))
    pos_T = torch.arange(11)
    attn = PackedCausalAttention(torch.tensor([0, 11]))
    with torch.no_grad():
        expected = full.logits(full(ids_T, pos_T, attn))
        cos, sin = full.rope.get(torch.device("cpu"), torch.float32)
        cos_T, sin_T = cos[pos_T], sin[pos_T]
        x = full.model.embed_tokens(ids_T)
        for i in range(full_cfg.num_hidden_layers):
            layers = [m.model.layers[i] for m in ranks]
            h = layers[0].input_layernorm(x)
            x = x + sum(layer.self_attn(h, cos_T, sin_T, attn) for layer in layers)
            h = layers[0].post_attention_layernorm(x)
            x = x + sum(layer.mlp(h) for layer in layers)
        hidden = ranks[0].model.norm(x)
        got = torch.cat([m.logits(hidden) for m in ranks], dim=-1)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_check_tp_size_errors():
    config = tiny_config(VOCAB, heads=4, kv_heads=2)
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        check_tp_size(config, 4)
    with pytest.raises(ValueError, match="vocab_size=41"):
        check_tp_size(tiny_config(41), 2)
    check_tp_size(tiny_config(41, tie_word_embeddings=True), 2)
