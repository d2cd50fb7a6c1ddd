"""The rollout workflow contract: how one dataset sample becomes trajectories.

A workflow talks to the rollout engine only through a ``RolloutClient`` (``await
client.agenerate(prompt_ids, sampling_params)``), so the same workflow runs colocated, partitioned,
in process or against a remote server. Users write their own workflow by subclassing
``RolloutWorkflow`` and naming it in the config by module path (``my_pkg.wf:MyWorkflow``) or file
(``./wf.py:MyWorkflow``), imported as ``reward.fn`` is (``load_workflow``).
"""

from __future__ import annotations

import contextvars
import difflib
import inspect
import logging
import math
import os
import random
import re
import traceback
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from areno.errors import ConfigError, RewardImportError
from areno.rewards.loader import import_object
from areno.rewards.sandbox import as_reward
from areno.rollout.client import RolloutClient
from areno.types import Trajectory

logger = logging.getLogger(__name__)

EPISODE_SEED: contextvars.ContextVar[int] = contextvars.ContextVar("areno_episode_seed")
"""The seed of the episode running in this context, set by the engine from the sample's place in the
data order (training rollouts only): a workflow that draws its own random numbers seeds them from it,
so a resumed run draws what the uninterrupted one drew."""


class EpisodeSeeds:
    """The sampling seeds of an episode's unseeded requests, in the order they are made: ``seed``, ``seed + 1``, ..."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.calls = 0

    def next(self) -> int:
        self.calls += 1
        return self.seed + self.calls - 1


EPISODE_SEEDS: contextvars.ContextVar[EpisodeSeeds] = contextvars.ContextVar("areno_episode_seeds")
"""The running episode's seed stream (set with ``EPISODE_SEED`` by the engine's sample ledger)."""


def fork_episode_seeds(index: int) -> None:
    """Give the concurrent part ``index`` of an episode (one of an agent's n runs, a task of its own) a seed
    stream of its own, in this task's context: they drew from one stream in the order their requests
    arrived, which the timing decides, so a resumed or repeated run could sample otherwise."""
    seeds = EPISODE_SEEDS.get(None)
    if seeds is not None:
        EPISODE_SEEDS.set(EpisodeSeeds(random.Random(f"{seeds.seed}/part/{index}").getrandbits(52)))


EpisodeResult = Trajectory | list[Trajectory] | None
"""What ``run_episode`` returns: one trajectory, a group (GRPO: n samples of one prompt), or None
to reject the sample (it is not trained on and does not count towards a batch)."""

ENGINE_ARGUMENTS: dict[str, str] = {
    "tokenizer": "the policy's tokenizer",
    "reward_fn": "reward.fn",
    "n_samples": "rollout.n_samples",
    "sampling_params": "rollout.temperature, top_p, max_new_tokens, ...",
    "prompt_key": "data.prompt_key",
    "answer_key": "data.answer_key",
}
"""The keyword arguments the engine passes every workflow it builds (``ArenoEngine._build_executor``),
with the config they come from; ``rollout.workflow_kwargs`` come on top."""
DECLARED_ARGUMENTS = ("store", "teacher_path", "vision", "chat_template", "system_prompt", "chat_template_kwargs")
"""Arguments the engine passes only to a workflow that declares the parameter by name (and whose
``rollout.workflow_kwargs`` leave it unset): the observation store, the recipe's teacher checkpoint,
a vision-language model's ``VisionConfig``, ``data.chat_template``, ``data.system_prompt`` and
``data.chat_template_kwargs``."""


class WorkflowReturnError(TypeError):
    """``run_episode`` returned something other than a Trajectory, a list of them or None."""


class RolloutWorkflow(ABC):
    """Turns one dataset sample into trajectories by talking to the rollout engine.

    The engine builds it with keyword arguments ``ENGINE_ARGUMENTS`` (``tokenizer``, ``reward_fn``,
    ``n_samples``, ``sampling_params``, ``prompt_key``, ``answer_key``), those of
    ``DECLARED_ARGUMENTS`` that ``__init__`` names, and ``rollout.workflow_kwargs``: ``__init__``
    takes them, or ``**kwargs``.

    ``run_episode`` runs on the executor's event loop, concurrently with many other episodes, so it
    must not block: await the client, keep CPU work (reward functions) short. An exception raised
    here counts the episode as failed; the executor retries the sample a bounded number of times.
    """

    carries_routes: ClassVar[bool | None] = None
    """Whether the trajectories carry the rollout's MoE expert routes (``Trajectory.routes_TLK``, what
    ``train.moe_rollout_routes`` and ``moe_routing_replay`` train with), set by a class on itself
    (``declares_no_routes``): a subclass that overrides ``run_episode`` says nothing by inheriting it."""
    carries_reward_parts: ClassVar[bool | None] = None
    """Whether the trajectories carry each function's score of a ``reward.fn`` list (``REWARD_PARTS_INFO_KEY``,
    what ``advantage_estimator=gdpo`` trains with), set by a class on itself as ``carries_routes`` is
    (``declares_no_reward_parts``)."""

    @abstractmethod
    async def run_episode(self, client: RolloutClient, sample: dict[str, Any]) -> EpisodeResult:
        """Run one episode for ``sample``; return a trajectory, a group of them, or None to reject."""

    def close(self) -> None:
        """Release what the workflow holds (a model of its own); called once when the run shuts down."""


def declares_no_routes(factory: Callable[..., Any]) -> bool:
    """Whether the workflow class ``factory`` says of itself (not through a base class) that its trajectories
    drop the rollout's expert routes (``RolloutWorkflow.carries_routes``): then a run that trains with
    them is refused at start-up; otherwise at its first step, if they are missing (``routes_dropped``)."""
    return _declares_not(factory, "carries_routes")


def declares_no_reward_parts(factory: Callable[..., Any]) -> bool:
    """Whether the workflow class ``factory`` says of itself that its trajectories carry no per-function reward
    scores (``RolloutWorkflow.carries_reward_parts``): ``gdpo`` is then refused at start-up, not at its first step."""
    return _declares_not(factory, "carries_reward_parts")


def _declares_not(factory: Callable[..., Any], flag: str) -> bool:
    """Whether the workflow class ``factory`` sets ``flag`` False on itself (a subclass inherits no claim)."""
    return isinstance(factory, type) and factory.__dict__.get(flag) is False


def routes_dropped(key: str, workflow: str) -> ConfigError:
    """The error of ``key`` (``train.moe_rollout_routes`` or ``train.moe_routing_replay``) with a workflow
    whose trajectories drop the rollout's expert routes: it would train without them, unsaid."""
    return ConfigError(
        f"{key}: rollout.workflow={workflow} returns trajectories without the rollout's expert routes "
        "(RLVRWorkflow and MultiTurnWorkflow carry them); set "
        f"{key}=false or carry GenerationOutput.routes_TLK into Trajectory.routes_TLK"
    )


