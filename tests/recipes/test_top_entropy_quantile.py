"""``train.algorithm_kwargs.top_entropy_quantile`` (TRL's GRPOConfig field): the policy loss keeps the
loss tokens whose entropy is in the top q fraction of their micro-batch's; the others stay in the
denominator and in the KL term. Validated in one line, the mask against ``torch.quantile``, the loss
against a hand computation, the forward asked for entropy, a short run's metric documented."""

from __future__ import annotations

import pytest
import torch

from areno.algo import high_entropy_mask_T, kl_estimate_T
from areno.api.config import load_config
from areno.cli import main as areno_main
from areno.errors import ConfigError
from areno.models.hf_io import load_model
from areno.recipes import get_recipe
from areno.specializations import ActorConfig, ActorSpecialization
from areno.specializations.base import with_extra
from tests.helpers.configs import run_to_end, tiny_run_overrides, train_args
from tests.helpers.recipes import PlainReducer, completion_positions, rl_batch, rl_batch_for, tiny_policy_dir


@pytest.mark.parametrize("q", [0.0, -0.2, 1.5])
def test_a_quantile_outside_0_1_is_refused_in_one_line_naming_the_key(q):
    with pytest.raises(ConfigError) as info:
        get_recipe("grpo", policy_kwargs={"top_entropy_quantile": q})
    said = str(info.value)
    assert "train.algorithm_kwargs.top_entropy_quantile" in said and "must be in (0, 1]" in said and "\n" not in said


