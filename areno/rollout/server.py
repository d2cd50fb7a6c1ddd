"""``areno serve MODEL_DIR``: the rollout engine behind an HTTP server.

Endpoints
- OpenAI-compatible: ``POST /v1/completions``, ``POST /v1/chat/completions`` (chat template from the
  tokenizer), ``GET /v1/models`` and ``/v1/models/{id}``. ``logprobs`` gives each sampled token's log-prob; top alternatives
  (completions' ``logprobs`` > 0, chat's ``top_logprobs`` > 0) are not computed, so asking for them is
  a 400. A field the server does not know is a 400 naming it (a misspelt ``temprature`` never samples
  at the default); OpenAI fields the engine cannot honour (``frequency_penalty``, ``presence_penalty``,
  ``logit_bias``, ``suffix``, ``best_of``, ``response_format``, ``tool_choice``, ...) are accepted only
  at their no-op value; ``user`` is accepted and changes nothing. Every choice also carries
  ``token_ids`` and ``prompt_token_ids`` so RL clients never re-tokenise. Besides OpenAI's fields both
  routes take vLLM's ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``stop_token_ids``
  and ``ignore_eos`` (``/generate``: ``SamplingParams``' names); the log-probs are of the
  temperature-scaled model distribution, before any of them (``rollout/sampling.py``).
- Token level: ``POST /generate`` ``{prompt_ids, sampling_params, request_id}`` → ``GenerationOutput``
  (what ``HTTPRolloutClient`` uses).
- Admin: ``GET /health`` (200 with ``paused``, or 503 with a reason when the engine's driver thread
  died or is stuck: see ``EngineWatchdog``), ``GET /version``, ``POST /pause``, ``POST /resume``,
  ``POST /abort`` ``{request_id}``, ``POST /update_weights_from_disk`` ``{path, version, names?}``
  (every parameter, or exactly the declared ``names``; never an older version), ``GET /metrics``
  (Prometheus text).

Security: it binds 127.0.0.1 unless ``--host`` says otherwise. With an API key every endpoint but
``/health`` needs ``Authorization: Bearer KEY`` (401 otherwise; compared in constant time). A server
that listens beyond loopback refuses to start without a key, since its admin endpoints (pause,
resume, abort, weight updates) would otherwise be open to the network. Weight updates read
safetensors only (never pickle). Bad input gets a 400 whose message names the field, in OpenAI's
error shape (404 for an unknown model); the server keeps serving. ``stream=true`` answers with
server-sent events in OpenAI's chunk shapes (``StreamedChoice``), ending with ``data: [DONE]``;
``stream_options.include_usage`` adds a last chunk with the usage (as OpenAI counts it: each prompt once
whatever ``n``, the completion tokens of every choice). Chat requests with ``tools`` are
refused: this endpoint neither renders nor parses tool calls (areno's agent client does).

Limits (``ServerLimits``): a body over ``max_body_bytes`` is a 413 before it is read; ``n``, prompts
per request and ``/generate_many`` entries are bounded; with ``max_queued``, requests beyond the
running batch plus that many get 429. Prompts are tokenized in a worker thread, after a length
check, so ``/health`` keeps answering; a client that disconnects has its generations aborted.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import difflib
import errno
import hmac
import ipaddress
import json
import logging
import os
import re
import socket
import threading
import time
import typing
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, TypeVar

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from areno.data.prompts import apply_template
from areno.data.tokenizer import load_pretrained_tokenizer
from areno.errors import ConfigError, ModelDirError, check_config, is_of_type, wrong_type
from areno.models.checkpoint_dirs import model_dir_of, newest_checkpoint
from areno.models.hf_io import load_model, read_config, stop_token_ids
from areno.models.vision import ImageInputs
from areno.observe.metrics import METRICS_FILENAME
from areno.observe.startup import process_age_s
from areno.rollout.client import InProcessRolloutClient, RolloutRequestTimeout, TokenStream
from areno.rollout.config import RolloutEngineSettings
from areno.rollout.engine import RolloutEngine, RolloutEngineConfig, UnknownRequestError, WeightUpdateError
from areno.rollout.requests import routes_to_json
from areno.rollout.wire import encode_arrays
from areno.types import MAX_SEED, MIN_TEMPERATURE, GenerationOutput, SamplingParams

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------- request bodies


def _temperature(value: float) -> float:
    if 0 < value < MIN_TEMPERATURE:
        raise ValueError(f"must be 0 (greedy) or >= {MIN_TEMPERATURE:g}, got {value:g}")
    return value


Temperature = Annotated[float, Field(ge=0, allow_inf_nan=False), AfterValidator(_temperature)]
TopP = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]
TopK = Annotated[int, Field(ge=-1)]
MinP = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
RepetitionPenalty = Annotated[float, Field(gt=0, allow_inf_nan=False)]
Seed = Annotated[int, Field(ge=-MAX_SEED, le=MAX_SEED)]
TokenId = Annotated[int, Field(ge=0)]


class StreamOptions(BaseModel):
    """``stream_options``: OpenAI's ``include_usage`` (a last chunk with the usage) and
    ``include_obfuscation`` (OpenAI pads its stream events against side channels; accepted, and a
    no-op here)."""

    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    include_obfuscation: bool = True


class _Sampling(BaseModel):
    """The fields both OpenAI routes take. A field this server does not know is a 400 naming it
    (``extra="forbid"``), as OpenAI refuses one: a misspelt ``temprature`` must not sample at 1.
    OpenAI fields this engine cannot honour are accepted only at their no-op value (``NO_OP``)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    max_tokens: int | None = Field(default=None, description="new tokens; > 0")
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = -1
    min_p: MinP = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    n: int = Field(default=1, ge=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    """An end-user id the caller's records keep (OpenAI's abuse monitoring); changes no output."""
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    NO_OP: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = {
        "frequency_penalty": (
            (None, 0),
            "this engine samples without penalties but repetition_penalty (vLLM's field, which it takes): send 0 "
            "or drop it",
        ),
        "presence_penalty": (
            (None, 0),
            "this engine samples without penalties but repetition_penalty (vLLM's field, which it takes): send 0 "
            "or drop it",
        ),
        "logit_bias": ((None, {}), "this engine samples without logit biases: drop it"),
    }
    """Fields accepted only at these values (what the engine does anyway), with why another is refused."""

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

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
                min_p=self.min_p,
                repetition_penalty=self.repetition_penalty,
                min_new_tokens=self.min_tokens,
                max_new_tokens=max_tokens,
                stop_token_ids=tuple(self.stop_token_ids or ()),
                stop=stop,
                ignore_eos=self.ignore_eos,
                seed=None if self.seed is None else self.seed + index,
            )
        except ValueError as e:
            raise _BadRequest(_param_of(str(e)), str(e)) from None

    def check(self, model_name: str, limits: ServerLimits) -> None:
        """What the field types cannot say: the model served, ``n`` within the server's limit,
        per-choice seeds (``seed + i``) within range."""
        if self.model is not None and self.model != model_name:
            raise _BadRequest(
                "model",
                f"model {self.model!r} does not exist: this server serves {model_name!r}",
                404,
                "model_not_found",
            )
        if self.stream_options is not None and not self.stream:
            raise _BadRequest("stream_options", "stream_options applies to stream=true only: drop it or stream")
        for field, (allowed, why) in self.NO_OP.items():
            value = getattr(self, field)
            if value not in allowed:
                raise _BadRequest(field, f"{field} {json.dumps(value)} is not supported: {why}")
        if self.n > limits.max_n:
            raise _BadRequest("n", f"n must be <= {limits.max_n} (this server's max_n), got {self.n}")
        if self.seed is not None and self.seed + self.n - 1 > MAX_SEED:
            raise _BadRequest("seed", f"seed + n - 1 must be <= {MAX_SEED}, got seed {self.seed} with n {self.n}")


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]  # token ids checked by the engine
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    """0: each sampled token's log-prob; more (top alternatives) is refused: the engine computes none."""
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    NO_OP = {
        **_Sampling.NO_OP,
        "suffix": ((None, ""), "this server does not insert text before a suffix: drop it"),
    }

    def check(self, model_name: str, limits: ServerLimits) -> None:
        super().check(model_name, limits)
        if self.logprobs:
            raise _BadRequest(
                "logprobs",
                f"logprobs {self.logprobs} asks for the top alternatives of each token, which this engine does not "
                "compute: send logprobs 0 for each sampled token's log-prob",
            )
        if self.best_of is not None and self.best_of != self.n:
            raise _BadRequest(
                "best_of",
                f"best_of {self.best_of} is not supported (it would rank extra samples server-side): drop it, or "
                f"sample n={self.best_of} and rank them yourself",
            )


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | None = ""


