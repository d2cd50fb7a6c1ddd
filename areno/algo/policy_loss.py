"""Policy-gradient losses, per token: clipped PPO (with clip-higher and dual clip), the decoupled
PPO objective for off-policy data (token- or sequence-level behaviour weights), DeepSeek-V3.2's
off-policy sequence mask, GSPO's sequence-level ratio, CISPO's clipped IS weight, SAPO's soft gate and
VESPO's gamma-shaped sequence weight.

Legend: B = sequences, T = packed tokens. Every function returns ``(loss_T, stats)`` where
``loss_T`` is the per-token loss (0 outside ``loss_mask_T``) and ``stats`` maps a metric name to
a detached per-token float tensor (e.g. a 0/1 clip indicator). Reduction over tokens is left to
the caller's ``Reducer`` so the same numbers are produced for any micro-batching.

Departure: a log-ratio is clamped at ``LOG_RATIO_MAX`` before its exponential (float32's ``exp``
overflows past ~88.7, and one inf ratio made the whole step's gradient NaN): a token beyond it has the
ratio ``exp(LOG_RATIO_MAX)`` and no gradient through it, as in verl.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from areno.algo.kl import LOG_RATIO_MAX
from areno.algo.losses import sequence_sum_B
from areno.types import repeat_per_sequence, sequence_index_T

Stats = dict[str, torch.Tensor]


def _ratio(log_ratio_T: torch.Tensor) -> torch.Tensor:
    return torch.exp(log_ratio_T.clamp(max=LOG_RATIO_MAX))


def _masked(x_T: torch.Tensor, mask_T: torch.Tensor) -> torch.Tensor:
    return torch.where(mask_T.bool(), x_T, torch.zeros_like(x_T))


def ppo_clip_loss_T(
    logprobs_T: torch.Tensor,
    old_logprobs_T: torch.Tensor,
    advantages_T: torch.Tensor,
    loss_mask_T: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float | None = None,
    dual_clip_c: float | None = None,
) -> tuple[torch.Tensor, Stats]:
    """Clipped surrogate (Schulman et al. 2017), token-level:

    ``r = exp(logp - old_logp)``, ``loss = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)``.

    ``eps_high`` different from ``eps_low`` is DAPO's clip-higher (Yu et al. 2025; 0.2 / 0.28);
    ``None`` means symmetric. ``dual_clip_c`` (> 1, Ye et al. 2020) additionally bounds the loss
    of negative-advantage tokens by ``-c A``. Stats: ``clip_frac`` (token was clipped),
    ``dual_clip_frac``, ``approx_kl`` (``old_logp - logp``, the k1 estimate) and ``ratio``.
    """
    eps_high = eps_low if eps_high is None else eps_high
    log_ratio_T = _masked(logprobs_T - old_logprobs_T.detach(), loss_mask_T)
    ratio_T = _ratio(log_ratio_T)
    pg1_T = -advantages_T * ratio_T
    pg2_T = -advantages_T * torch.clamp(ratio_T, 1.0 - eps_low, 1.0 + eps_high)
    loss_T = torch.maximum(pg1_T, pg2_T)
    clipped_T = pg2_T > pg1_T
    dual_T = torch.zeros_like(clipped_T)
    if dual_clip_c is not None:
        if dual_clip_c <= 1.0:
            raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
        pg3_T = -advantages_T * dual_clip_c
        dual_T = (advantages_T < 0) & (loss_T > pg3_T)
        loss_T = torch.where(advantages_T < 0, torch.minimum(loss_T, pg3_T), loss_T)
    stats = {
        "clip_frac": _masked(clipped_T.float(), loss_mask_T).detach(),
        "dual_clip_frac": _masked(dual_T.float(), loss_mask_T).detach(),
        "approx_kl": (-log_ratio_T).detach(),
        "ratio": _masked(ratio_T, loss_mask_T).detach(),
    }
    return _masked(loss_T, loss_mask_T), stats


BEHAV_WEIGHT_MODES = ("mask", "truncate", "sequence_mask", "sequence_truncate")
"""How the behaviour weight of decoupled PPO is bounded (``behaviour_importance_weight_T``): per token
(``mask``, ``truncate``) or one weight per sequence (``sequence_mask``, ``sequence_truncate``)."""


def behaviour_importance_weight_T(
    prox_logprobs_T: torch.Tensor,
    behave_logprobs_T: torch.Tensor,
    loss_mask_T: torch.Tensor,
    *,
    cap: float | None = None,
    mode: str = "mask",
    weight_min: float | None = None,
    cu_seqlens_B1: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The staleness factor of decoupled PPO, ``w = pi_prox / pi_behave`` (no gradient).

    Token modes: ``w_t = exp(logp_prox_t - logp_behave_t)``. Sequence modes (sequence-level importance
    sampling, Liu, Li et al. 2025, "When Speed Kills Stability"; TRL's ``vllm_importance_sampling_mode``
    ``sequence_*``): one weight per sequence, ``w_i = exp(sum_t (logp_prox_t - logp_behave_t))`` over the
    sequence's loss tokens (a sum, as TRL's, not GSPO's length-normalised mean: the ratio of the
    completions' probabilities), applied to each of its tokens.

    ``cap`` and ``weight_min`` bound it: the ``mask`` modes drop a token (a whole sequence) whose weight is
    above ``cap`` or below ``weight_min`` from the loss (AReaL's behaviour; masked IS as in IcePop, Ling
    Team 2025), the ``truncate`` modes clamp it into ``[weight_min, cap]`` (truncated IS as in IMPALA and
    Yao et al. 2025's TIS). TRL's ``vllm_importance_sampling_clip_min`` / ``_clip_max``, in every mode.
    Either bound may be None (none). ``cu_seqlens_B1`` is needed by the sequence modes. Departure: the log
    weight is clamped at ``LOG_RATIO_MAX`` (TRL's ``exp`` overflows to inf there, a sequence's sum sooner).
    Returns ``(weight_T, over_cap_T, under_min_T)`` (the last two 0/1 per token); all 0 off-mask.
    """
    if mode not in BEHAV_WEIGHT_MODES:
        raise ValueError(f"behaviour weight mode must be one of {BEHAV_WEIGHT_MODES}, got {mode!r}")
    if cap is not None and cap <= 0:
        raise ValueError(f"behav_imp_weight_cap must be > 0, got {cap}")
    if weight_min is not None and not (0 <= weight_min and (cap is None or weight_min < cap)):
        raise ValueError(f"behav_imp_weight_min must be >= 0 and < behav_imp_weight_cap ({cap}), got {weight_min}")
    log_w_T = _masked(prox_logprobs_T - behave_logprobs_T, loss_mask_T)
    if mode.startswith("sequence_"):
        if cu_seqlens_B1 is None:
            raise ValueError(f"behaviour weight mode {mode!r} needs cu_seqlens_B1 (one weight per sequence)")
        log_w_T = repeat_per_sequence(sequence_sum_B(log_w_T, cu_seqlens_B1, loss_mask_T), cu_seqlens_B1)
    w_T = _ratio(log_w_T).detach()
    no_T = torch.zeros_like(w_T, dtype=torch.bool)
    over_T = w_T > cap if cap is not None else no_T
    under_T = w_T < weight_min if weight_min is not None else no_T
    if mode.endswith("mask"):
        w_T = torch.where(over_T | under_T, torch.zeros_like(w_T), w_T)
    elif cap is not None or weight_min is not None:
        w_T = w_T.clamp(min=weight_min, max=cap)
    return _masked(w_T, loss_mask_T), _masked(over_T.float(), loss_mask_T), _masked(under_T.float(), loss_mask_T)


