"""The arguments a workflow is built with: the engine's own (``ENGINE_ARGUMENTS``) and
``rollout.workflow_kwargs``. Every mistake is a one-line ConfigError naming the key and the fix,
found by preflight before any warm start, also through a factory that forwards ``**kwargs``."""

from __future__ import annotations

import logging

import pytest

from areno.cli import main
from areno.errors import ConfigError
from areno.types import SamplingParams
from areno.workflows.agent import AgentWorkflow, calculator_workflow
from areno.workflows.base import (
    ENGINE_ARGUMENTS,
    RolloutWorkflow,
    check_workflow_arguments,
    load_workflow,
    workflow_factory,
)
from areno.workflows.multi_turn import MultiTurnWorkflow
from areno.workflows.rlvr import RLVRWorkflow
from tests.helpers.configs import train_args

ENGINE = {
    "tokenizer": None,
    "reward_fn": None,
    "n_samples": 2,
    "sampling_params": SamplingParams(),
    "prompt_key": "prompt",
    "answer_key": "answer",
}


def _check(path: str, **workflow_kwargs) -> None:
    check_workflow_arguments(path, workflow_factory(path), workflow_kwargs)


class NoInit(RolloutWorkflow):
    """A workflow written from the run_episode contract alone."""

    async def run_episode(self, client, sample):
        return None


class NoPromptKey(RolloutWorkflow):
    def __init__(self, tokenizer, reward_fn, n_samples, sampling_params, answer_key="answer"):
        pass

    async def run_episode(self, client, sample):
        return None


class TakesOwn(RolloutWorkflow):
    def __init__(self, tokenizer, reward_fn, n_samples, sampling_params, prompt_key, answer_key, *, depth):
        self.depth = depth

    async def run_episode(self, client, sample):
        return None


def forwards_unannotated(**kwargs):  # a factory that says nothing of where its **kwargs go
    return AgentWorkflow(agent=_agent, **kwargs)


async def _agent(client, sample):
    return 0.0


# three factories the engine builds, which preflight must not refuse
def picks(*, multi_turn: bool = False, **kwargs) -> RolloutWorkflow:  # the base class: nothing to follow
    return (MultiTurnWorkflow if multi_turn else RLVRWorkflow)(**kwargs)


def pops_depth(**kwargs) -> AgentWorkflow:  # takes one argument out of **kwargs for itself
    depth = kwargs.pop("depth", 3)
    workflow = AgentWorkflow(agent=_agent, **kwargs)
    workflow.depth = depth
    return workflow


class DeepAgent(AgentWorkflow):
    def __init__(self, *, depth: int = 3, **kwargs):
        super().__init__(**kwargs)
        self.depth = depth


def returns_subclass(**kwargs) -> AgentWorkflow:  # annotated with the class, returns a subclass taking more
    return DeepAgent(agent=_agent, **kwargs)


def needs_depth(**kwargs) -> TakesOwn:
    return TakesOwn(**kwargs)


class Buggy(RolloutWorkflow):
    """A constructor with a bug of its own (a TypeError that is not about its arguments)."""

    def __init__(self, **kwargs):
        self.size = len(kwargs.get("max_turns"))

    async def run_episode(self, client, sample):
        return None


def _scale(x, factor):
    return x * factor


def buggy_factory(**kwargs) -> AgentWorkflow:  # a helper called wrongly: a binding TypeError, not the config's
    _scale(2)
    return AgentWorkflow(agent=_agent, **kwargs)


def test_the_shipped_workflows_pass_with_their_example_kwargs():
    _check("areno.workflows.agent:calculator_workflow")
    _check("areno.workflows.agent:calculator_workflow", timeout_s=30.0, gamma=0.9)  # its own defaults
    _check("areno.workflows.env:arithmetic_retry_workflow", target_key="target", format_reward=0.0)
    _check("areno.workflows.rlvr:RLVRWorkflow")
    _check("areno.workflows.multi_turn:MultiTurnWorkflow", max_turns=3)
    wf = load_workflow("areno.workflows.agent:calculator_workflow", **ENGINE, timeout_s=30.0)
    assert isinstance(wf, AgentWorkflow) and wf.timeout_s == 30.0 and wf.n_samples == 2


