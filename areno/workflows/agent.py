"""``AgentWorkflow``: run any agent written against the OpenAI client as an areno rollout workflow.

An agent is ``async def agent(client, sample) -> float | None``: it talks to ``client`` (an
``ArenoAsyncOpenAI``, a drop-in for ``openai.AsyncOpenAI``) as it would to OpenAI, and either
returns the episode's final reward (given to its last completion) or sets rewards itself with
``client.set_reward(completion_id, r)`` / ``client.set_last_reward(r)``. To score with the
configured ``reward.fn`` it awaits ``client.ascore(sample, completion)`` (or ``client.reward_fn(...)``,
always async, with or without the reward sandbox). Every completion is
recorded; the episode is exported with discounting (``gamma``) as individual interactions or one
concatenated multi-turn sequence per branch (``export_style``). See docs/workflows.md.

With ``proxy=True`` the agent is called as ``agent(base_url, sample)`` instead: an HTTP base URL
on 127.0.0.1 (``AgentProxy``) for the official ``openai`` client or any other process or language;
it may POST ``{base_url}/reward``.

``n_samples`` episodes run per row as one group. An agent that raises or runs past ``timeout_s``
loses only its own episode (warned with the row named; the rest of the group and batch go on);
a row whose every episode failed is rejected (None). Each episode is traced with
``areno.observe.session``.

Shipped: ``calculator_agent`` (answer "47*8=" directly or through the ``calc`` tool, whose result
is then the answer; reward 1 when right; a malformed call is answered with the error and the model
tries again), its workflow factory ``calculator_workflow``, the held-out metric ``calculator_reward``
and the data writer ``write_calculator_rows`` (see ``examples/agent_calculator.yaml``).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
import random
import re
import uuid
from collections.abc import Awaitable, Callable, Collection
from pathlib import Path
from typing import Any

from areno.errors import ConfigError
from areno.observe.session import session
from areno.rollout.client import RolloutClient
from areno.types import SamplingParams, Trajectory
from areno.workflows.base import CHECK_KWARGS_ATTR, RolloutWorkflow, _import_dotted, fork_episode_seeds
from areno.workflows.interaction import ExportStyle
from areno.workflows.openai_client import AgentProxy, ArenoAsyncOpenAI
from areno.workflows.tools import (
    Tool,
    ToolCall,
    ToolSchemaError,
    ToolSet,
    calculator,
    calculator_tool,
    parse_tool_calls,
)

logger = logging.getLogger("areno.workflows")

AgentFn = Callable[[ArenoAsyncOpenAI, dict[str, Any]], Awaitable[float | None]]


def describe_row(sample: dict[str, Any]) -> str:
    for key in ("id", "uid", "index", "prompt"):
        if key in sample:
            return f"{key}={str(sample[key])[:60]!r}"
    return repr(sample)[:60]


def _dropped(rec: Any, reason: str) -> None:
    """A dropped episode's session is recorded as an error (``areno sessions --status error``), not ok."""
    rec.event("dropped", reason=reason)
    rec.finish("error", reason)


