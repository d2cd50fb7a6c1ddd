"""Right-padded attention batches on CPU (``models.attention``): ``length_buckets``' grouping of
sequences by length, and ``padded_sdpa`` over several padded batches against one batch and against
float64 per-sequence attention (causal, and aligned to the end of gathered keys)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from areno.models import attention
from areno.models.attention import PackedCausalAttention, length_buckets, padded_layout, padded_sdpa


def _cost(runs, len_q, len_k, heads, call):
    return sum(len(r) * len_q[r].max() * len_k[r].max() * heads + call for r in runs)


def test_equal_lengths_are_one_batch_and_shared_prompts_their_own():
    lens = np.full(8, 160)
    assert [r.tolist() for r in length_buckets(lens, lens, 4)[0]] == [list(range(8))]
    # six groups' prompts (34 queries over their 34 keys) and their samples' rests (128 over 162), 8 heads
    len_q, len_k = np.array([34] * 6 + [128] * 24), np.array([34] * 6 + [162] * 24)
    runs, _ = length_buckets(len_q, len_k, 8)
    assert sorted(map(sorted, (r.tolist() for r in runs))) == [list(range(6)), list(range(6, 30))]
    # a batch's cost against the padding it saves: one head's entries are not worth a second batch
    assert len(length_buckets(len_q, len_k, 1)[0]) == 1
    assert len(length_buckets(len_q, len_k, 8, call_entries=10**9)[0]) == 1


@pytest.mark.parametrize("seed", range(6))
def test_buckets_minimise_padding_over_the_sorted_splits(seed):
    """Every sequence in exactly one run, and no split of the length-sorted order into contiguous
    runs pads fewer score entries (with the per-run cost) than the one chosen."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 9))
    len_q = rng.integers(1, 60, n)
    len_k = len_q + rng.integers(0, 40, n) * (seed % 2)  # even seeds: causal (keys = queries)
    call, heads = int(rng.choice([0, 200, 5000])), int(rng.integers(1, 5))
    runs, cost = length_buckets(len_q, len_k, heads, call_entries=call)
    assert sorted(np.concatenate(runs).tolist()) == list(range(n))
    order = np.lexsort((-len_q, -len_k))
    best = min(
        _cost(np.split(order, list(cuts)), len_q, len_k, heads, call)
        for k in range(n)
        for cuts in itertools.combinations(range(1, n), k)
    )
    assert _cost(runs, len_q, len_k, heads, call) == best == cost


def _end_aligned_reference(q, k, v, cu_q, cu_k):
    """float64 per-sequence attention, each sequence's queries the last of its keys (GQA by repeat)."""
    outs = []
    for s in range(len(cu_q) - 1):
        qs, ks, vs = q[cu_q[s] : cu_q[s + 1]], k[cu_k[s] : cu_k[s + 1]], v[cu_k[s] : cu_k[s + 1]]
        g = qs.shape[1] // ks.shape[1]
        ks, vs = ks.repeat_interleave(g, 1), vs.repeat_interleave(g, 1)
        nq, nk = qs.shape[0], ks.shape[0]
        allowed = torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + (nk - nq)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) / qs.shape[-1] ** 0.5
        p = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", p, vs))
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_several_padded_batches_match_float64(dtype, monkeypatch):
    """Queries at the end of their keys (a shared prompt's rests) with lengths from 1 to 40: split
    into several batches (``PAD_CALL_ENTRIES`` = 0) or one, whole or in blocks of query rows, output
    and gradients match float64 per-sequence attention (bf16: two bf16 GEMMs around an fp32 softmax;
    fp32: SDPA under a mask)."""
    g = torch.Generator().manual_seed(0)
    len_q = np.array([40, 3, 17, 1, 25, 9])
    len_k = len_q + np.array([0, 12, 12, 30, 5, 0])
    cu_q, cu_k = np.concatenate([[0], len_q.cumsum()]), np.concatenate([[0], len_k.cumsum()])
    q = torch.randn(int(cu_q[-1]), 4, 8, generator=g)
    k, v = (torch.randn(int(cu_k[-1]), 2, 8, generator=g) for _ in range(2))
    grad = torch.randn(q.shape, generator=g)
    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    ref = _end_aligned_reference(*ref_in, cu_q, cu_k)
    ref.backward(grad.double())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    # a batch per sequence, one batch, and blocks of 8 query rows (each seeing the keys up to its last
    # row) in one batch or in a batch per shape (15 shapes of 15 blocks)
    for call, block, n_batches in ((0, None, 6), (10**9, None, 1), (10**9, 8, 1), (0, 8, 15)):
        monkeypatch.setattr(attention, "PAD_CALL_ENTRIES", call)
        layout = padded_layout(cu_q, cu_k, torch.device("cpu"), end_aligned=True, dtype=dtype, query_block=block)
        assert all((b.bias_B1QK is not None) == (dtype == torch.bfloat16) for b in layout.buckets)
        assert len(layout.buckets) == n_batches
        ins = [t.detach().to(dtype, copy=True).requires_grad_() for t in (q, k, v)]
        out = padded_sdpa(*ins, layout)
        out.float().backward(grad)
        for got, want in zip([out, *(t.grad for t in ins)], [ref, *(t.grad for t in ref_in)]):
            assert got.dtype == dtype
            torch.testing.assert_close(got.double(), want, atol=tol * want.abs().max().item(), rtol=0)


