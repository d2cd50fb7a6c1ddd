"""``ActorSpecialization``: the PPO-family policy (GRPO, Dr.GRPO, DAPO, GSPO, RLOO, REINFORCE++,
CISPO, PPO), configured entirely by one ``ActorConfig`` so every variant is a recipe, not a subclass.

Per step, on the whole batch (``prepare_batch``): optional overlong penalty on rewards, optional
dynamic-sampling filter, then the advantage estimator. Per micro-batch (``compute_loss``):

    loss_t = m_t policy_loss_t + kl_coef * k(pi, pi_ref)_t - entropy_coef * H_t
    loss   = sum_t w_t loss_t / denominator           (w, denominator from ``loss_aggregation``)

where m_t is 0 on the tokens the off-policy sequence mask and the entropy mask (``top_entropy_quantile``)
leave out of the policy loss and 1 elsewhere: neither changes the denominator. With ``entropy_target`` the
entropy coefficient is adaptive: ``after_optimizer_step`` moves it from each step's entropy (its state is
checkpointed through ``state_dict``).

The logged statistics (``actor/ratio``, clip fractions, ``kl``, ``entropy``) are averages under every
aggregation: the ``constant`` and ``seq_mean_token_sum`` ones' are the mean over sequences of each one's
token mean, not the loss's sums (``statistics_weights_T``).

Legend: B = sequences, T = packed tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from areno.algo import (
    BEHAV_WEIGHT_MODES,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    LOSS_KL_ESTIMATORS,
    aggregation_denominator,
    aggregation_weights_T,
    broadcast_to_tokens_T,
    cispo_loss_T,
    decoupled_ppo_loss_T,
    dynamic_sampling_keep_B,
    entropy_bonus_T,
    gae_T,
    gdpo_advantages_B,
    group_index_B,
    grpo_advantages_B,
    grpo_batch_std_advantages_B,
    gspo_loss_T,
    high_entropy_mask_T,
    importance_weighted_kl_T,
    kl_estimate_T,
    kl_reward_penalty_T,
    loglinear_prox_logprobs_T,
    off_policy_sequence_mask_T,
    overlong_penalty_B,
    ppo_clip_loss_T,
    reinforce_pp_advantages_T,
    rloo_advantages_B,
    sapo_loss_T,
    statistics_weights_T,
    vespo_loss_T,
)
from areno.errors import ConfigError, check_types
from areno.specializations.base import (
    POLICY_VERSION_KEY,
    Metrics,
    ModelSpecialization,
    Reducer,
    kept_sequences,
    reduce_stats,
)
from areno.specializations.forward import token_logprobs_T
from areno.types import REWARD_PARTS_KEY, TokenBatch

ADVANTAGE_ESTIMATORS = (
    "grpo",
    "dr_grpo",
    "grpo_batch_std",
    "gdpo",
    "rloo",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "gae",
    "given",
)
GROUP_ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo", "grpo_batch_std", "gdpo", "rloo", "reinforce_pp_baseline")
"""The estimators whose baseline is the group's mean reward: a group of one has advantage 0."""
POLICY_LOSSES = ("ppo", "gspo", "cispo", "sapo", "vespo")
PROX_LOGP_METHODS = ("recompute", "loglinear")


