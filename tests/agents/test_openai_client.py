"""The recording client against the official ``openai`` client: same requests, same handling."""

import asyncio
import json

import httpx
import openai
import pytest

from areno.data.tokenizer import build_char_tokenizer
from areno.types import SamplingParams
from areno.workflows.openai_client import AgentProxy, AgentRequestError, ArenoAsyncOpenAI
from areno.workflows.tools import CALCULATOR_SCHEMA, ToolSchemaError, ToolSet, calculator_tool
from tests.helpers.async_fakes import replying

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+3="}]


def official(app, base_url="http://areno/v1"):
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=base_url)
    return openai.AsyncOpenAI(base_url=base_url, api_key="x", http_client=http, max_retries=0)


def _same_choice(a, b):
    ea, eb = a.model_extra, b.model_extra
    assert ea["token_ids"] == eb["token_ids"] and ea["prompt_token_ids"] == eb["prompt_token_ids"]
    assert a.finish_reason == b.finish_reason


def test_chat_identical_to_official_client_on_areno_server(served):
    app, rollout_client, tokenizer = served
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=8, temperature=1.0, seed=11, n=2, logprobs=True)

    async def go():
        ref = await official(app).chat.completions.create(**kwargs)
        rec = ArenoAsyncOpenAI(rollout_client, tokenizer)
        mine = await rec.chat.completions.create(**kwargs)
        return ref, mine, rec

    ref, mine, rec = asyncio.run(go())
    assert type(mine) is type(ref) and mine.object == "chat.completion" and len(mine.choices) == 2
    for a, b in zip(ref.choices, mine.choices):
        _same_choice(a, b)
        assert a.message.content == b.message.content and a.message.role == b.message.role == "assistant"
        assert [t.logprob for t in a.logprobs.content] == pytest.approx(
            [t.logprob for t in b.logprobs.content], abs=1e-5
        )
    assert mine.usage == ref.usage
    # recorded: exact ids, log-probs, versions and messages of both choices
    inters = rec.cache.ordered()
    assert len(inters) == 2 and inters[0].messages == MESSAGES
    # as OpenAI counts: the prompt once, the completion tokens of both choices
    completion = sum(len(c.model_extra["token_ids"]) for c in mine.choices)
    assert (mine.usage.prompt_tokens, mine.usage.completion_tokens) == (len(inters[0].prompt_ids), completion)
    assert inters[1].output_ids == mine.choices[1].model_extra["token_ids"]
    assert inters[1].output_logprobs == pytest.approx([t.logprob for t in mine.choices[1].logprobs.content])
    assert inters[0].output_versions == [0] * len(inters[0].output_ids)
    assert inters[0].prompt_ids == tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_completions_identical_to_official_client(served):
    app, rollout_client, tokenizer = served
    kwargs = dict(model="tiny", prompt="12+7=", max_tokens=6, temperature=0, logprobs=0)

    async def go():
        return (
            await official(app).completions.create(**kwargs),
            await ArenoAsyncOpenAI(rollout_client, tokenizer).completions.create(**kwargs),
        )

    ref, mine = asyncio.run(go())
    _same_choice(ref.choices[0], mine.choices[0])
    assert mine.choices[0].text == ref.choices[0].text
    assert mine.choices[0].logprobs.tokens == ref.choices[0].logprobs.tokens
    assert mine.choices[0].logprobs.text_offset == ref.choices[0].logprobs.text_offset


def test_official_client_through_the_proxy_matches_in_process(served):
    app, rollout_client, tokenizer = served
    proxy = AgentProxy(rollout_client, tokenizer)
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=6, temperature=1.0, seed=3)

    async def go():
        sid, _ = proxy.start_session()
        via_proxy = await official(proxy.app, f"http://areno/sessions/{sid}/v1").chat.completions.create(**kwargs)
        direct = await ArenoAsyncOpenAI(rollout_client, tokenizer).chat.completions.create(**kwargs)
        return sid, via_proxy, direct

    sid, via_proxy, direct = asyncio.run(go())
    _same_choice(via_proxy.choices[0], direct.choices[0])
    recorded = proxy.end_session(sid)
    assert recorded.cache.last.id == via_proxy.id
    assert recorded.cache.last.output_ids == via_proxy.choices[0].model_extra["token_ids"]


