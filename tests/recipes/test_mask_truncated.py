"""``ActorConfig.mask_truncated_completions`` (DAPO's overlong filtering; TRL's option of that name, AReaL's
``mask_no_eos_with_zero``): completions cut at the length limit leave the loss, their rewards stay in their
group's baseline."""

from __future__ import annotations

import pytest
import torch

from areno.api.config import load_config
from areno.recipes import get_recipe
from areno.types import TokenBatch
from tests.helpers.configs import run_to_end, tiny_run_overrides
from tests.helpers.recipes import rl_batch


def prepared(batch: TokenBatch, **policy_kwargs) -> tuple[TokenBatch, dict]:
    spec = get_recipe("grpo", policy_kwargs=policy_kwargs).policy_role.build()
    return spec.prepare_batch(batch), spec.prepare_metrics(batch)


def test_truncated_completions_leave_the_loss_and_stay_in_the_baseline():
    batch = rl_batch()  # groups a, a, b, b, c, c
    batch.truncated_B = torch.tensor([False, True, False, False, False, True])
    masked, metrics = prepared(batch, mask_truncated_completions=True)
    plain, _ = prepared(batch)
    seq_T = torch.repeat_interleave(torch.arange(batch.num_seqs), batch.seqlens_B)
    cut_T = batch.truncated_B[seq_T]
    assert torch.equal(masked.loss_mask_T, plain.loss_mask_T & ~cut_T)
    assert not masked.advantages_T[cut_T].any()
    # the others' advantages are the ones of the whole group: the truncated rewards stay in its mean and std
    assert torch.equal(masked.advantages_T[~cut_T], plain.advantages_T[~cut_T])
    assert plain.advantages_T[cut_T & plain.loss_mask_T].abs().sum() > 0
    assert metrics == {"masked_truncated_seqs": 2.0}


def test_from_trajectories_marks_the_truncated_and_select_and_concat_keep_them():
    batch = rl_batch()
    assert batch.truncated_B is not None and not batch.truncated_B.any()  # every finish_reason "stop" there
    batch.truncated_B = torch.tensor([False, True, False, False, True, True])
    assert batch.select([5, 1, 0]).truncated_B.tolist() == [True, True, False]
    joined = TokenBatch.concat([batch.select([0, 1]), batch.select([2, 3, 4, 5])])
    assert torch.equal(joined.truncated_B, batch.truncated_B)


def test_a_batch_that_says_nothing_of_truncation_is_refused():
    batch = rl_batch()
    batch.truncated_B = None
    with pytest.raises(ValueError, match=r"mask_truncated_completions: this batch says nothing of truncation"):
        prepared(batch, mask_truncated_completions=True)


def test_a_run_leaves_its_truncated_completions_out(tmp_path):
    """4-token completions of a random tiny model: nearly all hit the limit and leave the loss."""
    overrides = [
        *tiny_run_overrides(tmp_path),
        "reward.sandbox=false",
        "data.num_eval=0",
        "train.eval_interval=0",
        "train.steps=2",
        "train.algorithm_kwargs={mask_truncated_completions: true}",
    ]
    rows = [r for r in run_to_end(load_config(None, overrides)) if "rollout/num_seqs" in r]
    for row in rows:
        truncated = row["rollout/truncated_frac"] * row["rollout/num_seqs"]
        assert row["train/policy/masked_truncated_seqs"] == pytest.approx(truncated)
    assert sum(r["train/policy/masked_truncated_seqs"] for r in rows) > 0
