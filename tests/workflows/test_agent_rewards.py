"""Rewards inside an agent: ``client.reward_fn`` / ``client.ascore`` are awaited the same way with or
without the reward sandbox; an un-awaited reward is told to be awaited; an episode whose last turn
got the final reward is not warned about, and one without is warned about once per process."""

from __future__ import annotations

import asyncio
import gc
import logging

import pytest

from areno.api.config import RewardSection
from areno.rewards.loader import load_reward
from areno.rewards.sandbox import RewardSandbox, close_all
from areno.types import SamplingParams
from areno.workflows.agent import AgentWorkflow
from areno.workflows.tools import ToolSet, calculator_tool, parse_tool_calls
from tests.helpers.async_fakes import replying

PARAMS = SamplingParams(max_new_tokens=128)
REWARD = "tests.helpers.rewards:misbehave"  # 1.0 for the completion "ok", raises KeyError for "raise"


async def reward_fn_agent(client, sample):
    resp = await client.completions.create(model="policy", prompt=sample["prompt"])
    return await client.reward_fn(sample["prompt"], resp.choices[0].text, sample.get("answer"))


async def ascore_agent(client, sample):
    resp = await client.completions.create(model="policy", prompt=sample["prompt"])
    return await client.ascore(sample, resp.choices[0].text)


async def forgets_await(client, sample):
    resp = await client.completions.create(model="policy", prompt=sample["prompt"])
    return client.reward_fn(sample["prompt"], resp.choices[0].text, None)


@pytest.fixture
def reward_fns():
    """The configured reward as the engine loads it: in a sandbox (async), and in-process (plain)."""
    try:
        sandboxed = load_reward(RewardSection(fn=REWARD, sandbox=True, workers=1, timeout_s=20.0))
        plain = load_reward(RewardSection(fn=REWARD, sandbox=False))
        assert isinstance(sandboxed, RewardSandbox) and not isinstance(plain, RewardSandbox)
        yield {"sandbox": sandboxed, "in-process": plain}
    finally:
        close_all()


@pytest.mark.parametrize("setting", ["sandbox", "in-process"])
@pytest.mark.parametrize("agent", [reward_fn_agent, ascore_agent], ids=["reward_fn", "ascore"])
def test_the_agent_awaits_the_reward_the_same_way_in_either_setting(reward_fns, char_tokenizer, setting, agent):
    wf = AgentWorkflow(char_tokenizer, PARAMS, agent=agent, reward_fn=reward_fns[setting], n_samples=1)
    (traj,) = asyncio.run(wf.run_episode(replying(char_tokenizer, "ok"), {"prompt": "hi"}))
    assert traj.reward == 1.0 and "reward_error" not in traj.info


def test_ascore_scores_a_failing_reward_0_and_marks_the_trajectories(reward_fns, char_tokenizer):
    wf = AgentWorkflow(char_tokenizer, PARAMS, agent=ascore_agent, reward_fn=reward_fns["sandbox"], n_samples=2)
    group = asyncio.run(wf.run_episode(replying(char_tokenizer, "raise"), {"prompt": "hi"}))
    assert [t.reward for t in group] == [0.0, 0.0]
    assert all("KeyError" in t.info["reward_error"] for t in group)  # counted as rollout/reward_errors


async def scores_each_turn(client, sample):
    """Scores its first completion ("raise": the reward fails), tries again and returns the second's
    score ("ok": 1.0)."""
    first = (await client.completions.create(model="policy", prompt=sample["prompt"])).choices[0]
    await client.ascore(sample, first.text)
    prompt = list(first.prompt_token_ids) + list(first.token_ids)
    prompt += client.tokenizer.encode(" again", add_special_tokens=False)
    second = (await client.completions.create(model="policy", prompt=prompt)).choices[0]
    return await client.ascore(sample, second.text)


async def scores_a_derived_text(client, sample):
    await client.completions.create(model="policy", prompt=sample["prompt"])
    return await client.ascore(sample, "raise")  # a text no completion wrote (an extracted answer)