@dataclass(frozen=True, kw_only=True)
class ActorConfig:
    """The options of ``ActorSpecialization``: what selects a PPO-family variant. Recipes set them
    (``areno/recipes/builtin.py``) and users override them through ``train.algorithm_kwargs``;
    every value is checked at construction (``ConfigError`` naming the option)."""

    # ---------------------------------------------------------------- advantages
    advantage_estimator: str = "grpo"
    """One of ``ADVANTAGE_ESTIMATORS``: ``grpo`` (group-normalised), ``dr_grpo`` (no std scaling),
    ``grpo_batch_std`` (the group's mean subtracted, divided by the std of the step's whole batch of rewards:
    Lite PPO's, TRL's ``scale_rewards="batch"``), ``gdpo`` (each function of a ``reward.fn`` list normalised in
    its group, their ``reward.weights`` sum normalised over the batch: TRL's
    ``multi_objective_aggregation="normalize_then_sum"``), ``rloo``, ``reinforce_pp`` / ``reinforce_pp_baseline``,
    ``gae`` (needs ``values_T`` from a critic role) or ``given`` (keeps the batch's ``advantages_T``)."""
    adv_eps: float = 1e-4
    """Added to the reward std before dividing (``grpo``: the group's; ``grpo_batch_std``: the batch's;
    ``gdpo``: each function's in its group, then the batch's)."""
    reward_weights: tuple[float, ...] | None = None
    """``gdpo``'s weight of each function of the ``reward.fn`` list: set by the run from ``reward.weights``
    (1.0 each where null), never in ``train.algorithm_kwargs``."""
    gamma: float = 1.0
    """Discount in [0, 1] (``gae``, ``reinforce_pp``)."""
    gae_lambda: float = 1.0
    """GAE's lambda in [0, 1]."""
    # ---------------------------------------------------------------- policy loss
    policy_loss: str = "ppo"
    """One of ``POLICY_LOSSES``: ``ppo`` (token-level clipped ratio), ``gspo`` (sequence-level
    ratio), ``cispo`` (clipped importance weight, stop-gradient), ``sapo`` (a sigmoid gate of the ratio in
    place of the clip) or ``vespo`` (a gamma-shaped weight of the sequence's ratio, stop-gradient)."""
    clip_eps: float = 0.2
    """Lower clip range of the ratio (> 0); also the upper one unless ``clip_eps_high`` is set."""
    clip_eps_high: float | None = None
    """Upper clip range (> 0; clip-higher as in DAPO when it differs from ``clip_eps``)."""
    dual_clip_c: float | None = None
    """Dual-clip bound of the loss for negative advantages (``ppo``); None: no dual clip."""
    sapo_temperature_pos: float = 1.0
    """``sapo``'s gate temperature where the advantage is positive (> 0; larger: the gradient fades faster as
    the ratio leaves 1). TRL's default."""
    sapo_temperature_neg: float = 1.05
    """``sapo``'s gate temperature where the advantage is 0 or negative (> 0). TRL's default."""
    vespo_k_pos: float = 2.0
    """``vespo``'s power k of the sequence ratio w where the advantage is >= 0 (>= 0; larger: sequences whose w
    is below 1 weigh less). TRL's default."""
    vespo_lambda_pos: float = 3.0
    """``vespo``'s decay lambda where the advantage is >= 0 (> 0; larger: sequences whose w is above 1 weigh
    less). TRL's default."""
    vespo_k_neg: float = 3.0
    """``vespo``'s k where the advantage is negative (>= 0). TRL's default."""
    vespo_lambda_neg: float = 2.0
    """``vespo``'s lambda where the advantage is negative (> 0). TRL's default."""
    loss_aggregation: str = "token"
    """How token losses are weighted and normalised: one of ``LOSS_AGGREGATIONS`` (``token``: the step's token
    mean; ``seq_mean_token_mean``: each sequence's token mean, averaged; ``seq_mean_token_sum``: each sequence's
    token sum, averaged, LUSPO's; ``constant``: the sum over B * ``loss_agg_constant``)."""
    loss_agg_constant: float = 1024.0
    """The denominator per sequence of the ``constant`` aggregation (> 0): Dr. GRPO's L, which the
    ``dr_grpo`` recipe sets from its ``max_completion_length`` (by default rollout.max_new_tokens). The
    logged statistics are not divided by it (``algo.aggregation.statistics_weights_T``)."""
    # ---------------------------------------------------------------- regularisers
    kl_coef: float = 0.0
    """Weight (>= 0) of the KL to a frozen reference (needs ``ref_logprobs_T``); 0: none. Its log-ratio
    is clamped to +-20 (``areno.algo.kl``): no KL gradient beyond."""
    kl_target: float | None = None
    """Adaptive KL control (Ziegler et al. 2019; verl's ``kl_ctrl.type=adaptive``, OpenRLHF's ``kl_target``): the
    coefficient starts at ``kl_coef`` (> 0) and after each optimizer step is multiplied by 1 + e n / ``kl_horizon``,
    e = clip(KL / kl_target - 1, -0.2, 0.2), KL the step's ``actor/kl`` (the policy's KL to the reference over the
    loss tokens) and n the sequences of the step's batch: the KL is held near this target. In the loss or in the
    reward (``kl_in_reward``); a critic that takes the KL into its returns (``ppo_kl``'s value role) follows the
    moved coefficient (``shared_state``). Checkpointed. None: ``kl_coef`` fixed."""
    kl_horizon: float = 10000.0
    """Adaptive KL control's horizon in sequences (> 0; with ``kl_target``): the larger, the slower the coefficient
    moves. verl's and OpenRLHF's default."""
    kl_estimator: str = "k3"
    """KL estimator: one of ``KL_ESTIMATORS``; in the loss k3 (its gradient the forward KL's, as DeepSeekMath)
    or k2 (the reverse KL's), k1 only as a reward penalty (``kl_in_reward``): in the loss its expected gradient is 0."""
    kl_in_reward: bool = False
    """Subtract the KL from the token rewards instead of adding it to the loss."""
    kl_bias_correction: bool = False
    """Weight each token's KL term by the importance weight pi_theta / pi_behave (TRL's
    ``use_bias_correction_kl``): the tokens were sampled by the rollout's policy, so the weighted estimate is
    the current policy's KL in expectation. The weight keeps its gradient, as TRL's. A loss term's only
    (``kl_coef`` > 0, ``kl_in_reward`` false)."""
    entropy_coef: float = 0.0
    """Weight (>= 0) of the entropy bonus; 0: none. With ``entropy_target``, the controller's first value."""
    entropy_target: float | None = None
    """Adaptive entropy control (Skywork-OR1; TRL's ``use_adaptive_entropy`` with its ``entropy_target``, e.g.
    0.2 nats): after each optimizer step the coefficient moves by ``entropy_coef_delta``, up where the step's
    ``actor/entropy`` was at or below this target, down otherwise, within [``entropy_coef_min``,
    ``entropy_coef_max``]; a step applies the bonus only while the previous step's entropy was at or below it
    (the first step none). Checkpointed. None: off (``entropy_coef`` fixed)."""
    entropy_coef_delta: float = 0.005
    """The adaptive coefficient's step per optimizer step (> 0; with ``entropy_target``). TRL's default."""
    entropy_coef_min: float = 0.0
    """The adaptive coefficient's lower bound (>= 0; with ``entropy_target``). TRL's default."""
    entropy_coef_max: float = 1.0
    """The adaptive coefficient's upper bound (>= ``entropy_coef_min``; with ``entropy_target``). TRL's default."""
    temperature: float = 1.0
    """Sampling temperature the log-probs are computed at (> 0). Set by the run to rollout.temperature
    for an online recipe (as for its reference and teacher roles); ``train.algorithm_kwargs.temperature``
    is refused (``specializations.base.RUN_SET_OPTIONS``)."""
    top_entropy_quantile: float = 1.0
    """The share of loss tokens, in (0, 1], that keep their policy-gradient term: those whose entropy is at or
    above the (1 - q) quantile of the micro-batch's loss tokens' (Wang et al. 2025, the high-entropy forking
    tokens; TRL's ``top_entropy_quantile``, e.g. 0.2). The others stay in the loss's denominator and in the KL
    term, as in TRL. The quantile is over the micro-batch of every data-parallel rank at once (gathered, as TRL
    gathers its processes'), with the sequences of zero advantage in it (``skip_zero_advantage`` is off with it,
    as their tokens count in the quantile). 1: off (no entropy computed for it)."""
    # ---------------------------------------------------------------- off-policy
    use_decoupled_loss: bool = False
    """Decoupled PPO (``policy_loss='ppo'`` only): clip against pi_prox, weight by pi_prox/pi_behav."""
    recompute_logprob: bool = False
    """The coupled loss uses recomputed log-probs of the current weights instead of the behaviour ones."""
    prox_logp_method: str = "recompute"
    """Where pi_prox comes from: ``recompute`` (a no-grad forward before the step) or
    ``loglinear`` (interpolated from the policy versions)."""
    behav_imp_weight_cap: float | None = None
    """Cap (> 0) of the behaviour importance weight pi_prox / pi_behav of decoupled PPO; None: no cap (TRL's
    ``vllm_importance_sampling_clip_max``)."""
    behav_imp_weight_min: float | None = None
    """Lower bound of the behaviour importance weight, in [0, behav_imp_weight_cap); None: none (TRL's
    ``vllm_importance_sampling_clip_min``): the mask modes drop a weight below it, the truncate modes raise
    it to it. 0 bounds nothing (a weight is never below it): a recipe refuses it."""
    behav_weight_mode: str = "mask"
    """One of ``BEHAV_WEIGHT_MODES``, what a weight outside its bounds does: ``mask`` drops the token,
    ``truncate`` clamps its weight; ``sequence_mask`` / ``sequence_truncate`` take one weight per sequence,
    exp of the sum over its loss tokens of log pi_prox - log pi_behav, and drop the whole sequence or clamp
    that weight for each of its tokens (TRL's ``vllm_importance_sampling_mode``; its default is
    ``sequence_mask``)."""
    off_policy_mask_threshold: float | None = None
    """DeepSeek-V3.2's off-policy sequence masking (TRL's ``off_policy_mask_threshold``, the paper's delta,
    > 0): a sequence of negative advantage whose mean over its loss tokens of log pi_behav - log pi_theta
    (sampler against the weights being trained) exceeds it is left out of the policy loss (not of its
    denominator, nor of the KL term). With every policy loss. None: off."""
    # ---------------------------------------------------------------- batch shaping
    dynamic_sampling: bool = False
    """Leave out groups whose rewards are all equal before the overlong penalty (DAPO's dynamic sampling):
    the rollout keeps sampling until the batch holds ``rollout.batch_size`` groups with varied rewards
    (``dynamic_sampling_max_rounds``); training drops whatever such groups still reach it."""
    dynamic_sampling_max_rounds: int = 10
    """With ``dynamic_sampling``: the samples a step may generate for its batch, in rounds of
    ``rollout.batch_size``. A synchronous step runs up to this many generation rounds (each sized by
    the step's share of groups kept so far) and trains on the groups it kept; the asynchronous pool
    generates until the batch is full. Either stops the run when this many batches' worth of samples in
    a row kept no group (the policy solves, or fails, every prompt alike). 1: no re-sampling (the step
    trains on the groups of its one batch that pass, or on none: the optimizer still steps, as TRL's and
    verl's do, so momentum and weight decay move the weights)."""
    mask_truncated_completions: bool = False
    """Leave completions cut at the length limit (no EOS: ``finish_reason`` "length") out of the loss: their
    tokens train nothing and leave the loss's denominator, while their rewards still count in their
    group's baseline (DAPO's overlong filtering; TRL's ``mask_truncated_completions``, AReaL's
    ``mask_no_eos_with_zero``). The policy's loss only: a PPO critic still fits its values on them."""
    overlong_max_length: int | None = None
    """Completion length past which DAPO's overlong penalty applies; None: no penalty."""
    overlong_buffer_length: int = 0
    """Length of the soft penalty ramp before ``overlong_max_length``, in (0, overlong_max_length]."""
    overlong_penalty: float = 1.0
    """Penalty at and beyond ``overlong_max_length``."""
    skip_zero_advantage: bool = True
    """Leave sequences whose advantages are all zero (a GRPO group whose rewards are all equal) out of
    the step's forward and backward, where the loss has no other term (``kl_coef`` 0 or the KL in the
    reward, ``entropy_coef`` 0): their gradient is zero and the loss keeps the whole batch's denominator,
    so the update is the same up to summation order. The step's loss statistics (``actor/pg_loss`` and
    the clip fractions) are means over the sequences it trained. Not where the backend truncates long
    sequences (``train.long_sequences=truncate``): that denominator is the truncated batch's."""
    logprob_chunk_size: int | None = None
    """Tokens per chunk of the LM head's log-prob computation (memory and speed, not values); None:
    ``models.logprobs.auto_chunk_size`` (on a GPU as large as 1/16 of its memory allows)."""

    def __post_init__(self) -> None:
        # types first: a range check below would compare a string with a number (a raw TypeError)
        check_types(self, type(self).__name__, ActorConfig)  # a subclass's own fields are its own to check

        def check(ok: bool, key: str, why: str) -> None:
            if not ok:
                raise ConfigError(f"ActorConfig.{key} {why}")

        for key, allowed in (
            ("advantage_estimator", ADVANTAGE_ESTIMATORS),
            ("policy_loss", POLICY_LOSSES),
            ("loss_aggregation", LOSS_AGGREGATIONS),
            ("kl_estimator", KL_ESTIMATORS),
            ("prox_logp_method", PROX_LOGP_METHODS),
            ("behav_weight_mode", BEHAV_WEIGHT_MODES),
        ):
            value = getattr(self, key)
            check(value in allowed, key, f"must be one of {allowed}, got {value!r}")
        check(self.clip_eps > 0, "clip_eps", f"must be > 0, got {self.clip_eps}")
        check(
            self.clip_eps_high is None or self.clip_eps_high > 0,
            "clip_eps_high",
            f"must be > 0 or None, got {self.clip_eps_high}",
        )
        check(
            self.dual_clip_c is None or self.dual_clip_c > 1,
            "dual_clip_c",
            f"must be > 1 or None (the lower bound c A on negative advantages), got {self.dual_clip_c}",
        )
        for key in ("sapo_temperature_pos", "sapo_temperature_neg", "vespo_lambda_pos", "vespo_lambda_neg"):
            check(getattr(self, key) > 0, key, f"must be > 0, got {getattr(self, key)}")
        for key in ("vespo_k_pos", "vespo_k_neg"):
            check(getattr(self, key) >= 0, key, f"must be >= 0, got {getattr(self, key)}")
        check(self.kl_coef >= 0, "kl_coef", f"must be >= 0, got {self.kl_coef}")
        check(
            self.kl_coef == 0 or self.kl_in_reward or self.kl_estimator in LOSS_KL_ESTIMATORS,
            "kl_estimator",
            f"must be k3 or k2 while the KL is a loss term (kl_coef={self.kl_coef:g}, kl_in_reward=false), got "
            f"{self.kl_estimator!r}: its expected gradient on the policy's samples is 0 (E[grad log pi] = 0), so the "
            "term would add noise and no KL; set kl_estimator=k3, or kl_in_reward=true to keep k1 as a reward penalty",
        )
        check(
            self.kl_target is None or (self.kl_target > 0 and self.kl_coef > 0),
            "kl_target",
            f"must be > 0 (the KL adaptive control holds the policy at, e.g. 0.1), with kl_coef > 0 its first "
            f"coefficient, or None (off); got kl_target={self.kl_target}, kl_coef={self.kl_coef:g}",
        )
        check(self.kl_horizon > 0, "kl_horizon", f"must be > 0, got {self.kl_horizon}")
        check(self.entropy_coef >= 0, "entropy_coef", f"must be >= 0, got {self.entropy_coef}")
        check(
            self.entropy_target is None or self.entropy_target > 0,
            "entropy_target",
            f"must be > 0 (the mean entropy in nats the adaptive bonus holds the policy at, e.g. 0.2) or None (off), "
            f"got {self.entropy_target}",
        )
        check(self.entropy_coef_delta > 0, "entropy_coef_delta", f"must be > 0, got {self.entropy_coef_delta}")
        check(
            0 <= self.entropy_coef_min <= self.entropy_coef_max,
            "entropy_coef_min",
            f"must be >= 0 and <= entropy_coef_max ({self.entropy_coef_max}), got {self.entropy_coef_min}",
        )
        check(self.temperature > 0, "temperature", f"must be > 0, got {self.temperature}")
        check(
            0 < self.top_entropy_quantile <= 1,
            "top_entropy_quantile",
            f"(train.algorithm_kwargs.top_entropy_quantile) must be in (0, 1] (the share of loss tokens, highest entropy "
            f"first, that keep their policy-gradient term, e.g. 0.2; 1: all), got {self.top_entropy_quantile}",
        )
        check(0 <= self.gamma <= 1, "gamma", f"must be in [0, 1], got {self.gamma}")
        check(0 <= self.gae_lambda <= 1, "gae_lambda", f"must be in [0, 1], got {self.gae_lambda}")
        check(self.loss_agg_constant > 0, "loss_agg_constant", f"must be > 0, got {self.loss_agg_constant}")
        check(
            self.behav_imp_weight_cap is None or self.behav_imp_weight_cap > 0,
            "behav_imp_weight_cap",
            f"must be > 0 or None, got {self.behav_imp_weight_cap}",
        )
        check(
            self.behav_imp_weight_min is None
            or 0 <= self.behav_imp_weight_min < (self.behav_imp_weight_cap or float("inf")),
            "behav_imp_weight_min",
            f"must be >= 0 and below behav_imp_weight_cap ({self.behav_imp_weight_cap}), or None (no lower bound), "
            f"got {self.behav_imp_weight_min}",
        )
        check(
            self.off_policy_mask_threshold is None or self.off_policy_mask_threshold > 0,
            "off_policy_mask_threshold",
            f"must be > 0 (the mean per-token KL past which a negative-advantage sequence is dropped, e.g. 0.5) "
            f"or None (off), got {self.off_policy_mask_threshold}",
        )
        check(
            self.logprob_chunk_size is None or self.logprob_chunk_size > 0,
            "logprob_chunk_size",
            f"must be > 0 or None (automatic), got {self.logprob_chunk_size}",
        )
        check(
            not self.use_decoupled_loss or self.policy_loss == "ppo",
            "use_decoupled_loss",
            f"works with policy_loss='ppo' only, got {self.policy_loss!r}",
        )
        check(
            self.dynamic_sampling_max_rounds >= 1,
            "dynamic_sampling_max_rounds",
            f"must be >= 1 (1: no re-sampling), got {self.dynamic_sampling_max_rounds}",
        )
        check(
            self.overlong_max_length is None or 0 < self.overlong_buffer_length <= self.overlong_max_length,
            "overlong_buffer_length",
            "must be in (0, overlong_max_length] when overlong_max_length is set",
        )


