"""The control routes of vLLM and SGLang servers, as one ``ServerAdmin`` per backend: the start-up
check (reachable, pause API, same model), pause/resume with requests kept, and loading a policy
from a safetensors export. Calls are synchronous (the trainer's thread makes them between steps).

vLLM (``VLLM_SERVER_DEV_MODE=1``): ``POST /pause?mode=keep``, ``POST /resume``, ``GET /is_paused``,
``POST /collective_rpc`` with ``reload_weights(weights_path=...)`` (every worker loads the
export in place), then ``POST /reset_prefix_cache?reset_running_requests=true``: cached prefixes
of the old policy are dropped and requests in flight recompute their context under the new one.
With ``rollout.weight_transfer=nccl`` the load is vLLM's weight transfer instead
(``/init_weight_transfer_engine`` once, then ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``; ``nccl.py``), followed by the same prefix-cache reset.
SGLang: ``POST /pause_generation`` (``mode: retract``: requests kept, their context recomputed), ``POST /continue_generation``,
``POST /update_weights_from_disk``, ``POST /flush_cache``, ``GET /get_model_info``.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from areno.errors import ConfigError, RunFailure
from areno.rollout.backends.base import StreamActivity, StreamingServerClient
from areno.rollout.backends.sglang import SGLangRolloutClient
from areno.rollout.backends.vllm import VLLMRolloutClient

WEIGHT_TRANSFER_ROUTES = (
    "/init_weight_transfer_engine",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
)
"""vLLM's weight-transfer routes (``VLLM_SERVER_DEV_MODE=1``) an NCCL policy sync uses."""
MODEL_SHAPE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
"""config.json fields that must agree between the trainer's model and the served one."""


class ServerAdmin(abc.ABC):
    """The control routes of one backend's servers (subclasses fill in the routes)."""

    backend: str
    check_timeout_s = 30.0
    load_timeout_s = 600.0

    def __init__(self, *, api_key: str | None = None, transport: Any = None) -> None:
        self.api_key = api_key
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(headers=headers, transport=transport, timeout=self.check_timeout_s)

    @abc.abstractmethod
    def client(
        self,
        url: str,
        *,
        model: str,
        version: Callable[[], int],
        timeout_s: float,
        activity: StreamActivity | None = None,
    ) -> StreamingServerClient:
        """The generation client of the server at ``url`` (``activity``: see ``StreamActivity``)."""

    @abc.abstractmethod
    def check(self, url: str, model_config: dict) -> str:
        """Before training starts: the server answers, has the pause API and serves a model shaped
        like ``model_config``; returns its served model name."""

    @abc.abstractmethod
    def pause(self, url: str) -> None:
        """Hold generation, requests kept."""

    @abc.abstractmethod
    def resume(self, url: str) -> None:
        """Let the held requests continue."""

    @abc.abstractmethod
    def load_weights(self, url: str, path: Path, version: int) -> None:
        """The server serves the export at ``path`` from now on; ``RunFailure`` if it refuses."""

    def _call(self, method: str, url: str, route: str, **kwargs: Any) -> httpx.Response:
        """One control call; transport errors propagate (an unreachable server), an error status
        is a ``RunFailure`` naming the server and its answer."""
        response = self._http.request(method, url + route, **kwargs)
        if response.status_code != 200:
            raise RunFailure(
                f"{self.backend} server {url} answered {route} with {response.status_code}: {response.text[:300]}"
            )
        return response

    def _reach(self, url: str, route: str) -> httpx.Response:
        try:
            return self._http.get(url + route)
        except httpx.TransportError as exc:
            raise RunFailure(
                f"{self.backend} server {url} cannot be reached ({type(exc).__name__}: {exc}): start it, or fix "
                "rollout.servers"
            ) from None


def check_same_model(backend: str, url: str, served_dir: str, model_config: dict) -> None:
    """A ConfigError when the served model directory's config.json differs from the trainer's in
    shape. A served model not on this machine's disk cannot be compared and is trusted."""
    config_path = Path(served_dir) / "config.json"
    if not config_path.is_file():
        return
    served = json.loads(config_path.read_text())
    differ = {k: (served.get(k), model_config.get(k)) for k in MODEL_SHAPE_KEYS if served.get(k) != model_config.get(k)}
    if differ:
        raise ConfigError(
            f"rollout.servers: {backend} server {url} serves {served_dir}, whose config differs from model.path's "
            f"(served vs trained: {differ}): serve the model you train"
        )


