import math

import pytest
import torch

from areno.rollout.sampling import Sampler, SampleRequest, _truncate, check_stop, suppressed_ids
from areno.types import SamplingParams


def test_top_k_and_top_p_keep_the_hand_computed_sets():
    probs = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]])
    logits = probs.log()
    keep = lambda p: torch.isfinite(_truncate(logits, [p]))[0].tolist()
    assert keep(SamplingParams(top_k=2)) == [True, True, False, False, False]
    # top_p=0.8: 0.5 + 0.2 = 0.7 < 0.8, so 0.15 is needed too; 0.85 >= 0.8 stops there.
    assert keep(SamplingParams(top_p=0.8)) == [True, True, True, False, False]
    assert keep(SamplingParams(top_p=0.7)) == [True, True, False, False, False]
    assert keep(SamplingParams(top_p=0.01)) == [True, False, False, False, False]
    assert keep(SamplingParams(top_k=4, top_p=0.8)) == [True, True, True, False, False]
    assert keep(SamplingParams()) == [True] * 5


def test_sampling_frequencies_follow_the_truncated_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(4000, 1)
    sampler = Sampler(device=torch.device("cpu"), seed=0)
    p = SamplingParams(temperature=1.0, top_k=3)
    tokens, logprobs = sampler.sample(logits, [SampleRequest(p, 0, None, ())] * 4000)
    freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / 4000
    expected = torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95
    assert torch.allclose(freq, expected, atol=0.03)
    # Log-probs are of the untruncated distribution.
    assert logprobs[tokens.index(0)] == pytest.approx(math.log(0.5), abs=1e-5)


def test_temperature_scales_logprobs_and_greedy_ignores_noise():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    sampler = Sampler(device=torch.device("cpu"), seed=0)
    tok, lp = sampler.sample(logits, [SampleRequest(SamplingParams(temperature=0), 0, None, ())])
    assert tok == [0] and lp[0] == pytest.approx(float(torch.log_softmax(logits[0], -1)[0]))
    tok, lp = sampler.sample(logits, [SampleRequest(SamplingParams(temperature=0.5, seed=1), 0, None, ())])
    assert lp[0] == pytest.approx(float(torch.log_softmax(logits[0] / 0.5, -1)[tok[0]]))
    # Suppressed ids are never chosen, even greedily.
    tok, _ = sampler.sample(logits, [SampleRequest(SamplingParams(temperature=0), 0, None, (0,))])
    assert tok == [1]


def test_stop_rules():
    p = SamplingParams(max_new_tokens=3, min_new_tokens=2, stop_token_ids=(7,), stop=("ab",))
    assert suppressed_ids(p, 1, (2,)) == (2, 7) and suppressed_ids(p, 2, (2,)) == ()
    assert check_stop(p, [5, 7], (2,), None) == ("stop", None)
    assert check_stop(p, [5, 2], (2,), None) == ("stop", None)
    assert check_stop(p, [5, 6], (2,), "xaby") == ("stop", "x")
    assert check_stop(p, [5, 6, 8], (2,), "xyz") == ("length", "xyz")
    assert check_stop(SamplingParams(ignore_eos=True), [2], (2,), None) == (None, None)
    # a stop string made before min_new_tokens was allowed: only one ending past stop_from cuts
    q = SamplingParams(max_new_tokens=9, min_new_tokens=3, stop=("ab", "zz"))
    assert check_stop(q, [5, 6, 7], (2,), "abxab", stop_from=2) == ("stop", "abx")
    assert check_stop(q, [5, 6, 7], (2,), "abxy", stop_from=2) == (None, "abxy")
    assert check_stop(q, [5, 6, 7], (2,), "abzzy", stop_from=3) == ("stop", "ab")  # "zz" ends past 3


def _rows(params, n_gen, V, eos=(2,)):
    from areno.rollout.sampling import RowParams

    return RowParams.build(params, n_gen, [10] * len(params), eos, V, max_len=64, device=torch.device("cpu"))


