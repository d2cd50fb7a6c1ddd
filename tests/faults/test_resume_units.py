"""The pieces of whole-run resume, without a run: atomic checkpoint publication, the metrics cut,
the resume setting, the fault spec, the asynchronous data ledger and per-episode sampling seeds."""

import asyncio
import json
import threading

import pytest

from areno.api.config import ConfigError, load_config
from areno.api.trainer import Trainer, truncate_metrics
from areno.data.tasks import PromptStream
from areno.engine.ledger import SEQ_KEY, LedgerWorkflow, SampleLedger, SeedingClient, episode_seed
from areno.faults import parse_faults
from areno.train import checkpoint
from areno.types import GenerationOutput, SamplingParams, Trajectory
from areno.workflows.base import RolloutWorkflow
from tests.helpers.configs import run_to_end
from tests.helpers.resume import overrides, train_rows


def _write_ckpt(tmp_path, step: int) -> tuple:
    path = tmp_path / "checkpoints" / f"step_{step:08d}"
    tmp = checkpoint.staging_dir(path)
    (tmp / "policy").mkdir(parents=True)
    (tmp / "policy" / "shard").write_text(str(step))
    return path, tmp


def test_checkpoint_is_published_whole_and_stale_writes_are_removed(tmp_path):
    root = tmp_path / "checkpoints"
    path1, tmp1 = _write_ckpt(tmp_path, 1)
    assert not path1.exists() and tmp1.name == "step_00000001.tmp"
    checkpoint.commit(tmp1, path1)
    assert checkpoint.is_complete(path1) and not tmp1.exists()
    path2, tmp2 = _write_ckpt(tmp_path, 2)  # killed before commit: a staging directory only
    path3 = root / "step_00000003"  # renamed without a marker (the layout before COMPLETE-first)
    (path3 / "policy").mkdir(parents=True)
    assert checkpoint.latest_complete(root) == path1
    assert checkpoint.complete_checkpoints(root) == [(1, path1)]
    removed = checkpoint.remove_stale(root)
    assert removed == [tmp2, path3]
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001"]
    # a new write over a stale staging directory starts empty
    _, tmp2 = _write_ckpt(tmp_path, 2)
    (tmp2 / "junk").write_text("x")
    _, tmp2 = _write_ckpt(tmp_path, 2)
    assert not (tmp2 / "junk").exists()


def test_committed_staging_directory_is_moved_into_place(tmp_path):
    """Killed after the marker but before the rename: the checkpoint is whole, so it is kept."""
    root = tmp_path / "checkpoints"
    path, tmp = _write_ckpt(tmp_path, 4)
    (tmp / checkpoint.COMPLETE_MARKER).write_text("ok")
    assert checkpoint.remove_stale(root) == []
    assert checkpoint.latest_complete(root) == path and (path / "policy" / "shard").read_text() == "4"


def test_commit_replaces_an_older_checkpoint_of_the_same_step(tmp_path):
    path, tmp = _write_ckpt(tmp_path, 5)
    checkpoint.commit(tmp, path)
    _, tmp = _write_ckpt(tmp_path, 5)
    (tmp / "policy" / "shard").write_text("new")
    checkpoint.commit(tmp, path)
    assert (path / "policy" / "shard").read_text() == "new"
    assert sorted(p.name for p in path.parent.iterdir()) == ["step_00000005"]


def test_truncate_metrics_keeps_steps_up_to_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 0, "eval/accuracy": 0.1}, {"step": 1, "a": 1}, {"step": 2, "a": 2}, {"step": 3, "a": 3}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "a"')  # torn last line
    assert truncate_metrics(path, after_step=2) == 2  # step 3 and the torn line
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows[:3]
    assert truncate_metrics(path, after_step=2) == 0
    assert truncate_metrics(path, after_step=-1) == 3 and path.read_text() == ""
    assert truncate_metrics(tmp_path / "absent.jsonl", after_step=1) == 0


@pytest.mark.parametrize(("value", "expected"), [("auto", "auto"), ("true", True), ("false", False), ("True", True)])
def test_resume_setting(value, expected):
    assert load_config(None, ["model.path=m", f"resume={value}"]).resume == expected


def test_resume_setting_rejects_other_values():
    with pytest.raises(ConfigError, match=r"^resume: must be auto, true or false, got 'sometimes'$"):
        load_config(None, ["model.path=m", "resume=sometimes"])


def test_resume_true_without_a_checkpoint_is_one_line(tmp_path):
    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}", f"model.path={tmp_path / 'm'}", "resume=true"])
    with pytest.raises(ValueError, match="resume=true but .* holds no completed checkpoint .* use resume=auto") as info:
        Trainer.init(cfg)
    assert "\n" not in str(info.value)


