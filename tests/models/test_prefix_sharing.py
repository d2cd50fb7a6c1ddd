"""Shared-prompt training forwards (``models.prefix_sharing``): the packing's indices, and the
hidden states, log-probs and gradients of a shared forward against the unshared one (CPU fp32;
flash in bf16 on a GPU)."""

from __future__ import annotations

import pytest
import torch

from areno.models import attention, prefix_sharing
from areno.specializations import ActorConfig, ActorSpecialization, token_logprobs_T
from areno.types import TokenBatch, Trajectory
from tests.helpers.recipes import VOCAB, loss_of, make_decoder, with_behaviour_logprobs

# (group, prompt tokens, completion length): runs of equal prompts, a singleton, a prompt that
# repeats in a group that is not adjacent, a group whose prompts differ in one token
SPECS = [
    ("a", [5, 6, 7, 8], 3),
    ("a", [5, 6, 7, 8], 5),
    ("a", [5, 6, 7, 8], 1),
    ("b", [9, 10], 4),
    ("c", [5, 6, 7, 8], 2),
    ("c", [5, 6, 7, 8], 6),
    ("d", [11, 12, 13], 2),
    ("d", [11, 12, 14], 3),
]


def shared_batch(specs=SPECS, seed: int = 0) -> TokenBatch:
    gen = torch.Generator().manual_seed(seed)
    trajs = [
        Trajectory(
            prompt_ids=list(prompt),
            completion_ids=torch.randint(3, VOCAB, (n,), generator=gen).tolist(),
            logprobs=[0.0] * n,
            versions=[1] * n,
            reward=float(i % 3),
            group_id=gid,
        )
        for i, (gid, prompt, n) in enumerate(specs)
    ]
    return TokenBatch.from_trajectories(trajs)


def test_plan_packs_each_run_of_equal_prompts_once():
    batch = shared_batch()
    sh = prefix_sharing.plan(batch.input_ids_T, batch.cu_seqlens_B1, batch.loss_mask_T)
    # runs a (3 x 4 prompt tokens) and c (2 x 4) share; b, d and d' do not
    assert sh.saved_tokens == 2 * 4 + 1 * 4
    assert sh.source_C.numel() == batch.num_tokens - sh.saved_tokens
    # every token's packed row holds that token
    ids_C = batch.input_ids_T[sh.source_C]
    assert torch.equal(ids_C[sh.expand_T], batch.input_ids_T)
    # query sequences: a's prompt, its 3 rests, b, c's prompt, its 2 rests, d, d'
    assert (sh.cu_q_B1[1:] - sh.cu_q_B1[:-1]).tolist() == [4, 3, 5, 1, 6, 4, 2, 6, 5, 6]
    assert (sh.cu_k_B1[1:] - sh.cu_k_B1[:-1]).tolist() == [4, 7, 9, 5, 6, 4, 6, 10, 5, 6]
    # a rest's keys: its prompt's rows, then its own rows (the queries)
    keys = sh.key_index_K[sh.cu_k_B1[2] : sh.cu_k_B1[3]].tolist()
    assert keys == [0, 1, 2, 3, *range(int(sh.cu_q_B1[2]), int(sh.cu_q_B1[3]))]


def test_plan_shares_nothing_without_equal_adjacent_prompts():
    batch = shared_batch([("a", [5, 6], 2), ("b", [5, 7], 3), ("c", [5, 6], 1)])
    assert prefix_sharing.plan(batch.input_ids_T, batch.cu_seqlens_B1, batch.loss_mask_T) is None
    # a sequence without loss tokens is all prompt: nothing of it is a rest, so it shares nothing
    batch = shared_batch([("a", [5, 6], 2), ("a", [5, 6], 2)])
    batch.loss_mask_T[batch.cu_seqlens_B1[1] :] = False
    assert prefix_sharing.plan(batch.input_ids_T, batch.cu_seqlens_B1, batch.loss_mask_T) is None


def _logprobs_and_grads(batch: TokenBatch, share: bool, device: str = "cpu", dtype=torch.float32, **kw):
    model = make_decoder(0, **kw).to(device=device, dtype=dtype)
    model.share_prompts = share
    mask_T = batch.loss_mask_T.bool()
    out = token_logprobs_T(model, batch, mask_T=mask_T, with_entropy=True, temperature=0.8)
    w_T = torch.linspace(0.5, 1.5, batch.num_tokens, device=out["logprobs_T"].device)
    ((out["logprobs_T"] + 0.1 * out["entropy_T"]) * w_T).sum().backward()
    return out, {n: p.grad.float().cpu() for n, p in model.named_parameters()}


WINDOWED = {"arch": "gemma3", "sliding_window": 3}
"""A 3-key window in layer 0 only, under which the prompts' and completions' rows see fewer keys."""