def decoupled_ppo_loss_T(
    logprobs_T: torch.Tensor,
    prox_logprobs_T: torch.Tensor,
    behave_logprobs_T: torch.Tensor,
    advantages_T: torch.Tensor,
    loss_mask_T: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float | None = None,
    behav_imp_weight_cap: float | None = None,
    behav_weight_mode: str = "mask",
    behav_imp_weight_min: float | None = None,
    cu_seqlens_B1: torch.Tensor | None = None,
    dual_clip_c: float | None = None,
) -> tuple[torch.Tensor, Stats]:
    """Decoupled PPO for off-policy (asynchronous) data (Hilton et al. 2022; AReaL):

    ``loss = w * -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)`` with the unclipped behaviour
    weight ``w = pi_prox / pi_behave`` (per token or per sequence, bounded by ``behav_imp_weight_cap``
    and ``behav_imp_weight_min``: see ``behaviour_importance_weight_T``; ``cu_seqlens_B1`` for the sequence
    modes) and the clipped trust-region ratio ``r = pi_theta / pi_prox``. ``pi_prox`` is the policy at the
    start of this train step (recomputed, or approximated by ``loglinear_prox_logprobs_T``).

    Stats add to ``ppo_clip_loss_T``'s: ``behave_over_cap_frac`` (tokens the cap touched),
    ``behave_under_min_frac`` (with ``behav_imp_weight_min``: tokens the lower bound touched),
    ``behave_weight`` and ``coupled_clip_frac`` — the fraction the *coupled* ratio
    ``pi_theta / pi_behave`` would have clipped, logged for comparison with ``clip_frac``.
    """
    loss_T, stats = ppo_clip_loss_T(
        logprobs_T,
        prox_logprobs_T,
        advantages_T,
        loss_mask_T,
        eps_low=eps_low,
        eps_high=eps_high,
        dual_clip_c=dual_clip_c,
    )
    w_T, over_T, under_T = behaviour_importance_weight_T(
        prox_logprobs_T,
        behave_logprobs_T,
        loss_mask_T,
        cap=behav_imp_weight_cap,
        mode=behav_weight_mode,
        weight_min=behav_imp_weight_min,
        cu_seqlens_B1=cu_seqlens_B1,
    )
    _, coupled = ppo_clip_loss_T(
        logprobs_T.detach(),
        behave_logprobs_T,
        advantages_T,
        loss_mask_T,
        eps_low=eps_low,
        eps_high=eps_high,
    )
    stats["behave_over_cap_frac"] = over_T
    if behav_imp_weight_min is not None:
        stats["behave_under_min_frac"] = under_T
    stats["behave_weight"] = w_T
    stats["coupled_clip_frac"] = coupled["clip_frac"]
    return loss_T * w_T, stats


