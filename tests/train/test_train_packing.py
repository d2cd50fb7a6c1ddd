"""Token-budget packing, DP balancing, schedules and config validation."""

import math

import pytest
import torch

from areno.train.config import TrainBackendConfig
from areno.train.optim import lr_factor
from areno.train.packing import MicroBatchSpec, estimate_max_tokens_per_mb, plan_micro_batches
from tests.helpers.train import group_batch


def test_ffd_respects_budget_and_covers_every_sequence_once():
    seqlens = [7, 3, 9, 2, 2, 5, 8, 1]
    plan = plan_micro_batches(seqlens, MicroBatchSpec(max_tokens_per_mb=10))
    mbs = plan.per_rank[0]
    assert sorted(i for mb in mbs for i in mb) == list(range(len(seqlens)))
    assert all(sum(seqlens[i] for i in mb) <= 10 for mb in mbs)
    # 37 tokens need at least 4 bins of 10; FFD finds 4 here (9+1, 8+2, 7+3, 5+2).
    assert len(mbs) == 4


def test_budget_smaller_than_longest_sequence_names_both_numbers():
    with pytest.raises(ValueError, match=r"sequence 1 has 12 tokens.*max_tokens_per_mb=8"):
        plan_micro_batches([3, 12, 4], MicroBatchSpec(max_tokens_per_mb=8))


def test_dp_balance_equal_micro_batch_counts_and_token_balance():
    seqlens = [100, 90, 10, 10, 10, 10, 10, 10, 40, 50]
    plan = plan_micro_batches(seqlens, MicroBatchSpec(max_tokens_per_mb=100, dp_size=2))
    loads = [sum(seqlens[i] for mb in rank for i in mb) for rank in plan.per_rank]
    assert sum(loads) == sum(seqlens) and abs(loads[0] - loads[1]) <= 10
    assert len(plan.per_rank[0]) == len(plan.per_rank[1]) == plan.n_mbs
    assert sorted(i for r in plan.per_rank for mb in r for i in mb) == list(range(len(seqlens)))


def test_fewer_sequences_than_ranks_gives_empty_micro_batches():
    plan = plan_micro_batches([5, 60], MicroBatchSpec(max_tokens_per_mb=64, dp_size=3))
    assert plan.n_mbs == 1
    assert sorted(len(r[0]) for r in plan.per_rank) == [0, 1, 1]
    # a rank with one long sequence and a rank with many short ones still agree on the count
    plan = plan_micro_batches([64, 20, 20, 20, 20], MicroBatchSpec(max_tokens_per_mb=64, dp_size=2))
    assert len(plan.per_rank[0]) == len(plan.per_rank[1])


def test_memory_estimate_scales_with_free_memory_and_checkpointing():
    kw = dict(hidden_size=896, intermediate_size=4864, num_layers=24, vocab_size=151936, q_kv_dim=1152)
    small = estimate_max_tokens_per_mb(free_bytes=10 * 2**30, **kw)
    big = estimate_max_tokens_per_mb(free_bytes=40 * 2**30, **kw)
    ac = estimate_max_tokens_per_mb(free_bytes=10 * 2**30, activation_checkpointing=True, **kw)
    assert 256 <= small < big and ac > small and small % 256 == 0
    # hand count: per layer 8*896 + 2*1152 + 5*4864 = 33792 elements; 24 layers bf16 + 151936*6
    per_token = 2 * 24 * 33792 + 151936 * 6
    assert small == (int(10 * 2**30 * 0.7) // per_token) // 256 * 256


def test_schedules_hand_computed():
    c = TrainBackendConfig(lr=1.0, schedule="linear_warmup", warmup_steps=4)
    assert [lr_factor(s, c) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    c = TrainBackendConfig(lr=1.0, schedule="cosine", warmup_steps=2, total_steps=6, min_lr_ratio=0.1)
    got = [lr_factor(s, c) for s in range(8)]
    assert got[:2] == [0.5, 1.0]
    assert math.isclose(got[2], 1.0) and math.isclose(got[4], 0.1 + 0.9 * 0.5)
    assert math.isclose(got[6], 0.1) and math.isclose(got[7], 0.1)
    assert lr_factor(3, TrainBackendConfig()) == 1.0


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(schedule="cosine"), "total_steps"),
        (dict(schedule="poly"), "optim.schedule"),
        (dict(betas=(0.9, 1.0)), "betas"),
        (dict(max_tokens_per_mb=0), "max_tokens_per_mb"),
        (dict(dtype="float16"), "dtype"),
        (dict(tp_size=0), "tp_size"),
    ],
)
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        TrainBackendConfig(**kw)


