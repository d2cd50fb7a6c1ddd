"""The recipe registry: ``@recipe("name")`` registers a factory returning a ``TrainingConfig``.

A user's recipe lives in their own module: ``train.algorithm=my_pkg.recipes:my_algo`` (or
``./my_recipes.py:my_algo``) imports that module, whose ``@recipe("my_algo")`` registers it, in
every process that resolves the recipe; ``areno recipes --modules my_pkg.recipes`` lists it.
"""

from __future__ import annotations

import difflib
import inspect
import os
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from areno.errors import ConfigError, is_of_type, wrong_type
from areno.recipes.config import TrainingConfig
from areno.rewards.loader import USER_FILE_MODULE, import_module
from areno.specializations.base import option_types

RecipeFactory = Callable[..., TrainingConfig]
TRAINING_CONFIGS: dict[str, RecipeFactory] = {}
"""Recipe name -> factory. Factories may take keyword options (e.g. ``teacher_path``)."""


def recipe(name: str) -> Callable[[RecipeFactory], RecipeFactory]:
    """Register ``factory`` under ``name`` (another factory under a registered name is an error)."""

    def register(factory: RecipeFactory) -> RecipeFactory:
        if name in TRAINING_CONFIGS and _source(TRAINING_CONFIGS[name]) != _source(factory):
            raise ConfigError(f"recipe {name!r} is already registered by {TRAINING_CONFIGS[name].__qualname__}")
        TRAINING_CONFIGS[name] = factory
        return factory

    return register


def _source(factory: RecipeFactory) -> tuple[str, str]:
    """Where ``factory`` is defined (file, qualified name): one module imported twice in a process, by
    name (``--modules my_recipes``) and by path (``./my_recipes.py:NAME``), registers the same factory
    again, which is no clash."""
    code = getattr(factory, "__code__", None)
    return (os.path.realpath(code.co_filename) if code else repr(factory), factory.__qualname__)


def _unknown(name: str) -> ConfigError:
    close = difflib.get_close_matches(name, list(TRAINING_CONFIGS), n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    return ConfigError(
        f"unknown recipe {name!r}: {hint}`areno recipes` lists the {len(TRAINING_CONFIGS)} registered ones"
    )


def import_recipes(module: str, *, what: str = "train.algorithm") -> None:
    """Import a user's module of ``@recipe`` factories (a dotted name found on sys.path or in the
    working directory, or a ``.py`` file); a bad one is a one-line :class:`ConfigError` naming
    ``what`` (where the module was named)."""
    import_module(module, what=what, error=ConfigError)


def resolve_name(name: str) -> str:
    """The registered name of ``name``: a plain recipe name, or ``module:recipe`` whose module is
    imported first (so its ``@recipe`` runs)."""
    module, sep, short = name.rpartition(":")
    if not sep:
        return name
    import_recipes(module)
    if short not in TRAINING_CONFIGS:
        raise ConfigError(
            f"train.algorithm: module {module!r} registers no recipe {short!r}: decorate its factory with "
            f"@recipe({short!r})"
        )
    return short


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
    return cfg.with_policy_kwargs(**policy_kwargs)


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


def describe(name: str) -> str:
    """First line of the recipe factory's docstring."""
    if name not in TRAINING_CONFIGS:
        raise _unknown(name)
    doc = inspect.getdoc(TRAINING_CONFIGS[name]) or ""
    return doc.splitlines()[0] if doc else ""


def list_recipes() -> list[tuple[str, str]]:
    """(name, one-line description) of every registered recipe, sorted by name."""
    return [(name, describe(name)) for name in sorted(TRAINING_CONFIGS)]


def main(argv: list[str] | None = None) -> int:
    """``areno recipes [--modules M[,M...]] [NAME]``: list the recipes, or print one recipe's formula and roles."""
    import argparse

    parser = argparse.ArgumentParser(prog="areno recipes", description="List the registered recipes.")
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
        rows = list_recipes()
        width = max(len(n) for n, _ in rows)
        for name, desc in rows:
            print(f"{name:<{width}}  {desc}")
        return 0
    if args.name not in TRAINING_CONFIGS:
        raise _unknown(args.name)
    factory = TRAINING_CONFIGS[args.name]
    print(inspect.getdoc(factory) or "")
    params = inspect.signature(factory).parameters
    options = {k: "<path>" for k, p in params.items() if p.default is None}
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
    return 0
