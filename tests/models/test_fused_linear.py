"""Fused q/k/v and gate/up projections (``Decoder.fuse_projections``, areno/models/fused_linear.py):
the parameters become row slices of one tensor per group under the same names; no-grad forwards
run one GEMM per group and equal the per-projection forward; anything else behaves as before."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from areno.models import Decoder, fused_linear, fused_ops, tiny_config
from areno.models.fused_linear import FusedRows

VOCAB = 62
CASES = {
    "qwen2": dict(arch="qwen2"),  # q/k/v bias
    "llama": dict(arch="llama"),  # no bias
    "llama_mlp_bias": dict(
        arch="llama", attention_bias=True, attention_out_bias=True, mlp_bias=True, tie_word_embeddings=True
    ),
    "qwen3": dict(arch="qwen3", head_dim=24),  # q/k RMSNorm on the strided q/k views
    "mha": dict(arch="qwen2", kv_heads=4),
}


def build(case: str, seed: int = 0) -> Decoder:
    config = tiny_config(VOCAB, hidden_size=48, layers=2, heads=4, **{"kv_heads": 2, **CASES[case]})
    torch.manual_seed(seed)
    model = Decoder(config).eval()
    with torch.no_grad():  # wide init, non-zero biases: a mix-up of rows cannot hide
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model


def packed_batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (13,), generator=g)
    return ids, torch.arange(13)


@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_forward_equals_unfused(case):
    model, ref = build(case), build(case)
    ids, pos = packed_batch()
    names = {n: id(p) for n, p in model.named_parameters()}
    before = {n: t.clone() for n, t in model.state_dict().items()}
    model.fuse_projections()
    assert model.projections_fused and not ref.projections_fused
    # Same parameter objects, names and values.
    assert {n: id(p) for n, p in model.named_parameters()} == names
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[n], before[n]) for n in before)
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        # One contiguous [Dq + 2 Dkv, D] (and [2I, D]) tensor, the parameters its row slices in order.
        assert torch.equal(a.qkv.weight, torch.cat([before_w(before, layer, p) for p in ("q", "k", "v")]))
        base, row = a.qkv.weight.data_ptr(), a.qkv.weight.stride(0) * a.qkv.weight.element_size()
        assert a.q_proj.weight.data_ptr() == base
        assert a.k_proj.weight.data_ptr() == base + a.q_proj.weight.shape[0] * row
        assert a.v_proj.weight.data_ptr() == base + (a.q_proj.weight.shape[0] + a.k_proj.weight.shape[0]) * row
        assert (a.qkv.bias is None) == (a.q_proj.bias is None)
        if a.qkv.bias is not None:
            assert a.k_proj.bias.data_ptr() == a.qkv.bias.data_ptr() + a.q_proj.bias.numel() * a.qkv.bias.element_size()
        assert m.gate_up.weight.shape == (2 * m.gate_proj.weight.shape[0], m.gate_proj.weight.shape[1])
        assert m.up_proj.weight.data_ptr() == m.gate_up.weight.data_ptr() + m.gate_proj.weight.numel() * 4
        assert all(
            p.is_contiguous()
            for p in (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, m.gate_proj.weight, m.up_proj.weight)
        )
    with torch.no_grad():
        got, want = model(ids, pos), ref(ids, pos)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(model.logits(got), ref.logits(want), rtol=0, atol=1e-5)


def before_w(sd, layer, p):
    return sd[f"model.layers.{layer.self_attn.layer_idx}.self_attn.{p}_proj.weight"]


def test_fused_path_is_taken_and_matches_by_hand():
    """A no-grad forward runs one GEMM per group (counted), and the layer's q/k/v equal hand-
    computed x @ W^T + b from the fused tensor's row blocks."""
    model = build("qwen2")
    model.fuse_projections()
    a = model.model.layers[0].self_attn
    x = torch.randn(5, 48)
    calls = []
    real_linear = F.linear

    def counting(inp, w, b=None):
        calls.append(tuple(w.shape))
        return real_linear(inp, w, b)

    F.linear = counting
    try:
        with torch.no_grad():
            y = a.qkv(x)
            model(*packed_batch())
    finally:
        F.linear = real_linear
    q, k, v = a.qkv.split(y)
    torch.testing.assert_close(q, x @ a.q_proj.weight.T + a.q_proj.bias, rtol=0, atol=1e-6)
    torch.testing.assert_close(k, x @ a.k_proj.weight.T + a.k_proj.bias, rtol=0, atol=1e-6)
    torch.testing.assert_close(v, x @ a.v_proj.weight.T + a.v_proj.bias, rtol=0, atol=1e-6)
    # Forward: per layer four GEMMs (q/k/v, o_proj, gate/up, down_proj), not seven.
    n_qkv, n_gu = tuple(a.qkv.weight.shape), tuple(model.model.layers[0].mlp.gate_up.weight.shape)
    assert n_qkv == (48 + 2 * 24, 48) and n_gu == (2 * 96, 48)
    assert calls == [n_qkv] + [n_qkv, (48, 48), n_gu, (48, 96)] * 2


def test_in_place_writes_land_in_fused_storage():
    """``update_weights``-style ``param.copy_`` and ``load_state_dict`` write the fused tensors;
    the fused forward then equals a fresh model holding those weights."""
    model, new = build("qwen2"), build("qwen2", seed=5)
    model.fuse_projections()
    ids, pos = packed_batch()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layers.0." in name:
                p.copy_(new.state_dict()[name])
    a = model.model.layers[0].self_attn
    assert torch.equal(a.qkv.weight[: a.q_proj.weight.shape[0]], new.model.layers[0].self_attn.q_proj.weight)
    model.load_state_dict(new.state_dict())
    assert model.projections_fused
    with torch.no_grad():
        torch.testing.assert_close(model(ids, pos), new(ids, pos), rtol=0, atol=1e-5)


