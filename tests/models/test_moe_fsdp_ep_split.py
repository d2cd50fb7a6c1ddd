"""Expert parallelism smaller than the data-parallel size (``fsdp:d4e2``): 4 CPU gloo ranks in EP
groups of 2 ({0, 1} and {2, 3} each hold every expert once, half per rank; the two groups are
replicas that sum the experts' gradients) train exactly as one process holding every expert, and as
EP over all 4 ranks (``d4e4``): losses, gradient norms and every weight after the steps; the
checkpoint loads in one process and resumes under d4e2. The fast tests cover the rank layout and the one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from areno.engine.cluster import ClusterLayout, LayoutError
from areno.errors import ConfigError
from areno.train import FSDP2TrainBackend, LocalTrainBackend, TrainBackendConfig
from areno.train.expert_parallel import expert_rank_groups
from tests.helpers.train import make_model_dir, nll_forward, nll_loss, random_batch, spawn, token_denominator

VOCAB = 100
LENGTHS = [13, 7, 21, 5, 9, 16, 3, 11]
CFG = dict(lr=1e-2, device="cpu", grad_clip=0.5, max_tokens_per_mb=24)
MOE = dict(arch="qwen3_moe", num_experts=4, mlp_only_layers=(1,), layers=3, initializer_range=0.2)
STEPS = 2


def _train(backend) -> dict:
    steps = []
    for s in range(STEPS):
        batch = random_batch(LENGTHS, VOCAB, 50 + s)
        m = backend.train_step(batch, forward_fn=nll_forward, loss_fn=nll_loss, denominator_fn=token_denominator)
        steps.append((m["loss"], m["grad_norm"]))
    return {"steps": steps, "weights": {k: v.clone() for k, v in backend.named_weights()}}


def _worker(rank, world, model_dir, out_dir):
    result = {}
    for ep in (2, 4):
        b = FSDP2TrainBackend(TrainBackendConfig(**CFG, ep_size=ep))
        b.initialize(model_dir)
        result[f"ep{ep}"] = _train(b)
        if ep == 2:
            experts = b.model.model.layers[0].mlp.experts.gate_up_proj
            result["ep2_layout"] = (experts.to_local().shape[0], experts.device_mesh.mesh.tolist())
            b.save_checkpoint(Path(out_dir) / "ckpt", {"pos": 1})
        b.shutdown()
    resumed = FSDP2TrainBackend(TrainBackendConfig(**CFG, ep_size=2))
    resumed.initialize(model_dir)
    resumed.load_checkpoint(Path(out_dir) / "ckpt")
    result["ep2_resumed"] = {k: v.clone() for k, v in resumed.named_weights()}
    resumed.shutdown()
    dist.barrier()
    if rank == 0:
        torch.save(result, Path(out_dir) / "result.pt")


@pytest.mark.slow  # 4 processes: over 20 s on 2 shared cores; the layout and error tests below run by default
def test_fsdp_d4e2_equals_one_process_and_d4e4(tmp_path):
    model_dir = make_model_dir(tmp_path / "model", **MOE)
    spawn(_worker, 4, str(model_dir), str(tmp_path), tmp=tmp_path)
    r = torch.load(tmp_path / "result.pt", weights_only=True)
    assert r["ep2_layout"] == (2, [[0, 1], [2, 3]])  # half the experts per rank, EP groups of consecutive ranks
    one = LocalTrainBackend(TrainBackendConfig(**CFG))
    one.initialize(model_dir)
    ref = _train(one)
    for ep in (2, 4):
        for (l1, g1), (l2, g2) in zip(ref["steps"], r[f"ep{ep}"]["steps"]):
            assert l2 == pytest.approx(l1, rel=1e-5, abs=1e-6), ep
            assert g2 == pytest.approx(g1, rel=1e-4), ep
        assert sorted(r[f"ep{ep}"]["weights"]) == sorted(ref["weights"])
        for k, v in ref["weights"].items():  # Adam's m/sqrt(v) magnifies summation-order differences of ~0 grads
            torch.testing.assert_close(r[f"ep{ep}"]["weights"][k], v, rtol=1e-4, atol=1e-4, msg=f"ep{ep} {k}")
    # the d4e2 checkpoint (experts sharded over ep, replicated over the groups) loads in one process
    fresh = LocalTrainBackend(TrainBackendConfig(**CFG))
    fresh.initialize(model_dir)
    fresh.load_checkpoint(tmp_path / "ckpt")
    for k, v in fresh.named_weights():
        torch.testing.assert_close(v, r["ep2"]["weights"][k], msg=k)
        torch.testing.assert_close(r["ep2_resumed"][k], v, msg=k)  # and resumes under d4e2


def test_expert_rank_layout():
    layout = expert_rank_groups([4, 5, 6, 7, 8, 9], 2)
    assert layout.tolist() == [[4, 5], [6, 7], [8, 9]]  # rows: EP groups; columns: replicas of one expert slice
    assert expert_rank_groups([0, 1, 2, 3], 4).tolist() == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="expert parallel size 4 does not divide the 6"):
        expert_rank_groups(list(range(6)), 4)


def test_layout_takes_e_dividing_the_shard_size_and_refuses_the_rest():
    lay = ClusterLayout(train_devices=(0, 1, 2, 3), rollout_devices=(4,), train_ep=2)
    assert (lay.train_dp_shard, lay.train_ep) == (4, 2)
    with pytest.raises(
        LayoutError, match=r"e2 must divide the FSDP shard size \(got 3\) with t1 \(got t1\).*use e.g. fsdp:d4e2"
    ):
        ClusterLayout(train_devices=(0, 1, 2), rollout_devices=(4,), train_ep=2)


def test_expert_parallel_on_a_dense_model_or_an_uneven_expert_split(tmp_path):
    dense = make_model_dir(tmp_path / "dense")
    with pytest.raises(ConfigError, match="a dense model has none.*leave out the e of cluster.allocation_mode"):
        LocalTrainBackend(TrainBackendConfig(**CFG, ep_size=2)).initialize(dense)
    moe = make_model_dir(tmp_path / "moe", **MOE)
    with pytest.raises(ConfigError, match="ep_size=3 must divide the model's expert count \\(4\\): pick a divisor"):
        LocalTrainBackend(TrainBackendConfig(**CFG, ep_size=3)).initialize(moe)
