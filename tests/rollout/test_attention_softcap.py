"""Gemma 2's soft-capped attention scores in the rollout engine's attention: every form of ``PagedAttention``
(the gathered decode and prefill, grouped or not; the CPU matmul decode with and without its carry; the paged
decode in torch and, emulated on CPU or real on a GPU, in Triton with split-K and RoPE) equals transformers'
eager attention with ``softcap``, a cap small enough to bend the scores gives another output, and the flash
varlen form, which has no cap, refuses it.

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

CAP = 1.5
"""Below most of the cases' scaled scores (q and k of unit entries over 8 dimensions): the cap bends them."""


def _reference(q_THD, k_S, v_S, tables_T, pos_T, window, softcap, bs=pc.BS) -> torch.Tensor:
    """transformers' eager Gemma 2 attention per query token in float64: scaled scores over keys 0..p of its
    table (the last ``window`` of them), capped to ``softcap * tanh(s / softcap)``, then the softmax."""
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
        if softcap is not None:
            s_HL = softcap * torch.tanh(s_HL / softcap)
        out[t] = torch.einsum("hl,lhd->hd", torch.softmax(s_HL, dim=1), v_LHD)
    return out


def _check(out_THD, ref_THD, plain_THD=None, atol=1e-5):
    """``out`` equals the reference; where given, the uncapped output differs (the cap acted)."""
    torch.testing.assert_close(out_THD.double().cpu(), ref_THD, rtol=0, atol=atol)
    if plain_THD is not None:
        assert (out_THD - plain_THD).abs().max() > 0.05


# ---------------------------------------------------------------------------------------------- decode


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("cpu_matmul", [True, False])
@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (2, 2)])
def test_gathered_decode(monkeypatch, hq, hkv, grouped, cpu_matmul, window):
    """Decode rows through the gathered form: the CPU matmul decode (``cpu_matmul``, capped before its mask)
    or the explicit-score form SDPA's call gives way to, q grouped per KV head or not."""
    monkeypatch.setattr(PagedAttention, "GROUPED_DECODE", grouped)
    monkeypatch.setattr(rollout_attention, "CPU_DECODE_MATMUL", cpu_matmul)
    cache = pc.pool(hkv)
    ctx = [1, 4, 9, 17, 30]
    tables = pc.tables(cache, ctx)
    bt_BN, ctx_B = pc.padded(cache, tables, 8), torch.tensor(ctx)
    q, k, v = pc.qkv(len(ctx), hq, hkv, scale=2.0)
    attn = PagedAttention.for_decode(cache, bt_BN, ctx_B, window)
    out = attn(0, q, k, v, softcap=CAP)
    plain = attn(0, q, k, v)
    _check(out, _reference(q, cache.k_S[0], cache.v_S[0], tables, ctx_B - 1, window, CAP), plain)
    _check(plain, _reference(q, cache.k_S[0], cache.v_S[0], tables, ctx_B - 1, window, None))


@pytest.mark.parametrize("hq,hkv", [(4, 2), (2, 2)])
def test_cpu_decode_carry(hq, hkv):
    """The CPU decode carry: a fresh gather, then two steps that extend the carried K/V."""
    cache = pc.pool(hkv)
    cache.decode_carry = DecodeCarry(1, 8 * pc.BS, 1 << 28)
    ctx = [1, 4, 9, 17, 29]
    tables = pc.tables(cache, [c + 2 for c in ctx])
    bt_BN = pc.padded(cache, tables, 8)
    for step in range(3):
        ctx_B = torch.tensor(ctx) + step
        attn = PagedAttention.for_decode(cache, bt_BN, ctx_B, carry=True)
        assert attn.decode.carry is not None and attn.decode.extend == (step > 0)
        q, k, v = pc.qkv(len(ctx), hq, hkv, seed=step, scale=2.0)
        out = attn(0, q, k, v, softcap=CAP)
        _check(out, _reference(q, cache.k_S[0], cache.v_S[0], tables, ctx_B - 1, None, CAP))
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
    q, k, v = pc.qkv(len(ctx), hq, hkv, dtype=dtype, scale=2.0)
    attn = PagedAttention.for_decode(cache, bt_BN, ctx_B, window, decode_attention="paged")
    out = attn(0, q, k, v, softcap=CAP)
    assert out.dtype == dtype
    _check(out, _reference(q, cache.k_S[0], cache.v_S[0], tables, ctx_B - 1, window, CAP), attn(0, q, k, v), atol)
    alone = paged_decode_torch(q, cache.k_S[0], cache.v_S[0], bt_BN, ctx_B, pc.BS, window, softcap=CAP)
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
    chunks, tables, tables_T, pos_T, (q, k, v) = pc.mixed_case(cache, hq, hkv, scale=2.0)
    if decode == "build":
        attn = PagedAttention.build(cache, chunks, torch.device("cpu"), window)
    else:
        dec = PagedAttention.for_decode(
            cache, pc.padded(cache, tables[:2]), torch.tensor([4, 11]), window, decode_attention=decode
        )
        attn = PagedAttention.mixed(dec, PagedAttention.build(cache, chunks[2:], torch.device("cpu"), window))
    out = attn(0, q, k, v, softcap=CAP)
    _check(out, _reference(q, cache.k_S[0], cache.v_S[0], tables_T, pos_T, window, CAP), attn(0, q, k, v))


