"""A user's specialization that breaks the loss contract is one line naming its method and the rule
(walk41a findings 4, 6): a loss that is detached, constant or per-token, a metric that is not a scalar,
``compute_advantages`` / ``prepare_batch`` returning no TokenBatch, a ``compute_loss`` without the
``reducer`` argument (refused when the recipe is built), and a NaN loss that stops the run."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from areno.algo import broadcast_to_tokens_T, group_index_B, grpo_advantages_B
from areno.errors import ConfigError, UserError
from areno.recipes import ModelRole, TrainingConfig, get_recipe, recipe
from areno.recipes.runner import RecipeRunner
from areno.specializations import ActorSpecialization, ModelSpecialization, token_logprobs_T
from areno.train.optim import NonFiniteStepError
from tests.helpers.recipes import rl_batch

train = pytest.importorskip("areno.train")


class Reinforce(ModelSpecialization):
    """docs/recipes.md's example loss: group-mean baseline, token-mean policy gradient."""

    output_keys = ("logprobs_T",)

    def compute_advantages(self, batch):
        adv_B = grpo_advantages_B(batch.rewards_B, group_index_B(batch.group_ids), scale_by_std=False)
        adv_T = broadcast_to_tokens_T(adv_B, batch.cu_seqlens_B1, batch.loss_mask_T)
        return dataclasses.replace(batch, advantages_T=adv_T.float())

    def extract_model_output(self, model, batch):
        return token_logprobs_T(model, batch, mask_T=batch.loss_mask_T)

    def terms(self, model_output, batch):
        logp_T = model_output["logprobs_T"]
        return -batch.advantages_T.to(logp_T) * logp_T, batch.loss_mask_T.to(logp_T.device)

    def compute_loss(self, model_output, batch, reducer):
        loss_T, mask_T = self.terms(model_output, batch)
        return reducer(loss_T, mask_T), {"reinforce/loss": reducer(loss_T.detach(), mask_T)}


class Detached(Reinforce):
    def compute_loss(self, model_output, batch, reducer):
        return reducer(*self.terms(model_output, batch)).detach(), {}


class Constant(Reinforce):
    def compute_loss(self, model_output, batch, reducer):
        return torch.tensor(0.5), {}


class PerToken(Reinforce):
    def compute_loss(self, model_output, batch, reducer):
        loss_T, mask_T = self.terms(model_output, batch)
        return loss_T * mask_T, {}


class PerTokenMetric(Reinforce):
    def compute_loss(self, model_output, batch, reducer):
        loss_T, mask_T = self.terms(model_output, batch)
        return reducer(loss_T, mask_T), {"adv": batch.advantages_T}


class NoAdvantages(Reinforce):
    def compute_advantages(self, batch):
        dataclasses.replace(batch)  # forgot the return


class NoPreparedBatch(Reinforce):
    def prepare_batch(self, rollout_data):
        super().prepare_batch(rollout_data)  # forgot the return


class NoReducer(Reinforce):
    def compute_loss(self, model_output, batch):
        loss_T, mask_T = self.terms(model_output, batch)
        return (loss_T * mask_T).sum() / mask_T.sum(), {}


class NanLoss(Reinforce):
    def compute_loss(self, model_output, batch, reducer):
        loss, metrics = super().compute_loss(model_output, batch, reducer)
        return loss * float("nan"), metrics


class SubclassedActor(ActorSpecialization):
    """A user's subclass of a built-in that keeps its loss."""


class OverridingActor(ActorSpecialization):
    """A user's subclass of a built-in with a loss of its own."""

    def compute_loss(self, model_output, batch, reducer):
        return super().compute_loss(model_output, batch, reducer)


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    from areno.data.tokenizer import build_char_tokenizer
    from areno.models.hf_io import init_model_dir, tiny_config

    tok = build_char_tokenizer()
    cfg = tiny_config(len(tok), hidden_size=32, layers=1, heads=2, kv_heads=1)
    return str(init_model_dir(tmp_path_factory.mktemp("models") / "policy", cfg, tok, seed=0))


def runner_of(cls, policy_dir, **backend_kwargs) -> RecipeRunner:
    backend = train.LocalTrainBackend(
        train.TrainBackendConfig(lr=1e-2, device="cpu", max_tokens_per_mb=16, seed=0, **backend_kwargs)
    )
    backend.initialize(policy_dir)
    role = ModelRole(name="policy", specialization_cls=cls, sync_to_rollout=True)
    return RecipeRunner(TrainingConfig(name="mine", roles=(role,)), {"policy": backend})


def test_the_docs_loss_trains(policy_dir):
    metrics = runner_of(Reinforce, policy_dir).step(rl_batch())
    assert metrics["policy/grad_norm"] > 0 and "policy/reinforce/loss" in metrics


