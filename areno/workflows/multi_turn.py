"""Multi-turn: the model answers, gets feedback when wrong, and retries up to ``max_turns`` times.

One episode is one trajectory: ``prompt_ids`` is the original prompt, ``completion_ids`` holds every
model answer with the feedback text between them. Feedback tokens have ``completion_mask`` 0, log-
prob 0 and version -1, so only model tokens are trained on. The reward of an episode that succeeds
on turn k (0-based) is ``reward * turn_discount**k``: answering right at once is worth most.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

import torch

from areno.data.prompts import render_prompt
from areno.rollout.client import RolloutClient
from areno.types import SamplingParams, Trajectory
from areno.workflows.base import RolloutWorkflow
from areno.workflows.common import REWARD_FIGURES_KEY, RewardFn, ascore_reward, require_field, sample_fields
from areno.workflows.rlvr import seeded

DEFAULT_FEEDBACK = "\nYour answer is incorrect. Try again.\n"

Feedback = str | Callable[[str, Any], str]
"""Fixed feedback text, or ``feedback(completion, answer) -> str``."""


class MultiTurnWorkflow(RolloutWorkflow):
    """Answer → reward → feedback → retry; stops at the first turn whose reward is > 0.

    ``n_samples`` episodes run per prompt as one group (shared ``group_id``). The reward function
    has the RLVR signature ``reward_fn(prompt, completion, answer, **other_fields)`` and sees one
    turn's answer at a time.
    """

    carries_routes = True  # the turns' routes, stitched

    def __init__(
        self,
        tokenizer: Any,
        reward_fn: RewardFn,
        sampling_params: SamplingParams,
        *,
        max_turns: int = 3,
        turn_discount: float = 0.9,
        n_samples: int = 1,
        feedback: Feedback = DEFAULT_FEEDBACK,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        chat_template: str = "auto",
        system_prompt: str | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if not 0 < turn_discount <= 1:
            raise ValueError(f"turn_discount must be in (0, 1], got {turn_discount}")
        if n_samples < 1:
            raise ValueError(f"n_samples must be >= 1, got {n_samples}")
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        self.sampling_params = sampling_params
        self.max_turns = max_turns
        self.turn_discount = turn_discount
        self.n_samples = n_samples
        self.feedback = feedback
        self.prompt_key = prompt_key
        self.answer_key = answer_key
        self.chat_template = chat_template
        self.system_prompt = system_prompt
        self.chat_template_kwargs = dict(chat_template_kwargs or {})

    async def run_episode(self, client: RolloutClient, sample: dict[str, Any]) -> list[Trajectory]:
        prompt = require_field(sample, self.prompt_key)
        answer = sample.get(self.answer_key)
        fields = sample_fields(sample, self.prompt_key, self.answer_key)
        prompt_ids = render_prompt(
            self.tokenizer,
            prompt,
            chat_template=self.chat_template,
            system_prompt=self.system_prompt,
            chat_template_kwargs=self.chat_template_kwargs,
        )
        group_id = uuid.uuid4().hex
        return list(
            await asyncio.gather(
                *(
                    self._aepisode(client, prompt, prompt_ids, answer, fields, group_id, i)
                    for i in range(self.n_samples)
                )
            )
        )

    def _feedback_ids(self, completion: str, answer: Any) -> list[int]:
        text = self.feedback if isinstance(self.feedback, str) else self.feedback(completion, answer)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    async def _aepisode(
        self,
        client: RolloutClient,
        prompt: str,
        prompt_ids: list[int],
        answer: Any,
        fields: dict[str, Any],
        group_id: str,
        sample_idx: int,
    ) -> Trajectory:
        completion_ids: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        turn_rewards: list[float] = []
        errors: list[str] = []
        figures: dict[str, float] = {}
        routes_TLK = None  # a recording MoE engine's routes (``GenerationOutput.routes_TLK``)
        finish_reason = "stop"
        for turn in range(self.max_turns):
            params = seeded(self.sampling_params, sample_idx * self.max_turns + turn)
            out = await client.agenerate(prompt_ids + completion_ids, params)
            completion_ids += out.output_ids
            mask += [1] * len(out.output_ids)
            logprobs += out.output_logprobs
            versions += out.output_versions
            routes_TLK = _stitch_routes(routes_TLK, out.routes_TLK, turn)
            finish_reason = out.finish_reason
            completion = self.tokenizer.decode(out.output_ids, skip_special_tokens=True)
            score = await ascore_reward(self.reward_fn, prompt, completion, answer, fields)
            reward, figures = score.value, score.figures  # the last turn's figures, as its reward
            turn_rewards.append(reward)
            if score.error is not None:
                errors.append(score.error)
            if reward > 0 or turn == self.max_turns - 1 or out.finish_reason == "abort":
                break
            feedback_ids = self._feedback_ids(completion, answer)
            completion_ids += feedback_ids
            mask += [0] * len(feedback_ids)
            logprobs += [0.0] * len(feedback_ids)
            versions += [-1] * len(feedback_ids)
        num_turns = len(turn_rewards)
        info: dict[str, Any] = {
            "prompt": prompt,
            "answer": answer,
            "num_turns": num_turns,
            "turn_rewards": turn_rewards,
        }
        if errors:
            info["reward_error"] = "; ".join(errors)
        if figures:
            info[REWARD_FIGURES_KEY] = figures
        return Trajectory(
            prompt_ids=prompt_ids,
            completion_ids=completion_ids,
            logprobs=logprobs,
            versions=versions,
            reward=turn_rewards[-1] * self.turn_discount ** (num_turns - 1),
            completion_mask=mask,
            group_id=group_id,
            finish_reason=finish_reason,
            info=info,
            routes_TLK=routes_TLK,
        )


def _stitch_routes(earlier_TLK: torch.Tensor | None, turn_TLK: torch.Tensor | None, turn: int) -> torch.Tensor | None:
    """The episode's routes after a turn: this turn's request's, a forward of the whole sequence (prefix
    sharing is off while routes are recorded), whose prefix rows are the routes its own tokens were
    sampled after. The earlier turns' rows differ from them only where a policy sync fell between the
    turns; kept, they replayed the newest tokens after another prefix's routes (their proximal
    log-probs off by up to 1e-2 nats at η > 0). None once a turn brought none."""
    return None if turn > 0 and earlier_TLK is None else turn_TLK
