"""The fused sampler (areno/rollout/fused_sampler.py): its judge of a draw by hand, the sampler's routing
through it on CPU with an eager stand-in for the kernels, and on CUDA (gpu tests) the kernels themselves."""

from __future__ import annotations

import math

import pytest
import torch

from areno.rollout import fused_sampler
from areno.rollout.sampling import RowParams, RowTensors, Sampler, inverse_cdf_draw
from areno.types import SamplingParams


def eager_draw(logits_BV, scale_B, u_B, greedy_B, stop_ids_BS=None, pending_BS=None):
    """``fused_sampler.draw``'s contract in eager ops: the reference the kernels are judged by."""
    x_BV = logits_BV.float() / scale_B[:, None]
    suppressed_BV = torch.zeros_like(x_BV, dtype=torch.bool)
    if stop_ids_BS is not None:
        suppressed_BV.scatter_(1, stop_ids_BS, pending_BS)
    xs_BV = x_BV.masked_fill(suppressed_BV, float("-inf"))
    logprobs_BV = torch.log_softmax(x_BV, dim=-1)
    tokens_B = xs_BV.argmax(dim=-1)
    if u_B is not None:
        sampled_B = inverse_cdf_draw(xs_BV, u_B, logprobs_BV.exp().masked_fill(suppressed_BV, 0.0))
        tokens_B = sampled_B if greedy_B is None else torch.where(greedy_B, tokens_B, sampled_B)
    return tokens_B, logprobs_BV.gather(1, tokens_B[:, None]).squeeze(1)


def test_interval_misses_by_hand():
    """Weights 1/4, 3/4 (cumulative 0.25, 1): u = 0.2 draws token 0, u = 0.3 token 1; a target within
    ``rtol`` of an edge accepts either side; a suppressed token is never a valid draw."""
    logits = torch.tensor([[0.0, math.log(3.0)]] * 4)
    scale = torch.ones(4)
    u = torch.tensor([0.2, 0.2, 0.3, 0.25 + 1e-7])
    miss = fused_sampler.interval_misses(logits, scale, u, torch.tensor([0, 1, 1, 0]))
    assert miss.tolist() == [False, True, False, False]
    assert not fused_sampler.interval_misses(logits, scale, u[3:], torch.tensor([1]))[0]  # either side of the edge
    suppressed = torch.tensor([[True, False]])
    one = (logits[:1], scale[:1], u[:1])
    assert fused_sampler.interval_misses(*one, torch.tensor([1]), suppressed).tolist() == [False]
    assert fused_sampler.interval_misses(*one, torch.tensor([0]), suppressed).tolist() == [True]
    # temperature 0.5: weights 1/10, 9/10
    assert fused_sampler.interval_misses(logits[:1], torch.tensor([0.5]), u[:1], torch.tensor([1])).tolist() == [False]


def test_self_check_passes_the_contract_and_catches_a_wrong_draw(monkeypatch):
    """The self-check that gates the kernels: an eager draw of the contract passes, a draw one token off
    (or a greedy row off) is reported, an exception is reported rather than raised."""
    monkeypatch.setattr(fused_sampler, "draw", eager_draw)
    assert fused_sampler.self_check("cpu") is None

    def shifted(*args, **kwargs):
        tokens, logprobs = eager_draw(*args, **kwargs)
        return (tokens + 1) % args[0].shape[1], logprobs

    monkeypatch.setattr(fused_sampler, "draw", shifted)
    assert "differ" in fused_sampler.self_check("cpu")

    def sampled_off(*args, **kwargs):
        tokens, logprobs = eager_draw(*args, **kwargs)
        greedy = args[3]
        return torch.where(greedy, tokens, (tokens + 1) % args[0].shape[1]), logprobs

    monkeypatch.setattr(fused_sampler, "draw", sampled_off)
    assert "outside their interval" in fused_sampler.self_check("cpu")

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel")

    monkeypatch.setattr(fused_sampler, "draw", broken)
    assert fused_sampler.self_check("cpu") == "RuntimeError: no kernel"


