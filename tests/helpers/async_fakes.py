"""A test double of the rollout engine + client: tokens appear one per ``step_s`` of asyncio time,
each tagged with the engine's current policy version; ``pause()`` holds every request at a token
boundary without losing what it generated (the contract of the real RolloutEngine). With ``hold_at=k``
every request stops after k tokens until ``release`` is set, so a test can act at a known point."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import uuid
from collections.abc import Callable

from areno.types import GenerationOutput, SamplingParams, Trajectory
from areno.workflows.base import RolloutWorkflow

Respond = Callable[[list[int], SamplingParams], list[int]]


class FakeEngine:
    def __init__(self, respond: Respond, step_s: float = 0.0, hold_at: int | None = None) -> None:
        self.respond = respond
        self.step_s = step_s
        self.hold_at = hold_at
        self.release = threading.Event()
        self.held = 0  # requests that reached token hold_at (they wait there until release is set)
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
            for i in range(len(tokens)):
                if i == self.hold_at:
                    with self._lock:
                        self.held += 1
                    await await_threading_event(self.release)
                await await_threading_event(self._running)
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


async def await_threading_event(event: threading.Event) -> None:
    """Wait in a coroutine, without polling, for a ``threading.Event`` that another thread sets (the
    tests pause and resume from their own thread). The waiting thread is a daemon, so an event never
    set holds up neither the loop's shutdown nor the interpreter's exit."""
    if event.is_set():
        return
    loop = asyncio.get_running_loop()
    woken = asyncio.Event()

    def wait() -> None:
        event.wait()
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits any more
            loop.call_soon_threadsafe(woken.set)

    threading.Thread(target=wait, daemon=True).start()
    await woken.wait()


# ---- for rollout worker processes (importable by dotted path) ----


def fixed_length(prompt_ids: list[int], params: SamplingParams) -> list[int]:
    return [5] * prompt_ids[0]  # prompt [n] -> n tokens


def make_engine(step_s: float = 0.0) -> FakeEngine:
    return FakeEngine(fixed_length, step_s=step_s)


class LengthWorkflow(RolloutWorkflow):
    """Sample {"id", "len"} -> one trajectory of `len` tokens, tagged with the sample id and pid."""

    async def run_episode(self, client, sample):
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


def generated(out, reward: float, **fields) -> Trajectory:
    """The trajectory of one ``agenerate`` output after the prompt [1] (``fields``: group_id, info, ...)."""
    return Trajectory(
        prompt_ids=[1],
        completion_ids=out.output_ids,
        logprobs=out.output_logprobs,
        versions=out.output_versions,
        reward=reward,
        **fields,
    )


def replying(tokenizer, *texts: str) -> FakeEngine:
    """An engine answering the i-th call of a multi-turn episode with ``texts[i]`` (+ EOS; the last
    text from then on): each call's prompt extends the one before, so the EOS tokens it holds count
    the turns done."""
    encoded = [tokenizer.encode(t, add_special_tokens=False) + [tokenizer.eos_token_id] for t in texts]

    def respond(prompt_ids: list[int], params: SamplingParams) -> list[int]:
        turn = sum(tokenizer.eos_token_id == t for t in prompt_ids)
        return encoded[min(turn, len(encoded) - 1)]

    return FakeEngine(respond)


def sync_weights(executor, engine: FakeEngine, version: int) -> None:
    """A policy sync as the trainer makes one: admission paused, the engine's weights swapped, the version set."""
    executor.pause()
    engine.pause()
    engine.update_weights(version)
    executor.set_version(version)
    engine.resume()
    executor.resume()