def test_static_sampler_matches_sample_rows():
    """The capture-safe sampler (masks instead of row subsets, step counter as a tensor) gives
    sample_rows' tokens and log-probs for greedy and seeded rows, min_new_tokens suppression included."""
    from areno.rollout.sampling import RowTensors

    V = 50
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, V, generator=g) * 3
    logits[[0, 1, 4, 5], 2] = 20.0  # EOS is these rows' favourite by far: suppression decides
    params = [
        SamplingParams(temperature=0, min_new_tokens=3, max_new_tokens=9),
        SamplingParams(temperature=1.0, top_p=0.7, min_new_tokens=5, max_new_tokens=9, seed=4),
        SamplingParams(temperature=0.6, top_k=5, stop_token_ids=(7,), max_new_tokens=9, seed=11),
        SamplingParams(temperature=1.4, max_new_tokens=9, seed=2**40 + 3),
        SamplingParams(temperature=0, max_new_tokens=9),
        SamplingParams(temperature=1.0, min_new_tokens=2, max_new_tokens=9, seed=5),
    ]
    n_gen = [1, 2, 0, 3, 4, 1]
    sampler = Sampler(device=torch.device("cpu"), seed=0)
    for rows in (slice(0, 6), slice(0, 1), slice(1, 4), slice(3, 6)):
        p, n = params[rows], n_gen[rows]
        rp = _rows(p, n, V)
        want_tok, want_lp = sampler.sample_rows(logits[rows], rp)
        t = RowTensors.from_table(rp.table_FB, 64)
        got_tok, got_lp = sampler.sample_static(logits[rows].clone(), t, t.n_gen_B, rp.mode)
        assert torch.equal(got_tok, want_tok) and torch.equal(got_lp, want_lp)
    # Rows 0, 1 and 5 are below min_new_tokens: EOS suppressed; row 4 (greedy, none pending) takes it.
    rp = _rows(params, n_gen, V)
    tok, _ = sampler.sample_static(logits.clone(), RowTensors.from_table(rp.table_FB, 64), rp.n_gen_B, rp.mode)
    assert 2 not in tok[[0, 1, 5]].tolist() and tok[4] == 2
    # One step later row 5 reaches min_new_tokens (2): the counter passed in decides.
    tok, _ = sampler.sample_static(logits.clone(), RowTensors.from_table(rp.table_FB, 64), rp.n_gen_B + 1, rp.mode)
    assert tok[5] == 2


def test_static_sampler_unseeded_rows_use_the_generator():
    from areno.rollout.sampling import RowTensors, SampleMode

    V = 40
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(1))
    params = [
        SamplingParams(temperature=1.0, max_new_tokens=4),
        SamplingParams(temperature=1.0, seed=3, max_new_tokens=4),
        SamplingParams(temperature=0, max_new_tokens=4),
        SamplingParams(temperature=0.5, top_k=3, max_new_tokens=4),
    ]
    rp = _rows(params, [0] * 4, V)
    assert rp.mode == SampleMode(True, True, True, True)
    eager = Sampler(device=torch.device("cpu"), seed=0).sample_rows(logits, rp)
    static = Sampler(device=torch.device("cpu"), seed=0).sample_static(
        logits.clone(), RowTensors.from_table(rp.table_FB, 64), rp.n_gen_B, rp.mode
    )
    assert torch.equal(static[0][1:3], eager[0][1:3]) and torch.equal(static[1][1:3], eager[1][1:3])
    draws = {
        tuple(
            Sampler(device=torch.device("cpu"), seed=s)
            .sample_static(logits.clone(), RowTensors.from_table(rp.table_FB, 64), rp.n_gen_B, rp.mode)[0]
            .tolist()
        )
        for s in range(20)
    }
    assert len(draws) > 1  # unseeded rows follow the generator's seed
    assert all(t[3] in logits[3].topk(3).indices.tolist() for t in draws)  # top-k holds for generator rows too


