"""IBM Granite 3 MoE (``GraniteMoeForCausalLM``: granite-3.0 / 3.1 1b-a400m and 3b-a800m, base and instruct):
Granite 3's layers and four multipliers with a sparse expert block in every layer, whose router takes a softmax
over its top-k logits (areno's softmax, top-k and renormalisation) and whose checkpoints store each layer's
experts fused (``block_sparse_moe.input_linear`` [E, 2I, D], gate rows first; ``output_linear`` [E, D, I];
``router.layer``). A checkpoint transformers saved, its multipliers far from 1, computes transformers' log-probs,
gradients and load-balancing loss, and other ones with its gate and up halves swapped; the export has transformers'
names and loads back in transformers without a missing or unexpected key; the rollout engine decodes it, reloads
it from disk and captures routes the trainer replays; a policy sync carries its disk names; GRPO on a tiny one
learns; the shared-expert and Mamba hybrid Granites, and vLLM / SGLang rollouts, are refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GraniteMoeConfig

from areno.models import Decoder, ModelConfig, load_model, moe, tiny_config
from areno.models.hf_io import read_config
from areno.models.logprobs import packed_logprobs
from areno.models.tp_plan import check_tp_size
from areno.sync.base import NamedTensorSource
from areno.sync.disk import CheckpointNamedSource
from tests.helpers.families import (
    assert_engine_decodes_as_recompute,
    assert_engine_reloads_from_disk,
    assert_export_reads_back,
    assert_sampled_logprobs_are_the_trainers,
    assert_server_rollouts_refused,
    grpo_learns_and_exports,
    packed_batch,
    reference_logprobs,
    saved_by_transformers,
)

MULTIPLIERS = dict(
    embedding_multiplier=12.0, attention_multiplier=0.015625, residual_multiplier=0.22, logits_scaling=6.0
)
"""All four far from 1 (granite-3.0's), so a missing or misplaced one shows."""
SHAPE = dict(
    **MULTIPLIERS,
    num_local_experts=5,
    num_experts_per_tok=2,
    intermediate_size=24,
    router_aux_loss_coef=0.01,
    initializer_range=0.4,
    spread_norms=True,
    tie_word_embeddings=True,
)
DEFAULTS = dict(embedding_multiplier=1.0, attention_multiplier=None, residual_multiplier=1.0, logits_scaling=1.0)
_THEIRS = {  # areno's in-memory name -> transformers 5's, then transformers 4's (its disk names)
    "mlp.gate.weight": ("block_sparse_moe.router.weight", "block_sparse_moe.router.layer.weight"),
    "mlp.experts.gate_up_proj": ("block_sparse_moe.experts.gate_up_proj", "block_sparse_moe.input_linear.weight"),
    "mlp.experts.down_proj": ("block_sparse_moe.experts.down_proj", "block_sparse_moe.output_linear.weight"),
}


def _saved(tmp_path) -> torch.nn.Module:
    return saved_by_transformers(GraniteMoeConfig, tmp_path, **SHAPE)


def _logprobs(model) -> torch.Tensor:
    _, ids_T, cu_B1 = packed_batch()
    with torch.no_grad():
        return packed_logprobs(model.eval(), ids_T, cu_B1, chunk_size=7)[0]


def _with(model: Decoder, config: ModelConfig, **changes) -> Decoder:
    """``model``'s weights in a decoder of ``config`` with ``changes``."""
    other = Decoder(config.replace(**changes))
    other.load_state_dict(model.state_dict())
    return other


def test_a_checkpoint_transformers_saved_computes_its_logprobs_and_exports_its_names(tmp_path):
    ref = _saved(tmp_path / "hf")
    model, config = load_model(tmp_path / "hf")
    assert config.architecture == "GraniteMoeForCausalLM" and config.model_type == "granitemoe"
    assert {k: getattr(config, k) for k in MULTIPLIERS} == MULTIPLIERS
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (5, 2, 24)
    assert config.norm_topk_prob and config.router_aux_loss_coef == 0.01
    assert all(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    seqs, _, _ = packed_batch()
    expected = reference_logprobs(ref, seqs)
    assert expected.abs().max() > 1.0
    assert (_logprobs(model) - expected).abs().max().item() <= 1e-4
    assert_export_reads_back(model, config, seqs, expected, tmp_path / "out")
    theirs, ours = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    assert "model.layers.1.block_sparse_moe.input_linear.weight" in ours
    for name, t in theirs.items():  # the same tensors under the same names and layouts
        assert torch.equal(ours[name], t), name
    _, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


def test_the_fused_gate_and_up_halves_and_the_renormalised_weights_act(tmp_path):
    """Negative controls: the same checkpoint with every expert's gate and up rows swapped (the other reading of
    ``input_linear``), or its top-k weights left unrenormalised (not the softmax over the top-k logits), or any
    multiplier left out, computes other log-probs."""
    _saved(tmp_path)
    model, config = load_model(tmp_path)
    ours = _logprobs(model)
    swapped = _with(model, config)
    with torch.no_grad():
        for layer in swapped.model.layers:
            gate, up = layer.mlp.experts.gate_up_proj.chunk(2, dim=1)
            layer.mlp.experts.gate_up_proj.copy_(torch.cat([up, gate], dim=1))
    assert (_logprobs(swapped) - ours).abs().max() > 0.05
    unnormed = _with(model, config)
    for block in moe.sparse_blocks(unnormed):  # the config refuses it: GraniteMoE's router always renormalises
        block.gate.norm_topk_prob = False
    assert (_logprobs(unnormed) - ours).abs().max() > 0.05
    for name, default in DEFAULTS.items():
        assert (_logprobs(_with(model, config, **{name: default})) - ours).abs().max() > 0.05, name


def test_gradients_match_transformers(tmp_path):
    ref = _saved(tmp_path)
    model, _ = load_model(tmp_path)
    seqs, ids_T, cu_B1 = packed_batch()
    ours, _ = packed_logprobs(model, ids_T, cu_B1, chunk_size=7)
    ours.sum().backward()
    reference_logprobs(ref, seqs, grad=True).sum().backward()
    ref_params = dict(ref.named_parameters())
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    for layer in range(2):
        names += [f"model.layers.{layer}.{n}" for n in ("self_attn.q_proj.weight", "self_attn.o_proj.weight")]
        names += [f"model.layers.{layer}.{n}" for n in ("input_layernorm.weight", "post_attention_layernorm.weight")]
        names += [f"model.layers.{layer}.{n}" for n in _THEIRS]
    for name, p in model.named_parameters():
        if name not in names:
            continue
        suffix = next((s for s in _THEIRS if name.endswith(s)), None)
        theirs = name
        if suffix is not None:
            prefix = name.removesuffix(suffix)
            theirs = next(prefix + t for t in _THEIRS[suffix] if prefix + t in ref_params)
        r = ref_params[theirs].grad
        assert r.abs().max() > 0, name
        torch.testing.assert_close(p.grad, r, rtol=1e-4, atol=1e-5 * max(1.0, r.abs().max().item()), msg=name)


def test_the_aux_loss_is_transformers(tmp_path):
    """``output_router_logits`` (read from config.json) adds ``router_aux_loss_coef`` x transformers'
    load-balancing loss of this router's logits, over both layers' tokens."""
    ref = _saved(tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "output_router_logits": True}))
    model, config = load_model(tmp_path)
    assert config.output_router_logits
    ids_T = torch.randint(0, 61, (13,), generator=torch.Generator().manual_seed(3))
    model.train()
    model(ids_T, torch.arange(13))
    ours = moe.take_aux_loss(model)
    with torch.no_grad():
        expected = 0.01 * ref(ids_T[None], output_router_logits=True).aux_loss
    assert expected > 0.01
    torch.testing.assert_close(ours.detach(), expected, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------------------------------ rollout engine


def test_the_rollout_engine_decodes_what_the_model_computes(tmp_path):
    _saved(tmp_path)
    assert_engine_decodes_as_recompute(*load_model(tmp_path), decode_steps=3)


def test_the_engines_sampled_logprobs_are_the_trainers(tmp_path):
    _saved(tmp_path)
    assert_sampled_logprobs_are_the_trainers(*load_model(tmp_path))


def test_the_rollout_engine_reloads_its_checkpoints_from_disk(tmp_path):
    """transformers' own file and areno's export both update the engine (its fused names renamed to the held)."""
    _saved(tmp_path / "hf")
    assert_engine_reloads_from_disk(tmp_path / "hf", tmp_path / "b")


def test_routes_the_engine_captures_replay_in_training(tmp_path):
    """The router's own routes replayed give its own forward; other experts, other log-probs, the router's
    softmax at them renormalised (gradients reach the router)."""
    _saved(tmp_path)
    model, _ = load_model(tmp_path)
    _, ids_T, cu_B1 = packed_batch()
    with torch.no_grad(), moe.record_routing(model) as record:
        own = packed_logprobs(model, ids_T, cu_B1)[0]
    routes_TLK = record.stacked()
    assert routes_TLK.shape == (ids_T.numel(), 2, 2)
    with torch.no_grad(), moe.replay_routes(model, routes_TLK):
        torch.testing.assert_close(packed_logprobs(model, ids_T, cu_B1)[0], own, rtol=0, atol=1e-6)
    block = model.model.layers[0].mlp
    x_TD = torch.randn(6, 48, generator=torch.Generator().manual_seed(2))
    forced_TK = (block.gate(x_TD)[2] + 1) % 5
    weights_TK, used_TK = block.gate.replayed(block.gate(x_TD)[0], forced_TK, forced_TK, torch.float32)
    logits_TE = x_TD @ block.gate.weight.t()
    theirs_TK = torch.softmax(logits_TE.gather(-1, forced_TK), -1)  # GraniteMoe's softmax over the chosen logits
    torch.testing.assert_close(weights_TK, theirs_TK)
    assert torch.equal(used_TK, forced_TK)
    with moe.replay_routes(model, (routes_TLK + 1) % 5):
        lp = packed_logprobs(model, ids_T, cu_B1)[0]
    assert (lp.detach() - own).abs().max() > 0.05
    lp.sum().backward()
    assert block.gate.weight.grad.abs().sum() > 0


def test_a_policy_sync_carries_the_checkpoints_names(tmp_path):
    """What a sync to a server or to disk sends (``CheckpointNamedSource``) is transformers' file, name for name."""
    _saved(tmp_path)
    model, config = load_model(tmp_path)
    sent = dict(CheckpointNamedSource(NamedTensorSource(lambda: model.state_dict().items()), config).iter_tensors())
    theirs = load_file(tmp_path / "model.safetensors")
    assert sorted(sent) == sorted(theirs)
    for name, t in theirs.items():
        assert torch.equal(sent[name], t), name


# ---------------------------------------------------------------------------------------- config, training

_SIZES = dict(vocab_size=61, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4)


def test_a_config_without_its_keys_takes_the_classs():
    """A bare config.json computes GraniteMoeConfig's model (8 experts, 2 a token, every multiplier 1, the
    attention's scale 1); the tiny config reads back as written; ``num_params`` counts transformers' model."""
    bare = ModelConfig.from_hf({"architectures": ["GraniteMoeForCausalLM"], "model_type": "granitemoe", **_SIZES})
    theirs = GraniteMoeConfig(**_SIZES)
    assert (bare.num_experts, bare.num_experts_per_tok) == (theirs.num_local_experts, theirs.num_experts_per_tok)
    assert bare.moe_intermediate_size == theirs.intermediate_size and bare.router_aux_loss_coef == 0.001
    for key in MULTIPLIERS:
        assert getattr(bare, key) == getattr(theirs, key) == 1.0, key
    assert bare.attention_scale == 1.0 and bare.sliding_window is None and not bare.output_router_logits
    assert bare.tie_word_embeddings == theirs.tie_word_embeddings is False
    assert bare.rope_theta == theirs.rope_parameters["rope_theta"]
    with torch.device("meta"):
        assert bare.num_params() == sum(p.numel() for p in AutoModelForCausalLM.from_config(theirs).parameters())
    tiny = tiny_config(61, arch="granitemoe")
    assert ModelConfig.from_hf(json.loads(json.dumps(tiny.to_hf()))) == tiny


@pytest.mark.parametrize(
    ("arch", "model_type", "what"),
    [
        ("GraniteMoeSharedForCausalLM", "granitemoeshared", "shared_mlp"),
        ("GraniteMoeHybridForCausalLM", "granitemoehybrid", "Mamba layers"),
    ],
)
def test_the_shared_expert_and_hybrid_granites_are_refused_in_one_line(tmp_path, arch, model_type, what):
    d = {**tiny_config(61, arch="granitemoe").to_hf(), "architectures": [arch], "model_type": model_type}
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=f"unsupported model architecture '{arch}' \\({model_type}: .*{what}") as e:
        read_config(tmp_path)
    assert "\n" not in str(e.value) and "GraniteMoeForCausalLM" in str(e.value)


