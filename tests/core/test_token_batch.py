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
