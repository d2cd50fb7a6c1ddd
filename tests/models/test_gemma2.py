"""Gemma 2 (``Gemma2ForCausalLM``: gemma-2-2b, 9b, 27b and their -it): Gemma 3's sandwich norms, GeGLU, scaled
embeddings and ``query_pre_attn_scalar`` without q/k norms, a window in every other layer and one RoPE for all,
and its soft-caps: ``cap * tanh(x / cap)`` on every attention score (``attn_logit_softcapping``) and every final
logit (``final_logit_softcapping``). A checkpoint transformers saved computes transformers' log-probs and
gradients, and others without either cap; the export loads back in transformers; the training attention's paths
and the chunked head's backward take the caps; the rollout engine decodes it and reports the trainer's
log-probs; GRPO on a tiny one learns; what areno does not compute is refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Gemma2Config

from areno.models import Decoder, ModelConfig, PackedCausalAttention, load_model, tiny_config
from areno.models.attention import explicit_attention
from areno.models.eager_ops import LogitMap
from areno.models.logprobs import compiled_logprob_kernels, logprobs_from_hidden, packed_logprobs
from areno.models.prefix_sharing import SharedPrefixAttention, pays_by_default, plan
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

ATTN_CAP, FINAL_CAP = 5.0, 3.0
"""Small enough to bend this tiny model's scores and logits (the released models: 50 and 30)."""
SHAPE = dict(
    head_dim=12,
    query_pre_attn_scalar=16,  # not head_dim: the scale's ratio shows
    attn_logit_softcapping=ATTN_CAP,
    final_logit_softcapping=FINAL_CAP,
    sliding_window=6,  # shorter than two of the three sequences, in layer 0
    spread_norms=True,
)


def _logprobs(model, **kw) -> torch.Tensor:
    _, ids_T, cu_B1 = packed_batch()
    with torch.no_grad():
        return packed_logprobs(model.eval(), ids_T, cu_B1, chunk_size=7, **kw)[0]


def test_a_checkpoint_transformers_saved_computes_its_logprobs_and_exports_it(tmp_path):
    ref = saved_by_transformers(Gemma2Config, tmp_path / "hf", **SHAPE)
    model, config = load_model(tmp_path / "hf")
    assert config.architecture == "Gemma2ForCausalLM" and config.norm_layout == "sandwich" and not config.qk_norm
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (ATTN_CAP, FINAL_CAP)
    assert (config.sliding_window, config.window_layers, config.window_rope) == (6, (0,), None)
    assert "model.layers.0.pre_feedforward_layernorm.weight" in model.state_dict()
    seqs, _, _ = packed_batch()
    ours = _logprobs(model)
    expected = reference_logprobs(ref, seqs)
    assert expected.abs().max() > 1.0
    assert (ours - expected).abs().max().item() <= 1e-4
    assert_export_reads_back(model, config, seqs, expected, tmp_path / "out")
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (exported["attn_logit_softcapping"], exported["final_logit_softcapping"]) == (ATTN_CAP, FINAL_CAP)


@pytest.mark.parametrize("cap", ["attn_logit_softcapping", "final_logit_softcapping"])
def test_without_either_cap_the_logprobs_differ(tmp_path, cap):
    """Each cap acts on this model: computed without it, the log-probs move (a missing cap would show)."""
    saved_by_transformers(Gemma2Config, tmp_path, **SHAPE)
    model, config = load_model(tmp_path)
    uncapped = Decoder(config.replace(**{cap: None}))
    uncapped.load_state_dict(model.state_dict())
    assert (_logprobs(uncapped) - _logprobs(model)).abs().max() > 0.05


def test_gradients_match_transformers(tmp_path):
    ref = saved_by_transformers(Gemma2Config, tmp_path / "hf", **SHAPE)
    model, _ = load_model(tmp_path / "hf")
    assert_gradients_match(
        model,
        ref,
        [
            "model.embed_tokens.weight",
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.self_attn.k_proj.weight",
            "model.layers.1.self_attn.v_proj.weight",
            "model.layers.0.pre_feedforward_layernorm.weight",
            "model.layers.1.post_attention_layernorm.weight",
            "model.norm.weight",
        ],
    )


# ---------------------------------------------------------------------------------------- the capped head


