"""``TokenBatch.from_trajectories`` packs ``extra_T`` keys by joining arrays; the result is, bit for bit
and in dtype, what the per-token Python list it replaced gave."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from areno.types import TokenBatch, Trajectory


def per_token_reference(trajectories: list[Trajectory]) -> dict[str, torch.Tensor]:
    """The packing it replaced: every value appended to one Python list, then ``torch.tensor``."""
    extra = {}
    for key in sorted({k for t in trajectories for k in t.extra_T}):
        values: list[float] = []
        for traj in trajectories:
            values.extend([0.0] * len(traj.prompt_ids))
            values.extend(traj.extra_T.get(key, [0.0] * len(traj.completion_ids)))
        extra[key] = torch.tensor(values, dtype=torch.float32)
    return extra


def random_values(rng: random.Random, n: int) -> list:
    """Floats float32 must round (and beyond its range), ints, bools, -0.0, infinities."""
    pool = [0.0, -0.0, 1.0, True, False, 0, 3, 0.1, 1e-40, 3.5e38, -1e39, float("inf"), 2**40 + 1]
    return [rng.choice(pool) if rng.random() < 0.3 else rng.uniform(-5, 5) for _ in range(n)]


@pytest.mark.parametrize("seed", range(5))
def test_extra_keys_pack_as_the_per_token_list_did(seed):
    rng = random.Random(seed)
    trajectories = []
    for i in range(30):
        n = rng.choice([0, 1, 3, 17])
        prompt = [1] * rng.choice([0, 1, 4])
        extra = {}
        for key in ("teacher_executed_T", "teacher_q_T", "teacher_q_mask_T"):
            if rng.random() < 0.5:
                values = random_values(rng, n)
                extra[key] = rng.choice([list, tuple, np.asarray])(values) if i % 3 == 0 else values
        trajectories.append(
            Trajectory(
                prompt_ids=prompt,
                completion_ids=[5] * n,
                logprobs=[-0.1] * n,
                versions=[0] * n,
                reward=0.0,
                extra_T=extra,
            )
        )
    trajectories.append(
        Trajectory(prompt_ids=[1], completion_ids=[5], logprobs=[0.0], versions=[0], reward=0.0, extra_T={"x_T": [7]})
    )
    with np.errstate(over="ignore"):
        got = TokenBatch.from_trajectories(trajectories).extra
    want = per_token_reference(trajectories)
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype == torch.float32 and got[key].shape == value.shape, key
        assert torch.equal(got[key].view(torch.int32), value.view(torch.int32)), key  # bit for bit: -0.0 and NaN too


def test_no_extra_keys_and_a_key_without_completion_tokens():
    prompt_only = Trajectory(
        prompt_ids=[1, 2], completion_ids=[], logprobs=[], versions=[], reward=0.0, extra_T={"a_T": []}
    )
    plain = Trajectory(prompt_ids=[1], completion_ids=[2], logprobs=[0.0], versions=[0], reward=0.0)
    assert TokenBatch.from_trajectories([plain]).extra == {}
    batch = TokenBatch.from_trajectories([prompt_only, plain])
    assert batch.extra["a_T"].tolist() == [0.0, 0.0, 0.0, 0.0] and batch.extra["a_T"].dtype == torch.float32


def test_extra_values_given_as_tensors_pack_as_their_lists():
    """walk38: a workflow handing a bf16 (or CUDA) tensor as extra_T values raised a TypeError once packing
    went through numpy; the values pack as the lists of the same numbers do."""
    import torch

    from areno.types import TokenBatch, Trajectory

    def traj(extra):
        return Trajectory(
            prompt_ids=[1, 2], completion_ids=[3, 4, 5], logprobs=[0.0] * 3, versions=[0] * 3, reward=1.0, extra_T=extra
        )

    values = [0.5, -1.25, 3.0]
    as_lists = TokenBatch.from_trajectories([traj({"k_T": values})]).extra["k_T"]
    for tensor in (torch.tensor(values, dtype=torch.bfloat16), torch.tensor(values, dtype=torch.float64)):
        packed = TokenBatch.from_trajectories([traj({"k_T": tensor})]).extra["k_T"]
        assert packed.dtype == as_lists.dtype and torch.equal(packed, as_lists)