def loglinear_prox_logprobs_T(
    behave_logprobs_T: torch.Tensor,
    logprobs_T: torch.Tensor,
    versions_T: torch.Tensor,
    loss_mask_T: torch.Tensor,
    *,
    prox_version: int,
) -> torch.Tensor:
    """Approximate ``log pi_prox`` without a forward pass (AReaL's ``loglinear`` method):

    ``log pi_prox ≈ log pi_behave + alpha (log pi_theta - log pi_behave)`` with
    ``alpha = (v_prox - v_behave) / (v_theta - v_behave)`` and ``v_theta = v_prox + 1`` (the
    version this step produces). ``logprobs_T`` is the training forward pass, used detached.
    A token generated by the current weights (``v_behave = v_prox``) gets ``alpha = 0``; one no policy
    version sampled (version -1: a teacher's) gets ``alpha = 1``, the training forward's value, as the
    recomputing method's forward of the current weights gives it (-1 read as a version interpolated by
    the step number).
    """
    v_behave_T = versions_T.to(torch.float32)
    alpha_T = (prox_version - v_behave_T) / (prox_version + 1 - v_behave_T)
    alpha_T = torch.where(versions_T < 0, 1.0, alpha_T.clamp(min=0.0, max=1.0))
    out_T = behave_logprobs_T + alpha_T * (logprobs_T.detach() - behave_logprobs_T)
    return _masked(out_T, loss_mask_T)


