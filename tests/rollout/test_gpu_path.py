"""The CUDA-graph decode path: its metadata builder on CPU, and the full path on a GPU."""

import dataclasses

import pytest
import torch

from areno.rollout.attention import PagedAttention, SeqChunk
from areno.rollout.cuda_graph import graph_num_blocks, padded_batch_size, padded_num_blocks
from areno.rollout.kv_cache import KVCache
from areno.rollout.sampling import SampleMode
from areno.types import SamplingParams
from tests.helpers.rollout import eager_runner, make_model, naive_greedy, random_prompts, sampled_mix


def test_static_decode_metadata_matches_eager_builder():
    torch.manual_seed(0)
    cache = KVCache(
        num_layers=1,
        num_blocks=10,
        block_size=4,
        num_kv_heads=2,
        head_dim=8,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    cache.k_S[0].normal_()
    cache.v_S[0].normal_()
    chunks = [
        SeqChunk(block_table=[3, 1, 7], start=9, num_new=1),
        SeqChunk(block_table=[2], start=0, num_new=1),
        SeqChunk(block_table=[5, 6], start=4, num_new=1),
    ]
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
    assert [padded_batch_size(n) for n in (1, 2, 3, 4, 5, 9, 16, 17, 64, 65, 97, 256, 257, 300)] == [
        1,
        2,
        4,
        4,
        8,
        16,
        16,
        24,
        64,
        96,
        128,
        256,
        320,
        320,
    ]
    assert [padded_num_blocks(n) for n in (1, 2, 3, 5, 16, 17, 33)] == [1, 2, 4, 8, 16, 32, 48]
    assert [graph_num_blocks(n, paged=False) for n in (3, 17)] == [4, 32]
    assert [graph_num_blocks(n, paged=True) for n in (1, 17, 64, 65, 200)] == [64, 64, 64, 128, 256]


# LongRoPE over 3 turned frequencies, its original context past every prompt and its 20 new tokens
PHI4_MINI_ROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0, 2.3, 3.1],
    "long_factor": [2.0, 4.6, 6.2],
    "original_max_position_embeddings": 64,
}


