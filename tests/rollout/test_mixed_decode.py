"""Decode steps after a mixed step (``RolloutEngineConfig.mixed_decode_min_rows``): a round trip that
prefills newly admitted requests beside decoding rows goes on with ``decode_steps`` decode steps of
every row that sampled, and gives exactly the one-step engine's tokens, log-probs and finish reasons."""

import dataclasses

import pytest
import torch

from areno.rollout.engine import RolloutEngine, RolloutEngineConfig
from areno.rollout.sampling import RowParams
from areno.types import SamplingParams
from tests.helpers.rollout import eager_runner, engine, make_model, random_prompts, same, sampled_mix


def drive(eng: RolloutEngine, prompts, params, arrive_every: int = 2) -> tuple[list, list[int]]:
    """Requests arrive two at a time every ``arrive_every`` steps (the others decode meanwhile), so
    most steps are mixed. Returns the outputs in request order and the tokens each step produced."""
    ids, done, per_step = [], {}, []
    pending = list(zip(prompts, params))
    step = 0
    while pending or len(done) < len(ids):
        if pending and step % arrive_every == 0:
            for p, sp in pending[:2]:
                ids.append(eng.add_request(p, sp))
            pending = pending[2:]
        before = eng.stats()["generated_tokens"]
        done.update({o.request_id: o for o in eng.step()})
        per_step.append(eng.stats()["generated_tokens"] - before)
        step += 1
    return [done[i] for i in ids], per_step


@pytest.fixture(scope="module")
def tiny_model():
    return make_model(0)


@pytest.mark.parametrize("graphs", [False, True])
def test_mixed_steps_decode_on_with_the_one_step_engines_tokens(tiny_model, graphs):
    """Greedy and seeded rows with top-p/top-k, min_new_tokens, stop ids and EOS, arriving while
    others decode (capture emulated on CPU for ``graphs``)."""
    prompts = random_prompts(14, seed=51, lo=3, hi=20)
    eos = (9, 17, 23)
    params = sampled_mix(14, eos)
    params[5] = SamplingParams(temperature=0, max_new_tokens=1)  # ends on its first token (length)
    ref, ref_steps = drive(engine(tiny_model, 1, eos=eos), prompts, params)
    eng = engine(tiny_model, 4, graphs=graphs, eos=eos)
    got, got_steps = drive(eng, prompts, params)
    same(got, ref)
    assert {o.finish_reason for o in ref} == {"stop", "length"}
    stats = eng.stats()
    # mixed steps went on decoding: some step gave a row more than one token though requests were prefilling
    assert stats["mixed_steps"] >= 5 and stats["steps"] > stats["sampling_round_trips"] + stats["mixed_steps"]
    assert len(got_steps) < len(ref_steps) - 5
    assert eng.allocator.num_used == 0 and eng.scheduler.block_tables_RN.eq(eng.cache.scratch_block).all()
    if graphs:
        assert eng._graphs._loops, "the k-step loop graph never served the steps after a mixed step"


def test_a_mixed_round_trip_gives_each_row_decode_steps_tokens(tiny_model):
    """k tokens per row per round trip, mixed or not (the first from the mixed forward, k - 1 from
    the loop), so rows admitted together stay in step; not while a waiting request could take a free
    slot or a prompt is half prefilled."""
    eng = engine(tiny_model, 4, max_num_seqs=6)
    p = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    for prompt in random_prompts(4, seed=55, lo=3, hi=8):
        eng.add_request(prompt, p)

    def tokens_of_step() -> int:
        before = eng.stats()["generated_tokens"]
        eng.step()
        return eng.stats()["generated_tokens"] - before

    assert tokens_of_step() == 4 * 4  # a prefill-only step, then 3 decode steps
    assert tokens_of_step() == 4 * 4  # pure decode
    for prompt in random_prompts(2, seed=56, lo=3, hi=8):
        eng.add_request(prompt, p)
    assert tokens_of_step() == 6 * 4 and eng.stats()["mixed_steps"] == 2
    assert eng.loop_steps == (4, 3)

    def arrival_step(first, later, **kw) -> tuple[RolloutEngine, int]:
        """An engine runs ``first`` for one round trip; ``later`` arrive; the tokens of the next one."""
        eng_ = engine(tiny_model, 4, max_num_seqs=6, **kw)
        for prompt in first:
            eng_.add_request(prompt, p)
        eng_.step()
        for prompt in later:
            eng_.add_request(prompt, p)
        before = eng_.stats()["generated_tokens"]
        eng_.step()
        return eng_, eng_.stats()["generated_tokens"] - before

    # a long prompt prefilled in chunks of 8: its mixed steps keep one token per decoding row
    _, n = arrival_step(random_prompts(3, seed=58, lo=3, hi=8), random_prompts(1, seed=57, lo=20, hi=21))
    assert n == 3
    # the token budget prefills one of two arrivals and only starts the other: one token per row,
    # so the other's prefill goes on at the next round trip
    eng3, n = arrival_step(
        random_prompts(4, seed=59, lo=2, hi=4), random_prompts(2, seed=60, lo=6, hi=8), max_tokens_per_step=12
    )
    assert n == 5
    assert sum(s.num_computed < len(s.token_ids) - 1 for s in eng3.scheduler.running) == 1
    # the budget is spent on the first arrival's whole prompt; the second waits with slots free
    eng4, n = arrival_step(
        random_prompts(4, seed=59, lo=2, hi=4), random_prompts(2, seed=61, lo=8, hi=9), max_tokens_per_step=12
    )
    assert n == 5 and len(eng4.scheduler.waiting) == 1


