"""docs/from_trl.md stays true: every areno key its GRPOConfig tables name is a setting of the run's
config or an option of the recipe the row names, every value it gives an option is one the option takes,
its count of mapped and unsupported fields is the tables', and its side-by-side YAML, rewards and
GRPOConfig agree. With TRL installed, every field of the tables' first column is a real
``trl.GRPOConfig`` field and the first table covers every field GRPOConfig adds to TrainingArguments."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from areno.api.config import load_config
from areno.recipes import TRAINING_CONFIGS, get_recipe
from areno.recipes.registry import REFERENCE_SYNC_OPTIONS, role_settings
from areno.rewards.sandbox import reward_parts
from areno.specializations.actor import ActorConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "from_trl.md"
TEXT = DOC.read_text()
OWN, GENERIC = "### GRPO's own fields", "### The TrainingArguments fields a GRPO run sets"
KWARGS = "train.algorithm_kwargs."
MODEL = "model.path=/nonexistent/model"
"""``model.path`` is mandatory; nothing here loads it."""


def _rows(heading: str) -> list[list[str]]:
    """The body rows of the table under ``heading``, three cells each."""
    lines = TEXT.split(heading, 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == 3, line
        rows.append(cells)
    return rows


ROWS = {OWN: _rows(OWN), GENERIC: _rows(GENERIC)}
ALL_ROWS = [row for rows in ROWS.values() for row in rows]


def _ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


@functools.cache
def _defaults() -> object:
    return load_config(None, [MODEL])


@functools.cache
def _top_level() -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(_defaults()))


def _is_config_key(token: str) -> bool:
    """``section.key[=value]`` or a top-level setting (``run_dir``, ``resume=auto``)."""
    name = token.split("=", 1)[0]
    return (
        re.fullmatch(r"[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)*", name) is not None
        and name.split(".", 1)[0] in _top_level()
    )


def _row_recipe(row: list[str]) -> str:
    """The recipe a row's areno and note cells name first (``grpo_async``, ``train.algorithm=gspo``), else grpo."""
    for token in _ticked(row[1]) + _ticked(row[2]):
        name = token.removeprefix("train.algorithm=")
        if name in TRAINING_CONFIGS:
            return name
    return "grpo"


def test_the_tables_are_read():
    assert len(ROWS[OWN]) >= 40 and len(ROWS[GENERIC]) >= 20
    assert all(_ticked(row[0]) for row in ALL_ROWS)


@pytest.mark.parametrize("row", ALL_ROWS, ids=lambda row: _ticked(row[0])[0])
def test_a_row_names_real_areno_keys_or_says_not_supported(row):
    keys = [t for t in _ticked(row[1]) if t.startswith(KWARGS) or _is_config_key(t)]
    assert row[1] == "not supported" or (keys and _ticked(row[1])[0] in keys), row
    defaults = _defaults()
    recipe = _row_recipe(row)
    for token in _ticked(row[1]) + _ticked(row[2]):
        key, _, value = token.partition("=")
        if key.startswith(KWARGS):
            _check_option(recipe, key[len(KWARGS) :], value)
        elif _is_config_key(token):  # a real key: load_config refuses an unknown one, naming it
            current = defaults
            for part in key.split("."):
                current = getattr(current, part)
            load_config(None, [MODEL, f"{key}={json.dumps(current)}"])


def _check_option(recipe: str, key: str, value: str) -> None:
    """``key`` is an option of ``recipe`` (its factory's, or its policy's ``ActorConfig``), and ``value``,
    when given, one it takes."""
    params = inspect.signature(TRAINING_CONFIGS[recipe]).parameters
    if key in params:
        get_recipe(recipe, policy_kwargs={key: yaml.safe_load(value) if value else params[key].default})
        return
    if key in REFERENCE_SYNC_OPTIONS:  # every recipe's, with a reference: grpo's comes with kl_coef > 0
        given = {"kl_coef": 0.04} if "kl_coef" in params else {}
        given |= {"ref_sync_steps": 512} | ({key: yaml.safe_load(value)} if value else {})
        assert get_recipe(recipe, policy_kwargs=given).reference_sync is not None
        return
    settings = role_settings(get_recipe(recipe).policy_role)
    assert key in settings and key in {f.name for f in dataclasses.fields(ActorConfig)}, (recipe, key)
    get_recipe(recipe, policy_kwargs={key: settings[key]})  # the recipe takes the option (its value unchanged)
    if value:
        ActorConfig(**{**settings, key: yaml.safe_load(value)})  # and the value is one the option takes


