"""Attention sinks (gpt-oss) in the rollout engine's attention: every form of ``PagedAttention`` (the
gathered SDPA decode and prefill, grouped or not; the CPU matmul decode with and without its carry;
the paged decode in torch and, emulated on CPU or real on a GPU, in Triton with split-K and RoPE; the
flash varlen prefill) equals transformers' eager sink attention, and ``sinks_H=None`` leaves each
unchanged.

Legend: T = packed new tokens, B = sequences, N = blocks per table, Hq/Hkv = query/KV heads, D = head
dim, S = KV slots, L = keys.
"""

from __future__ import annotations

import math

import pytest
import torch

from areno.rollout import attention as rollout_attention
from areno.rollout.attention import DecodeCarry, LayerWindowAttention, PagedAttention
from areno.rollout.paged_decode import paged_decode_torch, triton_available
from tests.helpers import paged_cases as pc
from tests.helpers.fake_triton import emulated_paged_decode

NEG_SINK = -30.0
"""A sink so low that its head's attention equals attention without one (e^-30 of the mass)."""


def _sinks(hq: int, seed=1, dtype=torch.float32) -> torch.Tensor:
    """Random sinks [Hq], the first large (+5: most of the mass) and the last ``NEG_SINK``."""
    s_H = 2 * torch.randn(hq, generator=torch.Generator().manual_seed(seed))
    s_H[0], s_H[-1] = 5.0, NEG_SINK
    return s_H.to(dtype)


