"""``ArenoAsyncOpenAI``: an ``openai.AsyncOpenAI`` look-alike that generates with areno and records.

Agent code written for the official client runs unchanged::

    client = ArenoAsyncOpenAI(rollout_client, tokenizer)
    resp = await client.chat.completions.create(model="x", messages=[...], tools=[...])
    client.set_last_reward(1.0)
    trajectories = client.export("concat", gamma=0.9)

Every call goes to an areno ``RolloutClient`` (in process or over HTTP) and is recorded in an
``InteractionCache``: exact prompt/output token ids, per-token log-probs and policy versions, the
messages, and the parsed tool calls. Responses are real ``openai.types`` objects; each choice also
carries ``token_ids`` and ``prompt_token_ids`` like areno's server. Prompts are built the way
``areno serve`` builds them (a chat: the tokenizer's chat template, tokenised without extra specials;
a completion's string prompt: with them, a BOS-adding tokenizer's BOS included), so the same request
gives the same tokens through either path. ``stream=True`` returns a
``ReplayedStream``: the finished response as the chunks a streaming server sends, so agent code that
streams runs unchanged too (the chunks come together once the completion is done).

Multi-turn prompts stay token-exact: when a chat call extends an earlier call's messages and reply,
its prompt is that call's prompt and output ids followed by the tokens of the new messages only
(never a re-tokenisation of text the model produced), so ``export("concat")`` rebuilds the
episode exactly as the model saw it.

``AgentProxy`` serves the same over HTTP on 127.0.0.1 (one base URL per episode) for agents in
other processes or languages.
"""

from __future__ import annotations

import inspect
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from openai._models import construct_type  # how the official client builds its response objects
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from areno.models.vision import ImageInputs, VisionConfig, decode_image, expand_image_tokens
from areno.rewards.sandbox import reward_parts
from areno.rollout.client import agenerate_many
from areno.rollout.server import ChatRequest, CompletionRequest, ServerThread, check_bind
from areno.rollout.store import ObservationStore
from areno.types import GenerationOutput, SamplingParams, Trajectory
from areno.workflows.common import RewardFn, acall_reward, require_field, sample_fields
from areno.workflows.images import IMAGES_KEY, stash_images
from areno.workflows.interaction import ExportStyle, Interaction, InteractionCache
from areno.workflows.tools import parse_tool_calls, render_tools_prompt, validate_tool_schema

logger = logging.getLogger("areno.workflows")

_IGNORED = {
    "user",
    "metadata",
    "store",
    "service_tier",
    "stream_options",  # include_usage is read first (_include_usage); the rest changes nothing here
    "timeout",
    "extra_headers",
    "extra_query",
}
"""Parameters of the official client that change no output: accepted at any value and dropped."""

_SERVER_NO_OP = {**CompletionRequest.NO_OP, **ChatRequest.NO_OP}
_NO_OP: dict[str, tuple[tuple[Any, ...], str]] = {
    **{
        key: _SERVER_NO_OP[key]
        for key in ("frequency_penalty", "presence_penalty", "logit_bias", "response_format", "suffix")
    },
    # unlike areno serve, this client parses tool calls: it returns every call the model wrote
    "parallel_tool_calls": ((None, True), "every tool call the model writes is returned: send true or drop it"),
    "reasoning_effort": ((None,), "this engine has no reasoning-effort setting: drop it"),
}
"""Fields of the official client this client cannot honour, accepted only at their no-op value (the
table ``areno serve`` refuses other values with, where it applies), with why another is refused:
an agent asking for ``presence_penalty=1.5`` must not silently get none. ``best_of`` is accepted
only equal to ``n``."""


_CHAT_KEYS = frozenset(
    {
        "messages",
        "model",
        "tools",
        "tool_choice",
        "functions",
        "function_call",
        "temperature",
        "top_p",
        "max_tokens",
        "max_completion_tokens",
        "n",
        "stop",
        "seed",
        "logprobs",
        "top_logprobs",
        "stream",
        "extra_body",
    }
)
"""Parameters of ``chat.completions.create`` this client serves (besides ``_IGNORED`` and ``_NO_OP``)."""
_COMPLETION_KEYS = frozenset(
    {
        "prompt",
        "model",
        "temperature",
        "top_p",
        "max_tokens",
        "n",
        "stop",
        "seed",
        "logprobs",
        "echo",
        "stream",
        "extra_body",
    }
)
"""Parameters of ``completions.create`` this client serves (besides ``_IGNORED`` and ``_NO_OP``)."""


class AgentRequestError(ValueError):
    """A request the recording client cannot serve; the message names the field."""


def _plain(obj: Any) -> Any:
    """pydantic objects / TypedDicts → plain dicts and lists."""
    if hasattr(obj, "model_dump"):
        return obj.model_dump(exclude_none=True)
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
"""What an ``image_url`` content part becomes in the rendered prompt (as Qwen2.5-VL's template writes it)."""


def _part_text(part: dict[str, Any]) -> str:
    return IMAGE_PLACEHOLDER if part.get("type") == "image_url" else part.get("text", "")


