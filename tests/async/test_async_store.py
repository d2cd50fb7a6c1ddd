import multiprocessing as mp
import pickle

import pytest
import torch

from areno.engine.executor import WorkflowExecutor
from areno.engine.staleness import StalenessManager
from areno.rollout.store import DirectoryStore, InProcessStore, StoreKeyError, StoreRef, fetch_refs, release_refs
from areno.types import SamplingParams, Trajectory
from areno.workflows.base import RolloutWorkflow
from tests.helpers.async_fakes import FakeEngine

MB_FLOATS = 256 * 1024  # float32: 1 MiB


def observation(episode: int, step: int) -> torch.Tensor:
    return torch.full((MB_FLOATS,), float(episode * 100 + step))


class MultiStepEnvWorkflow(RolloutWorkflow):
    """Each step the environment shows a 1 MiB observation; the model acts; observations travel by key."""

    def __init__(self, store, num_steps):
        self.store = store
        self.num_steps = num_steps
        self.refs: dict[int, list[StoreRef]] = {}

    async def run_episode(self, client, sample):
        completion, logprobs, versions = [], [], []
        refs = self.refs[sample["id"]] = []
        for step in range(self.num_steps):
            refs.append(self.store.put(observation(sample["id"], step)))
            out = await client.agenerate([1, step], SamplingParams(max_new_tokens=4))
            completion += out.output_ids
            logprobs += out.output_logprobs
            versions += out.output_versions
        return Trajectory(
            prompt_ids=[1],
            completion_ids=completion,
            logprobs=logprobs,
            versions=versions,
            reward=1.0,
            info={"id": sample["id"], "observations": refs},
        )


def test_multi_step_env_queue_traffic_stays_small():
    store = InProcessStore()
    num_episodes, num_steps = 4, 5
    staleness = StalenessManager(max_head_offpolicyness=1, batch_size=num_episodes, max_concurrent=4)
    rows = iter({"id": i} for i in range(num_episodes))
    engine = FakeEngine(lambda p, s: [3, 4])
    with WorkflowExecutor(engine, MultiStepEnvWorkflow(store, num_steps), rows, staleness, store=store) as ex:
        groups = ex.wait_batch(num_episodes, timeout=30)
    queue_bytes = len(pickle.dumps(groups))
    observation_bytes = num_episodes * num_steps * MB_FLOATS * 4
    assert observation_bytes == 20 * 2**20
    assert queue_bytes < 16 * 1024, queue_bytes  # keys and metadata only: < 0.1% of the pixels
    assert len(store) == num_episodes * num_steps
    # The trainer fetches lazily when it builds the batch, then releases.
    for (traj,) in groups:
        obs = fetch_refs(traj.info["observations"], store)
        assert [o[0].item() for o in obs] == [traj.info["id"] * 100 + s for s in range(num_steps)]
        assert obs[0].shape == (MB_FLOATS,)
        assert release_refs(traj.info, store) == num_steps
    assert len(store) == 0
    with pytest.raises(StoreKeyError, match="not in the store"):
        store.get(groups[0][0].info["observations"][0].key)


def test_stale_groups_release_their_observations():
    import time

    store = InProcessStore()
    staleness = StalenessManager(max_head_offpolicyness=0, batch_size=1, max_concurrent=1)
    rows = iter({"id": i} for i in range(10))
    engine = FakeEngine(lambda p, s: [3])
    workflow = MultiStepEnvWorkflow(store, 2)
    with WorkflowExecutor(engine, workflow, rows, staleness, store=store) as ex:
        ex.start()
        while ex.metrics()["rollout/ready"] < 1:
            time.sleep(0.005)
        dropped_refs = list(workflow.refs[0])
        ex.pause()
        engine.pause()
        engine.update_weights(2)
        ex.set_version(2)  # two updates later: the finished group (version 0) is too stale for eta=0
        engine.resume()
        with pytest.raises(TimeoutError):  # collected while paused: the sample run next is certain
            ex.wait_batch(1, timeout=0.2)
        ex.resume()
        ((traj,),) = ex.wait_batch(1, timeout=30)
        m = ex.metrics()
    # the dropped sample is generated again, with observations of its own
    assert traj.info["id"] == 0 and m["rollout/dropped_stale"] == 1
    for ref in dropped_refs:  # the dropped group's observations are gone, the kept group's remain
        with pytest.raises(StoreKeyError):
            store.get(ref.key)
    assert all(store.get(ref.key).shape == (MB_FLOATS,) for ref in traj.info["observations"])


def _producer(store, queue, n):
    for i in range(n):
        queue.put(store.put(torch.full((MB_FLOATS,), float(i))))
    queue.put(None)


def test_directory_store_shared_across_processes(tmp_path):
    store = DirectoryStore(tmp_path / "obs")
    ctx = mp.get_context("fork")  # fork: the child needs no re-import
    queue = ctx.Queue()
    proc = ctx.Process(target=_producer, args=(store, queue, 3))
    proc.start()
    refs = []
    while (ref := queue.get(timeout=60)) is not None:
        refs.append(ref)
    proc.join(timeout=60)
    assert proc.exitcode == 0
    assert all(isinstance(r, StoreRef) and len(pickle.dumps(r)) < 300 for r in refs)
    assert [store.get(r.key)[0].item() for r in refs] == [0.0, 1.0, 2.0]
    assert refs[0].nbytes == 2**20 and refs[0].dtype == "float32"
    assert not list((tmp_path / "obs").glob("*.tmp*"))  # writes are atomic renames
    release_refs(refs, store)
    assert len(store) == 0
