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


def _assert_same_batch(got: TokenBatch, want: TokenBatch) -> None:
    fields = ("input_ids_T", "cu_seqlens_B1", "loss_mask_T", "logprobs_T", "versions_T", "advantages_T", "rewards_B")
    for name in fields:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert got.group_ids == want.group_ids and got.images_B == want.images_B
    assert sorted(got.extra) == sorted(want.extra)
    for key, value in want.extra.items():
        assert got.extra[key].dtype == value.dtype and torch.equal(got.extra[key], value), key


@pytest.mark.parametrize("seed", range(3))
def test_concat_of_packed_groups_equals_packing_all(seed):
    """Groups packed one by one as their episodes end (``WorkflowExecutor.rollout_packed``), then
    joined, give the batch ``from_trajectories`` makes of all trajectories at once: offsets, extras
    that only some groups carry (0 elsewhere; routes -1), images of some sequences only."""
    trajectories = _random_trajectories(seed)
    rng = random.Random(seed)
    for i, t in enumerate(trajectories):
        t.group_id = f"g{i // 5}"
        n = len(t.completion_ids)
        if i % 7 == 1:
            t.extra_T["teacher_executed_T"] = [float(rng.choice([0, 1])) for _ in range(n)]
        if i % 5 == 2:
            t.routes_TLK = torch.randint(0, 8, (t.num_tokens, 3, 2), dtype=torch.int16)
        if i == 11:
            t.info["images"] = {"grid_thw": [[1, 2, 2]]}
    groups = [trajectories[i : i + 5] for i in range(0, len(trajectories), 5)]
    want = TokenBatch.from_trajectories(trajectories)
    assert set(want.extra) == {"teacher_executed_T", "moe_routes_T"} and want.images_B
    _assert_same_batch(TokenBatch.concat([TokenBatch.from_trajectories(g) for g in groups]), want)
    plain = [t for t in trajectories if not t.extra_T and t.routes_TLK is None and "images" not in t.info]
    _assert_same_batch(
        TokenBatch.concat([TokenBatch.from_trajectories(plain[:3]), TokenBatch.from_trajectories(plain[3:])]),
        TokenBatch.from_trajectories(plain),
    )
    with pytest.raises(ValueError, match="zero trajectories"):
        TokenBatch.concat([])
