"""Chunked log-probs: values and gradients equal the unchunked computation; alignment convention."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from areno.models import Decoder, tiny_config
from areno.models.logprobs import logprobs_from_hidden, packed_logprobs

VOCAB = 37


class _MatmulCount(TorchDispatchMode):
    """Counts the matrix products run inside it."""

    n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # a CPU head's logits run through oneDNN's packed product (logprobs._packed_head)
        if func.overloadpacket in (
            torch.ops.aten.mm,
            torch.ops.aten.addmm,
            torch.ops.aten.addmm_,
            torch.ops.mkldnn._linear_pointwise,
        ):
            self.n += 1
        return func(*args, **(kwargs or {}))


class _OpNames(TorchDispatchMode):
    """The names of the ops run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _reference(hidden_TD, weight_VD, targets_T, temperature):
    logp_TV = torch.log_softmax((hidden_TD @ weight_VD.t()).float() / temperature, -1)
    entropy_T = -(logp_TV.exp() * logp_TV).sum(-1)
    return logp_TV.gather(-1, targets_T[:, None])[:, 0], entropy_T


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [1, 5, 64])
def test_logprobs_from_hidden_values_and_grads(temperature, chunk_size):
    torch.manual_seed(0)
    h = torch.randn(23, 16, requires_grad=True)
    w = torch.randn(VOCAB, 16, requires_grad=True)
    tgt = torch.randint(0, VOCAB, (23,))
    g_lp, g_ent = torch.randn(23), torch.randn(23)

    lp, ent = logprobs_from_hidden(h, w, tgt, temperature, chunk_size, with_entropy=True)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None

    ref_lp, ref_ent = _reference(h, w, tgt, temperature)
    ((ref_lp * g_lp).sum() + (ref_ent * g_ent).sum()).backward()
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gh, h.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gw, w.grad, atol=1e-5, rtol=1e-5)


