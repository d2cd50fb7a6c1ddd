import math

import pytest
import torch

from areno.api.types import SamplingParams
from areno.rollout.sampling import SampleRequest, Sampler, _truncate, check_stop, suppressed_ids


def test_top_k_and_top_p_keep_the_hand_computed_sets():
    probs = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]])
    logits = probs.log()
    keep = lambda p: torch.isfinite(_truncate(logits, [p]))[0].tolist()  # noqa: E731
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
