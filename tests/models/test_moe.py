"""Mixture-of-experts layouts (Qwen3-MoE, Mixtral): parity with transformers on tiny random
checkpoints that transformers itself saved, checkpoint names both ways, the grouped experts against
the masked reference, the load-balancing loss, routing records."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from areno.errors import ModelDirError
from areno.models import Decoder, ModelConfig, check_tp_size, load_model, moe, save_model, tiny_config
from areno.models.logprobs import packed_logprobs
from tests.helpers.moe import VOCAB, saved_by_transformers

TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])


def _ref_logprobs(ref, ids_T):
    with torch.no_grad():
        logits = ref(ids_T[None]).logits[0].float()
    lp = torch.log_softmax(logits[:-1], -1).gather(-1, ids_T[1:, None])[:, 0]
    return torch.cat([torch.zeros(1), lp])


LAYOUTS = ["qwen3_moe", "qwen3_moe_unnormed", "mixtral"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_equal_transformers_on_its_checkpoint(layout, tmp_path):
    ref = saved_by_transformers(layout, tmp_path)
    model, config = load_model(tmp_path)
    # transformers 5 names it num_local_experts on every MoE config, 4.x num_experts on Qwen3-MoE's
    assert config.num_experts == (getattr(ref.config, "num_local_experts", None) or ref.config.num_experts)
    g = torch.Generator().manual_seed(1)
    lens = [9, 14, 5]
    seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in lens]
    cu_B1 = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    with torch.no_grad():
        ours, _ = packed_logprobs(model, torch.cat(seqs), cu_B1, chunk_size=7)
    expected = torch.cat([_ref_logprobs(ref, s) for s in seqs])
    assert expected.abs().max() > 1.0
    assert (ours - expected).abs().max().item() <= 1e-4
    if TRANSFORMERS_MAJOR < 5:  # 4.x keeps a module per expert in memory; the disk names are tested below
        return
    # in memory: transformers 5's names and shapes
    ref_sd, ours_sd = ref.state_dict(), model.state_dict()
    assert sorted(ours_sd) == sorted(ref_sd)
    assert all(torch.equal(ours_sd[k], ref_sd[k]) for k in ours_sd)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_export_has_transformers_disk_names_and_reloads(layout, tmp_path):
    ref = saved_by_transformers(layout, tmp_path / "hf")
    model, config = load_model(tmp_path / "hf")
    save_model(model, config, tmp_path / "ours")
    names = {}
    for d in ("hf", "ours"):
        with safe_open(str(tmp_path / d / "model.safetensors"), "pt") as f:
            names[d] = {k: f.get_tensor(k) for k in f.keys()}
    assert sorted(names["ours"]) == sorted(names["hf"])
    assert all(torch.equal(names["ours"][k], names["hf"][k]) for k in names["hf"])
    assert ModelConfig.from_hf(json.loads((tmp_path / "ours" / "config.json").read_text())) == config
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, ref(ids).logits, rtol=0, atol=1e-5)


def test_missing_expert_is_named(tmp_path):
    config = tiny_config(VOCAB, arch="mixtral", hidden_size=32, layers=1)
    save_model(moe_model(config), config, tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["model.layers.0.block_sparse_moe.experts.3.w2.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelDirError, match=r"experts\.3\.w2"):
        load_model(tmp_path)


def moe_model(config):
    torch.manual_seed(0)
    return Decoder(config)


def test_grouped_experts_equal_masked_reference_values_and_grads():
    g = torch.Generator().manual_seed(0)
    T, D, E, K, Di = 37, 16, 5, 2, 8
    f64 = dict(generator=g, dtype=torch.float64, requires_grad=True)  # sums in another order: compare in fp64
    x = torch.randn(T, D, **f64)
    gate_up = torch.randn(E, 2 * Di, D, **f64)
    down = torch.randn(E, D, Di, **f64)
    experts = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    experts[:, 0] = 1  # one expert takes every token, another (some) none
    experts[experts == 4] = 3
    weights = torch.rand(T, K, generator=g, dtype=torch.float64)
    a = moe.grouped_experts(x, experts, weights, gate_up, down)
    ga = torch.autograd.grad(a.square().sum(), (x, gate_up, down))
    b = moe.naive_experts(x, experts, weights, gate_up, down)
    gb = torch.autograd.grad(b.square().sum(), (x, gate_up, down))
    torch.testing.assert_close(a, b)
    for u, v in zip(ga, gb):
        torch.testing.assert_close(u, v)


def test_grouped_mm_experts_equal_grouped():
    """The device-offset grouped-GEMM path (GPU inference) computes what the grouped loop does;
    torch's CPU ``_grouped_mm`` runs the same code here."""
    g = torch.Generator().manual_seed(0)
    T, D, E, Di = 29, 16, 6, 8
    x = torch.randn(T, D, generator=g)
    gate_up, down = torch.randn(E, 2 * Di, D, generator=g), torch.randn(E, D, Di, generator=g)
    experts = torch.randint(0, E - 1, (T, 2), generator=g)  # the last expert gets no token
    weights = torch.rand(T, 2, generator=g)
    torch.testing.assert_close(
        moe.grouped_mm_experts(x, experts, weights, gate_up, down),
        moe.grouped_experts(x, experts, weights, gate_up, down),
    )


