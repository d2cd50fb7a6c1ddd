"""KL estimators between the policy and a reference policy, per token (Schulman 2020,
"Approximating KL divergence"), usable as a loss term or as a reward penalty.

Legend: T = packed tokens. With ``log_ratio = logp - ref_logp`` and samples drawn from the policy:
    k1 = log_ratio                          (unbiased, high variance, can be negative)
    k2 = 0.5 * log_ratio**2                 (biased, low variance; its gradient is the KL's)
    k3 = exp(-log_ratio) + log_ratio - 1    (unbiased, low variance, always >= 0)
As a loss differentiated through ``logp`` on the policy's own samples (a pathwise gradient, the samples
held fixed), the expected gradients differ from the values' meaning: k1's is 0 (E[grad log pi] = 0),
k2's is that of KL(pi || pi_ref), k3's that of the forward KL(pi_ref || pi) (DeepSeekMath's GRPO
KL loss).
"""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")


LOG_RATIO_MAX = 20.0
"""The largest |log-ratio| the KL estimators take, and the largest log-ratio the policy losses take a ratio of
(``areno.algo.policy_loss``): past float32 exp's range (~88.7) one token made a step's gradient NaN."""

LOSS_KL_ESTIMATORS = ("k2", "k3")
"""The estimators whose gradient, as a loss term, is a KL's (k1's expected gradient is 0)."""


def kl_estimate_T(
    logprobs_T: torch.Tensor,
    ref_logprobs_T: torch.Tensor,
    loss_mask_T: torch.Tensor,
    *,
    estimator: str = "k3",
    clamp: float | None = LOG_RATIO_MAX,
) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate, 0 outside the loss mask.

    ``clamp`` bounds ``log_ratio`` to ``[-clamp, clamp]`` before the exponential of k3 (a
    departure from the plain estimator that keeps a far-off reference from producing inf).
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    log_ratio_T = logprobs_T - ref_logprobs_T.detach()
    if clamp is not None:
        log_ratio_T = log_ratio_T.clamp(-clamp, clamp)
    if estimator == "k1":
        kl_T = log_ratio_T
    elif estimator == "k2":
        kl_T = 0.5 * log_ratio_T**2
    else:
        kl_T = torch.exp(-log_ratio_T) + log_ratio_T - 1.0
    return torch.where(loss_mask_T.bool(), kl_T, torch.zeros_like(kl_T))


def kl_reward_penalty_T(
    logprobs_T: torch.Tensor,
    ref_logprobs_T: torch.Tensor,
    loss_mask_T: torch.Tensor,
    *,
    coef: float,
    estimator: str = "k1",
) -> torch.Tensor:
    """KL as a reward: the per-token reward ``-coef * k`` (detached) that REINFORCE++ / PPO add
    to the sequence reward before computing returns (InstructGPT uses k1)."""
    return -coef * kl_estimate_T(logprobs_T.detach(), ref_logprobs_T, loss_mask_T, estimator=estimator)


def importance_weighted_kl_T(
    kl_T: torch.Tensor, logprobs_T: torch.Tensor, behave_logprobs_T: torch.Tensor, loss_mask_T: torch.Tensor
) -> torch.Tensor:
    """``kl_T`` times the importance weight pi_theta / pi_behave of each token (TRL's
    ``use_bias_correction_kl``): the tokens were sampled by pi_behave, so the weighted estimate's expectation
    is the KL under pi_theta. The weight keeps its gradient (as TRL's); its log is clamped to
    +-``LOG_RATIO_MAX`` as the estimators' is. 0 outside the loss mask."""
    log_w_T = (logprobs_T - behave_logprobs_T.detach()).clamp(-LOG_RATIO_MAX, LOG_RATIO_MAX)
    return torch.where(loss_mask_T.bool(), kl_T * torch.exp(log_w_T), torch.zeros_like(kl_T))
