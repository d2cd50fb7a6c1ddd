"""The ``ModelSpecialization`` contract: everything algorithm-specific about one model role.

The training backend (``areno/train``) is identical for every algorithm; a role's specialization
tells it what to compute. One training step of a role is:

    batch = spec.prepare_batch(rollout_data)            # whole batch: advantages, filters, targets
    backend.train_step(batch, forward_fn=spec.extract_model_output,
                       loss_fn=spec.compute_loss, denominator_fn=spec.denominator)

and a frozen role only ever runs ``backend.forward_only(batch, forward_fn=spec.extract_model_output)``
to supply tensors to another role (a ``DataSync``).

Departure from seed 004: there ``prepare_batch`` returns a list of micro-batch dicts. Here it
returns one packed ``TokenBatch`` for the whole step and the *backend* cuts it into token-budget
micro-batches (``areno/train/packing.py``), because only the backend knows the memory budget and
the data-parallel layout. Anything that needs the whole batch (group advantages, batch
normalisation, dynamic sampling) therefore happens in ``prepare_batch``; ``compute_loss`` sees one
micro-batch and returns a loss already divided by the *global* denominator through the
``reducer``, so gradients do not depend on how the batch was cut.

Legend: B = sequences, T = packed tokens, V = vocabulary, D = hidden size.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import typing
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from areno.errors import ConfigError, UserError, is_of_type, wrong_type
from areno.types import TokenBatch

Reducer = Callable[..., torch.Tensor]
"""``reducer(values, mask=None) -> (values * mask).sum() / global_denominator`` (a 0-dim tensor)."""

POLICY_VERSION_KEY = "policy_version_B"
"""Batch extra key the RecipeRunner fills with the role's weight version before the step (the
proximal version of decoupled PPO's loglinear method, the step of a beta schedule)."""

DENOMINATOR_CARRY_KEY = "denominator_carry_B"
"""Batch extra key (per sequence) the RecipeRunner adds when it leaves a step's gradient-free sequences
out (``ModelSpecialization.gradient_free_B``): their share of the global loss denominator, carried by the
first sequence kept (zeros elsewhere), so the loss and its gradient are the whole batch's."""

RUN_SET_OPTIONS: dict[str, str] = {
    "temperature": "rollout.temperature (train.eval_temperature for held-out evaluation)",
    "reward_weights": "reward.weights",
}
"""Role options the run sets itself (option -> the setting that gives it), never ``train.algorithm_kwargs``:
in an online recipe every role that takes a ``temperature`` (the policy, a reference, a teacher) scores
the rollout's tokens at the temperature they were sampled at, and a policy whose advantages weigh each
function of a ``reward.fn`` list (``gdpo``) takes ``reward.weights`` (``areno.engine.api.resolve_recipe``)."""

Metrics = dict[str, torch.Tensor]
"""Metric name -> 0-dim tensor already divided by the global denominator (through the reducer), so
the backend sums it over micro-batches and ranks to get the step's value."""


