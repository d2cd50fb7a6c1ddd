"""The built-in recipes. Each factory's docstring opens with a one-line description (shown by
``areno recipes``) and states the objective and where it departs from its paper.

Notation: r = pi_theta / pi_old per token, A advantage, eps clip range, sg stop-gradient,
G a group of completions of one prompt, |o| completion length, k3 the KL estimator
exp(t - s) + (s - t) - 1.

Temperature: in an online recipe every role that scores the rollout's tokens by log-probs, the policy
and a frozen reference or teacher alike, scores them at rollout.temperature T, log softmax(z / T), the
distribution the tokens were sampled from (the run passes ``temperature`` to each role that takes it,
``areno.engine.api.resolve_recipe``; TRL's GRPOTrainer and GKDTrainer and verl do the same), so a KL
to a reference with the policy's weights is 0 and distillation targets the teacher's sampling
distribution. Greedy rollouts (T = 0) and offline recipes score at 1. ``train.algorithm_kwargs.temperature``
is refused: the temperature is rollout.temperature's.

Lengths: dr_grpo's constant L and dapo's L_max default to the run's rollout.max_new_tokens (the
generation limit: TRL's max_completion_length, DAPO's maximum generation length).
"""

from __future__ import annotations

from areno.errors import ConfigError
from areno.recipes.config import DataSync, ModelRole, TrainingConfig
from areno.recipes.registry import recipe
from areno.specializations import (
    ActorSpecialization,
    AggrevateSpecialization,
    CriticSpecialization,
    DaggerSpecialization,
    DistillSpecialization,
    DPOSpecialization,
    LogProbSpecialization,
    MixedLossDaggerOPDSpecialization,
    RewardModelSpecialization,
    ScalarScorerSpecialization,
    SFTSpecialization,
)
from areno.specializations.supervised import SCORER_Q_SOURCES


def _policy(**kwargs) -> ModelRole:
    return ModelRole(name="policy", specialization_cls=ActorSpecialization, sync_to_rollout=True, init_kwargs=kwargs)


def _reference() -> ModelRole:
    return ModelRole(name="reference", specialization_cls=LogProbSpecialization, trainable=False)


def _teacher(path: str | None) -> ModelRole:
    return ModelRole(
        name="teacher",
        specialization_cls=LogProbSpecialization,
        trainable=False,
        model_path=path,
        requires_model_path=True,
    )


_REF_SYNC = DataSync(source="reference", target="policy", keys=("logprobs_T",), target_keys=("ref_logprobs_T",))


def _teacher_sync(key: str = "logprobs_T", target_key: str = "teacher_logprobs_T") -> DataSync:
    return DataSync(source="teacher", target="policy", keys=(key,), target_keys=(target_key,))


def _single(name: str, doc: str | None, policy: ModelRole, *, online: bool = True) -> TrainingConfig:
    return TrainingConfig(name=name, roles=(policy,), description=_first_line(doc), online=online)


def _first_line(doc: str | None) -> str:
    return (doc or "").strip().splitlines()[0]


LENGTH_WITHOUT_RUN = 1024
"""``max_completion_length`` of dr_grpo and dapo when it is None and no run fills it in (a recipe built by
``get_recipe`` alone, or shown by ``areno recipes``); a run gives its rollout.max_new_tokens
(``areno.engine.api.resolve_recipe``)."""


def _max_length(name: str, value: int | None) -> int:
    """The recipe's ``max_completion_length``: ``value``, or ``LENGTH_WITHOUT_RUN`` where no run resolved it."""
    if not isinstance(value, int):  # None; ``areno recipes NAME`` builds a None option as "<path>"
        return LENGTH_WITHOUT_RUN
    if value <= 0:
        raise ConfigError(f"{name}: train.algorithm_kwargs.max_completion_length must be > 0, got {value}")
    return value


