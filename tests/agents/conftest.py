"""Fixtures for agent tests: a scripted rollout client (replies chosen by the test) and a tiny engine."""

from __future__ import annotations

import itertools

import pytest

from areno.rollout.client import RolloutClient
from areno.types import GenerationOutput, SamplingParams


class ScriptedClient(RolloutClient):
    """Answers each call with the next scripted text (+ EOS), log-prob -0.5 per token, version 3.

    ``replies`` is a list of texts, or a function ``(prompt_text) -> text``. Records every prompt.
    """

    def __init__(self, tokenizer, replies, *, eos: bool = True, version: int = 3) -> None:
        self.tokenizer = tokenizer
        self.replies = replies if callable(replies) else iter(replies)
        self.eos = eos
        self.version = version
        self.prompts: list[list[int]] = []
        self.params: list[SamplingParams] = []
        self._ids = itertools.count()

    async def agenerate(self, prompt_ids, sampling_params, *, request_id=None):
        self.prompts.append(list(prompt_ids))
        self.params.append(sampling_params)
        prompt_text = self.tokenizer.decode(prompt_ids)
        text = self.replies(prompt_text) if callable(self.replies) else next(self.replies)
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        if self.eos:
            ids.append(self.tokenizer.eos_token_id)
        return GenerationOutput(
            request_id=f"r{next(self._ids)}",
            prompt_ids=list(prompt_ids),
            output_ids=ids,
            output_logprobs=[-0.5] * len(ids),
            output_versions=[self.version] * len(ids),
            finish_reason="stop",
            text=text,
        )


@pytest.fixture
def scripted(char_tokenizer):
    return lambda replies, **kw: ScriptedClient(char_tokenizer, replies, **kw)


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    """A tiny engine behind areno's OpenAI-compatible server app, and the in-process client that drives it."""
    from areno.rollout.server import build_engine, create_app

    engine, tokenizer = build_engine(str(tiny_model_dir), device="cpu", num_blocks=256, block_size=8, max_model_len=256)
    app = create_app(engine, tokenizer=tokenizer, model_name="tiny")
    yield app, app.state.client, tokenizer
    app.state.client.close()
