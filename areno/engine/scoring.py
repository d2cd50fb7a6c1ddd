"""Scoring held-out rows: what ``ArenoEngine.evaluate``, the test rollout and ``areno eval`` share.

``ascore_row`` generates one completion of a row and rewards it as rollouts do; ``ascore_rows``
takes ``samples`` completions of every row (sampled ones seeded from a base seed, the row and the
sample, so that an evaluation repeats exactly); ``eval_metrics`` summarises them: the mean reward
(``eval/accuracy``) and ``pass@k``, the unbiased estimate of Chen et al. (2021) over the samples whose
reward reaches a threshold.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from areno.data.prompts import render_prompt
from areno.engine.config import ArenoConfig
from areno.engine.ledger import SeedingClient
from areno.engine.rollout_side import RolloutSide
from areno.errors import ConfigError, DataError
from areno.recipes.config import RewardSync
from areno.recipes.runner import with_model_rewards
from areno.rollout.errors import RequestRejected
from areno.types import MAX_SEED, SamplingParams, TokenBatch, Trajectory
from areno.workflows.common import ascore_reward, reward_figure_means, sample_fields, warn_reward_errors
from areno.workflows.images import IMAGES_KEY, image_prompt, row_images


async def ascore_row(
    client, tokenizer, reward_fn, row: dict, cfg: ArenoConfig, params: SamplingParams, vision: Any = None
) -> Trajectory:
    """One held-out row generated with ``params`` and scored: the prompt rendered as rollouts render
    it, the completion decoded, the reward under the rollouts' failure policy (a raising reward
    scores 0 and is recorded in ``info["reward_error"]``: warned about in full the first time, then
    counted; ``ascore_rows`` sums its rows' up in one warning). Shared by ``ArenoEngine.evaluate``,
    the test rollout (``engine/test_rollout.py``) and ``areno eval`` (``engine/evaluation.py``), so
    all three score a policy alike. ``info`` also holds the prompt,
    the completion's text and its finish reason. ``vision``: the model's ``VisionConfig`` (rows with
    images)."""
    prompt_key, answer_key = cfg.data.prompt_key, cfg.data.answer_key
    templating = cfg.data.templating()
    images = row_images(row, vision)
    try:
        if images:
            prompt_ids, inputs = image_prompt(tokenizer, row[prompt_key], images, vision, **templating)
            out = await client.agenerate(prompt_ids, params, images=inputs)
        else:
            prompt_ids = render_prompt(tokenizer, row[prompt_key], **templating)
            out = await client.agenerate(prompt_ids, params)
    except RequestRejected as exc:  # the row's own problem: a prompt too long for the context, ...
        raise DataError(f"the held-out row with prompt {str(row[prompt_key])!r:.60}: {exc}") from None
    completion = tokenizer.decode(out.output_ids, skip_special_tokens=True)
    fields = sample_fields(row, prompt_key, answer_key, IMAGES_KEY)
    score = await ascore_reward(reward_fn, row[prompt_key], completion, row.get(answer_key), fields)
    n = len(out.output_ids)
    info = score.into({"prompt": row[prompt_key], "completion": completion, "finish_reason": out.finish_reason})
    return Trajectory(
        prompt_ids=list(prompt_ids),
        completion_ids=list(out.output_ids),
        logprobs=[0.0] * n,
        versions=[0] * n,
        reward=score.value,
        info=info,
    )


async def ascore_rows(
    client,
    tokenizer,
    reward_fn,
    rows: list[dict],
    cfg: ArenoConfig,
    params: SamplingParams,
    vision: Any = None,
    *,
    samples: int = 1,
    base_seed: int = 0,
    on_row: Callable[[int, list[Trajectory]], None] | None = None,
) -> list[list[Trajectory]]:
    """``samples`` scored completions of every row, in row order; a sampled request (temperature
    > 0) of row i's sample j carries the seed ``base_seed + i * samples + j``. ``on_row(done,
    trajectories)``: called as each row's samples are all scored. Reward errors: one warning at the
    end, with their count (``warn_reward_errors``)."""

    async def row(i: int) -> tuple[int, list[Trajectory]]:
        return i, await ascore_samples(
            client, tokenizer, reward_fn, rows[i], cfg, params, vision, index=i, samples=samples, base_seed=base_seed
        )

    scored: list[list[Trajectory]] = [[] for _ in rows]
    # tasks made in row order: their requests reach the engine in that order (as_completed alone
    # would start them in the order of a set), so a held burst forms the same batches every time
    tasks = [asyncio.ensure_future(row(i)) for i in range(len(rows))]
    try:
        for done, next_row in enumerate(asyncio.as_completed(tasks), 1):
            i, trajectories = await next_row
            scored[i] = trajectories
            if on_row is not None:
                on_row(done, trajectories)
    except (Exception, asyncio.CancelledError):
        # the first failure ends the evaluation: the other rows' requests are cancelled and their own
        # errors collected (left running, each failing row logged "Task exception was never retrieved")
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    warn_reward_errors([t for ts in scored for t in ts], "the held-out rows", several=cfg.reward.several())
    return scored


async def ascore_samples(
    client,
    tokenizer,
    reward_fn,
    row: dict,
    cfg: ArenoConfig,
    params: SamplingParams,
    vision: Any = None,
    *,
    index: int,
    samples: int,
    base_seed: int,
) -> list[Trajectory]:
    """``samples`` scored completions of row ``index`` (``ascore_rows``' seeds), their ``group_id``
    the row's index."""

    def request(j: int):
        seed = base_seed + index * samples + j
        seeded = params if params.temperature == 0 else dataclasses.replace(params, seed=seed)
        return ascore_row(client, tokenizer, reward_fn, row, cfg, seeded, vision)

    trajectories = list(await asyncio.gather(*(request(j) for j in range(samples))))
    for t in trajectories:
        t.group_id = str(index)
    return trajectories


@contextlib.contextmanager
def held_burst(side: RolloutSide) -> Iterator[SeedingClient]:
    """A client of ``side`` whose next burst of requests starts in the engine as one batch, in
    arrival order (``SeedingClient.hold``): on CPU a forward's rounding depends on what shares its
    batch, so an evaluation held this way scores alike every time it runs, in a run or alone."""
    client = SeedingClient(side.client)
    side.pause()
    client.hold(side.resume)
    try:
        yield client
    finally:
        client.release_now()  # a no-op once the burst was released


def check_eval_seeds(base_seed: int, rows: int, samples: int, *, name: str) -> None:
    """The seeds ``ascore_rows`` gives (``base_seed`` up to ``base_seed + rows * samples - 1``) within
    the sampler's exact range: a ConfigError naming ``name`` otherwise (seeds past it would collide,
    and the samples of a row come out alike)."""
    last = base_seed + rows * samples - 1
    if base_seed < -MAX_SEED or last > MAX_SEED:
        raise ConfigError(
            f"{name}: seeds {base_seed}..{last} ({rows} rows x {samples} samples) leave the sampler's exact range "
            f"+-{MAX_SEED}: use a smaller seed"
        )


def eval_params(cfg: ArenoConfig, samples: int, temperature: float | None, *, name: str) -> SamplingParams:
    """The sampling of an evaluation: greedy for one sample without a temperature (the policy's plain
    argmax, without the rollouts' repetition penalty too), else the rollouts' (top-k, top-p, min-p,
    repetition penalty) at ``temperature`` (None: ``rollout.temperature``). Several greedy samples would
    repeat one completion: a ConfigError naming ``name`` (the setting that asked for them). The
    engine gives no text (``ascore_row`` decodes each completion once itself)."""
    r = cfg.rollout
    if samples == 1 and not temperature:
        return SamplingParams(temperature=0.0, max_new_tokens=r.max_new_tokens, detokenize=False)
    temperature = r.temperature if temperature is None else temperature
    if temperature == 0:
        raise ConfigError(
            f"{name}: {samples} samples at temperature 0 repeat one greedy completion: sample at a temperature > 0 "
            "(or take 1 sample)"
        )
    return rollout_sampling(cfg, temperature, detokenize=False)


def rollout_sampling(cfg: ArenoConfig, temperature: float | None = None, **extra: Any) -> SamplingParams:
    """The ``rollout`` section's sampling (temperature, top-p/k, min-p, repetition penalty, length) at
    ``temperature`` (None: ``rollout.temperature``), with ``extra`` ``SamplingParams`` fields."""
    r = cfg.rollout
    return SamplingParams(
        temperature=r.temperature if temperature is None else temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        min_p=r.min_p,
        repetition_penalty=r.repetition_penalty,
        max_new_tokens=r.max_new_tokens,
        **extra,
    )


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of the chance that at least one of k samples solves a row, from n samples
    of which c solved it: 1 - C(n - c, k) / C(n, k) (Chen et al. 2021), as a stable product."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_ks(n: int) -> list[int]:
    """The k of the reported ``pass@k``: powers of two up to n, and n."""
    ks = [1 << i for i in range(n.bit_length()) if 1 << i <= n]
    return ks if ks[-1] == n else [*ks, n]


MODEL_SCORE_INFO_KEY = "reward_model_score"
"""``Trajectory.info`` key of a held-out completion's reward-model score (unweighted), beside its reward."""


def add_model_scores(
    scored: list[list[Trajectory]], syncs: tuple[RewardSync, ...], score: Callable[[TokenBatch], dict[str, Any]]
) -> dict[str, float]:
    """The held-out completions' rewards with their reward models' weighted scores added, as a training step adds
    them (``with_model_rewards``): each trajectory's ``reward`` changed in place, its first model's unweighted score
    kept as ``info[MODEL_SCORE_INFO_KEY]``. ``score``: the scores of a packed batch of them (a training side's
    ``reward_scores``). Returns ``eval/<source>/score_mean`` and the like."""
    flat = [t for ts in scored for t in ts]
    if not syncs or not flat:
        return {}
    batch = TokenBatch.from_trajectories(flat)
    scores = score(batch)
    rewards_B, figures = with_model_rewards(torch.tensor([t.reward for t in flat]), syncs, scores, batch.truncated_B)
    for t, reward, model_score in zip(flat, rewards_B.tolist(), scores[syncs[0].source].tolist()):
        t.reward = reward
        t.info[MODEL_SCORE_INFO_KEY] = model_score
    return {f"eval/{key}": value for key, value in figures.items()}


def eval_metrics(
    rewards: list[list[float]],
    trajectories: list[list[Trajectory]],
    threshold: float,
    sources: list[tuple[str, int]] | tuple = (),
) -> dict[str, float]:
    """The summary of scored rows: ``rewards[i][j]`` of row i's sample j (every row has n). ``sources``:
    ``(name, rows)`` of consecutive runs of the rows (``datasets.eval_sources``, one held-out file each), whose
    accuracy, pass@k and row count are also given as ``eval/<name>/...``."""
    metrics = _summary(rewards, trajectories, threshold)
    start = 0
    for name, count in sources:
        part = _summary(rewards[start : start + count], trajectories[start : start + count], threshold)
        start += count
        for key in ("eval/accuracy", "eval/num_prompts", *(k for k in part if k.startswith("eval/pass@"))):
            metrics[f"eval/{name}/{key[len('eval/') :]}"] = part[key]
    return metrics


def _summary(rewards: list[list[float]], trajectories: list[list[Trajectory]], threshold: float) -> dict[str, float]:
    n = len(rewards[0])
    flat = [t for ts in trajectories for t in ts]
    metrics = {
        "eval/accuracy": sum(map(sum, rewards)) / (len(rewards) * n),
        "eval/num_prompts": float(len(rewards)),
        "eval/samples_per_prompt": float(n),
        "eval/reward_errors": float(sum("reward_error" in t.info for t in flat)),
        "eval/completion_tokens_mean": sum(len(t.completion_ids) for t in flat) / len(flat),
        "eval/truncated_fraction": sum(t.info.get("finish_reason") == "length" for t in flat) / len(flat),
        **reward_figure_means(flat, "eval/reward"),
    }
    solved = [sum(r >= threshold for r in rs) for rs in rewards]
    for k in pass_ks(n):
        metrics[f"eval/pass@{k}"] = sum(pass_at_k(n, c, k) for c in solved) / len(solved)
    return metrics