def _image_urls(messages: list[Any]) -> list[str]:
    """The ``image_url`` parts' URLs (base64 data URLs) of ``messages``, in order."""
    urls = []
    for m in messages:
        msg = _plain(m)
        content = msg.get("content") if isinstance(msg, dict) else None
        for part in content if isinstance(content, list) else []:
            if isinstance(part, dict) and part.get("type") == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str) or not url.startswith("data:image/"):
                    raise AgentRequestError(
                        f"image_url {str(url)[:60]!r}: only base64 data URLs (data:image/png;base64,...) are supported"
                    )
                urls.append(url)
    return urls


def _normalise_message(message: Any, index: int) -> dict[str, Any]:
    msg = _plain(message)
    if not isinstance(msg, dict) or "role" not in msg:
        raise AgentRequestError(f"messages[{index}] must be a dict with a 'role', got {msg!r:.80}")
    for j, call in enumerate(msg.get("tool_calls") or []):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise AgentRequestError(
                f"messages[{index}].tool_calls[{j}] must be {{'type': 'function', 'function': {{'name': ..., "
                f"'arguments': '<JSON>'}}}}, got {call!r:.80}"
            )
        arguments = function.get("arguments") or "{}"
        if isinstance(arguments, dict):  # a history built by hand: the mapping OpenAI would send as JSON text
            arguments = function["arguments"] = json.dumps(arguments)
        try:
            if not isinstance(arguments, str) or not isinstance(json.loads(arguments), dict):
                raise ValueError("not a JSON object")
        except ValueError as exc:
            raise AgentRequestError(
                f"messages[{index}].tool_calls[{j}].function.arguments must be a JSON object as a string, got "
                f"{arguments!r:.60} ({exc})"
            ) from None
    content = msg.get("content")
    if isinstance(content, list):  # content parts: the text parts, an image part as its vision tokens
        msg["content"] = "".join(_part_text(p) for p in content if isinstance(p, dict))
    elif content is None:
        msg["content"] = ""
    return msg


class _NotGiven:
    pass


