"""Recipe registry and validation: built-ins, closest-name suggestions, bad DataSyncs, duplicate
roles, missing teacher checkpoints, bad specialization arguments — all before any model loads; and
which runs of an offline recipe build a rollout side (only those whose evaluation generates)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from areno.api.config import load_config
from areno.cli import main as areno_main
from areno.engine.local import LocalRolloutSide
from areno.engine.placement import build_engine
from areno.errors import ConfigError
from areno.recipes import TRAINING_CONFIGS, DataSync, ModelRole, TrainingConfig, get_recipe, list_recipes, main, recipe
from areno.recipes.registry import check_critic_agrees
from areno.recipes.runner import RecipeRunner
from areno.specializations import (
    ActorConfig,
    ActorSpecialization,
    DistillSpecialization,
    DPOSpecialization,
    LogProbSpecialization,
)
from tests.helpers.configs import tiny_run_overrides, train_args

REQUIRED = [
    "grpo",
    "dr_grpo",
    "dapo",
    "gspo",
    "rloo",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "cispo",
    "ppo",
    "sft",
    "dpo",
    "dpo_distributed",
    "opd",
    "dagger",
    "aggrevate",
    "mixed_loss_dagger_opd",
    "reward_model",
    "ppo_kl",
    "ppo_async",
    "grpo_recompute",
]
TEACHER = {"opd", "dagger", "aggrevate", "mixed_loss_dagger_opd"}


def test_builtins_registered_with_descriptions_and_formulas():
    listed = dict(list_recipes())
    assert set(REQUIRED) <= set(listed) and len(listed) >= 22  # seed 004 counts 22 built-in recipes
    for name in REQUIRED:
        assert listed[name], name
        doc = TRAINING_CONFIGS[name].__doc__
        assert "loss" in doc or "A_i" in doc, f"{name} docstring states no formula"
        cfg = get_recipe(name, teacher_path="/ckpt/teacher") if name in TEACHER else get_recipe(name)
        assert cfg.name == name and cfg.description == listed[name]
        assert any(r.trainable for r in cfg.roles)


def test_recipe_shapes():
    ppo = get_recipe("ppo")
    assert [r.name for r in ppo.roles] == ["policy", "value"]
    assert ppo.syncs[0].source == "value" and ppo.syncs[0].target_keys == ("values_T",)
    dd = get_recipe("dpo_distributed")
    assert dd.role("reference").trainable is False
    assert dd.syncs == (
        DataSync(source="reference", target="policy", keys=("logprobs_T",), target_keys=("ref_logprobs_T",)),
    )
    assert get_recipe("sft").online is False and get_recipe("grpo").online is True
    assert [r.name for r in get_recipe("grpo").roles] == ["policy"]  # kl_coef 0: no reference
    assert [r.name for r in get_recipe("grpo", policy_kwargs={"kl_coef": 0.04}).roles] == ["policy", "reference"]
    assert get_recipe("opd", teacher_path="/t").role("teacher").model_path == "/t"
    ppo_kl = get_recipe("ppo_kl")
    assert [r.name for r in ppo_kl.roles] == ["policy", "value", "reference"]
    assert {(s.source, s.target, s.target_keys) for s in ppo_kl.syncs} == {
        ("value", "policy", ("values_T",)),
        ("reference", "policy", ("ref_logprobs_T",)),
        ("reference", "value", ("ref_logprobs_T",)),
    }
    assert [r.name for r in get_recipe("ppo_async").roles] == ["policy", "value"]


@pytest.mark.parametrize("name", ["ppo", "ppo_kl", "ppo_async"])
def test_the_value_clip_is_a_recipe_option_train_algorithm_kwargs_reaches(name):
    """``train.algorithm_kwargs.value_clip_eps`` (a factory option, so it goes to the value role)."""
    from areno.specializations.critic import CriticSpecialization

    assert get_recipe(name).role("value").init_kwargs["value_clip_eps"] == 0.2
    for eps in (0.5, None):
        value = get_recipe(name, policy_kwargs={"value_clip_eps": eps, "clip_eps": 0.1}).role("value")
        assert value.init_kwargs["value_clip_eps"] == eps
        assert CriticSpecialization(**value.init_kwargs).value_clip_eps == eps
    assert "value_clip_eps" not in get_recipe(name, policy_kwargs={"value_clip_eps": 0.5}).policy_role.init_kwargs


def test_unknown_name_suggests_closest():
    with pytest.raises(ValueError, match="did you mean grpo"):
        get_recipe("grop")
    with pytest.raises(ValueError, match="dapo"):
        get_recipe("dappo")
    with pytest.raises(ValueError, match="unknown recipe 'zzzz'"):
        get_recipe("zzzz")


def test_options_and_policy_kwargs():
    cfg = get_recipe("grpo", policy_kwargs={"clip_eps": 0.1, "kl_coef": 0.0})
    assert cfg.policy_role.init_kwargs["clip_eps"] == 0.1
    # a factory option inside policy_kwargs goes to the factory (train.algorithm_kwargs carries both)
    cfg = get_recipe("opd", policy_kwargs={"teacher_path": "/t", "kl_estimator": "k2"})
    assert cfg.role("teacher").model_path == "/t" and cfg.policy_role.init_kwargs == {"kl_estimator": "k2"}
    with pytest.raises(ValueError, match="has no option"):
        get_recipe("grpo", temperature_of_moon=1)
    with pytest.raises(ValueError, match="clip_eps"):
        get_recipe("grpo", policy_kwargs={"clip_eps": -1})
    with pytest.raises(ValueError, match="bad arguments for ActorSpecialization"):
        get_recipe("grpo", policy_kwargs={"clip_epsilon": 0.2})


def test_policy_kwargs_become_the_actor_config():
    """The policy role's ``init_kwargs`` are the fields of its ``ActorConfig``: an unknown key is one
    ConfigError line naming it and listing the valid ones; a bad value names the option."""
    spec = get_recipe("grpo", policy_kwargs={"clip_eps": 0.1}).policy_role.build()
    assert spec.config == ActorConfig(clip_eps=0.1, kl_coef=0.0, loss_aggregation="seq_mean_token_mean")
    with pytest.raises(ConfigError) as info:
        get_recipe("grpo", policy_kwargs={"clip_epsilon": 0.2})
    message = str(info.value)
    assert "\n" not in message and "unknown option 'clip_epsilon'" in message
    assert "valid options: advantage_estimator, adv_eps," in message and "logprob_chunk_size" in message
    with pytest.raises(
        ConfigError, match=r"bad arguments for ActorSpecialization: ActorConfig.temperature must be > 0, got 0"
    ):
        get_recipe("grpo", policy_kwargs={"temperature": 0})
    with pytest.raises(ConfigError, match=r"ActorConfig.logprob_chunk_size must be > 0 or None \(automatic\), got 0"):
        get_recipe("grpo", policy_kwargs={"logprob_chunk_size": 0})


def test_k1_is_refused_where_the_kl_is_a_loss_term_only():
    """k1's expected gradient as a loss is 0 (tests/algo/test_losses.py): a KL loss term of k1 would add noise
    and no KL; as a reward penalty (reinforce_pp, ppo_kl) or at kl_coef 0 it is accepted."""
    with pytest.raises(
        ConfigError, match=r"ActorConfig.kl_estimator must be k3 or k2 while the KL is a loss term .*got 'k1'"
    ):
        get_recipe("grpo", kl_coef=0.1, policy_kwargs={"kl_estimator": "k1"})
    ActorConfig(kl_coef=0.1, kl_estimator="k1", kl_in_reward=True, advantage_estimator="reinforce_pp")
    ActorConfig(kl_coef=0.0, kl_estimator="k1")
    get_recipe("reinforce_pp").policy_role.build()


def test_teacher_without_checkpoint():
    with pytest.raises(ConfigError, match="role 'teacher' needs a checkpoint"):
        get_recipe("opd")


def _policy(**kw):
    return ModelRole(name="policy", specialization_cls=ActorSpecialization, sync_to_rollout=True, init_kwargs=kw)


def _ref(name="reference"):
    return ModelRole(name=name, specialization_cls=LogProbSpecialization, trainable=False)


def test_validation_errors():
    with pytest.raises(ConfigError, match="duplicate role names"):
        TrainingConfig(name="x", roles=(_policy(), _policy()))
    with pytest.raises(ConfigError, match="missing role 'reference'"):
        TrainingConfig(
            name="x", roles=(_policy(),), syncs=(DataSync(source="reference", target="policy", keys=("logprobs_T",)),)
        )
    with pytest.raises(ConfigError, match="does not output"):
        TrainingConfig(
            name="x",
            roles=(_policy(), _ref()),
            syncs=(DataSync(source="reference", target="policy", keys=("values_T",)),),
        )
    with pytest.raises(ConfigError, match=r"needs batch keys \['ref_logprobs_T'\]"):
        TrainingConfig(name="x", roles=(_policy(kl_coef=0.1), _ref()))
    with pytest.raises(ConfigError, match="no trainable role"):
        TrainingConfig(name="x", roles=(_ref(),))
    with pytest.raises(ConfigError, match="target_keys"):
        DataSync(source="a", target="b", keys=("logprobs_T",), target_keys=("x_T", "y_T"))
    with pytest.raises(ConfigError, match="stage"):
        DataSync(source="a", target="b", keys=("logprobs_T",), stage="after")
    with pytest.raises(ConfigError, match="sync_to_rollout=True needs trainable"):
        ModelRole(name="p", specialization_cls=ActorSpecialization, trainable=False, sync_to_rollout=True)
    with pytest.raises(ConfigError, match="ModelSpecialization subclass"):
        ModelRole(name="p", specialization_cls=dict)
    # a valid custom recipe: KL to a frozen reference through an inject sync
    cfg = TrainingConfig(
        name="x",
        roles=(_policy(kl_coef=0.1), _ref()),
        syncs=(DataSync(source="reference", target="policy", keys=("logprobs_T",), target_keys=("ref_logprobs_T",)),),
    )
    assert cfg.policy_role.name == "policy"


def test_register_custom_recipe_and_duplicate():
    @recipe("test_only_distill")
    def _custom(teacher_path: str | None = "/t"):
        """Custom distillation for the test."""
        return TrainingConfig(
            name="test_only_distill",
            roles=(
                ModelRole(name="student", specialization_cls=DistillSpecialization, sync_to_rollout=True),
                ModelRole(
                    name="teacher", specialization_cls=LogProbSpecialization, trainable=False, model_path=teacher_path
                ),
            ),
            syncs=(
                DataSync(source="teacher", target="student", keys=("logprobs_T",), target_keys=("teacher_logprobs_T",)),
            ),
        )

    try:
        assert get_recipe("test_only_distill").policy_role.name == "student"
        with pytest.raises(ConfigError, match="already registered"):
            recipe("test_only_distill")(get_recipe)  # another factory under the same name
        assert recipe("test_only_distill")(_custom) is _custom  # the same one again (a module imported twice)
    finally:
        del TRAINING_CONFIGS["test_only_distill"]


def test_runner_needs_a_backend_per_role():
    with pytest.raises(ValueError, match=r"no training backend for role\(s\) \['reference'\]"):
        RecipeRunner(get_recipe("dpo_distributed"), {"policy": object()})
    assert DPOSpecialization  # imported for the registry


def test_cli_main(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "grpo" in out and "Bradley" in out
    assert main(["ppo"]) == 0
    assert "role value: CriticSpecialization" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="did you mean grpo"):  # printed by the CLI as one line, exit 2
        main(["grop"])
    assert areno_main(["recipes", "grop"]) == 2
    assert capsys.readouterr().err.startswith("areno: error: unknown recipe 'grop': did you mean grpo")


@pytest.mark.parametrize("name", ["ppo_kl", "ppo_async", "grpo_recompute"])
def test_added_recipes_train_through_areno_train(tmp_path, name):
    """The three recipes that complete the seed's catalogue of 22 run from ``train.algorithm``."""
    assert areno_main(train_args(tmp_path, "train.steps=2", f"train.algorithm={name}")) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in rows if "train/policy/loss" in r]) == 2


