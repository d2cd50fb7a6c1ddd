"""Helpers shared by the shipped workflows: field lookup with clear errors, safe reward calls."""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from areno.rewards.combined import WeightedRewards, part_figures, weighted_sum
from areno.rewards.sandbox import is_finite_reward, reward_parts
from areno.rollout.client import raise_if_cancelled
from areno.types import REWARD_PARTS_INFO_KEY, Trajectory
from areno.workflows.base import _import_dotted

logger = logging.getLogger("areno.workflows")

RewardFn = Callable[..., float]
"""``reward_fn(prompt, completion: str, answer, **sample_fields) -> float`` (may be async; or a mapping with
the reward under ``"score"`` and named figures beside it, ``reward_parts``); ``prompt`` is the row's prompt
as the dataset holds it: a string or a list of role/content messages."""

REWARD_FIGURES_KEY = "reward_figures"
"""``Trajectory.info`` key of the named figures its reward function returned beside the reward (logged as
``rollout/reward/<name>_mean``)."""


REWARD_FAILED_PARTS_KEY = "reward_failed_parts"
"""``Trajectory.info`` key of the functions of a ``reward.fn`` list that failed on it (their figure names, and
``WEIGHTED_SUM_PART`` where the sum itself was not finite): the run stops on one that fails on every call
(``ArenoEngine._check_rewards``), not on rows that each lost some function."""
WEIGHTED_SUM_PART = "(weighted sum)"
"""``REWARD_FAILED_PARTS_KEY``'s name of a weighted sum beyond float32 (no function's failure: the weights')."""


class RewardScore(NamedTuple):
    """What one reward call gave: the reward (0 where it failed), the error, the named figures, and of a
    ``reward.fn`` list the functions that failed (``REWARD_FAILED_PARTS_KEY``)."""

    value: float
    error: str | None
    figures: dict[str, float]
    failed_parts: tuple[str, ...] = ()
    part_scores: tuple[float, ...] = ()
    """A ``reward.fn`` list's scores, unweighted, in its order (``REWARD_PARTS_INFO_KEY``: what an advantage
    estimator that normalises each function on its own reads)."""

    def into(self, info: dict[str, Any]) -> dict[str, Any]:
        """``info`` with the call's error, figures and failed parts under their keys (where there are any)."""
        if self.error is not None:
            info["reward_error"] = self.error
        if self.figures:
            info[REWARD_FIGURES_KEY] = self.figures
        if self.failed_parts:
            info[REWARD_FAILED_PARTS_KEY] = list(self.failed_parts)
        if self.part_scores:
            info[REWARD_PARTS_INFO_KEY] = list(self.part_scores)
        return info


def describe_sample(sample: dict[str, Any], limit: int = 80) -> str:
    """A short name for a dataset row in messages: its id when it has one, else a truncated repr."""
    for key in ("id", "uid", "index", "idx"):
        if key in sample:
            return f"row {key}={sample[key]!r}"
    text = repr(sample)
    return f"row {text[:limit]}{'...' if len(text) > limit else ''}"


def require_field(sample: dict[str, Any], key: str) -> Any:
    """``sample[key]``, or a ValueError naming the missing field, the row and the fix."""
    if not isinstance(sample, dict):
        raise ValueError(f"dataset rows must be dicts, got {type(sample).__name__}: {sample!r:.80}")
    if key not in sample:
        raise ValueError(
            f"dataset {describe_sample(sample)} has no field {key!r} (fields: {sorted(sample)}); "
            f"set prompt_key to the field that holds the prompt"
        )
    return sample[key]


class NonFiniteReward(ValueError):
    """A reward returned NaN, ±inf or a value beyond float32 (it would poison the batch's mean)."""


_failed_rewards: dict[int, Any] = {}
"""The reward functions (by ``id``, held so the id stays theirs) whose first failure was warned in
full, once per process (a run's, or each rollout worker process's): later ones are logged at DEBUG,
and summed up once per batch (``warn_reward_errors``)."""


async def acall_reward(
    reward_fn: RewardFn, prompt: str, completion: str, answer: Any, fields: dict[str, Any]
) -> tuple[float, str | None]:
    """``ascore_reward``'s reward and error (for callers that log no figures)."""
    score = await ascore_reward(reward_fn, prompt, completion, answer, fields)
    return score.value, score.error


