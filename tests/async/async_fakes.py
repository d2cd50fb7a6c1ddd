"""A test double of the rollout engine + client: tokens appear one per ``step_s`` of asyncio time,
each tagged with the engine's current policy version; ``pause()`` holds every request at a token
boundary without losing what it generated (the contract of the real RolloutEngine)."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable

from areno.types import GenerationOutput, SamplingParams

Respond = Callable[[list[int], SamplingParams], list[int]]


class FakeEngine:
    def __init__(self, respond: Respond, step_s: float = 0.0) -> None:
        self.respond = respond
        self.step_s = step_s
        self.version = 0
        self._running = threading.Event()
        self._running.set()
        self.requests = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.cancelled = 0
        self._lock = threading.Lock()

    def pause(self) -> None:
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def update_weights(self, version: int) -> None:
        assert not self._running.is_set(), "weights swapped while the engine runs"
        self.version = version

    async def agenerate(
        self, prompt_ids: list[int], sampling_params: SamplingParams, *, request_id: str | None = None
    ) -> GenerationOutput:
        with self._lock:
            self.requests += 1
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            tokens = self.respond(list(prompt_ids), sampling_params)[: sampling_params.max_new_tokens]
            versions = []
            for _ in tokens:
                while not self._running.is_set():
                    await asyncio.sleep(0.001)
                await asyncio.sleep(self.step_s)
                versions.append(self.version)
            return GenerationOutput(
                request_id=request_id or uuid.uuid4().hex,
                prompt_ids=list(prompt_ids),
                output_ids=list(tokens),
                output_logprobs=[-0.5] * len(tokens),
                output_versions=versions,
                finish_reason="stop",
            )
        except asyncio.CancelledError:
            self.cancelled += 1  # the caller aborted the request
            raise
        finally:
            with self._lock:
                self.in_flight -= 1


# ---- for rollout worker processes (importable by dotted path) ----
from areno.types import Trajectory  # noqa: E402
from areno.workflows.base import RolloutWorkflow  # noqa: E402


def fixed_length(prompt_ids: list[int], params: SamplingParams) -> list[int]:
    return [5] * prompt_ids[0]  # prompt [n] -> n tokens


def make_engine(step_s: float = 0.0) -> FakeEngine:
    return FakeEngine(fixed_length, step_s=step_s)


class LengthWorkflow(RolloutWorkflow):
    """Sample {"id", "len"} -> one trajectory of `len` tokens, tagged with the sample id and pid."""

    async def run_episode(self, client, sample):
        import os

        if sample.get("raise"):
            raise RuntimeError(f"env crashed on {sample['id']}")
        out = await client.agenerate([sample["len"]], SamplingParams(max_new_tokens=1000))
        return Trajectory(
            prompt_ids=[1],
            completion_ids=out.output_ids,
            logprobs=out.output_logprobs,
            versions=out.output_versions,
            reward=float(sample["id"]),
            group_id=str(sample["id"]),
            info={"id": sample["id"], "pid": os.getpid()},
        )