def as_group(result: EpisodeResult, *, source: str = "run_episode") -> list[Trajectory] | None:
    """Normalise an episode result to a non-empty group, or None for a rejected sample.

    A returned list is one group (the samples GRPO compares): its members whose ``group_id`` is
    empty get one id, new for each call, so a workflow that leaves the ids out still trains (an
    empty id would make each trajectory a group of its own, every advantage 0). Ids the workflow
    set are kept. Anything else than a Trajectory, a list (or tuple) of them or None is a
    :class:`WorkflowReturnError` naming ``source`` and the returned type."""
    if result is None:
        return None
    if isinstance(result, Trajectory):
        group = [result]
    elif isinstance(result, (list, tuple)):
        group = list(result)
        bad = next((i for i, item in enumerate(group) if not isinstance(item, Trajectory)), None)
        if bad is not None:
            raise WorkflowReturnError(
                f"{source} returned a {type(result).__name__} holding {type(group[bad]).__name__} at [{bad}]; "
                "return a Trajectory, a list of Trajectory, or None"
            )
    else:
        raise WorkflowReturnError(
            f"{source} returned {type(result).__name__}; return a Trajectory, a list of Trajectory, or None"
        )
    group_id = uuid.uuid4().hex
    for traj in group:
        _check_reward(traj, source)
        if not traj.group_id:
            traj.group_id = group_id
    return group or None