class ActorSpecialization(ModelSpecialization):
    """PPO-family actor, configured by one ``ActorConfig`` (see its fields).

    Advantages: ``advantage_estimator``. Policy loss: ``policy_loss`` with ``clip_eps`` /
    ``clip_eps_high`` (clip-higher when different) and ``dual_clip_c``. Off-policy:
    ``use_decoupled_loss`` with ``prox_logp_method`` (``recompute``: a no-grad forward of the current
    weights before the step gives pi_prox; ``loglinear``: interpolated from versions),
    ``behav_imp_weight_cap``, ``behav_imp_weight_min`` and ``behav_weight_mode`` (per token or per
    sequence); ``recompute_logprob`` makes the coupled loss use recomputed instead of behaviour log-probs;
    ``off_policy_mask_threshold`` drops far-off negative-advantage sequences from any policy loss;
    ``top_entropy_quantile`` keeps the policy loss of each micro-batch's highest-entropy tokens only.
    """

    config_cls = ActorConfig
    output_keys = ("logprobs_T", "entropy_T")

    def __init__(self, config: ActorConfig | None = None) -> None:
        self.config = config if config is not None else ActorConfig()
        needs = []
        if self.config.kl_coef > 0:
            needs.append("ref_logprobs_T")
        if self.config.advantage_estimator == "gae":
            needs.append("values_T")
        self.required_extra_keys = tuple(needs)
        self._entropy_coef = self.config.entropy_coef
        """The entropy bonus's coefficient: ``entropy_coef``, which adaptive control moves."""
        self._kl_coef = self.config.kl_coef
        """The KL term's coefficient: ``kl_coef``, which adaptive KL control (``kl_target``) moves."""
        self._last_entropy = float("inf")
        """The last optimizer step's ``actor/entropy`` (adaptive control; none yet: the bonus stays off)."""

    @property
    def self_forward_keys(self) -> dict[str, str]:
        recompute = self.config.recompute_logprob or (
            self.config.use_decoupled_loss and self.config.prox_logp_method == "recompute"
        )
        return {"logprobs_T": "prox_logprobs_T"} if recompute else {}

    @property
    def reads_rewards(self) -> bool:
        return self.config.advantage_estimator != "given"

    def shared_state(self) -> dict[str, float]:
        # a critic that puts the KL into its returns (ppo_kl) follows the coefficient adaptive control moves
        return {"kl_coef": self._kl_coef} if self.config.kl_target is not None else {}

    @property
    def needs_groups(self) -> str | None:
        if self.config.advantage_estimator in GROUP_ADVANTAGE_ESTIMATORS:
            return f"advantage_estimator={self.config.advantage_estimator}"
        if self.config.dynamic_sampling:  # drops every group whose rewards are all equal: all groups of one
            return "dynamic_sampling=True"
        return None

    # ------------------------------------------------------------------ whole batch
    def prepare_batch(self, rollout_data: TokenBatch) -> TokenBatch:
        return self._prepare_kept(rollout_data)[0]

    def self_forward_free_B(self, batch: TokenBatch) -> torch.Tensor | None:
        # the advantages and the dynamic-sampling filter read no self-forward output
        prepared, kept_B = self._prepare_kept(batch)
        free_B = self.gradient_free_B(prepared)
        if kept_B is None:
            return free_B
        out_B = ~kept_B
        if free_B is not None:
            out_B[kept_B] = free_B
        return out_B if bool(out_B.any()) else None

    def prepare_metrics(self, rollout_data: TokenBatch) -> dict[str, float]:
        """With the overlong penalty: ``overlong_penalty_mean`` over the batch's sequences. With
        ``dynamic_sampling``: ``dynamic_sampling_dropped_seqs`` / ``_groups``, what the filter drops (every
        sequence when every group's rewards are equal: the step then trains on none)."""
        out = {}
        if self.config.mask_truncated_completions:
            out["masked_truncated_seqs"] = float(self._truncated_B(rollout_data).sum())
        if self.config.overlong_max_length is not None:  # the mean reward change the advantages see
            out["overlong_penalty_mean"] = self._overlong_penalty_B(rollout_data).mean().item()
        keep_B = self._dynamic_sampling_keep_B(rollout_data)
        if keep_B is None:
            return out
        dropped_groups = group_index_B(_group_ids(rollout_data))[~keep_B].unique().numel()
        return out | {
            "dynamic_sampling_dropped_seqs": float((~keep_B).sum()),
            "dynamic_sampling_dropped_groups": float(dropped_groups),
        }

    @staticmethod
    def _truncated_B(batch: TokenBatch) -> torch.Tensor:
        """bool [B]: the sequences cut at the length limit (``mask_truncated_completions``)."""
        if batch.truncated_B is None:
            raise ValueError(
                "ActorConfig.mask_truncated_completions: this batch says nothing of truncation (truncated_B is None; "
                "TokenBatch.from_trajectories sets it from each trajectory's finish_reason)"
            )
        return batch.truncated_B.to(device=batch.loss_mask_T.device, dtype=torch.bool)

    def _overlong_penalty_B(self, batch: TokenBatch) -> torch.Tensor:
        """DAPO's soft overlong penalty of each sequence (``overlong_max_length`` set)."""
        assert self.config.overlong_max_length is not None
        return overlong_penalty_B(
            _completion_lengths_B(batch),
            max_length=self.config.overlong_max_length,
            buffer_length=self.config.overlong_buffer_length,
            penalty=self.config.overlong_penalty,
        )

    def batch_metrics(self, prepared: TokenBatch) -> dict[str, float]:
        """``advantage_mean`` / ``_std`` / ``_min`` / ``_max`` over the loss tokens of the prepared batch (the
        sequences dynamic sampling kept; none where no token has a loss)."""
        mask_T = prepared.loss_mask_T.bool()
        if not bool(mask_T.any()):
            return {}
        adv = prepared.advantages_T[mask_T].double()
        return {
            "advantage_mean": adv.mean().item(),
            "advantage_std": adv.std(unbiased=False).item(),
            "advantage_min": adv.min().item(),
            "advantage_max": adv.max().item(),
        }

    def _dynamic_sampling_keep_B(self, rollout_data: TokenBatch) -> torch.Tensor | None:
        """bool [B]: the sequences dynamic sampling keeps (None: it is off). The filter reads the task's
        rewards, before the overlong penalty (DAPO's eq. 11 keeps a group by its accuracy): a group all
        wrong at different lengths would otherwise train on its lengths alone."""
        if not self.config.dynamic_sampling:
            return None
        return dynamic_sampling_keep_B(rollout_data.rewards_B, group_index_B(_group_ids(rollout_data)))

    def _prepare_kept(self, rollout_data: TokenBatch) -> tuple[TokenBatch, torch.Tensor | None]:
        """``prepare_batch``'s batch and the sequences of ``rollout_data`` the dynamic-sampling filter
        kept (bool [B]; None: all)."""
        self._check_extra(rollout_data)
        kept_B = None
        batch = rollout_data
        keep_B = self._dynamic_sampling_keep_B(batch)
        if self.config.overlong_max_length is not None:
            batch = dataclasses.replace(batch, rewards_B=batch.rewards_B + self._overlong_penalty_B(batch))
        if self.config.mask_truncated_completions:  # after the penalty, which counts their loss tokens
            seq_T = torch.repeat_interleave(self._truncated_B(batch), batch.seqlens_B)
            batch = dataclasses.replace(batch, loss_mask_T=batch.loss_mask_T & ~seq_T)
        if keep_B is not None:
            if keep_B.any():
                batch = batch.select(torch.nonzero(keep_B).flatten().tolist())
                kept_B = keep_B.bool()
            else:  # every group is degenerate: train on nothing this step, through one sequence without loss
                # tokens (the shortest, as the runner keeps of a batch it skips whole): none is counted twice,
                # as dropped and as skipped, and none is forwarded for nothing
                one = kept_sequences(batch, torch.ones(batch.num_seqs, dtype=torch.bool))
                batch = batch.select(one)
                batch = dataclasses.replace(batch, loss_mask_T=torch.zeros_like(batch.loss_mask_T))
                kept_B = torch.zeros(rollout_data.num_seqs, dtype=torch.bool)
                kept_B[one] = True
        return self.compute_advantages(batch), kept_B

    def compute_advantages(self, rollout_data: TokenBatch) -> TokenBatch:
        b = rollout_data
        est = self.config.advantage_estimator
        if est == "given":
            return b
        mask_T = b.loss_mask_T
        token_rewards_T = None
        if self.config.kl_in_reward and self.config.kl_coef > 0:
            token_rewards_T = kl_reward_penalty_T(
                b.logprobs_T,
                b.extra["ref_logprobs_T"],
                mask_T,
                coef=self._kl_coef,
                estimator=self.config.kl_estimator,
            )
        group_B = group_index_B(_group_ids(b))
        extra = {}
        if est in ("grpo", "dr_grpo"):
            adv_B = grpo_advantages_B(b.rewards_B, group_B, scale_by_std=est == "grpo", eps=self.config.adv_eps)
            adv_T = broadcast_to_tokens_T(adv_B, b.cu_seqlens_B1, mask_T)
        elif est == "grpo_batch_std":  # the std of the step's whole batch: prepare_batch sees it whole
            adv_B = grpo_batch_std_advantages_B(b.rewards_B, group_B, eps=self.config.adv_eps)
            adv_T = broadcast_to_tokens_T(adv_B, b.cu_seqlens_B1, mask_T)
        elif est == "gdpo":  # the step's whole batch too: its last normalisation is the batch's
            if not self.config.reward_weights:  # set by areno's run (resolve_recipe): a recipe built by hand
                raise ValueError(
                    "advantage_estimator=gdpo needs reward_weights, one weight per function of the reward.fn list "
                    "(areno's run sets them from reward.weights): pass ActorConfig(reward_weights=...)"
                )
            weights_K = torch.tensor(self.config.reward_weights, dtype=torch.float64)
            adv_B = gdpo_advantages_B(_reward_parts_BK(b, len(weights_K)), weights_K, group_B, eps=self.config.adv_eps)
            adv_T = broadcast_to_tokens_T(adv_B, b.cu_seqlens_B1, mask_T)
        elif est == "rloo":
            adv_T = broadcast_to_tokens_T(rloo_advantages_B(b.rewards_B, group_B), b.cu_seqlens_B1, mask_T)
        elif est in ("reinforce_pp", "reinforce_pp_baseline"):
            adv_T = reinforce_pp_advantages_T(
                b.rewards_B,
                b.cu_seqlens_B1,
                mask_T,
                token_rewards_T=token_rewards_T,
                group_B=group_B if est == "reinforce_pp_baseline" else None,
                gamma=self.config.gamma,
            )
        else:  # gae
            adv_T, returns_T = gae_T(
                b.rewards_B,
                b.extra["values_T"],
                b.cu_seqlens_B1,
                mask_T,
                gamma=self.config.gamma,
                lam=self.config.gae_lambda,
                token_rewards_T=token_rewards_T,
            )
            extra["returns_T"] = returns_T
        return dataclasses.replace(b, advantages_T=adv_T.to(torch.float32), extra={**b.extra, **extra})

    # ------------------------------------------------------------------ per micro-batch
    def extract_model_output(self, model: nn.Module, batch: TokenBatch) -> dict[str, torch.Tensor]:
        return token_logprobs_T(
            model,
            batch,
            mask_T=batch.loss_mask_T,
            temperature=self.config.temperature,
            with_entropy=self._entropy_bonus_possible or self.config.top_entropy_quantile < 1,
            chunk_size=self.config.logprob_chunk_size,
        )

    def compute_loss(
        self, model_output: dict[str, torch.Tensor], batch: TokenBatch, reducer: Reducer
    ) -> tuple[torch.Tensor, Metrics]:
        logp_T = model_output["logprobs_T"]
        device = logp_T.device
        b = _to_device(batch, device)
        mask_T = b.loss_mask_T
        behave_T = b.logprobs_T
        adv_T = b.advantages_T
        if self.config.use_decoupled_loss:
            if self.config.prox_logp_method == "recompute":
                prox_T = b.extra["prox_logprobs_T"]
            else:
                version = (
                    int(b.extra[POLICY_VERSION_KEY][0]) if POLICY_VERSION_KEY in b.extra else int(b.versions_T.max())
                )
                prox_T = loglinear_prox_logprobs_T(behave_T, logp_T, b.versions_T, mask_T, prox_version=version)
            pg_T, stats = decoupled_ppo_loss_T(
                logp_T,
                prox_T,
                behave_T,
                adv_T,
                mask_T,
                eps_low=self.config.clip_eps,
                eps_high=self.config.clip_eps_high,
                behav_imp_weight_cap=self.config.behav_imp_weight_cap,
                behav_weight_mode=self.config.behav_weight_mode,
                behav_imp_weight_min=self.config.behav_imp_weight_min,
                cu_seqlens_B1=b.cu_seqlens_B1,
                dual_clip_c=self.config.dual_clip_c,
            )
        else:
            old_T = b.extra["prox_logprobs_T"] if self.config.recompute_logprob else behave_T
            if self.config.policy_loss == "ppo":
                pg_T, stats = ppo_clip_loss_T(
                    logp_T,
                    old_T,
                    adv_T,
                    mask_T,
                    eps_low=self.config.clip_eps,
                    eps_high=self.config.clip_eps_high,
                    dual_clip_c=self.config.dual_clip_c,
                )
            elif self.config.policy_loss == "gspo":
                pg_T, stats = gspo_loss_T(
                    logp_T,
                    old_T,
                    adv_T,
                    mask_T,
                    b.cu_seqlens_B1,
                    eps_low=self.config.clip_eps,
                    eps_high=self.config.clip_eps_high or self.config.clip_eps,
                )
            elif self.config.policy_loss == "sapo":
                pg_T, stats = sapo_loss_T(
                    logp_T,
                    old_T,
                    adv_T,
                    mask_T,
                    temperature_pos=self.config.sapo_temperature_pos,
                    temperature_neg=self.config.sapo_temperature_neg,
                )
            elif self.config.policy_loss == "vespo":
                pg_T, stats = vespo_loss_T(
                    logp_T,
                    old_T,
                    adv_T,
                    mask_T,
                    b.cu_seqlens_B1,
                    k_pos=self.config.vespo_k_pos,
                    lambda_pos=self.config.vespo_lambda_pos,
                    k_neg=self.config.vespo_k_neg,
                    lambda_neg=self.config.vespo_lambda_neg,
                )
            else:
                pg_T, stats = cispo_loss_T(
                    logp_T,
                    old_T,
                    adv_T,
                    mask_T,
                    eps_low=None,
                    eps_high=self.config.clip_eps_high or self.config.clip_eps,
                )
        if self.config.off_policy_mask_threshold is not None:
            drop_T = off_policy_sequence_mask_T(
                logp_T, behave_T, adv_T, mask_T, b.cu_seqlens_B1, threshold=self.config.off_policy_mask_threshold
            )
            pg_T = torch.where(drop_T, torch.zeros_like(pg_T), pg_T)
            stats["off_policy_mask_frac"] = drop_T.float()
        if self.config.top_entropy_quantile < 1:  # after every other mask: a token's entropy does not depend on them
            keep_T = high_entropy_mask_T(
                model_output["entropy_T"], mask_T, quantile=self.config.top_entropy_quantile, gather=reducer.gather
            )
            pg_T = torch.where(keep_T, pg_T, torch.zeros_like(pg_T))
            stats["entropy_mask_frac"] = (mask_T.bool() & ~keep_T).float()
        loss_T = pg_T
        stats["pg_loss"] = pg_T.detach()
        if self.config.kl_coef > 0:
            # logged in both modes: with kl_in_reward the penalty is in the advantages, and this is the
            # one place the KL to the reference is seen (the current policy's, as in the loss mode)
            in_loss = not self.config.kl_in_reward
            kl_T = kl_estimate_T(
                logp_T if in_loss else logp_T.detach(),
                b.extra["ref_logprobs_T"],
                mask_T,
                estimator=self.config.kl_estimator,
            )
            if in_loss and self.config.kl_bias_correction:
                kl_T = importance_weighted_kl_T(kl_T, logp_T, behave_T, mask_T)
            if in_loss:
                loss_T = loss_T + self._kl_coef * kl_T
            stats["kl"] = kl_T.detach()
        coef = self._applied_entropy_coef()
        if coef > 0:
            loss_T = loss_T + entropy_bonus_T(model_output["entropy_T"], mask_T, coef=coef)
        if "entropy_T" in model_output:
            stats["entropy"] = model_output["entropy_T"].detach()
        weight_T = aggregation_weights_T(batch.loss_mask_T, batch.cu_seqlens_B1, self.config.loss_aggregation).to(
            device
        )
        loss = reducer(loss_T, weight_T)
        if self.config.loss_aggregation in ("constant", "seq_mean_token_sum"):  # averages, not the loss's sums
            weight_T = statistics_weights_T(
                batch.loss_mask_T,
                batch.cu_seqlens_B1,
                self.config.loss_aggregation,
                constant=self.config.loss_agg_constant,
            ).to(device)
        return loss, reduce_stats(stats, weight_T, reducer, "actor")

    def gradient_free_B(self, batch: TokenBatch) -> torch.Tensor | None:
        c = self.config
        if not c.skip_zero_advantage or (c.kl_coef > 0 and not c.kl_in_reward) or self._entropy_bonus_possible:
            return None
        if c.top_entropy_quantile < 1:  # their tokens are part of the population the entropy quantile is taken over
            return None
        # every policy loss here is a multiple of the token's advantage: zero advantage, zero gradient
        return _tokens_per_sequence_B(batch, (batch.advantages_T != 0) & batch.loss_mask_T.bool()) == 0

    # ------------------------------------------------------------------ adaptive entropy control
    @property
    def _entropy_bonus_possible(self) -> bool:
        """Whether a step may add the entropy bonus: a coefficient above 0, or adaptive control (which may raise it)."""
        return self.config.entropy_coef > 0 or self.config.entropy_target is not None

    def _applied_entropy_coef(self) -> float:
        """The coefficient this step's loss applies: ``entropy_coef``, or the adaptive one while the last step's
        entropy was at or below ``entropy_target`` (0 before the first measurement)."""
        target = self.config.entropy_target
        if target is None:
            return self.config.entropy_coef
        return self._entropy_coef if self._last_entropy <= target else 0.0

    def after_optimizer_step(self, metrics: dict[str, float]) -> dict[str, float]:
        """The adaptive coefficients' updates (``_adapt_kl``, ``_adapt_entropy``); their figures to log."""
        return {**self._adapt_kl(metrics), **self._adapt_entropy(metrics)}

    def _adapt_kl(self, metrics: dict[str, float]) -> dict[str, float]:
        """Adaptive KL control's update (``kl_target``) from the step's ``actor/kl`` and its batch's sequences
        (``batch_seqs``, which the runner adds); logs ``actor/kl_coef``, the coefficient this step applied."""
        c = self.config
        if c.kl_target is None:
            return {}
        applied = self._kl_coef
        kl, seqs = metrics.get("actor/kl"), metrics.get("batch_seqs")
        if kl is not None and seqs:  # no KL where the step trained no token (dapo, every group's rewards equal)
            error = min(max(kl / c.kl_target - 1.0, -0.2), 0.2)
            self._kl_coef *= max(1.0 + error * seqs / c.kl_horizon, 0.0)
        return {"actor/kl_coef": applied}

    def _adapt_entropy(self, metrics: dict[str, float]) -> dict[str, float]:
        """Adaptive entropy control's update from the step's ``actor/entropy`` (the same value on every
        data-parallel rank); logs ``actor/entropy_coef`` (the controller's coefficient after the update, TRL's
        ``entropy_coef``) and ``actor/entropy_coef_applied`` (what this step's loss applied)."""
        target = self.config.entropy_target
        if target is None:
            return {}
        applied = self._applied_entropy_coef()
        entropy = metrics.get("actor/entropy")
        if entropy is not None:  # absent where the step trained no token (dapo, every group's rewards equal)
            c = self.config
            step = c.entropy_coef_delta if entropy <= target else -c.entropy_coef_delta
            self._entropy_coef = min(max(self._entropy_coef + step, c.entropy_coef_min), c.entropy_coef_max)
            self._last_entropy = float(entropy)
        return {"actor/entropy_coef": self._entropy_coef, "actor/entropy_coef_applied": applied}

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        if self.config.entropy_target is not None:
            state.update(entropy_coef=self._entropy_coef, last_entropy=self._last_entropy)
        if self.config.kl_target is not None:
            state.update(kl_coef=self._kl_coef)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.config.entropy_target is not None and "entropy_coef" in state:
            self._entropy_coef, self._last_entropy = float(state["entropy_coef"]), float(state["last_entropy"])
        if self.config.kl_target is not None and "kl_coef" in state:
            self._kl_coef = float(state["kl_coef"])

    def denominator(self, batch: TokenBatch) -> float:
        return aggregation_denominator(
            batch.loss_mask_T, batch.cu_seqlens_B1, self.config.loss_aggregation, constant=self.config.loss_agg_constant
        )


