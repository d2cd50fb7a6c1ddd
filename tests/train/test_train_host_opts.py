"""The host-side optimisations of ``train_step`` (``HOST_OPTIMIZATIONS``) change no numbers.

FSDP2 on one gloo rank (one spawned process) with bf16 compute / fp32 master weights, active
grad-norm clipping and several micro-batches: every optimisation on vs every one off gives
bit-identical metrics, gradients, weights and forward-only scores (also across a sleep / wake,
with activation checkpointing and under LoRA), and their checkpoints load into each other. The two-rank, TP and HSDP cases run in the slow ``test_train_fsdp.py`` (all
optimisations on, against the single-process backend).
"""

from pathlib import Path

import pytest
import torch

from areno.train import FSDP2TrainBackend, LoraConfig, TrainBackendConfig
from areno.train.backend import HOST_OPTIMIZATIONS, host_floats
from areno.train.optim import LocalShardAdamW, global_grad_norm
from tests.helpers.train import make_model_dir, nll_forward, nll_loss, random_batch, spawn, token_denominator

VOCAB = 100
LENGTHS = [13, 7, 21, 5, 9, 16, 3, 11, 6]
LORA = LoraConfig(rank=4, alpha=8, target_modules=("q_proj", "up_proj"))
CFG = dict(lr=1e-2, device="cpu", grad_clip=0.05, weight_decay=0.1, max_tokens_per_mb=24, param_dtype="bfloat16")


def _train(model_dir: str, opts: frozenset[str], ckpt: Path | None, steps: int = 3, **cfg) -> dict:
    backend = FSDP2TrainBackend(TrainBackendConfig(**CFG, **cfg))
    backend.host_optimizations = opts
    backend.initialize(model_dir)
    grads: dict[str, torch.Tensor] = {}

    def keep_grads(optimizer, args, kwargs):
        grads.update(
            {n: p.grad.full_tensor().clone() for n, p in backend.model.named_parameters() if p.grad is not None}
        )

    backend.optimizer.register_step_pre_hook(keep_grads)

    def step(s: int) -> dict:
        return backend.train_step(
            random_batch(LENGTHS, VOCAB, 50 + s),
            forward_fn=nll_forward,
            loss_fn=nll_loss,
            denominator_fn=token_denominator,
        )

    metrics = [step(s) for s in range(steps - 1)]
    backend.sleep()  # the last step after a sleep / wake round trip
    backend.wake()
    metrics.append(step(steps - 1))
    out = {
        "n_fsdp_modules": len(backend._fsdp_modules),
        "metrics": metrics,
        "grads": grads,
        "weights": {k: v.clone() for k, v in backend.named_weights()},
        "scores": backend.forward_only(random_batch(LENGTHS, VOCAB, 7), forward_fn=nll_forward)["logprobs_T"],
    }
    if ckpt is not None:
        backend.save_checkpoint(ckpt, {"pos": 1})
    backend.shutdown()
    return out


def _worker(rank, world, model_dir, out_dir):
    out_dir = Path(out_dir)
    result = {
        "off": _train(model_dir, frozenset(), out_dir / "ckpt_off"),
        "on": _train(model_dir, HOST_OPTIMIZATIONS, out_dir / "ckpt_on"),
    }
    for name, cfg in (("ac", dict(activation_checkpointing=True)), ("lora", dict(lora=LORA))):
        result[f"{name}_off"] = _train(model_dir, frozenset(), None, steps=2, **cfg)
        result[f"{name}_on"] = _train(model_dir, HOST_OPTIMIZATIONS, None, steps=2, **cfg)
    # each arm's checkpoint resumes in the other (one FSDP group vs per-layer groups: same names)
    for src, opts in (("ckpt_on", frozenset()), ("ckpt_off", HOST_OPTIMIZATIONS)):
        backend = FSDP2TrainBackend(TrainBackendConfig(**CFG))
        backend.host_optimizations = opts
        backend.initialize(model_dir)
        assert backend.load_checkpoint(out_dir / src) == {"pos": 1}
        result[f"resumed_{src}"] = backend.train_step(
            random_batch(LENGTHS, VOCAB, 60), forward_fn=nll_forward, loss_fn=nll_loss, denominator_fn=token_denominator
        )
        backend.shutdown()
    torch.save(result, out_dir / "result.pt")


@pytest.fixture(scope="module")
def one_rank_result(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("host_opts")
    model_dir = make_model_dir(tmp / "model", layers=3)
    spawn(_worker, 1, str(model_dir), str(tmp), tmp=tmp)
    return torch.load(tmp / "result.pt", weights_only=True)


def test_host_optimizations_change_no_numbers(one_rank_result):
    off, on = one_rank_result["off"], one_rank_result["on"]
    assert off["n_fsdp_modules"] == 4 and on["n_fsdp_modules"] == 1  # 3 layers + root vs one group
    assert len(off["metrics"][0]) > 5 and off["metrics"] == on["metrics"]  # every value, bit for bit
    assert off["metrics"][0]["mbs"] >= 3 and off["metrics"][0]["grad_norm"] > CFG["grad_clip"]  # clipping acts
    for name, grad in off["grads"].items():
        assert torch.equal(grad, on["grads"][name]), name
    for name, weight in off["weights"].items():
        assert torch.equal(weight, on["weights"][name]), name
    assert torch.equal(off["scores"], on["scores"])
    assert one_rank_result["resumed_ckpt_on"] == one_rank_result["resumed_ckpt_off"]


@pytest.mark.parametrize("variant", ["ac", "lora"])
def test_host_optimizations_change_no_numbers_with_checkpointing_and_lora(one_rank_result, variant):
    off, on = one_rank_result[f"{variant}_off"], one_rank_result[f"{variant}_on"]
    assert off["metrics"] == on["metrics"]
    assert off["grads"].keys() == on["grads"].keys() and len(off["grads"]) > 0
    for name, grad in off["grads"].items():
        assert torch.equal(grad, on["grads"][name]), name
    for name, weight in off["weights"].items():
        assert torch.equal(weight, on["weights"][name]), name


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
        assert global_grad_norm(params)[0] == global_grad_norm(twins, local_shards=True)[0]
        plain.step()
        local.step()
    assert all(torch.equal(p, q) for p, q in zip(params, twins))
