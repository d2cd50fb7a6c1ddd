"""MetricsLogger and its sinks: every sink receives the same validated metrics."""

from __future__ import annotations

import io
import sys
import threading
import types

import pytest

from areno.errors import DataError
from areno.observe.metrics import (
    WANDB_ID_FILENAME,
    ConsoleSink,
    JsonlSink,
    MetricSink,
    MetricsLogger,
    MissingDependencyError,
    WandbConfig,
    WandbSink,
    read_metrics,
)
from tests.helpers.tensorboard import read_tensorboard

STEPS = [
    {
        "rollout/reward_mean": 0.25,
        "rollout/completion_len_mean": 12.5,
        "train/loss": 1.5,
        "timing/tokens_per_s": 1200.0,
        "rollout/staleness_mean": 0.5,
        "policy_sync_bytes": 4096,
        "policy_sync_throughput_gbps": 1.25,
    },
    {
        "rollout/reward_mean": 0.5,
        "rollout/completion_len_mean": 9.0,
        "train/loss": 1.25,
        "timing/tokens_per_s": 1300.0,
        "rollout/staleness_mean": 1.0,
        "policy_sync_bytes": 4096,
        "policy_sync_throughput_gbps": 2.5,
    },
]


class RecordingSink(MetricSink):
    def __init__(self) -> None:
        self.records: list[tuple[int, dict]] = []
        self.closed = False

    def write(self, metrics, step):
        self.records.append((step, dict(metrics)))

    def close(self):
        self.closed = True


class FakeWandbRun:
    def __init__(self, **kwargs):
        self.init_kwargs = kwargs
        self.logged: list[dict] = []
        self.defined: list[tuple] = []
        self.finished = False

    def define_metric(self, name, **kwargs):
        self.defined.append((name, kwargs))

    def log(self, data):
        self.logged.append(dict(data))

    def finish(self):
        self.finished = True


def fake_wandb_module() -> types.ModuleType:
    module = types.ModuleType("wandb")
    module.runs = []

    def init(**kwargs):
        run = FakeWandbRun(**kwargs)
        module.runs.append(run)
        return run

    module.init = init
    return module


def test_every_sink_receives_the_same_metrics(tmp_path, monkeypatch, capsys):
    wandb = fake_wandb_module()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    recorder = RecordingSink()
    with MetricsLogger(
        tmp_path,
        total_steps=2,
        console=True,
        tensorboard=True,
        wandb=WandbConfig(project="p", mode="offline"),
        extra_sinks=[recorder],
    ) as logger:
        for step, metrics in enumerate(STEPS, start=1):
            logger.log(metrics, step=step)
    assert recorder.closed

    expected = [(step, metrics) for step, metrics in enumerate(STEPS, start=1)]
    assert recorder.records == expected

    records = read_metrics(tmp_path)
    assert [(r.pop("step"), r) for r in records if r.pop("time") > 0] == expected
    assert isinstance(records[0]["policy_sync_bytes"], int)

    scalars = read_tensorboard(tmp_path / "tensorboard")
    for key in STEPS[0]:
        assert scalars[key] == [(s, pytest.approx(m[key])) for s, m in expected]

    (run,) = wandb.runs
    assert run.init_kwargs["mode"] == "offline" and run.init_kwargs["name"] == tmp_path.name
    assert ("*", {"step_metric": "step"}) in run.defined
    assert run.logged == [{**m, "step": s} for s, m in expected]
    assert run.finished

    err = capsys.readouterr().err  # not a TTY under pytest: plain lines
    lines = [line for line in err.splitlines() if line.startswith("step ")]
    assert lines[0] == "step 1/2 | reward 0.25 | len 12.5 | tok/s 1200 | stale 0.5"  # no step timed yet: no eta
    assert lines[1] == "step 2/2 | reward 0.5 | len 9 | tok/s 1300 | stale 1 | eta 00:00"


def test_a_resumed_run_hides_the_tensorboard_steps_it_trains_again(tmp_path):
    """Killed after step 4 with a checkpoint at step 2: the resumed run logs steps 3 and 4 again, and
    TensorBoard shows each step once, with the resumed run's values (as metrics.jsonl is cut back)."""
    with MetricsLogger(tmp_path, total_steps=4, console=False, tensorboard=True, purge_step=0) as logger:
        for step in range(1, 5):
            logger.log({"rollout/reward_mean": float(step)}, step=step)
    with MetricsLogger(tmp_path, total_steps=4, console=False, tensorboard=True, purge_step=3) as logger:
        for step in (3, 4):
            logger.log({"rollout/reward_mean": 10.0 * step}, step=step)
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2
    rewards = read_tensorboard(tmp_path / "tensorboard")["rollout/reward_mean"]
    assert rewards == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]