def _group_ids(batch: TokenBatch) -> list[str]:
    return batch.group_ids if batch.group_ids else [""] * batch.num_seqs


def _completion_lengths_B(batch: TokenBatch) -> torch.Tensor:
    """Loss tokens per sequence (the generated length)."""
    return _tokens_per_sequence_B(batch, batch.loss_mask_T)


def _tokens_per_sequence_B(batch: TokenBatch, flags_T: torch.Tensor) -> torch.Tensor:
    """How many of each sequence's tokens ``flags_T`` sets."""
    seqlens_B = batch.seqlens_B
    seq_T = torch.repeat_interleave(torch.arange(seqlens_B.numel()), seqlens_B)
    return torch.zeros(seqlens_B.numel(), dtype=torch.long).index_add(0, seq_T, flags_T.long())


def _to_device(batch: TokenBatch, device: torch.device) -> TokenBatch:
    """The batch's tensors on ``device`` (a no-op on CPU)."""
    if batch.input_ids_T.device == device:
        return batch
    return dataclasses.replace(
        batch,
        input_ids_T=batch.input_ids_T.to(device),
        cu_seqlens_B1=batch.cu_seqlens_B1.to(device),
        loss_mask_T=batch.loss_mask_T.to(device),
        logprobs_T=batch.logprobs_T.to(device),
        versions_T=batch.versions_T.to(device),
        advantages_T=batch.advantages_T.to(device),
        rewards_B=batch.rewards_B.to(device),
        extra={k: v.to(device) for k, v in batch.extra.items()},
        truncated_B=None if batch.truncated_B is None else batch.truncated_B.to(device),
    )


def _reward_parts_BK(batch: TokenBatch, functions: int) -> torch.Tensor:
    """The batch's per-function reward scores [B, K] (``REWARD_PARTS_KEY``) for ``gdpo``, or a ValueError naming
    what lacks them: a sequence scored outside ``areno.workflows.common.ascore_reward`` (an agent's reward, a
    workflow's own) has no per-function scores."""
    parts_BK = batch.extra.get(REWARD_PARTS_KEY)
    if parts_BK is None or bool(parts_BK.isnan().any()):
        raise ValueError(
            "advantage_estimator=gdpo needs each reward function's score per sequence, and this batch has sequences "
            "without them (its rollout.workflow scores them outside areno.workflows.common.ascore_reward, e.g. an "
            "agent's reward): use advantage_estimator=grpo"
        )
    if parts_BK.shape[1] != functions:
        raise ValueError(
            f"advantage_estimator=gdpo: the batch has {parts_BK.shape[1]} reward functions' scores per sequence, "
            f"reward_weights {functions}: the run's reward.fn and reward.weights must list the same functions"
        )
    return parts_BK
