"""The run report renders every known panel from metrics.jsonl files, overlays several runs."""

from __future__ import annotations

import base64
import math
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace

import pytest

from areno.errors import DataError, UserError
from areno.observe import metrics as metrics_module
from areno.observe import report
from areno.observe.metrics import MetricsLogger
from areno.observe.session import SessionRecorder
from areno.observe.trace import configure_tracing, merge_traces, span

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(run_dir: Path, *, steps: int, reward_slope: float, with_extras: bool) -> None:
    with MetricsLogger(run_dir, total_steps=steps, console=False) as logger:
        for step in range(1, steps + 1):
            metrics = {
                "rollout/reward_mean": min(1.0, 0.1 + reward_slope * step),
                "rollout/staleness_mean": 0.5 * (step % 3),
                "rollout/num_tokens": 4000.0,
                "train/policy/loss": 2.0 / step,
                "train/policy/loss_denominator": 100.0,
                "train/policy/grad_norm": 1.0 / step,
                "train/policy/approx_kl": 0.01 * math.sin(step) ** 2,
                "train/policy/kl_coef": 0.1,
                "train/policy/clip_frac": 0.05,
                "timing/rollout_s": 1.0,
                "timing/train_s": 0.5,
                "timing/sync_s": 0.1,
                "timing/tokens_per_s": 4000 / 1.6,
                "policy_sync_time_s": 0.1,
                "policy_sync_transfer_time_s": 0.08,
                "policy_sync_bytes": 2**30,
                "policy_sync_tensors": 290,
                "policy_sync_throughput_gbps": 10.7,
                # not rewards: counts and times of the reward sandbox (walk18 found them on the reward axis)
                "rollout/reward_calls": 64.0 * step,
                "rollout/reward_nonfinite": 0.0,
                "rollout/reward_call_time_mean_s": 0.01,
            }
            if with_extras:
                metrics["rollout/worker_busy_frac"] = 0.9
            logger.log(metrics, step=step)
            if step % 5 == 0:
                held_out = {"eval/accuracy": step / (2 * steps), "eval/pass@4": 0.6, "eval/time_s": 3.0}
                # not fractions: a token count beside the accuracy would flatten it (walk18)
                held_out |= {"eval/completion_tokens_mean": 5.0, "eval/samples_per_prompt": 4.0}
                logger.log(held_out, step=step)


