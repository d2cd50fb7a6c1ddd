"""Vocab-parallel log-probs/entropy/argmax (TP=2, gloo, 2 processes) equal the single-process path.

Legend: T = tokens, D = hidden size, V = vocabulary.
"""

from pathlib import Path

import pytest
import torch

from tests.helpers.train import spawn

pytestmark = pytest.mark.slow  # two process start-ups: ~20 s CPU, over a minute on a loaded machine

T, D = 11, 8
CASES = [  # (vocab, temperature, chunk_size, with_entropy, (divisor, cap) of the head's LogitMap): 37 is odd, so
    # the shards are uneven (19 + 18)
    (37, 1.0, 4, True, None),
    (36, 0.7, 16, True, None),
    (37, 1.3, 3, False, None),
    (37, 0.8, 4, True, (1.0, 3.0)),  # Gemma 2's final soft-cap, small enough to bend most logits
    (37, 0.9, 4, True, (8.0, None)),  # Granite's logits_scaling
    (37, 1.0, 4, True, (2.0, 3.0)),  # both steps of the map
]


def _inputs(vocab: int):
    gen = torch.Generator().manual_seed(vocab)
    hidden_TD = torch.randn(T, D, generator=gen, dtype=torch.float64).float()
    weight_VD = torch.randn(vocab, D, generator=gen) * 2.0  # large logits: exercises the max shift
    targets_T = torch.randint(0, vocab, (T,), generator=gen)
    coef_T = torch.randn(T, generator=gen)
    coef_ent_T = torch.randn(T, generator=gen)
    return hidden_TD, weight_VD, targets_T, coef_T, coef_ent_T


def _scores(hidden_TD, weight_VD, targets_T, coef_T, coef_ent_T, temperature, chunk, with_entropy, mapping):
    from areno.models.eager_ops import LogitMap
    from areno.models.logprobs import logprobs_from_hidden

    h = hidden_TD.clone().requires_grad_(True)
    logit_map = None if mapping is None else LogitMap(*mapping)
    lp, ent = logprobs_from_hidden(
        h, weight_VD, targets_T, temperature, chunk, with_entropy=with_entropy, logit_map=logit_map
    )
    loss = (coef_T * lp).sum() + ((coef_ent_T * ent).sum() if with_entropy else 0.0)
    loss.backward()
    return lp.detach(), (ent.detach() if with_entropy else None), h.grad


def _worker(rank, world, out_dir):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import areno.train.vocab_parallel  # noqa: F401  (registers the DTensor path)
    from areno.models.logprobs import argmax_from_hidden

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    results = []
    for vocab, tau, chunk, with_entropy, mapping in CASES:
        hidden_TD, weight_VD, targets_T, coef_T, coef_ent_T = _inputs(vocab)
        case = {}
        for label, placement in (("sharded", Shard(0)), ("replicated", Replicate())):
            w = distribute_tensor(weight_VD, mesh, [placement]).requires_grad_(True)
            lp, ent, grad_h = _scores(hidden_TD, w, targets_T, coef_T, coef_ent_T, tau, chunk, with_entropy, mapping)
            case[label] = (
                lp,
                ent,
                grad_h,
                w.grad.full_tensor(),
                tuple(w.to_local().shape),
                argmax_from_hidden(hidden_TD, w.detach(), chunk),
            )
        results.append(case)
    if rank == 0:
        torch.save(results, Path(out_dir) / "vp.pt")


def test_vocab_parallel_tp2_equals_tp1(tmp_path):
    spawn(_worker, 2, str(tmp_path), tmp=tmp_path)
    results = torch.load(tmp_path / "vp.pt", weights_only=True)
    for (vocab, tau, chunk, with_entropy, mapping), case in zip(CASES, results):
        hidden_TD, weight_VD, targets_T, coef_T, coef_ent_T = _inputs(vocab)
        w = weight_VD.clone().requires_grad_(True)
        lp, ent, grad_h = _scores(hidden_TD, w, targets_T, coef_T, coef_ent_T, tau, chunk, with_entropy, mapping)
        # the hand formula: log_softmax(cap tanh(h W^T / divisor / cap) / tau)[target]
        divisor, cap = mapping or (1.0, None)
        z = hidden_TD.double() @ weight_VD.double().t() / divisor
        ref_logp = torch.log_softmax((z if cap is None else cap * torch.tanh(z / cap)) / tau, -1)
        torch.testing.assert_close(lp.double(), ref_logp.gather(-1, targets_T[:, None])[:, 0], rtol=0, atol=1e-5)
        assert case["sharded"][4] == (-(-vocab // 2), D)  # rank 0 holds only its rows
        for label in ("sharded", "replicated"):
            got_lp, got_ent, got_grad_h, got_grad_w, _, got_argmax = case[label]
            assert torch.equal(got_argmax, (hidden_TD @ weight_VD.t()).argmax(-1))
            torch.testing.assert_close(got_lp, lp, rtol=1e-5, atol=1e-5)
            if with_entropy:
                torch.testing.assert_close(got_ent, ent, rtol=1e-5, atol=1e-5)
            # gradients (entries up to ~8): relative L2 error, as in the backend tests
            for got, ref in ((got_grad_h, grad_h), (got_grad_w, w.grad)):
                assert float((got - ref).norm() / ref.norm()) < 1e-5, (label, vocab)
