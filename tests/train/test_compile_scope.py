"""``compile_scope="model"`` (the decoder layer stack as one compiled graph) trains like eager with
activation checkpointing, LoRA, and FSDP2 over 2 gloo ranks with per-layer groups (FSDP's hooks
run between the compiled layers). Slow: each case compiles (~1 min on 2 cores)."""

from pathlib import Path

import pytest

from areno.train import FSDP2TrainBackend, LocalTrainBackend, LoraConfig, TrainBackendConfig
from tests.helpers.train import make_model_dir, nll_forward, nll_loss, random_batch, spawn, token_denominator

pytestmark = pytest.mark.slow

LENGTHS = [13, 7, 21, 5, 9, 16, 3, 11, 6]
CFG = dict(lr=1e-2, device="cpu", grad_clip=0.5, max_tokens_per_mb=24)
LORA = LoraConfig(rank=4, alpha=8, target_modules=("q_proj", "up_proj"))


def _losses(backend) -> list[float]:
    return [
        backend.train_step(
            random_batch(LENGTHS, 100, 50 + s),
            forward_fn=nll_forward,
            loss_fn=nll_loss,
            denominator_fn=token_denominator,
        )["loss"]
        for s in range(2)
    ]


def _local(model_dir, **kw) -> list[float]:
    b = LocalTrainBackend(TrainBackendConfig(**CFG, **kw))
    b.initialize(model_dir)
    return _losses(b)


def _assert_close(a, b):
    assert all(abs(x - y) < 1e-5 for x, y in zip(a, b)), (a, b)


@pytest.mark.parametrize("extra", [dict(activation_checkpointing=True), dict(lora=LORA)], ids=["ac", "lora"])
def test_model_scope_equals_eager(tmp_path, extra):
    model_dir = make_model_dir(tmp_path / "m")
    _assert_close(_local(model_dir, compile=True, compile_scope="model", **extra), _local(model_dir, **extra))


def _fsdp_worker(rank, world, model_dir, out_dir):
    b = FSDP2TrainBackend(TrainBackendConfig(**CFG, compile=True, compile_scope="model"))
    b.initialize(model_dir)
    assert len(b._fsdp_modules) > 1  # per-layer FSDP groups: their hooks run inside the compiled stack's forward
    Path(out_dir, f"rank{rank}").write_text(repr(_losses(b)))


def test_model_scope_under_fsdp2_equals_one_process(tmp_path):
    model_dir = make_model_dir(tmp_path / "m")
    spawn(_fsdp_worker, 2, str(model_dir), str(tmp_path), tmp=tmp_path)
    reference = _local(model_dir)
    for rank in range(2):
        _assert_close(eval((tmp_path / f"rank{rank}").read_text()), reference)
