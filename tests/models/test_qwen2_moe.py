"""Qwen2-MoE (``Qwen2MoeForCausalLM``: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases as
``qkv_bias`` says), sparse blocks where ``decoder_sparse_step`` and ``mlp_only_layers`` put them, softmax top-k
routing not renormalised (``norm_topk_prob`` false, as released), and in every sparse block a shared SwiGLU
expert scaled by ``sigmoid(shared_expert_gate(x))``. A checkpoint transformers saved loads and computes its
log-probs, gradients and load-balancing loss; the export reads back under transformers' names; the rollout engine
decodes as a recompute and records the trainer's routes; routing replay keeps the shared expert; expert
parallelism is ``test_moe_expert_parallel``'s; GRPO on a tiny one learns; what it cannot be is refused in one line."""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers import AutoModelForCausalLM, Qwen2MoeConfig

from areno.models import Decoder, ModelConfig, check_tp_size, load_model, moe, tiny_config
from areno.models.logprobs import packed_logprobs
from areno.rollout.engine import RolloutEngine, RolloutEngineConfig
from areno.types import SamplingParams
from tests.helpers.families import (
    VOCAB,
    assert_engine_decodes_as_recompute,
    assert_engine_reloads_from_disk,
    assert_export_reads_back,
    assert_gradients_match,
    grpo_learns_and_exports,
    packed_batch,
    reference_logprobs,
    saved_by_transformers,
    saved_names,
)
from tests.helpers.moe import bf16_blocks

TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])
# three layers: sparse, dense (mlp_only_layers), sparse; the shared expert wider than the routed ones
SHAPE = dict(
    num_hidden_layers=3,
    decoder_sparse_step=1,
    mlp_only_layers=[1],
    num_experts=6,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=40,
    norm_topk_prob=False,
    router_aux_loss_coef=0.01,
    spread_biases=True,
)


class _Open(nn.Module):
    """A shared-expert gate that lets the shared expert through whole (sigmoid(inf) = 1): no gate."""

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return x_TD.new_full((x_TD.shape[0], 1), float("inf"))


def test_a_checkpoint_transformers_saved_computes_its_logprobs_and_exports_its_names(tmp_path):
    ref = saved_by_transformers(Qwen2MoeConfig, tmp_path / "hf", **SHAPE)
    model, config = load_model(tmp_path / "hf")
    assert config.architecture == "Qwen2MoeForCausalLM" and config.attention_bias and not config.attention_out_bias
    assert [config.is_moe_layer(i) for i in range(3)] == [True, False, True]
    assert (config.shared_expert_intermediate_size, config.intermediate_size, config.norm_topk_prob) == (40, 80, False)
    assert model.model.layers[1].mlp.gate_proj.weight.shape == (80, 48)  # the dense layer: intermediate_size
    gates = [model.model.layers[i].mlp.shared_expert_gate for i in (0, 2)]
    seqs, ids_T, cu_B1 = packed_batch()
    with torch.no_grad():
        x_TD = F.rms_norm(model.model.embed_tokens(ids_T), (48,))  # a normed input, as the block's
        assert all(torch.sigmoid(g(x_TD)).std() > 0.1 for g in gates)  # the gates are far from constant
        ours, _ = packed_logprobs(model.eval(), ids_T, cu_B1, chunk_size=7)
        expected = reference_logprobs(ref, seqs)
        kept = [b.shared_expert_gate for b in moe.sparse_blocks(model)]
        for b in moe.sparse_blocks(model):  # negative control: the shared expert ungated
            b.shared_expert_gate = _Open()
        ungated, _ = packed_logprobs(model, ids_T, cu_B1, chunk_size=7)
        for b, g in zip(moe.sparse_blocks(model), kept):
            b.shared_expert_gate = g
    assert expected.abs().max() > 1.0
    assert (ours - expected).abs().max().item() <= 1e-4
    assert (ungated - expected).abs().max().item() > 1e-2
    assert config.num_params() == sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in ref.parameters())
    if TRANSFORMERS_MAJOR >= 5:  # transformers 5's names in memory too (4.x keeps a module per expert)
        ref_sd, ours_sd = ref.state_dict(), model.state_dict()
        assert sorted(ours_sd) == sorted(ref_sd) and all(torch.equal(ours_sd[k], ref_sd[k]) for k in ours_sd)
    assert_export_reads_back(model, config, seqs, expected, tmp_path / "out")
    assert saved_names(tmp_path / "out") == saved_names(tmp_path / "hf")
    assert "model.layers.2.mlp.experts.5.up_proj.weight" in saved_names(tmp_path / "out")
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (exported["shared_expert_intermediate_size"], exported["qkv_bias"], exported["mlp_only_layers"]) == (
        40,
        True,
        [1],
    )


