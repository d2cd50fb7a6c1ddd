"""The messages of plausible naming mistakes with user code (walk41a findings 8, 9): a recipe named by
its function instead of its @recipe name, a recipe name registered twice, a reward path naming a
module, a tool whose fn is not callable, a ToolSet of plain functions."""

from __future__ import annotations

import sys

import pytest

from areno.errors import ConfigError, RewardImportError
from areno.recipes.registry import resolve_name
from areno.rewards.loader import import_object, reward_function
from areno.workflows import Tool, ToolSet
from tests.helpers.recipes import user_code_dir

RECIPES = """
from areno.recipes import ModelRole, TrainingConfig, recipe
from areno.specializations import ActorSpecialization


def _config(name):
    role = ModelRole(name="policy", specialization_cls=ActorSpecialization, sync_to_rollout=True)
    return TrainingConfig(name=name, roles=(role,))


@recipe("other_name")
def make_it():
    return _config("other_name")


@recipe("second")
def second():
    return _config("second")
"""


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """``tmp_path`` as the working directory; sys.path, sys.modules and the registry restored after."""
    with user_code_dir(tmp_path, monkeypatch):
        sys.path.insert(0, str(tmp_path))
        yield tmp_path


def test_a_recipe_named_by_its_function_names_its_registered_name(user_dir):
    (user_dir / "walk41_recipes.py").write_text(RECIPES)
    with pytest.raises(ConfigError) as info:
        resolve_name("walk41_recipes:make_it")
    assert str(info.value) == (
        "train.algorithm: module 'walk41_recipes' registers no recipe 'make_it': its function make_it is registered "
        "as @recipe('other_name') (a recipe is named by its @recipe name): use walk41_recipes:other_name"
    )
    with pytest.raises(ConfigError) as info:
        resolve_name("walk41_recipes:unrelated")
    assert str(info.value) == (
        "train.algorithm: module 'walk41_recipes' registers no recipe 'unrelated'; it registers other_name, second "
        "(a recipe is named by its @recipe name): use walk41_recipes:other_name, or decorate a factory with "
        "@recipe('unrelated')"
    )
    with pytest.raises(ConfigError, match=r"registers no recipe 'secnod': did you mean second\? use "):
        resolve_name("walk41_recipes:secnod")
    assert resolve_name("walk41_recipes:second") == "second"


@pytest.mark.parametrize("named", ["file", "module"])
def test_a_recipe_name_registered_twice_names_the_first_ones_module_and_the_users_line(user_dir, named):
    (user_dir / "walk41_recipes.py").write_text(RECIPES)
    (user_dir / "dup.py").write_text(
        "import walk41_recipes\nfrom areno.recipes import recipe\n\n\n@recipe('second')\ndef mine():\n    pass\n"
    )
    with pytest.raises(ConfigError) as info:
        resolve_name("./dup.py:second" if named == "file" else "dup:second")
    where = (
        f"{user_dir / 'dup.py'} failed at line 5" if named == "file" else f"dup failed at {user_dir / 'dup.py'} line 5"
    )
    assert str(info.value) == (
        f"train.algorithm: importing {where}: ConfigError: recipe 'second' is already registered by second in "
        "walk41_recipes: register mine under another name: fix the module"
    )


def test_an_error_inside_a_module_the_user_imports_still_names_its_line(user_dir):
    (user_dir / "helper.py").write_text("x = 1\nraise KeyError('inner')\n")
    (user_dir / "outer.py").write_text("import helper\n")
    with pytest.raises(ConfigError, match=rf"failed at {user_dir / 'helper.py'} line 2: KeyError"):
        resolve_name("./outer.py:anything")


def test_a_reward_path_naming_a_module_says_so(user_dir):
    (user_dir / "walk41_pkg").mkdir()
    (user_dir / "walk41_pkg" / "__init__.py").write_text("")
    (user_dir / "walk41_pkg" / "rewards.py").write_text(
        "import math\n\n\ndef score(prompt, completion, answer, **row):\n    return 1.0\n"
    )
    message = (
        "reward.fn: 'walk41_pkg.rewards' names a module, not a function or class in it: add :NAME, e.g. "
        "walk41_pkg.rewards:score (it defines score)"
    )
    with pytest.raises(RewardImportError) as info:
        reward_function("walk41_pkg.rewards")
    assert str(info.value) == message
    import walk41_pkg.rewards  # noqa: F401  - now an attribute of its package: the same message

    with pytest.raises(RewardImportError) as info:
        reward_function("walk41_pkg.rewards")
    assert str(info.value) == message
    assert reward_function("walk41_pkg.rewards:score")("p", "c", "a") == 1.0
    with pytest.raises(RewardImportError, match="module 'walk41_pkg' has no attribute 'nothing'"):
        import_object("walk41_pkg.nothing", what="reward.fn")


SCHEMA = {"name": "lookup", "parameters": {"type": "object", "properties": {"key": {"type": "string"}}}}


def lookup(key: str = "pi") -> str:
    return key


def test_a_tool_whose_fn_is_not_callable_is_refused():
    with pytest.raises(TypeError) as info:
        Tool(fn="lookup", schema=SCHEMA)
    assert str(info.value) == (
        "tool 'lookup': fn must be the function to call, got str 'lookup': pass the function itself "
        "(fn=lookup, not fn='lookup')"
    )


def test_a_toolset_of_plain_functions_says_to_wrap_them():
    with pytest.raises(TypeError) as info:
        ToolSet([lookup])
    assert str(info.value) == (
        "ToolSet takes Tool objects, got the function lookup: wrap it with its OpenAI function schema, "
        "Tool(fn=lookup, schema={...})"
    )
    assert list(ToolSet([Tool(fn=lookup, schema=SCHEMA)]).tools) == ["lookup"]