def _capped_reference(h_TD, w_VD, targets_T, tau, cap):
    z_TV = h_TD @ w_VD.t()
    logp_TV = torch.log_softmax(cap * torch.tanh(z_TV / cap) / tau, -1)
    return logp_TV.gather(-1, targets_T[:, None])[:, 0], -(logp_TV.exp() * logp_TV).sum(-1)


@pytest.mark.parametrize("tau", [1.0, 0.7])
@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("mode", ["kept", "recomputed", "compiled"])
def test_the_chunked_head_caps_its_logits_and_takes_the_tanh_derivative(monkeypatch, mode, with_entropy, tau):
    """``logprobs_from_hidden`` with a capping ``LogitMap``: the log-probs, entropies and gradients (hidden and weight) of
    autograd through ``cap * tanh(z / cap)``, whether backward reads the capped logits forward kept, recomputes
    them, or runs the compiled kernels."""
    from areno.models import logprobs as logprobs_module

    if mode == "recomputed":
        monkeypatch.setattr(logprobs_module, "keep_logits_budget", lambda device: 0)
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(19, 16, generator=g) * 2).requires_grad_()
    w = torch.randn(40, 16, generator=g).requires_grad_()
    targets = torch.randint(0, 40, (19,), generator=g)
    coef, coef_ent = torch.randn(19, generator=g), torch.randn(19, generator=g)

    def loss(lp, ent):
        return (coef * lp).sum() + ((coef_ent * ent).sum() if with_entropy else 0.0)

    with compiled_logprob_kernels(mode == "compiled"):
        lp, ent = logprobs_from_hidden(h, w, targets, tau, 6, with_entropy=with_entropy, logit_map=LogitMap(1.0, 3.0))
        loss(lp, ent).backward()
    got = (lp.detach(), h.grad.clone(), w.grad.clone())
    h.grad = w.grad = None
    ref_lp, ref_ent = _capped_reference(h, w, targets, tau, 3.0)
    loss(ref_lp, ref_ent).backward()
    torch.testing.assert_close(got[0], ref_lp.detach(), rtol=1e-5, atol=1e-5)
    if with_entropy:
        torch.testing.assert_close(ent.detach(), ref_ent.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], h.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[2], w.grad, rtol=1e-4, atol=1e-5)
    assert (ref_lp - _capped_reference(h, w, targets, tau, 1e6)[0]).abs().max() > 0.1  # the cap acts


# ----------------------------------------------------------------------------------- training attention


