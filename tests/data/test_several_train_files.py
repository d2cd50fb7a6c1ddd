"""``data.train_path`` as a glob pattern or a list of files: their rows in the order given, each file's errors
named by it, and a run that trains on the mix."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from areno.api.config import load_config
from areno.api.preflight import check_resumed_config
from areno.data.datasets import build_splits, check_prompt_forms, data_files
from areno.errors import ConfigError, DataError
from tests.helpers.configs import run_to_end, tiny_run_overrides


def _jsonl(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n" for p in prompts))
    return path


def _data(tmp_path: Path, train_path) -> object:
    return load_config(None, [f"model.path={tmp_path}", "data.task=null", f"data.train_path={train_path}"]).data


def test_a_list_and_a_pattern_read_their_files_in_order(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", ["a0", "a1"])
    shards = tmp_path / "shards"
    shards.mkdir()
    for i, prompts in ((1, ["s1"]), (0, ["s0a", "s0b"])):  # written out of order: read in name order
        pq.write_table(
            pa.Table.from_pylist([{"prompt": p, "answer": "1"} for p in prompts]), shards / f"part-{i}.parquet"
        )
    train, _ = build_splits(_data(tmp_path, f"[{shards}/*.parquet,{a}]"))
    assert [r["prompt"] for r in train] == ["s0a", "s0b", "s1", "a0", "a1"]
    # one string, no list: the pattern alone; a relative entry becomes absolute as a single path does
    assert [r["prompt"] for r in build_splits(_data(tmp_path, f"{shards}/part-*.parquet"))[0]] == ["s0a", "s0b", "s1"]
    assert data_files([str(a), str(a)], key="k") == [a, a]  # a file named twice is read twice: a weighting


def test_each_files_problem_is_named_by_that_file(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", ["a0"])
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"prompt": "b0", "answer": "1"}\n{"question": "b1"}\n')
    with pytest.raises(DataError, match=rf"^{bad} line 2: no string field 'prompt'"):
        build_splits(_data(tmp_path, f"[{a},{bad}]"))
    with pytest.raises(DataError, match=rf"^data.train_path: the pattern {tmp_path}/none-\*.jsonl matches no file"):
        build_splits(_data(tmp_path, f"[{a},{tmp_path}/none-*.jsonl]"))
    with pytest.raises(DataError, match=rf"data.train_path: dataset file {tmp_path / 'gone.jsonl'} does not exist"):
        build_splits(_data(tmp_path, f"[{a},{tmp_path / 'gone.jsonl'}]"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match=rf"^data.train_path: dataset file {empty} holds no rows: remove it"):
        build_splits(_data(tmp_path, f"[{a},{empty}]"))
    with pytest.raises(ConfigError, match=r"^data.train_path: is an empty list: name at least one file"):
        _data(tmp_path, "[]")
    # a directory of shards: the pattern that reads them is the fix
    with pytest.raises(DataError, match=rf"is a directory, not a file: .* such as {tmp_path}/\*.parquet"):
        build_splits(_data(tmp_path, str(tmp_path)))


def test_a_message_list_prompt_is_named_by_its_own_file_and_row(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", ["a0", "a1"])
    b = tmp_path / "b.jsonl"
    b.write_text(
        json.dumps({"prompt": "b0", "answer": "1"})
        + "\n"
        + json.dumps({"prompt": [{"role": "user", "content": "hi"}], "answer": "1"})
        + "\n"
    )
    data = _data(tmp_path, f"[{a},{b}]")
    with pytest.raises(DataError, match=rf"^{b} row 1: 'prompt' is a message list"):
        check_prompt_forms(data, build_splits(data), templated=False)


def test_a_run_trains_on_the_mix_and_resumes_only_with_the_same_files(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", ["1+1=", "2+2="])
    b = _jsonl(tmp_path / "b.jsonl", ["3+3=", "4+4="])
    overrides = [
        *tiny_run_overrides(tmp_path, num_eval=0),
        "data.task=null",
        f"data.train_path=[{a},{b}]",
        "reward.sandbox=false",
        "train.epochs=1",
        "train.eval_interval=0",
    ]
    rows = [r for r in run_to_end(load_config(None, overrides)) if "rollout/epoch" in r]
    assert len(rows) == 2 and rows[-1]["rollout/epoch"] == 1.0  # 4 rows of two files, 2 a step
    written = load_config(tmp_path / "run" / "config.yaml")
    assert written.data.train_path == [str(a), str(b)]
    with pytest.raises(ConfigError, match="data.train_path="):  # the data of a resumed run is its identity
        check_resumed_config(
            load_config(
                None, [*overrides, f"data.train_path=[{b},{a}]", "resume=true", "train.epochs=null", "train.steps=4"]
            )
        )
