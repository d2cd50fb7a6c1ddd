"""Compiled decoder layers (``train.compile``, scope ``layers``) share their graphs across depth: a layer reads nothing
per layer that dynamo would specialise on (its index, a routing record's contents, a per-expert count), so a deep
model compiles as many graphs as a shallow one. Past dynamo's recompile limit (8) every further layer ran eagerly,
flex attention included (which then materialises every score)."""

from __future__ import annotations

import pytest
import torch

from areno.models import Decoder, PackedCausalAttention, attention, compiled, moe, tiny_config
from areno.train.parallelize import apply_compile

VOCAB = 128


def _graphs(arch: str, layers: int) -> tuple[int, int]:
    """(graphs dynamo compiled for a forward, more graphs for a second forward under ``record_routing``)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = tiny_config(VOCAB, hidden_size=64, layers=layers, heads=4, kv_heads=2, arch=arch)
    model = Decoder(config)
    cu_B1 = torch.tensor([0, 12, 30])
    ids_T = torch.randint(0, VOCAB, (30,))
    pos_T = torch.cat([torch.arange(12), torch.arange(18)])
    with torch.no_grad(), moe.record_routing(model) as eager_record:
        eager_TV = model(ids_T, pos_T, PackedCausalAttention.for_model(cu_B1, config))
    graphs = []
    apply_compile(model, backend=lambda gm, inputs: graphs.append(gm) or gm.forward, scope="layers")
    with torch.no_grad():
        model(ids_T, pos_T, PackedCausalAttention.for_model(cu_B1, config))
        plain = len(graphs)
        with moe.record_routing(model) as record:
            compiled_TV = model(ids_T, pos_T, PackedCausalAttention.for_model(cu_B1, config))
    torch.testing.assert_close(compiled_TV, eager_TV)
    if moe.sparse_blocks(model):  # the eager breaks recorded every sparse layer's routes, as an eager forward does
        assert torch.equal(record.stacked(), eager_record.stacked())
    return plain, len(graphs) - plain


@pytest.mark.parametrize("arch", ["gemma2", "olmo3", "gpt_oss", "qwen2_moe", "glm4_moe"])
def test_a_deep_model_compiles_as_many_graphs_as_a_shallow_one(arch):
    # gemma2 / gpt_oss: every other layer slides; olmo3: three of four, with their own RoPE; the MoE
    # families: sparse blocks (glm4_moe after dense ones) recording their routes
    shallow, deep = _graphs(arch, 4), _graphs(arch, 12)
    assert deep == shallow, (shallow, deep)
    assert deep[0] <= 5 and deep[1] <= 2, deep


def _step_kinds(device_type: str) -> int:
    """The forwards of a step with a reference model: the policy with grad and without (the proximal forward) and a
    frozen reference, at three token counts, over Gemma 3's sliding and full layers; attention as one mask tensor,
    as flex's block mask on CUDA. Returns the graphs compiled."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = tiny_config(VOCAB, hidden_size=64, layers=6, heads=4, kv_heads=2, arch="gemma3")
    policy, reference = Decoder(config), Decoder(config).requires_grad_(False)
    graphs = []
    for model in (policy, reference):
        backend = lambda gm, inputs: graphs.append(gm) or gm.forward
        apply_compile(model, backend=backend, scope="layers", device_type=device_type)
    for T in (30, 41, 57):
        cu_B1 = torch.tensor([0, T // 3, T])
        ids_T = torch.randint(0, VOCAB, (T,))
        pos_T = torch.cat([torch.arange(T // 3), torch.arange(T - T // 3)])
        for model, grad in ((policy, False), (reference, False), (policy, True)):
            with torch.set_grad_enabled(grad):
                out = model(ids_T, pos_T, PackedCausalAttention.for_model(cu_B1, config, impl="sdpa_mask"))
            if grad:
                out.float().sum().backward()
    return len(graphs)


def test_on_cuda_a_steps_kinds_of_forward_stay_compiled(monkeypatch):
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 8)
    monkeypatch.setattr(torch._dynamo.config, "fail_on_recompile_limit_hit", True)
    with pytest.raises(Exception, match="recompile_limit"):  # dynamo's default: the last kinds would run eagerly
        _step_kinds("cpu")
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 8)
    assert 8 < _step_kinds("cuda") <= 16
    assert torch._dynamo.config.recompile_limit == compiled.RECOMPILE_LIMIT


def test_the_compiled_flex_attention_allows_a_steps_kinds(monkeypatch):
    # eager layers on CUDA (train.compile=false) still compile flex: its masks (sliding or full), grad mode and
    # token counts multiply as the layers' kinds do
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 8)
    monkeypatch.setattr(attention, "_FLEX", None)
    attention._compiled_flex_attention()
    assert torch._dynamo.config.recompile_limit == compiled.RECOMPILE_LIMIT


@pytest.mark.parametrize("arch", ["qwen2_moe", "gpt_oss"])
@pytest.mark.parametrize("checkpointed", [False, True])
def test_compiled_sparse_layers_replay_record_and_backpropagate_as_eager_ones(arch, checkpointed):
    # the CPU experts (grouped_experts) and the routing record run behind compiled.call's graph break: the
    # gradients through them, the replayed routes and both records equal an eager model's; activation
    # checkpointing recomputes the compiled layers in backward under the same replay (RoutingMonitor.replaying)
    import copy

    from areno.train.parallelize import apply_activation_checkpointing

    torch._dynamo.reset()
    torch.manual_seed(0)
    config = tiny_config(VOCAB, hidden_size=64, layers=4, heads=4, kv_heads=2, arch=arch)
    eager = Decoder(config)
    model = copy.deepcopy(eager)
    if checkpointed:
        apply_activation_checkpointing(model)
    apply_compile(model, backend="aot_eager", scope="layers")
    cu_B1 = torch.tensor([0, 12, 30])
    ids_T = torch.randint(0, VOCAB, (30,))
    pos_T = torch.cat([torch.arange(12), torch.arange(18)])
    K, L = config.num_experts_per_tok, len(moe.sparse_blocks(eager))
    routes_TLK = torch.stack([torch.randperm(config.num_experts)[:K] for _ in range(30 * L)]).view(30, L, K)
    routes_TLK[::3] = -1  # those tokens keep their own top-k
    seen = []
    for m in (eager, model):
        with moe.replay_routes(m, routes_TLK):
            with moe.record_routing(m) as record:
                out_TV = m(ids_T, pos_T, PackedCausalAttention.for_model(cu_B1, config))
            out_TV.float().square().mean().backward()
        grads = {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
        seen.append((out_TV.detach(), record.stacked(), record.stacked(used=True), grads))
    (e_TV, e_own, e_used, e_grads), (c_TV, c_own, c_used, c_grads) = seen
    torch.testing.assert_close(c_TV, e_TV)
    assert torch.equal(c_own, e_own) and torch.equal(c_used, e_used)
    assert c_grads.keys() == e_grads.keys() and any("experts.gate_up_proj" in n for n in e_grads)
    for name, grad in e_grads.items():
        torch.testing.assert_close(c_grads[name], grad, msg=name)
