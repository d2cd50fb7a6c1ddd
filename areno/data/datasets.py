"""Loading prompts: shipped synthetic tasks or a user's JSONL / Parquet file.

Every row is checked for the prompt field before training starts, so a malformed file fails with
one line naming the file, the line (JSONL) or row (JSON list, Parquet) and the field.
"""

from __future__ import annotations

import json
from pathlib import Path

from areno.data.tasks import TaskSpec, generate_rows


def load_rows(path: str | Path, *, prompt_key: str) -> list[dict]:
    """Rows of a ``.jsonl`` / ``.json`` (list) / ``.parquet`` file, validated.

    A bad row is named by its 1-based line number in a ``.jsonl`` file (``file line N: ...``, blank
    lines counted, as an editor shows them) and by its 0-based index in a ``.json`` list or a
    ``.parquet`` table (``file row i: ...``).
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"dataset file {path} does not exist: set data.train_path / data.eval_path")
    where: list[str]  # how each row is named in an error
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
        where = [f"row {i}" for i in range(len(rows))]
    elif path.suffix == ".json":
        try:
            rows = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} line {exc.lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(rows, list):
            raise ValueError(
                f"{path}: a .json dataset must be a list of objects, got a {type(rows).__name__} "
                f"(or write one object per line as .jsonl)"
            )
        where = [f"row {i}" for i in range(len(rows))]
    elif path.suffix == ".jsonl":
        rows, where = [], []
        for lineno, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path} line {lineno}: not valid JSON ({exc.msg})") from None
            where.append(f"line {lineno}")
    else:
        raise ValueError(f"dataset file {path}: unsupported suffix {path.suffix!r}; use .jsonl, .json or .parquet")
    for row, name in zip(rows, where):
        if not isinstance(row, dict):
            problem = f"the row is a JSON {_json_type(row)}, not an object"
        elif prompt_key not in row:
            problem = f"fields are {', '.join(map(repr, list(row)[:8])) or 'none'}"
        elif not isinstance(row[prompt_key], str):
            problem = f"{prompt_key!r} is {_json_type(row[prompt_key])}, not a string"
        else:
            continue
        raise ValueError(
            f"{path} {name}: no string field {prompt_key!r} ({problem}; "
            f"set data.prompt_key to the field that holds the prompt)"
        )
    return rows


def _json_type(value: object) -> str:
    """JSON's name for ``value``'s type (``null``, ``number``, ``array`` ...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)


def build_splits(data_cfg) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows) for a ``DataSection``; rows use the configured keys."""
    if data_cfg.task is not None:
        spec = TaskSpec(name=data_cfg.task, kwargs=dict(data_cfg.task_kwargs))
        train = generate_rows(spec, split="train", num=20_000, seed=data_cfg.seed)
        held_out = generate_rows(spec, split="eval", num=data_cfg.num_eval, seed=data_cfg.seed)
        if data_cfg.prompt_key != "prompt" or data_cfg.answer_key != "answer":
            remap = lambda r: {data_cfg.prompt_key: r["prompt"], data_cfg.answer_key: r["answer"]}
            train, held_out = [remap(r) for r in train], [remap(r) for r in held_out]
        return train, held_out
    train = load_rows(data_cfg.train_path, prompt_key=data_cfg.prompt_key)
    held_out = []
    if data_cfg.eval_path is not None:
        held_out = load_rows(data_cfg.eval_path, prompt_key=data_cfg.prompt_key)
        held_out = held_out[: data_cfg.num_eval]
    return train, held_out