def test_mixed_decode_stop_strings_context_limit_and_abort(tiny_model):
    from areno.data.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer("abcdefghijklmnopqrstuvwxyz")
    prompts = [tok.encode(w) for w in ("hello", "world", "abc", "mixed", "steps", "zz")]
    free = (
        engine(tiny_model, 1, tokenizer=tok, eos=())
        .generate(prompts[:1], SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True))[0]
        .text
    )
    params = [
        SamplingParams(temperature=0, max_new_tokens=60, ignore_eos=True, stop=(free[3:5],)),
        SamplingParams(temperature=0, max_new_tokens=70, ignore_eos=True),
    ] * 3  # 70: the context ends first
    ref, _ = drive(engine(tiny_model, 1, tokenizer=tok, eos=(), max_model_len=24), prompts, params)
    eng = engine(tiny_model, 4, tokenizer=tok, eos=(), max_model_len=24)
    got, _ = drive(eng, prompts, params)
    same(got, ref)
    assert [o.text for o in got] == [o.text for o in ref] and ref[0].finish_reason == "stop"
    assert all(len(o.prompt_ids) + len(o.output_ids) == 24 for o in got[1::2])
    # abort between round trips returns what was committed; its blocks come back
    rid = eng.add_request(prompts[0], SamplingParams(temperature=0, max_new_tokens=50, ignore_eos=True))
    eng.step()
    eng.add_request(prompts[1], SamplingParams(temperature=0, max_new_tokens=50, ignore_eos=True))
    eng.step()
    out = eng.abort(rid)
    assert out.finish_reason == "abort" and 1 < len(out.output_ids) < 50
    while eng.has_unfinished():
        eng.step()
    assert eng.allocator.num_used == 0


def test_small_mixed_steps_keep_one_token_below_the_row_minimum(tiny_model):
    prompts = random_prompts(6, seed=52)
    params = [SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)] * 6
    on = engine(tiny_model, 4, mixed_decode_min_rows=2)
    off = engine(tiny_model, 4, mixed_decode_min_rows=None)
    wide = engine(tiny_model, 4, mixed_decode_min_rows=100)
    outs = {name: drive(e, prompts, params) for name, e in (("on", on), ("off", off), ("wide", wide))}
    same(outs["on"][0], outs["off"][0])
    same(outs["wide"][0], outs["off"][0])
    assert off.stats()["steps"] == wide.stats()["steps"]
    # off: a mixed step samples one token per row; on: more round trips end with several tokens per row
    assert off.stats()["sampling_round_trips"] == wide.stats()["sampling_round_trips"]
    assert on.stats()["sampling_round_trips"] < off.stats()["sampling_round_trips"]


def test_mixed_decode_when_the_pool_is_short_preempts_and_matches(tiny_model):
    """Too few KV blocks for everyone: preemption and refused reservations, same tokens."""
    prompts = random_prompts(10, seed=53, lo=6, hi=20)
    params = [SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True) for n in (20, 9, 14, 30, 5) * 2]
    ref, _ = drive(engine(tiny_model, 1, num_blocks=24), prompts, params)
    eng = engine(tiny_model, 4, num_blocks=24)
    got, _ = drive(eng, prompts, params)
    same(got, ref)
    assert eng.stats()["num_preemptions"] > 0 and eng.allocator.num_used == 0