def test_long_prefill_in_blocks_of_query_rows(monkeypatch):
    """A prefill chunk whose scores exceed ``SINK_SCORES_BYTES`` attends in blocks of query rows."""
    monkeypatch.setattr(rollout_attention, "SINK_SCORES_BYTES", 4 * 2 * 4 * 20)  # 4 heads' rows a block
    cache = pc.pool(2)
    chunks, _, tables_T, pos_T, (q, k, v) = pc.mixed_case(cache, 4, 2, seed=3, scale=2.0)
    attn = PagedAttention.build(cache, chunks[2:], torch.device("cpu"))
    out = attn(0, q[2:], k[2:], v[2:], softcap=CAP)
    _check(out, _reference(q[2:], cache.k_S[0], cache.v_S[0], tables_T[2:], pos_T[2:], None, CAP))


@pytest.mark.parametrize("decode", ["gather", "paged"])
def test_layer_window_attention(decode):
    """Layers 0 sliding and 1 full (``LayerWindowAttention``, Gemma 2's layout), in a mixed step and a decode
    step."""
    cache = pc.pool(2, layers=2)
    chunks, tables, tables_T, pos_T, (q, k, v) = pc.mixed_case(cache, 4, 2, scale=2.0)
    cpu = torch.device("cpu")
    mixed = PagedAttention.build(cache, chunks, cpu, 3, window_layers=(0,))
    dec = PagedAttention.for_decode(
        cache, pc.padded(cache, tables[:2]), torch.tensor([4, 11]), 3, decode_attention=decode, window_layers=(0,)
    )
    assert isinstance(mixed, LayerWindowAttention) and isinstance(dec, LayerWindowAttention)
    for layer, window in ((0, 3), (1, None)):
        out = mixed(layer, q, k, v, softcap=CAP)
        _check(out, _reference(q, cache.k_S[layer], cache.v_S[layer], tables_T, pos_T, window, CAP))
        out = dec(layer, q[:2], k[:2], v[:2], softcap=CAP)
        _check(out, _reference(q[:2], cache.k_S[layer], cache.v_S[layer], tables_T[:2], pos_T[:2], window, CAP))


# ------------------------------------------------------------------------------------- flash varlen


def test_varlen_prefill_refuses_the_cap():
    """A prefill-graph step (flash's varlen kernel, which has no cap) asked for a cap says what to set."""
    cache = pc.pool(2)
    chunks, _, tables_T, pos_T, (q, k, v) = pc.mixed_case(cache, 4, 2, scale=2.0)
    i32 = dict(dtype=torch.int32)
    attn = PagedAttention.for_prefill(
        cache, torch.zeros(q.shape[0], dtype=torch.long), torch.zeros(3, dtype=torch.long),
        torch.tensor([0, q.shape[0]], **i32), torch.tensor([0, 3], **i32), q.shape[0], 3,
    )  # fmt: skip
    with pytest.raises(ValueError, match="soft-capped attention scores .* set rollout.prefill_cuda_graphs=false"):
        attn(0, q, k, v, softcap=CAP)


def test_prefill_graphs_name_the_cap_where_flash_would_run(monkeypatch):
    """With every other condition of the prefill graphs met, the soft-cap is the reason given."""
    from types import SimpleNamespace

    from areno.rollout import prefill_graph
    from tests.helpers.rollout import make_model

    monkeypatch.setattr(prefill_graph, "varlen_available", lambda: True)
    _, cfg = make_model(0, arch="gemma2")
    cache = pc.pool(2, dtype=torch.bfloat16, dh=16)
    engine = SimpleNamespace(tp_size=1, cache=cache, sliding_window=None, model_config=cfg)
    assert "soft-cap" in prefill_graph.PrefillGraphRunner.supported(engine)


# ------------------------------------------------------------------------------------- Triton kernel


@pytest.fixture
def emulated_kernel_module(monkeypatch):
    return emulated_paged_decode(monkeypatch)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("hq,hkv,bs,tile,splits", [(6, 2, 4, 16, 1), (4, 4, 16, 16, 3), (6, 2, 4, 16, 5)])