def test_logprobs_gradcheck_float64():
    torch.manual_seed(0)
    h = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    tgt = torch.randint(0, 9, (6,))
    # fp32 softmax inside: compare against the autograd reference rather than finite differences.
    lp, ent = logprobs_from_hidden(h, w, tgt, 1.3, 4, with_entropy=True)
    (lp.sum() + 2 * ent.sum()).backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    ref_lp, ref_ent = _reference(h, w, tgt, 1.3)
    (ref_lp.sum() + 2 * ref_ent.sum()).backward()
    torch.testing.assert_close(gh, h.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(gw, w.grad, atol=1e-5, rtol=1e-4)


def test_packed_logprobs_alignment_and_chunking():
    torch.manual_seed(0)
    model = Decoder(tiny_config(VOCAB, arch="qwen3", hidden_size=32, initializer_range=0.2))
    lens = [6, 1, 9]
    cu_B1 = torch.tensor([0, 6, 7, 16])
    ids_T = torch.randint(0, VOCAB, (16,))

    lp_full, ent_full = packed_logprobs(model, ids_T, cu_B1, temperature=0.8, chunk_size=10_000, with_entropy=True)
    lp_chunk, ent_chunk = packed_logprobs(model, ids_T, cu_B1, temperature=0.8, chunk_size=3, with_entropy=True)
    torch.testing.assert_close(lp_chunk, lp_full, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent_chunk, ent_full, atol=1e-6, rtol=1e-6)

    # Each sequence scored alone gives the same values; the first token of each is 0.
    start = 0
    for n in lens:
        seq = ids_T[start : start + n]
        with torch.no_grad():
            logp_TV = torch.log_softmax(model.logits(model(seq, torch.arange(n))) / 0.8, -1)
        expected = torch.zeros(n)
        expected[1:] = logp_TV[:-1].gather(-1, seq[1:, None])[:, 0]
        torch.testing.assert_close(lp_full[start : start + n].detach(), expected, atol=1e-5, rtol=1e-5)
        assert lp_full[start] == 0 and ent_full[start] == 0
        start += n

    # Gradients w.r.t. parameters are the same chunked or not.
    def grads(chunk):
        model.zero_grad()
        lp, ent = packed_logprobs(model, ids_T, cu_B1, chunk_size=chunk, with_entropy=True)
        (lp.sum() - 0.1 * ent.sum()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    g_full, g_chunk = grads(10_000), grads(4)
    for name in g_full:
        torch.testing.assert_close(g_chunk[name], g_full[name], atol=1e-5, rtol=1e-4, msg=name)


def test_packed_logprobs_bad_input():
    model = Decoder(tiny_config(VOCAB, hidden_size=32))
    with pytest.raises(ValueError, match="cu_seqlens"):
        packed_logprobs(model, torch.zeros(5, dtype=torch.long), torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="max_position_embeddings=8"):
        small = Decoder(tiny_config(VOCAB, hidden_size=32, max_position_embeddings=8))
        packed_logprobs(small, torch.zeros(12, dtype=torch.long), torch.tensor([0, 3, 12]))
    with pytest.raises(ValueError, match="temperature"):
        packed_logprobs(model, torch.zeros(5, dtype=torch.long), torch.tensor([0, 5]), temperature=0.0)


def test_logprobs_backward_keeps_forwards_autocast():
    """fp32 weights under bf16 autocast (the one-GPU backend's mixed precision): the backward's
    recomputed logits and both gradient matmuls run in bf16 like forward's, not as fp32 GEMMs, and
    the gradients keep the inputs' dtypes and match plain autograd through the same autocast."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class MatmulDtypes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
                self.seen.append({a.dtype for a in args if isinstance(a, torch.Tensor)})
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    h = torch.randn(24, 16, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    targets = torch.randint(0, 50, (24,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, _ = logprobs_from_hidden(h, w, targets, chunk_size=10)
        ref = torch.log_softmax((h @ w.t()).float(), -1).gather(-1, targets[:, None])[:, 0]
    mode = MatmulDtypes()
    with mode:
        gh, gw = torch.autograd.grad(lp.sum(), (h, w))
    assert mode.seen and all(s == {torch.bfloat16} for s in mode.seen), mode.seen
    assert gh.dtype == torch.float32 and gw.dtype == torch.float32
    rh, rw = torch.autograd.grad(ref.sum(), (h, w))
    torch.testing.assert_close(gh, rh, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gw, rw, rtol=2e-2, atol=2e-2)


def test_attention_gets_autocast_dtype_inputs():
    """fp32 weights under bf16 autocast: RoPE's fp32 tables would promote q and k to fp32 (and the
    packed kernels are not autocast ops), so the attention layer hands q/k/v over in bf16; without
    autocast they stay fp32."""
    import torch.nn.functional as F

    seen = []

    def attention(layer_idx, q_THD, k_THD, v_THD):
        seen.append({q_THD.dtype, k_THD.dtype, v_THD.dtype})
        q, k, v = (x.transpose(0, 1)[None] for x in (q_THD, k_THD, v_THD))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)[0].transpose(0, 1)

    model = Decoder(tiny_config(64, hidden_size=32, layers=2))
    ids = torch.randint(0, 64, (10,))
    pos = torch.arange(10)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(ids, pos, attention)
    assert seen == [{torch.bfloat16}] * 2, seen
    seen.clear()
    model(ids, pos, attention)
    assert seen == [{torch.float32}] * 2, seen


@pytest.mark.parametrize("with_entropy, entropy_in_loss", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_kept_log_softmax_gives_the_recomputed_gradients_bit_for_bit(
    monkeypatch, with_entropy, entropy_in_loss, temperature
):
    """A small head keeps forward's log-softmax for backward (KEEP_LOGSOFTMAX_MAX_BYTES), with the
    entropy also its softmax when both fit; a larger one keeps its logits when they fit
    (keep_logits_budget); the largest recompute the logits there. All give the same values and
    gradients, also over two backwards of one graph (retain_graph: the second recomputes)."""
    from areno.models import logprobs as lp_mod

    torch.manual_seed(0)
    h0, w0 = torch.randn(23, 16), torch.randn(VOCAB, 16)
    tgt = torch.randint(0, VOCAB, (23,))
    g_lp, g_ent = torch.randn(23), torch.randn(23)

    def run(budget, logits_budget=0):
        monkeypatch.setattr(lp_mod, "KEEP_LOGSOFTMAX_MAX_BYTES", budget)
        monkeypatch.setattr(lp_mod, "keep_logits_budget", lambda device: logits_budget)
        h, w = h0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        lp, ent = logprobs_from_hidden(h, w, tgt, temperature, 5, with_entropy=with_entropy)
        loss = (lp * g_lp).sum() + ((ent * g_ent).sum() if entropy_in_loss else 0.0)
        with _MatmulCount() as first_backward:
            loss.backward(retain_graph=True)
        first = (h.grad.clone(), w.grad.clone())
        loss.backward()
        outs = (lp.detach(), ent.detach() if with_entropy else lp.detach()), first, (h.grad, w.grad)
        return outs, first_backward.n

    # without entropy (the CPU softmax form) the weight's gradient is one GEMM over all chunks
    weight_gemms = 1 if not with_entropy else 5
    recomputed, recomputing_matmuls = run(0)
    assert recomputing_matmuls == 2 * 5 + weight_gemms  # per chunk the logits again and the input's gradient
    # log-softmax and softmax kept; the log-softmax alone; the logits alone
    for kept, matmuls in (run(1 << 30), run(23 * VOCAB * 4), run(0, 23 * VOCAB * 4)):
        assert matmuls == 5 + weight_gemms
        assert all(torch.equal(a, b) for a, b in zip(kept[0], recomputed[0]))
        for a, b in zip(kept[1] + kept[2], recomputed[1] + recomputed[2]):
            assert torch.equal(a, b)


def test_cpu_softmax_form_skips_the_exp_pass_and_keeps_tiny_targets_exact():
    """Without entropy a CPU head runs the softmax (kept for backward, which then needs no ``exp``
    over [C, V]) and takes log p[target] from it; a target whose probability is below
    ``TINY_PROB`` (here e^-200 or less, where fp32 underflows) is recomputed from its logits. Values and
    gradients match float64."""
    from areno.models import logprobs as lp_mod

    torch.manual_seed(0)
    h0, w0 = torch.randn(23, 16), torch.randn(VOCAB, 16)
    tgt = torch.randint(0, VOCAB, (23,))
    w0[5] = -20.0 * h0[3] / h0[3].norm() ** 2 * 10.0  # logit of token 5 at row 3: -200, far below the others
    tgt[3] = 5
    g_lp = torch.randn(23)
    for temperature in (1.0, 0.7):
        h, w = h0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        with _OpNames() as ops:
            lp, _ = logprobs_from_hidden(h, w, tgt, temperature, 5, with_entropy=False)
            (lp * g_lp).sum().backward()
        seen = ops.names
        assert "_softmax" in seen and "_log_softmax" not in seen and "exp_" not in seen and "exp" not in seen
        h64, w64 = h0.double().requires_grad_(True), w0.double().requires_grad_(True)
        ref = torch.log_softmax(h64 @ w64.t() / temperature, -1).gather(-1, tgt[:, None])[:, 0]
        assert ref[3] < math.log(lp_mod.TINY_PROB)  # the fallback row
        (ref * g_lp.double()).sum().backward()
        torch.testing.assert_close(lp.double(), ref.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(h.grad.double(), h64.grad, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-4, atol=1e-5)


class _CopiesOf(TorchDispatchMode):
    """The shapes of the tensors ``copy_`` writes inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten.copy_:
            self.shapes.append(tuple(args[0].shape))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fp32_cpu_head_builds_the_gradient_in_forwards_softmax_buffer(temperature):
    """A small fp32 CPU head without entropy writes each chunk's softmax into one [T, V] buffer, which
    backward turns into the logits' gradient in place: no chunk is copied, the weight's gradient is one
    GEMM over the buffer, and values and gradients match float64."""
    torch.manual_seed(1)
    h0, w0 = torch.randn(23, 16), torch.randn(VOCAB, 16)
    tgt = torch.randint(0, VOCAB, (23,))
    g_lp = torch.randn(23)
    h, w = h0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
    lp, _ = logprobs_from_hidden(h, w, tgt, temperature, 5, with_entropy=False)
    with _CopiesOf() as copies, _MatmulCount() as matmuls:
        (lp * g_lp).sum().backward()
    assert not [shape for shape in copies.shapes if shape[-1] == VOCAB], copies.shapes
    assert matmuls.n == 5 + 1  # the input's gradient per chunk, the weight's once
    h64, w64 = h0.double().requires_grad_(True), w0.double().requires_grad_(True)
    ref = torch.log_softmax(h64 @ w64.t() / temperature, -1).gather(-1, tgt[:, None])[:, 0]
    (ref * g_lp.double()).sum().backward()
    torch.testing.assert_close(lp.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h.grad.double(), h64.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-4, atol=1e-5)


def test_cpu_head_logits_take_the_packed_product_where_onednn_has_it(monkeypatch):
    """A CPU head's logits run through a oneDNN-packed copy of its weight, packed once per call, where
    oneDNN computes ``F.linear``; above ``PACKED_HEAD_MAX_ELEMENTS``, or in a dtype the hidden states do
    not share, the head keeps MKL's product. Both give the same log-probs within fp32 rounding."""
    from areno.models import cpu_gemm
    from areno.models import logprobs as lp_mod

    if not cpu_gemm.supported():
        pytest.skip("no oneDNN packed linear in this PyTorch build")
    torch.manual_seed(2)
    h, w = torch.randn(23, 16), torch.randn(VOCAB, 16)
    tgt = torch.randint(0, VOCAB, (23,))

    def run():
        with _OpNames() as ops, torch.no_grad():
            lp, _ = logprobs_from_hidden(h, w, tgt, 1.0, 5)
        return lp, ops.names

    packed_lp, names = run()
    assert {"_reorder_linear_weight", "_linear_pointwise"} <= names and "mm" not in names
    monkeypatch.setattr(lp_mod, "PACKED_HEAD_MAX_ELEMENTS", w.numel() - 1)
    mkl_lp, names = run()
    assert "mm" in names and "_linear_pointwise" not in names
    torch.testing.assert_close(packed_lp, mkl_lp, rtol=1e-5, atol=1e-5)
    monkeypatch.undo()
    # under bf16 autocast the weight's GEMMs run in bf16 and fp32 hidden states are cast in each: no packed copy
    with _OpNames() as ops, torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logprobs_from_hidden(h, w, tgt, 1.0, 5)
    assert "_linear_pointwise" not in ops.names


def test_head_weight_gradient_sums_chunks_in_float32():
    """The head's weight gradient is summed over chunks inside the GEMM (``addmm_`` for fp32): it
    matches float64 autograd at fp32 precision whatever the chunking, and under bf16 autocast
    (fp32 weights) the products still run in bf16 with an fp32 result."""
    torch.manual_seed(0)
    h = torch.randn(37, 16, dtype=torch.float64)
    w = torch.randn(50, 16, dtype=torch.float64)
    targets = torch.randint(0, 50, (37,))
    h64, w64 = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref = torch.log_softmax(h64 @ w64.t(), -1).gather(-1, targets[:, None])[:, 0]
    _, rw = torch.autograd.grad((ref * torch.linspace(-1, 1, 37, dtype=torch.float64)).sum(), (h64, w64))
    for chunk in (5, 16, 64):
        h32, w32 = h.float().requires_grad_(), w.float().requires_grad_()
        lp, _ = logprobs_from_hidden(h32, w32, targets, chunk_size=chunk)
        _, gw = torch.autograd.grad((lp * torch.linspace(-1, 1, 37)).sum(), (h32, w32))
        assert gw.dtype == torch.float32
        torch.testing.assert_close(gw.double(), rw, rtol=1e-5, atol=1e-5)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lp, _ = logprobs_from_hidden(h32, w32, targets, chunk_size=chunk)
        _, gw = torch.autograd.grad((lp * torch.linspace(-1, 1, 37)).sum(), (h32, w32))
        assert gw.dtype == torch.float32
        torch.testing.assert_close(gw.double(), rw, rtol=3e-2, atol=3e-2)


class _GpuHidden:
    """What ``auto_chunk_size`` reads of a hidden-state tensor on a GPU, without one."""

    def __init__(self, itemsize: int) -> None:
        self.device = torch.device("cuda")
        self._itemsize = itemsize

    def element_size(self) -> int:
        return self._itemsize


def test_auto_chunk_size_fits_the_peak_budget(monkeypatch):
    """None picks a power of two within the range whose chunk stays within a share of the GPU's
    memory (about three logits' bytes per entry); CPU heads take ``CPU_CHUNK``."""
    from areno.models import logprobs as lp

    low, high = lp.AUTO_CHUNK_RANGE
    assert lp.auto_chunk_size(torch.zeros(4, 8), torch.zeros(151_936, 8)) == lp.CPU_CHUNK
    for memory in (24 << 30, 80 << 30, 141 << 30):
        monkeypatch.setattr(lp, "_device_memory", lambda device, m=memory: m)
        budget = memory // lp.AUTO_CHUNK_MEMORY_SHARE
        for vocab, itemsize in [(151_936, 2), (32_000, 2), (262_144, 2), (151_936, 4), (10**7, 2)]:
            chunk = lp.auto_chunk_size(_GpuHidden(itemsize), torch.empty(vocab, 0))
            assert low <= chunk <= high and chunk & (chunk - 1) == 0
            assert chunk == low or 3 * vocab * itemsize * chunk <= budget
            assert chunk == high or 3 * vocab * itemsize * chunk * 2 > budget
    # Qwen2.5's 151,936-token head in bf16: 1024 tokens on a 24 GiB GPU, 4096 on 80, 8192 on an H200
    expected = {24 << 30: 1024, 80 << 30: 4096, 139 << 30: 8192}
    for memory, chunk in expected.items():
        monkeypatch.setattr(lp, "_device_memory", lambda device, m=memory: m)
        assert lp.auto_chunk_size(_GpuHidden(2), torch.empty(151_936, 0)) == chunk


def test_keep_logits_budget_is_a_share_of_the_gpu_and_half_of_what_is_free(monkeypatch):
    """Kept logits take at most 1/8 of a GPU's memory and half of its free memory (the device's and
    the caching allocator's unused blocks): a run near its limit recomputes them instead."""
    from areno.models import logprobs as lp

    gib, state = 1 << 30, {}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (state["free"], 141 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: state["reserved"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: state["allocated"])
    cuda = torch.device("cuda", 0)
    state.update(free=90 * gib, reserved=50 * gib, allocated=42 * gib)
    assert lp.keep_logits_budget(cuda) == 141 * gib // lp.KEEP_LOGITS_MEMORY_SHARE
    state.update(free=4 * gib, reserved=60 * gib, allocated=58 * gib)
    assert lp.keep_logits_budget(cuda) == 3 * gib
    assert lp.keep_logits_budget(torch.device("cpu")) == lp.KEEP_LOGSOFTMAX_MAX_BYTES
