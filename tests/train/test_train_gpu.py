"""CUDA paths of the training backends (run on a GPU machine: pytest -m gpu tests/train)."""

import math

import pytest
import torch

from areno.train import LocalTrainBackend, TrainBackendConfig
from tests.helpers.train import make_model_dir, nll_forward, nll_loss, random_batch, token_denominator

pytestmark = pytest.mark.gpu
LENGTHS = [130, 70, 210, 50, 90, 160, 30, 110]


def _step(b, seed):
    return b.train_step(
        random_batch(LENGTHS, 100, seed), forward_fn=nll_forward, loss_fn=nll_loss, denominator_fn=token_denominator
    )


def test_cuda_bf16_training_matches_fp32_cpu_and_sleep_frees_memory(tmp_path):
    model_dir = make_model_dir(tmp_path / "m", hidden=64)
    gpu = LocalTrainBackend(TrainBackendConfig(lr=1e-3, device="cuda"))  # bf16 compute, fp32 master
    gpu.initialize(model_dir)
    cpu = LocalTrainBackend(TrainBackendConfig(lr=1e-3, device="cpu"))
    cpu.initialize(model_dir)
    assert gpu.max_tokens_per_mb >= 256  # memory estimate
    for s in range(3):
        lg, lc = _step(gpu, s)["loss"], _step(cpu, s)["loss"]
        assert math.isclose(lg, lc, rel_tol=2e-2), (lg, lc)
    assert next(gpu.model.parameters()).dtype == torch.float32
    before = torch.cuda.memory_allocated()
    freed = gpu.sleep()
    assert before - torch.cuda.memory_allocated() >= freed * 0.99
    assert gpu.wake() == freed
    assert math.isfinite(_step(gpu, 5)["loss"])


@pytest.mark.parametrize(
    "attn,scope,arch",
    [
        ("flex", "layers", "qwen2"),
        ("varlen", "layers", "qwen2"),
        ("varlen", "model", "qwen2"),
        ("varlen", "layers", "glm4_moe"),
    ],
)
def test_cuda_compiled_step_matches_eager(tmp_path, attn, scope, arch):
    """compile=True (compiled decoder layers or layer stack + fused log-prob head) trains like eager
    in bf16; GLM-4.5's float32 router (autocast off inside a compiled layer) too."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model_dir = make_model_dir(tmp_path / "m", hidden=64, arch=arch)
    losses = {}
    for compile_ in (False, True):
        b = LocalTrainBackend(
            TrainBackendConfig(
                lr=1e-3, device="cuda", compile=compile_, compile_scope=scope, attention=attn, max_tokens_per_mb=512
            )
        )
        b.initialize(model_dir)
        losses[compile_] = [_step(b, s)["loss"] for s in range(3)]
    for le, lc in zip(losses[False], losses[True]):
        assert math.isclose(le, lc, rel_tol=1e-2), losses


def test_cuda_fp32_master_attends_with_bf16_varlen(tmp_path, monkeypatch):
    """The eager one-GPU path (fp32 master weights, bf16 autocast): q/k/v reach the flash varlen
    kernel in bf16. RoPE's fp32 tables used to promote them to fp32, which sent every training
    attention to fp32 FlexAttention (half the step rate, bench/LOG.md "ninth"). Eager, so that the
    recording wrapper sees each call (a compiled graph calls the kernel inside the graph)."""
    from areno.models import attention

    if not attention.varlen_available():
        pytest.skip("this torch has no varlen attention")
    seen = []
    varlen = attention.PackedCausalAttention._varlen

    def recording(self, q_THD, k_THD, v_THD):
        seen.append({q_THD.dtype, k_THD.dtype, v_THD.dtype})
        return varlen(self, q_THD, k_THD, v_THD)

    monkeypatch.setattr(attention.PackedCausalAttention, "_varlen", recording)
    b = LocalTrainBackend(
        TrainBackendConfig(lr=1e-3, device="cuda", attention="varlen", max_tokens_per_mb=512, compile=False)
    )
    b.initialize(make_model_dir(tmp_path / "m", hidden=64))
    assert next(b.model.parameters()).dtype == torch.float32
    assert math.isfinite(_step(b, 0)["loss"])
    assert seen and all(s == {torch.bfloat16} for s in seen), seen
