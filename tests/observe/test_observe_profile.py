"""``observe.profile_steps``: the chosen steps run under torch.profiler and leave a trace and a table."""

from __future__ import annotations

import gzip
import json

import pytest

from areno.api.config import load_config
from areno.errors import ConfigError
from tests.helpers.configs import run_to_end, tiny_grpo_overrides


def test_a_profiled_step_leaves_a_trace_of_its_operators_and_a_table(tmp_path):
    cfg = load_config(
        None,
        [
            *tiny_grpo_overrides(tmp_path),
            "reward.sandbox=false",
            "train.steps=2",
            "train.eval_interval=0",
            "observe.profile_steps=[2]",
        ],
    )
    run_to_end(cfg)
    out = tmp_path / "run" / "profile"
    assert sorted(p.name for p in out.iterdir()) == ["step_00000002.json.gz", "step_00000002.txt"]
    events = json.loads(gzip.decompress((out / "step_00000002.json.gz").read_bytes()))["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"aten::mm", "aten::addmm", "aten::linear"} & names  # the model's matmuls ran under it
    table = (out / "step_00000002.txt").read_text()
    assert "Self CPU" in table and "aten::" in table


def test_a_profile_step_the_run_never_reaches_is_refused_up_front(tmp_path):
    with pytest.raises(ConfigError, match=r"observe\.profile_steps.*\[3\].*1\.\.2"):
        load_config(None, [*tiny_grpo_overrides(tmp_path), "train.steps=2", "observe.profile_steps=[1,3]"])
