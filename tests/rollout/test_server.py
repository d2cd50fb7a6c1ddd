import threading
import time

import httpx
import pytest

from areno.cli import main as areno_main
from areno.launch.scheduler import free_port
from areno.rollout.server import build_engine, create_app
from tests.helpers.serving import serving

openai = pytest.importorskip("openai")  # the test extra; absent on some machines (then these tests skip)

KEY = "sekret"


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    engine, tokenizer = build_engine(str(tiny_model_dir), device="cpu", num_blocks=256, block_size=8, max_model_len=64)
    app = create_app(engine, tokenizer=tokenizer, model_name="tiny", api_key=KEY)
    with serving(app, log_level="warning") as base:
        yield base, engine, tokenizer


def _oa(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)


def test_openai_completions_with_logprobs(server):
    base, engine, tokenizer = server
    res = _oa(base).completions.create(
        model="tiny", prompt="hello", max_tokens=6, temperature=0, logprobs=0, extra_body={"ignore_eos": True}
    )
    choice = res.choices[0]
    assert len(choice.logprobs.token_logprobs) == 6 and all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    ids = choice.model_extra["token_ids"]
    expected = httpx.post(
        f"{base}/generate",
        headers={"Authorization": f"Bearer {KEY}"},
        json={
            "prompt_ids": tokenizer("hello")["input_ids"],
            "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True},
        },
    ).json()
    assert ids == expected["output_ids"] and res.usage.completion_tokens == 6
    assert choice.logprobs.token_logprobs == pytest.approx(expected["output_logprobs"], abs=1e-5)


def test_openai_chat_with_n(server):
    base, _, tokenizer = server
    res = _oa(base).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=1.0,
        n=3,
        seed=5,
        logprobs=True,
    )
    assert len(res.choices) == 3
    for c in res.choices:
        assert c.message.role == "assistant" and len(c.logprobs.content) == len(c.model_extra["token_ids"])
    prompt_ids = res.choices[0].model_extra["prompt_token_ids"]
    assert tokenizer.decode(prompt_ids).rstrip().endswith("<|im_start|>assistant")
    # as OpenAI counts: the prompt once per request, the completions of every choice
    completion = sum(len(c.model_extra["token_ids"]) for c in res.choices)
    assert (res.usage.prompt_tokens, res.usage.completion_tokens) == (len(prompt_ids), completion)
    assert res.usage.total_tokens == len(prompt_ids) + completion


def test_completions_usage_counts_each_prompt_once_whatever_n(server):
    base, _, tokenizer = server
    prompts = ["hello", "a longer prompt"]
    res = _oa(base).completions.create(
        model="tiny", prompt=prompts, max_tokens=3, n=3, seed=1, extra_body={"ignore_eos": True}
    )
    assert len(res.choices) == 6
    prompt_tokens = sum(len(tokenizer(p)["input_ids"]) for p in prompts)
    assert (res.usage.prompt_tokens, res.usage.completion_tokens, res.usage.total_tokens) == (
        prompt_tokens,
        18,
        prompt_tokens + 18,
    )


def test_admin_endpoints(server, tiny_model_dir):
    base, engine, _ = server
    h = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(f"{base}/health").json() == {"status": "ok", "paused": False}
    assert httpx.post(f"{base}/pause", headers=h).json() == {"paused": True}
    assert engine.is_paused
    assert httpx.post(f"{base}/resume", headers=h).json() == {"paused": False}
    r = httpx.post(f"{base}/update_weights_from_disk", headers=h, json={"path": str(tiny_model_dir), "version": 7})
    assert r.status_code == 200 and httpx.get(f"{base}/version", headers=h).json() == {"version": 7}
    assert "areno_version 7.0" in httpx.get(f"{base}/metrics", headers=h).text
    assert httpx.post(f"{base}/abort", headers=h, json={"request_id": "nope"}).status_code == 404


def test_abort_in_flight_request(server):
    base, engine, _ = server
    h = {"Authorization": f"Bearer {KEY}"}
    httpx.post(f"{base}/pause", headers=h)
    result = {}

    def call():
        result["r"] = httpx.post(
            f"{base}/generate",
            headers=h,
            timeout=30,
            json={
                "prompt_ids": [5, 6, 7],
                "request_id": "req-1",
                "sampling_params": {"max_new_tokens": 30, "ignore_eos": True},
            },
        )

    t = threading.Thread(target=call)
    t.start()
    while engine.stats()["num_waiting"] == 0:
        time.sleep(0.01)
    aborted = httpx.post(f"{base}/abort", headers=h, json={"request_id": "req-1"})
    t.join(timeout=30)
    httpx.post(f"{base}/resume", headers=h)
    assert aborted.json()["finish_reason"] == "abort" and result["r"].json()["finish_reason"] == "abort"