async def ascore_reward(
    reward_fn: RewardFn, prompt: str, completion: str, answer: Any, fields: dict[str, Any], *, part: str | None = None
) -> RewardScore:
    """Call the user's reward function; a raising reward, or one returning something other than a
    number or a bool (a str, None), or a non-finite value (sandboxed: a ``nonfinite`` failure,
    counted), gives ``(0.0, error)``, so one bad row never kills a run but is never silent either:
    the first failure of each reward function in this process is warned about with its prompt,
    completion and row fields; later ones are logged at DEBUG and counted, a batch's in one warning
    (``warn_reward_errors``), so a reward that fails on every row does not flood the log.

    Several functions (``reward.fn`` as a list: a ``WeightedRewards``) are each scored so, together:
    the reward is their weighted sum, a failed one's part 0 (``ascore_weighted``); ``part`` names one of
    them (``reward.fn[1] (path)``) in its first failure's warning."""
    raise_if_cancelled()  # a cancelled episode (Python 3.11's wait_for lost the cancel) calls no reward
    if isinstance(reward_fn, WeightedRewards):
        return await ascore_weighted(reward_fn, prompt, completion, answer, fields)
    try:
        value = reward_fn(prompt, completion, answer, **fields)
        if inspect.isawaitable(value):
            value = await value
        # a str or None is a reward error, not coerced (a bool counts 1 / 0); a mapping holds named figures too
        value, figures = reward_parts(value)
        if not is_finite_reward(value):
            raise NonFiniteReward(f"reward returned {value!r}; it must be a finite float")
        return RewardScore(value, None, figures)
    # user code: counted (info["reward_error"]) and warned, not hidden; sys.exit() or a KeyboardInterrupt it
    # raises too (they would end the rollout loop's task and hang the run); signals reach the main thread
    # only, so a KeyboardInterrupt there (an evaluation's reward) is the user's Ctrl-C and stops the run
    except (Exception, SystemExit, KeyboardInterrupt) as exc:
        if isinstance(exc, KeyboardInterrupt) and threading.current_thread() is threading.main_thread():
            raise
        error = f"{type(exc).__name__}: {exc}"
        first = id(reward_fn) not in _failed_rewards
        _failed_rewards.setdefault(id(reward_fn), reward_fn)
        logger.log(
            logging.WARNING if first else logging.DEBUG,
            "reward function %sfailed for prompt %r, completion %r, fields %r: %s; %s set to 0%s",
            "" if part is None else f"{part} ",
            prompt[:200],
            completion[:200],
            sorted(fields),
            error,
            "reward" if part is None else "its part of the reward",
            " (its later failures are counted: one warning per batch, rollout/reward_errors)" if first else "",
        )
        return RewardScore(0.0, error, {})


async def ascore_weighted(
    reward: WeightedRewards, prompt: str, completion: str, answer: Any, fields: dict[str, Any]
) -> RewardScore:
    """``reward``'s functions each scored by ``ascore_reward`` (at once: sandboxed ones run side by side),
    as a single function is, so one that fails scores 0 for its part alone. The reward is the weighted sum
    of their scores (``weighted_sum``); the figures are each function's score under its name and its own
    figures under ``<name>/<figure>`` (``part_figures``: a failed one's score 0, no figures of its own); the
    error, where any failed, each failed one's, prefixed with its name. A sum beyond float32 (weights too
    large) is a reward error scored 0, the parts' figures kept."""
    several = len(reward.rewards) > 1  # one function with a weight: its failure is the reward's, as a plain one's
    scores = await asyncio.gather(
        *(
            ascore_reward(r, prompt, completion, answer, fields, part=f"reward.fn[{i}] ({path})" if several else None)
            for i, (r, path) in enumerate(zip(reward.rewards, reward.paths))
        )
    )
    values = [s.value for s in scores]
    figures = part_figures(reward.names, values, [s.figures for s in scores])
    parts = [name for name, s in zip(reward.names, scores) if s.error is not None]
    failed = [f"{name}: {s.error}" for name, s in zip(reward.names, scores) if s.error is not None]
    total = weighted_sum(values, reward.weights)
    if not is_finite_reward(total):
        failed.append(f"NonFiniteReward: the weighted sum of reward.fn's scores is {total!r}: lower reward.weights")
        parts.append(WEIGHTED_SUM_PART)
        total = 0.0
    return RewardScore(total, "; ".join(failed) if failed else None, figures, tuple(parts), tuple(values))


