"""``stream=true`` on ``areno serve``'s OpenAI endpoints: server-sent chunks whose text, token ids and
log-probs add up to the unstreamed answer of the same request (greedy, or seeded), several chunks a
choice, stop strings never leaked, usage on request, a refused request still a 400, a client that
leaves has its generations aborted. Also ``echo`` and the refusal of ``tools``."""

import json
import time

import httpx
import pytest

from areno.rollout.server import StreamedChoice, build_engine, create_app
from areno.types import GenerationOutput, SamplingParams
from tests.helpers.serving import serving

openai = pytest.importorskip("openai")

KEY = "k"
H = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    # one decode step per round trip: every token is a chance for a chunk
    engine, tokenizer = build_engine(
        str(tiny_model_dir), device="cpu", num_blocks=256, block_size=8, max_model_len=96, decode_steps=1
    )
    app = create_app(engine, tokenizer=tokenizer, model_name="tiny", api_key=KEY)
    with serving(app, log_level="warning") as base:
        yield base, engine, tokenizer


def _oa(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)


def test_streamed_completion_adds_up_to_the_unstreamed_one(server):
    base, _, tokenizer = server
    kw = dict(model="tiny", prompt=["hello", "abc"], max_tokens=12, temperature=1.0, seed=7, n=2, logprobs=0)
    whole = _oa(base).completions.create(**kw, extra_body={"ignore_eos": True})
    chunks = list(_oa(base).completions.create(**kw, stream=True, stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True}))  # fmt: skip
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 48
    # each prompt counted once, not once per choice (n=2), as OpenAI counts
    prompt_tokens = sum(len(tokenizer(p)["input_ids"]) for p in kw["prompt"])
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens == prompt_tokens
    assert chunks[-1].usage.total_tokens == prompt_tokens + 48
    for choice in whole.choices:
        mine = [c.choices[0] for c in chunks[:-1] if c.choices[0].index == choice.index]
        assert len(mine) >= 3, choice.index  # streamed, not one chunk at the end
        assert "".join(c.text for c in mine) == choice.text
        assert sum((c.model_extra["token_ids"] for c in mine), []) == choice.model_extra["token_ids"]
        assert mine[0].model_extra["prompt_token_ids"] == choice.model_extra["prompt_token_ids"]
        assert [c.finish_reason for c in mine] == [None] * (len(mine) - 1) + ["length"]
        lps = sum((c.logprobs.token_logprobs for c in mine), [])
        assert lps == pytest.approx(choice.logprobs.token_logprobs, abs=1e-5)
        offsets = sum((c.logprobs.text_offset for c in mine), [])
        assert offsets == choice.logprobs.text_offset


def test_streamed_chat_adds_up_and_never_leaks_a_stop_string(server):
    base, _, tokenizer = server
    messages = [{"role": "user", "content": "hi"}]
    whole = _oa(base).chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0)
    text = whole.choices[0].message.content
    assert len(text) >= 6
    stop = text[3:6]  # greedy: the same completion again, which this stop string cuts after 3 characters
    for kw in ({}, {"stop": [stop]}):
        ref = _oa(base).chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0, **kw)
        chunks = list(
            _oa(base).chat.completions.create(
                model="tiny", messages=messages, max_tokens=24, temperature=0, stream=True, logprobs=True, **kw
            )  # fmt: skip
        )
        deltas = [c.choices[0].delta for c in chunks]
        assert deltas[0].role == "assistant" and all(d.role is None for d in deltas[1:])
        streamed = "".join(d.content or "" for d in deltas)
        assert streamed == ref.choices[0].message.content
        assert chunks[-1].choices[0].finish_reason == ref.choices[0].finish_reason
        assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
        n_tokens = sum(len(c.choices[0].logprobs.content) for c in chunks)
        assert n_tokens == len(ref.choices[0].model_extra["token_ids"])
    assert streamed == text[:3] and stop not in streamed


def test_streamed_chat_usage_counts_the_prompt_once_whatever_n(server):
    base, _, _ = server
    kw = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, n=3, seed=3)
    whole = _oa(base).chat.completions.create(**kw, extra_body={"ignore_eos": True})
    chunks = list(_oa(base).chat.completions.create(**kw, stream=True, stream_options={"include_usage": True},
                                                    extra_body={"ignore_eos": True}))  # fmt: skip
    prompt_tokens = len(whole.choices[0].model_extra["prompt_token_ids"])
    assert whole.usage.prompt_tokens == chunks[-1].usage.prompt_tokens == prompt_tokens
    assert whole.usage.completion_tokens == chunks[-1].usage.completion_tokens == 15
    assert chunks[-1].usage.total_tokens == prompt_tokens + 15


