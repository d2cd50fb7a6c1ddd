"""A recipe that cannot train as written, or a rollout that cannot feed it, is refused in one line before any
model loads: an online recipe that never updates the rollout policy, a factory that returns something else,
``train.algorithm_kwargs`` that need a role the recipe lacks, one sample per prompt for a group estimator.
A legitimate but easily mistaken choice (stale rollouts without correction) is warned about once."""

from __future__ import annotations

import logging
import textwrap

import pytest

from areno.api.config import load_config
from areno.api.preflight import check_run
from areno.cli import main as areno_main
from areno.errors import ConfigError
from areno.recipes import ModelRole, TrainingConfig, get_recipe, main, recipe
from areno.specializations import ActorSpecialization
from tests.helpers.configs import tiny_run_overrides, train_args
from tests.helpers.recipes import user_code_dir


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    with user_code_dir(tmp_path, monkeypatch) as path:
        yield path


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_an_online_recipe_must_sync_a_role_to_the_rollout():
    policy = ModelRole(name="policy", specialization_cls=ActorSpecialization)  # sync_to_rollout left False
    with pytest.raises(ConfigError) as err:
        TrainingConfig(name="no_sync", roles=(policy,))
    message = str(err.value)
    assert message.startswith("recipe 'no_sync': online=True but no role publishes its weights")
    assert "ModelRole(sync_to_rollout=True)" in message and "\n" not in message
    # an offline recipe trains on a dataset: nothing to sync (the built-in reward_model is one)
    assert TrainingConfig(name="offline", roles=(policy,), online=False).online is False
    assert not any(r.sync_to_rollout for r in get_recipe("reward_model").roles)


def test_a_factory_that_returns_another_type_is_named(user_dir, capsys):
    @recipe("returns_a_dict")
    def _bad():
        """Returns a dict."""
        return {"roles": []}

    with pytest.raises(ConfigError, match=r"^recipe 'returns_a_dict' returned dict, expected TrainingConfig"):
        get_recipe("returns_a_dict")
    assert areno_main(["recipes", "returns_a_dict"]) == 2
    assert "recipe 'returns_a_dict' returned dict, expected TrainingConfig" in _one_line(capsys)


def test_algorithm_kwargs_that_need_a_missing_role_name_the_key():
    """``kl_coef`` on a recipe with no reference: the key and the recipes whose kl_coef option adds one."""
    for kwargs in ({"kl_coef": 0.2}, {"clip_eps": 0.1, "kl_coef": 0.2}):
        with pytest.raises(ConfigError) as err:
            get_recipe("rloo", policy_kwargs=kwargs)
        assert str(err.value) == (
            "train.algorithm_kwargs.kl_coef=0.2 needs batch keys ['ref_logprobs_T'], which no role of recipe "
            "'rloo' provides: drop the key, or use a recipe whose kl_coef option adds a role for them "
            "(grpo, ppo_kl, reinforce_pp, reinforce_pp_baseline)"
        )
    with pytest.raises(ConfigError, match=r"^train.algorithm_kwargs.advantage_estimator='gae' needs batch keys"):
        get_recipe("dapo", policy_kwargs={"advantage_estimator": "gae"})
    # where kl_coef is the factory's option, the factory adds the reference
    assert [r.name for r in get_recipe("grpo", policy_kwargs={"kl_coef": 0.2}).roles] == ["policy", "reference"]


BAD_RECIPES = '''
from areno.recipes import DataSync, ModelRole, TrainingConfig, recipe
from areno.specializations import ActorSpecialization, LogProbSpecialization

POLICY = ModelRole(name="policy", specialization_cls=ActorSpecialization, sync_to_rollout=True)
REFERENCE = ModelRole(name="reference", specialization_cls=LogProbSpecialization, trainable=False)


@recipe("typo_role")
def typo_role():
    """A DataSync from a role that does not exist."""
    sync = DataSync(source="ref", target="policy", keys=("logprobs_T",), target_keys=("ref_logprobs_T",))
    return TrainingConfig(name="typo_role", roles=(POLICY, REFERENCE), syncs=(sync,))


@recipe("kl_no_ref")
def kl_no_ref():
    """A KL term with no reference to compare with."""
    policy = ModelRole(
        name="policy", specialization_cls=ActorSpecialization, sync_to_rollout=True, init_kwargs={"kl_coef": 0.1}
    )
    return TrainingConfig(name="kl_no_ref", roles=(policy,))
'''


def test_recipe_mistakes_are_one_line_before_the_model(user_dir, capsys):
    (user_dir / "bad_recipes.py").write_text(BAD_RECIPES)
    assert areno_main(["recipes", "--modules", "bad_recipes", "typo_role"]) == 2
    assert "DataSync ref->policy names a missing role 'ref'; roles are ['policy', 'reference']" in _one_line(capsys)
    assert areno_main(train_args(user_dir, "train.algorithm=bad_recipes:kl_no_ref")) == 2
    assert "role 'policy' (ActorSpecialization) needs batch keys ['ref_logprobs_T']" in _one_line(capsys)
    assert areno_main(train_args(user_dir, "train.algorithm=rloo", "train.algorithm_kwargs={kl_coef: 0.2}")) == 2
    assert _one_line(capsys).startswith("areno: error: train.algorithm_kwargs.kl_coef=0.2 needs batch keys")
    assert areno_main(train_args(user_dir, "rollout.n_samples=1")) == 2
    assert _one_line(capsys).startswith("areno: error: rollout.n_samples=1: recipe 'grpo'")
    assert not (user_dir / "model").exists()  # refused before the tiny model is made


