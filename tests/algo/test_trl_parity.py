"""Parity with TRL: TRL's own GRPO/DAPO/Dr.GRPO/GSPO/CISPO (and off-policy sequence mask) and DPO loss code (``_compute_loss`` of
its trainers, called on a stand-in trainer object) against areno's functions on the same tensors:
loss values and gradients. TRL is a test-only dependency; importing it takes ~10 s of CPU, so the
module is marked slow (run with ``-m slow``)."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from areno.algo import (
    aggregation_denominator,
    aggregation_weights_T,
    broadcast_to_tokens_T,
    cispo_loss_T,
    dpo_loss_B,
    grpo_advantages_B,
    grpo_batch_std_advantages_B,
    gspo_loss_T,
    importance_weighted_kl_T,
    kl_estimate_T,
    off_policy_sequence_mask_T,
    ppo_clip_loss_T,
    sequence_sum_B,
)

pytestmark = pytest.mark.slow


def _trl():
    """TRL's modules, imported on first use so collecting this file stays cheap."""
    pytest.importorskip("trl")
    from trl.trainer import dpo_trainer, grpo_trainer, utils

    return SimpleNamespace(DPOTrainer=dpo_trainer.DPOTrainer, GRPOTrainer=grpo_trainer.GRPOTrainer, nanstd=utils.nanstd)


class _Accelerator:
    num_processes = 1
    device = torch.device("cpu")
    sync_gradients = True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


def _padded_case(seed=0):
    """B=6 completions (3 groups of 2) padded to L=5, and the packed view of the same tokens."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [4, 2, 5, 3, 2, 3]
    B, L = len(lengths), max(lengths)
    mask_BL = torch.zeros(B, L)
    for b, n in enumerate(lengths):
        mask_BL[b, :n] = 1
    logp_BL = (-torch.rand(B, L, generator=gen) * 3).requires_grad_(True)
    old_BL = (logp_BL.detach() + 0.3 * torch.randn(B, L, generator=gen)) * mask_BL
    ref_BL = (logp_BL.detach() + 0.2 * torch.randn(B, L, generator=gen)) * mask_BL
    rewards_B = torch.tensor([1.0, 0.0, 0.2, 1.0, 0.5, 0.5])
    # packed: one prompt token (never a target) then the completion, per sequence
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + 1 + n)
    sel = [(b, j) for b, n in enumerate(lengths) for j in range(-1, n)]

    def pack(x_BL):
        return torch.stack([x_BL[b, j] if j >= 0 else x_BL.new_zeros(()) for b, j in sel])

    loss_mask_T = torch.tensor([j >= 0 for _, j in sel])
    return SimpleNamespace(
        B=B,
        L=L,
        mask_BL=mask_BL,
        logp_BL=logp_BL,
        old_BL=old_BL,
        ref_BL=ref_BL,
        rewards_B=rewards_B,
        cu=torch.tensor(cu),
        loss_mask_T=loss_mask_T,
        pack=pack,
    )


def _trl_grpo_advantages(rewards_B, n, scale=True):
    """TRL's advantage lines (``scale_rewards`` "group": True, "none": False, "batch") on the same rewards."""
    mean = rewards_B.view(-1, n).mean(dim=1).repeat_interleave(n)
    adv = rewards_B - mean
    if scale == "batch":
        adv = adv / (_trl().nanstd(rewards_B).expand_as(rewards_B) + 1e-4)
    elif scale:
        std = _trl().nanstd(rewards_B.view(-1, n), dim=1).repeat_interleave(n)
        adv = adv / (std + 1e-4)
    return adv