class ArenoAsyncOpenAI:
    """Recording OpenAI-compatible client over an areno ``RolloutClient``.

    Args:
        rollout_client: where generation happens (``InProcessRolloutClient`` / ``HTTPRolloutClient``).
        tokenizer: the policy's tokenizer (chat template, encode/decode).
        default_sampling: values for parameters a request leaves out (temperature, max_tokens, …).
        cache: where interactions are recorded (a fresh one by default).
        session: an ``areno.observe.session`` recorder; turns are appended to it.
        render_tools: how to show tools to a template that does not take ``tools``: ``"system"``
            prepends a Qwen/Hermes-style system message; ``"template"`` passes them to the template.
        vision: a vision-language policy's ``VisionConfig``: chat messages may then hold
            ``image_url`` parts (base64 data URLs); their pixels go with the request and, in the
            exported trajectory, by reference through ``store``.
        store: where the pixels of recorded image prompts are kept (None: inline).
        reward_fn: the configured reward (``reward.fn``), for the agent to score with: kept as
            ``client.reward_fn``, an async function whether or not ``reward.sandbox`` is on (``await
            client.reward_fn(prompt, completion, answer, **fields)``); ``await client.ascore(sample,
            completion)`` calls it the way the shipped workflows do.
        prompt_key, answer_key: the row fields holding the prompt and the answer (``data.prompt_key``,
            ``data.answer_key``), which ``ascore`` reads.
        fixed_temperature: a request's ``temperature`` must be ``default_sampling``'s (an
            ``AgentRequestError`` names it otherwise): the trainer recomputes an episode's log-probs at
            the run's temperature, so the workflows that train on the episode set it.
    """

    def __init__(
        self,
        rollout_client: Any,
        tokenizer: Any,
        *,
        default_sampling: SamplingParams | None = None,
        cache: InteractionCache | None = None,
        session: Any = None,
        render_tools: str = "auto",
        vision: VisionConfig | None = None,
        store: ObservationStore | None = None,
        reward_fn: RewardFn | None = None,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        fixed_temperature: bool = False,
    ) -> None:
        if render_tools not in ("auto", "system", "template"):
            raise ValueError(f"render_tools must be 'auto', 'system' or 'template', got {render_tools!r}")
        self.rollout_client = rollout_client
        self.tokenizer = tokenizer
        self.vision = vision
        self.store = store
        self.default_sampling = default_sampling or SamplingParams(max_new_tokens=16)
        self.fixed_temperature = fixed_temperature
        self.cache = cache if cache is not None else InteractionCache()
        self.session = session
        template = getattr(tokenizer, "chat_template", None) or ""
        self.render_tools = (
            render_tools if render_tools != "auto" else ("template" if "tools" in template else "system")
        )
        self.chat = _Chat(self)
        self.completions = _Completions(self)
        self._reward_fn = reward_fn  # as configured: acall_reward warns once per reward function, not per episode
        self.reward_fn = None if reward_fn is None else _areward(reward_fn)
        self.prompt_key, self.answer_key = prompt_key, answer_key
        self.reward_errors: list[str] = []
        """The failures of ``ascore`` calls (each scored 0), in order."""
        self._failed_scores: list[tuple[str, str]] = []
        """(completion, error) of each failed ``ascore`` call: ``export`` marks the trajectories they scored."""

    # ---- rewards and export
    async def ascore(self, sample: dict[str, Any], completion: str) -> float:
        """The configured reward of ``completion`` for ``sample``, as the shipped workflows score:
        ``reward_fn(sample[prompt_key], completion, sample.get(answer_key), **the row's other fields)``.
        A reward that raises or returns a non-number scores 0, is warned about (``acall_reward``) and
        marks the exported trajectories that hold ``completion`` (``info["reward_error"]``, counted in
        ``rollout/reward_errors``; see ``export``)."""
        if self._reward_fn is None:
            raise ValueError("ascore: this client has no reward function (the workflow was built without reward_fn)")
        prompt = require_field(sample, self.prompt_key)
        fields = sample_fields(sample, self.prompt_key, self.answer_key, IMAGES_KEY)
        value, error = await acall_reward(self._reward_fn, prompt, completion, sample.get(self.answer_key), fields)
        if error is not None:
            self.reward_errors.append(error)
            self._failed_scores.append((completion, error))
        return value

    def set_reward(self, interaction_id: str, reward: float) -> None:
        """Reward one completion (its response ``id``; for n > 1 the id rewards every choice)."""
        ids = [
            i.id for i in self.cache.ordered() if i.id == interaction_id or i.info.get("response_id") == interaction_id
        ]
        if not ids:
            raise KeyError(f"no completion {interaction_id!r} was recorded by this client")
        for i in ids:
            self.cache.set_reward(i, reward)

    def set_last_reward(self, reward: float) -> None:
        self.cache.set_last_reward(reward)

    def export(
        self,
        style: ExportStyle = "individual",
        *,
        gamma: float = 1.0,
        group_id: str = "",
        info: dict[str, Any] | None = None,
    ) -> list[Trajectory]:
        """The recorded completions as trajectories (``InteractionCache.export``). A trajectory that
        holds a completion whose ``ascore`` failed carries the error in ``info["reward_error"]``."""
        trajectories = self.cache.export(style, gamma=gamma, group_id=group_id, info=info)
        for traj in trajectories:
            error = self._reward_error(traj)
            if error is not None:
                traj.info["reward_error"] = error
        return trajectories

    def _reward_error(self, traj: Trajectory) -> str | None:
        """The last failed ``ascore`` error that concerns ``traj``: one that scored the text of a
        completion among its turns, or one that scored a text no completion wrote. The agent derived
        such a text itself (an extracted answer), and the record does not say which trajectory's
        reward its 0 went into, so it concerns them all."""
        ids = set(traj.info.get("interaction_ids") or [traj.info.get("interaction_id")])
        found = None
        for completion, error in self._failed_scores:
            scored = {i.id for i in self.cache.ordered() if _response_text(i.response) == completion}
            if not scored or scored & ids:
                found = error
        return found

    # ---- prompt building
    def _render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        *,
        generation: bool,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        kwargs: dict[str, Any] = dict(template_kwargs or {})
        if tools and self.render_tools == "template":
            kwargs["tools"] = tools
        elif tools:  # Qwen/Hermes style: the tool list joins (or becomes) the system message
            tools_text = render_tools_prompt(tools)
            if messages[0]["role"] == "system":
                messages = [{**messages[0], "content": messages[0]["content"] + "\n\n" + tools_text}] + messages[1:]
            else:
                messages = [{"role": "system", "content": tools_text}] + messages
        rendered = []
        for m in messages:  # templates without tool support still show the calls the model made
            if m.get("tool_calls") and self.render_tools == "template":
                # tool templates write `arguments | tojson`: a mapping, not OpenAI's JSON string (encoded twice)
                calls = [
                    {
                        **c,
                        "function": {**c["function"], "arguments": json.loads(c["function"].get("arguments") or "{}")},
                    }
                    for c in m["tool_calls"]
                ]
                m = {**m, "tool_calls": calls}
            elif m.get("tool_calls"):
                calls = "".join(
                    "<tool_call>"
                    + json.dumps(
                        {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"] or "{}")}
                    )
                    + "</tool_call>"
                    for c in m["tool_calls"]
                )
                m = {**m, "content": (m.get("content") or "") + calls}
            rendered.append(m)
        return self.tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=generation, **kwargs)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _chat_prompt(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> tuple[list[int], Interaction | None]:
        parent = self.cache.find_chat_parent(messages)
        text = self._render(messages, tools, generation=True, template_kwargs=template_kwargs)
        if parent is not None:
            k = len(parent.messages) + 1
            # the parent's prompt and its own tokens as text: what follows is new, including what the template
            # puts after a generated end-of-turn token (Qwen's "\n" after <|im_end|>), which a cut after the
            # re-rendered assistant turn dropped
            own = self._render(
                messages[: k - 1], tools, generation=True, template_kwargs=template_kwargs
            ) + self.tokenizer.decode(parent.output_ids, skip_special_tokens=False)
            if text.startswith(own):
                return parent.full_ids + self._encode(text[len(own) :]), parent
            # the turn rendered otherwise (tool calls)
            base = self._render(messages[:k], tools, generation=False, template_kwargs=template_kwargs)
            if text.startswith(base):
                return parent.full_ids + self._encode(text[len(base) :]), parent
            logger.warning(
                "chat template renders the history of turn %s differently once extended; "
                "re-tokenising the whole prompt (concat export splits here)",
                parent.id,
            )
        return self._encode(text), parent

    def _sampling(self, req: dict[str, Any], index: int) -> SamplingParams:
        d = self.default_sampling
        max_tokens = next(
            (req[k] for k in ("max_completion_tokens", "max_tokens") if req.get(k) is not None), d.max_new_tokens
        )  # a 0 is a value (refused below), not a missing one
        stop = self._stops(req)
        seed = req.get("seed", d.seed)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise AgentRequestError(f"seed must be an integer, got {seed!r:.40}")
        extra = req.get("extra_body") or {}
        temperature = req.get("temperature", d.temperature)
        if self.fixed_temperature and temperature != d.temperature:
            # the trainer recomputes every log-prob at the run's temperature: tokens sampled at another
            # would train against log-probs of a distribution they were not drawn from
            raise AgentRequestError(
                f"temperature={temperature!r}: the trainer scores this episode's tokens at the rollout temperature "
                f"{d.temperature:g} (rollout.temperature), so a sample at another would train on mismatched "
                "log-probs: leave temperature out of the request, or set rollout.temperature to it"
            )
        try:
            return SamplingParams(
                temperature=temperature,
                top_p=req.get("top_p", d.top_p),
                top_k=extra.get("top_k", d.top_k),
                min_p=extra.get("min_p", d.min_p),
                repetition_penalty=extra.get("repetition_penalty", d.repetition_penalty),
                min_new_tokens=extra.get("min_tokens", d.min_new_tokens),
                max_new_tokens=max_tokens,
                stop=stop,
                stop_token_ids=tuple(extra.get("stop_token_ids", d.stop_token_ids)),
                ignore_eos=extra.get("ignore_eos", d.ignore_eos),
                seed=None if seed is None else seed + index,
            )
        except ValueError as exc:
            raise AgentRequestError(f"sampling parameters: {exc}") from None

    def _stops(self, req: dict[str, Any]) -> tuple[str, ...]:
        stop = req.get("stop")
        return (stop,) if isinstance(stop, str) else tuple(stop or self.default_sampling.stop)

    def _text(self, out: GenerationOutput, req: dict[str, Any]) -> str:
        """The completion's text: the engine's, else its tokens decoded and cut at a stop string as the
        engine cuts (a stop string matched at the very start leaves the engine's text empty)."""
        if out.text or not out.output_ids:
            return out.text
        text = self.tokenizer.decode(out.output_ids, skip_special_tokens=True)
        cuts = [text.find(s) for s in self._stops(req) if s and s in text]
        return text[: min(cuts)] if cuts else text

    async def _agenerate_n(
        self, prompt_ids: list[int], req: dict[str, Any], images: ImageInputs | None = None
    ) -> tuple[list[GenerationOutput], float]:
        n = 1 if req.get("n") is None else req["n"]
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise AgentRequestError(f"n must be >= 1, got {n}")
        params = [self._sampling(req, i) for i in range(n)]
        t0 = time.perf_counter()
        outs = await agenerate_many(self.rollout_client, prompt_ids, params, images=images)
        return outs, time.perf_counter() - t0

    # ---- the two endpoints
    async def acreate_chat(self, **req: Any) -> ChatCompletion | ReplayedStream:
        """``stream=True``: the response as a ``ReplayedStream`` of ``ChatCompletionChunk``s."""
        include_usage = _include_usage(req)
        _check_kwargs(req, _CHAT_KEYS, "chat.completions.create")
        if req.pop("stream", False):
            return ReplayedStream(_chat_chunks(await self.acreate_chat(**req), include_usage))
        if not req.get("messages"):
            raise AgentRequestError("messages is empty: send at least one message")
        messages = [_normalise_message(m, i) for i, m in enumerate(req["messages"])]
        tools = [validate_tool_schema(_plain(t)) for t in req.get("tools") or []] or None
        for legacy, instead in (
            ("functions", "tools=[{'type': 'function', 'function': ...}]"),
            ("function_call", "tool_choice"),
        ):
            if req.get(legacy) is not None:  # left unread, the tools would neither reach the prompt nor be parsed
                raise AgentRequestError(
                    f"chat.completions.create: {legacy} is the deprecated form of tools and is not supported: send {instead}"
                )
        if req.get("tool_choice") not in (None, "auto", "none"):
            raise AgentRequestError(
                f"chat.completions.create: tool_choice {json.dumps(_plain(req['tool_choice']))} is not supported: this "
                "engine does not force tool calls: send 'auto' or 'none', or drop it"
            )
        if req.get("tool_choice") == "none":
            tools = None
        template_kwargs = (req.get("extra_body") or {}).get("chat_template_kwargs")
        urls = _image_urls(req["messages"])
        images = None
        if urls:  # the whole prompt is tokenised again: earlier turns' image tokens are already expanded
            if self.vision is None:
                raise AgentRequestError(
                    "image_url content needs a vision-language policy (ArenoAsyncOpenAI(vision=...))"
                )
            images = ImageInputs.from_images([decode_image(u) for u in urls], self.vision)
            text_ids = self._encode(self._render(messages, tools, generation=True, template_kwargs=template_kwargs))
            prompt_ids, parent = expand_image_tokens(text_ids, images.grid_thw, self.vision), None
        else:
            prompt_ids, parent = self._chat_prompt(messages, tools, template_kwargs)
        outs, duration = await self._agenerate_n(prompt_ids, req, images)
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        choices = []
        for index, out in enumerate(outs):
            message, calls, errors = self._chat_message(self._text(out, req), tools)
            inter = Interaction(
                id=response_id if len(outs) == 1 else f"{response_id}-{index}",
                messages=messages,
                prompt_ids=prompt_ids,
                output_ids=list(out.output_ids),
                output_logprobs=list(out.output_logprobs),
                output_versions=list(out.output_versions),
                finish_reason=out.finish_reason,
                response={k: v for k, v in message.items() if k in ("role", "content", "tool_calls")},
                tool_calls=calls,
                info={"response_id": response_id, "tool_call_errors": errors},
            )
            if images is not None:
                inter.info["images"] = stash_images(images, self.store)
            self.cache.add(inter, parent)
            self._record_turns(messages, parent, message, out, duration)
            finish = "tool_calls" if calls and out.finish_reason == "stop" else out.finish_reason
            choices.append(
                {
                    "index": index,
                    "message": message,
                    "finish_reason": _openai_finish(finish),
                    "logprobs": self._chat_logprobs(out) if req.get("logprobs") else None,
                    "token_ids": list(out.output_ids),
                    "prompt_token_ids": prompt_ids,
                }
            )
        return _response(ChatCompletion, "chat.completion", response_id, req, choices, prompt_ids, outs)

    def _chat_message(
        self, text: str, tools: list[dict[str, Any]] | None
    ) -> tuple[dict[str, Any], list[dict[str, Any]], list[str]]:
        """The assistant message of one generated ``text`` with the tool calls parsed out of it
        (when the request offered tools), the calls (OpenAI form) and the parse errors."""
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if not tools:
            return message, [], []
        content, parsed = parse_tool_calls(text)
        calls = [c.to_openai() for c in parsed if not hasattr(c, "message")]
        errors = [c.message for c in parsed if hasattr(c, "message")]
        if calls or errors:  # a reply of tool calls only has no content (null), as OpenAI's
            message["content"] = (content or None) if not errors else text
        if calls:
            message["tool_calls"] = calls
        if errors:
            message["tool_call_errors"] = errors
        return message, calls, errors

    def _chat_logprobs(self, out: GenerationOutput) -> dict[str, Any]:
        """A chat choice's ``logprobs``: one entry per generated token (no alternatives)."""
        content = []
        for t, lp in zip(out.output_ids, out.output_logprobs):
            token = self.tokenizer.decode([t])
            content.append({"token": token, "logprob": lp, "bytes": list(token.encode()), "top_logprobs": []})
        return {"content": content}

    async def acreate_completion(self, **req: Any) -> Completion | ReplayedStream:
        """``stream=True``: the response as a ``ReplayedStream`` of ``Completion`` chunks."""
        include_usage = _include_usage(req)
        _check_kwargs(req, _COMPLETION_KEYS, "completions.create")
        if req.pop("stream", False):
            return ReplayedStream(_completion_chunks(await self.acreate_completion(**req), include_usage))
        if req.get("echo"):
            raise AgentRequestError(
                "completions.create: echo true is not supported: this client returns the completion only (prepend the "
                "prompt yourself), or drop it"
            )
        prompt_ids = self._completion_prompt_ids(req.get("prompt"))
        outs, _ = await self._agenerate_n(prompt_ids, req)
        response_id = f"cmpl-{uuid.uuid4().hex}"
        parent = self.cache.find_token_parent(prompt_ids)
        choices = []
        for index, out in enumerate(outs):
            text = self._text(out, req)
            inter = Interaction(
                id=response_id if len(outs) == 1 else f"{response_id}-{index}",
                messages=None,
                prompt_ids=prompt_ids,
                output_ids=list(out.output_ids),
                output_logprobs=list(out.output_logprobs),
                output_versions=list(out.output_versions),
                finish_reason=out.finish_reason,
                response={"text": text},
                info={"response_id": response_id},
            )
            self.cache.add(inter, parent)
            if self.session is not None:
                self.session.turn("assistant", text, num_tokens=len(out.output_ids))
            choices.append(
                {
                    "index": index,
                    "text": text,
                    "finish_reason": _openai_finish(out.finish_reason),
                    "logprobs": self._completion_logprobs(out) if req.get("logprobs") is not None else None,
                    "token_ids": list(out.output_ids),
                    "prompt_token_ids": prompt_ids,
                }
            )
        return _response(Completion, "text_completion", response_id, req, choices, prompt_ids, outs)

    def _completion_prompt_ids(self, prompt: Any) -> list[int]:
        """A completion request's one prompt (a string or token ids) as token ids."""
        if isinstance(prompt, str):  # with the tokenizer's specials (a BOS), as areno serve and training encode it
            prompt_ids = list(self.tokenizer(prompt)["input_ids"])
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            prompt_ids = list(prompt)
        else:
            raise AgentRequestError("prompt must be a string or a list of token ids (one prompt per call)")
        if not prompt_ids:
            raise AgentRequestError("prompt is empty: send at least one token")
        return prompt_ids

    def _completion_logprobs(self, out: GenerationOutput) -> dict[str, Any]:
        """A completion choice's ``logprobs`` in the legacy layout (tokens, log-probs, offsets)."""
        tokens = [self.tokenizer.decode([t]) for t in out.output_ids]
        offsets, pos = [], 0
        for t in tokens:  # a running sum, as the server's: a sum per prefix is quadratic (seconds at 16k tokens)
            offsets.append(pos)
            pos += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": list(out.output_logprobs),
            "top_logprobs": [{} for _ in tokens],
            "text_offset": offsets,
        }

    def _record_turns(
        self,
        messages: list[dict[str, Any]],
        parent: Interaction | None,
        message: dict[str, Any],
        out: GenerationOutput,
        duration: float,
    ) -> None:
        if self.session is None:
            return
        start = len(parent.messages) + 1 if parent is not None else 0
        for m in messages[start:]:
            self.session.turn(m["role"], m.get("content") or "")
        self.session.turn(
            "assistant",
            message.get("content") or "",
            num_tokens=len(out.output_ids),
            duration_s=duration,
            tool_calls=len(message.get("tool_calls", [])),
        )


