import json

import pytest

from areno.data.datasets import build_splits, check_splits, load_rows
from areno.data.tasks import PromptStream, TaskSpec, extract_answer, generate_rows
from areno.errors import ConfigError, DataError
from areno.rewards.tasks import exact_match


def test_splits_are_disjoint_and_seeded():
    spec = TaskSpec(name="arithmetic", kwargs={"max_digits": 2})
    train = generate_rows(spec, split="train", num=500, seed=1)
    held = generate_rows(spec, split="eval", num=100, seed=1)
    assert len(held) == 100 and len(train) == 500
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    assert train == generate_rows(spec, split="train", num=500, seed=1)
    assert train != generate_rows(spec, split="train", num=500, seed=2)
    assert held == generate_rows(spec, split="eval", num=100, seed=2)  # same held-out set for every seed
    for row in train[:50]:
        a, b = row["prompt"][:-1].split("+")
        assert int(a) + int(b) == int(row["answer"])


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("arithmetic", {"ops": "+-*", "max_digits": 1}),
        ("sort", {"min_len": 1, "max_len": 2}),
        ("reverse", {"min_len": 2, "max_len": 3, "alphabet": "abcb"}),
    ],
)
def test_a_small_task_is_listed_whole_as_the_search_finds_it(monkeypatch, name, kwargs):
    """Asked for more rows than a task has, generate_rows lists them all in a seeded order instead of
    drawing 50 times as many (seconds at start-up): the same rows as the search, per split."""
    from areno.data import tasks

    spec, num = TaskSpec(name=name, kwargs=kwargs), 300  # more than each task has
    listed = {split: generate_rows(spec, split=split, num=num, seed=1) for split in ("train", "eval")}
    assert listed["train"] == generate_rows(spec, split="train", num=num, seed=1)
    assert listed["train"] != generate_rows(spec, split="train", num=num, seed=2)
    monkeypatch.setattr(tasks, "_ALL_ROWS", {})
    for rows, split in zip(listed.values(), listed):
        searched = generate_rows(spec, split=split, num=num, seed=1)
        assert len(rows) < num and sorted(rows, key=str) == sorted(searched, key=str)
        if split == "train":  # dozens of rows: the listing's shuffle, not the search's order of discovery
            assert rows != searched
    assert not {r["prompt"] for r in listed["train"]} & {r["prompt"] for r in listed["eval"]}


@pytest.mark.parametrize("task", ["reverse", "sort"])
def test_other_tasks(task):
    rows = generate_rows(TaskSpec(name=task, kwargs={}), split="train", num=20, seed=0)
    for row in rows:
        word = row["prompt"].split(" ", 1)[1][:-1]
        expected = word[::-1] if task == "reverse" else "".join(sorted(word))
        assert row["answer"] == expected


def test_unknown_task_and_kwargs():
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        TaskSpec(name="nope", kwargs={})
    with pytest.raises(ValueError, match="data.task_kwargs"):
        TaskSpec(name="arithmetic", kwargs={"bogus": 1})


def test_reward_and_extraction():
    assert extract_answer(" 46\nmore") == "46"
    assert exact_match("12+34=", "46", "46") == 1.0
    assert exact_match("12+34=", "47", "46") == 0.0
    assert exact_match("12+34=", "", "46") == 0.0


def test_prompt_stream_resumes_exactly():
    rows = [{"prompt": str(i)} for i in range(7)]
    a = PromptStream(rows, seed=3)
    first = a.take(5)
    state = a.state_dict()
    rest = a.take(12)
    b = PromptStream(rows, seed=3)
    b.load_state_dict(state)
    assert b.take(12) == rest
    assert sorted(r["prompt"] for r in first + rest[:2]) == sorted(r["prompt"] for r in rows)


def test_jsonl_and_parquet(tmp_path):
    rows = [{"question": "1+1=", "answer": "2"}, {"question": "2+2=", "answer": "4"}]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    assert load_rows(path, prompt_key="question") == rows
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    assert load_rows(tmp_path / "d.parquet", prompt_key="question") == rows