@pytest.mark.gpu
def test_grouped_mm_experts_on_gpu_bf16():
    g = torch.Generator().manual_seed(0)
    T, D, E, Di = 64, 64, 8, 32
    dev = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(T, D, generator=g).to(**dev)
    gate_up, down = (
        (torch.randn(E, 2 * Di, D, generator=g) / 8).to(**dev),
        (torch.randn(E, D, Di, generator=g) / 8).to(**dev),
    )
    experts = torch.randint(0, E, (T, 2), generator=g).cuda()
    weights = torch.rand(T, 2, generator=g).to(**dev)
    ref = moe.grouped_experts(x.float(), experts, weights.float(), gate_up.float(), down.float())
    torch.testing.assert_close(
        moe.grouped_mm_experts(x, experts, weights, gate_up, down).float(), ref, rtol=3e-2, atol=3e-2
    )


@pytest.mark.gpu
def test_grouped_mm_experts_gradients_on_gpu_bf16():
    """Training takes the grouped GEMMs on the GPU: their gradients equal the sorted matmuls' on the
    same bf16 inputs (relative error of each gradient), and an expert no token reaches gets exactly 0."""
    g = torch.Generator().manual_seed(0)
    T, D, E, Di = 96, 64, 8, 32
    leaves = {
        "x": torch.randn(T, D, generator=g),
        "gate_up": torch.randn(E, 2 * Di, D, generator=g) / 8,
        "down": torch.randn(E, D, Di, generator=g) / 8,
        "weights": torch.rand(T, 2, generator=g),
    }
    experts = torch.randint(0, E - 1, (T, 2), generator=g).cuda()  # the last expert gets no token
    upstream = torch.randn(T, D, generator=g).cuda()

    def grads(fn):
        t = {k: v.to("cuda", torch.bfloat16).requires_grad_() for k, v in leaves.items()}
        out = fn(t["x"], experts, t["weights"], t["gate_up"], t["down"])
        (out.float() * upstream).sum().backward()
        return {k: v.grad.float() for k, v in t.items()}

    ours, ref = grads(moe.grouped_mm_experts), grads(moe.grouped_experts)
    errors = {k: ((ours[k] - ref[k]).norm() / ref[k].norm()).item() for k in leaves}
    assert all(e < 2e-2 for e in errors.values()), errors
    assert not ours["gate_up"][E - 1].any() and not ours["down"][E - 1].any()


def test_expert_slice_computes_only_its_experts():
    g = torch.Generator().manual_seed(0)
    T, D, E, Di = 20, 8, 6, 4
    x = torch.randn(T, D, generator=g)
    gate_up, down = torch.randn(E, 2 * Di, D, generator=g), torch.randn(E, D, Di, generator=g)
    experts = torch.randint(0, E, (T, 2), generator=g)
    weights = torch.rand(T, 2, generator=g)
    full = moe.grouped_experts(x, experts, weights, gate_up, down)
    halves = moe.grouped_experts(x, experts, weights, gate_up[:3], down[:3]) + moe.grouped_experts(
        x, experts, weights, gate_up[3:], down[3:], first_expert=3
    )
    torch.testing.assert_close(halves, full)