# ------------------------------------------------------------------------------ RL, critic-free
@recipe("grpo")
def grpo(kl_coef: float = 0.0) -> TrainingConfig:
    """GRPO: group-normalised advantages, clipped ratio, optional k3 KL to a frozen reference.

    A_i = (R_i - mean_G R) / (std_G R + 1e-4);  loss = mean_i mean_{t in o_i}
    [-min(r A_i, clip(r, 1-0.2, 1+0.2) A_i) + beta k3(pi_theta, pi_ref)]  (DeepSeekMath, Shao et al. 2024).
    Departures: beta = kl_coef defaults to 0 (TRL's default; the paper used 0.04) and a reference
    role exists only when kl_coef > 0; std is unbiased (n-1) with eps added to it, as in TRL. pi_theta
    and pi_ref are both scored at rollout.temperature (as TRL and verl), so k3 = 0 at the first step.
    """
    return _with_optional_reference(
        "grpo",
        grpo.__doc__,
        kl_coef,
        advantage_estimator="grpo",
        clip_eps=0.2,
        loss_aggregation="seq_mean_token_mean",
        kl_estimator="k3",
    )


def _with_optional_reference(name: str, doc: str | None, kl_coef: float, **policy_kwargs) -> TrainingConfig:
    """A one-policy recipe, plus a frozen reference role and its inject sync when kl_coef > 0."""
    policy = _policy(kl_coef=kl_coef, **policy_kwargs)
    if kl_coef <= 0:
        return TrainingConfig(name=name, roles=(policy,), description=_first_line(doc))
    return TrainingConfig(name=name, roles=(policy, _reference()), syncs=(_REF_SYNC,), description=_first_line(doc))


@recipe("dr_grpo")
def dr_grpo(max_completion_length: int | None = None) -> TrainingConfig:
    """Dr.GRPO: GRPO without the std and length normalisations (unbiased), no KL.

    A_i = R_i - mean_G R;  loss = sum_i sum_{t in o_i} -min(r A_i, clip(r, 0.8, 1.2) A_i) / (B * L)
    over the step's B completions, with L = max_completion_length a constant (Liu et al. 2025,
    "Understanding R1-Zero-like training"): the constant divides the sum so long and short answers
    weigh alike per token. L defaults to rollout.max_new_tokens, the generation limit (the paper's
    MAX_TOKENS; TRL's max_completion_length); a larger L only shrinks every gradient (warned). The
    logged actor statistics (ratio, clip fractions, KL, entropy) are not divided by L: each is the
    mean over completions of its token mean.
    """
    return _single(
        "dr_grpo",
        dr_grpo.__doc__,
        _policy(
            advantage_estimator="dr_grpo",
            clip_eps=0.2,
            loss_aggregation="constant",
            loss_agg_constant=float(_max_length("dr_grpo", max_completion_length)),
        ),
    )


