"""Sequences whose advantages are all zero leave the step (``ActorConfig.skip_zero_advantage``): the
update must be the one of the whole batch, the loss keeps the whole batch's denominator, and the step
trains only the other sequences."""

from __future__ import annotations

import pytest
import torch

from areno.recipes import get_recipe
from areno.recipes.runner import RecipeRunner
from areno.specializations.actor import ActorConfig, ActorSpecialization
from areno.specializations.base import DENOMINATOR_CARRY_KEY, without_gradient_free
from tests.helpers.recipes import rl_batch, rl_batch_for, tiny_policy_dir

train = pytest.importorskip("areno.train")


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return tiny_policy_dir(tmp_path_factory.mktemp("models"))


def one_step(recipe, policy_dir, batch, forwarded=None, device="cpu", backend_kwargs=None, **runner_kwargs):
    backend = train.LocalTrainBackend(
        train.TrainBackendConfig(
            **{
                "lr": 1e-2,
                "device": device,
                "max_tokens_per_mb": 16,
                "seed": 0,
                "grad_clip": 1e9,
                **(backend_kwargs or {}),
            }
        )
    )
    backend.initialize(policy_dir)
    trained = []
    real = backend.train_step
    backend.train_step = lambda b, **kw: trained.append(b.num_seqs) or real(b, **kw)
    if forwarded is not None:
        real_forward = backend.forward_only
        backend.forward_only = lambda b, **kw: forwarded.append(b.num_seqs) or real_forward(b, **kw)
    metrics = RecipeRunner(recipe, {"policy": backend}, **runner_kwargs).step(batch)
    return metrics, [p.detach().cpu().clone() for p in backend.model.parameters()], trained


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("grpo", {}),
        ("grpo_async", {}),
        ("cispo", {}),
        ("gspo", {}),
        ("rloo", {}),
        ("grpo", {"loss_aggregation": "token"}),
    ],
)
def test_the_update_is_the_whole_batchs(policy_dir, name, kwargs):
    batch = rl_batch_for(policy_dir)
    on, p_on, trained_on = one_step(get_recipe(name, policy_kwargs=kwargs), policy_dir, batch)
    off, p_off, trained_off = one_step(
        get_recipe(name, policy_kwargs={**kwargs, "skip_zero_advantage": False}), policy_dir, batch
    )
    assert trained_on == [4] and trained_off == [6]  # group c left out
    assert on["policy/skipped_zero_grad_seqs"] == 2 and "policy/skipped_zero_grad_seqs" not in off
    assert on["policy/loss_denominator"] == off["policy/loss_denominator"]
    assert on["policy/loss"] == pytest.approx(off["policy/loss"], rel=1e-5, abs=1e-7)
    assert on["policy/grad_norm"] == pytest.approx(off["policy/grad_norm"], rel=1e-5)
    assert on["policy/tokens"] < off["policy/tokens"]
    for a, b in zip(p_on, p_off):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # the statistics (ratio, clip fraction, ...) are means over the sequences trained: those of a step on
    # groups a and b alone, not diluted by the left-out group's share of the denominator
    alone, _, _ = one_step(
        get_recipe(name, policy_kwargs={**kwargs, "skip_zero_advantage": False}), policy_dir, batch.select([0, 1, 2, 3])
    )
    stats = [k for k in on if k.startswith("policy/") and k.count("/") == 2]
    assert "policy/actor/ratio" in stats
    assert {k: on[k] for k in stats} == pytest.approx({k: alone[k] for k in stats}, rel=1e-5, abs=1e-7)


