"""walk6's numerics of the shipped recipes against hand-computed values:

- A1: at rollout.temperature T != 1 every role that scores the rollout's tokens (the policy, a reference,
  a teacher, aggrevate's teacher Q) does so at T, log_softmax(logits / T): with the reference or teacher
  = the policy's weights the step-1 KL is 0 and the loss that of kl_coef = 0;
- A2: train.algorithm_kwargs.temperature is refused, naming rollout.temperature;
- A3: dr_grpo's logged ratio is ~1 on a synchronous run, not divided by its L;
- A4: dr_grpo's L and dapo's overlong lengths follow rollout.max_new_tokens, a length no generation can
  reach is warned about.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

from areno import train
from areno.api.config import load_config
from areno.data.tokenizer import build_char_tokenizer
from areno.engine.api import resolve_recipe
from areno.errors import ConfigError
from areno.models.hf_io import init_model_dir, load_model, tiny_config
from areno.recipes import get_recipe
from areno.recipes import main as recipes_main
from areno.recipes.builtin import LENGTH_WITHOUT_RUN
from areno.recipes.runner import RecipeRunner
from areno.train.optim import build_optimizer, build_scheduler
from areno.types import TokenBatch
from tests.helpers.configs import run_to_end, tiny_run_overrides
from tests.helpers.recipes import completion_positions, grpo_adv, rl_batch

T = 0.5


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory) -> str:
    tok = build_char_tokenizer()
    cfg = tiny_config(len(tok), hidden_size=32, layers=2, heads=4, kv_heads=2, initializer_range=0.3)
    return str(init_model_dir(tmp_path_factory.mktemp("w6") / "policy", cfg, tok, seed=0))


def resolved(policy_dir: str, algorithm: str, *extra: str, temperature: float = T, max_new_tokens: int = 32):
    """The recipe a run of ``algorithm`` trains (``resolve_recipe``, as the engine resolves it)."""
    cfg = load_config(
        None,
        [
            f"model.path={policy_dir}",
            f"train.algorithm={algorithm}",
            f"rollout.temperature={temperature}",
            f"rollout.max_new_tokens={max_new_tokens}",
            *extra,
        ],
    )
    return resolve_recipe(cfg)


@torch.no_grad()
def logprobs_at(model, batch: TokenBatch, temperature: float) -> torch.Tensor:
    """By hand: each sequence alone, log_softmax(logits / T) of its next token, 0 at sequence starts."""
    out = torch.zeros(batch.num_tokens)
    cu = batch.cu_seqlens_B1.tolist()
    for b in range(batch.num_seqs):
        ids = batch.input_ids_T[cu[b] : cu[b + 1]]
        logits = model.logits(model(ids, torch.arange(ids.numel()))).float()
        logp = torch.log_softmax(logits / temperature, -1)
        for t in range(1, ids.numel()):
            out[cu[b] + t] = logp[t - 1, ids[t]]
    return out


def load(path):
    return load_model(path, dtype=torch.float32, device="cpu")[0]


def on_policy_batch(policy_dir: str, temperature: float = T) -> TokenBatch:
    """rl_batch with behaviour log-probs the policy's own at ``temperature`` (a synchronous first step)."""
    batch = rl_batch()
    logp = logprobs_at(load(policy_dir), batch, temperature)
    batch.logprobs_T = torch.where(batch.loss_mask_T, logp, torch.zeros(()))
    return batch


def backends_for(recipe, policy_dir: str) -> dict:
    backends = {}
    for role in recipe.roles:
        cfg = train.TrainBackendConfig(
            lr=1e-2, trainable=role.trainable, device="cpu", max_tokens_per_mb=16, seed=0, grad_clip=None
        )
        backend = train.LocalTrainBackend(cfg)
        backend.initialize(role.model_path or policy_dir)
        wrapped = role.build().wrap_model(backend.model)
        if wrapped is not backend.model:  # the critic's value head (initialize has no wrap hook here)
            backend.model = wrapped
            backend.optimizer = build_optimizer(backend.model.parameters(), cfg, "cpu")
            backend.scheduler = build_scheduler(backend.optimizer, cfg)
        backends[role.name] = backend
    return backends


