"""AgentWorkflow: bad agents lose only their own episode; the calculator agent end to end (scripted)."""

import asyncio
import functools
import json
import logging

import pytest

from areno.observe.session import configure_sessions, load_sessions
from areno.types import SamplingParams
from areno.workflows.agent import (
    AgentWorkflow,
    calculator_agent,
    calculator_reward,
    calculator_rows,
    calculator_workflow,
    write_calculator_rows,
)
from areno.workflows.base import load_workflow
from areno.workflows.tools import CALCULATOR_SCHEMA, ToolSet, calculator_tool

PARAMS = SamplingParams(max_new_tokens=80)
ROW = {"prompt": "12*34=", "answer": "x", "result": "408"}
CALL = '<tool_call>{"name":"calc","arguments":{"expr":"12*34"}}</tool_call>'


def workflow(tok, agent, **kw):
    return AgentWorkflow(tok, PARAMS, agent=agent, **kw)


def test_bad_agents_lose_only_their_episode(scripted, char_tokenizer, caplog, monkeypatch):
    monkeypatch.setattr("areno.workflows.interaction._warned_unrewarded", False)  # warned once per process
    calls = {"n": 0}

    async def flaky(client, sample):
        calls["n"] += 1
        k = calls["n"]
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        if k == 1:
            await asyncio.sleep(3600)  # never returns
        if k == 2:
            raise RuntimeError("agent bug")
        if k == 3:
            return None  # no reward set: warned, counted 0
        if k == 5:
            return "0.5"  # not a number: dropped, not coerced
        return 1.0

    # the deadline bounds the healthy episodes too: 2 s keeps a loaded machine from dropping one
    wf = workflow(char_tokenizer, flaky, n_samples=5, timeout_s=2.0, export_style="individual")
    with caplog.at_level(logging.WARNING, logger="areno.workflows"):
        group = asyncio.run(wf.run_episode(scripted(lambda p: "ok"), {"id": 7, "prompt": "hi"}))
    assert sorted(t.reward for t in group) == [0.0, 1.0] and len({t.group_id for t in group}) == 1
    assert "agent episode 0 of row id='7' did not return within timeout_s=2s; dropped" in caplog.text
    assert "agent episode 1 of row id='7' raised RuntimeError: agent bug; dropped" in caplog.text
    assert "1 of 1 interactions have no reward" in caplog.text
    assert "agent episode 4 of row id='7': the reward function returned str '0.5', not a number" in caplog.text


def test_all_episodes_failing_rejects_the_row_and_sync_agents_are_named(scripted, char_tokenizer, caplog):
    def not_async(client, sample):
        return 1.0

    wf = workflow(char_tokenizer, not_async, n_samples=2)
    with caplog.at_level(logging.WARNING, logger="areno.workflows"):
        assert asyncio.run(wf.run_episode(scripted([]), {"prompt": "p"})) is None
    assert "is not async: define it with 'async def agent(client, sample)'" in caplog.text
    assert "every agent episode of row prompt='p' failed; the row is skipped" in caplog.text
    with pytest.raises(ValueError, match="export_style"):
        workflow(char_tokenizer, not_async, export_style="tree")
    with pytest.raises(ValueError, match="cannot import module"):
        workflow(char_tokenizer, "no_such_module.agent")


def test_calculator_agent_right_call(scripted, char_tokenizer):
    wf = calculator_workflow(
        tokenizer=char_tokenizer,
        sampling_params=PARAMS,
        n_samples=1,
        reward_fn=None,
        prompt_key="prompt",
        answer_key="answer",
    )
    (traj,) = asyncio.run(wf.run_episode(scripted([CALL]), ROW))
    assert traj.reward == 1.0 and traj.info["num_turns"] == 1
    assert traj.completion_ids[:-1] == char_tokenizer.encode(CALL, add_special_tokens=False)
    # a valid call ends the episode; the shipped reward is answer correctness only
    wrong = asyncio.run(wf.run_episode(scripted([CALL.replace("34", "35")]), ROW))
    assert wrong[0].reward == 0.0 and wrong[0].info["num_turns"] == 1
    # operand shaping, when asked for: one operand of two copied right earns 0.5 x 1/2
    shaped = AgentWorkflow(char_tokenizer, PARAMS, agent=functools.partial(calculator_agent, operand_credit=0.5))
    assert asyncio.run(shaped.run_episode(scripted([CALL.replace("34", "35")]), ROW))[0].reward == 0.25
    with pytest.raises(ValueError, match="operand_credit must be in"):
        asyncio.run(calculator_agent(None, ROW, operand_credit=1.0))


def test_calculator_agent_direct_answer_is_final(scripted, char_tokenizer):
    wf = calculator_workflow(tokenizer=char_tokenizer, sampling_params=PARAMS, n_samples=1, reward_fn=None)
    for reply, reward in (("408", 1.0), ("408\nsome more", 1.0), ("418", 0.0), ("", 0.0)):
        rollout = scripted([reply])
        (traj,) = asyncio.run(wf.run_episode(rollout, ROW))
        assert (traj.reward, traj.info["num_turns"], len(rollout.prompts)) == (reward, 1, 1), reply