def test_proxy_over_http_on_localhost(served):
    """A real socket on 127.0.0.1: an agent in another process would do exactly this."""
    app, rollout_client, tokenizer = served
    proxy = AgentProxy(rollout_client, tokenizer, default_sampling=SamplingParams(max_new_tokens=4)).start()
    try:
        assert proxy.base_url.startswith("http://127.0.0.1:")
        sid, base_url = proxy.start_session()
        client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
        first = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        client.chat.completions.create(
            model="tiny",
            messages=[
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "again"},
            ],
        )
        assert httpx.post(f"{base_url}/reward", json={"reward": 1.0}).json() == {"ok": True}
        assert httpx.post(f"{base_url}/reward", json={"id": first.id, "reward": 0.25}).status_code == 200
        bad = httpx.post(f"{base_url}/reward", json={"id": "nope", "reward": 1})
        assert bad.status_code == 400 and "no completion 'nope'" in bad.json()["error"]["message"]
        with pytest.raises(openai.BadRequestError, match="messages is empty"):
            client.chat.completions.create(model="tiny", messages=[])
        with pytest.raises(openai.NotFoundError, match="no agent session"):
            openai.OpenAI(base_url=f"{proxy.base_url}/sessions/zzz/v1", api_key="x", max_retries=0).completions.create(
                model="tiny", prompt="a"
            )
        # a streamed call through the proxy: server-sent chunks the official client reads
        sid2, url2 = proxy.start_session()
        chunks = list(
            openai.OpenAI(base_url=url2, api_key="x", max_retries=0).chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True
            )
        )
        (streamed,) = proxy.end_session(sid2).cache.ordered()
        assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason is not None
        assert chunks[0].choices[0].model_extra["token_ids"] == streamed.output_ids
        rec = proxy.end_session(sid)
        a, b = rec.cache.ordered()
        assert b.parent is a and a.reward == 0.25 and b.reward == 1.0
        # token continuity: the second prompt extends the first prompt and output exactly
        assert b.prompt_ids[: len(a.full_ids)] == a.full_ids
        (traj,) = rec.export("concat", gamma=1.0)
        assert traj.reward == pytest.approx(1.25) and traj.prompt_ids == a.prompt_ids
    finally:
        proxy.stop()


def test_bad_requests_raise_clear_errors(scripted):
    client = ArenoAsyncOpenAI(scripted(["x"] * 5), scripted([]).tokenizer)

    async def go(**kw):
        return await client.chat.completions.create(model="m", **kw)

    with pytest.raises(TypeError, match="unexpected keyword argument 'temprature'"):
        asyncio.run(go(messages=MESSAGES, temprature=1.0))
    with pytest.raises(AgentRequestError, match="messages is empty"):
        asyncio.run(go(messages=[]))
    with pytest.raises(AgentRequestError, match="sampling parameters: top_p must be in"):
        asyncio.run(go(messages=MESSAGES, top_p=0))
    with pytest.raises(AgentRequestError, match="top_logprobs=2 asks for each token's top alternatives"):
        asyncio.run(go(messages=MESSAGES, logprobs=True, top_logprobs=2))
    with pytest.raises(AgentRequestError, match="completions.create: logprobs=1 asks for each token's top"):
        asyncio.run(client.completions.create(model="m", prompt="x", logprobs=1))
    with pytest.raises(ToolSchemaError, match="not a valid JSON Schema"):
        asyncio.run(
            go(
                messages=MESSAGES,
                tools=[
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": "x"}}}
                ],
            )
        )
    # parameters that change nothing here are accepted, as the official server does
    out = asyncio.run(go(messages=MESSAGES, presence_penalty=0.0, user="u"))
    assert out.choices[0].message.content == "x"


