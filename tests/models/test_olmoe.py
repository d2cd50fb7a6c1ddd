"""OLMoE (``OlmoeForCausalLM``: OLMoE-1B-7B-0924 and -0125, base and instruct): Llama's pre-norm layers with
OLMo 2's q/k norms over the whole projections, q, k and v clamped after them where ``clip_qkv`` is set, and an
expert block in every layer (softmax top-k, renormalised only with ``norm_topk_prob``; no shared expert). A
checkpoint transformers saved computes transformers' log-probs and gradients, and another with per-head q/k norms
or without its clamp; the export writes transformers' per-expert names and loads back; the load-balancing loss is
transformers' (which adds no router z-loss); the rollout engine decodes it and reports the trainer's log-probs;
GRPO on a tiny one learns; what areno does not compute, and what vLLM and SGLang compute otherwise, is refused by
name."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers
from safetensors import safe_open
from transformers import AutoModelForCausalLM, OlmoeConfig

from areno.models import Decoder, ModelConfig, check_tp_size, load_model, moe, tiny_config
from areno.models.decoder import eager_rms_norm_fp32_scale
from areno.models.logprobs import packed_logprobs
from tests.helpers.families import (
    VOCAB,
    assert_engine_decodes_as_recompute,
    assert_export_reads_back,
    assert_gradients_match,
    assert_sampled_logprobs_are_the_trainers,
    grpo_learns_and_exports,
    packed_batch,
    reference_logprobs,
    saved_by_transformers,
)

TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])
CLIP = 0.5
"""Small enough to clamp many of this tiny model's q, k and v entries (the released models set none)."""
SHAPE = dict(intermediate_size=16, num_experts=6, num_experts_per_tok=2, spread_norms=True)
"""Six experts of width 16, two a token (the released models: 64 of width 1024, eight a token); norm weights
spread, so that a norm over the wrong span or in the wrong place shows."""


def _saved(path, **kw):
    return saved_by_transformers(OlmoeConfig, path, **{**SHAPE, **kw})


def _logprobs(model) -> torch.Tensor:
    _, ids_T, cu_B1 = packed_batch()
    with torch.no_grad():
        return packed_logprobs(model.eval(), ids_T, cu_B1, chunk_size=7)[0]


