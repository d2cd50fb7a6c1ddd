"""The error policy through the CLI (``areno.errors``): a user mistake is one line on stderr and exit
code 2, found before any model is built; a run failure is one line naming the failing worker and
its log, exit code 1; anything else is a bug whose traceback goes through (exit code 1)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from areno.api.pipeline import DEMO_CONFIG
from areno.cli import main
from areno.engine.api import check_cuda_capability
from areno.engine.cluster import LayoutError
from areno.engine.executor import RolloutPoolBroken
from areno.engine.partitioned import WorkerLostError
from areno.errors import ConfigError, RunFailure, UserError
from areno.launch.allocation import AllocationModeError
from areno.launch.scheduler import SchedulerError, WorkerDiedError, WorkerError
from areno.launch.storage import StorageCheckError
from areno.launch.watchdog import WorkerTimeoutError
from areno.rollout.client import NoHealthyServerError, RolloutServersLost
from areno.sync.base import PolicySyncError
from areno.train.optim import NonFiniteStepError
from tests.helpers.configs import TINY, train_args


def _areno(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "areno", *args], capture_output=True, text=True, timeout=300, cwd=cwd)


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=cwd)


def _assert_user_error(rc: int, stderr: str, *fragments: str) -> None:
    lines = stderr.strip().splitlines()
    assert rc == 2 and len(lines) == 1, stderr[-3000:]
    assert lines[0].startswith("areno: error: ") and "Traceback" not in stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


# ------------------------------------------------------------------------------------- the classes
@pytest.mark.parametrize(
    "cls",
    [
        NoHealthyServerError,
        RolloutServersLost,
        WorkerLostError,
        PolicySyncError,
        WorkerError,
        WorkerDiedError,
        WorkerTimeoutError,
        RolloutPoolBroken,
    ],
)
def test_run_failures_are_run_failures(cls):
    assert issubclass(cls, RunFailure) and issubclass(cls, RuntimeError) and not issubclass(cls, UserError)


@pytest.mark.parametrize(
    "cls", [AllocationModeError, LayoutError, StorageCheckError, SchedulerError, NonFiniteStepError]
)
def test_setting_errors_are_config_errors(cls):
    assert issubclass(cls, ConfigError) and issubclass(cls, ValueError) and not issubclass(cls, RunFailure)


# ------------------------------------------------------------------------------------- early checks
def test_unknown_recipe_fails_before_the_warm_start(tmp_path):
    """The demo config runs a 40-step warm start before its recipe: a misspelt recipe is reported
    before it, and before the model that init_tiny would create (relative paths, under cwd)."""
    t0 = time.monotonic()
    proc = _areno("train", str(DEMO_CONFIG), "train.algorithm=grpox", cwd=tmp_path)
    elapsed = time.monotonic() - t0
    _assert_user_error(proc.returncode, proc.stderr, "unknown recipe 'grpox'", "did you mean grpo")
    assert not (tmp_path / "runs").exists()  # no run dir, no warm_start/, no init_model/
    assert elapsed < 60, elapsed  # the imports only (the warm start alone takes longer on CPU)


def test_each_user_error_kind_is_one_line_and_exit_2(tmp_path):
    """One per kind, through `python -m areno train`: data, model directory, reward import."""
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(json.dumps({"prompt": "caf\u00e9", "answer": "1"}, ensure_ascii=False).encode("latin-1") + b"\n")
    proc = _areno(*train_args(tmp_path, "data.task=null", f"data.train_path={latin1}"), cwd=tmp_path)
    _assert_user_error(proc.returncode, proc.stderr, f"{latin1}: not UTF-8 text", "convert the file to UTF-8")

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["Qwen2ForCausalLM"], ')
    proc = _areno(*train_args(tmp_path), cwd=tmp_path)
    _assert_user_error(proc.returncode, proc.stderr, f"{model / 'config.json'} is not valid JSON")
    shutil.rmtree(model)

    proc = _areno(*train_args(tmp_path, "reward.fn=no_such_module:score"), cwd=tmp_path)
    _assert_user_error(proc.returncode, proc.stderr, "reward.fn: cannot import module 'no_such_module'")
    assert not (tmp_path / "run").exists() and not (tmp_path / "model").exists()


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _no_tokenizer(model: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).unlink()


def _no_eos(model: Path) -> None:
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": None}))


def _vocabulary_missing(model: Path) -> None:
    """walk31: tokenizer_config.json whose vocabulary file was not copied loads as special tokens alone."""
    (model / "tokenizer.json").unlink()
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "Qwen2Tokenizer"}))


def _smaller_vocab(model: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "vocab_size": 20}))


def _gguf(model: Path) -> None:
    (model / "config.json").unlink()
    (model / "model-q4_k_m.gguf").write_bytes(b"GGUF")


def _bin_only(model: Path) -> None:
    (model / "model.safetensors").rename(model / "pytorch_model.bin")


def _truncated(model: Path) -> None:
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])


@pytest.mark.parametrize(
    "damage, fragment",
    [
        (None, "model.path: directory"),
        (
            lambda m: (m / "config.json").unlink(),
            "config.json not found: point model.path at a Hugging Face checkpoint",
        ),
        (lambda m: (m / "config.json").write_text("[1, 2]"), "holds a JSON list"),
        (
            lambda m: (m / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]})),
            "GPT2LMHeadModel",
        ),
        (lambda m: (m / "model.safetensors").unlink(), "no *.safetensors files"),
        (_truncated, "model.safetensors is truncated"),
        (_no_tokenizer, "has no tokenizer"),
        (_no_eos, "has no eos_token"),
        (_vocabulary_missing, "encodes text to no token"),
        (_smaller_vocab, "but config.json's vocab_size is 20: it is another model's tokenizer"),
        (_gguf, "holds GGUF files (llama.cpp's format), which areno does not read"),
        (_bin_only, "holds pytorch_model*.bin weights only, which areno does not read (pickles): convert them"),
    ],
    ids=[
        "missing",
        "no_config",
        "config_not_object",
        "unsupported_arch",
        "no_weights",
        "truncated",
        "no_tok",
        "no_eos",
        "vocabulary_missing",
        "tokenizer_past_vocab",
        "gguf",
        "bin_only",
    ],
)
def test_model_directory_errors(tiny_model_dir, tmp_path, capsys, damage, fragment):
    model = tmp_path / "model"
    if damage is not None:
        damage(_copy(tiny_model_dir, model))
    rc = main(train_args(tmp_path, "model.init_tiny=null"))
    _assert_user_error(rc, capsys.readouterr().err, fragment)
    assert not (tmp_path / "run").exists()  # checked before the run directory is made


def _rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (["train.algorithm_kwargs={clip_epz: 0.2}"], "bad arguments for ActorSpecialization"),
        (["train.algorithm=opd"], "role 'teacher' needs a checkpoint"),
        (
            ["train.algorithm=opd", "train.algorithm_kwargs={teacher_path: /no/teacher}"],
            "directory /no/teacher does not",
        ),
        (["rollout.workflow=areno.workflows.rlvr:NoSuchWorkflow"], "has no attribute 'NoSuchWorkflow'"),
        (["rollout.workflow=areno.types:Trajectory"], "not a subclass of areno.workflows.base.RolloutWorkflow"),
        (["rollout.workflow_kwargs={max_turnz: 3}"], "max_turnz"),
        (["reward.fn=areno.rewards.tasks:nope"], "reward.fn: module 'areno.rewards.tasks' has no attribute 'nope'"),
        (["data.task=nope"], "data.task: unknown task 'nope'"),
        (["data.task_kwargs={max_digitz: 2}"], "data.task_kwargs"),
        ([f"{TINY[:-1]}, bogus: 1}}"], "model.init_tiny"),
        (["resume=true"], "resume=true but"),
        (["train.backend=nope"], "train.backend: unknown backend 'nope'"),
    ],
)
def test_config_errors_before_any_model(tmp_path, capsys, extra, fragment):
    rc = main(train_args(tmp_path, *extra))
    _assert_user_error(rc, capsys.readouterr().err, fragment)
    assert not (tmp_path / "run").exists() and not (tmp_path / "model").exists()


def test_data_errors_before_any_model(tmp_path, capsys):
    no_answer = _rows(tmp_path / "no_answer.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2="}])
    rc = main(train_args(tmp_path, "train.algorithm=sft", "data.task=null", f"data.train_path={no_answer}"))
    _assert_user_error(rc, capsys.readouterr().err, f"{no_answer} line 2: no field 'answer'", "data.answer_key")

    empty = _rows(tmp_path / "empty.jsonl", [])
    rc = main(train_args(tmp_path / "e", "data.task=null", f"data.train_path={empty}"))
    _assert_user_error(rc, capsys.readouterr().err, f"{empty} holds no rows")

    parquet = tmp_path / "bad.parquet"
    parquet.write_bytes(b"not parquet at all")
    rc = main(train_args(tmp_path / "p", "data.task=null", f"data.train_path={parquet}"))
    _assert_user_error(rc, capsys.readouterr().err, f"{parquet}: not a readable Parquet file")


def test_warm_start_data_is_checked_before_it_starts(tmp_path, capsys):
    """The warm start trains on the answers: rows without one fail before the warm start."""
    rows = _rows(tmp_path / "train.jsonl", [{"prompt": "1+1="}])
    rc = main(train_args(tmp_path, "warm_start.steps=2", "data.task=null", f"data.train_path={rows}"))
    _assert_user_error(
        rc, capsys.readouterr().err, "no field 'answer': the reference answer, which supervised training"
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_cuda_without_a_device_is_a_config_error(tmp_path, capsys):
    rc = main(train_args(tmp_path, "cluster.device=cuda"))
    _assert_user_error(rc, capsys.readouterr().err, "cluster.device=cuda but no CUDA device is visible")


def test_a_gpu_older_than_ampere_is_refused_before_any_model_loads(tmp_path, capsys, monkeypatch):
    """walk34: on a V100 or T4 the CUDA defaults (bfloat16, flash attention, the Triton decode kernels) failed
    deep inside the first forward; the GPU is named at start-up now, with what to do."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-16GB")
    rc = main(train_args(tmp_path, "cluster.device=auto"))
    _assert_user_error(
        rc,
        capsys.readouterr().err,
        "cluster.device: Tesla V100-SXM2-16GB has CUDA compute capability 7.0; areno's CUDA path",
        "needs 8.0 or newer",
        "use cluster.device=cpu, or a newer GPU",
    )
    assert not (tmp_path / "model").exists()  # before init_tiny made the model
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    check_cuda_capability(torch.device("cuda"))  # an A100 passes


