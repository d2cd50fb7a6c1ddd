"""walk6: what a recipe does with the rollout it is given is said once at start, and the advice works: an
``*_async`` recipe run synchronously, stale rollouts for a loss that does not correct for them (with a fix
the recipe accepts), and a mixed DAgger/OPD loss whose workflow executes no teacher token."""

from __future__ import annotations

import logging
import re

import pytest

from areno.api.config import load_config
from areno.api.preflight import (
    check_recipe_rollout,
    check_run,
    mixed_loss_warning,
    stale_rollout_warning,
    synchronous_decoupled_warning,
)
from areno.engine.api import resolve_recipe
from areno.recipes import TRAINING_CONFIGS, get_recipe
from areno.recipes.registry import _example
from areno.specializations import ActorSpecialization
from tests.helpers.configs import tiny_run_overrides


def _config(tmp_path, *extra):
    return load_config(None, [*tiny_run_overrides(tmp_path), *extra])


def _messages(caplog, fragment: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if fragment in r.getMessage()]


@pytest.mark.parametrize(
    ("algorithm", "extra_cost", "base"),
    [("grpo_async", True, "grpo"), ("ppo_async", True, "ppo"), ("grpo_async_loglinear", False, "grpo")],
)
def test_an_async_recipe_run_synchronously_is_warned_once(tmp_path, caplog, algorithm, extra_cost, base):
    cfg = _config(tmp_path, f"train.algorithm={algorithm}")
    with caplog.at_level(logging.WARNING):
        check_run(cfg)
        check_run(cfg)  # the pipeline's check, then Trainer.init's
    (line,) = _messages(caplog, "runs synchronously")
    assert line.startswith(f"train.algorithm={algorithm} with rollout.max_head_offpolicyness=0 runs synchronously")
    assert "set rollout.max_head_offpolicyness=N (N >= 1, e.g. 2)" in line
    assert f"or train.algorithm={base} for synchronous training" in line
    assert ("a no-grad forward of the policy every step" in line) is extra_cost