def test_what_areno_does_not_compute_is_refused_in_one_line():
    d = tiny_config(61, arch="granitemoe").to_hf()
    with pytest.raises(ValueError, match="hidden_act='gelu' is not supported"):
        ModelConfig.from_hf({**d, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="norm_topk_prob=True"):
        tiny_config(61, arch="granitemoe", norm_topk_prob=False)
    with pytest.raises(ValueError, match="tensor parallelism of mixture-of-experts models"):
        check_tp_size(tiny_config(61, arch="granitemoe"), 2)


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_server_rollouts_refuse_it_before_any_server_starts(tmp_path, monkeypatch, backend):
    assert_server_rollouts_refused(
        tmp_path,
        monkeypatch,
        backend,
        "granitemoe",
        f"^rollout.backend={backend}: .* is a GraniteMoE checkpoint.*input_linear",
    )


def test_grpo_on_a_tiny_granitemoe_learns_the_reward(tmp_path):
    """Granite's learning rate (the other families' times ``logits_scaling``, 8), the aux loss on."""
    exported = grpo_learns_and_exports(
        tmp_path, "granitemoe", ", output_router_logits: true, router_aux_loss_coef: 0.01", lr=0.16
    )
    assert exported["num_local_experts"] == 4 and exported["intermediate_size"] == 64
    assert exported["logits_scaling"] == 8.0 and exported["output_router_logits"] is True
