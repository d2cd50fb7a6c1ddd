"""Expert parallelism (``areno.train.expert_parallel``) over a gloo group of 2 CPU processes equals
one process holding every expert: the loss and every gradient (dense ones summed over the ranks,
expert ones the rank's slice), for Qwen3-MoE and for Qwen2-MoE (its shared expert data parallel, as the
dense weights)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from areno.models import Decoder, PackedCausalAttention, tiny_config
from areno.train.expert_parallel import AllToAllDispatch, shard_experts
from tests.helpers.train import spawn

VOCAB = 53
LENS = [(11, 6), (4, 9)]  # rank r's sequences: the ranks hold different numbers of tokens


def _model(arch: str) -> Decoder:
    config = tiny_config(
        VOCAB, arch=arch, hidden_size=32, layers=3, num_experts=4, mlp_only_layers=(1,), initializer_range=0.2
    )
    torch.manual_seed(0)
    return Decoder(config)


def _batch(lens: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids_T = torch.randint(0, VOCAB, (sum(lens),), generator=g)
    pos_T = torch.cat([torch.arange(n) for n in lens])
    cu_B1 = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    return ids_T, pos_T, cu_B1


def _loss(model: Decoder, ids_T, pos_T, cu_B1) -> torch.Tensor:
    """Summed next-token NLL of a packed batch (the sum over ranks is the whole batch's)."""
    logits_TV = model.logits(model(ids_T, pos_T, PackedCausalAttention(cu_B1)))
    last = set((cu_B1[1:] - 1).tolist())
    keep = torch.tensor([t not in last for t in range(ids_T.numel())])
    return torch.nn.functional.cross_entropy(logits_TV[keep], ids_T.roll(-1)[keep], reduction="sum")


def _worker(rank: int, world: int, arch: str) -> None:
    full = _model(arch)
    batches = [_batch(lens, seed=r) for r, lens in enumerate(LENS)]
    ref_loss = sum(_loss(full, *b) for b in batches)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in full.named_parameters()}

    ep = copy.deepcopy(full)
    ep.zero_grad(set_to_none=True)
    assert len(shard_experts(ep, init_device_mesh("cpu", (world,)))) == 4  # 2 sparse layers x 2 tensors
    loss = _loss(ep, *batches[rank])
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    torch.testing.assert_close(total, ref_loss.detach(), rtol=1e-5, atol=1e-4)
    for name, p in ep.named_parameters():
        grad = p.grad.to_local() if ".experts." in name else p.grad
        if ".experts." in name:  # this rank's experts: their gradient already holds every rank's tokens
            expected = ref_grads[name][2 * rank : 2 * rank + 2]
        else:  # replicated (data parallel): summed over the ranks
            dist.all_reduce(grad)
            expected = ref_grads[name]
        torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-5, msg=name)
    with pytest.raises(ValueError, match="does not divide num_experts=5"):
        AllToAllDispatch(dist.group.WORLD, 5)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_expert_parallel_2_equals_1_and_refuses_an_uneven_split(tmp_path, arch):
    spawn(_worker, 2, arch, tmp=tmp_path)
