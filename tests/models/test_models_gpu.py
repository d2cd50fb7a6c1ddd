"""CUDA checks (run by the lead on the GPU machine): bf16 parity with transformers, and the flex /
varlen attention paths against SDPA, forward and backward."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from areno.models import Decoder, PackedCausalAttention, load_model, moe, save_model, tiny_config
from areno.models.logprobs import packed_logprobs

pytestmark = pytest.mark.gpu
VOCAB = 512


def _ref_logprobs(ref, seqs):
    out = []
    with torch.no_grad():
        for s in seqs:
            logits = ref(s[None]).logits[0].float()
            lp = torch.log_softmax(logits[:-1], -1).gather(-1, s[1:, None])[:, 0]
            out.append(torch.cat([lp.new_zeros(1), lp]))
    return torch.cat(out)


def _routed_as_float32_T(path, bf16_routes: moe.RoutingRecord, ids_T, cu_B1) -> torch.Tensor:
    """Per packed token, whether the position its log-prob is read at (the one before it) chose in every sparse
    layer the top-k expert set areno's float32 model chooses there (on CPU, transformers' float32 model's too) —
    ``bf16_routes``: the bf16 model's record of the same forward; all True for a dense model."""
    if not bf16_routes.experts:
        return torch.ones_like(ids_T, dtype=torch.bool)
    model32, _ = load_model(path, dtype=torch.float32, device="cuda")
    with torch.no_grad(), moe.record_routing(model32) as routes32:
        packed_logprobs(model32, ids_T, cu_B1, chunk_size=128)
    same_TL = (bf16_routes.stacked().sort(-1).values == routes32.stacked().sort(-1).values).all(-1)
    return torch.roll(same_TL.all(-1), 1).to(ids_T.device)


