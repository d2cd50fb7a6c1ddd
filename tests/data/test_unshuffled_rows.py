"""``data.shuffle=false`` (TRL's ``shuffle_dataset=False``; a curriculum): every epoch takes the training rows in
their file's order; the default shuffles each epoch anew."""

from __future__ import annotations

import json

from areno.api.config import load_config
from areno.api.trainer import Trainer
from areno.data.tasks import PromptStream
from tests.helpers.configs import TINY

ROWS = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(7)]


def test_an_unshuffled_stream_takes_the_rows_in_order_every_epoch():
    stream = PromptStream(ROWS, seed=3, batch_size=3, shuffle=False)
    assert stream.take_indices(10) == [0, 1, 2, 3, 4, 5, 6, 0, 1, 2]
    assert PromptStream(ROWS, seed=3, batch_size=3).take_indices(7) != list(range(7))


def test_a_run_with_data_shuffle_false_trains_the_file_in_order(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = load_config(
        None,
        [
            f"run_dir={tmp_path / 'run'}",
            f"model.path={tmp_path / 'model'}",
            TINY,
            "data.task=null",
            f"data.train_path={path}",
            "data.num_eval=0",
            "data.shuffle=false",
            "rollout.batch_size=3",
            "rollout.n_samples=2",
            "rollout.max_new_tokens=2",
            "reward.sandbox=false",
            "cluster.device=cpu",
            "cluster.cpu_threads=1",
            "observe.console=false",
            "train.steps=1",
            "train.eval_interval=0",
        ],
    )
    trainer = Trainer.init(cfg)
    try:
        prompts = [t.info["prompt"] for t in trainer.rollout_token_batch(0).trajectories[::2]]
    finally:
        trainer.shutdown()
    assert prompts == [r["prompt"] for r in ROWS[:3]]
