"""A stand-in for a vLLM server, for CPU tests without vLLM: the routes areno's vLLM backend uses
(``/v1/completions`` streamed with token ids and log-probs, ``/pause``, ``/resume``, ``/is_paused``,
``/collective_rpc`` ``reload_weights``, ``/reset_prefix_cache``, ``/v1/models``, ``/health``, and
the weight-transfer routes ``/init_weight_transfer_engine``, ``/start_weight_update``,
``/update_weights``, ``/finish_weight_update``, listed in ``/openapi.json`` as vLLM's are), in
vLLM 0.32's shapes, served by areno's own engine on the CPU. Every control call is recorded; the
weight-transfer routes only record (no NCCL here: the tests' group records the broadcast)."""

from __future__ import annotations

import json
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from areno.types import SamplingParams
from tests.helpers.serving import stand_in_engine


def fake_vllm_app(model_dir: Path, eos_token_id: int, *, weight_transfer: bool = True) -> FastAPI:
    engine, client = stand_in_engine(model_dir, eos_token_id)
    app = FastAPI()
    app.state.calls = []
    app.state.engine = engine

    @app.get("/health")
    async def health():
        return JSONResponse({})

    @app.get("/is_paused")
    async def is_paused():
        return {"is_paused": engine.is_paused}

    @app.get("/v1/models")
    async def models():
        return {"data": [{"id": "fake-policy", "root": str(model_dir)}]}

    @app.post("/pause")
    async def pause(request: Request, mode: str = "abort"):  # declared, as vLLM's: the start-up check reads it
        app.state.calls.append(("pause", dict(request.query_params)))
        engine.pause()
        return {"status": "paused"}

    @app.post("/resume")
    async def resume():
        app.state.calls.append(("resume", {}))
        engine.resume()
        client.wake()
        return {"status": "resumed"}

    @app.post("/collective_rpc")
    async def collective_rpc(request: Request):
        body = await request.json()
        app.state.calls.append(("collective_rpc", body))
        assert body["method"] == "reload_weights", body
        path = body["kwargs"]["weights_path"]
        version = json.loads((Path(path) / "model.safetensors.index.json").read_text())["metadata"]["policy_version"]
        engine.update_weights_from_disk(path, int(version))
        return JSONResponse({"results": [None]})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request):
        app.state.calls.append(("reset_prefix_cache", dict(request.query_params)))
        return {"success": True}

    if weight_transfer:  # a vLLM older than 0.32 has none of them

        @app.post("/init_weight_transfer_engine")
        async def init_weight_transfer_engine(request: Request):
            app.state.calls.append(("init_weight_transfer_engine", await request.json()))
            return JSONResponse({"message": "Weight transfer initialized"})

        @app.post("/start_weight_update")
        async def start_weight_update():
            app.state.calls.append(("start_weight_update", {}))
            return JSONResponse({"message": "Weight update started"})

        @app.post("/update_weights")
        async def update_weights(request: Request):
            app.state.calls.append(("update_weights", await request.json()))
            return JSONResponse({"message": "Weights updated"})

        @app.post("/finish_weight_update")
        async def finish_weight_update():
            app.state.calls.append(("finish_weight_update", {}))
            return JSONResponse({"message": "Weight update finished"})

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        params = SamplingParams(
            temperature=body["temperature"],
            top_p=body["top_p"],
            top_k=body.get("top_k", -1),
            min_p=body.get("min_p", 0.0),
            repetition_penalty=body.get("repetition_penalty", 1.0),
            max_new_tokens=body["max_tokens"],
            min_new_tokens=body["min_tokens"],
            stop_token_ids=tuple(body["stop_token_ids"]),
            ignore_eos=body["ignore_eos"],
            seed=body.get("seed"),
        )
        out = await client.agenerate(body["prompt"], params, request_id=body["request_id"])
        event = {
            "choices": [
                {
                    "index": 0,
                    "text": out.text,
                    "token_ids": out.output_ids,
                    "logprobs": {
                        "tokens": [f"token_id:{t}" for t in out.output_ids],
                        "token_logprobs": out.output_logprobs,
                    },
                    "finish_reason": out.finish_reason,
                }
            ]
        }

        async def stream():
            yield f"data: {json.dumps(event)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


class RecordingGroup:
    """Stands in for the NCCL group: the tensors rank 0 broadcasts, in order."""

    def __init__(self) -> None:
        self.joined: tuple | None = None
        self.sent: list = []


class StartedServer:
    """What ``start_servers`` returns for a server that is already up (the stand-in)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def alive(self) -> bool:
        return True

    def stop(self) -> None:
        pass
