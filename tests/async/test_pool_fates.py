"""What becomes of each sample the everlasting pool takes (walk39a, walk39c): rows a workflow keeps
rejecting stop the run, the ledger lets go of the samples that end without a group, a stale-aborted
sample is generated again in the same run, and an idle worker holds no trained group."""

import asyncio
import gc
import itertools
import logging
import time
import weakref
from collections import Counter

import pytest

from areno.data.tasks import PromptStream
from areno.engine.executor import RolloutPoolBroken, SampleSource, WorkflowExecutor
from areno.engine.ledger import SEQ_KEY, LedgerWorkflow, SampleLedger
from areno.engine.staleness import StalenessManager
from areno.rollout.errors import RequestRejected
from areno.types import SamplingParams, Trajectory
from areno.workflows.base import RolloutWorkflow
from tests.helpers.async_fakes import FakeEngine, sync_weights


def length_from_prompt(prompt_ids, params):
    return [5] * prompt_ids[0]  # prompt [n] -> n tokens


class ByPrompt(RolloutWorkflow):
    """Rows {"prompt", "len", "fate"}: fate "reject" returns None, "refuse" raises the engine's refusal,
    "fail" raises, "slow_once" generates ``len`` tokens on its first attempt and 2 after; else ``len``."""

    def __init__(self):
        self.calls: Counter[str] = Counter()

    async def run_episode(self, client, sample):
        prompt, fate = sample["prompt"], sample.get("fate")
        self.calls[prompt] += 1
        if fate == "reject":
            return None
        if fate == "refuse":
            raise RequestRejected(f"prompt {prompt} is longer than the context")
        if fate == "fail":
            raise RuntimeError(f"env crashed on {prompt}")
        length = 2 if fate == "slow_once" and self.calls[prompt] > 1 else sample["len"]
        out = await client.agenerate([length], SamplingParams(max_new_tokens=100_000))
        return Trajectory(
            prompt_ids=[1],
            completion_ids=out.output_ids,
            logprobs=out.output_logprobs,
            versions=out.output_versions,
            reward=0.0,
            info={"prompt": prompt},
        )


def ledger_pool(rows, workflow, *, eta, batch_size, max_concurrent, engine=None, **kwargs):
    ledger = SampleLedger(PromptStream(rows, seed=0))
    staleness = StalenessManager(max_head_offpolicyness=eta, batch_size=batch_size, max_concurrent=max_concurrent)
    ex = WorkflowExecutor(
        engine or FakeEngine(length_from_prompt),
        LedgerWorkflow(workflow, ledger, seed=0),
        ledger,
        staleness,
        **kwargs,
    )
    return ex, ledger


def train_step(ex, ledger, batch_size):
    """What the engine's asynchronous step does with the pool and the ledger."""
    groups = ex.wait_batch(batch_size, timeout=30)
    ledger.trained([g[0].info.get(SEQ_KEY) for g in groups])
    return [g[0].info["prompt"] for g in groups]


def test_a_pool_whose_workflow_rejects_every_row_stops_naming_the_cause():
    """walk39c 1: a rejected row reset the count of samples without a group and the trainer waited without
    limit: 0 steps and 226,857 rows handed out in 60 s, no error. Now max_consecutive_dropped batches' worth of
    samples in a row without a group stop the pool, as one all-rejected batch stops a synchronous run."""
    wf = ByPrompt()
    rows = [{"prompt": f"p{i}", "len": 3, "fate": "reject"} for i in range(10)]
    staleness = StalenessManager(max_head_offpolicyness=1, batch_size=4, max_concurrent=4)
    t0 = time.monotonic()
    with WorkflowExecutor(
        FakeEngine(length_from_prompt), wf, itertools.cycle(rows), staleness, max_consecutive_dropped=2
    ) as ex:
        with pytest.raises(
            RolloutPoolBroken,
            match=r"^no group from the last 8 samples: 8 rejected by the workflow \(ByPrompt.run_episode returned "
            r"None\), 0 dropped: fix its filter or the data \(rollout.max_consecutive_dropped=2 batches of samples "
            r"in a row without a group stop the run\)$",
        ):
            ex.wait_batch(4, timeout=20)
    assert time.monotonic() - t0 < 15
    assert sum(wf.calls.values()) <= 8 + 4  # the bound, and the episodes already running at it


