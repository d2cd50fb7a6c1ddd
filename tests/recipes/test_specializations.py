"""Each specialization's loss on a tiny decoder and a fixed batch, against a hand-computed value
built from naive (unpacked, full-logits) log-probs and plain torch arithmetic."""

from __future__ import annotations

import math

import pytest
import torch

from areno.errors import ConfigError
from areno.specializations import (
    ActorConfig,
    ActorSpecialization,
    AggrevateSpecialization,
    CriticSpecialization,
    DaggerSpecialization,
    DistillSpecialization,
    DPOSpecialization,
    LogProbSpecialization,
    MixedLossDaggerOPDSpecialization,
    RewardModelSpecialization,
    SFTSpecialization,
    token_logprobs_T,
)
from areno.specializations.base import with_extra
from tests.helpers.recipes import (
    PlainReducer,
    completion_positions,
    grpo_adv,
    loss_of,
    make_decoder,
    naive_logprobs,
    preference_batch,
    rl_batch,
    with_behaviour_logprobs,
)

SEQ = [(0, 7), (7, 12), (12, 19), (19, 24), (24, 30), (30, 37)]  # rl_batch() boundaries


def test_token_logprobs_match_naive_and_entropy(model):
    batch = rl_batch()
    out = token_logprobs_T(model, batch, with_entropy=True, with_argmax=True, chunk_size=5)
    assert torch.allclose(out["logprobs_T"], naive_logprobs(model, batch), atol=1e-5)
    # entropy and argmax of the distribution predicting token 2 of sequence 0, by hand
    ids = batch.input_ids_T[:7]
    logits = model.logits(model(ids, torch.arange(7)))[1].float()
    p = torch.softmax(logits, -1)
    assert out["entropy_T"][2].item() == pytest.approx(-(p * p.log()).sum().item(), abs=1e-5)
    assert out["argmax_T"][2].item() == int(logits.argmax())
    assert out["logprobs_T"][0].item() == 0.0 and out["entropy_T"][7].item() == 0.0


@pytest.mark.parametrize("aggregation", ["token", "seq_mean_token_mean", "constant"])
def test_actor_grpo_clipped_loss(model, aggregation):
    base = rl_batch()
    logp = naive_logprobs(model, base)
    batch = with_behaviour_logprobs(base, logp)
    spec = ActorSpecialization(
        ActorConfig(
            advantage_estimator="grpo",
            clip_eps=0.2,
            clip_eps_high=0.28,
            loss_aggregation=aggregation,
            loss_agg_constant=8.0,
        )
    )
    prepared = spec.prepare_batch(batch)
    loss, metrics = loss_of(spec, model, prepared)
    adv = grpo_adv(batch.rewards_B.tolist())
    total, per_seq, n_tok, clipped = 0.0, [], 0, 0
    for b in range(6):
        seq_sum, pos = 0.0, completion_positions(batch, b)
        for t in pos:
            r = math.exp(logp[t] - batch.logprobs_T[t])
            a = adv[b]
            term = -min(r * a, min(max(r, 0.8), 1.28) * a)
            clipped += (min(max(r, 0.8), 1.28) * a) < r * a
            seq_sum += term
        total += seq_sum
        per_seq.append(seq_sum / len(pos))
        n_tok += len(pos)
    expected = {"token": total / n_tok, "seq_mean_token_mean": sum(per_seq) / 6, "constant": total / (6 * 8.0)}[
        aggregation
    ]
    assert loss.item() == pytest.approx(expected, rel=1e-4)
    if aggregation == "token":
        assert metrics["actor/clip_frac"].item() == pytest.approx(clipped / n_tok)
    assert prepared.advantages_T[completion_positions(batch, 0)[0]].item() == pytest.approx(adv[0], rel=1e-5)


def test_actor_dapo_drops_zero_variance_groups_and_penalises_overlong(model):
    batch = rl_batch()
    spec = ActorSpecialization(
        ActorConfig(advantage_estimator="grpo", dynamic_sampling=True, overlong_max_length=4, overlong_buffer_length=2)
    )
    prepared = spec.prepare_batch(batch)
    # The filter reads the rewards before the penalty, as DAPO's eq. 11 keeps groups by accuracy: group c
    # (1, 1) is dropped though its lengths 2, 3 would give it rewards 1, 0.5 (advantages from length
    # alone); completion lengths 4, 2 | 5, 3 -> penalties -1, 0 | -1, -0.5 (L_max 4, buffer 2), so
    # the kept rewards become 0, 0 | -0.8, 0.5 (group a's advantages are then 0)
    assert prepared.group_ids == ["a", "a", "b", "b"]
    assert prepared.rewards_B.tolist() == pytest.approx([0.0, 0.0, -0.8, 0.5])
    assert prepared.advantages_T[completion_positions(prepared, 0)].abs().max().item() == 0.0


