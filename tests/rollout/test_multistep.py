"""Multi-step decode (``decode_steps`` > 1): k decode steps per host round trip give exactly the
tokens, log-probs and finish reasons of the one-step engine."""

import pytest
import torch

from areno.rollout.engine import RolloutEngine, RolloutEngineConfig
from areno.rollout.sampling import DRAW_BLOCK, RowParams, Sampler, hash_uniform, inverse_cdf_draw
from areno.types import SamplingParams
from tests.helpers.rollout import EOS, make_model, naive_greedy, random_prompts

GREEDY = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)


def engine(model_cfg, decode_steps: int, eos=(EOS,), tokenizer=None, **kw) -> RolloutEngine:
    model, cfg = model_cfg
    defaults = dict(block_size=4, num_blocks=128, max_tokens_per_step=64, prefill_chunk_size=8)
    defaults.update(kw)
    return RolloutEngine(
        model,
        cfg,
        config=RolloutEngineConfig(decode_steps=decode_steps, **defaults),
        eos_token_ids=eos,
        tokenizer=tokenizer,
    )


def summary(outs):
    return [(o.output_ids, o.finish_reason, o.output_versions) for o in outs]


def test_multistep_matches_reference_and_runs_fewer_round_trips(tiny):
    model, _ = tiny
    prompts = random_prompts(6, seed=1)
    params = [SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True) for n in (10, 3, 7, 1, 10, 5)]
    eng = engine(tiny, 4)
    outs = eng.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, outs):
        ref_ids, ref_lp = naive_greedy(model, prompt, p.max_new_tokens)
        assert out.output_ids == ref_ids and out.finish_reason == "length"
        assert out.output_logprobs == pytest.approx(ref_lp, abs=1e-4)
    one = engine(tiny, 1)
    assert summary(one.generate(prompts, params)) == summary(outs)
    # Same forward passes; the one-step engine copies tokens to the host after each, this one
    # after each group of up to 4 decode steps.
    assert eng.allocator.num_used == 0 and eng.stats()["steps"] == one.stats()["steps"]
    assert eng.stats()["sampling_round_trips"] <= one.stats()["sampling_round_trips"] - 5
    # prompts are prefilled in a few non-decode (graph-less) steps, as admissions allow; the rest decode
    stats = eng.stats()
    assert 1 <= stats["mixed_steps"] <= len(prompts) and stats["mixed_steps"] < stats["steps"] / 2
    assert stats["prefill_tokens"] == sum(len(p) for p in prompts) - len(prompts)


def test_multistep_stops_eos_stop_ids_min_tokens(tiny):
    prompt = random_prompts(1, seed=9)[0]
    free = engine(tiny, 1).generate([prompt], GREEDY)[0].output_ids
    stop_tok = free[3]
    cases = [
        SamplingParams(temperature=0, max_new_tokens=10, stop_token_ids=(stop_tok,)),
        SamplingParams(
            temperature=0, max_new_tokens=10, min_new_tokens=free.index(stop_tok) + 2, stop_token_ids=(stop_tok,)
        ),
        SamplingParams(temperature=0, max_new_tokens=10),
        SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True),
    ]
    for eos in ((EOS,), (stop_tok,)):
        ref = engine(tiny, 1, eos=eos).generate([prompt] * 4, cases)
        got = engine(tiny, 5, eos=eos).generate([prompt] * 4, cases)
        assert summary(got) == summary(ref)
        for g, r in zip(got, ref):
            assert g.output_logprobs == pytest.approx(r.output_logprobs, abs=1e-5)
    assert ref[0].finish_reason == "stop" and ref[0].output_ids == free[: free.index(stop_tok) + 1]


def test_multistep_stop_strings_and_context_limit(tiny):
    from areno.data.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer("abcdefghijklmnopqrstuvwxyz")
    prompt = tok.encode("hello")
    text = engine(tiny, 1, tokenizer=tok, eos=()).generate([prompt], GREEDY)[0].text
    p = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True, stop=(text[3:5],))
    ref = engine(tiny, 1, tokenizer=tok, eos=()).generate([prompt], p)[0]
    got = engine(tiny, 4, tokenizer=tok, eos=()).generate([prompt], p)[0]
    assert (got.output_ids, got.text, got.finish_reason) == (ref.output_ids, ref.text, "stop")
    long = SamplingParams(temperature=0, max_new_tokens=50, ignore_eos=True)
    outs = engine(tiny, 8, max_model_len=12).generate([[5] * 8, [6] * 3], long)
    assert [len(o.output_ids) for o in outs] == [4, 9] and {o.finish_reason for o in outs} == {"length"}


def test_multistep_seeded_sampling_independent_of_batch_and_k(tiny):
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, max_new_tokens=12, ignore_eos=True, seed=123)
    prompt = random_prompts(1, seed=5)[0]
    others = random_prompts(5, seed=6)
    alone = engine(tiny, 1).generate([prompt], p)[0]
    mixed = engine(tiny, 4).generate(
        others[:2] + [prompt] + others[2:],
        [SamplingParams(temperature=1.0)] * 2 + [p] + [SamplingParams(temperature=0.7, min_new_tokens=3)] * 3,
    )[2]
    assert alone.output_ids == mixed.output_ids
    assert alone.output_logprobs == pytest.approx(mixed.output_logprobs, abs=1e-5)


