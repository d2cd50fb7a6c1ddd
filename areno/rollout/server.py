"""``areno serve MODEL_DIR``: the rollout engine behind an HTTP server.

Endpoints
- OpenAI-compatible: ``POST /v1/completions``, ``POST /v1/chat/completions`` (chat template from the
  tokenizer), ``GET /v1/models``. ``logprobs`` is supported (the sampled token's log-prob; top
  alternatives are not computed and come back empty). Every choice also carries ``token_ids`` and
  ``prompt_token_ids`` so RL clients never re-tokenise.
- Token level: ``POST /generate`` ``{prompt_ids, sampling_params, request_id}`` → ``GenerationOutput``
  (what ``HTTPRolloutClient`` uses).
- Admin: ``GET /health`` (200, or 503 with a reason when the engine's driver thread died or is
  stuck: see ``EngineWatchdog``), ``GET /version``, ``POST /pause``, ``POST /resume``, ``POST /abort``
  ``{request_id}``, ``POST /update_weights_from_disk`` ``{path, version}``, ``GET /metrics``
  (Prometheus text).

Security: it binds 127.0.0.1 unless ``--host`` says otherwise. With an API key every endpoint but
``/health`` needs ``Authorization: Bearer KEY`` (401 otherwise; compared in constant time). A server
that listens beyond loopback refuses to start without a key, since its admin endpoints (pause,
resume, abort, weight updates) would otherwise be open to the network. Weight updates read
safetensors only (never pickle). Bad input gets a 400 whose message names the field, in OpenAI's
error shape; the server keeps serving.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hmac
import ipaddress
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from areno.models.hf_io import load_model
from areno.rollout.client import InProcessRolloutClient, RolloutRequestTimeout
from areno.rollout.engine import RolloutEngine, RolloutEngineConfig, UnknownRequestError, WeightUpdateError
from areno.types import GenerationOutput, SamplingParams

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------- request bodies
class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(default=None, description="new tokens; > 0")
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = Field(default=1, ge=1, le=128)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    seed: int | None = None

    def sampling_params(self, default_max: int, index: int) -> SamplingParams:
        max_tokens = default_max if self.max_tokens is None else self.max_tokens
        if max_tokens <= 0:
            raise _BadRequest("max_tokens", f"max_tokens must be > 0, got {max_tokens}")
        if isinstance(self.stop, str):
            stop = (self.stop,)
        else:
            stop = tuple(self.stop or ())
        try:
            return SamplingParams(
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                min_new_tokens=self.min_tokens,
                max_new_tokens=max_tokens,
                stop_token_ids=tuple(self.stop_token_ids or ()),
                stop=stop,
                ignore_eos=self.ignore_eos,
                seed=None if self.seed is None else self.seed + index,
            )
        except ValueError as e:
            raise _BadRequest(_param_of(str(e)), str(e)) from None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | None = ""


class ChatRequest(_Sampling):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None


class GenerateRequest(BaseModel):
    prompt_ids: list[int]
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    request_id: str | None = None


class GenerateManyRequest(BaseModel):
    """Several completions of one prompt (a GRPO group) in one request."""

    prompt_ids: list[int]
    sampling_params: list[dict[str, Any]] = Field(min_length=1)
    request_ids: list[str] | None = None


class AbortRequest(BaseModel):
    request_id: str


class UpdateFromDiskRequest(BaseModel):
    path: str
    version: int


class _BadRequest(Exception):
    def __init__(self, param: str | None, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.message, self.status = param, message, status


def _engine_error(exc: BaseException) -> _BadRequest:
    """A 500 naming the engine's exception (the full traceback is in the server log)."""
    logger.error("rollout engine failed a request: %s: %s", type(exc).__name__, exc)
    return _BadRequest(None, f"the rollout engine failed: {type(exc).__name__}: {exc}", status=500)


_SAMPLING_FIELDS = {"temperature", "top_p", "top_k", "min_new_tokens", "max_new_tokens", "seed"}


