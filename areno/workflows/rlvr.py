"""RLVR: single-turn generation scored by a verifiable reward, n samples per prompt as one group."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from areno.data.detokenize import adecode_texts
from areno.data.prompts import render_prompt
from areno.models.vision import VisionConfig
from areno.rollout.client import RolloutClient, agenerate_many
from areno.rollout.store import ObservationStore
from areno.types import GenerationOutput, SamplingParams, Trajectory
from areno.workflows.base import RolloutWorkflow
from areno.workflows.common import RewardFn, ascore_reward, require_field, sample_fields
from areno.workflows.images import IMAGES_KEY, image_prompt, row_images, stash_images


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
    ``trajectory.info["reward_error"]`` and is warned about (``acall_reward``: the first failure with
    the prompt named, later ones once per batch).

    A row with ``images`` (vision-language models: ``vision`` is set by the engine from the
    checkpoint) generates with the images' pixels; the trajectories keep them by reference in
    ``info["images"]`` (``store``, the run's observation store), for the trainer's forward.
    """

    carries_routes = True  # each trajectory takes its generation's routes_TLK

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
        chat_template_kwargs: dict | None = None,
        vision: VisionConfig | None = None,
        store: ObservationStore | None = None,
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
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.vision = vision
        self.store = store

    def token_params(self, i: int) -> SamplingParams:
        """The i-th sample's params: ``seeded``, and without the engine's text (the workflow decodes
        the completions itself, all of a group in one call)."""
        return seeded(dataclasses.replace(self.sampling_params, detokenize=False), i)

    async def run_episode(self, client: RolloutClient, sample: dict[str, Any]) -> list[Trajectory]:
        prompt = require_field(sample, self.prompt_key)
        answer = sample.get(self.answer_key)
        fields = sample_fields(sample, self.prompt_key, self.answer_key, IMAGES_KEY)
        images = row_images(sample, self.vision)
        inputs = None
        if images:
            prompt_ids, inputs = image_prompt(
                self.tokenizer,
                prompt,
                images,
                self.vision,
                chat_template=self.chat_template,
                system_prompt=self.system_prompt,
                chat_template_kwargs=self.chat_template_kwargs,
            )
        else:
            prompt_ids = render_prompt(
                self.tokenizer,
                prompt,
                chat_template=self.chat_template,
                system_prompt=self.system_prompt,
                chat_template_kwargs=self.chat_template_kwargs,
            )
        outputs: list[GenerationOutput] = await agenerate_many(
            client, prompt_ids, [self.token_params(i) for i in range(self.n_samples)], images=inputs
        )
        group_id = uuid.uuid4().hex
        group = []
        completions = await adecode_texts(self.tokenizer, [out.output_ids for out in outputs])
        scores = [await ascore_reward(self.reward_fn, prompt, c, answer, fields) for c in completions]
        # no await from here on: an episode cancelled between two stashes leaked the pixels stashed
        for out, completion, score in zip(outputs, completions, scores):
            info: dict[str, Any] = score.into({"prompt": prompt, "completion": completion, "answer": answer})
            if inputs is not None:  # one stored copy per trajectory: each is released after its step
                info["images"] = stash_images(inputs, self.store)
            group.append(
                Trajectory(  # takes the output's lists: fresh ones from the client, this episode's alone
                    prompt_ids=prompt_ids,
                    completion_ids=out.output_ids,
                    logprobs=out.output_logprobs,
                    versions=out.output_versions,
                    reward=score.value,
                    group_id=group_id,
                    finish_reason=out.finish_reason,
                    info=info,
                    routes_TLK=out.routes_TLK,
                )
            )
        return group
