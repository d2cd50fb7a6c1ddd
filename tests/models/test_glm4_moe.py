"""GLM-4.5 / GLM-4.5-Air / GLM-4.6 (``Glm4MoeForCausalLM``): Llama's pre-norm layers with q/k/v biases, per-head
q/k norms and half of each head turned by rotate-half RoPE; a dense first layer, then expert blocks whose
router scores by a sigmoid and chooses within the best groups by score + ``e_score_correction_bias``, weights
renormalised and scaled, a shared expert added. A checkpoint transformers saved (with a nonzero correction
bias and the release's multi-token-prediction layer beside it) computes transformers' log-probs and gradients;
the group limit and the bias are computed (without them the log-probs move); the export loads back in
transformers; the router stays float32 in a bf16 model; routing replay routes with the router's own weights;
the rollout engine decodes it; FSDP2 over two processes, the experts replicated or split, trains as one
process; GRPO on a tiny one learns; what it cannot do is refused in one line."""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Glm4MoeConfig

from areno.models import Decoder, ModelConfig, load_model, moe, save_model, tiny_config
from areno.models.hf_io import read_config
from areno.models.logprobs import packed_logprobs
from tests.helpers.families import (
    assert_engine_decodes_as_recompute,
    assert_engine_reloads_from_disk,
    assert_export_reads_back,
    grpo_learns_and_exports,
    packed_batch,
    reference_logprobs,
    saved_by_transformers,
    saved_names,
)
from tests.helpers.moe import bf16_blocks

SHAPE = dict(
    num_hidden_layers=3,
    head_dim=12,
    moe_intermediate_size=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    n_shared_experts=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    use_qk_norm=True,
    attention_bias=True,
    spread_norms=True,
    spread_biases=True,
)


def _saved(path):
    """transformers' tiny GLM-4.5 with a nonzero correction bias, saved; then a multi-token-prediction layer
    (``model.layers.3.*``, as the release's ``layers.46`` / ``layers.92``) added to its file."""
    ref = saved_by_transformers(Glm4MoeConfig, path, **SHAPE)
    with torch.no_grad():
        for name, buf in ref.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.5)  # the sigmoid scores lie in (0, 1): this moves the choice
    ref.save_pretrained(path)
    state = load_file(path / "model.safetensors")
    mtp = {k.replace("layers.2.", "layers.3."): t.clone() for k, t in state.items() if k.startswith("model.layers.2.")}
    mtp["model.layers.3.eh_proj.weight"] = torch.randn(48, 96)
    save_file({**state, **mtp}, str(path / "model.safetensors"), metadata={"format": "pt"})
    return ref


def _logprobs(model):
    _, ids_T, cu_B1 = packed_batch()
    with torch.no_grad():
        return packed_logprobs(model.eval(), ids_T, cu_B1, chunk_size=7)[0]


def test_a_checkpoint_transformers_saved_computes_its_logprobs_and_exports_its_names(tmp_path, caplog):
    ref = _saved(tmp_path / "hf")
    with caplog.at_level(logging.INFO, logger="areno.models.hf_io"):
        model, config = load_model(tmp_path / "hf")
    skipped = [r.getMessage() for r in caplog.records if "layers >= num_hidden_layers=3" in r.getMessage()]
    assert len(skipped) == 1 and "skipped 41 tensors" in skipped[0]
    assert (config.rotary_dim, config.rope_interleaved, config.norm_layout, config.qk_norm) == (6, False, "pre", True)
    assert [config.is_moe_layer(i) for i in range(3)] == [False, True, True]
    assert (config.n_group, config.topk_group, config.routed_scaling_factor) == (4, 2, 2.5)
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.abs().min() > 0 and torch.equal(bias, ref.model.layers[1].mlp.gate.e_score_correction_bias)
    seqs, _, _ = packed_batch()
    ours, expected = _logprobs(model), reference_logprobs(ref, seqs)
    assert expected.abs().max() > 1.0
    assert (ours - expected).abs().max().item() <= 1e-4
    # negative controls: without the group limit, or without the correction bias, other experts are chosen
    for router in moe.float32_routers(model):
        router.topk_group = router.n_group
    assert (_logprobs(model) - expected).abs().max().item() > 1e-2
    model, _ = load_model(tmp_path / "hf")
    for router in moe.float32_routers(model):
        router.e_score_correction_bias.zero_()
    assert (_logprobs(model) - expected).abs().max().item() > 1e-2
    model, _ = load_model(tmp_path / "hf")
    assert_export_reads_back(model, config, seqs, expected, tmp_path / "out")
    theirs, back = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(back) == sorted(k for k in theirs if not k.startswith("model.layers.3."))  # no MTP layer written
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["num_nextn_predict_layers"] == 0 and exported["n_routed_experts"] == 8


