"""TeacherQWorkflow's per-state baseline (``rollout.workflow_kwargs.q_baseline``): with ``teacher`` the
value written at the measured token is A = Q(s_t, a_t) - V(s_t), V a teacher roll-out from the prefix
before t; with ``none`` it is Q alone; anything else is a one-line ConfigError."""

from __future__ import annotations

import asyncio

import pytest
import torch

from areno.api.config import load_config
from areno.api.trainer import Trainer
from areno.data.tokenizer import build_char_tokenizer
from areno.errors import ConfigError
from areno.models.hf_io import init_model_dir, tiny_config
from areno.types import GenerationOutput, SamplingParams
from areno.workflows.teacher import TeacherQWorkflow
from tests.helpers.configs import tiny_run_overrides

ANSWER = "1234"
MAX_NEW = 5
TOK = build_char_tokenizer()


def _out(prompt_ids: list[int], ids: list[int], finish_reason: str) -> GenerationOutput:
    n = len(ids)
    return GenerationOutput(
        request_id="r",
        prompt_ids=list(prompt_ids),
        output_ids=ids,
        output_logprobs=[-0.5] * n,
        output_versions=[0] * n,
        finish_reason=finish_reason,
    )


class _Student:
    """Returns the completions of ``COMPLETIONS`` in turn (one per request)."""

    COMPLETIONS = [("13", "stop"), ("1234", "stop"), ("9234", "stop"), ("12399", "length")]

    def __init__(self) -> None:
        self.calls = 0

    async def agenerate(self, prompt_ids, sampling_params, *, request_id=None):
        text, finish = self.COMPLETIONS[self.calls % len(self.COMPLETIONS)]
        self.calls += 1
        ids = TOK.encode(text) + ([TOK.eos_token_id] if finish == "stop" else [])
        return _out(prompt_ids, ids, finish)


class _Teacher:
    """A teacher that writes the answer's characters from the position it is asked at (the prefix's
    length), as many as ``max_new_tokens`` allows; records each request."""

    def __init__(self, n_prompt: int) -> None:
        self.n_prompt = n_prompt
        self.requests: list[tuple[int, int, int]] = []  # (prefix length, budget, seed)

    async def agenerate(self, prompt_ids, params, *, request_id=None):
        k = len(prompt_ids) - self.n_prompt
        self.requests.append((k, params.max_new_tokens, params.seed))
        return _out(prompt_ids, TOK.encode(ANSWER[k:][: params.max_new_tokens]), "stop")


def _reward(prompt, completion, answer=None, **row):
    """The share of the answer's characters in place (so Q and V take several values)."""
    return sum(a == b for a, b in zip(completion, answer)) / len(answer)


def _workflow(**kwargs) -> TeacherQWorkflow:
    params = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW)
    return TeacherQWorkflow(TOK, _reward, 4, params, teacher_path="/unused", seed=5, **kwargs)


def _episodes(wf: TeacherQWorkflow, n: int):
    prompt = "sort 4321:"
    teacher = _Teacher(len(TOK.encode(prompt)))
    wf._teacher = teacher  # the workflow's teacher engine, replaced by the stub

    async def run():
        student = _Student()
        return [await wf.run_episode(student, {"prompt": prompt, "answer": ANSWER}) for _ in range(n)]

    return [traj for group in asyncio.run(run()) for traj in group], teacher