def _trl_grpo_loss(
    case,
    adv_B,
    *,
    loss_type,
    eps_low,
    eps_high,
    beta=0.0,
    level="token",
    max_len=None,
    off_policy_mask=None,
    kl_bias_correction=False,
):
    stand_in = SimpleNamespace(
        aux_loss_enabled=False,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=off_policy_mask,
        importance_sampling_level=level,
        beta=beta,
        loss_type=loss_type,
        epsilon_low=eps_low,
        epsilon_high=eps_high,
        args=SimpleNamespace(use_bias_correction_kl=kl_bias_correction, delta=None, steps_per_generation=1),
        use_vllm=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        max_completion_length=max_len or case.L,
        _entropy_bonus_enabled=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        accelerator=_Accelerator(),
        _get_per_token_logps_and_entropies=lambda *a, **k: (case.logp_BL, torch.zeros_like(case.logp_BL), None),
        get_off_policy_mask=_trl().GRPOTrainer.get_off_policy_mask,
    )
    inputs = {
        "prompt_ids": torch.zeros(case.B, 1, dtype=torch.long),
        "prompt_mask": torch.ones(case.B, 1),
        "completion_ids": torch.zeros(case.B, case.L, dtype=torch.long),
        "completion_mask": case.mask_BL,
        "advantages": adv_B,
        "old_per_token_logps": case.old_BL,
        "ref_per_token_logps": case.ref_BL,
        "num_items_in_batch": case.mask_BL.sum(),
    }
    if getattr(case, "sampling_BL", None) is not None:
        inputs["sampling_per_token_logps"] = case.sampling_BL
    return _trl().GRPOTrainer._compute_loss(stand_in, None, inputs)


def _areno_loss(case, adv_B, loss_fn, aggregation, *, constant=1.0, kl_coef=0.0, kl_bias_correction=False):
    logp_T = case.pack(case.logp_BL)
    adv_T = broadcast_to_tokens_T(adv_B, case.cu, case.loss_mask_T)
    loss_T, _ = loss_fn(logp_T, case.pack(case.old_BL), adv_T, case.loss_mask_T)
    if kl_coef:
        kl_T = kl_estimate_T(logp_T, case.pack(case.ref_BL), case.loss_mask_T, estimator="k3")
        if kl_bias_correction:
            kl_T = importance_weighted_kl_T(kl_T, logp_T, case.pack(case.old_BL), case.loss_mask_T)
        loss_T = loss_T + kl_coef * kl_T
    w_T = aggregation_weights_T(case.loss_mask_T, case.cu, aggregation)
    return (loss_T * w_T).sum() / aggregation_denominator(case.loss_mask_T, case.cu, aggregation, constant=constant)


def _check(case, trl_loss, areno_loss):
    assert areno_loss.item() == pytest.approx(trl_loss.item(), rel=1e-5, abs=1e-7)
    (g_trl,) = torch.autograd.grad(trl_loss, case.logp_BL)
    (g_areno,) = torch.autograd.grad(areno_loss, case.logp_BL)
    assert torch.allclose(g_trl, g_areno, atol=1e-6)


def test_grpo_advantages_match_trl():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.3, 0.3, 0.3, 1.0, 1.0, 0.0])
    group = torch.arange(3).repeat_interleave(3)
    assert torch.allclose(grpo_advantages_B(rewards, group), _trl_grpo_advantages(rewards, 3), atol=1e-6)
    assert torch.allclose(
        grpo_advantages_B(rewards, group, scale_by_std=False), _trl_grpo_advantages(rewards, 3, scale=False), atol=1e-6
    )


def test_grpo_batch_std_advantages_match_trl():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.3, 0.3, 0.3, 1.0, 1.0, 0.0])
    group = torch.arange(3).repeat_interleave(3)
    assert torch.allclose(
        grpo_batch_std_advantages_B(rewards, group), _trl_grpo_advantages(rewards, 3, scale="batch"), atol=1e-6
    )