def test_row_params_shifted_counts_the_first_token():
    params = [
        SamplingParams(temperature=0.5, max_new_tokens=5, min_new_tokens=4, seed=3),
        SamplingParams(temperature=0, max_new_tokens=9, stop_token_ids=(4, 6)),
    ]
    rp = RowParams.build(params, [1, 0], [7, 30], (2,), 50, 32, torch.device("cpu"))
    sh = rp.shifted(1)
    assert sh.n_gen_B.tolist() == [2, 1] and sh.room_B.tolist() == [min(5 - 2, 32 - 8), min(9 - 1, 32 - 31)]
    assert rp.n_gen_B.tolist() == [1, 0] and rp.table_FB is not sh.table_FB  # the original is untouched
    assert sh.steps_done == 0 and sh.mode == rp.mode
    assert torch.equal(sh.advance(torch.tensor([2, 4])), torch.tensor([False, True]))


def test_mixed_decode_min_rows_is_validated():
    with pytest.raises(ValueError, match="mixed_decode_min_rows"):
        RolloutEngineConfig(mixed_decode_min_rows=0)
    assert dataclasses.replace(RolloutEngineConfig(), mixed_decode_min_rows=None).mixed_decode_min_rows is None


@pytest.mark.gpu
@pytest.mark.parametrize("decode_attention", ["gather", "paged"])
def test_mixed_decode_with_cuda_graphs_matches_the_one_step_engine_on_gpu(decode_attention):
    """On CUDA: the decode steps after a mixed step replay the captured k-step loop (first tokens
    copied on the device into its static input) with the one-step engine's tokens and log-probs
    (greedy and seeded rows arriving while others decode), and the device-built decode metadata of
    the mixed step itself agrees with the host-built one."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model, cfg = make_model(0)
    model = model.cuda()
    prompts = random_prompts(14, seed=54, lo=3, hi=20)
    eos = (9, 17, 23)
    params = sampled_mix(14, eos)
    outs, engines = {}, {}
    for name, k, graphs in (("one_step", 1, False), ("k_graph", 8, True)):
        eng = RolloutEngine(
            model,
            cfg,
            config=RolloutEngineConfig(
                block_size=4,
                num_blocks=256,
                max_num_seqs=8,
                max_tokens_per_step=48,
                prefill_chunk_size=8,
                decode_steps=k,
                cuda_graphs=graphs,
                decode_attention=decode_attention,
                mixed_decode_min_rows=1,
            ),
            eos_token_ids=eos,
        )
        outs[name], _ = drive(eng, prompts, params)
        engines[name] = eng
    eng = engines["k_graph"]
    assert eng._graphs._loops and eng.stats()["mixed_steps"] >= 5
    assert eng.stats()["steps"] > eng.stats()["sampling_round_trips"] + eng.stats()["mixed_steps"]
    assert [o.output_ids for o in outs["k_graph"]] == [o.output_ids for o in outs["one_step"]]
    assert [o.finish_reason for o in outs["k_graph"]] == [o.finish_reason for o in outs["one_step"]]
    for a, b in zip(outs["k_graph"], outs["one_step"]):
        torch.testing.assert_close(a.output_logprobs, b.output_logprobs, rtol=0, atol=1e-4)


def test_warmup_captures_the_loops_after_mixed_steps_for_large_batches_only(tiny_model):
    """``warmup_cuda_graphs``: the (k - 1)-step loops that follow mixed steps for batch buckets of at
    least ``mixed_decode_min_rows`` rows, besides the k-step loops for every bucket (capture
    emulated on CPU); None: no (k - 1)-step loops."""
    for min_rows, want in ((8, {(4, 4), (16, 4), (16, 3)}), (None, {(4, 4), (16, 4)})):
        eng = engine(tiny_model, 4, max_num_seqs=16, mixed_decode_min_rows=min_rows)
        eng._graphs = eager_runner(eng, max_batch=16)
        eng.warmup_cuda_graphs([3, 12], max_len=16)
        assert {(key[0], key[2]) for key in eng._graphs._loops} == want
        assert eng.loop_steps == ((4, 3) if min_rows else (4,))