@pytest.mark.parametrize("q_baseline", ["teacher", "none"])
def test_the_written_value_is_q_minus_the_teachers_value_from_the_state_before(q_baseline):
    """Q: the reward of the student's prefix through t plus the teacher's continuation (the student's
    own text where it stopped at t or the budget is spent); V: of the prefix before t plus the
    teacher's continuation, which chooses token t itself, with the remaining budget and a seed of its own."""
    trajs, teacher = _episodes(_workflow(q_baseline=q_baseline), 6)
    seen_t, written, q_requests = set(), [], 0
    for traj in trajs:
        text = TOK.decode(traj.completion_ids, skip_special_tokens=True)
        n = len(traj.completion_ids)
        mask = traj.extra_T["teacher_q_mask_T"]
        assert sum(mask) == 1
        t = mask.index(1.0)
        seen_t.add(t)
        stopped_at_t = t == n - 1 and traj.finish_reason == "stop"
        q_requests += not stopped_at_t and t + 1 < MAX_NEW  # else Q is the student's own reward
        q = _reward(None, text if stopped_at_t else text[: t + 1] + ANSWER[t + 1 :][: MAX_NEW - t - 1], ANSWER)
        v = _reward(None, text[:t] + ANSWER[t:][: MAX_NEW - t], ANSWER)
        expected = q - v if q_baseline == "teacher" else q
        assert traj.info["q_value"] == pytest.approx(q)
        assert traj.extra_T["teacher_q_T"] == pytest.approx([expected if i == t else 0.0 for i in range(n)])
        assert ("v_value" in traj.info) == (q_baseline == "teacher")
        written.append(expected)
    assert len(seen_t) > 2  # several positions were measured, the stop token among them
    if q_baseline == "teacher":
        assert len(teacher.requests) == q_requests + len(trajs)  # one V roll-out per measured token
        assert any(a < 0 for a in written) and any(a == 0 for a in written)
        assert len({seed for _, _, seed in teacher.requests}) == len(teacher.requests)  # each its own seed
    else:
        assert len(teacher.requests) == q_requests


def test_the_baseline_changes_no_draw_of_q():
    """q_baseline=none is the default (the measurement before the option); the baseline measures Q at
    the same token with the same seed as without it."""
    assert _workflow().q_baseline == "none"
    with_v, teacher_v = _episodes(_workflow(q_baseline="teacher"), 4)
    without, teacher_q = _episodes(_workflow(), 4)
    assert [t.extra_T["teacher_q_mask_T"] for t in with_v] == [t.extra_T["teacher_q_mask_T"] for t in without]
    assert set(teacher_q.requests) <= set(teacher_v.requests)


def test_a_bad_q_baseline_is_one_line():
    with pytest.raises(ConfigError) as exc:
        _workflow(q_baseline="critic")
    assert str(exc.value) == "rollout.workflow_kwargs.q_baseline: must be one of none, teacher, got 'critic'"


def test_q_baseline_reaches_the_workflow_from_the_config(tmp_path):
    """rollout.workflow_kwargs.q_baseline=teacher on an aggrevate run: Q - V is written;
    a bad value stops Trainer.init with the one-line error."""
    tok = build_char_tokenizer()
    teacher = init_model_dir(
        tmp_path / "teacher",
        tiny_config(len(tok), hidden_size=32, layers=1, heads=2, kv_heads=1, intermediate_size=64),
        tok,
        seed=7,
    )
    base = tiny_run_overrides(tmp_path) + [
        "train.algorithm=aggrevate",
        f"train.algorithm_kwargs={{teacher_path: {teacher}, q_source: workflow}}",
        "rollout.workflow=areno.workflows.teacher:TeacherQWorkflow",
    ]
    trainer = Trainer.init(
        load_config(None, [*base, "rollout.workflow_kwargs={teacher_kv_blocks: 64, q_baseline: teacher}"])
    )
    try:
        rollout = trainer.rollout_token_batch(0)
    finally:
        trainer.shutdown()
    for traj in rollout.trajectories:
        t = traj.extra_T["teacher_q_mask_T"].index(1.0)
        assert traj.extra_T["teacher_q_T"][t] == pytest.approx(traj.info["q_value"] - traj.info["v_value"])
        assert traj.info["v_completion"].startswith(tok.decode(traj.completion_ids[:t], skip_special_tokens=True))
    assert torch.equal(rollout.batch.extra["teacher_q_mask_T"].sum(), torch.tensor(float(rollout.batch.num_seqs)))
    bad = load_config(None, [*base, "run_dir=" + str(tmp_path / "bad"), "rollout.workflow_kwargs={q_baseline: critic}"])
    with pytest.raises(
        ConfigError, match="^rollout.workflow_kwargs.q_baseline: must be one of none, teacher, got 'critic'$"
    ):
        Trainer.init(bad)
