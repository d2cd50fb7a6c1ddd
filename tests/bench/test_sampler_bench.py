"""bench/sampler.py: both samplers draw from the same distribution; the script prints its figures."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import sampler


def test_baseline_and_engine_draws_follow_the_softmax():
    probs = torch.tensor([0.6, 0.25, 0.1, 0.05])
    n = 6000
    race = probs.log().repeat(n, 1)
    seed, counter = torch.arange(n), torch.full((n,), 3)
    for draw in (sampler.baseline_draw, sampler.engine_draw):
        freq = torch.bincount(draw(race, seed, counter), minlength=4).float() / n
        assert torch.allclose(freq, probs, atol=0.02), (draw.__name__, freq)


def test_main_prints_one_line_per_shape(capsys):
    assert sampler.main(["--rows", "2", "3", "--vocab", "50", "--iters", "1"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [(r["rows"], r["vocab"]) for r in rows] == [(2, 50), (3, 50)]
    assert all(r["baseline_race_ms"] > 0 and r["inverse_cdf_ms"] > 0 and r["speedup"] > 0 for r in rows)