def _sft_engine(tmp_path, run: str, num_eval: int):
    overrides = tiny_run_overrides(tmp_path, run, num_eval=num_eval)
    engine = build_engine(
        load_config(None, [*overrides, "reward.sandbox=false", "train.algorithm=sft"]), tmp_path / run
    )
    engine.initialize()
    return engine


def test_sft_builds_a_rollout_side_only_when_its_held_out_evaluation_generates(tmp_path):
    engine = _sft_engine(tmp_path, "plain", num_eval=0)  # no held-out rows: it never generates
    try:
        assert engine.rollout is None
        assert engine.step(engine.generate_rollout(0))["train/policy/loss"] > 0
        assert engine.update_weights() == {} and engine.evaluate() == {}
        assert "rollout_rng" not in engine.resume_state()
        # what would generate is refused in one line, never skipped
        engine.eval_rows = engine.train_stream.take(1)
        with pytest.raises(RuntimeError, match="^a held-out evaluation that generates needs the rollout side, but "):
            engine.evaluate()
    finally:
        engine.shutdown()
    engine = _sft_engine(tmp_path, "evaluated", num_eval=2)  # its evaluation samples completions
    try:
        assert isinstance(engine.rollout, LocalRolloutSide)
        assert "eval/accuracy" in engine.evaluate() and "rollout_rng" in engine.resume_state()
    finally:
        engine.shutdown()


def test_a_critic_learns_from_the_rewards_the_policy_does():
    """walk19: ppo with overlong_max_length added the penalty to the policy's rewards only (the critic's
    returns were the raw ones), and ppo_kl's kl_estimator reached the policy alone (the critic's was k1):
    both refused now, and ppo_kl takes kl_estimator as its own option, which sets both."""
    with pytest.raises(ConfigError, match=r"overlong_max_length=8: recipe 'ppo''s critic \(role 'value'\)"):
        get_recipe("ppo", policy_kwargs={"overlong_max_length": 8, "overlong_buffer_length": 2})
    cfg = get_recipe("ppo_kl", policy_kwargs={"kl_estimator": "k3"})
    assert cfg.policy_role.build().config.kl_estimator == "k3" and cfg.role("value").build().kl_estimator == "k3"
    policy_only = dataclasses.replace(
        cfg,
        roles=tuple(
            dataclasses.replace(r, init_kwargs={**r.init_kwargs, "kl_estimator": "k2"}) if r.name == "policy" else r
            for r in cfg.roles
        ),
    )
    with pytest.raises(ConfigError, match=r"kl_estimator='k2' reaches the policy alone.*kl_estimator='k3'"):
        check_critic_agrees("ppo_kl", policy_only)