def reward_figure_means(trajectories: list[Trajectory], prefix: str) -> dict[str, float]:
    """``<prefix>/<name>_mean`` of each named figure the reward function returned beside the reward, over
    the trajectories that have it (``REWARD_FIGURES_KEY``; a failed call has none)."""
    sums: dict[str, list[float]] = {}
    for t in trajectories:
        for name, value in t.info.get(REWARD_FIGURES_KEY, {}).items():
            sums.setdefault(name, []).append(value)
    return {f"{prefix}/{name}_mean": sum(values) / len(values) for name, values in sorted(sums.items())}


def warn_reward_errors(trajectories: Sequence[Trajectory], batch: str, *, several: bool = False) -> None:
    """One warning for the reward errors among ``trajectories`` (``info["reward_error"]``), if any:
    how many of them, and the last error's first line. ``batch`` names them (``"step 3's rollout
    batch"``); ``several``: ``reward.fn`` lists several functions, of which a failed one lost only its part."""
    errors = [t.info["reward_error"] for t in trajectories if "reward_error" in t.info]
    if errors:
        scored = "a failed function's part scored 0, the others' kept" if several else "each scored 0"
        logger.warning(
            "reward function failed on %d of %d completions of %s (%s); last error: %s",
            len(errors),
            len(trajectories),
            batch,
            scored,
            next(iter(errors[-1].splitlines()), ""),
        )


def sample_fields(sample: dict[str, Any], *exclude: str) -> dict[str, Any]:
    """The row's other fields, passed to the reward function as keyword arguments."""
    return {k: v for k, v in sample.items() if k not in exclude}


def takes_store(workflow: Any) -> bool:
    """Whether a workflow class or factory (or its dotted path) declares a ``store`` parameter.

    Only an explicitly named ``store`` counts: a factory taking ``**kwargs`` is not assumed to
    forward it (``store`` would reach a constructor that rejects it)."""
    return takes_param(workflow, "store")


def prompt_kwargs(
    workflow: Any,
    workflow_kwargs: dict[str, Any],
    *,
    chat_template: str,
    system_prompt: str | None,
    chat_template_kwargs: dict | None = None,
) -> dict[str, Any]:
    """``data.chat_template`` / ``data.system_prompt`` / ``data.chat_template_kwargs`` for a workflow (class,
    factory or dotted path) that declares those parameters and whose ``workflow_kwargs`` do not set them; a
    custom workflow that renders its own prompts gets none."""
    given = {
        "chat_template": chat_template,
        "system_prompt": system_prompt,
        "chat_template_kwargs": chat_template_kwargs or {},
    }
    return {k: v for k, v in given.items() if k not in workflow_kwargs and takes_param(workflow, k)}


def takes_param(workflow: Any, name: str) -> bool:
    """Whether a workflow class or factory (or its dotted path) declares parameter ``name``."""
    if isinstance(workflow, str):
        workflow = _import_dotted(workflow)
    target = workflow.__init__ if isinstance(workflow, type) else workflow
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):  # builtins without a signature
        return False
    p = params.get(name)
    return p is not None and p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def store_kwargs(workflow: Any, store: Any, workflow_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """``{"store": store}`` when the workflow (class, factory or dotted path) takes ``store=`` and
    ``workflow_kwargs`` does not set it already, else ``{}``; for the engine building the workflow
    that its ``WorkflowExecutor`` (which releases the references of dropped groups) shares::

        load_workflow(path, **engine_kwargs, **store_kwargs(path, store, workflow_kwargs), **workflow_kwargs)
    """
    if store is None or (workflow_kwargs and "store" in workflow_kwargs) or not takes_store(workflow):
        return {}
    return {"store": store}


def teacher_kwargs(workflow: Any, recipe: Any, workflow_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``{"teacher_path": DIR}`` for a workflow that takes ``teacher_path`` (the teacher-executing
    rollout) when ``workflow_kwargs`` leaves it unset and the recipe has a role with its own
    checkpoint (the teacher: ``ModelRole.requires_model_path``), else ``{}``."""
    if "teacher_path" in workflow_kwargs or not takes_param(workflow, "teacher_path"):
        return {}
    paths = [role.model_path for role in recipe.roles if role.requires_model_path and role.model_path]
    return {"teacher_path": paths[0]} if paths else {}
