"""A config built and changed in Python: a misspelt attribute is refused at once, a value assigned after
construction is checked again by Trainer.init with the construction's message, an unset model.path
reads as load_config's, and relative paths become absolute in one place."""

import dataclasses
import os
import re

import pytest

from areno.api.config import (
    ArenoConfig,
    ClusterSection,
    DataSection,
    ModelSection,
    ObserveSection,
    OptimConfig,
    RewardSection,
    RolloutSection,
    TestRolloutSection,
    TrainSection,
    WarmStartSection,
    absolute_paths,
    load_config,
    to_yaml,
)
from areno.api.pipeline import run_pipeline
from areno.api.trainer import Trainer
from areno.errors import ConfigError, UnknownSettingError
from areno.train.config import LoraConfig


def _config(tmp_path, **sections) -> ArenoConfig:
    return ArenoConfig(run_dir=str(tmp_path / "run"), model=ModelSection(path=str(tmp_path / "model")), **sections)


@pytest.mark.parametrize(
    "section, name, message",
    [
        ("train", "stpes", "train.stpes: not a setting; did you mean train.steps?"),
        ("optim", "lrr", "optim.lrr: not a setting; did you mean optim.lr?"),  # given as areno.train's OptimConfig
        ("model", "pth", "model.pth: not a setting; did you mean model.path?"),
        ("data", "train_paht", "data.train_paht: not a setting; did you mean data.train_path?"),
        ("reward", "timeout", "reward.timeout: not a setting; did you mean reward.timeout_s?"),
        ("rollout", "batchsize", "rollout.batchsize: not a setting; did you mean rollout.batch_size?"),
        ("warm_start", "step", "warm_start.step: not a setting; did you mean warm_start.steps?"),
        ("cluster", "devices", "cluster.devices: not a setting; did you mean cluster.device?"),
        ("observe", "tensorbord", "observe.tensorbord: not a setting; did you mean observe.tensorboard?"),
        ("test_rollout", "enable", "test_rollout.enable: not a setting; did you mean test_rollout.enabled?"),
        (None, "trian", "trian: not a setting; did you mean train?"),
    ],
)
def test_a_misspelt_attribute_is_refused_with_the_closest_setting(tmp_path, section, name, message):
    cfg = _config(tmp_path, optim=OptimConfig(lr=1e-4))
    target = cfg if section is None else getattr(cfg, section)
    with pytest.raises(UnknownSettingError, match=f"^{re.escape(message)}$") as raised:
        setattr(target, name, 1)
    assert isinstance(raised.value, ConfigError) and isinstance(raised.value, AttributeError)
    assert not hasattr(target, name)


def test_an_unknown_name_far_from_any_setting_lists_them():
    with pytest.raises(UnknownSettingError, match=r"^warm_start\.zzz: not a setting; they are warm_start\.steps, "):
        WarmStartSection().zzz = 1


def test_the_guard_keeps_sections_equal_copyable_and_omegaconf_structured(tmp_path):
    cfg = _config(tmp_path, optim=OptimConfig(lr=1e-4), train=TrainSection(steps=3))
    assert cfg.optim == dataclasses.replace(cfg.optim) and cfg.optim.lr == 1e-4
    assert dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=4)).train.steps == 4
    yaml_path = tmp_path / "cfg.yaml"
    yaml_path.write_text(to_yaml(cfg))
    assert load_config(yaml_path) == cfg


def test_a_nested_setting_outside_the_guard_is_caught_by_validate(tmp_path):
    cfg = _config(tmp_path, train=TrainSection(lora=LoraConfig(rank=4)))
    cfg.train.lora.rnak = 8  # LoraConfig is areno.train's: no guard of its own
    with pytest.raises(
        UnknownSettingError, match=r"^train\.lora\.rnak: not a setting; did you mean train\.lora\.rank\?$"
    ):
        cfg.validate()