def test_sample_modes_and_padding_rows():
    from areno.rollout.sampling import GREEDY, RowTensors, SampleMode

    assert SampleMode.of(SamplingParams(temperature=0, top_p=0.5)) == GREEDY
    assert SampleMode.of(SamplingParams(temperature=1.0, top_p=0.95, seed=1)) == SampleMode(True, True, True, False)
    assert SampleMode.of(SamplingParams(temperature=1.0)) == SampleMode(True, False, False, True)
    assert _rows([SamplingParams(temperature=0, min_new_tokens=2)], [0], 10).mode == GREEDY
    assert _rows([SamplingParams(temperature=0), SamplingParams(top_k=3, seed=1)], [0, 0], 10).mode == SampleMode(
        True, True, True, False
    )
    pad = RowTensors.from_table(RowTensors.padding_table(2, 3, 10, torch.device("cpu")), max_len=64)
    assert pad.greedy_B.all() and pad.room_B.tolist() == [1, 1, 1] and not pad.stop_valid_BS.any()
    assert pad.top_k_B.tolist() == [10] * 3 and pad.scale_B.tolist() == [1.0] * 3


@pytest.mark.parametrize("V", [5000, 4096, 8191, 32000, 100])
def test_argmax_rows_equals_argmax(V):
    """The CPU two-level search gives ``argmax``'s indices: ties (first index), a tie between the
    chunks and the remainder, NaNs (first NaN wins), all -inf rows, vocabularies below two chunks."""
    from areno.rollout.sampling import argmax_rows

    g = torch.Generator().manual_seed(V)
    x = torch.randn(12, V, generator=g)
    x[1, V // 3] = x[1, V - 1] = 50.0  # tie: the earlier index
    x[2, V - 1] = 60.0  # maximum in the remainder after the last whole chunk
    x[3, 1] = x[3, V - 2] = 70.0
    x[4] = float("-inf")
    x[5, V // 2] = float("nan")
    x[6, V - 1] = float("nan")
    x[7, 0] = float("nan")
    x[7, V - 1] = float("nan")
    x[8] = 1.0  # all equal: index 0
    x[9, V // 2] = float("inf")
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


def test_draw_from_shifted_exp_weights_equals_draw_from_softmax():
    """The samplers' draw from ``exp(x - max)`` with suppressed ids zeroed picks the tokens the
    softmax of the masked logits picks (the two differ by rounding, so only a uniform within ~1e-7 of
    a boundary could differ), and never a suppressed id; the normaliser beside the weights gives
    ``log_softmax``'s log-probs."""
    from areno.rollout.sampling import _chosen_logprobs, _weights_and_norm, _zero_suppressed, inverse_cdf_draw

    g = torch.Generator().manual_seed(0)
    B, V = 512, 300
    scaled = torch.randn(B, V, generator=g) * 2
    stop_ids = torch.randint(0, V, (B, 3), generator=g)
    suppress = (torch.rand(B, generator=g) < 0.5)[:, None].expand(B, 3)
    masked = scaled.scatter(1, stop_ids, scaled.gather(1, stop_ids).masked_fill(suppress, float("-inf")))
    u = torch.rand(B, generator=g).clamp_min_(1e-9)
    weights, max_, log_sum = _weights_and_norm(scaled)
    tokens = torch.randint(0, V, (B,), generator=g)
    want = torch.log_softmax(scaled, dim=-1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(_chosen_logprobs(scaled, tokens, max_, log_sum), want, rtol=1e-6, atol=1e-7)
    got = inverse_cdf_draw(masked, u, _zero_suppressed(weights, stop_ids, suppress))
    assert torch.equal(got, inverse_cdf_draw(masked, u))
    assert not ((stop_ids == got[:, None]) & suppress).any()