def _reference(q_THD, k_S, v_S, tables_T, pos_T, window, sinks_H, bs=pc.BS) -> torch.Tensor:
    """transformers' eager gpt-oss attention per query token in float64: scores over keys 0..p of its
    table (the last ``window`` of them), the sink as one more column, dropped after the softmax."""
    T, Hq, Dh = q_THD.shape
    G = Hq // k_S.shape[1]
    out = torch.empty(T, Hq, Dh, dtype=torch.float64)
    for t in range(T):
        p = int(pos_T[t])
        keys = [j for j in range(p + 1) if window is None or j > p - window]
        slots = torch.tensor([tables_T[t][j // bs] * bs + j % bs for j in keys], device=k_S.device)
        k_LHD = k_S[slots].double().cpu().repeat_interleave(G, 1)
        v_LHD = v_S[slots].double().cpu().repeat_interleave(G, 1)
        s_HL = torch.einsum("hd,lhd->hl", q_THD[t].double().cpu(), k_LHD) / math.sqrt(Dh)
        if sinks_H is not None:
            s_HL = torch.cat((s_HL, sinks_H.double().cpu()[:, None]), dim=1)
        w_HL = torch.softmax(s_HL, dim=1)[:, : len(keys)]
        out[t] = torch.einsum("hl,lhd->hd", w_HL, v_LHD)
    return out


def _check(out_THD, ref_THD, plain_THD=None, atol=1e-5):
    """``out`` equals the reference; where given, the ``NEG_SINK`` head equals attention without sinks."""
    torch.testing.assert_close(out_THD.double().cpu(), ref_THD, rtol=0, atol=atol)
    if plain_THD is not None:
        torch.testing.assert_close(out_THD[:, -1], plain_THD[:, -1], rtol=0, atol=atol)


# ---------------------------------------------------------------------------------------------- decode


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("cpu_matmul", [True, False])
@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (2, 2)])
def test_gathered_decode(monkeypatch, hq, hkv, grouped, cpu_matmul, window):
    """Decode rows through the gathered form: the CPU matmul decode (``cpu_matmul``) or the SDPA call
    (explicit sink softmax), q grouped per KV head or not."""
    monkeypatch.setattr(PagedAttention, "GROUPED_DECODE", grouped)
    monkeypatch.setattr(rollout_attention, "CPU_DECODE_MATMUL", cpu_matmul)
    cache = pc.pool(hkv)
    ctx = [1, 4, 9, 17, 30]
    tables = pc.tables(cache, ctx)
    bt_BN, ctx_B = pc.padded(cache, tables, 8), torch.tensor(ctx)
    q, k, v = pc.qkv(len(ctx), hq, hkv)
    sinks_H = _sinks(hq)
    attn = PagedAttention.for_decode(cache, bt_BN, ctx_B, window)
    out = attn(0, q, k, v, sinks_H=sinks_H)
    plain = attn(0, q, k, v)
    assert torch.equal(attn(0, q, k, v, sinks_H=None), plain)
    _check(out, _reference(q, cache.k_S[0], cache.v_S[0], tables, ctx_B - 1, window, sinks_H), plain)
    _check(plain, _reference(q, cache.k_S[0], cache.v_S[0], tables, ctx_B - 1, window, None))


@pytest.mark.parametrize("hq,hkv", [(4, 2), (2, 2)])
def test_cpu_decode_carry(hq, hkv):
    """The CPU decode carry: a fresh gather, then two steps that extend the carried K/V."""
    cache = pc.pool(hkv)
    cache.decode_carry = DecodeCarry(1, 8 * pc.BS, 1 << 28)
    ctx = [1, 4, 9, 17, 29]
    tables = pc.tables(cache, [c + 2 for c in ctx])
    bt_BN, sinks_H = pc.padded(cache, tables, 8), _sinks(hq)
    for step in range(3):
        ctx_B = torch.tensor(ctx) + step
        attn = PagedAttention.for_decode(cache, bt_BN, ctx_B, carry=True)
        assert attn.decode.carry is not None and attn.decode.extend == (step > 0)
        q, k, v = pc.qkv(len(ctx), hq, hkv, seed=step)
        out = attn(0, q, k, v, sinks_H=sinks_H)
        _check(out, _reference(q, cache.k_S[0], cache.v_S[0], tables, ctx_B - 1, None, sinks_H))
    assert cache.decode_carry.steps == {"extended": 2, "gathered": 1}


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (2, 2), (4, 1)])
def test_paged_decode_torch(monkeypatch, hq, hkv, window, dtype, atol):
    """The paged decode in torch (chunks of 8 keys: the online softmax crosses chunks), through the
    backend and alone; a bf16 pool and query."""
    monkeypatch.setattr("areno.rollout.paged_decode.TORCH_CHUNK_KEYS", 8)
    cache = pc.pool(hkv, dtype=dtype)
    ctx = [1, 4, 9, 17, 30]
    tables = pc.tables(cache, ctx)
    bt_BN, ctx_B = pc.padded(cache, tables, 8), torch.tensor(ctx)
    q, k, v = pc.qkv(len(ctx), hq, hkv, dtype=dtype)
    sinks_H = _sinks(hq, dtype=dtype)
    attn = PagedAttention.for_decode(cache, bt_BN, ctx_B, window, decode_attention="paged")
    out = attn(0, q, k, v, sinks_H=sinks_H)
    assert out.dtype == dtype
    plain = attn(0, q, k, v)
    assert torch.equal(attn(0, q, k, v, sinks_H=None), plain)
    _check(out, _reference(q, cache.k_S[0], cache.v_S[0], tables, ctx_B - 1, window, sinks_H), plain, atol)
    alone = paged_decode_torch(q, cache.k_S[0], cache.v_S[0], bt_BN, ctx_B, pc.BS, window, sinks_H)
    assert torch.equal(alone, out)


# ------------------------------------------------------------------------------------- prefill, mixed


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("decode", ["build", "gather", "paged"])
@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (2, 2)])
def test_mixed_step(monkeypatch, hq, hkv, grouped, decode, window):
    """A step of decode rows and prompt chunks (the padded prefill batch, grouped per KV head or not):
    all from ``build``, or the decode rows from ``for_decode`` (gathered or paged) beside them."""
    monkeypatch.setattr(PagedAttention, "GROUPED_DECODE", grouped)
    cache = pc.pool(hkv)
    chunks, tables, tables_T, pos_T, (q, k, v) = pc.mixed_case(cache, hq, hkv)
    if decode == "build":
        attn = PagedAttention.build(cache, chunks, torch.device("cpu"), window)
    else:
        dec = PagedAttention.for_decode(
            cache, pc.padded(cache, tables[:2]), torch.tensor([4, 11]), window, decode_attention=decode
        )
        attn = PagedAttention.mixed(dec, PagedAttention.build(cache, chunks[2:], torch.device("cpu"), window))
    sinks_H = _sinks(hq)
    out = attn(0, q, k, v, sinks_H=sinks_H)
    plain = attn(0, q, k, v)
    assert torch.equal(attn(0, q, k, v, sinks_H=None), plain)
    _check(out, _reference(q, cache.k_S[0], cache.v_S[0], tables_T, pos_T, window, sinks_H), plain)


