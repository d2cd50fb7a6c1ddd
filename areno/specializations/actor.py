"""``ActorSpecialization``: the PPO-family policy (GRPO, Dr.GRPO, DAPO, GSPO, RLOO, REINFORCE++,
CISPO, PPO), configured entirely by keyword arguments so every variant is a recipe, not a subclass.

Per step, on the whole batch (``prepare_batch``): optional overlong penalty on rewards, optional
dynamic-sampling filter, then the advantage estimator. Per micro-batch (``compute_loss``):

    loss_t = policy_loss_t + kl_coef * k(pi, pi_ref)_t - entropy_coef * H_t
    loss   = sum_t w_t loss_t / denominator           (w, denominator from ``loss_aggregation``)

Legend: B = sequences, T = packed tokens.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from areno.algo import (
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    aggregation_denominator,
    aggregation_weights_T,
    broadcast_to_tokens_T,
    cispo_loss_T,
    decoupled_ppo_loss_T,
    dynamic_sampling_keep_B,
    entropy_bonus_T,
    gae_T,
    group_index_B,
    grpo_advantages_B,
    gspo_loss_T,
    kl_estimate_T,
    kl_reward_penalty_T,
    loglinear_prox_logprobs_T,
    overlong_penalty_B,
    ppo_clip_loss_T,
    reinforce_pp_advantages_T,
    rloo_advantages_B,
)
from areno.specializations.base import POLICY_VERSION_KEY, Metrics, ModelSpecialization, Reducer, reduce_stats
from areno.specializations.forward import token_logprobs_T
from areno.types import TokenBatch

ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae", "given")
POLICY_LOSSES = ("ppo", "gspo", "cispo")
PROX_LOGP_METHODS = ("recompute", "loglinear")
BEHAV_WEIGHT_MODES = ("mask", "truncate")


class ActorSpecialization(ModelSpecialization):
    """PPO-family actor. All arguments are keyword-only and validated at construction.

    Advantages: ``advantage_estimator`` in ``ADVANTAGE_ESTIMATORS`` (``given`` keeps the batch's
    ``advantages_T``; ``gae`` needs ``values_T`` from a critic role). Policy loss:
    ``policy_loss`` in ``POLICY_LOSSES``; ``clip_eps`` / ``clip_eps_high`` (clip-higher when
    different), ``dual_clip_c``. Off-policy: ``use_decoupled_loss`` with ``prox_logp_method``
    (``recompute``: a no-grad forward of the current weights before the step gives pi_prox;
    ``loglinear``: interpolated from versions), ``behav_imp_weight_cap`` and ``behav_weight_mode``;
    ``recompute_logprob`` makes the coupled loss use recomputed instead of behaviour log-probs.
    """

    output_keys = ("logprobs_T", "entropy_T")

    def __init__(
        self,
        *,
        advantage_estimator: str = "grpo",
        adv_eps: float = 1e-4,
        gamma: float = 1.0,
        gae_lambda: float = 1.0,
        policy_loss: str = "ppo",
        clip_eps: float = 0.2,
        clip_eps_high: float | None = None,
        dual_clip_c: float | None = None,
        loss_aggregation: str = "token",
        loss_agg_constant: float = 1024.0,
        kl_coef: float = 0.0,
        kl_estimator: str = "k3",
        kl_in_reward: bool = False,
        entropy_coef: float = 0.0,
        temperature: float = 1.0,
        use_decoupled_loss: bool = False,
        recompute_logprob: bool = False,
        prox_logp_method: str = "recompute",
        behav_imp_weight_cap: float | None = None,
        behav_weight_mode: str = "mask",
        dynamic_sampling: bool = False,
        overlong_max_length: int | None = None,
        overlong_buffer_length: int = 0,
        overlong_penalty: float = 1.0,
        logprob_chunk_size: int = 1024,
    ) -> None:
        def check(ok: bool, key: str, why: str) -> None:
            if not ok:
                raise ValueError(f"ActorSpecialization {key}: {why}")

        check(
            advantage_estimator in ADVANTAGE_ESTIMATORS,
            "advantage_estimator",
            f"must be one of {ADVANTAGE_ESTIMATORS}, got {advantage_estimator!r}",
        )
        check(policy_loss in POLICY_LOSSES, "policy_loss", f"must be one of {POLICY_LOSSES}, got {policy_loss!r}")
        check(
            loss_aggregation in LOSS_AGGREGATIONS,
            "loss_aggregation",
            f"must be one of {LOSS_AGGREGATIONS}, got {loss_aggregation!r}",
        )
        check(kl_estimator in KL_ESTIMATORS, "kl_estimator", f"must be one of {KL_ESTIMATORS}, got {kl_estimator!r}")
        check(
            prox_logp_method in PROX_LOGP_METHODS,
            "prox_logp_method",
            f"must be one of {PROX_LOGP_METHODS}, got {prox_logp_method!r}",
        )
        check(
            behav_weight_mode in BEHAV_WEIGHT_MODES,
            "behav_weight_mode",
            f"must be one of {BEHAV_WEIGHT_MODES}, got {behav_weight_mode!r}",
        )
        check(clip_eps > 0, "clip_eps", f"must be > 0, got {clip_eps}")
        check(clip_eps_high is None or clip_eps_high > 0, "clip_eps_high", f"must be > 0 or None, got {clip_eps_high}")
        check(kl_coef >= 0, "kl_coef", f"must be >= 0, got {kl_coef}")
        check(entropy_coef >= 0, "entropy_coef", f"must be >= 0, got {entropy_coef}")
        check(temperature > 0, "temperature", f"must be > 0, got {temperature}")
        check(0 <= gamma <= 1 and 0 <= gae_lambda <= 1, "gamma/gae_lambda", "must be in [0, 1]")
        check(loss_agg_constant > 0, "loss_agg_constant", f"must be > 0, got {loss_agg_constant}")
        check(
            behav_imp_weight_cap is None or behav_imp_weight_cap > 0,
            "behav_imp_weight_cap",
            f"must be > 0 or None, got {behav_imp_weight_cap}",
        )
        check(
            not use_decoupled_loss or policy_loss == "ppo",
            "use_decoupled_loss",
            f"works with policy_loss='ppo' only, got {policy_loss!r}",
        )
        check(
            overlong_max_length is None or 0 < overlong_buffer_length <= overlong_max_length,
            "overlong_buffer_length",
            "must be in (0, overlong_max_length] when overlong_max_length is set",
        )
        self.advantage_estimator = advantage_estimator
        self.adv_eps = adv_eps
        self.gamma = gamma
        self.gae_lambda = gae_lambda
        self.policy_loss = policy_loss
        self.clip_eps = clip_eps
        self.clip_eps_high = clip_eps_high
        self.dual_clip_c = dual_clip_c
        self.loss_aggregation = loss_aggregation
        self.loss_agg_constant = loss_agg_constant
        self.kl_coef = kl_coef
        self.kl_estimator = kl_estimator
        self.kl_in_reward = kl_in_reward
        self.entropy_coef = entropy_coef
        self.temperature = temperature
        self.use_decoupled_loss = use_decoupled_loss
        self.recompute_logprob = recompute_logprob
        self.prox_logp_method = prox_logp_method
        self.behav_imp_weight_cap = behav_imp_weight_cap
        self.behav_weight_mode = behav_weight_mode
        self.dynamic_sampling = dynamic_sampling
        self.overlong_max_length = overlong_max_length
        self.overlong_buffer_length = overlong_buffer_length
        self.overlong_penalty = overlong_penalty
        self.logprob_chunk_size = logprob_chunk_size
        needs = []
        if kl_coef > 0:
            needs.append("ref_logprobs_T")
        if advantage_estimator == "gae":
            needs.append("values_T")
        self.required_extra_keys = tuple(needs)

    @property
    def self_forward_keys(self) -> dict[str, str]:
        recompute = self.recompute_logprob or (self.use_decoupled_loss and self.prox_logp_method == "recompute")
        return {"logprobs_T": "prox_logprobs_T"} if recompute else {}

    # ------------------------------------------------------------------ whole batch
    def prepare_batch(self, rollout_data: TokenBatch) -> TokenBatch:
        self._check_extra(rollout_data)
        batch = rollout_data
        if self.overlong_max_length is not None:
            lengths_B = _completion_lengths_B(batch)
            penalty_B = overlong_penalty_B(
                lengths_B,
                max_length=self.overlong_max_length,
                buffer_length=self.overlong_buffer_length,
                penalty=self.overlong_penalty,
            )
            batch = dataclasses.replace(batch, rewards_B=batch.rewards_B + penalty_B)
        if self.dynamic_sampling:
            keep_B = dynamic_sampling_keep_B(batch.rewards_B, group_index_B(_group_ids(batch)))
            if keep_B.any():
                batch = batch.select(torch.nonzero(keep_B).flatten().tolist())
            else:  # every group is degenerate: train on nothing this step
                batch = dataclasses.replace(batch, loss_mask_T=torch.zeros_like(batch.loss_mask_T))
        return self.compute_advantages(batch)

    def compute_advantages(self, rollout_data: TokenBatch) -> TokenBatch:
        b = rollout_data
        est = self.advantage_estimator
        if est == "given":
            return b
        mask_T = b.loss_mask_T
        token_rewards_T = None
        if self.kl_in_reward and self.kl_coef > 0:
            token_rewards_T = kl_reward_penalty_T(
                b.logprobs_T, b.extra["ref_logprobs_T"], mask_T, coef=self.kl_coef, estimator=self.kl_estimator
            )
        group_B = group_index_B(_group_ids(b))
        extra = {}
        if est in ("grpo", "dr_grpo"):
            adv_B = grpo_advantages_B(b.rewards_B, group_B, scale_by_std=est == "grpo", eps=self.adv_eps)
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
                gamma=self.gamma,
            )
        else:  # gae
            adv_T, returns_T = gae_T(
                b.rewards_B,
                b.extra["values_T"],
                b.cu_seqlens_B1,
                mask_T,
                gamma=self.gamma,
                lam=self.gae_lambda,
                token_rewards_T=token_rewards_T,
            )
            extra["returns_T"] = returns_T
        return dataclasses.replace(b, advantages_T=adv_T.to(torch.float32), extra={**b.extra, **extra})

    # ------------------------------------------------------------------ per micro-batch
    def extract_model_output(self, model: nn.Module, batch: TokenBatch) -> dict[str, torch.Tensor]:
        return token_logprobs_T(
            model,
            batch,
            temperature=self.temperature,
            with_entropy=self.entropy_coef > 0,
            chunk_size=self.logprob_chunk_size,
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
        if self.use_decoupled_loss:
            if self.prox_logp_method == "recompute":
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
                eps_low=self.clip_eps,
                eps_high=self.clip_eps_high,
                behav_imp_weight_cap=self.behav_imp_weight_cap,
                behav_weight_mode=self.behav_weight_mode,
                dual_clip_c=self.dual_clip_c,
            )
        else:
            old_T = b.extra["prox_logprobs_T"] if self.recompute_logprob else behave_T
            if self.policy_loss == "ppo":
                pg_T, stats = ppo_clip_loss_T(
                    logp_T,
                    old_T,
                    adv_T,
                    mask_T,
                    eps_low=self.clip_eps,
                    eps_high=self.clip_eps_high,
                    dual_clip_c=self.dual_clip_c,
                )
            elif self.policy_loss == "gspo":
                pg_T, stats = gspo_loss_T(
                    logp_T,
                    old_T,
                    adv_T,
                    mask_T,
                    b.cu_seqlens_B1,
                    eps_low=self.clip_eps,
                    eps_high=self.clip_eps_high or self.clip_eps,
                )
            else:
                pg_T, stats = cispo_loss_T(
                    logp_T, old_T, adv_T, mask_T, eps_low=None, eps_high=self.clip_eps_high or self.clip_eps
                )
        loss_T = pg_T
        stats["pg_loss"] = pg_T.detach()
        if self.kl_coef > 0 and not self.kl_in_reward:
            kl_T = kl_estimate_T(logp_T, b.extra["ref_logprobs_T"], mask_T, estimator=self.kl_estimator)
            loss_T = loss_T + self.kl_coef * kl_T
            stats["kl"] = kl_T.detach()
        if self.entropy_coef > 0:
            loss_T = loss_T + entropy_bonus_T(model_output["entropy_T"], mask_T, coef=self.entropy_coef)
        if "entropy_T" in model_output:
            stats["entropy"] = model_output["entropy_T"].detach()
        weight_T = aggregation_weights_T(batch.loss_mask_T, batch.cu_seqlens_B1, self.loss_aggregation).to(device)
        loss = reducer(loss_T, weight_T)
        return loss, reduce_stats(stats, weight_T, reducer, "actor")

    def denominator(self, batch: TokenBatch) -> float:
        return aggregation_denominator(
            batch.loss_mask_T, batch.cu_seqlens_B1, self.loss_aggregation, constant=self.loss_agg_constant
        )


def _group_ids(batch: TokenBatch) -> list[str]:
    return batch.group_ids if batch.group_ids else [""] * batch.num_seqs


def _completion_lengths_B(batch: TokenBatch) -> torch.Tensor:
    """Loss tokens per sequence (the generated length)."""
    seqlens_B = batch.seqlens_B
    seq_T = torch.repeat_interleave(torch.arange(seqlens_B.numel()), seqlens_B)
    return torch.zeros(seqlens_B.numel(), dtype=torch.long).index_add(0, seq_T, batch.loss_mask_T.long())


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
    )