def test_streamed_choice_holds_back_what_may_still_change():
    """A possible stop string's first characters and a character split between tokens wait; the text
    is decoded a window of tokens at a time."""
    pieces = {1: b"ab", 2: b"cE", 3: b"N", 4: b"D", 7: b"ab\xc3", 8: b"\xa9!"}  # 7 + 8: "abé!"
    windows = []

    def decode(ids):
        windows.append(len(ids))
        return b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")

    stop = StreamedChoice(0, [1], SamplingParams(stop=("END",)))  # holds 2 characters back
    assert stop.advance(decode, [1], [-0.1], None) == ("", [1], [-0.1])
    stop.first = False
    assert stop.advance(decode, [1, 2], [-0.1, -0.2], None) == ("ab", [2], [-0.2])
    assert stop.advance(decode, [1, 2, 3], [-0.1, -0.2, -0.3], None) == ("c", [3], [-0.3])
    assert max(windows[-2:]) == 2  # the newest tokens and one of context, not the whole completion
    final = GenerationOutput(
        request_id="r", prompt_ids=[1], output_ids=[1, 2, 3, 4], output_logprobs=[-0.1, -0.2, -0.3, -0.4],
        output_versions=[0] * 4, finish_reason="stop", text="abc",
    )  # fmt: skip
    assert stop.advance(decode, final.output_ids, final.output_logprobs, final) == ("", [4], [-0.4])
    split = StreamedChoice(0, [1], SamplingParams(), echo=">")
    assert split.advance(decode, [7], [-1.0], None) == (">", [7], [-1.0])  # the echo; "ab" + half a character wait
    split.first = False
    assert split.advance(decode, [7, 8], [-1.0, -2.0], None) == ("abé!", [8], [-2.0])


def test_a_refused_stream_is_a_400_and_a_client_that_leaves_aborts_it(server):
    base, engine, _ = server
    body = {"model": "tiny", "prompt": "x" * 200, "max_tokens": 4, "stream": True}  # longer than max_model_len
    r = httpx.post(f"{base}/v1/completions", headers=H, json=body)
    assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"]
    long = {"model": "tiny", "prompt": "hello", "max_tokens": 80, "stream": True, "ignore_eos": True}
    before = engine.stats()["generated_tokens"]
    with httpx.stream("POST", f"{base}/v1/completions", headers=H, json=long) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
        httpx.post(f"{base}/pause", headers=H)  # no more tokens until the client has gone
    try:
        deadline = time.time() + 10
        while engine.has_unfinished() and time.time() < deadline:
            time.sleep(0.05)
        assert not engine.has_unfinished()  # aborted while paused: it never ran to 80 tokens
    finally:
        httpx.post(f"{base}/resume", headers=H)
    assert engine.stats()["generated_tokens"] - before < 80


def test_echo_and_refusals(server):
    base, _, tokenizer = server
    plain = _oa(base).completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0)
    echoed = _oa(base).completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == "hello" + plain.choices[0].text
    ids = tokenizer("hello")["input_ids"]
    by_ids = _oa(base).completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0, echo=True)
    assert by_ids.choices[0].text == tokenizer.decode(ids) + plain.choices[0].text
    streamed = _oa(base).completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0, echo=True,
                                            stream=True)  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed) == echoed.choices[0].text
    refusals = [
        ("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 0}, "echo"),
        ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
            "tools",
        ),  # fmt: skip
    ]
    for path, body, param in refusals:
        r = httpx.post(f"{base}{path}", headers=H, json={"model": "tiny", "max_tokens": 2, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, r.text)


def test_a_stream_dropped_unread_is_aborted_by_the_driver(tiny_model_dir):
    """A stream nobody iterates (a client gone before its response started) is collected; the driver
    thread aborts its request between steps instead of generating it for nobody. The same when its
    event loop has closed."""
    import asyncio
    import gc

    from areno.rollout.client import InProcessRolloutClient

    engine, _ = build_engine(str(tiny_model_dir), device="cpu", num_blocks=64, block_size=8, max_model_len=96)
    client = InProcessRolloutClient(engine)
    params = SamplingParams(max_new_tokens=80, ignore_eos=True)

    def settled() -> int:
        deadline = time.time() + 10
        while (engine.has_unfinished() or client.num_pending) and time.time() < deadline:
            time.sleep(0.02)
        assert not engine.has_unfinished() and client.num_pending == 0
        return engine.stats()["generated_tokens"]

    kept = []

    async def drop(resume: bool) -> int:
        engine.pause()  # nothing generated before it is dropped
        stream = client.stream([5, 6, 7], params)
        if not resume:  # kept, unread, while its loop closes
            kept.append(stream)
            return 0
        del stream
        gc.collect()
        engine.resume()
        client.wake()
        return await asyncio.to_thread(settled)  # the loop stays open: only the collected stream tells

    try:
        assert asyncio.run(drop(resume=True)) < 80  # aborted, not generated for nobody
        before = engine.stats()["generated_tokens"]
        asyncio.run(drop(resume=False))  # the loop closes with the request in the engine, its stream alive
        engine.resume()
        client.wake()
        assert settled() - before < 80
    finally:
        client.close()
