"""Prefill CUDA graphs (``rollout/prefill_graph.py``): the graph's inputs, padding and key
gathering give the eager engine's tokens. On CPU the capture is emulated (``eager_runner``) and
the flash varlen call replaced by a per-sequence reference; on a GPU both are real."""

import pytest
import torch
import torch.nn.functional as F

from areno.rollout import attention as rollout_attention
from areno.rollout.graph_shapes import padded_prefill_batch, padded_prefill_tokens
from areno.rollout.prefill_graph import MAX_GRAPHS, PrefillGraphRunner
from areno.types import SamplingParams
from tests.helpers.rollout import (
    GREEDY,
    SEEDED,
    drive_arrivals,
    engine,
    make_model,
    random_prompts,
    same,
    sampled_mix,
)


def reference_varlen(q_THD, k_LKD, v_LKD, cu_q, cu_k, max_q, max_k, window, *, has_gqa, has_window):
    """``varlen_causal`` per sequence: queries aligned to the end of their keys; no key: 0."""
    out = torch.zeros_like(q_THD)
    for b in range(cu_q.numel() - 1):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        nq, nk = q1 - q0, k1 - k0
        assert nq <= max_q and nk <= max_k
        if nq == 0 or nk == 0:
            continue
        qpos = torch.arange(nq) + nk - nq
        kpos = torch.arange(nk)
        mask = kpos[None, :] <= qpos[:, None]
        if window is not None:
            mask &= kpos[None, :] > qpos[:, None] - window
        seen = mask.any(1)
        o = F.scaled_dot_product_attention(
            q_THD[q0:q1].transpose(0, 1), k_LKD[k0:k1].transpose(0, 1), v_LKD[k0:k1].transpose(0, 1),
            attn_mask=mask, enable_gqa=True,
        ).transpose(0, 1)  # fmt: skip
        out[q0:q1][seen] = o[seen]
    return out


@pytest.fixture()
def emulated(monkeypatch):
    monkeypatch.setattr(rollout_attention, "varlen_causal", reference_varlen)
    monkeypatch.setattr("areno.rollout.prefill_graph.CAPTURE_AT", 1)


def test_a_shape_is_captured_when_it_recurs(monkeypatch):
    """The first step of a shape runs eagerly; the next one captures it; later ones replay."""
    monkeypatch.setattr(rollout_attention, "varlen_causal", reference_varlen)
    model = make_model(0)
    eng = with_prefill_graphs(engine(model, 4, graphs=True))
    prompts = random_prompts(4, seed=67, lo=5, hi=9)
    p = SamplingParams(temperature=0, max_new_tokens=3)
    ref = engine(model, 4).generate(prompts, p)
    for replays in (0, 1, 2):
        same(eng.generate(prompts, p), ref)
        assert eng.stats()["prefill_graph_steps"] == replays
    assert len(eng._stepper.prefill_graphs._graphs) == 1


def with_prefill_graphs(eng):
    eng._stepper.prefill_graphs = PrefillGraphRunner(eng._graphs)
    return eng


def test_padded_prefill_shapes():
    assert [padded_prefill_tokens(n) for n in (1, 256, 257, 385, 513, 1408, 1537, 4096)] == [
        256, 256, 384, 512, 768, 1536, 2048, 4096,
    ]  # fmt: skip
    assert [padded_prefill_batch(n) for n in (1, 2, 3, 8, 9, 64, 65)] == [1, 2, 4, 8, 16, 64, 128]


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_prefill_graphs_give_the_eager_engines_tokens_on_cpu(emulated, decode_steps):
    """Groups of samples sharing a prompt (the prefix cache: chunks after a cached prefix), prompts
    longer than a chunk (prefill steps that sample nothing, then a last chunk), greedy and seeded."""
    model = make_model(0)
    prompts = random_prompts(5, seed=61, lo=3, hi=30)
    prompts = [p for p in prompts for _ in range(3)]  # groups of three
    for params in (GREEDY, SEEDED):
        ref = engine(model, decode_steps).generate(prompts, params)
        eng = with_prefill_graphs(engine(model, decode_steps, graphs=True))
        got = eng.generate(prompts, params)
        same(got, ref)
        stats = eng.stats()
        assert stats["prefill_graph_steps"] >= 1
        assert stats["prefix_hit_rate"] > 0
    # a long prompt alone: three chunk steps that sample nothing, each after the cached chunks before it
    long = random_prompts(1, seed=62, lo=30, hi=31)
    eng = with_prefill_graphs(engine(model, decode_steps, graphs=True))
    same(eng.generate(long, GREEDY), engine(model, decode_steps).generate(long, GREEDY))
    assert eng.stats()["prefill_graph_steps"] == 4


def test_mixed_steps_through_prefill_graphs_give_the_eager_engines_tokens(emulated):
    """Requests arriving while others decode: their chunks and the decode rows (one-token chunks
    over their whole context) in one graph replay; sampled rows of every kind."""
    model = make_model(0)
    prompts = random_prompts(10, seed=66, lo=3, hi=20)
    params = sampled_mix(10, (9, 17))

    ref = drive_arrivals(engine(model, 1, eos=(9, 17)), prompts, params, every=2, per=2)
    eng = with_prefill_graphs(engine(model, 1, graphs=True, eos=(9, 17)))
    same(drive_arrivals(eng, prompts, params, every=2, per=2), ref)
    assert eng.stats()["mixed_steps"] >= 4 and eng.stats()["prefill_graph_steps"] >= 4


