"""Multi-step environments: the ``Environment`` contract and ``EnvWorkflow`` running a policy in one.

``Environment``: ``reset(sample) -> observation`` and ``step(action) -> StepResult(observation,
reward, done)``; both may be ``async``. An observation is text (what the model reads next) or an
``Observation`` with text plus tensors (images, board states). Tensors of ``ref_threshold_bytes``
or more are put into an ``ObservationStore`` and only their ``StoreRef`` travels with the
trajectory (``info["observation_refs"]``), so large observations never ride the results queue.

``EnvWorkflow`` runs ``n_samples`` episodes per row for up to ``horizon`` steps. The policy is
driven through the recording ``ArenoAsyncOpenAI`` client, so every step is an interaction in one
tree with its step reward; the episode is exported with discounting ``gamma`` (concatenated by
default: the model's actions are trained, observation tokens are masked out). Two modes:
``"text"`` continues one token sequence (observations appended as text), ``"chat"`` keeps a message
list (observations as user turns) and uses the tokenizer's chat template.

Shipped: ``ArithmeticRetryEnv`` (answer, hear "wrong" and retry) and its workflow factory
``arithmetic_retry_workflow``.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from areno.data.tasks import TaskSpec, extract_answer, generate_rows
from areno.observe.session import session
from areno.rollout.client import RolloutClient, wait_for_result
from areno.rollout.store import InProcessStore, ObservationStore, StoreRef, release_refs
from areno.types import SamplingParams, Trajectory
from areno.workflows.agent import describe_row
from areno.workflows.base import RolloutWorkflow, _import_dotted
from areno.workflows.interaction import ExportStyle
from areno.workflows.openai_client import ArenoAsyncOpenAI

logger = logging.getLogger("areno.workflows")


@dataclass(kw_only=True)
class Observation:
    """What the environment shows: ``text`` for the model, ``tensors`` kept by reference when large."""

    text: str
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(kw_only=True)
class StepResult:
    observation: str | Observation
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


class Environment(ABC):
    """One episode's world. A new instance per episode (``env_factory(sample)``)."""

    @abstractmethod
    def reset(self, sample: dict[str, Any]) -> str | Observation:
        """Start an episode for ``sample``; return the first observation (may be async)."""

    @abstractmethod
    def step(self, action: str) -> StepResult:
        """Apply the model's ``action`` (its decoded reply); may be async."""

    def close(self) -> None:
        """Release resources (subprocesses, files) at the end of the episode."""


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class EnvWorkflow(RolloutWorkflow):
    """Runs a policy in an ``Environment`` for up to ``horizon`` steps per episode.

    Accepts the engine's workflow keyword arguments (``tokenizer``, ``sampling_params``,
    ``n_samples``, ``reward_fn``, ``prompt_key``, ``answer_key``); ``reward_fn`` is unused (the
    environment rewards).
    """

    carries_routes = False  # its trajectories are built from the env steps' tokens
    carries_reward_parts = False  # the environment rewards its steps: no reward.fn list to split

    def __init__(
        self,
        tokenizer: Any,
        sampling_params: SamplingParams,
        *,
        env_factory: Callable[[dict[str, Any]], Environment] | str,
        horizon: int = 4,
        n_samples: int = 1,
        gamma: float = 1.0,
        mode: str = "text",
        export_style: ExportStyle = "concat",
        store: ObservationStore | None = None,
        ref_threshold_bytes: int = 1024,
        timeout_s: float = 300.0,
        reward_fn: Any = None,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
    ) -> None:
        if isinstance(env_factory, str):
            env_factory = _import_dotted(env_factory, what="rollout.workflow_kwargs.env_factory")
        if not callable(env_factory):
            raise ValueError("env_factory must be a callable sample -> Environment (or its dotted path)")
        if horizon < 1:
            raise ValueError(f"horizon must be >= 1, got {horizon}")
        if n_samples < 1:
            raise ValueError(f"n_samples must be >= 1, got {n_samples}")
        if not 0 <= gamma <= 1:
            raise ValueError(f"gamma must be in [0, 1], got {gamma}")
        if mode not in ("text", "chat"):
            raise ValueError(f"mode must be 'text' or 'chat', got {mode!r}")
        if ref_threshold_bytes < 0:
            raise ValueError(f"ref_threshold_bytes must be >= 0, got {ref_threshold_bytes}")
        self.tokenizer = tokenizer
        self.sampling_params = sampling_params
        self.env_factory = env_factory
        self.horizon = horizon
        self.n_samples = n_samples
        self.gamma = gamma
        self.mode = mode
        self.export_style = export_style
        self.store = store if store is not None else InProcessStore()
        self.ref_threshold_bytes = ref_threshold_bytes
        self.timeout_s = timeout_s

    async def run_episode(self, client: RolloutClient, sample: dict[str, Any]) -> list[Trajectory] | None:
        group_id = uuid.uuid4().hex
        refs: list[list[dict[str, Any]]] = [[] for _ in range(self.n_samples)]
        results: list[list[Trajectory] | None] = [None] * self.n_samples
        try:
            results = await asyncio.gather(
                *(self._aguarded(client, sample, group_id, i, refs[i]) for i in range(self.n_samples))
            )
        finally:
            # the engine releases the stored observations of the trajectories it gets; an episode that
            # gives none (it raised, timed out, or the group was cancelled) releases its own here
            release_refs([episode for episode, trajs in zip(refs, results) if not trajs], self.store)
        group = [t for trajs in results if trajs is not None for t in trajs]
        return group or None

    async def _aguarded(
        self, client: RolloutClient, sample: dict[str, Any], group_id: str, index: int, refs: list[dict[str, Any]]
    ) -> list[Trajectory] | None:
        try:
            return await wait_for_result(self._aepisode(client, sample, group_id, index, refs), self.timeout_s)
        except TimeoutError:
            logger.warning(
                "environment episode %d of row %s did not finish within timeout_s=%gs; dropped",
                index,
                describe_row(sample),
                self.timeout_s,
            )
        except Exception as exc:  # noqa: BLE001 - user environment code: warned with the row named, the group goes on
            logger.warning(
                "environment episode %d of row %s raised %s: %s; dropped",
                index,
                describe_row(sample),
                type(exc).__name__,
                exc,
            )
        return None

    def _observe(self, obs: str | Observation, refs: list[dict[str, Any]], step: int, rec: Any) -> str:
        """The text the model reads; large tensors go to the store and their refs to ``refs``."""
        if isinstance(obs, str):
            return obs
        if not isinstance(obs, Observation):
            raise TypeError(f"an observation must be a str or an Observation, got {type(obs).__name__}")
        for name, tensor in obs.tensors.items():
            nbytes = tensor.numel() * tensor.element_size()
            if nbytes >= self.ref_threshold_bytes:
                ref = self.store.put(tensor)
                refs.append({"step": step, "name": name, "ref": ref})
                rec.event("observation_ref", step=step, name=name, key=ref.key, nbytes=ref.nbytes)
            else:
                refs.append({"step": step, "name": name, "value": tensor.detach().cpu()})
        return obs.text

    async def _aepisode(
        self,
        rollout_client: RolloutClient,
        sample: dict[str, Any],
        group_id: str,
        index: int,
        refs: list[dict[str, Any]],
    ) -> list[Trajectory]:
        """One episode; its observations go into ``refs`` (the caller's, which releases them if it fails)."""
        params = self.sampling_params
        if params.seed is not None:
            import dataclasses

            params = dataclasses.replace(params, seed=params.seed + 1000 * index)
        with session(sample=describe_row(sample), group_id=group_id, episode=index, workflow="env") as rec:
            oai = ArenoAsyncOpenAI(
                rollout_client, self.tokenizer, default_sampling=params, session=rec, fixed_temperature=True
            )
            env = self.env_factory(sample)
            try:
                text = self._observe(await _maybe_await(env.reset(sample)), refs, 0, rec)
                messages = [{"role": "user", "content": text}]
                prompt_ids = list(self.tokenizer.encode(text, add_special_tokens=False))
                done, total, steps = False, 0.0, 0
                while not done and steps < self.horizon:
                    if self.mode == "chat":
                        resp = await oai.chat.completions.create(model="policy", messages=messages)
                        action = resp.choices[0].message.content or ""
                    else:
                        if self.mode == "text":
                            rec.turn("user", text)
                        resp = await oai.completions.create(model="policy", prompt=prompt_ids)
                        action = resp.choices[0].text
                    result = await _maybe_await(env.step(action))
                    steps += 1
                    total += float(result.reward)
                    oai.set_last_reward(float(result.reward))
                    rec.event("env_step", step=steps, reward=float(result.reward), done=bool(result.done))
                    done = bool(result.done)
                    if done or steps >= self.horizon:
                        break
                    text = self._observe(result.observation, refs, steps, rec)
                    if self.mode == "chat":
                        messages += [{"role": "assistant", "content": action}, {"role": "user", "content": text}]
                    else:
                        choice = resp.choices[0]
                        prompt_ids = (
                            list(choice.prompt_token_ids)
                            + list(choice.token_ids)
                            + list(self.tokenizer.encode(text, add_special_tokens=False))
                        )
            finally:
                env.close()
            rec.set_reward(total, steps=steps, done=done)
            info = {"sample": describe_row(sample), "env_steps": steps, "env_return": total}
            if refs:
                info["observation_refs"] = refs
            return oai.export(self.export_style, gamma=self.gamma, group_id=group_id, info=info)