def test_mesh_that_does_not_divide_world_size():
    with pytest.raises(ValueError, match="does not divide the world size 4"):
        TrainBackendConfig(tp_size=3).mesh_shape(4)
    with pytest.raises(ValueError, match="world size is 4"):
        TrainBackendConfig(dp_shard_size=3).mesh_shape(4)
    assert TrainBackendConfig(tp_size=2, dp_replicate_size=2).mesh_shape(8) == (2, 2, 2)
    assert torch.Size(TrainBackendConfig().mesh_shape(2)) == (1, 2, 1)


def test_truncate_long_sequences_hand_values():
    from areno.train.packing import truncate_long_sequences, untruncate_outputs
    from areno.types import TokenBatch

    batch = TokenBatch(
        input_ids_T=torch.tensor([10, 11, 12, 20, 21, 22, 23, 24]),
        cu_seqlens_B1=torch.tensor([0, 3, 8]),
        loss_mask_T=torch.tensor([0, 1, 1, 0, 1, 1, 1, 1], dtype=torch.bool),
        logprobs_T=torch.arange(8.0),
        versions_T=torch.arange(8),
        advantages_T=torch.arange(8.0) * 2,
        rewards_B=torch.tensor([1.0, 2.0]),
        extra={"ref_logprobs_T": torch.arange(8.0) * 3, "values_B": torch.tensor([5.0, 6.0])},
    )
    assert truncate_long_sequences(batch, 5) == (batch, None)
    cut, keep_T = truncate_long_sequences(batch, 4)
    assert keep_T.tolist() == [True] * 7 + [False]
    assert cut.cu_seqlens_B1.tolist() == [0, 3, 7] and cut.input_ids_T.tolist() == [10, 11, 12, 20, 21, 22, 23]
    assert cut.advantages_T.tolist() == [0, 2, 4, 6, 8, 10, 12] and cut.rewards_B.tolist() == [1.0, 2.0]
    assert cut.extra["ref_logprobs_T"].tolist() == [0, 3, 6, 9, 12, 15, 18] and cut.extra["values_B"].tolist() == [5, 6]
    back = untruncate_outputs({"logprobs_T": torch.ones(7), "score_B": torch.ones(2)}, keep_T)
    assert back["logprobs_T"].tolist() == [1.0] * 7 + [0.0] and back["score_B"].tolist() == [1.0, 1.0]


# ----------------------------------------------------------------------------- shared prompts
def _shared(batch) -> list[int]:
    from areno.models.prefix_sharing import shared_prompt_tokens

    return shared_prompt_tokens(batch.input_ids_T, batch.cu_seqlens_B1, batch.loss_mask_T)


def _rows(batch, seqs: list[int]) -> int:
    """Rows the shared-prompt forward of this micro-batch runs (``prefix_sharing.plan`` itself)."""
    from areno.models.prefix_sharing import plan

    if not seqs:
        return 0
    mb = batch.select(seqs)
    sharing = plan(mb.input_ids_T, mb.cu_seqlens_B1, mb.loss_mask_T)
    return mb.num_tokens if sharing is None else int(sharing.source_C.numel())


def test_shared_prompt_tokens_count_the_rows_the_shared_forward_runs():
    from areno.train.packing import _Prompts

    rng = torch.Generator().manual_seed(1)
    groups = [
        (int(torch.randint(1, 9, (1,), generator=rng)), [int(n) for n in torch.randint(1, 7, (k,))])
        for k in (3, 1, 4, 2, 5)
    ]
    batch = group_batch(groups)
    shared = _shared(batch)
    assert shared[0] == 0 and sum(1 for s in shared if s) == sum(len(c) - 1 for _, c in groups)
    prompts = _Prompts(shared, batch.seqlens_B.tolist())
    B = batch.num_seqs
    for _ in range(30):  # any micro-batch, contiguous or not
        seqs = sorted(torch.randperm(B, generator=rng)[: int(torch.randint(1, B + 1, (1,), generator=rng))].tolist())
        assert prompts.rows(seqs) == _rows(batch, seqs), seqs