def test_gradients_match_transformers(tmp_path):
    ref = _saved(tmp_path / "hf")
    model, _ = load_model(tmp_path / "hf")
    seqs, ids_T, cu_B1 = packed_batch()
    ours, _ = packed_logprobs(model, ids_T, cu_B1, chunk_size=7)
    ours.sum().backward()
    reference_logprobs(ref, seqs, grad=True).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}  # both hold the experts fused, under one name
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    assert sorted(grads) == sorted(ref_grads)
    for name, r in ref_grads.items():
        assert r.abs().max() > 0, name
        torch.testing.assert_close(grads[name], r, rtol=1e-4, atol=1e-5 * max(1.0, r.abs().max().item()), msg=name)


def test_the_router_stays_float32_in_a_bf16_model(tmp_path):
    _saved(tmp_path / "hf")
    model, _ = load_model(tmp_path / "hf", dtype=torch.bfloat16)
    gate = model.model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert model.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    assert model.float32_modules() == [model.model.layers[i].mlp.gate for i in (1, 2)]  # FSDP2's float32 groups
    ref32, _ = load_model(tmp_path / "hf")
    x_TD = torch.randn(5, 48).bfloat16()
    logits_TE = gate(x_TD)[0]
    assert logits_TE.dtype == torch.float32
    torch.testing.assert_close(logits_TE, ref32.model.layers[1].mlp.gate(x_TD.float())[0], rtol=0, atol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the local backend's bf16 autocast over fp32 weights
        assert ref32.model.layers[1].mlp.gate(x_TD.float())[0].dtype == torch.float32
    model.to(torch.bfloat16)  # even a cast of the whole module: its logits are computed in float32
    assert gate.weight.dtype == torch.bfloat16 and gate(x_TD)[0].dtype == torch.float32
    moe.keep_routers_float32(model)
    # a save of the bf16 model writes its routers in float32, which transformers loads
    save_model(*load_model(tmp_path / "hf", dtype=torch.bfloat16), tmp_path / "bf16")
    stored = load_file(tmp_path / "bf16" / "model.safetensors")
    assert stored["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert stored["model.layers.1.mlp.experts.0.up_proj.weight"].dtype == torch.bfloat16
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    assert back.model.layers[1].mlp.gate.weight.dtype == torch.float32


@pytest.mark.skipif(
    int(transformers.__version__.split(".")[0]) < 5, reason="transformers 4 sums the experts' outputs in float32"
)
def test_a_bf16_expert_block_rounds_as_transformers_rounds(tmp_path):
    """The float32 router's weights multiply each expert's bf16 output unrounded, the product rounded once
    (transformers' eager experts): the block equals transformers' bit for bit; weights rounded first do not."""
    _saved(tmp_path / "hf")
    block, x_TD, expected_TD = bf16_blocks(tmp_path / "hf", 1)
    with torch.no_grad():
        torch.testing.assert_close(block(x_TD), expected_TD, rtol=0, atol=0)
        _, weights_TK, experts_TK = block.gate(x_TD)
        assert weights_TK.dtype == torch.float32
        rounded_TD = block.experts(x_TD, experts_TK, weights_TK.bfloat16()) + block.shared_experts(x_TD)
    assert not torch.equal(rounded_TD, expected_TD)


def test_a_reward_model_export_of_a_bf16_model_keeps_its_routers_float32(tmp_path):
    """``save_reward_model`` writes a bf16 reward model's decoder in bf16 but its routers in float32, their trained
    values unrounded, as ``save_model`` writes a policy's."""
    from areno.specializations.preference import save_reward_model

    config = tiny_config(61, arch="glm4_moe", tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Decoder(config).to(torch.bfloat16)
    moe.keep_routers_float32(model)  # as load_model builds a bf16 model
    with torch.no_grad():
        model.model.layers[1].mlp.gate.weight.normal_(0.0, 0.2)  # float32 values bf16 cannot hold
        model.model.layers[1].mlp.gate.e_score_correction_bias.normal_(0.0, 0.3)
    state = {f"decoder.{k}": t for k, t in model.state_dict().items()}
    state["score.weight"] = torch.randn(1, config.hidden_size, dtype=torch.bfloat16)
    stored = load_file(save_reward_model(state, config, tmp_path / "rm") / "model.safetensors")
    for leaf in ("weight", "e_score_correction_bias"):
        name = f"model.layers.1.mlp.gate.{leaf}"
        assert stored[name].dtype == torch.float32 and torch.equal(stored[name], state[f"decoder.{name}"])
    assert stored["model.layers.1.mlp.experts.0.up_proj.weight"].dtype == torch.bfloat16


def test_routing_replay_routes_with_the_routers_own_weights(tmp_path):
    torch.manual_seed(0)
    model = Decoder(tiny_config(61, arch="glm4_moe", hidden_size=32, initializer_range=0.2))
    block = model.model.layers[1].mlp
    with torch.no_grad():
        block.gate.e_score_correction_bias.normal_(0.0, 0.3)
    ids_T, pos_T = torch.randint(0, 61, (12,)), torch.arange(12)
    with torch.no_grad(), moe.record_routing(model) as record:
        model(ids_T, pos_T)
    routes_TLK = record.stacked()
    assert routes_TLK.shape == (12, 1, 2)
    with torch.no_grad():
        block.gate.weight.add_(torch.randn_like(block.gate.weight))  # the router now prefers other experts
        block.gate.e_score_correction_bias.zero_()
    with moe.replay_routes(model, routes_TLK), moe.record_routing(model) as replayed:
        model(ids_T, pos_T).square().sum().backward()
    assert torch.equal(replayed.stacked(used=True), routes_TLK)
    assert not torch.equal(replayed.stacked(), routes_TLK)  # its own choice differs: the replay decided
    assert block.gate.weight.grad is not None and block.gate.weight.grad.abs().max() > 0
    # the weights: its own sigmoid scores at the replayed ids, renormalised and scaled
    x_TD = torch.randn(12, 32)
    logits_TE, _, own_TK = block.gate(x_TD)
    weights_TK, experts_TK = block.gate.replayed(logits_TE, own_TK, routes_TLK[:, 0], torch.float32)
    scores_TK = logits_TE.sigmoid().gather(-1, routes_TLK[:, 0])
    assert torch.equal(experts_TK, routes_TLK[:, 0])
    torch.testing.assert_close(weights_TK, 2.5 * scores_TK / scores_TK.sum(-1, keepdim=True))


def test_the_rollout_engine_decodes_what_the_model_computes(tmp_path):
    _saved(tmp_path / "hf")
    assert_engine_decodes_as_recompute(*load_model(tmp_path / "hf"), decode_steps=3)


def test_the_rollout_engine_reloads_a_release_checkpoint_with_its_mtp_layer(tmp_path):
    """The release's file with its MTP layer's tensors (left out), then areno's export."""
    _saved(tmp_path / "hf")
    assert_engine_reloads_from_disk(tmp_path / "hf", tmp_path / "b")


def test_grpo_on_a_tiny_glm4_moe_learns_the_reward(tmp_path):
    exported = grpo_learns_and_exports(tmp_path, "glm4_moe")
    assert (exported["n_group"], exported["topk_group"], exported["first_k_dense_replace"]) == (4, 2, 1)


def test_config_reads_transformers_keys_and_refuses_what_it_does_not_compute():
    theirs = Glm4MoeConfig(head_dim=128, n_group=4, topk_group=2)
    bare = ModelConfig.from_hf({"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "head_dim": 128})
    assert bare.partial_rotary_factor == theirs.rope_parameters["partial_rotary_factor"] == 0.5
    assert bare.rope_theta == theirs.rope_parameters["rope_theta"]
    assert (
        (bare.num_experts, bare.num_experts_per_tok, bare.n_shared_experts)
        == (128, 8, 1)
        == (
            theirs.n_routed_experts,
            theirs.num_experts_per_tok,
            theirs.n_shared_experts,
        )
    )
    assert (bare.first_k_dense_replace, bare.norm_topk_prob, bare.qk_norm) == (1, True, False)
    assert bare.attention_bias is False and bare.rms_norm_eps == theirs.rms_norm_eps
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(theirs.__class__(**{**theirs.to_dict(), "num_hidden_layers": 3}))
    small = bare.replace(num_hidden_layers=3, n_group=4, topk_group=2)
    assert small.num_params() == sum(p.numel() for p in hf.parameters())
    tiny = tiny_config(61, arch="glm4_moe")
    assert ModelConfig.from_hf(json.loads(json.dumps(tiny.to_hf()))) == tiny
    d = tiny.to_hf()
    with pytest.raises(ValueError, match="^output_router_logits=true: .* computes no load-balancing loss"):
        ModelConfig.from_hf({**d, "output_router_logits": True})
    with pytest.raises(ValueError, match="n_group=3 must divide num_experts=8"):
        ModelConfig.from_hf({**d, "n_group": 3})
    with pytest.raises(ValueError, match="topk_group=1 must be in .* hold num_experts_per_tok=4"):
        ModelConfig.from_hf({**d, "topk_group": 1, "num_experts_per_tok": 4})
    with pytest.raises(ValueError, match="are Glm4MoeForCausalLM's"):
        tiny_config(61, arch="qwen3_moe", n_shared_experts=1)
    with pytest.raises(ValueError, match="router_scoring='softmax' is impossible for Glm4MoeForCausalLM"):
        tiny.replace(router_scoring="softmax")
    with pytest.raises(ValueError, match="tensor parallelism of mixture-of-experts"):
        from areno.models.tp_plan import check_tp_size

        check_tp_size(tiny, 2)


def test_a_checkpoint_without_shared_experts_is_refused_in_one_line_before_its_weights_load(tmp_path):
    """n_shared_experts=0: transformers builds the shared experts 0 wide and saves their empty tensors; areno
    refuses the config by name as it reads config.json, before any tensor is read."""
    shape = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=0)
    saved_by_transformers(Glm4MoeConfig, tmp_path, **shape)
    assert any(".shared_experts." in name for name in saved_names(tmp_path))  # the empty tensors
    with pytest.raises(ValueError, match=r"n_shared_experts=0 is not supported .*: set n_shared_experts >= 1$") as e:
        read_config(tmp_path)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="n_shared_experts=0 is not supported"):
        load_model(tmp_path)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("n_group", 4.0, "ModelConfig.n_group must be an int, got 4.0"),  # a float fails the router's view
        ("topk_group", None, "ModelConfig.topk_group must be an int, got None"),
        ("first_k_dense_replace", True, "ModelConfig.first_k_dense_replace must be an int, got True"),
        ("n_routed_experts", "8", "ModelConfig.num_experts must be an int, got '8'"),
        ("routed_scaling_factor", None, "ModelConfig.routed_scaling_factor must be a positive float, got None"),
    ],
)
def test_a_config_json_value_of_the_wrong_type_is_refused_in_one_line(key, value, message):
    """Its routing fields as config.json may hold them wrongly: a one-line ValueError naming the field, not a
    TypeError, and never a config accepted that fails in the forward."""
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        ModelConfig.from_hf({**tiny_config(61, arch="glm4_moe").to_hf(), key: value})


def _fsdp_worker(rank, world, model_dir, out):
    from torch.distributed.fsdp import FSDPModule

    from areno.train import FSDP2TrainBackend, TrainBackendConfig
    from tests.helpers.train import nll_forward, nll_loss, random_batch, token_denominator

    backend = FSDP2TrainBackend(TrainBackendConfig(lr=1e-2, device="cpu", param_dtype="bfloat16"))
    backend.initialize(model_dir)
    routers = moe.float32_routers(backend.model)
    seen = []
    for router in routers:
        router.register_forward_hook(lambda m, args, o: seen.append((m.weight.dtype, o[0].dtype, args[0].dtype)))
    before = routers[0].weight.detach().full_tensor().clone()
    metrics = backend.train_step(
        random_batch([9, 14], 40, 0), forward_fn=nll_forward, loss_fn=nll_loss, denominator_fn=token_denominator
    )
    after = routers[0].weight.detach().full_tensor()
    torch.save(
        {
            "routers_sharded_apart": [isinstance(r, FSDPModule) for r in routers],
            "seen": seen,
            "expert_dtype": backend.model.model.layers[1].mlp.experts.gate_up_proj.dtype,
            "router_moved": bool((after - before).abs().max() > 0),
            "loss": metrics["loss"],
        },
        out,
    )
    backend.shutdown()


@pytest.mark.slow  # a spawned gloo process: about 12 s
def test_fsdp2_gathers_the_router_in_float32_under_bf16_compute(tmp_path):
    """FSDP2 (one gloo rank) with bf16 compute over fp32 master weights: each router is a float32 group of its
    own (``Decoder.float32_modules``), so its forward sees its float32 weight, makes float32 logits and trains."""
    from tests.helpers.train import make_model_dir, spawn

    model_dir = make_model_dir(tmp_path / "model", arch="glm4_moe")
    spawn(_fsdp_worker, 1, str(model_dir), str(tmp_path / "out.pt"), tmp=tmp_path)
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert out["routers_sharded_apart"] == [True]
    assert out["seen"] and all(s == (torch.float32, torch.float32, torch.float32) for s in out["seen"])
    assert out["router_moved"] and torch.isfinite(torch.tensor(out["loss"]))


def _ep_worker(rank, world):
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from areno.models import PackedCausalAttention
    from areno.train.expert_parallel import shard_experts

    def loss_of(model, seed):
        g = torch.Generator().manual_seed(seed)
        ids_T, cu_B1 = torch.randint(0, 61, (15,), generator=g), torch.tensor([0, 9, 15])
        pos_T = torch.cat([torch.arange(9), torch.arange(6)])
        logits_TV = model.logits(model(ids_T, pos_T, PackedCausalAttention(cu_B1)))
        keep = torch.ones(15, dtype=torch.bool)
        keep[[8, 14]] = False
        return torch.nn.functional.cross_entropy(logits_TV[keep], ids_T.roll(-1)[keep], reduction="sum")

    torch.manual_seed(0)
    full = Decoder(tiny_config(61, arch="glm4_moe", hidden_size=32, layers=3, initializer_range=0.2))
    with torch.no_grad():
        for router in moe.float32_routers(full):
            router.e_score_correction_bias.normal_(0.0, 0.3)
    ref_loss = sum(loss_of(full, r) for r in range(world))
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in full.named_parameters()}
    ep = copy.deepcopy(full)
    ep.zero_grad(set_to_none=True)
    assert len(shard_experts(ep, init_device_mesh("cpu", (world,)))) == 4  # 2 sparse layers x 2 tensors
    loss = loss_of(ep, rank)
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    torch.testing.assert_close(total, ref_loss.detach(), rtol=1e-5, atol=1e-4)
    for name, p in ep.named_parameters():
        if ".experts." in name:  # this rank's 4 of the 8 experts
            grad, expected = p.grad.to_local(), ref_grads[name][4 * rank : 4 * rank + 4]
        else:  # the routers, the shared experts and the rest: replicated, summed over the ranks
            grad, expected = p.grad, ref_grads[name]
            dist.all_reduce(grad)
        torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow  # two spawned gloo processes
