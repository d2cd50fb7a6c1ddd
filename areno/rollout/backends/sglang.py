"""``SGLangRolloutClient``: an SGLang server's native ``/generate``, token ids in, streamed.

The request sends ``input_ids``, ``sampling_params`` and ``return_logprob``; each streamed event
holds the output so far (SGLang's default, cumulative streaming): its ``meta_info`` has
``output_token_logprobs`` as ``[logprob, token_id, text]`` triples and, at the end, a
``finish_reason`` object (an ``abort`` one is a ``RolloutServerError``: the request is retried on
another server). A server run with ``--incremental-streaming-output`` sends only the new tokens;
``completion_tokens`` tells the two apart. SGLang's log-probs are of the temperature-scaled
distribution unless the server runs with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``: before top-k/top-p/min-p
(as areno's), after the repetition penalty, which SGLang applies to the logits first (areno's are
before it: a training run keeps ``rollout.repetition_penalty=1`` with SGLang). Untested against
SGLang itself (it does not install on the CPU machine areno is developed on): tested against
recorded answers and a stand-in server on areno's engine (``tests/helpers/fake_sglang.py``).
"""

from __future__ import annotations

from typing import Any

from areno.rollout.backends.base import StreamingServerClient, StreamState
from areno.rollout.client import RolloutServerError
from areno.types import SamplingParams


class SGLangRolloutClient(StreamingServerClient):
    """One SGLang server (``python -m sglang.launch_server``)."""

    path = "/generate"

    def request_body(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> dict[str, Any]:
        sampling: dict[str, Any] = {
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "min_p": params.min_p,
            "repetition_penalty": params.repetition_penalty,
            "max_new_tokens": params.max_new_tokens,
            "min_new_tokens": params.min_new_tokens,
            "stop_token_ids": list(params.stop_token_ids),
            "stop": list(params.stop),
            "ignore_eos": params.ignore_eos,
            "skip_special_tokens": False,
            "no_stop_trim": True,
        }
        if params.seed is not None:
            sampling["sampling_seed"] = params.seed
        return {
            "input_ids": prompt_ids,
            "sampling_params": sampling,
            "return_logprob": True,
            "stream": True,
            "rid": request_id,
        }

    def event_version(self, event: dict[str, Any]) -> int | None:
        # SGLang reports the weight version that served each chunk; areno loads every policy with
        # weight_version=<its version>, and a server's first weights ("default") are version 0
        version = (event.get("meta_info") or {}).get("weight_version")
        if version == "default":
            return 0
        return int(version) if isinstance(version, str) and version.isdigit() else None

    def absorb(self, state: StreamState, event: dict[str, Any]) -> tuple[list[int], list[float]]:
        meta = event.get("meta_info") or {}
        triples = meta.get("output_token_logprobs") or []
        done = meta.get("completion_tokens", len(triples))
        # cumulative (SGLang's default): the tail past what arrived is new; a server run with
        # --incremental-streaming-output sends only the new tokens
        new = triples[len(state.output_ids) :] if len(triples) == done else triples
        if event.get("text") is not None:
            state.text = event["text"] if len(triples) == done else state.text + event["text"]
        finish = meta.get("finish_reason")
        if finish is not None:
            kind = finish["type"] if isinstance(finish, dict) else str(finish)
            if kind == "abort":  # aborted by the server: partial output, another server retries it
                raise RolloutServerError(
                    f"{self.base_url}{self.path} aborted {meta.get('id')}: {finish}", server=self.base_url, status=500
                )
            state.finish_reason = kind
        return [int(t[1]) for t in new], [float(t[0]) for t in new]