def _param_of(message: str) -> str | None:
    word = message.split(" ", 1)[0]
    return {"min_new_tokens": "min_tokens", "max_new_tokens": "max_tokens"}.get(
        word, word if word in _SAMPLING_FIELDS else None
    )


_UNION_MEMBER = re.compile(r"^(str|int|float|bool|bytes|none|list|dict|tuple|set)(\[.*\])?$")


def _union_members(loc: tuple) -> list[str]:
    """The union member tags pydantic puts in an error location (``('prompt', 'list[int]', 0)``)."""
    return [x for x in loc if isinstance(x, str) and _UNION_MEMBER.match(x)]


def _field_loc(loc: tuple) -> list[str]:
    """An error location as the request spells it: no ``body`` prefix, no union member tags."""
    return [str(x) for x in loc if x != "body" and not (isinstance(x, str) and _UNION_MEMBER.match(x))]


_OUTPUT_FIELDS = tuple(f.name for f in dataclasses.fields(GenerationOutput))


def _output_dict(out: GenerationOutput) -> dict[str, Any]:
    """A generation's fields as they are (lists of ints / floats, no copies): ``dataclasses.asdict``
    deep-copies every list element by element in Python, ~20 ms for a GRPO group of 8 x 384 tokens."""
    return {name: getattr(out, name) for name in _OUTPUT_FIELDS}


def _json_response(content: dict[str, Any]) -> Response:
    """Token-level results encoded with ``json.dumps`` straight to bytes: FastAPI's response-model
    validation and ``jsonable_encoder`` walk each of the thousands of values of a group in Python
    (about 4x the time), and they run in the rollout worker's process, holding the GIL the engine's
    driver thread needs between decode steps."""
    return Response(
        json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")), media_type="application/json"
    )


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(
        status_code=status, content={"error": {"message": message, "type": kind, "param": param, "code": None}}
    )


# ------------------------------------------------------------------------------------- health
class _ServedClient(InProcessRolloutClient):
    """The server's client, which also says whether its driver thread is alive."""

    @property
    def driver_state(self) -> str:
        """``"idle"`` (not started yet), ``"alive"`` or ``"dead"``."""
        thread = self._thread
        if thread is None:
            return "idle"
        return "alive" if thread.is_alive() else "dead"


class EngineWatchdog:
    """Whether the engine behind a server makes progress, for ``GET /health``.

    ``check()`` gives None when healthy, else a one-line reason: the driver thread died while
    requests are pending (they would never finish), or the engine took no step for longer than
    ``stall_timeout_s`` while requests are pending and it is neither paused nor asleep (a hung
    forward, a deadlock). A stall is measured between checks, so it is seen at the first check at
    least ``stall_timeout_s`` after the last step. No lock is taken: a hung step holds the engine's.
    """

    def __init__(
        self, engine: RolloutEngine, client: _ServedClient, *, stall_timeout_s: float, clock: Any = time.monotonic
    ) -> None:
        if not stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s must be > 0, got {stall_timeout_s}")
        self.engine, self.client = engine, client
        self.stall_timeout_s = stall_timeout_s
        self._clock = clock
        self._state: tuple[int, bool] | None = None  # (engine steps, requests pending) at the last change
        self._since = clock()

    def check(self) -> str | None:
        now = self._clock()
        pending = self.client.num_pending
        steps = int(getattr(self.engine, "_steps", 0))  # a plain int: read without the engine lock
        waiting = pending > 0 and not (self.engine.is_paused or self.engine.is_sleeping)
        state = (steps, waiting)
        if state != self._state:
            self._state, self._since = state, now
        if pending and self.client.driver_state == "dead":
            return (
                f"the engine's driver thread died with {pending} request(s) pending (see the server log "
                f"for its traceback): restart the server"
            )
        if waiting and now - self._since > self.stall_timeout_s:
            return (
                f"the engine is stuck: no step for {now - self._since:.1f}s with {pending} request(s) "
                f"pending (stall_timeout_s={self.stall_timeout_s:g}): restart the server"
            )
        return None