@pytest.mark.parametrize("arch", ["llama", "mistral", "olmo3"])
def test_multistep_preemption_prefix_sharing_and_families(arch):
    kw = {"sliding_window": 6} if arch in ("mistral", "olmo3") else {}  # olmo3: in layer 0 only
    model, cfg = make_model(0, arch=arch, **kw)
    base = random_prompts(1, seed=3, lo=10, hi=11)[0]
    prompts = [base] * 3 + random_prompts(5, seed=4, lo=8, hi=16)
    eng = engine((model, cfg), 4, num_blocks=14)  # tight pool: preemption and lookahead fallbacks
    outs = eng.generate(prompts, GREEDY)
    assert eng.stats()["num_preemptions"] > 0 and eng.allocator.num_used == 0
    for prompt, out in zip(prompts, outs):
        assert out.output_ids == naive_greedy(model, prompt, 10)[0]


def test_multistep_join_midway_pause_and_weight_swap(tiny):
    model, cfg = make_model(0)
    new_model, _ = make_model(1)
    prompts = random_prompts(3, seed=2)
    eng = engine((model, cfg), 3, recompute_kv_on_weight_update=True)
    ids = [eng.add_request(prompts[0], GREEDY)]
    eng.step()
    eng.step()  # prefill + 3 decode steps in one round trip
    ids.append(eng.add_request(prompts[1], GREEDY))
    eng.step()
    eng.pause()
    assert eng.step() == []
    eng.update_weights(new_model.state_dict().items(), version=1)
    eng.resume()
    ids.append(eng.add_request(prompts[2], GREEDY))
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step()})
    first = done[ids[0]]
    n_old = first.output_versions.count(0)
    assert n_old >= 4 and first.output_versions == [0] * n_old + [1] * (10 - n_old)
    old_model, _ = make_model(0)  # the engine's model now holds the new weights
    assert first.output_ids[:n_old] == naive_greedy(old_model, prompts[0], n_old)[0]
    assert first.output_ids[n_old:] == naive_greedy(new_model, prompts[0] + first.output_ids[:n_old], 10 - n_old)[0]
    assert done[ids[2]].output_ids == naive_greedy(new_model, prompts[2], 10)[0]


def test_row_params_advance_and_suppression_on_device():
    params = [
        SamplingParams(temperature=0, max_new_tokens=3, min_new_tokens=2, stop_token_ids=(1,)),
        SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0, max_new_tokens=9),
    ]
    rp = RowParams.build(params, [0, 0, 0], [4, 4, 4], (2,), vocab_size=5, max_len=7, device=torch.device("cpu"))
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0, 0.0], [0.0, 5.0, 4.0, 1.0, 0.0], [0.0, 1.0, 5.0, 0.0, 0.0]])
    tokens, _ = Sampler(device=torch.device("cpu"), seed=0).sample_rows(logits, rp)
    # Row 0 may not stop before 2 tokens: its stop id 1 and EOS 2 are suppressed; rows 1-2 are not.
    assert tokens.tolist() == [3, 1, 2]
    assert rp.advance(tokens).tolist() == [False, False, True]  # row 2 sampled EOS
    assert rp.advance(torch.tensor([1, 2, 0])).tolist() == [True, False, False]  # stop id at n = 2
    assert rp.advance(torch.tensor([0, 0, 0])).tolist() == [True, True, True]  # max_new 3; context 7 for all


def test_hashed_uniform_is_a_function_of_seed_and_counter():
    a = hash_uniform(torch.tensor([5, 5, 6, 2**40 + 5]), torch.tensor([0, 1, 0, 0]))
    b = hash_uniform(torch.tensor([6, 5]), torch.tensor([0, 0]))
    assert torch.equal(a[0], b[1]) and torch.equal(a[2], b[0]) and len(set(a.tolist())) == 4  # high seed bits count
    u = hash_uniform(torch.arange(20_000), torch.zeros(20_000, dtype=torch.long))
    assert (u > 0).all() and (u < 1).all()
    # uniform: each tenth of (0, 1) holds a tenth of the values
    assert torch.allclose(torch.histc(u, bins=10, min=0, max=1) / 20_000, torch.full((10,), 0.1), atol=0.01)


