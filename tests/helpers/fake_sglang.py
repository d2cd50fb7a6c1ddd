"""A stand-in for an SGLang server, for CPU tests without SGLang (which does not install on areno's
CPU machine): areno's own ``RolloutEngine`` behind SGLang's native HTTP routes, in the shapes
SGLang documents (``docs/basic_usage/native_api``, ``sampling_params``; ``io_struct.py``). It is
not SGLang: the sampler, the scheduler and the log-probs are areno's.

Routes:

- ``POST /generate``: ``input_ids``, ``sampling_params`` (``temperature``, ``top_p``, ``top_k``,
  ``max_new_tokens``, ``min_new_tokens``, ``stop_token_ids``, ``ignore_eos``, ``sampling_seed``),
  ``return_logprob``, ``stream``, ``rid``. Streamed as server-sent events (``data: {...}``, then
  ``data: [DONE]``) with SGLang's default cumulative output: each event's ``text`` and
  ``output_ids`` are the output so far and ``meta_info`` holds ``id``, ``finish_reason`` (None, or
  ``{"type": "stop", "matched": id}`` / ``{"type": "length", "length": n}``), ``prompt_tokens``,
  ``completion_tokens``, ``weight_version`` and ``output_token_logprobs`` as ``[logprob, token_id,
  None]`` triples. Without ``stream``: the last event's object.
- ``POST /pause_generation`` (``mode``: ``abort`` | ``retract`` | ``in_place``; only ``retract``
  and ``in_place`` keep requests, which is all areno uses), ``POST /continue_generation``.
- ``POST /update_weights_from_disk`` (``model_path``, ``weight_version``, ``abort_all_requests``,
  ``flush_cache``): ``{"success", "message", "num_paused_requests"}``, 400 when it fails.
- ``POST /flush_cache`` (200, plain text), ``GET /health``, ``GET /get_model_info`` (``model_path``,
  ``tokenizer_path``, ``is_generation``, ``weight_version``), ``GET /get_server_info``.

``die_after``: the process exits (``os._exit``) when it receives that many ``/generate`` requests,
to test losing a server mid-step. ``python -m tests.helpers.fake_sglang --model-path DIR --port P --eos-token-id E``
serves it in a process of its own. Every control call is recorded in ``app.state.calls``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from areno.types import GenerationOutput, SamplingParams
from tests.helpers.serving import stand_in_engine

PAUSE_MODES = ("abort", "retract", "in_place")


def fake_sglang_app(model_dir: Path, eos_token_id: int, *, die_after: int | None = None) -> FastAPI:
    engine, client = stand_in_engine(model_dir, eos_token_id)
    app = FastAPI()
    app.state.calls = []
    app.state.engine = engine
    state = {"weight_version": "default", "generate_requests": 0}

    @app.get("/health")
    async def health():
        return PlainTextResponse("")

    @app.get("/get_model_info")
    async def get_model_info():
        return {
            "model_path": str(model_dir),
            "tokenizer_path": str(model_dir),
            "is_generation": True,
            "weight_version": state["weight_version"],
        }

    @app.get("/get_server_info")
    async def get_server_info():
        return {"model_path": str(model_dir), "version": "stand-in", "weight_version": state["weight_version"]}

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        body = await request.json()
        app.state.calls.append(("pause_generation", body))
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            return JSONResponse({"error": f"Invalid mode: {mode!r}. Expected one of {list(PAUSE_MODES)}."}, 400)
        assert mode != "abort", "the stand-in keeps requests (retract / in_place); areno never aborts them"
        engine.pause()
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation(request: Request):
        app.state.calls.append(("continue_generation", await request.json()))
        engine.resume()
        client.wake()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        body = await request.json()
        app.state.calls.append(("update_weights_from_disk", body))
        try:
            engine.update_weights_from_disk(body["model_path"], int(body["weight_version"]))
        except Exception as exc:  # noqa: BLE001  SGLang answers a failed load with 400 and success false
            return JSONResponse({"success": False, "message": f"{type(exc).__name__}: {exc}"}, 400)
        state["weight_version"] = body["weight_version"]
        return {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        app.state.calls.append(("flush_cache", {}))
        return PlainTextResponse("Cache flushed.\nPlease check backend logs for more details.")

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        state["generate_requests"] += 1
        if die_after is not None and state["generate_requests"] >= die_after:
            os._exit(1)  # a crashed server: connections reset, no answer
        sp = body.get("sampling_params") or {}
        params = SamplingParams(
            temperature=sp.get("temperature", 1.0),
            top_p=sp.get("top_p", 1.0),
            top_k=sp.get("top_k", -1),
            min_p=sp.get("min_p", 0.0),
            repetition_penalty=sp.get("repetition_penalty", 1.0),
            max_new_tokens=sp.get("max_new_tokens", 128),
            min_new_tokens=sp.get("min_new_tokens", 0),
            stop_token_ids=tuple(sp.get("stop_token_ids") or ()),
            ignore_eos=sp.get("ignore_eos", False),
            seed=sp.get("sampling_seed"),
        )
        rid = body.get("rid") or f"rid-{state['generate_requests']}"
        out = await client.agenerate(body["input_ids"], params, request_id=rid)
        # each chunk names the weights that produced its last token (the engine's per-token versions;
        # the stand-in streams after the request finished, SGLang while it runs)
        events = [
            _event(out, n, _served_by(out, n, state["weight_version"]), body.get("return_logprob", False))
            for n in _prefixes(out)
        ]
        if not body.get("stream"):
            return events[-1]

        async def stream():
            for event in events:
                yield f"data: {json.dumps(event)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


def _served_by(out: GenerationOutput, n: int, current: str) -> str:
    """The weight version of the ``n``-th token ("default" for the weights the server started with)."""
    if n == 0:
        return current
    version = out.output_versions[n - 1]
    return str(version) if version > 0 else "default"


def _prefixes(out: GenerationOutput) -> list[int]:
    """How many tokens each streamed event holds: one more per event (SGLang streams every decode
    step by default), the last one the whole output."""
    return list(range(1, len(out.output_ids) + 1)) or [0]


def _event(out: GenerationOutput, n: int, weight_version: str, logprobs: bool) -> dict:
    last = n == len(out.output_ids)
    finish = None
    if last:
        if out.finish_reason == "length":
            finish = {"type": "length", "length": n}
        else:
            finish = {"type": "stop", "matched": out.output_ids[-1] if out.output_ids else None}
    meta = {
        "id": out.request_id,
        "finish_reason": finish,
        "prompt_tokens": len(out.prompt_ids),
        "completion_tokens": n,
        "cached_tokens": 0,
        "weight_version": weight_version,
    }
    if logprobs:
        meta["input_token_logprobs"] = []
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(out.output_logprobs[:n], out.output_ids[:n])]
    text = out.text if last else ""
    return {"text": text, "output_ids": out.output_ids[:n], "meta_info": meta}


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--eos-token-id", type=int, required=True)
    parser.add_argument("--die-after", type=int, default=None)
    args = parser.parse_args()
    app = fake_sglang_app(Path(args.model_path), args.eos_token_id, die_after=args.die_after)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