def _expert_grads(ref: nn.Module, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' gradients of layer ``layer``'s experts as [E, 2I, D] and [E, D, I]: fused in 5.x, stacked
    from a module per expert in 4.x (an expert no token reached: zeros)."""
    experts = ref.model.layers[layer].mlp.experts
    if hasattr(experts, "gate_up_proj"):
        return experts.gate_up_proj.grad, experts.down_proj.grad

    def grad(p: torch.Tensor) -> torch.Tensor:
        return p.grad if p.grad is not None else torch.zeros_like(p)

    gate_up = [torch.cat([grad(e.gate_proj.weight), grad(e.up_proj.weight)]) for e in experts]
    return torch.stack(gate_up), torch.stack([grad(e.down_proj.weight) for e in experts])


def test_gradients_and_the_load_balancing_loss_match_transformers(tmp_path):
    ref = saved_by_transformers(Qwen2MoeConfig, tmp_path / "hf", **SHAPE)
    model, config = load_model(tmp_path / "hf")
    assert_gradients_match(
        model,
        ref,
        [
            "model.embed_tokens.weight",
            "model.layers.0.self_attn.k_proj.bias",
            "model.layers.0.mlp.gate.weight",
            "model.layers.0.mlp.shared_expert.gate_proj.weight",
            "model.layers.2.mlp.shared_expert.down_proj.weight",
            "model.layers.2.mlp.shared_expert_gate.weight",
            "model.layers.1.mlp.up_proj.weight",
        ],
    )
    for i in (0, 2):  # the routed experts, under either version's names
        ours = model.model.layers[i].mlp.experts
        for got, want in zip((ours.gate_up_proj.grad, ours.down_proj.grad), _expert_grads(ref, i)):
            assert want.abs().max() > 0
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())
    # the aux loss over the sparse layers' router logits only (the dense layer and the shared expert add none)
    aux = Decoder(config.replace(output_router_logits=True))
    aux.load_state_dict(model.state_dict())
    ids_T = torch.randint(0, VOCAB, (13,), generator=torch.Generator().manual_seed(3))
    aux.train()
    aux(ids_T, torch.arange(13))
    ours = moe.take_aux_loss(aux)
    with torch.no_grad():
        out = ref(ids_T[None], output_router_logits=True)
    assert len(out.router_logits) == 2
    torch.testing.assert_close(ours.detach(), 0.01 * out.aux_loss, rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(TRANSFORMERS_MAJOR < 5, reason="transformers 4 has no experts_implementation to choose")
@pytest.mark.parametrize("experts_implementation", ["eager", "grouped_mm"])
def test_a_bf16_block_rounds_as_transformers_rounds(tmp_path, experts_implementation):
    """In bf16 the block equals transformers' ``Qwen2MoeSparseMoeBlock`` bit for bit: the top-k weights rounded
    to bf16 before they scale each expert's output, each product rounded, the shared expert gated in bf16 and
    added last; the same experts given their weights in float32 do not."""
    saved_by_transformers(Qwen2MoeConfig, tmp_path / "hf", **SHAPE)
    block, x_TD, expected_TD = bf16_blocks(tmp_path / "hf", 2, experts_implementation)
    with torch.no_grad():
        torch.testing.assert_close(block(x_TD), expected_TD, rtol=0, atol=0)
        logits_TE, weights_TK, experts_TK = block.gate(x_TD)
        assert weights_TK.dtype == torch.bfloat16 and experts_TK.unique().numel() == 6  # every expert serves
        unrounded_TK, _ = block.gate.replayed(logits_TE, experts_TK, experts_TK, torch.float32)
        shared_TD = torch.sigmoid(block.shared_expert_gate(x_TD)) * block.shared_expert(x_TD)
        unrounded_TD = block.experts(x_TD, experts_TK, unrounded_TK) + shared_TD
    assert not torch.equal(unrounded_TD, expected_TD)


def test_the_rollout_engine_decodes_as_a_recompute_with_and_without_fused_projections(tmp_path):
    saved_by_transformers(Qwen2MoeConfig, tmp_path, **SHAPE)
    model, config = load_model(tmp_path)
    assert_engine_decodes_as_recompute(model, config, decode_steps=3, fused_projections=True)
    shared = model.model.layers[0].mlp.shared_expert
    assert model.projections_fused and shared.gate_up is not None and shared.gate_up.intact()
    model.unfuse_projections()
    assert shared.gate_up is None
    assert_engine_decodes_as_recompute(model, config, fused_projections=False)


def test_the_rollout_engine_reloads_a_checkpoint_from_disk(tmp_path):
    """Per-expert names and the shared expert's own, from transformers' file and areno's export."""
    saved_by_transformers(Qwen2MoeConfig, tmp_path / "hf", **SHAPE)
    assert_engine_reloads_from_disk(tmp_path / "hf", tmp_path / "b")


def test_lora_adapts_linear_layers_the_shared_expert_among_them(caplog):
    """Attention adapters as on any expert model; MLP names adapt the linear layers that have them (the dense
    layer's MLP and the shared experts, which a merge carries), never the routed experts' fused tensors."""
    from areno.train.config import LoraConfig
    from areno.train.lora import apply_lora, lora_layers

    config = tiny_config(VOCAB, arch="qwen2_moe", hidden_size=32, layers=2, mlp_only_layers=(1,))
    model = apply_lora(Decoder(config), LoraConfig(rank=4, target_modules=("q_proj", "v_proj")))
    assert sorted(lora_layers(model)) == [
        f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("q_proj", "v_proj")
    ]
    with caplog.at_level(logging.INFO, logger="areno.train.lora"):
        model = apply_lora(Decoder(config), LoraConfig(rank=4, target_modules=("gate_proj",)))
    assert sorted(lora_layers(model)) == ["model.layers.0.mlp.shared_expert.gate_proj", "model.layers.1.mlp.gate_proj"]
    assert "LoRA: 2 MLP layers adapted (shared experts and dense layers, e.g. model.layers.0.mlp.shared_expert" in (
        caplog.text
    )
    assert "the routed experts stay frozen" in caplog.text
    assert not model.model.layers[0].mlp.experts.gate_up_proj.requires_grad


def test_engine_routes_equal_the_trainer_models_and_replay_keeps_the_shared_expert():
    torch.manual_seed(0)
    config = tiny_config(VOCAB, arch="qwen2_moe", hidden_size=32, layers=3, mlp_only_layers=(1,), initializer_range=0.2)
    model = Decoder(config).eval()
    engine_config = RolloutEngineConfig(device="cpu", num_blocks=64, block_size=4, seed=3, record_routes=True)
    engine = RolloutEngine(Decoder(config), config, config=engine_config)
    engine.model.load_state_dict(model.state_dict())
    (out,) = engine.generate([[5, 9, 17, 30, 41, 7]], SamplingParams(temperature=1.0, max_new_tokens=6))
    ids = out.prompt_ids + out.output_ids
    with torch.no_grad(), moe.record_routing(model) as record:
        model(torch.tensor(ids), torch.arange(len(ids)))
    assert out.routes_TLK.shape == (len(ids), 2, 2)  # two sparse layers, top-2
    assert torch.equal(out.routes_TLK[:-1].long(), record.stacked()[:-1])
    # replay: the given experts weighted by the router's softmax there (not renormalised), plus the gated shared
    block = model.model.layers[0].mlp
    x = torch.randn(5, 32)
    with torch.no_grad():
        forced = (block.gate(x)[2] + 1) % 4
    with moe.replay_routes(nn.ModuleList([block]), forced[:, None]):
        got = block(x)
    probs = torch.softmax(F.linear(x, block.gate.weight), dim=-1)
    for t in range(5):
        routed = 0
        for k in range(2):
            e = int(forced[t, k])
            gate, up = F.linear(x[t], block.experts.gate_up_proj[e]).chunk(2)
            routed = routed + probs[t, e] * F.linear(F.silu(gate) * up, block.experts.down_proj[e])
        s = block.shared_expert
        shared = s.down_proj(F.silu(s.gate_proj(x[t])) * s.up_proj(x[t]))
        want = routed + torch.sigmoid(block.shared_expert_gate(x[t])) * shared
        torch.testing.assert_close(got[t], want, rtol=1e-5, atol=1e-6)
    got.sum().backward()
    assert block.gate.weight.grad.abs().sum() > 0 and block.shared_expert_gate.weight.grad.abs().sum() > 0


def test_grpo_on_a_tiny_qwen2_moe_learns_the_reward(tmp_path):
    extra = ", moe_intermediate_size: 16, shared_expert_intermediate_size: 48, output_router_logits: true"
    exported = grpo_learns_and_exports(tmp_path, "qwen2_moe", extra)
    assert exported["shared_expert_intermediate_size"] == 48 and exported["output_router_logits"] is True


def _a2_7b() -> dict:
    """A config.json of Qwen1.5-MoE-A2.7B's shape."""
    return {
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "max_position_embeddings": 8192,
        "max_window_layers": 21,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "use_sliding_window": False,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "num_experts_per_tok": 4,
        "num_experts": 60,
        "norm_topk_prob": False,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
    }


def test_a_bare_config_takes_the_classs_defaults_and_a_real_shape_counts_its_parameters():
    bare = ModelConfig.from_hf({"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe"})
    theirs = Qwen2MoeConfig()
    assert (bare.num_experts, bare.num_experts_per_tok, bare.moe_intermediate_size) == (60, 4, 1408)
    assert bare.shared_expert_intermediate_size == theirs.shared_expert_intermediate_size
    assert bare.attention_bias is theirs.qkv_bias is True and bare.sliding_window is None
    d = _a2_7b()
    config = ModelConfig.from_hf(d)
    assert config.sliding_window is None and config.window_layers is None
    with torch.device("meta"):
        ref = AutoModelForCausalLM.from_config(Qwen2MoeConfig(**{k: v for k, v in d.items() if k != "architectures"}))
    assert config.num_params() == sum(p.numel() for p in ref.parameters())
    no_bias = ModelConfig.from_hf({**d, "qkv_bias": False, "attention_bias": True})  # its class reads qkv_bias
    assert not no_bias.attention_bias and ModelConfig.from_hf(no_bias.to_hf()) == no_bias


def test_what_it_cannot_be_is_refused_in_one_line():
    d = tiny_config(VOCAB, arch="qwen2_moe").to_hf()
    cases = [
        ({**d, "use_sliding_window": True, "sliding_window": 8}, "use_sliding_window=true"),
        ({**d, "layer_types": ["sliding_attention", "full_attention"]}, "set use_sliding_window to false"),
        ({**d, "num_experts": 0}, "num_experts=0 is impossible for Qwen2MoeForCausalLM"),
        (
            {**d, "shared_expert_intermediate_size": 0},
            "its layers have a shared expert; set it to the expert's width (> 0)",
        ),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)) as err:
            ModelConfig.from_hf(bad)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="only Qwen2MoeForCausalLM has a shared expert of that width; leave it 0"):
        tiny_config(VOCAB, arch="qwen3_moe", shared_expert_intermediate_size=32)
    with pytest.raises(ValueError, match="no o_proj bias"):
        tiny_config(VOCAB, arch="qwen2_moe", attention_out_bias=True)
    with pytest.raises(ValueError, match="tp_size=1"):
        check_tp_size(tiny_config(VOCAB, arch="qwen2_moe"), 2)
    with pytest.raises(ValueError, match="drop head_dim from config.json"):
        ModelConfig.from_hf({**d, "head_dim": 32})


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_server_rollouts_refuse_q_k_v_without_biases_before_any_server_starts(tmp_path, monkeypatch, backend):
    from areno.api.config import load_config
    from areno.engine.seams import SideSetup
    from areno.engine.servers import ServerRolloutSide

    monkeypatch.setattr("areno.engine.servers.check_server_install", lambda backend: None)
    started = []
    monkeypatch.setattr("areno.engine.servers.start_servers", lambda *a, **k: started.append(a))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(tiny_config(VOCAB, arch="qwen2_moe", attention_bias=False).to_hf()))
    cfg = load_config(None, [f"model.path={model}", f"run_dir={tmp_path / 'run'}", f"rollout.backend={backend}"])
    with pytest.raises(ValueError, match=f"^rollout.backend={backend}: .* Qwen2-MoE checkpoint with qkv_bias=false"):
        ServerRolloutSide(cfg, tmp_path / "run").start(SideSetup(recipe=None, model_dir=model, tokenizer=None))
    assert not started