def test_fault_spec():
    assert parse_faults("") == frozenset()
    assert parse_faults("kill:train:3, kill:checkpoint_write:10") == {("train", 3), ("checkpoint_write", 10)}
    for bad in ("kill:train", "stall:train:3", "kill:eval:3", "kill:train:x"):
        with pytest.raises(ValueError, match=f"ARENO_FAULT: '{bad}' must look like kill:<phase>:<step>"):
            parse_faults(bad)


def _rows(n):
    return [{"prompt": f"p{i}", "answer": str(i)} for i in range(n)]


def test_ledger_saves_untrained_samples_and_replays_them_first():
    ledger = SampleLedger(PromptStream(_rows(10), seed=1))
    handed = [next(ledger) for _ in range(5)]
    seqs = [ledger.lookup(s)[0] for s in handed]
    assert seqs == [0, 1, 2, 3, 4]
    ledger.trained([seqs[0], seqs[2]])
    ledger.release(handed[3])  # rejected by the workflow: done, as without a resume
    state = json.loads(json.dumps(ledger.state_dict()))  # plain data (it goes into trainer_state.pt)
    assert [p["row"]["prompt"] for p in state["pending"]] == [handed[1]["prompt"], handed[4]["prompt"]]
    assert state["trained_groups"] == 2 and {k: state["stream"][k] for k in ("epoch", "position", "rows")} == {
        "epoch": 0,
        "position": 5,
        "rows": 10,
    }

    uninterrupted = [next(ledger)["prompt"] for _ in range(3)]
    restored = SampleLedger(PromptStream(_rows(10), seed=1))
    restored.load_state_dict(state)
    replay = [next(restored) for _ in range(5)]
    # the untrained ones again, with their original stream keys (so their original seeds), then the stream
    assert [s["prompt"] for s in replay] == [handed[1]["prompt"], handed[4]["prompt"], *uninterrupted]
    assert restored.lookup(replay[0])[1] == ledger.lookup(handed[1])[1] == (0, 2)
    assert restored.num_pending == 5 and restored.trained_groups == 2


def test_ledger_forgets_a_released_sample_only():
    ledger = SampleLedger(PromptStream(_rows(3), seed=0))
    sample = next(ledger)
    ledger.release(dict(sample))  # an equal row that the ledger did not hand out: not this hand-out
    assert ledger.num_pending == 1
    ledger.release(sample)
    assert ledger.num_pending == 0 and ledger.state_dict()["pending"] == []


class _RecordingClient:
    def __init__(self):
        self.seeds = []

    async def agenerate(self, prompt_ids, sampling_params, *, request_id=None):
        await asyncio.sleep(0)
        self.seeds.append(sampling_params.seed)
        return GenerationOutput(
            request_id="r",
            prompt_ids=prompt_ids,
            output_ids=[1],
            output_logprobs=[0.0],
            output_versions=[0],
            finish_reason="stop",
        )


class _GroupOf3(RolloutWorkflow):
    """Three concurrent requests per episode; rejects the prompt named ``reject``."""

    def __init__(self, reject: str) -> None:
        self.reject = reject

    async def run_episode(self, client, sample):
        params = SamplingParams(temperature=1.0, max_new_tokens=1)
        outs = await asyncio.gather(*(client.agenerate([1], params) for _ in range(3)))
        if sample["prompt"] == self.reject:
            return None
        return [
            Trajectory(
                prompt_ids=[1],
                completion_ids=o.output_ids,
                logprobs=o.output_logprobs,
                versions=o.output_versions,
                reward=0.0,
            )
            for o in outs
        ]


def test_episodes_sample_with_seeds_from_their_place_in_the_data():
    ledger = SampleLedger(PromptStream(_rows(4), seed=0))
    samples = [next(ledger) for _ in range(2)]
    workflow = LedgerWorkflow(_GroupOf3(reject=samples[1]["prompt"]), ledger, seed=7)
    inner = _RecordingClient()

    async def arun():
        return await asyncio.gather(*(workflow.run_episode(SeedingClient(inner), s) for s in samples))

    kept, rejected = asyncio.run(arun())
    # three requests per episode, interleaved: seeds are episode_seed(key) + k, distinct
    expected = {episode_seed(7, key) + k for key in [(0, 1), (0, 2)] for k in range(3)}
    assert sorted(inner.seeds) == sorted(expected) and len(expected) == 6
    assert [t.info[SEQ_KEY] for t in kept] == [0, 0, 0]
    assert rejected is None and ledger.num_pending == 2  # the pool, not the workflow, releases it