def sequence_mean_B(values_T: torch.Tensor, cu_seqlens_B1: torch.Tensor, loss_mask_T: torch.Tensor) -> torch.Tensor:
    """Mean of ``values_T`` over the loss tokens of each sequence (0 for a sequence without any)."""
    B = cu_seqlens_B1.numel() - 1
    seq_T = sequence_index_T(cu_seqlens_B1, values_T.device)
    mask_T = loss_mask_T.to(values_T.dtype)
    sum_B = torch.zeros(B, dtype=values_T.dtype, device=values_T.device).index_add(0, seq_T, values_T * mask_T)
    count_B = torch.zeros(B, dtype=values_T.dtype, device=values_T.device).index_add(0, seq_T, mask_T)
    return sum_B / count_B.clamp(min=1)


def off_policy_sequence_mask_T(
    logprobs_T: torch.Tensor,
    behave_logprobs_T: torch.Tensor,
    advantages_T: torch.Tensor,
    loss_mask_T: torch.Tensor,
    cu_seqlens_B1: torch.Tensor,
    *,
    threshold: float,
) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence masking (DeepSeek-AI 2025, eq. 9; TRL's
    ``off_policy_mask_threshold``): bool [T], True on the loss tokens to drop from the policy loss.

    A sequence is dropped when its advantage is negative and its mean over its loss tokens of
    ``log pi_behave - log pi_theta`` (the k1 estimate of KL(pi_behave || pi_theta) on pi_behave's own
    samples; ``logprobs_T`` used detached) exceeds ``threshold`` (delta). As TRL's: the sampling policy's
    log-probs against the current ones, so it catches both the staleness and the sampler's mismatch; a
    token's own advantage sign is read, which for the sequence-constant advantages of GRPO-like estimators
    is the sequence's (per-token advantages, gae or reinforce_pp, drop only the negative tokens of a
    far-off sequence, as TRL's broadcast does for a [B, T] advantage). The caller zeroes the dropped
    tokens' loss; they stay in the loss's denominator, as in TRL.
    """
    mask_T = loss_mask_T.bool()
    kl_T = _masked(behave_logprobs_T - logprobs_T.detach(), mask_T)
    far_B = sequence_mean_B(kl_T, cu_seqlens_B1, mask_T) > threshold
    far_T = repeat_per_sequence(far_B, cu_seqlens_B1)
    return far_T & (advantages_T < 0) & mask_T


def high_entropy_mask_T(
    entropy_T: torch.Tensor,
    loss_mask_T: torch.Tensor,
    *,
    quantile: float,
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The loss tokens whose entropy is in the top ``quantile`` fraction of ``loss_mask_T``'s (bool [T]): those at
    or above the ``1 - quantile`` quantile of their entropies, linearly interpolated as ``torch.quantile``
    (Wang et al. 2025, "Beyond the 80/20 rule": the high-entropy forking tokens; TRL's
    ``top_entropy_quantile``, its ``get_high_entropy_mask``). No gradient; ``quantile`` in (0, 1], 1 keeps
    every loss token. The population is the loss tokens given, with ``gather`` (``Reducer.gather``: the
    actor's) those of every data-parallel rank's micro-batch, as TRL gathers its processes'. Ties at the
    threshold are kept, so a constant entropy keeps all; no loss token, none kept."""
    if not 0 < quantile <= 1:
        raise ValueError(f"top_entropy_quantile must be in (0, 1], got {quantile}")
    mask_T = loss_mask_T.bool()
    ent_T = entropy_T.detach().float()
    values_K = ent_T[mask_T]
    values_K = (gather(values_K) if gather is not None else values_K).sort().values
    if values_K.numel() == 0:
        return torch.zeros_like(mask_T)
    # torch.quantile's linear interpolation, by sort: quantile() refuses more than 2**24 values
    position = (values_K.numel() - 1) * (1.0 - quantile)
    low = int(position)
    high = min(low + 1, values_K.numel() - 1)
    threshold = values_K[low] + (values_K[high] - values_K[low]) * (position - low)
    return (ent_T >= threshold) & mask_T


