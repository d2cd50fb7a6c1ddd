"""User code named by config: a ``@recipe`` module (``train.algorithm=module:name``, ``areno recipes
--modules``) and a reward (``reward.fn``) from the working directory or a file path, in-process and
in the reward sandbox's workers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from areno.api.config import load_config
from areno.cli import main
from areno.errors import RewardImportError
from areno.recipes.registry import TRAINING_CONFIGS
from areno.rewards.loader import import_object, resolve_path
from tests.helpers.configs import train_args

RECIPES = '''
from areno.recipes import ModelRole, TrainingConfig, recipe
from areno.specializations import ActorSpecialization


@recipe("{name}")
def my_grpo():
    """My GRPO: a user's recipe."""
    policy = ModelRole(name="policy", specialization_cls=ActorSpecialization, sync_to_rollout=True,
                       init_kwargs={{"advantage_estimator": "grpo", "clip_eps": 0.2}})
    return TrainingConfig(name="{name}", roles=(policy,), description="My GRPO: a user's recipe.")
'''

REWARD = """
def {fn}(prompt, completion, answer, **fields):
    return {value}
"""


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """``tmp_path`` as the working directory; sys.path, sys.modules and the registry restored after."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    saved_recipes = dict(TRAINING_CONFIGS)
    yield tmp_path
    for name, module in list(sys.modules.items()):  # the user modules imported from tmp_path
        if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]
    TRAINING_CONFIGS.clear()
    TRAINING_CONFIGS.update(saved_recipes)


def _rewards(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["rollout/reward_mean"] for r in rows if "rollout/reward_mean" in r]


def test_user_recipe_module_is_listed(user_dir, capsys):
    (user_dir / "my_recipes.py").write_text(RECIPES.format(name="my_listed"))
    assert main(["recipes", "--modules", "my_recipes"]) == 0
    out = capsys.readouterr().out
    assert "my_listed" in out and "My GRPO: a user's recipe." in out and "grpo" in out
    assert main(["recipes", "my_recipes:my_listed"]) == 0
    assert "role policy: ActorSpecialization" in capsys.readouterr().out
    assert main(["recipes", "--modules", "no_such_recipes"]) == 2
    assert "areno: error: --modules: cannot import module 'no_such_recipes'" in capsys.readouterr().err


@pytest.mark.parametrize("form", ["module", "file"])
def test_user_recipe_trains_through_areno_train(user_dir, form):
    (user_dir / "my_recipes.py").write_text(RECIPES.format(name=f"my_{form}"))
    algorithm = f"my_recipes:my_{form}" if form == "module" else f"./my_recipes.py:my_{form}"
    rc = main(train_args(user_dir, "train.steps=2", "reward.sandbox=false", "--algorithm", algorithm))
    assert rc == 0
    assert len(_rewards(user_dir / "run")) == 2
    assert f"my_{form}" in TRAINING_CONFIGS


def test_user_recipe_errors_are_one_line(user_dir, capsys):
    (user_dir / "my_recipes.py").write_text(RECIPES.format(name="my_other"))
    assert main(train_args(user_dir, "train.algorithm=my_recipes:my_typo")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "registers no recipe 'my_typo'" in err[0], err
    assert main(train_args(user_dir, "train.algorithm=./missing.py:x")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing.py does not exist" in err[0], err


@pytest.mark.parametrize("sandbox", ["false", "true"])
@pytest.mark.parametrize("form", ["module", "file"])
def test_reward_from_the_working_directory_or_a_file(user_dir, form, sandbox):
    """``vowel_reward:reward`` imports from the cwd and ``./rewards.py:score`` from its file, the
    same way in the sandbox's workers (which run in a temporary directory of their own)."""
    value = 0.25 if form == "module" else 0.5
    if form == "module":
        module = f"vowel_reward_{sandbox}"
        (user_dir / f"{module}.py").write_text(REWARD.format(fn="reward", value=value))
        fn = f"{module}:reward"
    else:
        (user_dir / "rewards.py").write_text(REWARD.format(fn="score", value=value))
        fn = "./rewards.py:score"
    workers = ["reward.workers=1"] if sandbox == "true" else []  # in-process: no workers to size
    rc = main(train_args(user_dir, "train.steps=2", f"reward.fn={fn}", f"reward.sandbox={sandbox}", *workers))
    assert rc == 0
    assert _rewards(user_dir / "run") == [value, value]


def test_file_paths_resolve_to_absolute_ones(user_dir):
    (user_dir / "rewards.py").write_text(REWARD.format(fn="score", value=1.0))
    assert resolve_path("./rewards.py:score") == f"{user_dir.resolve() / 'rewards.py'}:score"
    assert resolve_path("pkg.mod:fn") == "pkg.mod:fn"
    assert import_object("./rewards.py:score", what="reward.fn") is import_object(
        f"{user_dir / 'rewards.py'}:score", what="reward.fn"
    )  # one module per file, however it is named


@pytest.mark.parametrize(
    ("path", "fragment"),
    [
        ("./nope.py:score", "nope.py does not exist"),
        ("./rewards.py:nope", "has no attribute 'nope'"),
        ("./rewards.py", "is not a path like"),
        ("no_such_reward_module:score", "cannot import module 'no_such_reward_module'"),
    ],
)
def test_bad_reward_paths_are_one_line_reward_import_errors(user_dir, path, fragment):
    (user_dir / "rewards.py").write_text(REWARD.format(fn="score", value=1.0))
    with pytest.raises(RewardImportError, match=fragment) as info:
        import_object(path, what="reward.fn")
    assert "\n" not in str(info.value)


def test_the_config_names_user_files_by_absolute_path(user_dir):
    """A reward or workflow file named from the working directory is made absolute at load, so a worker
    started elsewhere, or a resume from another directory, imports the same file."""
    (user_dir / "rewards.py").write_text(REWARD.format(fn="score", value=1.0))
    cfg = load_config(None, ["model.path=/m", "reward.fn=./rewards.py:score", "rollout.workflow=./wf.py:W"])
    assert cfg.reward.fn == f"{user_dir.resolve() / 'rewards.py'}:score"
    assert cfg.rollout.workflow == f"{user_dir.resolve() / 'wf.py'}:W"
    assert load_config(None, ["model.path=/m"]).rollout.workflow == "areno.workflows.rlvr:RLVRWorkflow"
