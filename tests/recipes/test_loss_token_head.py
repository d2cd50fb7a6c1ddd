"""The LM head on loss tokens only (``token_logprobs_T(mask_T=...)``): on the masked tokens the
values equal the full head's, 0 elsewhere, and the gradients of a loss over those tokens equal the
full head's to fp32 rounding; the specializations score only their batch's loss tokens."""

from __future__ import annotations

import pytest
import torch

from areno.models import logprobs
from areno.specializations import ActorConfig, ActorSpecialization, LogProbSpecialization, token_logprobs_T
from tests.helpers.recipes import PlainReducer, loss_of, make_decoder, naive_logprobs, rl_batch, with_behaviour_logprobs


@pytest.mark.parametrize("chunk_size", [3, 1024])
def test_masked_head_equals_full_head_on_loss_tokens(chunk_size):
    model, batch = make_decoder(0), rl_batch()
    mask_T = batch.loss_mask_T.bool()
    kw = dict(temperature=0.7, with_entropy=True, with_argmax=True, chunk_size=chunk_size)
    full = token_logprobs_T(model, batch, **kw)
    masked = token_logprobs_T(model, batch, mask_T=mask_T, **kw)
    for key in ("logprobs_T", "entropy_T", "argmax_T"):
        assert masked[key].shape == full[key].shape
        torch.testing.assert_close(masked[key][mask_T], full[key][mask_T], rtol=0, atol=1e-6)
        assert not masked[key][~mask_T].any(), key  # nothing scored outside the mask
    assert full["logprobs_T"][~mask_T].abs().sum() > 0  # the prompt tokens were scored by the full head


@pytest.mark.parametrize("keep_bytes", [0, logprobs.KEEP_LOGSOFTMAX_MAX_BYTES])  # recomputed, kept log-softmax
def test_masked_head_gradients_equal_full_head(monkeypatch, keep_bytes):
    monkeypatch.setattr(logprobs, "KEEP_LOGSOFTMAX_MAX_BYTES", keep_bytes)
    batch = rl_batch()
    mask_T = batch.loss_mask_T.bool()
    w_T = torch.linspace(0.5, 1.5, batch.num_tokens)
    grads = []
    for mask in (None, mask_T):
        model = make_decoder(0)
        out = token_logprobs_T(model, batch, mask_T=mask, with_entropy=True, chunk_size=4)
        ((out["logprobs_T"] + 0.1 * out["entropy_T"]) * w_T * mask_T).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_specializations_score_loss_tokens_only():
    model, batch = make_decoder(0), rl_batch()
    mask_T = batch.loss_mask_T.bool()
    ref = naive_logprobs(model, batch)
    for spec in (ActorSpecialization(ActorConfig(entropy_coef=0.01)), LogProbSpecialization()):
        out = spec.extract_model_output(model, batch)
        torch.testing.assert_close(out["logprobs_T"][mask_T], ref[mask_T], rtol=0, atol=1e-5)
        assert not out["logprobs_T"][~mask_T].any()
    # the actor's loss is the full head's: the prompt tokens carried no weight before either
    spec = ActorSpecialization(ActorConfig(entropy_coef=0.01))
    b = spec.prepare_batch(with_behaviour_logprobs(batch, ref))
    loss, _ = loss_of(spec, model, b)
    full_out = token_logprobs_T(model, b, with_entropy=True)
    full_loss, _ = spec.compute_loss(full_out, b, PlainReducer(spec.denominator(b)))
    torch.testing.assert_close(loss, full_loss, rtol=1e-6, atol=1e-7)


@pytest.mark.slow  # a cold inductor compile of the two kernels
def test_masked_head_under_compiled_logprob_kernels():
    """The fused (torch.compile'd) log-prob kernels trace the masked head's row count as well."""
    batch = rl_batch()
    mask_T = batch.loss_mask_T.bool()
    outs = []
    for mask in (None, mask_T):
        model = make_decoder(0)
        with logprobs.compiled_logprob_kernels():
            out = token_logprobs_T(model, batch, mask_T=mask, with_entropy=True, chunk_size=4)
            (out["logprobs_T"] * mask_T).sum().backward()
        outs.append((out["logprobs_T"].detach(), model.output_weight.grad.clone()))
    torch.testing.assert_close(outs[1][0][mask_T], outs[0][0][mask_T], rtol=0, atol=1e-6)
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-5, atol=1e-6)


def test_empty_mask_scores_nothing_and_backward_runs():
    """A rank's dummy micro-batch (nothing in the loss) still runs forward and backward through the head."""
    model, batch = make_decoder(0), rl_batch()
    out = token_logprobs_T(model, batch, mask_T=torch.zeros(batch.num_tokens, dtype=torch.bool), with_entropy=True)
    assert out["logprobs_T"].shape == (batch.num_tokens,) and not out["logprobs_T"].any()
    (out["logprobs_T"].sum() + out["entropy_T"].sum()).backward()
    assert model.output_weight.grad is not None and not model.output_weight.grad.any()