@recipe("dapo")
def dapo(max_completion_length: int | None = None, overlong_buffer_length: int | None = None) -> TrainingConfig:
    """DAPO: clip-higher (0.2/0.28), token-level loss, dynamic sampling, soft overlong penalty.

    A_i = (R_i - mean_G R) / std_G R with R_i including the overlong penalty
    (L_max - L_buf - |o|)/L_buf inside the buffer (|o| > L_max - L_buf) and -1 beyond L_max; groups
    whose rewards before the penalty are all equal are dropped (the paper's filter on accuracy);
    loss = sum_{i,t} -min(r A, clip(r, 1-0.2, 1+0.28) A) / sum_i |o_i|; no KL (Yu et al. 2025).
    L_max = max_completion_length defaults to rollout.max_new_tokens, the generation limit, as in
    the paper (20480 generated tokens, of which the last L_buf = 4096 are the buffer); L_buf =
    overlong_buffer_length defaults to L_max // 5 (at least 1), the paper's ratio, so a completion
    cut at the limit gets -1. A length whose penalty
    can never fire (L_max - L_buf >= rollout.max_new_tokens) is warned about. As in the paper, the rollout
    samples again until the batch holds rollout.batch_size groups that pass: a synchronous step in up to
    dynamic_sampling_max_rounds rounds (10; ``rollout/sampling_rounds``), the asynchronous pool as it goes
    (``rollout/filtered_groups``); that many batches' worth of samples in a row without a passing group stop
    the run. dynamic_sampling_max_rounds=1 samples once: the step trains on the groups that pass, or none.
    """
    max_length = _max_length("dapo", max_completion_length)
    buffer = overlong_buffer_length if isinstance(overlong_buffer_length, int) else max(1, max_length // 5)
    if not 0 < buffer <= max_length:
        raise ConfigError(
            f"dapo: train.algorithm_kwargs.overlong_buffer_length={buffer} must be in (0, max_completion_length="
            f"{max_length}] (max_completion_length defaults to rollout.max_new_tokens)"
        )
    return _single(
        "dapo",
        dapo.__doc__,
        _policy(
            advantage_estimator="grpo",
            clip_eps=0.2,
            clip_eps_high=0.28,
            loss_aggregation="token",
            dynamic_sampling=True,
            overlong_max_length=max_length,
            overlong_buffer_length=buffer,
        ),
    )


@recipe("gspo")
def gspo() -> TrainingConfig:
    """GSPO: sequence-level, length-normalised importance ratio with a tight clip.

    s_i = exp(mean_{t in o_i} log r_t); loss = mean_i -min(s_i A_i, clip(s_i, 1-3e-4, 1+4e-4) A_i)
    with GRPO advantages (Zheng et al. 2025); implemented in the GSPO-token form (value s_i,
    gradient through each token), identical for sequence-level advantages.
    """
    return _single(
        "gspo",
        gspo.__doc__,
        _policy(
            advantage_estimator="grpo",
            policy_loss="gspo",
            clip_eps=3e-4,
            clip_eps_high=4e-4,
            loss_aggregation="seq_mean_token_mean",
        ),
    )


@recipe("luspo")
def luspo() -> TrainingConfig:
    """LUSPO: GSPO's sequence-level ratio and clip, each sequence's loss weighted by its length.

    s_i = exp(mean_{t in o_i} log r_t); loss = mean_i sum_{t in o_i} -min(s_i A_i, clip(s_i, 1-3e-4, 1+4e-4) A_i)
    with GRPO advantages (Length-Unbiased Sequence Policy Optimization, 2026; TRL's loss_type="luspo" with
    importance_sampling_level="sequence"): GSPO's per-sequence mean favours short answers' tokens, the sum
    over tokens undoes that. The mean runs over the sequences with loss tokens (TRL's over all of them).
    """
    return _single(
        "luspo",
        luspo.__doc__,
        _policy(
            advantage_estimator="grpo",
            policy_loss="gspo",
            clip_eps=3e-4,
            clip_eps_high=4e-4,
            loss_aggregation="seq_mean_token_sum",
        ),
    )


@recipe("rloo")
def rloo() -> TrainingConfig:
    """RLOO: REINFORCE with a leave-one-out baseline over the group.

    A_i = R_i - mean_{j != i} R_j;  loss = sum_{i,t} -min(r A_i, clip(r, 0.8, 1.2) A_i) / #tokens
    (Ahmadian et al. 2024). Departure: the paper's plain REINFORCE gradient is the r = 1 case of
    this clipped form, which only differs on stale data or repeated passes.
    """
    return _single("rloo", rloo.__doc__, _policy(advantage_estimator="rloo", clip_eps=0.2, loss_aggregation="token"))


@recipe("reinforce_pp")
def reinforce_pp(kl_coef: float = 0.01) -> TrainingConfig:
    """REINFORCE++: critic-free returns with a per-token KL reward, normalised over the batch.

    r_t = -beta k1(pi_behave, pi_ref)_t (+ R on the last token); G_t = sum_{k>=t} r_k;
    A_t = (G_t - mean_batch G) / std_batch G; loss = clipped surrogate (eps 0.2), token mean
    (Hu 2025). Normalisation is over the global batch (all loss tokens), not per group; beta =
    kl_coef, and kl_coef = 0 drops the reference role; pi_ref is scored at rollout.temperature, as
    pi_behave was sampled.
    """
    return _with_optional_reference(
        "reinforce_pp",
        reinforce_pp.__doc__,
        kl_coef,
        advantage_estimator="reinforce_pp",
        clip_eps=0.2,
        loss_aggregation="token",
        kl_estimator="k1",
        kl_in_reward=True,
    )


@recipe("reinforce_pp_baseline")
def reinforce_pp_baseline(kl_coef: float = 0.01) -> TrainingConfig:
    """REINFORCE++-baseline: REINFORCE++ with the group mean reward subtracted before batch normalisation.

    R'_i = R_i - mean_G R; G_t and A_t as in reinforce_pp from R'; the KL enters the loss as
    beta k3 (beta = kl_coef, 0 drops the reference) rather than the reward, as in the paper's
    baseline variant (Hu 2025).
    """
    return _with_optional_reference(
        "reinforce_pp_baseline",
        reinforce_pp_baseline.__doc__,
        kl_coef,
        advantage_estimator="reinforce_pp_baseline",
        clip_eps=0.2,
        loss_aggregation="token",
        kl_estimator="k3",
    )


@recipe("cispo")
def cispo() -> TrainingConfig:
    """CISPO: clip the importance-sampling weight (stop-grad), keep every token's gradient.

    loss = sum_{i,t} -sg[min(r, 1 + eps_high)] A_i log pi_theta / #tokens, GRPO advantages
    (MiniMax-M1, 2025). eps_high = 4 (weight <= 5) as TRL recommends; no lower clip.
    """
    return _single(
        "cispo",
        cispo.__doc__,
        _policy(
            advantage_estimator="grpo", policy_loss="cispo", clip_eps=0.2, clip_eps_high=4.0, loss_aggregation="token"
        ),
    )


@recipe("sapo")
def sapo() -> TrainingConfig:
    """SAPO: a smooth, temperature-controlled gate of the ratio in place of the hard clip.

    loss = mean_i mean_{t in o_i} -sigmoid(tau (r - 1)) 4 / tau A_i, tau = 1 where A_i > 0, else 1.05, GRPO
    advantages (Soft Adaptive Policy Optimization, Gao et al. 2025; TRL's loss_type="sapo", its temperatures
    and its per-sequence mean). The gradient, 4 s (1 - s) r A grad log pi, is the policy gradient at r = 1 and
    fades smoothly as r leaves 1, where a clip cuts it off.
    """
    return _single(
        "sapo",
        sapo.__doc__,
        _policy(advantage_estimator="grpo", policy_loss="sapo", loss_aggregation="seq_mean_token_mean"),
    )


@recipe("vespo")
def vespo() -> TrainingConfig:
    """VESPO: the policy gradient weighted per sequence by a gamma-shaped function of its importance ratio.

    loss = sum_{i,t} -sg[phi(w_i)] A_i log pi_theta / #tokens, w_i = prod_t pi_theta / pi_old over o_i,
    phi(w) = exp(lambda + k log w - lambda w) (phi(1) = 1): k = 2, lambda = 3 where A_i >= 0, k = 3,
    lambda = 2 where A_i < 0; GRPO advantages (TRL's loss_type="vespo", its defaults and token mean).
    """
    return _single(
        "vespo",
        vespo.__doc__,
        _policy(advantage_estimator="grpo", policy_loss="vespo", loss_aggregation="token"),
    )


@recipe("grpo_async")
def grpo_async() -> TrainingConfig:
    """GRPO for stale (asynchronous) data: decoupled PPO with a recomputed proximal policy.

    loss = w * -min(r' A, clip(r', 0.8, 1.2) A), w = pi_prox / pi_behave (tokens with w > 5
    masked), r' = pi_theta / pi_prox, pi_prox from a no-grad forward at the start of the step
    (Hilton et al. 2022; AReaL). Token-level mean, GRPO advantages, no KL.
    """
    return _single(
        "grpo_async",
        grpo_async.__doc__,
        _policy(
            advantage_estimator="grpo",
            clip_eps=0.2,
            loss_aggregation="token",
            use_decoupled_loss=True,
            prox_logp_method="recompute",
            behav_imp_weight_cap=5.0,
            behav_weight_mode="mask",
        ),
    )


@recipe("grpo_async_loglinear")
def grpo_async_loglinear() -> TrainingConfig:
    """GRPO for stale data, decoupled PPO with pi_prox interpolated from policy versions (no extra forward).

    As grpo_async, but log pi_prox = log pi_behave + alpha (log pi_theta - log pi_behave),
    alpha = (v_prox - v_behave) / (v_prox + 1 - v_behave) (AReaL's loglinear approximation).
    """
    return _single(
        "grpo_async_loglinear",
        grpo_async_loglinear.__doc__,
        _policy(
            advantage_estimator="grpo",
            clip_eps=0.2,
            loss_aggregation="token",
            use_decoupled_loss=True,
            prox_logp_method="loglinear",
            behav_imp_weight_cap=5.0,
            behav_weight_mode="mask",
        ),
    )


@recipe("grpo_recompute")
def grpo_recompute() -> TrainingConfig:
    """GRPO for stale data with the coupled ratio taken against recomputed log-probs (no behaviour weight).

    loss = -min(r A, clip(r, 0.8, 1.2) A), r = pi_theta / pi_old with log pi_old from a no-grad
    forward of the current weights at the step's start (without the decoupled loss: the
    rollout's staleness is ignored, not corrected, and warned about when rollout.max_head_offpolicyness > 0). Token mean,
    GRPO advantages, no KL.
    """
    return _single(
        "grpo_recompute",
        grpo_recompute.__doc__,
        _policy(advantage_estimator="grpo", clip_eps=0.2, loss_aggregation="token", recompute_logprob=True),
    )


# ------------------------------------------------------------------------------ RL with a critic
@recipe("ppo")
def ppo(gamma: float = 1.0, gae_lambda: float = 0.95, value_clip_eps: float | None = 0.2) -> TrainingConfig:
    """PPO: actor + value critic, GAE advantages, clipped policy and value losses.

    delta_t = r_t + gamma V_{t+1} - V_t, A_t = sum_l (gamma lambda)^l delta_{t+l}, R_t = A_t + V_t;
    policy: -min(r A, clip(r, 0.8, 1.2) A) token mean; value: 0.5 max((V-R)^2, (clip(V, V_old
    +- 0.2) - R)^2) (Schulman et al. 2017; Ouyang et al. 2022). The critic is the same decoder with
    a scalar head, trained as its own role; no KL term by default. ``value_clip_eps``: the value
    clip's 0.2 (None: the unclipped squared error).
    """
    return TrainingConfig(
        name="ppo",
        roles=(
            _policy(
                advantage_estimator="gae", gamma=gamma, gae_lambda=gae_lambda, clip_eps=0.2, loss_aggregation="token"
            ),
            ModelRole(
                name="value",
                specialization_cls=CriticSpecialization,
                init_kwargs={"gamma": gamma, "gae_lambda": gae_lambda, "value_clip_eps": value_clip_eps},
            ),
        ),
        syncs=(DataSync(source="value", target="policy", keys=("values_T",), target_keys=("values_T",)),),
        description=_first_line(ppo.__doc__),
    )


@recipe("ppo_kl")
def ppo_kl(
    kl_coef: float = 0.05,
    gamma: float = 1.0,
    gae_lambda: float = 0.95,
    value_clip_eps: float | None = 0.2,
    kl_estimator: str = "k1",
) -> TrainingConfig:
    """PPO with a frozen reference: the KL penalty enters the token rewards (RLHF PPO).

    r_t = -kl_coef (log pi_old - log ref)_t, plus the sequence reward on the last token (k1 as in
    InstructGPT, Ouyang et al. 2022; ref scored at rollout.temperature, as pi_old was sampled);
    advantages and value targets by GAE over r_t, losses as ppo.
    The policy's and the critic's returns use the same penalised rewards: reference.logprobs_T is
    injected into both, and kl_estimator reaches both. The reference is the initial policy (so the penalty starts at the
    behaviour/initial log-prob gap).
    """
    return TrainingConfig(
        name="ppo_kl",
        roles=(
            _policy(
                advantage_estimator="gae",
                gamma=gamma,
                gae_lambda=gae_lambda,
                clip_eps=0.2,
                loss_aggregation="token",
                kl_coef=kl_coef,
                kl_estimator=kl_estimator,
                kl_in_reward=True,
            ),
            ModelRole(
                name="value",
                specialization_cls=CriticSpecialization,
                init_kwargs={
                    "gamma": gamma,
                    "gae_lambda": gae_lambda,
                    "value_clip_eps": value_clip_eps,
                    "kl_coef": kl_coef,
                    "kl_estimator": kl_estimator,
                },
            ),
            _reference(),
        ),
        syncs=(
            DataSync(source="value", target="policy", keys=("values_T",), target_keys=("values_T",)),
            _REF_SYNC,
            DataSync(source="reference", target="value", keys=("logprobs_T",), target_keys=("ref_logprobs_T",)),
        ),
        description=_first_line(ppo_kl.__doc__),
    )


@recipe("ppo_async")
def ppo_async(gamma: float = 1.0, gae_lambda: float = 0.95, value_clip_eps: float | None = 0.2) -> TrainingConfig:
    """PPO for stale (asynchronous) data: the critic of ppo with the decoupled loss of grpo_async.

    loss = w * -min(r' A, clip(r', 0.8, 1.2) A), w = pi_prox / pi_behave (tokens with w > 5
    masked), r' = pi_theta / pi_prox, pi_prox recomputed at the step's start; A by GAE from the
    value role (AReaL's decoupled PPO actor with a critic). Value loss as ppo.
    """
    return TrainingConfig(
        name="ppo_async",
        roles=(
            _policy(
                advantage_estimator="gae",
                gamma=gamma,
                gae_lambda=gae_lambda,
                clip_eps=0.2,
                loss_aggregation="token",
                use_decoupled_loss=True,
                prox_logp_method="recompute",
                behav_imp_weight_cap=5.0,
                behav_weight_mode="mask",
            ),
            ModelRole(
                name="value",
                specialization_cls=CriticSpecialization,
                init_kwargs={"gamma": gamma, "gae_lambda": gae_lambda, "value_clip_eps": value_clip_eps},
            ),
        ),
        syncs=(DataSync(source="value", target="policy", keys=("values_T",), target_keys=("values_T",)),),
        description=_first_line(ppo_async.__doc__),
    )


# ------------------------------------------------------------------------------ supervised / preference
@recipe("sft")
def sft() -> TrainingConfig:
    """SFT: next-token cross-entropy on completion tokens of an offline dataset.

    loss = sum_t -log pi_theta(x_t | x_<t) / #completion tokens (token-level mean over the batch).
    """
    return TrainingConfig(
        name="sft",
        roles=(ModelRole(name="policy", specialization_cls=SFTSpecialization, sync_to_rollout=True),),
        description=_first_line(sft.__doc__),
        online=False,
    )


@recipe("dpo")
def dpo(beta: float = 0.1) -> TrainingConfig:
    """DPO on preference pairs, against a frozen reference: the initial policy.

    loss = -log sigmoid(beta ((log pi(y_c) - log ref(y_c)) - (log pi(y_r) - log ref(y_r)))), mean
    over pairs (Rafailov et al. 2023); log pi(y) sums the completion's tokens. ref is a frozen copy of
    the starting model (TRL's default ref_model=None), its log-probs computed before each step
    (DataSync reference.logprobs_T -> policy.ref_logprobs_T), so step 1's loss is log 2. Data: rows
    {prompt, chosen, rejected}, each two sequences of one group_id, chosen first.
    """
    return _dpo("dpo", dpo.__doc__, beta)


@recipe("dpo_distributed")
def dpo_distributed(beta: float = 0.1) -> TrainingConfig:
    """DPO: the same recipe as dpo under a second name (both keep the frozen reference as a role of their own).

    Same loss, roles and data as dpo (DataSync reference.logprobs_T -> policy.ref_logprobs_T before
    each step). The name dates from when dpo read reference log-probs recorded with the data; either
    places the reference on devices of its own with cluster.role_devices={ref: [1]}.
    """
    return _dpo("dpo_distributed", dpo_distributed.__doc__, beta)


def _dpo(name: str, doc: str | None, beta: float) -> TrainingConfig:
    return TrainingConfig(
        name=name,
        roles=(
            ModelRole(
                name="policy",
                specialization_cls=DPOSpecialization,
                sync_to_rollout=True,
                init_kwargs={"beta": beta, "ref_key": "ref_logprobs_T"},
            ),
            _reference(),
        ),
        syncs=(_REF_SYNC,),
        description=_first_line(doc),
        online=False,
    )


@recipe("reward_model")
def reward_model() -> TrainingConfig:
    """Reward model: Bradley–Terry loss on a scalar head over the last token of each sequence.

    loss = -log sigmoid(s(y_c) - s(y_r)) mean over pairs (Ouyang et al. 2022); s reads the final
    hidden state of prompt + completion + EOS. Data: rows {prompt, chosen, rejected}. The role is
    not synced to rollout; it is exported as a transformers sequence classifier (num_labels=1).
    """
    return TrainingConfig(
        name="reward_model",
        roles=(ModelRole(name="reward", specialization_cls=RewardModelSpecialization),),
        description=_first_line(reward_model.__doc__),
        online=False,
    )


# ------------------------------------------------------------------------------ distillation / imitation
@recipe("opd")
def opd(teacher_path: str | None = None) -> TrainingConfig:
    """On-policy distillation: the student samples, a frozen teacher scores; per-token reverse KL.

    loss = sum_t 0.5 (log pi_student - log pi_teacher)_t^2 / #tokens on the student's own completions
    (k2; Agarwal et al. 2024; Thinking Machines 2025): its gradient is, in expectation over the
    student's samples, the per-token reverse KL(student || teacher)'s, the policy gradient with reward
    log pi_teacher - log pi_student that OPD uses; kl_estimator=k3 follows the forward KL instead.
    Both are scored at rollout.temperature T, log softmax(z / T), as TRL's GKDTrainer divides both
    logits by its temperature: the target is the teacher's sampling distribution at T. The KL's
    log-ratio is clamped to +-20 (no gradient beyond). Needs teacher_path.
    """
    return TrainingConfig(
        name="opd",
        roles=(
            ModelRole(name="policy", specialization_cls=DistillSpecialization, sync_to_rollout=True),
            _teacher(teacher_path),
        ),
        syncs=(_teacher_sync(),),
        description=_first_line(opd.__doc__),
    )


@recipe("dagger")
def dagger(teacher_path: str | None = None) -> TrainingConfig:
    """DAgger: the teacher labels each state the student visits; cross-entropy toward its action.

    a*_t = argmax_a pi_teacher(a | s_t) on the student's trajectory (the same at any temperature);
    loss = sum_t -log pi(a*_t | s_t) / #tokens, pi at rollout.temperature (Ross et al. 2011). The
    beta-mixture rollout policy is the workflow's: rollout.workflow=areno.workflows.teacher:TeacherMixtureWorkflow with workflow_kwargs.beta lets
    the teacher generate each completion with probability beta (default workflow: beta = 0, the
    student executes). Needs teacher_path.
    """
    return TrainingConfig(
        name="dagger",
        roles=(
            ModelRole(name="policy", specialization_cls=DaggerSpecialization, sync_to_rollout=True),
            _teacher(teacher_path),
        ),
        syncs=(_teacher_sync("argmax_T", "teacher_action_T"),),
        description=_first_line(dagger.__doc__),
    )


@recipe("aggrevate")
def aggrevate(
    teacher_path: str | None = None,
    q_source: str = "teacher_logprob",
    reward_model_path: str | None = None,
    value_head_path: str | None = None,
) -> TrainingConfig:
    """AggreVaTe: weight the student's actions by the teacher's (whitened) action value.

    A_t = whiten(Q*_t) with Q*_t = log pi_teacher(a_t|s_t) at rollout.temperature as a proxy
    (q_source=teacher_logprob, the default), teacher_q_T measured by the rollout workflow
    (q_source=workflow with rollout.workflow=areno.workflows.teacher:TeacherQWorkflow: the teacher's
    roll-outs sample at rollout.temperature too; the student rolls in to a random
    token, the teacher rolls out, Q = the reward; only those tokens train), or a frozen scorer's
    head at every token, Q(s_t, a_t) = head(h_t) with h_t the hidden state that has read a_t:
    q_source=reward_model reads a transformers sequence-classification checkpoint
    (reward_model_path; role `reward`), q_source=value_head an areno critic checkpoint
    (value_head_path = checkpoints/step_N/<critic role>; role `value`, decoder shape of model.path).
    loss = sum_t -A_t log pi(a_t | s_t) / #tokens (Ross & Bagnell 2014). teacher_path is needed
    for teacher_logprob and workflow.
    """
    policy = ModelRole(
        name="policy",
        specialization_cls=AggrevateSpecialization,
        sync_to_rollout=True,
        init_kwargs={"q_source": q_source},
    )
    if q_source not in SCORER_Q_SOURCES:
        return TrainingConfig(
            name="aggrevate",
            roles=(policy, _teacher(teacher_path)),
            syncs=(_teacher_sync(),),
            description=_first_line(aggrevate.__doc__),
        )
    key = f"{q_source}_path"
    path = reward_model_path if q_source == "reward_model" else value_head_path
    if not path:
        raise ConfigError(
            f"aggrevate q_source={q_source}: set train.algorithm_kwargs.{key} (the scorer checkpoint to read Q from)"
        )
    scorer = ModelRole(
        name="reward" if q_source == "reward_model" else "value",
        specialization_cls=ScalarScorerSpecialization,
        trainable=False,
        # a reward model is its own checkpoint; a critic's decoder has model.path's shape
        model_path=path if q_source == "reward_model" else None,
        init_kwargs={"head": q_source, "head_path": path},
    )
    return TrainingConfig(
        name="aggrevate",
        roles=(policy, scorer),
        syncs=(DataSync(source=scorer.name, target="policy", keys=("q_T",), target_keys=("teacher_q_T",)),),
        description=_first_line(aggrevate.__doc__),
    )


@recipe("mixed_loss_dagger_opd")
def mixed_loss_dagger_opd(teacher_path: str | None = None, beta_decay_steps: int = 100) -> TrainingConfig:
    """Mixed DAgger/OPD: CE on teacher-executed tokens, reverse KL on student tokens, beta schedule.

    loss = sum_t [beta CE_t 1(teacher-executed) + (1 - beta) k2_t 1(student-executed)] / #tokens
    (k2 as opd's: the reverse KL's gradient in expectation),
    beta linear from beta_start = 1 (pure CE) to beta_end = 0 (pure k2) over beta_decay_steps policy
    versions; the student and the teacher are scored at rollout.temperature (as opd). Needs
    teacher_path; teacher-executed tokens come from the workflow
    (areno.workflows.teacher:TeacherMixtureWorkflow marks them teacher_executed_T); with the
    default workflow no token is teacher-executed and the CE term is 0.
    """
    return TrainingConfig(
        name="mixed_loss_dagger_opd",
        roles=(
            ModelRole(
                name="policy",
                specialization_cls=MixedLossDaggerOPDSpecialization,
                sync_to_rollout=True,
                init_kwargs={"beta_start": 1.0, "beta_end": 0.0, "beta_decay_steps": beta_decay_steps},
            ),
            _teacher(teacher_path),
        ),
        syncs=(_teacher_sync(),),
        description=_first_line(mixed_loss_dagger_opd.__doc__),
    )
