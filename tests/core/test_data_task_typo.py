"""A mistyped ``data.task`` beside a data file is named as the typo, with the fix: it was blamed on
``data.train_path`` and said the task that does not exist "generates the rows" (walk39b)."""

from __future__ import annotations

import pytest

from areno.api.config import load_config
from areno.errors import ConfigError


@pytest.mark.parametrize(
    "task, key, match",
    [
        (
            "nul",
            "train_path",
            r"data.task: 'nul' is not a shipped task \(did you mean 'null'\?\); to read data.train_path, set data.task=null",
        ),
        (
            "sortt",
            "eval_path",
            r"data.task: 'sortt' is not a shipped task \(did you mean 'sort'\?\); to read data.eval_path",
        ),
        ("sort", "train_path", r"data.train_path: is set but data.task='sort' generates the rows"),
    ],
)
def test_a_task_beside_a_file_is_named_for_what_is_wrong(task, key, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, ["model.path=/m", f"data.task={task}", f"data.{key}=rows.jsonl"])
