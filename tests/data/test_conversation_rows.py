"""TRL's conversational rows (``{"messages": [...]}``, one whole conversation) are read as TRL's SFT
reads them: the last assistant message(s) are the completion (the row's answer, under
``data.answer_key``), every message before them the prompt. A conversation that cannot be split is
one line naming the file and the line. A warm start on TRL preference rows trains on ``chosen``."""

from __future__ import annotations

import json

import pytest

from areno.api.config import DataSection, load_config
from areno.api.pipeline import run_pipeline, warm_start_config
from areno.api.trainer import Trainer
from areno.data.datasets import build_splits, load_rows, warm_start_answer_key
from areno.engine.api import load_tokenizer, sft_trajectories
from areno.errors import DataError
from areno.observe.metrics import read_metrics

TINY = "model.init_tiny={hidden_size: 32, layers: 1, heads: 2, kv_heads: 1, intermediate_size: 64}"

SYSTEM = {"role": "system", "content": "Add."}
USER = {"role": "user", "content": "1+1="}
REPLY = {"role": "assistant", "content": "2"}


def _file(tmp_path, rows: list, name: str = "d.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_last_assistant_turns_are_the_answer_and_the_messages_before_the_prompt(tmp_path):
    follow_up = {"role": "user", "content": "and 2+2?"}
    two_parts = [{"role": "assistant", "content": "4"}, {"role": "assistant", "content": "."}]
    rows = [
        {"messages": [USER, REPLY]},
        {"messages": [SYSTEM, USER, REPLY, follow_up, *two_parts], "source": "x"},  # other fields stay
    ]
    path = _file(tmp_path, rows)
    assert load_rows(path, prompt_key="prompt", answer_key="answer") == [
        {"prompt": [USER], "answer": [REPLY]},
        {"source": "x", "prompt": [SYSTEM, USER, REPLY, follow_up], "answer": two_parts},
    ]
    # the answer goes under data.answer_key whether or not the recipe needs one: an RL recipe's reward
    # and `areno eval` read the same rows as sft
    for need in (True, False):
        cfg = DataSection(task=None, train_path=str(path), eval_path=str(path), answer_key="reply")
        train, held_out = build_splits(cfg, need_answers=need, eval_answers=need)
        assert train[0] == held_out[0] == {"prompt": [USER], "reply": [REPLY]}


@pytest.mark.parametrize(
    "row, said",
    [
        (
            {"messages": [SYSTEM, USER]},
            "'messages' has no assistant turn at its end (its last message is the 'user''s): a conversation row's "
            "completion is its last assistant message(s); end it with the assistant's reply, or give a prompt "
            "without one as 'prompt'",
        ),
        ({"messages": [REPLY]}, "'messages' holds only assistant messages: a conversation row's prompt is"),
        ({"messages": []}, "'messages' is a message list but the message list is empty"),
        ({"messages": [USER, {"role": "assistant"}]}, "'messages' is a message list but message 1 is not an object"),
        ({"messages": [USER, REPLY], "answer": "2"}, "both 'messages', whose last assistant message(s) are the row's"),
    ],
)
def test_a_conversation_that_cannot_be_split_is_named_by_its_line(tmp_path, row, said):
    path = _file(tmp_path, [{"messages": [USER, REPLY]}, row])
    with pytest.raises(DataError) as info:
        build_splits(DataSection(task=None, train_path=str(path)), need_answers=True)
    assert str(info.value).startswith(f"{path} line 2: {said}")
    assert "\n" not in str(info.value)


def test_preference_recipes_still_read_preference_rows_only(tmp_path):
    path = _file(tmp_path, [{"messages": [USER, REPLY]}])
    with pytest.raises(DataError, match=r"line 1: no field 'prompt', only 'messages' .* \{'prompt', 'chosen'"):
        build_splits(DataSection(task=None, train_path=str(path)), pairs=True)


def test_sft_trains_on_the_last_assistant_turn_of_a_conversation_row(tmp_path):
    """A two-step sft run on conversation rows: the trained sequences are the templated prompt (its earlier
    turns included), then the last assistant message as the template writes its turn."""
    rows = [
        {"messages": [{"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": str(a + b)}]}
        for a, b in [(1, 2), (3, 4), (2, 2), (5, 1)]
    ]
    rows.append({"messages": [USER, REPLY, {"role": "user", "content": "3+3="}, {"role": "assistant", "content": "6"}]})
    path = _file(tmp_path, rows)
    overrides = [
        f"run_dir={tmp_path / 'run'}",
        f"model.path={tmp_path / 'model'}",
        TINY,
        "train.algorithm=sft",
        "data.task=null",
        f"data.train_path={path}",
        "data.chat_template=always",
        "rollout.batch_size=2",
        "cluster.device=cpu",
        "cluster.cpu_threads=1",
        "observe.console=false",
        "train.steps=2",
        "train.eval_interval=0",
    ]
    cfg = load_config(None, overrides)
    trainer = Trainer.init(cfg)
    try:
        trainer.run()
    finally:
        trainer.shutdown()
    assert [r["step"] for r in read_metrics(tmp_path / "run") if "train/policy/loss" in r] == [1, 2]
    tokenizer = load_tokenizer(tmp_path / "model")
    (last,) = sft_trajectories(build_splits(cfg.data)[0][-1:], tokenizer, "prompt", "answer", chat_template="always")
    assert tokenizer.decode(last.completion_ids) == "6<|im_end|>"  # the character tokenizer's ChatML turn
    prompt = tokenizer.decode(last.prompt_ids)
    assert "1+1=" in prompt and "3+3=" in prompt and prompt.index("2") < prompt.index("3+3=")  # the context turns


# ------------------------------------------------------------------------------ warm start on preference rows
PAIRS = [{"prompt": "1+2=", "chosen": "3", "rejected": "4"}, {"prompt": "2+2=", "chosen": "4", "rejected": "5"}]


@pytest.mark.parametrize(
    "rows, settings, key",
    [
        (PAIRS, [], "chosen"),  # TRL preference rows, no answer key named: the preferred completion
        (PAIRS, ["data.answer_key=rejected"], "rejected"),  # a key the user named is kept
        ([{**r, "answer": r["chosen"]} for r in PAIRS], [], "answer"),  # the rows have the default key
        ([{"prompt": "1+2=", "answer": "3"}], [], "answer"),  # prompt/answer rows
    ],
)
def test_a_warm_start_on_preference_rows_trains_on_chosen(tmp_path, rows, settings, key):
    path = _file(tmp_path, rows)
    base = [f"run_dir={tmp_path / 'run'}", f"model.path={tmp_path / 'm'}", "data.task=null"]
    cfg = load_config(None, [*base, f"data.train_path={path}", *settings])
    assert warm_start_answer_key(cfg.data) == key
    assert warm_start_config(cfg).data.answer_key == key
    assert cfg.data.answer_key == (key if settings else "answer")  # the main stage's rows are read as before


def test_a_warm_start_key_from_a_task_or_an_unreadable_file_is_the_configured_one(tmp_path):
    assert warm_start_answer_key(DataSection(task="arithmetic")) == "answer"
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    assert warm_start_answer_key(DataSection(task=None, train_path=str(bad))) == "answer"  # preflight names it
    listed = tmp_path / "pairs.json"  # a .json list is read whole
    listed.write_text(json.dumps(PAIRS))
    assert warm_start_answer_key(DataSection(task=None, train_path=str(listed))) == "chosen"


def test_an_rl_run_warm_started_on_a_preference_file_runs_without_an_answer_key(tmp_path):
    """GRPO on the prompts of TRL preference rows, after an sft warm start on their chosen completions:
    no data.answer_key to set (before: the warm start's preflight refused every row, no field 'answer')."""
    path = _file(tmp_path, PAIRS * 2)
    overrides = [
        f"run_dir={tmp_path / 'run'}",
        f"model.path={tmp_path / 'model'}",
        TINY,
        "data.task=null",
        f"data.train_path={path}",
        "reward.fn=tests.helpers.rewards:sevens_and_length",
        "reward.sandbox=false",
        "rollout.batch_size=2",
        "rollout.n_samples=2",
        "rollout.max_new_tokens=2",
        "cluster.device=cpu",
        "cluster.cpu_threads=1",
        "observe.console=false",
        "warm_start.steps=2",
        "warm_start.batch_size=2",
        "train.steps=1",
        "train.eval_interval=0",
    ]
    run_pipeline(load_config(None, overrides))
    warm = [r for r in read_metrics(tmp_path / "run" / "warm_start") if "train/policy/loss" in r]
    assert [r["step"] for r in warm] == [1, 2]
    assert [r["step"] for r in read_metrics(tmp_path / "run") if "rollout/reward_mean" in r] == [1]
