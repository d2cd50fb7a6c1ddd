"""A request cannot exhaust or confuse the rollout server: bodies over the limit are refused with 413
before they are read, a long prompt is tokenized off the event loop (``/health`` keeps answering),
every sampling field is validated with OpenAI's error shape (a streamed request's too), a client that
gives up has its requests aborted, and per-request limits and a bounded queue hold."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from areno.rollout.server import MAX_SEED, ServerLimits, TokenSampling, build_engine, create_app
from areno.types import SamplingParams
from tests.helpers.serving import serving


def _build(tiny_model_dir):
    return build_engine(
        str(tiny_model_dir), device="cpu", num_blocks=64, block_size=8, max_model_len=64, max_num_seqs=2
    )


@pytest.fixture
def built(tiny_model_dir):
    """A test's own engine: each app drives its engine from its own thread, and two driving one engine
    would take each other's outputs."""
    return _build(tiny_model_dir)


@contextlib.contextmanager
def _serving(app) -> Iterator[httpx.Client]:
    with serving(app) as base, httpx.Client(base_url=base, timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    engine, tokenizer = _build(tiny_model_dir)
    app = create_app(engine, tokenizer=tokenizer, model_name="tiny", limits=ServerLimits(max_body_bytes=20_000))
    with _serving(app) as client:
        yield client, engine, app


def _assert_openai_error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    return err


# ------------------------------------------------------------------------------ body size limit
def test_a_body_over_the_limit_is_413_before_it_is_read(server):
    client, _, _ = server
    big = {"model": "tiny", "prompt": "x" * 30_000}
    r = client.post("/v1/completions", json=big)
    assert "exceeds 20000" in _assert_openai_error(r, 413, "body")["message"]

    def chunks():  # no Content-Length: counted as it arrives
        body = json.dumps(big).encode()
        for i in range(0, len(body), 4096):
            yield body[i : i + 4096]

    r = client.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    _assert_openai_error(r, 413, "body")
    assert client.get("/health").status_code == 200  # still serving


def test_a_prompt_longer_than_any_context_is_refused_before_tokenizing(built):
    engine, tokenizer = built
    calls = []

    class Counting:
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def __call__(self, text):
            calls.append(len(text))
            return tokenizer(text)

    app = create_app(engine, tokenizer=Counting(), model_name="tiny")
    with _serving(app) as client:
        r = client.post("/v1/completions", json={"prompt": "y" * 100_000, "max_tokens": 2})
        assert "too long" in _assert_openai_error(r, 400, "prompt")["message"]
    assert calls == []


def test_health_answers_while_a_long_prompt_tokenizes(built):
    engine, tokenizer = built
    entered, release = threading.Event(), threading.Event()

    class Slow:
        """A tokenizer that takes its time (as a multi-megabyte prompt does): it holds until released,
        so /health is asked while the tokenizing is known to be under way."""

        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def __call__(self, text):
            entered.set()
            release.wait(30)
            return tokenizer(text)

    app = create_app(engine, tokenizer=Slow(), model_name="tiny")
    with _serving(app) as client:
        slow = threading.Thread(
            target=lambda: client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2}), daemon=True
        )
        slow.start()
        try:
            assert entered.wait(30), "the request never reached the tokenizer"
            # tokenizing on the event loop would hold this request until release.wait timed out (30 s)
            assert client.get("/health", timeout=20).status_code == 200
            assert slow.is_alive() and not release.is_set()  # answered while the prompt was tokenizing
        finally:
            release.set()
        slow.join(timeout=30)
        assert not slow.is_alive()


