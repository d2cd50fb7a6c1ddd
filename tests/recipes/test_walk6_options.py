"""walk6 (choosing a recipe): a ``train.algorithm_kwargs`` option the configured loss never reads is refused
in one line naming the option, why it does nothing there and which recipes read it; an unknown option is
the same did-you-mean line for every specialization; ``areno recipes NAME`` lists every option it takes."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest

from areno.cli import main as areno_main
from areno.errors import ConfigError
from areno.recipes import TRAINING_CONFIGS, ModelRole, get_recipe
from areno.recipes.config import specialization_options
from areno.recipes.registry import INERT_OPTIONS, _example, _recipes_reading, role_settings
from areno.specializations import ActorConfig, DPOSpecialization
from areno.specializations.base import RUN_SET_OPTIONS
from tests.helpers.configs import train_args


def _refusal(name: str, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        get_recipe(name, policy_kwargs=kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    ("name", "kwargs", "why", "readers"),
    [
        ("cispo", {"clip_eps": 0.01}, "the cispo loss has no lower clip", "set train.algorithm_kwargs.clip_eps_high"),
        ("gspo", {"dual_clip_c": 1.01}, "only policy_loss=ppo has a dual clip", "recipes that read it: dapo,"),
        ("cispo", {"dual_clip_c": 3.0}, "this recipe's policy_loss is cispo", "recipes that read it: dapo,"),
        ("grpo", {"gae_lambda": 0.5}, "only GAE advantages read it", "recipes that read it: ppo, ppo_async, ppo_kl"),
        (
            "grpo",
            {"behav_imp_weight_cap": 2.0},
            "only the decoupled loss reads it (use_decoupled_loss=true)",
            "recipes that read it: grpo_async, grpo_async_loglinear, ppo_async",
        ),
        ("grpo", {"overlong_penalty": 5.0}, "overlong_max_length is null", "recipes that read it: dapo"),
        ("grpo", {"loss_agg_constant": 7}, "only loss_aggregation=constant divides by it", "read it: dr_grpo"),
        ("grpo", {"kl_estimator": "k1"}, "kl_coef is 0, so no KL is estimated", "set kl_coef > 0 too"),
        ("grpo", {"kl_coef": 0.1, "kl_in_reward": True}, "the KL would leave the loss", "reinforce_pp"),
        ("grpo_async", {"recompute_logprob": True}, "prox_logp_method (recompute)", "recipes that read it: cispo,"),
        (
            "aggrevate",
            {"q_source": "value_head", "value_head_path": "/v", "teacher_path": "/t"},
            "q_source=value_head reads Q from a scorer role's head and builds no teacher role",
            "q_source=teacher_logprob and q_source=workflow",
        ),
        (
            "aggrevate",
            {"q_source": "reward_model", "reward_model_path": "/r", "teacher_path": "/t"},
            "q_source=reward_model reads Q",
            "drop it",
        ),
        ("aggrevate", {"teacher_path": "/t", "value_head_path": "/v"}, "only q_source=value_head reads it", "drop it"),
    ],
)
def test_an_option_the_loss_never_reads_is_refused(name, kwargs, why, readers):
    message = _refusal(name, **kwargs)
    key = next(k for k in kwargs if f"train.algorithm_kwargs.{k}=" in message)
    assert message.startswith(f"train.algorithm_kwargs.{key}="), message
    assert f"does nothing in recipe {name!r}: " in message
    assert why in message and readers in message, message


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("grpo_async", {"behav_imp_weight_cap": 2.0, "behav_weight_mode": "truncate"}),
        ("grpo", {"use_decoupled_loss": True, "behav_imp_weight_cap": 2.0}),  # the setting that reads it
        ("cispo", {"clip_eps_high": None, "clip_eps": 0.3}),  # clip_eps is then cispo's upper bound
        ("grpo", {"kl_coef": 0.1, "kl_estimator": "k2"}),
        ("reinforce_pp", {"kl_in_reward": False, "kl_estimator": "k3"}),  # the KL moves into the loss
        ("ppo", {"gae_lambda": 0.5, "dual_clip_c": 3.0}),
        ("dapo", {"overlong_penalty": 2.0}),
        ("dr_grpo", {"loss_agg_constant": 7.0}),
        ("aggrevate", {"q_source": "value_head", "value_head_path": "/v"}),
        ("aggrevate", {"teacher_path": "/t", "q_source": "workflow"}),
        # the recipe's own value given again does nothing new, and is no mistake
        ("cispo", {"clip_eps": 0.2}),
        ("grpo", {"gae_lambda": 1.0, "dual_clip_c": None}),
        ("mixed_loss_dagger_opd", {"teacher_path": "/t", "beta_start": 0.0}),
    ],
)
def test_the_same_options_are_accepted_where_they_are_read(name, kwargs):
    get_recipe(name, policy_kwargs=kwargs)


ENABLED_BY = {
    **{key: {"entropy_target": 0.2} for key in ("entropy_coef_delta", "entropy_coef_min", "entropy_coef_max")},
    "kl_horizon": {"kl_coef": 0.1, "kl_target": 0.1},
}
"""Options no shipped recipe reads as shipped, and the setting of the user's that makes them read."""


