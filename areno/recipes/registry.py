"""The recipe registry: ``@recipe("name")`` registers a factory returning a ``TrainingConfig``.

A user's recipe lives in their own module: ``train.algorithm=my_pkg.recipes:my_algo`` (or
``./my_recipes.py:my_algo``) imports that module, whose ``@recipe("my_algo")`` registers it, in
every process that resolves the recipe; ``areno recipes --modules my_pkg.recipes`` lists it.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import os
import sys
import textwrap
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from areno.algo.kl import LOSS_KL_ESTIMATORS
from areno.errors import ConfigError, is_of_type, wrong_type
from areno.recipes.config import (
    REQUIRED,
    ModelRole,
    ReferenceSync,
    TrainingConfig,
    options_from_kwargs,
    specialization_options,
    unknown_option,
)
from areno.recipes.traits import STALE_LABELS, RecipeTraits, recipe_traits
from areno.rewards.loader import USER_FILE_MODULE, import_module
from areno.specializations import (
    ActorConfig,
    ActorSpecialization,
    CriticSpecialization,
    MixedLossDaggerOPDSpecialization,
)
from areno.specializations.base import RUN_SET_OPTIONS, check_methods, option_types
from areno.specializations.supervised import SCORER_Q_SOURCES

RecipeFactory = Callable[..., TrainingConfig]
TRAINING_CONFIGS: dict[str, RecipeFactory] = {}
"""Recipe name -> factory. Factories may take keyword options (e.g. ``teacher_path``)."""


def recipe(name: str) -> Callable[[RecipeFactory], RecipeFactory]:
    """Register ``factory`` under ``name`` (another factory under a registered name is an error)."""

    def register(factory: RecipeFactory) -> RecipeFactory:
        if name in TRAINING_CONFIGS and _source(TRAINING_CONFIGS[name]) != _source(factory):
            raise ConfigError(
                f"recipe {name!r} is already registered by {_where(TRAINING_CONFIGS[name])}: register "
                f"{factory.__qualname__} under another name"
            )
        TRAINING_CONFIGS[name] = factory
        return factory

    return register


def _source(factory: RecipeFactory) -> tuple[str, str]:
    """Where ``factory`` is defined (file, qualified name): one module imported twice in a process, by
    name (``--modules my_recipes``) and by path (``./my_recipes.py:NAME``), registers the same factory
    again, which is no clash."""
    code = getattr(factory, "__code__", None)
    return (os.path.realpath(code.co_filename) if code else repr(factory), factory.__qualname__)


def _where(factory: RecipeFactory) -> str:
    """``factory`` and its module, as a message names them: a module imported by path is named by its
    file (its module name is one areno made up, ``USER_FILE_MODULE``)."""
    module = getattr(factory, "__module__", None) or "?"
    if module.startswith(USER_FILE_MODULE):
        module = _source(factory)[0]
    return f"{factory.__qualname__} in {module}"


def _unknown(name: str) -> ConfigError:
    close = difflib.get_close_matches(name, list(TRAINING_CONFIGS), n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    return ConfigError(
        f"unknown recipe {name!r}: {hint}`areno recipes` lists the {len(TRAINING_CONFIGS)} registered ones"
    )


def import_recipes(module: str, *, what: str = "train.algorithm") -> ModuleType:
    """Import a user's module of ``@recipe`` factories (a dotted name found on sys.path or in the
    working directory, or a ``.py`` file); a bad one is a one-line :class:`ConfigError` naming
    ``what`` (where the module was named)."""
    return import_module(module, what=what, error=ConfigError)


def resolve_name(name: str) -> str:
    """The registered name of ``name``: a plain recipe name, or ``module:recipe`` whose module is
    imported first (so its ``@recipe`` runs)."""
    module, sep, short = name.rpartition(":")
    if not sep:
        return name
    imported = import_recipes(module)
    if short not in TRAINING_CONFIGS:
        raise _not_registered(module, imported, short)
    return short


def _not_registered(module: str, imported: ModuleType, short: str) -> ConfigError:
    """The error of ``module:short`` where ``module`` registers no recipe ``short``: the name it registers
    its function ``short`` under (a recipe is named by its ``@recipe`` name, not its function's), else the
    names it registers, else how to register one."""
    mine = {n: f for n, f in TRAINING_CONFIGS.items() if getattr(f, "__module__", None) == imported.__name__}
    named = [n for n, f in mine.items() if f is getattr(imported, short, None)]
    what = f"train.algorithm: module {module!r} registers no recipe {short!r}"
    if named:
        return ConfigError(
            f"{what}: its function {short} is registered as @recipe({named[0]!r}) (a recipe is named by its "
            f"@recipe name): use {module}:{named[0]}"
        )
    if mine:
        close = difflib.get_close_matches(short, list(mine), n=3, cutoff=0.5)
        if close:
            return ConfigError(f"{what}: did you mean {', '.join(close)}? use {module}:{close[0]}")
        more = f" and {len(mine) - 8} more" if len(mine) > 8 else ""
        return ConfigError(
            f"{what}; it registers {', '.join(sorted(mine)[:8])}{more} (a recipe is named by its @recipe name): "
            f"use {module}:{sorted(mine)[0]}, or decorate a factory with @recipe({short!r})"
        )
    return ConfigError(f"{what}: decorate its factory with @recipe({short!r})")


REFERENCE_SYNC_OPTIONS: dict[str, Any] = {"ref_sync_steps": 0, "ref_sync_alpha": 0.6}


def frozen_policy_copies(cfg: TrainingConfig) -> list[str]:
    """The frozen roles that load the policy's checkpoint (a reference the policy's weights may move)."""
    policy = cfg.policy_role
    return [r.name for r in cfg.roles if not r.trainable and r.model_path == policy.model_path]


_REFERENCE_SYNC_DOCS = {
    "ref_sync_steps": "Every this many optimizer steps of the policy the frozen reference moves toward it (TRL's "
    "sync_ref_model with ref_model_sync_steps); 0: the reference stays the initial policy.",
    "ref_sync_alpha": "How far it moves: ref = alpha * policy + (1 - alpha) * ref (TRL's ref_model_mixup_alpha), in "
    "(0, 1].",
}
"""``train.algorithm_kwargs`` keys of every recipe, with their defaults, that move its frozen copy of the policy
(the reference) toward the policy (``ReferenceSync``, ``with_reference_sync``): TRL's ``ref_model_sync_steps``
(``sync_ref_model`` is ``ref_sync_steps`` > 0; 0 is off) and ``ref_model_mixup_alpha``."""
_REFERENCE_SYNC_TYPES = {"ref_sync_steps": int, "ref_sync_alpha": float}


def get_recipe(name: str, *, policy_kwargs: dict[str, Any] | None = None, **options: Any) -> TrainingConfig:
    """The validated ``TrainingConfig`` of recipe ``name``.

    ``options`` go to the recipe factory (e.g. ``teacher_path`` for distillation recipes);
    ``policy_kwargs`` override the policy role's specialization arguments. A key of
    ``policy_kwargs`` that is a factory option is passed to the factory instead, so
    ``train.algorithm_kwargs`` can carry both. Unknown name or option: a :class:`ConfigError` (with
    the closest names). ``name`` may be ``module:recipe`` (:func:`resolve_name`).
    """
    name = resolve_name(name)
    if name not in TRAINING_CONFIGS:
        raise _unknown(name)
    factory = TRAINING_CONFIGS[name]
    params = inspect.signature(factory).parameters
    policy_kwargs = dict(policy_kwargs or {})
    reference_sync = {k: policy_kwargs.pop(k) for k in REFERENCE_SYNC_OPTIONS if k in policy_kwargs and k not in params}
    _check_types(_REFERENCE_SYNC_TYPES, reference_sync)
    for key in list(policy_kwargs):
        if key in params:
            options.setdefault(key, policy_kwargs.pop(key))
    bad = [k for k in options if k not in params]
    if bad:
        close = difflib.get_close_matches(bad[0], list(params), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"recipe {name!r} has no option(s) {bad}{hint}; it accepts {list(params) or 'none'}")
    _check_types(_annotations(factory), options)
    cfg = _build(name, options)
    for role in cfg.roles:  # a user's loss that cannot take the step's call: now, before any model loads
        check_methods(role.specialization_cls)
    _check_option_names(cfg, policy_kwargs, list(params))
    check_policy_kwarg_types(cfg, policy_kwargs)
    keys, need = cfg.unmet_policy_kwargs(policy_kwargs)
    if keys:  # e.g. kl_coef on a recipe with no reference role to give ref_logprobs_T
        key = keys[0]
        takers = [n for n, f in sorted(TRAINING_CONFIGS.items()) if key in inspect.signature(f).parameters]
        instead = f"whose {key} option adds a role for them ({', '.join(takers)})" if takers else "with a role for them"
        raise ConfigError(
            f"train.algorithm_kwargs.{key}={policy_kwargs[key]!r} needs batch keys {need}, which no role of "
            f"recipe {name!r} provides: drop the key, or use a recipe {instead}"
        )
    configured = cfg.with_policy_kwargs(**policy_kwargs)
    check_inert_options(name, cfg, configured, options, policy_kwargs)
    check_estimator_reads_the_recipe(name, cfg, configured)
    check_critic_agrees(name, configured)
    return with_reference_sync(name, configured, reference_sync)


def with_reference_sync(name: str, cfg: TrainingConfig, given: Mapping[str, Any]) -> TrainingConfig:
    """``cfg`` whose frozen copy of the policy (its one frozen role loading the policy's checkpoint: the
    reference) follows the policy as ``given`` (``REFERENCE_SYNC_OPTIONS``) says; a one-line ``ConfigError``
    for a value out of range, an alpha without steps (it would do nothing) or a recipe without such a role."""
    steps = given.get("ref_sync_steps", REFERENCE_SYNC_OPTIONS["ref_sync_steps"])
    alpha = given.get("ref_sync_alpha", REFERENCE_SYNC_OPTIONS["ref_sync_alpha"])
    key = "train.algorithm_kwargs."
    if steps < 0:
        raise ConfigError(
            f"{key}ref_sync_steps must be >= 0 (the policy's optimizer steps between two moves of the reference "
            f"toward it, TRL's ref_model_sync_steps, e.g. 512; 0: off), got {steps}"
        )
    if not 0 < alpha <= 1:
        raise ConfigError(
            f"{key}ref_sync_alpha must be in (0, 1] (the policy's weight when the reference moves toward it, TRL's "
            f"ref_model_mixup_alpha; 0.6 by default), got {alpha}"
        )
    if steps == 0:
        if alpha != REFERENCE_SYNC_OPTIONS["ref_sync_alpha"]:  # as check_inert_options: the default is no change
            raise ConfigError(
                f"{key}ref_sync_alpha={alpha} does nothing while ref_sync_steps is 0 (the reference never moves): "
                f"set {key}ref_sync_steps too (e.g. 512, TRL's ref_model_sync_steps), or drop it"
            )
        return cfg
    copies = frozen_policy_copies(cfg)
    if len(copies) != 1:
        if copies:
            why = (
                f"several frozen roles of recipe {name!r} load the policy's checkpoint ({', '.join(copies)}): which one"
            )
        elif "kl_coef" in inspect.signature(TRAINING_CONFIGS[name]).parameters:
            why = f"recipe {name!r} has none at kl_coef=0: set {key}kl_coef > 0 too (e.g. 0.04), or drop it"
        else:
            why = f"recipe {name!r} has none: drop it, or use a recipe with one (grpo with kl_coef > 0, ppo_kl, dpo)"
        raise ConfigError(f"{key}ref_sync_steps={steps} moves a frozen reference role toward the policy, but {why}")
    sync = ReferenceSync(source=cfg.policy_role.name, target=copies[0], alpha=float(alpha), every=steps)
    return dataclasses.replace(cfg, reference_sync=sync)


def check_estimator_reads_the_recipe(name: str, base: TrainingConfig, cfg: TrainingConfig) -> None:
    """A one-line ``ConfigError`` where ``train.algorithm_kwargs.advantage_estimator`` (``cfg``'s, changed from
    ``base``'s, the recipe's own) leaves a part of the recipe unread: a critic role's values (only ``gae``
    reads them: the critic would train for nothing) or the KL the recipe places in the token rewards (only
    the estimators of per-token returns read them: the KL would reach nothing). An option the user set to
    do nothing is ``check_inert_options``' to refuse."""
    if cfg.policy_role.specialization_cls is not ActorSpecialization:
        return
    actor = cfg.policy_role.build().config
    est = actor.advantage_estimator
    if est == base.policy_role.build().config.advantage_estimator:  # the recipe's own pairing
        return
    critics = [r.name for r in cfg.roles if r.specialization_cls is CriticSpecialization]
    if critics and est != "gae":
        raise ConfigError(
            f"train.algorithm_kwargs.advantage_estimator={est}: recipe {name!r} trains a critic (role {critics[0]!r}) "
            "whose values only advantage_estimator=gae reads, so it would train for nothing: drop the key, or use a "
            "recipe without a critic (grpo, rloo, reinforce_pp)"
        )
    if actor.kl_in_reward and actor.kl_coef > 0 and est not in _RETURNS:
        k3 = " and kl_estimator=k3" if actor.kl_estimator not in LOSS_KL_ESTIMATORS else ""
        raise ConfigError(
            f"train.algorithm_kwargs.advantage_estimator={est}: recipe {name!r} subtracts its KL from the token "
            f"rewards (kl_in_reward=true), which advantage_estimator {est} never reads (one reward per sequence), so "
            f"the KL would reach nothing: set train.algorithm_kwargs.kl_in_reward=false{k3} too (the KL in the "
            "loss), or drop the key"
        )


