"""decode_attention="paged": attention read straight from the block pool equals the gather path."""

import math

import pytest
import torch

from areno.models.eager_ops import eager_rms_norm, eager_rms_norm_offset
from areno.rollout.attention import PagedAttention
from areno.rollout.engine import RolloutEngine, RolloutEngineConfig
from areno.rollout.kv_cache import KVCache
from areno.rollout.paged_decode import auto_num_splits, paged_decode, paged_decode_torch, triton_available
from areno.types import SamplingParams
from tests.helpers.fake_triton import emulated_paged_decode
from tests.helpers.rollout import eager_runner, make_model, random_prompts


def _random_pool(*, num_blocks=40, bs=4, hkv=2, dh=8, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    cache = KVCache(
        num_layers=1,
        num_blocks=num_blocks,
        block_size=bs,
        num_kv_heads=hkv,
        head_dim=dh,
        dtype=dtype,
        device=torch.device(device),
    )
    cache.k_S[0].copy_(torch.randn(cache.k_S[0].shape, generator=g))
    cache.v_S[0].copy_(torch.randn(cache.v_S[0].shape, generator=g))
    return cache


def _random_batch(cache, ctx: list[int], N: int, seed=0):
    """Block tables of distinct random blocks (padded with the scratch block) for contexts ``ctx``."""
    g = torch.Generator().manual_seed(seed)
    bs = cache.block_size
    perm = torch.randperm(cache.num_blocks, generator=g).tolist()
    rows = []
    for c in ctx:
        need = -(-c // bs)
        rows.append(perm[:need] + [cache.scratch_block] * (N - need))
        perm = perm[need:]
    return torch.tensor(rows), torch.tensor(ctx)


def _naive(q_BHD, cache, bt_BN, ctx_B, window):
    """Per-sequence softmax(q k^T / sqrt(d)) v over the keys listed by hand (fp64)."""
    bs, k_S, v_S = cache.block_size, cache.k_S[0].double(), cache.v_S[0].double()
    B, Hq, Dh = q_BHD.shape
    G = Hq // k_S.shape[1]
    out = torch.empty(B, Hq, Dh, dtype=torch.float64)
    for b in range(B):
        p = int(ctx_B[b]) - 1
        keys = [j for j in range(min(p + 1, bt_BN.shape[1] * bs)) if window is None or j > p - window]
        slots = torch.tensor([int(bt_BN[b, j // bs]) * bs + j % bs for j in keys])
        for h in range(Hq):
            k, v = k_S[slots, h // G], v_S[slots, h // G]
            w = torch.softmax(k @ q_BHD[b, h].double() / math.sqrt(Dh), dim=0)
            out[b, h] = w @ v
    return out


@pytest.mark.parametrize("cpu_matmul", [True, False])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("hq,hkv", [(6, 2), (4, 4), (8, 1)])
def test_paged_equals_gather_and_naive(window, hq, hkv, cpu_matmul, monkeypatch):
    # Ragged contexts, several blocks per sequence, one row exactly on a block edge; chunks of 2
    # blocks (8 keys) so the online softmax crosses chunk boundaries. The gathered form on CPU runs
    # the head-major matmul decode (cpu_matmul) or SDPA over the slot-major gather.
    monkeypatch.setattr("areno.rollout.paged_decode.TORCH_CHUNK_KEYS", 8)
    monkeypatch.setattr("areno.rollout.attention.CPU_DECODE_MATMUL", cpu_matmul)
    cache = _random_pool(hkv=hkv)
    ctx = [1, 4, 9, 17, 30, 23]
    bt_BN, ctx_B = _random_batch(cache, ctx, N=8)
    q_BHD = torch.randn(len(ctx), hq, 8, generator=torch.Generator().manual_seed(3))
    k0 = cache.k_S[0].clone()
    zero_kv = torch.zeros(len(ctx), hkv, 8)
    outs = {}
    for mode in ("gather", "paged"):
        cache.k_S[0].copy_(k0)
        # New K/V are written first (same slots for both modes); zero them so the naive check sees the pool.
        attn = PagedAttention.for_decode(cache, bt_BN, ctx_B, window, decode_attention=mode)
        outs[mode] = attn(0, q_BHD, zero_kv, zero_kv)
    torch.testing.assert_close(outs["paged"], outs["gather"], rtol=0, atol=1e-5)
    torch.testing.assert_close(outs["paged"].double(), _naive(q_BHD, cache, bt_BN, ctx_B, window), rtol=0, atol=1e-5)


def test_paged_padding_rows_and_rows_past_the_table():
    # Graph-style padding rows (all scratch, ctx 1) and a row whose context runs past its table
    # (multi-step decode past a row's end): finite outputs over the keys the table holds, as gather.
    cache = _random_pool()
    s = cache.scratch_block
    bt_BN = torch.tensor([[3, 1], [s, s], [5, 6]])
    ctx_B = torch.tensor([6, 1, 11])  # row 2: 11 > 2 blocks * 4 keys
    q_BHD = torch.randn(3, 4, 8)
    paged = paged_decode_torch(q_BHD, cache.k_S[0], cache.v_S[0], bt_BN, ctx_B, cache.block_size)
    gather = (
        PagedAttention.for_decode(cache, bt_BN, ctx_B)
        ._sdpa(
            q_BHD.reshape(3, 2, 2, 8), cache.k_S[0], cache.v_S[0], PagedAttention.for_decode(cache, bt_BN, ctx_B).decode
        )
        .reshape(3, 4, 8)
    )
    assert torch.isfinite(paged).all()
    torch.testing.assert_close(paged, gather, rtol=0, atol=1e-5)


def test_paged_bf16_pool_close_to_fp32():
    cache32 = _random_pool(hkv=2, dh=16)
    cache16 = _random_pool(hkv=2, dh=16, dtype=torch.bfloat16)
    bt_BN, ctx_B = _random_batch(cache32, [7, 19, 33], N=9)
    q_BHD = torch.randn(3, 4, 16)
    ref = paged_decode(q_BHD, cache32.k_S[0], cache32.v_S[0], bt_BN, ctx_B, 4)
    out = paged_decode(q_BHD.bfloat16(), cache16.k_S[0], cache16.v_S[0], bt_BN, ctx_B, 4)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=5e-2)


def test_config_validation():
    with pytest.raises(ValueError, match="rollout.decode_attention: must be auto, gather or paged"):
        RolloutEngineConfig(decode_attention="flash")
    with pytest.raises(ValueError, match="decode_attention must be one of"):
        PagedAttention.for_decode(
            _random_pool(),
            torch.zeros(1, 1, dtype=torch.long),
            torch.ones(1, dtype=torch.long),
            decode_attention="dense",
        )


def test_auto_resolves_per_device():
    from areno.rollout.engine import resolve_decode_attention
    from areno.rollout.paged_decode import triton_available

    assert resolve_decode_attention("auto", torch.device("cpu")) == "gather"
    assert resolve_decode_attention("auto", torch.device("cuda", 0)) == ("paged" if triton_available() else "gather")
    assert resolve_decode_attention("paged", torch.device("cpu")) == "paged"
    model, cfg = make_model(0)
    eng = RolloutEngine(model, cfg, config=RolloutEngineConfig(block_size=4, num_blocks=16), eos_token_ids=())
    assert RolloutEngineConfig().decode_attention == "auto"
    assert eng.config.decode_attention == "gather"  # CPU


@pytest.mark.parametrize("arch", ["llama", "mistral", "olmo3"])
def test_engine_greedy_paged_equals_gather(arch):
    kw = {"sliding_window": 6} if arch in ("mistral", "olmo3") else {}  # olmo3: in layer 0 only
    model, cfg = make_model(0, arch=arch, **kw)
    prompts = random_prompts(7, seed=51, lo=2, hi=20)
    params = SamplingParams(temperature=0, max_new_tokens=14, ignore_eos=True)
    res = {}
    for mode in ("gather", "paged"):
        eng = RolloutEngine(
            model,
            cfg,
            config=RolloutEngineConfig(
                block_size=4,
                num_blocks=128,
                max_tokens_per_step=64,
                prefill_chunk_size=8,
                decode_steps=3,
                decode_attention=mode,
            ),
            eos_token_ids=(),
        )
        res[mode] = eng.generate(prompts, params)
        # chunked prefill beside decoding rows: mixed steps, whose decode rows use the paged kernel too
        assert eng.stats()["mixed_steps"] > 0
    assert [o.output_ids for o in res["paged"]] == [o.output_ids for o in res["gather"]]
    for a, b in zip(res["paged"], res["gather"]):
        torch.testing.assert_close(a.output_logprobs, b.output_logprobs, rtol=0, atol=1e-5)


def test_graph_runner_paged_on_cpu():
    """The CUDA-graph runner's static-shape path (padded batch and table width, k-step greedy loop)
    with decode_attention="paged", capture emulated by re-running the recorded function."""

    model, cfg = make_model(0)
    prompts = random_prompts(9, seed=52)
    params = [SamplingParams(temperature=0, max_new_tokens=6 + 2 * i, ignore_eos=True) for i in range(9)]
    outs = {}
    for mode in ("gather", "paged"):
        eng = RolloutEngine(
            model,
            cfg,
            config=RolloutEngineConfig(
                block_size=4, num_blocks=64, max_num_seqs=5, max_model_len=60, decode_steps=4, decode_attention=mode
            ),
            eos_token_ids=(),
        )
        eng._graphs = eager_runner(eng, max_batch=5)
        outs[mode] = eng.generate(prompts, params)
        assert eng._graphs._loops, "the k-step loop graph was never taken"
        if mode == "paged":  # one table width (at least 64 blocks) for every context length
            assert {key[1] for key in [*eng._graphs._loops, *eng._graphs._graphs]} == {64}
    assert [o.output_ids for o in outs["paged"]] == [o.output_ids for o in outs["gather"]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [None, 37])
def test_triton_kernel_matches_gather_on_gpu(dtype, atol, window):
    assert triton_available(), "CUDA torch without triton"
    cache = _random_pool(num_blocks=600, bs=16, hkv=2, dh=64, dtype=dtype, device="cuda")
    ctx = [1, 16, 17, 100, 255, 300, 513, 64]
    bt_BN, ctx_B = _random_batch(cache, ctx, N=40)
    bt_BN, ctx_B = bt_BN.cuda(), ctx_B.cuda()
    q_BHD = torch.randn(len(ctx), 14, 64, device="cuda", dtype=dtype)
    z = torch.zeros(len(ctx), 2, 64, device="cuda", dtype=dtype)
    k0, v0 = cache.k_S[0].clone(), cache.v_S[0].clone()
    gather = PagedAttention.for_decode(cache, bt_BN, ctx_B, window)(0, q_BHD, z, z)
    cache.k_S[0].copy_(k0), cache.v_S[0].copy_(v0)
    paged = PagedAttention.for_decode(cache, bt_BN, ctx_B, window, decode_attention="paged")(0, q_BHD, z, z)
    torch.testing.assert_close(paged.float(), gather.float(), rtol=0, atol=atol)
    from areno.rollout.paged_decode import paged_decode_triton

    for splits in (1, 3):  # auto picks 8 here (8 sequences): the single-program and another split count
        out = paged_decode_triton(q_BHD, cache.k_S[0], cache.v_S[0], bt_BN, ctx_B, 16, window, num_splits=splits)
        torch.testing.assert_close(out.float(), paged.float(), rtol=0, atol=atol)
    # Inside a CUDA graph: static inputs changed between replays.
    cache.k_S[0].copy_(k0), cache.v_S[0].copy_(v0)
    static_ctx = ctx_B.clone()
    fn = lambda: paged_decode(q_BHD, cache.k_S[0], cache.v_S[0], bt_BN, static_ctx, 16, window)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    static_ctx.sub_(1).clamp_(min=1)
    graph.replay()
    ref = paged_decode_torch(q_BHD, cache.k_S[0], cache.v_S[0], bt_BN, static_ctx, 16, window)
    torch.testing.assert_close(out.float(), ref.float(), rtol=0, atol=atol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_engine_paged_equals_gather_on_gpu():
    model, cfg = make_model(0)
    model = model.cuda()
    prompts = random_prompts(11, seed=53)
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    res = {}
    for mode in ("gather", "paged"):
        eng = RolloutEngine(
            model,
            cfg,
            config=RolloutEngineConfig(block_size=4, num_blocks=256, decode_attention=mode),
            eos_token_ids=(),
        )
        res[mode] = eng.generate(prompts, params)
    assert [o.output_ids for o in res["paged"]] == [o.output_ids for o in res["gather"]]


# ---------------------------------------------------------------------------------------------
# The Triton kernel's own code on CPU. This machine has no triton (so no TRITON_INTERPRET=1): the
# kernel function is run under a small stand-in for ``triton``/``triton.language`` that executes
# each program (sequence, KV head) eagerly with torch ops — pointers are (flat tensor, element
# offsets), masked loads/stores, ``tl.dot`` in fp32. It checks the kernel's indexing (tiles across
# blocks, the sliding-window start, padding, strides), its online softmax and its wrapper; Triton
# compilation itself is covered by the gpu-marked tests (the stand-in: ``tests/helpers/fake_triton``).


@pytest.fixture
def emulated_kernel_module(monkeypatch):
    return emulated_paged_decode(monkeypatch)


@pytest.mark.parametrize("window", [None, 5, 21])
@pytest.mark.parametrize(
    "hq,hkv,bs,tile,splits",
    [(6, 2, 4, 16, 1), (4, 4, 16, 16, 3), (8, 1, 4, 64, 1), (6, 2, 16, 64, 2), (6, 2, 4, 16, 5)],
)
def test_triton_kernel_code_emulated_on_cpu(emulated_kernel_module, window, hq, hkv, bs, tile, splits):
    cache = _random_pool(num_blocks=80, bs=bs, hkv=hkv, dh=8)
    ctx = [1, 4, 16, 17, 45, 33, 70]
    N = -(-max(ctx) // bs) + 1  # one padding column
    bt_BN, ctx_B = _random_batch(cache, ctx, N=N, seed=4)
    ctx_B[-1] = N * bs + 3  # a row past its table (multi-step decode past a row's end)
    q_BHD = torch.randn(len(ctx), hq, 8, generator=torch.Generator().manual_seed(5))
    # splits > 1: split-K partials merged by the combine kernel (some splits empty for short rows).
    out = emulated_kernel_module.paged_decode_triton(
        q_BHD, cache.k_S[0], cache.v_S[0], bt_BN, ctx_B, bs, window, tile=tile, num_splits=splits
    )
    ref = paged_decode_torch(q_BHD, cache.k_S[0], cache.v_S[0], bt_BN, ctx_B, bs, window)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.double()[:-1], _naive(q_BHD, cache, bt_BN, ctx_B, window)[:-1], rtol=0, atol=1e-5)
    # A bf16 pool under an fp32 model: computed in bf16, returned in the query's dtype.
    c16 = _random_pool(num_blocks=80, bs=bs, hkv=hkv, dh=8, dtype=torch.bfloat16)
    out16 = emulated_kernel_module.paged_decode_triton(q_BHD, c16.k_S[0], c16.v_S[0], bt_BN, ctx_B, bs, window)
    assert out16.dtype == torch.float32
    torch.testing.assert_close(
        out16, paged_decode_torch(q_BHD, c16.k_S[0], c16.v_S[0], bt_BN, ctx_B, bs, window), rtol=0, atol=2e-2
    )
    # A strided query (a view) takes the same code.
    q_wide = torch.randn(len(ctx), hq, 16)[:, :, :8]
    torch.testing.assert_close(
        emulated_kernel_module.paged_decode_triton(q_wide, cache.k_S[0], cache.v_S[0], bt_BN, ctx_B, bs, window),
        paged_decode_torch(q_wide, cache.k_S[0], cache.v_S[0], bt_BN, ctx_B, bs, window),
        rtol=0,
        atol=1e-5,
    )


def _rotary_case(cache, hq, ctx, N, window, seed, dtype, norms=None):
    """A decode step's fused q/k/v rows, RoPE tables and new-token slots for contexts ``ctx`` (the
    last row then runs past its table), and what ``rope_write_kv`` + ``paged_decode_torch`` give:
    (args, reference output, reference pools). ``norms`` (a ``HeadNorms``): q's and k's heads normed
    first, by the eager RMSNorm of that order."""
    from areno.models.fused_ops import eager_rope_write_kv
    from areno.rollout.fused_loop import new_token_slots_torch

    g = torch.Generator().manual_seed(seed)
    bs, hkv, dh = cache.block_size, cache.num_kv_heads, cache.head_dim
    dev = cache.k_S[0].device
    bt_BN, ctx_B = _random_batch(cache, ctx, N=N, seed=seed)
    ctx_B[-1] = N * bs + 3
    bt_BN, ctx_B = bt_BN.to(dev), ctx_B.to(dev)
    qkv = torch.randn(len(ctx), (hq + 2 * hkv) * dh, generator=g).to(dev, dtype)
    angle = (ctx_B - 1).float()[:, None].cpu() * torch.rand(dh // 2, generator=g)
    cos, sin = angle.cos().to(dev, dtype), angle.sin().to(dev, dtype)
    slot_B = new_token_slots_torch(bt_BN, ctx_B, bs, cache.scratch_block * bs)
    k_ref, v_ref = cache.k_S[0].clone(), cache.v_S[0].clone()
    qkv_in = qkv
    if norms is not None:
        q_heads, k_heads = qkv[:, : hq * dh].view(-1, hq, dh), qkv[:, hq * dh : (hq + hkv) * dh].view(-1, hkv, dh)
        if norms.scale_in_float32:
            q_heads = eager_rms_norm_offset(q_heads, norms.q_weight, norms.eps, norms.offset)
            k_heads = eager_rms_norm_offset(k_heads, norms.k_weight, norms.eps, norms.offset)
        else:
            q_heads = eager_rms_norm(q_heads, norms.q_weight, norms.eps)
            k_heads = eager_rms_norm(k_heads, norms.k_weight, norms.eps)
        qkv_in = torch.cat([q_heads.flatten(1), k_heads.flatten(1), qkv[:, (hq + hkv) * dh :]], dim=1)
    q = eager_rope_write_kv(qkv_in, hq, hkv, cos, sin, k_ref, v_ref, slot_B)
    ref = paged_decode_torch(q, k_ref, v_ref, bt_BN, ctx_B, bs, window)
    return (qkv, hq, hkv, cos, sin, cache.k_S[0], cache.v_S[0], slot_B, bt_BN, ctx_B, bs, window), ref, (k_ref, v_ref)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("hq,hkv,bs,tile,splits", [(6, 2, 4, 16, 1), (4, 4, 16, 16, 3), (6, 2, 4, 16, 5)])
def test_rotary_kernel_code_emulated_on_cpu(emulated_kernel_module, window, hq, hkv, bs, tile, splits):
    """RoPE and the K/V write inside the decode kernel: the same output and pools as
    ``rope_write_kv`` then the torch decode, for every split count (the last split attends the new
    key), rows at a block's first slot, and a row past its table (its K/V to the scratch slot)."""
    cache = _random_pool(num_blocks=80, bs=bs, hkv=hkv, dh=8)
    ctx = [1, 4, 16, 17, 45, 33, 70]
    N = -(-max(ctx) // bs) + 1
    args, ref, (k_ref, v_ref) = _rotary_case(cache, hq, ctx, N, window, seed=6, dtype=torch.float32)
    out = emulated_kernel_module.paged_decode_rotary(*args, tile=tile, num_splits=splits)
    # the row past its table is discarded by the engine: it may read the scratch slot before or after its write
    torch.testing.assert_close(out[:-1], ref[:-1], rtol=0, atol=1e-5)
    assert torch.equal(cache.k_S[0], k_ref) and torch.equal(cache.v_S[0], v_ref)
    with pytest.raises(ValueError, match="do not match"):  # a head count that is not the product's layout
        emulated_kernel_module.paged_decode_rotary(args[0], hq + 1, *args[2:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [0.0, 1.0])  # Qwen3's per-head norms; Gemma 3's (offset weights, float32 scale)
def test_rotary_kernel_with_head_norms_emulated_on_cpu(emulated_kernel_module, offset, dtype):
    """q's and the new key's per-head RMSNorms inside the decode kernel: the output and pools of the
    eager norms, then ``rope_write_kv``, then the torch decode."""
    from areno.models.attention import HeadNorms

    cache = _random_pool(num_blocks=80, bs=4, hkv=2, dh=8, dtype=dtype)
    ctx = [1, 4, 16, 17, 45, 33, 70]
    g = torch.Generator().manual_seed(9)
    norms = HeadNorms(
        torch.randn(8, generator=g).to(dtype), torch.randn(8, generator=g).to(dtype), 1e-6, offset, bool(offset)
    )
    args, ref, (k_ref, v_ref) = _rotary_case(cache, 6, ctx, 19, None, seed=6, dtype=dtype, norms=norms)
    out = emulated_kernel_module.paged_decode_rotary(*args, tile=16, num_splits=2, qk_norm=norms)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[:-1].float(), ref[:-1].float(), rtol=0, atol=tol)
    torch.testing.assert_close(cache.k_S[0].float(), k_ref.float(), rtol=0, atol=tol)
    assert torch.equal(cache.v_S[0], v_ref)
    with pytest.raises(ValueError, match="qk_norm weights"):
        bad = HeadNorms(norms.q_weight[:4], norms.k_weight, 1e-6)
        emulated_kernel_module.paged_decode_rotary(*args, qk_norm=bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("window", [None, 37])
def test_rotary_kernel_matches_rope_write_then_decode_on_gpu(window):
    from areno.rollout.paged_decode import paged_decode_rotary

    for splits in (None, 1, 3):
        cache = _random_pool(num_blocks=600, bs=16, hkv=2, dh=64, dtype=torch.bfloat16, device="cuda")
        ctx = [1, 16, 17, 100, 255, 300, 513, 64, 20]
        args, ref, (k_ref, v_ref) = _rotary_case(cache, 14, ctx, 40, window, seed=3, dtype=torch.bfloat16)
        out = paged_decode_rotary(*args, num_splits=splits)
        torch.testing.assert_close(out[:-1].float(), ref[:-1].float(), rtol=0, atol=2e-2)
        # the same roundings as rope_write_kv: the pools bit for bit
        assert torch.equal(cache.k_S[0], k_ref) and torch.equal(cache.v_S[0], v_ref)
    from areno.models.attention import HeadNorms

    g = torch.Generator().manual_seed(1)
    for offset in (0.0, 1.0):  # Qwen3's per-head norms, Gemma 3's; head dim 256 as Gemma 3's
        w = [torch.randn(256, generator=g).to("cuda", torch.bfloat16) for _ in range(2)]
        norms = HeadNorms(w[0], w[1], 1e-6, offset, bool(offset))
        cache = _random_pool(num_blocks=600, bs=16, hkv=1, dh=256, dtype=torch.bfloat16, device="cuda")
        ctx = [1, 16, 17, 100, 255, 300, 513, 64, 20]
        args, ref, (k_ref, v_ref) = _rotary_case(cache, 4, ctx, 40, window, seed=3, dtype=torch.bfloat16, norms=norms)
        out = paged_decode_rotary(*args, qk_norm=norms)
        torch.testing.assert_close(out[:-1].float(), ref[:-1].float(), rtol=0, atol=3e-2)
        torch.testing.assert_close(cache.k_S[0].float(), k_ref.float(), rtol=0.02, atol=2e-2)
        assert torch.equal(cache.v_S[0], v_ref)


def test_held_graph_captures_run_eagerly_with_the_same_tokens():
    """While captures are held (a policy sync on the rollout worker), a decode step whose graph is
    missing runs eagerly: same tokens, nothing captured, the deferral counted; afterwards graphs are
    captured again (capture emulated on CPU)."""

    model, cfg = make_model(0)
    prompts = random_prompts(6, seed=54)
    params = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
    ref = RolloutEngine(
        model, cfg, config=RolloutEngineConfig(block_size=4, num_blocks=64, decode_steps=4), eos_token_ids=()
    ).generate(prompts, params)
    eng = RolloutEngine(
        model, cfg, config=RolloutEngineConfig(block_size=4, num_blocks=64, decode_steps=4), eos_token_ids=()
    )
    eng._graphs = eager_runner(eng, max_batch=8)
    with eng.hold_graph_captures():
        held = eng.generate(prompts, params)
    assert not eng._graphs._graphs and not eng._graphs._loops
    assert eng.stats()["cuda_graph_deferred_steps"] > 0
    after = eng.generate(prompts, params)
    assert eng._graphs._loops, "captures resume once released"
    assert [o.output_ids for o in held] == [o.output_ids for o in after] == [o.output_ids for o in ref]


@pytest.mark.parametrize(
    ("seqs", "splits"),
    [(256, 1), (192, 1), (128, 2), (64, 4), (32, 8), (8, 8), (1, 8)],
)
def test_split_count_keeps_programs_at_most_four_per_sm(monkeypatch, seqs, splits):
    # 132 SMs (an H200), two KV heads: a batch whose programs fill the SMs alone runs unsplit
    class Props:
        multi_processor_count = 132

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())
    assert auto_num_splits(seqs, 2, 1024, 64, torch.device("cuda")) == splits
    assert auto_num_splits(seqs, 2, 64, 64, torch.device("cuda")) == 1  # one tile of keys: nothing to split
    assert auto_num_splits(seqs, 2, 1024, 64, torch.device("cpu")) == 1
