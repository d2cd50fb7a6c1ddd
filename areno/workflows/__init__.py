"""Rollout workflows: single-turn RLVR, multi-turn retry, agents behind a recording OpenAI client,
tool calling and multi-step environments. How to write one: docs/workflows.md.

The public names are importable from here (``from areno.workflows import AgentWorkflow``); they are
loaded on first access, so importing one workflow module does not pull in the others' dependencies
(``openai``, ``jsonschema``, the HTTP proxy).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, str] = {
    # the contract (docs/workflows.md)
    "ENGINE_ARGUMENTS": "base",
    "EpisodeResult": "base",
    "RolloutWorkflow": "base",
    "WorkflowReturnError": "base",
    # single- and multi-turn text workflows
    "RLVRWorkflow": "rlvr",
    "MultiTurnWorkflow": "multi_turn",
    "RewardFn": "common",
    "acall_reward": "common",
    "sample_fields": "common",
    "store_kwargs": "common",
    "takes_store": "common",
    "teacher_kwargs": "common",
    # teacher-executed rollouts: DAgger's beta mixture, AggreVaTe's teacher roll-outs
    "TeacherMixtureWorkflow": "teacher",
    "TeacherQWorkflow": "teacher",
    "teacher_engine_client": "teacher",
    # agents behind the recording OpenAI-compatible client
    "AgentWorkflow": "agent",
    "AgentProxy": "openai_client",
    "AgentRequestError": "openai_client",
    "ArenoAsyncOpenAI": "openai_client",
    "calculator_agent": "agent",
    "calculator_reward": "agent",
    "calculator_rows": "agent",
    "calculator_workflow": "agent",
    "tool_calling_agent": "agent",
    "tool_workflow": "agent",
    "write_calculator_rows": "agent",
    # interaction trees
    "ExportStyle": "interaction",
    "Interaction": "interaction",
    "InteractionCache": "interaction",
    # tools
    "Tool": "tools",
    "ToolCall": "tools",
    "ToolCallError": "tools",
    "ToolResult": "tools",
    "ToolSchemaError": "tools",
    "ToolSet": "tools",
    "calculator_tool": "tools",
    "parse_tool_calls": "tools",
    "render_tools_prompt": "tools",
    "validate_tool_schema": "tools",
    # environments
    "ArithmeticRetryEnv": "env",
    "EnvWorkflow": "env",
    "Environment": "env",
    "Observation": "env",
    "StepResult": "env",
    "arithmetic_retry_workflow": "env",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'areno.workflows' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"areno.workflows.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # for type checkers and IDEs
    from areno.workflows.agent import (
        AgentWorkflow,
        calculator_agent,
        calculator_reward,
        calculator_rows,
        calculator_workflow,
        write_calculator_rows,
    )
    from areno.workflows.base import ENGINE_ARGUMENTS, EpisodeResult, RolloutWorkflow, WorkflowReturnError
    from areno.workflows.common import (
        RewardFn,
        acall_reward,
        sample_fields,
        store_kwargs,
        takes_store,
        teacher_kwargs,
    )
    from areno.workflows.env import (
        ArithmeticRetryEnv,
        Environment,
        EnvWorkflow,
        Observation,
        StepResult,
        arithmetic_retry_workflow,
    )
    from areno.workflows.interaction import ExportStyle, Interaction, InteractionCache
    from areno.workflows.multi_turn import MultiTurnWorkflow
    from areno.workflows.openai_client import AgentProxy, AgentRequestError, ArenoAsyncOpenAI
    from areno.workflows.rlvr import RLVRWorkflow
    from areno.workflows.teacher import TeacherMixtureWorkflow, TeacherQWorkflow, teacher_engine_client
    from areno.workflows.tools import (
        Tool,
        ToolCall,
        ToolCallError,
        ToolResult,
        ToolSchemaError,
        ToolSet,
        calculator_tool,
        parse_tool_calls,
        render_tools_prompt,
        validate_tool_schema,
    )
