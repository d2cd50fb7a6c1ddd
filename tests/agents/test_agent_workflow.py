"""AgentWorkflow: bad agents lose only their own episode; the calculator agent end to end (scripted)."""

import asyncio
import json
import logging

import pytest

from areno.api.types import SamplingParams
from areno.api.workflow import load_workflow
from areno.observe.session import configure_sessions, load_sessions
from areno.workflows.agent import AgentWorkflow, calculator_agent, calculator_rows, calculator_workflow
from areno.workflows.tools import CALCULATOR_SCHEMA, ToolSet, calculator_tool

PARAMS = SamplingParams(max_new_tokens=80)
ROW = {"prompt": "12*34=", "answer": "x", "result": "408"}
CALL = '<tool_call>{"name":"calc","arguments":{"expr":"12*34"}}</tool_call>'


def workflow(tok, agent, **kw):
    return AgentWorkflow(tok, PARAMS, agent=agent, **kw)


def test_bad_agents_lose_only_their_episode(scripted, char_tokenizer, caplog):
    calls = {"n": 0}

    async def flaky(client, sample):
        calls["n"] += 1
        k = calls["n"]
        resp = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        if k == 1:
            await asyncio.sleep(3600)  # never returns
        if k == 2:
            raise RuntimeError("agent bug")
        if k == 3:
            return None  # no reward set: warned, counted 0
        return 1.0

    wf = workflow(char_tokenizer, flaky, n_samples=4, timeout_s=0.5, export_style="individual")
    with caplog.at_level(logging.WARNING, logger="areno.workflows"):
        group = asyncio.run(wf.run_episode(scripted(lambda p: "ok"), {"id": 7, "prompt": "hi"}))
    assert sorted(t.reward for t in group) == [0.0, 1.0] and len({t.group_id for t in group}) == 1
    assert "agent episode 0 of row id='7' did not return within timeout_s=0.5s; dropped" in caplog.text
    assert "agent episode 1 of row id='7' raised RuntimeError: agent bug; dropped" in caplog.text
    assert "1 of 1 interactions have no reward" in caplog.text


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
    wf = calculator_workflow(tokenizer=char_tokenizer, sampling_params=PARAMS, n_samples=1, reward_fn=None,
                             prompt_key="prompt", answer_key="answer")
    (traj,) = asyncio.run(wf.run_episode(scripted([CALL]), ROW))
    assert traj.reward == 1.0 and traj.info["num_turns"] == 1
    assert traj.completion_ids[:-1] == char_tokenizer.encode(CALL, add_special_tokens=False)
    wrong = asyncio.run(wf.run_episode(scripted([CALL.replace("34", "35")]), ROW))
    # a valid call ends the episode; one operand of two copied right earns 0.5 x 1/2
    assert wrong[0].reward == 0.25 and wrong[0].info["num_turns"] == 1
    plain = AgentWorkflow(char_tokenizer, PARAMS, agent=calculator_agent)
    assert asyncio.run(plain.run_episode(scripted([CALL.replace("34", "35")]), ROW))[0].reward == 0.0


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
    wf = load_workflow("areno.workflows.agent:calculator_workflow", tokenizer=char_tokenizer, reward_fn=None,
                       n_samples=4, sampling_params=PARAMS, prompt_key="prompt", answer_key="answer")
    assert isinstance(wf, AgentWorkflow) and wf.n_samples == 4
    wf = load_workflow("areno.workflows.env:arithmetic_retry_workflow", tokenizer=char_tokenizer, reward_fn=None,
                       n_samples=2, sampling_params=PARAMS, prompt_key="prompt", answer_key="answer")
    assert wf.horizon == 3


def test_calculator_rows():
    rows = calculator_rows(3, seed=0)
    assert rows == calculator_rows(3, seed=0)
    for r in rows:
        a, b = r["prompt"].rstrip("=").split("*")
        assert r["result"] == str(int(a) * int(b)) and r["answer"].startswith("<tool_call>")


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
