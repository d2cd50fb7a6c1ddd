"""Fused inference kernels (areno/models/fused_ops.py): off everywhere but CUDA no-grad forwards;
on CUDA (gpu tests) each kernel equals the eager op and a decoder forward is unchanged."""

from __future__ import annotations

import pytest
import torch

from areno.models import Decoder, fused_ops, tiny_config
from areno.models.attention import PackedCausalAttention
from areno.models.eager_ops import eager_rms_norm, eager_rms_norm_offset, eager_rope
from tests.helpers.fused import emulate_fused_path_on_cpu


def test_inference_scope_is_per_thread_and_nests():
    """Only forwards inside ``inference()`` on the same thread may take the fused path (a colocated
    trainer's thread keeps the eager ops while the rollout thread decodes)."""
    import threading

    seen = []
    with fused_ops.inference():
        assert fused_ops._LOCAL.on
        t = threading.Thread(target=lambda: seen.append(getattr(fused_ops._LOCAL, "on", False)))
        t.start()
        t.join()
        with fused_ops.inference(False):
            assert not fused_ops._LOCAL.on
        assert fused_ops._LOCAL.on
    assert not fused_ops._LOCAL.on and seen == [False]


def test_inactive_on_cpu_and_with_grad():
    x = torch.randn(3, 8)
    assert not fused_ops.active(x)  # CPU tensors never take the fused path, enabled or not
    if not fused_ops.available():
        assert fused_ops.enable() is False  # no Triton or no CUDA: stays off, eager ops used
        assert not fused_ops._SWITCH.on


def test_cpu_decoder_forward_unaffected_by_enable():
    """``enable()`` is a no-op here (no CUDA); the CPU forward is the eager reference either way."""
    config = tiny_config(64, hidden_size=32, layers=2, heads=4, kv_heads=2)
    model = Decoder(config).eval()
    ids = torch.randint(0, 64, (10,))
    pos = torch.arange(10)
    with torch.no_grad():
        before = model(ids, pos)
        fused_ops.enable()
        with fused_ops.inference():
            after = model(ids, pos)
    fused_ops.disable()
    assert torch.equal(before, after)


def test_kv_write_keeps_index_copy_off_the_gpu():
    """On CPU (or with the kernels off) the pool write is the two ``index_copy_``: ``write_kv_fits`` says no."""
    k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    assert not fused_ops.write_kv_fits(k, v, torch.zeros(8, 2, 4), torch.zeros(8, 2, 4))


gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kv_write_kernel_equals_index_copy(dtype):
    """One kernel writes K and V into the pools exactly as two ``index_copy_`` do: views of a fused q/k/v
    product (row stride wider than K x Dh), slots in any order, no tokens; it serves only fitting layouts."""
    g = torch.Generator().manual_seed(0)
    for T in (0, 1, 37):
        qkv = torch.randn(T, (14 + 2 * 2) * 64, generator=g).to("cuda", dtype)
        k, v = qkv[:, 14 * 64 : 16 * 64].view(T, 2, 64), qkv[:, 16 * 64 :].view(T, 2, 64)
        slots = torch.randperm(300, generator=g)[:T].cuda()
        pools = [torch.randn(300, 2, 64, generator=g).to("cuda", dtype) for _ in range(2)]
        ref = [p.clone() for p in pools]
        fused_ops.write_kv(k, v, pools[0], pools[1], slots)
        ref[0].index_copy_(0, slots, k)
        ref[1].index_copy_(0, slots, v)
        assert torch.equal(pools[0], ref[0]) and torch.equal(pools[1], ref[1])
    if fused_ops.enable():
        with fused_ops.inference(), torch.no_grad():
            assert fused_ops.write_kv_fits(k, v, pools[0], pools[1])
            assert not fused_ops.write_kv_fits(k.transpose(1, 2), v, pools[0], pools[1])  # not one run per token
            assert not fused_ops.write_kv_fits(k.float() if dtype != torch.float32 else k.half(), v, *pools)