def _areward(reward_fn: RewardFn) -> Callable[..., Awaitable[float]]:
    """``reward_fn`` as an async function returning a float: the configured reward is a coroutine
    function under the reward sandbox and a plain one with ``reward.sandbox=false``, and agent code
    must not depend on which. A mapping return gives its ``"score"`` (``reward_parts``)."""

    async def areward(prompt: Any, completion: str, answer: Any = None, **fields: Any) -> float:
        value = reward_fn(prompt, completion, answer, **fields)
        return reward_parts(await value if inspect.isawaitable(value) else value)[0]

    return areward


def _response_text(response: dict[str, Any]) -> str | None:
    """A recorded completion's text: a chat reply's content, a raw completion's text."""
    return response.get("content", response.get("text"))


_EXTRA_BODY_KEYS = frozenset({"top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids", "ignore_eos"})
"""vLLM's extra sampling parameters this client honours (a chat also takes ``chat_template_kwargs``)."""
_EXTRA_BODY_NO_OP = {
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "include_stop_str_in_output": False,
    "add_generation_prompt": True,
    "echo": False,
}
"""vLLM's extra parameters at the value that changes nothing here (agent stacks send them): dropped."""
_UNSET = object()


def _check_kwargs(req: dict[str, Any], known: frozenset[str], where: str) -> None:
    """Drop from ``req`` what changes no output (``_IGNORED``, unset values, no-op values of
    ``_NO_OP``); a TypeError for a parameter the official client does not have, an
    :class:`AgentRequestError` naming one this client cannot honour at the value asked."""
    for key in list(req):
        if key in _IGNORED:
            req.pop(key)
        elif key not in known and key not in _NO_OP and key != "best_of":
            raise TypeError(f"{where}() got an unexpected keyword argument {key!r}")
    for key in [k for k, v in req.items() if v is None or isinstance(v, _NotGiven) or type(v).__name__ == "NotGiven"]:
        req.pop(key)
    for key, (allowed, why) in _NO_OP.items():
        value = _plain(req.pop(key, None))
        if value not in allowed:
            raise AgentRequestError(f"{where}: {key} {json.dumps(value, default=str)} is not supported: {why}")
    best_of = req.pop("best_of", None)
    if best_of is not None and best_of != req.get("n", 1):
        raise AgentRequestError(
            f"{where}: best_of {best_of} is not supported (it would rank extra samples): drop it, or sample "
            f"n={best_of} and rank them yourself"
        )
    extra = req.get("extra_body") or {}
    served = _EXTRA_BODY_KEYS | ({"chat_template_kwargs"} if known is _CHAT_KEYS else set())
    if not isinstance(extra, dict):
        raise AgentRequestError(f"{where}: extra_body must be a mapping, got {extra!r:.40}")
    # what changes no output (vLLM's defaults, a null) is dropped; the rest is refused by name
    extra = {k: v for k, v in extra.items() if v is not None and _EXTRA_BODY_NO_OP.get(k, _UNSET) != v}
    req["extra_body"] = extra
    if any(k not in served for k in extra):
        unknown = sorted(set(extra) - served)
        raise AgentRequestError(
            f"{where}: extra_body {unknown!r} is not supported; it takes {sorted(served)} (and other vLLM "
            "parameters at their defaults)"
        )
    if not isinstance(extra.get("chat_template_kwargs", {}), dict):
        raise AgentRequestError(f"{where}: extra_body chat_template_kwargs must be a mapping of template variables")
    # top alternatives per token: the engine computes none, and empty lists would read as an answer
    top = "top_logprobs" if "top_logprobs" in known else "logprobs"
    if req.get(top):
        raise AgentRequestError(
            f"{where}: {top}={req[top]} asks for each token's top alternatives, which areno's engine does not "
            f"compute: leave {top} unset or 0 (each sampled token's log-prob comes with "
            f"{'logprobs=True' if top == 'top_logprobs' else 'logprobs=0'})"
        )


