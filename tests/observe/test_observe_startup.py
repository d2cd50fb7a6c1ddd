"""Start-up time: the first generated token of a process is logged once, with its age, and reaches the
first step's metrics as ``system/startup_to_first_token_s``."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import transformers

from areno.api.config import load_config
from areno.api.trainer import Trainer
from areno.observe import startup
from tests.helpers.configs import tiny_grpo_overrides

ROOT = Path(__file__).resolve().parents[2]


def test_process_age_is_positive_and_grows():
    first = startup.process_age_s()
    assert first is not None and 0 < first <= startup.process_age_s()


def test_first_token_reaches_the_first_step_metrics(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(startup, "_first_token_s", None)  # as in a fresh process
    cfg = load_config(
        None,
        [*tiny_grpo_overrides(tmp_path), "reward.sandbox=false", "train.steps=2", "train.eval_interval=0"],
    )
    with caplog.at_level(logging.INFO, logger="areno.observe.startup"):
        trainer = Trainer.init(cfg)
        try:
            trainer.run()
        finally:
            trainer.shutdown()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "rollout/reward_mean" in r]
    assert 0 < steps[0]["system/startup_to_first_token_s"] <= startup.process_age_s()
    assert all("system/startup_to_first_token_s" not in r for r in steps[1:])  # once per process
    lines = [r.getMessage() for r in caplog.records if "first generated token" in r.getMessage()]
    assert len(lines) == 1 and "after the process started" in lines[0]


SLOW_IMPORTS = (
    "torch._dynamo",
    # transformers 4.x imports DTensor itself with PreTrainedTokenizerFast
    *(("torch.distributed.tensor",) if int(transformers.__version__.split(".")[0]) >= 5 else ()),
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "transformers.models",
)
"""Modules a one-process CPU run does not need before its first rollout token (the last: transformers'
registry of model classes, which a tiny model's character tokenizer loads without)."""

FIRST_TOKEN_PROBE = """
import json, logging, sys
from areno.cli import main

seen = {}

class Snapshot(logging.Handler):
    def emit(self, record):
        if "first generated token" in record.getMessage() and not seen:
            seen.update({m: m in sys.modules for m in SLOW})

SLOW = json.loads(sys.argv[1])
logging.getLogger("areno.observe.startup").addHandler(Snapshot())
rc = main(["train", *sys.argv[2:]])
print(json.dumps({"rc": rc, "before": seen, "after": {m: m in sys.modules for m in SLOW}}))
"""


def test_slow_imports_come_after_the_first_token(tmp_path):
    """`areno train` on the CPU generates its first token before importing torch._dynamo (the
    optimizer's), DTensor, FSDP and DCP (the checkpoint's) or transformers' model registry, and still
    imports the first two kinds to train and save."""
    overrides = [*tiny_grpo_overrides(tmp_path), "reward.sandbox=false", "train.steps=1", "train.eval_interval=0"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", FIRST_TOKEN_PROBE, json.dumps(SLOW_IMPORTS), *overrides],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["rc"] == 0
    assert result["before"] == dict.fromkeys(SLOW_IMPORTS, False)
    assert result["after"]["torch._dynamo"] and result["after"]["torch.distributed.checkpoint"]
