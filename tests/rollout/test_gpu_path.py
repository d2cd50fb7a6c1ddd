"""The CUDA-graph decode path: its metadata builder on CPU, and the full path on a GPU."""

import pytest
import torch

from areno.api.types import SamplingParams
from areno.rollout.attention import PagedAttention, SeqChunk
from areno.rollout.cuda_graph import padded_batch_size, padded_num_blocks
from areno.rollout.kv_cache import KVCache
from tests.rollout.conftest import make_model, random_prompts


def test_static_decode_metadata_matches_eager_builder():
    torch.manual_seed(0)
    cache = KVCache(num_layers=1, num_blocks=10, block_size=4, num_kv_heads=2, head_dim=8,
                    dtype=torch.float32, device=torch.device("cpu"))
    cache.k_S[0].normal_()
    cache.v_S[0].normal_()
    chunks = [SeqChunk(block_table=[3, 1, 7], start=9, num_new=1), SeqChunk(block_table=[2], start=0, num_new=1),
              SeqChunk(block_table=[5, 6], start=4, num_new=1)]
    q, k, v = torch.randn(3, 4, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    for window in (None, 3):
        k0, v0 = cache.k_S[0].clone(), cache.v_S[0].clone()
        eager = PagedAttention.build(cache, chunks, torch.device("cpu"), window)(0, q, k, v)
        cache.k_S[0].copy_(k0), cache.v_S[0].copy_(v0)
        # Padded like the graph runner: 4 rows of 4 blocks, padding in the scratch block.
        s = cache.scratch_block
        bt = torch.tensor([[3, 1, 7, s], [2, s, s, s], [5, 6, s, s], [s, s, s, s]])
        ctx = torch.tensor([10, 1, 5, 1])
        qp = torch.cat([q, torch.zeros(1, 4, 8)])
        kp, vp = torch.cat([k, torch.zeros(1, 2, 8)]), torch.cat([v, torch.zeros(1, 2, 8)])
        static = PagedAttention.for_decode(cache, bt, ctx, window)(0, qp, kp, vp)
        torch.testing.assert_close(static[:3], eager)
        assert torch.equal(cache.k_S[0][: s * 4], k0[: s * 4].index_copy(0, torch.tensor([7 * 4 + 1, 2 * 4, 6 * 4]), k))
        cache.k_S[0].copy_(k0), cache.v_S[0].copy_(v0)


def test_padding_buckets():
    assert [padded_batch_size(n) for n in (1, 2, 3, 4, 5, 9, 16, 17)] == [1, 2, 4, 4, 8, 16, 16, 24]
    assert [padded_num_blocks(n) for n in (1, 2, 3, 5, 16, 17, 33)] == [1, 2, 4, 8, 16, 32, 48]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphs_match_eager_on_gpu(dtype):
    from areno.rollout.engine import RolloutEngine, RolloutEngineConfig

    model, cfg = make_model(0)
    model = model.to(device="cuda", dtype=dtype)
    prompts = random_prompts(11, seed=40)
    params = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
    outs = {}
    for graphs, k in ((False, 1), (False, None), (True, None)):  # None: the CUDA default, multi-step
        eng = RolloutEngine(model, cfg, config=RolloutEngineConfig(block_size=4, num_blocks=256, cuda_graphs=graphs,
                                                                   decode_steps=k), eos_token_ids=())
        if k == 1:
            one_step = eng.generate(prompts, params)
            continue
        outs[graphs] = eng.generate(prompts, params)
        seeded = SamplingParams(temperature=1.0, max_new_tokens=20, ignore_eos=True, seed=5)
        outs[(graphs, "seeded")] = eng.generate(prompts[:3], seeded)
    assert [o.output_ids for o in outs[True]] == [o.output_ids for o in outs[False]]
    if dtype == torch.float32:  # k = 8 reserves blocks ahead: other padded key widths, bf16 rounding may differ
        assert [o.output_ids for o in outs[False]] == [o.output_ids for o in one_step]
    assert [o.output_ids for o in outs[(True, "seeded")]] == [o.output_ids for o in outs[(False, "seeded")]]
    if dtype == torch.float32:
        from tests.rollout.conftest import naive_greedy

        cpu_model, _ = make_model(0)
        for p, o in zip(prompts, outs[True]):
            assert o.output_ids == naive_greedy(cpu_model, p, 20)[0]


@pytest.mark.gpu
def test_warmup_captures_every_bucket_then_generation_reuses_them():
    from areno.rollout.engine import RolloutEngine, RolloutEngineConfig

    model, cfg = make_model(0)
    eng = RolloutEngine(model.cuda(), cfg, config=RolloutEngineConfig(block_size=4, num_blocks=256), eos_token_ids=())
    # Batch bucket 8; 10 blocks -> widths 1, 2, 4, 8, 16; one-step graphs and 8-step greedy loops.
    n = eng.warmup_cuda_graphs([5], max_len=40)
    assert n == 10
    eng.generate(random_prompts(5, seed=41, lo=4, hi=10), SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True))
    assert len(eng._graphs._graphs) == 5 and len(eng._graphs._loops) == 5


