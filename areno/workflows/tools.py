"""Tool calling for agent workflows: OpenAI-schema tools, parsing of model tool calls, safe execution.

- ``Tool``: a Python function plus its OpenAI function schema (``{"type": "function", "function":
  {"name", "description", "parameters"}}``); ``parameters`` must be a valid JSON Schema of an object
  (``{"type": "object", "properties": {...}, "required": [...]}``, or ``{}`` for a tool without
  arguments; checked with ``jsonschema`` at construction, and against the function's signature),
  and every call's arguments are validated against it.
- ``parse_tool_calls(text)``: the calls a model wrote, in the Qwen / Hermes ``<tool_call>{json}
  </tool_call>`` format (``arguments`` as an object or a JSON string, ``parameters`` accepted as
  an alias) and the Qwen3-Coder XML format (``<tool_call><function=NAME><parameter=KEY>VALUE
  </parameter></function></tool_call>``). A malformed call is returned as a ``ToolCallError``,
  never raised, so the workflow can feed the message back to the model.
- ``ToolSet.aexecute(call, session=...)``: runs a call with a timeout; an unknown tool, invalid
  arguments, a tool that raises and a tool that runs past its timeout all come back as an error
  string for the model. Given the episode's session (``client.session``), it records the call, so
  ``areno sessions`` shows it.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jsonschema

TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
FUNCTION_XML_RE = re.compile(r"<function=([^>\s]+)>(.*?)</function>", re.DOTALL)
PARAMETER_XML_RE = re.compile(r"<parameter=([^>\s]+)>(.*?)</parameter>", re.DOTALL)


class ToolSchemaError(ValueError):
    """A tool declaration that is not a valid OpenAI function schema / JSON Schema."""


@dataclass(kw_only=True)
class ToolCall:
    """One parsed call: ``arguments`` is the decoded JSON object."""

    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict[str, Any]:
        """The ``tool_calls`` entry of an OpenAI assistant message."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments)},
        }


@dataclass(kw_only=True)
class ToolCallError:
    """A call the model attempted but wrote wrongly; ``message`` is what the model is told."""

    raw: str
    message: str


def _coerce_xml_value(text: str) -> Any:
    text = text.strip()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _parse_one(body: str) -> ToolCall | ToolCallError:
    body = body.strip()
    xml = FUNCTION_XML_RE.search(body)
    if xml is not None:
        args = {k: _coerce_xml_value(v) for k, v in PARAMETER_XML_RE.findall(xml.group(2))}
        return ToolCall(name=xml.group(1), arguments=args)
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return ToolCallError(
            raw=body,
            message=f"tool call is not valid JSON ({exc.msg} at char {exc.pos}); "
            'write <tool_call>{"name": ..., "arguments": {...}}</tool_call>',
        )
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCallError(
            raw=body,
            message='tool call needs a string "name" field: <tool_call>{"name": ..., "arguments": {...}}</tool_call>',
        )
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            return ToolCallError(raw=body, message=f"arguments of tool {obj['name']!r} are not valid JSON ({exc.msg})")
    if not isinstance(args, dict):
        return ToolCallError(
            raw=body, message=f"arguments of tool {obj['name']!r} must be a JSON object, got {type(args).__name__}"
        )
    return ToolCall(name=obj["name"], arguments=args)


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall | ToolCallError]]:
    """Split model output into (content without the calls, calls in order).

    An unterminated ``<tool_call>`` (the model hit its token limit) is parsed up to the end of the
    text; if that is not a complete call it becomes a ``ToolCallError``.
    """
    calls: list[ToolCall | ToolCallError] = []
    for match in TOOL_CALL_RE.finditer(text):
        calls.append(_parse_one(match.group(1)))
    content = TOOL_CALL_RE.sub("", text).strip() if calls else text
    return content, calls