PARAMS = [
    SamplingParams(temperature=0, min_new_tokens=3, max_new_tokens=9),
    SamplingParams(temperature=1.0, top_p=0.7, min_new_tokens=5, max_new_tokens=9, seed=4),
    SamplingParams(temperature=0.6, top_k=5, stop_token_ids=(7,), max_new_tokens=9, seed=11),
    SamplingParams(temperature=1.4, max_new_tokens=9, seed=2**40 + 3),
    SamplingParams(temperature=0, max_new_tokens=9),
    SamplingParams(temperature=1.0, min_new_tokens=2, max_new_tokens=9, seed=5),
    SamplingParams(temperature=0.8, max_new_tokens=9),
]
N_GEN = [1, 2, 0, 3, 4, 1, 0]


def _rows(params, n_gen, V):
    return RowParams.build(params, n_gen, [10] * len(params), (2,), V, max_len=64, device=torch.device("cpu"))


def _logits(V=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(PARAMS), V, generator=g) * 3
    logits[[0, 1, 4, 5], 2] = 20.0  # EOS is these rows' favourite by far: suppression decides
    return logits


@pytest.mark.parametrize("rows", [slice(0, 7), slice(3, 4), slice(0, 1), slice(3, 7), slice(1, 3)])
def test_sampler_through_the_fused_draw_equals_the_eager_sampler(monkeypatch, rows):
    """With the draw routed through ``fused_sampler`` (here its eager contract standing in for the
    kernels), both samplers give the eager sampler's tokens and log-probs: the temperature, the
    uniforms (seeded, unseeded, greedy rows), and the suppressed stop ids reach the draw."""
    logits = _logits()[rows]
    params, n_gen = PARAMS[rows], N_GEN[rows]
    want = {}
    for fused in (False, True):
        if fused:
            monkeypatch.setattr(fused_sampler, "serves", lambda x: True)
            monkeypatch.setattr(fused_sampler, "draw", eager_draw)
        sampler = Sampler(device=torch.device("cpu"), seed=0)
        rp = _rows(params, n_gen, logits.shape[1])
        got_rows = sampler.sample_rows(logits, rp)
        t = RowTensors.from_table(rp.table_FB, 64)
        sampler = Sampler(device=torch.device("cpu"), seed=0)
        got_static = sampler.sample_static(logits.clone(), t, t.n_gen_B, rp.mode)
        if not fused:
            want = {"rows": got_rows, "static": got_static}
            continue
        for name, got in (("rows", got_rows), ("static", got_static)):
            assert torch.equal(got[0], want[name][0]), name
            torch.testing.assert_close(got[1], want[name][1], rtol=0, atol=1e-6)


def test_rows_that_truncate_keep_the_eager_draw(monkeypatch):
    """In a batch with top-k / top-p rows, those rows take the eager sort and draw and every other row
    the fused draw's result, so a row's token does not depend on what else is in its batch."""
    V = 50
    marker = (torch.full((len(PARAMS),), V - 1), torch.full((len(PARAMS),), -123.0))
    calls = []

    def marked(*args, **kwargs):
        calls.append(args)
        return marker[0][: args[0].shape[0]].clone(), marker[1][: args[0].shape[0]].clone()

    logits = _logits(V)
    rp = _rows(PARAMS, N_GEN, V)
    want_tok, want_lp = Sampler(device=torch.device("cpu"), seed=0).sample_rows(logits, rp)
    monkeypatch.setattr(fused_sampler, "serves", lambda x: True)
    monkeypatch.setattr(fused_sampler, "draw", marked)
    truncating = [p.temperature > 0 and (p.top_k > 0 or p.top_p < 1) for p in PARAMS]
    for tok, lp in (
        Sampler(device=torch.device("cpu"), seed=0).sample_rows(logits, _rows(PARAMS, N_GEN, V)),
        Sampler(device=torch.device("cpu"), seed=0).sample_static(
            logits.clone(), *(lambda t: (t, t.n_gen_B))(RowTensors.from_table(rp.table_FB, 64)), rp.mode
        ),
    ):
        for i, trunc in enumerate(truncating):
            if trunc:
                assert tok[i] == want_tok[i] and lp[i] == want_lp[i]
            else:
                assert tok[i] == V - 1 and lp[i] == -123.0
    assert len(calls) == 2


