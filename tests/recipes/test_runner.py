"""One RecipeRunner step of each built-in recipe on tiny checkpoints with LocalTrainBackend, micro-
batches small enough that the batch is cut into several. The step's loss (computed at the initial
weights) is checked against a hand-computed value from naive log-probs."""

from __future__ import annotations

import math

import pytest
import torch

from areno.recipes import get_recipe
from areno.recipes.config import ModelRole, TrainingConfig
from areno.recipes.runner import RecipeRunner
from areno.specializations import DPOSpecialization
from areno.types import TokenBatch
from tests.helpers.recipes import (
    RecordingBackend,
    completion_positions,
    grpo_adv,
    naive_logprobs,
    preference_batch,
    rl_batch,
    with_behaviour_logprobs,
)

train = pytest.importorskip("areno.train")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from areno.data.tokenizer import build_char_tokenizer
    from areno.models.hf_io import init_model_dir, tiny_config

    tok = build_char_tokenizer()
    root = tmp_path_factory.mktemp("models")
    cfg = tiny_config(len(tok), hidden_size=32, layers=2, heads=4, kv_heads=2, initializer_range=0.3)
    return {
        name: str(init_model_dir(root / name, cfg, tok, seed=seed)) for name, seed in (("policy", 0), ("teacher", 1))
    }


def load(path):
    from areno.models.hf_io import load_model

    return load_model(path, dtype=torch.float32, device="cpu")[0]


def run_step(recipe, dirs, batch: TokenBatch, initial_version=0):
    backends = {}
    for role in recipe.roles:
        backend = train.LocalTrainBackend(
            train.TrainBackendConfig(
                lr=1e-2, trainable=role.trainable, device="cpu", max_tokens_per_mb=16, seed=0, grad_clip=None
            )
        )
        backend.initialize(role.model_path or dirs["policy"])
        backends[role.name] = backend
    runner = RecipeRunner(recipe, backends, initial_version=initial_version)
    before = {n: [p.detach().clone() for p in b.model.parameters()] for n, b in backends.items()}
    metrics = runner.step(batch)
    for role in recipe.roles:
        moved = any(
            not torch.equal(p0, p1) for p0, p1 in zip(before[role.name], backends[role.name].model.parameters())
        )
        assert moved == role.trainable, f"role {role.name}: parameters moved={moved}, trainable={role.trainable}"
        if not role.trainable:
            assert backends[role.name].optimizer is None  # frozen roles hold no optimizer state
    assert metrics[f"{recipe.policy_role.name}/mbs"] > 1
    assert runner.versions[recipe.policy_role.name] == initial_version + 1
    return metrics


def rl_setup(dirs, noise=0.3):
    policy = load(dirs["policy"])
    base = rl_batch()
    logp = naive_logprobs(policy, base)
    batch = with_behaviour_logprobs(base, logp, scale=noise)
    return policy, batch, logp


def clipped(r, a, lo, hi):
    return -min(r * a, min(max(r, lo), hi) * a)


def token_mean(batch, fn, seqs=range(6)):
    terms = [fn(b, t) for b in seqs for t in completion_positions(batch, b)]
    return sum(terms) / len(terms)


def seq_mean(batch, fn, seqs=range(6)):
    per = []
    for b in seqs:
        pos = completion_positions(batch, b)
        per.append(sum(fn(b, t) for t in pos) / len(pos))
    return sum(per) / len(per)


