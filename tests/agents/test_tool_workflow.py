"""``tool_workflow`` (TRL's ``tools=`` and ``max_tool_calling_iterations``): the policy chats with tools read off
plain functions, each reply's calls run and answered, until a reply calls none or the bound is reached; the
reward scores the last reply. Scripted replies; the tools by path from the run config."""

from __future__ import annotations

import asyncio

import pytest

from areno.errors import ConfigError
from areno.types import SamplingParams
from areno.workflows.agent import AgentWorkflow, tool_workflow
from areno.workflows.base import load_workflow
from areno.workflows.tools import Tool, ToolSchemaError

PARAMS = SamplingParams(max_new_tokens=120)
CALL = '<tool_call>{"name": "calculator", "arguments": {"expr": "12*34"}}</tool_call>'


def exact(prompt, completion, answer, **row):
    return float(completion.strip() == answer)


def _workflow(tok, **kw):
    return tool_workflow(
        tools=["areno.workflows.tools:calculator"], tokenizer=tok, sampling_params=PARAMS, reward_fn=exact, **kw
    )


def test_a_call_is_run_and_answered_then_the_last_reply_is_scored(scripted, char_tokenizer):
    client = scripted([CALL, "408"])
    (traj,) = asyncio.run(
        _workflow(char_tokenizer, n_samples=1).run_episode(client, {"prompt": "12*34=", "answer": "408"})
    )
    assert traj.reward == 1.0
    assert "408" in char_tokenizer.decode(client.prompts[1])  # the tool's result reached the second turn
    # one sequence (concat): both replies trained, the tool's answer between them masked
    text = char_tokenizer.decode(traj.prompt_ids + traj.completion_ids)
    assert CALL in text and text.count("408") >= 2  # the tool's result and the final reply
    trained = char_tokenizer.decode([t for t, m in zip(traj.completion_ids, traj.completion_mask) if m])
    assert CALL in trained and "408" in trained


@pytest.mark.parametrize(("bound", "turns"), [(0, 1), (2, 3), (None, 5)])
def test_the_bound_stops_a_policy_that_keeps_calling(scripted, char_tokenizer, bound, turns):
    replies = [CALL] * (turns - 1) + (["408"] if bound is None else [CALL])
    client = scripted(replies)
    wf = _workflow(char_tokenizer, n_samples=1, max_tool_calling_iterations=bound)
    (traj,) = asyncio.run(wf.run_episode(client, {"prompt": "12*34=", "answer": "408"}))
    assert len(client.prompts) == turns
    assert traj.reward == (1.0 if bound is None else 0.0)


def test_settings_that_cannot_work_are_refused_in_one_line(char_tokenizer):
    def untyped(x):
        return x

    with pytest.raises(ToolSchemaError, match="tool 'untyped': no schema can be read off the function") as info:
        Tool.from_function(untyped)
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="max_tool_calling_iterations must be an integer >= 0"):
        _workflow(char_tokenizer, max_tool_calling_iterations=-1)
    with pytest.raises(ConfigError, match="tools must be a non-empty list"):
        tool_workflow(tools="areno.workflows.tools:calculator", tokenizer=char_tokenizer, sampling_params=PARAMS)
    with pytest.raises(Exception, match=r"rollout.workflow_kwargs.tools\[0\]"):
        tool_workflow(tools=["no_such_module:fn"], tokenizer=char_tokenizer, sampling_params=PARAMS)


def test_loads_from_the_run_configs_path_and_kwargs(char_tokenizer):
    wf = load_workflow(
        "areno.workflows.agent:tool_workflow",
        tokenizer=char_tokenizer,
        reward_fn=exact,
        n_samples=2,
        sampling_params=PARAMS,
        prompt_key="prompt",
        answer_key="answer",
        tools=["areno.workflows.tools:calculator"],
        max_tool_calling_iterations=3,
    )
    assert isinstance(wf, AgentWorkflow) and wf.n_samples == 2
    assert wf.agent.keywords["max_tool_calling_iterations"] == 3
    assert [s["function"]["name"] for s in wf.agent.keywords["tools"].schemas()] == ["calculator"]


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ("{tools: [no_such_module:fn]}", "rollout.workflow_kwargs.tools[0]: cannot import module 'no_such_module'"),
        ("{tools: [areno.workflows.tools:calculator], max_tool_calling_iterations: -2}", "must be an integer >= 0"),
        ("{tools: [areno.workflows.tools:render_tools_prompt]}", "tools[0]: tool 'render_tools_prompt': no schema"),
    ],
)
def test_the_cli_refuses_a_tool_list_that_cannot_work_before_the_model_loads(tmp_path, capsys, kwargs, says):
    from areno.cli import main as areno_main
    from tests.helpers.configs import tiny_run_overrides

    overrides = [*tiny_run_overrides(tmp_path), "rollout.workflow=areno.workflows.agent:tool_workflow"]
    assert areno_main(["train", *overrides, f"rollout.workflow_kwargs={kwargs}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert says in err[-1] and len([line for line in err if line.startswith("areno: error")]) == 1, err
    assert not (tmp_path / "model").exists()  # refused before the tiny model was made, let alone loaded