def test_the_cli_refuses_it_in_one_line(tmp_path, capsys):
    assert areno_main(train_args(tmp_path, "train.algorithm_kwargs.top_entropy_quantile=0")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.algorithm_kwargs.top_entropy_quantile" in err[0], err


@pytest.mark.parametrize("q", [0.05, 0.2, 0.5, 0.8, 0.999])
def test_the_mask_keeps_the_tokens_at_or_above_torch_quantile(q):
    gen = torch.Generator().manual_seed(0)
    ent_T = torch.rand(200, generator=gen) * 3
    mask_T = torch.rand(200, generator=gen) < 0.7
    keep_T = high_entropy_mask_T(ent_T, mask_T, quantile=q)
    threshold = torch.quantile(ent_T[mask_T], 1 - q)  # TRL's threshold, linearly interpolated
    assert torch.equal(keep_T, (ent_T >= threshold) & mask_T)
    assert not keep_T[~mask_T].any()
    assert int(keep_T.sum()) == pytest.approx(q * int(mask_T.sum()), abs=1.0)


def test_with_a_gather_the_threshold_is_that_of_every_ranks_tokens():
    """Two data-parallel ranks' micro-batches: each rank's mask, its threshold taken over both ranks' loss
    tokens (``Reducer.gather``), is the single process's mask over the two together, cut where they meet."""
    gen = torch.Generator().manual_seed(1)
    ent_T, mask_T = torch.rand(90, generator=gen) * 2, torch.rand(90, generator=gen) < 0.8
    ent_T[:40] += 1.0  # rank 0's tokens run hotter: its own quantile would keep other tokens
    whole = high_entropy_mask_T(ent_T, mask_T, quantile=0.25)
    parts = [(ent_T[:40], mask_T[:40]), (ent_T[40:], mask_T[40:])]
    both = torch.cat([e[m] for e, m in parts])
    gathered = [high_entropy_mask_T(e, m, quantile=0.25, gather=lambda _: both) for e, m in parts]
    assert torch.equal(torch.cat(gathered), whole)
    alone = [high_entropy_mask_T(e, m, quantile=0.25) for e, m in parts]
    assert not torch.equal(torch.cat(alone), whole)  # each rank's own quantile: another mask


def test_the_mask_keeps_all_at_1_ties_and_none_without_loss_tokens():
    ent_T = torch.tensor([0.3, 0.1, 0.2, 0.5])
    mask_T = torch.tensor([True, True, False, True])
    assert torch.equal(high_entropy_mask_T(ent_T, mask_T, quantile=1.0), mask_T)
    assert torch.equal(high_entropy_mask_T(torch.ones(4), mask_T, quantile=0.1), mask_T)  # ties at the threshold
    assert not high_entropy_mask_T(ent_T, torch.zeros(4, dtype=torch.bool), quantile=0.5).any()
    with pytest.raises(ValueError, match="top_entropy_quantile must be in"):
        high_entropy_mask_T(ent_T, mask_T, quantile=0.0)


def test_the_policy_loss_keeps_the_high_entropy_tokens_the_denominator_and_the_kl_all():
    """dr_grpo (token mean over the step) at pi_theta = pi_behave: each token's policy loss is -A; the KL
    term (k3 against a reference 0.1 lower) stays on every token; the denominator stays every loss token."""
    batch = rl_batch()
    gen = torch.Generator().manual_seed(4)
    mask_T = batch.loss_mask_T.bool()
    batch.logprobs_T = torch.where(mask_T, -torch.rand(batch.num_tokens, generator=gen) - 0.5, torch.zeros(()))
    ent_T = torch.where(mask_T, torch.rand(batch.num_tokens, generator=gen) * 2, torch.zeros(()))
    ref_T = batch.logprobs_T - 0.1
    config = dict(advantage_estimator="dr_grpo", loss_aggregation="token", kl_coef=0.05, top_entropy_quantile=0.25)
    spec = ActorSpecialization(ActorConfig(**config))
    prepared = spec.prepare_batch(with_extra(batch, ref_logprobs_T=ref_T))
    n = int(mask_T.sum())
    output = {"logprobs_T": batch.logprobs_T.clone().requires_grad_(), "entropy_T": ent_T}
    loss, metrics = spec.compute_loss(output, prepared, PlainReducer(spec.denominator(prepared)))

    threshold = torch.quantile(ent_T[mask_T], 0.75)
    adv_B = [0.5, -0.5, -0.4, 0.4, 0.0, 0.0]  # dr_grpo: the reward minus its group's mean
    kl_T = kl_estimate_T(batch.logprobs_T, ref_T, mask_T, estimator="k3")
    total, dropped = 0.0, 0
    for b in range(batch.num_seqs):
        for t in completion_positions(batch, b):
            kept = bool(ent_T[t] >= threshold)
            dropped += not kept
            total += (-adv_B[b] if kept else 0.0) + 0.05 * float(kl_T[t])
    assert loss.item() == pytest.approx(total / n, rel=1e-5)
    assert metrics["actor/entropy_mask_frac"].item() == pytest.approx(dropped / n)
    assert dropped / n == pytest.approx(0.75, abs=1.0 / n)
    # without it, the same tokens' policy loss all count: a different loss, and no mask figure
    plain = ActorSpecialization(ActorConfig(**{**config, "top_entropy_quantile": 1.0}))
    plain_loss, plain_metrics = plain.compute_loss(output, prepared, PlainReducer(plain.denominator(prepared)))
    assert plain_loss.item() != pytest.approx(loss.item()) and "actor/entropy_mask_frac" not in plain_metrics
    # the gradient reaches the dropped tokens through the KL term alone
    (grad_T,) = torch.autograd.grad(loss, output["logprobs_T"])
    dropped_T = mask_T & (ent_T < threshold)
    kl_grad_T = 0.05 * (1 - torch.exp(ref_T - batch.logprobs_T)) / n  # d k3 / d logp
    assert torch.allclose(grad_T[dropped_T], kl_grad_T[dropped_T], atol=1e-6)


def test_the_forward_computes_entropy_and_no_sequence_is_skipped(tmp_path):
    policy_dir = tiny_policy_dir(tmp_path)
    model = load_model(policy_dir, dtype=torch.float32, device="cpu")[0]
    batch = rl_batch_for(policy_dir)  # group c's advantages are all 0
    on = ActorSpecialization(ActorConfig(top_entropy_quantile=0.5))
    off = ActorSpecialization(ActorConfig())
    assert "entropy_T" in on.extract_model_output(model, batch)
    assert "entropy_T" not in off.extract_model_output(model, batch)
    # the zero-advantage sequences' tokens are part of the population the quantile is taken over
    assert on.gradient_free_B(on.prepare_batch(batch)) is None
    assert off.gradient_free_B(off.prepare_batch(batch)) is not None


def test_a_short_run_logs_the_mask_fraction_documented(tmp_path):
    overrides = [
        *tiny_run_overrides(tmp_path),
        "train.steps=1",
        "train.eval_interval=0",
        "reward.sandbox=false",
        "train.algorithm_kwargs={top_entropy_quantile: 0.5}",
    ]
    rows = run_to_end(load_config(None, overrides))
    keys = {k for row in rows for k in row}
    assert {"train/policy/actor/entropy_mask_frac", "train/policy/actor/entropy"} <= keys, sorted(keys)
    frac = next(
        row["train/policy/actor/entropy_mask_frac"] for row in rows if "train/policy/actor/entropy_mask_frac" in row
    )
    assert 0.3 <= frac <= 0.6  # about half of the loss tokens (ties and small micro-batches move it)