class ModelSpecialization(ABC):
    """What one model role computes. Subclasses are named by function (``ActorSpecialization``,
    ``CriticSpecialization``, …) and chosen by ``ModelRole.specialization_cls``.

    Class attributes declare the data flow so a recipe is validated before any model loads:
    ``output_keys`` are the keys ``extract_model_output`` returns (what a ``DataSync`` may send),
    ``self_forward_keys`` maps an output key to the batch ``extra`` key it fills from a no-grad
    forward pass of this role's own model at the start of the step (e.g. the proximal log-probs
    of decoupled PPO), and ``required_extra_keys`` lists the ``extra`` keys that
    ``prepare_batch`` needs from other roles.
    """

    config_cls: ClassVar[type | None] = None
    """The keyword-only dataclass of this specialization's options, when it has one: a recipe
    builds it from the role's ``init_kwargs`` and passes it as the one constructor argument
    (``areno.recipes.config.ModelRole.build``). None: ``init_kwargs`` are constructor arguments."""
    output_keys: tuple[str, ...] = ()
    required_extra_keys: tuple[str, ...] = ()

    @property
    def self_forward_keys(self) -> dict[str, str]:
        """Output key -> batch extra key filled from this role's own forward before training."""
        return {}

    @property
    def needs_groups(self) -> str | None:
        """What of this role compares the completions of one prompt (their shared ``group_id``), in a
        few words (e.g. ``advantage_estimator=grpo``): with one completion per prompt
        (``rollout.n_samples=1``) it learns nothing, and the run is refused. None: it does not."""
        return None

    def shared_state(self) -> dict[str, float]:
        """Values of this role's that another role's batch preparation follows (the actor's KL coefficient, which
        adaptive KL control moves): the runner hands them to every other trainable role's ``follow`` before each
        step's ``prepare_batch``. Default: none."""
        return {}

    def follow(self, shared: dict[str, float]) -> None:
        """Take what the step's other roles share (``shared_state``) before this step's ``prepare_batch``.
        Default: nothing."""

    @property
    def reads_rewards(self) -> bool:
        """Whether ``prepare_batch`` reads the batch's ``rewards_B`` (advantages, returns): a recipe adds a reward
        model's score to them only where some role does (``RewardSync``). Default: False."""
        return False

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """The module the backend trains, built around the loaded decoder before the optimizer
        exists (a value or reward head is added here). Default: the decoder itself."""
        return model

    def compute_advantages(self, rollout_data: TokenBatch) -> TokenBatch:
        """Fill ``advantages_T`` (RL actors); the base class returns the batch unchanged."""
        return rollout_data

    def prepare_batch(self, rollout_data: TokenBatch) -> TokenBatch:
        """Everything the loss needs, computed on the whole batch (default: the advantages)."""
        self._check_extra(rollout_data)
        return check_returns_batch(self.compute_advantages(rollout_data), self, "compute_advantages")

    def prepare_metrics(self, rollout_data: TokenBatch) -> dict[str, float]:
        """What ``prepare_batch`` does to ``rollout_data`` worth logging with the step (the runner
        logs them as ``<role>/<key>``), e.g. the sequences it drops. Default: nothing."""
        return {}

    def batch_metrics(self, prepared: TokenBatch) -> dict[str, float]:
        """Figures of the batch ``prepare_batch`` made worth logging with the step (as ``<role>/<key>``),
        e.g. its advantages. Default: nothing."""
        return {}

    @abstractmethod
    def extract_model_output(self, model: nn.Module, batch: TokenBatch) -> dict[str, torch.Tensor]:
        """Run the model on one packed micro-batch; keys end in their shape letter."""

    @abstractmethod
    def compute_loss(
        self, model_output: dict[str, torch.Tensor], batch: TokenBatch, reducer: Reducer
    ) -> tuple[torch.Tensor, Metrics]:
        """``(loss, metrics)`` of one micro-batch, the loss already reduced by ``reducer``."""

    def denominator(self, batch: TokenBatch) -> float:
        """This micro-batch's additive share of the global loss denominator (default: loss tokens)."""
        return float(batch.loss_mask_T.sum())

    def gradient_free_B(self, batch: TokenBatch) -> torch.Tensor | None:
        """The sequences of a prepared batch whose loss has no gradient (bool [B]): the step leaves them
        out of its forward and backward (``without_gradient_free``). None (the default): every
        sequence may carry gradient."""
        return None

    def self_forward_free_B(self, batch: TokenBatch) -> torch.Tensor | None:
        """The sequences the step will leave out (``gradient_free_B``, or dropped by ``prepare_batch``)
        whatever the self-forward gives them (bool [B] over ``batch``, before ``prepare_batch``): the
        runner runs ``self_forward_keys``' forward over the others only. None (the default): all."""
        return None

    def after_optimizer_step(self, metrics: dict[str, float]) -> dict[str, float]:
        """Called by the runner after each optimizer step of this role with the step's metrics (reduced over
        the data-parallel ranks, keys as the loss logged them: ``actor/entropy``; ``batch_seqs``: the sequences
        of the batch the step trained on): a specialization with state
        that follows training (an adaptive coefficient) updates it here. Returns more metrics to log with the
        step (``<role>/<key>``). Default: nothing."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """What ``after_optimizer_step`` changed and a checkpoint must keep (plain Python values), so that a
        resumed run goes on as the uninterrupted one. Default: nothing."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict``'s values (an empty dict: a checkpoint written without them)."""

    def step_denominator(self, batch: TokenBatch) -> float:
        """``denominator`` plus the share carried for the sequences left out (``DENOMINATOR_CARRY_KEY``):
        the ``denominator_fn`` a training step is given."""
        carry_B = batch.extra.get(DENOMINATOR_CARRY_KEY)
        return self.denominator(batch) + (float(carry_B.sum()) if carry_B is not None else 0.0)

    def _check_extra(self, batch: TokenBatch) -> None:
        missing = [k for k in self.required_extra_keys if k not in batch.extra]
        if missing:
            raise ValueError(
                f"{type(self).__name__} needs batch.extra keys {missing}: add a DataSync that "
                f"provides them (have: {sorted(batch.extra)})"
            )