# ------------------------------------------------------------------------------------- run failures, bugs
RUN_FAILURE = """
import sys

import areno.api.pipeline as pipeline
from areno.cli import main
from areno.launch.scheduler import LocalScheduler


def run_pipeline(config):  # a run whose rollout worker's call raises
    with LocalScheduler(log_dir={log_dir!r}) as scheduler:
        scheduler.create_workers("rollout", "collections:Counter", 1)
        scheduler.call("rollout", "pop", "no-such-key")


pipeline.run_pipeline = run_pipeline
sys.exit(main(["train", "model.path=unused"]))
"""


def test_run_failure_names_the_worker_and_its_log(tmp_path):
    proc = _python(RUN_FAILURE.format(log_dir=str(tmp_path / "logs")), cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    log = tmp_path / "logs" / "rollout-0.log"
    assert last.startswith("areno: error: rollout[0] (pid ") and f"; log {log})" in last, last
    assert "pop raised KeyError: 'no-such-key'" in last and "Traceback" not in proc.stderr
    assert log.is_file()


BUG = """
import sys

import areno.api.pipeline as pipeline
from areno.cli import main


def run_pipeline(config):
    raise ValueError("an internal invariant broke")


pipeline.run_pipeline = run_pipeline
sys.exit(main(["train", "model.path=unused"]))
"""


def test_a_plain_value_error_is_a_bug_with_its_traceback(tmp_path):
    proc = _python(BUG, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback (most recent call last)" in proc.stderr and "areno: error" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "ValueError: an internal invariant broke"


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_a_missing_optional_package_is_a_config_error(tmp_path, capsys):
    rc = main(train_args(tmp_path, "observe.wandb_project=demo"))
    _assert_user_error(rc, capsys.readouterr().err, "observe: wandb is not installed", "pip install 'areno[wandb]'")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["report", "{tmp}"], "has no metrics.jsonl: pass a run directory"),
        (["trace", "{tmp}"], "or train with observe.trace=true"),
        (["sessions", "{tmp}"], "or train with observe.sessions=true"),
        (["doctor", "--require", "nope"], "--require: unknown check(s) nope"),
    ],
)
def test_other_commands_report_user_errors_in_one_line(tmp_path, capsys, argv, fragment):
    rc = main([a.format(tmp=tmp_path) for a in argv])
    err = capsys.readouterr().err
    assert rc == 2 and err.strip().splitlines()[-1].startswith("areno: error: ") and fragment in err, err


def test_a_hub_id_as_model_path_says_how_to_download_it(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc = main([*train_args(tmp_path, "model.init_tiny=null"), "model.path=Qwen/Qwen2.5-0.5B-Instruct"])
    _assert_user_error(
        rc, capsys.readouterr().err, "(if Qwen/Qwen2.5-0.5B-Instruct is a Hugging Face Hub id: areno downloads nothing"
    )


def test_out_of_device_memory_is_one_line_naming_the_settings(monkeypatch, capsys):
    """walk34: an OOM (a model or KV pool that does not fit, the first training step's optimizer state) was a
    torch traceback; the CLI now names what to lower, and other exceptions still propagate."""
    import areno.cli as cli

    def run(args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.1 GiB total)\nmore")

    monkeypatch.setattr(cli, "_parse", lambda parser, argv: argparse.Namespace(func=run))
    assert main(["train"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "areno: error: out of device memory (CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.1 GiB total)): "
        + cli.OUT_OF_MEMORY_FIX
    ]
    monkeypatch.setattr(cli, "_parse", lambda parser, argv: argparse.Namespace(func=lambda args: 1 / 0))
    with pytest.raises(ZeroDivisionError):
        main(["train"])