def test_only_the_trajectories_holding_the_failed_score_are_marked(reward_fns, char_tokenizer):
    reward = reward_fns["in-process"]
    wf = AgentWorkflow(
        char_tokenizer, PARAMS, agent=scores_each_turn, reward_fn=reward, n_samples=1, export_style="individual"
    )
    first, second = asyncio.run(wf.run_episode(replying(char_tokenizer, "raise", "ok"), {"prompt": "hi"}))
    assert "KeyError" in first.info["reward_error"] and "reward_error" not in second.info
    assert second.info["own_reward"] == 1.0
    # one sequence holding both turns holds the failed one
    wf = AgentWorkflow(char_tokenizer, PARAMS, agent=scores_each_turn, reward_fn=reward, n_samples=1)
    (concat,) = asyncio.run(wf.run_episode(replying(char_tokenizer, "raise", "ok"), {"prompt": "hi"}))
    assert "KeyError" in concat.info["reward_error"]
    # a failed score of a text no completion wrote: which reward its 0 went into cannot be told
    wf = AgentWorkflow(char_tokenizer, PARAMS, agent=scores_a_derived_text, reward_fn=reward, n_samples=2)
    group = asyncio.run(wf.run_episode(replying(char_tokenizer, "ok"), {"prompt": "hi"}))
    assert len(group) == 2 and all("KeyError" in t.info["reward_error"] for t in group)


def test_an_unawaited_reward_is_dropped_with_await_it_and_no_runtime_warning(char_tokenizer, caplog, recwarn):
    reward = load_reward(RewardSection(fn=REWARD, sandbox=False))
    wf = AgentWorkflow(char_tokenizer, PARAMS, agent=forgets_await, reward_fn=reward, n_samples=1)
    with caplog.at_level(logging.WARNING, logger="areno.workflows"):
        assert asyncio.run(wf.run_episode(replying(char_tokenizer, "ok"), {"id": 3, "prompt": "hi"})) is None
    gc.collect()
    assert "agent episode 0 of row id='3': the reward is a coroutine, not a number: await it" in caplog.text
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


TOOLS = ToolSet([calculator_tool()])
CALL = '<tool_call>{"name":"calc","arguments":{"expr":"6*7"}}</tool_call>'


async def tool_then_answer(client, sample):
    """The documented multi-turn pattern: a tool call, its result fed back, then an answer whose
    reward is returned (given to the last completion only)."""
    first = (await client.completions.create(model="policy", prompt=sample["prompt"])).choices[0]
    _, calls = parse_tool_calls(first.text)
    result = await TOOLS.aexecute(calls[0], session=client.session)
    prompt = list(first.prompt_token_ids) + list(first.token_ids)
    prompt += client.tokenizer.encode(f"<tool_response>{result.content}</tool_response>", add_special_tokens=False)
    second = (await client.completions.create(model="policy", prompt=prompt)).choices[0]
    return float(second.text.strip() == result.content)


async def never_rewards(client, sample):
    await client.completions.create(model="policy", prompt=sample["prompt"])


def test_a_final_reward_after_a_tool_call_is_not_warned_about(char_tokenizer, caplog, monkeypatch):
    monkeypatch.setattr("areno.workflows.interaction._warned_unrewarded", False)
    wf = AgentWorkflow(char_tokenizer, PARAMS, agent=tool_then_answer, n_samples=3)
    with caplog.at_level(logging.DEBUG, logger="areno.workflows"):
        group = asyncio.run(wf.run_episode(replying(char_tokenizer, CALL, "42"), {"prompt": "6*7="}))
    assert [t.reward for t in group] == [1.0] * 3 and [t.info["turn_rewards"] for t in group] == [[0.0, 1.0]] * 3
    assert "have no reward" not in caplog.text


def test_episodes_without_a_final_reward_are_warned_about_once(char_tokenizer, caplog, monkeypatch):
    monkeypatch.setattr("areno.workflows.interaction._warned_unrewarded", False)
    wf = AgentWorkflow(char_tokenizer, PARAMS, agent=never_rewards, n_samples=3)
    with caplog.at_level(logging.DEBUG, logger="areno.workflows"):
        for _ in range(2):
            asyncio.run(wf.run_episode(replying(char_tokenizer, "x"), {"prompt": "p"}))
    said = [r for r in caplog.records if "have no reward" in r.getMessage()]
    assert len(said) == 6 and [r.levelno for r in said].count(logging.WARNING) == 1
    assert "1 of 1 interactions have no reward, among them 1 that end the episode" in said[0].getMessage()