@pytest.mark.parametrize(
    "section, key, value, message",
    [
        ("rollout", "batch_size", "2", "rollout.batch_size: must be an integer, got '2'"),
        ("train", "steps", -1, "train.steps: must be >= 0, got -1"),
        ("rollout", "temperature", -1.0, "rollout.temperature: must be 0 (greedy) or >= 0.001, got -1.0"),
        ("optim", "lr", float("nan"), "optim.lr: must be a finite number, got nan"),
        (
            "reward",
            "fn",
            print,
            "reward.fn: must be a string, got <built-in function print>: name the function by its path, "
            "'module:function' or './file.py:function' (reward sandbox processes import it)",
        ),
        ("data", "task", None, "data: set data.task to a shipped task or data.train_path to a JSONL/Parquet file"),
        ("model", "dtype", "fp16", "model.dtype: must be one of ('float32', 'bfloat16'), got 'fp16'"),
    ],
)
def test_trainer_init_checks_a_value_assigned_after_construction_as_construction_does(
    tmp_path, section, key, value, message
):
    cfg = _config(tmp_path)
    setattr(getattr(cfg, section), key, value)
    with pytest.raises(ConfigError) as at_init:
        Trainer.init(cfg)
    assert str(at_init.value) == message
    with pytest.raises(ConfigError) as at_construction:  # the section built with the value: the same words
        dataclasses.replace(getattr(cfg, section))
    assert str(at_construction.value) == message
    assert not (tmp_path / "run").exists()  # refused before the run directory is made


def test_a_cross_section_check_runs_again_too(tmp_path):
    cfg = _config(tmp_path)
    cfg.observe.profile_steps = [500]  # outside train.steps (100)
    with pytest.raises(ConfigError, match=r"^observe\.profile_steps: steps \[500\] are outside"):
        Trainer.init(cfg)


def test_an_unset_model_path_reads_as_load_config_says(tmp_path):
    with pytest.raises(ConfigError) as from_yaml:
        load_config(None, [f"run_dir={tmp_path / 'run'}"])
    for cfg in (ArenoConfig(run_dir=str(tmp_path / "run")), ArenoConfig(model=ModelSection(), run_dir=str(tmp_path))):
        for start in (Trainer.init, run_pipeline):
            with pytest.raises(ConfigError) as from_python:
                start(cfg)
            assert str(from_python.value) == str(from_yaml.value)
            assert "???" not in str(from_python.value)


def test_absolute_paths_makes_every_path_absolute_in_place(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = ArenoConfig(
        run_dir="runs/x",
        model=ModelSection(path="~/models/m"),
        data=DataSection(task=None, train_path="d/train.jsonl", eval_path="../held.jsonl"),
        reward=RewardSection(fn="./rewards.py:score"),
        rollout=RolloutSection(workflow="wf.py:Mine"),
        train=TrainSection(algorithm="recipes/mine.py:mine", algorithm_kwargs={"teacher_path": "t", "clip_eps": 0.2}),
        cluster=ClusterSection(device="cpu"),
        observe=ObserveSection(console=False),
        test_rollout=TestRolloutSection(),
    )
    assert absolute_paths(cfg) is cfg
    assert cfg.run_dir == str(tmp_path / "runs" / "x")
    assert cfg.model.path == os.path.expanduser("~/models/m")
    assert cfg.data.train_path == str(tmp_path / "d" / "train.jsonl")
    assert cfg.data.eval_path == str(tmp_path.parent / "held.jsonl")
    assert cfg.reward.fn == f"{tmp_path / 'rewards.py'}:score"
    assert cfg.rollout.workflow == f"{tmp_path / 'wf.py'}:Mine"
    assert cfg.train.algorithm == f"{tmp_path / 'recipes' / 'mine.py'}:mine"
    assert cfg.train.algorithm_kwargs == {"teacher_path": str(tmp_path / "t"), "clip_eps": 0.2}
    # module paths, recipe names and an unset model.path stay as they are
    plain = ArenoConfig(train=TrainSection(algorithm="grpo"))
    absolute_paths(plain)
    assert (plain.train.algorithm, plain.reward.fn) == ("grpo", "areno.rewards.tasks:exact_match")
    assert plain.model.path == "???"


def test_load_config_makes_user_code_absolute_the_recipe_too(tmp_path, monkeypatch):
    """The files of user code, from a YAML file or overrides (areno eval starts reward sandboxes); the
    other paths are made absolute where the run starts (Trainer.init, run_pipeline)."""
    monkeypatch.chdir(tmp_path)
    cfg = load_config(
        None,
        ["model.path=m", "train.algorithm=./my_recipes.py:reinforce", "reward.fn=r.py:f", "rollout.workflow=w/x.py:W"],
    )
    assert cfg.train.algorithm == f"{tmp_path / 'my_recipes.py'}:reinforce"
    assert cfg.reward.fn == f"{tmp_path / 'r.py'}:f" and cfg.rollout.workflow == f"{tmp_path / 'w' / 'x.py'}:W"