@gpu
def test_self_check_and_kernels_match_eager():
    assert fused_ops.self_check() is None and fused_ops.add_norm_self_check() is None
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(33, 1536, device="cuda", dtype=dtype)
        w = torch.randn(1536, device="cuda", dtype=dtype)
        ref = eager_rms_norm(x, w, 1e-6)
        torch.testing.assert_close(fused_ops.rms_norm(x, w, 1e-6), ref, rtol=2 * torch.finfo(dtype).eps, atol=1e-6)
        # Gemma 3's weights, offsets from 1 added in float32, rounded once
        ref = eager_rms_norm_offset(x, w, 1e-6, 1.0)
        got = fused_ops.rms_norm(x, w, 1e-6, offset=1.0)
        torch.testing.assert_close(got, ref, rtol=2 * torch.finfo(dtype).eps, atol=1e-6)
        r = torch.randn(33, 1536, device="cuda", dtype=dtype)  # the residual add + RMSNorm kernel
        (s, y), (s_ref, y_ref) = fused_ops.add_rms_norm(x, r, w, 1e-6), fused_ops.eager_add_rms_norm(x, r, w, 1e-6)
        assert torch.equal(s, s_ref)
        torch.testing.assert_close(y, y_ref, rtol=2 * torch.finfo(dtype).eps, atol=1e-6)
        q = torch.randn(9, 12, 128, device="cuda", dtype=dtype)[:, :, :]  # Qwen2.5-1.5B heads
        cos, sin = torch.randn(9, 64, device="cuda", dtype=dtype), torch.randn(9, 64, device="cuda", dtype=dtype)
        tol = dict(rtol=2 * torch.finfo(dtype).eps, atol=1e-6)
        torch.testing.assert_close(fused_ops.rope(q, cos, sin), eager_rope(q, cos, sin), **tol)
        # a strided view, as q/k come out of the projections
        qkv = torch.randn(9, 3 * 12 * 128, device="cuda", dtype=dtype)
        k_view = qkv[:, 12 * 128 : 24 * 128].view(9, 12, 128)
        torch.testing.assert_close(fused_ops.rope(k_view, cos, sin), eager_rope(k_view, cos, sin), **tol)
        g, u = torch.randn(5, 8960, device="cuda", dtype=dtype), torch.randn(5, 8960, device="cuda", dtype=dtype)
        for gelu in (False, True):  # SwiGLU, GeGLU
            torch.testing.assert_close(
                fused_ops.glu(g, u, gelu=gelu),
                fused_ops.eager_glu(g, u, gelu=gelu),
                rtol=2 * torch.finfo(dtype).eps,
                atol=1e-6,
            )


@gpu
@pytest.mark.parametrize("arch", ["qwen2", "olmo2", "olmo3", "gemma3"])  # pre, post and sandwich norms; windows
def test_decoder_forward_fused_equals_eager(arch):
    torch.manual_seed(0)
    config = tiny_config(512, arch=arch, hidden_size=256, layers=4, heads=8, kv_heads=2, initializer_range=0.05)
    model = Decoder(config).cuda().to(torch.bfloat16).eval()
    ids = torch.randint(0, 512, (300,), device="cuda")
    cu = torch.tensor([0, 100, 300])
    pos = torch.cat([torch.arange(100), torch.arange(200)]).cuda()
    with torch.no_grad():
        fused_ops.disable()
        eager = model.logits(model(ids, pos, PackedCausalAttention(cu))).float()
        assert fused_ops.enable()
        outside = model.logits(model(ids, pos, PackedCausalAttention(cu))).float()
        assert torch.equal(outside, eager)  # enabled, but not inside inference(): the eager ops
        with fused_ops.inference():
            fused = model.logits(model(ids, pos, PackedCausalAttention(cu))).float()
    assert (fused - eager).abs().max().item() < 0.05  # bf16: RMSNorm's sum order may move a rounding
    assert (fused.argmax(-1) == eager.argmax(-1)).float().mean().item() > 0.98
    with torch.enable_grad():  # training keeps the eager ops
        x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        assert not fused_ops.active(x)


