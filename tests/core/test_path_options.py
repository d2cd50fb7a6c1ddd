"""A path setting given an areno run or checkpoint directory where it needs another kind is refused at
preflight, before any model is made or loaded, with one line naming the setting and the directory to
pass: model.path and teacher_path a checkpoint's ``hf/`` export, value_head_path its critic role."""

from __future__ import annotations

import pytest

from areno.api.config import load_config
from areno.api.preflight import check_run
from areno.errors import ModelDirError
from tests.helpers.configs import run_to_end, tiny_run_overrides


def _run_dir(tmp_path):
    """An areno run directory of a PPO run: checkpoints/step_00000002 with its roles and hf export."""
    run = tmp_path / "ppo_run"
    step = run / "checkpoints" / "step_00000002"
    for role in ("policy", "value"):
        (step / role).mkdir(parents=True)
        (step / role / ".metadata").write_bytes(b"")
        (step / role / "trainer_state.pt").write_bytes(b"")
    (step / "hf").mkdir()
    (step / "hf" / "config.json").write_text("{}")
    (step / "COMPLETE").write_text("ok")
    return run, step


def _refused(tmp_path, *extra: str) -> str:
    with pytest.raises(ModelDirError) as info:
        check_run(load_config(None, [*tiny_run_overrides(tmp_path), *extra]))
    assert "\n" not in str(info.value)
    assert not (tmp_path / "model").exists()  # before the model is made
    return str(info.value)


def test_model_path_names_the_hf_export_of_a_checkpoint_or_a_run(tmp_path):
    run, step = _run_dir(tmp_path)
    said = _refused(tmp_path, f"model.path={step}")
    assert (
        said
        == f"model.path: {step} is an areno checkpoint, not a model directory: pass its Hugging Face export, {step / 'hf'}"
    )
    said = _refused(tmp_path, f"model.path={run}")
    assert said == (
        f"model.path: {run} is a run directory, not a model directory: pass a checkpoint's Hugging Face export, "
        f"such as {step / 'hf'}"
    )
    assert "checkpoints directory" in _refused(tmp_path, f"model.path={run / 'checkpoints'}")
    assert (run / "checkpoints").is_dir() and (step / "COMPLETE").is_file()  # nothing deleted


@pytest.mark.parametrize("where", ["step", "run", "missing", "no_config"])
def test_teacher_path_errors_name_the_setting(tmp_path, where):
    run, step = _run_dir(tmp_path)
    (tmp_path / "empty").mkdir()
    path = {"step": step, "run": run, "missing": tmp_path / "nope", "no_config": tmp_path / "empty"}[where]
    said = _refused(tmp_path, "train.algorithm=opd", f"train.algorithm_kwargs={{teacher_path: {path}}}")
    assert said.startswith(
        f"train.algorithm_kwargs.teacher_path: {path}"
        if where != "missing"
        else "train.algorithm_kwargs.teacher_path: directory"
    )
    assert "hf" in said and "delete" not in said and "role 'teacher'" not in said


@pytest.mark.parametrize("where", ["step", "hf", "run"])
def test_value_head_path_names_the_critic_role_of_the_checkpoint(tmp_path, where):
    run, step = _run_dir(tmp_path)
    path = {"step": step, "hf": step / "hf", "run": run}[where]
    said = _refused(
        tmp_path,
        "train.algorithm=aggrevate",
        f"train.algorithm_kwargs={{q_source: value_head, value_head_path: {path}}}",
    )
    assert said.startswith(f"train.algorithm_kwargs.value_head_path: {path} ")
    assert "delete" not in said and "resume" not in said
    assert said.endswith(f"not a critic checkpoint: pass the directory of its critic role, {step / 'value'}")
    (tmp_path / "empty").mkdir()
    said = _refused(
        tmp_path,
        "train.algorithm=aggrevate",
        f"train.algorithm_kwargs={{q_source: value_head, value_head_path: {tmp_path / 'empty'}}}",
    )
    assert said.endswith(
        "not an areno critic checkpoint (no .metadata / trainer_state.pt): pass the critic role's "
        "directory of a PPO run's checkpoint, run_dir/checkpoints/step_N/value"
    )


def test_a_critic_of_the_run_model_passes_and_one_of_another_shape_is_named(tmp_path):
    ppo = load_config(None, [*tiny_run_overrides(tmp_path, "ppo"), "train.algorithm=ppo", "train.steps=1"])
    run_to_end(ppo)
    critic = tmp_path / "ppo" / "checkpoints" / "step_00000001" / "value"
    aggrevate = [
        "train.algorithm=aggrevate",
        f"train.algorithm_kwargs={{q_source: value_head, value_head_path: {critic}}}",
    ]
    check_run(load_config(None, [*tiny_run_overrides(tmp_path), *aggrevate]))
    wider = [f"model.path={tmp_path / 'wider'}", "model.init_tiny={hidden_size: 48, layers: 1, heads: 2, kv_heads: 1}"]
    with pytest.raises(ModelDirError) as info:  # before the model is made: the shapes of init_tiny
        check_run(load_config(None, [*tiny_run_overrides(tmp_path), *wider, *aggrevate]))
    assert str(info.value).startswith(
        f"train.algorithm_kwargs.value_head_path: {critic} is the critic of another model"
    )
    assert "embeddings (105, 32), 1 layers; the run's model has (105, 48), 1 layers" in str(info.value)
    assert not (tmp_path / "wider").exists()