def _check_reward(traj: Trajectory, source: str) -> None:
    """``traj.reward`` as a float: a one-element tensor or array, or any real number, is taken, anything else is a
    :class:`WorkflowReturnError` naming ``source``; a NaN or infinite one is scored 0 with
    ``info["reward_error"]`` (warned about per batch and counted in ``rollout/reward_nonfinite``, as a
    reward function's), not left to turn its group's advantages into 0 or NaN."""
    reward = traj.reward
    one_element_array = type(reward).__module__ == "numpy" and getattr(reward, "size", None) == 1
    if (isinstance(reward, torch.Tensor) and reward.numel() == 1) or one_element_array:
        reward = reward.item()  # a scorer's tensor or array result, as the batch packing took it
    if inspect.isawaitable(reward):
        if inspect.iscoroutine(reward):
            reward.close()  # no "never awaited" warning beside the error
        raise WorkflowReturnError(
            f"{source} set Trajectory.reward to a coroutine, not a number: await it "
            "(reward = await self.reward_fn(...))"
        )
    try:
        reward = as_reward(reward)  # what a reward function may return (numpy's bools and numbers too)
    except TypeError:
        raise WorkflowReturnError(
            f"{source} set Trajectory.reward to {type(reward).__name__} {reward!r:.40}, not a number: set a float"
        ) from None
    if not math.isfinite(reward):
        traj.info = {**traj.info, "reward_error": f"{source} set Trajectory.reward to {reward}: scored 0"}
        traj.info[NONFINITE_REWARD_KEY] = True
        reward = 0.0
    traj.reward = reward


NONFINITE_REWARD_KEY = "reward_nonfinite"
"""``Trajectory.info`` key marking a reward its workflow set to NaN or inf, scored 0 (``_check_reward``)."""


def run_episode_name(workflow: RolloutWorkflow) -> str:
    """How a workflow's ``run_episode`` is named in messages (``MyWorkflow.run_episode``): the
    ``source`` of :func:`as_group` wherever the engine runs one."""
    return f"{type(workflow).__qualname__}.run_episode"


def check_run_episode(dotted_path: str, cls: type) -> None:
    """A one-line :class:`ConfigError` when workflow class ``cls`` (named ``dotted_path``) has a
    plain ``def run_episode``: the executor awaits what it returns, so every episode would fail with
    "object ... can't be used in 'await' expression", each sample retried, then dropped. An abstract
    one is left to ``RolloutWorkflow``'s ABC, which refuses to build the class."""
    run = getattr(cls, "run_episode", None)
    if run is None or getattr(run, "__isabstractmethod__", False) or inspect.iscoroutinefunction(run):
        return
    raise ConfigError(
        f"rollout.workflow: {dotted_path}: {cls.__qualname__}.run_episode must be 'async def' (the executor "
        "awaits it): write `async def run_episode(self, client, sample)`"
    )


def raised_in_workflow(workflow: RolloutWorkflow, exc: BaseException) -> bool:
    """Whether ``exc`` came from the workflow's own code: the innermost frame of its traceback is in
    the file that defines the workflow's class (a failed episode is then the workflow's to fix, not
    the rollout engine's or a server's)."""
    try:
        source = inspect.getsourcefile(type(workflow))
    except TypeError:  # a class defined in C or at the prompt: no file to compare with
        return False
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(source and frames) and os.path.realpath(frames[-1].filename) == os.path.realpath(source)


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
    dotted_path: str, factory: Callable[..., RolloutWorkflow], workflow_kwargs: dict[str, Any]
) -> None:
    """A one-line :class:`ConfigError` for what building ``factory`` as the engine does would meet:
    a class whose ``run_episode`` is not ``async def`` (``check_run_episode``), a ``workflow_kwargs``
    key the engine sets itself, an argument the factory does not take (one of
    the engine's, or ``rollout.workflow_kwargs.<key>``), or one it needs that nobody passes.

    A factory function taking ``**kwargs`` whose return annotation names a concrete RolloutWorkflow
    class with an ``__init__`` of its own (``def my_workflow(**kwargs) -> AgentWorkflow``) has the
    arguments it does not name itself checked against that ``__init__`` (``_check_forwarded``): a
    close misspelling of a parameter is refused, anything else only warned about, as the factory
    may use it itself or return a subclass that takes it. The engine checks them all again when
    it builds the workflow (``load_workflow``)."""
    for key in workflow_kwargs:
        if key in ENGINE_ARGUMENTS:
            raise ConfigError(
                f"rollout.workflow_kwargs.{key}: the engine passes {key} to every workflow itself (from "
                f"{ENGINE_ARGUMENTS[key]}): remove it from rollout.workflow_kwargs"
            )
    if isinstance(factory, type):
        check_run_episode(dotted_path, factory)
    declared = [name for name in DECLARED_ARGUMENTS if name not in workflow_kwargs and _names(factory, name)]
    given = [*ENGINE_ARGUMENTS, *declared, *workflow_kwargs]
    _check_binds(repr(dotted_path), factory, given, missing=True)
    target = _forwarded_class(factory)
    if target is not None:
        own = set(inspect.signature(factory).parameters)
        _check_forwarded(dotted_path, factory, target, [k for k in given if k not in own])
    check_values = getattr(factory, CHECK_KWARGS_ATTR, None)
    if check_values is not None:  # the factory's own values (a tool list it imports), before any model loads
        check_values(workflow_kwargs)


