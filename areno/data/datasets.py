"""Loading prompts: shipped synthetic tasks or a user's JSONL / Parquet file.

Every row is checked for the prompt field before training starts, so a malformed file fails with
one line naming the file, the row and the field.
"""

from __future__ import annotations

import json
from pathlib import Path

from areno.data.tasks import TaskSpec, generate_rows


def load_rows(path: str | Path, *, prompt_key: str) -> list[dict]:
    """Rows of a ``.jsonl`` / ``.json`` (list) / ``.parquet`` file, validated."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"dataset file {path} does not exist: set data.train_path / data.eval_path")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    elif path.suffix in (".jsonl", ".json"):
        text = path.read_text()
        if path.suffix == ".json":
            rows = json.loads(text)
        else:
            rows = []
            for lineno, line in enumerate(text.splitlines(), start=1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path} line {lineno}: not valid JSON ({exc.msg})") from None
    else:
        raise ValueError(f"dataset file {path}: unsupported suffix {path.suffix!r}; use .jsonl, .json or .parquet")
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not isinstance(row.get(prompt_key), str):
            raise ValueError(
                f"{path} row {i}: no string field {prompt_key!r} "
                f"(set data.prompt_key to the field that holds the prompt)"
            )
    return rows


def build_splits(data_cfg) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows) for a ``DataSection``; rows use the configured keys."""
    if data_cfg.task is not None:
        spec = TaskSpec(name=data_cfg.task, kwargs=dict(data_cfg.task_kwargs))
        train = generate_rows(spec, split="train", num=20_000, seed=data_cfg.seed)
        held_out = generate_rows(spec, split="eval", num=data_cfg.num_eval, seed=data_cfg.seed)
        if data_cfg.prompt_key != "prompt" or data_cfg.answer_key != "answer":
            remap = lambda r: {data_cfg.prompt_key: r["prompt"], data_cfg.answer_key: r["answer"]}  # noqa: E731
            train, held_out = [remap(r) for r in train], [remap(r) for r in held_out]
        return train, held_out
    train = load_rows(data_cfg.train_path, prompt_key=data_cfg.prompt_key)
    held_out = []
    if data_cfg.eval_path is not None:
        held_out = load_rows(data_cfg.eval_path, prompt_key=data_cfg.prompt_key)
        held_out = held_out[: data_cfg.num_eval]
    return train, held_out