@pytest.mark.parametrize("kw", [{}, WINDOWED], ids=["full", "window_in_layer_0"])
@pytest.mark.parametrize("call_entries", [0, None], ids=["batches_by_length", "default"])
def test_shared_forward_equals_unshared_forward_on_cpu(call_entries, kw, monkeypatch):
    """fp32 on the CPU; with ``PAD_CALL_ENTRIES`` = 0 the query sequences go into a padded batch per
    length (``attention.length_buckets``)."""
    if call_entries is not None:
        monkeypatch.setattr(attention, "PAD_CALL_ENTRIES", call_entries)
    batch = shared_batch()
    (ref, ref_grads), (out, grads) = _logprobs_and_grads(batch, False, **kw), _logprobs_and_grads(batch, True, **kw)
    for key in ("logprobs_T", "entropy_T"):
        torch.testing.assert_close(out[key], ref[key], rtol=0, atol=1e-5, msg=key)
    for name, g in ref_grads.items():  # fp32 sums in another order: within 1e-5 of the gradient's scale
        assert (grads[name] - g).abs().max() <= 1e-5 * g.abs().max(), name


def test_critic_values_under_shared_prompts_equal_unshared():
    """A value head over the decoder (``ScalarHeadModel``) shares its decoder's setting."""
    from areno.specializations.forward import ScalarHeadModel, values_T

    batch = shared_batch()
    out = []
    for share in (False, True):
        critic = ScalarHeadModel(make_decoder(0))
        torch.nn.init.normal_(critic.score.weight, generator=torch.Generator().manual_seed(3))
        critic.decoder.share_prompts = share
        assert critic.share_prompts is share
        out.append(values_T(critic, batch))
    torch.testing.assert_close(out[1], out[0], rtol=0, atol=1e-5)


def test_actor_loss_under_shared_prompts_equals_unshared():
    batch = shared_batch()
    spec = ActorSpecialization(ActorConfig(entropy_coef=0.01))
    losses = []
    for share in (False, True):
        model = make_decoder(0)
        model.share_prompts = share
        logp = token_logprobs_T(model, batch, mask_T=batch.loss_mask_T)["logprobs_T"].detach()
        b = spec.prepare_batch(with_behaviour_logprobs(batch, logp))
        losses.append(loss_of(spec, model, b)[0])
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)


def _shared_equals_unshared_in_bf16(device: str, **kw) -> None:
    prompt = [3 + i % (VOCAB - 3) for i in range(64)]
    specs = [("a", prompt, n) for n in (40, 70, 33, 90)] + [("b", prompt[7:30], 50)]
    batch = shared_batch(specs)
    (ref, ref_grads), (out, grads) = (
        _logprobs_and_grads(batch, False, device, torch.bfloat16, **kw),
        _logprobs_and_grads(batch, True, device, torch.bfloat16, **kw),
    )
    mask = batch.loss_mask_T.to(device)
    torch.testing.assert_close(out["logprobs_T"][mask], ref["logprobs_T"][mask], rtol=0, atol=0.05)
    for name, g in ref_grads.items():
        scale = g.abs().max().clamp_min(1e-6)
        assert (grads[name] - g).abs().max() / scale < 0.05, name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kw", [{}, {"arch": "gemma3", "sliding_window": 24}], ids=["full", "window_in_layer_0"])
def test_shared_forward_equals_unshared_forward_with_flash(kw):
    """bf16 on the GPU: the varlen flash path (keys gathered, causal mask aligned to their end)."""
    _shared_equals_unshared_in_bf16("cuda", **kw)


@pytest.mark.parametrize("kw", [{}, {"arch": "gemma3", "sliding_window": 24}], ids=["full", "window_in_layer_0"])
@pytest.mark.parametrize("call_entries", [0, None], ids=["batches_by_length", "default"])
def test_shared_forward_equals_unshared_forward_in_bf16_on_cpu(call_entries, kw, monkeypatch):
    """bf16 on the CPU: the query sequences padded into batches under their masks, attended as two
    bf16 GEMMs around an fp32 softmax (``CpuExplicitAttention``); a batch per length with
    ``PAD_CALL_ENTRIES`` = 0."""
    if call_entries is not None:
        monkeypatch.setattr(attention, "PAD_CALL_ENTRIES", call_entries)
    _shared_equals_unshared_in_bf16("cpu", **kw)


def _token_forward(model, mb):
    return token_logprobs_T(model, mb, mask_T=mb.loss_mask_T)