CHECK_KWARGS_ATTR = "check_workflow_kwargs"
"""A workflow factory's optional attribute: a function of ``rollout.workflow_kwargs`` raising a one-line
:class:`ConfigError` for a value that cannot work (``tool_workflow``'s tools), which preflight calls before the
model loads (``check_workflow_arguments``)."""


def _names(factory: Callable[..., Any], name: str) -> bool:
    """Whether ``factory`` takes an argument ``name`` by keyword (not only through ``**kwargs``)."""
    param = inspect.signature(factory).parameters.get(name)
    return param is not None and param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)


def _check_binds(what: str, factory: Callable[..., Any], given: list[str], *, missing: bool) -> None:
    """A :class:`ConfigError` unless ``factory`` (named ``what``) takes every name in ``given`` by
    keyword and (with ``missing``) needs no argument besides them."""
    params = inspect.signature(factory).parameters
    by_keyword = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        engine = [k for k in given if k in ENGINE_ARGUMENTS and k not in by_keyword]
        if engine:
            untaken = "the engine's arguments" if len(engine) == len(ENGINE_ARGUMENTS) else ", ".join(engine)
            raise ConfigError(
                f"rollout.workflow: {what} does not take {untaken}; the engine builds every workflow "
                f"with keyword arguments {', '.join(ENGINE_ARGUMENTS)} (and {', '.join(DECLARED_ARGUMENTS)} where "
                "__init__ names them) plus rollout.workflow_kwargs: accept them as parameters or with **kwargs"
            )
        unknown = [k for k in given if k not in by_keyword]
        if unknown:
            own = [k for k in by_keyword if k not in ENGINE_ARGUMENTS]
            raise ConfigError(
                f"rollout.workflow_kwargs.{unknown[0]}: workflow {what} takes no argument {unknown[0]!r}; "
                f"it takes {', '.join(own) if own else 'only the engine arguments'}"
            )
    if missing:
        needed = [
            n
            for n, p in params.items()
            if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and n not in given
        ]
        if needed:
            raise ConfigError(
                f"rollout.workflow_kwargs.{needed[0]}: workflow {what} needs argument {needed[0]!r}: set it in "
                "rollout.workflow_kwargs"
            )


def _forwarded_class(factory: Callable[..., Any]) -> type | None:
    """The RolloutWorkflow class that a factory function taking ``**kwargs`` says it returns (its
    return annotation), where the arguments it does not name go; None when it says none, or when
    its ``__init__`` says nothing to check them against: an abstract class (``-> RolloutWorkflow``
    for a factory choosing among several), one without an ``__init__`` of its own, one taking
    ``**kwargs``."""
    if isinstance(factory, type):
        return None
    signature = inspect.signature(factory)
    if not any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values()):
        return None
    returned = signature.return_annotation
    if isinstance(returned, str):  # postponed annotations (from __future__ import annotations)
        try:
            # evaluated as typing.get_type_hints does, but the return annotation alone: a parameter's
            # annotation that only a type checker resolves does not stop it
            returned = eval(returned, getattr(factory, "__globals__", {}))
        except (NameError, AttributeError, SyntaxError):  # a name only a type checker sees: nothing to follow
            return None
    if not (isinstance(returned, type) and issubclass(returned, RolloutWorkflow)):
        return None
    if inspect.isabstract(returned) or returned.__init__ is object.__init__:
        return None
    if any(p.kind == p.VAR_KEYWORD for p in inspect.signature(returned).parameters.values()):
        return None
    return returned


