"""Environment episodes: horizon, rewards, discounting, masks and observations by reference."""

import asyncio
import logging

import pytest
import torch

from areno.rollout.store import InProcessStore, StoreRef, fetch_refs, release_refs
from areno.types import SamplingParams
from areno.workflows.env import (
    ArithmeticRetryEnv,
    Environment,
    EnvWorkflow,
    Observation,
    StepResult,
    arithmetic_retry_workflow,
)

PARAMS = SamplingParams(max_new_tokens=8)


def test_retry_env_episode_text_mode(scripted, char_tokenizer):
    rollout = scripted(["5", "7"])  # wrong, then right
    wf = arithmetic_retry_workflow(
        tokenizer=char_tokenizer,
        sampling_params=PARAMS,
        n_samples=1,
        reward_fn=None,
        prompt_key="prompt",
        answer_key="answer",
    )
    (traj,) = asyncio.run(wf.run_episode(rollout, {"prompt": "3+4=", "answer": "7"}))
    assert traj.info["env_steps"] == 2 and traj.info["num_turns"] == 2
    # turn 1: wrong but all digits (format reward 0.1 x 1.0); turn 2: right
    assert traj.info["turn_rewards"] == [0.1, 1.0] and traj.info["env_return"] == pytest.approx(1.1)
    assert traj.reward == pytest.approx(0.1 + 0.5 * 1.0)  # gamma = 0.5
    eos = char_tokenizer.eos_token_id
    enc = lambda s: char_tokenizer.encode(s, add_special_tokens=False)
    feedback = enc(ArithmeticRetryEnv.FEEDBACK + "3+4=")
    assert traj.prompt_ids == enc("3+4=")
    assert traj.completion_ids == enc("5") + [eos] + feedback + enc("7") + [eos]
    assert traj.completion_mask == [1, 1] + [0] * len(feedback) + [1, 1]
    assert traj.versions == [3, 3] + [-1] * len(feedback) + [3, 3]
    # the second prompt the engine saw is exactly the first turn continued
    assert rollout.prompts[1] == enc("3+4=") + enc("5") + [eos] + feedback


def test_format_reward_shaping():
    env = ArithmeticRetryEnv({"prompt": "3+4=", "answer": "7"}, format_reward=0.5)
    assert env.step("7").reward == 1.0 and env.step("7").done
    assert env.step("1x").reward == pytest.approx(0.25) and not env.step("1x").done
    assert env.step("").reward == 0.0 and env.step("ab\n7").reward == 0.0
    with pytest.raises(ValueError, match="format_reward"):
        ArithmeticRetryEnv({"prompt": "p", "answer": "a"}, format_reward=1.0)


def test_horizon_caps_the_episode(scripted, char_tokenizer):
    wf = EnvWorkflow(char_tokenizer, PARAMS, env_factory=ArithmeticRetryEnv, horizon=3, n_samples=2, gamma=0.9)
    group = asyncio.run(wf.run_episode(scripted(["1"] * 6), {"prompt": "3+4=", "answer": "7"}))
    assert len(group) == 2 and len({t.group_id for t in group}) == 1
    assert all(t.info["env_steps"] == 3 and t.reward == 0.0 for t in group)


class GridEnv(Environment):
    """Returns a big board tensor (by reference) and a small one (inline) each step; done after 2."""

    def __init__(self, sample):
        self.t = 0

    async def reset(self, sample):
        return Observation(
            text="start", tensors={"board": torch.arange(1024, dtype=torch.float32), "pos": torch.tensor([0, 0])}
        )

    def step(self, action):
        self.t += 1
        obs = Observation(text=f"obs{self.t}", tensors={"board": torch.full((512,), float(self.t))})
        return StepResult(observation=obs, reward=float(action == "go"), done=self.t >= 2)