def test_backend_sets_share_prompts_and_a_step_trains_the_same(tmp_path):
    """``train.share_prompts``: auto and true share (here on CPU), and train one step to the unshared
    step's loss and weights (fp32 rounding); true where it cannot apply is one ConfigError line."""
    from areno.errors import ConfigError
    from areno.train import LocalTrainBackend, TrainBackendConfig
    from tests.helpers.train import make_model_dir, nll_loss, token_denominator

    model_dir = make_model_dir(tmp_path / "m")
    batch = shared_batch([(g, [5, 6, 7, 8, 9], n) for g, n in (("a", 6), ("a", 3), ("a", 8), ("b", 4))])
    params, losses = [], []
    for share in ("auto", True, False):
        b = LocalTrainBackend(TrainBackendConfig(lr=1e-2, device="cpu", grad_clip=None, share_prompts=share))
        b.initialize(model_dir)
        assert b.model.share_prompts is (share is not False)
        metrics = b.train_step(batch, forward_fn=_token_forward, loss_fn=nll_loss, denominator_fn=token_denominator)
        losses.append(metrics["loss"])
        params.append({n: p.detach().clone() for n, p in b.model.named_parameters()})
    assert losses[0] == losses[1] == pytest.approx(losses[2], rel=1e-5)
    for name, p in params[2].items():
        if name.endswith("k_proj.bias"):
            # a key bias shifts every score of a query's row alike: its gradient is 0 but for rounding,
            # which Adam scales to a step of up to lr either way
            continue
        torch.testing.assert_close(params[1][name], p, rtol=1e-4, atol=1e-6, msg=name)
    windowed = LocalTrainBackend(TrainBackendConfig(device="cpu", share_prompts=True))
    windowed.initialize(make_model_dir(tmp_path / "w", arch="mistral", sliding_window=4))  # windows share too
    assert windowed.model.share_prompts
    with pytest.raises(ConfigError, match=r"^train.share_prompts=true: not with train.attention=flex, whose"):
        b = LocalTrainBackend(TrainBackendConfig(device="cpu", share_prompts=True, attention="flex"))
        b.initialize(model_dir)
    with pytest.raises(ConfigError, match=r"^train.share_prompts=true: not with a mixture of experts, whose routing"):
        b = LocalTrainBackend(TrainBackendConfig(device="cpu", share_prompts=True))
        b.initialize(make_model_dir(tmp_path / "moe", arch="qwen3_moe"))
    with pytest.raises(ConfigError, match="train.share_prompts: must be true, false or auto, got 'yes'"):
        TrainBackendConfig(share_prompts="yes")


def test_backend_plans_micro_batches_around_shared_prompts(tmp_path):
    """A sharing backend plans its micro-batches by the rows the shared forwards run (groups kept whole
    where no micro-batch is added), an unsharing one by tokens; a step trains to the same loss."""
    from areno.train import LocalTrainBackend, TrainBackendConfig
    from areno.train.packing import MicroBatchSpec, plan_micro_batches
    from tests.helpers.train import make_model_dir, nll_loss, token_denominator

    model_dir = make_model_dir(tmp_path / "m")
    # three groups of (5 prompt + 2..8) tokens, 9-13 a sequence: 11 + 9 + 13 + 10 = 43 tokens a group
    batch = shared_batch(
        [(g, [5, 6, 7, g_tok, 9], n) for g, g_tok in (("a", 10), ("b", 11), ("c", 12)) for n in (6, 4, 8, 5)]
    )
    seqlens = batch.seqlens_B.tolist()
    losses = []
    for share in (True, False):
        b = LocalTrainBackend(TrainBackendConfig(lr=1e-2, device="cpu", share_prompts=share, max_tokens_per_mb=90))
        b.initialize(model_dir)
        plan = b.plan(batch).per_rank[0]
        by_tokens = plan_micro_batches(seqlens, MicroBatchSpec(max_tokens_per_mb=90)).per_rank[0]
        if share:  # two groups, then one, whole; by tokens the longest first: every group split
            assert plan == [list(range(8)), list(range(8, 12))]
            assert all(len({i // 4 for i in mb}) == 3 for mb in by_tokens)
        else:
            assert plan == by_tokens
        metrics = b.train_step(batch, forward_fn=_token_forward, loss_fn=nll_loss, denominator_fn=token_denominator)
        losses.append(metrics["loss"])
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_varlen_gqa_mode_follows_the_signature_and_the_probe(monkeypatch):
    """``varlen_features``: the flag where varlen_attn has one; else the probe's answer (False
    before the process uses CUDA), so ``varlen_causal`` repeats k/v only where neither takes them."""
    from areno.models import attention

    monkeypatch.setattr(attention, "_varlen_params", lambda: frozenset({"enable_gqa", "window_size"}))
    assert attention.varlen_features() == (attention.GQA_FLAG, True)
    monkeypatch.setattr(attention, "_varlen_params", lambda: frozenset({"window_size"}))
    monkeypatch.setattr(attention, "_NATIVE_GQA", True)
    assert attention.varlen_features() == (attention.GQA_NATIVE, True)
    monkeypatch.setattr(attention, "_NATIVE_GQA", None)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert attention.varlen_features() == ("", True)
