"""Rollout routes of mixture-of-experts models: the engine records each token's experts
(``RolloutEngineConfig.record_routes``) exactly as the trainer's model routes the same tokens, they
survive the HTTP transport, and routing replay (``moe.replay_routes``) routes to the given experts
with the router's own renormalised softmax weights, gradients reaching the router."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from areno.models import Decoder, moe, tiny_config
from areno.rollout.client import HTTPRolloutClient, InProcessRolloutClient
from areno.rollout.engine import RolloutEngine, RolloutEngineConfig
from areno.rollout.requests import routes_from_json, routes_to_json
from areno.rollout.server import build_engine, create_app
from areno.types import ROUTES_KEY, SamplingParams, TokenBatch, Trajectory
from areno.workflows.multi_turn import MultiTurnWorkflow
from tests.helpers.moe import saved_by_transformers
from tests.helpers.serving import serving

VOCAB = 61


def _model(arch: str = "qwen3_moe", vocab: int = VOCAB, **kw) -> Decoder:
    torch.manual_seed(0)
    config = tiny_config(vocab, arch=arch, hidden_size=32, layers=2, **kw)
    model = Decoder(config)
    return model


def _engine(model: Decoder, **kw) -> RolloutEngine:
    config = RolloutEngineConfig(device="cpu", num_blocks=64, block_size=4, seed=3, **kw)
    return RolloutEngine(copy.deepcopy(model), model.config, config=config)


@pytest.mark.parametrize("steps", [dict(decode_steps=1), dict(decode_steps=3, mixed_decode_min_rows=1)])
def test_engine_routes_equal_the_trainer_models_routes(steps):
    model = _model()
    engine = _engine(model, record_routes=True, prefill_chunk_size=3, **steps)
    prompts = [[5, 9, 17, 30, 41], [12, 7], [50, 51, 52, 53, 54, 55, 56, 57, 58], [5, 9, 17, 30, 41]]
    outs = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=7))
    L, K = 2, model.config.num_experts_per_tok
    for out in outs:
        ids = out.prompt_ids + out.output_ids
        routes = out.routes_TLK
        assert routes.dtype == torch.int16 and routes.shape == (len(ids), L, K)
        with torch.no_grad(), moe.record_routing(model) as record:
            model(torch.tensor(ids), torch.arange(len(ids)))
        own = record.stacked()
        assert torch.equal(routes[:-1].long(), own[:-1])  # every token the engine ran a forward for
        assert (routes[-1] == -1).all()  # the last sampled token has none
        assert routes_from_json(routes_to_json(routes)).equal(routes)
        # the engine steps in inference mode; its routes are normal tensors a workflow may write to
        assert not routes.is_inference()
        routes[-1] = -1


def test_engine_records_nothing_unless_asked():
    model = _model()
    (out,) = _engine(model).generate([[1, 2, 3]], SamplingParams(temperature=0, max_new_tokens=3))
    assert out.routes_TLK is None
    dense = _model(arch="qwen3")
    (out,) = _engine(dense, record_routes=True).generate([[1, 2, 3]], SamplingParams(temperature=0, max_new_tokens=3))
    assert out.routes_TLK is None


def test_routes_pack_into_the_batch():
    routes = torch.arange(5 * 2 * 2, dtype=torch.int16).reshape(5, 2, 2)
    a = Trajectory(prompt_ids=[1, 2], completion_ids=[3, 4, 5], logprobs=[0.0] * 3, versions=[0] * 3, reward=1.0)
    b = Trajectory(prompt_ids=[1], completion_ids=[6], logprobs=[0.0], versions=[0], reward=0.0, routes_TLK=routes[:2])
    a.routes_TLK = routes
    batch = TokenBatch.from_trajectories([b, a])
    packed = batch.extra[ROUTES_KEY]
    assert packed.shape == (7, 2, 2) and torch.equal(packed[2:], routes) and torch.equal(packed[:2], routes[:2])
    assert torch.equal(batch.select([1]).extra[ROUTES_KEY], routes)
    no_routes = TokenBatch.from_trajectories(
        [Trajectory(prompt_ids=[1], completion_ids=[2], logprobs=[0.0], versions=[0], reward=0.0), a]
    )
    assert (no_routes.extra[ROUTES_KEY][:2] == -1).all()


def _expert(block: moe.SparseMoE, e: int, x_D: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x_D, block.experts.gate_up_proj[e]).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, block.experts.down_proj[e])


@pytest.mark.parametrize(
    ("arch", "norm"), [("qwen3_moe", False), ("qwen3_moe", True), ("mixtral", True), ("olmoe", False)]
)
def test_replay_routes_to_the_given_experts_with_the_routers_weights(arch, norm):
    model = _model(arch, num_experts=4, num_experts_per_tok=2, norm_topk_prob=norm)
    block = model.model.layers[0].mlp
    holder = nn.ModuleList([block])
    x = torch.randn(6, 32, dtype=torch.float32)
    with torch.no_grad():
        own_out = block(x)
        own_ids = block.gate(x)[2]
    forced = (own_ids + 1) % 4  # a different expert set on every token
    forced[3] = -1  # no recorded route: the router's own top-k
    with moe.replay_routes(holder, forced[:, None]):
        out = block(x)
    assert block.replay_TK is None  # replay ends with the context
    probs = torch.softmax(F.linear(x, block.gate.weight), dim=-1, dtype=torch.float32)
    for t in range(6):
        if t == 3:
            torch.testing.assert_close(out[t], own_out[t], rtol=1e-5, atol=1e-6)  # GEMMs of other row counts
            continue
        w = probs[t, forced[t]]
        if norm:
            w = w / w.sum()
        want = sum(w[k] * _expert(block, int(forced[t, k]), x[t]) for k in range(2))
        torch.testing.assert_close(out[t], want, rtol=1e-5, atol=1e-6)
    out.sum().backward()
    assert block.gate.weight.grad is not None and block.gate.weight.grad.abs().sum() > 0


def test_route_mismatch_pairs_counts_sets_where_routed():
    a = torch.tensor([[[0, 1]], [[2, 3]], [[-1, -1]], [[1, 2]]], dtype=torch.int16)
    b = torch.tensor([[[1, 0]], [[2, 1]], [[0, 1]], [[3, 0]]])
    assert moe.route_mismatch_pairs(a, b, torch.tensor([True, True, True, False])) == (1, 2)


def test_routes_cross_the_server(tmp_path, char_tokenizer):
    """``areno serve`` returns the routes (base64 int16) and ``HTTPRolloutClient`` rebuilds them."""
    saved_by_transformers("qwen3_moe", tmp_path, vocab=len(char_tokenizer))
    char_tokenizer.save_pretrained(str(tmp_path))
    engine, tokenizer = build_engine(str(tmp_path), device="cpu", num_blocks=64, block_size=4, record_routes=True)
    params = [SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)] * 2
    (local, _) = engine.generate([[5, 9, 17]] * 2, params)

    async def agenerate():
        client = HTTPRolloutClient(base)
        try:
            return await client.agenerate_many([5, 9, 17], params), await client.agenerate([5, 9, 17], params[0])
        finally:
            await client.aclose()

    with serving(create_app(engine, tokenizer=tokenizer, model_name="tiny"), log_level="warning") as base:
        many, one = asyncio.run(agenerate())
    for out in [*many, one]:
        assert out.routes_TLK.dtype == torch.int16 and torch.equal(out.routes_TLK, local.routes_TLK)


def test_multi_turn_episode_carries_every_turns_routes(char_tokenizer):
    model = _model(vocab=len(char_tokenizer))
    engine = _engine(model, record_routes=True)
    client = InProcessRolloutClient(engine)
    never = lambda prompt, completion, answer, **fields: 0.0
    wf = MultiTurnWorkflow(char_tokenizer, never, SamplingParams(max_new_tokens=3), max_turns=3, feedback="No.")
    try:
        (traj,) = asyncio.run(wf.run_episode(client, {"prompt": "1+1=", "answer": 2}))
    finally:
        client.close()
    assert traj.info["num_turns"] == 3
    ids = traj.prompt_ids + traj.completion_ids
    with torch.no_grad(), moe.record_routing(model) as record:
        model(torch.tensor(ids), torch.arange(len(ids)))
    assert traj.routes_TLK.shape[0] == len(ids)
    assert torch.equal(traj.routes_TLK[:-1].long(), record.stacked()[:-1])


def test_a_multi_turn_episode_across_a_policy_sync_carries_its_last_requests_routes(char_tokenizer):
    """A sync between two turns changes the prefix's routes when the next turn runs it again: the routes
    the later tokens were sampled after are that request's, for the whole sequence (the earlier turn's
    rows, kept, replayed the newest tokens after another prefix's routes)."""
    model = _model(vocab=len(char_tokenizer))
    engine = _engine(model, record_routes=True)
    client = InProcessRolloutClient(engine)
    never = lambda prompt, completion, answer, **fields: 0.0
    new = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in new.named_parameters():
            if name.endswith("mlp.gate.weight"):  # the routers: other experts win
                p.copy_(torch.randn_like(p) * 3)

    def feedback(completion, answer):  # between turns 1 and 2: the trainer's next policy arrives
        if engine.version == 0:
            engine.update_weights(new.state_dict().items(), version=1)
        return "No."

    wf = MultiTurnWorkflow(char_tokenizer, never, SamplingParams(max_new_tokens=3), max_turns=2, feedback=feedback)
    try:
        (traj,) = asyncio.run(wf.run_episode(client, {"prompt": "1+1=", "answer": 2}))
    finally:
        client.close()
    assert traj.info["num_turns"] == 2 and set(traj.versions) == {-1, 0, 1}
    ids = traj.prompt_ids + traj.completion_ids
    with torch.no_grad(), moe.record_routing(new) as record:
        new(torch.tensor(ids), torch.arange(len(ids)))
    with torch.no_grad(), moe.record_routing(model) as old:
        model(torch.tensor(ids), torch.arange(len(ids)))
    assert not torch.equal(record.stacked()[:-1], old.stacked()[:-1])  # the sync did move the routes
    assert torch.equal(traj.routes_TLK[:-1].long(), record.stacked()[:-1])