def test_load_balancing_loss_equals_transformers(tmp_path):
    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(11, 6, generator=g) for _ in range(3)]
    ours = moe.load_balancing_loss(logits, 6, 2)
    torch.testing.assert_close(ours, load_balancing_loss_func(tuple(logits), 6, 2))


@pytest.mark.parametrize("layout", ["qwen3_moe", "mixtral"])
def test_decoder_aux_loss_equals_transformers(layout, tmp_path):
    ref = saved_by_transformers(layout, tmp_path)
    loaded, config = load_model(tmp_path)
    model = Decoder(config.replace(output_router_logits=True))
    model.load_state_dict(loaded.state_dict())
    ids_T = torch.randint(0, VOCAB, (13,), generator=torch.Generator().manual_seed(3))
    model.train()
    model(ids_T, torch.arange(13))
    ours = moe.take_aux_loss(model)
    with torch.no_grad():
        expected = ref.config.router_aux_loss_coef * ref(ids_T[None], output_router_logits=True).aux_loss
    torch.testing.assert_close(ours.detach(), expected, rtol=1e-5, atol=1e-7)


def test_aux_loss_taken_only_in_training_when_asked():
    config = tiny_config(VOCAB, arch="qwen3_moe", hidden_size=32, layers=2, output_router_logits=True)
    model = moe_model(config)
    ids = torch.randint(0, VOCAB, (10,))
    pos = torch.arange(10)
    model.eval()
    model(ids, pos)
    assert moe.take_aux_loss(model) is None
    model.train()
    model(ids, pos)
    aux = moe.take_aux_loss(model)
    assert aux is not None and aux.requires_grad and aux.item() > 0
    aux.backward()
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0
    assert moe.take_aux_loss(model) is None  # taken once
    dense = moe_model(config.replace(output_router_logits=False)).train()
    dense(ids, pos)
    assert moe.take_aux_loss(dense) is None


def test_routing_records_and_mismatch():
    config = tiny_config(VOCAB, arch="mixtral", hidden_size=32, layers=2)
    model = moe_model(config).eval()
    ids, pos = torch.randint(0, VOCAB, (16,)), torch.arange(16)
    with torch.no_grad(), moe.record_routing(model) as a:
        model(ids, pos)
    with torch.no_grad(), moe.record_routing(model) as b:
        model(ids, pos)
    assert set(a.per_layer()) == {0, 1} and a.per_layer()[0].shape == (16, 2)
    assert moe.routing_mismatch(a, b) == 0.0
    with torch.no_grad():
        model.model.layers[0].mlp.gate.weight.mul_(-1)  # reversed preferences in layer 0
    with torch.no_grad(), moe.record_routing(model) as c:
        model(ids, pos)
    assert 0.3 <= moe.routing_mismatch(a, c) <= 0.5 + 1e-9  # layer 0 differs, layer 1 (mostly) not
    assert model.model.layers[0].mlp.record is None  # recording ends with the block


def test_config_errors_are_one_line():
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        tiny_config(VOCAB, arch="qwen3_moe", num_experts_per_tok=5)
    with pytest.raises(
        ValueError,
        match="only Qwen3MoeForCausalLM, MixtralForCausalLM, GptOssForCausalLM, OlmoeForCausalLM have experts",
    ):
        tiny_config(VOCAB, arch="qwen2", num_experts=4)
    with pytest.raises(ValueError, match="norm_topk_prob=True"):
        tiny_config(VOCAB, arch="mixtral", norm_topk_prob=False)
    with pytest.raises(ValueError, match="router_jitter_noise"):
        ModelConfig.from_hf({**tiny_config(VOCAB, arch="mixtral").to_hf(), "router_jitter_noise": 0.1})
    config = tiny_config(VOCAB, arch="qwen3_moe")
    with pytest.raises(ValueError, match="tp_size=1"):
        check_tp_size(config, 2)