def test_the_rejected_streak_that_stops_the_pool_stays_pending_but_a_refused_row_goes():
    """walk46 P2: the samples of the streak without a group that stops the pool were let go one by one, so the
    resume after the fix skipped them. Now a rejected (or dropped) sample is let go once a group follows it; a
    row the engine refuses at once (its own fault: a resume would only be refused again)."""

    class Told(SampleSource):
        def __init__(self, rows):
            self._rows, self.released = iter(rows), []

        def __next__(self):
            return next(self._rows)

        def release(self, sample):
            self.released.append(sample["prompt"])

    fates = {"a": "reject", "b": "reject", "c": None, "d": "refuse", "e": "reject", "f": "reject", "g": "reject"}
    source = Told([{"prompt": p, "len": 3, "fate": fate} for p, fate in fates.items()] + [{"prompt": "h", "len": 3}])
    staleness = StalenessManager(max_head_offpolicyness=4, batch_size=2, max_concurrent=1)
    with WorkflowExecutor(
        FakeEngine(length_from_prompt), ByPrompt(), source, staleness, max_consecutive_dropped=2
    ) as ex:
        with pytest.raises(RolloutPoolBroken, match=r"^no group from the last 4 samples: 3 rejected"):
            ex.wait_batch(2, timeout=20)
    assert source.released == ["a", "b", "d"]  # a and b once c's group came; e, f and g stay for the resume
    source.released.clear()
    with WorkflowExecutor(FakeEngine(length_from_prompt), ByPrompt(), source, staleness, max_retries=0) as ex:
        with pytest.raises(RolloutPoolBroken, match=r"^no trajectories from a rollout batch of 3 samples"):
            ex.rollout_batch([{"prompt": p, "len": 3, "fate": fates[p]} for p in "dea"])
    assert source.released == ["d"]  # a synchronous batch that stops the run leaves the rest to its caller


def test_a_workflow_that_keeps_a_few_rows_is_not_stopped():
    wf = ByPrompt()
    # one row in five kept: at most 4 rejected in a row, under the bound of 2 batches of 4
    rows = [{"prompt": f"p{i}", "len": 3, **({} if i % 5 == 0 else {"fate": "reject"})} for i in range(20)]
    staleness = StalenessManager(max_head_offpolicyness=8, batch_size=4, max_concurrent=1)
    with WorkflowExecutor(
        FakeEngine(length_from_prompt), wf, itertools.cycle(rows), staleness, max_consecutive_dropped=2
    ) as ex:
        for _ in range(3):
            assert len(ex.wait_batch(4, timeout=20)) == 4
        assert ex.metrics()["rollout/rejected"] >= 40  # four rejected a kept one, mostly in a row


def test_the_ledger_lets_go_of_refused_rejected_and_dropped_samples():
    """walk39c 6: a refused row (a prompt past the context) was dropped by the pool at once but forgotten by
    the ledger only after max_retries + 1 failures: it stayed pending, once more every epoch, in every
    checkpoint, replayed by every resume. Now every sample that ends without a group is released."""
    rows = [{"prompt": f"p{i}", "len": 3} for i in range(7)]
    rows += [
        {"prompt": "refused", "len": 3, "fate": "refuse"},
        {"prompt": "rejected", "len": 3, "fate": "reject"},
        {"prompt": "failing", "len": 3, "fate": "fail"},
    ]
    ex, ledger = ledger_pool(rows, ByPrompt(), eta=1, batch_size=7, max_concurrent=2, max_retries=1)
    with ex:
        trained = []
        for step in range(3):  # three epochs of 7 good rows
            trained += train_step(ex, ledger, 7)
            sync_weights(ex, ex.client, step + 1)
        ex.pause()
        deadline = time.monotonic() + 20
        while ex.metrics()["rollout/running"] and time.monotonic() < deadline:
            time.sleep(0.005)
        pending = Counter(p["row"]["prompt"] for p in ledger.state_dict()["pending"])
        ready = ex.metrics()["rollout/ready"]
    assert Counter(trained) == Counter({f"p{i}": 3 for i in range(7)})
    # a row that ends without a group is pending at most once: drawn (or retried) and not yet over
    assert max(pending["refused"], pending["rejected"], pending["failing"]) <= 1, pending
    # the ready groups (the pool reads ahead into the next epoch), one sample drawn ahead, a retry of "failing"
    assert sum(pending.values()) <= ready + 2, pending