_NO_TOOLS = "this endpoint serves no tools (see 'tools')"


class ChatRequest(_Sampling):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    """0 or unset: the top alternatives, which this engine does not compute, are refused."""
    max_completion_tokens: int | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    function_call: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    """The chat template's own variables (vLLM's field), e.g. ``{"enable_thinking": false}`` for Qwen3."""

    NO_OP = {
        **_Sampling.NO_OP,
        "tool_choice": ((None, "none"), f"{_NO_TOOLS}: send 'none' or drop it"),
        "function_call": ((None, "none"), f"{_NO_TOOLS}: send 'none' or drop it"),
        "parallel_tool_calls": ((None,), f"{_NO_TOOLS}: drop it"),
        "response_format": (
            (None, {"type": "text"}),
            'this engine does not constrain its output to JSON: send {"type": "text"} or drop it',
        ),
    }

    def check(self, model_name: str, limits: ServerLimits) -> None:
        for field in ("tools", "functions"):  # before tool_choice & co., which name them
            if getattr(self, field):
                raise _BadRequest(
                    field,
                    f"{field}: this endpoint neither renders tools into the prompt nor parses tool calls (it would "
                    "ignore them): describe them in the messages, or use areno's agent client (ArenoAsyncOpenAI, "
                    "AgentProxy), which does both",
                )
        super().check(model_name, limits)
        if self.top_logprobs:
            raise _BadRequest(
                "top_logprobs",
                f"top_logprobs {self.top_logprobs} asks for the top alternatives of each token, which this engine "
                "does not compute: drop it (logprobs=true gives each sampled token's log-prob)",
            )


class TokenSampling(BaseModel):
    """``SamplingParams`` as ``/generate`` receives it: every field typed and bounded, unknown keys refused."""

    model_config = ConfigDict(extra="forbid")
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = -1
    min_p: MinP = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    min_new_tokens: int = Field(default=0, ge=0)
    max_new_tokens: int = Field(default=128, gt=0)
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    stop: list[str] = Field(default_factory=list)
    ignore_eos: bool = False
    seed: Seed | None = None
    detokenize: bool = True


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt_ids: list[int]
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    request_id: str | None = None
    images: dict[str, Any] | None = None
    """A vision-language prompt's pixels (``ImageInputs.to_wire``)."""
    token_encoding: Literal["list", "base64"] = "list"
    """How token ids, versions and log-probs come back (``wire.py``)."""


class GenerateManyRequest(BaseModel):
    """Several completions of one prompt (a GRPO group) in one request."""

    model_config = ConfigDict(extra="forbid")

    prompt_ids: list[int]
    sampling_params: list[dict[str, Any]] = Field(min_length=1)
    request_ids: list[str] | None = None
    images: dict[str, Any] | None = None
    """The group's images, sent once (``ImageInputs.to_wire``)."""
    token_encoding: Literal["list", "base64"] = "list"
    """How token ids, versions and log-probs come back (``wire.py``)."""


class AbortRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    request_id: str


class UpdateFromDiskRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str
    version: int = Field(ge=0)
    names: list[str] | None = None
    """The tensors the file updates when it holds only some (a declared subset); None: every
    parameter of the model must be in it."""


_BODY_FIELDS: dict[tuple[str, ...], list[str]] = {
    (path, *nested): list(model.model_fields)
    for path, nested, model in [
        ("/v1/completions", (), CompletionRequest),
        ("/v1/completions", ("stream_options",), StreamOptions),
        ("/v1/chat/completions", (), ChatRequest),
        ("/v1/chat/completions", ("stream_options",), StreamOptions),
        ("/generate", (), GenerateRequest),
        ("/generate_many", (), GenerateManyRequest),
        ("/abort", (), AbortRequest),
        ("/update_weights_from_disk", (), UpdateFromDiskRequest),
    ]
}
"""(route, nested field...) -> the fields its body takes there: the "did you mean" of an unknown one."""


@dataclasses.dataclass(kw_only=True, frozen=True)
class ServerLimits:
    """What one request, and all of them together, may ask of a server."""

    max_body_bytes: int = 4 * 2**20
    """Largest request body; a larger one is refused with 413 before it is read."""
    max_n: int = 128
    """Largest ``n`` (completions per prompt) of an OpenAI request."""
    max_prompts: int = 64
    """Most prompts in one ``/v1/completions`` request."""
    max_group: int = 1024
    """Most entries of one ``/generate_many`` request."""
    max_queued: int | None = None
    """Most requests waiting beyond the engine's running batch (``max_num_seqs``); more get 429.
    None: no bound (a trainer's own servers, whose clients bound their concurrency)."""

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_n", "max_prompts", "max_group"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_queued is not None and self.max_queued < 0:
            raise ConfigError(f"max_queued must be >= 0 or None, got {self.max_queued}")


