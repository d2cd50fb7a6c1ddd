"""FSDP2TrainBackend on CPU with gloo, 2 processes: equals the single-process backend.

One spawn runs every scenario (process start-up dominates on CPU); marked slow (~2 min on 2 cores).
"""

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from areno.models.prefix_sharing import shared_prompt_tokens
from areno.train import FSDP2TrainBackend, LocalTrainBackend, LoraConfig, TrainBackendConfig
from areno.train.packing import _Prompts
from tests.helpers.train import (
    group_batch,
    make_model_dir,
    nll_forward,
    nll_loss,
    random_batch,
    spawn,
    token_denominator,
)

pytestmark = pytest.mark.slow

VOCAB = 100
LORA = LoraConfig(rank=4, alpha=8, target_modules=("q_proj", "up_proj"))
LENGTHS = [13, 7, 21, 5, 9, 16, 3, 11, 6]
STEPS = 3
GROUPS = [(6, [3, 9, 5, 7]), (4, [8, 2, 6]), (9, [4, 4, 10, 2]), (5, [7, 3, 5])]
"""Groups (prompt length, completion lengths) of a batch whose prompts the forwards run once."""
CFG = dict(lr=1e-2, device="cpu", grad_clip=0.5, weight_decay=0.1, max_tokens_per_mb=24)


def _run(backend, grads_out: dict | None = None):
    def hook(optimizer, args, kwargs):
        for name, p in backend.model.named_parameters():
            g = p.grad
            grads_out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()

    handle = backend.optimizer.register_step_pre_hook(hook) if grads_out is not None else None
    losses = []
    for s in range(STEPS):
        m = backend.train_step(
            random_batch(LENGTHS, VOCAB, 50 + s),
            forward_fn=nll_forward,
            loss_fn=nll_loss,
            denominator_fn=token_denominator,
        )
        losses.append((m["loss"], m["grad_norm"]))
        if handle is not None:
            handle.remove()
            handle = None
    return losses


def _worker(rank, world, model_dir, out_dir):
    out_dir = Path(out_dir)
    result = {}
    # data parallel (FSDP over 2 ranks)
    b = FSDP2TrainBackend(TrainBackendConfig(**CFG))
    b.initialize(model_dir)
    assert b._dp_size == 2 and b.plan(random_batch(LENGTHS, VOCAB, 0)).n_mbs >= 2
    grads = {}
    result["dp_losses"] = _run(b, grads)
    result["dp_grads"] = grads
    result["dp_scores"] = b.forward_only(random_batch(LENGTHS, VOCAB, 7), forward_fn=nll_forward)["logprobs_T"]
    # one sequence on two ranks: rank 1 runs an empty (dummy) micro-batch that adds nothing
    result["one_seq_loss"] = b.train_step(
        random_batch([9], VOCAB, 8), forward_fn=nll_forward, loss_fn=nll_loss, denominator_fn=token_denominator
    )["loss"]
    # groups sharing their prompts: each rank's share planned by rows (whole groups), the same step
    grouped = group_batch(GROUPS, seed=9)
    result["shared_plan"] = b.plan(grouped).per_rank
    result["shared_loss"] = b.train_step(
        grouped, forward_fn=nll_forward, loss_fn=nll_loss, denominator_fn=token_denominator
    )["loss"]
    result["dp_weights"] = {k: v.clone() for k, v in b.named_weights()}
    # sleep / wake round trip on sharded parameters and optimizer state
    local_before = [p.to_local().clone() for p in b.model.parameters()]
    freed = b.sleep()
    result["freed"] = freed
    result["restored"] = b.wake()
    result["sleep_exact"] = all(torch.equal(p.to_local(), q) for p, q in zip(b.model.parameters(), local_before))
    b.save_checkpoint(out_dir / "ckpt", {"pos": 3})
    b.shutdown()
    # tensor parallel (TP=2, no data parallelism)
    t = FSDP2TrainBackend(TrainBackendConfig(**CFG, tp_size=2))
    t.initialize(model_dir)
    # the untied LM head is vocab-parallel: this rank holds ceil(105 / 2) = 53 of the char vocabulary's rows
    result["tp_head_rows"] = t.model.lm_head.weight.to_local().shape[0]
    result["tp_losses"] = _run(t)
    t.shutdown()
    # HSDP: 2 replicas of a 1-way shard
    h = FSDP2TrainBackend(TrainBackendConfig(**CFG, dp_replicate_size=2))
    h.initialize(model_dir)
    result["hsdp_losses"] = _run(h)
    h.shutdown()
    # LoRA under FSDP: adapters only in the optimizer, merged export
    lo = FSDP2TrainBackend(TrainBackendConfig(**CFG, lora=LORA))
    lo.initialize(model_dir)
    result["lora_losses"] = _run(lo)
    result["lora_weights"] = {k: v.clone() for k, v in lo.named_weights()}
    result["lora_adapters"] = {k: v.clone() for k, v in lo.named_adapter_weights()}  # gathered from the shards
    lo.shutdown()
    # a mesh that does not divide the world size
    try:
        FSDP2TrainBackend(TrainBackendConfig(**CFG, dp_replicate_size=3)).initialize(model_dir)
    except ValueError as e:
        result["mesh_error"] = str(e)
    dist.barrier()
    if rank == 0:
        torch.save(result, out_dir / "result.pt")


