"""walk22: the observe section and the run-directory commands. ``overwrite=true`` left the old run's traces,
sessions and profiles to merge into the new run's; every resume was a new W&B run; curve.png clipped
rewards outside [0, 1]; a bad WANDB_MODE was a traceback after the model was built; ``areno trace -o`` to
an unwritable path was a traceback; profile steps a resumed run does not train were skipped without a
word; ``areno sessions --last 0`` showed everything; ``areno doctor`` listed packages that cannot import
as ok; ``--algorithm`` silently beat a ``train.algorithm=`` override."""

from __future__ import annotations

import json

import matplotlib.axes
import pytest

from areno.api.pipeline import plot_curve
from areno.api.rundir import clear_run
from areno.cli import main
from areno.errors import ConfigError, UserError
from areno.observe import doctor, session
from areno.observe.metrics import WANDB_ID_FILENAME, resolve_wandb_mode
from areno.observe.profile import profiles_missed
from areno.observe.trace import merge_traces


def test_overwrite_deletes_the_old_runs_traces_sessions_profiles_and_wandb_id(tmp_path):
    run = tmp_path / "run"
    for d in ("checkpoints/step_00000002", "traces", "profile", "tensorboard"):
        (run / d).mkdir(parents=True)
    for f in ("metrics.jsonl", "traces/h-1.jsonl", "trace.json", "sessions.jsonl", "profile/step_00000001.txt"):
        (run / f).write_text("{}\n")
    (run / WANDB_ID_FILENAME).write_text("abc\n")
    (run / "config.until_step_00000002.yaml").write_text("a: 1\n")
    (run / "config.yaml").write_text("a: 2\n")
    clear_run(run)
    # config.yaml is the new run's to write; tensorboard/ purges the old steps itself
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml", "tensorboard"]
    clear_run(run)  # nothing left of a run: nothing to say or do


def test_wandb_mode_from_the_environment_is_checked(monkeypatch):
    assert resolve_wandb_mode(None, {}) == "offline"
    assert resolve_wandb_mode(None, {"WANDB_MODE": ""}) == "offline"
    assert resolve_wandb_mode(None, {"WANDB_MODE": "dryrun"}) == "offline"
    assert resolve_wandb_mode(None, {"WANDB_MODE": "Online"}) == "online"
    assert resolve_wandb_mode("disabled", {"WANDB_MODE": "bogus"}) == "disabled"
    with pytest.raises(ConfigError, match=r"WANDB_MODE=bogus: must be online, offline or disabled.*observe.wandb_mode"):
        resolve_wandb_mode(None, {"WANDB_MODE": "bogus"})


def test_the_curve_keeps_a_reward_outside_0_1_in_view(tmp_path, monkeypatch):
    limits, set_ylim = [], matplotlib.axes.Axes.set_ylim

    def record(self, *a, **k):
        limits.append(a)
        return set_ylim(self, *a, **k)

    monkeypatch.setattr(matplotlib.axes.Axes, "set_ylim", record)
    for name, rewards in (("unit", [0.0, 0.5, 1.0]), ("wide", [-5.0, 2.5, 35.0])):
        run = tmp_path / name
        run.mkdir()
        rows = [{"step": i + 1, "rollout/reward_mean": r} for i, r in enumerate(rewards)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        plot_curve(run)
    assert limits.count((-0.02, 1.02)) == 1  # the unit run only; the wide one autoscales


def test_trace_to_an_unwritable_path_is_one_line_and_leaves_nothing(tmp_path):
    (tmp_path / "traces").mkdir()
    (tmp_path / "traces" / "h-1.jsonl").write_text(json.dumps({"ph": "X", "pid": 1, "ts": 0, "dur": 1}) + "\n")
    with pytest.raises(UserError, match=r"cannot write the trace to .*: pass -o a file in a writable directory"):
        merge_traces(tmp_path, tmp_path / "traces")  # a directory
    assert not (tmp_path / "traces.tmp").exists()
    assert merge_traces(tmp_path).name == "trace.json"


def test_profile_steps_before_the_resumed_checkpoint_are_named(tmp_path):
    (tmp_path / "profile").mkdir()
    (tmp_path / "profile" / "step_00000001.txt").write_text("table\n")  # profiled by the first run
    assert profiles_missed(tmp_path, [1, 2, 5], trained=3) == [2]
    assert profiles_missed(tmp_path, [4], trained=3) == []


def test_sessions_last_must_be_positive(tmp_path, capsys):
    (tmp_path / "sessions.jsonl").write_text("")
    for bad in ("0", "-3"):
        with pytest.raises(SystemExit) as exc:
            session.main([str(tmp_path), "--last", bad])
        assert exc.value.code == 2 and "must be >= 1" in capsys.readouterr().err
    with pytest.raises(UserError, match="only workflows that record sessions write any"):
        session.main([str(tmp_path)])


def test_doctor_imports_what_it_lists(tmp_path, monkeypatch):
    pkg = tmp_path / "areno_walk22_broken"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('simulated broken install')\n")
    dist = tmp_path / "areno_walk22_broken-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: areno_walk22_broken\nVersion: 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(doctor, "PACKAGES", (("broken", "areno_walk22_broken", None),))
    checks = {c.name: c for c in doctor.versions()}
    assert not checks["broken"].ok and "simulated broken install" in checks["broken"].detail


def test_algorithm_flag_and_override_must_agree(capsys):
    assert main(["train", "model.path=unused", "train.algorithm=grpo", "--algorithm", "rloo"]) == 2
    assert "--algorithm rloo and the override train.algorithm=grpo disagree" in capsys.readouterr().err