def test_values_are_converted_and_validated(tmp_path):
    import numpy as np
    import torch

    sink = RecordingSink()
    logger = MetricsLogger(tmp_path, total_steps=None, console=False, extra_sinks=[sink])
    logger.log({"train/loss": torch.tensor(0.5), "train/n": np.int64(3), "eval/ok": True}, step=0)
    assert sink.records == [(0, {"train/loss": 0.5, "train/n": 3, "eval/ok": 1})]
    assert type(sink.records[0][1]["train/n"]) is int
    with pytest.raises(ValueError, match="no namespace"):
        logger.log({"loss": 1.0}, step=1)
    with pytest.raises(ValueError, match="must be a real number"):
        logger.log({"train/loss": "high"}, step=1)
    with pytest.raises(ValueError, match="step must be"):
        logger.log({"train/loss": 1.0}, step=-1)
    logger.log({"train/loss": float("nan"), "policy_sync_time_s": 0.1}, step=1)
    logger.close()
    assert read_metrics(tmp_path)[-1]["train/loss"] is None  # strict JSON
    with pytest.raises(RuntimeError, match="after close"):
        logger.log({"train/loss": 1.0}, step=2)


def test_the_observe_wandb_keys_reach_the_wandb_run_with_the_resolved_config(tmp_path, monkeypatch):
    from areno.api.config import load_config
    from areno.api.trainer import wandb_config

    wandb = fake_wandb_module()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setenv("WANDB_MODE", "online")  # the fake client has no network to miss
    keys = ["model.path=/m", "observe.wandb_project=p", "optim.lr=3e-5"]
    cfg = load_config(None, [*keys, "observe.wandb_entity=team", "observe.wandb_name=n", "observe.wandb_tags=[a,b]"])
    MetricsLogger(tmp_path, total_steps=1, console=False, wandb=wandb_config(cfg, tmp_path, resumed=False)).close()
    (run,) = wandb.runs
    got = run.init_kwargs
    assert (got["project"], got["entity"], got["name"], got["tags"]) == ("p", "team", "n", ["a", "b"])
    assert got["mode"] == "online"  # WANDB_MODE where observe.wandb_mode is null
    assert got["config"]["optim"]["lr"] == 3e-5 and got["config"]["observe"]["wandb_tags"] == ["a", "b"]
    assert (
        wandb_config(load_config(None, [*keys, "observe.wandb_mode=offline"]), tmp_path, resumed=False).mode
        == "offline"
    )
    monkeypatch.delenv("WANDB_MODE")
    assert wandb_config(load_config(None, keys), tmp_path, resumed=False).mode == "offline"
    assert wandb_config(load_config(None, ["model.path=/m"]), tmp_path, resumed=False) is None


def test_a_resumed_run_logs_to_the_same_wandb_run(tmp_path, monkeypatch):
    """walk22: every resume was a new W&B run (no id passed), the first keeping the steps trained again."""
    from areno.api.config import load_config
    from areno.api.trainer import wandb_config

    wandb = fake_wandb_module()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    config = load_config(None, ["model.path=/m", "observe.wandb_project=p"])
    for resumed in (False, True, False):  # the last one started over: a new W&B run
        WandbSink(tmp_path, wandb_config(config, tmp_path, resumed=resumed)).close()
    first, again, fresh = (run.init_kwargs for run in wandb.runs)
    assert (tmp_path / WANDB_ID_FILENAME).read_text().strip() == fresh["id"]
    assert first["resume"] == "allow" and again["id"] == first["id"] and fresh["id"] != first["id"]


def test_missing_wandb_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(MissingDependencyError, match=r"pip install 'areno\[wandb\]'"):
        MetricsLogger(tmp_path, total_steps=1, console=False, wandb=WandbConfig())
    # the JSONL sink opened before the failure was closed again; disabled mode never imports wandb
    MetricsLogger(tmp_path, total_steps=1, console=False, wandb=WandbConfig(mode="disabled")).close()
    with pytest.raises(ValueError, match="wandb.mode"):
        WandbConfig(mode="cloud")