def test_http_rollout_client(server):
    import asyncio

    from areno.rollout.client import HTTPRolloutClient
    from areno.types import SamplingParams

    base, _, _ = server

    async def go():
        client = HTTPRolloutClient(base, api_key=KEY)
        try:
            outs = await asyncio.gather(
                *(client.agenerate([5, 6, 7 + i], SamplingParams(max_new_tokens=5, ignore_eos=True)) for i in range(4))
            )
            with pytest.raises(RuntimeError, match="empty"):
                await client.agenerate([], SamplingParams(max_new_tokens=5))
            return outs
        finally:
            await client.aclose()

    outs = asyncio.run(go())
    assert [len(o.output_ids) for o in outs] == [5] * 4 and all(len(o.output_versions) == 5 for o in outs)


def test_http_client_passes_detokenize(server):
    """``detokenize=False`` reaches the server through the HTTP client: the same tokens, no text."""
    import asyncio
    import dataclasses

    from areno.rollout.client import HTTPRolloutClient
    from areno.types import SamplingParams

    base, _, _ = server
    params = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)

    async def go():
        client = HTTPRolloutClient(base, api_key=KEY)
        try:
            return [
                await client.agenerate([5, 6, 7], p) for p in (params, dataclasses.replace(params, detokenize=False))
            ]
        finally:
            await client.aclose()

    with_text, without = asyncio.run(go())
    assert with_text.output_ids == without.output_ids and with_text.text and without.text == ""