def test_actor_kl_and_entropy_terms(model):
    base = rl_batch()
    logp = naive_logprobs(model, base)
    batch = with_behaviour_logprobs(base, logp, scale=0.0)  # ratio 1: pg = -A
    ref_model = make_decoder(5)
    ref = naive_logprobs(ref_model, batch)
    batch = with_extra(batch, ref_logprobs_T=ref)
    spec = ActorSpecialization(
        ActorConfig(advantage_estimator="dr_grpo", kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01)
    )
    loss, metrics = loss_of(spec, model, spec.prepare_batch(batch))
    ent = token_logprobs_T(model, batch, with_entropy=True)["entropy_T"].detach()
    adv = grpo_adv(batch.rewards_B.tolist(), std=False)
    total, n = 0.0, 0
    for b in range(6):
        for t in completion_positions(batch, b):
            d = float(ref[t] - logp[t])
            total += -adv[b] + 0.1 * (math.exp(d) - d - 1) - 0.01 * float(ent[t])
            n += 1
    assert loss.item() == pytest.approx(total / n, rel=1e-4)
    assert metrics["actor/kl"].item() > 0


@pytest.mark.parametrize("kl_in_reward", [False, True])
def test_actor_logs_the_kl_to_the_reference_in_the_loss_and_in_the_reward(model, kl_in_reward):
    # ppo_kl / reinforce_pp put the KL in the reward: it must still be logged, with the same value
    base = rl_batch()
    logp = naive_logprobs(model, base)
    batch = with_behaviour_logprobs(base, logp, scale=0.0)
    ref = naive_logprobs(make_decoder(5), batch)
    batch = with_extra(batch, ref_logprobs_T=ref)
    config = ActorConfig(advantage_estimator="reinforce_pp", kl_coef=0.1, kl_estimator="k3", kl_in_reward=kl_in_reward)
    spec = ActorSpecialization(config)
    loss, metrics = loss_of(spec, model, spec.prepare_batch(batch))
    kls = []
    for b in range(6):
        for t in completion_positions(batch, b):
            d = float(ref[t] - logp[t])
            kls.append(math.exp(d) - d - 1)  # k3 of log(pi/pi_ref) = -d
    assert metrics["actor/kl"].item() == pytest.approx(sum(kls) / len(kls), rel=1e-4)
    # in the reward mode the KL is no loss term: the loss is the policy loss alone
    assert loss.item() == pytest.approx(
        metrics["actor/pg_loss"].item() + (0 if kl_in_reward else 0.1 * sum(kls) / len(kls)), rel=1e-4
    )


def test_actor_decoupled_recompute_and_loglinear(model):
    base = rl_batch()
    logp = naive_logprobs(model, base)
    batch = with_behaviour_logprobs(base, logp, scale=0.5)
    gen = torch.Generator().manual_seed(7)
    prox = torch.where(batch.loss_mask_T, logp + 0.1 * torch.randn(batch.num_tokens, generator=gen), torch.zeros(()))
    spec = ActorSpecialization(
        ActorConfig(
            advantage_estimator="grpo",
            use_decoupled_loss=True,
            prox_logp_method="recompute",
            behav_imp_weight_cap=1.5,
            behav_weight_mode="mask",
        )
    )
    assert spec.self_forward_keys == {"logprobs_T": "prox_logprobs_T"}
    prepared = spec.prepare_batch(with_extra(batch, prox_logprobs_T=prox))
    loss, metrics = loss_of(spec, model, prepared)
    adv = grpo_adv(batch.rewards_B.tolist())
    total, n = 0.0, 0
    for b in range(6):
        for t in completion_positions(batch, b):
            w = math.exp(prox[t] - batch.logprobs_T[t])
            w = 0.0 if w > 1.5 else w
            r = math.exp(logp[t] - prox[t])
            total += w * -min(r * adv[b], min(max(r, 0.8), 1.2) * adv[b])
            n += 1
    assert loss.item() == pytest.approx(total / n, rel=1e-4)
    assert "actor/coupled_clip_frac" in metrics and "actor/behave_over_cap_frac" in metrics
    # loglinear: versions 3, prox version 5 -> alpha = 2/3
    ll = ActorSpecialization(
        ActorConfig(advantage_estimator="grpo", use_decoupled_loss=True, prox_logp_method="loglinear")
    )
    assert ll.self_forward_keys == {}
    prepared = ll.prepare_batch(with_extra(batch, policy_version_B=torch.full((6,), 5)))
    loss_ll, _ = loss_of(ll, model, prepared)
    total = 0.0
    for b in range(6):
        for t in completion_positions(batch, b):
            p = batch.logprobs_T[t] + (2 / 3) * (logp[t] - batch.logprobs_T[t])
            w = math.exp(p - batch.logprobs_T[t])
            r = math.exp(logp[t] - p)
            total += w * -min(r * adv[b], min(max(r, 0.8), 1.2) * adv[b])
    assert loss_ll.item() == pytest.approx(total / n, rel=1e-4)