def check_returns_batch(result: Any, spec: ModelSpecialization, method: str) -> TokenBatch:
    """``result``, what ``spec.<method>`` returned, when it is a TokenBatch; else a :class:`UserError`
    naming ``<Class>.<method>`` (a forgotten ``return`` failed later, in the runner, on ``None``)."""
    if not isinstance(result, TokenBatch):
        raise UserError(
            f"{type(spec).__name__}.{method} returned {type(result).__name__}, expected a TokenBatch: return the "
            "batch it was given with its fields set, e.g. `return dataclasses.replace(batch, advantages_T=adv_T)`"
        )
    return result


METHOD_ARGUMENTS: dict[str, tuple[str, ...]] = {
    "extract_model_output": ("model", "batch"),
    "compute_loss": ("model_output", "batch", "reducer"),
    "compute_advantages": ("rollout_data",),
    "prepare_batch": ("rollout_data",),
    "denominator": ("batch",),
}
"""The arguments the training step passes each method of a specialization, by position."""


@functools.cache
def check_methods(cls: type[ModelSpecialization]) -> None:
    """A :class:`ConfigError` naming ``<cls>.<method>`` for a method of ``cls`` that cannot take the call
    the training step makes (``METHOD_ARGUMENTS``): found when the recipe is built, before any model
    loads, not in the first step's call. A method without a signature (a builtin) is not checked."""
    for method, arguments in METHOD_ARGUMENTS.items():
        fn = getattr(cls, method)
        # a plain function takes the instance first; a static or class method does not
        bound = not isinstance(inspect.getattr_static(cls, method), (staticmethod, classmethod))
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):
            continue
        try:
            signature.bind(*([None] if bound else []), *arguments)
        except TypeError:
            takes = ", ".join(list(signature.parameters)[1 if bound else 0 :])
            fix = " (reduce the loss with it: `reducer(loss_T, batch.loss_mask_T)`)" if method == "compute_loss" else ""
            raise ConfigError(
                f"{cls.__name__}.{method} takes ({takes}) but is called with ({', '.join(arguments)}): define it "
                f"as `def {method}(self, {', '.join(arguments)})`{fix}"
            ) from None


def with_extra(batch: TokenBatch, **tensors: torch.Tensor) -> TokenBatch:
    """A shallow copy of ``batch`` whose ``extra`` has the given tensors added."""
    import dataclasses

    return dataclasses.replace(batch, extra={**batch.extra, **tensors})