def _check_forwarded(dotted_path: str, factory: Callable[..., Any], target: type, forwarded: list[str]) -> None:
    """Check the arguments a factory forwards through ``**kwargs`` against ``target`` (what its
    return annotation names). The annotation says what the factory returns, not that every argument
    reaches that class: the factory may pop one for itself (``kwargs.pop("depth", 3)``) or return a
    subclass taking more. So a name ``target`` does not take is refused only when it is a close
    misspelling of a parameter (of ``target`` or of the factory) that the factory's source does not
    mention (``gama`` for ``gamma``); any other, and any where the source cannot be read, is a
    warning, once per process."""
    factory_params = inspect.signature(factory).parameters
    params = inspect.signature(target).parameters
    taken = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    known = [*taken, *(n for n, p in factory_params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))]
    source = _source(factory)
    what = f"workflow {dotted_path!r} (its **kwargs go to {target.__name__})"
    for key in forwarded:
        if key in taken or (source is not None and re.search(rf"\b{re.escape(key)}\b", source)):
            continue  # taken, or the factory names it (it may use it itself): build time tells
        close = difflib.get_close_matches(key, known, n=1)
        user = key not in ENGINE_ARGUMENTS and key not in DECLARED_ARGUMENTS
        if user and close and source is not None:
            own = [k for k in taken if k not in ENGINE_ARGUMENTS]
            raise ConfigError(
                f"rollout.workflow_kwargs.{key}: {what} takes no argument {key!r} (did you mean {close[0]!r}?); "
                f"it takes {', '.join(own) if own else 'only the engine arguments'}"
            )
        if (dotted_path, key) not in _warned_forwarded:
            _warned_forwarded.add((dotted_path, key))
            logger.warning(
                "%s: %s takes no argument %r; building the workflow fails unless the factory uses it itself or "
                "returns a class that takes it",
                f"rollout.workflow_kwargs.{key}" if user else "rollout.workflow",
                what,
                key,
            )


_warned_forwarded: set[tuple[str, str]] = set()
"""(rollout.workflow, argument) pairs ``_check_forwarded`` warned about in this process: preflight
runs twice for one run, and the warning is said once."""


def _source(factory: Callable[..., Any]) -> str | None:
    """The source of ``factory``; None when Python cannot show it (nothing then says an argument is
    unused)."""
    try:
        return inspect.getsource(factory)
    except (OSError, TypeError):
        return None


_BAD_ARGUMENT = re.compile(r"(?:keyword argument|arguments?:) '(\w+)'")
"""The argument a TypeError from a call names ("unexpected keyword argument 'x'", "multiple values
for keyword argument 'x'", "missing 1 required keyword-only argument: 'x'")."""


def load_workflow(dotted_path: str, **kwargs: Any) -> RolloutWorkflow:
    """Build the workflow named by ``dotted_path`` (a ``RolloutWorkflow`` subclass, or a factory
    function returning an instance) with ``kwargs`` (the engine's arguments and
    ``rollout.workflow_kwargs``); its arguments are checked before it is built, and a TypeError
    from binding them (an argument a factory forwards that its target does not take) is a
    :class:`ConfigError` naming the argument. A TypeError from inside the workflow's own code is
    its bug: raised unchanged, with its traceback."""
    factory = workflow_factory(dotted_path)
    _check_binds(repr(dotted_path), factory, list(kwargs), missing=True)
    try:
        workflow = factory(**kwargs)
    except TypeError as exc:
        key = _bound_argument(exc, factory, kwargs)
        if key is None:
            raise
        user = bool(key) and key not in ENGINE_ARGUMENTS and key not in DECLARED_ARGUMENTS
        where = f"rollout.workflow_kwargs.{key}" if user else "rollout.workflow"
        raise ConfigError(
            f"{where}: building workflow {dotted_path!r} failed: {exc} (check rollout.workflow_kwargs; the engine "
            f"passes {', '.join(ENGINE_ARGUMENTS)} itself)"
        ) from exc
    if not isinstance(workflow, RolloutWorkflow):
        raise RewardImportError(
            f"rollout.workflow: factory {dotted_path!r} returned {type(workflow).__name__}, expected a RolloutWorkflow"
        )
    check_run_episode(dotted_path, type(workflow))  # a factory's class is known only now
    return workflow


def _bound_argument(exc: TypeError, factory: Callable[..., Any], kwargs: dict[str, Any]) -> str | None:
    """The argument (``""`` when it names none) of a TypeError that building ``factory`` with
    ``kwargs`` raised while binding them: at the call itself (no frame below it), naming one of
    ``kwargs`` (a factory or ``super().__init__`` forwarded it to something that does not take it),
    or naming a parameter the class a factory forwards to needs (nobody passed it). None for any
    other TypeError: one raised inside the workflow's own code."""
    match = _BAD_ARGUMENT.search(str(exc))
    key = match.group(1) if match else None
    if exc.__traceback__ is not None and exc.__traceback__.tb_next is None:
        return key or ""
    if key is None:
        return None
    if key in kwargs:
        return key
    target = _forwarded_class(factory)
    needed = inspect.signature(target).parameters.get(key) if target is not None else None
    return key if needed is not None and needed.default is needed.empty else None
