"""TRL GRPOConfig options areno gained as ``train.algorithm_kwargs``: sequence-level behaviour weights
(``behav_weight_mode=sequence_mask|sequence_truncate``), their lower bound (``behav_imp_weight_min``),
DeepSeek-V3.2's off-policy sequence mask (``off_policy_mask_threshold``) and the batch-std advantage
(``advantage_estimator=grpo_batch_std``): validated, refused where inert, and wired into the actor's loss
(hand-computed, on given log-probs: no model)."""

from __future__ import annotations

import math

import pytest
import torch

from areno.cli import main as areno_main
from areno.errors import ConfigError
from areno.recipes import get_recipe
from areno.specializations import ActorConfig, ActorSpecialization
from areno.specializations.base import with_extra
from tests.helpers.configs import train_args
from tests.helpers.recipes import PlainReducer, completion_positions, rl_batch


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"behav_weight_mode": "sequence"}, "behav_weight_mode must be one of ('mask', 'truncate', 'sequence_mask', "),
        ({"behav_imp_weight_min": -0.1}, "behav_imp_weight_min must be >= 0 and below behav_imp_weight_cap"),
        ({"behav_imp_weight_cap": 2.0, "behav_imp_weight_min": 2.0}, "below behav_imp_weight_cap (2.0)"),
        ({"off_policy_mask_threshold": 0.0}, "off_policy_mask_threshold must be > 0"),
        ({"advantage_estimator": "grpo_batch"}, "'dr_grpo', 'grpo_batch_std', 'gdpo', 'rloo'"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_key(kwargs, says):
    with pytest.raises(ConfigError) as info:
        ActorConfig(**kwargs)
    assert says in str(info.value) and "\n" not in str(info.value)


def test_a_lower_bound_alone_is_valid():
    ActorConfig(behav_imp_weight_min=0.5)
    ActorConfig(behav_imp_weight_min=0.0, behav_imp_weight_cap=3.0)


@pytest.mark.parametrize(
    ("name", "kwargs", "why"),
    [
        ("grpo", {"behav_imp_weight_min": 0.5}, "only the decoupled loss reads it"),
        ("grpo", {"behav_weight_mode": "sequence_mask"}, "only the decoupled loss reads it"),
        ("grpo_async", {"behav_imp_weight_cap": None, "behav_weight_mode": "truncate"}, "both are null (no bound)"),
        ("dr_grpo", {"adv_eps": 0.01}, "only advantage_estimator grpo (the group's), grpo_batch_std (the batch's)"),
        # TRL's vllm_importance_sampling_clip_min copied at 0: no weight is below it, in any mode
        ("grpo_async", {"behav_imp_weight_min": 0.0}, "never below 0, so a lower bound of 0 bounds nothing: drop it"),
        ("grpo_async", {"behav_imp_weight_min": 0, "behav_weight_mode": "sequence_truncate"}, "never below 0"),
    ],
)
def test_an_option_that_does_nothing_is_refused(name, kwargs, why):
    with pytest.raises(ConfigError) as info:
        get_recipe(name, policy_kwargs=kwargs)
    assert why in str(info.value), str(info.value)


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("grpo_async", {"behav_weight_mode": "sequence_mask", "behav_imp_weight_cap": 3.0}),
        ("grpo_async", {"behav_weight_mode": "sequence_truncate", "behav_imp_weight_min": 0.5}),
        ("grpo_async", {"behav_imp_weight_cap": None, "behav_weight_mode": "sequence_mask"}),  # the granularity
        ("grpo_async_loglinear", {"behav_imp_weight_min": 0.2}),
        ("grpo", {"off_policy_mask_threshold": 0.5}),
        ("gspo", {"off_policy_mask_threshold": 0.5}),
        ("dr_grpo", {"advantage_estimator": "grpo_batch_std", "adv_eps": 0.01}),
        # the KL in the loss, as the refusal of grpo_batch_std with reinforce_pp's KL reward offers
        ("reinforce_pp", {"advantage_estimator": "grpo_batch_std", "kl_in_reward": False, "kl_estimator": "k3"}),
        ("reinforce_pp", {"advantage_estimator": "reinforce_pp_baseline"}),  # per-token returns: the KL read
    ],
)
def test_the_options_are_accepted_where_they_are_read(name, kwargs):
    get_recipe(name, policy_kwargs=kwargs)


@pytest.mark.parametrize(
    ("name", "kwargs", "why"),
    [
        ("ppo", {"advantage_estimator": "grpo_batch_std"}, "recipe 'ppo' trains a critic (role 'value') whose values "
         "only advantage_estimator=gae reads, so it would train for nothing: drop the key, or use a recipe without"),
        ("ppo_async", {"advantage_estimator": "grpo"}, "recipe 'ppo_async' trains a critic"),
        ("reinforce_pp", {"advantage_estimator": "grpo_batch_std"}, "recipe 'reinforce_pp' subtracts its KL from the "
         "token rewards (kl_in_reward=true), which advantage_estimator grpo_batch_std never reads (one reward per "
         "sequence), so the KL would reach nothing: set train.algorithm_kwargs.kl_in_reward=false and kl_estimator=k3"),
    ],
)  # fmt: skip
def test_an_estimator_that_leaves_a_part_of_the_recipe_unread_is_refused(name, kwargs, why):
    """The critic's values, or the KL the recipe places in the token rewards, would reach nothing: a whole
    role (the critic, the reference) computed for nothing, silently."""
    with pytest.raises(ConfigError) as info:
        get_recipe(name, policy_kwargs=kwargs)
    assert str(info.value).startswith(f"train.algorithm_kwargs.advantage_estimator={kwargs['advantage_estimator']}: ")
    assert why in str(info.value) and "\n" not in str(info.value)


