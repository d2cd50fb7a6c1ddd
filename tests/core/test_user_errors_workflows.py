"""A workflow whose ``run_episode`` is a plain ``def`` is refused at preflight in one line (every
episode used to fail with "can't be used in 'await' expression", retried and dropped, and the run
stopped blaming the rollout engine); an exception from the workflow's own code is told apart from one
of the rollout side (``raised_in_workflow``)."""

from __future__ import annotations

import asyncio

import pytest

from areno.api.config import load_config
from areno.api.preflight import check_run
from areno.errors import ConfigError, RewardImportError
from areno.rewards.loader import import_object
from areno.workflows.base import check_workflow_arguments, load_workflow, raised_in_workflow, workflow_factory
from tests.helpers.configs import tiny_run_overrides

WORKFLOWS = """
from areno.workflows.base import RolloutWorkflow


class Sync(RolloutWorkflow):
    def __init__(self, **kwargs):
        pass

    def run_episode(self, client, sample):
        return None


def make_sync(**kwargs):
    return Sync(**kwargs)


class Boom(RolloutWorkflow):
    def __init__(self, **kwargs):
        pass

    async def run_episode(self, client, sample):
        raise RuntimeError("workflow boom")


class Calls(RolloutWorkflow):
    def __init__(self, **kwargs):
        pass

    async def run_episode(self, client, sample):
        return int(sample["prompt"])  # raises inside int(), called from this file
"""

ENGINE_KWARGS = {
    "tokenizer": None,
    "reward_fn": None,
    "n_samples": 2,
    "sampling_params": None,
    "prompt_key": "prompt",
    "answer_key": "answer",
}


@pytest.fixture
def wf_file(tmp_path):
    path = tmp_path / "wf.py"
    path.write_text(WORKFLOWS)
    return path


def test_a_plain_def_run_episode_is_refused_at_preflight(tmp_path, wf_file):
    cfg = load_config(None, [*tiny_run_overrides(tmp_path), f"rollout.workflow={wf_file}:Sync"])
    with pytest.raises(ConfigError) as info:
        check_run(cfg)
    assert str(info.value) == (
        f"rollout.workflow: {wf_file}:Sync: Sync.run_episode must be 'async def' (the executor awaits it): "
        "write `async def run_episode(self, client, sample)`"
    )


def test_a_factory_of_such_a_class_is_refused_when_built(wf_file):
    path = f"{wf_file}:make_sync"
    check_workflow_arguments(path, workflow_factory(path), {})  # a factory's class is not known before
    with pytest.raises(ConfigError, match=r"Sync\.run_episode must be 'async def'"):
        load_workflow(path, **ENGINE_KWARGS)


def _raised(workflow, *args):
    try:
        asyncio.run(workflow.run_episode(*args))
    except Exception as exc:  # noqa: BLE001 - what the executor's attempt catches
        return exc
    raise AssertionError("run_episode did not raise")


def test_an_exception_of_the_workflows_own_code_is_told_apart(wf_file):
    boom = load_workflow(f"{wf_file}:Boom", **ENGINE_KWARGS)
    assert raised_in_workflow(boom, _raised(boom, None, {"prompt": "1"}))
    calls = load_workflow(f"{wf_file}:Calls", **ENGINE_KWARGS)
    # its innermost frame is int()'s, a builtin: no frame, so the workflow's line is the innermost
    assert raised_in_workflow(calls, _raised(calls, None, {"prompt": "x"}))
    with pytest.raises(RewardImportError) as info:  # raised in areno's code, not the workflow's
        import_object("no_such_module_xyz:f", what="x")
    assert not raised_in_workflow(boom, info.value)
