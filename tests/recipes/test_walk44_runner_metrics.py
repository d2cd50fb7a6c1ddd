"""What the RecipeRunner logs and trains when dynamic sampling drops groups (walk44): a later pass over
a step's batch trains the sequences the first pass kept, and a step that trains no token logs no mean
of its tokens."""

from __future__ import annotations

import pytest

from areno.recipes import get_recipe
from areno.recipes.runner import RecipeRunner
from tests.helpers.recipes import rl_batch_for, tiny_policy_dir

train = pytest.importorskip("areno.train")


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return tiny_policy_dir(tmp_path_factory.mktemp("models"))


def _backend(policy_dir):
    backend = train.LocalTrainBackend(
        train.TrainBackendConfig(lr=1e-2, device="cpu", max_tokens_per_mb=16, seed=0, grad_clip=1.0)
    )
    backend.initialize(policy_dir)
    return backend


def runner_for(policy_dir, recipe, trained: list, **policy_kwargs) -> RecipeRunner:
    backend = _backend(policy_dir)
    real = backend.train_step
    backend.train_step = lambda b, **kw: trained.append(b.input_ids_T.tolist()) or real(b, **kw)
    return RecipeRunner(get_recipe(recipe), {"policy": backend}, policy_kwargs=policy_kwargs)


def test_a_later_pass_trains_the_sequences_dynamic_sampling_kept(policy_dir):
    """dapo with train.num_train_passes=2: a step whose filter dropped a group raised "pass_order must be a
    permutation of the first pass's 4 sequences; got 6 indices" at its second pass."""
    batch = rl_batch_for(policy_dir)
    trained: list = []
    runner = runner_for(policy_dir, "dapo", trained, skip_zero_advantage=False)
    first = runner.step(batch)
    assert first["policy/dynamic_sampling_dropped_seqs"] == 2
    order = [5, 2, 0, 4, 1, 3]
    second = runner.step(batch.select(order), pass_order=order)
    kept_in_order = [i for i in order if i < 4]  # group c (sequences 4 and 5) dropped
    assert trained[1] == batch.select(kept_in_order).input_ids_T.tolist()
    assert second["policy/step"] == 2.0 and second["policy/dynamic_sampling_dropped_seqs"] == 2


@pytest.mark.parametrize("policy_kwargs", [{}, {"entropy_coef": 0.01}])
def test_a_step_that_trains_no_token_logs_no_token_means(policy_dir, policy_kwargs):
    """dapo, every group's rewards equal: nothing trains, and actor/ratio, clip_frac, approx_kl (and entropy)
    read 0.0, a mean over no token (a ratio of 0 reads as a collapsed policy); they are left out now."""
    batch = rl_batch_for(policy_dir, rewards=[1.0, 1.0, 0.0, 0.0, 1.0, 1.0])
    metrics = runner_for(policy_dir, "dapo", [], **policy_kwargs).step(batch)
    assert metrics["policy/dynamic_sampling_dropped_seqs"] == 6
    assert metrics["policy/loss_denominator"] == 0.0
    assert not [k for k in metrics if "/actor/" in k]
    # a step that trains tokens keeps them
    metrics = runner_for(policy_dir, "dapo", [], **policy_kwargs).step(rl_batch_for(policy_dir))
    assert 0.5 < metrics["policy/actor/ratio"] < 2.0


@pytest.mark.parametrize("policy_kwargs", [{}, {"entropy_coef": 0.01}])
def test_a_step_whose_groups_are_all_dropped_counts_each_sequence_once(policy_dir, policy_kwargs):
    """walk44 P1: every group dropped by dynamic sampling also counted 5 of the 6 as skipped (the whole batch,
    its loss mask zeroed, went on to the zero-advantage skip, which kept the shortest), 11 of 6; with an
    entropy term every sequence was forwarded and backpropagated for nothing. One sequence without loss
    tokens goes on now."""
    trained = []
    batch = rl_batch_for(policy_dir, rewards=[1.0, 1.0, 0.0, 0.0, 1.0, 1.0])
    metrics = runner_for(policy_dir, "dapo", trained, **policy_kwargs).step(batch)
    assert metrics["policy/dynamic_sampling_dropped_seqs"] == 6
    assert metrics.get("policy/skipped_zero_grad_seqs", 0.0) == 0.0
    assert [len(tokens) for tokens in trained] == [int(batch.seqlens_B.min())]  # one sequence, the shortest


def test_the_advantages_and_the_overlong_penalty_are_logged(policy_dir):
    """walk44 P2: the step's advantages (over the loss tokens of the kept sequences) and dapo's overlong
    penalty, by hand: groups a (rewards 1, 0; 4 and 2 completion tokens) and b (0.2, 1; 5 and 3 tokens) are
    kept, c is flat; GRPO's A = (r - mean) / (unbiased std + 1e-4), one value per token of a sequence."""
    recipe = get_recipe("dapo", max_completion_length=100, overlong_buffer_length=2)  # no penalty reached
    metrics = RecipeRunner(recipe, {"policy": _backend(policy_dir)}).step(rl_batch_for(policy_dir))
    assert metrics["policy/overlong_penalty_mean"] == 0.0
    a = 0.5 / (0.5 * 2**0.5 + 1e-4)  # each of a pair differing by d sits d/2 from the mean; std = d / sqrt(2)
    b = 0.4 / (0.8 / 2**0.5 + 1e-4)
    tokens = [a] * 4 + [-a] * 2 + [-b] * 5 + [b] * 3
    mean = sum(tokens) / len(tokens)
    std = (sum((x - mean) ** 2 for x in tokens) / len(tokens)) ** 0.5
    assert metrics["policy/advantage_mean"] == pytest.approx(mean, abs=1e-6)  # near 0: fp32 rounding
    assert metrics["policy/advantage_std"] == pytest.approx(std, rel=1e-5)
    assert metrics["policy/advantage_min"] == pytest.approx(-a, rel=1e-5)  # a > b: the eps weighs less
    assert metrics["policy/advantage_max"] == pytest.approx(a, rel=1e-5)
    # L_max 4, buffer 2: lengths 4, 2, 5, 3, 2, 3 -> (2 - L) / 2 inside the buffer, -1 past L_max
    recipe = get_recipe("dapo", max_completion_length=4, overlong_buffer_length=2)
    metrics = RecipeRunner(recipe, {"policy": _backend(policy_dir)}).step(rl_batch_for(policy_dir))
    penalties = [-1.0, 0.0, -1.0, -0.5, 0.0, -0.5]
    assert metrics["policy/overlong_penalty_mean"] == pytest.approx(sum(penalties) / 6)