def test_a_stale_aborted_sample_is_generated_again_in_the_same_run(caplog):
    """walk39a 2: an episode aborted as stale (and a group dropped as stale) was never reported: its sample stayed
    pending for the rest of the run, in every checkpoint, and was trained only after a resume. Now it is re-queued
    at once; one that falls behind on every attempt is dropped after max_retries + 1 with a warning."""
    n = 40
    order = PromptStream([{}] * n, seed=0).take_indices(n)  # the places epoch 0 hands out first
    rows = [{"id": f"p{i}", "prompt": f"p{i}", "len": 2} for i in range(n)]
    rows[order[0]] = {"id": "slow_once", "prompt": "slow_once", "len": 5000, "fate": "slow_once"}
    rows[order[1]] = {"id": "slow", "prompt": "slow", "len": 5000}  # 10 s: longer than the test
    engine = FakeEngine(length_from_prompt, step_s=0.002)
    wf = ByPrompt()
    ex, ledger = ledger_pool(rows, wf, eta=1, batch_size=2, max_concurrent=4, engine=engine, max_retries=1)
    trained = []
    with caplog.at_level(logging.WARNING, logger="areno.engine.executor"), ex:
        for step in range(8):
            trained += train_step(ex, ledger, 2)
            sync_weights(ex, engine, step + 1)
        m = ex.metrics()
        pending = [p["row"]["prompt"] for p in ledger.state_dict()["pending"]]
    assert "slow_once" in trained  # aborted once, then trained
    assert "slow" not in trained and wf.calls["slow"] == 2 and "slow" not in pending  # released
    assert m["rollout/aborted_stale"] >= 3  # (a loaded machine may abort a short one too: re-queued alike)
    assert (
        "dropping dataset row id='slow': its episode fell more than rollout.max_head_offpolicyness=1 versions "
        "behind on all 2 attempts" in caplog.text
    )
    assert len(trained) == len(set(trained)) == 16  # none trained twice


def test_an_idle_worker_keeps_no_trained_group():
    """walk39a 3: a worker waiting for admission kept its last group (and the episode's Task) alive in its frame
    until it ran another episode: up to max_concurrent groups held for nothing."""
    staleness = StalenessManager(max_head_offpolicyness=0, batch_size=2, max_concurrent=2)
    rows = [{"prompt": f"p{i}", "len": 3} for i in range(2)]
    with WorkflowExecutor(FakeEngine(length_from_prompt), ByPrompt(), iter(rows), staleness) as ex:
        batch = ex.wait_batch(2, timeout=20)  # the dataset is exhausted: both workers wait, idle
        refs = [weakref.ref(traj) for group in batch for traj in group]
        del batch
        gc.collect()
        assert [ref() for ref in refs] == [None, None]


def test_a_finite_dataset_is_not_exhausted_while_its_stale_samples_wait_to_be_generated_again():
    """walk40 L1: the trainer dropped both last groups as stale and, in the same pass, found the pool drained
    (the loop had not queued them again yet): DatasetExhausted, and the regenerated groups never collected."""
    rows = [{"prompt": f"p{i}", "len": 3} for i in range(2)]
    staleness = StalenessManager(max_head_offpolicyness=1, batch_size=2, max_concurrent=4)
    wf, engine = ByPrompt(), FakeEngine(length_from_prompt)
    with WorkflowExecutor(engine, wf, iter(rows), staleness) as ex:
        ex.start()
        deadline = time.monotonic() + 30
        while (len(ex._results) < 2 or not ex._exhausted) and time.monotonic() < deadline:
            time.sleep(0.01)
        sync_weights(ex, engine, 3)  # both groups now more than η behind
        batch = ex.wait_batch(2, timeout=30)
        assert sorted(group[0].info["prompt"] for group in batch) == ["p0", "p1"]
        assert ex.stats.counts["dropped_stale"] == 2 and wf.calls == {"p0": 2, "p1": 2}


def test_a_synchronous_batch_rule_counts_no_streak_across_batches():
    """walk40 L2: the asynchronous "batches' worth without a group" rule counted in synchronous batches too, where
    rows finish in any order: at max_consecutive_dropped=1 the rejections closing one batch and opening the next
    stopped a run whose every batch had groups."""

    class Delayed(RolloutWorkflow):
        async def run_episode(self, client, sample):
            await asyncio.sleep(sample["delay"])
            if not sample["keep"]:
                return None
            return Trajectory(prompt_ids=[1], completion_ids=[2], logprobs=[0.0], versions=[0], reward=0.0)

    staleness = StalenessManager(max_head_offpolicyness=0, batch_size=4, max_concurrent=4)
    with WorkflowExecutor(None, Delayed(), None, staleness, max_consecutive_dropped=1) as ex:
        kept_first = [{"keep": True, "delay": 0.0}] + [{"keep": False, "delay": 0.05}] * 3
        rejected_first = [{"keep": False, "delay": 0.0}] + [{"keep": True, "delay": 0.05}] * 3
        assert len(ex.rollout_batch(kept_first)) == 1
        assert len(ex.rollout_batch(rejected_first)) == 3