# -------------------------------------------------------------------------------- a shipped env
class ArithmeticRetryEnv(Environment):
    """Answer an arithmetic prompt; a wrong answer is told so and the prompt is asked again.

    Reward 1 for the right answer (ending the episode). A wrong answer earns ``format_reward`` ×
    the fraction of digit characters in its first line (0 disables the shaping), which gives a
    model trained from scratch a signal long before its first right sum. With discounting, an
    early wrong turn that led to a later right one is credited ``gamma``. Works for any task with
    exact answers; ``target_key`` names the row field holding the right answer (e.g. ``"target"``
    when ``"answer"`` holds a demonstration for the warm start that may be wrong).
    """

    FEEDBACK = "\nwrong, try again\n"

    def __init__(self, sample: dict[str, Any], *, format_reward: float = 0.0, target_key: str = "answer") -> None:
        if not 0 <= format_reward < 1:
            raise ValueError(f"format_reward must be in [0, 1), got {format_reward}")
        if target_key not in sample:
            raise ValueError(
                f"ArithmeticRetryEnv: row {describe_row(sample)} has no field {target_key!r} "
                f"(fields: {sorted(sample)}); set target_key to the field with the right answer"
            )
        self.prompt = sample["prompt"]
        self.answer = str(sample[target_key]).strip()
        self.format_reward = format_reward

    def reset(self, sample: dict[str, Any]) -> str:
        return self.prompt

    def step(self, action: str) -> StepResult:
        line = extract_answer(action)
        if line == self.answer:
            return StepResult(observation="", reward=1.0, done=True)
        digits = sum(ch.isdigit() for ch in line) / len(line) if line else 0.0
        return StepResult(observation=self.FEEDBACK + self.prompt, reward=self.format_reward * digits, done=False)