def without_gradient_free(spec: ModelSpecialization, batch: TokenBatch) -> tuple[TokenBatch, int | None]:
    """``batch`` without the sequences ``spec.gradient_free_B`` names, their share of the denominator
    carried (``DENOMINATOR_CARRY_KEY``), and how many were left out (None where the specialization names
    none). When no sequence would be left, the shortest stays (its gradient is zero too) so that the
    optimizer still steps as it would: the cheapest, and the same one in every pass over the batch."""
    free_B = spec.gradient_free_B(batch)
    if free_B is None:
        return batch, None
    if not bool(free_B.any()):
        return batch, 0
    keep = kept_sequences(batch, free_B)
    kept = batch.select(keep)
    carry_B = torch.zeros(len(keep), dtype=torch.float64)
    carry_B[0] = spec.step_denominator(batch) - spec.step_denominator(kept)
    return with_extra(kept, **{DENOMINATOR_CARRY_KEY: carry_B}), batch.num_seqs - len(keep)


def kept_sequences(batch: TokenBatch, free_B: torch.Tensor) -> list[int]:
    """The indices of the sequences ``free_B`` does not name; where it names all, the shortest (ties
    broken by its tokens, so the same one in every pass over the batch)."""
    keep = torch.nonzero(~free_B).flatten().tolist()
    if not keep:
        cu, ids = batch.cu_seqlens_B1.tolist(), batch.input_ids_T.tolist()
        keep = [min(range(batch.num_seqs), key=lambda i: (cu[i + 1] - cu[i], ids[cu[i] : cu[i + 1]]))]
    return keep


def reduce_stats(stats: dict[str, torch.Tensor], mask_T: torch.Tensor, reducer: Reducer, prefix: str) -> Metrics:
    """Reduce detached per-token statistics with the loss reducer under ``prefix/`` (the runner rescales
    the keys with a ``/`` to means over the trained tokens when sequences were left out of the step)."""
    return {f"{prefix}/{k}": reducer(v.detach(), mask_T).detach() for k, v in stats.items()}


@functools.cache
def option_types(cls: type[ModelSpecialization]) -> dict[str, Any]:
    """The annotated type of each option of specialization ``cls``: its ``config_cls``'s fields, else
    its constructor's keyword arguments (what a recipe's ``init_kwargs`` and ``train.algorithm_kwargs``
    set). Empty where the annotations do not resolve (a name only a type checker sees): nothing is
    checked then."""
    target = cls.config_cls if cls.config_cls is not None else cls.__init__
    try:
        hints = typing.get_type_hints(target)
    except (NameError, TypeError, AttributeError):  # unresolvable, or object.__init__ (no annotations)
        return {}
    if cls.config_cls is not None:
        return {f.name: hints[f.name] for f in dataclasses.fields(cls.config_cls) if f.init and f.name in hints}
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    params = inspect.signature(cls.__init__).parameters
    return {n: hints[n] for n, p in params.items() if p.kind in kinds and n in hints}


def takes_option(cls: type[ModelSpecialization], name: str) -> bool:
    """Whether a role of specialization ``cls`` takes option ``name`` in its ``init_kwargs``: a field of
    its ``config_cls``, else a keyword argument of its constructor (by name: a bare ``**kwargs`` does
    not count)."""
    if cls.config_cls is not None:
        return any(f.name == name and f.init for f in dataclasses.fields(cls.config_cls))
    param = inspect.signature(cls.__init__).parameters.get(name)
    return param is not None and param.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def check_arguments(cls: type[ModelSpecialization], arguments: dict[str, Any]) -> None:
    """A ``ConfigError`` naming ``<cls>.<argument>`` for a constructor argument of ``cls`` whose value
    is not of its annotated type (``arguments``: the constructor's ``locals()`` on entry). Called first,
    before a range check compares a string with a number."""
    for name, hint in option_types(cls).items():
        value = arguments.get(name)
        if isinstance(value, os.PathLike):  # a path where a string goes, as check_types takes one
            value = os.fspath(value)
        if name in arguments and not is_of_type(value, hint):
            raise wrong_type(f"{cls.__name__}.{name}", hint, arguments[name])
