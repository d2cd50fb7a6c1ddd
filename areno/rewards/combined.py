"""Several reward functions scored as one: ``reward.fn`` as a list, with ``reward.weights`` (TRL's
``reward_funcs`` and ``reward_weights``).

The reward is the weighted sum of the functions' scores, added in ``reward.fn``'s order (TRL's default
``multi_objective_aggregation="sum_then_normalize"``: the advantage estimator then normalises the sum as
it does any reward; TRL adds float32 tensors, areno Python floats). Each function's own score, unweighted,
is a named figure under the function's name (``part_names``): ``rollout/reward/<name>_mean``. The other
figures a function returns beside its score (``{"score": ..., "<figure>": ...}``) are logged under
``<name>/<figure>`` (``rollout/reward/<name>/<figure>_mean``): a name holds no ``/``, so no two
functions' figures, nor a figure and a function's score, can share a key.

Each function is loaded as a single ``reward.fn`` is (in-process, or its own sandbox pool) and fails
alone, as a single function does: one that raises, crashes or hangs scores 0 for its part (a sandboxed
one counted in ``rollout/reward_failures_<kind>``), the others' scores and figures are kept, and the
completion's reward is the weighted sum with that part 0, its error recorded
(``areno.workflows.common.ascore_reward``)."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Sequence
from typing import Any

from areno.rewards.sandbox import reward_parts


def function_name(path: str) -> str:
    """The name of the function ``path`` names: what follows its ``:`` (else its last ``.``), its last
    attribute (``pkg.mod:Class.method`` is ``method``)."""
    module, sep, attr = path.partition(":")
    if not sep:
        attr = path.rpartition(".")[2]
    return attr.rpartition(".")[2]


def part_names(paths: Sequence[str]) -> list[str]:
    """The figure name of each function of ``paths``: its name (``function_name``), the second of a name
    ``name_2``, the third ``name_3`` (skipping any that another function is named), so every function
    has its own, the same in every run of the list."""
    bases = [function_name(p) for p in paths]
    taken: set[str] = set()
    names = []
    for base in bases:
        name, k = base, 2
        while name in taken or (name != base and name in bases):
            name, k = f"{base}_{k}", k + 1
        taken.add(name)
        names.append(name)
    return names


def weighted_sum(values: Sequence[float], weights: Sequence[float]) -> float:
    """``sum(w * v)``, added left to right from 0.0 (a single function's ``w * v`` exactly)."""
    total = 0.0
    for weight, value in zip(weights, values, strict=True):
        total += weight * value
    return total


def part_figures(
    names: Sequence[str], values: Sequence[float], figures: Sequence[dict[str, float]]
) -> dict[str, float]:
    """The named figures of the functions' results: each function's score under its name, and each figure
    it returned beside its score under ``<name>/<figure>``."""
    out: dict[str, float] = {}
    for name, value, extras in zip(names, values, figures, strict=True):
        out[name] = value
        out.update({f"{name}/{figure}": v for figure, v in extras.items()})
    return out


class WeightedRewards:
    """The functions of ``reward.fn``'s list, each loaded (``rewards``: ``InProcessReward`` or
    ``RewardSandbox``), scored as their weighted sum. The workflows score it through
    ``areno.workflows.common.ascore_reward``, which calls every function, keeps what each gave and
    records the failures; called directly (``await reward_fn(prompt, completion, answer, **row)``, as an
    agent's ``client.reward_fn`` does) it returns the weighted sum, and a function's failure raises."""

    def __init__(self, paths: Sequence[str], rewards: Sequence[Any], weights: Sequence[float]) -> None:
        assert len(paths) == len(rewards) == len(weights)  # RewardSection checks the weights' count
        self.paths = list(paths)
        self.names = part_names(paths)
        self.rewards = list(rewards)
        self.weights = [float(w) for w in weights]

    async def __call__(self, prompt: Any, completion: str, answer: Any = None, **fields: Any) -> float:
        values = await asyncio.gather(*(_acall(r, prompt, completion, answer, fields) for r in self.rewards))
        return weighted_sum([reward_parts(v)[0] for v in values], self.weights)

    def __repr__(self) -> str:
        parts = ", ".join(f"{w:g} * {p}" for w, p in zip(self.weights, self.paths))
        return f"WeightedRewards({parts})"


async def _acall(reward: Any, prompt: Any, completion: str, answer: Any, fields: dict[str, Any]) -> Any:
    value = reward(prompt, completion, answer, **fields)
    return await value if inspect.isawaitable(value) else value
