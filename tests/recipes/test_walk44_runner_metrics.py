"""What the RecipeRunner logs and trains when dynamic sampling drops groups (walk44): a later pass over
a step's batch trains the sequences the first pass kept, and a step that trains no token logs no mean
of its tokens."""

from __future__ import annotations

import pytest
import torch

from areno.recipes import get_recipe
from areno.recipes.runner import RecipeRunner
from tests.helpers.recipes import naive_logprobs, rl_batch, with_behaviour_logprobs

train = pytest.importorskip("areno.train")


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    from areno.data.tokenizer import build_char_tokenizer
    from areno.models.hf_io import init_model_dir, tiny_config

    tok = build_char_tokenizer()
    cfg = tiny_config(len(tok), hidden_size=32, layers=2, heads=4, kv_heads=2, initializer_range=0.3)
    return str(init_model_dir(tmp_path_factory.mktemp("models") / "policy", cfg, tok, seed=0))


def batch_for(policy_dir, rewards=None):
    from areno.models.hf_io import load_model

    batch = rl_batch()  # 6 sequences in groups a, a, b, b, c, c; group c's rewards are equal
    if rewards is not None:
        batch.rewards_B = torch.tensor(rewards, dtype=torch.float32)
    logp = naive_logprobs(load_model(policy_dir, dtype=torch.float32, device="cpu")[0], batch)
    return with_behaviour_logprobs(batch, logp, scale=0.3)


def runner_for(policy_dir, recipe, trained: list, **policy_kwargs) -> RecipeRunner:
    backend = train.LocalTrainBackend(
        train.TrainBackendConfig(lr=1e-2, device="cpu", max_tokens_per_mb=16, seed=0, grad_clip=1.0)
    )
    backend.initialize(policy_dir)
    real = backend.train_step
    backend.train_step = lambda b, **kw: trained.append(b.input_ids_T.tolist()) or real(b, **kw)
    return RecipeRunner(get_recipe(recipe), {"policy": backend}, policy_kwargs=policy_kwargs)


def test_a_later_pass_trains_the_sequences_dynamic_sampling_kept(policy_dir):
    """dapo with train.num_train_passes=2: a step whose filter dropped a group raised "pass_order must be a
    permutation of the first pass's 4 sequences; got 6 indices" at its second pass."""
    batch = batch_for(policy_dir)
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
    batch = batch_for(policy_dir, rewards=[1.0, 1.0, 0.0, 0.0, 1.0, 1.0])
    metrics = runner_for(policy_dir, "dapo", [], **policy_kwargs).step(batch)
    assert metrics["policy/dynamic_sampling_dropped_seqs"] == 6
    assert metrics["policy/loss_denominator"] == 0.0
    assert not [k for k in metrics if "/actor/" in k]
    # a step that trains tokens keeps them
    metrics = runner_for(policy_dir, "dapo", [], **policy_kwargs).step(batch_for(policy_dir))
    assert 0.5 < metrics["policy/actor/ratio"] < 2.0