@pytest.mark.parametrize(
    "path,body,field",
    [
        ("/v1/completions", {"model": "tiny", "prompt": "x" * 80, "max_tokens": 4}, "prompt"),
        ("/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": -3}, "max_tokens"),
        ("/v1/completions", {"model": "tiny", "prompt": "", "max_tokens": 4}, "prompt"),
        ("/v1/completions", {"model": "tiny", "prompt": [], "max_tokens": 4}, "prompt"),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": -1}, "temperature"),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "top_p": 0}, "top_p"),
        ("/v1/completions", {"model": "tiny"}, "prompt"),
        ("/v1/chat/completions", {"model": "tiny", "messages": []}, "messages"),
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x" * 80}]}, "messages"),
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "a"}], "max_tokens": 0},
            "max_tokens",
        ),
        (  # walk27: named as sent, not as max_tokens
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "a"}], "max_completion_tokens": 0},
            "max_completion_tokens",
        ),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "stop": ""}, "stop"),  # walk27: stopped at once
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "a"}], "stop": [""]},
            "stop",
        ),
        ("/generate", {"prompt_ids": [], "sampling_params": {}}, "prompt_ids"),
        ("/generate", {"prompt_ids": [5], "sampling_params": {"bogus": 1}}, "sampling_params.bogus"),
        ("/generate", {"prompt_ids": [5], "sampling_params": {"max_new_tokens": 0}}, "sampling_params"),
    ],
)
def test_bad_input_is_400_naming_the_field(server, path, body, field):
    base, _, _ = server
    r = httpx.post(f"{base}{path}", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field.split(".")[0] in err["message"]


def test_malformed_json_and_auth(server):
    base, _, _ = server
    r = httpx.post(
        f"{base}/v1/completions",
        content=b"{not json",
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    assert httpx.post(f"{base}/v1/completions", json={"prompt": "hi"}).status_code == 401
    assert httpx.get(f"{base}/version", headers={"Authorization": "Bearer wrong"}).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).completions.create(
            model="tiny", prompt="hi"
        )
    # Still serving after all of the above.
    assert _oa(base).completions.create(model="tiny", prompt="ok", max_tokens=2).choices[0].text is not None


def test_main_reports_bad_model_dir(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    assert areno_main(["serve", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("areno: error:") and err.count("\n") == 1


def test_generate_many_one_request_per_group(server):
    """A GRPO group in one POST /generate_many: the same tokens as one /generate per sample (same
    seeds), in order; every entry validated first; a group through MultiServerRolloutClient is one
    request to one server."""
    import asyncio

    from areno.rollout.client import HTTPRolloutClient, MultiServerRolloutClient
    from areno.types import SamplingParams

    base, _, tokenizer = server
    prompt = tokenizer("hello")["input_ids"]
    params = [SamplingParams(temperature=1.0, max_new_tokens=5, seed=100 + i, ignore_eos=True) for i in range(4)]

    async def go():
        client = HTTPRolloutClient(base, KEY)
        try:
            many = await client.agenerate_many(prompt, params)
            one_by_one = [await client.agenerate(prompt, p) for p in params]
        finally:
            await client.aclose()
        multi = MultiServerRolloutClient([base, base], api_key=KEY)
        try:
            grouped = await multi.agenerate_many(prompt, params)
            counts = list(multi.requests_per_server)
        finally:
            await multi.aclose()
        return many, one_by_one, grouped, counts

    many, one_by_one, grouped, counts = asyncio.run(go())
    assert [o.output_ids for o in many] == [o.output_ids for o in one_by_one] == [o.output_ids for o in grouped]
    for a, b in zip(many, one_by_one):
        assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-5)
    assert len({tuple(o.output_ids) for o in many}) > 1  # per-sample seeds, not one sample four times
    assert sum(counts) == 1  # the whole group was one request to one server

    h = {"Authorization": f"Bearer {KEY}"}
    ok = {"temperature": 0, "max_new_tokens": 2}
    r = httpx.post(
        f"{base}/generate_many",
        headers=h,
        json={"prompt_ids": prompt, "sampling_params": [ok, {**ok, "temprature": 1}]},
    )
    assert r.status_code == 400 and "sampling_params[1]: unknown parameter 'temprature'" in r.json()["error"]["message"]
    r = httpx.post(
        f"{base}/generate_many",
        headers=h,
        json={"prompt_ids": prompt, "sampling_params": [ok, ok], "request_ids": ["a"]},
    )
    assert r.status_code == 400 and "request_ids: 1 ids for 2 sampling_params" in r.json()["error"]["message"]
    r = httpx.post(f"{base}/generate_many", headers=h, json={"prompt_ids": prompt, "sampling_params": []})
    assert r.status_code == 400


def test_token_results_as_base64_arrays_are_the_lists_exactly(server):
    """walk37: a partitioned run's rollouts crossed the wire as JSON lists (a float's 17-digit text: ~25 ms a
    group of 8 x 4,096 tokens on the server's event loop). token_encoding=base64 sends them as int64 /
    float64 arrays, exactly the values of the lists; the default stays plain lists for any HTTP client."""
    from areno.rollout.wire import ARRAY_FIELDS, decode_arrays, encode_arrays

    base, _, tokenizer = server
    h = {"Authorization": f"Bearer {KEY}"}
    prompt = tokenizer("hello")["input_ids"]
    sp = [{"temperature": 1.0, "max_new_tokens": 6, "seed": 7 + i, "ignore_eos": True} for i in range(3)]
    lists = httpx.post(f"{base}/generate_many", headers=h, json={"prompt_ids": prompt, "sampling_params": sp})
    arrays = httpx.post(
        f"{base}/generate_many",
        headers=h,
        json={"prompt_ids": prompt, "sampling_params": sp, "token_encoding": "base64"},
    )
    assert lists.status_code == arrays.status_code == 200
    for plain, packed in zip(lists.json()["outputs"], arrays.json()["outputs"]):
        assert all(isinstance(packed[name], dict) for name in ARRAY_FIELDS)
        assert isinstance(plain["output_logprobs"], list)
        decoded = decode_arrays(packed)
        # two generations: the same tokens, log-probs alike up to the CPU's batch-dependent rounding
        for key in ("prompt_ids", "output_ids", "output_versions", "finish_reason", "text"):
            assert decoded[key] == plain[key]
        assert decoded["output_logprobs"] == pytest.approx(plain["output_logprobs"], abs=1e-5)
    # the encoding itself is exact: any int64 id and version, any float64 log-prob
    fields = {"prompt_ids": [0, 2**40], "output_ids": [-1, 151_935], "output_versions": [-1, 7]}
    fields["output_logprobs"] = [-0.1, -1e-300, float.fromhex("-0x1.fffffffffffffp-2")]
    assert decode_arrays(encode_arrays({**fields, "text": "x"})) == {**fields, "text": "x"}
    one = httpx.post(
        f"{base}/generate",
        headers=h,
        json={"prompt_ids": prompt, "sampling_params": sp[0], "token_encoding": "base64"},
    )
    assert decode_arrays(one.json())["output_ids"] == lists.json()["outputs"][0]["output_ids"]
    bad = httpx.post(
        f"{base}/generate", headers=h, json={"prompt_ids": prompt, "sampling_params": sp[0], "token_encoding": "b64"}
    )
    assert bad.status_code in (400, 422) and "token_encoding" in bad.text


class _HealthView:
    """A ``ServerHealthView`` that is no ``HealthMonitor``: the client needs nothing more."""

    def __init__(self, unhealthy: set[str]) -> None:
        self.unhealthy, self.failures = unhealthy, []

    def is_healthy(self, url: str) -> bool:
        return url not in self.unhealthy

    def report_failure(self, url: str, reason: str) -> None:
        self.failures.append(url)

    async def await_healthy(self, timeout_s: float) -> bool:
        return True

    def describe(self) -> dict[str, str]:
        return {}


def test_multi_server_client_routes_by_any_health_view(server):
    """Unhealthy servers get no request; one that fails to answer is reported to the view."""
    import asyncio

    from areno.rollout.client import MultiServerRolloutClient
    from areno.types import SamplingParams

    base, _, tokenizer = server
    dead = f"http://127.0.0.1:{free_port()}"
    prompt = tokenizer("hello")["input_ids"]
    params = SamplingParams(temperature=0, max_new_tokens=2)

    async def go(view: _HealthView) -> list[int]:
        multi = MultiServerRolloutClient([dead, base], api_key=KEY, health=view)
        try:
            for _ in range(2):
                await multi.agenerate(prompt, params)
            return list(multi.requests_per_server)
        finally:
            await multi.aclose()

    skipping = _HealthView({dead})
    assert asyncio.run(go(skipping)) == [0, 2] and skipping.failures == []
    trusting = _HealthView(set())
    assert asyncio.run(go(trusting)) == [0, 2] and trusting.failures == [dead]


def test_max_completion_tokens_wins_over_the_deprecated_max_tokens(server):
    """walk27: with both, areno serve generated max_tokens tokens and the recording client max_completion_tokens."""
    base, _, _ = server
    r = _oa(base).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "a"}], max_tokens=7, max_completion_tokens=3,
        temperature=0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_a_model_is_retrieved_by_its_id(server):
    """walk27: `client.models.retrieve` was a bare 404 (the route did not exist)."""
    base, _, _ = server
    assert _oa(base).models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError, match="model 'other' does not exist: this server serves 'tiny'"):
        _oa(base).models.retrieve("other")


