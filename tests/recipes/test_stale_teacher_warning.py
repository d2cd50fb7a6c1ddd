"""A recipe whose frozen role scores the student's own samples (opd, dagger, aggrevate,
mixed_loss_dagger_opd) on stale rollouts (``rollout.max_head_offpolicyness > 0``) trains off-policy with
no importance correction: ``stale_teacher_warning`` says so in one line with the fix, and nothing at
staleness 0 or for the recipes whose warnings live elsewhere (PPO-family) or that have no rollouts."""

import logging

import pytest

from areno.api.config import load_config
from areno.api.preflight import check_run
from areno.data.tokenizer import build_char_tokenizer
from areno.models.hf_io import init_model_dir, tiny_config
from areno.recipes import DataSync, ModelRole, TrainingConfig, get_recipe
from areno.recipes.traits import stale_teacher_warning
from areno.specializations import DistillSpecialization, LogProbSpecialization
from tests.helpers.configs import tiny_run_overrides

TEACHER = ["opd", "dagger", "aggrevate", "mixed_loss_dagger_opd"]


@pytest.mark.parametrize("name", TEACHER)
def test_a_teacher_recipe_on_stale_rollouts_is_warned(name):
    line = stale_teacher_warning(get_recipe(name, teacher_path="/ckpt/teacher"), 2)
    assert line is not None and "\n" not in line
    assert line.startswith(
        f"train.algorithm={name} with rollout.max_head_offpolicyness=2 trains the policy on completions sampled "
        "by a policy up to 2 versions older, scored by the frozen teacher role, and "
    )
    assert "loss has no importance correction for that, so the update is off-policy" in line
    assert line.endswith("set rollout.max_head_offpolicyness=0 for on-policy samples, or keep the staleness knowingly")


@pytest.mark.parametrize("name", TEACHER)
def test_a_teacher_recipe_on_fresh_rollouts_is_not_warned(name):
    assert stale_teacher_warning(get_recipe(name, teacher_path="/ckpt/teacher"), 0) is None


def test_aggrevate_with_a_scorer_names_the_scorer_role():
    cfg = get_recipe("aggrevate", q_source="value_head", value_head_path="/ckpt/value")
    line = stale_teacher_warning(cfg, 1)
    assert "up to 1 version older, scored by the frozen value role, and AggrevateSpecialization's loss" in line


@pytest.mark.parametrize("name", ["grpo", "ppo", "grpo_async", "grpo_recompute", "cispo", "ppo_kl", "sft", "dpo"])
def test_other_recipes_are_not_warned_here(name):
    assert stale_teacher_warning(get_recipe(name), 4) is None


def test_a_users_distillation_recipe_is_warned_by_its_roles():
    """Read off the roles, not the name: a frozen role injecting into a policy whose loss has no correction."""
    cfg = TrainingConfig(
        name="my_distill",
        roles=(
            ModelRole(name="student", specialization_cls=DistillSpecialization, sync_to_rollout=True),
            ModelRole(name="expert", specialization_cls=LogProbSpecialization, trainable=False, model_path="/t"),
        ),
        syncs=(DataSync(source="expert", target="student", keys=("logprobs_T",), target_keys=("teacher_logprobs_T",)),),
    )
    line = stale_teacher_warning(cfg, 3)
    assert "trains the student on completions" in line and "scored by the frozen expert role" in line
    assert stale_teacher_warning(cfg, 0) is None


def test_the_preflight_check_says_it_once_at_start(tmp_path, caplog):
    tok = build_char_tokenizer()
    shape = {"hidden_size": 32, "layers": 1, "heads": 2, "kv_heads": 1, "intermediate_size": 64}
    teacher = init_model_dir(tmp_path / "teacher", tiny_config(len(tok), **shape), tok, seed=7)
    overrides = [*tiny_run_overrides(tmp_path), "train.algorithm=opd", f"train.algorithm_kwargs.teacher_path={teacher}"]
    for staleness, said in ((2, 1), (0, 0)):
        cfg = load_config(
            None, [*overrides, f"rollout.max_head_offpolicyness={staleness}", f"run_dir={tmp_path / str(staleness)}"]
        )
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            check_run(cfg)
            check_run(cfg)  # the pipeline's check, then Trainer.init's
        lines = [r.getMessage() for r in caplog.records if "importance correction" in r.getMessage()]
        assert len(lines) == said, lines