def test_grpo_batch_std_needs_groups():
    assert ActorSpecialization(ActorConfig(advantage_estimator="grpo_batch_std")).needs_groups is not None


def test_the_cli_refuses_a_bad_mode_in_one_line(tmp_path, capsys):
    args = train_args(tmp_path, "train.algorithm=grpo_async", "train.algorithm_kwargs.behav_weight_mode=seq_mask")
    assert areno_main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ActorConfig.behav_weight_mode must be one of" in err[0], err
    assert "'sequence_mask'" in err[0]


def _loss(spec: ActorSpecialization, batch, logp_T: torch.Tensor):
    prepared = spec.prepare_batch(batch)
    return spec.compute_loss({"logprobs_T": logp_T}, prepared, PlainReducer(spec.denominator(prepared)))


def _seq_of(batch) -> list[int]:
    """The sequence of each loss token, in order."""
    return [b for b in range(batch.num_seqs) for _ in completion_positions(batch, b)]


def test_grpo_batch_std_advantages_reach_the_batch():
    batch = rl_batch()  # rewards 1, 0 | 0.2, 1 | 1, 1 in groups a, b, c
    prepared = ActorSpecialization(ActorConfig(advantage_estimator="grpo_batch_std")).prepare_batch(batch)
    std = math.sqrt(0.22)  # of the six rewards: mean 0.7, squared deviations sum 1.1, / 5
    per_seq = [0.5, -0.5, -0.4, 0.4, 0.0, 0.0]
    for b in range(6):
        for t in completion_positions(batch, b):
            assert prepared.advantages_T[t].item() == pytest.approx(per_seq[b] / (std + 1e-4), rel=1e-5)


def test_off_policy_mask_drops_a_far_off_negative_sequence_from_the_policy_loss():
    """Group advantages a: +, -; b: -, +; c: 0. Sequence 1 (negative, mean gap 1 > 0.5) is dropped, sequence 2
    (negative, gap 0.25) and the positive ones stay; the dropped tokens stay in the denominator."""
    batch = rl_batch()
    gap_B = [1.0, 1.0, 0.25, 1.0, 1.0, 1.0]  # log pi_behave - log pi_theta on every loss token
    batch.logprobs_T = torch.where(batch.loss_mask_T, torch.full((batch.num_tokens,), -1.0), torch.zeros(()))
    logp_T = batch.logprobs_T.clone()
    for b in range(6):
        logp_T[completion_positions(batch, b)] -= gap_B[b]
    spec = ActorSpecialization(ActorConfig(advantage_estimator="dr_grpo", off_policy_mask_threshold=0.5))
    loss, metrics = _loss(spec, batch, logp_T)
    adv_B = [0.5, -0.5, -0.4, 0.4, 0.0, 0.0]
    seqs = _seq_of(batch)
    total = 0.0
    for b in seqs:
        if b != 1:
            r = math.exp(-gap_B[b])
            total += -min(r * adv_B[b], min(max(r, 0.8), 1.2) * adv_B[b])
    assert loss.item() == pytest.approx(total / len(seqs), rel=1e-5)
    assert metrics["actor/off_policy_mask_frac"].item() == pytest.approx(seqs.count(1) / len(seqs))
    plain, plain_metrics = _loss(ActorSpecialization(ActorConfig(advantage_estimator="dr_grpo")), batch, logp_T)
    assert plain.item() != pytest.approx(loss.item()) and "actor/off_policy_mask_frac" not in plain_metrics


def test_sequence_mask_weights_each_sequence_by_its_probability_ratio():
    """Decoupled loss at pi_theta = pi_prox (ratio 1, loss -w A). pi_prox / pi_behave over each sequence:
    3 (over the cap 2: dropped), 1.5, 0.25 (under the bound 0.5: dropped), 1.2, and 1 for group c."""
    batch = rl_batch()
    seq_ratio = [3.0, 1.5, 0.25, 1.2, 1.0, 1.0]
    behave_T = torch.where(batch.loss_mask_T, torch.full((batch.num_tokens,), -2.0), torch.zeros(()))
    prox_T = behave_T.clone()
    for b in range(6):
        first, *rest = completion_positions(batch, b)
        prox_T[first] += math.log(seq_ratio[b]) - 0.1 * len(rest)  # the sum over the sequence is log of it
        prox_T[rest] += 0.1
    batch.logprobs_T = behave_T
    spec = ActorSpecialization(
        ActorConfig(
            advantage_estimator="dr_grpo",
            use_decoupled_loss=True,
            behav_imp_weight_cap=2.0,
            behav_imp_weight_min=0.5,
            behav_weight_mode="sequence_mask",
        )
    )
    loss, metrics = _loss(spec, with_extra(batch, prox_logprobs_T=prox_T), prox_T)
    adv_B = [0.5, -0.5, -0.4, 0.4, 0.0, 0.0]
    weight_B = [0.0, 1.5, 0.0, 1.2, 1.0, 1.0]
    seqs = _seq_of(batch)
    assert loss.item() == pytest.approx(sum(-weight_B[b] * adv_B[b] for b in seqs) / len(seqs), rel=1e-5)
    assert metrics["actor/behave_over_cap_frac"].item() == pytest.approx(seqs.count(0) / len(seqs))
    assert metrics["actor/behave_under_min_frac"].item() == pytest.approx(seqs.count(2) / len(seqs))
