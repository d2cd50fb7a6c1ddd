"""``data.train_path`` as a glob pattern or a list of files: their rows in the order given, each file's errors
named by it, and a run that trains on the mix; ``data.eval_path`` likewise, each held-out file's figures logged."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from areno.api.config import load_config
from areno.api.preflight import check_resumed_config
from areno.cli import main as areno_main
from areno.data.datasets import build_splits, check_prompt_forms, data_files, eval_sources, held_out_row_source
from areno.engine.evaluation import EvalOptions, run_eval
from areno.engine.scoring import eval_metrics
from areno.errors import ConfigError, DataError
from areno.types import Trajectory
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


def _with_a_message_list_second(path: Path) -> Path:
    """A file whose second row's prompt is a message list (which needs a chat template)."""
    rows = [{"prompt": "b0", "answer": "1"}, {"prompt": [{"role": "user", "content": "hi"}], "answer": "1"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_message_list_prompt_is_named_by_its_own_file_and_row(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", ["a0", "a1"])
    b = _with_a_message_list_second(tmp_path / "b.jsonl")
    data = _data(tmp_path, f"[{a},{b}]")
    with pytest.raises(DataError, match=rf"^{b} line 2: 'prompt' is a message list"):
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


# ------------------------------------------------------------------------------ several held-out files
def test_several_held_out_files_keep_num_eval_rows_each_and_are_named_by_their_stems(tmp_path):
    (tmp_path / "other").mkdir()
    files = [
        _jsonl(tmp_path / "gsm8k.jsonl", ["g0", "g1", "g2"]),
        _jsonl(tmp_path / "math.jsonl", ["m0"]),
        _jsonl(tmp_path / "other" / "gsm8k.jsonl", ["o0", "o1"]),
        _jsonl(tmp_path / "reward.jsonl", ["r0", "r1"]),
    ]
    train = _jsonl(tmp_path / "train.jsonl", ["t0"])
    listed = ",".join(map(str, files))
    data = load_config(
        None,
        [
            f"model.path={tmp_path}",
            "data.task=null",
            f"data.train_path={train}",
            f"data.eval_path=[{listed}]",
            "data.num_eval=2",
        ],
    ).data
    _, held_out = build_splits(data)
    assert [r["prompt"] for r in held_out] == ["g0", "g1", "m0", "o0", "o1", "r0", "r1"]
    assert eval_sources(data) == [("gsm8k", 2), ("math", 1), ("gsm8k_2", 2), ("reward_data", 2)]
    one = dataclasses.replace(data, eval_path=str(files[0]))
    assert eval_sources(one) == [] and len(build_splits(one)[1]) == 2  # one file: the whole's figures alone
    assert eval_sources(dataclasses.replace(data, eval_path=f"{tmp_path}/*.jsonl")) == [
        ("gsm8k", 2),
        ("math", 1),
        ("reward_data", 2),
        ("train", 1),
    ]


def _scored(rewards: list[list[float]]) -> list[list[Trajectory]]:
    return [
        [Trajectory(prompt_ids=[1], completion_ids=[2], logprobs=[0.0], versions=[0], reward=r) for r in rs]
        for rs in rewards
    ]


def test_each_files_figures_are_those_of_its_rows_alone():
    rewards = [[1.0, 0.0], [0.0, 0.0], [1.0, 1.0]]  # file a: rows 0-1, file b: row 2
    metrics = eval_metrics(rewards, _scored(rewards), 1.0, [("a", 2), ("b", 1)])
    assert metrics["eval/accuracy"] == pytest.approx(0.5)
    assert (metrics["eval/a/accuracy"], metrics["eval/a/num_prompts"], metrics["eval/a/pass@2"]) == (0.25, 2.0, 0.5)
    assert (metrics["eval/b/accuracy"], metrics["eval/b/pass@1"], metrics["eval/b/pass@2"]) == (1.0, 1.0, 1.0)
    assert metrics["eval/a/pass@1"] == pytest.approx(0.25)  # row 0 solved by one sample of two
    assert not any(k.startswith("eval/") and k.count("/") == 2 for k in eval_metrics(rewards, _scored(rewards), 1.0))


def test_a_run_and_areno_eval_log_each_held_out_files_accuracy(tmp_path, caplog):
    a = _jsonl(tmp_path / "a.jsonl", ["1+1=", "2+2=", "3+3="])
    b = _jsonl(tmp_path / "b.jsonl", ["4+4=", "5+5="])
    overrides = [
        *tiny_run_overrides(tmp_path),
        "data.task=null",
        f"data.train_path={a}",
        f"data.eval_path=[{a},{b}]",
        "data.num_eval=2",
        "reward.sandbox=false",
        "train.steps=1",
    ]
    cfg = load_config(None, overrides)
    evaluated = [r for r in run_to_end(cfg) if "eval/accuracy" in r]
    last = evaluated[-1]
    assert (last["eval/num_prompts"], last["eval/a/num_prompts"], last["eval/b/num_prompts"]) == (4, 2, 2)
    assert last["eval/accuracy"] == pytest.approx((last["eval/a/accuracy"] + last["eval/b/accuracy"]) / 2)
    alone = run_eval(cfg, EvalOptions(checkpoint="latest"))["metrics"]
    assert {k: alone[k] for k in ("eval/a/accuracy", "eval/b/accuracy")} == pytest.approx(
        {k: last[k] for k in ("eval/a/accuracy", "eval/b/accuracy")}
    )
    # the command's summary line gives each file's accuracy beside the whole's
    with caplog.at_level(logging.INFO, logger="areno.eval"):
        assert areno_main(["eval", str(tmp_path / "run" / "config.yaml"), "--checkpoint", "latest"]) == 0
    said = (
        f"accuracy {alone['eval/accuracy']:.4f}, a {alone['eval/a/accuracy']:.4f}, b {alone['eval/b/accuracy']:.4f}, "
    )
    assert said in caplog.text
    # --num-prompts counts each file's rows, as data.num_eval does; more than a file holds is named by it
    assert run_eval(cfg, EvalOptions(checkpoint="latest", num_prompts=1))["metrics"]["eval/b/num_prompts"] == 1
    with pytest.raises(ConfigError, match=rf"--num-prompts 3 \(each held-out file's\): {b} has only 2 rows"):
        run_eval(cfg, EvalOptions(checkpoint="latest", num_prompts=3))


def test_a_held_out_rows_problem_is_named_by_its_file_and_its_row_there(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", ["a0", "a1", "a2"])  # data.num_eval=2 keeps a0, a1
    b = _with_a_message_list_second(tmp_path / "b.jsonl")
    overrides = [f"model.path={tmp_path}", "data.task=null", f"data.train_path={a}", f"data.eval_path=[{a},{b}]"]
    data = load_config(None, [*overrides, "data.num_eval=2"]).data
    with pytest.raises(DataError, match=rf"^{b} line 2: 'prompt' is a message list"):
        check_prompt_forms(data, build_splits(data), templated=False)
    # a .jsonl row by its line, as an editor and the load errors count them
    assert held_out_row_source(data, 1) == f"{a} line 2" and held_out_row_source(data, 2) == f"{b} line 1"