def test_calculator_reward_matches_the_agent():
    r = functools.partial(calculator_reward, "12*34=", answer="ignored", result="408")
    assert r(CALL) == 1.0 and r(CALL.replace("12*34", "34*12")) == 1.0 and r(CALL.replace("34", "35")) == 0.0
    assert r("408") == 1.0 and r(" 408 \nx") == 1.0 and r("48") == 0.0
    assert r('<tool_call>{"name":"calc","arguments":{"expr":"12*"}}</tool_call>') == 0.0  # tool error
    assert r('<tool_call>{"name":"calc","arguments":{"expr":"import os"}}</tool_call>') == 0.0
    assert r('<tool_call>{"name":"other","arguments":{"expr":"12*34"}}</tool_call>') == 0.0
    assert r('<tool_call>{"name":"calc","arguments":{"x":1}}</tool_call>') == 0.0
    assert r("<tool_call>not json</tool_call>") == 0.0
    with pytest.raises(ValueError, match="needs the row's 'result' field"):
        calculator_reward("12*34=", CALL, "x")


def test_calculator_agent_feeds_malformed_call_back(scripted, char_tokenizer, tmp_path):
    configure_sessions(tmp_path, True)
    try:
        wf = calculator_workflow(tokenizer=char_tokenizer, sampling_params=PARAMS, n_samples=1, reward_fn=None)
        rollout_replies = ['<tool_call>{"name":"calc","arguments":{"expr":"12*"}}</tool_call>', CALL]
        rollout = scripted(rollout_replies)
        (traj,) = asyncio.run(wf.run_episode(rollout, ROW))
    finally:
        configure_sessions(None, False)
    assert traj.info["num_turns"] == 2 and traj.reward == 1.0 and traj.info["turn_rewards"] == [0.0, 1.0]
    second_prompt = char_tokenizer.decode(rollout.prompts[1])
    assert "<tool_response>Error: tool 'calc' raised SyntaxError" in second_prompt and second_prompt.endswith("12*34=")
    n_first = len(char_tokenizer.encode(rollout_replies[0], add_special_tokens=False)) + 1  # + EOS
    n_feedback = len(rollout.prompts[1]) - len(rollout.prompts[0]) - n_first
    n_second = len(char_tokenizer.encode(CALL, add_special_tokens=False)) + 1
    assert traj.completion_mask == [1] * n_first + [0] * n_feedback + [1] * n_second
    (record,) = load_sessions(tmp_path)
    assert record["num_tool_calls"] == 2 and record["reward"] == 1.0 and record["meta"]["workflow"] == "agent"
    assert "error" in record["events"][1] and json.dumps(record)


def test_loads_by_dotted_path_with_engine_kwargs(char_tokenizer):
    wf = load_workflow(
        "areno.workflows.agent:calculator_workflow",
        tokenizer=char_tokenizer,
        reward_fn=None,
        n_samples=4,
        sampling_params=PARAMS,
        prompt_key="prompt",
        answer_key="answer",
    )
    assert isinstance(wf, AgentWorkflow) and wf.n_samples == 4
    wf = load_workflow(
        "areno.workflows.env:arithmetic_retry_workflow",
        tokenizer=char_tokenizer,
        reward_fn=None,
        n_samples=2,
        sampling_params=PARAMS,
        prompt_key="prompt",
        answer_key="answer",
    )
    assert wf.horizon == 3


def test_calculator_rows(tmp_path):
    rows = calculator_rows(400, seed=0, tool_fraction=0.3)
    assert rows == calculator_rows(400, seed=0, tool_fraction=0.3)
    tools = 0
    for r in rows:
        a, b = r["prompt"].rstrip("=").split("*")
        assert 10 <= int(a) <= 99 and 2 <= int(b) <= 9 and r["result"] == str(int(a) * int(b))
        if r["answer"].startswith("<tool_call>"):
            tools += 1
            assert calculator_reward(r["prompt"], r["answer"], result=r["result"]) == 1.0
        else:
            assert r["answer"] == r["result"]
    assert 0.2 < tools / len(rows) < 0.4
    held_out = write_calculator_rows(tmp_path / "eval.jsonl", 16, seed=1)
    assert [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()] == held_out
    train = calculator_rows(200, seed=0, exclude={r["prompt"] for r in held_out})
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    with pytest.raises(ValueError, match="tool_fraction must be in"):
        calculator_rows(1, seed=0, tool_fraction=1.5)
    with pytest.raises(ValueError, match="every prompt"):
        calculator_rows(1, seed=0, a_range=(2, 2), b_range=(3, 3), exclude={"2*3="})