def test_cpu_never_takes_the_fused_draw():
    """No CUDA here (or CPU logits anywhere): the eager sampler runs, whatever ``enable`` says."""
    assert not fused_sampler.serves(torch.zeros(2, 8))
    if not torch.cuda.is_available():
        assert fused_sampler.enable() is False


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernels_draw_the_contract_on_gpu(dtype):
    """The kernels at a real vocabulary (151,936, 64 rows): greedy rows equal the masked argmax, every
    sampled row's token holds its target in float64 interval bounds, log-probs within 1e-4 of
    ``log_softmax``; against the eager sampler's draw with the same uniforms most tokens equal (at this
    vocabulary an interval is ~1e-5 of the total, so the two fp32 cumulative sums' rounding moves about
    one row in 64 across an edge; the interval check above is the contract)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    assert fused_sampler.self_check() is None
    g = torch.Generator().manual_seed(1)
    B, V = 64, 151_936
    logits = (torch.randn(B, V, generator=g) * 2).to(dtype).cuda()
    scale = torch.where(torch.arange(B) % 3 == 0, 1.0, 0.7).cuda()
    u = torch.rand(B, generator=g).clamp_min(1e-7).cuda()
    greedy = (torch.arange(B) % 5 == 0).cuda()
    stops = torch.randint(0, V, (B, 3), generator=g).cuda()
    pending = (torch.rand(B, 3, generator=g) < 0.5).cuda()
    scale[greedy] = 1.0
    tok, lp = fused_sampler.draw(logits, scale, u, greedy, stops, pending)
    want_tok, want_lp = eager_draw(logits, scale, u, greedy, stops, pending)
    suppressed = torch.zeros(B, V, dtype=torch.bool, device="cuda").scatter_(1, stops, pending)
    assert torch.equal(tok[greedy], want_tok[greedy])
    assert not bool(fused_sampler.interval_misses(logits.float(), scale, u, tok, suppressed)[~greedy].any())
    assert (tok == want_tok).float().mean().item() >= 0.9
    x = logits.float() / scale[:, None]
    torch.testing.assert_close(lp, torch.log_softmax(x, -1).gather(1, tok[:, None]).squeeze(1), rtol=0, atol=1e-4)
    torch.testing.assert_close(lp[tok == want_tok], want_lp[tok == want_tok], rtol=0, atol=1e-4)
    # strided tables, as the decode loop passes them (a transposed stop table, an expanded mask, a
    # bool greedy flag), are read in place: the same draw as contiguous copies
    strided = (stops.T.contiguous().T, pending[:, :1].expand_as(stops))
    got = fused_sampler.draw(logits, scale, u, greedy, *strided)
    want = fused_sampler.draw(logits, scale, u, greedy.int(), stops, strided[1].contiguous())
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    # greedy only (no uniforms): the argmax of every row
    tok, _ = fused_sampler.draw(logits, torch.ones(B, device="cuda"), None, None)
    assert torch.equal(tok, logits.float().argmax(dim=-1))
    # inside a CUDA graph: the same tokens on replay
    static = logits.clone()
    graph = torch.cuda.CUDAGraph()
    fused_sampler.draw(static, scale, u, greedy, stops, pending)  # compile outside the capture
    with torch.cuda.graph(graph):
        out = fused_sampler.draw(static, scale, u, greedy, stops, pending)
    graph.replay()
    assert torch.equal(out[0], fused_sampler.draw(logits, scale, u, greedy, stops, pending)[0])