@pytest.mark.gpu
# olmo3 / gemma3: a 6-key window in layer 0 only, layer 1 in full; qwen3 / gemma3: per-head q/k norms;
# ministral3: queries scaled by position (every 8 positions), past the fused RoPE kernels; gpt_oss: sinks in
# every attention path, a 6-key window in layer 0, biased experts in CUDA graphs; phi4_mini: 6 of 8 head
# dimensions turned by LongRoPE's short factors, past the fused RoPE kernels; glm4: adjacent pairs of half
# of each head turned, sandwich norms in the model dtype (past the fused add + norm kernels); gemma2: scores
# soft-capped in every decode path (the paged kernel's cap, no prefill graphs) and logits capped, a 6-key window
# in layer 0; granite: scaled embeddings, scores (q scaled: past the fused RoPE + KV kernel), block outputs (scaled
# before the fused add + norm, no split-K MLP partials) and logits; ernie4_5: adjacent pairs of whole heads turned
# in float32, biases on every projection; exaone4: a 6-key window in layer 0, layer 1 in full without RoPE (its
# q/k norms still applied), post-block norms in the model dtype; glm4_moe: the float32 sigmoid router's group
# choice and the shared expert in CUDA graphs; qwen2_moe: routed experts and the gated shared expert (its gate/up
# fused) in CUDA graphs; granitemoe: granite's multipliers around expert blocks in every layer (the grouped GEMMs
# in CUDA graphs); olmoe: experts in every layer, q, k and v clamped after q/k norms over the whole projections
@pytest.mark.parametrize(
    "arch",
    [
        "qwen2",
        "qwen3",
        "olmo3",
        "gemma3",
        "ministral3",
        "gpt_oss",
        "phi4_mini",
        "glm4",
        "gemma2",
        "granite",
        "ernie4_5",
        "exaone4",
        "glm4_moe",
        "qwen2_moe",
        "granitemoe",
        "olmoe",
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphs_match_eager_on_gpu(dtype, arch):
    from areno.rollout.engine import RolloutEngine, RolloutEngineConfig

    windowed = ("olmo3", "gemma3", "gpt_oss", "gemma2", "exaone4")
    kw = {"arch": arch, "sliding_window": 6} if arch in windowed else {"arch": arch}
    if arch == "phi4_mini":
        kw = {"arch": "phi3", "partial_rotary_factor": 0.75, "rope_scaling": PHI4_MINI_ROPE}
    if arch == "olmoe":  # a clamp that bites q (normed: about N(0, 1)) and v
        kw["clip_qkv"] = 1.0
    model, cfg = make_model(0, **kw)
    model = model.to(device="cuda", dtype=dtype)
    prompts = random_prompts(11, seed=40)
    params = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
    outs = {}
    for graphs, k in ((False, 1), (False, None), (True, None)):  # None: the CUDA default, multi-step
        eng = RolloutEngine(
            model,
            cfg,
            config=RolloutEngineConfig(block_size=4, num_blocks=256, cuda_graphs=graphs, decode_steps=k),
            eos_token_ids=(),
        )
        if k == 1:
            one_step = eng.generate(prompts, params)
            continue
        outs[graphs] = eng.generate(prompts, params)
        seeded = SamplingParams(temperature=1.0, max_new_tokens=20, ignore_eos=True, seed=5)
        outs[(graphs, "seeded")] = eng.generate(prompts[:3], seeded)
    if arch == "gpt_oss" and dtype == torch.bfloat16:
        # graphed prompt chunks attend through flash varlen rescaled by its bf16 log-sum-exp, eager ones through
        # an fp32 softmax with the sink: bf16 roundings apart, so greedy paths may part late at a near-tie (the
        # fp32 run below is exact against a recompute)
        for a, b in zip(outs[True], outs[False]):
            same = next((i for i, (x, y) in enumerate(zip(a.output_ids, b.output_ids)) if x != y), 20)
            assert same >= 8, (a.output_ids, b.output_ids)
    else:
        assert [o.output_ids for o in outs[True]] == [o.output_ids for o in outs[False]]
    if dtype == torch.float32:  # k = 8 reserves blocks ahead: other padded key widths, bf16 rounding may differ
        assert [o.output_ids for o in outs[False]] == [o.output_ids for o in one_step]
    if not (arch == "gpt_oss" and dtype == torch.bfloat16):
        assert [o.output_ids for o in outs[(True, "seeded")]] == [o.output_ids for o in outs[(False, "seeded")]]
    if dtype == torch.float32:
        cpu_model, _ = make_model(0, **kw)
        for p, o in zip(prompts, outs[True]):
            assert o.output_ids == naive_greedy(cpu_model, p, 20)[0]


@pytest.mark.gpu
def test_warmup_captures_every_bucket_then_generation_reuses_them():
    from areno.rollout.engine import RolloutEngine, RolloutEngineConfig

    model, cfg = make_model(0)
    eng = RolloutEngine(model.cuda(), cfg, config=RolloutEngineConfig(block_size=4, num_blocks=256), eos_token_ids=())
    # Batch bucket 8; 10 blocks -> one width under the paged kernel (the CUDA default), widths
    # 1, 2, 4, 8, 16 under gather; one-step graphs and 8-step greedy loops for each.
    widths = {eng._graphs.width(n) for n in range(1, 11)}
    assert len(widths) == (1 if eng._graphs.paged else 5)
    n = eng.warmup_cuda_graphs([5], max_len=40)
    assert n == 2 * len(widths)
    eng.generate(
        random_prompts(5, seed=41, lo=4, hi=10), SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
    )
    assert len(eng._graphs._graphs) == len(widths) and len(eng._graphs._loops) == len(widths)  # nothing new


@pytest.mark.gpu
def test_captured_one_step_graphs_share_their_logits_buffer_on_gpu():
    """The shared logits buffer under real capture: warm-up captures the sizes smallest first (the buffer
    grows by doubling), and generation over them gives the graph-free engine's tokens."""
    from areno.rollout.engine import RolloutEngine, RolloutEngineConfig

    model, cfg = make_model(0)
    model = model.cuda()
    prompts = random_prompts(24, seed=44)
    params = [SamplingParams(temperature=0, max_new_tokens=4 + i, ignore_eos=True) for i in range(24)]
    outs = {}
    for graphs in (False, True):
        config = RolloutEngineConfig(block_size=4, num_blocks=256, cuda_graphs=graphs, decode_steps=1)
        eng = RolloutEngine(model, cfg, config=config, eos_token_ids=())
        if graphs:
            eng.warmup_cuda_graphs([1, 2, 4, 8, 16, 24], max_len=40)
        outs[graphs] = eng.generate(prompts, params)
    one_step = eng._graphs._graphs
    storages = {g.logits_BV.untyped_storage().data_ptr() for g in one_step.values()}
    assert len(one_step) >= 6 and len(storages) <= 6  # 1, 2, 4, 8, 16, 32 rows
    assert [o.output_ids for o in outs[True]] == [o.output_ids for o in outs[False]]


@pytest.mark.gpu
def test_sampled_loop_graph_matches_eager_on_gpu():
    """On CUDA: the captured k-step loop serves sampled batches (top-p / top-k, seeds, greedy rows,
    min_new_tokens, stop ids) with the tokens and log-probs of the eager k-step path (one-step
    graph + eager sampling) and of the eager one-step engine; unseeded rows draw the engine's
    generator inside the graph (registered with it) and the eager path keeps working after."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from areno.rollout.engine import RolloutEngine, RolloutEngineConfig

    model, cfg = make_model(0)
    model = model.cuda()
    prompts = random_prompts(14, seed=44)
    eos = (9, 17, 23)
    params = sampled_mix(14, eos)
    outs, engines = {}, {}
    for name, k, graphs in (("one_step", 1, False), ("k_eager", 8, False), ("k_graph", 8, True)):
        eng = RolloutEngine(
            model,
            cfg,
            config=RolloutEngineConfig(block_size=4, num_blocks=256, decode_steps=k, cuda_graphs=graphs),
            eos_token_ids=eos,
        )
        outs[name], engines[name] = eng.generate(prompts, params), eng
    eng = engines["k_graph"]
    assert any(key[4].sample for key in eng._graphs._loops), "the sampled loop graph was never taken"
    for name in ("k_eager", "k_graph"):
        assert [o.output_ids for o in outs[name]] == [o.output_ids for o in outs["one_step"]], name
        assert [o.finish_reason for o in outs[name]] == [o.finish_reason for o in outs["one_step"]], name
        for a, b in zip(outs[name], outs["one_step"]):
            torch.testing.assert_close(a.output_logprobs, b.output_logprobs, rtol=0, atol=1e-4)
    # Unseeded rows: the generator's noise inside the graph (a sampled loop, then eager steps).
    unseeded = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=16, ignore_eos=True)
    first = eng.generate(prompts[:6], unseeded)
    assert any(key[4].rng_noise for key in eng._graphs._loops)
    second = eng.generate(prompts[:6], unseeded)
    assert [o.output_ids for o in first] != [o.output_ids for o in second]  # the generator advanced
    with torch.no_grad():
        for o, prompt in zip(first[:3], prompts):
            ids = torch.tensor(prompt + o.output_ids, device="cuda")
            logits = model.logits(model(ids, torch.arange(len(ids), device="cuda")))[len(prompt) - 1 : -1].float()
            ref = torch.log_softmax(logits, -1).gather(1, ids[len(prompt) :, None]).squeeze(1)
            torch.testing.assert_close(torch.tensor(o.output_logprobs, device="cuda"), ref, rtol=0, atol=1e-3)


@pytest.mark.gpu
def test_warmup_captures_sampled_loops():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from areno.rollout.engine import RolloutEngine, RolloutEngineConfig

    model, cfg = make_model(0)
    eng = RolloutEngine(model.cuda(), cfg, config=RolloutEngineConfig(block_size=4, num_blocks=256), eos_token_ids=(2,))
    # ignore_eos: the 5 requests end together, so the batch stays in one bucket.
    rl = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=20, min_new_tokens=4, ignore_eos=True, seed=1)
    # Batch bucket 8, every table width of 10 blocks: one-step graphs and one sampled loop per width.
    widths = {eng._graphs.width(n) for n in range(1, 11)}
    assert eng.warmup_cuda_graphs([5], max_len=40, params=[rl]) == 2 * len(widths)
    eng.generate(random_prompts(5, seed=41, lo=4, hi=10), [dataclasses.replace(rl, seed=i) for i in range(5)])
    assert len(eng._graphs._loops) == len(widths) and {key[4] for key in eng._graphs._loops} == {SampleMode.of(rl)}


@pytest.mark.parametrize("decode_steps,mode", [(1, "mixed"), (4, "mixed"), (4, "greedy_eos")])
def test_graph_runner_inputs_on_cpu(decode_steps, mode):
    """The graph runner's static inputs (block-table rows from the scheduler's tensor, padding rows,
    ids and context lengths, advanced in place by a multi-step decode; the k-step loop with its
    stop ids and length limits) give the eager one-step engine's tokens, with requests joining
    and leaving. Capture is emulated by re-running the recorded function."""
    from areno.rollout.engine import RolloutEngine, RolloutEngineConfig

    model, cfg = make_model(0)
    prompts = random_prompts(13, seed=42)
    lengths = [5 + 3 * i for i in range(13)]  # requests finish at different steps
    params = [SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=mode == "mixed") for n in lengths]
    eos = ()
    if mode == "mixed":  # seeded sampling rows too: their noise depends on (seed, tokens generated) only
        params[1::3] = [
            SamplingParams(temperature=0.8, top_k=10, max_new_tokens=n, ignore_eos=True, seed=n) for n in lengths[1::3]
        ]
    else:  # all greedy: the k-step loop graph, with an EOS that ends some requests early
        eos = (17,)
    outs = {}
    for graphs in (False, True):
        eng = RolloutEngine(
            model,
            cfg,
            config=RolloutEngineConfig(
                block_size=4,
                num_blocks=64,
                max_num_seqs=6,
                max_model_len=70,
                decode_steps=decode_steps if graphs else 1,
            ),
            eos_token_ids=eos,
        )
        if graphs:
            eng._graphs = eager_runner(eng, max_batch=6)
        outs[graphs] = eng.generate(prompts, params)
        if graphs:
            assert eng._graphs._graphs or eng._graphs._loops, "the graph path was never taken"
            assert decode_steps == 1 or eng._graphs._loops, "the k-step loop graph was never taken"
            assert eng.scheduler.block_tables_RN.eq(eng.cache.scratch_block).all()  # every row released
    assert [o.output_ids for o in outs[True]] == [o.output_ids for o in outs[False]]
    assert [o.finish_reason for o in outs[True]] == [o.finish_reason for o in outs[False]]
    if mode == "greedy_eos":
        assert {o.finish_reason for o in outs[True]} == {"stop", "length"}
    for a, b in zip(outs[True], outs[False]):
        torch.testing.assert_close(a.output_logprobs, b.output_logprobs, rtol=0, atol=1e-5)


def test_one_step_graphs_share_one_logits_buffer():
    """walk33: every one-step graph kept its own [B, V] logits output, GiBs at 150k vocabularies over the
    batch sizes and widths an asynchronous run sweeps. They write one buffer, grown geometrically, and
    still give the eager engine's tokens (``test_graph_runner_inputs_on_cpu``)."""
    from areno.rollout.engine import RolloutEngine, RolloutEngineConfig

    model, cfg = make_model(0)
    eng = RolloutEngine(
        model,
        cfg,
        config=RolloutEngineConfig(block_size=4, num_blocks=256, max_num_seqs=40, max_model_len=70, decode_steps=1),
        eos_token_ids=(),
    )
    eng._graphs = eager_runner(eng, max_batch=40)
    prompts = random_prompts(40, seed=43)
    params = [SamplingParams(temperature=0, max_new_tokens=3 + i, ignore_eos=True) for i in range(40)]
    eng.generate(prompts, params)  # rows finish one a step: batch sizes 40 down to 1
    graphs = eng._graphs._graphs
    sizes = sorted({b for b, _ in graphs})
    assert len(sizes) >= 8, sizes
    storages = {g.logits_BV.untyped_storage().data_ptr() for g in graphs.values()}
    # smallest first (the batch shrinks): the buffer grows at most by doubling past each earlier size
    assert len(storages) <= max(sizes).bit_length() + 1
    held = sum(
        {
            g.logits_BV.untyped_storage().data_ptr(): g.logits_BV.untyped_storage().nbytes() for g in graphs.values()
        }.values()
    )
    one_each = sum(g.logits_BV.nbytes for g in graphs.values())
    assert held <= 2 * padded_batch_size(40) * cfg.vocab_size * 4 < one_each


@pytest.mark.parametrize("uniform", [False, True])
def test_sampled_loop_graph_matches_eager_per_step_on_cpu(uniform):
    """The k-step loop graph serves sampled rows (temperature, top-p, top-k, per-request seeds),
    greedy rows and pending min_new_tokens in one replay, with the tokens, log-probs and finish
    reasons of the eager one-step engine and of the eager k-step path (capture emulated on CPU)."""
    from areno.rollout.engine import RolloutEngine, RolloutEngineConfig
    from areno.rollout.sampling import GREEDY

    model, cfg = make_model(0)
    prompts = random_prompts(14, seed=44)
    eos = (9, 17, 23)
    if uniform:  # one mode for every row: RL rollouts (temperature 1, top-p, seeds, min_new_tokens)
        params = [
            SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=16, min_new_tokens=5, seed=i) for i in range(14)
        ]
    else:
        params = sampled_mix(14, eos)
    outs, engines = {}, {}
    for name, k, graphs in (("one_step", 1, False), ("k_eager", 4, False), ("k_graph", 4, True)):
        eng = RolloutEngine(
            model,
            cfg,
            config=RolloutEngineConfig(block_size=4, num_blocks=96, max_num_seqs=6, max_model_len=60, decode_steps=k),
            eos_token_ids=eos,
        )
        if graphs:
            eng._graphs = eager_runner(eng, max_batch=6)
        outs[name], engines[name] = eng.generate(prompts, params), eng
    runner = engines["k_graph"]._graphs
    modes = {key[4] for key in runner._loops}
    assert modes and (uniform or GREEDY not in modes) and all(m.sample for m in modes)
    assert len(modes) <= 2 and all(m.hash_noise and not m.rng_noise for m in modes)
    ref = outs["one_step"]
    for name in ("k_eager", "k_graph"):
        assert [o.output_ids for o in outs[name]] == [o.output_ids for o in ref], name
        assert [o.finish_reason for o in outs[name]] == [o.finish_reason for o in ref], name
        for a, b in zip(outs[name], ref):
            torch.testing.assert_close(a.output_logprobs, b.output_logprobs, rtol=0, atol=1e-5)
    # The rules held: EOS / stop ids only from min_new_tokens on, and some requests did stop.
    assert {o.finish_reason for o in ref} == {"stop", "length"}
    for p, o in zip(params, ref):
        stops = set(eos) | set(p.stop_token_ids)
        assert not stops & set(o.output_ids[: p.min_new_tokens - 1])
        assert (o.finish_reason == "stop") == (o.output_ids[-1] in stops)