def test_large_observations_travel_by_reference(scripted, char_tokenizer):
    store = InProcessStore()
    wf = EnvWorkflow(
        char_tokenizer,
        PARAMS,
        env_factory=GridEnv,
        horizon=4,
        mode="chat",
        store=store,
        ref_threshold_bytes=1024,
        gamma=1.0,
    )
    rollout = scripted(["go", "stop"])
    (traj,) = asyncio.run(wf.run_episode(rollout, {"prompt": "p"}))
    refs = traj.info["observation_refs"]
    assert [(r["step"], r["name"]) for r in refs] == [(0, "board"), (0, "pos"), (1, "board")]
    assert isinstance(refs[0]["ref"], StoreRef) and refs[0]["ref"].nbytes == 4096 and "value" in refs[1]
    assert len(store) == 2  # only the large tensors are stored
    fetched = fetch_refs(traj.info, store)["observation_refs"]
    torch.testing.assert_close(fetched[0]["ref"], torch.arange(1024, dtype=torch.float32))
    torch.testing.assert_close(fetched[2]["ref"], torch.ones(512))
    assert traj.reward == 1.0 and traj.info["turn_rewards"] == [1.0, 0.0]
    # chat mode: the observation text is the user turn, rendered by the chat template
    second_prompt = char_tokenizer.decode(rollout.prompts[1])
    assert second_prompt.endswith("<|im_start|>user\nobs1<|im_end|>\n<|im_start|>assistant\n")
    assert release_refs(traj.info, store) == 2 and len(store) == 0


class ExplodingEnv(ArithmeticRetryEnv):
    def step(self, action):
        raise RuntimeError("env crashed")


def test_failing_env_episode_is_dropped_with_a_message(scripted, char_tokenizer, caplog):
    wf = EnvWorkflow(char_tokenizer, PARAMS, env_factory=ExplodingEnv, horizon=2)
    with caplog.at_level(logging.WARNING, logger="areno.workflows"):
        assert asyncio.run(wf.run_episode(scripted(["1"]), {"prompt": "3+4=", "answer": "7"})) is None
    assert "environment episode 0 of row prompt='3+4=' raised RuntimeError: env crashed; dropped" in caplog.text


class FlakyGridEnv(GridEnv):
    """GridEnv whose step 2 raises (``"raise"``), never returns (``"hang"``, saying so in ``hanging``)
    or goes on (``"ok"``)."""

    def __init__(self, sample, fate, hanging):
        super().__init__(sample)
        self.fate, self.hanging = fate, hanging

    async def step(self, action):
        if self.t == 1 and self.fate == "raise":
            raise RuntimeError("env crashed")
        if self.t == 1 and self.fate == "hang":
            self.hanging.put_nowait(self)
            await asyncio.Event().wait()
        return super().step(action)


@pytest.mark.parametrize("fates", [("ok", "raise"), ("ok", "hang"), ("hang", "hang")])
def test_dropped_episodes_release_their_stored_observations(scripted, char_tokenizer, fates):
    """walk39a: an episode that raised or timed out, or a group cancelled (a staleness abort), kept its
    large observations in the store for the rest of the run: only returned trajectories are released."""
    store = InProcessStore()
    made, hanging = iter(fates * 4), {}
    wf = EnvWorkflow(
        char_tokenizer,
        PARAMS,
        env_factory=lambda sample: FlakyGridEnv(sample, next(made), hanging["queue"]),
        horizon=4,
        n_samples=2,
        store=store,
        timeout_s=0.5 if fates == ("ok", "hang") else 60,
    )

    async def agroup():
        hanging["queue"] = asyncio.Queue()
        episode = asyncio.ensure_future(wf.run_episode(scripted(lambda prompt: "go"), {"prompt": "p"}))
        if fates == ("hang", "hang"):
            for _ in fates:  # both episodes wait in their second step
                await hanging["queue"].get()
            episode.cancel()
        return await asyncio.gather(episode, return_exceptions=True)

    for _ in range(3):
        (group,) = asyncio.run(agroup())
        if isinstance(group, list):
            assert len(group) == 1 and len(store) == 2  # the finished episode's two boards
            release_refs([t.info for t in group], store)  # as the engine does after the step
        assert len(store) == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"horizon": 0}, "horizon must be >= 1"),
        ({"mode": "voice"}, "mode must be"),
        ({"gamma": 2.0}, "gamma"),
        ({"env_factory": 3}, "env_factory must be a callable"),
    ],
)
def test_bad_env_config(char_tokenizer, kwargs, message):
    with pytest.raises(ValueError, match=message):
        EnvWorkflow(char_tokenizer, PARAMS, **{"env_factory": ArithmeticRetryEnv, **kwargs})