@pytest.mark.parametrize(
    ("path", "kwargs", "fragment"),
    [
        # a typo reaching AgentWorkflow through calculator_workflow(**kwargs): found through its annotation
        (
            "areno.workflows.agent:calculator_workflow",
            {"gama": 1},
            "rollout.workflow_kwargs.gama: workflow 'areno.workflows.agent:calculator_workflow' (its **kwargs go "
            "to AgentWorkflow) takes no argument 'gama' (did you mean 'gamma'?); it takes agent, gamma,",
        ),
        (
            "areno.workflows.env:arithmetic_retry_workflow",
            {"horizn": 2},
            "rollout.workflow_kwargs.horizn: workflow 'areno.workflows.env:arithmetic_retry_workflow' (its **kwargs "
            "go to EnvWorkflow) takes no argument 'horizn' (did you mean 'horizon'?)",
        ),
        (
            "areno.workflows.rlvr:RLVRWorkflow",
            {"max_turnz": 3},
            "rollout.workflow_kwargs.max_turnz: workflow 'areno.workflows.rlvr:RLVRWorkflow' takes no argument "
            "'max_turnz'; it takes chat_template, system_prompt, chat_template_kwargs, vision, store",
        ),
        (
            "areno.workflows.rlvr:RLVRWorkflow",
            {"n_samples": 4},
            "rollout.workflow_kwargs.n_samples: the engine passes n_samples to every workflow itself (from "
            "rollout.n_samples): remove it",
        ),
        (
            f"{__name__}:TakesOwn",
            {},
            f"rollout.workflow_kwargs.depth: workflow '{__name__}:TakesOwn' needs argument 'depth'",
        ),
    ],
)
def test_workflow_kwargs_mistakes_name_the_key(path, kwargs, fragment):
    with pytest.raises(ConfigError) as info:
        _check(path, **kwargs)
    assert fragment in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_a_workflow_without_the_engine_arguments_is_told_what_the_engine_passes():
    for check in (lambda: _check(f"{__name__}:NoInit"), lambda: load_workflow(f"{__name__}:NoInit", **ENGINE)):
        with pytest.raises(ConfigError) as info:
            check()
        message = str(info.value)
        assert message.startswith(f"rollout.workflow: '{__name__}:NoInit' does not take the engine's arguments; ")
        assert f"the engine builds every workflow with keyword arguments {', '.join(ENGINE_ARGUMENTS)} (and " in message
        assert "accept them as parameters or with **kwargs" in message and "workflow_kwargs." not in message


def test_a_workflow_missing_one_engine_argument_is_told_which():
    with pytest.raises(ConfigError, match=r"^rollout.workflow: '.*:NoPromptKey' does not take prompt_key; the engine"):
        _check(f"{__name__}:NoPromptKey")


def test_a_factory_forwarding_unannotated_kwargs_fails_at_build_with_the_key_named():
    _check(f"{__name__}:forwards_unannotated", gama=1)  # nothing says where **kwargs go: build time tells
    with pytest.raises(ConfigError) as info:
        load_workflow(f"{__name__}:forwards_unannotated", **ENGINE, gama=1)
    message = str(info.value)
    assert message.startswith(f"rollout.workflow_kwargs.gama: building workflow '{__name__}:forwards_unannotated'")
    assert "unexpected keyword argument 'gama'" in message and "\n" not in message
    # the calculator's own defaults can be overridden (they were keywords it passed itself before)
    assert calculator_workflow(**ENGINE, gamma=0.5).gamma == 0.5


def test_a_workflow_kwargs_typo_is_refused_before_the_warm_start(tmp_path, capsys):
    rc = main(
        train_args(
            tmp_path,
            "rollout.workflow=areno.workflows.agent:calculator_workflow",
            "warm_start.steps=50",
            "rollout.workflow_kwargs={gama: 1}",
        )
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("areno: error: rollout.workflow_kwargs.gama: "), err
    assert not (tmp_path / "run").exists() and not (tmp_path / "model").exists()  # nothing ran


def test_factories_the_engine_builds_pass_preflight(caplog, monkeypatch):
    monkeypatch.setattr("areno.workflows.base._warned_forwarded", set())  # warned once per process
    with caplog.at_level(logging.WARNING, logger="areno.workflows"):
        _check(f"{__name__}:picks", multi_turn=True, max_turns=2)  # -> RolloutWorkflow: not followed
        _check(f"{__name__}:pops_depth", depth=5)  # its code names depth: no word about it
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    with caplog.at_level(logging.WARNING, logger="areno.workflows"):
        _check(f"{__name__}:returns_subclass", depth=5)  # not a misspelling: a warning, not a refusal
    (warning,) = caplog.records
    assert warning.getMessage().startswith(
        f"rollout.workflow_kwargs.depth: workflow '{__name__}:returns_subclass' (its **kwargs go to AgentWorkflow) "
        "takes no argument 'depth'; building the workflow fails unless"
    )
    # and each builds as the engine builds it
    assert isinstance(load_workflow(f"{__name__}:picks", **ENGINE, multi_turn=True, max_turns=2), MultiTurnWorkflow)
    assert load_workflow(f"{__name__}:pops_depth", **ENGINE, depth=5).depth == 5
    assert load_workflow(f"{__name__}:returns_subclass", **ENGINE, depth=5).depth == 5


def test_a_typo_the_factory_forwards_is_still_refused_before_it_is_built():
    with pytest.raises(ConfigError, match=r"^rollout.workflow_kwargs.gama: .* \(did you mean 'gamma'\?\)"):
        _check(f"{__name__}:pops_depth", depth=5, gama=1)


def test_a_type_error_inside_the_workflow_is_its_bug_not_a_config_error():
    for path in (f"{__name__}:Buggy", f"{__name__}:buggy_factory"):
        with pytest.raises(TypeError) as info:
            load_workflow(path, **ENGINE)
        assert type(info.value) is TypeError, info.value  # raised unchanged, with its traceback
    # a binding error of the engine's arguments stays a config error naming the key: one the target
    # needs that nobody passed, one it does not take (test_a_factory_forwarding_unannotated_kwargs_...)
    with pytest.raises(ConfigError, match=r"^rollout.workflow_kwargs.depth: building workflow .*'depth'"):
        load_workflow(f"{__name__}:needs_depth", **ENGINE)