# ------------------------------------------------------------------------------------ declarations
def validate_tool_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """Check an OpenAI tool declaration; returns it in the ``{"type": "function", "function": …}`` form."""
    if not isinstance(schema, dict):
        raise ToolSchemaError(f"a tool schema must be a dict, got {type(schema).__name__}")
    fn = schema.get("function", schema) if schema.get("type", "function") == "function" else None
    if fn is None:
        raise ToolSchemaError(f"tool type {schema.get('type')!r} is not supported; use type 'function'")
    name = fn.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
        raise ToolSchemaError(f"tool name {name!r} must be 1-64 characters of letters, digits, '_' or '-'")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise ToolSchemaError(f"tool {name!r}: parameters must be a JSON Schema object, got {type(params).__name__}")
    # {} is how OpenAI (and tool-description code) declares a tool without arguments: an object with
    # no properties. Other keys without "type", such as {"a": {"type": "integer"}}, are valid JSON
    # Schema that accepts any arguments: the calls would never be validated
    if params and params.get("type") != "object":
        raise ToolSchemaError(
            f"tool {name!r}: parameters must describe an object, "
            f'{{"type": "object", "properties": {{...}}, "required": [...]}}; got {_keys(params)}'
        )
    try:
        jsonschema.validators.validator_for(params).check_schema(params)
    except jsonschema.SchemaError as exc:
        path = "/".join(str(p) for p in exc.path) or "(root)"
        raise ToolSchemaError(
            f"tool {name!r}: parameters is not a valid JSON Schema at {path}: {exc.message}"
        ) from None
    return {
        "type": "function",
        "function": {"name": name, "description": fn.get("description", ""), "parameters": params},
    }


def _keys(params: dict[str, Any]) -> str:
    return f"type {params['type']!r}" if "type" in params else f"no type (keys {sorted(params)})"


def check_tool_signature(name: str, fn: Callable[..., Any], parameters: dict[str, Any]) -> None:
    """A :class:`ToolSchemaError` unless the schema lists ``properties`` (``{}``, a tool without
    arguments, lists none) and ``fn(**arguments)`` can take every call it allows: each property is
    a parameter (or ``fn`` takes ``**kwargs``), and each parameter without a default is a required
    property (a call that leaves it out would fail inside the episode, told to the model instead of
    the user)."""
    properties = parameters.get("properties", {} if not parameters else None)
    if not isinstance(properties, dict):
        raise ToolSchemaError(
            f'tool {name!r}: parameters needs "properties" (a dict of argument schemas, {{}} for none), so '
            "every call's arguments are validated"
        )
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: its calls tell
        return
    by_keyword = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    properties, required = set(properties), set(parameters.get("required", ()))
    positional = [n for n, p in params.items() if p.kind == p.POSITIONAL_ONLY and p.default is p.empty]
    if positional:
        raise ToolSchemaError(
            f"tool {name!r}: {_fn_name(fn)} takes {positional[0]!r} by position only; tools are called with "
            "keyword arguments"
        )
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        extra = sorted((properties | required) - by_keyword)
        if extra:
            raise ToolSchemaError(
                f"tool {name!r}: the schema names arguments {extra} that {_fn_name(fn)} takes no parameter for; "
                f"its parameters are {sorted(by_keyword)}"
            )
    for n, p in params.items():
        if p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
            continue
        if n not in required:
            raise ToolSchemaError(
                f"tool {name!r}: {_fn_name(fn)} needs argument {n!r} but the schema does not require it: add "
                f"{n!r} to parameters.required (and properties), or give it a default"
            )


def _fn_name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__name__', type(fn).__name__)}()"