def test_prefill_graph_keeps_the_scratch_block_finite_and_live_blocks_untouched(emulated):
    """Padding tokens write only the scratch block; what they write there is finite (a NaN there
    would reach gathered decode rows through their masked keys)."""
    model = make_model(0)
    eng = with_prefill_graphs(engine(model, 1, graphs=True))
    eng.generate(random_prompts(3, seed=63, lo=5, hi=9), SamplingParams(temperature=0, max_new_tokens=2))
    bs, scratch = eng.cache.block_size, eng.cache.scratch_block
    for k_S, v_S in zip(eng.cache.k_S, eng.cache.v_S):
        assert k_S[scratch * bs : (scratch + 1) * bs].isfinite().all()
        assert v_S[scratch * bs : (scratch + 1) * bs].isfinite().all()
        assert k_S.isfinite().all() and v_S.isfinite().all()


def test_prefill_graph_cap_and_decode_rows_run_eagerly(emulated, monkeypatch):
    """Past ``MAX_GRAPHS`` shapes a step with prompt chunks runs eagerly."""
    monkeypatch.setattr("areno.rollout.prefill_graph.MAX_GRAPHS", 1)
    model = make_model(0)
    eng = with_prefill_graphs(engine(model, 1, graphs=True))
    p = SamplingParams(temperature=0, max_new_tokens=3)
    same(eng.generate([[5, 6, 7]], p), engine(model, 1).generate([[5, 6, 7]], p))
    assert eng.stats()["prefill_graph_steps"] == 1
    # six sequences a step: another padded batch size, so another shape; over the cap of one: eager
    prompts = random_prompts(12, seed=64, lo=24, hi=26)
    same(eng.generate(prompts, p), engine(model, 1).generate(prompts, p))
    assert len(eng._stepper.prefill_graphs._graphs) == 1
    assert MAX_GRAPHS > 1


def test_prefill_graph_runner_refuses_what_flash_cannot_serve():
    eng = engine(make_model(0), 1)
    assert "16-bit" in PrefillGraphRunner.supported(eng)
    eng.tp_size = 2
    assert "tensor-parallel" in PrefillGraphRunner.supported(eng)
    # a mixture of experts in bf16 off a Hopper GPU: its captured experts would run densely
    model, cfg = make_model(0, arch="qwen3_moe", num_experts=4)
    moe = engine((model.to(torch.bfloat16), cfg), 1)
    assert "mixture of experts" in PrefillGraphRunner.supported(moe)


def test_prefill_graph_runner_refuses_experts_the_grouped_gemm_cannot_take(monkeypatch):
    """On a Hopper GPU in bf16 a mixture of experts prefills in a graph only where ``grouped_mm_experts`` serves
    its widths (multiples of 8): a captured block of other widths would run every expert over every token."""
    import types

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))

    def reason(moe_width: int) -> str | None:
        model, cfg = make_model(0, arch="qwen3_moe", num_experts=4, moe_intermediate_size=moe_width)
        fake = types.SimpleNamespace(
            cache=types.SimpleNamespace(dtype=torch.bfloat16, head_dim=8),
            sliding_window=None,
            model_config=cfg,
            device=torch.device("cuda", 0),
            model=model.to(torch.bfloat16),
        )
        return PrefillGraphRunner.supported(fake)

    assert reason(16) is None
    assert "multiples of 8" in reason(12)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen2", "olmo3"])  # olmo3: a 6-key window in layer 0, layer 1 in full
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_graphs_match_eager_on_gpu(dtype, arch):
    from areno.rollout.engine import RolloutEngine, RolloutEngineConfig

    model, cfg = make_model(0, **({"arch": arch, "sliding_window": 6} if arch == "olmo3" else {}))
    model = model.to(device="cuda", dtype=dtype)
    prompts = [p for p in random_prompts(6, seed=65, lo=3, hi=40) for _ in range(4)]
    outs, stats = {}, {}
    for prefill_graphs in (False, True):
        eng = RolloutEngine(
            model,
            cfg,
            config=RolloutEngineConfig(
                block_size=4, num_blocks=512, prefill_chunk_size=16, prefill_cuda_graphs=prefill_graphs
            ),
            eos_token_ids=(),
        )
        params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
        eng.generate(prompts, params)  # the prefill shapes' first sightings (run eagerly)
        outs[prefill_graphs] = eng.generate(prompts, params)
        stats[prefill_graphs] = eng.stats()
        for k_S in eng.cache.k_S + eng.cache.v_S:
            assert k_S.isfinite().all()
    assert stats[True]["prefill_graph_steps"] >= 1 and stats[False]["prefill_graph_steps"] == 0
    assert [o.output_ids for o in outs[True]] == [o.output_ids for o in outs[False]]
    for a, b in zip(outs[True], outs[False]):
        torch.testing.assert_close(a.output_logprobs, b.output_logprobs, rtol=0, atol=0.05)
