"""The shipped example data: no held-out row's prompt is also a training prompt (a shipped example must not
trip areno's own overlap warning, nor count trained rows as held out)."""

import json
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("stem", ["sort_prefs", "agent_calculator", "agent_multiturn"])
def test_held_out_prompts_are_not_training_prompts(stem):
    def prompts(split):
        rows = [json.loads(line) for line in (EXAMPLES / f"{stem}_{split}.jsonl").read_text().splitlines() if line]
        return [json.dumps(r["prompt"], sort_keys=True) for r in rows]

    train, held_out = prompts("train"), prompts("eval")
    assert held_out and not set(held_out) & set(train)