# ------------------------------------------------------------------------------ field validation
NAN_BODY = b'{"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": NaN}'
INF_BODY = b'{"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": 1e999}'
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 2}


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/v1/completions", NAN_BODY, 400, "temperature"),
        ("/v1/completions", INF_BODY, 400, "temperature"),
        ("/v1/completions", {**COMPLETION, "temperature": 1e-38}, 400, "temperature"),
        ("/v1/completions", {**COMPLETION, "top_p": 1.5}, 400, "top_p"),
        ("/v1/completions", {**COMPLETION, "top_k": 2.5}, 400, "top_k"),
        ("/v1/completions", {**COMPLETION, "top_k": -2}, 400, "top_k"),
        ("/v1/completions", {**COMPLETION, "logprobs": -1}, 400, "logprobs"),
        ("/v1/completions", {**COMPLETION, "logprobs": 1000}, 400, "logprobs"),
        ("/v1/completions", {**COMPLETION, "stop_token_ids": "abc"}, 400, "stop_token_ids"),
        ("/v1/completions", {**COMPLETION, "seed": 2**60}, 400, "seed"),
        ("/v1/completions", {**COMPLETION, "seed": MAX_SEED, "n": 2}, 400, "seed"),
        ("/v1/completions", {**COMPLETION, "n": 129}, 400, "n"),
        ("/v1/completions", {**COMPLETION, "stream": [1]}, 400, "stream"),
        ("/v1/completions", {**COMPLETION, "stream": True, "n": 129}, 400, "n"),
        ("/v1/completions", {**COMPLETION, "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ("/v1/completions", {**COMPLETION, "model": "gpt-4"}, 404, "model"),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": -5}, 400, "top_logprobs"),
        ("/v1/chat/completions", {**CHAT, "stream": [1]}, 400, "stream"),
        ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
        ("/v1/chat/completions", {**CHAT, "model": "gpt-4"}, 404, "model"),
        ("/generate", {"prompt_ids": [5], "sampling_params": {"temperature": 1e-45}}, 400, "sampling_params"),
        ("/generate", {"prompt_ids": [5], "sampling_params": {"stop_token_ids": "abc"}}, 400, "sampling_params"),
        ("/generate", {"prompt_ids": [5], "sampling_params": {"seed": 2**60}}, 400, "sampling_params"),
        ("/generate", {"prompt_ids": [5], "sampling_params": {"top_k": 2.5}}, 400, "sampling_params"),
        ("/generate", b"\xff\xfe{not utf-8", 400, "body"),
        ("/v1/completions", b'{"prompt": "\xff\xfe"}', 400, "body"),
    ],
)
def test_every_field_is_validated_in_openai_shape(server, path, body, status, param):
    client, _, _ = server
    if isinstance(body, bytes):
        r = client.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = client.post(path, json=body)
    err = _assert_openai_error(r, status, param)
    if param not in ("body", "sampling_params"):
        assert param in err["message"]
    if path == "/generate" and param == "sampling_params":
        key = next(iter(body["sampling_params"]))
        assert key in err["message"]  # the message names the key; the seed no longer blames prompt_ids
    assert client.get("/health").status_code == 200


def test_valid_edges_are_served(server):
    client, _, _ = server
    ok = client.post("/v1/completions", json={**COMPLETION, "temperature": 1e-3, "logprobs": 0, "seed": MAX_SEED})
    assert ok.status_code == 200, ok.text
    lps = ok.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert lps and all(lp is not None and lp <= 0 for lp in lps)
    assert client.post("/v1/completions", json={**COMPLETION, "model": None}).status_code == 200


@pytest.mark.parametrize(
    "path, body, param, message",
    [
        ("/v1/completions", {**COMPLETION, "temprature": 0}, "temprature", "(did you mean 'temperature'?)"),
        ("/v1/chat/completions", {**CHAT, "max_token": 2}, "max_token", "(did you mean 'max_tokens'?)"),
        ("/v1/chat/completions", {**CHAT, "reasoning_effort": "low"}, "reasoning_effort", "argument 'reasoning_effort':"),
        ("/v1/completions", {**COMPLETION, "stream": True, "stream_options": {"include_usge": True}},
         "stream_options.include_usge", "(did you mean 'stream_options.include_usage'?)"),
        ("/generate", {"prompt_ids": [5], "reqest_id": "a"}, "reqest_id", "(did you mean 'request_id'?)"),
        ("/update_weights_from_disk", {"path": "/x", "version": 1, "nmes": ["a"]}, "nmes", "'names'"),
        # top alternatives are not computed: asking for them is refused, not answered with empty ones
        ("/v1/completions", {**COMPLETION, "logprobs": 1}, "logprobs", "send logprobs 0"),
        ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 2}, "top_logprobs", "does not compute"),
        # OpenAI fields the engine cannot honour: refused unless at their no-op value
        ("/v1/completions", {**COMPLETION, "presence_penalty": 0.5}, "presence_penalty", "without penalties"),
        ("/v1/chat/completions", {**CHAT, "frequency_penalty": -1}, "frequency_penalty", "without penalties"),
        ("/v1/completions", {**COMPLETION, "logit_bias": {"5": 100}}, "logit_bias", "without logit biases"),
        ("/v1/completions", {**COMPLETION, "suffix": "end"}, "suffix", "suffix"),
        ("/v1/completions", {**COMPLETION, "best_of": 3}, "best_of", "rank them yourself"),
        ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}}, "response_format", "JSON"),
        ("/v1/chat/completions", {**CHAT, "tool_choice": "auto"}, "tool_choice", "serves no tools"),
        ("/v1/chat/completions", {**CHAT, "parallel_tool_calls": False}, "parallel_tool_calls", "serves no tools"),
    ],
)  # fmt: skip
def test_unknown_fields_and_unhonoured_values_are_refused_by_name(server, path, body, param, message):
    """A misspelt field must not sample with the default (``temprature`` would sample at 1), and a
    value the engine cannot honour must not be dropped: both are 400s naming the field, as OpenAI's are."""
    client, _, _ = server
    err = _assert_openai_error(client.post(path, json=body), 400, param)
    assert param in err["message"] and message in err["message"], err


