"""The training step's host-side fast path on one rank.

FSDP2 on one gloo rank (one spawned process) with bf16 compute / fp32 master weights, active
grad-norm clipping and several micro-batches: the whole model is one FSDP group, and a step after a
checkpoint round trip or a sleep / wake gives the same numbers, bit for bit, as the step trained
straight on (also with activation checkpointing and under LoRA). The losses and metrics come back in
one host read (``host_floats``); AdamW and the grad norm run on local shards (``LocalShardAdamW``,
``global_grad_norm``), with the values of the plain ones. The two-rank, TP and HSDP cases run in the
slow ``test_train_fsdp.py`` (against the single-process backend).
"""

import math
from pathlib import Path

import pytest
import torch

from areno.train import FSDP2TrainBackend, LoraConfig, TrainBackendConfig
from areno.train.backend import host_floats
from areno.train.optim import LocalShardAdamW, global_grad_norm
from tests.helpers.train import make_model_dir, nll_forward, nll_loss, random_batch, spawn, token_denominator

VOCAB = 100
LENGTHS = [13, 7, 21, 5, 9, 16, 3, 11, 6]
LORA = LoraConfig(rank=4, alpha=8, target_modules=("q_proj", "up_proj"))
CFG = dict(lr=1e-2, device="cpu", grad_clip=0.05, weight_decay=0.1, max_tokens_per_mb=24, param_dtype="bfloat16")


def _backend(model_dir: str, **cfg) -> FSDP2TrainBackend:
    backend = FSDP2TrainBackend(TrainBackendConfig(**CFG, **cfg))
    backend.initialize(model_dir)
    return backend


def _step(backend: FSDP2TrainBackend, s: int) -> dict:
    return backend.train_step(
        random_batch(LENGTHS, VOCAB, 50 + s), forward_fn=nll_forward, loss_fn=nll_loss, denominator_fn=token_denominator
    )


def _weights(backend: FSDP2TrainBackend) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in backend.named_weights()}


def _arms(model_dir: str, ckpt: Path, **cfg) -> dict:
    """Three steps straight on; the third again after a checkpoint round trip, and after a checkpoint
    round trip and a sleep / wake (eager, or lazy: the optimizer state back only at the optimizer step)."""
    straight = _backend(model_dir, **cfg)
    first = [_step(straight, s) for s in range(2)]
    straight.save_checkpoint(ckpt, {"pos": 2})
    out = {"n_fsdp_modules": len(straight._fsdp_modules), "first": first, "straight": _step(straight, 2)}
    out["straight_weights"] = _weights(straight)
    straight.shutdown()
    for arm in ("resumed", "woken", "woken_lazily"):
        backend = _backend(model_dir, **cfg)
        assert backend.load_checkpoint(ckpt) == {"pos": 2}
        if arm != "resumed":
            backend.sleep()
            backend.wake(lazy=arm == "woken_lazily")
        out[arm], out[f"{arm}_weights"] = _step(backend, 2), _weights(backend)
        backend.shutdown()
    return out


def _worker(rank, world, model_dir, out_dir):
    out_dir = Path(out_dir)
    result = {"plain": _arms(model_dir, out_dir / "ckpt")}
    result["ac"] = _arms(model_dir, out_dir / "ckpt_ac", activation_checkpointing=True)
    result["lora"] = _arms(model_dir, out_dir / "ckpt_lora", lora=LORA)
    torch.save(result, out_dir / "result.pt")


@pytest.fixture(scope="module")
def one_rank_result(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("one_rank")
    model_dir = make_model_dir(tmp / "model", layers=3)
    spawn(_worker, 1, str(model_dir), str(tmp), tmp=tmp)
    return torch.load(tmp / "result.pt", weights_only=True)


@pytest.mark.parametrize("variant", ["plain", "ac", "lora"])
def test_one_rank_step_is_one_fsdp_group_and_resumes_bit_for_bit(one_rank_result, variant):
    arms = one_rank_result[variant]
    assert arms["n_fsdp_modules"] == 1  # one group for the whole model, not one per layer + root
    first = arms["first"][0]
    assert len(first) > 5 and first["mbs"] >= 3 and all(math.isfinite(v) for v in first.values())
    if variant == "plain":
        assert first["grad_norm"] > CFG["grad_clip"]  # clipping acts
    for arm in ("resumed", "woken", "woken_lazily"):
        assert arms[arm] == arms["straight"], arm  # every value, bit for bit
        for name, weight in arms["straight_weights"].items():
            assert torch.equal(weight, arms[f"{arm}_weights"][name]), (arm, name)


def test_host_floats_reads_each_value_exactly():
    values = [
        torch.tensor(0.1),
        2.5,
        torch.tensor([1 / 3], dtype=torch.float64),
        torch.tensor(3, dtype=torch.int64),
        torch.tensor(0.3, dtype=torch.bfloat16),
        torch.tensor(7.25),
    ]
    assert host_floats(values) == [float(v) for v in values]
    assert host_floats([]) == []
    with pytest.raises(ValueError, match="one-element"):
        host_floats([torch.ones(2)])


def test_local_shard_adamw_and_grad_norm_equal_the_plain_ones():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    plain = torch.optim.AdamW(params, lr=0.1, weight_decay=0.1, foreach=True)
    local = LocalShardAdamW(twins, lr=0.1, weight_decay=0.1, foreach=True)
    for _ in range(3):
        for p, q in zip(params, twins):
            g = torch.randn_like(p)
            p.grad, q.grad = g.clone(), g.clone()
        plain_norm = math.sqrt(float(torch.nn.utils.get_total_norm([p.grad for p in params]).float()) ** 2)
        assert global_grad_norm(twins)[0] == plain_norm
        plain.step()
        local.step()
    assert all(torch.equal(p, q) for p, q in zip(params, twins))