def _fields(rows: list[list[str]]) -> list[str]:
    return [name for row in rows for name in _ticked(row[0])]


def _count(rows: list[list[str]]) -> tuple[int, int]:
    """(mapped, not supported) fields of ``rows``."""
    unsupported = sum(len(_ticked(row[0])) for row in rows if row[1] == "not supported")
    return len(_fields(rows)) - unsupported, unsupported


def test_the_counts_are_the_tables():
    own, generic = _fields(ROWS[OWN]), _fields(ROWS[GENERIC])
    assert len(own) == len(set(own)) and len(generic) == len(set(generic)) and not set(own) & set(generic)
    said = re.search(
        r"of GRPOConfig's (\d+) fields of its own, (\d+) have an areno counterpart.*? and (\d+) are not supported; "
        r"of the (\d+) TrainingArguments fields above, (\d+) map and (\d+) do not",
        " ".join(TEXT.split()),
    )
    assert said is not None
    numbers = [int(n) for n in said.groups()]
    assert numbers == [len(own), *_count(ROWS[OWN]), len(generic), *_count(ROWS[GENERIC])]


def _block(language: str, first_line: str) -> str:
    return next(b for b in re.findall(rf"```{language}\n(.*?)```", TEXT, flags=re.S) if b.startswith(first_line))


def test_the_side_by_side_runs_agree(tmp_path):
    path = tmp_path / "grpo.yaml"
    path.write_text(_block("yaml", "# grpo.yaml"))
    config = load_config(path)
    get_recipe(config.train.algorithm, policy_kwargs=config.train.algorithm_kwargs)
    commands = [shlex.split(b.replace("\\\n", " ")) for b in re.findall(r"```bash\n(.*?)```", TEXT, flags=re.S)]
    assert [c[:3] for c in commands] == [["areno", "train", "grpo.yaml"]] * 2
    load_config(path, commands[1][3:])  # the CPU try's overrides
    call = next(
        node
        for node in ast.walk(ast.parse(_block("python", "# train_grpo.py")))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "GRPOConfig"
    )
    trl = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    assert trl["per_device_train_batch_size"] * trl["gradient_accumulation_steps"] == (
        config.rollout.batch_size * config.rollout.n_samples
    )
    assert (trl["num_generations"], trl["max_completion_length"], trl["temperature"]) == (
        config.rollout.n_samples,
        config.rollout.max_new_tokens,
        config.rollout.temperature,
    )
    assert (trl["learning_rate"], trl["lr_scheduler_type"], trl["warmup_steps"]) == (
        config.optim.lr,
        config.optim.schedule,
        config.optim.warmup_steps,
    )
    assert (trl["beta"], trl["max_steps"], trl["save_steps"], trl["seed"]) == (
        config.train.algorithm_kwargs["kl_coef"],
        config.train.steps,
        config.train.save_interval,
        config.train.seed,
    )
    assert trl["output_dir"] == "runs/grpo" and config.run_dir.endswith("runs/grpo")


def test_the_rewards_score_alike(tmp_path):
    trl_ns: dict = {}
    source = _block("python", "# train_grpo.py")
    exec(source[source.index("def correct") : source.index("args = ")], trl_ns)
    areno_ns: dict = {}
    exec(_block("python", "# rewards.py\ndef correct"), areno_ns)
    completions, answers = [" 42", "41", "42\n", "forty-two"], ["42"] * 4
    assert trl_ns["correct"](completions=completions, answer=answers) == [
        areno_ns["correct"]("What is 17 + 25?", c, a) for c, a in zip(completions, answers)
    ]
    several = tmp_path / "several.yaml"
    several.write_text(_block("yaml", "reward:\n  fn: ["))
    reward = load_config(several, [MODEL]).reward
    assert [Path(fn).name for fn in reward.fn] == ["rewards.py:correct", "rewards.py:think_format"]
    assert reward.weights == [1.0, 0.2]
    exec(_block("python", "# rewards.py\ndef score"), areno_ns)
    assert reward_parts(areno_ns["score"]("p", "<think>x</think> 42", "42")) == (1.2, {"format": 1.0, "correct": 1.0})


def test_the_trl_fields_are_grpo_configs():
    trl = pytest.importorskip("trl")
    transformers = pytest.importorskip("transformers")
    fields = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    generic = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    assert set(_fields(ROWS[OWN])) == fields - generic  # every field GRPOConfig adds, each once
    assert set(_fields(ROWS[GENERIC])) <= generic
    source = _block("python", "# train_grpo.py")
    call = next(
        n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "GRPOConfig"
    )
    assert {k.arg for k in call.keywords} <= fields
