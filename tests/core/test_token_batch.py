import random

import pytest
import torch

from areno.engine.api import rollout_metrics
from areno.types import TokenBatch, Trajectory


def test_from_trajectories_packs_hand_computed_values():
    """Prompt tokens, masked completion tokens (a tool's) and the first token of each sequence are
    not targets; their behaviour log-probs are 0 and versions -1, whatever the trajectory held."""
    a = Trajectory(
        prompt_ids=[5, 6],
        completion_ids=[7, 8, 9],
        logprobs=[-0.5, -9.0, -0.25],
        versions=[3, 7, 4],
        reward=1.0,
        completion_mask=[1, 0, 1],
        group_id="g",
    )
    b = Trajectory(prompt_ids=[], completion_ids=[1, 2], logprobs=[-1.0, -2.0], versions=[2, 2], reward=0.5)
    batch = TokenBatch.from_trajectories([a, b])
    assert batch.input_ids_T.tolist() == [5, 6, 7, 8, 9, 1, 2]
    assert batch.cu_seqlens_B1.tolist() == [0, 5, 7]
    assert batch.loss_mask_T.tolist() == [False, False, True, False, True, False, True]
    assert batch.logprobs_T.tolist() == [0.0, 0.0, -0.5, 0.0, -0.25, -1.0, -2.0]
    assert batch.versions_T.tolist() == [-1, -1, 3, -1, 4, 2, 2]
    assert batch.input_ids_T.dtype == torch.long and batch.logprobs_T.dtype == torch.float32
    assert batch.rewards_B.tolist() == [1.0, 0.5] and batch.group_ids == ["g", ""]
    # staleness counts sampled tokens only (the masked one, version 7, is not)
    metrics = rollout_metrics([a, b], version=4)
    assert metrics["rollout/staleness_max"] == 2.0 and metrics["rollout/staleness_mean"] == 1.25  # (1 + 0 + 2 + 2) / 4


def _packed_per_token(trajectories: list[Trajectory]) -> dict[str, list]:
    """Each per-token field packed one token at a time in Python: the reference the packing's
    filled runs and joined arrays must reproduce."""
    ids, mask, logprobs, versions = [], [], [], []
    for t in trajectories:
        p = len(t.prompt_ids)
        sampled = [bool(m) for m in t.completion_mask]
        ids += [*t.prompt_ids, *t.completion_ids]
        logprobs += [0.0] * p + [lp if s else 0.0 for lp, s in zip(t.logprobs, sampled)]
        versions += [-1] * p + [int(v) if s else -1 for v, s in zip(t.versions, sampled)]
        targets = [False] * p + sampled
        targets[0] = False  # the first token is never a target
        mask += targets
    return {"ids": ids, "mask": mask, "logprobs": logprobs, "versions": versions}


def _random_trajectories(seed: int) -> list[Trajectory]:
    """Mixed shapes: empty prompts, masked (tool) tokens, runs of one version and mixed versions,
    teacher tokens at -1, ``True`` in a mask, one-token completions."""
    rng = random.Random(seed)
    out = []
    for i in range(24):
        n = rng.choice([1, 2, 5, 17])
        prompt = [rng.randrange(50_000) for _ in range(rng.choice([0, 1, 3, 8]))]
        kind = i % 4
        mask = [1] * n if kind < 2 else [rng.choice([0, 1, True]) for _ in range(n)]
        versions = [rng.choice([3, 4])] * n if kind in (0, 2) else [rng.choice([-1, 2, 5]) for _ in range(n)]
        out.append(
            Trajectory(
                prompt_ids=prompt,
                completion_ids=[rng.randrange(50_000) for _ in range(n)],
                logprobs=[-rng.random() * 4 for _ in range(n)],
                versions=versions,
                reward=rng.random(),
                completion_mask=mask,
            )
        )
    return out


@pytest.mark.parametrize("seed", range(4))
def test_packing_equals_per_token_reference(seed):
    """The packed fields equal a per-token Python packing, whatever mix of runs the trajectories
    hold; the rollout figures read from the packed batch equal those joined from the trajectories."""
    mixed = _random_trajectories(seed)
    runs_only = mixed[::4]  # every mask all ones, every trajectory of one version
    for trajectories in (mixed, runs_only):
        batch = TokenBatch.from_trajectories(trajectories)
        ref = _packed_per_token(trajectories)
        assert batch.input_ids_T.tolist() == ref["ids"]
        assert batch.loss_mask_T.tolist() == ref["mask"]
        assert batch.logprobs_T.tolist() == torch.tensor(ref["logprobs"], dtype=torch.float32).tolist()
        assert batch.versions_T.tolist() == ref["versions"]
        assert batch.loss_mask_T.dtype == torch.bool and batch.versions_T.dtype == torch.long
        for version in (5, 9):
            assert rollout_metrics(trajectories, version, batch) == rollout_metrics(trajectories, version)
