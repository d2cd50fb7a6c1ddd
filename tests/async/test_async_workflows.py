import asyncio
import logging

import pytest

from areno.data.tokenizer import build_char_tokenizer
from areno.types import SamplingParams
from areno.workflows.base import RolloutWorkflow, as_group, load_workflow
from areno.workflows.multi_turn import MultiTurnWorkflow
from areno.workflows.rlvr import RLVRWorkflow
from tests.helpers.async_fakes import FakeEngine

TOK = build_char_tokenizer()


def answer_with(text_for_seed):
    def respond(prompt_ids, params):
        return TOK.encode(text_for_seed(params.seed), add_special_tokens=False) + [TOK.eos_token_id]

    return respond


def exact_match(prompt, completion, answer, **fields):
    return float(completion.strip() == str(answer))


def test_load_workflow_by_dotted_path():
    wf = load_workflow(
        "areno.workflows.rlvr.RLVRWorkflow",
        tokenizer=TOK,
        reward_fn=exact_match,
        n_samples=2,
        sampling_params=SamplingParams(),
    )
    assert isinstance(wf, RLVRWorkflow) and wf.n_samples == 2
    assert isinstance(
        load_workflow(
            "areno.workflows.multi_turn:MultiTurnWorkflow",
            tokenizer=TOK,
            reward_fn=exact_match,
            sampling_params=SamplingParams(),
        ),
        RolloutWorkflow,
    )
    with pytest.raises(ValueError, match="cannot import module 'areno.nope'"):
        load_workflow("areno.nope.Workflow")
    with pytest.raises(ValueError, match="has no attribute 'Nope'"):
        load_workflow("areno.workflows.rlvr.Nope")
    with pytest.raises(ValueError, match="not a subclass of areno.workflows.base.RolloutWorkflow"):
        load_workflow("collections.OrderedDict")
    with pytest.raises(ValueError, match="is not a path like"):
        load_workflow("RLVRWorkflow")


def test_rlvr_group_rewards_and_fields():
    seen = []

    def reward(prompt, completion, answer, **fields):
        seen.append((prompt, completion, answer, fields))
        return exact_match(prompt, completion, answer)

    asked = []
    respond = answer_with(lambda seed: "4" if seed % 2 == 0 else "5")
    engine = FakeEngine(lambda ids, params: asked.append(params) or respond(ids, params))
    wf = RLVRWorkflow(TOK, reward, n_samples=4, sampling_params=SamplingParams(seed=10, max_new_tokens=8))
    group = asyncio.run(wf.run_episode(engine, {"prompt": "2+2=", "answer": 4, "level": "easy"}))
    # the workflow decodes the group's completions itself: the engine is not asked for texts
    assert [p.detokenize for p in asked] == [False] * 4 and wf.sampling_params.detokenize
    assert len(group) == 4 and len({t.group_id for t in group}) == 1 and group[0].group_id
    assert [t.reward for t in group] == [1.0, 0.0, 1.0, 0.0]  # seeds 10, 11, 12, 13
    assert group[0].prompt_ids == TOK.encode("2+2=")
    assert group[0].completion_ids == TOK.encode("4", add_special_tokens=False) + [TOK.eos_token_id]
    assert group[0].versions == [0, 0] and group[0].logprobs == [-0.5, -0.5]
    assert seen[0] == ("2+2=", "4", 4, {"level": "easy"})


def test_rlvr_reward_that_raises_scores_zero_and_warns(caplog):
    def broken(prompt, completion, answer, **fields):
        raise ZeroDivisionError("boom")

    wf = RLVRWorkflow(TOK, broken, n_samples=2, sampling_params=SamplingParams(max_new_tokens=8))
    with caplog.at_level(logging.WARNING, logger="areno.workflows"):
        group = asyncio.run(wf.run_episode(FakeEngine(answer_with(lambda s: "x")), {"prompt": "1+1=", "answer": 2}))
    assert [t.reward for t in group] == [0.0, 0.0]
    assert all(t.info["reward_error"] == "ZeroDivisionError: boom" for t in group)
    assert "'1+1='" in caplog.text and "boom" in caplog.text


def test_rlvr_row_without_prompt_is_a_clear_error():
    wf = RLVRWorkflow(TOK, exact_match, n_samples=1, sampling_params=SamplingParams())
    with pytest.raises(ValueError, match=r"row id=7 has no field 'question'.*prompt_key"):
        wf.prompt_key = "question"
        asyncio.run(wf.run_episode(FakeEngine(answer_with(lambda s: "x")), {"id": 7, "prompt": "1+1="}))


def test_multi_turn_feedback_masked_and_reward_discounted():
    feedback = "\nWrong.\n"
    feedback_ids = TOK.encode(feedback, add_special_tokens=False)

    def respond(context_ids, params):
        wrongs = TOK.decode(context_ids).count("Wrong.")
        text = "9" if wrongs < 2 else "7"  # right on the third turn
        return TOK.encode(text, add_special_tokens=False)

    wf = MultiTurnWorkflow(
        TOK, exact_match, SamplingParams(max_new_tokens=4), max_turns=4, turn_discount=0.5, feedback=feedback
    )
    (traj,) = asyncio.run(wf.run_episode(FakeEngine(respond), {"prompt": "3+4=", "answer": 7}))
    nine, seven = TOK.encode("9", add_special_tokens=False), TOK.encode("7", add_special_tokens=False)
    assert traj.completion_ids == nine + feedback_ids + nine + feedback_ids + seven
    f = len(feedback_ids)
    assert traj.completion_mask == [1] + [0] * f + [1] + [0] * f + [1]
    assert traj.versions == [0] + [-1] * f + [0] + [-1] * f + [0]
    assert traj.info["num_turns"] == 3 and traj.info["turn_rewards"] == [0.0, 0.0, 1.0]
    assert traj.reward == pytest.approx(1.0 * 0.5**2)


def test_multi_turn_gives_up_after_max_turns():
    wf = MultiTurnWorkflow(TOK, exact_match, SamplingParams(max_new_tokens=4), max_turns=2, n_samples=3)
    group = asyncio.run(wf.run_episode(FakeEngine(answer_with(lambda s: "0")), {"prompt": "1+1=", "answer": 2}))
    assert len(group) == 3 and len({t.group_id for t in group}) == 1
    assert all(t.info["num_turns"] == 2 and t.reward == 0.0 for t in group)


def test_as_group():
    assert as_group(None) is None and as_group([]) is None
    with pytest.raises(TypeError, match=r"run_episode returned a list holding int at \[0\]; return a Trajectory"):
        as_group([1])
