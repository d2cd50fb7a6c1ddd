"""User code that is wrong, named by config: a reward or workflow module that fails to import, a
reward whose signature cannot take the workflows' call, a reward that returns something other than a
number, and a shipped reward given a row without an answer. Each is a one-line error naming the
config key and the fix, or a counted reward error; never a traceback, never a silent score."""

from __future__ import annotations

import asyncio
import sys

import numpy as np
import pytest

from areno.cli import main
from areno.errors import ConfigError, RewardImportError
from areno.recipes.registry import TRAINING_CONFIGS
from areno.rewards.code import code_execution
from areno.rewards.loader import check_reward_signature, import_object
from areno.rewards.math import math_verify
from areno.rewards.sandbox import RewardFailure, RewardSandbox
from areno.rewards.tasks import exact_match
from areno.workflows.base import RolloutWorkflow, load_workflow, workflow_factory
from areno.workflows.common import acall_reward
from tests.helpers.configs import train_args

WORKFLOW = """
from areno.workflows.base import RolloutWorkflow


class MyWF(RolloutWorkflow):
    def __init__(self, **kwargs):
        self.kwargs = kwargs

    async def run_episode(self, client, sample):
        raise RuntimeError("not run here")
"""

BAD_MODULES = {
    "syntax": ("def f(:\n", "SyntaxError: invalid syntax", 1),
    "nameerr": ("x = 1\ny = undefined_name\n", "NameError: name 'undefined_name' is not defined", 2),
    "raising": ("raise RuntimeError('bad config\\nsecond line')\n", "RuntimeError: bad config", 1),
    "missingdep": ("import no_such_dependency_xyz\n", "No module named 'no_such_dependency_xyz'", 1),
    "exits": ("import sys\nsys.exit(3)\n", "SystemExit: 3", 2),
}


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """``tmp_path`` as the working directory, holding package ``rw`` with each of BAD_MODULES and a
    good workflow module; sys.path, sys.modules and the recipe registry restored after."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    saved_recipes = dict(TRAINING_CONFIGS)
    (tmp_path / "rw").mkdir()
    for name, (source, _, _) in BAD_MODULES.items():
        (tmp_path / "rw" / f"{name}.py").write_text(source)
    (tmp_path / "rw" / "wf.py").write_text(WORKFLOW)
    yield tmp_path
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]
    TRAINING_CONFIGS.clear()
    TRAINING_CONFIGS.update(saved_recipes)


def _one_line_error(rc: int, stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert lines[0].startswith("areno: error: "), lines[0]
    return lines[0]


# ------------------------------------------------------------------------------- import failures
@pytest.mark.parametrize("form", ["file", "module"])
@pytest.mark.parametrize("name", list(BAD_MODULES))
def test_a_module_that_fails_to_import_is_one_line(user_dir, name, form):
    _, fragment, line = BAD_MODULES[name]
    path = f"./rw/{name}.py:f" if form == "file" else f"rw.{name}:f"
    with pytest.raises(RewardImportError) as info:
        import_object(path, what="reward.fn")
    message = str(info.value)
    assert "\n" not in message and message.startswith("reward.fn: importing "), message
    assert fragment in message and f"line {line}" in message, message
    assert str(user_dir / "rw" / f"{name}.py") in message  # the file where it failed
    fix = "install what it imports, or fix the import" if name == "missingdep" else "fix the module"
    assert message.endswith(fix), message
    assert info.value.__cause__ is not None  # the original exception stays chained for debugging


def test_a_fixed_file_imports_after_a_failed_import(user_dir):
    with pytest.raises(RewardImportError):
        import_object("./rw/syntax.py:f", what="reward.fn")
    (user_dir / "rw" / "syntax.py").write_text("def f(prompt, completion, answer, **row):\n    return 1.0\n")
    assert import_object("./rw/syntax.py:f", what="reward.fn")("p", "c", "a") == 1.0


@pytest.mark.parametrize("path", ["./rw/syntax.py:f", "rw.syntax:f", "rw.nameerr:f"])
def test_a_reward_that_fails_to_import_exits_2_with_one_line(user_dir, capsys, path):
    rc = main(train_args(user_dir, f"reward.fn={path}"))
    line = _one_line_error(rc, capsys.readouterr().err)
    assert "reward.fn: importing " in line and "fix the module" in line
    assert not (user_dir / "run").exists() and not (user_dir / "model").exists()  # before any work


# ------------------------------------------------------------------------------------- workflows
@pytest.mark.parametrize("path", ["./rw/wf.py:MyWF", "rw/wf.py:MyWF", "rw.wf:MyWF", "rw.wf.MyWF"])
def test_a_workflow_imports_from_a_file_or_the_working_directory(user_dir, path):
    factory = workflow_factory(path)
    assert issubclass(factory, RolloutWorkflow) and factory.__name__ == "MyWF"
    assert load_workflow(path, n_samples=2).kwargs == {"n_samples": 2}


@pytest.mark.parametrize(
    ("path", "fragment"),
    [
        ("./rw/syntax.py:MyWF", "importing " + "{dir}/rw/syntax.py failed at line 1: SyntaxError"),
        ("rw.nameerr:MyWF", "importing rw.nameerr failed at {dir}/rw/nameerr.py line 2: NameError"),
        ("./rw/nope.py:MyWF", "nope.py does not exist"),
        ("rw.wf:Nope", "module 'rw.wf' has no attribute 'Nope'"),
        ("no_such_wf_module:MyWF", "cannot import module 'no_such_wf_module'"),
        ("MyWF", "is not a path like"),
    ],
)
def test_a_bad_workflow_is_a_one_line_error_naming_rollout_workflow(user_dir, path, fragment):
    with pytest.raises(RewardImportError) as info:
        workflow_factory(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith("rollout.workflow: "), message
    assert fragment.format(dir=user_dir) in message, message


def test_a_workflow_that_fails_to_import_exits_2_with_one_line(user_dir, capsys):
    rc = main(train_args(user_dir, "rollout.workflow=./rw/syntax.py:MyWF"))
    line = _one_line_error(rc, capsys.readouterr().err)
    assert "rollout.workflow: importing " in line and "SyntaxError" in line


def test_recipes_modules_errors_name_the_option(user_dir, capsys):
    assert main(["recipes", "--modules", "no_such_recipes_module"]) == 2
    line = _one_line_error(2, capsys.readouterr().err)
    assert "--modules: cannot import module 'no_such_recipes_module'" in line
    assert main(["recipes", "--modules", "./rw/syntax.py"]) == 2
    line = _one_line_error(2, capsys.readouterr().err)
    assert "--modules: importing " in line and "SyntaxError" in line
    with pytest.raises(ConfigError, match="train.algorithm: importing rw.nameerr failed"):
        from areno.recipes.registry import resolve_name

        resolve_name("rw.nameerr:my_algo")


# ----------------------------------------------------------------------------- reward signatures
def twoargs(prompt, completion):
    return 1.0


def three(prompt, completion, answer):
    return 1.0


def renamed(p, c, a, **row):
    return 1.0


def star_args(*args, **kwargs):
    return 1.0


def only_args(*args):
    return 1.0


def two_and_kwargs(prompt, completion, **kwargs):
    return 1.0


class Scorer:
    def __call__(self, prompt, completion, answer, **row):
        return 1.0


class TwoArgScorer:
    def __call__(self, prompt, completion):
        return 1.0


ROW_KEYS = ["id", "difficulty"]


@pytest.mark.parametrize("fn", [renamed, star_args, Scorer(), exact_match, math_verify, code_execution, max])
def test_rewards_that_take_the_call_pass_the_signature_check(fn):
    check_reward_signature(fn, "m:f", ROW_KEYS)


@pytest.mark.parametrize(
    ("fn", "keys", "fragment"),
    [
        (twoargs, [], "too many positional arguments"),
        (two_and_kwargs, [], "too many positional arguments"),
        (only_args, ROW_KEYS, "unexpected keyword argument 'difficulty'"),
        (TwoArgScorer(), [], "too many positional arguments"),
        (three, ROW_KEYS, "unexpected keyword argument 'difficulty'"),
        (renamed, ["p"], "multiple values for argument 'p'"),
    ],
)
def test_a_reward_that_cannot_take_the_call_is_one_line(fn, keys, fragment):
    with pytest.raises(RewardImportError) as info:
        check_reward_signature(fn, "./rw/r.py:f", keys)
    message = str(info.value)
    assert "\n" not in message and message.startswith("reward.fn: ./rw/r.py:f takes ("), message
    assert "called as fn(prompt, completion, answer, **row)" in message and fragment in message
    assert message.endswith("make it take (prompt, completion, answer, **row), or add **kwargs"), message
    if keys:
        assert str(sorted(keys)) in message


def test_positional_only_rewards_pass_without_row_fields():
    check_reward_signature(three, "m:f", [])
    check_reward_signature(only_args, "m:f", [])


# ------------------------------------------------------------------------- what a reward returns
def _call(value):
    async def reward(prompt, completion, answer, **row):
        return value

    return asyncio.run(acall_reward(reward, "p", "c", "a", {}))


@pytest.mark.parametrize("value", ["0.5", None, [1.0]])
def test_a_reward_that_is_not_a_number_is_a_reward_error(value, caplog):
    reward, error = _call(value)
    assert reward == 0.0 and error is not None
    assert error.startswith("TypeError: the reward function returned ") and type(value).__name__ in error
    assert repr(value)[:20] in error and "not a number: return a float" in error
    assert "reward set to 0" in caplog.text


@pytest.mark.parametrize("value", [0.5, 1, np.float32(0.5), np.float64(0.25), np.int64(1), True, False, np.bool_(True)])
def test_numbers_and_bools_are_rewards(value):
    assert _call(value) == (float(value), None)


def test_a_sandboxed_reward_that_is_not_a_number_is_a_counted_error(tmp_path):
    (tmp_path / "r.py").write_text("def f(prompt, completion, answer=None, **row):\n    return eval(completion)\n")
    with RewardSandbox(f"{tmp_path / 'r.py'}:f", workers=1, timeout_s=60.0) as pool:
        assert pool.score("p", "0.5") == 0.5
        assert pool.score("p", "True") == 1.0  # a comparison's result
        for completion, named in [("'0.5'", "str '0.5'"), ("None", "NoneType None")]:
            with pytest.raises(RewardFailure) as info:
                pool.score("p", completion)
            assert info.value.kind == "error" and named in str(info.value), str(info.value)
        assert pool.metrics()["rollout/reward_failures_error"] == 2.0
        assert pool.score("p", "1") == 1.0  # the worker keeps scoring


# --------------------------------------------------------------------------- rows without answers
@pytest.mark.parametrize("reward", [exact_match, math_verify])
def test_shipped_rewards_refuse_a_missing_answer(reward):
    with pytest.raises(ValueError, match="answer is missing or null: set data.answer_key"):
        reward("p", "None", None)
    assert reward.areno_needs_answer  # preflight refuses rows without one before the run


def test_exact_match_scores_a_row_without_answer_as_a_reward_error():
    reward, error = asyncio.run(acall_reward(exact_match, "1+1=", "None", None, {}))
    assert reward == 0.0 and "data.answer_key" in error
    assert exact_match("1+1=", "2\nmore", "2") == 1.0 and exact_match("1+1=", "3", 2) == 0.0


def test_shipped_rewards_score_a_trl_conversational_answer_by_its_text():
    # the answer SFT trains on (completion_text), not the Python repr of the message list
    answer = [{"role": "assistant", "content": "7"}]
    assert exact_match("3+4=", "7", answer) == 1.0 and exact_match("3+4=", "8", answer) == 0.0
    assert math_verify("3+4=", "\\boxed{7}", answer) == 1.0 and math_verify("3+4=", "\\boxed{8}", answer) == 0.0
    with pytest.raises(ValueError, match="a message is not the assistant's"):
        exact_match("3+4=", "7", [{"role": "user", "content": "7"}])


def test_code_execution_refuses_a_conversational_answer_as_tests():
    # assistant messages are a reference solution, not tests: named, never run as code
    with pytest.raises(ValueError, match="code tests must be .*got list: put them in the row's 'tests' field"):
        code_execution("p", "print(1)", [{"role": "assistant", "content": "print(1)"}])


def test_code_execution_without_tests_or_answer_names_the_fix():
    with pytest.raises(ValueError, match="add a 'tests' field, or set data.answer_key"):
        code_execution("p", "print(1)", None)


def test_a_reward_module_reading_a_relative_file_in_a_sandbox_worker_is_told_why(tmp_path, monkeypatch):
    """walk31: a module opening lookup.json relative to the working directory imports in the trainer but not
    in the sandbox's workers, whose working directory is a private temporary one: the error says so."""
    module = tmp_path / "rw_cwd.py"
    module.write_text("import json\nTABLE = json.load(open('lookup.json'))\n\ndef score(p, c, a):\n    return 1.0\n")
    worker_dir = tmp_path / "areno-reward-abc"
    worker_dir.mkdir()
    monkeypatch.chdir(worker_dir)
    with pytest.raises(RewardImportError, match="private temporary directory, not the run's: open files by absolute"):
        import_object(f"{module}:score", what="reward.fn")
