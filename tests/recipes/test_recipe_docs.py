"""The example of ``docs/recipes.md`` works as written: its ``my_recipes.py`` is listed by ``areno recipes``
and trains two steps on a tiny CPU model with a gradient; its loss returning a bare tensor is one line
naming ``compute_loss``."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from areno.cli import main
from tests.helpers.recipes import user_code_dir

DOC = Path(__file__).resolve().parents[2] / "docs" / "recipes.md"


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", DOC.read_text(), flags=re.S)


def _commands() -> list[list[str]]:
    """The ``areno`` command lines of the doc's bash block, without ``areno``."""
    text = _blocks("bash")[0].replace("\\\n", " ")
    return [shlex.split(line)[1:] for line in text.splitlines() if line.startswith("areno ")]


@pytest.fixture
def doc_dir(tmp_path, monkeypatch):
    """The doc's ``my_recipes.py`` in the working directory (``user_code_dir``)."""
    with user_code_dir(tmp_path, monkeypatch) as path:
        (path / "my_recipes.py").write_text(_blocks("python")[0])
        yield path


def test_the_docs_recipe_is_listed_and_trains(doc_dir, capsys):
    listing, train = _commands()
    assert listing[:2] == ["recipes", "--modules"] and train[0] == "train"
    assert main(listing) == 0
    assert "role policy: Reinforce({}) [trainable, sync_to_rollout]" in capsys.readouterr().out
    assert main([*train, "observe.console=false"]) == 0
    rows = [json.loads(line) for line in (doc_dir / "runs/reinforce/metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/policy/loss" in r]
    assert len(steps) == 2
    assert all(r["train/policy/grad_norm"] > 0 and r["train/policy/reinforce/advantage"] > 0 for r in steps)


def test_a_loss_without_metrics_is_one_line_naming_compute_loss(doc_dir, capsys):
    source = (doc_dir / "my_recipes.py").read_text()
    (doc_dir / "my_recipes.py").write_text(source.replace("return loss, metrics", "return loss"))
    _, train = _commands()
    assert main([*train, "observe.console=false", "run_dir=runs/bare", "data.num_eval=0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        "areno: error: Reinforce.compute_loss returned Tensor, expected a tuple (loss, metrics): return the loss "
        "reduced with the reducer (a 0-dim tensor) and a dict of metric tensors, e.g. `return loss, {}`"
    )


def test_the_docs_loss_that_needs_groups_refuses_one_sample(doc_dir, capsys):
    _, train = _commands()
    assert main([*train, "rollout.n_samples=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "areno: error: rollout.n_samples=1: recipe 'reinforce' (a group-mean baseline) compares the completions of "
        "a prompt within their group, so with one per prompt nothing trains (every advantage is 0, or every group "
        "is filtered out): set rollout.n_samples >= 2, or use a recipe without groups (e.g. reinforce_pp)"
    ]
    assert not (doc_dir / "runs").exists()  # before the tiny model is made


def test_a_loss_without_temperature_is_refused_before_the_run(doc_dir, capsys):
    source = (doc_dir / "my_recipes.py").read_text()
    init = "def __init__(self, *, temperature: float = 1.0) -> None:  # areno passes rollout.temperature\n"
    assert init + "        self.temperature = temperature" in source
    fixed = "def __init__(self) -> None:\n        self.temperature = 1.0"
    (doc_dir / "my_recipes.py").write_text(source.replace(init + "        self.temperature = temperature", fixed))
    _, train = _commands()
    assert main([*train, "warm_start.steps=5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("areno: error: role 'policy': bad arguments for Reinforce"), err
    assert "areno passes temperature=rollout.temperature to an online recipe's policy role" in err[0]
    assert not (doc_dir / "runs").exists()  # before the tiny model or the warm start