def step(recipe, policy_dir: str, batch: TokenBatch) -> dict[str, float]:
    return RecipeRunner(recipe, backends_for(recipe, policy_dir)).step(batch)


def k3(s: float, t: float) -> float:
    return math.exp(t - s) + (s - t) - 1


# ------------------------------------------------------------------------------------------------ A1
def test_the_reference_scores_at_the_rollout_temperature_by_hand(policy_dir):
    """The reference role of grpo(kl_coef) at T = 0.5 gives log_softmax(logits / 0.5) of the reference
    model for each token; at T = 1 (the old behaviour) it would differ, and k3 between the two is far from 0."""
    recipe = resolved(policy_dir, "grpo", "train.algorithm_kwargs.kl_coef=0.1")
    assert recipe.role("reference").init_kwargs == {"temperature": T}
    assert recipe.policy_role.init_kwargs["temperature"] == T
    model, batch = load(policy_dir), rl_batch()
    ref_T = recipe.role("reference").build().extract_model_output(model, batch)["logprobs_T"].detach()
    mask = batch.loss_mask_T  # the completion tokens (the role scores no prompt token)
    expected = torch.where(mask, logprobs_at(model, batch, T), torch.zeros(()))
    assert ref_T.tolist() == pytest.approx(expected.tolist(), abs=1e-5)
    # one token by hand, sequence 0's second completion token: z_x / T - logsumexp(z / T)
    assert completion_positions(batch, 0)[1] == 4
    ids = batch.input_ids_T[:5]
    z = model.logits(model(ids, torch.arange(5)))[3].float().detach()
    by_hand = float(z[ids[4]] / T - torch.logsumexp(z / T, -1))
    assert float(ref_T[4]) == pytest.approx(by_hand, abs=1e-5)
    # the old reference at temperature 1 is another distribution: the KL it gave at step 1 was not 0
    at_one = logprobs_at(model, batch, 1.0)
    old_kl = sum(k3(float(expected[t]), float(at_one[t])) for t in range(batch.num_tokens) if mask[t]) / int(mask.sum())
    assert old_kl > 1e-3


def test_every_log_prob_role_of_every_online_recipe_takes_the_rollout_temperature(policy_dir):
    """Reference, teacher (opd, dagger, aggrevate, mixed) and policy: T; the critic and scorer heads take
    none; offline recipes (sft, dpo, reward_model) and greedy rollouts stay at 1."""
    teacher = f"train.algorithm_kwargs.teacher_path={policy_dir}"
    cases = {
        "grpo": ("train.algorithm_kwargs.kl_coef=0.1",),
        "reinforce_pp": (),
        "reinforce_pp_baseline": (),
        "ppo_kl": (),
        "opd": (teacher,),
        "dagger": (teacher,),
        "aggrevate": (teacher,),
        "mixed_loss_dagger_opd": (teacher,),
    }
    for name, extra in cases.items():
        recipe = resolved(policy_dir, name, *extra)
        frozen = [r for r in recipe.roles if r.name in ("reference", "teacher")]
        assert frozen, name
        for role in (recipe.policy_role, *frozen):
            assert role.init_kwargs["temperature"] == T, (name, role.name)
            spec = role.build()
            assert (spec.config if hasattr(spec, "config") else spec).temperature == T, (name, role.name)
        assert all("temperature" not in r.init_kwargs for r in recipe.roles if r.name == "value"), name
    for name in ("sft", "dpo", "reward_model"):
        assert all("temperature" not in r.init_kwargs for r in resolved(policy_dir, name).roles), name
    greedy = resolved(policy_dir, "grpo", "train.algorithm_kwargs.kl_coef=0.1", temperature=0)
    assert all("temperature" not in r.init_kwargs for r in greedy.roles)


