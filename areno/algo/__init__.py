"""Pure, shape-annotated loss and advantage functions (no model, no distributed code).

Modules: ``advantages`` (GRPO, Dr.GRPO, GRPO with the batch's std, RLOO, REINFORCE++, GAE),
``policy_loss`` (clipped PPO, clip-higher, dual clip, decoupled PPO with token or sequence behaviour
weights, off-policy sequence masking, the high-entropy token mask, GSPO, CISPO), ``kl`` (k1/k2/k3), ``losses`` (value,
entropy, NLL, DPO, Bradley–Terry), ``filters`` (dynamic sampling, overlong penalty),
``aggregation`` (token / sequence / constant loss normalisation as weights + denominator).
"""

from areno.algo.advantages import (
    broadcast_to_tokens_T,
    gae_T,
    gdpo_advantages_B,
    group_index_B,
    group_mean_std_B,
    grpo_advantages_B,
    grpo_batch_std_advantages_B,
    masked_whiten_T,
    reinforce_pp_advantages_T,
    rloo_advantages_B,
    sequence_returns_T,
)
from areno.algo.aggregation import (
    LOSS_AGGREGATIONS,
    aggregation_denominator,
    aggregation_weights_T,
    statistics_weights_T,
)
from areno.algo.filters import dynamic_sampling_keep_B, dynamic_sampling_kept, overlong_penalty_B
from areno.algo.kl import (
    KL_ESTIMATORS,
    LOSS_KL_ESTIMATORS,
    importance_weighted_kl_T,
    kl_estimate_T,
    kl_reward_penalty_T,
)
from areno.algo.losses import (
    bradley_terry_loss_B,
    dpo_loss_B,
    entropy_bonus_T,
    nll_loss_T,
    sequence_sum_B,
    value_loss_T,
)
from areno.algo.policy_loss import (
    BEHAV_WEIGHT_MODES,
    behaviour_importance_weight_T,
    cispo_loss_T,
    decoupled_ppo_loss_T,
    gspo_loss_T,
    high_entropy_mask_T,
    loglinear_prox_logprobs_T,
    off_policy_sequence_mask_T,
    ppo_clip_loss_T,
    sapo_loss_T,
    sequence_mean_B,
    vespo_loss_T,
)

__all__ = [name for name in dir() if not name.startswith("_")]
