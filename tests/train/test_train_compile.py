"""torch.compile of the training step: the fused log-prob head kernels and compiled decoder layers
give the eager numbers (fp32, CPU).

Legend: T = tokens, D = hidden size, V = vocabulary.
"""

import dataclasses
import os

import pytest
import torch

from areno.models import logprobs as lp_mod
from areno.models.logprobs import compiled_logprob_kernels, logprobs_from_hidden
from areno.train import LocalTrainBackend, TrainBackendConfig
from tests.helpers.train import make_model_dir, nll_forward, nll_loss, random_batch, token_denominator

T, D, V = 13, 8, 29


def _head(fused: bool, tau: float, with_entropy: bool):
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(T, D, generator=gen).requires_grad_(True)
    w = (torch.randn(V, D, generator=gen) * 2).requires_grad_(True)
    targets_T = torch.randint(0, V, (T,), generator=gen)
    coef_T, coef_ent_T = torch.randn(T, generator=gen), torch.randn(T, generator=gen)
    with compiled_logprob_kernels(fused):
        logp_T, ent_T = logprobs_from_hidden(h, w, targets_T, tau, 5, with_entropy=with_entropy)
    loss = (coef_T * logp_T).sum() + ((coef_ent_T * ent_T).sum() if with_entropy else 0.0)
    loss.backward()  # outside the context: the forward's choice holds for backward
    return logp_T.detach(), ent_T.detach() if with_entropy else None, h.grad, w.grad


def _assert_head_close(a, b):
    torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-5)
    if a[1] is not None:
        torch.testing.assert_close(a[1], b[1], rtol=1e-5, atol=1e-5)
    for got, ref in zip(a[2:], b[2:]):
        assert float((got - ref).norm() / ref.norm()) < 1e-5


@pytest.mark.parametrize("tau,with_entropy", [(1.0, False), (0.7, True)])
def test_fused_head_math_equals_eager(monkeypatch, tau, with_entropy):
    # the fused kernels' math run eagerly (fast); the compiled run is the slow test below
    monkeypatch.setattr(lp_mod, "_KERNELS", (lp_mod._fused_forward_stats, lp_mod._fused_grad_logits))
    _assert_head_close(_head(True, tau, with_entropy), _head(False, tau, with_entropy))


@pytest.mark.parametrize("with_entropy", [False, True])
def test_fused_head_keeps_the_logits_bit_for_bit(monkeypatch, with_entropy):
    """The fused path's backward from forward's kept logits (keep_logits_budget) equals the recomputed one."""
    monkeypatch.setattr(lp_mod, "_KERNELS", (lp_mod._fused_forward_stats, lp_mod._fused_grad_logits))
    logits_matmuls = []
    real_logits = lp_mod._logits

    def counting_logits(h_CD, weight_mm_VD, packed, fp32=False):  # a chunk's logits (MKL's or oneDNN's product)
        logits_matmuls.append(weight_mm_VD.shape == (V, D))
        return real_logits(h_CD, weight_mm_VD, packed, fp32)

    monkeypatch.setattr(lp_mod, "_logits", counting_logits)
    monkeypatch.setattr(lp_mod, "keep_logits_budget", lambda device: 0)
    recomputed = _head(True, 0.7, with_entropy)
    assert sum(logits_matmuls) == 2 * 3  # 3 chunks of 5 tokens, in forward and again in backward
    logits_matmuls.clear()
    monkeypatch.setattr(lp_mod, "keep_logits_budget", lambda device: T * V * 4)
    kept = _head(True, 0.7, with_entropy)
    assert sum(logits_matmuls) == 3  # forward's only
    for a, b in zip(kept, recomputed):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("scope", ["layers", "model"])
def test_compiled_head_and_layers_equal_eager(tmp_path, scope):
    _assert_head_close(_head(True, 0.7, True), _head(False, 0.7, True))
    model_dir = make_model_dir(tmp_path / "model")
    losses = {}
    for compile_ in (False, True):
        b = LocalTrainBackend(
            TrainBackendConfig(lr=1e-2, device="cpu", max_tokens_per_mb=24, compile=compile_, compile_scope=scope)
        )
        b.initialize(model_dir)
        losses[compile_] = [
            b.train_step(
                random_batch([13, 7, 21, 5, 9], 100, 50 + s),
                forward_fn=nll_forward,
                loss_fn=nll_loss,
                denominator_fn=token_denominator,
            )["loss"]
            for s in range(2)
        ]
    assert all(abs(a - b) < 1e-5 for a, b in zip(losses[True], losses[False])), losses