class ImageCollector(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.images: list[tuple[str, bytes]] = []
        self.headings: list[str] = []
        self._in_h2 = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "img":
            prefix = "data:image/png;base64,"
            assert attrs["src"].startswith(prefix)
            self.images.append((attrs["alt"], base64.b64decode(attrs["src"][len(prefix) :])))
        self._in_h2 = tag == "h2"

    def handle_data(self, data):
        if self._in_h2:
            self.headings.append(data)
            self._in_h2 = False


@pytest.fixture
def two_runs(tmp_path):
    a, b = tmp_path / "runs" / "grpo", tmp_path / "runs" / "ppo"
    write_run(a, steps=20, reward_slope=0.04, with_extras=True)
    write_run(b, steps=15, reward_slope=0.02, with_extras=False)
    recorder = SessionRecorder(a)
    with recorder.session(sample_id=3) as s:
        s.turn("user", "2+3=<b>?</b>")
        with s.tool_call("calculator", {"expr": "2+3"}) as call:
            call.result = 5
        s.set_reward(1.0)
    recorder.close()
    configure_tracing(b, True)
    with span("train_step", "train"):
        pass
    merge_traces(b)
    configure_tracing(None, False)
    return a, b


def test_report_renders_all_panels_for_two_runs(two_runs, tmp_path):
    a, b = two_runs
    out = tmp_path / "cmp.html"
    assert report.main([str(a), str(b), "-o", str(out), "--png-dir", str(tmp_path / "png")]) == 0
    text = out.read_text()
    parser = ImageCollector()
    parser.feed(text)
    alts = [alt for alt, _ in parser.images]
    assert alts == [p.title for p in report.PANELS] + ["other metrics"]
    for _, png in parser.images:
        assert png.startswith(PNG_MAGIC) and len(png) > 5000
    assert "Agent sessions" in parser.headings and "Performance traces" in parser.headings
    assert "&lt;b&gt;?&lt;/b&gt;" in text  # session text is escaped
    assert "tool calculator" in text
    assert str(b / "trace.json") in text
    assert "<td>train</td><td>train_step</td><td>1</td>" in text  # span table of run b
    # summary row per run: 20 and 15 steps, best eval accuracy 0.5
    rows = re.findall(r"<tr><td>(grpo|ppo)</td><td>(\d+)</td>", text)
    assert rows == [("grpo", "20"), ("ppo", "15")]
    pngs = sorted(p.name for p in (tmp_path / "png").iterdir())
    assert "reward.png" in pngs and "policy-sync_bandwidth.png" in pngs and len(pngs) == 12


def test_panels_select_the_right_metrics(two_runs):
    a, _ = two_runs
    run = report.load_run(a)
    chosen = {p.title: p.select(run.keys()) for p in report.PANELS}
    assert chosen["Reward"] == ["rollout/reward_mean"]
    assert chosen["Held-out accuracy"] == ["eval/accuracy", "eval/pass@4"]
    assert chosen["KL"] == ["train/policy/approx_kl"]
    assert chosen["Loss"] == ["train/policy/loss"]
    assert chosen["Clip and mask fractions"] == ["train/policy/clip_frac"]
    assert chosen["Time split per step"] == ["timing/rollout_s", "timing/sync_s", "timing/train_s"]
    assert chosen["Policy-sync time"] == ["policy_sync_time_s", "policy_sync_transfer_time_s"]
    steps, values = run.series("eval/accuracy")
    assert steps == [5, 10, 15, 20] and values == [0.125, 0.25, 0.375, 0.5]
    summary = report.summarize(run)
    assert summary["steps"] == 20 and summary["best eval/accuracy"] == 0.5
    assert summary["first reward"] == pytest.approx(0.14) and summary["sessions"] == 1


def test_the_fractions_of_tokens_the_losss_bounds_touched_share_a_panel():
    """The clip fractions, the decoupled loss's behaviour-weight bounds and the off-policy mask: a panel of
    their own, not the "Other metrics" grid (cut at MAX_OTHER_PANELS keys in name order: train/ keys last)."""
    keys = [
        "train/policy/actor/clip_frac",
        "train/policy/actor/behave_over_cap_frac",
        "train/policy/actor/behave_under_min_frac",
        "train/policy/actor/off_policy_mask_frac",
        "train/value/critic/value_clip_frac",
    ]
    others = ["train/policy/actor/behave_weight", "train/policy/moe_routing_replayed_fraction", "rollout/x_frac"]
    run = report.Run(name="r", path=Path("r"), records=[{"step": 1, **dict.fromkeys(keys + others, 0.1)}])
    (panel,) = [p for p in report.PANELS if p.title == "Clip and mask fractions"]
    assert panel.select(run.keys()) == sorted(keys)


def test_durations_count_days_past_24_hours():
    assert report.format_duration(59.9) == "00:00:59"
    assert report.format_duration(3 * 3600 + 62) == "03:01:02"
    assert report.format_duration(86400) == "1d 00:00:00"
    assert report.format_duration(2 * 86400 + 3 * 3600 + 4 * 60 + 5) == "2d 03:04:05"


def test_a_resumed_run_s_step_time_leaves_out_the_time_between_sessions(tmp_path, monkeypatch):
    """Two sessions appending to one metrics.jsonl, 3 days apart: "elapsed" spans both (with its days),
    "step time" sums the steps' logged time split (1.6 s a step), each step once."""
    clock = iter(float(t) for t in [1000, 1002, 1003, 1005] + [1000 + 3 * 86400 + 2 * i for i in range(3)])
    monkeypatch.setattr(metrics_module, "time", SimpleNamespace(time=lambda: next(clock)))
    split = {"timing/rollout_s": 1.0, "timing/train_s": 0.5, "timing/sync_s": 0.1}
    run_dir = tmp_path / "resumed"
    with MetricsLogger(run_dir, total_steps=6, console=False) as logger:  # stopped after step 3
        for step in (1, 2, 3):
            logger.log({"rollout/reward_mean": 0.1, **split}, step=step)
        logger.log({"eval/accuracy": 0.5, "eval/time_s": 1.0}, step=3)
    with MetricsLogger(run_dir, total_steps=6, start_step=3, console=False) as logger:  # resumed
        for step in (4, 5, 6):
            logger.log({"rollout/reward_mean": 0.2, **split}, step=step)
    summary = report.summarize(report.load_run(run_dir))
    assert summary["elapsed"] == "3d 00:00:04"
    assert summary["step time"] == "00:00:09"  # 6 x 1.6 s
    text = report.build_report([report.load_run(run_dir)])
    assert "<td>3d 00:00:04</td><td>00:00:09</td>" in text and "step time: the steps" in text


def test_single_run_default_output_and_missing_metrics(tmp_path):
    run = tmp_path / "only_reward"
    with MetricsLogger(run, total_steps=3, console=False) as logger:
        for step in (1, 2, 3):
            logger.log({"rollout/reward_mean": step / 3}, step=step)
    assert report.main([str(run), "--smooth", "0.5"]) == 0
    parser = ImageCollector()
    parser.feed((run / "report.html").read_text())
    assert [alt for alt, _ in parser.images] == ["Reward"]
    summary = report.summarize(report.load_run(run))
    assert summary["step time"] is None  # no time split logged
    with pytest.raises(DataError, match="pass a run directory"):
        report.main([str(tmp_path / "missing")])
    with pytest.raises(ValueError, match="--smooth"):
        report.main([str(run), "--smooth", "1.5"])


def test_an_output_path_that_cannot_be_written_is_one_line(tmp_path):
    run = tmp_path / "run"
    with MetricsLogger(run, total_steps=1, console=False) as logger:
        logger.log({"rollout/reward_mean": 0.5}, step=1)
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for out, reason in (
        (Path("/proc/areno_report.html"), None),  # /proc takes no new files (ENOENT as root)
        (a_file / "report.html", f"{a_file} is a file, not a directory"),
        (tmp_path, "Is a directory"),
    ):
        with pytest.raises(UserError) as exc:
            report.main([str(run), "--out", str(out)])
        message = str(exc.value)
        assert message.startswith(f"cannot write the report to {out} (") and "\n" not in message
        assert message.endswith("): pass --out a file in a writable directory")
        assert reason is None or f"({reason})" in message
    with pytest.raises(UserError, match=r"cannot write the plots to .*: pass --png-dir a writable directory"):
        report.main([str(run), "--png-dir", str(a_file / "plots")])


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome", "headless_shell"):
        if path := shutil.which(name):
            return path
    return None


@pytest.mark.skipif(_chromium() is None, reason="no Chromium/Chrome binary on PATH")
def test_report_renders_in_headless_chromium(two_runs, tmp_path):
    a, b = two_runs
    out = report.write_report([a, b], tmp_path / "r.html")
    # dump-dom runs the page (scripts included) and prints the DOM after load
    dom = subprocess.run(
        [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", out.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert dom.count("data:image/png;base64,") == len(report.PANELS) + 1
    shot = tmp_path / "shot.png"
    subprocess.run(
        [
            _chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            f"--screenshot={shot}",
            "--window-size=1400,3000",
            out.as_uri(),
        ],
        capture_output=True,
        timeout=120,
        check=True,
    )
    assert shot.read_bytes().startswith(PNG_MAGIC)


DEMO = """
import sys
from areno.api.pipeline import run_demo
run_demo(run_dir=sys.argv[1], overrides=sys.argv[2:])
"""


@pytest.mark.slow  # over 10 s: the default suite keeps within its 10 minutes
def test_report_from_a_real_tiny_run(tmp_path):
    """A few GRPO steps of the CPU demo with a 2-layer model, then the report of that run.

    The run is a subprocess with a deadline so that a hang in training fails this test instead
    of stalling the suite."""
    run_dir = tmp_path / "demo"
    overrides = [
        f"model.path={tmp_path / 'init_model'}",
        "model.init_tiny.hidden_size=32",
        "model.init_tiny.layers=2",
        "model.init_tiny.intermediate_size=64",
        "warm_start.steps=0",
        "train.steps=3",
        "train.eval_interval=2",
        "data.num_eval=8",
        "rollout.batch_size=4",
        "rollout.n_samples=2",
        "observe.console=false",
    ]
    repo = Path(__file__).resolve().parents[2]
    subprocess.run(
        [sys.executable, "-c", DEMO, str(run_dir), *overrides],
        cwd=repo,
        env={**os.environ, "PYTHONPATH": str(repo)},
        check=True,
        timeout=600,
    )
    out = report.write_report([run_dir])
    parser = ImageCollector()
    parser.feed(out.read_text())
    alts = [alt for alt, _ in parser.images]
    for title in ("Reward", "Held-out accuracy", "Loss", "Throughput", "Time split per step"):
        assert title in alts
    assert report.summarize(report.load_run(run_dir))["steps"] == 3
