"""A scalar head on the decoder (``ScalarHeadModel``) on the FSDP2 backend, CPU gloo: bf16 mixed
precision, tensor parallelism, and a partitioned PPO run with bf16 compute."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from areno.specializations.forward import ScalarHeadModel
from areno.train import FSDP2TrainBackend, LocalTrainBackend, TrainBackendConfig
from tests.helpers.configs import role_run_config, run_to_end
from tests.helpers.train import make_model_dir, random_batch, spawn

VOCAB = 100
LENGTHS = [13, 7, 9, 5]
CFG = dict(lr=1e-2, device="cpu", max_tokens_per_mb=24)


def _scores(model, mb):
    return {"scores_T": model.scores_T(mb)}


def _loss(out, mb, reducer):
    return reducer((out["scores_T"] - 1.0) ** 2, mb.loss_mask_T), {}


def _tokens(mb) -> float:
    return float(mb.loss_mask_T.sum())


def _losses(backend, steps: int = 3) -> list[tuple[float, float]]:
    out = []
    for s in range(steps):
        m = backend.train_step(
            random_batch(LENGTHS, VOCAB, s), forward_fn=_scores, loss_fn=_loss, denominator_fn=_tokens
        )
        out.append((m["loss"], m["grad_norm"]))
    return out


def _bf16_worker(rank, world, model_dir, out_dir):
    b = FSDP2TrainBackend(TrainBackendConfig(**CFG, param_dtype="bfloat16"))
    b.initialize(model_dir, wrap_model=ScalarHeadModel)
    with torch.no_grad():  # one rank: the local shard is the whole head
        b.model.score.weight.to_local().zero_()
        b.model.score.bias.to_local().fill_(PI)
    pinned = b.forward_only(random_batch(LENGTHS, VOCAB, 9), forward_fn=_scores)["scores_T"]
    before = b.model.score.weight.full_tensor().clone()
    result = {"losses": _losses(b), "pinned": pinned}
    result["score_moved"] = float((b.model.score.weight.full_tensor() - before).abs().sum())
    if rank == 0:
        torch.save(result, Path(out_dir) / "bf16.pt")


PI = 3.14159
"""A head bias that bf16 rounds (to 3.140625)."""


def test_a_value_head_trains_in_float32_under_fsdp_bf16_mixed_precision(tmp_path):
    """The decoder computes in bf16; the head's parameters stay float32 (a group of their own), so a
    bias of 3.14159 scores 3.14159, not bf16's 3.140625, and the head trains."""
    model_dir = make_model_dir(tmp_path / "model", layers=1)
    spawn(_bf16_worker, 1, str(model_dir), str(tmp_path), tmp=tmp_path)
    result = torch.load(tmp_path / "bf16.pt", weights_only=True)
    assert result["pinned"].dtype == torch.float32
    assert torch.equal(result["pinned"], torch.full_like(result["pinned"], PI))
    assert result["score_moved"] > 0
    assert all(grad_norm > 0 for _, grad_norm in result["losses"])


def _tp_worker(rank, world, model_dir, out_dir):
    b = FSDP2TrainBackend(TrainBackendConfig(**CFG, tp_size=2))
    b.initialize(model_dir, wrap_model=ScalarHeadModel)
    q_proj = b.model.decoder.model.layers[0].self_attn.q_proj.weight
    result = {"q_proj_rows": q_proj.to_local().shape[0], "losses": _losses(b)}
    dist.barrier()
    if rank == 0:
        torch.save(result, Path(out_dir) / "tp.pt")


@pytest.mark.slow
def test_tensor_parallelism_shards_the_decoder_inside_a_value_head_and_trains_like_one_process(tmp_path):
    model_dir = make_model_dir(tmp_path / "model", layers=1, tie_word_embeddings=True)
    spawn(_tp_worker, 2, str(model_dir), str(tmp_path), tmp=tmp_path)
    result = torch.load(tmp_path / "tp.pt", weights_only=True)
    local = LocalTrainBackend(TrainBackendConfig(**CFG))
    local.initialize(model_dir, wrap_model=ScalarHeadModel)
    assert result["q_proj_rows"] == local.model.decoder.model.layers[0].self_attn.q_proj.weight.shape[0] // 2
    for (loss, norm), (ref_loss, ref_norm) in zip(result["losses"], _losses(local), strict=True):
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert norm == pytest.approx(ref_norm, rel=1e-4)


@pytest.mark.slow
def test_partitioned_ppo_with_bf16_compute_trains_its_critic(tmp_path):
    cfg = role_run_config(
        tmp_path,
        "ppo-fsdp-bf16",
        "train.algorithm=ppo",
        "model.compute_dtype=bfloat16",
        "cluster.allocation_mode='areno:d1+fsdp:d1'",
        "data.num_eval=0",
        steps=2,
    )
    rows = [r for r in run_to_end(cfg) if "train/value/loss" in r]
    assert len(rows) == 2
    assert all(r["train/value/grad_norm"] > 0 for r in rows)