def test_a_backend_that_truncates_long_sequences_trains_the_whole_batch(policy_dir):
    """walk17: with long_sequences=truncate the left-out sequences' share of the denominator was counted
    untruncated, the kept ones truncated after it: at token aggregation the update came out 2.2x smaller.
    Such a backend now trains every sequence, so the step is the one without skipping."""
    batch = rl_batch_for(policy_dir)
    truncate = {"long_sequences": "truncate", "max_tokens_per_mb": 6}  # every sequence is longer than 6
    on, p_on, trained = one_step(
        get_recipe("grpo", policy_kwargs={"loss_aggregation": "token"}), policy_dir, batch, backend_kwargs=truncate
    )
    off, p_off, _ = one_step(
        get_recipe("grpo", policy_kwargs={"loss_aggregation": "token", "skip_zero_advantage": False}),
        policy_dir,
        batch,
        backend_kwargs=truncate,
    )
    assert trained == [6] and on["policy/truncated_tokens"] > 0
    assert on["policy/loss_denominator"] == off["policy/loss_denominator"]
    for a, b in zip(p_on, p_off):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_every_group_equal_trains_the_shortest_sequence_and_steps_alike(policy_dir):
    batch = rl_batch_for(policy_dir, rewards=[1.0, 1.0, 0.0, 0.0, 1.0, 1.0])
    on, p_on, trained_on = one_step(get_recipe("grpo"), policy_dir, batch)
    off, p_off, _ = one_step(get_recipe("grpo", policy_kwargs={"skip_zero_advantage": False}), policy_dir, batch)
    assert trained_on == [1] and on["policy/skipped_zero_grad_seqs"] == 5
    spec = ActorSpecialization(ActorConfig())
    prepared = spec.compute_advantages(batch)
    kept, _ = without_gradient_free(spec, prepared)
    assert kept.num_seqs == 1 and kept.num_tokens == int(prepared.seqlens_B.min())  # lengths 7, 5, 7, 5, 6, 7
    order = [5, 4, 3, 2, 1, 0]  # a later pass reorders the batch: the same sequence stays
    again, _ = without_gradient_free(spec, prepared.select(order))
    assert again.input_ids_T.tolist() == kept.input_ids_T.tolist()
    assert on["policy/grad_norm"] == 0.0 == off["policy/grad_norm"]
    for a, b in zip(p_on, p_off):  # AdamW's weight decay and its step count move both alike
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("kwargs", [{"kl_coef": 0.1}, {"entropy_coef": 0.01}, {"skip_zero_advantage": False}])
def test_nothing_left_out_where_the_loss_has_another_term(kwargs):
    spec = ActorSpecialization(ActorConfig(**kwargs))
    batch = spec.compute_advantages(rl_batch())
    assert spec.gradient_free_B(batch) is None
    assert without_gradient_free(spec, batch) == (batch, None)


@pytest.mark.parametrize("aggregation", ["token", "seq_mean_token_mean", "constant"])
def test_the_denominator_is_carried_by_the_first_sequence_kept(aggregation):
    spec = ActorSpecialization(ActorConfig(loss_aggregation=aggregation, loss_agg_constant=7.0))
    batch = spec.compute_advantages(rl_batch())
    assert spec.gradient_free_B(batch).tolist() == [False, False, False, False, True, True]
    kept, skipped = without_gradient_free(spec, batch)
    assert skipped == 2 and kept.num_seqs == 4
    carry = kept.extra[DENOMINATOR_CARRY_KEY]
    assert carry[1:].eq(0).all() and carry[0] > 0
    # cut into micro-batches any way, the shares still add up to the whole batch's denominator
    parts = [kept.select([0, 3]), kept.select([1]), kept.select([2])]
    assert sum(spec.step_denominator(p) for p in parts) == spec.denominator(batch)
    # a sequence with no loss tokens has no gradient either
    batch.loss_mask_T[batch.cu_seqlens_B1[0] : batch.cu_seqlens_B1[1]] = False
    assert spec.gradient_free_B(batch).tolist() == [True, False, False, False, True, True]


def test_an_unknown_option_is_still_refused():
    from areno.errors import ConfigError

    with pytest.raises(ConfigError, match="skip_zero_advantages"):
        get_recipe("grpo", policy_kwargs={"skip_zero_advantages": False})


@pytest.mark.parametrize(
    ("kwargs", "rewards", "forwards", "trains"),
    [
        ({}, None, [4], [4]),  # group c's equal rewards: no proximal forward, no training
        ({}, [1.0, 1.0, 0.0, 0.0, 1.0, 1.0], [1], [1]),  # every group equal: the one sequence kept
        ({"dynamic_sampling": True, "skip_zero_advantage": False}, None, [4], [4]),  # group c dropped
        ({"entropy_coef": 0.01, "dynamic_sampling": True}, None, [4], [4]),
        ({"entropy_coef": 0.01}, None, [6], [6]),  # every sequence has gradient
    ],
)
def test_the_proximal_forward_runs_over_the_sequences_the_step_trains(
    policy_dir, monkeypatch, kwargs, rewards, forwards, trains
):
    check_partial_forward(policy_dir, monkeypatch, kwargs, rewards, forwards, trains, "cpu", 1e-5)