def check_critic_agrees(name: str, cfg: TrainingConfig) -> None:
    """A one-line ``ConfigError`` where a recipe's critic would learn value targets from other rewards than
    the policy's advantages use: the critic has no overlong penalty, and its KL penalty is its own setting
    (a recipe passes one value to both; a policy option alone changes one side). Discounting may differ
    on purpose (decoupled GAE: a critic's lambda 1 beside a policy's lower one), so it is not checked."""
    critics = [r for r in cfg.roles if r.specialization_cls is CriticSpecialization]
    if not critics or cfg.policy_role.specialization_cls is not ActorSpecialization:
        return
    actor = cfg.policy_role.build().config
    for critic in critics:
        if actor.overlong_max_length is not None:
            raise ConfigError(
                f"train.algorithm_kwargs.overlong_max_length={actor.overlong_max_length}: recipe {name!r}'s critic "
                f"(role {critic.name!r}) learns value targets from the rewards without the overlong penalty the "
                "policy's advantages add: drop it, or use a recipe without a critic (dapo)"
            )
        if not actor.kl_in_reward:
            continue
        spec = critic.build()
        for key, mine, theirs in (
            ("kl_coef", actor.kl_coef, spec.kl_coef),
            ("kl_estimator", actor.kl_estimator, spec.kl_estimator),
        ):
            if mine != theirs:
                raise ConfigError(
                    f"train.algorithm_kwargs.{key}={mine!r} reaches the policy alone: recipe {name!r}'s critic "
                    f"(role {critic.name!r}) computes its value targets with {key}={theirs!r}, so the two would "
                    f"learn from different returns: give {key} as the recipe's option, which sets both"
                )