MODULE = '''
from areno.recipes import ModelRole, TrainingConfig, recipe
from areno.specializations import ActorSpecialization


@recipe("{name}")
def factory():
    """Recipe {name} of module {module}."""
    policy = ModelRole(name="policy", specialization_cls=ActorSpecialization, sync_to_rollout=True)
    return TrainingConfig(name="{name}", roles=(policy,))
'''


def test_recipes_modules_then_name(user_dir, capsys):
    """``areno recipes [--modules M[,M...]] [NAME]`` as documented: NAME after the flag is not a module."""
    for module, name in (("mod_a", "recipe_a"), ("mod_b", "recipe_b")):
        (user_dir / f"{module}.py").write_text(textwrap.dedent(MODULE.format(module=module, name=name)))
    assert main(["--modules", "mod_a", "recipe_a"]) == 0
    assert "Recipe recipe_a of module mod_a." in capsys.readouterr().out
    assert main(["recipe_b", "--modules", "mod_b"]) == 0
    assert "role policy: ActorSpecialization" in capsys.readouterr().out
    for argv in (["--modules", "mod_a,mod_b"], ["--modules", "mod_a", "--modules", "mod_b"]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert "Recipe recipe_a of module mod_a." in out and "Recipe recipe_b of module mod_b." in out


@pytest.mark.parametrize(
    "algorithm, estimator",
    [
        ("grpo", "advantage_estimator=grpo"),
        ("dr_grpo", "advantage_estimator=dr_grpo"),
        ("rloo", "advantage_estimator=rloo"),
        ("dapo", "advantage_estimator=grpo"),
        ("reinforce_pp_baseline", "advantage_estimator=reinforce_pp_baseline"),
        ("grpo_async", "advantage_estimator=grpo"),
    ],
)
def test_group_estimators_refuse_one_sample_per_prompt(tmp_path, algorithm, estimator):
    cfg = load_config(None, [*tiny_run_overrides(tmp_path), f"train.algorithm={algorithm}", "rollout.n_samples=1"])
    with pytest.raises(ConfigError) as err:
        check_run(cfg)
    assert str(err.value).startswith(
        f"rollout.n_samples=1: recipe '{algorithm}' ({estimator}) compares the completions"
    )
    assert "set rollout.n_samples >= 2" in str(err.value)


@pytest.mark.parametrize("algorithm", ["reinforce_pp", "ppo"])  # sft has no samples: it refuses the key
def test_recipes_without_groups_take_one_sample_per_prompt(tmp_path, algorithm):
    check_run(load_config(None, [*tiny_run_overrides(tmp_path), f"train.algorithm={algorithm}", "rollout.n_samples=1"]))


def _staleness_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "max_head_offpolicyness" in r.getMessage()]


def test_stale_rollouts_without_correction_are_warned_once(tmp_path, caplog):
    """Not refused (a legitimate choice), but said once at start, naming the recipe that corrects it; the
    pipeline and ``Trainer.init`` both run the checks."""
    cfg = load_config(None, [*tiny_run_overrides(tmp_path), "rollout.max_head_offpolicyness=2"])
    with caplog.at_level(logging.WARNING):
        check_run(cfg)
        check_run(cfg)
    warnings = _staleness_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("train.algorithm=grpo with rollout.max_head_offpolicyness=2 trains on rollouts")
    assert "use train.algorithm=grpo_async (decoupled PPO)" in warnings[0]


@pytest.mark.parametrize(
    ("algorithm", "advice"),
    [("ppo", "train.algorithm=ppo_async"), ("rloo", "train.algorithm_kwargs.use_decoupled_loss=true")],
)
def test_the_staleness_warning_names_the_recipe_s_own_correction(tmp_path, caplog, algorithm, advice):
    overrides = [*tiny_run_overrides(tmp_path), f"train.algorithm={algorithm}", "rollout.max_head_offpolicyness=1"]
    with caplog.at_level(logging.WARNING):
        check_run(load_config(None, overrides))
    (warning,) = _staleness_warnings(caplog)
    assert f"use {advice} (decoupled PPO)" in warning


def test_a_user_workflow_with_one_sample_per_prompt_is_warned_not_refused(tmp_path, caplog):
    """A user's workflow may build its groups otherwise (branches of a search): the check is a warning."""
    (tmp_path / "branching.py").write_text(
        "from areno.workflows.rlvr import RLVRWorkflow\n\n\nclass Branching(RLVRWorkflow):\n    pass\n"
    )
    overrides = [
        *tiny_run_overrides(tmp_path),
        "rollout.n_samples=1",
        f"rollout.workflow={tmp_path}/branching.py:Branching",
    ]
    with caplog.at_level(logging.WARNING):
        check_run(load_config(None, overrides))
    assert any(
        "rollout.n_samples=1: recipe 'grpo'" in r.getMessage() and "returns larger groups itself" in r.getMessage()
        for r in caplog.records
    )


@pytest.mark.parametrize(
    "extra",
    [
        ["train.algorithm=grpo_async", "rollout.max_head_offpolicyness=2"],  # decoupled PPO corrects it
        ["train.algorithm=cispo", "rollout.max_head_offpolicyness=2"],  # its weight is truncated IS (walk6)
        ["rollout.max_head_offpolicyness=0"],  # fresh rollouts
    ],
)
def test_no_staleness_warning_where_it_is_corrected_or_fresh(tmp_path, caplog, extra):
    with caplog.at_level(logging.WARNING):
        check_run(load_config(None, [*tiny_run_overrides(tmp_path), *extra]))
    assert _staleness_warnings(caplog) == []