def test_openai_fields_at_their_no_op_value_are_served(server):
    """What clients send with no effect here (``user``, penalties of 0, no logit bias, text format,
    tool_choice none, best_of = n) is served, greedy as asked."""
    client, _, _ = server
    greedy = client.post("/v1/completions", json={**COMPLETION, "temperature": 0, "ignore_eos": True}).json()
    no_ops = {"user": "u-1", "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}}
    r = client.post(
        "/v1/completions",
        json={**COMPLETION, "temperature": 0, "ignore_eos": True, "suffix": "", "best_of": 1, **no_ops},
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == greedy["choices"][0]["token_ids"]
    chat = {**CHAT, **no_ops, "response_format": {"type": "text"}, "tool_choice": "none", "function_call": "none"}
    r = client.post("/v1/chat/completions", json={**chat, "logprobs": True, "top_logprobs": 0})
    assert r.status_code == 200, r.text
    assert all(t["top_logprobs"] == [] for t in r.json()["choices"][0]["logprobs"]["content"])
    # OpenAI's newer stream option (padding its events against side channels) changes nothing here
    options = {"include_usage": True, "include_obfuscation": False}
    r = client.post("/v1/chat/completions", json={**CHAT, "stream": True, "stream_options": options})
    assert r.status_code == 200, r.text
    assert '"usage": {' in r.text or '"usage":{' in r.text, r.text


def test_token_sampling_mirrors_sampling_params():
    import dataclasses

    assert set(TokenSampling.model_fields) == {f.name for f in dataclasses.fields(SamplingParams)}


# --------------------------------------------------------------------------- disconnect, limits
def test_a_client_that_gives_up_has_its_requests_aborted(server):
    client, engine, app = server
    client.post("/pause")
    try:
        with pytest.raises(httpx.ReadTimeout):
            client.post(
                "/generate",
                json={"prompt_ids": [5, 6], "sampling_params": {"max_new_tokens": 8}},
                timeout=httpx.Timeout(30, read=0.5),
            )
        deadline = time.monotonic() + 30
        while app.state.client.num_pending and time.monotonic() < deadline:
            time.sleep(0.05)
        assert app.state.client.num_pending == 0 and not engine.has_unfinished()
    finally:
        client.post("/resume")


def test_limits_per_request_and_a_bounded_queue(built):
    engine, tokenizer = built
    limits = ServerLimits(max_n=2, max_prompts=2, max_group=3, max_queued=0)
    app = create_app(engine, tokenizer=tokenizer, model_name="tiny", limits=limits)
    with _serving(app) as client:
        _assert_openai_error(client.post("/v1/completions", json={**COMPLETION, "n": 3}), 400, "n")
        _assert_openai_error(client.post("/v1/completions", json={**COMPLETION, "prompt": ["a"] * 3}), 400, "prompt")
        group = {"prompt_ids": [5], "sampling_params": [{"max_new_tokens": 2}] * 4}
        _assert_openai_error(client.post("/generate_many", json=group), 400, "sampling_params")
        client.post("/pause")
        body = {"prompt_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}
        waiting = [threading.Thread(target=client.post, args=("/generate",), kwargs={"json": body}) for _ in range(2)]
        try:
            for t in waiting:  # max_num_seqs=2 and no queue: two fill the server
                t.start()
            while app.state.client.num_pending < 2:
                time.sleep(0.02)
            r = client.post("/generate", json=body)
            assert _assert_openai_error(r, 429, None)["code"] == "rate_limit_exceeded"
        finally:
            client.post("/resume")
            for t in waiting:
                t.join(timeout=30)
        assert client.post("/generate", json=body).status_code == 200


@pytest.mark.parametrize("field, value", [("max_body_bytes", 0), ("max_n", 0), ("max_queued", -1)])
def test_limits_are_validated(field, value):
    with pytest.raises(ValueError, match=field):
        ServerLimits(**{field: value})