@pytest.mark.parametrize(
    "name, kl_on, kl_off",
    [
        ("grpo", ("train.algorithm_kwargs.kl_coef=0.1",), ()),
        ("reinforce_pp", ("train.algorithm_kwargs.kl_coef=0.1",), ("train.algorithm_kwargs.kl_coef=0",)),
        ("ppo_kl", ("train.algorithm_kwargs.kl_coef=0.5",), ("train.algorithm_kwargs.kl_coef=0",)),
    ],
)
def test_the_kl_to_a_reference_with_the_policy_weights_is_zero_at_step_one(policy_dir, name, kl_on, kl_off):
    """At T = 0.5, reference = policy weights, on-policy data: the KL (in the loss for grpo, in the reward
    for reinforce_pp and ppo_kl) is 0 at step 1 and the losses are those of kl_coef = 0."""
    batch = on_policy_batch(policy_dir)
    with_kl = step(resolved(policy_dir, name, *kl_on), policy_dir, batch)
    without = step(resolved(policy_dir, name, *kl_off), policy_dir, batch)
    assert with_kl["policy/actor/kl"] == pytest.approx(0.0, abs=1e-6)
    assert with_kl["policy/actor/ratio"] == pytest.approx(1.0, abs=1e-5)
    for key in ("policy/loss", "policy/actor/pg_loss", "value/loss"):
        if key in without:
            assert with_kl[key] == pytest.approx(without[key], abs=1e-6), key


def test_the_grpo_loss_at_temperature_by_hand(policy_dir):
    """grpo kl_coef=0.1 at T = 0.5, on-policy: ratio 1, k3 0, loss = mean_i mean_t -A_i."""
    batch = on_policy_batch(policy_dir)
    m = step(resolved(policy_dir, "grpo", "train.algorithm_kwargs.kl_coef=0.1"), policy_dir, batch)
    adv = grpo_adv(batch.rewards_B.tolist())
    assert m["policy/loss"] == pytest.approx(sum(-a for a in adv) / 6, abs=1e-5)


def test_opd_with_the_student_as_teacher_distils_nothing(policy_dir):
    """opd and mixed_loss_dagger_opd at T = 0.5 with teacher = student: reverse KL 0 (the audit measured
    0.00464 with the teacher at 1), loss 0."""
    batch = on_policy_batch(policy_dir)
    teacher = f"train.algorithm_kwargs.teacher_path={policy_dir}"
    m = step(resolved(policy_dir, "opd", teacher), policy_dir, batch)
    assert m["policy/distill/reverse_kl"] == pytest.approx(0.0, abs=1e-6)
    assert m["policy/loss"] == pytest.approx(0.0, abs=1e-6)
    m = step(
        resolved(policy_dir, "mixed_loss_dagger_opd", teacher, "train.algorithm_kwargs.beta_decay_steps=0"),
        policy_dir,
        batch,
    )
    assert m["policy/mixed/k3"] == pytest.approx(0.0, abs=1e-6)


def test_aggrevate_teacher_q_is_the_teacher_log_prob_at_the_rollout_temperature(policy_dir):
    """q_source=teacher_logprob: Q*_t = log pi_teacher(a_t | s_t) at T, injected as teacher_logprobs_T."""
    batch = rl_batch()
    recipe = resolved(policy_dir, "aggrevate", f"train.algorithm_kwargs.teacher_path={policy_dir}")
    runner = RecipeRunner(recipe, backends_for(recipe, policy_dir))
    q_T = runner.prepare(batch)["policy"].extra["teacher_logprobs_T"]
    expected = logprobs_at(load(policy_dir), batch, T)
    mask = batch.loss_mask_T
    assert q_T[mask].tolist() == pytest.approx(expected[mask].tolist(), abs=1e-5)