def test_unseeded_rows_in_the_loop_graph_sample_from_the_policy():
    """Rows without a seed draw the engine generator's noise inside the loop: their log-probs are
    the model's (recomputed without a cache) and different requests of one prompt part ways."""
    from areno.rollout.engine import RolloutEngine, RolloutEngineConfig

    model, cfg = make_model(0)
    prompt = random_prompts(1, seed=45)[0]
    p = SamplingParams(temperature=0.9, max_new_tokens=12, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    eng = RolloutEngine(
        model, cfg, config=RolloutEngineConfig(block_size=4, num_blocks=64, decode_steps=4), eos_token_ids=()
    )
    eng._graphs = eager_runner(eng, max_batch=8)
    outs = eng.generate([prompt] * 6, [p] * 5 + [greedy])
    assert {key[4] for key in eng._graphs._loops} == {SampleMode(True, False, False, True)}
    assert len({tuple(o.output_ids) for o in outs[:5]}) > 1

    assert outs[5].output_ids == naive_greedy(model, prompt, 12)[0]
    with torch.no_grad():
        for o in outs[:2]:
            ids = prompt + o.output_ids
            logits = model.logits(model(torch.tensor(ids), torch.arange(len(ids))))[len(prompt) - 1 : -1].float()
            ref = torch.log_softmax(logits / 0.9, -1).gather(1, torch.tensor(o.output_ids)[:, None]).squeeze(1)
            torch.testing.assert_close(torch.tensor(o.output_logprobs), ref, rtol=0, atol=1e-4)


def test_grouped_gqa_decode_matches_enable_gqa(monkeypatch):
    """The CUDA layout of decode rows and prefill chunks (KV heads x query groups, no enable_gqa)
    computes the same attention."""
    torch.manual_seed(1)
    cache = KVCache(
        num_layers=1,
        num_blocks=10,
        block_size=4,
        num_kv_heads=2,
        head_dim=8,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    cache.k_S[0].normal_()
    cache.v_S[0].normal_()
    chunks = [
        SeqChunk(block_table=[3, 1, 7], start=9, num_new=1),
        SeqChunk(block_table=[2], start=0, num_new=1),
        SeqChunk(block_table=[5, 6], start=3, num_new=4),
    ]
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


@pytest.mark.gpu
def test_weight_update_mid_generation_beside_another_threads_gpu_work():
    """The engine steps while another thread keeps the GPU busy (a colocated asynchronous trainer), and a
    weight update lands mid-generation; the tokens, versions and log-probs equal those of a run alone."""
    import threading

    from areno.rollout.engine import RolloutEngine, RolloutEngineConfig

    model, cfg = make_model(0)
    new_model, _ = make_model(1)
    model = model.to(device="cuda", dtype=torch.bfloat16)
    new_weights = {n: t.to(device="cuda", dtype=torch.bfloat16) for n, t in new_model.state_dict().items()}
    prompts = random_prompts(16, seed=41)
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    results = {}
    for busy_beside in (False, True):
        eng = RolloutEngine(
            model,
            cfg,
            config=RolloutEngineConfig(
                block_size=4,
                num_blocks=512,
                decode_steps=8,
                recompute_kv_on_weight_update=False,
                overlap_round_trips=False,  # one round trip per step: the update lands after 9 tokens
            ),
            eos_token_ids=(),
        )
        # graphs are captured before the "trainer" starts, as a run's engine does at start-up
        # (rollout.cuda_graph_warmup) and as a colocated asynchronous step guarantees
        # (hold_graph_captures): the other thread's device synchronizations would invalidate a capture
        assert eng.warmup_cuda_graphs([len(prompts)], max_len=64, params=[params]) > 0
        captured = eng.stats()["cuda_graphs_captured"]
        stop = threading.Event()
        a = torch.randn(2048, 2048, device="cuda")

        def busy(a=a, stop=stop):  # default-stream work from another thread, as a trainer's would be
            while not stop.is_set():
                a.copy_(torch.tanh(a @ a * 1e-3))
                torch.cuda.synchronize()

        trainer = threading.Thread(target=busy)
        if busy_beside:
            trainer.start()
        try:
            # Captures are held while the "trainer" runs, as ArenoEngine.step does: the warm-up
            # covers the k-step loop of every batch size, but not a shorter last round trip (a 7-step
            # loop here, on the H200), which then runs eagerly instead of being captured beside the
            # other thread's device synchronizations (those invalidate a capture).
            with eng.hold_graph_captures():
                ids = [eng.add_request(p, params) for p in prompts]
                outs = []
                for _ in range(2):  # the prefill, then one 8-step decode loop: 9 of 24 tokens
                    outs += eng.step()
                assert not outs  # the update lands mid-generation
                eng.update_weights(new_weights.items(), version=1)
                while eng.has_unfinished():
                    outs += eng.step()
        finally:
            stop.set()
            if busy_beside:
                trainer.join()
        assert eng.stats()["cuda_graphs_captured"] == captured  # nothing captured beside the busy thread
        model.load_state_dict(make_model(0)[0].state_dict())  # the next engine starts from version 0 again
        by_id = {o.request_id: o for o in outs}
        results[busy_beside] = [(by_id[i].output_ids, by_id[i].output_versions) for i in ids]
        results[busy_beside, "lp"] = [lp for i in ids for lp in by_id[i].output_logprobs]
    assert all(set(versions) == {0, 1} for _, versions in results[True])  # every request saw the switch
    assert results[True] == results[False]
    torch.testing.assert_close(torch.tensor(results[True, "lp"]), torch.tensor(results[False, "lp"]), atol=1e-3, rtol=0)


@pytest.mark.gpu
def test_chained_round_trips_on_gpu_give_the_serial_engines_tokens():
    """On CUDA with the decode-loop graphs: round trips chained (``overlap_round_trips``, the
    default) give the tokens and log-probs of an engine that reads each round trip before the next,
    for long fixed-length rows (many chained round trips) and rows ending at different lengths."""
    from areno.rollout.engine import RolloutEngine, RolloutEngineConfig

    model, cfg = make_model(0)
    model = model.cuda()
    prompts = random_prompts(24, seed=45)
    params = sampled_mix(24, (9,)) + [SamplingParams(temperature=1.0, max_new_tokens=100, ignore_eos=True, seed=3)] * 8
    prompts += random_prompts(8, seed=46)
    outs, engines = {}, {}
    for overlap in (False, True):
        config = RolloutEngineConfig(block_size=4, num_blocks=1024, overlap_round_trips=overlap)
        engines[overlap] = eng = RolloutEngine(model, cfg, config=config, eos_token_ids=(9,))
        outs[overlap] = eng.generate(prompts, params)
    for a, b in zip(outs[False], outs[True]):
        assert a.output_ids == b.output_ids and a.finish_reason == b.finish_reason
        torch.testing.assert_close(a.output_logprobs, b.output_logprobs, rtol=0, atol=1e-5)
    assert engines[False]._stepper.chained_round_trips == 0
    assert engines[True]._stepper.chained_round_trips > 5
    assert engines[True]._graphs._loops


@pytest.mark.gpu
def test_two_engines_of_one_process_capture_from_their_own_threads_at_once():
    """walk34: torch's default capture stream is one per process, so two engines (a run's and its test rollout's,
    or a teacher's) capturing lazily from their own threads at once collided; each runner now captures on its own
    stream, one capture at a time in the process. Both threads' tokens equal each engine's alone."""
    import threading

    from areno.rollout.engine import RolloutEngine, RolloutEngineConfig

    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    prompts = [random_prompts(24, seed=51), random_prompts(24, seed=52)]

    def engine(seed):
        model, cfg = make_model(seed)
        config = RolloutEngineConfig(block_size=4, num_blocks=1024, decode_steps=1, overlap_round_trips=False)
        return RolloutEngine(model.to(device="cuda", dtype=torch.bfloat16), cfg, config=config, eos_token_ids=())

    def tokens(outputs):
        return [o.output_ids for o in outputs]

    alone = [tokens(engine(i).generate(prompts[i], params)) for i in range(2)]
    engines, together, errors = [engine(0), engine(1)], [None, None], []
    start = threading.Barrier(2)

    def run(i):
        try:
            start.wait()
            together[i] = tokens(engines[i].generate(prompts[i], params))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert together == alone
    assert all(e.stats()["cuda_graphs_captured"] > 0 for e in engines)


def test_a_capture_that_fails_runs_its_steps_eagerly_and_is_not_tried_again(caplog):
    """walk34: a capture that failed at first use (out of memory beside the KV pool) left engine.step, which
    failed every pending request, and the next step tried the same capture again. It is warned about once now,
    and its steps run eagerly: the same tokens as the engine without graphs. Capture emulated on CPU."""
    import logging

    from areno.rollout.engine import RolloutEngine, RolloutEngineConfig

    model, cfg = make_model(0)
    prompts = random_prompts(5, seed=43)
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    config = RolloutEngineConfig(block_size=4, num_blocks=64, max_num_seqs=6, max_model_len=70, decode_steps=1)
    eager = RolloutEngine(model, cfg, config=config).generate(prompts, params)
    eng = RolloutEngine(model, cfg, config=config)
    eng._graphs = runner = eager_runner(eng, max_batch=6)
    attempts = []

    def out_of_memory(fn, generator=None):
        attempts.append(1)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    runner.record = out_of_memory
    with caplog.at_level(logging.DEBUG, logger="areno.rollout.cuda_graph"):
        outs = eng.generate(prompts, params)
    assert [o.output_ids for o in outs] == [o.output_ids for o in eager]
    keys = {r.args[1] for r in caplog.records if "capturing a CUDA graph" in r.getMessage()}
    assert len(attempts) == len(keys) >= 1  # each shape tried once, however many steps needed it
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert (
        len(warnings) == 1
        and "its steps run eagerly (OutOfMemoryError: CUDA out of memory." in warnings[0].getMessage()
    )
    runner.clear()
    assert not runner._uncapturable


def test_a_tensor_parallel_engine_never_captures_at_first_use():
    """walk34: a TP rank capturing lazily (two warm-up forwards with their all-reduces) while another rank's
    captures were held by its own policy sync (one eager forward) launched different collectives: a hang.
    A TP engine's graphs come from the warm-up alone; other steps run eagerly on every rank alike."""
    from areno.rollout.engine import RolloutEngine, RolloutEngineConfig

    model, cfg = make_model(0)
    config = RolloutEngineConfig(block_size=4, num_blocks=64, max_num_seqs=6, max_model_len=70, decode_steps=1)
    eng = RolloutEngine(model, cfg, config=config)
    eng._graphs = runner = eager_runner(eng, max_batch=6)
    eng.tp_size = 2  # what tp.py's engine sets; the capture path reads only this
    outs = eng.generate(random_prompts(3, seed=45), SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True))
    assert all(len(o.output_ids) == 5 for o in outs)
    assert not runner._graphs and runner.tp_eager > 0 and eng.stats()["cuda_graph_tp_eager_steps"] == runner.tp_eager


def test_a_failed_warm_up_of_a_tensor_parallel_engine_stops_the_run(monkeypatch):
    """Its ranks could hold different graphs after it (one failed part-way): a RunFailure naming the fixes,
    where a single-GPU engine warns and captures at first use."""
    from types import SimpleNamespace

    from areno.api.config import load_config
    from areno.engine import api
    from areno.errors import RunFailure

    def fail(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    cfg = load_config(None, ["model.path=/m", "rollout.cuda_graph_warmup=true"])
    engine = SimpleNamespace(device=torch.device("cuda"), warmup_cuda_graphs=fail, tp_size=2)
    with pytest.raises(RunFailure, match="tensor-parallel engine failed .*rollout.cuda_graphs=false"):
        api.warm_up_rollout_engine(engine, cfg)
    engine.tp_size = 1
    assert api.warm_up_rollout_engine(engine, cfg) == 0


def test_a_failed_capture_keeps_the_logits_buffer_it_had():
    """walk38: a buffer grown for a graph whose capture then ran out of memory stayed held, written by no
    graph (80-155 MB at a 150k vocabulary, on a GPU that had just run out)."""
    from areno.rollout.engine import RolloutEngine, RolloutEngineConfig

    model, cfg = make_model(0)
    config = RolloutEngineConfig(block_size=4, num_blocks=64, max_num_seqs=8, max_model_len=70, decode_steps=1)
    eng = RolloutEngine(model, cfg, config=config)
    runner = eager_runner(eng, max_batch=8)
    runner._capture(2, runner.width(4))
    held = runner._logits_out
    assert held is not None and held.shape[0] == 2

    def out_of_memory(fn, generator=None):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    runner.record = out_of_memory
    with pytest.raises(torch.OutOfMemoryError):
        runner._capture(8, runner.width(4))
    assert runner._logits_out is held