def test_logging_from_threads_keeps_every_record(tmp_path):
    logger = MetricsLogger(tmp_path, total_steps=None, console=False)

    def train_loop():
        for step in range(200):
            logger.log({"train/loss": step * 0.5, "rollout/reward_mean": 0.1}, step=step)

    def eval_loop():
        for step in range(0, 200, 2):
            logger.log({"eval/accuracy": step / 200}, step=step)

    threads = [threading.Thread(target=train_loop), threading.Thread(target=eval_loop)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    logger.close()
    records = read_metrics(tmp_path)
    assert len(records) == 300
    assert sorted(r["step"] for r in records if "train/loss" in r) == list(range(200))
    assert sorted(r["step"] for r in records if "eval/accuracy" in r) == list(range(0, 200, 2))


def test_console_derives_tokens_per_s_and_prints_eval_lines():
    stream = io.StringIO()
    sink = ConsoleSink(total_steps=None, stream=stream)
    assert not sink.use_tqdm
    sink.write({"rollout/num_tokens": 1000, "rollout/reward_mean": 1.0}, step=1)
    sink.write({"eval/accuracy": 0.75}, step=1)
    sink.close()
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("step 1 | reward 1 | tok/s ")
    assert float(lines[0].split("tok/s ")[1].split()[0]) > 0
    assert lines[1] == "eval @ step 1: eval/accuracy=0.75"
    assert len(lines) == 2


def test_console_eval_line_leaves_the_detail_to_the_metrics_file():
    stream = io.StringIO()
    sink = ConsoleSink(total_steps=None, stream=stream)
    detail = {"eval/completion_tokens_mean": 4.0, "eval/truncated_fraction": 0.5, "eval/num_prompts": 6}
    sink.write({"eval/accuracy": 0.5, "eval/samples_per_prompt": 1, "eval/pass@1": 0.5, "eval/reward_errors": 0,
                **detail}, step=2)  # fmt: skip
    sink.write({"eval/accuracy": 0.5, "eval/samples_per_prompt": 4, "eval/pass@1": 0.5, "eval/pass@4": 0.75,
                "eval/reward_errors": 2, **detail}, step=3)  # fmt: skip
    sink.write({"test/accuracy": 0.5, "test/pass@1": 0.5, "test/reward_errors": 0}, step=4)
    sink.close()
    assert [line for line in stream.getvalue().splitlines() if line.startswith("eval @")] == [
        "eval @ step 2: eval/accuracy=0.5 eval/num_prompts=6",
        "eval @ step 3: eval/accuracy=0.5 eval/num_prompts=6 eval/pass@1=0.5 eval/pass@4=0.75 eval/reward_errors=2",
        "eval @ step 4: test/accuracy=0.5",
    ]


def test_console_tqdm_bar_shows_progress_and_postfix():
    stream = io.StringIO()
    sink = ConsoleSink(total_steps=4, stream=stream, use_tqdm=True)
    sink.write({"rollout/reward_mean": 0.5, "timing/tokens_per_s": 2000.0, "rollout/staleness_mean": 0.25}, step=1)
    sink.write({"rollout/reward_mean": 0.75, "rollout/completion_len_mean": 7.0}, step=2)
    sink.close()
    out = stream.getvalue()
    assert "2/4" in out and "reward=0.75" in out and "tok/s=2000" in out and "stale=0.25" in out
    assert "train: " in out and "len=7" in out and "eta=00:0" in out  # the sink's ETA, not tqdm's own
    stream = io.StringIO()
    sink = ConsoleSink(total_steps=4, stream=stream, use_tqdm=True, stage="warm start")
    sink.write({"train/policy/loss": 2.5}, step=1)
    sink.close()
    assert "warm start: " in stream.getvalue() and "1/4" in stream.getvalue() and "loss=2.5" in stream.getvalue()


class FakeClock:
    """``time.monotonic`` of the metrics module, moved by hand."""

    def __init__(self, monkeypatch) -> None:
        self.now = 1000.0
        monkeypatch.setattr("areno.observe.metrics.time.monotonic", lambda: self.now)


def test_console_shows_the_loss_and_the_stage():
    stream = io.StringIO()
    sink = ConsoleSink(total_steps=80, stream=stream, stage="warm start")
    sft = {"rollout/num_tokens": 1030.0, "train/policy/loss": 4.579, "train/policy/grad_norm": 8.2}
    sink.write({**sft, "timing/tokens_per_s": 642.0}, step=1)
    sink.close()
    assert stream.getvalue().splitlines() == ["warm start step 1/80 | loss 4.58 | tok/s 642"]

    stream = io.StringIO()
    sink = ConsoleSink(total_steps=None, stream=stream)
    # an RL step shows its rollout's reward and length (its policy-gradient loss reads ~0); a recipe
    # without a policy shows its role's loss, a backend's own train/loss counts too
    rl = {"rollout/reward_mean": 0.484, "rollout/completion_len_mean": 5.25, "train/policy/loss": -4.66e-10}
    sink.write({**rl, "train/value/loss": 2.0}, step=1)
    sink.write({"train/reward/loss": 0.693, "train/reward/accuracy": 0.5}, step=2)
    sink.write({"train/loss": 1.5e-7}, step=3)
    sink.close()
    assert stream.getvalue().splitlines() == [
        "step 1 | reward 0.484 | len 5.25",
        "step 2 | loss 0.693",
        "step 3 | loss 1.5e-07",
    ]


def test_metrics_logger_labels_the_console_with_its_stage(tmp_path, capsys):
    with MetricsLogger(tmp_path, total_steps=3, stage="warm start") as logger:
        logger.log({"train/policy/loss": 2.5}, step=1)
    assert capsys.readouterr().err.splitlines() == ["warm start step 1/3 | loss 2.5"]


def test_console_eta_counts_from_the_first_step_not_the_start_up(monkeypatch):
    clock = FakeClock(monkeypatch)
    stream = io.StringIO()
    sink = ConsoleSink(total_steps=10, stream=stream)
    for step, at in [(1, 100.0), (2, 102.0), (3, 106.0)]:  # 100 s of start-up, then steps of 2 and 4 s
        clock.now = 1000.0 + at
        sink.write({"train/policy/loss": 1.0}, step=step)
    clock.now += 50.0  # an evaluation at the step already printed is not a step: the ETA is not asked
    sink.write({"eval/accuracy": 0.5}, step=3)
    sink.close()
    lines = stream.getvalue().splitlines()
    assert lines[0] == "step 1/10 | loss 1"
    assert lines[1] == "step 2/10 | loss 1 | eta 00:16"  # 2 s x 8 steps left (start-up included: 6:48)
    assert lines[2] == "step 3/10 | loss 1 | eta 00:21"  # mean of 2 and 4 s x 7 left
    assert sink.eta_s(10, clock.now) == 0.0 and sink.eta_s(11, clock.now) is None


def test_console_eta_of_a_resumed_run_counts_its_own_steps(monkeypatch):
    clock = FakeClock(monkeypatch)
    for start_step in (0, 50):  # the trainer's logger starts at the checkpoint's step
        sink = ConsoleSink(total_steps=100, stream=io.StringIO(), start_step=start_step)
        assert sink.eta_s(51, clock.now) is None
        clock.now += 30.0  # start-up
        sink.write({"train/policy/loss": 1.0}, step=51)
        clock.now += 1.0
        assert sink.eta_s(52, clock.now) == pytest.approx(48.0)  # 1 s a step, not (31 s / 52 steps)


def test_the_bar_of_a_resumed_run_starts_at_its_checkpoint():
    stream = io.StringIO()
    sink = ConsoleSink(total_steps=100, stream=stream, use_tqdm=True, start_step=50)
    sink.write({"train/policy/loss": 1.0}, step=51)
    sink.close()
    assert "51/100" in stream.getvalue() and "1/100" not in stream.getvalue().replace("51/100", "")


def test_read_metrics_skips_a_torn_last_line(tmp_path):
    sink = JsonlSink(tmp_path)
    sink.write({"train/loss": 1.0}, step=1)
    sink.close()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 2, "train/lo')
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]
    with pytest.raises(DataError, match="run directory"):
        read_metrics(tmp_path / "nope")


def test_wandb_offline_run_without_network(tmp_path, monkeypatch):
    """The real W&B client in offline mode (runs only where wandb is installed)."""
    pytest.importorskip("wandb", reason="wandb is optional: pip install 'areno[wandb]'")
    monkeypatch.setenv("WANDB_SILENT", "true")
    with MetricsLogger(
        tmp_path, total_steps=2, console=False, wandb=WandbConfig(project="areno-test", mode="offline")
    ) as logger:
        for step, metrics in enumerate(STEPS, start=1):
            logger.log(metrics, step=step)
    assert list((tmp_path / "wandb").glob("offline-run-*"))