class _BadRequest(Exception):
    def __init__(self, param: str | None, message: str, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.message, self.status, self.code = param, message, status, code


class _BodyTooLarge(HTTPException):
    """A chunked body that grew past the limit while it was read (an ``HTTPException``, so FastAPI's
    body parsing passes it on rather than calling it a parse error)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body exceeds {limit} bytes (this server's max_body_bytes)")


def _engine_error(exc: BaseException) -> _BadRequest:
    """A 500 naming the engine's exception (the full traceback is in the server log)."""
    logger.error("rollout engine failed a request: %s: %s", type(exc).__name__, exc)
    return _BadRequest(None, f"the rollout engine failed: {type(exc).__name__}: {exc}", status=500)


_SAMPLING_FIELDS = {
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_new_tokens",
    "max_new_tokens",
    "seed",
    "stop",
}


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


def _output_dict(out: GenerationOutput, token_encoding: str = "list") -> dict[str, Any]:
    """A generation's fields as they are (lists of ints / floats, no copies): ``dataclasses.asdict``
    deep-copies every list element by element in Python, ~20 ms for a GRPO group of 8 x 384 tokens.
    ``token_encoding="base64"``: the token-level lists as arrays (``wire.encode_arrays``)."""
    fields = {name: getattr(out, name) for name in _OUTPUT_FIELDS}
    fields["routes_TLK"] = routes_to_json(out.routes_TLK)
    return encode_arrays(fields) if token_encoding == "base64" else fields


def _json_response(content: dict[str, Any]) -> Response:
    """Token-level results encoded with ``json.dumps`` straight to bytes: FastAPI's response-model
    validation and ``jsonable_encoder`` walk each of the thousands of values of a group in Python
    (about 4x the time), and they run in the rollout worker's process, holding the GIL the engine's
    driver thread needs between decode steps."""
    return Response(
        json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")), media_type="application/json"
    )


def _error_body(message: str, param: str | None, kind: str, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _error(
    status: int,
    message: str,
    param: str | None = None,
    kind: str = "invalid_request_error",
    code: str | None = None,
) -> JSONResponse:
    return JSONResponse(status_code=status, content=_error_body(message, param, kind, code))


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
    limits: ServerLimits | None = None,
) -> FastAPI:
    """The FastAPI app serving ``engine`` (one ``InProcessRolloutClient`` drives it).

    ``stall_timeout_s``: ``/health`` answers 503 once the engine took no step for this long while
    requests are pending (``EngineWatchdog``); keep it above the slowest single step.
    ``limits``: body size, ``n``, prompts and group entries per request, the waiting queue.
    """
    limits = limits or ServerLimits()
    client = _ServedClient(engine)
    admission = _Admission(client, engine.config.max_num_seqs, limits.max_queued)
    watchdog = EngineWatchdog(engine, client, stall_timeout_s=stall_timeout_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await client.aclose()

    app = FastAPI(title="areno rollout server", lifespan=lifespan)
    app.state.client = client
    app.state.watchdog = watchdog
    app.add_middleware(_Gate, api_key=api_key, max_body_bytes=limits.max_body_bytes)
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_exception_handler(_BadRequest, _bad_request)
    app.add_exception_handler(HTTPException, _http_error)
    _OpenAIRoutes(admission, tokenizer, model_name, default_max_tokens, limits, engine.max_model_len).add_to(app)
    _TokenRoutes(admission, limits).add_to(app)
    _AdminRoutes(engine, client, watchdog).add_to(app)
    return app


class _Gate:
    """ASGI middleware in front of every route: the API key (with one, every endpoint but
    ``/health`` needs ``Authorization: Bearer <api_key>``, compared in constant time; 401 otherwise)
    and the body limit (413 from ``Content-Length`` before any byte is read; a chunked body is
    counted as it arrives). Plain ASGI rather than ``BaseHTTPMiddleware``, so routes see the
    server's own ``receive`` and can wait on it for the client's disconnect."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int) -> None:
        self.app, self.max_body_bytes = app, max_body_bytes
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.expected is not None and scope["path"] != "/health":
            if not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
                message = "missing or wrong API key: send 'Authorization: Bearer <key>'"
                return await _send_error(send, 401, message, None, "authentication_error")
        declared = headers.get(b"content-length", b"0")
        limit = self.max_body_bytes
        if not declared.isdigit() or int(declared) > limit:
            message = f"request body of {declared.decode(errors='replace')} bytes exceeds {limit} (max_body_bytes)"
            return await _send_error(send, 413, message, "body", "invalid_request_error")
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > limit:
                raise _BodyTooLarge(limit)
            return message

        await self.app(scope, counted, send)


async def _send_error(send: Send, status: int, message: str, param: str | None, kind: str) -> None:
    body = json.dumps(_error_body(message, param, kind, None)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    """A 400 naming the first invalid field as the request spells it."""
    errors = exc.errors()
    err = errors[0]
    if err.get("type") == "json_invalid":
        return _error(400, f"request body is not valid JSON: {err.get('msg')}", "body")
    loc = _field_loc(err.get("loc", ()))
    field = ".".join(loc) or "body"
    if err.get("type") == "extra_forbidden":  # as OpenAI answers one: refused, never ignored
        known = _BODY_FIELDS.get((request.url.path, *loc[:-1]), ())
        close = difflib.get_close_matches(loc[-1], known, n=1, cutoff=0.75)
        hint = f" (did you mean '{'.'.join([*loc[:-1], close[0]])}'?)" if close else ""
        message = f"unrecognized request argument '{field}'{hint}: fields this server does not know are refused"
        return _error(400, message, field)
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
    return _error(exc.status, exc.message, exc.param, code=exc.code)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own errors (unknown path, wrong method, a body FastAPI could not decode, such as
    non-UTF-8 bytes) in OpenAI's shape, not ``{"detail": ...}``."""
    param = "body" if exc.status_code in (400, 413) else None
    return _error(exc.status_code, str(exc.detail), param)


async def _agenerate(
    client: InProcessRolloutClient,
    prompt_ids: list[int],
    params: SamplingParams,
    field: str,
    request_id: str | None = None,
    images: ImageInputs | None = None,
) -> GenerationOutput:
    """One completion; a request the engine rejects is a 400 naming ``field``, an engine failure a 500."""
    try:
        return await client.agenerate(prompt_ids, params, request_id=request_id, images=images)
    except ValueError as e:
        raise _BadRequest(field, f"{field}: {e}") from None
    except RolloutRequestTimeout:
        raise
    except Exception as e:  # noqa: BLE001 - the engine failed: a 500 that says why
        raise _engine_error(e) from None


_T = TypeVar("_T")


class _Admission:
    """Admits a request's generations into the engine: 429 when the waiting queue is full, and
    every generation cancelled (so aborted in the engine) when the client disconnects first."""

    def __init__(self, client: InProcessRolloutClient, running: int, max_queued: int | None) -> None:
        self.client = client
        self.capacity = None if max_queued is None else running + max_queued

    def reserve(self, count: int) -> None:
        """429 when ``count`` more requests would queue beyond the limit (checked before any is added)."""
        if self.capacity is not None and self.client.num_pending + count > self.capacity:
            raise _BadRequest(
                None,
                f"the server is at capacity ({self.client.num_pending} requests in the engine, room for "
                f"{self.capacity}): retry later",
                status=429,
                code="rate_limit_exceeded",
            )

    async def agenerate(
        self,
        request: Request,
        jobs: list[tuple[list[int], SamplingParams, str | None]],
        field: str,
        images: ImageInputs | None = None,
    ) -> list[GenerationOutput]:
        """One completion per ``(prompt_ids, params, request_id)``, in order (each with ``images``);
        if one fails, or the client goes away, the others are cancelled, which aborts them in the engine."""
        self.reserve(len(jobs))
        tasks = [asyncio.ensure_future(_agenerate(self.client, p, sp, field, rid, images)) for p, sp, rid in jobs]
        try:
            return await _unless_disconnected(request, asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()


async def _unless_disconnected(request: Request, work: Awaitable[_T]) -> _T:
    """``await work``, cancelling it when the client disconnects first (a 499 nobody reads)."""
    work_future = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait((work_future, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work_future.done():
            work_future.cancel()
    if not work_future.done() or work_future.cancelled():
        raise _BadRequest(None, "the client disconnected; its requests were aborted", status=499)
    return work_future.result()


async def _disconnect(request: Request) -> None:
    """Returns when the client disconnects: after the body, the server's next message is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _usage(prompt_tokens: int, outs: list[GenerationOutput]) -> dict[str, int]:
    """OpenAI's ``usage``: ``prompt_tokens`` counts each prompt of the request once, however many
    choices (``n``) it has; ``completion_tokens`` sums every choice's tokens."""
    completion = sum(len(o.output_ids) for o in outs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class StreamedChoice:
    """What one streamed choice has sent. Its text is decoded incrementally (only the tokens since
    the last settled point, as a character may need several tokens' bytes: while the newest decodes
    as U+FFFD the text waits), and sent only as far as it cannot change: a stop string may still end
    the completion within its last ``len(stop) - 1`` characters, so those wait for the next tokens
    or the end. ``echo``: text sent before the completion."""

    def __init__(self, index: int, prompt_ids: list[int], params: SamplingParams, echo: str = "") -> None:
        self.index, self.prompt_ids, self.echo = index, prompt_ids, echo
        self.hold = max((len(s) for s in params.stop), default=1) - 1
        self.first = True
        self.text = ""
        """The completion's text sent so far (echo not included)."""
        self.decoded = ""
        """The completion's text decoded so far (``text`` and what is held back)."""
        self.tokens = 0
        """Tokens sent (their ids and log-probs)."""
        self._prefix, self._read = 0, 0  # tokens before _prefix are settled; _prefix.._read decoded as context
        self.token_chars = 0
        """Characters of the sent tokens' own texts (``/v1/completions`` log-probs' ``text_offset``)."""

    def advance(
        self, decode: Any, ids: list[int], logprobs: list[float], final: GenerationOutput | None
    ) -> tuple[str, list[int], list[float]]:
        """``(text to send, new token ids, their log-probs)`` given the tokens so far (``final``:
        the finished output, whose text the engine decoded whole and cut at a stop string)."""
        if final is not None:
            settled = final.text
        else:
            context = decode(ids[self._prefix : self._read])
            window = decode(ids[self._prefix :])
            if len(window) > len(context) and not window.endswith("\ufffd"):
                self.decoded += window[len(context) :]
                self._prefix, self._read = self._read, len(ids)
            settled = self.decoded[: max(len(self.decoded) - self.hold, 0)]
        new = settled[len(self.text) :] if len(settled) > len(self.text) else ""
        self.text += new
        if self.first:
            new = self.echo + new
        new_ids, new_lps = ids[self.tokens :], logprobs[self.tokens :]
        self.tokens = len(ids)
        return new, new_ids, new_lps


class _OpenAIRoutes:
    """``GET /v1/models`` (and one by id), ``POST /v1/completions``, ``POST /v1/chat/completions``."""

    def __init__(
        self,
        admission: _Admission,
        tokenizer: Any,
        model_name: str,
        default_max_tokens: int,
        limits: ServerLimits,
        max_model_len: int,
    ) -> None:
        self.admission, self.tokenizer = admission, tokenizer
        self.model_name, self.default_max_tokens = model_name, default_max_tokens
        self.limits = limits
        # a prompt of more characters than this holds at least max_model_len tokens, whatever
        # they are: refused before the tokenizer spends time (and memory) on it
        longest = max((len(t) for t in tokenizer.get_vocab()), default=1) if tokenizer is not None else 1
        self.max_prompt_chars = (max_model_len - 1) * max(longest, 1)

    def add_to(self, app: FastAPI) -> None:
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/models/{model_id:path}", self.model, methods=["GET"], response_model=None)
        app.add_api_route("/v1/completions", self.completions, methods=["POST"], response_model=None)
        app.add_api_route("/v1/chat/completions", self.chat, methods=["POST"], response_model=None)

    def _check_chars(self, chars: int, field: str) -> None:
        if chars > self.max_prompt_chars:
            raise _BadRequest(
                field,
                f"{field} is too long: {chars} characters cannot fit the context (at most "
                f"{self.max_prompt_chars} characters); shorten the prompt",
            )

    async def _aencode(self, texts: list[str]) -> list[list[int]]:
        """Tokenized in a worker thread: a long prompt must not hold up ``/health`` and other requests."""
        if self.tokenizer is None:
            raise _BadRequest("prompt", "this server has no tokenizer: send token ids")
        for text in texts:
            self._check_chars(len(text), "prompt")
        return await asyncio.to_thread(lambda: [list(self.tokenizer(t)["input_ids"]) for t in texts])

    def _decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)

    async def models(self) -> dict:
        return {"object": "list", "data": [self._model_card()]}

    async def model(self, model_id: str) -> dict | JSONResponse:
        """``client.models.retrieve(id)``: the served model, else OpenAI's 404."""
        if model_id != self.model_name:
            return _error(
                404, f"model {model_id!r} does not exist: this server serves {self.model_name!r}", "model",
                code="model_not_found",
            )  # fmt: skip
        return self._model_card()

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "owned_by": "areno", "created": 0}

    async def completions(self, req: CompletionRequest, request: Request) -> dict | StreamingResponse:
        req.check(self.model_name, self.limits)
        if req.echo and req.logprobs is not None:
            raise _BadRequest(
                "echo", "echo with logprobs needs the prompt's log-probs, which this server does not compute: drop one"
            )
        batch = req.prompt
        if isinstance(batch, str) or not batch or isinstance(batch[0], int):
            batch = [batch]  # one prompt
        if len(batch) > self.limits.max_prompts:
            raise _BadRequest(
                "prompt", f"prompt holds {len(batch)} prompts; at most {self.limits.max_prompts} (max_prompts)"
            )
        texts = batch if isinstance(batch[0], str) else None
        prompts = await self._aencode(texts) if texts is not None else [list(p) for p in batch]
        if any(len(p) == 0 for p in prompts):
            raise _BadRequest("prompt", "prompt is empty: send at least one token")
        jobs = [(p, req.sampling_params(self.default_max_tokens, i), None) for p in prompts for i in range(req.n)]
        # echo: the prompt's text (as sent, or its token ids decoded) before each choice's completion
        echoes = [""] * len(jobs)
        if req.echo:
            prompt_texts = texts if texts is not None else [self._decode(p, special=True) for p in prompts]
            echoes = [t for t in prompt_texts for _ in range(req.n)]
        prompt_tokens = sum(len(p) for p in prompts)
        if req.stream:
            return self._stream(request, req, jobs, "prompt", "cmpl", echoes, prompt_tokens)
        outs = await self.admission.agenerate(request, jobs, "prompt")
        choices = [
            self._completion_choice(index, prompt_ids, out, req.logprobs is not None, echoes[index])
            for index, ((prompt_ids, _, _), out) in enumerate(zip(jobs, outs))
        ]
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": _usage(prompt_tokens, outs),
        }

    def _decode(self, ids: list[int], *, special: bool = False) -> str:
        """Text of ``ids`` (a completion's without special tokens, as the engine decodes it)."""
        return self.tokenizer.decode(ids, skip_special_tokens=not special) if self.tokenizer is not None else ""

    def _completion_choice(
        self, index: int, prompt_ids: list[int], out: GenerationOutput, logprobs: bool, echo: str = ""
    ) -> dict[str, Any]:
        return {
            "index": index,
            "text": echo + out.text,
            "finish_reason": out.finish_reason,
            "logprobs": self._completion_logprobs(out.output_ids, out.output_logprobs) if logprobs else None,
            "token_ids": out.output_ids,
            "prompt_token_ids": prompt_ids,
        }

    def _completion_logprobs(self, ids: list[int], logprobs: list[float], offset: int = 0) -> dict[str, Any]:
        """``/v1/completions`` log-probs of ``ids``, whose text starts ``offset`` characters into the completion."""
        tokens = [self._decode_token(t) for t in ids]
        offsets, pos = [], offset
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": logprobs,
            "top_logprobs": [{} for _ in tokens],  # logprobs 0: no alternatives asked (more is a 400)
            "text_offset": offsets,
        }

    async def chat(self, req: ChatRequest, request: Request) -> dict | StreamingResponse:
        req.check(self.model_name, self.limits)
        tokenizer = self.tokenizer
        if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
            raise _BadRequest("messages", "this server's tokenizer has no chat template: use /v1/completions")
        if not req.messages:
            raise _BadRequest("messages", "messages is empty: send at least one message")
        if req.max_completion_tokens is not None:  # OpenAI's name for it now, max_tokens the deprecated one
            if req.max_completion_tokens <= 0:
                raise _BadRequest(
                    "max_completion_tokens", f"max_completion_tokens must be > 0, got {req.max_completion_tokens}"
                )
            req.max_tokens = req.max_completion_tokens
        self._check_chars(sum(len(m.content or "") for m in req.messages), "messages")
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        # training's template renderer (areno.data.prompts, as data.chat_template=always): a chat is templated
        try:
            prompt_ids = await asyncio.to_thread(
                apply_template, tokenizer, messages, **(req.chat_template_kwargs or {})
            )
        except Exception as exc:  # noqa: BLE001 - jinja's TemplateError, or whatever the template raises
            raise _BadRequest(
                "messages", f"the chat template fails on these messages ({type(exc).__name__}: {exc})"
            ) from None
        jobs = [(prompt_ids, req.sampling_params(self.default_max_tokens, i), None) for i in range(req.n)]
        if req.stream:
            return self._stream(request, req, jobs, "messages", "chatcmpl", [""] * len(jobs), len(prompt_ids))
        outs = await self.admission.agenerate(request, jobs, "messages")
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
            "model": self.model_name,
            "choices": choices,
            "usage": _usage(len(prompt_ids), outs),
        }

    def _chat_logprobs(self, out: GenerationOutput) -> dict[str, Any]:
        return self._chat_token_logprobs(out.output_ids, out.output_logprobs)

    def _chat_token_logprobs(self, ids: list[int], logprobs: list[float]) -> dict[str, Any]:
        content = []
        for t, lp in zip(ids, logprobs):
            s = self._decode_token(t)
            # top_logprobs 0 or unset: no alternatives asked (more is a 400)
            content.append({"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []})
        return {"content": content}

    # ------------------------------------------------------------------ streaming
    def _stream(
        self,
        request: Request,
        req: CompletionRequest | ChatRequest,
        jobs: list[tuple[list[int], SamplingParams, str | None]],
        field: str,
        id_prefix: str,
        echoes: list[str],
        prompt_tokens: int,
    ) -> StreamingResponse:
        """Server-sent events of ``jobs`` (one choice each, by index): every request enters the
        engine before the response starts, so a refused one is still a 400; a client that goes away
        has them all aborted. ``prompt_tokens``: the request's prompts' tokens, each prompt once
        (the usage chunk's count)."""
        self.admission.reserve(len(jobs))
        streams: list[TokenStream] = []
        try:
            for prompt_ids, params, request_id in jobs:
                streams.append(self.admission.client.stream(prompt_ids, params, request_id=request_id))
        except ValueError as e:
            for stream in streams:
                stream.close()
            raise _BadRequest(field, f"{field}: {e}") from None
        chat = isinstance(req, ChatRequest)
        head = {
            "id": f"{id_prefix}-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
        }
        choices = [
            StreamedChoice(index, prompt_ids, params, echoes[index])
            for index, (prompt_ids, params, _) in enumerate(jobs)
        ]
        logprobs = bool(req.logprobs) if chat else req.logprobs is not None

        def chunk(choice: StreamedChoice, ids: list[int], lps: list[float], final: GenerationOutput | None) -> str:
            text, new_ids, new_lps = choice.advance(self._decode, ids, lps, final)
            entry: dict[str, Any] = {"index": choice.index}
            if chat:
                if choice.first:
                    entry["delta"] = {"role": "assistant", "content": text}
                else:
                    entry["delta"] = {"content": text} if text or final is None else {}
                entry["logprobs"] = self._chat_token_logprobs(new_ids, new_lps) if logprobs else None
            else:
                entry["text"] = text
                entry["logprobs"] = None
                if logprobs:
                    entry["logprobs"] = self._completion_logprobs(new_ids, new_lps, choice.token_chars)
                    choice.token_chars += sum(len(t) for t in entry["logprobs"]["tokens"])
            entry["finish_reason"] = final.finish_reason if final is not None else None
            entry["token_ids"] = new_ids
            if choice.first:
                entry["prompt_token_ids"] = choice.prompt_ids
                choice.first = False
            return _sse({**head, "choices": [entry]})

        async def events() -> AsyncIterator[str]:
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(choice: StreamedChoice, stream: TokenStream) -> None:
                try:
                    async for event in stream:
                        await queue.put((choice, event))
                except Exception as exc:  # noqa: BLE001 - told to the client in an error event
                    await queue.put((choice, exc))

            tasks = [asyncio.ensure_future(pump(c, st)) for c, st in zip(choices, streams)]
            outs: list[GenerationOutput] = []
            try:
                while len(outs) < len(choices):
                    choice, event = await queue.get()
                    if isinstance(event, BaseException):
                        error = event if isinstance(event, RolloutRequestTimeout) else _engine_error(event)
                        yield _sse(_error_body(str(error), None, "server_error", None))
                        return
                    if isinstance(event, GenerationOutput):
                        outs.append(event)
                        yield chunk(choice, event.output_ids, event.output_logprobs, event)
                    else:
                        yield chunk(choice, *event, None)
                if req.include_usage:
                    yield _sse({**head, "choices": [], "usage": _usage(prompt_tokens, outs)})
                yield "data: [DONE]\n\n"
            finally:  # the client left (the response was cancelled) or a request failed: abort the rest
                for task in tasks:
                    task.cancel()
                for stream in streams:
                    stream.close()

        return StreamingResponse(events(), media_type="text/event-stream")


def _token_sampling_params(raw: dict[str, Any], field: str) -> SamplingParams:
    """``SamplingParams`` from a request's dict, validated as ``TokenSampling``: a 400 whose param is
    ``field`` (``field.key`` for an unknown key) and whose message names the key."""
    try:
        valid = TokenSampling.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(x) for x in err["loc"])
        if err["type"] == "extra_forbidden":
            raise _BadRequest(f"{field}.{key}", f"{field}: unknown parameter {key!r}") from None
        raise _BadRequest(field, f"{field}: invalid {key!r}: {err['msg']}") from None
    try:
        return SamplingParams(**valid.model_dump())
    except ValueError as e:
        raise _BadRequest(field, f"{field}: {e}") from None


def _images(wire: dict[str, Any] | None) -> ImageInputs | None:
    """A request's ``images`` field decoded (a 400 naming it when it does not decode)."""
    if wire is None:
        return None
    try:
        return ImageInputs.from_wire(wire)
    except ValueError as e:
        raise _BadRequest("images", str(e)) from None


class _TokenRoutes:
    """``POST /generate`` and ``POST /generate_many``: token ids in, ``GenerationOutput`` out."""

    def __init__(self, admission: _Admission, limits: ServerLimits) -> None:
        self.admission, self.limits = admission, limits

    def add_to(self, app: FastAPI) -> None:
        app.add_api_route("/generate", self.generate, methods=["POST"])
        app.add_api_route("/generate_many", self.generate_many, methods=["POST"])

    async def generate(self, req: GenerateRequest, request: Request) -> Response:
        params = _token_sampling_params(req.sampling_params, "sampling_params")
        job = (req.prompt_ids, params, req.request_id)
        (out,) = await self.admission.agenerate(request, [job], "prompt_ids", _images(req.images))
        return _json_response(_output_dict(out, req.token_encoding))

    async def generate_many(self, req: GenerateManyRequest, request: Request) -> Response:
        """One completion of ``prompt_ids`` per entry of ``sampling_params``, in order; every
        entry is validated before any is queued, and if one fails the others are aborted."""
        if len(req.sampling_params) > self.limits.max_group:
            raise _BadRequest(
                "sampling_params",
                f"sampling_params has {len(req.sampling_params)} entries; at most {self.limits.max_group} (max_group)",
            )
        params = [_token_sampling_params(raw, f"sampling_params[{i}]") for i, raw in enumerate(req.sampling_params)]
        ids = req.request_ids or [None] * len(params)
        if len(ids) != len(params):
            raise _BadRequest("request_ids", f"request_ids: {len(ids)} ids for {len(params)} sampling_params")
        jobs = [(req.prompt_ids, p, rid) for p, rid in zip(params, ids)]
        outs = await self.admission.agenerate(request, jobs, "prompt_ids", _images(req.images))
        return _json_response({"outputs": [_output_dict(o, req.token_encoding) for o in outs]})


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
        if reason is None:  # a paused engine is healthy but generates nothing until /resume
            return {"status": "ok", "paused": self.engine.is_paused}
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
        return _output_dict(out)  # routes (a tensor) as JSON

    async def update_weights_from_disk(self, req: UpdateFromDiskRequest) -> dict:
        if req.version < self.engine.version:
            raise _BadRequest(
                "version",
                f"version {req.version} is older than the served version {self.engine.version}: versions only move forward",
                status=409,
            )
        try:  # a pickle, a truncated file, a missing shard or tensor: refused as a whole, never unpickled
            await asyncio.to_thread(self.engine.update_weights_from_disk, req.path, req.version, names=req.names)
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


class ServerThread:
    """An ASGI app served by uvicorn from a daemon thread: ``start()`` returns once it listens (port 0
    takes a free one); ``stop()`` ends it. The agent proxy, the benchmarks and the tests serve this way."""

    def __init__(
        self, app: Any, *, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning", name: str = "areno-http"
    ) -> None:
        self.app, self.host, self.port, self.log_level, self.name = app, host, port, log_level, name
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> ServerThread:
        if self.port == 0:
            with socket.socket() as s:
                s.bind((self.host, 0))
                self.port = s.getsockname()[1]
        config = uvicorn.Config(self.app, host=self.host, port=self.port, log_level=self.log_level)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name=self.name, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"{self.name} did not start on {self.base_url}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            assert self._thread is not None
            self._thread.join(timeout=10)
            self._server = None


def check_bind(host: str, api_key: str | None) -> None:
    """A one-line ConfigError when ``host`` listens beyond loopback without an API key."""
    if not api_key and not is_loopback(host):
        raise ConfigError(
            f"--host {host} listens beyond loopback, so the admin endpoints ({', '.join(ADMIN_ENDPOINTS)}) "
            f"need a key: pass --api-key KEY or set ARENO_API_KEY (or bind 127.0.0.1)"
        )


def served_name(model_dir: str) -> str:
    """The model id a server answers to by default: the directory's name, or ``step_N`` for a run's
    checkpoint export (``checkpoints/step_N/hf``, whose name is the same for every step)."""
    path = os.path.normpath(model_dir)
    name, parent = os.path.basename(path), os.path.basename(os.path.dirname(path))
    return parent if name == "hf" and parent.startswith("step_") else name


def serve_model_dir(model_dir: str) -> str:
    """The directory ``areno serve MODEL_DIR`` loads: a Hugging Face directory as given, a run's
    checkpoint ``step_N`` as its ``hf/`` export (``areno eval --checkpoint`` reads paths alike). A run
    directory, or a directory inside a checkpoint (its LoRA adapter), is a one-line ModelDirError
    naming the checkpoint to pass: a server does not pick a step for the user."""
    path = Path(model_dir)
    if not path.is_dir():
        return model_dir  # build_engine names it as MODEL_DIR
    named = model_dir_of(path, "MODEL_DIR")
    if named is not None:
        return str(named[0])
    newest = newest_checkpoint(path)
    if newest is not None:
        raise ModelDirError(
            f"MODEL_DIR {path} is a run directory, not a model: serve one of its checkpoints, such as its newest "
            f"complete one: areno serve {newest}"
        )
    if (path / "checkpoints").is_dir() or (path / METRICS_FILENAME).is_file():
        raise ModelDirError(
            f"MODEL_DIR {path} is a run directory without a complete checkpoint: serve a checkpoint "
            "(run_dir/checkpoints/step_N) once one is saved, or the model the run started from"
        )
    checkpoint = next((p for p in path.parents if p.name.startswith("step_") and (p / "hf").is_dir()), None)
    if checkpoint is not None:
        what = "a LoRA adapter" if (path / "adapter_config.json").is_file() else "a part"
        raise ModelDirError(
            f"MODEL_DIR {path} is {what} of checkpoint {checkpoint}, not a model: serve the checkpoint (its hf/ "
            f"export holds the merged weights): areno serve {checkpoint}"
        )
    return model_dir


def _device_arg(value: str) -> str:
    """``--device``: auto, cpu, cuda or cuda:N (argparse reports anything else as an invalid choice)."""
    if re.fullmatch(r"auto|cpu|cuda(:\d+)?", value) is None:
        raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from auto, cpu, cuda, cuda:N)")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="areno serve", description="Serve a Hugging Face checkpoint with the areno rollout engine."
    )
    p.add_argument(
        "model_dir",
        help="a Hugging Face directory (config.json, *.safetensors, a tokenizer) or a run's checkpoint "
        "(run_dir/checkpoints/step_N: its hf/ export)",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: local only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port, 1-65535 (0: any free one, logged at start)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("ARENO_API_KEY"),
        help="require 'Authorization: Bearer KEY' (env ARENO_API_KEY)",
    )
    p.add_argument(
        "--served-model-name", default=None, help="model id reported by /v1/models (default: the directory name)"
    )
    p.add_argument(
        "--device",
        default="auto",
        type=_device_arg,
        help="auto (the default: cuda when available, else cpu), cpu or cuda (another GPU: CUDA_VISIBLE_DEVICES)",
    )
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
    p.add_argument(
        "--engine-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other rollout engine setting, as a run's rollout.KEY (e.g. cuda_graphs=false, decode_steps=4); "
        "repeatable",
    )
    p.add_argument("--default-max-tokens", type=int, default=16, help="max_tokens when a request omits it (>= 1)")
    p.add_argument(
        "--stall-timeout-s",
        type=float,
        default=300.0,
        help="/health answers 503 after this long without an engine step while requests are pending",
    )
    limits = ServerLimits()
    p.add_argument(
        "--max-body-mb",
        type=float,
        default=limits.max_body_bytes / 2**20,
        help="largest request body in MiB; larger ones get 413 before they are read",
    )
    p.add_argument("--max-n", type=int, default=limits.max_n, help="largest n (completions per prompt)")
    p.add_argument("--max-prompts", type=int, default=limits.max_prompts, help="most prompts per /v1/completions")
    p.add_argument("--max-group", type=int, default=limits.max_group, help="most entries per /generate_many")
    p.add_argument(
        "--max-queued",
        type=int,
        default=4096,
        help="most requests waiting beyond the running batch (--max-num-seqs); more get 429",
    )
    return p


