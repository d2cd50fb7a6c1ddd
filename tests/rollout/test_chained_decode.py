"""Chained decode round trips (``RolloutEngineConfig.overlap_round_trips``): the next k-step loop is
launched before the host reads the last one's tokens. Run on CPU through ``overlap_round_trips_on_cpu``
(the same code path as CUDA's, minus the overlap itself)."""

import dataclasses
import threading

import pytest

from areno.rollout.control import StepLock
from areno.rollout.engine import RolloutEngine, RolloutEngineConfig
from areno.types import SamplingParams
from tests.helpers.rollout import EOS, make_model, random_prompts


def engine(model, cfg, chained: bool, **kw) -> RolloutEngine:
    config = RolloutEngineConfig(block_size=4, num_blocks=512, overlap_round_trips_on_cpu=chained, **kw)
    return RolloutEngine(model, cfg, config=config, eos_token_ids=(EOS,))


def mixed_params(i: int, n: int) -> SamplingParams:
    """Seeded and greedy rows, stop ids, min_new_tokens, EOS on and off, different length limits."""
    if i % 5 == 4:
        return SamplingParams(temperature=0, max_new_tokens=n - i % 7)
    return SamplingParams(
        temperature=1.0,
        max_new_tokens=n - i % 7,
        min_new_tokens=(n // 2) if i % 2 else 0,
        ignore_eos=i % 3 == 0,
        stop_token_ids=(7,) if i % 4 == 1 else (),
        seed=31 + i,
    )


def run(eng: RolloutEngine, prompts, params):
    return [(o.output_ids, o.output_logprobs, o.finish_reason, o.text) for o in eng.generate(prompts, params)]


def assert_same(a, b):
    assert [x[0] for x in a] == [x[0] for x in b]
    assert [x[2] for x in a] == [x[2] for x in b]
    for (_, lp_a, _, _), (_, lp_b, _, _) in zip(a, b):
        assert lp_a == pytest.approx(lp_b, abs=1e-4)


def test_chained_round_trips_give_the_tokens_of_the_unchained_engine():
    model, cfg = make_model()
    base = random_prompts(6, seed=5)
    prompts = [p for p in base for _ in range(4)]  # GRPO groups: shared prompts, prefix cache hits
    first = [mixed_params(i, 60) for i in range(len(prompts))]
    second = [mixed_params(i + 3, 30) for i in range(8)]
    plain, chained = engine(model, cfg, False), engine(model, cfg, True)
    for eng in (plain, chained):
        eng.results = run(eng, prompts, first) + run(eng, prompts[:8], second)  # the second pass reuses prefixes
    assert_same(plain.results, chained.results)
    assert plain._stepper.chained_round_trips == 0
    assert chained._stepper.chained_round_trips > 5  # long fixed-length rows chained many round trips
    assert not chained.has_unfinished() and chained.allocator.num_used == plain.allocator.num_used


def test_rows_ending_mid_chain_drop_their_tokens_past_the_end():
    """Every row ends at a different length: most chains stop after the round trip that ran past a
    row's end, whose tokens for that row are dropped."""
    model, cfg = make_model(seed=1)
    prompts = random_prompts(10, seed=9)
    params = [SamplingParams(temperature=1.0, max_new_tokens=9 + 5 * i, ignore_eos=True, seed=i) for i in range(10)]
    plain, chained = run(engine(model, cfg, False), prompts, params), run(engine(model, cfg, True), prompts, params)
    assert_same(plain, chained)
    assert [len(x[0]) for x in chained] == [9 + 5 * i for i in range(10)]


def _stop_chain_after_first_read(eng: RolloutEngine, interrupt) -> list[int]:
    """Wrap the stepper's commit: the first time a chained step reads tokens, call ``interrupt``;
    returns the chained count seen at each read."""
    stepper = eng._stepper
    original = stepper._commit_tokens
    seen: list[int] = []

    def commit(*args):
        seen.append(stepper.chained_round_trips)
        if len(seen) == 1:
            interrupt()
        return original(*args)

    stepper._commit_tokens = commit
    return seen


LONG = SamplingParams(temperature=0, max_new_tokens=80, ignore_eos=True)


def decoding_engine() -> RolloutEngine:
    """A chaining engine with four long greedy rows past their prefill."""
    model, cfg = make_model()
    eng = engine(model, cfg, True)
    for p in random_prompts(4, seed=2):
        eng.add_request(p, LONG)
    eng.step()  # prefill
    return eng


def test_a_new_request_ends_the_chain_at_the_next_read():
    eng = decoding_engine()
    seen = _stop_chain_after_first_read(eng, lambda: eng.add_request([5, 6, 7], LONG))
    eng.step()
    # one round trip chained before the first read, none after: the arrival is admitted next step
    assert seen == [1, 1]
    assert len(eng.scheduler.running) == 4
    eng.step()
    assert len(eng.scheduler.running) == 5


def test_a_caller_waiting_for_the_engine_ends_the_chain():
    eng = decoding_engine()
    lock = eng._control.lock
    pauser = threading.Thread(target=eng.pause)

    def start_pauser():
        pauser.start()
        while lock.waiters == 0:  # pause() now blocks on the step lock this step holds
            pass

    seen = _stop_chain_after_first_read(eng, start_pauser)
    eng.step()
    pauser.join(timeout=10)
    assert seen == [1, 1] and eng.is_paused
    assert eng.step() == []


def test_step_lock_counts_blocked_threads_and_is_reentrant():
    lock = StepLock()
    with lock:
        with lock:  # reentrant
            assert lock.waiters == 0
        entered = threading.Event()

        def wait():
            with lock:
                entered.set()

        t = threading.Thread(target=wait)
        t.start()
        while lock.waiters != 1:
            pass
        assert not entered.is_set()
    t.join(timeout=10)
    assert entered.is_set() and lock.waiters == 0
    assert lock.acquire(blocking=False)
    lock.release()


def test_overlap_is_off_on_cpu_unless_asked():
    model, cfg = make_model()
    assert not engine(model, cfg, False)._stepper.overlap
    assert engine(model, cfg, True)._stepper.overlap
    eng = RolloutEngine(
        model,
        cfg,
        config=RolloutEngineConfig(block_size=4, num_blocks=64, decode_steps=1, overlap_round_trips_on_cpu=True),
        eos_token_ids=(EOS,),
    )
    assert not eng._stepper.overlap  # one token per round trip: nothing to chain


@pytest.mark.parametrize("graphs", [False, True])
def test_chained_loops_with_arrivals_match_the_one_step_engine(graphs):
    """Requests arriving while others decode, rows of every sampling kind; the k-step loop served by
    the decode-graph runner (its capture emulated on CPU) for ``graphs``: the chained round trip's
    input tokens are the previous replay's output buffer."""
    from tests.helpers.rollout import drive_arrivals, same, sampled_mix
    from tests.helpers.rollout import engine as small_engine

    tiny = make_model(0)
    prompts = random_prompts(14, seed=51, lo=3, hi=20)
    eos = (9, 17, 23)
    params = [dataclasses.replace(p, max_new_tokens=p.max_new_tokens + 20) for p in sampled_mix(14, eos)]

    ref = drive_arrivals(small_engine(tiny, 1, eos=eos, max_model_len=120), prompts, params, every=6, per=3)
    eng = small_engine(tiny, 4, graphs=graphs, eos=eos, max_model_len=120, overlap_round_trips_on_cpu=True)
    same(drive_arrivals(eng, prompts, params, every=6, per=3), ref)
    assert eng._stepper.chained_round_trips > 0
    assert eng.allocator.num_used == 0 and eng.scheduler.block_tables_RN.eq(eng.cache.scratch_block).all()
    if graphs:
        assert eng._graphs._loops, "no k-step loop graph served the chained round trips"