def _response(
    type_: type,
    object_name: str,
    response_id: str,
    req: dict[str, Any],
    choices: list[dict[str, Any]],
    prompt_ids: list[int],
    outs: list[GenerationOutput],
) -> Any:
    """The ``openai.types`` response object (``ChatCompletion`` or ``Completion``) of one request."""
    return construct_type(
        type_=type_,
        value={
            "id": response_id,
            "object": object_name,
            "created": int(time.time()),
            "model": req.get("model") or "areno",
            "choices": choices,
            "usage": _usage(prompt_ids, outs),
        },
    )


def _openai_finish(reason: str) -> str:
    # OpenAI has no 'abort'; an aborted request (weights swapped with abort policy) reads as 'length'.
    return {"abort": "length"}.get(reason, reason)


def _usage(prompt_ids: list[int], outs: list[GenerationOutput]) -> dict[str, int]:
    """OpenAI's ``usage``: the prompt once, however many choices; the completion tokens of them all."""
    completion = sum(len(o.output_ids) for o in outs)
    prompt = len(prompt_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _include_usage(req: dict[str, Any]) -> bool:
    options = req.get("stream_options")
    return bool(_plain(options).get("include_usage")) if isinstance(options, dict) else False


class ReplayedStream:
    """What ``stream=True`` returns: a finished response as the chunks a streaming server sends (the
    recording client generates each completion whole, so they all arrive once it is done), iterated
    with ``async for`` like the official client's ``AsyncStream``."""

    def __init__(self, chunks: list[Any]) -> None:
        self.chunks = chunks
        self._next = 0

    def __aiter__(self) -> ReplayedStream:
        return self

    async def __anext__(self) -> Any:
        if self._next >= len(self.chunks):
            raise StopAsyncIteration
        self._next += 1
        return self.chunks[self._next - 1]

    async def __aenter__(self) -> ReplayedStream:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        self._next = len(self.chunks)


def _chunk_head(response: Any, object_name: str) -> dict[str, Any]:
    return {"id": response.id, "object": object_name, "created": response.created, "model": response.model}


def _usage_chunk(response: Any, object_name: str, type_: type) -> Any:
    return construct_type(
        type_=type_, value={**_chunk_head(response, object_name), "choices": [], "usage": response.usage.model_dump()}
    )


def _chat_chunks(response: ChatCompletion, include_usage: bool) -> list[ChatCompletionChunk]:
    """Per choice: the role and content, the tool calls (with their index), the finish reason."""
    head = _chunk_head(response, "chat.completion.chunk")
    values = []
    for choice in response.choices:
        extra = choice.model_extra or {}
        first = {"role": "assistant", "content": choice.message.content or ""}
        values.append({
            "index": choice.index, "delta": first, "finish_reason": None,
            "logprobs": choice.logprobs.model_dump() if choice.logprobs is not None else None,
            "token_ids": extra.get("token_ids"), "prompt_token_ids": extra.get("prompt_token_ids"),
        })  # fmt: skip
        calls = choice.message.tool_calls or []
        if calls:
            deltas = [{"index": k, **call.model_dump()} for k, call in enumerate(calls)]
            values.append(
                {"index": choice.index, "delta": {"tool_calls": deltas}, "finish_reason": None, "token_ids": []}
            )
        values.append({"index": choice.index, "delta": {}, "finish_reason": choice.finish_reason, "token_ids": []})
    chunks = [construct_type(type_=ChatCompletionChunk, value={**head, "choices": [v]}) for v in values]
    if include_usage:
        chunks.append(_usage_chunk(response, "chat.completion.chunk", ChatCompletionChunk))
    return chunks


def _completion_chunks(response: Completion, include_usage: bool) -> list[Completion]:
    """One chunk per choice (its whole text), then the usage when asked for."""
    head = _chunk_head(response, "text_completion")
    chunks = [
        construct_type(type_=Completion, value={**head, "choices": [choice.model_dump()]})
        for choice in response.choices
    ]
    if include_usage:
        chunks.append(_usage_chunk(response, "text_completion", Completion))
    return chunks


class _ChatCompletions:
    def __init__(self, owner: ArenoAsyncOpenAI) -> None:
        self._owner = owner

    async def create(self, **kwargs: Any) -> ChatCompletion | ReplayedStream:
        return await self._owner.acreate_chat(**kwargs)


class _Chat:
    def __init__(self, owner: ArenoAsyncOpenAI) -> None:
        self.completions = _ChatCompletions(owner)


class _Completions:
    def __init__(self, owner: ArenoAsyncOpenAI) -> None:
        self._owner = owner

    async def create(self, **kwargs: Any) -> Completion | ReplayedStream:
        return await self._owner.acreate_completion(**kwargs)


# ------------------------------------------------------------------------------------------ proxy
class AgentProxy:
    """The recording client over HTTP on 127.0.0.1, one base URL per episode.

    ``sid, base_url = proxy.start_session()`` → the agent uses ``openai.AsyncOpenAI(base_url=base_url,
    api_key="areno")``; it may ``POST {base_url}/reward`` ``{"reward": r, "id": optional}`` (no id:
    the newest completion); ``proxy.end_session(sid)`` returns the ``ArenoAsyncOpenAI`` holding the
    recorded interactions. Serving starts with ``start()`` (a uvicorn thread) or use ``app`` in tests.
    """

    def __init__(
        self,
        rollout_client: Any,
        tokenizer: Any,
        *,
        default_sampling: SamplingParams | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        fixed_temperature: bool = False,
    ) -> None:
        """``api_key``: every request must carry ``Authorization: Bearer <key>`` (the ``openai``
        client's ``api_key``); required when ``host`` is not a loopback address. ``fixed_temperature``:
        as ``ArenoAsyncOpenAI``'s, for every session."""
        check_bind(host, api_key)
        self.api_key = api_key
        self.rollout_client = rollout_client
        self.tokenizer = tokenizer
        self.default_sampling = default_sampling
        self.fixed_temperature = fixed_temperature
        self.host = host
        self.port = port
        self.sessions: dict[str, ArenoAsyncOpenAI] = {}
        self._server: ServerThread | None = None
        self.app = self._build_app()

    def start_session(self, session: Any = None) -> tuple[str, str]:
        sid = uuid.uuid4().hex[:16]
        self.sessions[sid] = ArenoAsyncOpenAI(
            self.rollout_client,
            self.tokenizer,
            default_sampling=self.default_sampling,
            session=session,
            fixed_temperature=self.fixed_temperature,
        )
        return sid, f"{self.base_url}/sessions/{sid}/v1"

    def end_session(self, sid: str) -> ArenoAsyncOpenAI:
        try:
            return self.sessions.pop(sid)
        except KeyError:
            raise KeyError(f"no proxy session {sid!r} (already ended?)") from None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _build_app(self) -> Any:
        import hmac

        app = FastAPI(title="areno agent proxy")
        expected = f"Bearer {self.api_key}".encode() if self.api_key else b""

        @app.middleware("http")
        async def _auth(request: Request, call_next):
            if self.api_key and not hmac.compare_digest(request.headers.get("authorization", "").encode(), expected):
                return JSONResponse(
                    status_code=401,
                    content={
                        "error": {
                            "message": "missing or wrong API key: pass the proxy's api_key to the openai client",
                            "type": "authentication_error",
                            "param": None,
                            "code": None,
                        }
                    },
                )
            return await call_next(request)

        def error(status: int, message: str) -> JSONResponse:
            return JSONResponse(
                status_code=status,
                content={"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}},
            )

        async def call(sid: str, request: Request, chat: bool) -> Any:
            client = self.sessions.get(sid)
            if client is None:
                return error(404, f"no agent session {sid!r}: start one with AgentProxy.start_session()")
            try:
                body = await request.json()
            except json.JSONDecodeError as exc:
                return error(400, f"request body is not valid JSON: {exc}")
            if not isinstance(body, dict):
                return error(400, f"the request body must be a JSON object, got a JSON {type(body).__name__}")
            moved = (*sorted(_EXTRA_BODY_KEYS), "chat_template_kwargs")
            extra = {k: body.pop(k) for k in moved if k in body}
            if extra:
                body["extra_body"] = extra
            try:
                resp = await (client.acreate_chat(**body) if chat else client.acreate_completion(**body))
            except (ValueError, TypeError) as exc:  # AgentRequestError, ToolSchemaError, engine limits
                return error(400, str(exc))
            if isinstance(resp, ReplayedStream):  # server-sent events, as a streaming server sends them
                events = [f"data: {c.model_dump_json()}\n\n" for c in resp.chunks] + ["data: [DONE]\n\n"]
                return StreamingResponse(iter(events), media_type="text/event-stream")
            return resp.model_dump(exclude_none=False)

        @app.post("/sessions/{sid}/v1/chat/completions")
        async def chat(sid: str, request: Request) -> Any:
            return await call(sid, request, True)

        @app.post("/sessions/{sid}/v1/completions")
        async def completions(sid: str, request: Request) -> Any:
            return await call(sid, request, False)

        @app.get("/sessions/{sid}/v1/models")
        async def models(sid: str) -> dict:
            return {"object": "list", "data": [{"id": "areno", "object": "model", "owned_by": "areno", "created": 0}]}

        @app.post("/sessions/{sid}/v1/reward")
        async def reward(sid: str, request: Request) -> Any:
            client = self.sessions.get(sid)
            if client is None:
                return error(404, f"no agent session {sid!r}")
            try:
                body = await request.json()
            except json.JSONDecodeError as exc:
                return error(400, f"request body is not valid JSON: {exc}")
            if (
                not isinstance(body, dict)
                or isinstance(body.get("reward"), bool)
                or not isinstance(body.get("reward"), (int, float))
            ):
                return error(400, 'reward must be a number: POST {"reward": 1.0, "id": optional completion id}')
            try:
                if body.get("id"):
                    client.set_reward(body["id"], body["reward"])
                else:
                    client.set_last_reward(body["reward"])
            except (KeyError, ValueError) as exc:
                return error(400, str(exc))
            return {"ok": True}

        return app

    def start(self) -> AgentProxy:
        """Serve on ``host:port`` (port 0 picks a free one) from a background thread."""
        self._server = ServerThread(
            self.app, host=self.host, port=self.port, log_level="warning", name="areno-agent-proxy"
        ).start()
        self.port = self._server.port
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None


__all__ = ["AgentProxy", "AgentRequestError", "ArenoAsyncOpenAI"]