ENGINE_FLAGS = {"max_num_seqs", "max_model_len", "block_size", "kv_memory_fraction"}
"""Engine settings with a flag of their own (``--max-num-seqs``, ...)."""


def engine_settings(pairs: list[str]) -> dict[str, Any]:
    """``--engine-set KEY=VALUE`` pairs as engine settings, typed as a run's ``rollout.KEY`` is (OmegaConf
    against ``RolloutEngineSettings``: ``false``, ``4``, ``null``); a one-line ConfigError for a malformed
    pair, an unknown key, one with its own flag or a value of the wrong type."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    allowed = sorted(f.name for f in dataclasses.fields(RolloutEngineSettings) if f.name not in ENGINE_FLAGS)
    keys = []
    for pair in pairs:
        key, sep, _ = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--engine-set {pair!r}: give KEY=VALUE, e.g. cuda_graphs=false")
        if key in ENGINE_FLAGS:
            raise ConfigError(f"--engine-set {key}: it has a flag of its own: --{key.replace('_', '-')}")
        if key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"--engine-set {key}: not a rollout engine setting{hint}; they are {allowed}")
        keys.append(key)
    try:
        typed = OmegaConf.merge(OmegaConf.structured(RolloutEngineSettings), OmegaConf.from_dotlist(pairs))
    except OmegaConfBaseException as exc:
        raise ConfigError(f"--engine-set {getattr(exc, 'full_key', '')}: {str(exc).splitlines()[0]}") from None
    return {key: typed[key] for key in keys}


def build_engine(
    model_dir: str, *, device: str | None = None, dtype: str | None = None, **engine_kw: Any
) -> tuple[RolloutEngine, Any]:
    """Load ``model_dir`` (weights + tokenizer) into a ``RolloutEngine``.

    ``engine_kw``: fields of ``RolloutEngineConfig`` (``max_num_seqs``, ``num_blocks``, ...).

    Raises:
        TypeError: a keyword that is not one of them (with the closest one). ConfigError: a bad
            engine setting, of the wrong type or out of range. ModelDirError: a directory whose
            config, weights or tokenizer does not load. All before the weights are read where the
            check allows.
    """
    check_engine_kwargs(engine_kw)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    config = RolloutEngineConfig(**engine_kw)  # a bad setting fails before the weights load
    # a missing directory or config.json named as such, not as a tokenizer failure
    model_config = read_config(model_dir, key="MODEL_DIR")
    model_config.check_context(config.max_model_len, "--max-model-len", where=f" in {model_dir}/config.json")
    try:  # the tokenizer before the weights: a broken tokenizer file fails in a second, not after the load
        tokenizer = load_pretrained_tokenizer(model_dir)
    except (OSError, ValueError, TypeError) as exc:  # a corrupt or incomplete tokenizer file, as preflight's
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ModelDirError(
            f"the tokenizer in {model_dir} does not load ({type(exc).__name__}: {first}): "
            "copy the model's tokenizer files there again"
        ) from None
    model, model_config = load_model(model_dir, dtype=getattr(torch, dtype), device=device)
    engine = RolloutEngine(
        model,
        model_config,
        config=config,
        eos_token_ids=stop_token_ids(model_dir, model_config, tokenizer),
        tokenizer=tokenizer,
    )
    return engine, tokenizer


def check_engine_kwargs(engine_kw: dict[str, Any]) -> None:
    """``build_engine``'s ``engine_kw`` name fields of ``RolloutEngineConfig`` (a TypeError naming the
    closest one otherwise) holding values of their types (a ConfigError naming the keyword): the
    user's mistakes named before a range check or the constructor meets them."""
    hints = typing.get_type_hints(RolloutEngineConfig)
    fields = [f.name for f in dataclasses.fields(RolloutEngineConfig) if f.init and f.name not in ("device", "dtype")]
    for key, value in engine_kw.items():
        if key not in fields:
            close = difflib.get_close_matches(key, [*fields, "device", "dtype"], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(
                f"build_engine() got an unexpected keyword argument {key!r}{hint}; it takes device, dtype and the "
                f"fields of RolloutEngineConfig: {', '.join(fields)}"
            )
        if not is_of_type(value, hints[key]):
            raise wrong_type(f"build_engine({key}=...)", hints[key], value)


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (as uvicorn binds it), for ``uvicorn.Server.run(sockets=...)``.

    Bound before the model loads, and held until the server listens on it, so a taken port fails in
    a second and no other process can take it meanwhile. Raises a one-line :class:`ConfigError`
    naming the address and the fix.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: rebinding past TIME_WAIT
    try:
        sock.bind((host, port))
    except OSError as exc:  # socket.gaierror (an unknown host name) included
        sock.close()
        fixes = {
            errno.EADDRINUSE: "another process listens there: pick another --port (0: any free one) or stop it",
            errno.EACCES: "ports below 1024 need privileges: pick --port 1024 or above",
            errno.EADDRNOTAVAIL: "it is not an address of this machine: pass one of its addresses as --host",
        }
        fix = fixes.get(exc.errno, "pass an address of this machine as --host and a free --port")
        raise ConfigError(f"cannot listen on --host {host} --port {port} ({exc.strerror or exc}): {fix}") from None
    sock.set_inheritable(True)
    return sock


def main(argv: list[str] | None = None) -> int:
    """``areno serve MODEL_DIR [--host --port --api-key ...]``.

    The arguments are checked and the port is bound before the model loads; a mistake raises a
    :class:`~areno.errors.UserError`, which ``areno``'s CLI prints as one line (exit 2).
    """
    args = build_parser().parse_args(argv)
    check_bind(args.host, args.api_key)
    check_config(0 <= args.port <= 65535, "--port", f"must be in 1-65535 (0: any free port), got {args.port}")
    check_config(args.default_max_tokens >= 1, "--default-max-tokens", f"must be >= 1, got {args.default_max_tokens}")
    check_config(args.stall_timeout_s > 0, "--stall-timeout-s", f"must be > 0, got {args.stall_timeout_s}")
    check_config(
        0 < args.max_body_mb < float("inf"), "--max-body-mb", f"must be a positive number, got {args.max_body_mb}"
    )
    check_config(
        not args.device.startswith("cuda") or torch.cuda.is_available(),
        f"--device {args.device}",
        "this torch sees no CUDA device (torch.cuda.is_available() is False): pass --device cpu, "
        "or run where a GPU is visible with a CUDA build of torch",
    )
    # the engine's driver thread, its CUDA graphs and kernels run on the current device, GPU 0 of those visible
    check_config(
        args.device in ("cuda", "cuda:0") or not args.device.startswith("cuda:"),
        f"--device {args.device}",
        f"serve on that GPU with CUDA_VISIBLE_DEVICES={args.device[len('cuda:') :]} areno serve ... --device cuda",
    )
    for flag in ("max_n", "max_prompts", "max_group"):  # ServerLimits checks them too, by field name
        check_config(
            getattr(args, flag) >= 1, f"--{flag.replace('_', '-')}", f"must be >= 1, got {getattr(args, flag)}"
        )
    check_config(
        args.max_queued is None or args.max_queued >= 0, "--max-queued", f"must be >= 0, got {args.max_queued}"
    )
    limits = ServerLimits(
        max_body_bytes=int(args.max_body_mb * 2**20),
        max_n=args.max_n,
        max_prompts=args.max_prompts,
        max_group=args.max_group,
        max_queued=args.max_queued,
    )
    settings = engine_settings(args.engine_set)
    model_dir = serve_model_dir(args.model_dir)
    with listen_socket(args.host, args.port) as sock:
        engine, tokenizer = build_engine(
            model_dir,
            device=None if args.device == "auto" else args.device,
            dtype=args.dtype,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            block_size=args.block_size,
            kv_memory_fraction=args.kv_memory_fraction,
            **settings,
        )
        name = args.served_model_name or served_name(model_dir)
        app = create_app(
            engine,
            tokenizer=tokenizer,
            model_name=name,
            api_key=args.api_key,
            default_max_tokens=args.default_max_tokens,
            stall_timeout_s=args.stall_timeout_s,
            limits=limits,
        )
        server = _ReadyServer(uvicorn.Config(app, log_level="warning"))
        host = f"[{args.host}]" if ":" in args.host else args.host
        logger.info("serving %s (%s) at http://%s:%d", name, model_dir, host, sock.getsockname()[1])
        # the engine's "first generated token N s after the process started" would come with the first
        # request, so it would time the client's arrival: the server logs when it is ready instead
        startup_log = logging.getLogger("areno.observe.startup")
        startup_log.addFilter(_not_first_token)
        try:
            server.run(sockets=[sock])
        except KeyboardInterrupt:  # Ctrl-C is how a server is stopped (uvicorn re-raises it after shutting down)
            pass
        finally:
            startup_log.removeFilter(_not_first_token)
    return 0 if server.started else 1  # not started: uvicorn logged why (an app startup failure)


def _not_first_token(record: logging.LogRecord) -> bool:
    return "first generated token" not in record.getMessage()


class _ReadyServer(uvicorn.Server):
    """uvicorn's server, which logs how long the process took to be ready once it listens."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            age_s = process_age_s()
            took = f"{age_s:.2f} s" if age_s is not None else "an unknown time"
            logger.info("ready to serve after %s (from the process start: imports, model load, engine set-up)", took)


if __name__ == "__main__":
    raise SystemExit(main())