def test_kernel_switch_turns_on_only_after_its_self_check(monkeypatch, caplog):
    calls = []

    def check(arg):
        calls.append(arg)
        return None if arg == "good" else "off by 1 ulp"

    monkeypatch.setattr(fused_ops, "available", lambda: False)
    switch = fused_ops.KernelSwitch("test kernels", check)
    assert switch.enable("good") is False and calls == []  # no Triton/CUDA: not even checked
    monkeypatch.setattr(fused_ops, "available", lambda: True)
    with caplog.at_level("WARNING", logger=fused_ops.log.name):
        assert switch.enable("bad") is False
    assert "test kernels stay off: off by 1 ulp" in caplog.text and not switch.on
    assert switch.enable("good") is True and switch.on
    assert switch.enable("bad") is True and calls == ["bad", "good"]  # on stays on, unchecked
    switch.disable()
    assert not switch.on
    switch.allowed = False  # an A/B run keeps it off, checked or not
    assert switch.enable("good") is False and not switch.on and calls == ["bad", "good"]


@pytest.mark.parametrize("arch", ["qwen2", "granite"])  # granite: each block's output scaled before the add
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_residual_norm_loop_equals_the_layer_loop(monkeypatch, dtype, arch):
    """The forward that fuses each residual add with the RMSNorm after it (taken on CUDA when the
    add+RMSNorm kernel is on) gives exactly the layer-by-layer forward's values: run here with the
    eager reference of the fused op, so the restructured loop itself is what is checked."""
    torch.manual_seed(0)
    config = tiny_config(64, arch=arch, hidden_size=32, layers=3, heads=4, kv_heads=2, initializer_range=0.2)
    model = Decoder(config).to(dtype).eval()
    ids = torch.randint(0, 64, (19,))
    pos = torch.cat([torch.arange(7), torch.arange(12)])
    cu = torch.tensor([0, 7, 19])
    with torch.no_grad():
        ref = model(ids, pos, PackedCausalAttention(cu))
        calls = []

        def add_rms_norm(x, r, w, eps):
            calls.append(w)
            return fused_ops.eager_add_rms_norm(x, r, w, eps)

        monkeypatch.setattr(fused_ops, "add_norm_active", lambda x: True)
        monkeypatch.setattr(fused_ops, "add_rms_norm", add_rms_norm)
        got = model(ids, pos, PackedCausalAttention(cu))
    assert torch.equal(got, ref)
    # two per layer: its post-attention norm, then the next layer's input norm (the final norm last)
    layers = model.model.layers
    want = [
        n.weight
        for i, layer in enumerate(layers)
        for n in (
            layer.post_attention_layernorm,
            layers[i + 1].input_layernorm if i + 1 < len(layers) else model.model.norm,
        )
    ]
    assert len(calls) == 6 and all(a is b for a, b in zip(calls, want))


def test_add_norm_stays_off_without_the_fused_kernels():
    x = torch.randn(3, 8)
    assert not fused_ops.add_norm_active(x)  # CPU, and (without CUDA) never enabled
    fused_ops.disable()
    assert not fused_ops._ADD_NORM.on


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused_projections", [True, False])
@pytest.mark.parametrize("arch", ["qwen2", "olmo2", "gemma3", "granite"])  # pre, post, sandwich norms; scaled blocks
def test_fused_kernel_routing_equals_the_eager_forward(monkeypatch, dtype, fused_projections, arch):
    torch.manual_seed(0)
    config = tiny_config(64, arch=arch, hidden_size=32, layers=3, heads=4, kv_heads=2, initializer_range=0.2)
    model = Decoder(config).to(dtype).eval()
    if fused_projections:
        model.fuse_projections()
    ids = torch.randint(0, 64, (19,))
    pos = torch.cat([torch.arange(7), torch.arange(12)])
    cu = torch.tensor([0, 7, 19])
    with torch.no_grad():
        ref = model.logits(model(ids, pos, PackedCausalAttention(cu)))
        emulate_fused_path_on_cpu(monkeypatch)
        got = model.logits(model(ids, pos, PackedCausalAttention(cu)))
    assert torch.equal(got, ref)


