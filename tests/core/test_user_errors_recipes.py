"""Recipe mistakes of a Python user, each one line naming the key: a value of the wrong type in
``train.algorithm_kwargs`` or a specialization's options (it used to be a raw comparison error), a
``DataSync`` given a string for its keys, and a recipe registered by a script's ``__main__`` in a run
whose roles get worker processes of their own (they failed with "unknown recipe" once started)."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest

from areno.api.config import load_config
from areno.api.preflight import check_run
from areno.errors import ConfigError
from areno.recipes import DataSync, get_recipe
from areno.recipes.registry import TRAINING_CONFIGS, worker_name_problem
from areno.specializations import ActorConfig, CriticSpecialization, DPOSpecialization, LogProbSpecialization
from tests.helpers.configs import tiny_run_overrides
from tests.helpers.recipes import user_code_dir


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: ActorConfig(clip_eps="0.2"), "ActorConfig.clip_eps: must be a number, got '0.2'"),
        (lambda: ActorConfig(kl_coef="0.1"), "ActorConfig.kl_coef: must be a number, got '0.1'"),
        (lambda: ActorConfig(clip_eps=None), "ActorConfig.clip_eps: must be a number, got null"),
        (lambda: ActorConfig(entropy_coef=[0.1]), "ActorConfig.entropy_coef: must be a number, got [0.1]"),
        (
            lambda: CriticSpecialization(value_clip_eps="0.2"),
            "CriticSpecialization.value_clip_eps: must be a number or null, got '0.2'",
        ),
        (
            lambda: LogProbSpecialization(temperature="1"),
            "LogProbSpecialization.temperature: must be a number, got '1'",
        ),
        (lambda: DPOSpecialization(beta="0.1"), "DPOSpecialization.beta: must be a number, got '0.1'"),
    ],
)
def test_specialization_options_check_their_types_first(make, message):
    with pytest.raises(ConfigError) as info:
        make()
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("recipe", "kwargs", "message"),
    [
        ("grpo", {"clip_eps": "0.2"}, "train.algorithm_kwargs.clip_eps: must be a number, got '0.2'"),
        ("grpo", {"kl_coef": "0.05"}, "train.algorithm_kwargs.kl_coef: must be a number, got '0.05'"),  # a factory's
        ("dpo", {"beta": "0.1"}, "train.algorithm_kwargs.beta: must be a number, got '0.1'"),
    ],
)
def test_algorithm_kwargs_of_the_wrong_type_name_the_key(recipe, kwargs, message):
    with pytest.raises(ConfigError) as info:
        get_recipe(recipe, policy_kwargs=kwargs)
    assert str(info.value) == message


def test_an_override_of_the_wrong_type_is_refused_at_preflight(tmp_path):
    with pytest.raises(ConfigError, match=r"^train\.algorithm_kwargs\.clip_eps: must be a number, got 'abc'$"):
        check_run(load_config(None, [*tiny_run_overrides(tmp_path), "train.algorithm_kwargs.clip_eps=abc"]))


@pytest.mark.parametrize("field", ["keys", "target_keys"])
def test_a_string_for_data_sync_keys_shows_the_tuple(field):
    given = {"keys": ("logprobs_T",), field: "logprobs_T"}
    with pytest.raises(ConfigError) as info:
        DataSync(source="reference", target="policy", **given)
    assert str(info.value) == (
        f"DataSync reference->policy: {field} must be a tuple of names, got the string 'logprobs_T': "
        f"write {field}=('logprobs_T',)"
    )


def _walk_kl():
    return dataclasses.replace(get_recipe("grpo", kl_coef=0.05), name="walk_kl")


@pytest.fixture
def main_recipe(tmp_path, monkeypatch):
    """``walk_kl`` registered by a script ``run.py`` run as ``__main__`` from ``tmp_path``."""
    script = types.ModuleType("__main__")
    script.__file__ = str(tmp_path / "run.py")
    monkeypatch.setitem(sys.modules, "__main__", script)
    monkeypatch.setattr(_walk_kl, "__module__", "__main__")
    monkeypatch.setitem(TRAINING_CONFIGS, "walk_kl", _walk_kl)
    monkeypatch.chdir(tmp_path)


def test_a_main_recipe_is_refused_only_where_workers_start(tmp_path, main_recipe):
    overrides = [*tiny_run_overrides(tmp_path), "train.algorithm=walk_kl", "reward.sandbox=false"]
    check_run(load_config(None, overrides))  # colocated: every role in this process, which registered it
    with pytest.raises(ConfigError) as info:
        check_run(load_config(None, [*overrides, "cluster.role_devices={ref: [1]}"]))
    message = str(info.value)
    assert message.startswith(
        "train.algorithm='walk_kl': the worker processes of cluster.role_devices resolve the recipe by name in a "
        "fresh interpreter, but it is registered by the script ./run.py (__main__), which they do not run: name it "
        "./run.py:walk_kl so they import it"
    ), message
    assert "\n" not in message


def test_a_recipe_of_an_imported_module_is_named_by_its_module(tmp_path, monkeypatch):
    with user_code_dir(tmp_path, monkeypatch) as path:
        (path / "walk_recipes.py").write_text(
            "from areno.recipes import get_recipe, recipe\n\n\n"
            '@recipe("walk_mod")\n'
            "def walk_mod():\n"
            "    return get_recipe('grpo')\n"
        )
        sys.path.insert(0, str(path))
        __import__("walk_recipes")
        assert worker_name_problem("walk_mod") == (
            "registered by module walk_recipes, which they do not import: name it walk_recipes:walk_mod"
        )
        assert worker_name_problem("walk_recipes:walk_mod") is None  # imported by every process first
    assert worker_name_problem("grpo") is None  # areno's own