def test_expert_parallel_2_equals_1_with_shared_experts_and_the_sigmoid_router(tmp_path):
    from tests.helpers.train import spawn

    spawn(_ep_worker, 2, tmp=tmp_path)


def test_a_disk_policy_sync_of_a_bf16_model_writes_what_save_model_writes(tmp_path):
    """The DISK transport (vLLM / SGLang rollouts, ``sync.disk``) publishes transformers' names, the routers in
    float32 beside bf16 weights, and the engine reloads it exactly."""
    from areno.sync.base import NamedTensorSource
    from areno.sync.disk import DiskTransport, latest_policy

    _saved(tmp_path / "hf")
    decoder, config = load_model(tmp_path / "hf", dtype=torch.bfloat16)
    expected = load_file(save_model(decoder, config, tmp_path / "saved") / "model.safetensors")
    source = NamedTensorSource(lambda: decoder.state_dict().items())
    DiskTransport(source, tmp_path / "sync", model_dir=tmp_path / "hf", model_config=config).sync(1)
    path, _ = latest_policy(tmp_path / "sync")
    synced = {}
    for shard in path.glob("*.safetensors"):
        synced.update(load_file(shard))
    assert sorted(synced) == sorted(expected)
    for name, t in expected.items():
        assert synced[name].dtype == t.dtype and torch.equal(synced[name], t), name
    assert synced["model.layers.2.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    reloaded, _ = load_model(path, dtype=torch.bfloat16)
    for name, t in decoder.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], t), name