def _qkv(T: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return tuple((3 * torch.randn(T, h, 8, generator=g)).requires_grad_() for h in (4, 2, 2))


def _capped_sdpa(q, k, v, cu, window, cap):
    """Per sequence: transformers' eager attention with the cap (explicit scores in float64)."""
    outs = []
    for s, e in zip(cu[:-1], cu[1:]):
        qq, kk, vv = (x[s:e].double().transpose(0, 1) for x in (q, k, v))
        kk, vv = kk.repeat_interleave(2, 0), vv.repeat_interleave(2, 0)
        scores = cap * torch.tanh(qq @ kk.transpose(1, 2) / 8**0.5 / cap)
        i = torch.arange(e - s)
        keep = (i[None, :] <= i[:, None]) & ((i[:, None] - i[None, :] < window) if window else True)
        outs.append((torch.softmax(scores.masked_fill(~keep, -torch.inf), -1) @ vv).transpose(0, 1))
    return torch.cat(outs).float()


@pytest.mark.parametrize("window", [None, 4])
def test_packed_attention_caps_its_scores_and_refuses_the_impls_that_cannot(window):
    """On CPU ``auto`` attends through explicit scores with the cap; the impls without one are refused by name
    (at construction, or on CUDA ``train.attention=varlen``), and a call without the cap it was built for too."""
    cu = [0, 7, 8, 19]
    q, k, v = _qkv(19)
    attn = PackedCausalAttention(torch.tensor(cu), sliding_window=window, softcap=2.0)
    out = attn(0, q, k, v, softcap=2.0)
    torch.testing.assert_close(out, _capped_sdpa(q, k, v, cu, window, 2.0), rtol=1e-5, atol=1e-5)
    plain = PackedCausalAttention(torch.tensor(cu), sliding_window=window)(0, q, k, v)
    assert (out - plain).abs().max() > 0.05
    for impl in ("sdpa_mask", "sdpa_padded", "varlen"):
        with pytest.raises(ValueError, match=f"soft-capped scores .Gemma 2. runs as one of .* not impl='{impl}'"):
            PackedCausalAttention(torch.tensor(cu), impl=impl, softcap=2.0)
    with pytest.raises(ValueError, match="train.attention=varlen: .*soft-capped scores .* set train.attention=auto"):
        PackedCausalAttention(torch.tensor(cu), softcap=2.0).prepare(19, "cpu", 8, torch.bfloat16, cuda_impl="varlen")
    with pytest.raises(ValueError, match="built with softcap=2.0 called with softcap=None"):
        attn(0, q, k, v)


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_cpu_attention_caps_in_explicit_padded_batches_with_the_caps_gradient(monkeypatch, window, dtype, atol):
    """On CPU the cap runs in the padded batches' explicit attention (``CpuExplicitAttention``): values and
    gradients those of float64 capped scores, float32 exactly and bf16 within its rounding; batches beyond
    ``CPU_EXPLICIT_MAX_SCORES`` go back to the per-sequence explicit form, with the same values."""
    from areno.models import attention as attn_mod

    cu = [0, 7, 8, 19]
    q, k, v = (x.detach().to(dtype).requires_grad_() for x in _qkv(19, seed=1))
    g_out = torch.linspace(-1, 1, 19 * 4 * 8).view(19, 4, 8)
    ref_in = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = _capped_sdpa(*ref_in, cu, window, 2.0).double()
    ref.backward(g_out.double())

    def run():
        attn = PackedCausalAttention(torch.tensor(cu), sliding_window=window, softcap=2.0)
        out = attn(0, q, k, v, softcap=2.0)
        grads = torch.autograd.grad(out, (q, k, v), g_out.to(dtype))
        return attn._impl, out, *grads

    impl, *got = run()
    assert impl == "sdpa_padded"
    for a, b in zip(got, (ref, *(x.grad for x in ref_in))):
        scale = 1.0 if dtype == torch.float32 else b.abs().max().item()
        torch.testing.assert_close(a.double(), b, rtol=0 if scale != 1.0 else 1e-5, atol=atol * scale)
    monkeypatch.setattr(attn_mod, "CPU_EXPLICIT_MAX_SCORES", 0)
    impl, *fallback = run()
    assert impl == "sdpa"
    for a, b in zip(fallback, got):
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=atol * max(1.0, b.abs().max().item()))


def test_shared_prompts_compute_the_same_capped_attention_and_gradients():
    """``train.share_prompts``: a group's prompt computed once attends with the cap as the unshared forward,
    values and gradients (layer 0 windowed, layer 1 full, as Gemma 2's)."""
    config = tiny_config(40, arch="gemma2", hidden_size=32, layers=2, heads=4, kv_heads=2, sliding_window=4)
    torch.manual_seed(0)
    model = Decoder(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.4)
    prompt = torch.randint(3, 40, (6,)).tolist()
    seqs = [prompt + torch.randint(3, 40, (n,)).tolist() for n in (5, 3, 7)]
    ids_T = torch.tensor([t for s in seqs for t in s])
    cu = torch.tensor([0, 11, 20, 33])
    loss_mask = torch.tensor([i >= 6 for s in seqs for i in range(len(s))])
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    sharing = plan(ids_T, cu, loss_mask)
    assert sharing is not None
    windows = dict(sliding_window=4, window_layers=config.window_layers, softcap=config.attn_logit_softcapping)
    outs = []
    for shared in (False, True):
        model.zero_grad()
        if shared:
            shared_attn = SharedPrefixAttention(sharing, **windows)
            hidden = model(ids_T[sharing.source_C], pos[sharing.source_C], shared_attn)[sharing.expand_T]
            assert shared_attn.padded is not None  # the cap in explicit padded batches, not per sequence
        else:
            hidden = model(ids_T, pos, PackedCausalAttention(cu, **windows))
        (hidden * torch.linspace(-1, 1, hidden.numel()).view_as(hidden)).sum().backward()
        outs.append((hidden.detach(), model.model.layers[0].self_attn.q_proj.weight.grad.clone()))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=1e-4, atol=1e-5)


def test_auto_shares_prompts_on_cpu_only():
    """``train.share_prompts=auto`` shares Gemma 2's prompts on CPU (explicit padded batches with the cap) and
    not on a GPU, where the unshared forward's flex kernel has the cap; other families share on both."""
    gemma2, qwen2 = tiny_config(40, arch="gemma2"), tiny_config(40, arch="qwen2")
    assert pays_by_default(gemma2, "cpu") and not pays_by_default(gemma2, "cuda")
    assert pays_by_default(qwen2, "cpu") and pays_by_default(qwen2, "cuda")