def test_grad_forward_keeps_per_projection_gradients():
    """With gradients on, the fused module takes the per-projection path: every parameter gets
    the same gradient as in a never-fused model (training through a fused model is not silent)."""
    model, ref = build("qwen2"), build("qwen2")
    model.fuse_projections()
    ids, pos = packed_batch()
    for m in (model, ref):
        m.train()
        m.logits(m(ids, pos)).float().logsumexp(-1).sum().backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_replaced_storage_falls_back_then_refuses(caplog):
    """Moving the model after fusion breaks the views: forwards run per projection with the moved
    weights (never the stale fused copy), once warned; ``fuse_projections`` again re-fuses."""
    model, ref = build("llama"), build("llama")
    model.fuse_projections()
    model.to(torch.float64)
    ref.to(torch.float64)
    assert not model.projections_fused
    ids, pos = packed_batch()
    fused_linear._WARNED = False
    with torch.no_grad(), caplog.at_level("WARNING"):
        torch.testing.assert_close(model(ids, pos), ref(ids, pos), rtol=0, atol=1e-10)
    assert "no longer share storage" in caplog.text
    model.fuse_projections()
    assert model.projections_fused and model.model.layers[0].self_attn.qkv.weight.dtype == torch.float64
    with torch.no_grad():
        torch.testing.assert_close(model(ids, pos), ref(ids, pos), rtol=0, atol=1e-10)


def test_unfuse_restores_independent_parameters():
    model, ref = build("qwen2"), build("qwen2")
    model.fuse_projections()
    model.fuse_projections()  # idempotent: the same fused tensors
    a = model.model.layers[0].self_attn
    qkv = a.qkv.weight
    model.fuse_projections()
    assert a.qkv.weight is qkv
    model.unfuse_projections()
    assert a.qkv is None and model.model.layers[0].mlp.gate_up is None and not model.projections_fused
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(storages) == len(list(model.parameters()))
    ids, pos = packed_batch()
    with torch.no_grad():
        assert torch.equal(model(ids, pos), ref(ids, pos))


def test_save_and_reload_a_fused_model(tmp_path):
    from areno.models import load_model, save_model

    model = build("qwen2")
    model.fuse_projections()
    save_model(model, model.config, tmp_path / "m")
    loaded, _ = load_model(tmp_path / "m")
    for (n, p), (_, q) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(p, q), n


def test_fused_rows_rejects_mismatched_members():
    a, b = torch.nn.Linear(4, 3), torch.nn.Linear(5, 3)
    with pytest.raises(ValueError, match="cannot share one tensor"):
        FusedRows([a, b])
    with pytest.raises(ValueError, match="every projection of a group has a bias or none"):
        FusedRows([torch.nn.Linear(4, 3), torch.nn.Linear(4, 3, bias=False)])


def test_tp_sharded_decoder_fuses_its_local_shards():
    """A TP rank's decoder (1/tp of the heads and MLP rows, loaded by name) fuses its local slices:
    each rank's fused q/k/v and gate/up products are its slice of the whole model's."""
    from areno.models.tp_plan import shard_tensor, tp_plan, tp_style

    full = build("qwen2")
    plan = tp_plan(full.config)
    x = torch.randn(7, 48)
    for rank in range(2):
        shard = Decoder(full.config, tp_size=2, tp_reduce=lambda t: t).eval()
        shard.load_state_dict({n: shard_tensor(t, tp_style(plan, n), rank, 2) for n, t in full.state_dict().items()})
        shard.fuse_projections()
        a, m = shard.model.layers[1].self_attn, shard.model.layers[1].mlp
        fa, fm = full.model.layers[1].self_attn, full.model.layers[1].mlp
        with torch.no_grad():
            got = a.qkv.split(a.qkv(x)) + m.gate_up.split(m.gate_up(x))
            for out, lin in zip(got, (fa.q_proj, fa.k_proj, fa.v_proj, fm.gate_proj, fm.up_proj)):
                n = lin.weight.shape[0] // 2
                assert out.shape == (7, n)
                torch.testing.assert_close(out, lin(x)[:, rank * n : (rank + 1) * n], rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------------- GPU
gpu = pytest.mark.gpu


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("gelu", [False, True])  # SwiGLU, GeGLU
def test_glu_halves_kernel_matches_eager_on_gpu(gelu):
    assert fused_linear.self_check() is None
    assert fused_linear.enable()
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for rows, half in ((64, 4864), (1, 13), (3000, 1000)):
            x = torch.randn(rows, 2 * half, generator=g).to("cuda", dtype)
            got = fused_linear.glu_halves(x, gelu=gelu)
            ref = fused_ops.eager_glu(x[:, :half], x[:, half:], gelu=gelu)
            torch.testing.assert_close(got, ref, rtol=2 * torch.finfo(dtype).eps, atol=1e-6)
            # Bit for bit what the existing kernel gives on copied halves.
            assert torch.equal(got, fused_ops.glu(x[:, :half], x[:, half:], gelu=gelu))


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", ["qwen2", "llama", "qwen3"])
def test_fused_forward_bf16_on_gpu(case):
    """bf16 CUDA forward with the fused kernels on: fused projections within bf16 rounding of the
    per-projection forward (the GEMM's reduction order may differ with N)."""
    model, ref = build(case).to("cuda", torch.bfloat16), build(case).to("cuda", torch.bfloat16)
    model.fuse_projections()
    ids, pos = (t.cuda() for t in packed_batch())
    fused_ops.enable()
    fused_linear.enable()
    with torch.no_grad(), fused_ops.inference():
        got, want = model(ids, pos), ref(ids, pos)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=5e-2)