def test_off_policy_sequence_mask_matches_trl():
    """TRL's ``off_policy_mask_threshold`` in its ``_compute_loss`` (sampler log-probs given, dapo's loss) against
    areno's clipped loss with ``off_policy_sequence_mask_T``'s tokens zeroed: sequence 1 (negative advantage,
    mean gap 0.5) is dropped, sequence 2 (negative, 0.1) and the others (advantage >= 0) stay."""
    case = _padded_case(5)
    gap_B = torch.tensor([0.5, 0.5, 0.1, 0.5, 0.5, 0.5])
    case.sampling_BL = (case.logp_BL.detach() + gap_B[:, None]) * case.mask_BL
    adv = _trl_grpo_advantages(case.rewards_B, 2)
    trl_loss = _trl_grpo_loss(case, adv, loss_type="dapo", eps_low=0.2, eps_high=0.28, off_policy_mask=0.3)
    sampling_T = case.pack(case.sampling_BL)

    def masked_loss(logp_T, old_T, adv_T, mask_T):
        loss_T, stats = ppo_clip_loss_T(logp_T, old_T, adv_T, mask_T, eps_low=0.2, eps_high=0.28)
        drop_T = off_policy_sequence_mask_T(logp_T, sampling_T, adv_T, mask_T, case.cu, threshold=0.3)
        assert drop_T.any() and not drop_T.all()
        return torch.where(drop_T, torch.zeros_like(loss_T), loss_T), stats

    _check(case, trl_loss, _areno_loss(case, adv, masked_loss, "token"))


def test_grpo_with_kl_matches_trl():
    case = _padded_case()
    adv = _trl_grpo_advantages(case.rewards_B, 2)
    trl_loss = _trl_grpo_loss(case, adv, loss_type="grpo", eps_low=0.2, eps_high=0.2, beta=0.04)
    ours = _areno_loss(
        case,
        grpo_advantages_B(case.rewards_B, torch.arange(3).repeat_interleave(2)),
        lambda *a: ppo_clip_loss_T(*a, eps_low=0.2),
        "seq_mean_token_mean",
        kl_coef=0.04,
    )
    _check(case, trl_loss, ours)


def test_kl_bias_correction_matches_trl():
    """TRL's ``use_bias_correction_kl`` (the k3 term times the token's ratio to the old policy, whose log-probs
    are the sampler's here) against ``kl_bias_correction``'s ``importance_weighted_kl_T``: values and gradients."""
    case = _padded_case(7)
    adv = _trl_grpo_advantages(case.rewards_B, 2)
    trl_loss = _trl_grpo_loss(case, adv, loss_type="dapo", eps_low=0.2, eps_high=0.2, beta=0.5, kl_bias_correction=True)
    plain = _trl_grpo_loss(case, adv, loss_type="dapo", eps_low=0.2, eps_high=0.2, beta=0.5)
    assert abs(trl_loss.item() - plain.item()) > 1e-4  # the weights are not 1 here
    ours = _areno_loss(
        case, adv, lambda *a: ppo_clip_loss_T(*a, eps_low=0.2), "token", kl_coef=0.5, kl_bias_correction=True
    )
    _check(case, trl_loss, ours)


def test_dapo_matches_trl():
    case = _padded_case(1)
    adv = _trl_grpo_advantages(case.rewards_B, 2)
    trl_loss = _trl_grpo_loss(case, adv, loss_type="dapo", eps_low=0.2, eps_high=0.28)
    ours = _areno_loss(case, adv, lambda *a: ppo_clip_loss_T(*a, eps_low=0.2, eps_high=0.28), "token")
    _check(case, trl_loss, ours)


def test_dr_grpo_matches_trl():
    case = _padded_case(2)
    adv = _trl_grpo_advantages(case.rewards_B, 2, scale=False)
    trl_loss = _trl_grpo_loss(case, adv, loss_type="dr_grpo", eps_low=0.2, eps_high=0.2, max_len=16)
    ours = _areno_loss(
        case,
        grpo_advantages_B(case.rewards_B, torch.arange(3).repeat_interleave(2), scale_by_std=False),
        lambda *a: ppo_clip_loss_T(*a, eps_low=0.2),
        "constant",
        constant=16,
    )
    _check(case, trl_loss, ours)