class AgentWorkflow(RolloutWorkflow):
    """Runs ``agent`` ``n_samples`` times per row against a recording OpenAI-compatible client.

    Accepts the keyword arguments the engine passes to every workflow (``tokenizer``,
    ``reward_fn``, ``n_samples``, ``sampling_params``, ``prompt_key``, ``answer_key``); the agent
    scores with ``await client.ascore(sample, completion)`` or ``await client.reward_fn(prompt,
    completion, answer, **fields)`` (the configured reward, async either way) and reads
    ``client.prompt_key`` / ``answer_key``.
    """

    carries_routes = False  # its trajectories come from the recorded requests
    carries_reward_parts = False  # client.ascore keeps the score alone (one number), not the list's parts

    def __init__(
        self,
        tokenizer: Any,
        sampling_params: SamplingParams,
        *,
        agent: AgentFn | str,
        reward_fn: Callable[..., float] | None = None,
        n_samples: int = 1,
        gamma: float = 1.0,
        export_style: ExportStyle = "concat",
        timeout_s: float = 300.0,
        proxy: bool = False,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
    ) -> None:
        if isinstance(agent, str):
            agent = _import_dotted(agent, what="rollout.workflow_kwargs.agent")
        if not callable(agent):
            raise ValueError(f"agent must be an async function agent(client, sample), got {type(agent).__name__}")
        if n_samples < 1:
            raise ValueError(f"n_samples must be >= 1, got {n_samples}")
        if not 0 <= gamma <= 1:
            raise ValueError(f"gamma must be in [0, 1], got {gamma}")
        if export_style not in ("individual", "concat"):
            raise ValueError(f"export_style must be 'individual' or 'concat', got {export_style!r}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.tokenizer = tokenizer
        self.sampling_params = sampling_params
        self.agent = agent
        self.reward_fn = reward_fn
        self.n_samples = n_samples
        self.gamma = gamma
        self.export_style = export_style
        self.timeout_s = timeout_s
        self.proxy = proxy
        self._proxy: AgentProxy | None = None
        self.prompt_key = prompt_key
        self.answer_key = answer_key

    async def run_episode(self, client: RolloutClient, sample: dict[str, Any]) -> list[Trajectory] | None:
        group_id = uuid.uuid4().hex
        results = await asyncio.gather(*(self._aepisode(client, sample, group_id, i) for i in range(self.n_samples)))
        group = [t for trajs in results if trajs is not None for t in trajs]
        if not group:
            logger.warning("every agent episode of row %s failed; the row is skipped", describe_row(sample))
            return None
        return group

    def close(self) -> None:
        """Stop the proxy server (proxy mode)."""
        if self._proxy is not None:
            self._proxy.stop()
            self._proxy = None

    def _client(self, rollout_client: RolloutClient, index: int, recorder: Any) -> ArenoAsyncOpenAI:
        params = self.sampling_params
        if params.seed is not None:  # episodes of one group must not be copies of each other
            import dataclasses

            params = dataclasses.replace(params, seed=params.seed + 1000 * index)
        return ArenoAsyncOpenAI(
            rollout_client,
            self.tokenizer,
            default_sampling=params,
            session=recorder,
            reward_fn=self.reward_fn,
            prompt_key=self.prompt_key,
            answer_key=self.answer_key,
            fixed_temperature=True,
        )

    async def _aepisode(
        self, rollout_client: RolloutClient, sample: dict[str, Any], group_id: str, index: int
    ) -> list[Trajectory] | None:
        fork_episode_seeds(index)  # a task of its own (gather): its requests' seeds, whatever the others' timing
        with session(sample=describe_row(sample), group_id=group_id, episode=index, workflow="agent") as rec:
            if self.proxy:  # the agent gets a base URL on 127.0.0.1 and may use any HTTP client
                if self._proxy is None:
                    self._proxy = AgentProxy(
                        rollout_client, self.tokenizer, default_sampling=self.sampling_params, fixed_temperature=True
                    ).start()
                sid, base_url = self._proxy.start_session(session=rec)
                oai = self._proxy.sessions[sid]
            else:
                oai = self._client(rollout_client, index, rec)
            try:
                value = self.agent(base_url if self.proxy else oai, sample)
                if not inspect.isawaitable(value):
                    raise TypeError(
                        f"agent {getattr(self.agent, '__name__', self.agent)!r} is not async: "
                        "define it with 'async def agent(client, sample)'"
                    )
                reward = await asyncio.wait_for(value, self.timeout_s)
            except TimeoutError:
                logger.warning(
                    "agent episode %d of row %s did not return within timeout_s=%gs; dropped "
                    "(raise timeout_s if episodes are legitimately long)",
                    index,
                    describe_row(sample),
                    self.timeout_s,
                )
                _dropped(rec, f"timeout: no return within timeout_s={self.timeout_s:g}s")
                return None
            except Exception as exc:  # noqa: BLE001 - user agent code: warned with the row named, the group goes on
                logger.warning(
                    "agent episode %d of row %s raised %s: %s; dropped",
                    index,
                    describe_row(sample),
                    type(exc).__name__,
                    exc,
                )
                _dropped(rec, f"{type(exc).__name__}: {exc}")
                return None
            finally:
                if self.proxy:
                    self._proxy.end_session(sid)
            if len(oai.cache) == 0:
                logger.warning(
                    "agent episode %d of row %s made no completion call; dropped", index, describe_row(sample)
                )
                _dropped(rec, "the agent made no completion call")
                return None
            if reward is not None and oai.cache.last.reward is None:
                try:
                    # "0.5" or an un-awaited client.reward_fn(...) is the agent's mistake, not a reward
                    oai.set_last_reward(reward)
                except TypeError as exc:
                    logger.warning("agent episode %d of row %s: %s; dropped", index, describe_row(sample), exc)
                    _dropped(rec, str(exc))
                    return None
            # a trajectory holding a completion whose client.ascore failed carries info["reward_error"]
            # (counted as rollout/reward_errors, as the shipped workflows' are)
            info: dict[str, Any] = {"sample": describe_row(sample)}
            trajs = oai.export(self.export_style, gamma=self.gamma, group_id=group_id, info=info)
            rec.set_reward(sum(t.reward for t in trajs) / len(trajs), num_interactions=len(oai.cache))
            return trajs


# ------------------------------------------------------------------------------ the calculator task
TOOLS = ToolSet([calculator_tool()])


def _call_text(expr: str) -> str:
    return (
        "<tool_call>"
        + json.dumps({"name": "calc", "arguments": {"expr": expr}}, separators=(",", ":"))
        + "</tool_call>"
    )


def calculator_rows(
    num: int,
    seed: int,
    *,
    a_range: tuple[int, int] = (10, 99),
    b_range: tuple[int, int] = (2, 9),
    tool_fraction: float = 1.0,
    exclude: Collection[str] = (),
) -> list[dict[str, Any]]:
    """Rows ``{"prompt": "47*8=", "answer": <a demonstration>, "result": "376"}``.

    The demonstration (what a supervised warm start imitates) is the reference tool call
    ``<tool_call>{"name":"calc","arguments":{"expr":"47*8"}}</tool_call>`` for a ``tool_fraction``
    share of the rows and the product stated directly for the rest: a mixed demonstrator. A tiny
    model can learn to copy the operands into a call but not to multiply two-digit numbers in its
    head, so the direct answers it imitates are mostly wrong and RL has to teach it to use the tool.
    The reward never looks at ``answer``, only at ``result``. Prompts in ``exclude`` (a held-out
    set) are skipped.
    """
    if not 0 <= tool_fraction <= 1:
        raise ValueError(f"tool_fraction must be in [0, 1], got {tool_fraction}")
    for name, (lo, hi) in (("a_range", a_range), ("b_range", b_range)):
        if not 0 <= lo <= hi:
            raise ValueError(f"{name} must be (low, high) with 0 <= low <= high, got {(lo, hi)}")
    exclude = set(exclude)
    space = (a_range[1] - a_range[0] + 1) * (b_range[1] - b_range[0] + 1)
    if space <= len(exclude) and all(
        f"{a}*{b}=" in exclude for a in range(a_range[0], a_range[1] + 1) for b in range(b_range[0], b_range[1] + 1)
    ):
        raise ValueError(f"every prompt of a_range={a_range}, b_range={b_range} is excluded")
    rng = random.Random(seed)
    rows = []
    while len(rows) < num:
        a, b = rng.randint(*a_range), rng.randint(*b_range)
        expr = f"{a}*{b}"
        if f"{expr}=" in exclude:
            continue
        answer = _call_text(expr) if rng.random() < tool_fraction else str(a * b)
        rows.append({"prompt": f"{expr}=", "answer": answer, "result": str(a * b)})
    return rows


def write_calculator_rows(path: str | Path, num: int, seed: int, **kwargs: Any) -> list[dict[str, Any]]:
    """Write ``calculator_rows(num, seed, **kwargs)`` as JSONL and return them. The shipped example's
    data: ``eval = write_calculator_rows(eval_path, 64, 1)``, then
    ``write_calculator_rows(train_path, 2000, 0, tool_fraction=0.3, exclude={r["prompt"] for r in eval})``."""
    rows = calculator_rows(num, seed, **kwargs)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return rows


def _operands(expr: str) -> list[str]:
    return [part.strip() for part in re.split(r"[*+/-]", expr)]


def _direct_answer(text: str) -> str:
    return text.strip().split("\n", 1)[0].strip()


async def calculator_agent(
    client: ArenoAsyncOpenAI, sample: dict[str, Any], *, max_attempts: int = 2, operand_credit: float = 0.0
) -> float:
    """Answer ``sample["prompt"]`` ("47*8="), with or without the ``calc`` tool; reward 1 when right.

    A reply with a tool call is run, and the tool's result is the answer. A reply without one is a
    direct answer (its first line). A malformed or failing call is answered with the tool error and
    the model tries again (up to ``max_attempts``), continuing the same token sequence, so the tree
    and concat export see one multi-turn episode. ``operand_credit`` > 0 shapes the reward of a
    call that ran but gave the wrong result: ``operand_credit`` x the fraction of operands copied
    right from the question (off in the shipped example: its reward is answer correctness only).
    """
    if not 0 <= operand_credit < 1:
        raise ValueError(f"operand_credit must be in [0, 1), got {operand_credit}")
    expected = _operands(sample["prompt"].rstrip("="))
    target = str(sample["result"]).strip()
    prompt_ids = list(client.tokenizer.encode(sample["prompt"], add_special_tokens=False))
    for _ in range(max_attempts):
        resp = await client.completions.create(model="policy", prompt=prompt_ids)
        choice = resp.choices[0]
        _, calls = parse_tool_calls(choice.text)
        if not calls:  # a direct answer is final
            if client.session is not None:
                client.session.event("direct_answer", text=_direct_answer(choice.text)[:40])
            return float(_direct_answer(choice.text) == target)
        result = await TOOLS.aexecute(calls[0], session=client.session)  # recorded for `areno sessions`
        if result.ok:
            if result.content.strip() == target:
                return 1.0
            got = _operands(str(calls[0].arguments.get("expr", "")))
            right = sum(g == e for g, e in zip(got, expected)) if len(got) == len(expected) else 0
            return operand_credit * right / len(expected)
        client.set_last_reward(0.0)
        feedback = f"\n<tool_response>{result.content}</tool_response>\n"
        prompt_ids = (
            list(choice.prompt_token_ids)
            + list(choice.token_ids)
            + list(client.tokenizer.encode(feedback + sample["prompt"], add_special_tokens=False))
        )
    return 0.0


def calculator_reward(prompt: str, completion: str, answer: Any = None, *, result: Any = None, **_: Any) -> float:
    """1.0 when one reply answers the row right: its first tool call runs and ``calc`` returns the
    row's ``result``, or (no tool call) its first line is ``result``. The calculator example's
    ``reward.fn``, i.e. its held-out accuracy (greedy, one attempt)."""
    if result is None:
        raise ValueError("calculator_reward needs the row's 'result' field (the value of the expression)")
    target = str(result).strip()
    _, calls = parse_tool_calls(completion)
    if not calls:
        return float(_direct_answer(completion) == target)
    call = calls[0]
    if not isinstance(call, ToolCall) or call.name != "calc" or not isinstance(call.arguments.get("expr"), str):
        return 0.0
    try:
        return float(calculator(call.arguments["expr"]) == target)
    except (ValueError, SyntaxError, ZeroDivisionError, RecursionError, OverflowError):
        return 0.0


# bounded string work (the calculator takes digits and + - * / only, the completion its length): safe in
# process under reward.sandbox=auto, which spares a run a pool of reward workers importing areno (seconds each)
calculator_reward.areno_sandbox = False


def calculator_workflow(
    *, gamma: float = 1.0, export_style: ExportStyle = "concat", timeout_s: float = 120.0, **kwargs: Any
) -> AgentWorkflow:
    """``rollout.workflow: areno.workflows.agent:calculator_workflow`` (concat export, gamma 1,
    reward = answer correct, two attempts when a call is malformed). Its own defaults are
    parameters, so ``rollout.workflow_kwargs`` may override them; every other argument goes to
    ``AgentWorkflow`` (the return annotation lets preflight check them against it)."""
    return AgentWorkflow(agent=calculator_agent, gamma=gamma, export_style=export_style, timeout_s=timeout_s, **kwargs)


TOOL_TIMEOUT_S = 10.0
"""``tool_workflow``'s default limit of one tool call (``tool_timeout_s``)."""


async def tool_calling_agent(
    client: ArenoAsyncOpenAI, sample: dict[str, Any], *, tools: ToolSet, max_tool_calling_iterations: int | None = None
) -> float:
    """A chat with ``tools`` (TRL's ``tools=`` loop): the row's prompt as the user's message (a list of messages as
    they are), then each reply's tool calls run and their results appended as tool messages, until a reply calls
    none, ``max_tool_calling_iterations`` rounds of calls ran (None: no bound but the context), or a reply is
    cut at the length limit. The reward scores the last reply's text (``client.ascore``)."""
    prompt = sample[client.prompt_key]
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    rounds = 0
    while True:
        reply = (
            await client.chat.completions.create(model="policy", messages=messages, tools=tools.schemas())
        ).choices[0]
        message = reply.message
        messages.append(message.model_dump(include={"role", "content", "tool_calls"}, exclude_none=True))
        bounded = max_tool_calling_iterations is not None and rounds >= max_tool_calling_iterations
        if not message.tool_calls or reply.finish_reason == "length" or bounded:
            return await client.ascore(sample, message.content or "")
        messages += await tools.arespond(message, session=client.session)
        rounds += 1


def tool_workflow(
    *,
    tools: list[str | Callable[..., Any] | Tool],
    max_tool_calling_iterations: int | None = None,
    tool_timeout_s: float = TOOL_TIMEOUT_S,
    gamma: float = 1.0,
    export_style: ExportStyle = "concat",
    timeout_s: float = 300.0,
    **kwargs: Any,
) -> AgentWorkflow:
    """``rollout.workflow: areno.workflows.agent:tool_workflow`` with ``rollout.workflow_kwargs: {tools: [my_tools:lookup,
    ...], max_tool_calling_iterations: 4}``: the policy chats with the tools (``tool_calling_agent``; TRL's
    ``tools=`` and ``max_tool_calling_iterations``). A tool is a function (``module:name`` or ``./file.py:name``)
    whose schema is read off its type hints and docstring (``Tool.from_function``), or a ``Tool``; each call
    gets ``tool_timeout_s``. The turns train in one sequence (``export_style="concat"``), the tool results
    masked; every other argument goes to ``AgentWorkflow``."""
    toolset = _tool_set(tools, max_tool_calling_iterations, tool_timeout_s)
    agent = functools.partial(
        tool_calling_agent, tools=toolset, max_tool_calling_iterations=max_tool_calling_iterations
    )
    return AgentWorkflow(agent=agent, gamma=gamma, export_style=export_style, timeout_s=timeout_s, **kwargs)


def _tool_set(tools: Any, max_tool_calling_iterations: Any, tool_timeout_s: float) -> ToolSet:
    """``tool_workflow``'s tools, imported and given their schemas; a one-line :class:`ConfigError` for a value
    that cannot work."""
    key = "rollout.workflow_kwargs"
    bound = max_tool_calling_iterations
    if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int) or bound < 0):
        raise ConfigError(
            f"{key}.max_tool_calling_iterations must be an integer >= 0 (0: answer without calling a tool) or null "
            f"(no bound), got {bound!r}"
        )
    if not isinstance(tools, (list, tuple)) or not tools:
        raise ConfigError(f"{key}.tools must be a non-empty list of tools, e.g. [my_tools:lookup], got {tools!r:.60}")
    built = []
    for i, tool in enumerate(tools):
        if isinstance(tool, str):
            tool = _import_dotted(tool, what=f"{key}.tools[{i}]")
        try:
            built.append(tool if isinstance(tool, Tool) else Tool.from_function(tool, timeout_s=tool_timeout_s))
        except (ToolSchemaError, TypeError, ValueError) as exc:
            raise ConfigError(f"{key}.tools[{i}]: {exc}") from None
    try:
        return ToolSet(built)
    except ToolSchemaError as exc:
        raise ConfigError(f"{key}.tools: {exc}") from None


def _check_tool_workflow_kwargs(workflow_kwargs: dict[str, Any]) -> None:
    _tool_set(
        workflow_kwargs.get("tools"),
        workflow_kwargs.get("max_tool_calling_iterations"),
        workflow_kwargs.get("tool_timeout_s", TOOL_TIMEOUT_S),
    )


setattr(tool_workflow, CHECK_KWARGS_ATTR, _check_tool_workflow_kwargs)