def test_the_executor_store_reaches_workflows_that_take_one(scripted, char_tokenizer):
    from areno.engine.executor import WorkflowExecutor
    from areno.workflows import RLVRWorkflow, calculator_workflow, store_kwargs, takes_store
    from areno.workflows.base import load_workflow

    assert takes_store(EnvWorkflow) and takes_store("areno.workflows.env:arithmetic_retry_workflow")
    assert takes_store(RLVRWorkflow)  # image prompts put their pixels in the store
    # a factory that only forwards **kwargs, and workflows without the parameter, get nothing
    assert not takes_store(calculator_workflow)
    assert not takes_store(lambda **kwargs: None)
    store = InProcessStore()
    assert store_kwargs("areno.workflows.agent:calculator_workflow", store) == {}
    assert store_kwargs(EnvWorkflow, None) == {}
    assert store_kwargs(EnvWorkflow, store, {"store": "mine"}) == {}  # the user's workflow_kwargs win
    path = "areno.workflows.env:arithmetic_retry_workflow"
    wf = load_workflow(
        path,
        tokenizer=char_tokenizer,
        sampling_params=PARAMS,
        n_samples=1,
        reward_fn=None,
        prompt_key="prompt",
        answer_key="answer",
        **store_kwargs(path, store),
    )
    assert wf.store is store
    # end to end: the episode's large observation lands in the executor's store, by reference
    wf = EnvWorkflow(
        char_tokenizer, PARAMS, env_factory=GridEnv, horizon=2, mode="text", **store_kwargs(EnvWorkflow, store)
    )
    executor = WorkflowExecutor(scripted(lambda prompt: "go"), wf, store=store)
    (traj,) = executor.rollout_batch([{"prompt": "p"}])
    ref = traj.info["observation_refs"][0]["ref"]
    assert executor.store is wf.store is store and len(store) == 2
    torch.testing.assert_close(ref.fetch(store), torch.arange(1024, dtype=torch.float32))


def test_sort_retry_rows_and_target_key(scripted, char_tokenizer):
    from areno.workflows.env import sort_retry_rows

    rows = sort_retry_rows(200, 0, lazy_fraction=0.6)
    assert rows == sort_retry_rows(200, 0, lazy_fraction=0.6)
    for r in rows:
        given = r["prompt"].removeprefix("sort ").rstrip(":")
        assert r["target"] == "".join(sorted(given)) and r["answer"] in (given, r["target"])
    lazy = sum(r["answer"] != r["target"] for r in rows) / len(rows)
    assert 0.4 < lazy < 0.7  # 0.6 minus the prompts that were already sorted
    held_out = sort_retry_rows(64, 0, split="eval")
    assert all(r["answer"] == r["target"] for r in held_out)
    assert not {r["prompt"] for r in rows} & {r["prompt"] for r in held_out}
    with pytest.raises(ValueError, match="lazy_fraction"):
        sort_retry_rows(1, 0, lazy_fraction=2.0)
    # the environment grades against the target, not the (lazy) demonstration
    row = {"prompt": "sort 627:", "answer": "627", "target": "267"}
    wf = arithmetic_retry_workflow(
        tokenizer=char_tokenizer,
        sampling_params=PARAMS,
        n_samples=1,
        reward_fn=None,
        target_key="target",
        format_reward=0.0,
        gamma=0.5,
    )
    (traj,) = asyncio.run(wf.run_episode(scripted(["627", "267"]), row))
    assert traj.info["turn_rewards"] == [0.0, 1.0] and traj.reward == 0.5
    with pytest.raises(ValueError, match="has no field 'target'"):
        ArithmeticRetryEnv({"prompt": "p", "answer": "a"}, target_key="target")
    with pytest.raises(ValueError, match="format_reward"):
        arithmetic_retry_workflow(tokenizer=char_tokenizer, sampling_params=PARAMS, format_reward=1.5)


def test_shipped_multiturn_data_is_held_out():
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "examples"
    train = [json.loads(line) for line in (root / "agent_multiturn_train.jsonl").read_text().splitlines()]
    held_out = [json.loads(line) for line in (root / "agent_multiturn_eval.jsonl").read_text().splitlines()]
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    for r in train + held_out:
        assert r["target"] == "".join(sorted(r["prompt"].removeprefix("sort ").rstrip(":")))
    assert all(r["answer"] == r["target"] for r in held_out)  # the eval reward grades `answer`