def test_actor_gspo_and_cispo(model):
    base = rl_batch()
    logp = naive_logprobs(model, base)
    batch = with_behaviour_logprobs(base, logp, scale=0.01)
    adv = grpo_adv(batch.rewards_B.tolist())
    gspo = ActorSpecialization(
        ActorConfig(policy_loss="gspo", clip_eps=3e-4, clip_eps_high=4e-4, loss_aggregation="seq_mean_token_mean")
    )
    loss, _ = loss_of(gspo, model, gspo.prepare_batch(batch))
    per_seq = []
    for b in range(6):
        pos = completion_positions(batch, b)
        s = math.exp(sum(float(logp[t] - batch.logprobs_T[t]) for t in pos) / len(pos))
        per_seq.append(-min(s * adv[b], min(max(s, 1 - 3e-4), 1 + 4e-4) * adv[b]))
    assert loss.item() == pytest.approx(sum(per_seq) / 6, rel=1e-4, abs=1e-6)
    cispo = ActorSpecialization(ActorConfig(policy_loss="cispo", clip_eps_high=0.005, loss_aggregation="token"))
    loss, _ = loss_of(cispo, model, cispo.prepare_batch(batch))
    total, n = 0.0, 0
    for b in range(6):
        for t in completion_positions(batch, b):
            r = min(math.exp(logp[t] - batch.logprobs_T[t]), 1.005)
            total += -r * adv[b] * float(logp[t])
            n += 1
    assert loss.item() == pytest.approx(total / n, rel=1e-4)


def test_actor_rloo_and_reinforce_pp_advantages():
    batch = rl_batch()
    rloo = ActorSpecialization(ActorConfig(advantage_estimator="rloo")).prepare_batch(batch)
    # pairs: leave-one-out baseline is the other reward
    assert rloo.advantages_T[completion_positions(batch, 2)[0]].item() == pytest.approx(0.2 - 1.0)
    rpp = ActorSpecialization(ActorConfig(advantage_estimator="reinforce_pp_baseline")).prepare_batch(batch)
    pos = [t for b in range(6) for t in completion_positions(batch, b)]
    vals = rpp.advantages_T[pos]
    assert vals.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert vals.std().item() == pytest.approx(1.0, abs=1e-5)


def test_critic_value_loss_and_gae(model):
    from areno.specializations.forward import ScalarHeadModel

    critic = CriticSpecialization(value_clip_eps=0.2, gamma=1.0, gae_lambda=0.5)
    vm = critic.wrap_model(model)
    assert isinstance(vm, ScalarHeadModel)
    with torch.no_grad():
        vm.score.weight.normal_(0, 0.3)
        vm.score.bias.fill_(0.1)
    batch = rl_batch()
    values = critic.extract_model_output(vm, batch)["values_T"].detach()
    # value of token t is the head at t-1 (same sequence)
    hidden = model(batch.input_ids_T[:7], torch.arange(7))
    head = (hidden @ vm.score.weight.T).squeeze(-1) + 0.1
    assert values[3].item() == pytest.approx(head[2].item(), abs=1e-5)
    old = values + 0.3 * torch.where(batch.loss_mask_T, torch.ones(()), torch.zeros(()))
    prepared = critic.prepare_batch(with_extra(batch, old_values_T=old))
    loss, metrics = loss_of(critic, vm, prepared)
    total, n = 0.0, 0
    for b in range(6):
        pos = completion_positions(batch, b)
        adv, nxt, running = {}, 0.0, 0.0
        for i, t in enumerate(reversed(pos)):
            rew = float(batch.rewards_B[b]) if i == 0 else 0.0
            running = rew + nxt - float(old[t]) + 0.5 * running
            adv[t], nxt = running, float(old[t])
        for t in pos:
            ret = adv[t] + float(old[t])
            v, vo = float(values[t]), float(old[t])
            v_clip = vo + min(max(v - vo, -0.2), 0.2)
            total += 0.5 * max((v - ret) ** 2, (v_clip - ret) ** 2)
            n += 1
    assert loss.item() == pytest.approx(total / n, rel=1e-4)


