"""IBM Granite 3 (``GraniteForCausalLM``: granite-3.0 to 3.3, 2B and 8B, base and instruct): Llama's layers and
four scalars, embeddings times ``embedding_multiplier``, ``attention_multiplier`` as the softmax's scale, each
block's output times ``residual_multiplier`` before its residual add, and final logits divided by
``logits_scaling``. A checkpoint transformers saved with all four far from 1 computes transformers' log-probs and
gradients, and others without any one of them; the export loads back in transformers; the chunked head divides
its logits (beside Gemma 2's cap: one map); the rollout engine decodes it and reports the trainer's log-probs;
GRPO on a tiny one learns; what areno does not compute is refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import GraniteConfig

from areno.models import Decoder, ModelConfig, load_model, tiny_config
from areno.models.eager_ops import LogitMap
from areno.models.logprobs import compiled_logprob_kernels, logprobs_from_hidden, packed_logprobs
from tests.helpers.families import (
    assert_engine_decodes_as_recompute,
    assert_export_reads_back,
    assert_gradients_match,
    assert_sampled_logprobs_are_the_trainers,
    grpo_learns_and_exports,
    packed_batch,
    reference_logprobs,
    saved_by_transformers,
)

MULTIPLIERS = dict(
    embedding_multiplier=12.0, attention_multiplier=0.015625, residual_multiplier=0.22, logits_scaling=8.0
)
"""All four far from 1 (the released 2B's values), so a missing or misplaced one shows."""
SHAPE = dict(**MULTIPLIERS, initializer_range=0.4, spread_norms=True, tie_word_embeddings=True)
DEFAULTS = dict(embedding_multiplier=1.0, attention_multiplier=None, residual_multiplier=1.0, logits_scaling=1.0)


def _logprobs(model, **kw) -> torch.Tensor:
    _, ids_T, cu_B1 = packed_batch()
    with torch.no_grad():
        return packed_logprobs(model.eval(), ids_T, cu_B1, chunk_size=7, **kw)[0]


def test_a_checkpoint_transformers_saved_computes_its_logprobs_and_exports_it(tmp_path):
    ref = saved_by_transformers(GraniteConfig, tmp_path / "hf", **SHAPE)
    model, config = load_model(tmp_path / "hf")
    assert config.architecture == "GraniteForCausalLM" and config.norm_layout == "pre"
    assert {k: getattr(config, k) for k in MULTIPLIERS} == MULTIPLIERS
    assert config.tie_word_embeddings and not config.attention_bias and not config.mlp_bias
    seqs, _, _ = packed_batch()
    ours = _logprobs(model)
    expected = reference_logprobs(ref, seqs)
    assert expected.abs().max() > 1.0
    assert (ours - expected).abs().max().item() <= 1e-4
    assert_export_reads_back(model, config, seqs, expected, tmp_path / "out")
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert {k: exported[k] for k in MULTIPLIERS} == MULTIPLIERS


def test_biases_load_as_transformers_computes_them(tmp_path):
    """Llama's ``attention_bias`` (q/k/v/o) and ``mlp_bias``, untied, as Granite's class reads them."""
    kw = {**SHAPE, "tie_word_embeddings": False, "attention_bias": True, "mlp_bias": True}
    ref = saved_by_transformers(GraniteConfig, tmp_path, **kw)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.3)
    ref.save_pretrained(tmp_path)
    model, config = load_model(tmp_path)
    assert config.attention_bias and config.attention_out_bias and config.mlp_bias and not config.tie_word_embeddings
    assert "model.layers.0.self_attn.o_proj.bias" in model.state_dict()
    seqs, _, _ = packed_batch()
    assert (_logprobs(model) - reference_logprobs(ref, seqs)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("name", sorted(MULTIPLIERS))
def test_without_any_multiplier_the_logprobs_differ(tmp_path, name):
    """Each multiplier acts on this model: computed without it, the log-probs move (a missing one would show)."""
    saved_by_transformers(GraniteConfig, tmp_path, **SHAPE)
    model, config = load_model(tmp_path)
    without = Decoder(config.replace(**{name: DEFAULTS[name]}))
    without.load_state_dict(model.state_dict())
    assert (_logprobs(without) - _logprobs(model)).abs().max() > 0.05


def test_gradients_match_transformers(tmp_path):
    ref = saved_by_transformers(GraniteConfig, tmp_path / "hf", **SHAPE)
    model, _ = load_model(tmp_path / "hf")
    assert_gradients_match(
        model,
        ref,
        [
            "model.embed_tokens.weight",
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.self_attn.k_proj.weight",
            "model.layers.1.self_attn.v_proj.weight",
            "model.layers.1.self_attn.o_proj.weight",
            "model.layers.0.mlp.down_proj.weight",
            "model.layers.0.input_layernorm.weight",
            "model.layers.1.post_attention_layernorm.weight",
            "model.norm.weight",
        ],
    )


# ---------------------------------------------------------------------------------------- the scaled head


def _mapped_reference(h_TD, w_VD, targets_T, tau, divisor, cap):
    z_TV = h_TD @ w_VD.t() / divisor
    if cap is not None:
        z_TV = cap * torch.tanh(z_TV / cap)
    logp_TV = torch.log_softmax(z_TV / tau, -1)
    return logp_TV.gather(-1, targets_T[:, None])[:, 0], -(logp_TV.exp() * logp_TV).sum(-1)


@pytest.mark.parametrize("cap", [None, 3.0])
@pytest.mark.parametrize("tau", [1.0, 0.7])
@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("mode", ["kept", "recomputed", "compiled"])
def test_the_chunked_head_divides_its_logits_and_takes_the_maps_derivative(monkeypatch, mode, with_entropy, tau, cap):
    """``logprobs_from_hidden`` with a ``LogitMap``: the log-probs, entropies and gradients (hidden and weight) of
    autograd through ``z / divisor`` (and a cap after it: the map's two steps together), whether backward reads
    what forward kept, recomputes it, or runs the compiled kernels."""
    from areno.models import logprobs as logprobs_module

    if mode == "recomputed":
        monkeypatch.setattr(logprobs_module, "keep_logits_budget", lambda device: 0)
        monkeypatch.setattr(logprobs_module, "KEEP_LOGSOFTMAX_MAX_BYTES", 0)
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(19, 16, generator=g) * 2).requires_grad_()
    w = torch.randn(40, 16, generator=g).requires_grad_()
    targets = torch.randint(0, 40, (19,), generator=g)
    coef, coef_ent = torch.randn(19, generator=g), torch.randn(19, generator=g)

    def loss(lp, ent):
        return (coef * lp).sum() + ((coef_ent * ent).sum() if with_entropy else 0.0)

    with compiled_logprob_kernels(mode == "compiled"):
        lp, ent = logprobs_from_hidden(h, w, targets, tau, 6, with_entropy=with_entropy, logit_map=LogitMap(4.0, cap))
        loss(lp, ent).backward()
    got = (lp.detach(), h.grad.clone(), w.grad.clone())
    h.grad = w.grad = None
    ref_lp, ref_ent = _mapped_reference(h, w, targets, tau, 4.0, cap)
    loss(ref_lp, ref_ent).backward()
    torch.testing.assert_close(got[0], ref_lp.detach(), rtol=1e-5, atol=1e-5)
    if with_entropy:
        torch.testing.assert_close(ent.detach(), ref_ent.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], h.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[2], w.grad, rtol=1e-4, atol=1e-5)
    assert (ref_lp - _mapped_reference(h, w, targets, tau, 1.0, cap)[0]).abs().max() > 0.1  # the divisor acts