def test_prefetched_uniforms_are_each_steps_own_hash():
    params = [SamplingParams(temperature=1.0, seed=s, max_new_tokens=20) for s in (7, -3, 2**40 + 1)]
    params.append(SamplingParams(temperature=1.0, max_new_tokens=20))  # unseeded: the generator's noise
    rp = RowParams.build(params, [0, 4, 9, 0], [3, 7, 12, 3], (), vocab_size=5, max_len=64, device=torch.device("cpu"))
    rp.prefetch_uniforms(3)
    # a shifted copy (the tokens after a round trip's first) hashes its own counters, not the block's
    shifted = rp.shifted(2)
    assert torch.equal(shifted.seeded_uniforms(), hash_uniform(shifted.seed_B, shifted.n_gen_B))
    for _ in range(4):  # the fourth step is past the prefetched block: hashed on its own
        assert torch.equal(rp.seeded_uniforms(), hash_uniform(rp.seed_B, rp.n_gen_B))
        rp.advance(torch.zeros(4, dtype=torch.long))
    rp.prefetch_uniforms(2)  # a block from a later step
    assert torch.equal(rp.seeded_uniforms(), hash_uniform(rp.seed_B, rp.n_gen_B))


@pytest.mark.parametrize("block", [DRAW_BLOCK, 2, 3])
def test_inverse_cdf_draw_gives_each_token_its_share_of_a_uniform_grid(block):
    """With u on a grid of n points, token i is drawn for ~p_i * n of them (hand-computed shares)
    and a token of zero probability (-inf) never, u at the top of (0, 1) included. Blocks of 2 and 3
    take the two-level search (a block of zeros, a shorter last block)."""
    probs = torch.tensor([0.5, 0.0, 0.0, 0.0, 0.3, 0.15, 0.05, 0.0])
    n = 1000
    u = (torch.arange(n, dtype=torch.float32) + 0.5) / n
    race = probs.log().repeat(n, 1)
    tokens = inverse_cdf_draw(race, u, block=block)
    counts = torch.bincount(tokens, minlength=8)
    assert counts.tolist() == [500, 0, 0, 0, 300, 150, 50, 0]
    top = inverse_cdf_draw(race[:2], torch.tensor([1 - 2**-24, 2**-149]), block=block)
    assert top.tolist() == [6, 0]  # the last and the first token of non-zero probability
    nan = inverse_cdf_draw(torch.full((1, 8), float("nan")), torch.tensor([0.5]), block=block)
    assert 0 <= int(nan) < 8  # a broken policy's NaN logits still give a valid token id


def test_two_level_draw_picks_the_tokens_of_one_cumulative_sum():
    """Blocks then one block: the token of a single cumulative sum over the row, except where u
    falls within rounding of a boundary between two tokens' intervals."""
    g = torch.Generator().manual_seed(0)
    B, V = 256, 5000
    race = torch.randn(B, V, generator=g) * 3
    race[:, 1000:2200] = float("-inf")  # zero-probability blocks, whole and partial
    u = torch.rand(B, generator=g).clamp_min_(1e-9)
    one = inverse_cdf_draw(race, u, block=V)
    two = inverse_cdf_draw(race, u, block=64)
    cdf = torch.softmax(race.double(), dim=-1).cumsum(dim=-1)
    lower = torch.where(one > 0, cdf.gather(1, (one - 1).clamp(min=0)[:, None]).squeeze(1), 0.0)
    upper = cdf.gather(1, one[:, None]).squeeze(1)
    clear = ((u.double() - lower) > 1e-5) & ((upper - u.double()) > 1e-5)
    assert clear.sum() > 0.9 * B and torch.equal(one[clear], two[clear])
    assert not ((two >= 1000) & (two < 2200)).any()


def test_seeded_rows_sample_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 4000
    params = [SamplingParams(temperature=1.0, seed=s, max_new_tokens=4) for s in range(n)]
    rp = RowParams.build(params, [0] * n, [1] * n, (), vocab_size=4, max_len=64, device=torch.device("cpu"))
    tokens, logprobs = Sampler(device=torch.device("cpu"), seed=0).sample_rows(probs.log().repeat(n, 1), rp)
    freq = torch.bincount(tokens, minlength=4).float() / n
    assert torch.allclose(freq, probs, atol=0.03)
    assert torch.allclose(logprobs, probs.log()[tokens], atol=1e-6)


def test_full_batch_with_waiting_requests_keeps_k_steps_per_round_trip(tiny, monkeypatch):
    """Requests waiting for a slot: a full batch of at least WAITING_CLAMP_MAX_ROWS rows still runs
    decode_steps per round trip, rather than stopping at its first row's length limit; a smaller one
    stops there (the waiting request joins sooner). Tokens are the same either way."""
    from areno.rollout import stepping

    prompts = random_prompts(12, seed=3)
    params = [
        SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)
        for n in (9, 3, 14, 5, 11, 2, 16, 7, 4, 13, 6, 10)
    ]
    reference = summary(engine(tiny, 1, num_blocks=256).generate(prompts, params))
    trips = {}
    for clamp_rows in (0, 1000):  # 6 running rows: never clamped / always clamped
        monkeypatch.setattr(stepping, "WAITING_CLAMP_MAX_ROWS", clamp_rows)
        eng = engine(tiny, 8, num_blocks=256, max_num_seqs=6)  # 6 running, the rest waiting
        assert summary(eng.generate(prompts, params)) == reference
        trips[clamp_rows] = eng.stats()["sampling_round_trips"]
    assert trips[0] < trips[1000], trips
    assert trips[0] <= sum(p.max_new_tokens for p in params) / 8 + len(prompts), trips