def test_causal_batches_by_length_and_auto_pads_a_long_tail(monkeypatch):
    """Packed causal sequences with a long tail of lengths: ``sdpa_padded`` splits them into batches
    by length and matches per-sequence SDPA; ``auto`` on CPU pads them (their batches pad less than
    half) where one batch padded to the longest would not, and empty sequences take no rows."""
    lens = [200, 3, 0, 5, 4, 6, 2, 7, 3, 5, 0]
    cu_B1 = torch.tensor([0, *np.cumsum(lens).tolist()])
    g = torch.Generator().manual_seed(1)
    q = torch.randn(int(cu_B1[-1]), 4, 8, generator=g)
    k, v = (torch.randn(int(cu_B1[-1]), 2, 8, generator=g) for _ in range(2))
    ref = PackedCausalAttention(cu_B1, impl="sdpa")(0, q, k, v)
    attn = PackedCausalAttention(cu_B1, impl="auto")
    out = attn(0, q, k, v)
    assert attn._impl == "sdpa_padded" and len(attn._state.buckets) >= 2
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # one batch padded to 200 rows a sequence: auto takes one masked call instead
    monkeypatch.setattr(attention, "PAD_CALL_ENTRIES", 10**12)
    attn = PackedCausalAttention(cu_B1, impl="auto")
    torch.testing.assert_close(attn(0, q, k, v), ref, atol=1e-5, rtol=1e-5)
    assert attn._impl == "sdpa_mask"


def test_a_query_sequence_without_rows_but_with_keys_is_refused():
    cu_q, cu_k = np.array([0, 3, 3]), np.array([0, 3, 5])
    with pytest.raises(ValueError, match="without query rows has keys"):
        padded_layout(cu_q, cu_k, torch.device("cpu"), end_aligned=True)


def test_blocks_see_the_keys_up_to_their_last_row(monkeypatch):
    """A causal sequence of 10 rows in blocks of 4: pieces of 4, 4 and 2 query rows over its first 4, 8
    and 10 keys; every q row lands in one padded slot that gathers it back, and a padding slot repeats
    a real row of its piece. In bf16 on CPU the training layout takes blocks of ``QUERY_BLOCK`` rows."""
    cu = np.array([0, 10])
    monkeypatch.setattr(attention, "PAD_CALL_ENTRIES", 0)
    layout = padded_layout(cu, cu, torch.device("cpu"), end_aligned=False, query_block=4)
    shapes = sorted((b.num_seqs, b.len_q, b.len_k) for b in layout.buckets)
    assert shapes == [(1, 2, 10), (1, 4, 4), (1, 4, 8)]
    assert torch.equal(layout.src_q[layout.out_index], torch.arange(10))
    assert set(layout.src_k.tolist()) <= set(range(10))
    for b in layout.buckets:  # end-aligned: the block's last query row sees all its keys
        assert b.mask_BQK is not None and b.mask_BQK[0, b.len_q - 1].all()
    monkeypatch.undo()
    attn = PackedCausalAttention(torch.tensor([0, 600, 900]), impl="sdpa_padded")
    attn.prepare(900, torch.device("cpu"), 8, torch.bfloat16, query_heads=8)
    assert max(b.len_q for b in attn._state.buckets) == attention.QUERY_BLOCK
    # short sequences stay whole: their blocks would save less than the blocks' smaller products cost
    attn = PackedCausalAttention(torch.tensor([0, 100, 180]), impl="sdpa_padded")
    attn.prepare(180, torch.device("cpu"), 8, torch.bfloat16, query_heads=8)
    assert max(b.len_q for b in attn._state.buckets) == 100
    # float32 keeps whole sequences under the kernel's own causal mask (it skips the blocks above it)
    attn = PackedCausalAttention(torch.tensor([0, 600, 900]), impl="sdpa_padded")
    attn.prepare(900, torch.device("cpu"), 8, torch.float32, query_heads=8)
    assert max(b.len_q for b in attn._state.buckets) == 600
    assert all(b.mask_BQK is None for b in attn._state.buckets)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16: explicit GEMMs over query blocks
def test_windowed_sequences_pad_into_batches_as_the_full_ones_do(dtype):
    """A sliding window (Gemma 3's, OLMo 3's) in the padded batches: every batch's mask keeps the keys
    p - window < j <= p, query blocks included; values and gradients equal per-sequence SDPA's with the
    window; a layer outside ``window_layers`` attends in full through the twin."""
    lens = [300, 3, 0, 41, 17, 90]
    cu_B1 = torch.tensor([0, *np.cumsum(lens).tolist()])
    g = torch.Generator().manual_seed(2)
    T = int(cu_B1[-1])
    ins = [torch.randn(T, h, 16, generator=g).to(dtype).requires_grad_() for h in (4, 2, 2)]
    grad = torch.randn(T, 4, 16, generator=g).to(dtype)

    def run(attn, layer=0):
        for t in ins:
            t.grad = None
        out = attn(layer, *ins)
        out.backward(grad)
        return [out.detach().float(), *(t.grad.float() for t in ins)]

    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    attn = PackedCausalAttention(cu_B1, sliding_window=24, impl="auto", window_layers=(0,))
    got = run(attn)
    assert attn._impl == "sdpa_padded" and all(b.mask_BQK is not None for b in attn._state.buckets)
    for a, b in zip(got, run(PackedCausalAttention(cu_B1, sliding_window=24, impl="sdpa"))):
        torch.testing.assert_close(a, b, **tol)
    full = run(attn, layer=1)  # not a window layer
    for a, b in zip(full, run(PackedCausalAttention(cu_B1, impl="sdpa"))):
        torch.testing.assert_close(a, b, **tol)
    assert (full[0] - got[0]).abs().max() > 0.05  # the window changes the long sequences' rows