def test_shared_prompts_keep_groups_whole_where_no_micro_batch_is_added():
    # cpu5m's 8 x 4 batch: by tokens 25 + 7 sequences (a group split); by rows 4 whole groups each
    seqlens, shared = [162] * 32, [0 if i % 4 == 0 else 34 for i in range(32)]
    spec = MicroBatchSpec(max_tokens_per_mb=4096)
    assert [len(mb) for mb in plan_micro_batches(seqlens, spec).per_rank[0]] == [25, 7]
    assert plan_micro_batches(seqlens, spec, shared).per_rank[0] == [list(range(16)), list(range(16, 32))]
    # completions of 16-254 tokens in each of 8 groups of 8 (1,336 tokens a group): first-fit-decreasing by
    # length puts a part of every group in each of its 3 micro-batches (each prompt three times); by rows
    # 3 + 3 + 2 whole groups
    batch = group_batch([(32, [16 + 34 * j for j in range(8)])] * 8)
    seqlens, shared = batch.seqlens_B.tolist(), _shared(batch)
    by_tokens = plan_micro_batches(seqlens, spec).per_rank[0]
    assert len(by_tokens) == 3 and all(len({i // 8 for i in mb}) == 8 for mb in by_tokens)
    assert plan_micro_batches(seqlens, spec, shared).per_rank[0] == [
        list(range(24)),
        list(range(24, 48)),
        list(range(48, 64)),
    ]
    # 1,392 tokens a group: whole groups would take four micro-batches, so three of consecutive sequences
    # (two groups split: two prompts again, not sixteen)
    batch = group_batch([(32, [16 + 36 * j for j in range(8)])] * 8)
    seqlens, shared = batch.seqlens_B.tolist(), _shared(batch)
    by_tokens = plan_micro_batches(seqlens, spec).per_rank[0]
    by_rows = plan_micro_batches(seqlens, spec, shared).per_rank[0]
    assert len(by_rows) == len(by_tokens) == 3
    assert all(mb == list(range(mb[0], mb[-1] + 1)) and sum(seqlens[i] for i in mb) <= 4096 for mb in by_rows)
    ideal = 8 * (32 + sum(16 + 36 * j for j in range(8)))
    assert sum(_rows(batch, mb) for mb in by_tokens) == ideal + 16 * 32
    assert ideal <= sum(_rows(batch, mb) for mb in by_rows) <= ideal + 2 * 32


def test_one_more_micro_batch_where_it_saves_more_rows_than_it_costs():
    from areno.train.packing import MICRO_BATCH_ROWS

    # 256-token prompts, 3,136 tokens a group: seven micro-batches of consecutive sequences would run six
    # prompts again (1,536 rows), more than an eighth micro-batch costs: one whole group each
    batch = group_batch([(256, [16 + 34 * j for j in range(8)])] * 8)
    seqlens, shared = batch.seqlens_B.tolist(), _shared(batch)
    plan = plan_micro_batches(seqlens, MicroBatchSpec(max_tokens_per_mb=4096), shared).per_rank[0]
    assert plan == [list(range(8 * g, 8 * g + 8)) for g in range(8)] and 6 * 256 > MICRO_BATCH_ROWS
    # a GPU's spec (micro_batch_rows=None): the fewest micro-batches, then the fewest rows
    gpu = MicroBatchSpec(max_tokens_per_mb=4096, micro_batch_rows=None)
    plan = plan_micro_batches(seqlens, gpu, shared).per_rank[0]
    assert len(plan) == 7 and all(mb == list(range(mb[0], mb[-1] + 1)) for mb in plan)
    # 32-token prompts: a fourth micro-batch would save two prompts (64 rows), less than it costs
    batch = group_batch([(32, [16 + 36 * j for j in range(8)])] * 8)
    plan = plan_micro_batches(batch.seqlens_B.tolist(), MicroBatchSpec(max_tokens_per_mb=4096), _shared(batch))
    assert plan.n_mbs == 3 and 2 * 32 < MICRO_BATCH_ROWS


def test_shared_prompts_keep_groups_on_one_data_parallel_rank():
    rank_rows = lambda batch, p: max(sum(_rows(batch, mb) for mb in rank) for rank in p.per_rank)
    batch = group_batch([(40, [10, 30, 20, 50])] * 6)
    seqlens, shared = batch.seqlens_B.tolist(), _shared(batch)
    plan = plan_micro_batches(seqlens, MicroBatchSpec(max_tokens_per_mb=1024, dp_size=3), shared)
    for rank in plan.per_rank:  # two whole groups each
        (mb,) = rank
        groups = sorted({i // 4 for i in mb})
        assert len(groups) == 2 and mb == [i for g in groups for i in range(4 * g, 4 * g + 4)]
    assert rank_rows(batch, plan) == 2 * (40 + 110)
    # three groups on two ranks: by tokens each rank gets part of every group (every prompt twice)
    batch = group_batch([(40, [50, 40, 30, 20])] * 3)
    seqlens, shared = batch.seqlens_B.tolist(), _shared(batch)
    spec = MicroBatchSpec(max_tokens_per_mb=1024, dp_size=2)
    by_tokens, by_rows = plan_micro_batches(seqlens, spec), plan_micro_batches(seqlens, spec, shared)
    assert all(len({i // 4 for mb in rank for i in mb}) == 3 for rank in by_tokens.per_rank)
    assert rank_rows(batch, by_rows) < rank_rows(batch, by_tokens)
    assert sum(len(rank[0]) for rank in by_rows.per_rank) == 12


@pytest.mark.parametrize("seed", range(12))
def test_shared_prompt_plans_are_valid_and_never_need_more_micro_batches(seed):
    from areno.train.packing import MICRO_BATCH_ROWS, _Prompts

    rng = torch.Generator().manual_seed(seed)
    r = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=rng))
    groups = [(r(1, 40), [r(1, 60) for _ in range(r(1, 8))]) for _ in range(r(1, 10))]
    batch = group_batch(groups, seed)
    seqlens, shared = batch.seqlens_B.tolist(), _shared(batch)
    dp, budget = r(1, 4), max(seqlens) + r(0, 300)
    spec = MicroBatchSpec(max_tokens_per_mb=budget, dp_size=dp)
    plan = plan_micro_batches(seqlens, spec, shared)
    assert len(plan.per_rank) == dp and all(len(rank) == plan.n_mbs for rank in plan.per_rank)
    assert sorted(i for rank in plan.per_rank for mb in rank for i in mb) == list(range(len(seqlens)))
    assert all(mb == sorted(mb) and sum(seqlens[i] for i in mb) <= budget for rank in plan.per_rank for mb in rank)
    if dp == 1:  # one rank: no more rows and micro-batches' fixed costs than by tokens
        prompts = _Prompts(shared, seqlens)
        by_tokens = plan_micro_batches(seqlens, spec).per_rank[0]
        cost = lambda mbs: sum(map(prompts.rows, mbs)) + MICRO_BATCH_ROWS * len(mbs)
        assert cost(plan.per_rank[0]) <= cost(by_tokens)


def test_the_linear_schedule_is_transformers_linear_decay_after_the_warm_up():
    """``optim.schedule=linear`` (TRL's and transformers' default): after the warm-up the factor falls
    linearly to ``min_lr_ratio`` at ``total_steps`` (transformers' get_linear_schedule_with_warmup at 0)."""
    c = TrainBackendConfig(lr=1.0, schedule="linear", warmup_steps=2, total_steps=6)
    assert [lr_factor(s, c) for s in range(8)] == pytest.approx([0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0])
    c = TrainBackendConfig(lr=1.0, schedule="linear", warmup_steps=0, total_steps=4, min_lr_ratio=0.2)
    assert [lr_factor(s, c) for s in range(5)] == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2])
    with pytest.raises(ValueError, match=r"schedule='linear' needs total_steps > 0"):
        TrainBackendConfig(lr=1.0, schedule="linear")