@pytest.mark.parametrize(
    "kw",
    [{}, {"clip_qkv": CLIP}, {"attention_bias": True, "tie_word_embeddings": True, "norm_topk_prob": True}],
    ids=["released", "clipped", "bias_tied_renormed"],
)
def test_a_checkpoint_transformers_saved_computes_its_logprobs_and_exports_it(kw, tmp_path):
    ref = _saved(tmp_path / "hf", spread_biases=True, **kw)
    model, config = load_model(tmp_path / "hf")
    assert config.architecture == "OlmoeForCausalLM"
    assert (config.qk_norm, config.qk_norm_scope, config.norm_layout) == (True, "projection", "pre")
    assert not config.norms_scale_in_float32  # Llama's order: normed in float32, rounded, then scaled
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (6, 2, 16)
    assert all(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    assert config.clip_qkv == kw.get("clip_qkv")
    assert config.attention_bias == config.attention_out_bias == config.norm_topk_prob == ("attention_bias" in kw)
    attn = model.model.layers[0].self_attn
    assert attn.q_norm.weight.shape == (48,) and attn.k_norm.weight.shape == (2 * 12,)  # Hq*Dh, Hkv*Dh
    seqs, _, _ = packed_batch()
    expected = reference_logprobs(ref, seqs)
    assert expected.abs().max() > 1.0
    assert (_logprobs(model) - expected).abs().max().item() <= 1e-4
    assert config.num_params() == sum(p.numel() for p in model.parameters())
    if TRANSFORMERS_MAJOR >= 5:  # in memory, transformers 5's names and values (4.x keeps a module per expert)
        ref_sd = {
            k: v for k, v in ref.state_dict().items() if not (config.tie_word_embeddings and k == "lm_head.weight")
        }
        ours_sd = model.state_dict()
        assert sorted(ours_sd) == sorted(ref_sd)
        assert all(torch.equal(ours_sd[k], ref_sd[k]) for k in ours_sd)
    assert_export_reads_back(model, config, seqs, expected, tmp_path / "out")
    # on disk, the names transformers saved: one tensor per expert, the router under mlp.gate
    names = {}
    for d in ("hf", "out"):
        with safe_open(str(tmp_path / d / "model.safetensors"), "pt") as f:
            names[d] = {k: f.get_tensor(k) for k in f.keys()}
    assert sorted(names["out"]) == sorted(names["hf"])
    assert all(torch.equal(names["out"][k], names["hf"][k]) for k in names["hf"])
    assert "model.layers.1.mlp.experts.5.up_proj.weight" in names["out"]
    assert "model.layers.0.mlp.gate.weight" in names["out"]


def test_a_clip_that_bites_changes_the_logprobs(tmp_path):
    """The clamp acts on this model (the test above then shows it computed as transformers does): without it the
    log-probs move, and transformers' own model with the clamp differs from it without."""
    ref = _saved(tmp_path, clip_qkv=CLIP)
    model, config = load_model(tmp_path)
    unclipped = Decoder(config.replace(clip_qkv=None))
    unclipped.load_state_dict(model.state_dict())
    assert (_logprobs(unclipped) - _logprobs(model)).abs().max() > 0.05
    ref.config.clip_qkv = None
    seqs, _, _ = packed_batch()
    assert (_logprobs(unclipped) - reference_logprobs(ref, seqs)).abs().max().item() <= 1e-4


def test_per_head_qk_norms_would_compute_another_model(tmp_path):
    """The negative control of the projection norms: with q/k norm weights of 1 (so that only the span differs),
    norms over each head instead of the whole projection move the log-probs away from transformers'."""
    ref = _saved(tmp_path / "hf")
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.fill_(1.0)
    ref.save_pretrained(tmp_path / "ones")
    model, config = load_model(tmp_path / "ones")
    seqs, _, _ = packed_batch()
    expected = reference_logprobs(ref, seqs)
    assert (_logprobs(model) - expected).abs().max().item() <= 1e-4
    per_head_config = copy.copy(config)  # past ModelConfig's check, which keeps the projection span OLMoE's
    object.__setattr__(per_head_config, "qk_norm_scope", "head")
    per_head = Decoder(per_head_config)
    state = {k: v for k, v in model.state_dict().items() if not k.endswith(("q_norm.weight", "k_norm.weight"))}
    assert per_head.load_state_dict(state, strict=False).missing_keys  # its per-head norms: weights of 1
    assert per_head.model.layers[0].self_attn.q_norm.weight.shape == (12,)
    assert (_logprobs(per_head) - expected).abs().max() > 0.05


def test_its_norms_scale_in_the_model_dtype_as_transformers(tmp_path):
    """In bf16 the q/k norms over the whole projections, the block norms and the final one round, then scale, as
    transformers' OLMoE norm does, bit for bit: Llama's order, not OLMo 2's (scaled in float32) beside which its
    q/k norms span the same."""
    ref = _saved(tmp_path / "hf").to(torch.bfloat16)
    model, _ = load_model(tmp_path / "hf", dtype=torch.bfloat16)
    torch.manual_seed(0)
    q_TN, k_TN, x_TD = ((torch.randn(9, n) * 3).to(torch.bfloat16) for n in (48, 24, 48))
    ours, theirs = model.model.layers[1], ref.model.layers[1]
    assert torch.equal(ours.self_attn.q_norm(q_TN), theirs.self_attn.q_norm(q_TN))
    assert torch.equal(ours.self_attn.k_norm(k_TN), theirs.self_attn.k_norm(k_TN))
    for name in ("input_layernorm", "post_attention_layernorm"):
        assert torch.equal(getattr(ours, name)(x_TD), getattr(theirs, name)(x_TD)), name
    assert torch.equal(model.model.norm(x_TD), ref.model.norm(x_TD))
    olmo2_order = eager_rms_norm_fp32_scale(q_TN, theirs.self_attn.q_norm.weight, 1e-5)
    assert not torch.equal(olmo2_order, theirs.self_attn.q_norm(q_TN))


def test_gradients_match_transformers(tmp_path):
    ref = _saved(tmp_path / "hf", clip_qkv=2.0)  # a clamp that bites some entries: its gradient is zero there
    model, _ = load_model(tmp_path / "hf")
    experts = ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"]
    assert_gradients_match(
        model,
        ref,
        [
            "model.embed_tokens.weight",
            "model.layers.0.self_attn.q_norm.weight",
            "model.layers.1.self_attn.k_norm.weight",
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.1.self_attn.v_proj.weight",
            "model.layers.0.input_layernorm.weight",
            "model.layers.1.post_attention_layernorm.weight",
            "model.layers.0.mlp.gate.weight",
            *(experts if TRANSFORMERS_MAJOR >= 5 else []),  # 4.x: a module per expert, other names
            "model.norm.weight",
            "lm_head.weight",
        ],
    )


def test_the_load_balancing_loss_is_transformers_and_it_adds_no_router_z_loss(tmp_path):
    """``take_aux_loss`` after a training forward equals transformers' ``router_aux_loss_coef`` x ``aux_loss`` over
    every layer's router logits; transformers' training loss is the cross-entropy plus that alone (no router
    z-loss, which OLMoE's own trainer had: areno computes none either)."""
    ref = _saved(tmp_path, router_aux_loss_coef=0.05)
    loaded, config = load_model(tmp_path)
    assert config.router_aux_loss_coef == 0.05 and not config.output_router_logits
    model = Decoder(config.replace(output_router_logits=True))
    model.load_state_dict(loaded.state_dict())
    ids_T = torch.randint(0, VOCAB, (13,), generator=torch.Generator().manual_seed(3))
    model.train()
    model(ids_T, torch.arange(13))
    ours = moe.take_aux_loss(model)
    assert ours.requires_grad
    with torch.no_grad():
        out = ref(ids_T[None], labels=ids_T[None], output_router_logits=True)
        plain = ref(ids_T[None], labels=ids_T[None], output_router_logits=False)
    assert len(out.router_logits) == config.num_hidden_layers  # every layer routes
    torch.testing.assert_close(ours.detach(), 0.05 * out.aux_loss, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(out.loss, plain.loss + 0.05 * out.aux_loss, rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------------------------------ rollout engine


@pytest.mark.parametrize("decode_attention", ["gather", "paged"])
def test_the_rollout_engine_decodes_what_the_model_computes(tmp_path, decode_attention):
    _saved(tmp_path, clip_qkv=CLIP)
    assert_engine_decodes_as_recompute(*load_model(tmp_path), decode_steps=3, decode_attention=decode_attention)


def test_the_engines_fused_projections_compute_transformers_logprobs(tmp_path):
    """The engine runs q/k/v as one product: the clamp of its v columns and the norms of its q and k columns
    compute transformers' log-probs still."""
    from areno.rollout.engine import RolloutEngine, RolloutEngineConfig

    ref = _saved(tmp_path, clip_qkv=CLIP)
    model, config = load_model(tmp_path)
    RolloutEngine(model.eval(), config, config=RolloutEngineConfig(block_size=4, num_blocks=64))
    assert model.projections_fused
    seqs, _, _ = packed_batch()
    assert (_logprobs(model) - reference_logprobs(ref, seqs)).abs().max().item() <= 1e-4


def test_the_engines_sampled_logprobs_are_the_trainers(tmp_path):
    """Sampled tokens' log-probs equal ``packed_logprobs`` over prompt and completion: the engine clamps q, k and v
    (its fused q/k/v product included) and routes as the trainer does."""
    _saved(tmp_path, clip_qkv=CLIP)
    assert_sampled_logprobs_are_the_trainers(*load_model(tmp_path))


def test_the_engines_recorded_routes_replay_in_training(tmp_path):
    """The engine records each token's top-k experts in every layer (``record_routes``), equal to the trainer model's
    own; replayed in a training forward (``replay_routes``) they give its own hidden states, other routes move them,
    and the router keeps its gradient."""
    from areno.rollout.engine import RolloutEngine, RolloutEngineConfig
    from areno.types import SamplingParams

    _saved(tmp_path, clip_qkv=CLIP)
    model, config = load_model(tmp_path)
    engine_model, _ = load_model(tmp_path)
    engine = RolloutEngine(
        engine_model, config, config=RolloutEngineConfig(num_blocks=64, block_size=4, record_routes=True)
    )
    out = engine.generate([[5, 9, 17, 30, 41, 7]], SamplingParams(temperature=1.0, max_new_tokens=6, seed=1))[0]
    ids_T = torch.tensor(out.prompt_ids + out.output_ids)
    pos_T = torch.arange(len(ids_T))
    routes_TLK = out.routes_TLK[:-1].long()  # the last sampled token had no forward
    assert routes_TLK.shape == (len(ids_T) - 1, config.num_hidden_layers, config.num_experts_per_tok)
    with torch.no_grad(), moe.record_routing(model) as record:
        own_TD = model(ids_T[:-1], pos_T[:-1])
    assert torch.equal(record.stacked(), routes_TLK)
    model.train()
    with moe.replay_routes(model, routes_TLK):
        replayed_TD = model(ids_T[:-1], pos_T[:-1])
    torch.testing.assert_close(replayed_TD, own_TD, rtol=1e-5, atol=1e-5)
    with moe.replay_routes(model, (routes_TLK + 1) % config.num_experts):
        other_TD = model(ids_T[:-1], pos_T[:-1])
    assert (other_TD - own_TD).abs().max() > 1e-2
    other_TD.sum().backward()
    assert model.model.layers[1].mlp.gate.weight.grad.abs().sum() > 0


# ---------------------------------------------------------------------------------------- config, training

RELEASED = {
    "architectures": ["OlmoeForCausalLM"],
    "model_type": "olmoe",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "clip_qkv": None,
    "eos_token_id": 50279,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 1024,
    "max_position_embeddings": 4096,
    "norm_topk_prob": False,
    "num_attention_heads": 16,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 16,
    "num_key_value_heads": 16,
    "output_router_logits": False,
    "pad_token_id": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "router_aux_loss_coef": 0.01,
    "tie_word_embeddings": False,
    "vocab_size": 50304,
}
"""The config.json keys of OLMoE-1B-7B-0924 (its -0125 and instruct models share the shape)."""


def test_the_released_config_reads_as_transformers_builds_it():
    config = ModelConfig.from_hf(RELEASED)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (64, 8, 1024)
    assert config.head_dim == 128 and config.clip_qkv is None and not config.norm_topk_prob
    theirs = OlmoeConfig(**{k: v for k, v in RELEASED.items() if k != "architectures"})
    with torch.device("meta"):
        count = sum(p.numel() for p in AutoModelForCausalLM.from_config(theirs).parameters())
    assert config.num_params() == count and 6.9e9 < count < 7.0e9  # "OLMoE-1B-7B": 6.9B in all
    assert ModelConfig.from_hf(json.loads(json.dumps(config.to_hf()))) == config
    # keys left out take OlmoeConfig's defaults
    bare = ModelConfig.from_hf({"architectures": ["OlmoeForCausalLM"], "model_type": "olmoe"})
    default = OlmoeConfig()
    assert (bare.num_experts, bare.num_experts_per_tok) == (default.num_experts, default.num_experts_per_tok)
    assert bare.moe_intermediate_size == default.intermediate_size
    assert bare.router_aux_loss_coef == default.router_aux_loss_coef == 0.01
    assert (bare.rms_norm_eps, bare.max_position_embeddings) == (default.rms_norm_eps, default.max_position_embeddings)
    assert (bare.pad_token_id, bare.eos_token_id) == (default.pad_token_id, default.eos_token_id)
    theta = default.rope_parameters["rope_theta"] if TRANSFORMERS_MAJOR >= 5 else default.rope_theta
    assert bare.rope_theta == theta and bare.clip_qkv is None
    tiny = tiny_config(VOCAB, arch="olmoe", clip_qkv=3.0)
    assert ModelConfig.from_hf(json.loads(json.dumps(tiny.to_hf()))) == tiny


def test_what_areno_does_not_compute_is_refused_by_name():
    d = tiny_config(VOCAB, arch="olmoe").to_hf()
    # transformers 5 sizes q_norm by hidden_size, 4.x derives head_dim from it: no model of another head_dim
    with pytest.raises(ValueError, match="sizes its q norm by hidden_size=64: head_dim=8 x num_attention_heads=4"):
        ModelConfig.from_hf({**d, "head_dim": 8})
    # transformers passes a window to flash attention only; its mask and its eager and SDPA kernels read none
    with pytest.raises(ValueError, match="sliding_window=16 is not supported for OlmoeForCausalLM"):
        ModelConfig.from_hf({**d, "sliding_window": 16})
    with pytest.raises(ValueError, match="hidden_act='gelu' is not supported"):
        ModelConfig.from_hf({**d, "hidden_act": "gelu"})
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match=f"ModelConfig.clip_qkv must be a positive float or None, got {bad}"):
            ModelConfig.from_hf({**d, "clip_qkv": bad})
    with pytest.raises(ValueError, match="clip_qkv=2.0 is only expressible for OlmoeForCausalLM"):
        tiny_config(VOCAB, arch="olmo2", clip_qkv=2.0)
    with pytest.raises(ValueError, match="OlmoeForCausalLM has experts in every layer"):
        tiny_config(VOCAB, arch="olmoe", mlp_only_layers=(1,))
    with pytest.raises(ValueError, match="OlmoeForCausalLM has qk_norm_scope='projection' and norm_layout='pre'"):
        tiny_config(VOCAB, arch="olmoe", qk_norm_scope="head")
    with pytest.raises(ValueError, match="OlmoeForCausalLM biases q/k/v/o together"):
        tiny_config(VOCAB, arch="olmoe", attention_bias=True)
    with pytest.raises(ValueError, match="tp_size=2: tensor parallelism of mixture-of-experts models"):
        check_tp_size(tiny_config(VOCAB, arch="olmoe"), 2)


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_server_rollouts_refuse_what_their_olmoe_ignores_before_any_server_starts(tmp_path, monkeypatch, backend):
    """vLLM's and SGLang's OLMoE clamp nothing, build no attention bias, norm with eps 1e-5 and never
    renormalise: a checkpoint that sets any of them is refused there (the released ones set none)."""
    from areno.api.config import load_config
    from areno.engine.seams import SideSetup
    from areno.engine.servers import ServerRolloutSide, server_ignored_olmoe_keys

    monkeypatch.setattr("areno.engine.servers.check_server_install", lambda backend: None)
    started = []
    monkeypatch.setattr("areno.engine.servers.start_servers", lambda *a, **k: started.append(a))
    model = tmp_path / "model"
    model.mkdir()
    config = tiny_config(61, arch="olmoe", clip_qkv=4.0, norm_topk_prob=True)
    (model / "config.json").write_text(json.dumps(config.to_hf()))
    cfg = load_config(None, [f"model.path={model}", f"run_dir={tmp_path / 'run'}", f"rollout.backend={backend}"])
    with pytest.raises(
        ValueError,
        match=f"^rollout.backend={backend}: .* OLMoE checkpoint with clip_qkv=4.0, rms_norm_eps=1e-06, "
        "norm_topk_prob=True, which",
    ):
        ServerRolloutSide(cfg, tmp_path / "run").start(SideSetup(recipe=None, model_dir=model, tokenizer=None))
    assert not started
    assert server_ignored_olmoe_keys(RELEASED) == []
    assert server_ignored_olmoe_keys(tiny_config(61, arch="qwen3_moe").to_hf()) == []


def test_grpo_on_a_tiny_olmoe_learns_the_reward(tmp_path):
    """With the clamp and the load-balancing loss in the training loss, as a fine-tune of OLMoE would set them."""
    extra = ", clip_qkv: 4.0, output_router_logits: true, router_aux_loss_coef: 0.01"
    exported = grpo_learns_and_exports(tmp_path, "olmoe", extra)
    assert exported["clip_qkv"] == 4.0 and exported["num_experts"] == 4 and exported["intermediate_size"] == 64
    assert exported["output_router_logits"] is True and exported["norm_topk_prob"] is False
