"""walk27: the recording client and its proxy against the OpenAI API. A tool call in the history reached a
tool-taking template with its arguments still a JSON string (encoded twice in the trained prompt); tool_choice
"required"/named, the deprecated functions/function_call and echo were accepted and ignored; max_tokens=0 and n=0
were replaced by defaults; a string prompt lost the tokenizer's BOS that areno serve and training keep; an
empty stop string ended every completion at once; malformed bodies were 500s or unclear 400s."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from tokenizers import processors

from areno.data.tokenizer import build_char_tokenizer
from areno.types import SamplingParams
from areno.workflows.openai_client import AgentProxy, AgentRequestError, ArenoAsyncOpenAI
from areno.workflows.tools import CALCULATOR_SCHEMA

CALL = {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"expr": "2+3"}'}}
HISTORY = [
    {"role": "user", "content": "2+3="},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": "5"},
]
TOOL_TEMPLATE = (  # as Qwen2.5's and Llama-3.1's: a call's arguments written with `| tojson`
    "{% for m in messages %}{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}</tool_call>'
    "{% endfor %}{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}"
)


def _chat(client, **kw):
    return asyncio.run(client.chat.completions.create(model="m", **kw))


def test_a_tool_call_in_the_history_reaches_a_tool_template_as_a_mapping(scripted):
    tokenizer = build_char_tokenizer()  # not the session's: its template changes here
    tokenizer.chat_template = TOOL_TEMPLATE
    rollout = scripted(["5", "5"])
    client = ArenoAsyncOpenAI(rollout, tokenizer, render_tools="template")
    _chat(client, messages=HISTORY, tools=[CALCULATOR_SCHEMA])
    prompt = tokenizer.decode(rollout.prompts[0])
    assert '<tool_call>{"name": "calc", "arguments": {"expr": "2+3"}}</tool_call>' in prompt, prompt
    assert '\\"' not in prompt
    # a history built by hand with the arguments as a mapping renders the same
    by_hand = [
        HISTORY[0],
        {**HISTORY[1], "tool_calls": [{**CALL, "function": {"name": "calc", "arguments": {"expr": "2+3"}}}]},
        HISTORY[2],
    ]
    _chat(client, messages=by_hand, tools=[CALCULATOR_SCHEMA])
    assert tokenizer.decode(rollout.prompts[1]) == prompt


def test_requests_this_client_cannot_honour_are_refused_by_name(scripted, char_tokenizer):
    client = ArenoAsyncOpenAI(scripted(lambda p: "ok"), char_tokenizer)
    user = [{"role": "user", "content": "hi"}]
    tools = [CALCULATOR_SCHEMA]
    for kw, message in (
        ({"tool_choice": "required", "tools": tools}, r"tool_choice \"required\" is not supported"),
        ({"tool_choice": {"type": "function", "function": {"name": "calc"}}, "tools": tools}, "tool_choice"),
        ({"functions": [CALCULATOR_SCHEMA["function"]]}, "functions is the deprecated form of tools"),
        ({"function_call": "auto"}, "function_call is the deprecated form"),
        ({"max_tokens": 0}, "max_new_tokens must be > 0"),
        ({"max_completion_tokens": 0, "max_tokens": 2}, "max_new_tokens must be > 0"),
        ({"n": 0}, "n must be >= 1"),
        ({"stop": ""}, "stop strings must be non-empty"),
        ({"seed": "x"}, "seed must be an integer"),
    ):
        with pytest.raises(AgentRequestError, match=message):
            _chat(client, messages=user, **kw)
    with pytest.raises(AgentRequestError, match="echo true is not supported"):
        asyncio.run(client.completions.create(model="m", prompt="ab", echo=True))
    _chat(client, messages=user, tools=tools, tool_choice="auto")  # what it honours still goes
    _chat(client, messages=user, tools=tools, tool_choice="none")
    with pytest.raises(AgentRequestError, match=r"messages\[1\].tool_calls\[0\] must be"):
        _chat(client, messages=[user[0], {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}])
    bad_args = {**CALL, "function": {"name": "calc", "arguments": "{not json"}}
    with pytest.raises(AgentRequestError, match=r"messages\[1\].tool_calls\[0\].function.arguments must be a JSON"):
        _chat(client, messages=[user[0], {"role": "assistant", "content": None, "tool_calls": [bad_args]}])


def test_a_string_prompt_keeps_the_tokenizers_bos_as_areno_serve_does(scripted):
    tokenizer = build_char_tokenizer()
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.bos_token_id)]
    )
    rollout = scripted(["x"])
    asyncio.run(ArenoAsyncOpenAI(rollout, tokenizer).completions.create(model="m", prompt="ab"))
    assert rollout.prompts[0] == tokenizer("ab")["input_ids"] == [tokenizer.bos_token_id, *tokenizer.encode("ab")[1:]]


def test_the_proxy_answers_malformed_bodies_with_400s(scripted, char_tokenizer):
    proxy = AgentProxy(scripted(lambda p: "ok"), char_tokenizer, default_sampling=SamplingParams(max_new_tokens=4))
    proxy.start()
    try:
        _, base_url = proxy.start_session()
        client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError, match=r"messages\[1\].tool_calls\[0\] must be"):
            client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [{"id": "1"}]}],
            )
        assert client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}]).choices
        as_list = httpx.post(f"{base_url}/chat/completions", json=[1, 2])
        assert as_list.status_code == 400 and "must be a JSON object" in as_list.json()["error"]["message"]
        reward = httpx.post(f"{base_url}/reward", content=b"{not json", headers={"content-type": "application/json"})
        assert reward.status_code == 400 and "not valid JSON" in reward.json()["error"]["message"]
    finally:
        proxy.stop()


def test_the_proxy_takes_vllms_sampling_keys_at_the_top_of_the_body(scripted, char_tokenizer):
    """vLLM's OpenAI server reads top_k, min_p, repetition_penalty, ... at the top level of the JSON body (the
    official client sends extra_body there): the proxy hands each to the sampler."""
    rollout = scripted(lambda p: "ok")
    proxy = AgentProxy(rollout, char_tokenizer, default_sampling=SamplingParams(max_new_tokens=4))
    proxy.start()
    try:
        _, base_url = proxy.start_session()
        client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
        extra = {"top_k": 5, "min_p": 0.2, "repetition_penalty": 1.3, "min_tokens": 1}
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}], extra_body=extra)
    finally:
        proxy.stop()
    (params,) = rollout.params
    assert (params.top_k, params.min_p, params.repetition_penalty, params.min_new_tokens) == (5, 0.2, 1.3, 1)