@pytest.mark.gpu
def test_the_proximal_forward_over_the_trained_sequences_on_gpu(policy_dir, monkeypatch):
    on = check_partial_forward(policy_dir, monkeypatch, {}, None, [4], [4], "cuda", 2e-2)
    assert on["policy/skipped_zero_grad_seqs"] == 2


def check_partial_forward(policy_dir, monkeypatch, kwargs, rewards, forwards, trains, device, tol):
    batch = rl_batch_for(policy_dir, rewards=rewards)
    batch.versions_T = batch.versions_T.clamp(max=0)  # sampled by the weights trained: measured
    recipe = get_recipe("grpo_async", policy_kwargs=kwargs)
    forwarded = []
    on, p_on, trained = one_step(recipe, policy_dir, batch, forwarded, device, measure_rollout_logprobs=True)
    assert forwarded == forwards and trained == trains
    monkeypatch.setattr(ActorSpecialization, "self_forward_free_B", lambda self, b: None)
    full = []
    off, p_off, _ = one_step(recipe, policy_dir, batch, full, device, measure_rollout_logprobs=True)
    assert full == [6]
    for key in ("policy/loss", "policy/grad_norm", "policy/loss_denominator"):
        assert on[key] == pytest.approx(off[key], rel=tol, abs=tol / 100), key
    for a, b in zip(p_on, p_off):  # bf16 noise may flip the sign of AdamW's first update of a near-zero grad
        torch.testing.assert_close(a, b, rtol=tol, atol=1e-6 if device == "cpu" else 2.5e-2)
    # the train/rollout mismatch is measured over the tokens forwarded (a subset of all)
    assert 0 < on["rollout/logprob_abs_diff_mean"] <= on["rollout/logprob_abs_diff_max"]
    assert on["rollout/logprob_abs_diff_max"] <= off["rollout/logprob_abs_diff_max"]
    return on


def test_a_partial_forward_keeps_the_rollouts_values_elsewhere():
    from areno.recipes.runner import _scattered

    batch = rl_batch()
    cu = batch.cu_seqlens_B1.tolist()
    part = batch.select([1, 3])
    out, computed_T = _scattered(batch, [1, 3], {"logprobs_T": torch.full((part.num_tokens,), -9.0)})
    inside = torch.zeros(batch.num_tokens, dtype=torch.bool)
    for i in (1, 3):
        inside[cu[i] : cu[i + 1]] = True
    assert computed_T.tolist() == inside.tolist()
    assert out["logprobs_T"][inside].eq(-9.0).all()
    torch.testing.assert_close(out["logprobs_T"][~inside], batch.logprobs_T[~inside].float())
    with pytest.raises(ValueError, match="per-token"):
        _scattered(batch, [1, 3], {"score_B": torch.zeros(2)})


@pytest.mark.parametrize(
    ("rewards", "dropped_seqs", "dropped_groups", "trained"),
    [(None, 2, 1, [4]), ([1.0, 1.0, 0.0, 0.0, 1.0, 1.0], 6, 3, [1])],
)
def test_dapo_reports_the_groups_dynamic_sampling_drops_every_step(
    policy_dir, rewards, dropped_seqs, dropped_groups, trained
):
    """walk39c: with 2 of 6 sequences dropped the step logged skipped_zero_grad_seqs = 0 and nothing else
    named the drop; only a step whose every group was dropped showed it (as skipped sequences)."""
    batch = rl_batch_for(policy_dir, rewards)  # groups a, a, b, b, c, c; group c's rewards are equal
    metrics, _, trained_seqs = one_step(get_recipe("dapo"), policy_dir, batch)
    assert trained_seqs == trained
    assert metrics["policy/dynamic_sampling_dropped_seqs"] == dropped_seqs
    assert metrics["policy/dynamic_sampling_dropped_groups"] == dropped_groups
    grpo, _, _ = one_step(get_recipe("grpo"), policy_dir, batch)
    assert not any("dynamic_sampling" in k for k in grpo)  # only where the filter is on
