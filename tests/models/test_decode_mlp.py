"""A decode step's MLP in two Triton GEMMs (areno/models/decode_mlp.py): the routing on CPU with the
kernels replaced by eager references, and on CUDA (gpu tests) the kernels against the eager MLP and
a float64 one, bit-for-bit repeatable, inside a CUDA graph and through the rollout engine."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from areno.models import Decoder, decode_mlp, fused_ops, tiny_config
from areno.models.attention import PackedCausalAttention
from tests.helpers.fused import emulate_fused_path_on_cpu


def _eager_gate_up_glu(x_TD, gate_up_ND, gelu=False):
    gate, up = F.linear(x_TD, gate_up_ND).chunk(2, dim=-1)
    return fused_ops.eager_glu(gate, up, gelu=gelu)


def _eager_down_parts(a_TI, down_DI, parts=3):
    return torch.stack([F.linear(a, w).float() for a, w in zip(a_TI.chunk(parts, -1), down_DI.chunk(parts, -1))])


def _model(dtype, fused=True, arch="qwen2"):
    torch.manual_seed(0)
    config = tiny_config(64, arch=arch, hidden_size=32, layers=3, heads=4, kv_heads=2, initializer_range=0.2)
    model = Decoder(config).to(dtype).eval()
    if fused:
        model.fuse_projections()
    return model


def test_off_on_cpu_and_without_the_switch():
    model = _model(torch.bfloat16)
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    assert not decode_mlp.active(x)
    assert model.model.layers[0].mlp.decode_partials(x) is None


@pytest.mark.parametrize("arch", ["qwen2", "olmo2", "gemma3"])  # SwiGLU pre- and post-norm, GeGLU sandwich
@pytest.mark.parametrize("rows,served", [(19, True), (decode_mlp.MAX_ROWS + 1, False)])
def test_routing_sums_the_partials_into_the_residual_norm(monkeypatch, rows, served, arch):
    """With the kernels' eager references on CPU: a forward of up to ``MAX_ROWS`` rows takes the
    partials through ``add_parts_rms_norm`` (same logits as the eager forward up to the partials' sum
    order), more rows keep the MLP's own forward; an unfused model never takes it."""
    model = _model(torch.bfloat16, arch=arch)
    ids = torch.randint(0, 64, (rows,))
    pos = torch.arange(rows)
    cu = torch.tensor([0, rows])
    with torch.no_grad():
        ref = model.logits(model(ids, pos, PackedCausalAttention(cu))).float()
        emulate_fused_path_on_cpu(monkeypatch)
        calls = []
        monkeypatch.setattr(decode_mlp, "active", lambda x: True)
        monkeypatch.setattr(decode_mlp, "_sm_count", lambda device: 132)
        gelus = []
        monkeypatch.setattr(
            decode_mlp, "gate_up_glu", lambda x, w, gelu: gelus.append(gelu) or _eager_gate_up_glu(x, w, gelu)
        )
        monkeypatch.setattr(decode_mlp, "down_parts", lambda a, w: calls.append(a.shape[0]) or _eager_down_parts(a, w))
        monkeypatch.setattr(fused_ops, "add_parts_rms_norm", fused_ops.eager_add_parts_rms_norm)
        got = model.logits(model(ids, pos, PackedCausalAttention(cu))).float()
        assert calls == ([rows] * 3 if served else [])
        assert gelus == ([arch == "gemma3"] * 3 if served else [])
        assert (got - ref).abs().max().item() < 0.05  # bf16: the down projection's sum in another order
        if not served:
            assert torch.equal(got, ref)
        calls.clear()
        _model(torch.bfloat16, fused=False, arch=arch)(ids, pos, PackedCausalAttention(cu))
        assert calls == []  # no fused gate/up weight: the MLP's forward


def test_launch_shapes_fit_one_wave_of_the_sms():
    # an H200's 132 SMs: the 0.5B MLP (I 4864: 76 gate/up programs) at up to 64 rows, the 1.5B one
    # (I 8960: 140 programs, two waves) at up to 16; the down projection in 8 and 5 shares
    assert decode_mlp.serves(64, 4864, 132) and not decode_mlp.serves(65, 4864, 132)
    assert decode_mlp.serves(16, 8960, 132) and not decode_mlp.serves(17, 8960, 132)
    assert not decode_mlp.serves(0, 4864, 132)
    assert decode_mlp.down_splits(896, 132) == 8 and decode_mlp.down_splits(1536, 132) == 5
    assert decode_mlp.down_splits(16384, 132) == 1


