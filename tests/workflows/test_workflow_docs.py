"""The examples of ``docs/workflows.md`` work as written: its ``wf.py`` workflow gives each row one
scored group (ids left out, filled in), is checked like the engine builds it (a typo in its
workflow_kwargs is one line), and trains two steps; its ``my_agent.py`` agent runs its tool, records
the call, and is rewarded on its final turn only."""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

import pytest

from areno.cli import main
from areno.engine.executor import WorkflowExecutor
from areno.errors import ConfigError
from areno.observe.session import configure_sessions, load_sessions
from areno.types import SamplingParams
from areno.workflows.base import check_workflow_arguments, load_workflow, workflow_factory
from tests.helpers.async_fakes import FakeEngine, replying
from tests.helpers.configs import train_args

DOC = Path(__file__).resolve().parents[2] / "docs" / "workflows.md"


def _file(name: str) -> str:
    """The doc's python block that starts with ``# <name>``."""
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S) if b.startswith(f"# {name}")]
    return block


@pytest.fixture
def doc_dir(tmp_path, monkeypatch):
    """The doc's ``wf.py`` and ``my_agent.py`` in the working directory; sys.path and sys.modules restored after."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("wf.py", "my_agent.py"):
        (tmp_path / name).write_text(_file(name))
    yield tmp_path
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]


def _engine_kwargs(tokenizer, reward_fn, n_samples=3):
    return {
        "tokenizer": tokenizer,
        "reward_fn": reward_fn,
        "n_samples": n_samples,
        "sampling_params": SamplingParams(max_new_tokens=128),
        "prompt_key": "prompt",
        "answer_key": "answer",
    }


def exact(prompt, completion, answer, **fields):
    return float(completion.strip() == answer)


def test_the_doc_workflow_gives_each_row_one_scored_group(doc_dir, char_tokenizer):
    check_workflow_arguments("./wf.py:Sampled", workflow_factory("./wf.py:Sampled"), {"prefix": "Q: "})
    with pytest.raises(ConfigError, match=r"^rollout.workflow_kwargs.prefx: workflow './wf.py:Sampled' takes no"):
        check_workflow_arguments("./wf.py:Sampled", workflow_factory("./wf.py:Sampled"), {"prefx": "Q: "})
    wf = load_workflow("./wf.py:Sampled", **_engine_kwargs(char_tokenizer, exact), prefix="Q: ")
    answers = {"Q: 2+2=": "4", "Q: 4+5=": "8"}  # right, then wrong
    engine = FakeEngine(
        lambda ids, params: char_tokenizer.encode(answers[char_tokenizer.decode(ids)], add_special_tokens=False)
    )
    with WorkflowExecutor(engine, wf, max_retries=0) as ex:
        trajs = ex.rollout_batch([{"prompt": "2+2=", "answer": "4"}, {"prompt": "4+5=", "answer": "9"}])
    assert [t.reward for t in trajs] == [1.0] * 3 + [0.0] * 3
    assert len({t.group_id for t in trajs[:3]}) == 1 and trajs[0].group_id != trajs[3].group_id
    assert char_tokenizer.decode(trajs[0].prompt_ids) == "Q: 2+2="


def test_the_doc_workflow_trains(doc_dir, capsys):
    rc = main(train_args(doc_dir, "rollout.workflow=./wf.py:Sampled", "train.steps=2", "train.eval_interval=0"))
    assert rc == 0, capsys.readouterr().err[-2000:]


def test_the_doc_agent_runs_its_tool_and_is_rewarded_on_its_final_turn(doc_dir, char_tokenizer):
    call = '<tool_call>{"name":"lookup","arguments":{"key":"pi"}}</tool_call>'
    wf = load_workflow("./my_agent.py:workflow", **_engine_kwargs(char_tokenizer, exact, n_samples=2))
    configure_sessions(doc_dir, True)
    try:
        group = asyncio.run(
            wf.run_episode(replying(char_tokenizer, call, "3.14159"), {"prompt": "pi?", "answer": "3.14159"})
        )
    finally:
        configure_sessions(None, False)
    assert [t.reward for t in group] == [1.0, 1.0] and group[0].info["turn_rewards"] == [0.0, 1.0]
    mask = group[0].completion_mask  # the tool's response between the two turns is not trained
    assert mask[0] == 1 and mask[-1] == 1 and 0 in mask
    sessions = load_sessions(doc_dir)
    assert len(sessions) == 2 and all(s["num_tool_calls"] == 1 for s in sessions)