def test_the_logit_map_is_the_models():
    """``LogitMap.of``: Granite's divisor, Gemma 2's cap, None for a model whose logits are the product;
    ``Decoder.logits`` applies it."""
    assert LogitMap.of(tiny_config(61, arch="granite")) == LogitMap(8.0, None)
    assert LogitMap.of(tiny_config(61, arch="gemma2")) == LogitMap(1.0, 5.0)
    assert LogitMap.of(tiny_config(61, arch="llama")) is None
    model = Decoder(tiny_config(61, arch="granite"))
    h = torch.randn(3, 64)
    torch.testing.assert_close(model.logits(h), h @ model.output_weight.t() / 8.0)


# ------------------------------------------------------------------------------------------ rollout engine


@pytest.mark.parametrize("decode_attention", ["gather", "paged"])
def test_the_rollout_engine_decodes_what_the_model_computes(tmp_path, decode_attention):
    saved_by_transformers(GraniteConfig, tmp_path, **SHAPE)
    assert_engine_decodes_as_recompute(*load_model(tmp_path), decode_steps=3, decode_attention=decode_attention)


def test_the_engines_sampled_logprobs_are_the_trainers(tmp_path):
    """Sampled tokens' log-probs (temperature 1: the divided logits' softmax) equal ``packed_logprobs`` over the
    prompt and completion: the engine divides the logits the trainer divides."""
    saved_by_transformers(GraniteConfig, tmp_path, **SHAPE)
    assert_sampled_logprobs_are_the_trainers(*load_model(tmp_path))


