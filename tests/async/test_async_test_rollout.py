import hashlib
import threading
import time
from pathlib import Path

import pytest
import torch

from areno.engine.test_rollout import TestRolloutManager
from areno.train.checkpoint import COMPLETE_MARKER, complete_checkpoints
from areno.types import SamplingParams, Trajectory
from areno.workflows.base import RolloutWorkflow
from tests.helpers.async_fakes import await_threading_event

PAYLOAD = 64 * 1024


def write_checkpoint(root: Path, step: int, *, complete: bool, chunk_pause_s: float = 0.0) -> Path:
    """Like the trainer: weights written in chunks (a reader may see half a file), COMPLETE last."""
    path = root / f"step_{step:08d}"
    (path / "hf").mkdir(parents=True, exist_ok=True)
    data = bytes([step % 256]) * PAYLOAD
    with open(path / "hf" / "weights.bin", "wb") as f:
        for i in range(0, PAYLOAD, PAYLOAD // 4):
            f.write(data[i : i + PAYLOAD // 4])
            f.flush()
            time.sleep(chunk_pause_s)
    (path / "hf" / "sha").write_text(hashlib.sha256(data).hexdigest())
    if complete:
        (path / COMPLETE_MARKER).write_text("ok")
    return path


class FakeEvalEngine:
    """Records loads and checks each loaded checkpoint is whole (complete marker + full weights)."""

    def __init__(self):
        self.loaded: list[int] = []
        self.version = 0

    def update_weights_from_disk(self, path, version):
        data = (Path(path) / "weights.bin").read_bytes()
        assert (Path(path).parent / COMPLETE_MARKER).is_file(), f"loaded {path} before it was complete"
        assert hashlib.sha256(data).hexdigest() == (Path(path) / "sha").read_text(), f"half-written {path}"
        self.loaded.append(version)
        self.version = version

    async def agenerate(self, prompt_ids, sampling_params, *, request_id=None):
        raise AssertionError("the scoring workflow below does not generate")


class VersionScoreWorkflow(RolloutWorkflow):
    """Scores each sample by the engine's version (so metrics prove which checkpoint was evaluated);
    optionally waits on a gate to model a slow evaluation."""

    def __init__(self, engine, gate: threading.Event | None = None):
        self.engine = engine
        self.gate = gate

    async def run_episode(self, client, sample):
        if self.gate is not None:
            await await_threading_event(self.gate)
        return Trajectory(
            prompt_ids=[1], completion_ids=[], logprobs=[], versions=[], reward=float(self.engine.version + sample["x"])
        )


def manager(tmp_path, engine, gate=None, **kw):
    samples = [{"x": 0}, {"x": 1}]
    return TestRolloutManager(tmp_path, engine, engine, VersionScoreWorkflow(engine, gate), samples, **kw)


def test_only_completed_checkpoints_are_listed(tmp_path):
    write_checkpoint(tmp_path, 1, complete=True)
    write_checkpoint(tmp_path, 2, complete=False)
    write_checkpoint(tmp_path, 10, complete=True)
    (tmp_path / "step_00000011.tmp").mkdir()
    (tmp_path / "step_00000011.tmp" / COMPLETE_MARKER).write_text("ok")
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [1, 10]
    assert complete_checkpoints(tmp_path / "missing") == []


def test_poll_loads_newest_completed_and_tags_metrics(tmp_path):
    engine = FakeEvalEngine()
    tr = manager(tmp_path, engine)
    try:
        assert tr.poll_once() is None  # nothing saved yet
        write_checkpoint(tmp_path, 1, complete=True)
        write_checkpoint(tmp_path, 2, complete=False)  # half-written: never loaded
        m = tr.poll_once()
        assert engine.loaded == [1]
        assert m["eval/checkpoint_step"] == 1 and m["eval/reward_mean"] == pytest.approx(1.5)
        assert tr.poll_once() is None  # nothing new
        write_checkpoint(tmp_path, 3, complete=False)
        (tmp_path / "step_00000002" / COMPLETE_MARKER).write_text("ok")
        assert tr.poll_once()["eval/checkpoint_step"] == 2
        assert engine.loaded == [1, 2]
        assert [s for s, _ in tr.pop_results()] == [1, 2] and tr.pop_results() == []
    finally:
        tr.stop()


def test_background_daemon_never_loads_half_written_and_never_blocks(tmp_path):
    engine = FakeEvalEngine()
    gate = threading.Event()
    seen = []
    tr = manager(tmp_path, engine, gate, poll_interval_s=0.01, on_metrics=lambda s, m: seen.append(s))
    tr.start()
    try:
        for step in range(1, 6):  # the "trainer" saves slowly while the daemon scans every 10 ms
            write_checkpoint(tmp_path, step, complete=True, chunk_pause_s=0.01)
            # what the training loop calls: returns even mid-evaluation. Blocking would wait for the gate,
            # never opened in this loop, so it would never return: a thread's join says so whatever the load
            popper = threading.Thread(target=tr.pop_results, daemon=True)
            popper.start()
            popper.join(30)
            assert not popper.is_alive(), "pop_results blocked on the evaluation in progress"
        gate.set()
        deadline = time.monotonic() + 30
        while (not seen or seen[-1] != 5) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        gate.set()  # (a failed check) lets the evaluation in progress end, so that stop() returns
        tr.stop()
    assert engine.loaded[-1] == 5 and engine.loaded == sorted(set(engine.loaded))
    assert seen == engine.loaded  # every load evaluated, tagged with its step


def test_bad_checkpoint_is_skipped_once(tmp_path, caplog):
    engine = FakeEvalEngine()
    path = write_checkpoint(tmp_path, 4, complete=True)
    (path / "hf" / "weights.bin").unlink()
    tr = manager(tmp_path, engine)
    try:
        assert tr.poll_once() is None and tr.poll_once() is None
    finally:
        tr.stop()
    assert engine.loaded == [] and caplog.text.count("cannot load checkpoint") == 1


def test_hot_loads_real_engine_from_disk(tmp_path, tiny_model_dir, char_tokenizer):
    from areno.models.hf_io import init_model_dir, load_model, tiny_config
    from areno.rollout.client import InProcessRolloutClient
    from areno.rollout.engine import RolloutEngine, RolloutEngineConfig
    from areno.workflows.rlvr import RLVRWorkflow

    torch.set_num_threads(1)

    def build(model_dir):
        model, cfg = load_model(model_dir)
        return RolloutEngine(
            model,
            cfg,
            config=RolloutEngineConfig(num_blocks=64),
            eos_token_ids=[char_tokenizer.eos_token_id],
            tokenizer=char_tokenizer,
        )

    step_dir = tmp_path / "ckpt" / "step_00000007"
    init_model_dir(step_dir / "hf", tiny_config(len(char_tokenizer), hidden_size=64, layers=2), char_tokenizer, seed=7)
    (step_dir / COMPLETE_MARKER).write_text("ok")
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    prompts = ["1+2=", "3+4="]
    expected = [
        char_tokenizer.decode(o.output_ids, skip_special_tokens=True)
        for o in build(step_dir / "hf").generate([char_tokenizer.encode(p) for p in prompts], greedy)
    ]

    engine = build(tiny_model_dir)
    client = InProcessRolloutClient(engine)
    completions = []

    def reward(prompt, completion, answer, **fields):
        completions.append((prompt, completion))
        return 1.0

    workflow = RLVRWorkflow(char_tokenizer, reward, n_samples=1, sampling_params=greedy)
    tr = TestRolloutManager(tmp_path / "ckpt", engine, client, workflow, [{"prompt": p} for p in prompts])
    try:
        metrics = tr.poll_once()
    finally:
        tr.stop()
        client.close()
    assert engine.version == 7 and metrics["eval/checkpoint_step"] == 7
    assert sorted(completions) == sorted(zip(prompts, expected))  # evaluated with the loaded weights


def test_a_loaded_but_unfinished_evaluation_is_not_waited_for_as_done(tmp_path):
    """``wait_for`` counts a checkpoint only once its evaluation finished, not when it was loaded (the
    trainer's end-of-run wait would otherwise log nothing for an evaluation still running)."""
    engine, gate = FakeEvalEngine(), threading.Event()
    tr = manager(tmp_path, engine, gate, poll_interval_s=0.01)
    write_checkpoint(tmp_path, 3, complete=True)
    tr.start()
    try:
        deadline = time.monotonic() + 10
        while engine.loaded != [3] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.loaded == [3]  # loaded, its evaluation held at the gate
        assert not tr.wait_for(3, 0.1)
        gate.set()
        assert tr.wait_for(3, 10) and tr.evaluated_step == 3
    finally:
        gate.set()
        tr.stop()