@pytest.mark.parametrize(
    ("endpoint", "field", "value", "fragment"),
    [
        (
            "chat",
            "presence_penalty",
            1.5,
            "presence_penalty 1.5 is not supported: this engine samples without penalties",
        ),
        ("completions", "frequency_penalty", -1, "frequency_penalty -1 is not supported: "),
        ("chat", "logit_bias", {"5": 100}, 'logit_bias {"5": 100} is not supported: this engine samples without logit'),
        ("chat", "response_format", {"type": "json_object"}, "does not constrain its output to JSON"),
        ("completions", "suffix", "END", 'suffix "END" is not supported'),
        (
            "completions",
            "best_of",
            3,
            "best_of 3 is not supported (it would rank extra samples): drop it, or sample n=3",
        ),
        ("chat", "parallel_tool_calls", False, "every tool call the model writes is returned: send true or drop it"),
        ("chat", "reasoning_effort", "low", 'reasoning_effort "low" is not supported'),
    ],
)
def test_fields_the_policy_cannot_honour_are_refused_by_name(scripted, endpoint, field, value, fragment):
    """As ``areno serve`` refuses them (its NO_OP table): an agent asking for a penalty must not
    silently sample without one. Through the proxy they are a 400 the official client raises."""
    rollout = scripted(["x"] * 4)
    client = ArenoAsyncOpenAI(rollout, rollout.tokenizer)
    proxy = AgentProxy(rollout, rollout.tokenizer)
    request = {"messages": MESSAGES} if endpoint == "chat" else {"prompt": "2+3="}

    def create(c):
        return (c.chat.completions if endpoint == "chat" else c.completions).create(
            model="m", **request, **{field: value}
        )

    with pytest.raises(AgentRequestError) as info:
        asyncio.run(create(client))
    assert f".create: {field}" in str(info.value) and fragment in str(info.value), str(info.value)
    sid, _ = proxy.start_session()
    with pytest.raises(openai.BadRequestError, match=field):
        asyncio.run(create(official(proxy.app, f"http://areno/sessions/{sid}/v1")))
    assert not rollout.prompts  # refused before anything was generated


def test_no_op_values_and_fields_that_change_no_output_are_accepted(scripted):
    rollout = scripted(["x"] * 2)
    client = ArenoAsyncOpenAI(rollout, rollout.tokenizer)
    chat = asyncio.run(
        client.chat.completions.create(
            model="m",
            messages=MESSAGES,
            frequency_penalty=0,
            presence_penalty=0.0,
            logit_bias={},
            response_format={"type": "text"},
            parallel_tool_calls=True,
            user="u",
            metadata={"k": "v"},
            store=False,
            service_tier="auto",
            timeout=5.0,
            extra_headers={"x-a": "b"},
        )
    )
    completion = asyncio.run(client.completions.create(model="m", prompt="2+3=", best_of=1, suffix="", n=1))
    assert chat.choices[0].message.content == "x" and completion.choices[0].text == "x"


