"""Expert parallelism composed with FSDP2 (``TrainBackendConfig.ep_size``, the ``e`` of ``cluster.allocation_mode``), CPU gloo, 2 processes: training with
the experts split over the 2 ranks (EP 2) equals training with every expert on every rank (EP 1,
plain FSDP), for Qwen3-MoE and Qwen2-MoE: losses, gradient norms and the weights after the steps; checkpoints and exports see
whole expert tensors. Layouts expert parallelism does not cover are one-line ConfigErrors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from areno.errors import ConfigError
from areno.train import FSDP2TrainBackend, LocalTrainBackend, TrainBackendConfig
from tests.helpers.train import make_model_dir, nll_forward, nll_loss, random_batch, spawn, token_denominator

VOCAB = 100
LENGTHS = [13, 7, 21, 5, 9, 16, 3, 11]
CFG = dict(lr=1e-2, device="cpu", grad_clip=0.5, max_tokens_per_mb=24)
MOE = dict(num_experts=4, mlp_only_layers=(1,), layers=3, initializer_range=0.2)


def _train(backend) -> list[tuple[float, float]]:
    out = []
    for s in range(3):
        batch = random_batch(LENGTHS, VOCAB, 50 + s)
        m = backend.train_step(batch, forward_fn=nll_forward, loss_fn=nll_loss, denominator_fn=token_denominator)
        out.append((m["loss"], m["grad_norm"]))
    return out


def _worker(rank, world, model_dir, out_dir):
    result = {}
    for ep in (1, 2):
        b = FSDP2TrainBackend(TrainBackendConfig(**CFG, ep_size=ep))
        b.initialize(model_dir)
        result[f"ep{ep}_losses"] = _train(b)
        result[f"ep{ep}_scores"] = b.forward_only(random_batch(LENGTHS, VOCAB, 7), forward_fn=nll_forward)["logprobs_T"]
        result[f"ep{ep}_weights"] = {k: v.clone() for k, v in b.named_weights()}
        if ep == 2:
            local = b.model.model.layers[0].mlp.experts.gate_up_proj.to_local()
            result["ep2_local_experts"] = local.shape[0]
            b.save_checkpoint(Path(out_dir) / "ckpt", {"pos": 1})
        b.shutdown()
    try:
        FSDP2TrainBackend(TrainBackendConfig(**CFG, ep_size=2, dp_replicate_size=2)).initialize(model_dir)
    except ConfigError as e:
        result["layout_error"] = str(e)
    dist.barrier()
    if rank == 0:
        torch.save(result, Path(out_dir) / "result.pt")


@pytest.mark.parametrize(
    "arch",
    # Qwen2-MoE: its gated shared expert sharded as the dense weights (its gate one row over two ranks)
    ["qwen3_moe", pytest.param("qwen2_moe", marks=pytest.mark.slow)],
)
def test_fsdp_expert_parallel_2_equals_1(tmp_path, arch):
    model_dir = make_model_dir(tmp_path / "model", arch=arch, **MOE)
    spawn(_worker, 2, str(model_dir), str(tmp_path), tmp=tmp_path)
    r = torch.load(tmp_path / "result.pt", weights_only=True)
    assert r["ep2_local_experts"] == 2  # each rank holds half the experts
    for (l1, g1), (l2, g2) in zip(r["ep1_losses"], r["ep2_losses"]):
        assert l2 == pytest.approx(l1, rel=1e-5, abs=1e-6)
        assert g2 == pytest.approx(g1, rel=1e-4)
    torch.testing.assert_close(r["ep2_scores"], r["ep1_scores"], rtol=1e-5, atol=1e-5)
    assert sorted(r["ep2_weights"]) == sorted(r["ep1_weights"])
    for k, v in r["ep1_weights"].items():  # Adam's m/sqrt(v) magnifies summation-order differences of ~0 grads
        torch.testing.assert_close(r["ep2_weights"][k], v, rtol=1e-4, atol=1e-4, msg=k)
    assert "ep_size=2" in r["layout_error"] and "\n" not in r["layout_error"]
    # the EP checkpoint loads in one process with every expert (DCP reshards the expert tensors)
    one = LocalTrainBackend(TrainBackendConfig(**CFG))
    one.initialize(model_dir)
    one.load_checkpoint(tmp_path / "ckpt")
    for k, v in one.named_weights():
        torch.testing.assert_close(v, r["ep2_weights"][k], msg=k)


def test_expert_parallel_needs_the_fsdp_backend(tmp_path):
    model_dir = make_model_dir(tmp_path / "model", arch="qwen3_moe", **MOE)
    with pytest.raises(ConfigError, match="ep_size=2 needs the FSDP2 backend"):
        LocalTrainBackend(TrainBackendConfig(**CFG, ep_size=2)).initialize(model_dir)