def test_lora_adapts_the_attention_and_refuses_the_expert_names_as_for_every_expert_model():
    from areno.errors import ConfigError
    from areno.train.config import LoraConfig
    from areno.train.lora import apply_lora, lora_layers

    model = apply_lora(Decoder(tiny_config(61, arch="glm4_moe")), LoraConfig(target_modules="q_proj,o_proj"))
    assert sorted(lora_layers(model)) == [
        f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("o_proj", "q_proj")
    ]
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32
    with pytest.raises(ConfigError, match="^train.lora.target_modules: .* not linear .*Experts"):
        apply_lora(Decoder(tiny_config(61, arch="glm4_moe")), LoraConfig(target_modules="down_proj"))


_DP = dict(lr=1e-2, device="cpu", grad_clip=0.5, weight_decay=0.1, max_tokens_per_mb=24)
_DP_LENGTHS = [13, 7, 21, 5, 9, 16, 3, 11]


def _dp_steps(backend) -> list[tuple[float, float]]:
    from tests.helpers.train import nll_forward, nll_loss, random_batch, token_denominator

    out = []
    for s in range(3):
        batch = random_batch(_DP_LENGTHS, 100, 50 + s)
        m = backend.train_step(batch, forward_fn=nll_forward, loss_fn=nll_loss, denominator_fn=token_denominator)
        out.append((m["loss"], m["grad_norm"]))
    return out