def test_tool_calls_and_multi_turn_token_continuity(scripted):
    call = '<tool_call>{"name": "calc", "arguments": {"expr": "6*7"}}</tool_call>'
    rollout = scripted([call, "42", '<tool_call>{"name": "calc", "arguments": {"expr": </tool_call>'])
    tok = rollout.tokenizer
    client = ArenoAsyncOpenAI(rollout, tok, default_sampling=SamplingParams(max_new_tokens=64, temperature=0.5))
    messages = [{"role": "user", "content": "6*7?"}]

    async def go():
        first = await client.chat.completions.create(model="m", messages=messages, tools=[CALCULATOR_SCHEMA])
        msg = first.choices[0].message
        assert first.choices[0].finish_reason == "tool_calls"
        # walk27: a reply of tool calls only has content null, as OpenAI's (it was "")
        assert msg.content is None and msg.tool_calls[0].function.name == "calc"
        assert json.loads(msg.tool_calls[0].function.arguments) == {"expr": "6*7"}
        history = messages + [
            msg.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "42"},
        ]
        second = await client.chat.completions.create(model="m", messages=history, tools=[CALCULATOR_SCHEMA])
        third = await client.chat.completions.create(model="m", messages=messages, tools=[CALCULATOR_SCHEMA])
        return first, second, third

    first, second, third = asyncio.run(go())
    # the tools are declared to the model in a Qwen/Hermes-style system message
    first_prompt = tok.decode(rollout.prompts[0])
    assert first_prompt.startswith("<|im_start|>system\n# Tools") and '"name": "calc"' in first_prompt
    assert rollout.params[0].temperature == 0.5 and rollout.params[0].max_new_tokens == 64
    # the second prompt is the first prompt + the exact output tokens + only the new tool turn
    a, b, c = client.cache.ordered()
    assert b.parent is a and b.prompt_ids[: len(a.full_ids)] == a.full_ids
    assert tok.decode(b.prompt_ids[len(a.full_ids) :]) == "<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    assert second.choices[0].message.content == "42" and second.choices[0].finish_reason == "stop"
    # a malformed call: no tool_calls, the raw text kept, the error reported for the agent to feed back
    msg3 = third.choices[0].message
    assert msg3.tool_calls is None and "not valid JSON" in msg3.model_extra["tool_call_errors"][0]
    assert c.parent is None  # same first message, but a sibling of a (a new sample of turn one)
    # ToolSet.arespond turns both kinds into tool messages for the next turn
    tools = ToolSet([calculator_tool()])
    answer = asyncio.run(tools.arespond(first.choices[0].message))
    assert answer == [
        {"role": "tool", "content": "42", "tool_call_id": first.choices[0].message.tool_calls[0].id, "name": "calc"}
    ]
    (err,) = asyncio.run(tools.arespond(msg3))
    assert err["role"] == "tool" and err["content"].startswith("Error: tool call is not valid JSON")
    client.set_reward(second.id, 1.0)
    client.set_reward(first.id, 0.0)
    client.set_reward(third.id, 0.0)
    trajs = client.export("concat", gamma=0.9)
    assert len(trajs) == 2 and trajs[0].reward == pytest.approx(0.9)
    mask = trajs[0].completion_mask
    n_a = len(a.output_ids)
    assert mask[:n_a] == [1] * n_a and 0 in mask and mask[-len(b.output_ids) :] == [1] * len(b.output_ids)
    with pytest.raises(KeyError, match="no completion 'zzz'"):
        client.set_reward("zzz", 1.0)


def test_proxy_api_key(served):
    """With a key every request needs it (the openai client sends its api_key as a bearer token);
    beyond loopback the proxy refuses to start without one."""
    app, rollout_client, tokenizer = served
    with pytest.raises(ValueError, match="0.0.0.0"):
        AgentProxy(rollout_client, tokenizer, host="0.0.0.0")
    proxy = AgentProxy(rollout_client, tokenizer, api_key="s3cret", default_sampling=SamplingParams(max_new_tokens=2))
    proxy.start()
    try:
        sid, base_url = proxy.start_session()
        with pytest.raises(openai.AuthenticationError, match="API key"):
            openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0).completions.create(model="t", prompt="a")
        assert httpx.post(f"{base_url}/reward", json={"reward": 1.0}).status_code == 401
        out = openai.OpenAI(base_url=base_url, api_key="s3cret", max_retries=0).completions.create(
            model="t", prompt="a"
        )
        assert out.choices[0].text is not None
    finally:
        proxy.stop()