def _check_option_names(cfg: TrainingConfig, policy_kwargs: dict[str, Any], factory_options: list[str]) -> None:
    """A key of ``policy_kwargs`` that the policy role's specialization does not take: one line naming it,
    the closest option and every option ``train.algorithm_kwargs`` takes for this recipe (the
    specialization's, then the factory's), for every specialization alike (not Python's "unexpected
    keyword argument")."""
    role = cfg.policy_role
    valid = specialization_options(role.specialization_cls)
    unknown = [] if valid is None else [k for k in policy_kwargs if k not in valid]
    if unknown:
        everything = [
            *(k for k in valid if k not in RUN_SET_OPTIONS),
            *(k for k in factory_options if k not in valid),
        ]
        if frozen_policy_copies(cfg):  # a reference to move
            everything += [k for k in REFERENCE_SYNC_OPTIONS if k not in everything]
        raise ConfigError(
            f"role {role.name!r}: bad arguments for {role.specialization_cls.__name__}: "
            f"{unknown_option(unknown[0], everything)} (check train.algorithm_kwargs; `areno recipes {cfg.name}` "
            "describes each)"
        )


def check_policy_kwarg_types(cfg: TrainingConfig, policy_kwargs: dict[str, Any]) -> None:
    """A ``ConfigError`` naming ``train.algorithm_kwargs.<key>`` for a value of another type than the
    policy role's option of that name (``option_types``), before a range check meets it (a string
    compared with a number)."""
    _check_types(option_types(cfg.policy_role.specialization_cls), policy_kwargs)


def _check_types(types: dict[str, Any], given: dict[str, Any]) -> None:
    for key, value in given.items():
        typed = os.fspath(value) if isinstance(value, os.PathLike) else value  # a path where a string goes
        if key in types and not is_of_type(typed, types[key]):
            raise wrong_type(f"train.algorithm_kwargs.{key}", types[key], value)


def _annotations(factory: RecipeFactory) -> dict[str, Any]:
    """A recipe factory's annotated option types; empty where they do not resolve (nothing checked)."""
    try:
        return typing.get_type_hints(factory)
    except (NameError, TypeError, AttributeError):  # a name only a type checker sees, or no annotations
        return {}


