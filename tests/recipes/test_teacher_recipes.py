"""Teacher-driven recipes on real two-role runs: the teacher executes with probability beta
(``TeacherMixtureWorkflow``), its tokens reach the loss as ``teacher_executed_T``, and the mixed
DAgger/OPD loss equals the hand-computed value at beta = 1, 0 and between; the shipped DAgger,
AggreVaTe, OPD and mixed examples run three passes; AggreVaTe's Q sources."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from areno.algo import masked_whiten_T
from areno.api.config import load_config
from areno.api.trainer import Trainer
from areno.data.tokenizer import build_char_tokenizer
from areno.errors import ConfigError, DataError
from areno.models.hf_io import init_model_dir, load_model, tiny_config
from areno.recipes import get_recipe
from areno.types import SamplingParams, TokenBatch, Trajectory
from areno.workflows.teacher import TeacherMixtureWorkflow
from tests.helpers.configs import shrunk_example_overrides, tiny_run_overrides
from tests.helpers.recipes import naive_logprobs
from tests.helpers.rewards import sevens_and_length

ROOT = Path(__file__).resolve().parents[2]
TINY = {"hidden_size": 32, "layers": 1, "heads": 2, "kv_heads": 1, "intermediate_size": 64}
MIXTURE = "rollout.workflow=areno.workflows.teacher:TeacherMixtureWorkflow"


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory) -> Path:
    tok = build_char_tokenizer()
    return init_model_dir(tmp_path_factory.mktemp("teacher") / "hf", tiny_config(len(tok), **TINY), tok, seed=7)


def _traj(n_prompt: int, n: int, **extra_T) -> Trajectory:
    return Trajectory(
        prompt_ids=list(range(1, n_prompt + 1)),
        completion_ids=list(range(10, 10 + n)),
        logprobs=[-1.0] * n,
        versions=[0] * n,
        reward=0.0,
        extra_T=extra_T,
    )


def test_trajectory_extras_reach_the_batch():
    """extra_T is packed per token (0 on prompts and where a trajectory lacks the key) and follows select()."""
    batch = TokenBatch.from_trajectories([_traj(2, 3, teacher_executed_T=[1.0, 1.0, 0.0]), _traj(1, 2)])
    assert batch.extra["teacher_executed_T"].tolist() == [0, 0, 1, 1, 0, 0, 0, 0]
    assert batch.select([1, 0]).extra["teacher_executed_T"].tolist() == [0, 0, 0, 0, 0, 1, 1, 0]
    with pytest.raises(ValueError, match="extra_T"):
        _traj(1, 2, teacher_executed_T=[1.0])


def _mixture_overrides(tmp_path, teacher_dir, workflow_kwargs: str, beta: float = 0.5) -> list[str]:
    """A tiny mixed_loss_dagger_opd run with the teacher-mixture workflow (``workflow_kwargs`` last)."""
    return tiny_run_overrides(tmp_path) + [
        "train.algorithm=mixed_loss_dagger_opd",
        f"train.algorithm_kwargs={{teacher_path: {teacher_dir}, beta_start: {beta}, beta_end: {beta}}}",
        MIXTURE,
        f"rollout.workflow_kwargs={workflow_kwargs}",
    ]


@pytest.mark.parametrize("beta", [1.0, 0.0, 0.25])
def test_mixed_loss_on_a_two_role_run(beta, tmp_path, teacher_dir):
    """loss = sum_t [beta CE_t e_t + (1 - beta) k2_t (1 - e_t)] / #loss tokens, with e_t the
    teacher-executed mask the workflow recorded, CE and k2 (k3 logged) from naive forwards of both checkpoints."""
    overrides = _mixture_overrides(tmp_path, teacher_dir, "{beta: 0.5, teacher_kv_blocks: 64}", beta=beta)
    trainer = Trainer.init(load_config(None, overrides))
    try:
        rollout = trainer.rollout_token_batch(0)
        student = load_model(tmp_path / "model", dtype=torch.float32)[0]  # the weights before the step
        metrics = trainer.train(0, rollout)
    finally:
        trainer.shutdown()
    batch = rollout.batch
    teacher = load_model(teacher_dir, dtype=torch.float32)[0]
    with torch.no_grad():
        s_T, t_T = naive_logprobs(student, batch), naive_logprobs(teacher, batch)
    mask = batch.loss_mask_T.tolist()
    executed = batch.extra["teacher_executed_T"].tolist()
    flags = [t.info["teacher"] for t in rollout.trajectories]
    assert any(flags) and not all(flags)  # both executed in this rollout
    ce = k2 = k3 = 0.0
    for i, m in enumerate(mask):
        if not m:
            continue
        # the behaviour log-probs are those of the model that generated the token
        generator = t_T if executed[i] else s_T
        assert batch.logprobs_T[i].item() == pytest.approx(generator[i].item(), abs=1e-4)
        s, t = s_T[i].item(), t_T[i].item()
        if executed[i]:
            ce += -s
        else:
            k2 += 0.5 * (s - t) ** 2
            k3 += math.exp(t - s) - (t - s) - 1
    n = sum(mask)
    expected = (beta * ce + (1 - beta) * k2) / n
    assert metrics["train/policy/mixed/beta"] == pytest.approx(beta)
    assert metrics["train/policy/loss"] == pytest.approx(expected, rel=1e-4)
    if beta == 1.0:  # cross-entropy on the teacher's tokens: no longer 0 at version 0
        assert metrics["train/policy/loss"] > 0.1
        assert metrics["train/policy/mixed/ce"] == pytest.approx(ce / n, rel=1e-4)
    if beta == 0.0:  # pure OPD on the student's tokens
        assert metrics["train/policy/loss"] == pytest.approx(k2 / n, rel=1e-4)
        assert metrics["train/policy/mixed/k3"] == pytest.approx(k3 / n, rel=1e-4)


def test_aggrevate_teacher_q_on_a_two_role_run(tmp_path, teacher_dir):
    """AggreVaTe with teacher roll-outs: Q at the drawn token is the reward of the student's prefix
    plus the teacher's continuation, and loss = sum_t -whiten(Q)_t log pi(a_t | s_t) / #measured
    tokens over the measured tokens only."""
    overrides = tiny_run_overrides(tmp_path) + [
        "train.algorithm=aggrevate",
        f"train.algorithm_kwargs={{teacher_path: {teacher_dir}, q_source: workflow}}",
        "rollout.workflow=areno.workflows.teacher:TeacherQWorkflow",
        "rollout.workflow_kwargs={teacher_kv_blocks: 64}",
    ]
    trainer = Trainer.init(load_config(None, overrides))
    try:
        rollout = trainer.rollout_token_batch(0)
        student = load_model(tmp_path / "model", dtype=torch.float32)[0]
        metrics = trainer.train(0, rollout)
    finally:
        trainer.shutdown()
    batch, trajs = rollout.batch, rollout.trajectories
    tok = build_char_tokenizer()
    qs = []
    for traj in trajs:
        t = traj.extra_T["teacher_q_mask_T"].index(1.0)
        assert sum(traj.extra_T["teacher_q_mask_T"]) == 1
        scored = traj.info["q_completion"]
        assert scored.startswith(tok.decode(traj.completion_ids[: t + 1], skip_special_tokens=True))
        q = sevens_and_length(traj.info["prompt"], scored, traj.info["answer"])
        assert traj.extra_T["teacher_q_T"][t] == pytest.approx(q)
        qs.append(q)
    assert any(traj.info["q_completion"] != traj.info["completion"] for traj in trajs)  # the teacher rolled out
    with torch.no_grad():
        s_T = naive_logprobs(student, batch)
    measured = (batch.extra["teacher_q_mask_T"] > 0) & batch.loss_mask_T
    q_t = torch.tensor(qs, dtype=torch.float64)
    adv = (q_t - q_t.mean()) / (q_t.std() + 1e-8)  # sequences in order: one measured token each
    expected = float(-(adv * s_T[measured].double()).sum() / measured.sum())
    assert metrics["train/policy/loss_denominator"] == float(measured.sum())
    assert metrics["train/policy/loss"] == pytest.approx(expected, rel=1e-4, abs=1e-6)


EXAMPLES = ["dagger", "aggrevate", "opd", "mixed_dagger_opd"]


@pytest.mark.parametrize("name", EXAMPLES)
def test_teacher_example_runs_three_passes(name, tmp_path, teacher_dir):
    """The shipped example, shrunk: one rollout trained on three times (train.num_train_passes: 3)."""
    path = ROOT / "examples" / f"{name}.yaml"
    kwargs = dict(load_config(path, []).train.algorithm_kwargs, teacher_path=str(teacher_dir))
    overrides = shrunk_example_overrides(tmp_path, kwargs)
    cfg = load_config(path, overrides)
    assert cfg.train.num_train_passes == 3
    trainer = Trainer.init(cfg)
    passes, rollouts = [], []
    train, rollout_batch = trainer.train, trainer.rollout_token_batch
    trainer.train = lambda rollout_id, rollout: passes.append(train(rollout_id, rollout)) or passes[-1]
    trainer.rollout_token_batch = lambda rollout_id: rollouts.append(rollout_batch(rollout_id)) or rollouts[-1]
    try:
        trainer.run()
    finally:
        trainer.shutdown()
    assert len(rollouts) == 1 and len(passes) == 3
    executed = rollouts[0].batch.extra.get("teacher_executed_T")
    if cfg.rollout.workflow.endswith("TeacherMixtureWorkflow"):  # the teacher generated some completions
        assert executed is not None and 0 < executed.sum() < rollouts[0].batch.loss_mask_T.sum()
    else:
        assert executed is None
    if cfg.rollout.workflow.endswith("TeacherQWorkflow"):  # one measured action value per sequence
        assert rollouts[0].batch.extra["teacher_q_mask_T"].sum() == rollouts[0].batch.num_seqs
    assert all(math.isfinite(m["train/policy/loss"]) for m in passes)


def test_aggrevate_q_sources():
    """An unknown Q source is refused; a value-head or reward-model Q needs its checkpoint path;
    q_source=workflow uses the workflow's teacher_q_T (and refuses a batch without it) instead of
    the log-prob proxy."""
    with pytest.raises(ConfigError, match="q_source='critic' is not supported"):
        get_recipe("aggrevate", teacher_path="/t", policy_kwargs={"q_source": "critic"})
    with pytest.raises(ConfigError, match="set train.algorithm_kwargs.value_head_path"):
        get_recipe("aggrevate", policy_kwargs={"q_source": "value_head"})
    spec = get_recipe("aggrevate", teacher_path="/t", policy_kwargs={"q_source": "workflow"}).policy_role.build()
    q = [0.5, -1.0, 2.0]
    batch = TokenBatch.from_trajectories([_traj(2, 3, teacher_q_T=q)])
    batch.extra["teacher_logprobs_T"] = torch.zeros(batch.num_tokens)
    prepared = spec.prepare_batch(batch)
    expected = masked_whiten_T(batch.extra["teacher_q_T"], batch.loss_mask_T)
    assert torch.allclose(prepared.advantages_T, expected)
    del batch.extra["teacher_q_T"]
    with pytest.raises(DataError, match="teacher_q_T"):
        spec.prepare_batch(batch)


def _mixture(**kwargs):
    return TeacherMixtureWorkflow(build_char_tokenizer(), lambda *a, **k: 0.0, 8, SamplingParams(), **kwargs)


def test_mixture_draws():
    """beta 0 and 1 are all-student and all-teacher; a draw repeats for the same run; beta > 0 needs a teacher."""
    assert _mixture(beta=0.0).draws([1, 2]) == [None] * 8
    assert None not in _mixture(beta=1.0, teacher_path="/t").draws([1, 2])
    a, b = _mixture(beta=0.5, teacher_path="/t", seed=1), _mixture(beta=0.5, teacher_path="/t", seed=1)
    assert a.draws([1, 2]) == b.draws([1, 2]) and a.draws([3]) == b.draws([3])
    with pytest.raises(ConfigError, match="teacher's checkpoint"):
        _mixture(beta=0.5)
    with pytest.raises(ConfigError, match=r"in \[0, 1\]"):
        _mixture(beta=1.5, teacher_path="/t")


def test_the_teacher_engine_leaves_what_the_training_side_will_take(tmp_path, teacher_dir, monkeypatch):
    """walk34: the teacher's engine, built at its first request in the trainer's process, sized its KV pool from
    80% of the memory free then, which held what the first training step still allocates; the run now passes
    the training side's bytes to come on the teacher's device (a user's own setting wins)."""
    from areno.engine.api import ArenoEngine

    monkeypatch.setattr(ArenoEngine, "training_bytes_to_come", lambda self, device: 4321)
    overrides = _mixture_overrides(tmp_path, teacher_dir, "{beta: 0.5}")
    trainer = Trainer.init(load_config(None, overrides))
    try:
        workflow = trainer.backend.engine.workflow
        assert workflow.teacher_kv_reserved_bytes == 4321
        assert workflow.teacher_client().engine.config.kv_reserved_bytes == 4321
    finally:
        trainer.shutdown()
    own = Trainer.init(
        load_config(None, [*overrides[:-1], "rollout.workflow_kwargs={beta: 0.5, teacher_kv_reserved_bytes: 7}"])
    )
    try:
        assert own.backend.engine.workflow.teacher_kv_reserved_bytes == 7
    finally:
        own.shutdown()


def test_a_teacher_device_other_than_the_current_one_is_refused_at_start_up(tmp_path, teacher_dir, monkeypatch):
    """walk35: teacher_device=cuda:1 reached the engine's current-device refusal at the first teacher request, in
    the middle of a rollout; it is named when the run starts."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    overrides = _mixture_overrides(tmp_path, teacher_dir, "{beta: 0.5, teacher_device: 'cuda:1'}")
    with pytest.raises(ConfigError, match=r"teacher_device=cuda:1: the teacher's engine runs in the trainer's process"):
        Trainer.init(load_config(None, overrides))


def test_a_frozen_roles_forwards_reserve_no_training_memory(tmp_path, monkeypatch):
    """walk35: the training side's bytes to come took the largest micro-batch activations of every role, a frozen
    teacher's included, whose forwards keep nothing for a backward (and a larger teacher has the larger estimate)."""
    tok = build_char_tokenizer()
    shape = dict(hidden_size=64, layers=2, heads=4, kv_heads=2, intermediate_size=256)
    big = init_model_dir(tmp_path / "big_teacher", tiny_config(len(tok), **shape), tok, seed=3)
    overrides = tiny_run_overrides(tmp_path) + ["train.algorithm=opd", f"train.algorithm_kwargs.teacher_path={big}"]
    trainer = Trainer.init(load_config(None, overrides))
    try:
        side = trainer.backend.engine.training
        backends = side.runner.backends
        policy, teacher = backends["policy"], backends["teacher"]
        assert not teacher.cfg.trainable and teacher.activation_bytes() > policy.activation_bytes()
        monkeypatch.setattr(side, "device", torch.device("cuda"))
        assert side.device_bytes_to_come() == policy.lazy_state_bytes() + policy.activation_bytes()
    finally:
        trainer.shutdown()