@dataclass(kw_only=True)
class Tool:
    """A callable the model may invoke. ``fn(**arguments)`` may be sync or async."""

    fn: Callable[..., Any]
    schema: dict[str, Any]
    """OpenAI tool declaration (``{"type": "function", "function": {...}}`` or the inner function dict)."""
    timeout_s: float = 10.0
    """Wall-clock limit of one call; past it the model gets an error string."""

    def __post_init__(self) -> None:
        self.schema = validate_tool_schema(self.schema)
        if not callable(self.fn):
            example = f" (fn={self.fn}, not fn={self.fn!r})" if isinstance(self.fn, str) else ""
            raise TypeError(
                f"tool {self.name!r}: fn must be the function to call, got {type(self.fn).__name__} {self.fn!r}: "
                f"pass the function itself{example}"
            )
        if self.timeout_s <= 0:
            raise ValueError(f"tool {self.name!r}: timeout_s must be > 0, got {self.timeout_s}")
        check_tool_signature(self.name, self.fn, self.parameters)

    @classmethod
    def from_function(cls, fn: Callable[..., Any], *, timeout_s: float = 10.0) -> Tool:
        """A tool whose schema is read off ``fn``'s type hints and Google-style docstring, as TRL's ``tools=``
        and ``transformers``' chat templates read one (``transformers.utils.get_json_schema``); a one-line
        :class:`ToolSchemaError` naming what ``fn`` lacks."""
        from transformers.utils import get_json_schema

        name = getattr(fn, "__name__", repr(fn))
        try:
            schema = get_json_schema(fn)
        except Exception as exc:  # noqa: BLE001 - transformers' parsing errors name what is missing
            raise ToolSchemaError(
                f"tool {name!r}: no schema can be read off the function ({str(exc).splitlines()[0]}): give every "
                "argument a type hint and a line under 'Args:' in its docstring, or pass Tool(fn=..., schema=...)"
            ) from None
        return cls(fn=fn, schema={"type": "function", "function": schema["function"]}, timeout_s=timeout_s)

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]

    @property
    def parameters(self) -> dict[str, Any]:
        return self.schema["function"]["parameters"]


@dataclass(kw_only=True)
class ToolResult:
    """What a call produced: ``content`` goes back to the model as the tool message."""

    call: ToolCall | ToolCallError
    content: str
    ok: bool
    duration_s: float = 0.0


class ToolSet:
    """The tools of one agent, by name."""

    def __init__(self, tools: list[Tool]) -> None:
        self.tools: dict[str, Tool] = {}
        for tool in tools:
            if not isinstance(tool, Tool):
                name = getattr(tool, "__name__", None) if callable(tool) else None
                what = f"the function {name}" if name else f"{type(tool).__name__} {tool!r}"
                raise TypeError(
                    f"ToolSet takes Tool objects, got {what}: wrap it with its OpenAI function schema, "
                    f"Tool(fn={name or '...'}, schema={{...}})"
                )
            if tool.name in self.tools:
                raise ToolSchemaError(f"two tools are named {tool.name!r}; tool names must be unique")
            self.tools[tool.name] = tool

    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self.tools.values()]

    async def aexecute(self, call: ToolCall | ToolCallError, session: Any = None) -> ToolResult:
        """Run one call; every failure becomes ``ok=False`` with a message for the model. With
        ``session`` (an agent's ``client.session``; None outside a traced episode) the call, its
        result or error and its duration are recorded there."""
        result = await self._aexecute(call)
        if session is not None:
            _record(session, result)
        return result

    async def _aexecute(self, call: ToolCall | ToolCallError) -> ToolResult:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        if isinstance(call, ToolCallError):
            return ToolResult(call=call, content=f"Error: {call.message}", ok=False)
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolResult(
                call=call, ok=False, content=f"Error: unknown tool {call.name!r}; available tools: {sorted(self.tools)}"
            )
        try:
            jsonschema.validate(call.arguments, tool.parameters)
        except jsonschema.ValidationError as exc:
            return ToolResult(call=call, ok=False, content=f"Error: invalid arguments for {call.name!r}: {exc.message}")
        try:
            if inspect.iscoroutinefunction(tool.fn):
                value = await asyncio.wait_for(tool.fn(**call.arguments), tool.timeout_s)
            else:
                value = await asyncio.wait_for(asyncio.to_thread(tool.fn, **call.arguments), tool.timeout_s)
        except TimeoutError:
            return ToolResult(
                call=call,
                ok=False,
                duration_s=loop.time() - t0,
                content=f"Error: tool {call.name!r} timed out after {tool.timeout_s:g}s",
            )
        except Exception as exc:  # noqa: BLE001 - user tool code: its failure is told to the model, not hidden
            return ToolResult(
                call=call,
                ok=False,
                duration_s=loop.time() - t0,
                content=f"Error: tool {call.name!r} raised {type(exc).__name__}: {exc}",
            )
        content = value if isinstance(value, str) else json.dumps(value, default=str)
        return ToolResult(call=call, content=content, ok=True, duration_s=loop.time() - t0)

    async def arespond(self, message: Any, session: Any = None) -> list[dict[str, Any]]:
        """The tool messages answering an assistant message (an ``openai`` ChatCompletionMessage or
        its dict): one per call, in order, then one per malformed call (``tool_call_errors``) telling
        the model what was wrong. Calls run concurrently; each is recorded on ``session`` if given."""
        msg = message.model_dump() if hasattr(message, "model_dump") else dict(message)
        calls: list[ToolCall | ToolCallError] = []
        for tc in msg.get("tool_calls") or []:
            fn = tc["function"]
            try:
                args = json.loads(fn.get("arguments") or "{}")
            except json.JSONDecodeError as exc:
                calls.append(
                    ToolCallError(
                        raw=fn.get("arguments", ""),
                        message=f"arguments of tool {fn['name']!r} are not valid JSON ({exc.msg})",
                    )
                )
                continue
            calls.append(ToolCall(name=fn["name"], arguments=args, id=tc.get("id") or f"call_{uuid.uuid4().hex[:24]}"))
        calls += [ToolCallError(raw="", message=m) for m in msg.get("tool_call_errors") or []]
        results = await asyncio.gather(*(self._aexecute(c) for c in calls))
        out = []
        for r in results:
            if session is not None:  # in the calls' order, not the order they finished in
                _record(session, r)
            entry: dict[str, Any] = {"role": "tool", "content": r.content}
            if isinstance(r.call, ToolCall):
                entry["tool_call_id"] = r.call.id
                entry["name"] = r.call.name
            out.append(entry)
        return out


