"""The pool against the real RolloutEngine + InProcessRolloutClient on a tiny random model."""

import time

import pytest
import torch

from areno.engine.executor import WorkflowExecutor
from areno.engine.staleness import StalenessManager
from areno.types import SamplingParams, TokenBatch
from areno.workflows.rlvr import RLVRWorkflow


@pytest.fixture()
def engine_and_client(tiny_model_dir, char_tokenizer):
    from areno.models.hf_io import load_model
    from areno.rollout.client import InProcessRolloutClient
    from areno.rollout.engine import RolloutEngine, RolloutEngineConfig

    torch.set_num_threads(1)
    model, cfg = load_model(tiny_model_dir)
    engine = RolloutEngine(
        model,
        cfg,
        # one token per round trip: a request spends 23 steps mid-generation where a sync can land (at the
        # default 8 it spends two, and a loaded machine can miss both)
        config=RolloutEngineConfig(num_blocks=256, decode_steps=1),
        eos_token_ids=[char_tokenizer.eos_token_id],
        tokenizer=char_tokenizer,
    )
    client = InProcessRolloutClient(engine)
    yield engine, client
    client.close()


def perturbed(engine, scale):
    return [(name, p.detach() + scale) for name, p in engine.model.named_parameters() if name.endswith("norm.weight")]


def sync_weights(executor, engine, client, version):
    executor.pause()
    engine.pause()
    engine.update_weights(perturbed(engine, 0.01), version)
    executor.set_version(version)
    engine.resume()
    client.wake()
    executor.resume()


def reward_len(prompt, completion, answer, **fields):
    return float(len(completion) % 2)


def test_pool_with_real_engine_records_versions_and_keeps_in_flight_work(engine_and_client, char_tokenizer):
    engine, client = engine_and_client
    params = SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True, seed=3)
    workflow = RLVRWorkflow(char_tokenizer, reward_len, n_samples=2, sampling_params=params)
    rows = iter([{"id": i, "prompt": f"{i}+{i}=", "answer": 2 * i} for i in range(100)])
    staleness = StalenessManager(max_head_offpolicyness=1, batch_size=2, max_concurrent=4)
    all_trajs = []
    with WorkflowExecutor(client, workflow, rows, staleness) as ex:
        ex.start()
        for step in range(3):
            # a loaded machine can finish every request between two polls: sync only once one is
            # mid-generation (the executor keeps up to 4 in flight)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not any(
                0 < len(s.output_ids) < 24 for s in list(engine.scheduler.running)
            ):
                time.sleep(0.0005)
            sync_weights(ex, engine, client, step + 1)  # lands while requests are in flight
            batch = ex.wait_batch(2, timeout=60)
            assert len(batch) == 2 and all(len(g) == 2 and g[0].group_id == g[1].group_id for g in batch)
            all_trajs += [t for g in batch for t in g]
        metrics = ex.metrics()
    for traj in all_trajs:
        assert len(traj.completion_ids) == 24 and len(traj.versions) == 24  # nothing thrown away
        assert traj.versions == sorted(traj.versions)
    # At least one request was interrupted by a weight update and continued under the new policy.
    assert any(len(set(t.versions)) > 1 for t in all_trajs)
    assert metrics["rollout/staleness_max"] <= 1
    batch = TokenBatch.from_trajectories(all_trajs)
    # Per-token versions survive packing: the trained tokens carry exactly the engine's versions.
    assert batch.versions_T[batch.loss_mask_T].tolist() == [v for t in all_trajs for v in t.versions]


def test_rollout_batch_with_real_engine(engine_and_client, char_tokenizer):
    engine, client = engine_and_client
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=0)
    workflow = RLVRWorkflow(char_tokenizer, reward_len, n_samples=3, sampling_params=params)
    with WorkflowExecutor(client, workflow) as ex:
        trajs = ex.rollout_batch([{"prompt": f"{i}*2="} for i in range(4)])
    assert len(trajs) == 12 and len({t.group_id for t in trajs}) == 4
    assert all(set(t.versions) == {0} and len(t.logprobs) == len(t.completion_ids) for t in trajs)
    assert all(lp <= 0 for t in trajs for lp in t.logprobs)


def test_rollout_packed_equals_packing_its_trajectories(engine_and_client, char_tokenizer):
    """The groups packed as their episodes end, joined, are the batch of the returned trajectories;
    a rejected sample contributes neither."""
    engine, client = engine_and_client
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=0)

    class SkipSecond(RLVRWorkflow):
        async def run_episode(self, client, sample):
            return None if sample["prompt"] == "1*2=" else await super().run_episode(client, sample)

    workflow = SkipSecond(char_tokenizer, reward_len, n_samples=3, sampling_params=params)
    with WorkflowExecutor(client, workflow) as ex:
        trajs, batch = ex.rollout_packed([{"prompt": f"{i}*2="} for i in range(4)])
    assert len(trajs) == 9 and batch.num_seqs == 9
    want = TokenBatch.from_trajectories(trajs)
    for name in ("input_ids_T", "cu_seqlens_B1", "loss_mask_T", "logprobs_T", "versions_T", "rewards_B"):
        assert torch.equal(getattr(batch, name), getattr(want, name)), name
    assert batch.group_ids == want.group_ids