def _dp_worker(rank, world, model_dir, out_dir):
    from pathlib import Path

    from areno.train import FSDP2TrainBackend, TrainBackendConfig

    result = {}
    for ep in (1, 2):
        backend = FSDP2TrainBackend(TrainBackendConfig(**_DP, ep_size=ep))
        backend.initialize(model_dir)
        result[f"ep{ep}"] = (_dp_steps(backend), {k: v.clone() for k, v in backend.named_weights()})
        if ep == 2:
            result["router_rows"] = [r.weight.to_local().shape[0] for r in moe.float32_routers(backend.model)]
            backend.save_checkpoint(Path(out_dir) / "ckpt", {"pos": 3})
        backend.shutdown()
    if rank == 0:
        torch.save(result, Path(out_dir) / "result.pt")


def test_fsdp2_over_two_processes_trains_as_one_process(tmp_path):
    """FSDP2 over 2 gloo ranks, the experts replicated (EP 1) and split (EP 2), equals the one-process backend: the
    losses, the clipped gradients' norm (each router's float32 group counted once), the weights after 3 AdamW
    steps with weight decay; the correction biases (buffers) stay as loaded; the 2-rank checkpoint loads in one
    process over another model's weights and zero biases and gives back every tensor, the biases included."""
    from areno.train import LocalTrainBackend, TrainBackendConfig
    from tests.helpers.moe import BIAS, glm4_moe_dir
    from tests.helpers.train import spawn

    model_dir = glm4_moe_dir(tmp_path / "model", seed=0, biased=True)
    biases = {i: load_file(model_dir / "model.safetensors")[BIAS.format(i)] for i in (1, 2)}
    spawn(_dp_worker, 2, str(model_dir), str(tmp_path), tmp=tmp_path)
    r = torch.load(tmp_path / "result.pt", weights_only=True)
    one = LocalTrainBackend(TrainBackendConfig(**_DP))
    one.initialize(model_dir)
    losses, weights = _dp_steps(one), dict(one.named_weights())
    assert r["router_rows"] == [4, 4]  # each router sharded over the 2 ranks: 4 of its 8 rows here
    for ep in (1, 2):
        dp_losses, dp_weights = r[f"ep{ep}"]
        for (loss, norm), (dp_loss, dp_norm) in zip(losses, dp_losses):
            assert dp_loss == pytest.approx(loss, rel=1e-5) and dp_norm == pytest.approx(norm, rel=1e-4)
        assert losses[0][1] > 2 * _DP["grad_clip"]  # the clip acts: a norm counted twice would change every update
        assert sorted(dp_weights) == sorted(weights)
        for name, t in weights.items():
            assert dp_weights[name].dtype == t.dtype, name
            torch.testing.assert_close(dp_weights[name], t, rtol=1e-4, atol=1e-4, msg=name)
        for i in (1, 2):
            assert dp_weights[f"model.layers.{i}.mlp.gate.weight"].dtype == torch.float32
            assert torch.equal(dp_weights[BIAS.format(i)], biases[i])  # weight decay reaches no buffer
    back = LocalTrainBackend(TrainBackendConfig(**_DP))
    back.initialize(glm4_moe_dir(tmp_path / "other", seed=1, biased=False))
    assert back.load_checkpoint(tmp_path / "ckpt") == {"pos": 3}
    for name, t in back.named_weights():
        assert torch.equal(t, r["ep2"][1][name]), name
