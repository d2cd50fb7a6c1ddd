"""The rollout engine with fused q/k/v and gate/up projections (``RolloutEngineConfig.fused_projections``):
same tokens and log-probs as the per-projection engine, and every way weights reach an engine
(``update_weights``, ``update_weights_from_disk``, staged / swap / in-place policy sync) writes
the fused storage, so the fused forward (and a captured decode graph) serves the new policy."""

from __future__ import annotations

import pytest
import torch

from areno.models.hf_io import save_model
from areno.rollout.engine import RolloutEngine, RolloutEngineConfig
from areno.types import SamplingParams
from tests.helpers.rollout import ARCHS, SEEDED, eager_runner, model_of, random_prompts, run, sync_into


def engine_of(model, cfg, fused: bool, **kw) -> RolloutEngine:
    config = RolloutEngineConfig(
        block_size=4,
        num_blocks=96,
        max_num_seqs=5,
        max_model_len=80,
        prefill_chunk_size=8,
        fused_projections=fused,
        **kw,
    )
    return RolloutEngine(model, cfg, config=config, eos_token_ids=())


def assert_same(a, b) -> None:
    assert a[0] == b[0]
    for x, y in zip(a[1], b[1]):
        torch.testing.assert_close(torch.tensor(x), torch.tensor(y), rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_engine_equals_unfused_engine(arch):
    """Greedy and seeded sampling, chunked prefill and continuous batching (5 slots, 9 requests)."""
    prompts = random_prompts(9, seed=3, hi=30)
    fused_model, cfg = model_of(arch)
    plain_model, _ = model_of(arch)
    fused, plain = engine_of(fused_model, cfg, True), engine_of(plain_model, cfg, False)
    assert fused_model.projections_fused and not plain_model.projections_fused
    assert_same(run(fused, prompts), run(plain, prompts))
    assert_same(run(fused, prompts[:4], SEEDED), run(plain, prompts[:4], SEEDED))
    # weight_tensors() hands out the fused views under the HF names.
    live = fused.weight_tensors()
    a = fused_model.model.layers[1].self_attn
    assert live["model.layers.1.self_attn.k_proj.weight"] is a.k_proj.weight
    assert (
        live["model.layers.1.self_attn.k_proj.weight"].untyped_storage().data_ptr()
        == a.qkv.weight.untyped_storage().data_ptr()
    )
    assert live.keys() == plain.weight_tensors().keys()


def test_fused_flag_validated_and_false_unfuses():
    with pytest.raises(ValueError, match="rollout.fused_projections: must be true or false"):
        RolloutEngineConfig(fused_projections="yes")
    model, cfg = model_of("qwen2")
    engine_of(model, cfg, True)
    assert model.projections_fused
    engine_of(model, cfg, False)
    assert not model.projections_fused


@pytest.mark.parametrize("arch", ARCHS)
def test_update_weights_on_fused_engine(arch):
    """``update_weights`` (a subset, then all) on a fused engine serves what an unfused engine
    loaded with the same tensors serves; the new values sit in the fused tensors."""
    prompts = random_prompts(4, seed=8)
    model, cfg = model_of(arch)
    fused = engine_of(model, cfg, True)
    run(fused, prompts)
    new_model, _ = model_of(arch, seed=7)
    new = new_model.state_dict()
    subset = [(n, t) for n, t in new.items() if ".self_attn.v_proj." in n or "mlp.up_proj" in n]
    fused.update_weights(subset, version=1)
    partial, _ = model_of(arch)
    partial.load_state_dict({**partial.state_dict(), **dict(subset)})
    assert_same(run(fused, prompts), run(engine_of(partial, cfg, False), prompts))
    fused.update_weights(new.items(), version=2)
    assert model.projections_fused
    a, m = model.model.layers[0].self_attn, model.model.layers[0].mlp
    q_rows = a.q_proj.weight.shape[0]
    assert torch.equal(a.qkv.weight[:q_rows], new["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(m.gate_up.weight[m.gate_proj.weight.shape[0] :], new["model.layers.0.mlp.up_proj.weight"])
    ref, _ = model_of(arch, seed=7)
    assert_same(run(fused, prompts), run(engine_of(ref, cfg, False), prompts))


def test_update_weights_from_disk_on_fused_engine(tmp_path):
    prompts = random_prompts(4, seed=9)
    model, cfg = model_of("qwen2")
    fused = engine_of(model, cfg, True)
    new_model, _ = model_of("qwen2", seed=4)
    save_model(new_model, cfg, tmp_path / "new")
    fused.update_weights_from_disk(str(tmp_path / "new"), version=3)
    assert fused.version == 3 and model.projections_fused
    ref, _ = model_of("qwen2", seed=4)
    assert_same(run(fused, prompts), run(engine_of(ref, cfg, False), prompts))


@pytest.mark.parametrize("commit", ["staged", "swap", "inplace"])
def test_policy_sync_into_fused_engine(commit):
    """``engine_receiver`` (the transports' receiving end) into a fused engine: staged copies, swap
    (falls back to copying for the fused views: they share storage) and in-place writes all land
    in the fused storage; the engine then serves the new weights."""
    prompts = random_prompts(4, seed=10)
    model, cfg = model_of("qwen2")
    fused = engine_of(model, cfg, True)
    run(fused, prompts)
    new = model_of("qwen2", seed=6)[0].state_dict()
    qkv_storage = model.model.layers[1].self_attn.qkv.weight.data_ptr()
    sync_into(fused, new, commit)
    assert fused.version == 1 and not fused.is_paused
    assert model.projections_fused and model.model.layers[1].self_attn.qkv.weight.data_ptr() == qkv_storage
    for name, t in fused.weight_tensors().items():
        assert torch.equal(t, new[name]), name
    ref, _ = model_of("qwen2", seed=6)
    assert_same(run(fused, prompts), run(engine_of(ref, cfg, False), prompts))


@pytest.mark.parametrize("decode_attention", ["gather", "paged"])
def test_graph_runner_emulation_with_fused_projections(decode_attention):
    """The CUDA-graph runner's static path (k-step loop, capture emulated on CPU by re-running
    the recorded function) over a fused model gives the unfused eager engine's tokens, before and
    after an in-place weight update (the "graphs" keep reading the same fused storage)."""
    prompts = random_prompts(7, seed=12)
    params = [SamplingParams(temperature=0, max_new_tokens=5 + i, ignore_eos=True) for i in range(7)]
    outs = {}
    for fused in (True, False):
        model, cfg = model_of("qwen2")
        eng = engine_of(model, cfg, fused, decode_steps=4 if fused else 1, decode_attention=decode_attention)
        if fused:
            eng._graphs = eager_runner(eng, max_batch=5)
        before = run(eng, prompts, params)
        eng.update_weights(model_of("qwen2", seed=2)[0].state_dict().items(), version=1)
        outs[fused] = (before, run(eng, prompts, params))
        if fused:
            assert eng._graphs._loops, "the k-step loop graph was never taken"
    for a, b in zip(outs[True], outs[False]):
        assert_same(a, b)
    assert outs[True][0][0] != outs[True][1][0]  # the update changed what is served


# ------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ARCHS)
def test_fused_engine_equals_unfused_engine_bf16_on_gpu(arch):
    """bf16 on CUDA with graphs, the paged kernel and the fused kernels: the fused engine's
    log-probs stay within bf16 rounding of the unfused engine's and greedy tokens agree until a
    near-tie parts them (the GEMM's reduction order may change with the fused width); after a
    weight update both serve the new weights alike."""
    prompts = random_prompts(16, seed=13, hi=40)
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    res = {}
    for fused in (True, False):
        model, cfg = model_of(arch)
        model = model.to("cuda", torch.bfloat16)
        eng = RolloutEngine(
            model,
            cfg,
            config=RolloutEngineConfig(
                block_size=16, num_blocks=256, max_num_seqs=16, max_model_len=128, fused_projections=fused
            ),
            eos_token_ids=(),
        )
        outs = eng.generate(prompts, params)
        eng.update_weights(model_of(arch, seed=5)[0].state_dict().items(), version=1)
        after = eng.generate(prompts, params)
        res[fused] = (outs, after)
        assert model.projections_fused == fused
    for a_list, b_list in zip(res[True], res[False]):
        same = sum(a.output_ids == b.output_ids for a, b in zip(a_list, b_list))
        assert same >= 12, f"only {same}/16 sequences identical"  # a bf16 near-tie may part a few
        for a, b in zip(a_list, b_list):
            n = next((i for i, (x, y) in enumerate(zip(a.output_ids, b.output_ids)) if x != y), len(a.output_ids))
            # Up to where they part (inclusive: same context), the log-probs agree to bf16 rounding.
            m = min(n + 1, len(a.output_ids))
            torch.testing.assert_close(
                torch.tensor(a.output_logprobs[:m]), torch.tensor(b.output_logprobs[:m]), rtol=0, atol=5e-2
            )
