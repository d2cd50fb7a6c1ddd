"""``VLLMRolloutClient``: a vLLM server's ``/v1/completions``, token ids in, streamed.

The prompt goes as token ids; each streamed event carries the new tokens' ids
(``return_token_ids``, or ``token_id:N`` strings with ``return_tokens_as_token_ids``) and the
log-prob of each sampled token (``logprobs: 0``). Those log-probs are areno's only when the server
runs with ``--logprobs-mode processed_logprobs`` (log-softmax of the temperature-scaled logits, as
areno's engine and the trainer's recompute; vLLM's default, ``raw_logprobs``, ignores the
temperature): areno's launcher passes it, a server you start needs it too. They are of the
distribution after top-k/top-p/min-p truncation and the repetition penalty as well (vLLM applies the
penalty, the temperature, then min-p, top-k and top-p), which areno's are not: a training run keeps
``rollout.top_p=1``, ``rollout.top_k=-1``, ``rollout.min_p=0`` and ``rollout.repetition_penalty=1``
with vLLM (refused at config load; ``logprob_abs_diff`` would show the difference); and after
the min-tokens processor masks the stop tokens, so a request with ``min_new_tokens`` is refused. A
stream that ends with ``finish_reason: abort`` is a ``RolloutServerError`` (retried elsewhere), not a
short completion.
"""

from __future__ import annotations

from typing import Any

from areno.rollout.backends.base import StreamingServerClient, StreamState
from areno.rollout.client import RolloutServerError
from areno.types import SamplingParams


class VLLMRolloutClient(StreamingServerClient):
    """One vLLM server (``python -m vllm.entrypoints.openai.api_server``) serving ``model``."""

    path = "/v1/completions"

    def __init__(self, base_url: str, api_key: str | None = None, *, model: str, **kwargs: Any) -> None:
        """``model``: the served model name (``/v1/models``); ``kwargs``: ``StreamingServerClient``'s."""
        super().__init__(base_url, api_key, **kwargs)
        self.model = model

    def request_body(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> dict[str, Any]:
        if params.min_new_tokens:
            raise ValueError(
                f"min_new_tokens={params.min_new_tokens} (min_tokens) with a vLLM rollout: vLLM reports log-probs "
                "after its min-tokens processor masks the stop tokens, areno's trainer before it, so the importance "
                "ratios would be off: leave it unset, or use rollout.backend=areno"
            )
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt_ids,
            "max_tokens": params.max_new_tokens,
            "min_tokens": params.min_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "min_p": params.min_p,
            "repetition_penalty": params.repetition_penalty,
            "stop_token_ids": list(params.stop_token_ids),
            "stop": list(params.stop),
            "include_stop_str_in_output": True,
            "ignore_eos": params.ignore_eos,
            "skip_special_tokens": False,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
            "stream": True,
            "request_id": request_id,
        }
        if params.top_k > 0:
            body["top_k"] = params.top_k
        if params.seed is not None:
            body["seed"] = params.seed
        return body

    def absorb(self, state: StreamState, event: dict[str, Any]) -> tuple[list[int], list[float]]:
        if not event.get("choices"):  # a usage-only event
            return [], []
        choice = event["choices"][0]
        state.text += choice.get("text") or ""
        if choice.get("finish_reason") == "abort":  # aborted by the server: partial output, another server retries it
            raise RolloutServerError(
                f"{self.base_url}{self.path} aborted the request", server=self.base_url, status=500
            )
        if choice.get("finish_reason") is not None:
            state.finish_reason = choice["finish_reason"]
        logprobs = choice.get("logprobs") or {}
        token_logprobs = [float(lp) for lp in logprobs.get("token_logprobs") or []]
        ids = choice.get("token_ids")
        if ids is None:  # a vLLM without return_token_ids: the tokens as "token_id:N"
            ids = [int(t.rsplit(":", 1)[1]) for t in logprobs.get("tokens") or []]
        assert len(ids) == len(token_logprobs), (ids, token_logprobs)
        return list(ids), token_logprobs