class VLLMAdmin(ServerAdmin):
    backend = "vllm"

    def client(
        self,
        url: str,
        *,
        model: str,
        version: Callable[[], int],
        timeout_s: float,
        activity: StreamActivity | None = None,
    ) -> StreamingServerClient:
        return VLLMRolloutClient(
            url, self.api_key, model=model, version=version, timeout_s=timeout_s, activity=activity
        )

    def check(self, url: str, model_config: dict) -> str:
        paused = self._reach(url, "/is_paused")
        if paused.status_code == 404:
            raise ConfigError(
                f"rollout.servers: vLLM server {url} has no pause API (/is_paused answered 404): areno needs a vLLM "
                "with /pause?mode=keep (0.32 or newer), started with VLLM_SERVER_DEV_MODE=1"
            )
        api = self._reach(url, "/openapi.json")
        if api.status_code == 200:  # a vLLM whose /pause predates `mode` ignores mode=keep and aborts every request
            pause = api.json().get("paths", {}).get("/pause", {}).get("post", {})
            if "mode" not in {p.get("name") for p in pause.get("parameters", [])}:
                raise ConfigError(
                    f"rollout.servers: vLLM server {url} has a /pause without `mode`: it would abort every request in "
                    "flight at each policy sync; areno needs a vLLM with /pause?mode=keep (0.32 or newer)"
                )
        models = self._call("GET", url, "/v1/models").json()["data"]
        served = models[0]
        check_same_model(self.backend, url, served.get("root") or served["id"], model_config)
        return served["id"]

    def pause(self, url: str) -> None:
        self._call("POST", url, "/pause", params={"mode": "keep"})

    def resume(self, url: str) -> None:
        self._call("POST", url, "/resume")

    def load_weights(self, url: str, path: Path, version: int) -> None:
        self._call(
            "POST",
            url,
            "/collective_rpc",
            json={"method": "reload_weights", "kwargs": {"weights_path": str(path)}},
            timeout=self.load_timeout_s,
        )
        self.reset_prefix_cache(url, version)

    # NCCL weight transfer (rollout.weight_transfer=nccl; areno/rollout/backends/nccl.py drives them)
    def check_weight_transfer(self, url: str) -> None:
        """A ConfigError unless the server has vLLM's weight-transfer routes."""
        paths = self._call("GET", url, "/openapi.json").json().get("paths", {})
        missing = [r for r in WEIGHT_TRANSFER_ROUTES if r not in paths]
        if missing:
            raise ConfigError(
                f"rollout.weight_transfer: vLLM server {url} has no {', '.join(missing)}: nccl needs a vLLM with "
                "weight transfer (0.32 or newer), started with VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config "
                '\'{"backend": "nccl"}\'; or use rollout.weight_transfer=disk'
            )

    def init_weight_transfer(self, url: str, init_info: dict) -> None:
        self._call(
            "POST", url, "/init_weight_transfer_engine", json={"init_info": init_info}, timeout=self.load_timeout_s
        )

    def start_weight_update(self, url: str) -> None:
        self._call("POST", url, "/start_weight_update", timeout=self.load_timeout_s)

    def update_weights_nccl(self, url: str, update_info: dict) -> None:
        """Answers once the server's workers received the whole broadcast and loaded it."""
        self._call("POST", url, "/update_weights", json={"update_info": update_info}, timeout=self.load_timeout_s)

    def finish_weight_update(self, url: str) -> None:
        self._call("POST", url, "/finish_weight_update", timeout=self.load_timeout_s)

    def reset_prefix_cache(self, url: str, version: int) -> None:
        # the old policy's cached prefixes must not serve new requests; requests in flight
        # recompute their context under the new weights (preempted, then resumed)
        reset = self._call(
            "POST", url, "/reset_prefix_cache", params={"reset_running_requests": "true"}, timeout=self.load_timeout_s
        )
        # vLLM releases before {"success": ...} answer an empty 200 (reset, not checked)
        try:
            success = reset.json().get("success", False) if reset.content else True
        except ValueError:
            raise RunFailure(
                f"vllm server {url}: /reset_prefix_cache answered {reset.text[:80]!r}, not JSON: areno needs a vLLM "
                "0.32 or newer"
            ) from None
        if not success:
            raise RunFailure(f"vllm server {url} could not drop its prefix cache after loading policy v{version}")


class SGLangAdmin(ServerAdmin):
    """Untested against SGLang itself (it does not install on areno's CPU machine): tested against a
    stand-in on areno's engine (``tests/helpers/fake_sglang.py``)."""

    backend = "sglang"

    def client(
        self,
        url: str,
        *,
        model: str,
        version: Callable[[], int],
        timeout_s: float,
        activity: StreamActivity | None = None,
    ) -> StreamingServerClient:
        return SGLangRolloutClient(url, self.api_key, version=version, timeout_s=timeout_s, activity=activity)

    def check(self, url: str, model_config: dict) -> str:
        info = self._reach(url, "/get_model_info")
        if info.status_code != 200:
            raise RunFailure(f"sglang server {url} answered /get_model_info with {info.status_code}: {info.text[:300]}")
        served_dir = info.json().get("model_path", "")
        check_same_model(self.backend, url, served_dir, model_config)
        return served_dir

    def pause(self, url: str) -> None:
        # retract: running requests go back to the queue, so the cache can be flushed and their
        # context is recomputed under the new policy on continue (in_place would keep old K/V
        # and make /flush_cache fail)
        self._call("POST", url, "/pause_generation", json={"mode": "retract"})

    def resume(self, url: str) -> None:
        self._call("POST", url, "/continue_generation", json={})

    def load_weights(self, url: str, path: Path, version: int) -> None:
        answer = self._call(
            "POST",
            url,
            "/update_weights_from_disk",
            json={
                "model_path": str(path),
                "abort_all_requests": False,
                "weight_version": str(version),
                "flush_cache": True,
            },
            timeout=self.load_timeout_s,
        ).json()
        if not answer.get("success", False):
            raise RunFailure(f"sglang server {url} refused policy v{version} from {path}: {answer.get('message')}")
        self._call("POST", url, "/flush_cache")


ADMINS = {"vllm": VLLMAdmin, "sglang": SGLangAdmin}


def admin_for(backend: str, *, api_key: str | None = None, transport: Any = None) -> ServerAdmin:
    return ADMINS[backend](api_key=api_key, transport=transport)