def test_the_client_asks_a_server_that_predates_token_encoding_for_lists():
    """walk38: an areno serve from before token_encoding refuses the unknown field (400), so every request of
    a newer client failed. The client asks once, then sends plain requests to that server."""
    import asyncio
    import json

    from areno.rollout.client import HTTPRolloutClient
    from areno.types import SamplingParams

    bodies = []

    def old_server(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        if "token_encoding" in body:
            msg = "unrecognized request argument 'token_encoding': fields this server does not know are refused"
            return httpx.Response(400, json={"error": {"message": msg, "param": "token_encoding"}})
        out = {
            "request_id": "r",
            "prompt_ids": body["prompt_ids"],
            "output_ids": [7, 8],
            "output_logprobs": [-0.5, -0.25],
            "output_versions": [0, 0],
            "finish_reason": "length",
            "text": "",
            "routes_TLK": None,
        }
        return httpx.Response(200, json={"outputs": [out]} if request.url.path == "/generate_many" else out)

    async def go():
        client = HTTPRolloutClient("http://old", KEY)
        client._client = httpx.AsyncClient(base_url="http://old", transport=httpx.MockTransport(old_server))
        try:
            one = await client.agenerate([1, 2], SamplingParams(max_new_tokens=2))
            many = await client.agenerate_many([1, 2], [SamplingParams(max_new_tokens=2)])
        finally:
            await client.aclose()
        return one, many

    one, (many,) = asyncio.run(go())
    assert one.output_ids == many.output_ids == [7, 8] and one.output_logprobs == [-0.5, -0.25]
    assert ["token_encoding" in b for b in bodies] == [True, False, False]  # asked once, then plain


def test_multi_server_client_closes_each_event_loops_connections_when_the_loop_ends(server):
    """walk39a: every evaluation (a fresh ``asyncio.run``) left its httpx clients and their sockets open,
    one per concurrent request (+16 fds an evaluation); the clients of a loop now close with it."""
    import asyncio
    import os

    from areno.rollout.client import MultiServerRolloutClient
    from areno.types import SamplingParams

    base, _, tokenizer = server
    prompt = tokenizer("hello")["input_ids"]
    params = SamplingParams(temperature=1.0, max_new_tokens=2)
    multi = MultiServerRolloutClient([base], api_key=KEY)

    async def evaluation() -> None:
        await asyncio.gather(*(multi.agenerate(prompt, params) for _ in range(8)))

    def settled_fds(at_most: int) -> int:  # the server closes its ends of the connections a moment later
        deadline = time.monotonic() + 5
        while (n := len(os.listdir("/proc/self/fd"))) > at_most and time.monotonic() < deadline:
            time.sleep(0.05)
        return n

    asyncio.run(evaluation())
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        asyncio.run(evaluation())
    assert settled_fds(before) <= before  # was before + 40