def test_explicit_attention_without_terms_is_sdpa():
    """The explicit form with neither sinks nor a cap is the plain causal attention."""
    q, k, v = (x.detach() for x in _qkv(9, seed=3))
    torch.testing.assert_close(
        explicit_attention(q, k, v), _capped_sdpa(q, k, v, [0, 9], None, 1e9), rtol=1e-5, atol=1e-5
    )


# ------------------------------------------------------------------------------------------ rollout engine


@pytest.mark.parametrize("decode_attention", ["gather", "paged"])
def test_the_rollout_engine_decodes_what_the_model_computes(tmp_path, decode_attention):
    saved_by_transformers(Gemma2Config, tmp_path, **SHAPE)
    assert_engine_decodes_as_recompute(*load_model(tmp_path), decode_steps=3, decode_attention=decode_attention)


def test_the_engines_sampled_logprobs_are_the_trainers(tmp_path):
    """Sampled tokens' log-probs (temperature 1: the capped logits' softmax) equal ``packed_logprobs`` over the
    prompt and completion: the engine caps the logits the trainer caps."""
    saved_by_transformers(Gemma2Config, tmp_path, **SHAPE)
    assert_sampled_logprobs_are_the_trainers(*load_model(tmp_path))


# ---------------------------------------------------------------------------------------- config, training


def test_a_config_without_its_keys_takes_the_classs():
    """A bare config.json computes Gemma2Config's model: its caps (50, 30), a window in every other layer from
    the first, one RoPE base; a legacy file without layer_types slides the same layers."""
    bare = ModelConfig.from_hf({"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2"})
    theirs = Gemma2Config()
    assert bare.attn_logit_softcapping == theirs.attn_logit_softcapping == 50.0
    assert bare.final_logit_softcapping == theirs.final_logit_softcapping == 30.0
    windowed = tuple(i for i, t in enumerate(theirs.layer_types) if t == "sliding_attention")
    assert bare.window_layers == windowed and bare.sliding_window == theirs.sliding_window
    assert bare.rope_theta == theirs.rope_parameters["rope_theta"] and bare.window_rope is None
    assert (bare.query_pre_attn_scalar, bare.head_dim, bare.vocab_size) == (256.0, 256, theirs.vocab_size)
    assert bare.tie_word_embeddings and bare.scale_embeddings and bare.norm_weight_offset == 1.0
    tiny = tiny_config(61, arch="gemma2")
    assert ModelConfig.from_hf(json.loads(json.dumps(tiny.to_hf()))) == tiny
    uncapped = tiny.replace(attn_logit_softcapping=None, final_logit_softcapping=None)
    assert ModelConfig.from_hf(json.loads(json.dumps(uncapped.to_hf()))) == uncapped  # null caps stay null


@pytest.mark.parametrize(
    "change, message",
    [
        ({"hidden_activation": "gelu"}, "hidden_activation='gelu' is not supported for Gemma 2"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention=true .* areno is causal"),
        ({"attn_logit_softcapping": 0.0}, "attn_logit_softcapping must be a positive float or None, got 0.0"),
        ({"final_logit_softcapping": -1.0}, "final_logit_softcapping must be a positive float or None, got -1.0"),
    ],
)
def test_what_areno_does_not_compute_is_refused_by_name(change, message):
    d = {**tiny_config(61, arch="gemma2").to_hf(), **change}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(d)


def test_the_caps_are_gemma_2s():
    """Only Gemma 2 sets the caps (Gemma 3's config.json keeps refusing them)."""
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0 is only expressible for Gemma2ForCausalLM"):
        tiny_config(61, arch="qwen3", final_logit_softcapping=30.0)
    with pytest.raises(ValueError, match="attn_logit_softcapping=50.0 is not supported .* set it to null"):
        ModelConfig.from_hf({**tiny_config(61, arch="gemma3").to_hf(), "attn_logit_softcapping": 50.0})


def test_grpo_on_a_tiny_gemma2_learns_the_reward(tmp_path):
    exported = grpo_learns_and_exports(tmp_path, "gemma2")
    assert (exported["attn_logit_softcapping"], exported["final_logit_softcapping"]) == (5.0, 5.0)
    assert exported["layer_types"] == ["sliding_attention", "full_attention"]