def _record(session: Any, result: ToolResult) -> None:
    """Record one executed call on an ``areno.observe.session`` recorder."""
    call = result.call
    session.add_tool_call(
        getattr(call, "name", "(malformed)"),
        call.arguments if isinstance(call, ToolCall) else call.raw,
        result=result.content if result.ok else None,
        error=None if result.ok else result.content,
        duration_s=result.duration_s,
    )


def render_tools_prompt(schemas: list[dict[str, Any]]) -> str:
    """Qwen/Hermes-style system text declaring the tools, for templates without tool support."""
    lines = [
        "# Tools",
        "",
        "You may call one or more functions to assist with the user query.",
        "",
        "You are provided with function signatures within <tools></tools> XML tags:",
        "<tools>",
    ]
    lines += [json.dumps(s) for s in schemas]
    lines += [
        "</tools>",
        "",
        "For each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:",
        "<tool_call>",
        '{"name": <function-name>, "arguments": <args-json-object>}',
        "</tool_call>",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------- a shipped tool
_CALC_ALLOWED = re.compile(r"[0-9+\-*/(). ]+")


def calculator(expr: str) -> str:
    """Evaluate an arithmetic expression of integers, + - * / and parentheses.

    Args:
        expr: The expression, e.g. "12*(3+4)".
    """
    if not _CALC_ALLOWED.fullmatch(expr):
        raise ValueError(f"expression {expr!r} may hold only digits, + - * / ( ) and spaces")
    import ast

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -ev(node.operand) if isinstance(node.op, ast.USub) else ev(node.operand)
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
            a, b = ev(node.left), ev(node.right)
            return (
                {ast.Add: a + b, ast.Sub: a - b, ast.Mult: a * b}.get(type(node.op))
                if not isinstance(node.op, ast.Div)
                else a / b
            )
        raise ValueError(f"expression {expr!r} is not arithmetic")

    value = ev(ast.parse(expr, mode="eval"))
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


CALCULATOR_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]},
    },
}


def calculator_tool(timeout_s: float = 5.0) -> Tool:
    return Tool(fn=calculator, schema=CALCULATOR_SCHEMA, timeout_s=timeout_s)