def worker_name_problem(name: str) -> str | None:
    """Why a worker process (its own interpreter, importing areno only) cannot resolve the bare recipe
    name ``name`` that resolves here, and the name to give instead: a recipe registered by code that
    process does not run (a script's ``__main__``, or a module the script imported). None when it can:
    a built-in recipe, an unregistered name (``get_recipe`` says so), or ``module:name``, whose module
    every process imports first."""
    if ":" in name or name not in TRAINING_CONFIGS:
        return None
    module_name = getattr(TRAINING_CONFIGS[name], "__module__", None) or ""
    if module_name.startswith("areno."):
        return None
    module = sys.modules.get(module_name)
    file = getattr(module, "__file__", None)
    if module_name != "__main__" and not module_name.startswith(USER_FILE_MODULE) and module is not None:
        return f"registered by module {module_name}, which they do not import: name it {module_name}:{name}"
    if file is None:  # a notebook or an interactive session: no file to import it from
        return (
            f"registered by {module_name} without a file to import it from: move the recipe to a module file "
            f"and name it ./my_recipes.py:{name} (or my_recipes:{name})"
        )
    path = Path(file).resolve()
    shown = f"./{path.relative_to(Path.cwd())}" if path.is_relative_to(Path.cwd()) else str(path)
    if module_name != "__main__":
        return f"registered by {shown}, which they do not import: name it {shown}:{name}"
    return (
        f"registered by the script {shown} (__main__), which they do not run: name it {shown}:{name} so they import "
        'it, with the script\'s run under `if __name__ == "__main__":` (or the recipe moved to a module of its own)'
    )


def _build(name: str, options: dict[str, Any]) -> TrainingConfig:
    """``TRAINING_CONFIGS[name](**options)``, checked to be a ``TrainingConfig`` (a user's factory may
    return anything)."""
    cfg = TRAINING_CONFIGS[name](**options)
    if not isinstance(cfg, TrainingConfig):
        raise ConfigError(
            f"recipe {name!r} returned {type(cfg).__name__}, expected TrainingConfig: return "
            f"TrainingConfig(name=..., roles=(...)) from its @recipe factory"
        )
    return cfg


# ------------------------------------------------------------------------------ options that do nothing
_RETURNS = ("gae", "reinforce_pp", "reinforce_pp_baseline")
"""The advantage estimators that compute per-token returns (a discount, token rewards such as a KL)."""


@dataclass(frozen=True)
class InertOption:
    """An option that is accepted but never read under some settings: set to another value than the
    recipe's own where ``when`` holds of the settings, it is refused (``check_inert_options``)."""

    owner: type | str
    """The policy role's specialization class (the class itself, not a user's subclass, whose loss may
    read its options otherwise), or a recipe name for an option of that recipe's factory."""
    key: str
    when: Callable[[Mapping[str, Any]], bool]
    """True of the settings (the specialization's options, or the factory's) where ``key`` does nothing."""
    why: str
    """Why, formatted with the settings (``{advantage_estimator}``)."""
    fix: str = "drop it"
    """What to do instead."""


def _not_decoupled(s: Mapping[str, Any]) -> bool:
    return not s["use_decoupled_loss"]


def _policy_loss_is_not(loss: str) -> Callable[[Mapping[str, Any]], bool]:
    return lambda s: s["policy_loss"] != loss


_DECOUPLED_ONLY = (
    "only the decoupled loss reads it (use_decoupled_loss=true), and this recipe's loss is the coupled one"
)