def test_model_scope_compiles_the_layer_stack_once(tmp_path):
    """compile_scope='model': one compiled callable runs every layer (the layers themselves stay
    plain modules), and forward goes through it."""
    from areno.train.parallelize import apply_compile

    model_dir = make_model_dir(tmp_path / "model")
    b = LocalTrainBackend(TrainBackendConfig(lr=1e-2, device="cpu", max_tokens_per_mb=24))
    b.initialize(model_dir)
    model = b.model
    calls = []
    apply_compile(model, backend=lambda gm, inputs: calls.append(gm) or gm.forward, scope="model")
    assert "forward_layers" in vars(model)
    assert all(layer._compiled_call_impl is None for layer in model.model.layers)  # no per-layer compile
    ids = torch.randint(0, 100, (11,))
    model(ids, torch.arange(11))
    assert len(calls) == 1  # the whole stack in one graph: no graph break between layers


def test_bad_compile_scope_is_named():
    with pytest.raises(ValueError, match="train.compile_scope: must be layers or model"):
        TrainBackendConfig(compile_scope="whole")
    from areno.train.parallelize import apply_compile

    with pytest.raises(ValueError, match="needs an areno Decoder"):
        apply_compile(torch.nn.Linear(2, 2), scope="model")


def test_chunked_argmax_equals_full_argmax():
    from areno.models.logprobs import argmax_from_hidden

    gen = torch.Generator().manual_seed(1)
    h, w = torch.randn(T, D, generator=gen), torch.randn(V, D, generator=gen)
    assert torch.equal(argmax_from_hidden(h, w, 4), (h @ w.t()).argmax(-1))
    assert argmax_from_hidden(h[:0], w, 4).shape == (0,)


def test_compile_auto_resolves_per_device_and_explicit_values_are_honoured():
    assert TrainBackendConfig().compile == "auto"
    assert TrainBackendConfig().resolved_compile("cuda") is True
    assert TrainBackendConfig().resolved_compile("cpu") is False
    assert TrainBackendConfig(compile=True).resolved_compile("cpu") is True
    assert TrainBackendConfig(compile=False).resolved_compile("cuda") is False
    with pytest.raises(ValueError, match="train.compile: must be true, false or auto"):
        TrainBackendConfig(compile="sometimes")


@pytest.mark.parametrize("value,compiled", [(None, False), ("false", False), ("true", True)])
def test_train_compile_key_reaches_the_backend_with_its_cache(
    tiny_model_dir, tmp_path, monkeypatch, caplog, value, compiled
):
    """`train.compile` (default auto: off on CPU) decides whether the trained role compiles; when it
    does, inductor's cache goes to a user cache directory that outlives the run, named in the log."""
    from areno.api.config import load_config
    from areno.engine.api import build_role_backends, resolve_recipe
    from areno.train.parallelize import COMPILE_CACHE_ENV

    monkeypatch.setenv(COMPILE_CACHE_ENV, "unused")  # recorded, so the test's change is undone
    monkeypatch.delenv(COMPILE_CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    overrides = [f"model.path={tiny_model_dir}", f"run_dir={tmp_path / 'run'}", "cluster.device=cpu"]
    cfg = load_config(None, overrides + ([f"train.compile={value}"] if value else []))
    with caplog.at_level("INFO", logger="areno.engine.api"):
        # on the CPU, as the colocated engine builds it for cluster.device=cpu (also on a machine with a GPU)
        on_cpu = lambda c: LocalTrainBackend(dataclasses.replace(c, device="cpu"))
        backends = build_role_backends(cfg, resolve_recipe(cfg), tiny_model_dir, on_cpu)
    backend = next(iter(backends.values()))
    assert backend.cfg.compile is compiled
    assert all((layer._compiled_call_impl is not None) is compiled for layer in backend.model.model.layers)
    if compiled:
        cache = tmp_path / "cache" / "areno" / "inductor"
        assert backend.compile_cache == cache
        assert os.environ[COMPILE_CACHE_ENV] == str(cache)
        assert "compiling the training step (train.compile=True, train.compile_scope=layers)" in caplog.text
        assert str(cache) in caplog.text
    else:
        assert backend.compile_cache is None
        assert "compiling" not in caplog.text


def test_an_explicit_inductor_cache_dir_is_kept(monkeypatch, tmp_path):
    from areno.train.parallelize import COMPILE_CACHE_ENV, compile_cache_dir

    monkeypatch.setenv(COMPILE_CACHE_ENV, str(tmp_path / "mine"))
    assert compile_cache_dir() == tmp_path / "mine"
