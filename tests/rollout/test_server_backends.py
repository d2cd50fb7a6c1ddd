"""The vLLM and SGLang backends without their servers: config keys and errors, the clients'
request/response translation against recorded answers, the admin routes, the launcher's command,
and routing over several servers. Real servers: tests/rollout/test_vllm_servers.py (-m vllm)."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import httpx
import pytest
import torch

from areno.api.config import load_config
from areno.api.trainer import Trainer
from areno.data.tokenizer import build_char_tokenizer
from areno.engine.placement import build_engine
from areno.engine.seams import SideSetup, WeightKind
from areno.engine.servers import ServerRolloutSide
from areno.errors import ConfigError, RunFailure
from areno.launch.scheduler import free_port
from areno.launch.servers import ServerSpec, check_server_install, check_tp, server_command, server_env
from areno.models.hf_io import init_model_dir, tiny_config
from areno.recipes.runner import logprob_diff_metrics
from areno.rollout.backends import SGLangRolloutClient, VLLMRolloutClient
from areno.rollout.backends.admin import admin_for
from areno.rollout.client import MultiServerRolloutClient, RolloutServerError
from areno.types import SamplingParams
from tests.helpers.configs import tiny_run_overrides
from tests.helpers.fake_vllm import fake_vllm_app
from tests.helpers.serving import serving

# A vLLM 0.32 /v1/completions stream (token-id prompt, logprobs=0, return_token_ids), as recorded.
VLLM_STREAM = [
    {"choices": [{"index": 0, "text": "1", "logprobs": {"tokens": ["token_id:17"], "token_logprobs": [-0.25]},
                  "finish_reason": None, "token_ids": [17]}]},
    {"choices": [{"index": 0, "text": "2", "logprobs": {"tokens": ["token_id:18"], "token_logprobs": [-1.5]},
                  "finish_reason": None, "token_ids": [18]}]},
    {"choices": [{"index": 0, "text": "", "logprobs": {"tokens": ["token_id:2"], "token_logprobs": [-0.125]},
                  "finish_reason": "stop", "stop_reason": None, "token_ids": [2]}]},
]  # fmt: skip
# SGLang's native /generate stream: cumulative output, [logprob, id, text] triples.
SGLANG_STREAM = [
    {"text": "1", "meta_info": {"id": "r", "finish_reason": None, "output_token_logprobs": [[-0.25, 17, None]]}},
    {"text": "12", "meta_info": {"id": "r", "finish_reason": None,
                                  "output_token_logprobs": [[-0.25, 17, None], [-1.5, 18, None]]}},
    {"text": "12", "meta_info": {"id": "r", "finish_reason": {"type": "length", "length": 3},
                                  "output_token_logprobs": [[-0.25, 17, None], [-1.5, 18, None], [-0.125, 2, None]]}},
]  # fmt: skip


def sse(events: list[dict]) -> bytes:
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events).encode() + b"data: [DONE]\n\n"


class Recorder:
    """An httpx MockTransport handler answering a path with a recorded stream, keeping the bodies."""

    def __init__(self, path: str, events: list[dict], *, versions: list[int] | None = None) -> None:
        self.path, self.events, self.bodies = path, events, []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path == self.path, request.url.path
        self.bodies.append(json.loads(request.content))
        return httpx.Response(200, content=sse(self.events), headers={"content-type": "text/event-stream"})


def test_vllm_client_sends_token_ids_and_reads_ids_logprobs_versions():
    rec = Recorder("/v1/completions", VLLM_STREAM)
    client = VLLMRolloutClient("http://vllm", "key", model="m", version=lambda: 4, transport=httpx.MockTransport(rec))
    params = SamplingParams(temperature=0.7, top_k=5, max_new_tokens=3, stop_token_ids=(9,), seed=11)
    out = asyncio.run(client.agenerate([5, 6, 7], params, request_id="r1"))
    assert (out.output_ids, out.output_logprobs, out.output_versions) == ([17, 18, 2], [-0.25, -1.5, -0.125], [4] * 3)
    assert (out.finish_reason, out.text, out.prompt_ids, out.request_id) == ("stop", "12", [5, 6, 7], "r1")
    body = rec.bodies[0]
    assert body["prompt"] == [5, 6, 7] and body["model"] == "m" and body["stream"] is True
    assert (body["temperature"], body["top_k"], body["max_tokens"], body["min_tokens"]) == (0.7, 5, 3, 0)
    assert (body["stop_token_ids"], body["seed"], body["logprobs"]) == ([9], 11, 0)
    no_seed = asyncio.run(client.agenerate([5], SamplingParams(max_new_tokens=3)))
    assert no_seed.output_ids == [17, 18, 2] and "seed" not in rec.bodies[1] and "top_k" not in rec.bodies[1]


def test_vllm_client_reads_token_id_strings_without_return_token_ids():
    events = [{**e, "choices": [{k: v for k, v in e["choices"][0].items() if k != "token_ids"}]} for e in VLLM_STREAM]
    client = VLLMRolloutClient(
        "http://v", model="m", transport=httpx.MockTransport(Recorder("/v1/completions", events))
    )
    assert asyncio.run(client.agenerate([1], SamplingParams(max_new_tokens=3))).output_ids == [17, 18, 2]


def test_tokens_carry_the_version_served_when_they_arrive():
    versions = iter([0, 0, 1])  # a policy sync lands between the second and third token
    client = VLLMRolloutClient(
        "http://v",
        model="m",
        version=lambda: next(versions),
        transport=httpx.MockTransport(Recorder("/v1/completions", VLLM_STREAM)),
    )
    assert asyncio.run(client.agenerate([1], SamplingParams(max_new_tokens=3))).output_versions == [0, 0, 1]


def test_sglang_client_sends_input_ids_and_reads_cumulative_stream():
    rec = Recorder("/generate", SGLANG_STREAM)
    client = SGLangRolloutClient("http://sgl", version=lambda: 2, transport=httpx.MockTransport(rec))
    out = asyncio.run(client.agenerate([5, 6], SamplingParams(temperature=1.0, max_new_tokens=3, seed=3)))
    assert (out.output_ids, out.output_logprobs, out.output_versions) == ([17, 18, 2], [-0.25, -1.5, -0.125], [2] * 3)
    assert out.finish_reason == "length"
    body = rec.bodies[0]
    assert body["input_ids"] == [5, 6] and body["return_logprob"] is True and body["stream"] is True
    assert body["sampling_params"]["max_new_tokens"] == 3 and body["sampling_params"]["sampling_seed"] == 3


def test_sglang_client_reads_incremental_streams_and_retries_aborts():
    """``--incremental-streaming-output``: each event holds only its new tokens (``completion_tokens``
    counts them all); an ``abort`` finish is a server error the router retries elsewhere."""
    incremental = [
        {"text": "1", "meta_info": {"completion_tokens": 1, "finish_reason": None,
                                    "output_token_logprobs": [[-0.25, 17, None]]}},
        {"text": "2", "meta_info": {"completion_tokens": 3, "finish_reason": {"type": "stop", "matched": 2},
                                    "output_token_logprobs": [[-1.5, 18, None], [-0.125, 2, None]]}},
    ]  # fmt: skip
    client = SGLangRolloutClient("http://sgl", transport=httpx.MockTransport(Recorder("/generate", incremental)))
    out = asyncio.run(client.agenerate([5], SamplingParams(max_new_tokens=3)))
    assert (out.output_ids, out.output_logprobs, out.finish_reason, out.text) == (
        [17, 18, 2], [-0.25, -1.5, -0.125], "stop", "12"
    )  # fmt: skip
    aborted = [{"text": "", "meta_info": {"id": "r", "finish_reason": {"type": "abort", "message": "paused"},
                                          "completion_tokens": 0, "output_token_logprobs": []}}]  # fmt: skip
    client = SGLangRolloutClient("http://sgl", transport=httpx.MockTransport(Recorder("/generate", aborted)))
    with pytest.raises(RolloutServerError, match="aborted r") as info:
        asyncio.run(client.agenerate([5], SamplingParams(max_new_tokens=3)))
    assert info.value.status == 500  # retried on another server


def test_server_errors_are_rollout_server_errors():
    def refuse(request):
        return httpx.Response(503, text="engine dead")

    client = VLLMRolloutClient("http://v", model="m", transport=httpx.MockTransport(refuse))
    with pytest.raises(RolloutServerError, match="503") as info:
        asyncio.run(client.agenerate([1], SamplingParams(max_new_tokens=2)))
    assert info.value.status == 503

    def truncated(request):  # the server died mid-stream: no finish reason
        return httpx.Response(200, content=sse(VLLM_STREAM[:1])[: -len(b"data: [DONE]\n\n")])

    client = VLLMRolloutClient("http://v", model="m", transport=httpx.MockTransport(truncated))
    with pytest.raises(RolloutServerError, match="ended the stream"):
        asyncio.run(client.agenerate([1], SamplingParams(max_new_tokens=2)))


def test_least_loaded_routing_and_rerouting_around_a_dead_server():
    dead = "http://a"

    def handler(request):
        if str(request.url).startswith(dead):
            raise httpx.ConnectError("refused")
        return httpx.Response(200, content=sse(VLLM_STREAM))

    multi = MultiServerRolloutClient(
        [dead, "http://b"],
        new_client=lambda url: VLLMRolloutClient(url, model="m", transport=httpx.MockTransport(handler)),
        least_loaded=True,
    )
    outs = asyncio.run(asyncio.wait_for(_many(multi, 4), 10))
    assert all(o.output_ids == [17, 18, 2] for o in outs)
    assert multi.requests_per_server == [0, 4] and multi.in_flight == [0, 0]


async def _many(client, n):
    return await asyncio.gather(*(client.agenerate([1], SamplingParams(max_new_tokens=3)) for _ in range(n)))


def test_vllm_admin_routes(tmp_path):
    calls = []
    (tmp_path / "served").mkdir()
    (tmp_path / "served" / "config.json").write_text(json.dumps({"vocab_size": 99, "hidden_size": 8}))

    def handler(request):
        calls.append((request.method, request.url.path, dict(request.url.params), request.content))
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "srv", "root": str(tmp_path / "served")}]})
        if request.url.path == "/reset_prefix_cache":
            return httpx.Response(200, json={"success": True})
        if request.url.path == "/openapi.json":
            return httpx.Response(200, json=PAUSE_WITH_MODE)
        return httpx.Response(200, json={})

    admin = admin_for("vllm", api_key="k", transport=httpx.MockTransport(handler))
    assert admin.check("http://v", {"vocab_size": 99, "hidden_size": 8}) == "srv"
    with pytest.raises(ConfigError, match=r"config differs from model.path's .*'vocab_size': \(99, 100\)"):
        admin.check("http://v", {"vocab_size": 100, "hidden_size": 8})
    calls.clear()
    admin.pause("http://v")
    admin.load_weights("http://v", Path("/x/policy-v3"), 3)
    admin.resume("http://v")
    assert [(m, p) for m, p, *_ in calls] == [
        ("POST", "/pause"),
        ("POST", "/collective_rpc"),
        ("POST", "/reset_prefix_cache"),
        ("POST", "/resume"),
    ]
    assert calls[0][2] == {"mode": "keep"}
    assert json.loads(calls[1][3]) == {"method": "reload_weights", "kwargs": {"weights_path": "/x/policy-v3"}}
    assert calls[2][2] == {"reset_running_requests": "true"}


PAUSE_WITH_MODE = {"paths": {"/pause": {"post": {"parameters": [{"name": "mode", "in": "query"}]}}}}


def test_vllm_aborts_old_pause_min_tokens_and_empty_resets():
    """walk24: a stream vLLM ended with finish_reason abort was trained as a short completion (SGLang's raised);
    a vLLM whose /pause has no `mode` passed the start-up check, then aborted every request at each sync; a
    request with min_tokens got log-probs after vLLM's EOS masking; an empty 200 from /reset_prefix_cache (older
    vLLM) was a bare JSONDecodeError at the first sync."""
    aborted = [{**VLLM_STREAM[0], "choices": [{**VLLM_STREAM[0]["choices"][0], "finish_reason": "abort"}]}]
    client = VLLMRolloutClient(
        "http://v", model="m", transport=httpx.MockTransport(Recorder("/v1/completions", aborted))
    )
    with pytest.raises(RolloutServerError, match=r"http://v/v1/completions aborted the request") as info:
        asyncio.run(client.agenerate([1], SamplingParams(max_new_tokens=3)))
    assert info.value.status == 500  # a server-side failure: retried on another server
    with pytest.raises(ValueError, match=r"min_new_tokens=2 \(min_tokens\) with a vLLM rollout: .*leave it unset"):
        asyncio.run(client.agenerate([1], SamplingParams(max_new_tokens=3, min_new_tokens=2)))

    def old_pause(request):
        if request.url.path == "/openapi.json":
            return httpx.Response(200, json={"paths": {"/pause": {"post": {"parameters": [{"name": "clear_cache"}]}}}})
        return httpx.Response(200, json={"is_paused": False})

    with pytest.raises(ConfigError, match=r"has a /pause without `mode`: it would abort every request in flight"):
        admin_for("vllm", transport=httpx.MockTransport(old_pause)).check("http://v", {})

    def empty_reset(request):
        return httpx.Response(200) if request.url.path == "/reset_prefix_cache" else httpx.Response(200, json={})

    admin_for("vllm", transport=httpx.MockTransport(empty_reset)).load_weights("http://v", Path("/p"), 1)

    def html_reset(request):
        return httpx.Response(200, text="<html>") if request.url.path == "/reset_prefix_cache" else httpx.Response(200)

    with pytest.raises(RunFailure, match=r"http://v: /reset_prefix_cache answered '<html>', not JSON"):
        admin_for("vllm", transport=httpx.MockTransport(html_reset)).load_weights("http://v", Path("/p"), 1)


def test_vllm_without_pause_api_and_refused_updates_are_errors():
    def old_vllm(request):
        return httpx.Response(404, json={"detail": "Not Found"})

    with pytest.raises(ConfigError, match=r"^rollout.servers: vLLM server http://v has no pause API"):
        admin_for("vllm", transport=httpx.MockTransport(old_vllm)).check("http://v", {})

    def refuse(request):
        return httpx.Response(500, text="size mismatch for model.embed_tokens.weight")

    with pytest.raises(RunFailure, match=r"vllm server http://v answered /collective_rpc with 500: size mismatch"):
        admin_for("vllm", transport=httpx.MockTransport(refuse)).load_weights("http://v", Path("/p"), 1)

    def unreachable(request):
        raise httpx.ConnectError("refused")

    with pytest.raises(RunFailure, match=r"^vllm server http://v cannot be reached .*fix rollout.servers"):
        admin_for("vllm", transport=httpx.MockTransport(unreachable)).check("http://v", {})


def test_sglang_admin_routes():
    calls = []

    def handler(request):
        calls.append((request.url.path, json.loads(request.content or b"{}")))
        if request.url.path == "/update_weights_from_disk":
            return httpx.Response(200, json={"success": calls[-1][1]["model_path"] != "/bad", "message": "bad shape"})
        return httpx.Response(200, json={"model_path": "/nowhere"})

    admin = admin_for("sglang", transport=httpx.MockTransport(handler))
    admin.check("http://s", {})
    admin.pause("http://s")
    admin.load_weights("http://s", Path("/p"), 2)
    admin.resume("http://s")
    assert [p for p, _ in calls] == [
        "/get_model_info", "/pause_generation", "/update_weights_from_disk", "/flush_cache", "/continue_generation"
    ]  # fmt: skip
    assert calls[1][1] == {"mode": "retract"}  # requests kept, their context recomputed after the update
    assert calls[2][1]["model_path"] == "/p" and calls[2][1]["abort_all_requests"] is False
    with pytest.raises(RunFailure, match="refused policy v2 from /bad: bad shape"):
        admin.load_weights("http://s", Path("/bad"), 2)


def test_launcher_command_and_env(tmp_path):
    spec = ServerSpec(
        backend="vllm", model_dir=tmp_path, served_name="p", dtype="float32", tp=2, port=8001, api_key="k",
        devices=None, max_model_len=512, extra_args=["--enforce-eager"],
    )  # fmt: skip
    cmd = server_command(spec)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    text = " ".join(cmd)
    for part in ("--tensor-parallel-size 2", "--host 127.0.0.1", "--port 8001", "--api-key k", "--dtype float32"):
        assert part in text
    assert "--logprobs-mode processed_logprobs" in text and cmd[-1] == "--enforce-eager"
    env = server_env(spec, {})
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] and "CUDA_VISIBLE_DEVICES" not in env
    gpu = server_env(ServerSpec(**{**spec.__dict__, "devices": [2, 3], "backend": "sglang"}), {})
    assert gpu["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert server_command(ServerSpec(**{**spec.__dict__, "backend": "sglang"}))[1:3] == ["-m", "sglang.launch_server"]
    check_tp({"num_attention_heads": 4, "num_key_value_heads": 2}, 2, "vllm")
    with pytest.raises(ConfigError, match=r"vllm TP size 3 must divide the model's 4 attention heads.*\[1, 2, 4\]"):
        check_tp({"num_attention_heads": 4, "num_key_value_heads": 2}, 3, "vllm")


@pytest.mark.parametrize(
    "overrides, backend",
    [
        (["rollout.backend=vllm"], "vllm"),
        (["cluster.allocation_mode='vllm:d2+fsdp:d1'"], "vllm"),
        (["cluster.allocation_mode='sglang:d1|fsdp:d1'"], "sglang"),
        (["rollout.backend=vllm", "rollout.servers=[http://h:1,http://h:2]"], "vllm"),
        ([], "areno"),
    ],
)
def test_backend_keys(overrides, backend):
    assert load_config(None, ["model.path=m", *overrides]).rollout.backend == backend


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.backend=tgi"], "rollout.backend: must be one of areno, vllm, sglang, got 'tgi'"),
        (["rollout.servers=[http://h:1]"], "rollout.servers: lists vLLM/SGLang servers: set rollout.backend"),
        (["rollout.backend=vllm", "rollout.servers=[h:1]"], "rollout.servers: 'h:1' is not an http(s):// URL"),
        (
            ["rollout.backend=sglang", "cluster.allocation_mode='vllm:d1+fsdp:d1'"],
            "rollout.backend: is 'sglang' but cluster.allocation_mode 'vllm:d1+fsdp:d1' names 'vllm'",
        ),
        (
            ["cluster.allocation_mode='vllm:d1+megatron:d1'"],
            "cluster.allocation_mode: training backend 'megatron' (megatron[actor]:d1) is not supported: use fsdp",
        ),
        (
            ["rollout.backend=vllm", "cluster.offload=sleep"],
            "cluster.offload: sleep offloads areno's own rollout engine; a vllm server manages its own memory",
        ),
        (
            ["rollout.backend=vllm", "cluster.train_devices=[0]", "cluster.rollout_devices=[1]"],
            "cluster.train_devices: a vllm rollout takes its layout from cluster.allocation_mode",
        ),
    ],
)
def test_backend_key_errors(overrides, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        load_config(None, ["model.path=m", *overrides])


def test_logprob_diff_metrics_over_trained_tokens():
    rollout = torch.tensor([-1.0, -0.5, -2.0, -3.0])
    trainer = torch.tensor([-1.5, -0.5, -2.25, 0.0])
    mask = torch.tensor([1, 1, 1, 0])
    m = logprob_diff_metrics(rollout, trainer, mask)
    assert m == {"rollout/logprob_abs_diff_mean": pytest.approx(0.25), "rollout/logprob_abs_diff_max": 0.5}
    assert logprob_diff_metrics(rollout, trainer, torch.zeros(4)) == {}


def _server_config(tmp_path, *overrides):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"num_attention_heads": 4, "num_key_value_heads": 2}))
    return load_config(None, [f"model.path={model}", f"run_dir={tmp_path / 'run'}", *overrides]), model


def test_build_engine_puts_server_backends_behind_the_rollout_seam(tmp_path):

    cfg, _ = _server_config(tmp_path, "rollout.backend=vllm", "rollout.servers=[http://127.0.0.1:9]")
    engine = build_engine(cfg, tmp_path / "run")
    assert isinstance(engine.rollout, ServerRolloutSide) and engine.weight_kind is WeightKind.DISK
    assert engine.training.measure_rollout_logprobs


def test_unreachable_server_at_start_names_the_url(tmp_path):

    url = f"http://127.0.0.1:{free_port()}"
    cfg, model = _server_config(tmp_path, "rollout.backend=vllm", f"rollout.servers=[{url}]")
    side = ServerRolloutSide(cfg, tmp_path / "run")
    with pytest.raises(RunFailure, match=f"^vllm server {re.escape(url)} cannot be reached"):
        side.start(SideSetup(recipe=None, model_dir=model, tokenizer=None))
    side.shutdown()


def test_tp_that_does_not_divide_the_heads_is_refused_before_a_server_starts(tmp_path, monkeypatch):

    monkeypatch.setattr("areno.engine.servers.check_server_install", lambda backend: None)
    started = []
    monkeypatch.setattr("areno.engine.servers.start_servers", lambda *a, **k: started.append(a))
    cfg, model = _server_config(tmp_path, "cluster.allocation_mode='vllm:t3+fsdp:d1'")
    side = ServerRolloutSide(cfg, tmp_path / "run")
    with pytest.raises(ConfigError, match="vllm TP size 3 must divide the model's 4 attention heads"):
        side.start(SideSetup(recipe=None, model_dir=model, tokenizer=None))
    assert not started


def test_missing_server_package_is_a_config_error(monkeypatch):

    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(
        ConfigError, match=r"^rollout.backend=vllm: vllm is not installed in .*pip install 'areno\[vllm\]'"
    ):
        check_server_install("vllm")


@pytest.mark.parametrize("eta", [0, 1])
def test_grpo_through_the_vllm_backend_against_a_stand_in_server(tmp_path, eta):
    """``areno train``'s path with ``rollout.backend=vllm`` and ``rollout.servers``: the policy goes
    out as a disk export at each sync, loaded through vLLM's routes; the trainer's log-probs match
    the server's (its engine is areno's, so they are equal)."""

    tok = build_char_tokenizer()
    model = tmp_path / "model"
    init_model_dir(
        model, tiny_config(len(tok), hidden_size=32, layers=1, heads=2, kv_heads=1, intermediate_size=64), tok
    )
    app = fake_vllm_app(model, tok.eos_token_id)
    with serving(app) as url:
        cfg = load_config(
            None,
            [
                *tiny_run_overrides(tmp_path),
                "train.steps=2",
                "data.num_eval=2",
                "train.eval_interval=1",
                "rollout.backend=vllm",
                f"rollout.servers=[{url}]",
                f"rollout.max_head_offpolicyness={eta}",
            ],
        )
        trainer = Trainer.init(cfg)
        try:
            trainer.run()
        finally:
            trainer.shutdown()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "rollout/healthy_servers" in r]
    assert len(steps) == 2 and all(r["rollout/staleness_max"] <= eta for r in steps), steps
    # tokens of the version trained on: the server's log-probs are the trainer's (stale ones left out)
    assert all(r.get("rollout/logprob_abs_diff_max", 0.0) < 1e-4 for r in steps), steps
    assert eta or all("rollout/logprob_abs_diff_max" in r for r in steps)
    assert app.state.engine.version == 2  # both syncs reached the server
    assert sum("eval/accuracy" in r for r in rows) >= 2  # held-out evaluation through the server too
    names = [name for name, _ in app.state.calls]
    assert names == ["pause", "collective_rpc", "reset_prefix_cache", "resume"] * 2
    assert app.state.calls[0][1] == {"mode": "keep"}


def test_servers_take_the_allocations_inference_devices(tmp_path, monkeypatch):
    monkeypatch.setattr("areno.engine.servers.check_server_install", lambda backend: None)
    cfg, _ = _server_config(tmp_path, "cluster.allocation_mode='fsdp:d1+vllm:d2t2'")
    n, tp, devices = ServerRolloutSide(cfg, tmp_path / "run").layout(num_devices=8)
    assert (n, tp, devices) == (2, 2, [1, 2, 3, 4])  # after the training device: server 0 on 1-2, 1 on 3-4


def test_config_of_the_server_backends_is_checked_first(tmp_path, monkeypatch):
    """walk24: a vision-language model with vLLM/SGLang failed every group with a TypeError; rollout.backend=vllm
    beside an allocation without an inference component was a bare StopIteration at start; server_api_key with
    servers areno starts, and an allocation placing another number of servers than rollout.servers lists, were
    ignored; rollout.servers with the backend named by the allocation string was refused."""
    from areno.api.config import load_config
    from areno.engine.api import prepare_model_dir
    from tests.helpers.vlm import vl_overrides

    monkeypatch.setattr("areno.engine.servers.check_server_install", lambda backend: None)
    started = []
    monkeypatch.setattr("areno.engine.servers.start_servers", lambda *a, **k: started.append(a))
    cfg = load_config(None, [*vl_overrides(tmp_path, 3), "rollout.backend=vllm"])
    prepare_model_dir(cfg)
    side = ServerRolloutSide(cfg, tmp_path / "run")
    with pytest.raises(
        ConfigError,
        match=r"^rollout.backend=vllm: .* is a vision-language checkpoint, which areno .*rollout.backend=areno",
    ):
        side.start(SideSetup(recipe=None, model_dir=Path(cfg.model.path), tokenizer=None))
    assert not started
    for overrides, message in (
        (["rollout.backend=vllm", "cluster.allocation_mode='fsdp:d1'"], r"names no inference component"),
        (["rollout.backend=sglang", "rollout.server_api_key=k"], r"^rollout.server_api_key: is the key of servers"),
        (["rollout.servers=[http://h:1]", "cluster.allocation_mode='vllm:d4t2+fsdp:d1'"], r"places 4 vllm servers"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config(None, ["model.path=/m", *overrides])
    chosen = load_config(
        None, ["model.path=/m", "rollout.servers=[http://h:1]", "cluster.allocation_mode='vllm:d1+fsdp:d1'"]
    )
    assert chosen.rollout.backend == "vllm"


def test_the_training_side_runs_on_the_train_components_gpu_beside_servers(tmp_path, monkeypatch):
    """walk35: with 'vllm:d1+fsdp:d1' the training device was cuda:1, but only its type reached the training
    backends, which took "cuda", the current device: cuda:0, the vLLM server's. The process's current device is
    now the train component's."""
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    servers = "rollout.servers=[http://127.0.0.1:9]"  # started elsewhere: nothing launches
    cfg, _ = _server_config(tmp_path, "cluster.allocation_mode='vllm:d1+fsdp:d1'", "cluster.device=cuda", servers)
    engine = build_engine(cfg, tmp_path / "run")
    assert engine.training.device == torch.device("cuda", 1) and chosen == [torch.device("cuda", 1)]