def test_grpo(dirs):
    _, batch, logp = rl_setup(dirs)
    adv = grpo_adv(batch.rewards_B.tolist())
    r = lambda t: math.exp(logp[t] - batch.logprobs_T[t])
    # grpo: reference = initial policy, so k3 = 0 at the first step
    m = run_step(get_recipe("grpo", kl_coef=0.04), dirs, batch)
    assert m["policy/loss"] == pytest.approx(seq_mean(batch, lambda b, t: clipped(r(t), adv[b], 0.8, 1.2)), rel=1e-4)
    assert m["policy/actor/kl"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.slow
def test_dr_grpo_dapo_cispo(dirs):
    _, batch, logp = rl_setup(dirs)
    adv = grpo_adv(batch.rewards_B.tolist())
    r = lambda t: math.exp(logp[t] - batch.logprobs_T[t])
    dr = grpo_adv(batch.rewards_B.tolist(), std=False)
    m = run_step(get_recipe("dr_grpo", max_completion_length=16), dirs, batch)
    total = sum(clipped(r(t), dr[b], 0.8, 1.2) for b in range(6) for t in completion_positions(batch, b))
    assert m["policy/loss"] == pytest.approx(total / (6 * 16), rel=1e-4)
    m = run_step(get_recipe("dapo"), dirs, batch)  # group c (rewards 1, 1) dropped
    assert m["policy/loss"] == pytest.approx(
        token_mean(batch, lambda b, t: clipped(r(t), adv[b], 0.8, 1.28), range(4)), rel=1e-4
    )
    m = run_step(get_recipe("cispo"), dirs, batch)
    assert m["policy/loss"] == pytest.approx(
        token_mean(batch, lambda b, t: -min(r(t), 5.0) * adv[b] * float(logp[t])), rel=1e-4
    )


@pytest.mark.slow
def test_gspo_rloo(dirs):
    _, batch, logp = rl_setup(dirs, noise=0.01)
    adv = grpo_adv(batch.rewards_B.tolist())
    m = run_step(get_recipe("gspo"), dirs, batch)

    def gspo_term(b, t):
        pos = completion_positions(batch, b)
        s = math.exp(sum(float(logp[u] - batch.logprobs_T[u]) for u in pos) / len(pos))
        return clipped(s, adv[b], 1 - 3e-4, 1 + 4e-4)

    assert m["policy/loss"] == pytest.approx(seq_mean(batch, gspo_term), rel=1e-4, abs=1e-6)
    r = lambda t: math.exp(logp[t] - batch.logprobs_T[t])
    rewards = batch.rewards_B.tolist()
    loo = [rewards[b] - rewards[b ^ 1] for b in range(6)]  # groups of two: the other one is the baseline
    m = run_step(get_recipe("rloo"), dirs, batch)
    assert m["policy/loss"] == pytest.approx(token_mean(batch, lambda b, t: clipped(r(t), loo[b], 0.8, 1.2)), rel=1e-4)


@pytest.mark.slow
def test_reinforce_pp_recipes(dirs):
    _, batch, logp = rl_setup(dirs)
    r = lambda t: math.exp(logp[t] - batch.logprobs_T[t])
    rewards = batch.rewards_B.tolist()
    baseline = [rewards[b] - (rewards[b] + rewards[b ^ 1]) / 2 for b in range(6)]
    for name, centred, kl_reward in (("reinforce_pp", rewards, True), ("reinforce_pp_baseline", baseline, False)):
        # returns-to-go: sequence reward plus, for reinforce_pp, the per-token k1 KL reward
        # -0.01 (log pi_behave - log pi_ref) with pi_ref = the initial policy
        returns = {}
        for b in range(6):
            running = centred[b]
            for t in reversed(completion_positions(batch, b)):
                running += -0.01 * float(batch.logprobs_T[t] - logp[t]) if kl_reward else 0.0
                returns[t] = running
        vals = torch.tensor(list(returns.values()), dtype=torch.float64)
        mean, std = vals.mean().item(), vals.std().item()
        m = run_step(get_recipe(name), dirs, batch)
        adv = {t: (ret - mean) / (std + 1e-8) for t, ret in returns.items()}
        expected = token_mean(batch, lambda b, t, adv=adv: clipped(r(t), adv[t], 0.8, 1.2))
        assert m["policy/loss"] == pytest.approx(expected, rel=1e-4, abs=1e-6), name


@pytest.mark.slow
def test_decoupled_recipes(dirs):
    _, batch, logp = rl_setup(dirs, noise=0.8)
    adv = grpo_adv(batch.rewards_B.tolist())

    # recompute: pi_prox = current weights, so r' = 1 and the loss is -w A with w masked above 5
    def w_term(b, t):
        w = math.exp(logp[t] - batch.logprobs_T[t])
        return 0.0 if w > 5.0 else -w * adv[b]

    m = run_step(get_recipe("grpo_async"), dirs, batch)
    assert m["policy/loss"] == pytest.approx(token_mean(batch, w_term), rel=1e-4)

    # loglinear: versions 3, prox version 5 -> alpha 2/3
    def ll_term(b, t):
        p = batch.logprobs_T[t] + (2 / 3) * (logp[t] - batch.logprobs_T[t])
        w = math.exp(p - batch.logprobs_T[t])
        return 0.0 if w > 5.0 else w * clipped(math.exp(logp[t] - p), adv[b], 0.8, 1.2)

    m = run_step(get_recipe("grpo_async_loglinear"), dirs, batch, initial_version=5)
    assert m["policy/loss"] == pytest.approx(token_mean(batch, ll_term), rel=1e-4)
    assert "policy/actor/coupled_clip_frac" in m


@pytest.mark.slow
def test_sft_and_distillation(dirs):
    policy, batch, logp = rl_setup(dirs)
    m = run_step(get_recipe("sft"), dirs, batch)
    assert m["policy/loss"] == pytest.approx(token_mean(batch, lambda b, t: -float(logp[t])), rel=1e-5)
    teacher = load(dirs["teacher"])
    tl = naive_logprobs(teacher, batch)
    k3 = lambda t: math.exp(tl[t] - logp[t]) - float(tl[t] - logp[t]) - 1
    k2 = lambda t: 0.5 * float(logp[t] - tl[t]) ** 2  # the loss; k3 is logged as the reverse KL
    m = run_step(get_recipe("opd", teacher_path=dirs["teacher"]), dirs, batch)
    assert m["policy/loss"] == pytest.approx(token_mean(batch, lambda b, t: k2(t)), rel=1e-4)
    assert m["policy/distill/reverse_kl"] == pytest.approx(token_mean(batch, lambda b, t: k3(t)), rel=1e-4)
    # dagger: labels are the teacher's greedy tokens
    with torch.no_grad():
        from areno.specializations import LogProbSpecialization

        actions = LogProbSpecialization().extract_model_output(teacher, batch)["argmax_T"]
    on_labels = naive_logprobs(policy, batch, targets_T=actions)
    m = run_step(get_recipe("dagger", teacher_path=dirs["teacher"]), dirs, batch)
    assert m["policy/loss"] == pytest.approx(token_mean(batch, lambda b, t: -float(on_labels[t])), rel=1e-4)
    pos = [t for b in range(6) for t in completion_positions(batch, b)]
    qs = torch.tensor([float(tl[t]) for t in pos], dtype=torch.float64)
    m = run_step(get_recipe("aggrevate", teacher_path=dirs["teacher"]), dirs, batch)
    expected = token_mean(batch, lambda b, t: -float((tl[t] - qs.mean()) / (qs.std() + 1e-8)) * float(logp[t]))
    assert m["policy/loss"] == pytest.approx(expected, rel=1e-4)
    executed = torch.zeros(batch.num_tokens, dtype=torch.bool)
    executed[pos[::3]] = True
    batch.extra["teacher_executed_T"] = executed
    m = run_step(
        get_recipe("mixed_loss_dagger_opd", teacher_path=dirs["teacher"], beta_decay_steps=100),
        dirs,
        batch,
        initial_version=25,
    )  # beta = 0.75
    expected = token_mean(batch, lambda b, t: 0.75 * -float(logp[t]) if executed[t] else 0.25 * k2(t))
    assert m["policy/loss"] == pytest.approx(expected, rel=1e-4)


@pytest.mark.slow
def test_dpo_recorded_reference(dirs):
    # DPOSpecialization(ref_key="logprobs_T"): the batch's own log-probs are the reference (a user's
    # recipe of one role; the built-in dpo has a reference role)
    policy = load(dirs["policy"])
    batch = preference_batch()
    logp = naive_logprobs(policy, batch)
    s = [sum(float(logp[t]) for t in completion_positions(batch, b)) for b in range(4)]
    r = [sum(float(batch.logprobs_T[t]) for t in completion_positions(batch, b)) for b in range(4)]
    expected = sum(math.log1p(math.exp(-0.5 * ((s[c] - r[c]) - (s[j] - r[j])))) for c, j in ((0, 2), (3, 1))) / 2
    recorded = TrainingConfig(
        name="dpo_recorded",
        roles=(
            ModelRole(
                name="policy",
                specialization_cls=DPOSpecialization,
                sync_to_rollout=True,
                init_kwargs={"beta": 0.5, "ref_key": "logprobs_T"},
            ),
        ),
        online=False,
    )
    m = run_step(recorded, dirs, batch)
    assert m["policy/loss"] == pytest.approx(expected, rel=1e-5)
    assert 0.0 <= m["policy/dpo/accuracy"] <= 1.0


@pytest.mark.parametrize("name", ["dpo", "dpo_distributed"])
def test_dpo_reference_inject(dirs, name):
    m = run_step(get_recipe(name, beta=0.5), dirs, preference_batch())
    assert m["policy/loss"] == pytest.approx(math.log(2), rel=1e-5)  # reference = initial policy: h = 0


def test_independent_roles_train_concurrently_and_shared_ones_serially():
    import threading

    recipe = get_recipe("ppo")
    log = []
    barrier = threading.Barrier(2, timeout=10)
    runner = RecipeRunner(recipe, {"policy": RecordingBackend(log, barrier), "value": RecordingBackend(log, barrier)})
    metrics = runner.step(rl_batch())
    advantages = {f"policy/advantage_{stat}" for stat in ("mean", "std", "min", "max")}
    assert set(metrics) == {"policy/loss", "value/loss", "policy/skipped_zero_grad_seqs", *advantages}
    assert [e for e, _ in log if e != "forward"] == ["enter", "enter", "exit", "exit"]
    assert sum(e == "forward" for e, _ in log) == 1  # the critic's forward serves both the sync and its own targets
    shared_log = []
    shared = RecordingBackend(shared_log)
    RecipeRunner(recipe, {"policy": shared, "value": shared}).step(rl_batch())
    assert [e for e, _ in shared_log if e != "forward"] == ["enter", "exit", "enter", "exit"]


def test_placement_groups_roles_by_device():
    """``placement`` (cluster.role_devices): roles on one device train one after another even on
    distinct backends; roles on different devices concurrently."""
    import threading

    recipe = get_recipe("ppo")
    log = []
    backends = {"policy": RecordingBackend(log), "value": RecordingBackend(log)}
    RecipeRunner(recipe, backends, placement={"policy": (0,), "value": (0,)}).step(rl_batch())
    assert [e for e, _ in log if e != "forward"] == ["enter", "exit", "enter", "exit"]
    log.clear()
    barrier = threading.Barrier(2, timeout=10)
    backends = {"policy": RecordingBackend(log, barrier), "value": RecordingBackend(log, barrier)}
    RecipeRunner(recipe, backends, placement={"policy": (0,), "value": (1,)}).step(rl_batch())
    assert [e for e, _ in log if e != "forward"] == ["enter", "enter", "exit", "exit"]


@pytest.mark.slow
def test_ppo_critic_with_local_backend(dirs):
    """PPO's two roles on LocalTrainBackend. The value head is attached to the critic backend's
    model by hand here, as ``initialize`` has no wrap hook yet."""
    from areno.train.optim import build_optimizer, build_scheduler

    recipe = get_recipe("ppo")
    policy_model, batch, logp = rl_setup(dirs)
    backends = {}
    for role in recipe.roles:
        cfg = train.TrainBackendConfig(lr=1e-2, device="cpu", max_tokens_per_mb=16, seed=0, grad_clip=None)
        backend = train.LocalTrainBackend(cfg)
        backend.initialize(dirs["policy"])
        spec = role.build()
        if spec.wrap_model(backend.model) is not backend.model:
            backend.model = spec.wrap_model(backend.model)
            backend.optimizer = build_optimizer(backend.model.parameters(), cfg, "cpu")
            backend.scheduler = build_scheduler(backend.optimizer, cfg)
        backends[role.name] = backend
    m = RecipeRunner(recipe, backends).step(batch)
    # zero-initialised head: V = 0 everywhere, so GAE(lambda=.95) gives A_t = .95^(n-1-k) R and the
    # value loss is 0.5 * mean(R_t^2) with R_t = A_t
    adv, sq = {}, []
    for b in range(6):
        pos = completion_positions(batch, b)
        for k, t in enumerate(pos):
            adv[t] = 0.95 ** (len(pos) - 1 - k) * float(batch.rewards_B[b])
            sq.append(0.5 * adv[t] ** 2)
    assert m["value/loss"] == pytest.approx(sum(sq) / len(sq), rel=1e-5)
    r = lambda t: math.exp(logp[t] - batch.logprobs_T[t])
    assert m["policy/loss"] == pytest.approx(token_mean(batch, lambda b, t: clipped(r(t), adv[t], 0.8, 1.2)), rel=1e-4)


def _critic_backends(recipe, dirs):
    """LocalTrainBackends of ``recipe``'s roles, the critic's value head attached by hand (as above)."""
    from areno.train.optim import build_optimizer, build_scheduler

    backends = {}
    for role in recipe.roles:
        cfg = train.TrainBackendConfig(
            lr=1e-2, trainable=role.trainable, device="cpu", max_tokens_per_mb=16, seed=0, grad_clip=None
        )
        backend = train.LocalTrainBackend(cfg)
        backend.initialize(dirs["policy"])
        spec = role.build()
        if spec.wrap_model(backend.model) is not backend.model:
            backend.model = spec.wrap_model(backend.model)
            backend.optimizer = build_optimizer(backend.model.parameters(), cfg, "cpu")
            backend.scheduler = build_scheduler(backend.optimizer, cfg)
        backends[role.name] = backend
    return backends


def _gae_zero_values(batch, token_reward, lam=0.95):
    """GAE with V = 0 (the zero-initialised head), gamma 1: A_k = sum_j lam^(j-k) r_j over a
    sequence's completion tokens, r_j = token_reward(j) plus the sequence reward on the last one."""
    adv = {}
    for b in range(6):
        pos = completion_positions(batch, b)
        running = 0.0
        for k, t in reversed(list(enumerate(pos))):
            r = token_reward(t) + (float(batch.rewards_B[b]) if k == len(pos) - 1 else 0.0)
            running = r + lam * running
            adv[t] = running
    return adv


@pytest.mark.slow
def test_ppo_kl_penalty_in_the_reward(dirs):
    """ppo_kl: reference = the initial policy, so the k1 penalty per token is -0.05 (behave - logp);
    value targets and advantages are GAE over the penalised rewards, V = 0 at the first step."""
    recipe = get_recipe("ppo_kl")
    _, batch, logp = rl_setup(dirs)
    m = RecipeRunner(recipe, _critic_backends(recipe, dirs)).step(batch)
    adv = _gae_zero_values(batch, lambda t: -0.05 * float(batch.logprobs_T[t] - logp[t]))
    assert m["value/loss"] == pytest.approx(token_mean(batch, lambda b, t: 0.5 * adv[t] ** 2), rel=1e-5)
    r = lambda t: math.exp(logp[t] - batch.logprobs_T[t])
    expected = token_mean(batch, lambda b, t: clipped(r(t), adv[t], 0.8, 1.2))
    assert m["policy/loss"] == pytest.approx(expected, rel=1e-4)
    # the penalty moved the advantages: without it the loss is ppo's
    plain = _gae_zero_values(batch, lambda t: 0.0)
    assert expected != pytest.approx(token_mean(batch, lambda b, t: clipped(r(t), plain[t], 0.8, 1.2)), rel=1e-3)


@pytest.mark.slow
def test_ppo_async_decoupled_with_a_critic(dirs):
    """ppo_async: pi_prox recomputed = current weights, so r' = 1 and the loss is -w A (w =
    pi_prox / pi_behave, masked above 5) with ppo's GAE advantages (V = 0 at the first step)."""
    recipe = get_recipe("ppo_async")
    _, batch, logp = rl_setup(dirs, noise=0.8)
    m = RecipeRunner(recipe, _critic_backends(recipe, dirs)).step(batch)
    adv = _gae_zero_values(batch, lambda t: 0.0)

    def w_term(b, t):
        w = math.exp(logp[t] - batch.logprobs_T[t])
        return 0.0 if w > 5.0 else -w * adv[t]

    assert m["policy/loss"] == pytest.approx(token_mean(batch, w_term), rel=1e-4)
    assert m["value/loss"] == pytest.approx(token_mean(batch, lambda b, t: 0.5 * adv[t] ** 2), rel=1e-5)


@pytest.mark.slow
def test_grpo_recompute_ignores_the_behaviour_logprobs(dirs):
    """grpo_recompute: pi_old is recomputed from the current weights, so r = 1 whatever the
    behaviour log-probs were, and the loss is the token mean of -A."""
    _, batch, _ = rl_setup(dirs, noise=0.8)
    adv = grpo_adv(batch.rewards_B.tolist())
    m = run_step(get_recipe("grpo_recompute"), dirs, batch)
    assert m["policy/loss"] == pytest.approx(token_mean(batch, lambda b, t: -adv[b]), rel=1e-4, abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp_baseline", "gspo", "cispo"])
def test_rl_recipes_move_logprobs_toward_reward(dirs, name):
    """Three on-policy steps: completions with an above-group reward become more likely and those
    below become less likely (groups a and b of rl_batch; group c has no signal)."""
    backend = train.LocalTrainBackend(train.TrainBackendConfig(lr=1e-3, device="cpu", seed=0))
    backend.initialize(dirs["policy"])
    batch = rl_batch()
    lp0 = naive_logprobs(backend.model, batch)
    batch = with_behaviour_logprobs(batch, lp0, scale=0.0)
    recipe = get_recipe(name, kl_coef=0.0) if name.startswith("reinforce") else get_recipe(name)
    runner = RecipeRunner(recipe, {"policy": backend})
    for _ in range(3):
        runner.step(batch)
    lp1 = naive_logprobs(backend.model, batch)
    delta = [sum(float(lp1[t] - lp0[t]) for t in completion_positions(batch, b)) for b in range(4)]
    assert delta[0] > 0 > delta[1] and delta[3] > 0 > delta[2], delta  # a: 1 vs 0, b: 0.2 vs 1


def test_later_pass_reuses_first_pass_forwards(dirs):
    """A second optimizer pass (``pass_order``) trains on the first pass's prepared batch, reordered:
    pi_prox is not recomputed (so the decoupled clip acts from the second pass), no forward runs."""
    # every sequence trained, zero-advantage ones too: the test follows sequences through the passes
    recipe = get_recipe("grpo_async", policy_kwargs={"skip_zero_advantage": False})
    backend = train.LocalTrainBackend(
        train.TrainBackendConfig(lr=1e-2, device="cpu", max_tokens_per_mb=16, seed=0, grad_clip=None)
    )
    backend.initialize(dirs["policy"])
    forwards, trained = [], []
    real_forward, real_train = backend.forward_only, backend.train_step

    def counting_forward(batch, **kw):
        forwards.append(batch.num_seqs)
        return real_forward(batch, **kw)

    def recording_train(batch, **kw):
        trained.append(batch)
        return real_train(batch, **kw)

    backend.forward_only, backend.train_step = counting_forward, recording_train
    runner = RecipeRunner(recipe, {"policy": backend})
    _, batch, _ = rl_setup(dirs)
    with pytest.raises(ValueError, match="needs a first pass"):
        runner.step(batch, pass_order=list(range(batch.num_seqs)))
    runner.step(batch)
    assert len(forwards) == 1  # pi_prox of the first pass
    order = list(reversed(range(batch.num_seqs)))
    m2 = runner.step(batch.select(order), pass_order=order)
    assert len(forwards) == 1  # reused, not recomputed after the first pass moved the weights
    first, second = trained
    torch.testing.assert_close(
        second.extra["prox_logprobs_T"], first.select(order).extra["prox_logprobs_T"], rtol=0, atol=0
    )
    torch.testing.assert_close(second.advantages_T, first.select(order).advantages_T, rtol=0, atol=0)
    recomputed = real_forward(batch.select(order), forward_fn=runner.specs["policy"].extract_model_output)["logprobs_T"]
    assert not torch.allclose(recomputed, second.extra["prox_logprobs_T"])  # the weights did move
    assert math.isfinite(m2["policy/loss"])
    with pytest.raises(ValueError, match="permutation"):
        runner.step(batch, pass_order=[0] * batch.num_seqs)


def test_minibatches_share_one_forward(dirs):
    """num_minibatches=2: one pi_prox forward, two optimizer steps on consecutive halves of the
    prepared batch; the second half's ratio pi_theta / pi_prox is off 1 (the clip can act)."""
    backend = train.LocalTrainBackend(
        train.TrainBackendConfig(lr=5e-2, device="cpu", max_tokens_per_mb=16, seed=0, grad_clip=None)
    )
    backend.initialize(dirs["policy"])
    forwards, trained, results = [], [], []
    real_forward, real_train = backend.forward_only, backend.train_step
    backend.forward_only = lambda batch, **kw: forwards.append(1) or real_forward(batch, **kw)

    def recording_train(batch, **kw):
        trained.append(batch)
        results.append(real_train(batch, **kw))
        return results[-1]

    backend.train_step = recording_train
    recipe = get_recipe("grpo_async", policy_kwargs={"skip_zero_advantage": False})  # halves of every sequence
    runner = RecipeRunner(recipe, {"policy": backend}, num_minibatches=2)
    _, batch, _ = rl_setup(dirs)
    runner.step(batch)
    assert len(forwards) == 1 and len(trained) == 2
    n = batch.num_seqs
    assert [b.num_seqs for b in trained] == [n // 2, n - n // 2]
    assert runner.versions["policy"] == 2  # two optimizer steps
    assert results[0]["actor/ratio"] == pytest.approx(1.0, abs=1e-6)  # first minibatch: pi_theta = pi_prox
    assert results[1]["actor/ratio"] != pytest.approx(1.0, abs=1e-6)  # second: the weights moved since pi_prox
    with pytest.raises(ValueError, match="num_minibatches"):
        RecipeRunner(get_recipe("grpo_async"), {"policy": backend}, num_minibatches=0)
