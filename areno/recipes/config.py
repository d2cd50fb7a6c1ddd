"""Recipes as data: an algorithm is a frozen ``TrainingConfig`` of model roles and the
data they exchange. Everything is validated at construction, before any model loads: role names,
specialization arguments, DataSync roles and keys, teacher checkpoints.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from dataclasses import dataclass, field
from typing import Any

from areno.errors import ConfigError
from areno.specializations.base import ModelSpecialization

SYNC_STAGES = ("inject",)


REQUIRED = inspect.Parameter.empty
"""The default of a specialization option without one (a constructor argument the role must give)."""


def unknown_option(key: str, valid: list[str]) -> str:
    """The one line that refuses option ``key``: the closest valid name, then all of them."""
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown option {key!r}{hint}; valid options: {', '.join(valid) or 'none'}"


def specialization_options(cls: type[ModelSpecialization]) -> dict[str, Any] | None:
    """Option name -> default of specialization ``cls``, in order: its ``config_cls``'s fields, else its
    constructor's keyword arguments (``REQUIRED`` where one has no default). None where the constructor
    takes ``**kwargs``: any name may be valid."""
    if cls.config_cls is not None:
        return {
            f.name: f.default if f.default is not dataclasses.MISSING else REQUIRED
            for f in dataclasses.fields(cls.config_cls)
            if f.init
        }
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]  # without self
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name: p.default for p in params if p.kind in kinds}


def options_from_kwargs(config_cls: type, kwargs: dict[str, Any]) -> Any:
    """``config_cls(**kwargs)`` for a keyword-only options dataclass; a key it does not have is a
    ConfigError (one line) that names it and lists the valid ones."""
    valid = [f.name for f in dataclasses.fields(config_cls) if f.init]
    unknown = sorted(set(kwargs) - set(valid))
    if unknown:
        raise ConfigError(unknown_option(unknown[0], valid))
    return config_cls(**kwargs)


@dataclass(frozen=True, kw_only=True)
class ModelRole:
    """One model of a recipe (policy, value, reference, teacher, reward, …)."""

    name: str
    """Role name in RL words; also the key of its training backend."""
    specialization_cls: type[ModelSpecialization]
    """What the role computes; chosen by class, never by a switch on ``name``."""
    trainable: bool = True
    """False: a frozen role (reference, teacher) that only runs forward passes and holds no
    optimizer state."""
    sync_to_rollout: bool = False
    """Publish this role's weights to the rollout engine after each step (the policy)."""
    init_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of ``specialization_cls``."""
    model_path: str | None = None
    """Hugging Face checkpoint directory of this role; None = the run's ``model.path``."""
    requires_model_path: bool = False
    """The role is a different model than the policy (a teacher): ``model_path`` must be set."""

    def __post_init__(self) -> None:
        if not self.name or not self.name.isidentifier():
            raise ConfigError(f"ModelRole name must be a non-empty identifier, got {self.name!r}")
        if not (isinstance(self.specialization_cls, type) and issubclass(self.specialization_cls, ModelSpecialization)):
            raise ConfigError(
                f"role {self.name!r}: specialization_cls must be a ModelSpecialization subclass, "
                f"got {self.specialization_cls!r}"
            )
        if self.sync_to_rollout and not self.trainable:
            raise ConfigError(
                f"role {self.name!r}: sync_to_rollout=True needs trainable=True (a frozen role never changes)"
            )
        if self.requires_model_path and not self.model_path:
            raise ConfigError(
                f"role {self.name!r} needs a checkpoint: set its model_path (for built-in recipes pass "
                f"teacher_path=DIR, e.g. train.algorithm_kwargs.teacher_path=DIR)"
            )

    def build(self, **overrides: Any) -> ModelSpecialization:
        """The role's specialization with ``init_kwargs`` updated by ``overrides`` (as its
        ``config_cls`` where it has one); a bad argument (unknown, or a value the specialization
        rejects) is a :class:`ConfigError` naming the role."""
        cls = self.specialization_cls
        kwargs = {**self.init_kwargs, **overrides}
        try:
            if cls.config_cls is not None:
                return cls(options_from_kwargs(cls.config_cls, kwargs))
            valid = specialization_options(cls)
            unknown = [] if valid is None else [k for k in kwargs if k not in valid]
            if unknown:  # as a config_cls's are named, not as Python's "unexpected keyword argument"
                raise ConfigError(unknown_option(unknown[0], list(valid)))
            return cls(**kwargs)
        except (TypeError, ValueError) as err:  # the constructor validates its arguments, set by the user
            raise ConfigError(
                f"role {self.name!r}: bad arguments for {cls.__name__}: {err} (check train.algorithm_kwargs)"
            ) from None