def test_shipped_calculator_data_is_held_out():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "examples"
    train = [json.loads(line) for line in (root / "agent_calculator_train.jsonl").read_text().splitlines()]
    held_out = [json.loads(line) for line in (root / "agent_calculator_eval.jsonl").read_text().splitlines()]
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    assert all(calculator_reward(r["prompt"], r["answer"], **{"result": r["result"]}) == 1.0 for r in train + held_out)


def test_proxy_mode_runs_an_official_openai_agent(scripted, char_tokenizer):
    import httpx
    import openai

    async def http_agent(base_url, sample):
        client = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0)
        messages = [{"role": "user", "content": sample["prompt"]}]
        first = await client.chat.completions.create(model="m", messages=messages, tools=[CALCULATOR_SCHEMA])
        tool_msgs = await ToolSet([calculator_tool()]).arespond(first.choices[0].message)
        messages += [first.choices[0].message.model_dump(exclude_none=True), *tool_msgs]
        second = await client.chat.completions.create(model="m", messages=messages, tools=[CALCULATOR_SCHEMA])
        async with httpx.AsyncClient() as http:
            await http.post(f"{base_url}/reward", json={"reward": float(second.choices[0].message.content == "408")})
        return None

    wf = AgentWorkflow(char_tokenizer, PARAMS, agent=http_agent, proxy=True, gamma=0.5, n_samples=2)
    try:
        rollout = scripted(lambda prompt: "408" if "<|im_start|>tool" in prompt else CALL)
        group = asyncio.run(wf.run_episode(rollout, ROW))
        assert wf._proxy.base_url.startswith("http://127.0.0.1:") and wf._proxy.sessions == {}
    finally:
        wf.close()
    assert len(group) == 2
    for traj in group:
        assert traj.info["num_turns"] == 2 and traj.info["turn_rewards"] == [0.0, 1.0]
        assert traj.reward == 0.5  # gamma x the second turn's reward
        assert 0 in traj.completion_mask  # the tool turn is masked out


def test_a_dropped_episode_is_recorded_as_an_error(scripted, char_tokenizer, tmp_path, monkeypatch):
    """walk22: an agent that raised, timed out, returned no number or made no call was recorded with status ok
    (only a `dropped` event said otherwise), so `areno sessions --status error` missed it."""
    monkeypatch.setattr("areno.workflows.interaction._warned_unrewarded", False)
    calls = {"n": 0}

    async def flaky(client, sample):
        calls["n"] += 1
        k = calls["n"]
        if k == 4:
            return 1.0  # no completion call
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        if k == 1:
            await asyncio.sleep(3600)
        if k == 2:
            raise RuntimeError("agent bug")
        if k == 3:
            return "0.5"
        return 1.0

    configure_sessions(tmp_path, True)
    try:
        # the deadline bounds the healthy episodes' calls and session writes too: 2 s keeps load from
        # dropping one
        wf = workflow(char_tokenizer, flaky, n_samples=5, timeout_s=2.0, export_style="individual")
        group = asyncio.run(wf.run_episode(scripted(lambda p: "ok"), {"id": 7, "prompt": "hi"}))
    finally:
        configure_sessions(None, False)
    assert [t.reward for t in group] == [1.0]
    records = load_sessions(tmp_path)
    assert sorted(r["status"] for r in records) == ["error"] * 4 + ["ok"]
    errors = sorted(r["error"] for r in records if r["status"] == "error")
    assert errors[0] == "RuntimeError: agent bug" and any("timeout_s=2s" in e for e in errors)
    assert any("no completion call" in e for e in errors) and any("'0.5'" in e for e in errors)
    assert all(sum(e["kind"] == "dropped" for e in r["events"]) == (r["status"] == "error") for r in records)


def test_an_agents_runs_draw_seeds_of_their_own_whatever_their_timing(scripted, char_tokenizer):
    """The n runs of one episode are tasks of their own: each gets a seed stream of its own from the episode's
    (they drew from one stream in the order their requests arrived, which timing decides)."""
    from areno.workflows.base import EPISODE_SEEDS, EpisodeSeeds

    def agent_for(delays):
        async def agent(client, sample):
            index = len(seen)
            seen.append(None)
            await asyncio.sleep(delays[index])
            seen[index] = [EPISODE_SEEDS.get().next() for _ in range(2)]
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            return 1.0

        return agent

    def seeds(delays):
        async def episode():
            EPISODE_SEEDS.set(EpisodeSeeds(1000))
            wf = workflow(char_tokenizer, agent_for(delays), n_samples=2, export_style="individual")
            await wf.run_episode(scripted(lambda p: "ok"), {"prompt": "hi"})

        seen.clear()
        asyncio.run(episode())
        return list(seen)

    seen: list = []
    first, second = seeds([0.0, 0.05]), seeds([0.05, 0.0])
    assert first == second and first[0] != first[1] and first[0][1] == first[0][0] + 1
