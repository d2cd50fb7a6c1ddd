"""A Tool's schema is checked when the Tool is made: an object schema with properties, matching the
function's signature (one-line errors naming the tool), so a wrong declaration never reaches an
episode. ``ToolSet.aexecute(call, session=...)`` records the call for ``areno sessions``."""

from __future__ import annotations

import asyncio

import pytest

from areno.observe.session import configure_sessions, load_sessions, session
from areno.workflows.tools import Tool, ToolCall, ToolSchemaError, ToolSet, parse_tool_calls, validate_tool_schema


def _schema(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def add(a: int, b: int = 0) -> int:
    return a + b


def positional(x, /):
    return x


INTS = {"a": {"type": "integer"}, "b": {"type": "integer"}}


@pytest.mark.parametrize(
    ("fn", "parameters", "fragment"),
    [
        # the audit's schema: property schemas without the object around them validate nothing
        (add, {"a": {"type": "integer"}}, "tool 't': parameters must describe an object, "),
        (add, {"type": "string"}, "tool 't': parameters must describe an object"),
        (add, {"type": "object"}, "tool 't': parameters needs \"properties\""),
        (
            add,
            {"type": "object", "properties": {**INTS, "c": {"type": "integer"}}, "required": ["a"]},
            "tool 't': the schema names arguments ['c'] that add() takes no parameter for; its parameters are ['a', 'b']",
        ),
        (
            add,
            {"type": "object", "properties": INTS, "required": ["a", "d"]},
            "the schema names arguments ['d'] that add() takes no parameter for",
        ),
        (
            add,
            {"type": "object", "properties": INTS},
            "tool 't': add() needs argument 'a' but the schema does not require it: add 'a' to parameters.required",
        ),
        (
            positional,
            {"type": "object", "properties": {"x": {}}, "required": ["x"]},
            "tool 't': positional() takes 'x' by position only; tools are called with keyword arguments",
        ),
    ],
)
def test_a_schema_that_cannot_check_or_make_the_call_is_refused_when_the_tool_is_made(fn, parameters, fragment):
    with pytest.raises(ToolSchemaError) as info:
        Tool(fn=fn, schema=_schema("t", parameters))
    assert fragment in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_matching_schemas_are_accepted_and_validate_every_call():
    tool = Tool(fn=add, schema=_schema("add", {"type": "object", "properties": INTS, "required": ["a"]}))
    Tool(fn=lambda **kw: kw, schema=_schema("any", {"type": "object", "properties": {"q": {}}}))  # **kwargs takes all
    Tool(fn=lambda: 1, schema={"name": "none"})  # no parameters: an empty object schema
    tools = ToolSet([tool])
    ok = asyncio.run(tools.aexecute(ToolCall(name="add", arguments={"a": 2, "b": 3})))
    bad = asyncio.run(tools.aexecute(ToolCall(name="add", arguments={"a": "two"})))
    assert ok.ok and ok.content == "5" and not bad.ok and "'two' is not of type 'integer'" in bad.content


def test_empty_parameters_declare_a_tool_without_arguments():
    """``"parameters": {}`` is how OpenAI and tool-description code declare a no-argument tool: a
    request's tools pass through as sent, and a Tool takes it (its calls are made without arguments)."""
    declared = validate_tool_schema(_schema("now", {}))
    assert declared["function"]["parameters"] == {}
    tools = ToolSet([Tool(fn=lambda: "noon", schema=_schema("now", {}))])
    assert asyncio.run(tools.aexecute(ToolCall(name="now", arguments={}))).content == "noon"
    with pytest.raises(ToolSchemaError, match="add\\(\\) needs argument 'a' but the schema does not require it"):
        Tool(fn=add, schema=_schema("add", {}))  # a function that needs arguments still needs them declared


def test_aexecute_records_the_call_in_the_episode_session(tmp_path):
    tools = ToolSet([Tool(fn=add, schema=_schema("add", {"type": "object", "properties": INTS, "required": ["a"]}))])
    _, calls = parse_tool_calls('<tool_call>{"name":"add","arguments":{"a":1,"b":2}}</tool_call><tool_call>oops')
    configure_sessions(tmp_path, True)
    try:

        async def episode():
            with session(workflow="agent") as rec:
                return [await tools.aexecute(call, session=rec) for call in calls]

        results = asyncio.run(episode())
    finally:
        configure_sessions(None, False)
    assert [r.ok for r in results] == [True, False]
    (record,) = load_sessions(tmp_path)
    events = [e for e in record["events"] if e["kind"] == "tool_call"]
    assert record["num_tool_calls"] == 2
    assert events[0]["name"] == "add" and events[0]["arguments"] == {"a": 1, "b": 2} and events[0]["result"] == "3"
    assert events[1]["name"] == "(malformed)" and "not valid JSON" in events[1]["error"]
