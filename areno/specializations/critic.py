"""``CriticSpecialization``: the PPO value function, a scalar linear head on the decoder's hidden
states (``forward.ScalarHeadModel``; the head lives here, not in ``areno/models``).

Targets are GAE returns computed on the whole batch from the critic's own values before the step
(``old_values_T``, a no-grad forward) with the same ``gamma`` / ``gae_lambda`` as the actor:

    loss_t = 0.5 * max((V_t - R_t)^2, (clip(V_t, V_old - eps, V_old + eps) - R_t)^2)

Legend: B = sequences, T = packed tokens.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from areno.algo import gae_T, kl_reward_penalty_T, value_loss_T
from areno.specializations.base import Metrics, ModelSpecialization, Reducer, check_arguments, reduce_stats
from areno.specializations.forward import ScalarHeadModel, values_T
from areno.types import TokenBatch


class CriticSpecialization(ModelSpecialization):
    """Value role. ``value_clip_eps`` (None: unclipped), ``gamma`` / ``gae_lambda`` (must match the
    actor's), ``kl_coef`` / ``kl_estimator`` when the actor puts the KL into the reward (then the
    batch needs ``ref_logprobs_T``)."""

    output_keys = ("values_T",)

    def __init__(
        self,
        *,
        value_clip_eps: float | None = 0.2,
        gamma: float = 1.0,
        gae_lambda: float = 1.0,
        kl_coef: float = 0.0,
        kl_estimator: str = "k1",
    ) -> None:
        check_arguments(CriticSpecialization, locals())
        if value_clip_eps is not None and value_clip_eps <= 0:
            raise ValueError(f"CriticSpecialization value_clip_eps: must be > 0 or None, got {value_clip_eps}")
        if not (0 <= gamma <= 1 and 0 <= gae_lambda <= 1):
            raise ValueError(f"CriticSpecialization gamma/gae_lambda: must be in [0, 1], got {gamma}, {gae_lambda}")
        self.value_clip_eps = value_clip_eps
        self.gamma = gamma
        self.gae_lambda = gae_lambda
        self.kl_coef = kl_coef
        self.kl_estimator = kl_estimator
        self.required_extra_keys = ("ref_logprobs_T",) if kl_coef > 0 else ()

    @property
    def self_forward_keys(self) -> dict[str, str]:
        return {"values_T": "old_values_T"}

    @property
    def reads_rewards(self) -> bool:
        return True

    def follow(self, shared: dict[str, float]) -> None:
        # the policy's KL coefficient as adaptive KL control moved it: the returns take the penalty its advantages do
        if self.kl_coef > 0 and "kl_coef" in shared:
            self.kl_coef = shared["kl_coef"]

    def wrap_model(self, model: nn.Module) -> nn.Module:
        return ScalarHeadModel(model)

    def prepare_batch(self, rollout_data: TokenBatch) -> TokenBatch:
        self._check_extra(rollout_data)
        b = rollout_data
        token_rewards_T = None
        if self.kl_coef > 0:
            token_rewards_T = kl_reward_penalty_T(
                b.logprobs_T, b.extra["ref_logprobs_T"], b.loss_mask_T, coef=self.kl_coef, estimator=self.kl_estimator
            )
        _, returns_T = gae_T(
            b.rewards_B,
            b.extra["old_values_T"],
            b.cu_seqlens_B1,
            b.loss_mask_T,
            gamma=self.gamma,
            lam=self.gae_lambda,
            token_rewards_T=token_rewards_T,
        )
        return dataclasses.replace(b, extra={**b.extra, "returns_T": returns_T})

    def extract_model_output(self, model: nn.Module, batch: TokenBatch) -> dict[str, torch.Tensor]:
        return {"values_T": values_T(model, batch)}

    def compute_loss(
        self, model_output: dict[str, torch.Tensor], batch: TokenBatch, reducer: Reducer
    ) -> tuple[torch.Tensor, Metrics]:
        v_T = model_output["values_T"]
        dev = v_T.device
        mask_T = batch.loss_mask_T.to(dev)
        loss_T, stats = value_loss_T(
            v_T,
            batch.extra["old_values_T"].to(dev),
            batch.extra["returns_T"].to(dev),
            mask_T,
            clip_eps=self.value_clip_eps,
        )
        stats["value_loss"] = loss_T.detach()
        stats["value_mean"] = v_T.detach()
        return reducer(loss_T, mask_T), reduce_stats(stats, mask_T, reducer, "critic")