@pytest.fixture(scope="module")
def fsdp_result(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp")
    model_dir = make_model_dir(tmp / "model")
    spawn(_worker, 2, str(model_dir), str(tmp), tmp=tmp)
    local = LocalTrainBackend(TrainBackendConfig(**CFG))
    local.initialize(model_dir)
    grads = {}
    losses = _run(local, grads)
    ref = {
        "losses": losses,
        "grads": grads,
        "scores": local.forward_only(random_batch(LENGTHS, VOCAB, 7), forward_fn=nll_forward)["logprobs_T"],
    }
    ref["one_seq_loss"] = local.train_step(
        random_batch([9], VOCAB, 8), forward_fn=nll_forward, loss_fn=nll_loss, denominator_fn=token_denominator
    )["loss"]
    ref["shared_loss"] = local.train_step(
        group_batch(GROUPS, seed=9), forward_fn=nll_forward, loss_fn=nll_loss, denominator_fn=token_denominator
    )["loss"]
    ref["weights"] = {k: v.clone() for k, v in local.named_weights()}  # named_weights may alias live params
    return torch.load(tmp / "result.pt", weights_only=True), ref, tmp, model_dir


def test_fsdp_two_ranks_equal_single_process(fsdp_result):
    got, ref, _, _ = fsdp_result
    for (l_dp, n_dp), (l_ref, n_ref) in zip(got["dp_losses"], ref["losses"]):
        assert abs(l_dp - l_ref) < 1e-5 and math.isclose(n_dp, n_ref, rel_tol=1e-4)
    for name, g in ref["grads"].items():  # gradient of 1 vs 2 ranks
        err = (got["dp_grads"][name] - g).norm() / g.norm().clamp_min(1e-12)
        assert err < 1e-5, (name, float(err))
    torch.testing.assert_close(got["dp_scores"], ref["scores"], rtol=1e-5, atol=1e-5)
    assert abs(got["one_seq_loss"] - ref["one_seq_loss"]) < 1e-5
    # shared prompts over two ranks: whole groups on each (every prompt run once), the one-process loss
    grouped = group_batch(GROUPS, seed=9)
    run = _Prompts(shared_prompt_tokens(grouped.input_ids_T, grouped.cu_seqlens_B1, grouped.loss_mask_T), []).run
    rank_of = {i: r for r, rank in enumerate(got["shared_plan"]) for mb in rank for i in mb}
    assert sorted(rank_of) == list(range(grouped.num_seqs)) and len(set(run)) == len(GROUPS)
    assert all(rank_of[i] == rank_of[run[i]] for i in rank_of), got["shared_plan"]  # a group on one rank
    assert abs(got["shared_loss"] - ref["shared_loss"]) < 1e-5
    assert list(got["dp_weights"]) == list(ref["weights"])
    for name, w in ref["weights"].items():
        # after 3 AdamW steps (lr 1e-2): within 1% of one step; Adam magnifies 1e-7 gradient noise
        torch.testing.assert_close(got["dp_weights"][name], w, rtol=0, atol=1e-4)


def test_tp2_equals_tp1(fsdp_result):
    got, ref, _, _ = fsdp_result
    assert got["tp_head_rows"] == 53
    for (l_tp, _), (l_ref, _) in zip(got["tp_losses"], ref["losses"]):
        assert abs(l_tp - l_ref) < 1e-5


def test_hsdp_equals_single_process(fsdp_result):
    got, ref, _, _ = fsdp_result
    for (l_h, _), (l_ref, _) in zip(got["hsdp_losses"], ref["losses"]):
        assert abs(l_h - l_ref) < 1e-5


def test_lora_under_fsdp_equals_single_process(fsdp_result):
    got, _, _, model_dir = fsdp_result
    local = LocalTrainBackend(TrainBackendConfig(**CFG, lora=LORA))
    local.initialize(model_dir)
    for (l_dp, _), (l_ref, _) in zip(got["lora_losses"], _run(local)):
        assert abs(l_dp - l_ref) < 1e-5
    for name, w in local.named_weights():
        torch.testing.assert_close(got["lora_weights"][name], w, rtol=0, atol=1e-4)
    adapters = dict(local.named_adapter_weights())
    assert list(got["lora_adapters"]) == list(adapters) and len(adapters) == 2 * 2 * 2  # 2 layers x 2 modules x A/B
    for name, w in adapters.items():
        torch.testing.assert_close(got["lora_adapters"][name], w, rtol=0, atol=1e-4)


def test_fsdp_sleep_wake_and_mesh_error(fsdp_result):
    got, _, _, _ = fsdp_result
    assert got["sleep_exact"] and got["freed"] == got["restored"] > 0
    assert "world size is 2" in got["mesh_error"] or "does not divide the world size 2" in got["mesh_error"]


def test_fsdp_checkpoint_loads_in_one_process(fsdp_result):
    got, _, tmp, model_dir = fsdp_result
    local = LocalTrainBackend(TrainBackendConfig(**CFG))
    local.initialize(model_dir)
    assert local.load_checkpoint(tmp / "ckpt") == {"pos": 3}
    for name, w in local.named_weights():
        torch.testing.assert_close(w, got["dp_weights"][name], rtol=0, atol=0)
