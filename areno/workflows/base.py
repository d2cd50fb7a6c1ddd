"""The rollout workflow contract: how one dataset sample becomes trajectories.

A workflow talks to the rollout engine only through a ``RolloutClient`` (``await
client.agenerate(prompt_ids, sampling_params)``), so the same workflow runs colocated, partitioned,
in process or against a remote server. Users write their own workflow by subclassing
``RolloutWorkflow`` and naming it in the config by module path (``my_pkg.wf:MyWorkflow``) or file
(``./wf.py:MyWorkflow``), imported as ``reward.fn`` is (``load_workflow``).
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from areno.errors import ConfigError, RewardImportError
from areno.rewards.loader import import_object
from areno.rollout.client import RolloutClient
from areno.types import Trajectory

EpisodeResult = Trajectory | list[Trajectory] | None
"""What ``run_episode`` returns: one trajectory, a group (GRPO: n samples of one prompt), or None
to reject the sample (it is not trained on and does not count towards a batch)."""


class RolloutWorkflow(ABC):
    """Turns one dataset sample into trajectories by talking to the rollout engine.

    ``run_episode`` runs on the executor's event loop, concurrently with many other episodes, so it
    must not block: await the client, keep CPU work (reward functions) short. An exception raised
    here counts the episode as failed; the executor retries the sample a bounded number of times.
    """

    @abstractmethod
    async def run_episode(self, client: RolloutClient, sample: dict[str, Any]) -> EpisodeResult:
        """Run one episode for ``sample``; return a trajectory, a group of them, or None to reject."""

    def close(self) -> None:
        """Release what the workflow holds (a model of its own); called once when the run shuts down."""


def as_group(result: EpisodeResult) -> list[Trajectory] | None:
    """Normalise an episode result to a non-empty group, or None for a rejected sample."""
    if result is None:
        return None
    if isinstance(result, Trajectory):
        return [result]
    group = list(result)
    for item in group:
        if not isinstance(item, Trajectory):
            raise TypeError(f"run_episode returned a list holding {type(item).__name__}, expected Trajectory")
    return group or None


def _import_dotted(path: str, *, what: str = "rollout.workflow") -> Any:
    """Import ``path`` (``package.module.Name``, ``package.module:Name`` or ``./file.py:Name``) as
    ``reward.fn`` is imported; a one-line :class:`RewardImportError` naming ``what`` (the config key)
    when it does not resolve or its module fails to import."""
    return import_object(path, what=what)


def workflow_factory(dotted_path: str) -> Callable[..., RolloutWorkflow]:
    """The ``RolloutWorkflow`` subclass or factory function ``dotted_path`` names, imported; a
    :class:`RewardImportError` when it does not import or names something else."""
    obj = _import_dotted(dotted_path)
    if isinstance(obj, type) and not issubclass(obj, RolloutWorkflow):
        raise RewardImportError(
            f"rollout.workflow: {dotted_path!r} names class {obj.__name__}, which is not a subclass of "
            "areno.workflows.base.RolloutWorkflow"
        )
    if not callable(obj):
        raise RewardImportError(
            f"rollout.workflow: {dotted_path!r} names a {type(obj).__name__}, expected a RolloutWorkflow class"
        )
    return obj


def check_workflow_arguments(
    dotted_path: str, factory: Callable[..., RolloutWorkflow], kwargs: dict[str, Any], *, partial: bool = False
) -> None:
    """A :class:`ConfigError` naming an argument ``factory`` does not take, or (unless ``partial``: the
    engine adds its own arguments later) one it needs that ``kwargs`` lacks."""
    bind = inspect.signature(factory).bind_partial if partial else inspect.signature(factory).bind
    try:
        bind(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"workflow {dotted_path!r}: {exc} (check rollout.workflow_kwargs)") from None


def load_workflow(dotted_path: str, **kwargs: Any) -> RolloutWorkflow:
    """Build the workflow named by ``dotted_path`` (a ``RolloutWorkflow`` subclass, or a factory
    function returning an instance) with ``kwargs``; its arguments are checked before it is built."""
    factory = workflow_factory(dotted_path)
    check_workflow_arguments(dotted_path, factory, kwargs)
    workflow = factory(**kwargs)
    if not isinstance(workflow, RolloutWorkflow):
        raise RewardImportError(
            f"rollout.workflow: factory {dotted_path!r} returned {type(workflow).__name__}, expected a RolloutWorkflow"
        )
    return workflow