def test_an_async_recipe_with_stale_rollouts_is_not_warned(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        check_run(_config(tmp_path, "train.algorithm=grpo_async", "rollout.max_head_offpolicyness=2"))
    assert _messages(caplog, "max_head_offpolicyness") == []


def test_use_decoupled_loss_given_on_a_synchronous_run_names_the_key_to_drop(tmp_path):
    cfg = _config(tmp_path, "train.algorithm=rloo", "train.algorithm_kwargs={use_decoupled_loss: true}")
    line = synchronous_decoupled_warning(cfg, resolve_recipe(cfg))
    assert line and line.endswith("or drop train.algorithm_kwargs.use_decoupled_loss for synchronous training")


def _online_actor_recipes() -> list[str]:
    return sorted(
        n
        for n, f in TRAINING_CONFIGS.items()
        if f.__module__.startswith("areno.")
        and _example(n).online
        and _example(n).policy_role.specialization_cls is ActorSpecialization
    )


@pytest.mark.parametrize("algorithm", _online_actor_recipes())
def test_the_staleness_advice_is_a_recipe_or_option_that_is_accepted(tmp_path, algorithm):
    """gspo and cispo once got ``use_decoupled_loss=true``, which they refuse (walk6 C1): every fix named is
    one that builds, and corrects (uses the decoupled loss)."""
    cfg = _config(tmp_path, f"train.algorithm={algorithm}", "rollout.max_head_offpolicyness=1")
    line = stale_rollout_warning(cfg, resolve_recipe(cfg))
    decoupled = _example(algorithm).policy_role.build().config.use_decoupled_loss
    if decoupled or algorithm == "cispo":  # corrected: the decoupled loss, cispo's truncated IS weight
        assert line is None
        return
    assert line is not None
    (fix,) = re.findall(r": use (\S+)", line)
    key, _, value = fix.partition("=")
    if key == "train.algorithm":
        fixed = get_recipe(value)
    else:
        assert key == "train.algorithm_kwargs.use_decoupled_loss" and value == "true"
        fixed = get_recipe(algorithm, policy_kwargs={"use_decoupled_loss": True})
    assert fixed.policy_role.build().config.use_decoupled_loss


def test_grpo_recompute_on_stale_rollouts_says_their_staleness_is_ignored(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        check_run(_config(tmp_path, "train.algorithm=grpo_recompute", "rollout.max_head_offpolicyness=2"))
    (line,) = _messages(caplog, "max_head_offpolicyness")
    assert "its ratio taken against log-probs the current weights recompute" in line
    assert "staleness is ignored, not corrected" in line


def test_gspo_on_stale_rollouts_is_pointed_at_grpo_async(tmp_path):
    cfg = _config(tmp_path, "train.algorithm=gspo", "rollout.max_head_offpolicyness=1")
    line = stale_rollout_warning(cfg, resolve_recipe(cfg))
    assert "use train.algorithm=grpo_async (decoupled PPO; the gspo loss has no decoupled form)" in line
    assert "use_decoupled_loss" not in line


MIXED = ["train.algorithm=mixed_loss_dagger_opd", "train.algorithm_kwargs.teacher_path=/t"]
MIXTURE = "rollout.workflow=areno.workflows.teacher:TeacherMixtureWorkflow"


def test_mixed_loss_with_the_default_workflow_says_when_it_starts_to_train(tmp_path, caplog):
    cfg = _config(tmp_path, *MIXED)
    recipe = resolve_recipe(cfg)
    with caplog.at_level(logging.WARNING):
        check_recipe_rollout(cfg, recipe)
        check_recipe_rollout(cfg, recipe)
    (line,) = _messages(caplog, "mixed_loss_dagger_opd")
    assert "rollout.workflow=areno.workflows.rlvr:RLVRWorkflow marks no token teacher-executed" in line
    assert "the cross-entropy term (weight beta) is 0" in line
    assert "1 - beta = 0 at step 1, 0.01 at step 2 and 1 from step 101 on" in line  # walk6: loss 0 at step 1
    assert f"set {MIXTURE} (rollout.workflow_kwargs.beta > 0)" in line
    assert "train.algorithm_kwargs.beta_start=0 (or use train.algorithm=opd)" in line


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        ([MIXTURE], False),  # the teacher executes half the completions: the CE term trains
        ([MIXTURE, "rollout.workflow_kwargs={beta: 0.0}"], True),  # ... none of them
        (["train.algorithm_kwargs.beta_start=0.0"], False),  # pure k3 from the start: opd's loss
        (["train.algorithm_kwargs.beta_decay_steps=5"], True),
    ],
)
def test_mixed_loss_warns_only_where_the_ce_term_has_weight_and_nothing_to_train_on(tmp_path, extra, said):
    cfg = _config(tmp_path, *MIXED, *extra)
    line = mixed_loss_warning(cfg, resolve_recipe(cfg))
    assert (line is not None) is said, line
    if line and "beta_decay_steps=5" in extra[0]:
        assert "1 - beta = 0 at step 1, 0.2 at step 2 and 1 from step 6 on" in line


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_a_synchronous_decoupled_loss_over_an_inference_server_is_not_warned(tmp_path, backend):
    """With vLLM or SGLang generating, the decoupled loss's behaviour weight corrects the mismatch between the
    server's log-probs and the trainer's even at eta 0 (as TRL's vllm_importance_sampling_correction): the
    warning that it has nothing to correct was wrong there (walk49)."""
    cfg = _config(tmp_path, "train.algorithm=grpo_async", f"rollout.backend={backend}")
    assert synchronous_decoupled_warning(cfg, resolve_recipe(cfg)) is None
    cfg = _config(tmp_path, "train.algorithm=grpo_async")
    assert "has no staleness to correct" in synchronous_decoupled_warning(cfg, resolve_recipe(cfg))