def test_long_prefill_in_blocks_of_query_rows(monkeypatch):
    """A prefill chunk whose scores exceed ``SINK_SCORES_BYTES`` attends in blocks of query rows."""
    monkeypatch.setattr(rollout_attention, "SINK_SCORES_BYTES", 4 * 2 * 4 * 20)  # 4 heads' rows a block
    cache = pc.pool(2)
    chunks, _, tables_T, pos_T, (q, k, v) = pc.mixed_case(cache, 4, 2, seed=3)
    attn = PagedAttention.build(cache, chunks[2:], torch.device("cpu"))
    sinks_H = _sinks(4)
    out = attn(0, q[2:], k[2:], v[2:], sinks_H=sinks_H)
    _check(out, _reference(q[2:], cache.k_S[0], cache.v_S[0], tables_T[2:], pos_T[2:], None, sinks_H))


@pytest.mark.parametrize("decode", ["gather", "paged"])
def test_layer_window_attention(decode):
    """Layers 0 full and 1 sliding (``LayerWindowAttention``), in a mixed step and a decode step."""
    cache = pc.pool(2, layers=2)
    chunks, tables, tables_T, pos_T, (q, k, v) = pc.mixed_case(cache, 4, 2)
    sinks_H = _sinks(4)
    cpu = torch.device("cpu")
    mixed = PagedAttention.build(cache, chunks, cpu, 3, window_layers=(1,))
    dec = PagedAttention.for_decode(
        cache, pc.padded(cache, tables[:2]), torch.tensor([4, 11]), 3, decode_attention=decode, window_layers=(1,)
    )
    assert isinstance(mixed, LayerWindowAttention) and isinstance(dec, LayerWindowAttention)
    for layer, window in ((0, None), (1, 3)):
        out = mixed(layer, q, k, v, sinks_H)
        _check(out, _reference(q, cache.k_S[layer], cache.v_S[layer], tables_T, pos_T, window, sinks_H))
        out = dec(layer, q[:2], k[:2], v[:2], sinks_H=sinks_H)
        _check(out, _reference(q[:2], cache.k_S[layer], cache.v_S[layer], tables_T[:2], pos_T[:2], window, sinks_H))


# ------------------------------------------------------------------------------------- flash varlen


