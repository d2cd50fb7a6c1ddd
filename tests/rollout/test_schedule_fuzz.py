"""Random schedules, one answer: for random arrival patterns, GRPO-like groups sharing a prompt,
greedy and seeded sampling with stop ids / min tokens, and a KV pool small enough to preempt, every
engine configuration (multi-step decode, decode after mixed steps, CUDA-graph capture emulated on
CPU, paged decode attention) gives the tokens, log-probs, versions and finish reasons of the plain
one-step engine."""

import random

import pytest

from tests.helpers.rollout import engine, make_model, random_prompts, same, sampled_mix

VARIANTS = {
    "k4_mixed_paged": dict(decode_steps=4, mixed_decode_min_rows=1, decode_attention="paged"),
    "k3_mixed_graphs": dict(decode_steps=3, mixed_decode_min_rows=1, graphs=True),
    "k4_no_mixed_small_pool": dict(decode_steps=4, mixed_decode_min_rows=None, num_blocks=20),
    # CPU gathered decode keeping the gathered K/V across steps (attention.DecodeCarry); the
    # reference gathers at every step
    "k1_carry": dict(decode_steps=1, mixed_decode_min_rows=None, decode_attention="gather"),
    "k4_mixed_carry": dict(decode_steps=4, mixed_decode_min_rows=1, decode_attention="gather"),
}


def scenario(seed: int):
    rng = random.Random(seed)
    eos = tuple(rng.sample(range(5, 60), 2))
    prompts, params = [], []
    base = sampled_mix(12, eos)
    for g, prompt in enumerate(random_prompts(4, seed=seed, lo=3, hi=18)):
        n = rng.choice((1, 2, 3))  # a group: samples of one prompt (prefix sharing)
        prompts += [prompt] * n
        params += [base[(3 * g + i) % len(base)] for i in range(n)]
    arrivals = [rng.choice((0, 1, 1, 2, 3)) for _ in prompts]  # steps to wait before each arrival
    return prompts, params, eos, arrivals


def drive(eng, prompts, params, arrivals):
    ids, done = [], {}
    queue = list(zip(prompts, params, arrivals))
    wait = queue[0][2] if queue else 0
    while queue or len(done) < len(ids):
        while queue and wait <= 0:
            p, sp, _ = queue.pop(0)
            ids.append(eng.add_request(p, sp))
            wait = queue[0][2] if queue else 0
        done.update({o.request_id: o for o in eng.step()})
        wait -= 1
    return [done[i] for i in ids]


@pytest.fixture(scope="module")
def tiny_model():
    return make_model(3)


@pytest.mark.parametrize("seed", [0, 1, 5])
def test_every_configuration_gives_the_one_step_engines_outputs(tiny_model, seed):
    prompts, params, eos, arrivals = scenario(seed)
    ref_engine = engine(
        tiny_model, 1, eos=eos, mixed_decode_min_rows=None, decode_attention="gather", cpu_decode_carry=False
    )
    ref = drive(ref_engine, prompts, params, arrivals)
    for name, kw in VARIANTS.items():
        kw = dict(kw)
        eng = engine(tiny_model, kw.pop("decode_steps"), eos=eos, **kw)
        got = drive(eng, prompts, params, arrivals)
        same(got, ref)
        assert eng.allocator.num_used == 0, name  # every block returned
        assert eng.stats()["mixed_steps"] > 0, name
        if name.endswith("carry"):
            assert eng.cache.decode_carry.steps["extended"] > 0, name
        if name == "k4_no_mixed_small_pool" and seed in (1, 5):
            assert eng.stats()["num_preemptions"] > 0  # the pool ran out: recomputed, same outputs
