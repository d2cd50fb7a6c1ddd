"""Per-layer settings (activation checkpointing, compile, FSDP) reach the decoder inside a wrapper such
as a PPO critic's value head or a reward model's score head: they used to read ``model.model.layers``
and crashed on the wrapper (CPU)."""

import pytest
import torch

from areno.specializations.forward import ScalarHeadModel
from areno.train.parallelize import apply_activation_checkpointing, apply_compile
from tests.helpers.configs import role_run_config, run_to_end
from tests.helpers.recipes import make_decoder


def _scores_and_grads(model: ScalarHeadModel) -> tuple[torch.Tensor, list[torch.Tensor]]:
    ids_T = torch.tensor([3, 9, 4, 1, 7, 2])
    hidden_TD = model(ids_T, torch.arange(6))
    out_T = model.score(hidden_TD.float()).squeeze(-1)
    out_T.pow(2).sum().backward()
    return out_T.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_checkpointing_a_score_head_model_keeps_its_scores_and_gradients():
    plain, checkpointed = ScalarHeadModel(make_decoder(0)), ScalarHeadModel(make_decoder(0))
    for m in (plain, checkpointed):
        torch.nn.init.normal_(m.score.weight, generator=torch.Generator().manual_seed(1))
    apply_activation_checkpointing(checkpointed)
    assert all(hasattr(layer.forward, "__wrapped__") for layer in checkpointed.decoder.model.layers)
    a, b = _scores_and_grads(plain), _scores_and_grads(checkpointed)
    torch.testing.assert_close(a[0], b[0])
    assert len(a[1]) == len(b[1]) > 0
    for x, y in zip(a[1], b[1]):
        torch.testing.assert_close(x, y)


def test_layer_scope_compile_marks_each_layer_inside_a_score_head_model():
    model = ScalarHeadModel(make_decoder(0))
    apply_compile(model, scope="layers")  # compiles lazily: nothing is compiled until a forward
    assert all(layer._compiled_call_impl is not None for layer in model.decoder.model.layers)


def test_ppo_with_activation_checkpointing_trains_like_without(tmp_path):
    runs = {}
    for ckpt in (False, True):
        cfg = role_run_config(
            tmp_path, f"ppo-{ckpt}", "train.algorithm=ppo", f"train.activation_checkpointing={ckpt}", steps=2
        )
        runs[ckpt] = [r for r in run_to_end(cfg) if "train/value/loss" in r]
    assert len(runs[False]) == len(runs[True]) == 2
    keys = [f"train/{role}/{k}" for role in ("policy", "value") for k in ("loss", "grad_norm")]
    for a, b in zip(runs[False], runs[True]):
        for k in keys:
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k