def test_engine_generates_the_same_tokens_through_the_fused_routing(monkeypatch):
    """The rollout engine (paged K/V, prefill and decode steps) on the fused routing: the fused q/k/v
    product reaches the pool through ``rope_write_kv``'s routing (q rotated, K/V written in one
    call), or, with that kernel off, q and k as views of one RoPE output and K/V through ``write_kv``;
    greedy tokens and log-probs are unchanged."""
    from areno.rollout.engine import RolloutEngine, RolloutEngineConfig
    from areno.types import SamplingParams

    torch.manual_seed(0)
    config = tiny_config(
        64, hidden_size=32, layers=2, heads=4, kv_heads=2, initializer_range=0.3, max_position_embeddings=128
    )
    model = Decoder(config).eval()
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    prompts = [[3, 4, 5], [7, 8, 9, 10, 11, 12], [20]]

    def run():
        eng = RolloutEngine(
            model,
            config,
            config=RolloutEngineConfig(block_size=4, num_blocks=64, fused_projections=True),
            eos_token_ids=(),
        )
        return [(o.output_ids, o.output_logprobs) for o in eng.generate(prompts, params)]

    ref = run()
    emulate_fused_path_on_cpu(monkeypatch)
    rotary, writes = [], []
    monkeypatch.setattr(
        fused_ops, "rope_write_kv", lambda *a: rotary.append(a[0].shape[0]) or fused_ops.eager_rope_write_kv(*a)
    )
    eager_write = fused_ops.write_kv
    monkeypatch.setattr(fused_ops, "write_kv", lambda *a: writes.append(a[0].shape[0]) or eager_write(*a))
    assert run() == ref
    # the prefill steps rotated and wrote their K/V in the one call (CPU decode steps carry their K/V
    # as tensors between steps, so they keep the two calls; on CUDA there is no carry)
    assert sum(rotary) > 0
    monkeypatch.setattr(fused_ops, "rope_write_fits", lambda *a: False)
    rotary.clear()
    assert run() == ref
    assert not rotary and sum(writes) > 0  # the layers' K/V writes took write_kv's routing


def test_self_checks_pass_with_the_eager_references_on_cpu(monkeypatch):
    """The self-checks' own comparisons (what they build as the reference) hold when each kernel is its
    eager reference: a self-check that fails there would keep every fused kernel off on a GPU."""
    emulate_fused_path_on_cpu(monkeypatch)
    assert fused_ops.self_check(device="cpu") is None
    assert fused_ops.add_norm_self_check(device="cpu") is None


@pytest.mark.gpu
@pytest.mark.skipif(not fused_ops.available(), reason="needs CUDA and Triton")
def test_fused_sampling_hash_equals_the_element_wise_ops():
    """The seeded rows' uniform from one kernel: every value equal to the element-wise ops', and
    the engine's path (inside ``inference()``, no grad) takes it once enabled."""
    from areno.rollout import sampling

    assert sampling.fused_hash_self_check() is None
    assert fused_ops.enable() and sampling.enable_fused_hash()
    seeds = torch.tensor([5, -7, 2**40 + 3, 2**63 - 1], device="cuda")
    counters = torch.tensor([0, 1, 2**33, 9], device="cuda")
    ref = sampling.hash_uniform(seeds, counters)  # outside inference(): the element-wise ops
    with fused_ops.inference(), torch.no_grad():
        got = sampling.hash_uniform(seeds, counters)
    assert torch.equal(got, ref) and torch.equal(fused_ops.hash_uniform(seeds, counters), ref)