def test_sft_distill_and_mixed(model):
    batch = rl_batch()
    logp = naive_logprobs(model, batch)
    teacher = naive_logprobs(make_decoder(9), batch)
    pos = [t for b in range(6) for t in completion_positions(batch, b)]
    sft = SFTSpecialization()
    loss, _ = loss_of(sft, model, sft.prepare_batch(batch))
    assert loss.item() == pytest.approx(-sum(float(logp[t]) for t in pos) / len(pos), rel=1e-5)
    tb = with_extra(batch, teacher_logprobs_T=teacher)
    k3 = {t: math.exp(float(teacher[t] - logp[t])) - float(teacher[t] - logp[t]) - 1 for t in pos}
    k2 = {t: 0.5 * float(logp[t] - teacher[t]) ** 2 for t in pos}
    opd = DistillSpecialization()  # the loss differentiates k2 (the reverse KL's gradient), k3 is logged
    loss, metrics = loss_of(opd, model, opd.prepare_batch(tb))
    assert loss.item() == pytest.approx(sum(k2.values()) / len(pos), rel=1e-4)
    assert metrics["distill/reverse_kl"].item() == pytest.approx(sum(k3.values()) / len(pos), rel=1e-4)
    opd3 = DistillSpecialization(kl_estimator="k3")
    loss, _ = loss_of(opd3, model, opd3.prepare_batch(tb))
    assert loss.item() == pytest.approx(sum(k3.values()) / len(pos), rel=1e-4)
    with pytest.raises(ValueError, match="'k1' as the loss has an expected gradient of 0.*use k2"):
        DistillSpecialization(kl_estimator="k1")
    executed = torch.zeros(batch.num_tokens, dtype=torch.bool)
    executed[pos[::2]] = True  # every other completion token came from the teacher
    mixed = MixedLossDaggerOPDSpecialization(beta_start=1.0, beta_end=0.0, beta_decay_steps=4)
    assert [mixed.beta(s) for s in (0, 1, 4, 9)] == [1.0, 0.75, 0.0, 0.0]
    mb = with_extra(tb, teacher_executed_T=executed, policy_version_B=torch.full((6,), 1))
    loss, metrics = loss_of(mixed, model, mixed.prepare_batch(mb))
    expected = sum(0.75 * -float(logp[t]) if executed[t] else 0.25 * k2[t] for t in pos) / len(pos)
    assert loss.item() == pytest.approx(expected, rel=1e-4)
    assert metrics["mixed/beta"].item() == pytest.approx(0.75)
    student_k3 = sum(k3[t] for t in pos if not executed[t]) / len(pos)
    assert metrics["mixed/k3"].item() == pytest.approx(student_k3, rel=1e-4)


def test_dagger_and_aggrevate(model):
    batch = rl_batch()
    teacher_model = make_decoder(9)
    with torch.no_grad():
        teacher_out = LogProbSpecialization().extract_model_output(teacher_model, batch)
    actions = teacher_out["argmax_T"]
    pos = [t for b in range(6) for t in completion_positions(batch, b)]
    dagger = DaggerSpecialization()
    loss, _ = loss_of(dagger, model, dagger.prepare_batch(with_extra(batch, teacher_action_T=actions)))
    student_on_labels = naive_logprobs(model, batch, targets_T=actions)
    assert loss.item() == pytest.approx(-sum(float(student_on_labels[t]) for t in pos) / len(pos), rel=1e-5)
    q = teacher_out["logprobs_T"]
    agg = AggrevateSpecialization()
    prepared = agg.prepare_batch(with_extra(batch, teacher_logprobs_T=q))
    loss, _ = loss_of(agg, model, prepared)
    qs = torch.tensor([float(q[t]) for t in pos], dtype=torch.float64)
    a = {t: float((q[t] - qs.mean()) / (qs.std() + 1e-8)) for t in pos}
    logp = naive_logprobs(model, batch)
    assert loss.item() == pytest.approx(-sum(a[t] * float(logp[t]) for t in pos) / len(pos), rel=1e-4)