def test_a_synchronous_grpo_run_at_half_temperature_has_no_kl_at_step_one(tmp_path):
    """The audit's run: grpo kl_coef=0.1 at rollout.temperature=0.5, policy = reference at step 1: the
    logged KL is 0 (it was 0.00464 with the reference at 1) and the ratio ~1 (the sampler's log-probs at T)."""
    overrides = tiny_run_overrides(tmp_path, num_eval=0)
    cfg = load_config(
        None,
        [*overrides, "train.steps=1", "rollout.temperature=0.5", "train.algorithm_kwargs={kl_coef: 0.1}"],
    )
    row = next(r for r in run_to_end(cfg) if "train/policy/actor/kl" in r)
    assert row["train/policy/actor/kl"] == pytest.approx(0.0, abs=1e-6)
    assert row["train/policy/actor/ratio"] == pytest.approx(1.0, abs=1e-3)


# ------------------------------------------------------------------------------------------------ A2
def test_algorithm_kwargs_temperature_is_refused_naming_rollout_temperature(policy_dir):
    for name, extra in (("grpo", ()), ("opd", (f"train.algorithm_kwargs.teacher_path={policy_dir}",))):
        with pytest.raises(ConfigError) as err:
            resolved(policy_dir, name, "train.algorithm_kwargs.temperature=0.5", *extra)
        message = str(err.value)
        assert message.startswith("train.algorithm_kwargs.temperature: ") and "\n" not in message
        assert "rollout.temperature" in message and "train.eval_temperature" in message
    with pytest.raises(ConfigError, match=r"^train\.algorithm_kwargs\.temperature: "):  # the same value too
        resolved(policy_dir, "grpo", f"train.algorithm_kwargs.temperature={T}")


# ------------------------------------------------------------------------------------------------ A3
def test_dr_grpo_logs_a_ratio_of_one_on_a_synchronous_run(tmp_path):
    """A synchronous dr_grpo run's first step: actor/ratio ~1 (rollout and trainer log-probs of the same
    weights), not 1 / L; the loss keeps Dr. GRPO's B * L denominator, L = rollout.max_new_tokens = 4."""
    overrides = tiny_run_overrides(tmp_path, num_eval=0)
    cfg = load_config(None, [*overrides, "train.algorithm=dr_grpo", "train.steps=1", "rollout.temperature=0.7"])
    rows = [r for r in run_to_end(cfg) if "train/policy/actor/ratio" in r]
    assert rows[0]["train/policy/actor/ratio"] == pytest.approx(1.0, abs=1e-3)
    assert rows[0]["train/policy/actor/clip_frac"] == pytest.approx(0.0, abs=1e-6)
    assert rows[0]["train/policy/loss_denominator"] == 8 * 4  # 2 prompts x 4 samples, L = 4


# ------------------------------------------------------------------------------------------------ A4
def test_dr_grpo_constant_follows_max_new_tokens(policy_dir):
    """L defaults to rollout.max_new_tokens: loss = sum_{i,t} clipped / (B * L), by hand, at L = 4."""
    recipe = resolved(policy_dir, "dr_grpo", temperature=1.0, max_new_tokens=4)
    assert recipe.policy_role.init_kwargs["loss_agg_constant"] == 4.0
    assert get_recipe("dr_grpo").policy_role.init_kwargs["loss_agg_constant"] == float(LENGTH_WITHOUT_RUN)
    batch = on_policy_batch(policy_dir, 1.0)
    m = step(recipe, policy_dir, batch)
    dr = grpo_adv(batch.rewards_B.tolist(), std=False)
    total = sum(-dr[b] for b in range(6) for _ in completion_positions(batch, b))  # ratio 1: -A per token
    assert m["policy/loss"] == pytest.approx(total / (6 * 4), abs=1e-5)
    assert m["policy/actor/ratio"] == pytest.approx(1.0, abs=1e-5)