def test_servers_keep_a_longrope_models_context_within_its_original_one(tmp_path, monkeypatch):
    """Past LongRoPE's original context a server turns by the long factors, which training does not: areno
    bounds the servers it starts there unless ``rollout.max_model_len`` says otherwise."""
    from areno.models import tiny_config

    monkeypatch.setattr("areno.engine.servers.check_server_install", lambda backend: None)
    cfg, model = _server_config(tmp_path, "rollout.backend=vllm")
    rope = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    longrope = tiny_config(61, arch="phi3", rope_scaling={**rope, "original_max_position_embeddings": 512})
    (model / "config.json").write_text(json.dumps(longrope.to_hf()))
    assert ServerRolloutSide(cfg, tmp_path / "run")._specs(model, 1, 1, "k")[0].max_model_len == 512
    cfg, _ = _server_config(tmp_path, "rollout.backend=vllm", "rollout.max_model_len=256")
    (model / "config.json").write_text(json.dumps(longrope.to_hf()))
    assert ServerRolloutSide(cfg, tmp_path / "run")._specs(model, 1, 1, "k")[0].max_model_len == 256
    cfg, _ = _server_config(tmp_path, "rollout.backend=vllm")
    (model / "config.json").write_text(json.dumps(tiny_config(61, arch="phi3").to_hf()))
    assert ServerRolloutSide(cfg, tmp_path / "run")._specs(model, 1, 1, "k")[0].max_model_len is None