def test_streamed_calls_add_up_as_the_areno_servers_streams_do(served, scripted):
    """stream=True: the recorded response replayed as chunks (role and content, tool calls, finish;
    usage on request) that add up to what the official client streams from areno's server."""
    app, rollout_client, tokenizer = served
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=8, temperature=1.0, seed=11, n=2, logprobs=True)
    usage = {"stream_options": {"include_usage": True}}

    async def go():
        ref = [c async for c in await official(app).chat.completions.create(**kwargs, stream=True, **usage)]
        rec = ArenoAsyncOpenAI(rollout_client, tokenizer)
        async with await rec.chat.completions.create(**kwargs, stream=True, **usage) as stream:
            mine = [c async for c in stream]
        ref_c = [c async for c in await official(app).completions.create(model="tiny", prompt="12+7=", max_tokens=5,
                                                                           temperature=0, stream=True)]  # fmt: skip
        mine_c = [c async for c in await rec.completions.create(model="tiny", prompt="12+7=", max_tokens=5,
                                                                 temperature=0, stream=True)]  # fmt: skip
        return ref, mine, ref_c, mine_c, rec

    ref, mine, ref_c, mine_c, rec = asyncio.run(go())
    assert all(type(c).__name__ == "ChatCompletionChunk" for c in mine) and mine[-1].usage == ref[-1].usage
    for index in (0, 1):
        a = [c.choices[0] for c in ref if c.choices and c.choices[0].index == index]
        b = [c.choices[0] for c in mine if c.choices and c.choices[0].index == index]
        assert "".join(x.delta.content or "" for x in a) == "".join(x.delta.content or "" for x in b)
        assert sum((x.model_extra["token_ids"] or [] for x in a), []) == b[0].model_extra["token_ids"]
        assert a[-1].finish_reason == b[-1].finish_reason and b[0].delta.role == "assistant"
        assert len(b[0].logprobs.content) == len(b[0].model_extra["token_ids"])
    assert len(rec.cache.ordered()) == 3  # the streamed calls were recorded like any other
    assert "".join(c.choices[0].text for c in ref_c) == mine_c[0].choices[0].text
    # tool calls come as their own delta, with their index
    tools_client = ArenoAsyncOpenAI(scripted(['<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>']),
                                    scripted([]).tokenizer)  # fmt: skip

    async def tools():
        stream = await tools_client.chat.completions.create(
            model="m", messages=MESSAGES, tools=[CALCULATOR_SCHEMA], stream=True
        )
        return [c async for c in stream]

    chunks = asyncio.run(tools())
    (call,) = chunks[1].choices[0].delta.tool_calls
    assert (
        call.index == 0
        and call.function.name == "calculator"
        and json.loads(call.function.arguments) == {"expression": "2+3"}
    )
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_training_client_refuses_another_temperature(scripted):
    """walk16: an agent's hard-coded temperature (0.7, 0) was sampled at, while the trainer recomputes the
    episode's log-probs at rollout.temperature: a ratio off 1 for the same policy. A workflow's client
    (fixed_temperature) refuses it by name; the run's own temperature, or none, is served."""
    rollout = scripted(["a", "b"])
    client = ArenoAsyncOpenAI(
        rollout, rollout.tokenizer, default_sampling=SamplingParams(temperature=0.8), fixed_temperature=True
    )
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(
        AgentRequestError, match=r"temperature=0\.5: the trainer scores .* at the rollout temperature 0\.8"
    ):
        asyncio.run(client.chat.completions.create(model="m", messages=messages, temperature=0.5))
    asyncio.run(client.chat.completions.create(model="m", messages=messages, temperature=0.8))
    asyncio.run(client.chat.completions.create(model="m", messages=messages))
    assert [p.temperature for p in rollout.params] == [0.8, 0.8]
    free = ArenoAsyncOpenAI(rollout, rollout.tokenizer)  # outside training: any temperature
    rollout.replies = iter(["c"])
    asyncio.run(free.chat.completions.create(model="m", messages=messages, temperature=0))


def test_a_stop_string_at_the_start_leaves_the_text_empty(scripted):
    """walk16: the engine's text is empty when a stop string matches at the very start; the client decoded
    the tokens again and gave the agent the stop string itself."""
    rollout = scripted([","])
    rollout_out = rollout.agenerate

    async def engine_cut(prompt_ids, params, **kw):  # the engine's text after its stop-string cut
        out = await rollout_out(prompt_ids, params, **kw)
        out.text = ""
        return out

    rollout.agenerate = engine_cut
    client = ArenoAsyncOpenAI(rollout, rollout.tokenizer)
    reply = asyncio.run(client.completions.create(model="m", prompt="x", stop=[","]))
    assert reply.choices[0].text == ""


QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_continued_chat_keeps_what_the_template_puts_after_the_end_of_turn_token():
    """walk17: turn 2's prompt was the parent's tokens (ending at the generated <|im_end|>) plus the text after
    the re-rendered assistant turn, which already held the template's "\\n" after <|im_end|>: the trained
    sequence lacked it, a sequence no deployment renders. It is now the template's rendering, token for token."""
    tok = build_char_tokenizer()
    tok.eos_token = "<|im_end|>"
    tok.chat_template = QWEN_TEMPLATE
    client = ArenoAsyncOpenAI(replying(tok, "A1", "A2"), tok, default_sampling=SamplingParams(max_new_tokens=8))
    messages = [{"role": "user", "content": "q1"}]

    async def go():
        first = await client.chat.completions.create(model="m", messages=messages)
        messages.extend(
            [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "q2"}]
        )
        second = await client.chat.completions.create(model="m", messages=messages)
        messages.append({"role": "assistant", "content": second.choices[0].message.content})

    asyncio.run(go())
    (traj,) = client.export("concat")
    assert traj.info["num_turns"] == 2  # one sequence: turn 2 continued turn 1's tokens
    rendered = tok.apply_chat_template(messages, tokenize=False)
    assert tok.decode(traj.prompt_ids + traj.completion_ids) == rendered.removesuffix("\n")


def test_chat_template_kwargs_render_the_prompt_and_unknown_extra_body_keys_are_refused():
    """walk30: extra_body's chat_template_kwargs (vLLM's, Qwen3's enable_thinking) were dropped, as was any
    key this client does not read."""
    tok = build_char_tokenizer()
    tok.eos_token = "<|im_end|>"
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
        "enable_thinking is false %}nothink\n{% endif %}{% endif %}"
    )
    seen = []
    engine = replying(tok, "A1")
    respond = engine.respond

    def recording(prompt_ids, params):
        seen.append(tok.decode(prompt_ids))
        return respond(prompt_ids, params)

    engine.respond = recording
    client = ArenoAsyncOpenAI(engine, tok, default_sampling=SamplingParams(max_new_tokens=8))
    messages = [{"role": "user", "content": "q1"}]
    extra = {"chat_template_kwargs": {"enable_thinking": False}}
    asyncio.run(client.chat.completions.create(model="m", messages=messages, extra_body=extra))
    assert seen[-1].endswith("<|im_start|>assistant\nnothink\n")
    no_op = {"skip_special_tokens": True, "include_stop_str_in_output": False, "chat_template_kwargs": None}
    asyncio.run(client.chat.completions.create(model="m", messages=messages, extra_body=no_op))  # vLLM's defaults
    with pytest.raises(AgentRequestError, match=r"extra_body \['skip_special_tokens'\] is not supported; it takes"):
        asyncio.run(
            client.chat.completions.create(model="m", messages=messages, extra_body={"skip_special_tokens": False})
        )
    with pytest.raises(AgentRequestError, match=r"extra_body \['chat_template_kwargs'\] is not supported"):
        asyncio.run(client.completions.create(model="m", prompt="q1", extra_body=extra))


def test_min_p_and_repetition_penalty_reach_the_sampler_and_default_to_the_runs():
    """vLLM's extra_body min_p / repetition_penalty are the engine's SamplingParams fields (the run's values when
    absent, the request's when given, 1.0 and 0.0 included); a value out of range is refused by name."""
    tok = build_char_tokenizer()
    engine = replying(tok, "A1")
    seen = []
    respond = engine.respond

    def recording(prompt_ids, params):
        seen.append((params.min_p, params.repetition_penalty))
        return respond(prompt_ids, params)

    engine.respond = recording
    run = SamplingParams(max_new_tokens=8, min_p=0.05, repetition_penalty=1.2)
    client = ArenoAsyncOpenAI(engine, tok, default_sampling=run)
    messages = [{"role": "user", "content": "q1"}]
    for extra in (None, {"min_p": 0.1, "repetition_penalty": 1.5}, {"min_p": 0.0, "repetition_penalty": 1.0}):
        asyncio.run(client.chat.completions.create(model="m", messages=messages, extra_body=extra))
    asyncio.run(client.completions.create(model="m", prompt="q1", extra_body={"repetition_penalty": 1.1}))
    assert seen == [(0.05, 1.2), (0.1, 1.5), (0.0, 1.0), (0.05, 1.1)]
    with pytest.raises(AgentRequestError, match="min_p must be in"):
        asyncio.run(client.chat.completions.create(model="m", messages=messages, extra_body={"min_p": 2.0}))