# ---------------------------------------------------------------------------------------- config, training


def test_a_config_without_its_keys_takes_the_classs():
    """A bare config.json computes GraniteConfig's model: every multiplier 1, the attention's scale 1 (not
    head_dim^-1/2), untied; the tiny config and one without multipliers read back as written."""
    bare = ModelConfig.from_hf({"architectures": ["GraniteForCausalLM"], "model_type": "granite", **_SIZES})
    theirs = GraniteConfig(**_SIZES)
    for key in MULTIPLIERS:
        assert getattr(bare, key) == getattr(theirs, key) == 1.0, key
    assert bare.attention_scale == 1.0 and bare.sliding_window is None
    assert bare.tie_word_embeddings == theirs.tie_word_embeddings is False
    assert bare.rope_theta == theirs.rope_parameters["rope_theta"]
    assert (bare.bos_token_id, bare.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)
    tiny = tiny_config(61, arch="granite")
    assert ModelConfig.from_hf(json.loads(json.dumps(tiny.to_hf()))) == tiny
    plain = tiny.replace(**DEFAULTS)  # the default attention scale written as head_dim^-1/2: read back the same
    back = ModelConfig.from_hf(json.loads(json.dumps(plain.to_hf())))
    assert back.attention_scale == plain.attention_scale and back.replace(attention_multiplier=None) == plain


_SIZES = dict(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)


@pytest.mark.parametrize("name", sorted(MULTIPLIERS))
@pytest.mark.parametrize("value", [0.0, -2.0, float("inf")])
def test_a_non_positive_multiplier_is_refused_by_name(name, value):
    d = {**tiny_config(61, arch="granite").to_hf(), name: value}
    with pytest.raises(ValueError, match=f"ModelConfig.{name} must be a positive float, got {value}"):
        ModelConfig.from_hf(d)


@pytest.mark.parametrize("name", sorted(MULTIPLIERS))
def test_the_multipliers_are_granites(name):
    """Only Granite sets them: another family's config with one is refused, naming the key."""
    with pytest.raises(ValueError, match=f"{name}=0.5 is only expressible for GraniteForCausalLM"):
        tiny_config(61, arch="llama", **{name: 0.5})


def test_what_areno_does_not_compute_is_refused_by_name():
    d = {**tiny_config(61, arch="granite").to_hf(), "hidden_act": "gelu"}
    with pytest.raises(ValueError, match="hidden_act='gelu' is not supported"):
        ModelConfig.from_hf(d)


def test_grpo_on_a_tiny_granite_learns_the_reward(tmp_path):
    """At the other families' learning rate times ``logits_scaling`` (8): Adam's steps move the divided logits as
    far as an undivided model's."""
    exported = grpo_learns_and_exports(tmp_path, "granite", lr=0.16)
    assert exported["logits_scaling"] == 8.0 and exported["residual_multiplier"] == 0.22
    assert exported["embedding_multiplier"] == 12.0 and exported["attention_multiplier"] == 1.0 / 16