def test_dapo_overlong_penalty_follows_max_new_tokens(policy_dir):
    """L_max = rollout.max_new_tokens, L_buf = L_max // 5 (at least 1) by default. rl_batch's completions
    are 4, 2, 5, 3, 2, 3 tokens; at max_new_tokens=5 and L_buf=3 the penalty (L_max - L_buf - |o|) / L_buf
    is -2/3, 0, -1, -1/3, 0, -1/3, and the loss is GRPO's on the penalised rewards (ratio 1) of the groups
    whose rewards differ before the penalty (group c's, 1 and 1, do not: it is dropped)."""
    policy = resolved(policy_dir, "dapo", max_new_tokens=10).policy_role.init_kwargs
    assert (policy["overlong_max_length"], policy["overlong_buffer_length"]) == (10, 2)
    policy = resolved(policy_dir, "dapo", max_new_tokens=4).policy_role.init_kwargs
    assert (policy["overlong_max_length"], policy["overlong_buffer_length"]) == (4, 1)
    recipe = resolved(
        policy_dir, "dapo", "train.algorithm_kwargs.overlong_buffer_length=3", temperature=1.0, max_new_tokens=5
    )
    batch = on_policy_batch(policy_dir, 1.0)
    prepared = RecipeRunner(recipe, backends_for(recipe, policy_dir)).prepare(batch)["policy"]
    rewards = [1.0, 0.0, 0.2, 1.0, 1.0, 1.0]
    penalised = [r + p for r, p in zip(rewards, [-2 / 3, 0.0, -1.0, -1 / 3, 0.0, -1 / 3])]
    assert prepared.rewards_B.tolist() == pytest.approx(penalised[:4], abs=1e-6)
    adv = grpo_adv(penalised[:4])  # group c's penalised rewards differ, by length alone: still dropped
    m = step(recipe, policy_dir, batch)
    lengths = [len(completion_positions(batch, b)) for b in range(6)]
    assert lengths == [4, 2, 5, 3, 2, 3]
    expected = sum(-adv[b] * lengths[b] for b in range(4)) / sum(lengths[:4])
    assert m["policy/loss"] == pytest.approx(expected, abs=1e-5)


def test_a_length_no_generation_reaches_is_warned_once(policy_dir, caplog, monkeypatch):
    monkeypatch.setattr("areno.engine.api._LENGTHS_WARNED", set())  # warned once per process: a rerun warns too
    caplog.set_level(logging.WARNING, logger="areno.engine.api")
    args = ("train.algorithm_kwargs.max_completion_length=6000",)
    for _ in range(2):  # resolve_recipe runs several times in a run: one warning
        resolved(policy_dir, "dapo", *args, max_new_tokens=8)
    lines = [r.getMessage() for r in caplog.records if "overlong penalty" in r.getMessage()]
    assert len(lines) == 1
    assert "train.algorithm_kwargs.max_completion_length=6000" in lines[0] and "rollout.max_new_tokens=8" in lines[0]
    assert "never fires" in lines[0]
    caplog.clear()
    resolved(policy_dir, "dr_grpo", "train.algorithm_kwargs.max_completion_length=1024", max_new_tokens=8)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "max_completion_length=1024 > rollout.max_new_tokens=8" in lines[0]
    caplog.clear()  # within reach: no warning
    resolved(policy_dir, "dapo", "train.algorithm_kwargs.max_completion_length=8", max_new_tokens=8)
    resolved(policy_dir, "dr_grpo", max_new_tokens=8)
    assert not caplog.records


def test_dapo_bad_buffer_names_both_keys(policy_dir):
    with pytest.raises(ConfigError, match=r"overlong_buffer_length=9 must be in \(0, max_completion_length=4\]"):
        resolved(policy_dir, "dapo", "train.algorithm_kwargs.overlong_buffer_length=9", max_new_tokens=4)
    with pytest.raises(ConfigError, match=r"max_completion_length must be > 0"):
        resolved(policy_dir, "dr_grpo", "train.algorithm_kwargs.max_completion_length=0")


@pytest.mark.parametrize("name", ["dapo", "dr_grpo"])
def test_areno_recipes_shows_the_length_recipes(name, capsys):
    assert recipes_main([name]) == 0
    assert "rollout.max_new_tokens" in capsys.readouterr().out
