import json

import pytest

from areno.data.datasets import build_splits, load_rows
from areno.data.tasks import PromptStream, TaskSpec, extract_answer, generate_rows
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
    with pytest.raises(ValueError, match=r"row 1: no string field 'prompt'"):
        load_rows(path, prompt_key="prompt")
    path.write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(ValueError, match="line 2: not valid JSON"):
        load_rows(path, prompt_key="prompt")
    with pytest.raises(ValueError, match="does not exist"):
        load_rows(tmp_path / "missing.jsonl", prompt_key="prompt")


def test_build_splits_from_files(tmp_path):
    from areno.api.config import DataSection

    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n')
    train, held = build_splits(DataSection(task=None, train_path=str(path), eval_path=str(path)))
    assert train == held == [{"prompt": "a", "answer": "1"}]