@pytest.mark.parametrize(
    "arch",
    [
        "qwen2",
        "qwen3",
        "llama",
        "olmo2",
        "olmo3",
        "gemma3",
        "gemma2",
        "phi3",
        "phi4_mini",
        "glm4",
        "granite",
        "ernie4_5",
        "exaone4",
        "smollm3",
        "ministral3",
        "gpt_oss",
        "glm4_moe",
        "qwen2_moe",
        "granitemoe",
        "olmoe",
    ],
)
def test_bf16_logprob_parity_with_transformers(arch, tmp_path):
    torch.manual_seed(0)
    kw = {"arch": arch}
    if arch == "phi4_mini":  # 24 of 32 head dimensions turned by LongRoPE's short factors, within 512 positions
        short = [1.0 + 0.2 * i for i in range(12)]
        rope = {"rope_type": "longrope", "short_factor": short, "long_factor": [2 * x for x in short]}
        kw = {
            "arch": "phi3",
            "partial_rotary_factor": 0.75,
            "rope_scaling": {**rope, "original_max_position_embeddings": 512},
        }
    if arch == "olmoe":  # a clamp that bites the normed q and k (about N(0, 1)) now and then
        kw["clip_qkv"] = 2.0
    config = tiny_config(VOCAB, hidden_size=256, layers=4, heads=8, kv_heads=2, initializer_range=0.05, **kw)
    save_model(Decoder(config), config, tmp_path)
    lens = [100, 37, 300]
    seqs = [torch.randint(0, VOCAB, (n,), device="cuda") for n in lens]
    ids_T = torch.cat(seqs)
    cu_B1 = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda")

    ref32 = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).cuda().eval()
    expected = _ref_logprobs(ref32, seqs)
    del ref32
    ref16 = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).cuda().eval()
    hf_bf16_err = (_ref_logprobs(ref16, seqs) - expected).abs()
    del ref16

    model, _ = load_model(tmp_path, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad(), moe.record_routing(model) as routes:
        ours, _ = packed_logprobs(model, ids_T, cu_B1, chunk_size=128)
    err = (ours - expected).abs()
    # bf16 error of the same order as transformers' own bf16 error against fp32.
    assert err.mean() <= 2 * hf_bf16_err.mean() + 1e-3, (err.mean(), hf_bf16_err.mean())
    # max over tokens routed as in float32: a near-tie flipped by bf16 costs ~0.5 at a token each model's noise picks
    keep_T = _routed_as_float32_T(tmp_path, routes, ids_T, cu_B1)
    assert keep_T.float().mean() >= 0.75, keep_T.float().mean()  # near-ties flip 2-15% on CPU; a broken router, most
    assert err[keep_T].max() <= 2 * hf_bf16_err[keep_T].max() + 0.05, (err[keep_T].max(), hf_bf16_err[keep_T].max())


@pytest.mark.parametrize("impl", ["flex", "varlen", "sdpa"])
@pytest.mark.parametrize("window", [None, 64])
def test_cuda_attention_impls_match_sdpa(impl, window):
    if impl == "varlen":
        pytest.importorskip("torch.nn.attention.varlen")
    torch.manual_seed(0)
    cu_B1 = torch.tensor([0, 130, 131, 400, 512], device="cuda")
    q = torch.randn(512, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(512, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(512, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(512, 8, 64, device="cuda", dtype=torch.bfloat16)

    def run(name):
        q.grad = k.grad = v.grad = None
        out = PackedCausalAttention(cu_B1, sliding_window=window, impl=name)(0, q, k, v)
        out.backward(grad)
        return out.float(), q.grad.float(), k.grad.float(), v.grad.float()

    for got, exp in zip(run(impl), run("sdpa_mask")):
        torch.testing.assert_close(got, exp, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("window", [None, 64])
def test_cuda_flex_sinks_match_explicit_sink_attention(window):
    """gpt-oss's sinks on CUDA: flex's log-sum-exp rescaled (``apply_sinks``) against explicit scores, forward
    and backward, the sinks' own gradient included."""
    torch.manual_seed(0)
    cu_B1 = torch.tensor([0, 130, 131, 400, 512], device="cuda")
    q = torch.randn(512, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(512, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(512, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    sinks = (torch.randn(8, device="cuda") * 2).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(512, 8, 64, device="cuda", dtype=torch.bfloat16)

    def run(name):
        q.grad = k.grad = v.grad = sinks.grad = None
        out = PackedCausalAttention(cu_B1, sliding_window=window, impl=name, sinks=True)(0, q, k, v, sinks_H=sinks)
        out.backward(grad)
        return out.float(), q.grad.float(), k.grad.float(), v.grad.float(), sinks.grad.float()

    for got, exp in zip(run("flex"), run("sdpa")):
        torch.testing.assert_close(got, exp, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("window", [None, 64])
def test_cuda_flex_softcap_matches_explicit_attention(window):
    """Gemma 2's soft-capped scores on CUDA: flex's ``score_mod`` (what ``auto`` runs for them) against explicit
    fp32 scores, forward and backward; and ``train.attention=varlen``, whose flash kernel has no cap, refused."""
    torch.manual_seed(0)
    cu_B1 = torch.tensor([0, 130, 131, 400, 512], device="cuda")
    q = (torch.randn(512, 8, 64, device="cuda") * 3).to(torch.bfloat16).requires_grad_()  # scores past the cap
    k = torch.randn(512, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(512, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(512, 8, 64, device="cuda", dtype=torch.bfloat16)

    def run(name):
        q.grad = k.grad = v.grad = None
        attn = PackedCausalAttention(cu_B1, sliding_window=window, impl=name, softcap=5.0)
        out = attn(0, q, k, v, softcap=5.0)
        out.backward(grad)
        return out.float(), q.grad.float(), k.grad.float(), v.grad.float()

    for got, exp in zip(run("auto"), run("sdpa")):
        # bf16 inputs and gradients: within bf16 rounding of each tensor's scale (elementwise rtol failed once in 114)
        torch.testing.assert_close(got, exp, atol=2e-2 * exp.abs().max().item(), rtol=0)
    with pytest.raises(ValueError, match="soft-capped scores .Gemma 2. runs as flex on CUDA"):
        attn = PackedCausalAttention(cu_B1, sliding_window=window, softcap=5.0)
        attn.prepare(512, q.device, 64, q.dtype, cuda_impl="varlen")


def test_cuda_compiled_layers_with_sinks_match_eager():
    """gpt-oss's training forward and backward with each layer compiled (``train.compile``'s default on CUDA:
    flex with its log-sum-exp inside the compiled layer) against the eager layers."""
    from areno.train.parallelize import apply_compile

    torch.manual_seed(0)
    config = tiny_config(VOCAB, arch="gpt_oss", hidden_size=128, layers=2, heads=4, kv_heads=2)
    lens = [100, 37, 300]
    ids_T = torch.randint(0, VOCAB, (sum(lens),), device="cuda")
    cu_B1 = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda")
    runs = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = Decoder(config).to(device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 1.0)
        if compiled:
            apply_compile(model)
        lp, _ = packed_logprobs(model, ids_T, cu_B1, chunk_size=128)
        lp.sum().backward()
        runs.append((lp.float(), model.model.layers[0].self_attn.sinks.grad.float()))
    (eager, g_eager), (comp, g_comp) = runs
    torch.testing.assert_close(comp, eager, atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(g_comp, g_eager, atol=5e-2, rtol=1e-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [5, 78, 200])
def test_cuda_flex_runs_small_heads_and_short_batches(tokens, dtype):
    # below 128 query tokens inductor would take its decoding kernel, which has no configuration for
    # head dim 16: flex must run (and match sdpa) at the smallest head dim ``auto`` gives it
    torch.manual_seed(0)
    cu_B1 = torch.tensor([0, tokens // 2, tokens], device="cuda")
    q, k, v = (torch.randn(tokens, h, 16, device="cuda", dtype=dtype, requires_grad=True) for h in (4, 2, 2))
    grad = torch.randn(tokens, 4, 16, device="cuda", dtype=dtype)

    def run(name):
        q.grad = k.grad = v.grad = None
        out = PackedCausalAttention(cu_B1, impl=name)(0, q, k, v)
        out.backward(grad)
        return out.float(), q.grad.float(), k.grad.float(), v.grad.float()

    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for got, exp in zip(run("flex"), run("sdpa_mask")):
        torch.testing.assert_close(got, exp, atol=tol, rtol=tol)


def test_cuda_packed_logprobs_backward_runs_chunked():
    torch.manual_seed(0)
    config = tiny_config(VOCAB, arch="qwen2", hidden_size=256, layers=2, heads=8, kv_heads=2)
    model = Decoder(config).cuda().to(torch.bfloat16)
    ids_T = torch.randint(0, VOCAB, (1000,), device="cuda")
    cu_B1 = torch.tensor([0, 500, 1000], device="cuda")
    lp_a, ent_a = packed_logprobs(model, ids_T, cu_B1, chunk_size=64, with_entropy=True)
    (lp_a.sum() + ent_a.sum()).backward()
    g_a = model.model.layers[0].self_attn.q_proj.weight.grad.float().clone()
    model.zero_grad()
    lp_b, ent_b = packed_logprobs(model, ids_T, cu_B1, chunk_size=4096, with_entropy=True)
    (lp_b.sum() + ent_b.sum()).backward()
    g_b = model.model.layers[0].self_attn.q_proj.weight.grad.float()
    torch.testing.assert_close(lp_a, lp_b, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(g_a, g_b, atol=1e-2, rtol=5e-2)


def test_cuda_auto_attention_picks_varlen_where_flash_runs_else_flex_or_sdpa():
    pytest.importorskip("torch.nn.attention.varlen")
    cu_B1 = torch.tensor([0, 100, 256], device="cuda")
    for dtype, head_dim, expected in (
        (torch.bfloat16, 32, "varlen"),
        (torch.float32, 32, "flex"),
        (torch.bfloat16, 20, "flex"),
        (torch.bfloat16, 12, "sdpa"),
    ):
        q = torch.randn(256, 4, head_dim, device="cuda", dtype=dtype)
        k = torch.randn(256, 2, head_dim, device="cuda", dtype=dtype)
        attn = PackedCausalAttention(cu_B1)
        out = attn(0, q, k, k)
        assert attn._impl == expected
        ref = PackedCausalAttention(cu_B1, impl="sdpa_mask")(0, q, k, k)
        torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)


def test_cuda_head_weight_gradient_accumulates_in_the_gemm():
    """bf16 head on CUDA: each chunk's weight gradient is summed by ``addmm(out_dtype=float32)``
    into the fp32 sum, not rounded to a bf16 product first, so the sum is far closer to float64
    than the per-chunk bf16 products it replaced; the head's gradient still matches float64."""
    from areno.models import logprobs as L

    assert L._out_dtype_addmm("cuda"), "torch.addmm(out_dtype=float32) is missing on this CUDA build"
    torch.manual_seed(0)
    T, V, D, chunk = 4096, 2048, 64, 256
    gz = (torch.randn(T, V, device="cuda") * 1e-2).to(torch.bfloat16)
    h = torch.randn(T, D, device="cuda").to(torch.bfloat16)
    ref = gz.double().t() @ h.double()
    new = torch.zeros(V, D, device="cuda")
    old = torch.zeros(V, D, device="cuda")
    for s in range(0, T, chunk):
        L._add_weight_grad(new, gz[s : s + chunk], h[s : s + chunk])
        old += (gz[s : s + chunk].t() @ h[s : s + chunk]).float()
    new_err, old_err = (new.double() - ref).abs().max().item(), (old.double() - ref).abs().max().item()
    assert new_err * 20 < old_err, (new_err, old_err)

    h = h.requires_grad_()
    w = (torch.randn(V, D, device="cuda") * 0.3).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, V, (T,), device="cuda")
    lp, _ = L.logprobs_from_hidden(h, w, targets, chunk_size=chunk)
    (gw,) = torch.autograd.grad(lp.sum(), (w,))
    h64, w64 = h.double().detach().requires_grad_(), w.double().detach().requires_grad_()
    (rw,) = torch.autograd.grad(torch.log_softmax(h64 @ w64.t(), -1).gather(-1, targets[:, None]).sum(), (w64,))
    # bf16 logits and a bf16 result: within 1% of the gradient's scale (the largest entries are ~10)
    torch.testing.assert_close(gw.double(), rw, rtol=2e-2, atol=1e-2 * rw.abs().max().item())


def test_varlen_takes_gqa_inputs_without_repeating_them():
    """torch 2.11's varlen_attn has no enable_gqa flag but hands k/v to flash, which takes fewer
    k/v heads: the probe finds that (values and gradients equal to repeated k/v), so training and
    prefill pass them as they are; newer torch has the flag."""
    pytest.importorskip("torch.nn.attention.varlen")
    from areno.models.attention import GQA_FLAG, GQA_NATIVE, varlen_features

    torch.zeros(1, device="cuda")  # the probe runs once the process uses CUDA
    assert varlen_features()[0] in (GQA_FLAG, GQA_NATIVE)


@pytest.mark.parametrize("context", ["inference_mode", "no_grad"])
def test_varlen_gqa_probe_answers_alike_inside_the_rollout_engines_step(context, monkeypatch):
    """The probe's first caller may be the rollout engine's prefill, inside inference mode (or
    no-grad): its backward must still run there, or it caches False and training repeats k/v."""
    pytest.importorskip("torch.nn.attention.varlen")
    from areno.models import attention as A

    torch.zeros(1, device="cuda")
    monkeypatch.setattr(A, "_NATIVE_GQA", None)
    outside = A._native_gqa()
    monkeypatch.setattr(A, "_NATIVE_GQA", None)
    with torch.inference_mode() if context == "inference_mode" else torch.no_grad():
        inside = A._native_gqa()
    assert inside == outside
    if "enable_gqa" not in A._varlen_params():  # torch 2.11: flash takes fewer k/v heads
        assert inside


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gemma2_on_cuda_shares_prompts_only_when_asked(tmp_path):
    """``train.share_prompts=auto`` on a GPU leaves Gemma 2's prompts unshared (its capped attention would run
    per sequence); ``true`` shares them."""
    from areno.train import LocalTrainBackend, TrainBackendConfig
    from tests.helpers.train import make_model_dir

    model_dir = make_model_dir(tmp_path / "g", arch="gemma2", heads=2, kv_heads=1)
    for share, expected in (("auto", False), (True, True)):
        backend = LocalTrainBackend(TrainBackendConfig(device="cuda", share_prompts=share))
        backend.initialize(model_dir)
        assert backend.model.share_prompts is expected