def test_gspo_and_cispo_match_trl():
    case = _padded_case(3)
    case.old_BL = (case.logp_BL.detach() + 0.01 * torch.randn(case.B, case.L)) * case.mask_BL
    adv = _trl_grpo_advantages(case.rewards_B, 2)
    trl_loss = _trl_grpo_loss(case, adv, loss_type="grpo", eps_low=3e-4, eps_high=4e-4, level="sequence")
    ours = _areno_loss(
        case,
        adv,
        lambda lp, old, a, m: gspo_loss_T(lp, old, a, m, case.cu, eps_low=3e-4, eps_high=4e-4),
        "seq_mean_token_mean",
    )
    _check(case, trl_loss, ours)
    case = _padded_case(4)
    # TRL's cispo clamps the ratio at epsilon_high itself; areno's bound is 1 + clip_eps_high
    trl_loss = _trl_grpo_loss(case, adv, loss_type="cispo", eps_low=0.2, eps_high=1.1)
    ours = _areno_loss(case, adv, lambda *a: cispo_loss_T(*a, eps_high=0.1), "token")
    _check(case, trl_loss, ours)


def test_luspo_matches_trl():
    """TRL's ``loss_type="luspo"`` at ``importance_sampling_level="sequence"`` (as it recommends) against the
    ``luspo`` recipe's gspo loss under ``seq_mean_token_sum``: each sequence's token losses summed, averaged."""
    case = _padded_case(6)
    case.old_BL = (case.logp_BL.detach() + 0.01 * torch.randn(case.B, case.L)) * case.mask_BL
    adv = _trl_grpo_advantages(case.rewards_B, 2)
    trl_loss = _trl_grpo_loss(case, adv, loss_type="luspo", eps_low=3e-4, eps_high=4e-4, level="sequence")
    ours = _areno_loss(
        case,
        adv,
        lambda lp, old, a, m: gspo_loss_T(lp, old, a, m, case.cu, eps_low=3e-4, eps_high=4e-4),
        "seq_mean_token_sum",
    )
    _check(case, trl_loss, ours)


def test_dpo_matches_trl():
    gen = torch.Generator().manual_seed(5)
    P, L = 3, 4
    mask = torch.ones(2 * P, L + 1)
    mask[:, 0] = 0  # prompt token
    mask[1, 4:] = 0
    mask[4, 3:] = 0
    logp = (-torch.rand(2 * P, L, generator=gen) * 2).requires_grad_(True)
    ref = -torch.rand(2 * P, generator=gen) * 6
    shift_mask = mask[:, 1:]
    stand_in = SimpleNamespace(
        model=SimpleNamespace(training=True),
        accelerator=_Accelerator(),
        aux_loss_enabled=False,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=["sigmoid"],
        loss_weights=[1.0],
        beta=0.3,
        use_weighting=False,
        _metrics={"train": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    out = SimpleNamespace(
        log_probs=logp * shift_mask,
        entropy=torch.zeros(2 * P, L),
        mean_logits=torch.zeros(2 * P, L),
        is_top1=torch.zeros(2 * P, L, dtype=torch.bool),
    )
    inputs = {
        "input_ids": torch.zeros(2 * P, L + 1, dtype=torch.long),
        "attention_mask": torch.ones(2 * P, L + 1),
        "completion_mask": mask,
        "ref_chosen_logps": ref[:P],
        "ref_rejected_logps": ref[P:],
    }
    trl_loss = _trl().DPOTrainer._compute_loss(stand_in, lambda **kw: out, inputs, return_outputs=False)
    # areno: packed [T] log-probs of the same 2P sequences, summed per sequence
    cu = torch.arange(0, 2 * P * (L + 1) + 1, L + 1)
    logp_T = torch.cat([torch.cat([logp.new_zeros(1), logp[b]]) for b in range(2 * P)])
    seq_B = sequence_sum_B(logp_T, cu, mask.flatten().bool())
    loss_P, _ = dpo_loss_B(seq_B[:P], seq_B[P:], ref[:P], ref[P:], beta=0.3)
    ours = loss_P.mean()
    assert ours.item() == pytest.approx(trl_loss.item(), rel=1e-6)
    (g_trl,) = torch.autograd.grad(trl_loss, logp)
    (g_ours,) = torch.autograd.grad(ours, logp)
    assert torch.allclose(g_trl, g_ours, atol=1e-7)
