"""RLVR: single-turn generation scored by a verifiable reward, n samples per prompt as one group."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from areno.data.prompts import render_prompt
from areno.rollout.client import RolloutClient, agenerate_many
from areno.types import GenerationOutput, SamplingParams, Trajectory
from areno.workflows.base import RolloutWorkflow
from areno.workflows.common import RewardFn, acall_reward, require_field, sample_fields


def seeded(params: SamplingParams, offset: int) -> SamplingParams:
    """The i-th sample of a group gets seed + i, so a seeded group is not n copies of one answer."""
    if params.seed is None:
        return params
    return dataclasses.replace(params, seed=params.seed + offset)


class RLVRWorkflow(RolloutWorkflow):
    """One prompt → ``n_samples`` completions sharing a ``group_id``, each rewarded by ``reward_fn``.

    ``reward_fn(prompt, completion, answer, **other_fields) -> float`` receives the decoded
    completion (special tokens removed), the row's answer (None when the row has no answer field)
    and every other field of the row. A reward that raises scores 0, is recorded in
    ``trajectory.info["reward_error"]`` and is warned about with the prompt named.
    """

    def __init__(
        self,
        tokenizer: Any,
        reward_fn: RewardFn,
        n_samples: int,
        sampling_params: SamplingParams,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        *,
        chat_template: str = "auto",
        system_prompt: str | None = None,
    ) -> None:
        if n_samples < 1:
            raise ValueError(f"n_samples must be >= 1, got {n_samples}")
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        self.n_samples = n_samples
        self.sampling_params = sampling_params
        self.prompt_key = prompt_key
        self.answer_key = answer_key
        self.chat_template = chat_template
        self.system_prompt = system_prompt

    async def run_episode(self, client: RolloutClient, sample: dict[str, Any]) -> list[Trajectory]:
        prompt = require_field(sample, self.prompt_key)
        answer = sample.get(self.answer_key)
        fields = sample_fields(sample, self.prompt_key, self.answer_key)
        prompt_ids = render_prompt(
            self.tokenizer, prompt, chat_template=self.chat_template, system_prompt=self.system_prompt
        )
        outputs: list[GenerationOutput] = await agenerate_many(
            client, prompt_ids, [seeded(self.sampling_params, i) for i in range(self.n_samples)]
        )
        group_id = uuid.uuid4().hex
        group = []
        for out in outputs:
            completion = self.tokenizer.decode(out.output_ids, skip_special_tokens=True)
            reward, error = await acall_reward(self.reward_fn, prompt, completion, answer, fields)
            info: dict[str, Any] = {"prompt": prompt, "completion": completion, "answer": answer}
            if error is not None:
                info["reward_error"] = error
            group.append(
                Trajectory(
                    prompt_ids=prompt_ids,
                    completion_ids=list(out.output_ids),
                    logprobs=list(out.output_logprobs),
                    versions=list(out.output_versions),
                    reward=reward,
                    group_id=group_id,
                    finish_reason=out.finish_reason,
                    info=info,
                )
            )
        return group