def test_triton_kernel_code_emulated_on_cpu(emulated_kernel_module, window, hq, hkv, bs, tile, splits):
    """The Triton decode kernel's own code (``tests/helpers/fake_triton``) with the cap: the torch loop's
    output and the reference's, for every split count; and a cap that bends nothing leaves it unchanged."""
    cache = pc.pool(hkv, num_blocks=80, bs=bs)
    ctx = [1, 4, 16, 17, 45, 33, 70]
    tables = pc.tables(cache, ctx)
    bt_BN, ctx_B = pc.padded(cache, tables, -(-max(ctx) // bs) + 1), torch.tensor(ctx)
    q = pc.qkv(len(ctx), hq, hkv, seed=5, scale=2.0)[0]
    k_S, v_S = cache.k_S[0], cache.v_S[0]
    out = emulated_kernel_module.paged_decode_triton(
        q, k_S, v_S, bt_BN, ctx_B, bs, window, tile=tile, num_splits=splits, softcap=CAP
    )
    torch.testing.assert_close(
        out, paged_decode_torch(q, k_S, v_S, bt_BN, ctx_B, bs, window, softcap=CAP), rtol=0, atol=1e-5
    )
    _check(out, _reference(q, k_S, v_S, tables, ctx_B - 1, window, CAP, bs=bs))
    plain = emulated_kernel_module.paged_decode_triton(
        q, k_S, v_S, bt_BN, ctx_B, bs, window, tile=tile, num_splits=splits
    )
    wide = emulated_kernel_module.paged_decode_triton(
        q, k_S, v_S, bt_BN, ctx_B, bs, window, tile=tile, num_splits=splits, softcap=1e4
    )
    torch.testing.assert_close(wide, plain, rtol=0, atol=1e-5)


@pytest.mark.parametrize("splits", [1, 3])
def test_rotary_kernel_code_emulated_on_cpu(emulated_kernel_module, splits):
    """RoPE and the K/V write inside the decode kernel, the new key's score capped too: ``rope_write_kv`` then
    the torch decode with the cap."""
    from areno.models.fused_ops import eager_rope_write_kv
    from areno.rollout.fused_loop import new_token_slots_torch

    cache = pc.pool(2, num_blocks=80)
    hq, hkv, dh = 6, 2, pc.D
    ctx = [1, 4, 16, 17, 45, 33]
    tables = pc.tables(cache, ctx)
    bt_BN, ctx_B = pc.padded(cache, tables, 13), torch.tensor(ctx)
    g = torch.Generator().manual_seed(6)
    qkv = 2 * torch.randn(len(ctx), (hq + 2 * hkv) * dh, generator=g)
    angle = (ctx_B - 1).float()[:, None] * torch.rand(dh // 2, generator=g)
    cos, sin = angle.cos(), angle.sin()
    slot_B = new_token_slots_torch(bt_BN, ctx_B, pc.BS, cache.scratch_block * pc.BS)
    k_ref, v_ref = cache.k_S[0].clone(), cache.v_S[0].clone()
    q = eager_rope_write_kv(qkv, hq, hkv, cos, sin, k_ref, v_ref, slot_B)
    ref = paged_decode_torch(q, k_ref, v_ref, bt_BN, ctx_B, pc.BS, None, softcap=CAP)
    out = emulated_kernel_module.paged_decode_rotary(
        qkv, hq, hkv, cos, sin, cache.k_S[0], cache.v_S[0], slot_B, bt_BN, ctx_B, pc.BS, None, tile=16,
        num_splits=splits, softcap=CAP,
    )  # fmt: skip
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    assert torch.equal(cache.k_S[0], k_ref) and torch.equal(cache.v_S[0], v_ref)
    assert (out - paged_decode_torch(q, k_ref, v_ref, bt_BN, ctx_B, pc.BS, None)).abs().max() > 0.05


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not triton_available(), reason="needs CUDA and triton")
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("splits", [1, 3])
def test_triton_kernel_caps_as_the_torch_loop_on_gpu(dtype, atol, window, splits):
    """The compiled Triton kernel with the cap (``_soft_cap``) against the torch loop on the GPU."""
    from areno.rollout.paged_decode import paged_decode_triton

    cache = pc.pool(2, num_blocks=80, dtype=dtype, device="cuda", dh=64)
    ctx = [1, 4, 16, 17, 45, 33, 70]
    tables = pc.tables(cache, ctx)
    bt_BN, ctx_B = pc.padded(cache, tables, 19).cuda(), torch.tensor(ctx, device="cuda")
    q = (torch.randn(len(ctx), 6, 64, device="cuda") * 3).to(dtype)
    k_S, v_S = cache.k_S[0], cache.v_S[0]
    out = paged_decode_triton(q, k_S, v_S, bt_BN, ctx_B, pc.BS, window, num_splits=splits, softcap=CAP)
    ref = paged_decode_torch(q, k_S, v_S, bt_BN, ctx_B, pc.BS, window, softcap=CAP)
    torch.testing.assert_close(out.float(), ref.float(), rtol=0, atol=atol)
