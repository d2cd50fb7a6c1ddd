"""A run on a CPU with native bfloat16 and a wide model: ``auto`` rolls out in bfloat16 and trains under
bfloat16 autocast over float32 master weights, and the step is a real GRPO step."""

from __future__ import annotations

import json
import math

import torch

from areno.api.config import load_config
from areno.api.trainer import Trainer
from areno.models import cpu_gemm
from tests.helpers.configs import tiny_run_overrides

WIDE = "model.init_tiny={hidden_size: 256, layers: 1, heads: 4, kv_heads: 2, intermediate_size: 512}"


def test_a_wide_model_rolls_out_and_computes_in_bfloat16_with_float32_master_weights(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_gemm, "native_bf16", lambda: True)
    overrides = [
        *tiny_run_overrides(tmp_path, reward="tests.helpers.rewards:first_char"),
        WIDE,
        "reward.sandbox=false",
        "train.steps=2",
        "train.eval_interval=0",
    ]
    trainer = Trainer.init(load_config(None, overrides))
    try:
        engine = trainer.backend.engine
        policy = engine.training.runner.backends["policy"]
        assert {p.dtype for p in engine.rollout.engine.model.parameters()} == {torch.bfloat16}
        assert {p.dtype for p in policy.model.parameters()} == {torch.float32}
        assert policy.cfg.resolved_param_dtype("cpu") == "bfloat16"
        trainer.run()
    finally:
        trainer.shutdown()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/policy/loss" in r]
    assert len(steps) == 2
    assert all(math.isfinite(r["train/policy/loss"]) and r["train/policy/grad_norm"] > 0 for r in steps), steps