def _fake_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, window_size=(-1, -1), **kw):
    """``varlen_attn`` in torch for CPU: queries aligned to the end of their keys, the log-sum-exp
    [H, T] as flash returns it (+inf for a query with no key)."""
    T, H, _ = q.shape
    out = torch.zeros_like(q)
    lse_HT = torch.full((H, T), math.inf)
    for b in range(cu_q.numel() - 1):
        q0, q1, k0, k1 = (int(x) for x in (cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]))
        qpos, kpos = torch.arange(q1 - q0) + (k1 - k0) - (q1 - q0), torch.arange(k1 - k0)
        keep = kpos[None, :] <= qpos[:, None]
        if window_size[0] >= 0:
            keep &= kpos[None, :] >= qpos[:, None] - window_size[0]
        kk, vv = (x[k0:k1].repeat_interleave(H // x.shape[1], 1).float() for x in (k, v))
        s_HQL = torch.einsum("qhd,lhd->hql", q[q0:q1].float(), kk) / math.sqrt(q.shape[-1])
        s_HQL = s_HQL.masked_fill(~keep, -math.inf)
        lse_HT[:, q0:q1] = torch.logsumexp(s_HQL, dim=-1)
        out[q0:q1] = torch.einsum("hql,lhd->qhd", torch.softmax(s_HQL, -1), vv).to(q.dtype)
    return (out, lse_HT) if return_aux is not None and return_aux.lse else out


def _varlen_case(cache, hq, hkv, window, device="cpu", dtype=torch.float32):
    """A prefill-graph step (``for_prefill``) of ``_mixed_case``'s sequences as chunks, and q/k/v."""
    chunks, tables, tables_T, pos_T, qkv = pc.mixed_case(cache, hq, hkv)
    bs = cache.block_size
    slot = lambda t, j: t[j // bs] * bs + j % bs
    slot_T = [slot(t, p) for t, p in zip(tables_T, pos_T)]
    kv_slots_L = [slot(c.block_table, j) for c in chunks for j in range(c.start + c.num_new)]
    cu_q = [0] + torch.tensor([c.num_new for c in chunks]).cumsum(0).tolist()
    cu_k = [0] + torch.tensor([c.start + c.num_new for c in chunks]).cumsum(0).tolist()
    i32 = dict(dtype=torch.int32, device=device)
    attn = PagedAttention.for_prefill(
        cache, torch.tensor(slot_T, device=device), torch.tensor(kv_slots_L, device=device),
        torch.tensor(cu_q, **i32), torch.tensor(cu_k, **i32), 7, 11, window,
    )  # fmt: skip
    return attn, tables_T, pos_T, tuple(x.to(device, dtype) for x in qkv)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (2, 2)])
def test_varlen_prefill_scales_flash_by_the_sink_share(monkeypatch, hq, hkv, window):
    """The prefill graphs' flash varlen form: its output times sigmoid(lse - sink) (flash emulated)."""
    monkeypatch.setattr("torch.nn.attention.varlen.varlen_attn", _fake_varlen_attn)
    cache = pc.pool(hkv)
    attn, tables_T, pos_T, (q, k, v) = _varlen_case(cache, hq, hkv, window)
    sinks_H = _sinks(hq)
    out = attn(0, q, k, v, sinks_H=sinks_H)
    plain = attn(0, q, k, v)
    _check(out, _reference(q, cache.k_S[0], cache.v_S[0], tables_T, pos_T, window, sinks_H), plain)
    _check(plain, _reference(q, cache.k_S[0], cache.v_S[0], tables_T, pos_T, window, None))


def test_varlen_without_lse_refuses_sinks(monkeypatch):
    """A torch whose varlen_attn returns no log-sum-exp: the prefill graphs are not taken for a sink
    model (the engine logs why), and a varlen step asked for sinks says what to set."""
    from types import SimpleNamespace

    from areno.rollout import prefill_graph
    from areno.rollout.prefill_graph import PrefillGraphRunner
    from tests.helpers.rollout import engine, make_model

    model, cfg = make_model(0)
    eng = engine((model.to(torch.bfloat16), cfg), 1)
    assert PrefillGraphRunner.supported(eng) is None
    for where in (rollout_attention, prefill_graph):
        monkeypatch.setattr(where, "varlen_lse_available", lambda: False)
    assert PrefillGraphRunner.supported(eng) is None  # no sinks: nothing needs the log-sum-exp
    eng.model_config = SimpleNamespace(attention_sinks=True, attn_logit_softcapping=None)
    assert "log-sum-exp" in PrefillGraphRunner.supported(eng)
    attn, _, _, (q, k, v) = _varlen_case(pc.pool(2), 4, 2, None)
    with pytest.raises(ValueError, match="rollout.prefill_cuda_graphs=false"):
        attn(0, q, k, v, sinks_H=_sinks(4))


# ----------------------------------------------------------------------------- Triton kernel, emulated


@pytest.fixture
def emulated(monkeypatch):
    """``paged_decode.py`` loaded under the stand-in for triton (CPU)."""
    return emulated_paged_decode(monkeypatch)


def _decode_case(cache, hq, ctx, seed=0):
    tables = pc.tables(cache, ctx, seed)
    bt_BN, ctx_B = pc.padded(cache, tables), torch.tensor(ctx)
    dev = cache.k_S[0].device
    q = torch.randn(len(ctx), hq, cache.head_dim, generator=torch.Generator().manual_seed(seed + 5))
    return tables, bt_BN.to(dev), ctx_B.to(dev), q.to(dev, cache.dtype)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("hq,hkv,splits", [(4, 2, 1), (4, 2, 3), (2, 2, 5), (4, 1, 2)])
def test_triton_kernel_code_emulated(emulated, hq, hkv, splits, window):
    """The kernel's sink: counted once, in the last split (some splits empty for short rows)."""
    cache = pc.pool(hkv)
    tables, bt_BN, ctx_B, q = _decode_case(cache, hq, [1, 4, 17, 30])
    sinks_H = _sinks(hq)
    k_S, v_S = cache.k_S[0], cache.v_S[0]
    out = emulated.paged_decode_triton(
        q, k_S, v_S, bt_BN, ctx_B, pc.BS, window, tile=16, num_splits=splits, sinks_H=sinks_H
    )
    plain = emulated.paged_decode_triton(q, k_S, v_S, bt_BN, ctx_B, pc.BS, window, tile=16, num_splits=splits)
    _check(out, _reference(q, k_S, v_S, tables, ctx_B - 1, window, sinks_H), plain)


def _rotary_case(cache, hq, ctx, seed=0):
    """A decode step's fused q/k/v rows before RoPE, the tables and slots; and the rotated q and the
    pools that ``rope_write_kv`` gives (the reference's inputs)."""
    from areno.models.fused_ops import eager_rope_write_kv
    from areno.rollout.fused_loop import new_token_slots_torch

    g = torch.Generator().manual_seed(seed)
    hkv, dh, dev, dt = cache.num_kv_heads, cache.head_dim, cache.k_S[0].device, cache.dtype
    tables = pc.tables(cache, ctx, seed)
    bt_BN, ctx_B = pc.padded(cache, tables).to(dev), torch.tensor(ctx, device=dev)
    qkv = torch.randn(len(ctx), (hq + 2 * hkv) * dh, generator=g).to(dev, dt)
    angle = (ctx_B - 1).float()[:, None].cpu() * torch.rand(dh // 2, generator=g)
    cos, sin = angle.cos().to(dev, dt), angle.sin().to(dev, dt)
    slot_B = new_token_slots_torch(bt_BN, ctx_B, cache.block_size, cache.scratch_block * cache.block_size)
    k_ref, v_ref = cache.k_S[0].clone(), cache.v_S[0].clone()
    q_ref = eager_rope_write_kv(qkv, hq, hkv, cos, sin, k_ref, v_ref, slot_B)
    return tables, (qkv, hq, hkv, cos, sin, bt_BN, ctx_B, slot_B), (q_ref, k_ref, v_ref)


@pytest.mark.parametrize("splits", [1, 3])
def test_rotary_kernel_code_emulated(emulated, monkeypatch, splits):
    """RoPE and the K/V write in the decode kernel, with sinks; through ``attend_rotary`` (a pure paged
    decode step) and, for a gathered step, ``rope_write_kv`` then the gathered form."""
    from areno.models import fused_ops

    cache = pc.pool(2)
    tables, (qkv, hq, hkv, cos, sin, bt_BN, ctx_B, slot_B), (q_ref, k_ref, v_ref) = _rotary_case(cache, 4, [1, 5, 18])
    sinks_H = _sinks(4)
    ref = _reference(q_ref, k_ref, v_ref, tables, ctx_B - 1, None, sinks_H)
    out = emulated.paged_decode_rotary(
        qkv, hq, hkv, cos, sin, cache.k_S[0], cache.v_S[0], slot_B, bt_BN, ctx_B, pc.BS, None,
        tile=16, num_splits=splits, sinks_H=sinks_H,
    )  # fmt: skip
    _check(out, ref)
    assert torch.equal(cache.k_S[0], k_ref) and torch.equal(cache.v_S[0], v_ref)
    # attend_rotary's two forms (the fused kernels stood in for: emulated, and eager)
    monkeypatch.setattr(fused_ops, "rope_write_fits", lambda *a: True)
    monkeypatch.setattr(fused_ops, "rope_write_kv", fused_ops.eager_rope_write_kv)
    monkeypatch.setattr(rollout_attention, "triton_available", lambda: True)
    monkeypatch.setattr(rollout_attention, "paged_decode_rotary", emulated.paged_decode_rotary)
    for mode in ("paged", "gather"):
        attn = PagedAttention.for_decode(cache, bt_BN, ctx_B, decode_attention=mode)
        _check(attn.attend_rotary(0, qkv, hq, hkv, cos, sin, sinks_H=sinks_H), ref)


# ---------------------------------------------------------------------------------------------- GPU


def needs_gpu(fn):
    return pytest.mark.gpu(
        pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and triton")(fn)
    )


@needs_gpu
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("splits", [1, 3, None])
def test_triton_paged_decode_on_gpu(dtype, atol, window, splits):
    """The Triton kernel, one split and several (None: auto, 8 here), and the gathered form on CUDA."""
    from areno.rollout.fused_loop import new_token_slots_torch
    from areno.rollout.paged_decode import paged_decode_triton

    cache = pc.pool(2, num_blocks=600, bs=16, dh=64, dtype=dtype, device="cuda")
    tables, bt_BN, ctx_B, q = _decode_case(cache, 14, [1, 16, 17, 100, 255, 300, 513, 64])
    sinks_H = _sinks(14, dtype=dtype).cuda()
    k_S, v_S = cache.k_S[0], cache.v_S[0]
    ref = _reference(q, k_S, v_S, tables, ctx_B - 1, window, sinks_H, bs=16)
    out = paged_decode_triton(q, k_S, v_S, bt_BN, ctx_B, 16, window, num_splits=splits, sinks_H=sinks_H)
    plain = paged_decode_triton(q, k_S, v_S, bt_BN, ctx_B, 16, window, num_splits=splits)
    assert out.dtype == dtype
    _check(out, ref, plain, atol)
    slot_B = new_token_slots_torch(bt_BN, ctx_B, 16, cache.scratch_block * 16)
    k_new, v_new = k_S[slot_B].clone(), v_S[slot_B].clone()  # the new K/V as the pool holds them
    for mode in ("paged", "gather"):  # through the backend; the gathered form: explicit sink softmax
        attn = PagedAttention.for_decode(cache, bt_BN, ctx_B, window, decode_attention=mode)
        _check(attn(0, q, k_new, v_new, sinks_H), ref, atol=atol)


@needs_gpu
@pytest.mark.parametrize("splits", [1, 3, None])
def test_triton_rotary_decode_on_gpu(splits):
    from areno.rollout.paged_decode import paged_decode_rotary

    cache = pc.pool(2, num_blocks=600, bs=16, dh=64, dtype=torch.bfloat16, device="cuda")
    tables, args, (q_ref, k_ref, v_ref) = _rotary_case(cache, 14, [1, 16, 17, 100, 255, 300, 513, 64])
    qkv, hq, hkv, cos, sin, bt_BN, ctx_B, slot_B = args
    sinks_H = _sinks(14, dtype=torch.bfloat16).cuda()
    out = paged_decode_rotary(
        qkv, hq, hkv, cos, sin, cache.k_S[0], cache.v_S[0], slot_B, bt_BN, ctx_B, 16, 37,
        num_splits=splits, sinks_H=sinks_H,
    )  # fmt: skip
    _check(out, _reference(q_ref, k_ref, v_ref, tables, ctx_B - 1, 37, sinks_H, bs=16), atol=2e-2)
    assert torch.equal(cache.k_S[0], k_ref) and torch.equal(cache.v_S[0], v_ref)


@needs_gpu
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (2, 2)])
def test_varlen_prefill_on_gpu(hq, hkv, window):
    """The real flash varlen call's log-sum-exp: its layout and units are what the sink scaling reads."""
    from areno.models.attention import varlen_available

    if not (varlen_available() and rollout_attention.varlen_lse_available()):
        pytest.skip("this torch's varlen_attn returns no log-sum-exp")
    cache = pc.pool(hkv, dtype=torch.bfloat16, device="cuda")
    attn, tables_T, pos_T, (q, k, v) = _varlen_case(cache, hq, hkv, window, "cuda", torch.bfloat16)
    sinks_H = _sinks(hq, dtype=torch.bfloat16).cuda()
    out = attn(0, q, k, v, sinks_H=sinks_H)
    plain = attn(0, q, k, v)
    _check(out, _reference(q, cache.k_S[0], cache.v_S[0], tables_T, pos_T, window, sinks_H), plain, atol=2e-2)