def arithmetic_retry_workflow(
    *,
    store: ObservationStore | None = None,
    horizon: int = 3,
    gamma: float = 0.5,
    format_reward: float = 0.1,
    target_key: str = "answer",
    **kwargs: Any,
) -> EnvWorkflow:
    """``rollout.workflow: areno.workflows.env:arithmetic_retry_workflow``: ``ArithmeticRetryEnv`` on
    the rows' prompt/answer (any task with exact answers), text mode; ``horizon``, ``gamma`` and
    ``format_reward`` and ``target_key`` can be set with ``rollout.workflow_kwargs`` (see
    ``examples/agent_multiturn.yaml``)."""
    kwargs.pop("reward_fn", None)
    ArithmeticRetryEnv(
        {"prompt": "", target_key: ""}, format_reward=format_reward, target_key=target_key
    )  # validates now
    env_factory = functools.partial(ArithmeticRetryEnv, format_reward=format_reward, target_key=target_key)
    return EnvWorkflow(env_factory=env_factory, horizon=horizon, gamma=gamma, mode="text", store=store, **kwargs)


def sort_retry_rows(
    num: int, seed: int, *, split: str = "train", min_len: int = 3, max_len: int = 3, lazy_fraction: float = 0.0
) -> list[dict[str, Any]]:
    """Rows of the shipped sort task (``"sort 627:"``) for ``ArithmeticRetryEnv`` with
    ``target_key="target"``: ``target`` is the sorted digits; ``answer`` (what a warm start imitates)
    is the target, or for a ``lazy_fraction`` share of the rows a lazy demonstrator's answer, the
    digits as given. Train and eval prompts never overlap (``areno.data.tasks.generate_rows``)."""
    if not 0 <= lazy_fraction <= 1:
        raise ValueError(f"lazy_fraction must be in [0, 1], got {lazy_fraction}")
    import random

    rng = random.Random(f"sort_retry/{seed}")
    rows = generate_rows(
        TaskSpec(name="sort", kwargs={"min_len": min_len, "max_len": max_len}), split=split, num=num, seed=seed
    )
    out = []
    for row in rows:
        given = row["prompt"].removeprefix("sort ").rstrip(":")
        lazy = rng.random() < lazy_fraction
        out.append({"prompt": row["prompt"], "answer": given if lazy else row["answer"], "target": row["answer"]})
    return out


__all__ = [
    "ArithmeticRetryEnv",
    "EnvWorkflow",
    "Environment",
    "Observation",
    "StepResult",
    "StoreRef",
    "arithmetic_retry_workflow",
    "sort_retry_rows",
]
