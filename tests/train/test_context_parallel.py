"""Context parallelism (Ulysses, the ``c`` of ``cluster.allocation_mode``), CPU gloo, 2 processes: the decoder over each
rank's half of a packed stream gives the single-process log-probs and, averaged over the CP ranks,
its gradients (GQA with KV heads split and with KV heads repeated; Gemma 2's soft-capped scores); FSDP2 training with cp 2 equals
single-process training (losses, grad norms, weights, forward-only scores), odd token counts
included (the stream is padded to a multiple of cp). Layouts it does not cover are one-line
ConfigErrors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from areno.errors import ConfigError
from areno.models.hf_io import load_model
from areno.train import FSDP2TrainBackend, LocalTrainBackend, TrainBackendConfig
from areno.train.context_parallel import apply_context_parallel, context_parallel_group, cp_rank_groups, padded_tokens
from areno.train.packing import MicroBatchSpec, plan_micro_batches
from tests.helpers.train import make_model_dir, nll_forward, nll_loss, random_batch, spawn, token_denominator

VOCAB = 100
LENGTHS = [13, 7, 21, 5, 9, 16, 3, 11]  # 85 tokens: odd, so micro-batches get padded
CFG = dict(lr=1e-2, device="cpu", grad_clip=0.5, max_tokens_per_mb=24)
# Tolerances: fp32 on CPU; CP changes only summation order (attention per head group, gradients
# summed over ranks), so values agree to rounding; Adam's m/sqrt(v) magnifies ~0 gradients' noise.
LOGP_TOL = dict(rtol=1e-5, atol=1e-5)
GRAD_TOL = dict(rtol=1e-4, atol=1e-6)
WEIGHT_TOL = dict(rtol=1e-4, atol=1e-4)


def _grads_worker(rank, world, model_dirs, out_dir):
    group, _ = context_parallel_group([[0, 1]])
    batch = random_batch(LENGTHS, VOCAB, 3)
    result = {}
    for name, model_dir in model_dirs.items():
        results = []
        for cp in (1, 2):
            model, _ = load_model(model_dir, dtype=torch.float32, device="cpu")
            if cp == 2:
                apply_context_parallel(model, group, 2)
            out = nll_forward(model, batch)
            loss = -(out["logprobs_T"] * batch.loss_mask_T).sum() / batch.loss_mask_T.sum()
            loss.backward()
            grads = {}
            for k, p in model.named_parameters():
                g = p.grad.clone()
                if cp == 2:  # the data-parallel average FSDP takes over the CP ranks
                    dist.all_reduce(g, group=group)
                    g /= 2
                grads[k] = g
            results.append((out["logprobs_T"].detach(), grads))
        result[name] = results
    if rank == 0:
        torch.save(result, Path(out_dir) / "grads.pt")


def test_ulysses_logprobs_and_gradients_equal_one_process(tmp_path):
    dirs = {
        "kv_split": str(make_model_dir(tmp_path / "kv2", heads=4, kv_heads=2)),  # 1 KV head per rank
        "kv_repeat": str(make_model_dir(tmp_path / "kv1", heads=4, kv_heads=1, tie_word_embeddings=True)),
        # a 4-key window in layer 0 only, which turns by its own RoPE (Gemma 3's layout)
        "layer_windows": str(make_model_dir(tmp_path / "g3", heads=4, kv_heads=2, arch="gemma3", sliding_window=4)),
        # Gemma 2: each rank's heads cap their scores, every other layer windowed, the logits capped
        "softcap": str(make_model_dir(tmp_path / "g2", heads=4, kv_heads=2, arch="gemma2", sliding_window=4)),
    }
    spawn(_grads_worker, 2, dirs, str(tmp_path), tmp=tmp_path)
    r = torch.load(tmp_path / "grads.pt", weights_only=True)
    for name, ((logp1, grads1), (logp2, grads2)) in r.items():
        torch.testing.assert_close(logp2, logp1, **LOGP_TOL, msg=name)
        for k, g in grads1.items():
            torch.testing.assert_close(grads2[k], g, **GRAD_TOL, msg=f"{name} {k}")


def _train(backend) -> list[tuple[float, float]]:
    out = []
    for s in range(3):
        batch = random_batch(LENGTHS, VOCAB, 50 + s)
        m = backend.train_step(batch, forward_fn=nll_forward, loss_fn=nll_loss, denominator_fn=token_denominator)
        out.append((m["loss"], m["grad_norm"], m["mbs"]))
    return out


def _fsdp_worker(rank, world, model_dir, out_dir):
    b = FSDP2TrainBackend(TrainBackendConfig(**CFG, cp_size=2))
    b.initialize(model_dir)
    result = {"losses": _train(b), "scores": b.forward_only(random_batch(LENGTHS, VOCAB, 7), forward_fn=nll_forward)}
    result["weights"] = {k: v.clone() for k, v in b.named_weights()}
    b.shutdown()
    ac = FSDP2TrainBackend(TrainBackendConfig(**CFG, cp_size=2, activation_checkpointing=True))
    ac.initialize(model_dir)  # recomputing a layer in backward runs its all-to-alls again
    result["ac_first"] = _train(ac)[0]
    ac.shutdown()
    try:
        FSDP2TrainBackend(TrainBackendConfig(**CFG, cp_size=2, tp_size=2)).initialize(model_dir)
    except ConfigError as e:
        result["layout_error"] = str(e)
    dist.barrier()
    if rank == 0:
        torch.save(result, Path(out_dir) / "result.pt")


def test_fsdp_cp2_training_equals_one_process(tmp_path):
    model_dir = make_model_dir(tmp_path / "model", heads=4, kv_heads=2)
    spawn(_fsdp_worker, 2, str(model_dir), str(tmp_path), tmp=tmp_path)
    r = torch.load(tmp_path / "result.pt", weights_only=True)
    one = LocalTrainBackend(TrainBackendConfig(**{**CFG, "max_tokens_per_mb": 48}))  # cp 2 x 24 per rank
    one.initialize(model_dir)
    ref = _train(one)
    for (l1, g1, m1), (l2, g2, m2) in zip(ref, r["losses"]):
        assert m2 == m1  # the planner packs cp x max_tokens_per_mb per micro-batch
        assert l2 == pytest.approx(l1, rel=1e-5, abs=1e-6)
        assert g2 == pytest.approx(g1, rel=1e-4)
    ref_scores = one.forward_only(random_batch(LENGTHS, VOCAB, 7), forward_fn=nll_forward)
    torch.testing.assert_close(r["scores"]["logprobs_T"], ref_scores["logprobs_T"], **LOGP_TOL)
    for k, v in one.named_weights():
        torch.testing.assert_close(r["weights"][k], v, **WEIGHT_TOL, msg=k)
    assert r["ac_first"][:2] == pytest.approx(r["losses"][0][:2], rel=1e-5)
    assert "cp_size=2" in r["layout_error"] and "\n" not in r["layout_error"]


def test_context_parallel_needs_the_fsdp_backend_and_dividing_heads(tmp_path):
    with pytest.raises(ConfigError, match="cp_size=2 needs the FSDP2 backend"):
        LocalTrainBackend(TrainBackendConfig(**CFG, cp_size=2)).initialize(make_model_dir(tmp_path / "m"))
    model, _ = load_model(make_model_dir(tmp_path / "m3", heads=3, kv_heads=1, hidden=48), device="cpu")
    with pytest.raises(ConfigError, match="cp_size=2 must divide the model's attention heads"):
        apply_context_parallel(model, None, 2)


def test_cp_groups_are_consecutive_shard_ranks_per_replica():
    mesh = torch.arange(8).reshape(2, 4, 1)  # (dp_replicate, dp_shard, tp)
    assert cp_rank_groups(mesh, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert cp_rank_groups(torch.arange(8).reshape(1, 4, 2), 2) == [[0, 2], [4, 6], [1, 3], [5, 7]]


def test_planner_packs_cp_times_the_budget():
    spec = MicroBatchSpec(max_tokens_per_mb=8, cp_size=2)
    plan = plan_micro_batches([7, 9, 5, 3], spec)
    for mb in plan.per_rank[0]:
        assert padded_tokens(sum([7, 9, 5, 3][i] for i in mb), 2) <= 16
    assert plan.n_mbs == 2
    with pytest.raises(ConfigError, match="cp_size=2"):
        plan_micro_batches([17], spec)