def test_the_table_names_real_options_each_read_by_some_shipped_recipe():
    """Every row names an option its owner takes, and some built-in recipe reads that option as shipped
    (a row true everywhere would make the option unusable)."""
    actor_fields = {f.name for f in dataclasses.fields(ActorConfig)}
    for row in INERT_OPTIONS:
        if isinstance(row.owner, str):
            assert row.key in inspect.signature(TRAINING_CONFIGS[row.owner]).parameters, row
            continue
        assert row.key in (specialization_options(row.owner) or {}), row
        if row.owner.config_cls is ActorConfig:
            assert row.key in actor_fields
        shipped = [n for n in TRAINING_CONFIGS if _example(n).policy_role.specialization_cls is row.owner]
        values = {role_settings(_example(n).policy_role)[row.key] for n in shipped}
        if row.key in ENABLED_BY:  # read once the user sets the option no shipped recipe sets
            rows = [r for r in INERT_OPTIONS if r.owner is row.owner and r.key == row.key]
            settings = [{**role_settings(_example(n).policy_role), **ENABLED_BY[row.key]} for n in shipped]
            assert any(not any(r.when(s) for r in rows) for s in settings), row
            continue
        assert any(_recipes_reading(row.owner, row.key, v) for v in values), row


@pytest.mark.parametrize(
    ("name", "kwargs", "bad", "valid"),
    [
        ("dpo", {"kl_coef": 0.1}, "kl_coef", "beta, label_smoothing, ref_key, logprob_chunk_size"),
        ("opd", {"teacher_path": "/t", "kl_coef": 0.1}, "kl_coef", "kl_estimator, logprob_chunk_size, teacher_path"),
        ("sft", {"beta": 0.1}, "beta", "logprob_chunk_size"),
        ("reward_model", {"marginn": 1.0}, "marginn' (did you mean 'margin'?)", "margin"),
        ("ppo", {"gama": 0.9}, "gama' (did you mean 'gamma'?)", "advantage_estimator, adv_eps,"),
    ],
)
def test_an_unknown_option_is_one_did_you_mean_line_for_every_specialization(name, kwargs, bad, valid):
    message = _refusal(name, **kwargs)
    assert f"unknown option '{bad}" in message and f"valid options: {valid}" in message, message
    if name == "ppo":  # the factory's own options follow the specialization's
        assert "logprob_chunk_size, value_clip_eps (check" in message
    assert "unexpected keyword argument" not in message and "__init__" not in message
    assert message.endswith(f"(check train.algorithm_kwargs; `areno recipes {name}` describes each)")
    for key in RUN_SET_OPTIONS:  # set by the run (rollout.temperature): not offered
        assert not re.search(rf"valid options: .*\b{key}\b", message)


def test_a_role_built_with_an_unknown_argument_says_so_alike():
    role = ModelRole(name="policy", specialization_cls=DPOSpecialization, init_kwargs={"betta": 0.2})
    with pytest.raises(ConfigError, match=r"unknown option 'betta' \(did you mean 'beta'\?\); valid options: beta,"):
        role.build()


def test_the_cli_refuses_an_inert_option_before_the_model_is_made(tmp_path, capsys):
    args = train_args(tmp_path, "train.algorithm=cispo", "train.algorithm_kwargs.clip_eps=0.01")
    assert areno_main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("areno: error: train.algorithm_kwargs.clip_eps=0.01 does nothing"), err
    assert not (tmp_path / "model").exists() and not (tmp_path / "run").exists()


def _listed(name: str, capsys) -> str:
    assert areno_main(["recipes", name]) == 0
    return capsys.readouterr().out


# the shipped recipes only: test modules imported before this one register their own
@pytest.mark.parametrize("name", sorted(n for n, f in TRAINING_CONFIGS.items() if f.__module__.startswith("areno.")))
def test_areno_recipes_lists_every_option_with_its_value_and_meaning(name, capsys):
    out = _listed(name, capsys)
    lines = out.splitlines()
    cfg = _example(name)
    params = inspect.signature(TRAINING_CONFIGS[name]).parameters
    options = [*params, *(k for k in specialization_options(cfg.policy_role.specialization_cls) if k not in params)]
    for key in options:
        if key in RUN_SET_OPTIONS:
            assert f"set by the run, not train.algorithm_kwargs: {key} = " in out
            continue
        (i,) = [i for i, line in enumerate(lines) if line.startswith(f"    {key}=")]
        meaning = lines[i + 1]
        assert meaning.startswith(" " * 8) and meaning.strip(), (key, meaning)  # every built-in option says what it is


def test_the_options_walk6_found_hidden_are_listed(capsys):
    assert "    label_smoothing=0.0\n        cDPO" in _listed("dpo", capsys)
    assert "    margin=0.0\n        Subtracted from the chosen-minus-rejected score" in _listed("reward_model", capsys)
    assert "    kl_estimator=k2\n" in _listed("opd", capsys)
    out = _listed("mixed_loss_dagger_opd", capsys)
    assert "    beta_start=1.0\n" in out and "    beta_end=0.0\n" in out
    out = _listed("ppo", capsys)
    assert "    entropy_coef=0.0\n" in out and "    clip_eps_high=null\n" in out and "    dual_clip_c=null\n" in out
    # the options of ActorConfig this recipe does not read are marked, from the same table that refuses them
    out = _listed("cispo", capsys)
    (clip,) = re.findall(r"^    clip_eps=0\.2\n((?:        .*\n)+)", out, flags=re.M)
    assert "Does nothing here: the cispo loss has no lower clip" in " ".join(clip.split())