class _EagerReplay:
    """Stands in for a CUDA graph on CPU: ``replay()`` runs the captured function again and copies
    its results into the outputs the capture returned."""

    def __init__(self, fn, out) -> None:
        self.fn, self.out = fn, out

    def replay(self) -> None:
        new = self.fn()
        for dst, src in zip(*((self.out, new) if isinstance(self.out, tuple) else ((self.out,), (new,)))):
            dst.copy_(src)


@pytest.mark.parametrize("decode_steps,mode", [(1, "mixed"), (4, "mixed"), (4, "greedy_eos")])
def test_graph_runner_inputs_on_cpu(decode_steps, mode):
    """The graph runner's static inputs (block-table rows from the scheduler's tensor, padding rows,
    ids and context lengths, advanced in place by a multi-step decode; the greedy k-step loop with
    its stop ids and length limits) give the eager one-step engine's tokens, with requests joining
    and leaving. Capture is emulated by re-running the recorded function."""
    from areno.rollout.cuda_graph import DecodeGraphRunner
    from areno.rollout.engine import RolloutEngine, RolloutEngineConfig

    class EagerRunner(DecodeGraphRunner):
        def _record(self, fn):
            out = fn()
            return _EagerReplay(fn, out), out

    model, cfg = make_model(0)
    prompts = random_prompts(13, seed=42)
    lengths = [5 + 3 * i for i in range(13)]  # requests finish at different steps
    params = [SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=mode == "mixed") for n in lengths]
    eos = ()
    if mode == "mixed":  # seeded sampling rows too: their noise depends on (seed, tokens generated) only
        params[1::3] = [SamplingParams(temperature=0.8, top_k=10, max_new_tokens=n, ignore_eos=True, seed=n)
                        for n in lengths[1::3]]
    else:  # all greedy: the k-step loop graph, with an EOS that ends some requests early
        eos = (17,)
    outs = {}
    for graphs in (False, True):
        eng = RolloutEngine(model, cfg, config=RolloutEngineConfig(
            block_size=4, num_blocks=64, max_num_seqs=6, max_model_len=70, decode_steps=decode_steps if graphs else 1),
            eos_token_ids=eos)
        if graphs:
            eng._graphs = EagerRunner(eng, max_batch=6)
        outs[graphs] = eng.generate(prompts, params)
        if graphs:
            assert eng._graphs._graphs or eng._graphs._loops, "the graph path was never taken"
            assert mode != "greedy_eos" or eng._graphs._loops, "the k-step loop graph was never taken"
            assert eng.scheduler.block_tables_RN.eq(eng.cache.scratch_block).all()  # every row released
    assert [o.output_ids for o in outs[True]] == [o.output_ids for o in outs[False]]
    assert [o.finish_reason for o in outs[True]] == [o.finish_reason for o in outs[False]]
    if mode == "greedy_eos":
        assert {o.finish_reason for o in outs[True]} == {"stop", "length"}
    for a, b in zip(outs[True], outs[False]):
        torch.testing.assert_close(a.output_logprobs, b.output_logprobs, rtol=0, atol=1e-5)


def test_grouped_gqa_decode_matches_enable_gqa(monkeypatch):
    """The CUDA decode layout (KV heads x query groups, no enable_gqa) computes the same attention."""
    torch.manual_seed(1)
    cache = KVCache(num_layers=1, num_blocks=10, block_size=4, num_kv_heads=2, head_dim=8,
                    dtype=torch.float32, device=torch.device("cpu"))
    cache.k_S[0].normal_()
    cache.v_S[0].normal_()
    chunks = [SeqChunk(block_table=[3, 1, 7], start=9, num_new=1), SeqChunk(block_table=[2], start=0, num_new=1),
              SeqChunk(block_table=[5, 6], start=3, num_new=4)]
    q, k, v = torch.randn(6, 6, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 8)  # 3 query heads per KV head
    outs = {}
    for grouped in (False, True):
        monkeypatch.setattr(PagedAttention, "GROUPED_DECODE", grouped)
        k0, v0 = cache.k_S[0].clone(), cache.v_S[0].clone()
        outs[grouped] = PagedAttention.build(cache, chunks, torch.device("cpu"))(0, q, k, v)
        cache.k_S[0].copy_(k0), cache.v_S[0].copy_(v0)
    torch.testing.assert_close(outs[True], outs[False], rtol=0, atol=1e-6)

    model, cfg = make_model(0)
    from areno.rollout.engine import RolloutEngine, RolloutEngineConfig

    prompts = random_prompts(7, seed=43)
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    res = {}
    for grouped in (False, True):
        monkeypatch.setattr(PagedAttention, "GROUPED_DECODE", grouped)
        eng = RolloutEngine(model, cfg, config=RolloutEngineConfig(block_size=4, num_blocks=128), eos_token_ids=())
        res[grouped] = eng.generate(prompts, params)
    assert [o.output_ids for o in res[True]] == [o.output_ids for o in res[False]]
    for a, b in zip(res[True], res[False]):
        torch.testing.assert_close(a.output_logprobs, b.output_logprobs, rtol=0, atol=1e-5)