def gspo_loss_T(
    logprobs_T: torch.Tensor,
    old_logprobs_T: torch.Tensor,
    advantages_T: torch.Tensor,
    loss_mask_T: torch.Tensor,
    cu_seqlens_B1: torch.Tensor,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
) -> tuple[torch.Tensor, Stats]:
    """GSPO (Zheng et al. 2025), the GSPO-token form:

    ``s_i = exp(mean_t (logp_t - old_logp_t))`` (length-normalised sequence ratio) and per token
    ``s_it = sg[s_i] * pi_theta(t) / sg[pi_theta(t)]`` (value s_i, gradient of a token-level
    ratio); ``loss_t = -min(s_it A_t, clip(s_it, 1 - eps_low, 1 + eps_high) A_t)``. With a
    sequence-constant advantage this equals sequence-level GSPO. The paper averages tokens within
    a sequence then over sequences: use ``loss_aggregation="seq_mean_token_mean"``.
    """
    mask_T = loss_mask_T.bool()
    log_ratio_T = _masked(logprobs_T - old_logprobs_T.detach(), mask_T)
    seq_log_ratio_B = sequence_mean_B(log_ratio_T, cu_seqlens_B1, mask_T)
    seq_log_ratio_T = repeat_per_sequence(seq_log_ratio_B, cu_seqlens_B1)
    log_s_T = seq_log_ratio_T.detach() + logprobs_T - logprobs_T.detach()
    s_T = _ratio(log_s_T)
    pg1_T = -advantages_T * s_T
    pg2_T = -advantages_T * torch.clamp(s_T, 1.0 - eps_low, 1.0 + eps_high)
    loss_T = torch.maximum(pg1_T, pg2_T)
    stats = {
        "clip_frac": _masked((pg2_T > pg1_T).float(), mask_T).detach(),
        "approx_kl": (-log_ratio_T).detach(),
        "ratio": _masked(s_T, mask_T).detach(),
    }
    return _masked(loss_T, mask_T), stats


def cispo_loss_T(
    logprobs_T: torch.Tensor,
    old_logprobs_T: torch.Tensor,
    advantages_T: torch.Tensor,
    loss_mask_T: torch.Tensor,
    *,
    eps_low: float | None = None,
    eps_high: float = 0.28,
) -> tuple[torch.Tensor, Stats]:
    """CISPO (MiniMax-M1, 2025): clip the importance-sampling weight, not the update:

    ``loss = -sg[clip(r, 1 - eps_low, 1 + eps_high)] * A * logp`` with ``r = exp(logp - old_logp)``.
    Every token keeps a gradient (through ``logp``); the weight is a constant. The paper sets no
    lower bound in practice (``eps_low=None`` means none). Stats: ``clip_frac`` (weight clipped),
    ``approx_kl``, ``ratio``.
    """
    log_ratio_T = _masked(logprobs_T - old_logprobs_T.detach(), loss_mask_T)
    ratio_T = _ratio(log_ratio_T).detach()
    lo = 0.0 if eps_low is None else 1.0 - eps_low
    weight_T = ratio_T.clamp(min=lo, max=1.0 + eps_high)
    loss_T = -weight_T * advantages_T * logprobs_T
    stats = {
        "clip_frac": _masked((weight_T != ratio_T).float(), loss_mask_T),
        "approx_kl": (-log_ratio_T).detach(),
        "ratio": _masked(ratio_T, loss_mask_T),
    }
    return _masked(loss_T, loss_mask_T), stats