INERT_OPTIONS: tuple[InertOption, ...] = (
    # ActorSpecialization (actor.py): compute_advantages, compute_loss, _prepare_kept
    InertOption(
        ActorSpecialization,
        "adv_eps",
        lambda s: s["advantage_estimator"] not in ("grpo", "grpo_batch_std", "gdpo"),
        "only advantage_estimator grpo (the group's), grpo_batch_std (the batch's) and gdpo (both) divide by a "
        "reward std + adv_eps, and this recipe's advantage_estimator is {advantage_estimator}",
    ),
    InertOption(
        ActorSpecialization,
        "gamma",
        lambda s: s["advantage_estimator"] not in _RETURNS,
        "only per-token returns are discounted (advantage_estimator gae, reinforce_pp or reinforce_pp_baseline), "
        "and this recipe's advantage_estimator is {advantage_estimator}",
    ),
    InertOption(
        ActorSpecialization,
        "gae_lambda",
        lambda s: s["advantage_estimator"] != "gae",
        "only GAE advantages read it (advantage_estimator=gae), and this recipe's advantage_estimator is "
        "{advantage_estimator}",
    ),
    InertOption(
        ActorSpecialization,
        "clip_eps",
        lambda s: s["policy_loss"] == "cispo" and s["clip_eps_high"] is not None,
        "the cispo loss has no lower clip, and its upper one is clip_eps_high ({clip_eps_high}; clip_eps stands in "
        "for it only when clip_eps_high is null)",
        "set train.algorithm_kwargs.clip_eps_high instead",
    ),
    InertOption(
        ActorSpecialization,
        "dual_clip_c",
        lambda s: s["policy_loss"] != "ppo",
        "only policy_loss=ppo has a dual clip, and this recipe's policy_loss is {policy_loss}",
    ),
    InertOption(
        ActorSpecialization,
        "clip_eps",
        lambda s: s["policy_loss"] in ("sapo", "vespo"),
        "policy_loss {policy_loss} has no clip (sapo gates the ratio with a sigmoid, vespo weighs the sequence's "
        "ratio)",
    ),
    InertOption(
        ActorSpecialization,
        "clip_eps_high",
        lambda s: s["policy_loss"] in ("sapo", "vespo"),
        "policy_loss {policy_loss} has no clip (sapo gates the ratio with a sigmoid, vespo weighs the sequence's "
        "ratio)",
    ),
    *(
        InertOption(
            ActorSpecialization,
            key,
            _policy_loss_is_not(loss),
            f"only policy_loss={loss} reads it, and this recipe's policy_loss is {{policy_loss}}",
        )
        for loss, key in (
            ("sapo", "sapo_temperature_pos"),
            ("sapo", "sapo_temperature_neg"),
            ("vespo", "vespo_k_pos"),
            ("vespo", "vespo_lambda_pos"),
            ("vespo", "vespo_k_neg"),
            ("vespo", "vespo_lambda_neg"),
        )
    ),
    InertOption(
        ActorSpecialization,
        "loss_agg_constant",
        lambda s: s["loss_aggregation"] != "constant",
        "only loss_aggregation=constant divides by it, and this recipe's loss_aggregation is {loss_aggregation}",
    ),
    InertOption(
        ActorSpecialization,
        "kl_estimator",
        lambda s: s["kl_coef"] == 0,
        "kl_coef is 0, so no KL is estimated",
        "drop it, or set kl_coef > 0 too",
    ),
    *(
        InertOption(
            ActorSpecialization,
            key,
            lambda s: s["entropy_target"] is None,
            "only adaptive entropy control moves the coefficient (entropy_target set), and entropy_target is null",
            "drop it, or set entropy_target too (e.g. 0.2)",
        )
        for key in ("entropy_coef_delta", "entropy_coef_min", "entropy_coef_max")
    ),
    InertOption(
        ActorSpecialization,
        "kl_horizon",
        lambda s: s["kl_target"] is None,
        "only adaptive KL control moves the coefficient (kl_target set), and kl_target is null",
        "drop it, or set kl_target too (e.g. 0.1)",
    ),
    InertOption(
        ActorSpecialization,
        "kl_bias_correction",
        lambda s: s["kl_coef"] == 0,
        "kl_coef is 0, so there is no KL term to weight",
        "drop it, or set kl_coef > 0 too",
    ),
    InertOption(
        ActorSpecialization,
        "kl_bias_correction",
        lambda s: s["kl_in_reward"],
        "the KL is a reward penalty here (kl_in_reward=true), which the rollout's policy already sampled: only a "
        "KL loss term is weighted",
        "drop it, or set kl_in_reward=false to keep the KL in the loss",
    ),
    InertOption(
        ActorSpecialization,
        "kl_in_reward",
        lambda s: s["kl_coef"] == 0,
        "kl_coef is 0, so there is no KL to place",
        "drop it, or set kl_coef > 0 too",
    ),
    InertOption(
        ActorSpecialization,
        "kl_in_reward",
        lambda s: s["kl_in_reward"] and s["advantage_estimator"] not in _RETURNS,
        "advantage_estimator {advantage_estimator} reads one reward per sequence, never per-token rewards, so the "
        "KL would leave the loss and reach nothing (only gae, reinforce_pp and reinforce_pp_baseline take it)",
        "drop it to keep the KL in the loss",
    ),
    InertOption(
        ActorSpecialization,
        "recompute_logprob",
        lambda s: s["use_decoupled_loss"],
        "the decoupled loss takes its proximal log-probs from prox_logp_method ({prox_logp_method}) instead",
    ),
    InertOption(ActorSpecialization, "prox_logp_method", _not_decoupled, _DECOUPLED_ONLY),
    InertOption(ActorSpecialization, "behav_imp_weight_cap", _not_decoupled, _DECOUPLED_ONLY),
    InertOption(ActorSpecialization, "behav_imp_weight_min", _not_decoupled, _DECOUPLED_ONLY),
    InertOption(
        ActorSpecialization,
        "behav_imp_weight_min",
        lambda s: s["behav_imp_weight_min"] == 0,
        "a behaviour weight pi_prox / pi_behave is never below 0, so a lower bound of 0 bounds nothing",
        "drop it (null: no lower bound), or give it a value above 0",
    ),
    InertOption(ActorSpecialization, "behav_weight_mode", _not_decoupled, _DECOUPLED_ONLY),
    InertOption(
        ActorSpecialization,
        "behav_weight_mode",
        lambda s: (
            s["behav_imp_weight_cap"] is None
            and s["behav_imp_weight_min"] is None
            and not s["behav_weight_mode"].startswith("sequence_")
        ),
        "a token mode ({behav_weight_mode}) says what a weight outside [behav_imp_weight_min, behav_imp_weight_cap] "
        "does, and both are null (no bound)",
        "drop it, or set behav_imp_weight_cap (or behav_imp_weight_min) too",
    ),
    InertOption(
        ActorSpecialization,
        "dynamic_sampling_max_rounds",
        lambda s: not s["dynamic_sampling"],
        "dynamic sampling is off (dynamic_sampling is false), so no group is filtered or sampled again",
        "drop it, or set dynamic_sampling=true too",
    ),
    InertOption(
        ActorSpecialization,
        "overlong_buffer_length",
        lambda s: s["overlong_max_length"] is None,
        "the overlong penalty is off (overlong_max_length is null)",
        "drop it, or set overlong_max_length too",
    ),
    InertOption(
        ActorSpecialization,
        "overlong_penalty",
        lambda s: s["overlong_max_length"] is None,
        "the overlong penalty is off (overlong_max_length is null)",
        "drop it, or set overlong_max_length too",
    ),
    # MixedLossDaggerOPDSpecialization (supervised.py): beta()
    InertOption(
        MixedLossDaggerOPDSpecialization,
        "beta_decay_steps",
        lambda s: s["beta_start"] == s["beta_end"],
        "beta_start = beta_end = {beta_end}, so beta has nothing to decay",
    ),
    # the aggrevate factory (builtin.py): which Q source builds which role
    InertOption(
        "aggrevate",
        "teacher_path",
        lambda s: s["q_source"] in SCORER_Q_SOURCES,
        "q_source={q_source} reads Q from a scorer role's head and builds no teacher role (teacher_path is read by "
        "q_source=teacher_logprob and q_source=workflow)",
    ),
    InertOption(
        "aggrevate",
        "reward_model_path",
        lambda s: s["q_source"] != "reward_model",
        "only q_source=reward_model reads it, and q_source is {q_source}",
    ),
    InertOption(
        "aggrevate",
        "value_head_path",
        lambda s: s["q_source"] != "value_head",
        "only q_source=value_head reads it, and q_source is {q_source}",
    ),
)
"""Every option areno accepts but would not read, and where: ``check_inert_options`` refuses them from
this table, and ``areno recipes NAME`` marks them."""


def role_settings(role: ModelRole) -> dict[str, Any]:
    """The options the role's specialization runs with: its ``config_cls``'s fields, else its
    constructor's defaults, updated by ``init_kwargs``."""
    cls = role.specialization_cls
    if cls.config_cls is not None:
        config = options_from_kwargs(cls.config_cls, role.init_kwargs)
        return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    return {**(specialization_options(cls) or {}), **role.init_kwargs}


