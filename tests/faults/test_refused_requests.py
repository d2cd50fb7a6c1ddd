"""A training row whose request the rollout engine refuses (a prompt longer than the context) is dropped at
once, not retried, and counted in synchronous runs as in asynchronous ones; a batch of only such rows stops
the run naming the rows, not the rollout side."""

from __future__ import annotations

import json

from areno.api.config import load_config
from areno.api.trainer import Trainer
from areno.observe.metrics import read_metrics
from tests.helpers.configs import TINY, train_args


def _rows(path, long_rows: set[int], n: int = 8):
    rows = [{"prompt": ("1+2=" * 30) if i in long_rows else "1+2=", "answer": "3"} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_refused_rows_are_dropped_without_retries_and_counted_in_a_synchronous_run(tmp_path, caplog):
    _rows(tmp_path / "t.jsonl", {0, 3})
    config = load_config(
        None,
        [
            f"run_dir={tmp_path / 'run'}",
            f"model.path={tmp_path / 'm'}",
            TINY,
            "data.task=null",
            f"data.train_path={tmp_path / 't.jsonl'}",
            "data.num_eval=0",
            "rollout.batch_size=4",
            "rollout.n_samples=2",
            "rollout.max_new_tokens=8",
            "rollout.max_model_len=40",
            "rollout.max_retries=2",
            "train.steps=2",
            "train.eval_interval=0",
            "data.seed=1",
            "cluster.device=cpu",
            "cluster.cpu_threads=1",
            "observe.console=false",
            "test_rollout.enabled=false",
        ],
    )
    Trainer.init(config).run()
    rows = read_metrics(tmp_path / "run")
    refused = [r["rollout/refused_requests"] for r in rows]
    # the counters are cumulative: the two long rows, one attempt each, whichever steps drew them
    assert refused[-1] == rows[-1]["rollout/dropped_failed"] == rows[-1]["rollout/failed_episodes"] == 2
    assert [r["rollout/num_seqs"] for r in rows] == [2 * (4 - (b - a)) for a, b in zip([0, *refused], refused)]
    warnings = [r.getMessage() for r in caplog.records if "refused its request" in r.getMessage()]
    assert len(warnings) == 2 and "not retried" in warnings[0] and "max_model_len=40" in warnings[0]


def test_a_batch_of_refused_rows_stops_the_run_naming_the_rows(tmp_path, capsys):
    from areno.cli import main

    _rows(tmp_path / "t.jsonl", set(range(8)))
    rc = main(
        train_args(
            tmp_path,
            "data.task=null",
            f"data.train_path={tmp_path / 't.jsonl'}",
            "data.num_eval=0",
            "rollout.max_model_len=40",
            "reward.sandbox=false",
        )
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1, err
    assert "refused by the rollout engine (last: RequestRejected: prompt has 120 tokens" in err[-1]
    assert err[-1].endswith(
        "fix or filter the rows (a prompt longer than rollout.max_model_len, a token outside the vocabulary)"
    )