# ---------------------------------------------------------------------------------------- the app
def create_app(
    engine: RolloutEngine,
    *,
    tokenizer: Any = None,
    model_name: str = "areno",
    api_key: str | None = None,
    default_max_tokens: int = 16,
    stall_timeout_s: float = 300.0,
) -> FastAPI:
    """The FastAPI app serving ``engine`` (one ``InProcessRolloutClient`` drives it).

    ``stall_timeout_s``: ``/health`` answers 503 once the engine took no step for this long while
    requests are pending (``EngineWatchdog``); keep it above the slowest single step.
    """
    client = _ServedClient(engine)
    watchdog = EngineWatchdog(engine, client, stall_timeout_s=stall_timeout_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await client.aclose()

    app = FastAPI(title="areno rollout server", lifespan=lifespan)
    app.state.client = client
    app.state.watchdog = watchdog
    app.middleware("http")(_bearer_auth(api_key))
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_exception_handler(_BadRequest, _bad_request)
    _OpenAIRoutes(client, tokenizer, model_name, default_max_tokens).add_to(app)
    _TokenRoutes(client).add_to(app)
    _AdminRoutes(engine, client, watchdog).add_to(app)
    return app


def _bearer_auth(api_key: str | None) -> Callable[[Request, Any], Awaitable[Response]]:
    """Middleware: with an ``api_key``, every endpoint but ``/health`` needs ``Authorization: Bearer
    <api_key>`` (401 otherwise; compared in constant time)."""
    expected = f"Bearer {api_key}".encode() if api_key else b""

    async def auth(request: Request, call_next: Any) -> Response:
        if api_key and request.url.path != "/health":
            if not hmac.compare_digest(request.headers.get("authorization", "").encode(), expected):
                return _error(
                    401, "missing or wrong API key: send 'Authorization: Bearer <key>'", kind="authentication_error"
                )
        return await call_next(request)

    return auth


async def _invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    """A 400 naming the first invalid field as the request spells it."""
    errors = exc.errors()
    err = errors[0]
    if err.get("type") == "json_invalid":
        return _error(400, f"request body is not valid JSON: {err.get('msg')}", "body")
    loc = _field_loc(err.get("loc", ()))
    field = ".".join(loc) or "body"
    # a union-typed field fails once per member type (``prompt.str``, ``prompt.list[int]``): name
    # the field itself and list the types it accepts
    members = list(
        dict.fromkeys(
            m for e in errors if _field_loc(e.get("loc", ()))[:1] == loc[:1] for m in _union_members(e.get("loc", ()))
        )
    )
    accepts = f" (it accepts {', '.join(members)})" if len(members) > 1 else ""
    return _error(400, f"invalid field '{field}': {err.get('msg')}{accepts}", field)


async def _bad_request(request: Request, exc: _BadRequest) -> JSONResponse:
    return _error(exc.status, exc.message, exc.param)


async def _agenerate(
    client: InProcessRolloutClient,
    prompt_ids: list[int],
    params: SamplingParams,
    field: str,
    request_id: str | None = None,
) -> GenerationOutput:
    """One completion; a request the engine rejects is a 400 naming ``field``, an engine failure a 500."""
    try:
        return await client.agenerate(prompt_ids, params, request_id=request_id)
    except ValueError as e:
        raise _BadRequest(field, f"{field}: {e}") from None
    except RolloutRequestTimeout:
        raise
    except Exception as e:  # noqa: BLE001 - the engine failed: a 500 that says why
        raise _engine_error(e) from None


def _usage(prompt_tokens: int, outs: list[GenerationOutput]) -> dict[str, int]:
    completion = sum(len(o.output_ids) for o in outs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


class _OpenAIRoutes:
    """``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``."""

    def __init__(
        self, client: InProcessRolloutClient, tokenizer: Any, model_name: str, default_max_tokens: int
    ) -> None:
        self.client, self.tokenizer = client, tokenizer
        self.model_name, self.default_max_tokens = model_name, default_max_tokens

    def add_to(self, app: FastAPI) -> None:
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat, methods=["POST"])

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise _BadRequest("prompt", "this server has no tokenizer: send token ids")
        return list(self.tokenizer(text)["input_ids"])

    def _decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)

    async def models(self) -> dict:
        return {
            "object": "list",
            "data": [{"id": self.model_name, "object": "model", "owned_by": "areno", "created": 0}],
        }

    async def completions(self, req: CompletionRequest) -> dict:
        prompt = req.prompt
        if isinstance(prompt, str):
            prompts = [self._encode(prompt)]
        elif prompt and isinstance(prompt[0], str):
            prompts = [self._encode(p) for p in prompt]
        elif prompt and isinstance(prompt[0], list):
            prompts = [list(p) for p in prompt]
        else:
            prompts = [list(prompt)]
        if any(len(p) == 0 for p in prompts):
            raise _BadRequest("prompt", "prompt is empty: send at least one token")
        jobs = [(p, req.sampling_params(self.default_max_tokens, i)) for p in prompts for i in range(req.n)]
        outs = await asyncio.gather(*(_agenerate(self.client, p, sp, "prompt") for p, sp in jobs))
        choices = [
            self._completion_choice(index, prompt_ids, out, req.logprobs is not None)
            for index, ((prompt_ids, _), out) in enumerate(zip(jobs, outs))
        ]
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": req.model or self.model_name,
            "choices": choices,
            "usage": _usage(sum(len(p) for p, _ in jobs), outs),
        }

    def _completion_choice(
        self, index: int, prompt_ids: list[int], out: GenerationOutput, logprobs: bool
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": index,
            "text": out.text,
            "finish_reason": out.finish_reason,
            "logprobs": None,
            "token_ids": out.output_ids,
            "prompt_token_ids": prompt_ids,
        }
        if logprobs:
            tokens = [self._decode_token(t) for t in out.output_ids]
            offsets, pos = [], 0
            for t in tokens:
                offsets.append(pos)
                pos += len(t)
            choice["logprobs"] = {
                "tokens": tokens,
                "token_logprobs": out.output_logprobs,
                "top_logprobs": [{} for _ in tokens],
                "text_offset": offsets,
            }
        return choice

    async def chat(self, req: ChatRequest) -> dict:
        tokenizer = self.tokenizer
        if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
            raise _BadRequest("messages", "this server's tokenizer has no chat template: use /v1/completions")
        if not req.messages:
            raise _BadRequest("messages", "messages is empty: send at least one message")
        if req.max_completion_tokens is not None and req.max_tokens is None:
            req.max_tokens = req.max_completion_tokens
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(prompt_ids, dict) or hasattr(prompt_ids, "keys"):  # BatchEncoding in transformers 5
            prompt_ids = prompt_ids["input_ids"]
        prompt_ids = list(prompt_ids)
        jobs = [req.sampling_params(self.default_max_tokens, i) for i in range(req.n)]
        outs = await asyncio.gather(*(_agenerate(self.client, prompt_ids, sp, "messages") for sp in jobs))
        choices = [
            {
                "index": index,
                "message": {"role": "assistant", "content": out.text},
                "finish_reason": out.finish_reason,
                "logprobs": self._chat_logprobs(out) if req.logprobs else None,
                "token_ids": out.output_ids,
                "prompt_token_ids": prompt_ids,
            }
            for index, out in enumerate(outs)
        ]
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": req.model or self.model_name,
            "choices": choices,
            "usage": _usage(len(prompt_ids) * len(jobs), outs),
        }

    def _chat_logprobs(self, out: GenerationOutput) -> dict[str, Any]:
        content = []
        for t, lp in zip(out.output_ids, out.output_logprobs):
            s = self._decode_token(t)
            content.append({"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []})
        return {"content": content}


def _token_sampling_params(raw: dict[str, Any], field: str) -> SamplingParams:
    """``SamplingParams`` from a request's dict; an unknown or invalid key is a 400 naming it."""
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise _BadRequest(f"{field}.{unknown[0]}", f"{field}: unknown parameter {unknown[0]!r}")
    try:
        return SamplingParams(**raw)
    except (ValueError, TypeError) as e:
        raise _BadRequest(field, f"{field}: {e}") from None


class _TokenRoutes:
    """``POST /generate`` and ``POST /generate_many``: token ids in, ``GenerationOutput`` out."""

    def __init__(self, client: InProcessRolloutClient) -> None:
        self.client = client

    def add_to(self, app: FastAPI) -> None:
        app.add_api_route("/generate", self.generate, methods=["POST"])
        app.add_api_route("/generate_many", self.generate_many, methods=["POST"])

    async def generate(self, req: GenerateRequest) -> Response:
        params = _token_sampling_params(req.sampling_params, "sampling_params")
        out = await _agenerate(self.client, req.prompt_ids, params, "prompt_ids", req.request_id)
        return _json_response(_output_dict(out))

    async def generate_many(self, req: GenerateManyRequest) -> dict:
        """One completion of ``prompt_ids`` per entry of ``sampling_params``, in order; every
        entry is validated before any is queued, and if one fails the others are aborted."""
        params = [_token_sampling_params(raw, f"sampling_params[{i}]") for i, raw in enumerate(req.sampling_params)]
        ids = req.request_ids or [None] * len(params)
        if len(ids) != len(params):
            raise _BadRequest("request_ids", f"request_ids: {len(ids)} ids for {len(params)} sampling_params")
        tasks = [
            asyncio.ensure_future(_agenerate(self.client, req.prompt_ids, p, "prompt_ids", rid))
            for p, rid in zip(params, ids)
        ]
        try:
            outs = await asyncio.gather(*tasks)
        finally:
            for task in tasks:  # on an error (or a dropped connection) abort the rest
                task.cancel()
        return _json_response({"outputs": [_output_dict(o) for o in outs]})


class _AdminRoutes:
    """``GET /health``, ``GET /version``, ``POST /pause``, ``POST /resume``, ``POST /abort``,
    ``POST /update_weights_from_disk``, ``GET /metrics``."""

    def __init__(self, engine: RolloutEngine, client: _ServedClient, watchdog: EngineWatchdog) -> None:
        self.engine, self.client, self.watchdog = engine, client, watchdog

    def add_to(self, app: FastAPI) -> None:
        app.add_api_route("/health", self.health, methods=["GET"], response_model=None)
        app.add_api_route("/version", self.version, methods=["GET"])
        app.add_api_route("/pause", self.pause, methods=["POST"])
        app.add_api_route("/resume", self.resume, methods=["POST"])
        app.add_api_route("/abort", self.abort, methods=["POST"])
        app.add_api_route("/update_weights_from_disk", self.update_weights_from_disk, methods=["POST"])
        app.add_api_route("/metrics", self.metrics, methods=["GET"])

    async def health(self) -> dict | JSONResponse:
        reason = self.watchdog.check()
        if reason is None:
            return {"status": "ok"}
        return JSONResponse(
            status_code=503,
            content={
                "status": "unhealthy",
                "reason": reason,
                "error": {"message": reason, "type": "engine_unhealthy", "param": None, "code": None},
            },
        )

    async def version(self) -> dict:
        return {"version": self.engine.version}

    async def pause(self) -> dict:
        await asyncio.to_thread(self.engine.pause)
        return {"paused": True}

    async def resume(self) -> dict:
        await asyncio.to_thread(self.engine.resume)
        self.client.wake()
        return {"paused": False}

    async def abort(self, req: AbortRequest) -> dict:
        try:
            out = await asyncio.to_thread(self.client.abort, req.request_id)
        except UnknownRequestError as e:
            raise _BadRequest("request_id", str(e), status=404) from None
        return dataclasses.asdict(out)

    async def update_weights_from_disk(self, req: UpdateFromDiskRequest) -> dict:
        try:  # a pickle, a truncated file or a missing shard: refused as a whole, never unpickled
            await asyncio.to_thread(self.engine.update_weights_from_disk, req.path, req.version)
        except WeightUpdateError as e:
            raise _BadRequest("path", str(e)) from None
        return {"version": self.engine.version}

    async def metrics(self) -> PlainTextResponse:
        lines = []
        for key, value in self.engine.stats().items():
            lines.append(f"# TYPE areno_{key} gauge")
            lines.append(f"areno_{key} {float(value)}")
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")


# ---------------------------------------------------------------------------------------- the CLI
ADMIN_ENDPOINTS = ("/pause", "/resume", "/abort", "/update_weights_from_disk")


def is_loopback(host: str) -> bool:
    """True for addresses only this machine reaches (127.0.0.0/8, ::1, localhost); a wildcard
    (0.0.0.0, ::) or any other name or address is treated as reachable from the network."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, api_key: str | None) -> None:
    """A one-line ValueError when ``host`` listens beyond loopback without an API key."""
    if not api_key and not is_loopback(host):
        raise ValueError(
            f"--host {host} listens beyond loopback, so the admin endpoints ({', '.join(ADMIN_ENDPOINTS)}) "
            f"need a key: pass --api-key KEY or set ARENO_API_KEY (or bind 127.0.0.1)"
        )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="areno serve", description="Serve a Hugging Face checkpoint with the areno rollout engine."
    )
    p.add_argument("model_dir", help="directory with config.json, *.safetensors and a tokenizer")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: local only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=os.environ.get("ARENO_API_KEY"),
        help="require 'Authorization: Bearer KEY' (env ARENO_API_KEY)",
    )
    p.add_argument(
        "--served-model-name", default=None, help="model id reported by /v1/models (default: the directory name)"
    )
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="default: bfloat16 on cuda, float32 on cpu",
    )
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-memory-fraction", type=float, default=0.8)
    p.add_argument("--default-max-tokens", type=int, default=16, help="max_tokens when a request omits it")
    p.add_argument(
        "--stall-timeout-s",
        type=float,
        default=300.0,
        help="/health answers 503 after this long without an engine step while requests are pending",
    )
    return p


def build_engine(
    model_dir: str, *, device: str | None = None, dtype: str | None = None, **engine_kw: Any
) -> tuple[RolloutEngine, Any]:
    """Load ``model_dir`` (weights + tokenizer) into a ``RolloutEngine``."""
    from transformers import AutoTokenizer  # about a second to import: only a server's start-up needs it

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    model, model_config = load_model(model_dir, dtype=getattr(torch, dtype), device=device)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = RolloutEngine(
        model,
        model_config,
        config=RolloutEngineConfig(**engine_kw),
        eos_token_ids=_eos_ids(model_dir, model_config, tokenizer),
        tokenizer=tokenizer,
    )
    return engine, tokenizer


def _eos_ids(model_dir: str, model_config: Any, tokenizer: Any) -> tuple[int, ...]:
    ids: list[int] = []

    def add(value: Any) -> None:
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if v is not None and v not in ids:
                ids.append(int(v))

    add(model_config.eos_token_id)
    gen_path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            add(json.load(f).get("eos_token_id"))
    add(getattr(tokenizer, "eos_token_id", None))
    return tuple(ids)


def main(argv: list[str] | None = None) -> int:
    """``areno serve MODEL_DIR [--host --port --api-key ...]``."""
    import uvicorn

    args = build_parser().parse_args(argv)
    try:
        check_bind(args.host, args.api_key)
        if not args.stall_timeout_s > 0:
            raise ValueError(f"--stall-timeout-s must be > 0, got {args.stall_timeout_s}")
        engine, tokenizer = build_engine(
            args.model_dir,
            device=args.device,
            dtype=args.dtype,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            block_size=args.block_size,
            kv_memory_fraction=args.kv_memory_fraction,
        )
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"areno serve: {e}")
        return 2
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model_dir))
    app = create_app(
        engine,
        tokenizer=tokenizer,
        model_name=name,
        api_key=args.api_key,
        default_max_tokens=args.default_max_tokens,
        stall_timeout_s=args.stall_timeout_s,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