@pytest.mark.parametrize(
    ("cls", "message"),
    [
        (
            Detached,
            "Detached.compute_loss returned a loss that does not require grad (detached, a constant, or not "
            "computed from model_output): compute it from model_output's tensors, reduced with the reducer, "
            "without .detach(), .item() or torch.tensor(...)",
        ),
        (Constant, "Constant.compute_loss returned a loss that does not require grad"),
        (
            PerToken,
            "PerToken.compute_loss returned a loss of shape (14,), expected a 0-dim tensor: reduce the per-token "
            "losses with the reducer, e.g. `reducer(loss_T, batch.loss_mask_T)`",
        ),
        (
            PerTokenMetric,
            "PerTokenMetric.compute_loss returned metric 'adv' of shape (14,), expected a 0-dim tensor or a "
            "number: reduce it with the reducer",
        ),
        (
            NoAdvantages,
            "NoAdvantages.compute_advantages returned NoneType, expected a TokenBatch: return the batch it was "
            "given with its fields set, e.g. `return dataclasses.replace(batch, advantages_T=adv_T)`",
        ),
        (NoPreparedBatch, "NoPreparedBatch.prepare_batch returned NoneType, expected a TokenBatch"),
    ],
)
def test_a_broken_loss_contract_is_one_line_naming_the_method(policy_dir, cls, message):
    runner = runner_of(cls, policy_dir)
    with pytest.raises(UserError) as info:
        runner.step(rl_batch())
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


NO_REDUCER = (
    "NoReducer.compute_loss takes (model_output, batch) but is called with (model_output, batch, reducer): "
    "define it as `def compute_loss(self, model_output, batch, reducer)` (reduce the loss with it: "
    "`reducer(loss_T, batch.loss_mask_T)`)"
)


def test_a_loss_without_the_reducer_is_refused_when_the_recipe_is_built(registry):
    @recipe("walk41_no_reducer")
    def no_reducer() -> TrainingConfig:
        role = ModelRole(name="policy", specialization_cls=NoReducer, sync_to_rollout=True)
        return TrainingConfig(name="walk41_no_reducer", roles=(role,))

    with pytest.raises(ConfigError) as info:
        get_recipe("walk41_no_reducer")  # no model loaded yet
    assert str(info.value) == NO_REDUCER


def test_a_loss_without_the_reducer_is_refused_by_the_runner(policy_dir):
    with pytest.raises(ConfigError, match="^NoReducer.compute_loss takes"):
        runner_of(NoReducer, policy_dir)


def test_methods_taking_more_than_the_call_gives_are_refused_and_extra_defaults_are_not(policy_dir):
    class ExtraArgument(Reinforce):
        def extract_model_output(self, model, batch, temperature):
            return super().extract_model_output(model, batch)

    class Defaults(Reinforce):
        def compute_loss(self, model_output, batch, reducer, scale=1.0, **kwargs):
            return super().compute_loss(model_output, batch, reducer)

    with pytest.raises(ConfigError, match=r"^ExtraArgument.extract_model_output takes \(model, batch, temperature\)"):
        runner_of(ExtraArgument, policy_dir)
    assert runner_of(Defaults, policy_dir).step(rl_batch())["policy/grad_norm"] > 0


def test_a_nan_loss_that_stops_the_run_names_the_users_compute_loss(policy_dir):
    runner = runner_of(NanLoss, policy_dir, max_consecutive_skips=2)
    runner.step(rl_batch())
    with pytest.raises(NonFiniteStepError) as info:
        runner.step(rl_batch())
    message = str(info.value)
    assert message.startswith("the training backend skipped 2 optimizer steps in a row")
    assert message.endswith(
        "; the loss is NanLoss.compute_loss's (not one of areno's): check it and its gradient first for NaN/inf "
        "(a log or a division of 0)"
    )


def test_only_a_users_loss_is_named_as_the_suspect():
    from areno.train.backend import user_loss_name

    assert user_loss_name(ActorSpecialization().compute_loss) is None
    assert user_loss_name(SubclassedActor().compute_loss) is None  # the loss it runs is areno's
    assert user_loss_name(OverridingActor().compute_loss) == "OverridingActor.compute_loss"
    assert user_loss_name(NanLoss().compute_loss) == "NanLoss.compute_loss"
    assert user_loss_name(lambda output, batch, reducer: None) is None


def test_a_step_with_nothing_to_train_still_steps(policy_dir):
    """Every group's rewards equal: every advantage is 0 and skip_zero_advantage leaves all but one
    sequence out; the built-in loss still has a gradient (zero), so the optimizer steps as before."""
    batch = rl_batch()
    batch.rewards_B = torch.ones_like(batch.rewards_B)
    backend = train.LocalTrainBackend(train.TrainBackendConfig(lr=1e-2, device="cpu", max_tokens_per_mb=16, seed=0))
    backend.initialize(policy_dir)
    metrics = RecipeRunner(get_recipe("grpo"), {"policy": backend}).step(batch)
    assert metrics["policy/skipped_zero_grad_seqs"] == 5 and metrics["policy/grad_norm"] == 0.0
    assert metrics["policy/skipped_steps"] == 0.0
