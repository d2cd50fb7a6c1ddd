"""What kind of run a recipe is, read off its ``TrainingConfig`` (never a table of names): online or
offline, the roles it builds beside the one it trains, and what its loss does with rollouts sampled by
older policy versions (``rollout.max_head_offpolicyness > 0``). ``areno recipes`` lists them;
``stale_teacher_warning`` says when a recipe scoring the student's samples with a frozen model runs
asynchronously.
"""

from __future__ import annotations

from dataclasses import dataclass

from areno.recipes.config import TrainingConfig
from areno.specializations import ActorSpecialization

STALE_LABELS: dict[str, str] = {
    "corrected": "the decoupled loss weights each token by pi_prox / pi_behave (the *_async recipes)",
    "recomputed": "the ratio is against log-probs the current weights recompute (staleness ignored)",
    "truncated-IS": "cispo's weight min(pi_theta / pi_behave, 1 + eps_high), against the sampling policy",
    "uncorrected": "no correction for staleness: a PPO-family clip (or sapo's gate, vespo's weight) anchored at "
    "the stale sampling policy, or a distillation or imitation loss that takes each sample as the current policy's",
    "unknown": "a loss of your own, whose treatment of stale samples areno cannot read",
    "-": "offline: no rollouts",
}
"""What the ``STALE`` column of ``areno recipes`` says of a recipe's loss on stale rollouts, and what each
value means (``stale_rollouts``)."""


@dataclass(frozen=True, kw_only=True)
class RecipeTraits:
    """The kind of run one recipe is, as ``areno recipes`` lists it."""

    online: bool
    """True: it trains on rollouts the rollout engine generates from the policy; False: on dataset rows."""
    extra_roles: tuple[str, ...]
    """Its roles other than the policy role (reference, value, teacher, ...), in order."""
    stale: str
    """What its loss does with stale rollouts: a key of ``STALE_LABELS``."""


def recipe_traits(cfg: TrainingConfig) -> RecipeTraits:
    """The kind of run ``cfg`` is (its roles as built, so a factory option that adds one counts only when set)."""
    policy = cfg.policy_role.name
    return RecipeTraits(
        online=cfg.online,
        extra_roles=tuple(r.name for r in cfg.roles if r.name != policy),
        stale=stale_rollouts(cfg),
    )


def stale_rollouts(cfg: TrainingConfig) -> str:
    """What the policy role's loss does with a rollout sampled by an older policy version (a key of
    ``STALE_LABELS``), as ``areno.api.preflight.stale_rollout_warning`` judges a PPO-family loss: the
    decoupled loss corrects; cispo's weight, taken against the sampling policy, is truncated importance
    sampling unless ``recompute_logprob`` replaces that policy by the current weights; a recomputed ratio
    ignores the staleness; any other loss of areno's (the PPO clip anchored at the stale policy, the
    distillation and imitation losses) has no correction."""
    if not cfg.online:
        return "-"
    role = cfg.policy_role
    spec = role.build()
    if isinstance(spec, ActorSpecialization):
        c = spec.config
        if c.use_decoupled_loss:
            return "corrected"
        if c.recompute_logprob:
            return "recomputed"
        return "truncated-IS" if c.policy_loss == "cispo" else "uncorrected"
    if not role.specialization_cls.__module__.startswith("areno."):
        return "unknown"
    return "uncorrected"


def stale_teacher_warning(cfg: TrainingConfig, max_head_offpolicyness: int) -> str | None:
    """Why ``rollout.max_head_offpolicyness > 0`` makes a recipe whose frozen role scores the policy's own
    samples (opd, dagger, aggrevate, mixed_loss_dagger_opd: a teacher's log-probs or actions, or a scorer's
    Q) train off-policy without saying so, and what to do; None at staleness 0, for an offline recipe, a
    PPO-family policy (``stale_rollout_warning`` speaks of those), a loss that corrects, or a loss of the
    user's own (which may)."""
    if max_head_offpolicyness <= 0 or stale_rollouts(cfg) != "uncorrected":
        return None
    policy = cfg.policy_role
    if issubclass(policy.specialization_cls, ActorSpecialization):
        return None
    frozen = {r.name for r in cfg.roles if not r.trainable}
    scorers = list(dict.fromkeys(s.source for s in cfg.syncs if s.target == policy.name and s.source in frozen))
    if not scorers:
        return None
    who = " and ".join(f"the frozen {name} role" for name in scorers)
    versions = "version" if max_head_offpolicyness == 1 else "versions"
    return (
        f"train.algorithm={cfg.name} with rollout.max_head_offpolicyness={max_head_offpolicyness} trains the "
        f"{policy.name} on completions sampled by a policy up to {max_head_offpolicyness} {versions} older, scored by "
        f"{who}, and {policy.specialization_cls.__name__}'s loss has no importance correction for that, so the "
        "update is off-policy: set rollout.max_head_offpolicyness=0 for on-policy samples, or keep the staleness "
        "knowingly"
    )