@dataclass(frozen=True, kw_only=True)
class DataSync:
    """Tensors one role computes for another within a step. ``stage="inject"``: before training,
    ``source`` runs a no-grad forward on the step's batch and its output ``keys[i]`` becomes the
    target batch's ``extra[target_keys[i]]`` (e.g. reference ``logprobs_T`` -> ``ref_logprobs_T``)."""

    source: str
    """Role that computes the tensors."""
    target: str
    """Role whose batch receives them."""
    keys: tuple[str, ...]
    """Output keys of the source's ``extract_model_output``."""
    target_keys: tuple[str, ...] = ()
    """Names in the target batch's ``extra``; empty = the same as ``keys``."""
    stage: str = "inject"
    """When the sync runs; only ``inject`` (before training) exists."""

    def __post_init__(self) -> None:
        for field_name in ("keys", "target_keys"):
            value = getattr(self, field_name)
            if isinstance(value, str):  # tuple("logprobs_T") would be its letters
                raise ConfigError(
                    f"DataSync {self.source}->{self.target}: {field_name} must be a tuple of names, got the string "
                    f"{value!r}: write {field_name}=({value!r},)"
                )
        object.__setattr__(self, "keys", tuple(self.keys))
        object.__setattr__(self, "target_keys", tuple(self.target_keys) or tuple(self.keys))
        if not self.keys:
            raise ConfigError(f"DataSync {self.source}->{self.target}: keys must name at least one tensor")
        if len(self.target_keys) != len(self.keys):
            raise ConfigError(
                f"DataSync {self.source}->{self.target}: {len(self.keys)} keys but "
                f"{len(self.target_keys)} target_keys; give one target key per key"
            )
        if self.stage not in SYNC_STAGES:
            raise ConfigError(
                f"DataSync {self.source}->{self.target}: stage must be one of {SYNC_STAGES}, got {self.stage!r}"
            )
        if self.source == self.target:
            raise ConfigError(f"DataSync {self.source}->{self.target}: source and target must differ")
        for key in self.target_keys:
            if not (key.endswith("_T") or key.endswith("_B")):
                raise ConfigError(f"DataSync target key {key!r} must end in its shape letter (_T or _B)")


@dataclass(frozen=True, kw_only=True)
class RewardSync:
    """A frozen role's score of each sequence added to the step's rewards: before any role's ``prepare_batch``,
    the batch's ``rewards_B`` becomes ``rewards_B + weight * (scores_B - missing_eos_penalty * truncated_B)``
    with ``scores_B`` the source's per-sequence output ``key`` (a reward model's head at each sequence's last
    token), so the advantages, a critic's returns and the filters all read the same reward. ``reward.model``
    adds one (``areno.engine.api.resolve_recipe``)."""

    source: str
    """The frozen role that scores (``reward_model``)."""
    key: str = "scores_B"
    """Its per-sequence output (``_B``)."""
    weight: float = 1.0
    """The score's weight in the reward (``reward.model_weight``)."""
    missing_eos_penalty: float = 0.0
    """Subtracted from the score of a sequence cut at the length limit (``truncated_B``), before the weight
    (``reward.missing_eos_penalty``)."""

    def __post_init__(self) -> None:
        if self.missing_eos_penalty < 0:
            raise ConfigError(
                f"RewardSync {self.source}: missing_eos_penalty must be >= 0, got {self.missing_eos_penalty}"
            )
        if not self.key.endswith("_B"):
            raise ConfigError(
                f"RewardSync {self.source}: key {self.key!r} must be a per-sequence output (ending in _B)"
            )