def test_malformed_rows_are_named(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(ValueError, match=r"d\.jsonl line 2: no string field 'prompt' \(fields are 'text';"):
        load_rows(path, prompt_key="prompt")
    path.write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(ValueError, match="line 2: not valid JSON"):
        load_rows(path, prompt_key="prompt")
    with pytest.raises(ValueError, match="does not exist"):
        load_rows(tmp_path / "missing.jsonl", prompt_key="prompt")


def test_jsonl_errors_name_the_line_blank_lines_counted(tmp_path):
    """JSONL: the 1-based line an editor shows (blank lines count), whatever is wrong with the row."""
    path = tmp_path / "d.jsonl"
    for bad, problem in [
        ('{"prompt": 7}', "'prompt' is number, not a string"),
        ('{"prompt": null}', "'prompt' is null, not a string"),
        ('["prompt", "b"]', "the row is a JSON array, not an object"),
        ('"just a string"', "the row is a JSON string, not an object"),
    ]:
        path.write_text('{"prompt": "a"}\n\n\n' + bad + "\n")
        with pytest.raises(ValueError) as info:
            load_rows(path, prompt_key="prompt")
        # a row that is no object has no field data.prompt_key could name
        fix = "set data.prompt_key to the field that holds the prompt"
        if "not an object" in problem:
            fix = "write each row as an object holding its fields, {'prompt': ...}"
        assert str(info.value) == f"{path} line 4: no string field 'prompt' ({problem}; {fix})"


def test_json_list_and_parquet_errors_name_the_row_index(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": "a"}, {"prompt": "b"}, {"text": "c"}]
    (tmp_path / "d.json").write_text(json.dumps(rows, indent=2))  # row 2 sits on line 9: the index is named
    with pytest.raises(ValueError, match=r"d\.json row 2: no string field 'prompt' \(fields are 'text';"):
        load_rows(tmp_path / "d.json", prompt_key="prompt")
    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "n": 1}, {"prompt": None, "n": 2}]), tmp_path / "d.parquet")
    with pytest.raises(ValueError, match=r"d\.parquet row 1: no string field 'prompt' \('prompt' is null"):
        load_rows(tmp_path / "d.parquet", prompt_key="prompt")


def test_json_that_is_not_a_list_or_not_json_is_named(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps({"prompt": "a"}))
    with pytest.raises(ValueError, match=r"d\.json: a \.json dataset must be a list of objects, got a dict"):
        load_rows(path, prompt_key="prompt")
    path.write_text('[{"prompt": "a"},\n oops]')
    with pytest.raises(ValueError, match=r"d\.json line 2: not valid JSON"):
        load_rows(path, prompt_key="prompt")


def test_build_splits_from_files(tmp_path):
    from areno.api.config import DataSection

    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n')
    train, held = build_splits(DataSection(task=None, train_path=str(path), eval_path=str(path)))
    assert train == held == [{"prompt": "a", "answer": "1"}]


def test_every_data_problem_is_a_one_line_data_error(tmp_path):
    """Not UTF-8, not Parquet, an unsupported suffix: a DataError naming the file and the fix."""
    latin1 = tmp_path / "d.jsonl"
    latin1.write_bytes('{"prompt": "café"}\n'.encode("latin-1"))
    parquet = tmp_path / "d.parquet"
    parquet.write_bytes(b"PAR1 but not really")
    csv = tmp_path / "d.csv"
    csv.write_text("prompt\na\n")
    for path, pattern in [
        (latin1, r"d\.jsonl: not UTF-8 text \(byte 0xe9 at offset 15\): convert the file to UTF-8"),
        (parquet, r"d\.parquet: not a readable Parquet file \("),
        (csv, r"d\.csv: unsupported suffix '\.csv'; use \.jsonl, \.json or \.parquet"),
        (tmp_path / "missing.jsonl", r"missing\.jsonl does not exist: set data\.train_path"),
    ]:
        with pytest.raises(DataError, match=pattern) as info:
            load_rows(path, prompt_key="prompt")
        assert "\n" not in str(info.value)


def test_supervised_rows_need_the_answer_field(tmp_path):
    from areno.api.config import DataSection

    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "label": "2"}\n')
    data = DataSection(task=None, train_path=str(path))
    assert len(build_splits(data)[0]) == 2  # RL rows need no answer: the reward may not use one
    with pytest.raises(DataError, match=r"d\.jsonl line 2: no field 'answer': the reference answer, which supervised"):
        build_splits(data, need_answers=True)
    with pytest.raises(DataError, match=r"d\.jsonl line 2: no field 'answer'.*set data\.answer_key"):
        check_splits(data, need_answers=True)
    path.write_text("\n")
    with pytest.raises(DataError, match=r"d\.jsonl holds no rows"):
        check_splits(data)


def test_check_splits_validates_a_task_without_generating_it():
    from areno.api.config import DataSection

    check_splits(DataSection(task="sort", task_kwargs={"max_len": 4}))
    with pytest.raises(ConfigError, match="data.task: unknown task 'nope'"):
        check_splits(DataSection(task="nope"))
    with pytest.raises(ConfigError, match="data.task_kwargs: .*max_lenn"):
        check_splits(DataSection(task="sort", task_kwargs={"max_lenn": 4}))