def factory_settings(name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """Recipe ``name``'s factory options: their defaults updated by ``options``."""
    params = inspect.signature(TRAINING_CONFIGS[name]).parameters
    return {k: p.default for k, p in params.items() if p.default is not inspect.Parameter.empty} | dict(options)


def inert_reasons(name: str, cfg: TrainingConfig, options: Mapping[str, Any]) -> dict[str, InertOption]:
    """Key -> the ``INERT_OPTIONS`` row that says why it does nothing in recipe ``name`` as configured
    (``cfg``, built with factory ``options``); keys that do something are absent."""
    spec_cls = cfg.policy_role.specialization_cls
    spec, factory = role_settings(cfg.policy_role), factory_settings(name, options)
    out: dict[str, InertOption] = {}
    for row in INERT_OPTIONS:
        if row.key in out:  # the first row that applies says why
            continue
        if (row.owner is spec_cls and row.when(spec)) or (row.owner == name and row.when(factory)):
            out[row.key] = row
    return out


def check_inert_options(
    name: str,
    base: TrainingConfig,
    configured: TrainingConfig,
    options: Mapping[str, Any],
    policy_kwargs: Mapping[str, Any],
) -> None:
    """A ``ConfigError`` for an option given another value than the recipe's own (the factory's default,
    or what ``base``, the recipe before ``policy_kwargs``, gives its policy role) that the configured
    recipe never reads (``INERT_OPTIONS``): one line naming it, why it does nothing here and what reads it."""
    params = inspect.signature(TRAINING_CONFIGS[name]).parameters
    before = role_settings(base.policy_role)
    changed = {k: v for k, v in options.items() if k in params and v != params[k].default}
    changed |= {k: v for k, v in policy_kwargs.items() if k not in before or v != before[k]}
    if not changed:
        return
    inert = inert_reasons(name, configured, options)
    for key, value in changed.items():
        row = inert.get(key)
        if row is None:
            continue
        settings = (
            role_settings(configured.policy_role) if isinstance(row.owner, type) else factory_settings(name, options)
        )
        readers = [r for r in _recipes_reading(row.owner, key, value) if r != name]
        shown = ", ".join(readers[:4]) + (", ..." if len(readers) > 4 else "")
        raise ConfigError(
            f"train.algorithm_kwargs.{key}={_shown(value)} does nothing in recipe {name!r}: "
            f"{row.why.format_map(_ShownSettings(settings))}: {row.fix}"
            + (f"; recipes that read it: {shown}" if readers else "")
        )


class _ShownSettings(dict):
    """Settings as ``str.format_map`` shows them (YAML's spelling: null, true)."""

    def __getitem__(self, key: str) -> str:
        return _shown(super().__getitem__(key))


def _shown(value: Any) -> str:
    """``value`` as a YAML override spells it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _recipes_reading(owner: type | str, key: str, value: Any) -> list[str]:
    """The registered recipes whose policy role is of class ``owner`` and reads option ``key`` set to
    ``value`` on top of their own settings (empty for a factory's option: the one recipe that has it)."""
    if not isinstance(owner, type):
        return []
    rows = [r for r in INERT_OPTIONS if r.owner is owner and r.key == key]
    names = []
    for name in sorted(TRAINING_CONFIGS):
        try:
            cfg = _example(name)
        except (ConfigError, TypeError, ValueError):  # a user's factory that needs real options
            continue
        if cfg.policy_role.specialization_cls is not owner:
            continue
        settings = {**role_settings(cfg.policy_role), key: value}
        if not any(r.when(settings) for r in rows):
            names.append(name)
    return names


def _example(name: str) -> TrainingConfig:
    """Recipe ``name`` as ``areno recipes NAME`` shows it: a placeholder for each path option it needs."""
    return _build(name, _placeholders(name))


def _placeholders(name: str) -> dict[str, str]:
    """``<path>`` for each factory option whose default is None and that takes a string (a checkpoint the
    run must give, or may)."""
    factory = TRAINING_CONFIGS[name]
    hints = _annotations(factory)
    return {
        k: "<path>"
        for k, p in inspect.signature(factory).parameters.items()
        if p.default is None and (k not in hints or is_of_type("<path>", hints[k]))
    }


# ------------------------------------------------------------------------------ what each option means
_DPO_BETA = "DPO's beta (> 0): the strength of the implicit KL to the reference."
"""dpo's and dpo_distributed's factory option and DPOSpecialization's, one meaning."""

_BETA_DECAY = "Policy versions over which beta goes linearly from beta_start to beta_end (0: beta_end from the start)."
"""mixed_loss_dagger_opd's factory option and MixedLossDaggerOPDSpecialization's, one meaning."""

OPTION_DOCS: dict[tuple[str, str], str] = {
    # factory options of the built-in recipes ("*": any recipe)
    ("*", "kl_coef"): "Weight (>= 0) of the KL to a frozen reference, the initial policy; > 0 adds the reference "
    "role (and its forward each step). The KL's log-ratio is clamped to +-20 (no gradient beyond).",
    ("*", "teacher_path"): "The frozen teacher's Hugging Face checkpoint directory (a run's checkpoints/step_N/hf).",
    ("*", "value_clip_eps"): "The critic's value clip range (> 0); null: the unclipped squared error.",
    ("dr_grpo", "max_completion_length"): "L: the summed token losses of each completion are divided by this "
    "constant; null: the run's rollout.max_new_tokens.",
    ("dapo", "max_completion_length"): "L_max: a completion of this length or more gets the full overlong penalty; "
    "null: the run's rollout.max_new_tokens.",
    ("dapo", "overlong_buffer_length"): "L_buf: the soft overlong penalty ramps over the L_buf tokens before L_max.",
    ("aggrevate", "q_source"): "Where the action value Q comes from: teacher_logprob (the teacher's log-prob), "
    "workflow (teacher roll-outs, TeacherQWorkflow), reward_model (reward_model_path's head) or value_head "
    "(value_head_path's critic head).",
    ("aggrevate", "reward_model_path"): "q_source=reward_model: a transformers sequence-classification checkpoint "
    "(a reward_model run's checkpoints/step_N/hf).",
    ("aggrevate", "value_head_path"): "q_source=value_head: an areno critic checkpoint (a PPO run's "
    "checkpoints/step_N/value).",
    ("dpo", "beta"): _DPO_BETA,
    ("dpo_distributed", "beta"): _DPO_BETA,
    # constructor options of specializations without a config_cls
    ("DPOSpecialization", "beta"): _DPO_BETA,
    ("DPOSpecialization", "label_smoothing"): "cDPO: the assumed share of flipped preference labels, in [0, 0.5); "
    "0: plain DPO.",
    ("DPOSpecialization", "ref_key"): "The batch tensor of reference log-probs: ref_logprobs_T (the reference "
    "role's); logprobs_T, log-probs recorded with the data, is refused on preference files, which record none.",
    ("RewardModelSpecialization", "margin"): "Subtracted from the chosen-minus-rejected score inside the "
    "Bradley-Terry loss, -log sigmoid(s_c - s_r - margin); 0: plain Bradley-Terry.",
    ("DistillSpecialization", "kl_estimator"): "The per-token KL estimator the loss differentiates: k2, whose "
    "gradient is the reverse KL(student || teacher)'s in expectation, or k3, the forward KL(teacher || student)'s "
    "(mode-covering); k1 is refused (its expected gradient is 0). The log-ratio is clamped to +-20 (no gradient "
    "beyond).",
    ("MixedLossDaggerOPDSpecialization", "beta_start"): "beta at policy version 0, in [0, 1]: the weight of the "
    "cross-entropy on teacher-executed tokens (1 - beta: the reverse-KL term's on the student's).",
    ("MixedLossDaggerOPDSpecialization", "beta_end"): "beta from version beta_decay_steps on, in [0, 1].",
    ("MixedLossDaggerOPDSpecialization", "beta_decay_steps"): _BETA_DECAY,
    ("mixed_loss_dagger_opd", "beta_decay_steps"): _BETA_DECAY,
    ("AggrevateSpecialization", "q_source"): "Where the action value Q comes from (the recipe's q_source).",
}
"""The one-line meaning of a recipe factory's option (keyed by recipe name, or ``*``) or of a
specialization's constructor argument (keyed by class name) that has no attribute docstring of its own;
an ``ActorConfig`` field, and a constructor argument of the same name as one, reads that field's."""


def recipe_options(name: str) -> list[tuple[str, Any, str, str | None]]:
    """``(key, value, meaning, why it does nothing here or None)`` for every option
    ``train.algorithm_kwargs`` takes for recipe ``name``: the factory's (``<path>`` where the run must give
    one), then its policy role's (the value this recipe runs with)."""
    factory = TRAINING_CONFIGS[name]
    params = inspect.signature(factory).parameters
    placeholders = _placeholders(name)
    cfg = _build(name, placeholders)
    role = cfg.policy_role
    cls = role.specialization_cls
    inert = inert_reasons(name, cfg, placeholders)
    spec_docs = _attribute_docs(cls.config_cls) if cls.config_cls is not None else {}
    actor_docs = _attribute_docs(ActorConfig)
    settings = role_settings(role)
    rows = []

    def meaning(key: str, factory_option: bool) -> str:
        keys = [(name, key), ("*", key)] if factory_option else [(cls.__name__, key)]
        for doc_key in keys:
            if doc_key in OPTION_DOCS:
                return OPTION_DOCS[doc_key]
        return (spec_docs.get(key) or actor_docs.get(key, "")).replace("``", "")

    def why(key: str) -> str | None:
        row = inert.get(key)
        if row is None:
            return None
        shown = role_settings(role) if isinstance(row.owner, type) else factory_settings(name, placeholders)
        return row.why.format_map(_ShownSettings(shown))

    for key, p in params.items():
        value = placeholders[key] if key in placeholders and _needed(name, placeholders, key) else p.default
        rows.append((key, REQUIRED if value is inspect.Parameter.empty else value, meaning(key, True), why(key)))
    for key, value in settings.items():
        if key not in params and key not in RUN_SET_OPTIONS:
            rows.append((key, value, meaning(key, False), why(key)))
    return rows


def _needed(name: str, placeholders: dict[str, str], key: str) -> bool:
    """Whether recipe ``name`` cannot be built without path option ``key`` (a teacher's checkpoint)."""
    try:
        _build(name, {k: v for k, v in placeholders.items() if k != key})
    except ConfigError:
        return True
    return False


def _attribute_docs(cls: type) -> dict[str, str]:
    """Field -> the docstring under it in ``cls``'s source (``x: int = 0`` then ``\"\"\"...\"\"\"``), as one
    line; empty where the source cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for field, doc in zip(body, body[1:]):
        if (
            isinstance(field, ast.AnnAssign)
            and isinstance(field.target, ast.Name)
            and isinstance(doc, ast.Expr)
            and isinstance(doc.value, ast.Constant)
            and isinstance(doc.value.value, str)
        ):
            docs[field.target.id] = " ".join(doc.value.value.split())
    return docs


def describe(name: str) -> str:
    """First line of the recipe factory's docstring."""
    if name not in TRAINING_CONFIGS:
        raise _unknown(name)
    doc = inspect.getdoc(TRAINING_CONFIGS[name]) or ""
    return doc.splitlines()[0] if doc else ""


def list_recipes() -> list[tuple[str, str]]:
    """(name, one-line description) of every registered recipe, sorted by name."""
    return [(name, describe(name)) for name in sorted(TRAINING_CONFIGS)]


def traits_of(name: str) -> RecipeTraits | None:
    """The kind of run recipe ``name`` is at its default options (``recipe_traits``); None for a user's
    factory that cannot be built without options of its own."""
    try:
        return recipe_traits(_example(name))
    except (ConfigError, TypeError, ValueError, KeyError, OSError, ImportError):  # e.g. it opens a path option
        return None


LISTING_WIDTH = 100
"""Columns of the ``areno recipes`` listing: each line fits this terminal width."""

_LEGEND = (
    "RUN: online trains on rollouts the rollout engine samples from the policy; offline on dataset rows.",
    "EXTRA ROLES: the roles beside the trained policy at the recipe's default options (an option such as "
    "kl_coef may add one); `areno recipes NAME` shows its roles and syncs.",
    "STALE: the policy's loss on rollouts of older policies (rollout.max_head_offpolicyness > 0):",
)


def listing(width: int = LISTING_WIDTH) -> list[str]:
    """The lines of ``areno recipes``: a row per recipe (name, RUN, STALE, EXTRA ROLES), its description
    indented beneath, then a legend of the columns; no line longer than ``width`` (a long role list or
    description wraps)."""
    rows = []
    for name, desc in list_recipes():
        traits = traits_of(name)
        if traits is None:
            rows.append((name, "?", "?", "?", desc))
        else:
            run = "online" if traits.online else "offline"
            rows.append((name, run, traits.stale, ", ".join(traits.extra_roles) or "-", desc))
    heads = ("NAME", "RUN", "STALE")
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(heads)]
    indent = sum(w + 2 for w in widths)

    def columns(values: tuple[str, ...], roles: str) -> list[str]:
        first = "".join(f"{v:<{w}}  " for v, w in zip(values, widths))
        return textwrap.wrap(
            roles, width=width, initial_indent=first, subsequent_indent=" " * indent, break_on_hyphens=False
        ) or [first.rstrip()]

    lines = columns(heads, "EXTRA ROLES")
    for name, run, stale, roles, desc in rows:
        lines += columns((name, run, stale), roles)
        lines += textwrap.wrap(desc, width=width, initial_indent="  ", subsequent_indent="  ")
    lines.append("")
    for text in _LEGEND:
        lines += textwrap.wrap(text, width=width, subsequent_indent="  ")
    pad = max(len(label) for label in STALE_LABELS) + 2
    for label, meaning in STALE_LABELS.items():
        lines += textwrap.wrap(
            meaning, width=width, initial_indent=f"  {label:<{pad}}", subsequent_indent=" " * (pad + 2)
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    """``areno recipes [--modules M[,M...]] [NAME]``: list the recipes, or print one recipe's formula and roles."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="areno recipes",
        description="List the registered recipes: whether each runs online (on rollouts) or offline (on dataset "
        "rows), what its loss does with stale rollouts, and the roles it builds beside the policy.",
    )
    parser.add_argument("name", nargs="?", help="print this recipe's formula, roles and syncs (or module:name)")
    # one value per flag (repeat it, or separate modules by commas): nargs="+" would take NAME for a module
    parser.add_argument(
        "--modules",
        action="append",
        default=[],
        metavar="M[,M...]",
        help="import these @recipe modules (or .py files) first; repeat the flag or separate them by commas",
    )
    args = parser.parse_args(argv)
    # a bad module or name is a ConfigError, which the CLI prints as one line (exit 2)
    for module in [m.strip() for given in args.modules for m in given.split(",") if m.strip()]:
        import_recipes(module, what="--modules")
    if args.name is not None:
        args.name = resolve_name(args.name)
    if args.name is None:
        print("\n".join(listing()))
        return 0
    if args.name not in TRAINING_CONFIGS:
        raise _unknown(args.name)
    factory = TRAINING_CONFIGS[args.name]
    print(inspect.getdoc(factory) or "")
    params = inspect.signature(factory).parameters
    options = _placeholders(args.name)
    if params:  # a factory option without a default names a path the run must give
        shown = ", ".join(f"{k}={options.get(k, p.default)}" for k, p in params.items())
        print(f"  options (train.algorithm_kwargs.KEY): {shown}")
    cfg = _build(args.name, options)
    for role in cfg.roles:
        flags = ", ".join(
            f for f, on in (("trainable", role.trainable), ("sync_to_rollout", role.sync_to_rollout)) if on
        )
        print(f"  role {role.name}: {role.specialization_cls.__name__}({role.init_kwargs}) [{flags or 'frozen'}]")
    for sync in cfg.syncs:
        print(
            f"  sync {sync.source}.{','.join(sync.keys)} -> {sync.target}.{','.join(sync.target_keys)} ({sync.stage})"
        )
    _print_options(args.name, cfg)
    return 0


def _print_options(name: str, cfg: TrainingConfig) -> None:
    """Every option ``train.algorithm_kwargs`` takes for recipe ``name``, with its value here and meaning."""
    valid = specialization_options(cfg.policy_role.specialization_cls)
    print(
        f"  every option (train.algorithm_kwargs.KEY=VALUE; VALUE as this recipe runs; role {cfg.policy_role.name}: "
        f"{cfg.policy_role.specialization_cls.__name__}):"
    )
    for key, value, meaning, inert in recipe_options(name):
        shown = "<required>" if value is REQUIRED else _shown(value)
        text = meaning + (f" Does nothing here: {inert}." if inert else "")
        print(f"    {key}={shown}")
        if text:
            print(textwrap.fill(text, width=100, initial_indent=" " * 8, subsequent_indent=" " * 8))
    if valid is None:
        print(f"    (and any keyword {cfg.policy_role.specialization_cls.__name__}.__init__ takes: **kwargs)")
    has_reference = bool(frozen_policy_copies(cfg))
    if has_reference or "kl_coef" in inspect.signature(TRAINING_CONFIGS[name]).parameters:
        where = "" if has_reference else " (with a reference: train.algorithm_kwargs.kl_coef > 0)"
        print(f"  the reference role following the policy{where}:")
        for key, value in REFERENCE_SYNC_OPTIONS.items():
            print(f"    {key}={_shown(value)}")
            print(
                textwrap.fill(_REFERENCE_SYNC_DOCS[key], width=100, initial_indent=" " * 8, subsequent_indent=" " * 8)
            )
    for k, setting in RUN_SET_OPTIONS.items():
        if valid is not None and k in valid:
            print(f"  set by the run, not train.algorithm_kwargs: {k} = {setting}")