@dataclass(frozen=True, kw_only=True)
class ReferenceSync:
    """A frozen copy of the policy that follows it: every ``every`` optimizer steps of ``source``, the
    weights of ``target`` become ``alpha * source + (1 - alpha) * target``, parameter by parameter (TR-DPO's
    soft update, Gorbatovski et al. 2024; TRL's ``sync_ref_model`` with ``ref_model_mixup_alpha`` and
    ``ref_model_sync_steps``). ``train.algorithm_kwargs.ref_sync_steps`` / ``ref_sync_alpha`` set it
    (``areno.recipes.registry.with_reference_sync``); checkpoints then hold the target's weights too."""

    source: str
    """The trainable role whose weights are mixed in (the policy)."""
    target: str
    """The frozen role that moves (the reference): loaded from the same checkpoint as ``source``."""
    alpha: float
    """The weight of ``source``, in (0, 1]; 1 copies it."""
    every: int
    """Optimizer steps of ``source`` between two mixes (>= 1): after its step s, where s % every == 0."""

    def __post_init__(self) -> None:
        if not 0 < self.alpha <= 1:
            raise ConfigError(f"ReferenceSync {self.source}->{self.target}: alpha must be in (0, 1], got {self.alpha}")
        if self.every < 1:
            raise ConfigError(f"ReferenceSync {self.source}->{self.target}: every must be >= 1, got {self.every}")


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """An algorithm: its roles, the data they exchange and a description."""

    name: str
    """Registry name (``areno train --algorithm NAME``)."""
    roles: tuple[ModelRole, ...]
    """The model roles; role names are unique."""
    syncs: tuple[DataSync, ...] = ()
    """Cross-role tensors, run in order before training."""
    description: str = ""
    """One line for ``areno recipes``."""
    online: bool = True
    """True: trains on rollouts of the policy (RL, on-policy distillation). False: on an offline
    dataset (SFT, DPO, reward modelling)."""
    reference_sync: ReferenceSync | None = None
    """A frozen role moved toward a trained one every few optimizer steps; None: frozen roles never change."""
    reward_syncs: tuple[RewardSync, ...] = ()
    """Frozen roles whose scores are added to the rewards before training (a reward model)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "roles", tuple(self.roles))
        object.__setattr__(self, "syncs", tuple(self.syncs))
        where = f"recipe {self.name!r}"
        if not self.roles:
            raise ConfigError(f"{where}: needs at least one role")
        names = [r.name for r in self.roles]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigError(f"{where}: duplicate role names {dupes}; give every role a unique name")
        if not any(r.trainable for r in self.roles):
            raise ConfigError(f"{where}: no trainable role; set trainable=True on the role to train")
        if self.online and not any(r.sync_to_rollout for r in self.roles):
            # the rollouts would come from the initial weights for the whole run, with no message
            raise ConfigError(
                f"{where}: online=True but no role publishes its weights to the rollout engine: mark the policy "
                "ModelRole(sync_to_rollout=True), or set online=False to train on an offline dataset"
            )
        specs = {r.name: r.build() for r in self.roles}  # bad specialization arguments fail here
        for sync in self.syncs:
            for role in (sync.source, sync.target):
                if role not in specs:
                    raise ConfigError(
                        f"{where}: DataSync {sync.source}->{sync.target} names a missing role {role!r}; roles are {names}"
                    )
            missing = [k for k in sync.keys if k not in specs[sync.source].output_keys]
            if missing:
                raise ConfigError(
                    f"{where}: DataSync {sync.source}->{sync.target} asks for {missing}, which "
                    f"{type(specs[sync.source]).__name__} does not output (it outputs {list(specs[sync.source].output_keys)})"
                )
        if self.reference_sync is not None:
            self._check_reference_sync(self.reference_sync)
        object.__setattr__(self, "reward_syncs", tuple(self.reward_syncs))
        for reward in self.reward_syncs:
            self._check_reward_sync(reward, specs)
        for role in self.roles:
            spec = specs[role.name]
            for key in spec.self_forward_keys:
                if key not in spec.output_keys:
                    raise ConfigError(
                        f"{where}: role {role.name!r} self-forward key {key!r} is not an output of {type(spec).__name__}"
                    )
            need = self._unmet_keys(role, spec)
            if need:
                raise ConfigError(
                    f"{where}: role {role.name!r} ({type(spec).__name__}) needs batch keys "
                    f"{need}; add a DataSync that provides them"
                )

    def _check_reference_sync(self, sync: ReferenceSync) -> None:
        where = f"recipe {self.name!r}: ReferenceSync {sync.source}->{sync.target}"
        roles = {r.name: r for r in self.roles}
        for name in (sync.source, sync.target):
            if name not in roles:
                raise ConfigError(f"{where} names a missing role {name!r}; roles are {list(roles)}")
        source, target = roles[sync.source], roles[sync.target]
        if not source.trainable or target.trainable:
            raise ConfigError(f"{where}: the source must be a trainable role and the target a frozen one")
        if source.model_path != target.model_path:  # the same checkpoint: the same tensors, name for name
            raise ConfigError(
                f"{where}: the two roles load different checkpoints ({source.model_path or 'model.path'}, "
                f"{target.model_path or 'model.path'}), so their weights cannot be mixed"
            )

    def _check_reward_sync(self, sync: RewardSync, specs: dict[str, ModelSpecialization]) -> None:
        where = f"recipe {self.name!r}: RewardSync from {sync.source!r}"
        roles = {r.name: r for r in self.roles}
        if sync.source not in roles:
            raise ConfigError(f"{where} names a missing role; roles are {list(roles)}")
        if roles[sync.source].trainable:
            raise ConfigError(f"{where}: the scoring role must be frozen (trainable=False)")
        if sync.key not in specs[sync.source].output_keys:
            raise ConfigError(
                f"{where}: {type(specs[sync.source]).__name__} does not output {sync.key!r} "
                f"(it outputs {list(specs[sync.source].output_keys)})"
            )
        readers = [r.name for r in self.roles if r.trainable and specs[r.name].reads_rewards]
        if not self.online or not readers:
            raise ConfigError(
                f"{where}: no role of this recipe trains on rewards (an online recipe whose loss reads them: grpo, "
                "ppo, ...), so the score would change nothing"
            )

    def _unmet_keys(self, role: ModelRole, spec: ModelSpecialization) -> list[str]:
        """The batch keys trainable ``role`` (as ``spec``) needs that neither a DataSync into it nor its
        own forward provides (a frozen role's ``prepare_batch`` never runs)."""
        if not role.trainable:
            return []
        provided = {k for sync in self.syncs if sync.target == role.name for k in sync.target_keys}
        return sorted(set(spec.required_extra_keys) - provided - set(spec.self_forward_keys.values()))

    def unmet_policy_kwargs(self, kwargs: dict[str, Any]) -> tuple[list[str], list[str]]:
        """``(keys, batch_keys)``: the batch keys the policy role would need with its ``init_kwargs``
        updated by ``kwargs`` that no role of this recipe provides (e.g. ``kl_coef`` needs a reference's
        ``ref_logprobs_T``), and which of ``kwargs`` alone bring that need (all of them when only the
        combination does). Both empty when the recipe provides everything."""
        policy = self.policy_role
        need = self._unmet_keys(policy, policy.build(**kwargs)) if kwargs else []
        if not need:
            return [], []
        culprits = []
        for key, value in kwargs.items():
            try:
                alone = self._unmet_keys(policy, policy.build(**{key: value}))
            except ConfigError:  # a value valid only together with another key
                continue
            if alone:
                culprits.append(key)
        return culprits or list(kwargs), need

    def check_n_samples(self, n_samples: int) -> None:
        """A ConfigError when a trained role compares the completions of one prompt (group advantages,
        dynamic sampling; ``ModelSpecialization.needs_groups``) and ``rollout.n_samples`` gives it one."""
        if not self.online or n_samples >= 2:
            return
        for role in self.roles:
            what = role.build().needs_groups if role.trainable else None
            if what:
                raise ConfigError(
                    f"rollout.n_samples={n_samples}: recipe {self.name!r} ({what}) compares the completions of "
                    "a prompt within their group, so with one per prompt nothing trains (every advantage is 0, "
                    "or every group is filtered out): set rollout.n_samples >= 2, or use a recipe without groups "
                    "(e.g. reinforce_pp)"
                )

    def role(self, name: str) -> ModelRole:
        for role in self.roles:
            if role.name == name:
                return role
        raise ConfigError(f"recipe {self.name!r} has no role {name!r}; roles are {[r.name for r in self.roles]}")

    @property
    def policy_role(self) -> ModelRole:
        """The role ``algorithm_kwargs`` apply to: the first sync_to_rollout role, else the first
        trainable one."""
        for role in self.roles:
            if role.sync_to_rollout:
                return role
        return next(r for r in self.roles if r.trainable)

    def with_policy_kwargs(self, **kwargs: Any) -> TrainingConfig:
        """A validated copy whose policy role has ``init_kwargs`` updated by ``kwargs``."""
        if not kwargs:
            return self
        policy = self.policy_role
        new_role = dataclasses.replace(policy, init_kwargs={**policy.init_kwargs, **kwargs})
        roles = tuple(new_role if r.name == policy.name else r for r in self.roles)
        return dataclasses.replace(self, roles=roles)