def sapo_loss_T(
    logprobs_T: torch.Tensor,
    old_logprobs_T: torch.Tensor,
    advantages_T: torch.Tensor,
    loss_mask_T: torch.Tensor,
    *,
    temperature_pos: float = 1.0,
    temperature_neg: float = 1.05,
) -> tuple[torch.Tensor, Stats]:
    """SAPO (Soft Adaptive Policy Optimization, Gao et al. 2025; TRL's ``loss_type="sapo"``): a smooth gate in
    place of the hard clip,

    ``loss = -sigmoid(tau (r - 1)) * 4 / tau * A`` with ``r = exp(logp - old_logp)``, ``tau`` = ``temperature_pos``
    where ``A > 0``, else ``temperature_neg``. Its gradient is ``-4 s (1 - s) r A grad logp`` (``s`` the
    sigmoid): the policy gradient at ``r = 1``, fading smoothly as the ratio leaves 1 instead of dropping to 0 at a
    clip edge; a larger ``tau`` fades faster. Stats: ``soft_gate`` (``4 s (1 - s)``, the gradient's scale),
    ``approx_kl``, ``ratio``.
    """
    log_ratio_T = _masked(logprobs_T - old_logprobs_T.detach(), loss_mask_T)
    ratio_T = _ratio(log_ratio_T)
    tau_T = torch.where(advantages_T > 0, temperature_pos, temperature_neg).to(ratio_T.dtype)
    gate_T = torch.sigmoid(tau_T * (ratio_T - 1.0))
    loss_T = -gate_T * (4.0 / tau_T) * advantages_T
    stats = {
        "soft_gate": _masked(4.0 * gate_T * (1.0 - gate_T), loss_mask_T).detach(),
        "approx_kl": (-log_ratio_T).detach(),
        "ratio": _masked(ratio_T, loss_mask_T).detach(),
    }
    return _masked(loss_T, loss_mask_T), stats


VESPO_LOG_W_MIN = math.log(1e-8)
"""The lower bound of VESPO's sequence log-ratio (TRL's, after the original implementation)."""
VESPO_LOG_W_MAX = 20.0


def vespo_loss_T(
    logprobs_T: torch.Tensor,
    old_logprobs_T: torch.Tensor,
    advantages_T: torch.Tensor,
    loss_mask_T: torch.Tensor,
    cu_seqlens_B1: torch.Tensor,
    *,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
) -> tuple[torch.Tensor, Stats]:
    """VESPO (TRL's ``loss_type="vespo"``): the policy gradient weighted, per sequence, by a gamma-shaped function
    of its importance ratio,

    ``loss_t = -sg[phi(w)] * A * logp_t``, ``w = exp(sum_t (logp_t - old_logp_t))`` (the sequence's ratio, each
    token's log-ratio clamped to [-20, 20] and the sum to [log 1e-8, 20]), ``phi(w) = exp(lambda + k log w -
    lambda w)`` (so ``phi(1) = 1``), ``k, lambda`` = ``k_pos, lambda_pos`` where ``A >= 0``, else ``k_neg,
    lambda_neg``. ``phi`` falls toward 0 as ``w`` leaves 1 on either side (``k`` sets how fast below, ``lambda``
    above), bounding the weight of sequences far off the sampling policy; a non-finite ``phi`` counts 0. Stats:
    ``vespo_weight`` (``phi``), ``approx_kl``, ``ratio`` (``w``).
    """
    mask_T = loss_mask_T.bool()
    log_ratio_T = _masked((logprobs_T - old_logprobs_T).detach(), mask_T)
    log_w_B = sequence_sum_B(log_ratio_T.clamp(-20.0, 20.0), cu_seqlens_B1, mask_T).clamp(
        VESPO_LOG_W_MIN, VESPO_LOG_W_MAX
    )
    log_w_T = repeat_per_sequence(log_w_B, cu_seqlens_B1)
    nonneg_T = advantages_T >= 0
    k_T = torch.where(nonneg_T, k_pos, k_neg).to(log_w_T.dtype)
    lam_T = torch.where(nonneg_T, lambda_pos, lambda_neg).to(log_w_T.dtype).clamp(min=1e-4)
    phi_T = torch.exp(lam_T + k_T * log_w_T - lam_T * torch.exp(log_w_T))
    phi_T = torch.nan_to_num(phi_T, nan=0.0, posinf=0.0, neginf=0.0)
    loss_T = -phi_T * advantages_T * logprobs_T
    stats = {
        "vespo_weight": _masked(phi_T, mask_T),
        "approx_kl": -log_ratio_T,
        "ratio": _masked(torch.exp(log_w_T), mask_T),
    }
    return _masked(loss_T, mask_T), stats