def test_load_into_a_started_asynchronous_pool_is_refused_before_any_weight_is_read(tmp_path):
    from areno.engine.api import ArenoEngine

    engine = object.__new__(ArenoEngine)  # only what load() reads first: no model, no backend
    engine.ledger = SampleLedger(PromptStream(_rows(4), seed=0))
    engine.check_loadable()  # the pool has not started: loadable
    next(engine.ledger)
    with pytest.raises(
        RuntimeError,
        match=r"^load\(\): this asynchronous engine's rollout pool has started \(1 samples "
        r"handed out\); load a checkpoint into a new engine",
    ):
        engine.load(tmp_path / "absent")  # refused before the (absent) checkpoint is opened


def _run_within(cfg, timeout_s: float) -> None:
    """``Trainer.init(cfg).run()`` on a daemon thread: a run that waits forever fails the test, not the suite."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            run_to_end(cfg)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"the run did not end within {timeout_s} s"
    if errors:
        raise errors[0]


def test_an_async_run_resumes_with_a_smaller_batch_size(tmp_path):
    """walk11: a grpo_async run (eta 2, 2 groups a step) resumed with rollout.batch_size=1 admitted no
    prompt and waited forever: the staleness bound credited the 8 groups trained at the old size against
    (eta + version + 1) x the new one. It now credits the version's worth at the new size, so the pool
    starts with its usual room and the resumed run trains its steps."""
    run_dir = tmp_path / "run"
    args = overrides(tmp_path, run_dir, "rollout.max_head_offpolicyness=2", "train.algorithm=grpo_async", steps=4)
    _run_within(load_config(None, args), 60)
    resumed = [*args, "rollout.batch_size=1", "train.steps=6"]
    _run_within(load_config(None, resumed), 60)
    assert sorted(train_rows(run_dir)) == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize(
    "new_rows", [[f"{i}+{i}=" for i in range(8, 16)], ["1+1=", "2+2="]], ids=["rewritten", "shrunk"]
)
def test_a_data_file_changed_in_place_is_refused_at_resume(tmp_path, capsys, new_rows):
    """walk31: a data file rewritten under the same path resumed from the old cursor into other rows, or (fewer
    rows) failed with an IndexError traceback after the model loaded."""
    import json

    from areno.cli import main
    from tests.helpers.configs import train_args

    rows = tmp_path / "rows.jsonl"

    def write(prompts):
        rows.write_text("".join(json.dumps({"prompt": p, "answer": "0"}) + "\n" for p in prompts))

    write([f"{i}+{i}=" for i in range(8)])
    args = train_args(tmp_path, "data.task=null", f"data.train_path={rows}", "data.num_eval=0", "reward.sandbox=false")
    assert main([*args, "train.save_interval=1"]) == 0
    write(new_rows)
    assert main([*args, "train.steps=2", "resume=auto"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("areno: error: resume: the training rows are not the checkpoint's (8 rows then, ")


def test_an_episode_closed_in_another_context_is_no_failed_episode():
    """walk31: a second Ctrl-C stops the loop, whose pending episodes are closed in another context; the
    seeds' reset raised ValueError there, which the pool logged as a failed episode it was "retrying"."""
    import contextvars

    class Pending:
        def __await__(self):
            yield

    class Waits(RolloutWorkflow):
        async def run_episode(self, client, sample):
            await Pending()

    ledger = SampleLedger(PromptStream(_rows(4), seed=1))
    episode = LedgerWorkflow(Waits(), ledger, seed=0).run_episode(None, next(ledger))
    contextvars.copy_context().run(episode.send, None)  # started in one context, as the loop's task
    episode.close()  # closed from another


def test_the_newest_complete_checkpoint_reads_markers_from_the_newest_down(tmp_path, monkeypatch):
    """walk37: the test rollout asks for the newest checkpoint every few seconds and read every step's marker
    (106 ms at 2,000 checkpoints); the newest complete one is found from the top, with the same answer."""
    from areno.models import checkpoint_dirs

    root = tmp_path / "checkpoints"
    for step in range(1, 40):
        path, tmp = _write_ckpt(tmp_path, step)
        checkpoint.commit(tmp, path)
    newest_incomplete = root / "step_00000050"  # a newer directory without its marker
    (newest_incomplete / "policy").mkdir(parents=True)
    (root / "step_00000060").write_text("a file, not a checkpoint")
    (root / "notes").mkdir()
    read = []
    real = checkpoint_dirs.is_complete
    monkeypatch.setattr(checkpoint_dirs, "is_complete", lambda p: read.append(p.name) or real(p))
    assert checkpoint_dirs.newest_complete(root) == checkpoint.complete_checkpoints(root)[-1]
    assert read[:2] == ["step_00000050", "step_00000039"]
    read.clear()
    assert checkpoint.latest_complete(root) == root / "step_00000039" and len(read) == 2
    assert checkpoint_dirs.newest_complete(tmp_path / "nowhere") is None
