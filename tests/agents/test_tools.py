"""Tool-call parsing (valid, malformed, unknown tool), schema validation and safe execution."""

import asyncio
import time

import pytest

from areno.workflows.tools import (
    Tool,
    ToolCall,
    ToolCallError,
    ToolSchemaError,
    ToolSet,
    calculator,
    calculator_tool,
    parse_tool_calls,
    validate_tool_schema,
)

ECHO = {
    "type": "function",
    "function": {
        "name": "echo",
        "description": "say it back",
        "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
    },
}


def test_parse_qwen_json():
    content, calls = parse_tool_calls(
        'Let me compute.\n<tool_call>\n{"name": "calc", "arguments": {"expr": "2*3"}}\n</tool_call>'
    )
    assert content == "Let me compute."
    assert len(calls) == 1 and isinstance(calls[0], ToolCall)
    assert calls[0].name == "calc" and calls[0].arguments == {"expr": "2*3"}
    assert calls[0].to_openai()["function"] == {"name": "calc", "arguments": '{"expr": "2*3"}'}


def test_parse_hermes_string_arguments_and_several_calls():
    text = (
        '<tool_call>{"arguments": "{\\"x\\": 1}", "name": "echo"}</tool_call>'
        '<tool_call>{"name": "echo", "parameters": {"x": 2}}</tool_call>'
    )
    content, calls = parse_tool_calls(text)
    assert content == ""
    assert [(c.name, c.arguments) for c in calls] == [("echo", {"x": 1}), ("echo", {"x": 2})]


def test_parse_xml_function_format():
    text = "<tool_call>\n<function=echo>\n<parameter=x>\n5\n</parameter>\n<parameter=y>\nhi there\n</parameter>\n</function>\n</tool_call>"
    _, calls = parse_tool_calls(text)
    assert calls[0].name == "echo" and calls[0].arguments == {"x": 5, "y": "hi there"}


def test_no_call_keeps_text():
    assert parse_tool_calls("just an answer: 42") == ("just an answer: 42", [])


@pytest.mark.parametrize(
    "text, message",
    [
        ('<tool_call>{"name": "calc", "arguments": {"expr": "2*3"</tool_call>', "not valid JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'string "name"'),
        (
            '<tool_call>{"name": "calc", "arguments": "{oops"}</tool_call>',
            "arguments of tool 'calc' are not valid JSON",
        ),
        ('<tool_call>{"name": "calc", "arguments": [1, 2]}</tool_call>', "must be a JSON object, got list"),
        ('<tool_call>{"name": "calc", "argu', "not valid JSON"),  # cut off by the token limit
    ],
)
def test_malformed_calls_become_errors(text, message):
    _, calls = parse_tool_calls(text)
    assert len(calls) == 1 and isinstance(calls[0], ToolCallError)
    assert message in calls[0].message


def test_schema_validation():
    assert validate_tool_schema(ECHO["function"])["type"] == "function"  # the bare function form is accepted
    bad_schema = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "nonsense"}}}},
    }
    with pytest.raises(ToolSchemaError, match=r"tool 'f': parameters is not a valid JSON Schema at properties/x/type"):
        validate_tool_schema(bad_schema)
    with pytest.raises(ToolSchemaError, match="tool name 'has space'"):
        validate_tool_schema({"name": "has space"})
    with pytest.raises(ToolSchemaError, match="must describe an object"):
        validate_tool_schema({"name": "f", "parameters": {"type": "string"}})
    with pytest.raises(ToolSchemaError, match="type 'retrieval' is not supported"):
        validate_tool_schema({"type": "retrieval"})
    with pytest.raises(ToolSchemaError, match="unique"):
        ToolSet([calculator_tool(), calculator_tool()])
    with pytest.raises(ValueError, match="timeout_s"):
        Tool(fn=print, schema=ECHO, timeout_s=0)


def test_calculator():
    assert calculator("12*(3+4)/2") == "42" and calculator("7/2") == "3.5" and calculator("-3+1") == "-2"
    with pytest.raises(ValueError, match="only digits"):
        calculator("__import__('os')")


def _run(coro):
    return asyncio.run(coro)


def test_execution_failures_are_strings_for_the_model():
    def slow(x):
        time.sleep(2)
        return x

    async def boom(x):
        raise RuntimeError("disk on fire")

    tools = ToolSet(
        [
            Tool(fn=lambda x: {"echo": x}, schema=ECHO),
            Tool(fn=slow, schema={**ECHO, "function": {**ECHO["function"], "name": "slow"}}, timeout_s=0.1),
            Tool(fn=boom, schema={**ECHO, "function": {**ECHO["function"], "name": "boom"}}),
        ]
    )
    ok = _run(tools.aexecute(ToolCall(name="echo", arguments={"x": 3})))
    assert ok.ok and ok.content == '{"echo": 3}'
    unknown = _run(tools.aexecute(ToolCall(name="nope", arguments={})))
    assert not unknown.ok and unknown.content == "Error: unknown tool 'nope'; available tools: ['boom', 'echo', 'slow']"
    invalid = _run(tools.aexecute(ToolCall(name="echo", arguments={"x": "three"})))
    assert not invalid.ok and "invalid arguments for 'echo': 'three' is not of type 'integer'" in invalid.content
    timed_out = _run(tools.aexecute(ToolCall(name="slow", arguments={"x": 1})))
    assert not timed_out.ok and timed_out.content == "Error: tool 'slow' timed out after 0.1s"
    raised = _run(tools.aexecute(ToolCall(name="boom", arguments={"x": 1})))
    assert not raised.ok and raised.content == "Error: tool 'boom' raised RuntimeError: disk on fire"
    malformed = _run(tools.aexecute(ToolCallError(raw="{", message="tool call is not valid JSON")))
    assert not malformed.ok and malformed.content == "Error: tool call is not valid JSON"
