"""``top_entropy_quantile`` over data-parallel ranks (gloo, 2 processes): the actor's loss of a step on two
ranks, each micro-batch's entropy threshold gathered over both (``Reducer.gather``), equals one process's step
on the whole batch; marked slow (a spawn)."""

from pathlib import Path

import pytest
import torch

from areno.specializations import ActorConfig, ActorSpecialization
from areno.train import FSDP2TrainBackend, LocalTrainBackend, TrainBackendConfig
from tests.helpers.train import make_model_dir, random_batch, spawn

pytestmark = pytest.mark.slow

LENGTHS = [13, 7, 21, 5, 9, 16, 3, 11]
CFG = dict(lr=1e-2, device="cpu", grad_clip=None, max_tokens_per_mb=4096)  # one micro-batch a rank


def _batch():
    batch = random_batch(LENGTHS, 100, 5)
    gen = torch.Generator().manual_seed(6)
    batch.advantages_T = torch.randn(batch.num_tokens, generator=gen)
    return batch


def _step(backend) -> tuple[float, float]:
    spec = ActorSpecialization(ActorConfig(top_entropy_quantile=0.3, policy_loss="ppo"))
    out = backend.train_step(
        _batch(), forward_fn=spec.extract_model_output, loss_fn=spec.compute_loss, denominator_fn=spec.denominator
    )
    return out["loss"], out["actor/entropy_mask_frac"]


def _worker(rank, world, model_dir, out_dir):
    backend = FSDP2TrainBackend(TrainBackendConfig(**CFG))
    backend.initialize(model_dir)
    assert backend._dp_size == 2 and all(len(r) == 1 for r in backend.plan(_batch()).per_rank)
    loss = _step(backend)
    backend.shutdown()
    if rank == 0:
        torch.save(loss, Path(out_dir) / "dp.pt")


def test_two_ranks_mask_as_one_process_does(tmp_path):
    model_dir = make_model_dir(tmp_path / "model")
    spawn(_worker, 2, str(model_dir), str(tmp_path), tmp=tmp_path)
    local = LocalTrainBackend(TrainBackendConfig(**CFG))
    local.initialize(model_dir)
    assert torch.load(tmp_path / "dp.pt", weights_only=True) == pytest.approx(_step(local), rel=1e-5, abs=1e-7)