def test_eager_parts_norm_sums_in_fp32_then_rounds():
    x = torch.randn(5, 16, dtype=torch.bfloat16)
    parts = torch.randn(4, 5, 16)
    w = torch.randn(16, dtype=torch.bfloat16)
    s, y = fused_ops.eager_add_parts_rms_norm(x, parts, w, 1e-6)
    s_ref, y_ref = fused_ops.eager_add_rms_norm(x, (parts[0] + parts[1] + parts[2] + parts[3]).bfloat16(), w, 1e-6)
    assert torch.equal(s, s_ref) and torch.equal(y, y_ref)


gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not fused_ops.available(), reason="needs CUDA and Triton")


@gpu
@needs_cuda
def test_kernels_match_the_eager_mlp_and_repeat_bit_for_bit():
    assert decode_mlp.self_check() is None
    g = torch.Generator().manual_seed(0)
    cases = [(torch.bfloat16, 1, 896, 4864), (torch.bfloat16, 8, 896, 4864), (torch.bfloat16, 64, 1536, 8960)]
    for (dt, rows, d, i), gelu in itertools.product(
        [*cases, (torch.bfloat16, 33, 100, 300), (torch.float16, 16, 896, 4864)], (False, True)
    ):
        x = torch.randn(rows, d, generator=g).cuda().to(dt)
        w_gu = (torch.randn(2 * i, d, generator=g) / d**0.5).cuda().to(dt)
        w_d = (torch.randn(d, i, generator=g) / i**0.5).cuda().to(dt)
        act = decode_mlp.gate_up_glu(x, w_gu, gelu=gelu)
        ref_act = _eager_gate_up_glu(x, w_gu, gelu)
        # the GEMM's sum order may move a rounding of gate or up: within a few bf16 ulps
        torch.testing.assert_close(act.float(), ref_act.float(), rtol=0.03, atol=0.03)
        parts = decode_mlp.down_parts(act, w_d)
        assert parts.dtype == torch.float32 and parts.shape[1:] == (rows, d) and parts.shape[0] <= 8
        assert torch.equal(parts, decode_mlp.down_parts(act, w_d))  # no atomics: the same bits again
        torch.testing.assert_close(parts.sum(0), F.linear(act.float(), w_d.float()), rtol=1e-4, atol=1e-4)
        x_res, w_norm = torch.randn(rows, d, generator=g).cuda().to(dt), torch.randn(d, generator=g).cuda().to(dt)
        s, y = fused_ops.add_parts_rms_norm(x_res, parts, w_norm, 1e-6)
        s_ref, y_ref = fused_ops.eager_add_parts_rms_norm(x_res, parts, w_norm, 1e-6)
        assert torch.equal(s, s_ref)
        torch.testing.assert_close(y, y_ref, rtol=2 * torch.finfo(dt).eps, atol=1e-6)


@gpu
@needs_cuda
@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])  # SwiGLU, GeGLU
def test_decode_forward_close_to_eager_and_graph_capturable(monkeypatch, arch):
    """A bf16 decoder's no-grad forward of a few rows takes the kernels inside ``inference()`` (the
    same logits as the eager forward up to bf16 roundings), also replayed from a CUDA graph."""
    torch.manual_seed(0)
    config = tiny_config(512, arch=arch, hidden_size=256, layers=4, heads=8, kv_heads=2, initializer_range=0.05)
    model = Decoder(config).cuda().to(torch.bfloat16).eval()
    model.fuse_projections()
    ids = torch.randint(0, 512, (24,), device="cuda")
    pos = torch.arange(24, device="cuda")
    cu = torch.tensor([0, 24])
    monkeypatch.setattr(decode_mlp._SWITCH, "on", decode_mlp._SWITCH.on)  # as it was after the test
    assert fused_ops.enable() and decode_mlp.enable()
    calls = []
    real = decode_mlp.down_parts
    monkeypatch.setattr(decode_mlp, "down_parts", lambda a, w: calls.append(1) or real(a, w))
    with torch.no_grad():
        eager = model.logits(model(ids, pos, PackedCausalAttention(cu))).float()
        with fused_ops.inference():
            fused = model.logits(model(ids, pos, PackedCausalAttention(cu))).float()
            assert len(calls) == 4
            decode_mlp.disable()
            without = model.logits(model(ids, pos, PackedCausalAttention(cu))).float()
            assert len(calls) == 4
            decode_mlp.enable()
            h = model.model.layers[0].post_attention_layernorm(model.model.embed_tokens(ids))
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(side):
                model.model.layers[0].mlp.decode_partials(h)
                with torch.cuda.graph(graph, stream=side):
                    static_out = model.model.layers[0].mlp.decode_partials(h)
            torch.cuda.current_stream().wait_stream(side)
            h.copy_(h.flip(0))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(static_out, model.model.layers[0].mlp.decode_partials(h))
    assert (fused - eager).abs().max().item() < 0.05
    assert (fused.argmax(-1) == eager.argmax(-1)).float().mean().item() > 0.95
    assert (without - eager).abs().max().item() < 0.05