def _seq_sums(values, batch):
    return [sum(float(values[t]) for t in completion_positions(batch, b)) for b in range(batch.num_seqs)]


def test_dpo_surrogate_value_and_gradient(model):
    batch = preference_batch()
    ref = naive_logprobs(make_decoder(4), batch)
    spec = DPOSpecialization(beta=0.5, ref_key="ref_logprobs_T")
    current = naive_logprobs(model, batch)
    prepared = spec.prepare_batch(with_extra(batch, ref_logprobs_T=ref, current_logprobs_T=current))
    s, r = _seq_sums(current, batch), _seq_sums(ref, batch)
    pairs = [(0, 2), (3, 1)]  # (chosen, rejected)
    expected = sum(math.log1p(math.exp(-0.5 * ((s[c] - r[c]) - (s[j] - r[j])))) for c, j in pairs) / 2
    # the loss splits into any micro-batches: run the pair members in different ones
    model.zero_grad()
    total = 0.0
    for idx in ([0, 1], [2, 3]):
        mb = prepared.select(idx)
        out = spec.extract_model_output(model, mb)
        loss, _ = spec.compute_loss(out, mb, _reducer(2.0))
        loss.backward()
        total += loss.item()
    assert total == pytest.approx(expected, rel=1e-5)
    grad_split = [p.grad.clone() for p in model.parameters()]
    # the gradient equals autograd through the true DPO loss
    model.zero_grad()
    lp = spec.extract_model_output(model, batch)["logprobs_T"]
    sums = [sum(lp[t] for t in completion_positions(batch, b)) for b in range(4)]
    true = sum(-torch.nn.functional.logsigmoid(0.5 * ((sums[c] - r[c]) - (sums[j] - r[j]))) for c, j in pairs) / 2
    true.backward()
    for g, p in zip(grad_split, model.parameters()):
        assert torch.allclose(g, p.grad, atol=1e-6)
    # dpo recipe flavour: the batch's own logprobs_T are the reference
    spec2 = DPOSpecialization(beta=0.5, ref_key="logprobs_T")
    prepared2 = spec2.prepare_batch(with_extra(batch, current_logprobs_T=current))
    l2, m2 = loss_of(spec2, model, prepared2)
    r2 = _seq_sums(batch.logprobs_T, batch)
    exp2 = sum(math.log1p(math.exp(-0.5 * ((s[c] - r2[c]) - (s[j] - r2[j])))) for c, j in pairs) / 2
    assert l2.item() == pytest.approx(exp2, rel=1e-5)


def _reducer(denominator):
    return PlainReducer(denominator)


def test_reward_model_bradley_terry(model):
    batch = preference_batch()
    spec = RewardModelSpecialization()
    rm = spec.wrap_model(model)
    with torch.no_grad():
        rm.score.weight.normal_(0, 0.5)
    scores = spec.extract_model_output(rm, batch)["scores_B"].detach()
    prepared = spec.prepare_batch(with_extra(batch, current_scores_B=scores))
    loss, metrics = loss_of(spec, rm, prepared)
    expected = (math.log1p(math.exp(-(scores[0] - scores[2]))) + math.log1p(math.exp(-(scores[3] - scores[1])))) / 2
    assert loss.item() == pytest.approx(float(expected), rel=1e-5)
    # score = head on the last token of the sequence
    hidden = model(batch.input_ids_T[:6], torch.arange(6))
    assert scores[0].item() == pytest.approx((hidden[-1] @ rm.score.weight[0]).item(), abs=1e-5)


def test_preference_batch_errors():
    batch = rl_batch()  # group c has equal rewards, groups have 2 members
    with pytest.raises(ValueError, match="both sequences have reward"):
        DPOSpecialization(ref_key="logprobs_T").prepare_batch(with_extra(batch, current_logprobs_T=batch.logprobs_T))
    three = batch.select([0, 1, 2])
    with pytest.raises(ValueError, match="exactly 2 sequences"):
        DPOSpecialization(ref_key="logprobs_T").prepare_batch(with_extra(three, current_logprobs_T=three.logprobs_T))


def test_bad_arguments_are_one_line_errors():
    with pytest.raises(ConfigError, match="advantage_estimator"):
        ActorConfig(advantage_estimator="grpoo")
    with pytest.raises(ConfigError, match="use_decoupled_loss"):
        ActorConfig(policy_loss="gspo", use_decoupled_loss=True)
    with pytest.raises(ValueError, match="needs batch.extra keys"):
        ActorSpecialization(ActorConfig(kl_coef=0.1)).prepare_batch(rl_batch())
