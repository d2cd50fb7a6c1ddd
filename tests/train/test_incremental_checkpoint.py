"""Incremental checkpoints (``train.checkpoint_full_every``): a checkpoint between full ones stores
only the tensors that changed since the last full one, and resumes bit-exactly like a full one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from areno.train import FSDP2TrainBackend, LocalTrainBackend, LoraConfig, TrainBackendConfig, checkpoint
from tests.helpers.resume import losses, overrides, resumed_step, run_areno, train_rows
from tests.helpers.train import make_model_dir, nll_forward, nll_loss, random_batch, spawn, token_denominator

VOCAB = 100
LENGTHS = [13, 7, 21, 5, 9]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("incr_tiny"))


def _backend(model_dir, **kw):
    b = LocalTrainBackend(TrainBackendConfig(lr=1e-2, device="cpu", grad_clip=None, **kw))
    b.initialize(model_dir)
    return b


def _step(b, seed):
    batch = random_batch(LENGTHS, VOCAB, seed)
    return b.train_step(batch, forward_fn=nll_forward, loss_fn=nll_loss, denominator_fn=token_denominator)["loss"]


def _save(b, root, step):
    """Save and commit ``root/step_N/policy`` as a run does (staging directory, then rename)."""
    final = root / f"step_{step:08d}"
    tmp = checkpoint.staging_dir(final)
    b.save_checkpoint(tmp / "policy", {"step": step})
    checkpoint.commit(tmp, final)
    return final


def _shard_bytes(path):
    return sum(f.stat().st_size for f in path.glob("*.distcp"))


@pytest.mark.parametrize("lora", [False, True], ids=["full_ft", "lora"])
def test_incremental_resume_matches_full_resume_bit_for_bit(model_dir, tmp_path, lora):
    kw = {"checkpoint_full_every": 3, "lora": LoraConfig(rank=4) if lora else None}
    b = _backend(model_dir, **kw)
    _step(b, 1)
    full = _save(b, tmp_path / "inc", 1)
    _step(b, 2)
    incr = _save(b, tmp_path / "inc", 2)
    assert not checkpoint.is_incremental(full / "policy") and checkpoint.is_incremental(incr / "policy")
    assert checkpoint.incremental_base(incr / "policy") == (full / "policy").resolve()
    record = json.loads((incr / "policy" / checkpoint.INCREMENTAL).read_text())
    if lora:  # the frozen base weights are not written again
        assert record["changed_tensors"] < record["tensors"]
        assert _shard_bytes(incr / "policy") < 0.6 * _shard_bytes(full / "policy")
    reference = _backend(model_dir, lora=kw["lora"])  # default: every checkpoint full
    reference.load_checkpoint(incr / "policy")
    plain = _save(reference, tmp_path / "plain", 2)
    assert not checkpoint.is_incremental(plain / "policy")

    a, c = _backend(model_dir, **kw), _backend(model_dir, lora=kw["lora"])
    a.load_checkpoint(incr / "policy")
    c.load_checkpoint(plain / "policy")
    for (name, pa), (_, pc) in zip(a.model.state_dict().items(), c.model.state_dict().items()):
        assert torch.equal(pa, pc), name
    assert _step(a, 3) == _step(c, 3) == _step(b, 3)
    for (name, pa), (_, pb) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert torch.equal(pa, pb), name

    # one full checkpoint in three: the resumed backend keeps the count and the base
    assert checkpoint.is_incremental(_save(a, tmp_path / "inc", 3) / "policy")
    assert checkpoint.incremental_base(tmp_path / "inc" / f"step_{3:08d}" / "policy") == (full / "policy").resolve()
    assert not checkpoint.is_incremental(_save(a, tmp_path / "inc", 4) / "policy")


def test_missing_or_damaged_base_falls_back(model_dir, tmp_path):
    b = _backend(model_dir, checkpoint_full_every=2)
    root = tmp_path / "ckpts"
    for step in range(1, 5):  # full, incremental, full, incremental
        _step(b, step)
        _save(b, root, step)
    assert [checkpoint.is_incremental(root / f"step_{s:08d}" / "policy") for s in range(1, 5)] == [
        False,
        True,
        False,
        True,
    ]
    assert checkpoint.newest_intact(root) == root / f"step_{4:08d}"
    shard = root / f"step_{3:08d}" / "policy" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-8])  # step 3 damaged: step 4 (its incremental) is too
    problem = checkpoint.verify(root / f"step_{4:08d}")
    assert problem is not None and "base checkpoint" in problem and "damaged" in problem
    assert checkpoint.newest_intact(root) == root / f"step_{2:08d}"
    shutil.rmtree(root / f"step_{1:08d}")  # step 2's base gone: nothing intact
    assert "missing" in checkpoint.verify(root / f"step_{2:08d}")
    with pytest.raises(Exception, match="every checkpoint"):
        checkpoint.newest_intact(root)


def test_default_writes_full_checkpoints_without_hashes(model_dir, tmp_path):
    b = _backend(model_dir)
    for step in (1, 2):
        _step(b, step)
        path = _save(b, tmp_path, step) / "policy"
        assert not checkpoint.is_incremental(path)
        assert not list(path.glob("tensor_hashes_rank*.json"))


def test_negative_full_every_is_a_config_error():
    with pytest.raises(ValueError, match="train.checkpoint_full_every"):
        TrainBackendConfig(checkpoint_full_every=-1)


# ------------------------------------------------------------------------------ through `areno train`
@pytest.mark.slow
def test_run_resumes_from_an_incremental_checkpoint_bit_for_bit(tmp_path):
    run_dir = tmp_path / "run"
    args = overrides(tmp_path, run_dir, "train.checkpoint_full_every=2", steps=4, save_interval=1)
    first = run_areno(args)
    assert first.returncode == 0, first.stderr[-3000:]
    ckpts = run_dir / "checkpoints"
    assert [checkpoint.is_incremental(ckpts / f"step_{s:08d}" / "policy") for s in range(1, 5)] == [
        False,
        True,
        False,
        True,
    ]
    before = train_rows(run_dir)
    for step in (3, 4):
        shutil.rmtree(ckpts / f"step_{step:08d}")
    resumed = run_areno(args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed_step(resumed) == 2  # the incremental checkpoint over step 1
    assert losses(train_rows(run_dir)) == losses(before)


# ------------------------------------------------------------------------------ FSDP2, 2 ranks (gloo)
def _save_ranks(b, root, step):
    """``_save`` on every rank: each writes its shards, rank 0 commits (as the engine's driver does)."""
    final = root / f"step_{step:08d}"
    tmp = final.with_name(final.name + checkpoint.STAGING_SUFFIX)
    b.save_checkpoint(tmp / "policy", {"step": step})
    if dist.get_rank() == 0:
        checkpoint.commit(tmp, final)
    dist.barrier()
    return final


def _fsdp_worker(rank, world, model_dir, out_dir):
    out_dir = Path(out_dir)
    cfg = dict(lr=1e-2, device="cpu", grad_clip=None, lora=LoraConfig(rank=4), checkpoint_full_every=2)
    b = FSDP2TrainBackend(TrainBackendConfig(**cfg))
    b.initialize(model_dir)
    _step(b, 1)
    _save_ranks(b, out_dir / "ckpts", 1)
    _step(b, 2)
    incr = _save_ranks(b, out_dir / "ckpts", 2)
    weights = {k: v.clone() for k, v in b.named_weights()}
    next_loss = _step(b, 3)
    b.shutdown()
    resumed = FSDP2TrainBackend(TrainBackendConfig(**cfg))
    resumed.initialize(model_dir)
    resumed.load_checkpoint(incr / "policy")
    same = all(torch.equal(v, weights[k]) for k, v in resumed.named_weights())
    result = {"same_weights": same, "same_next_loss": _step(resumed, 3) == next_loss, "weights": weights}
    dist.barrier()
    if rank == 0:
        torch.save(result, out_dir / "result.pt")


@pytest.mark.slow
def test_fsdp_incremental_checkpoint_resumes_bit_for_bit(model_dir, tmp_path):
    spawn(_fsdp_worker, 2, str(model_dir), str(tmp_path), tmp=tmp_path)
    result = torch.load(tmp_path / "result.pt", weights_only=True)
    incr = tmp_path / "ckpts" / f"step_{2:08d}" / "policy"
    assert checkpoint.is_incremental(incr) and result["same_weights"] and result["same_next_loss"]
    local = _backend(model_dir, lora=LoraConfig(rank=4))  # resharded into one process
    local.load_checkpoint(incr)
    assert all(torch.equal(v, result["weights"][k]) for k, v in local.named_weights())
