"""CPU decode attention keeping the gathered K/V across pure-decode steps (``attention.DecodeCarry``):
bit-identical to gathering at every step through joins, leaves, new blocks, weight updates, sleep
and abort; and ``begin`` extends only what is still the pool's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from areno.rollout.attention import DecodeCarry
from areno.rollout.engine import RolloutEngine, RolloutEngineConfig
from areno.types import SamplingParams
from tests.helpers.rollout import make_model, random_prompts

GREEDY = SamplingParams(temperature=0, max_new_tokens=23, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=17, ignore_eos=True, seed=5)


def engine(model, cfg, carry: bool, recompute: bool = False) -> RolloutEngine:
    config = RolloutEngineConfig(
        block_size=4,
        num_blocks=200,
        max_num_seqs=5,
        max_model_len=80,
        prefill_chunk_size=8,
        decode_attention="gather",
        recompute_kv_on_weight_update=recompute,
        cpu_decode_carry=carry,
    )
    eng = RolloutEngine(model, cfg, config=config, eos_token_ids=())
    assert (eng.cache.decode_carry is not None) is carry
    return eng


def drive(eng: RolloutEngine, new_state: dict) -> list:
    """9 requests of different lengths through 5 slots; a weight update, a sleep/wake and an abort
    on the way. Returns every output (the aborted one's partial output included)."""
    prompts = random_prompts(9, seed=4, lo=2, hi=20)
    ids = [eng.add_request(p, GREEDY if i % 3 else SEEDED) for i, p in enumerate(prompts)]
    done, step = {}, 0
    while len(done) < len(ids):
        done.update({o.request_id: o for o in eng.step()})
        step += 1
        if step == 9:
            eng.update_weights(new_state.items(), version=1)
        if step == 15:
            eng.sleep()
            eng.wake()
        if step == 20 and ids[7] not in done:
            done[ids[7]] = eng.abort(ids[7])
    return [done[i] for i in ids]


@pytest.mark.parametrize(
    ("recompute", "kw"),
    [(False, {}), (True, {}), (False, {"arch": "gemma3", "sliding_window": 6})],
    ids=["keep-kv", "recompute-kv", "window-in-layer-0"],  # gemma3: both kinds of layer extend one carry
)
def test_carry_is_bit_identical_to_gathering_every_step(recompute, kw):
    model, cfg = make_model(2, **kw)
    new_state = make_model(3, **kw)[0].state_dict()
    carried = engine(model, cfg, True, recompute)
    got = drive(carried, new_state)
    model_b, _ = make_model(2, **kw)
    ref = drive(engine(model_b, cfg, False, recompute), new_state)
    assert [o.output_ids for o in got] == [o.output_ids for o in ref]
    assert [o.output_versions for o in got] == [o.output_versions for o in ref]
    assert [o.output_logprobs for o in got] == [o.output_logprobs for o in ref]  # exactly
    steps = carried.cache.decode_carry.steps
    assert steps["extended"] > 3 * steps["gathered"] > 0


def state(bt, ctx):
    return torch.tensor(bt), torch.tensor(ctx)


def test_flag_validated():
    with pytest.raises(ValueError, match="RolloutEngineConfig.cpu_decode_carry: must be True or False"):
        RolloutEngineConfig(cpu_decode_carry=1)
    model, cfg = make_model(2)
    paged = RolloutEngine(model, cfg, config=RolloutEngineConfig(decode_attention="paged"), eos_token_ids=())
    assert paged.cache.decode_carry is None  # the paged form gathers nothing
    bf16 = RolloutEngine(model, cfg, config=RolloutEngineConfig(dtype="bfloat16"), eos_token_ids=())
    assert bf16.cache.decode_carry is None  # a fresh bfloat16 gather beats the carried strided view


def test_begin_extends_only_what_is_still_the_pools():
    c = DecodeCarry(num_layers=2, capacity=16, max_bytes=1 << 20)
    args = dict(num_kv_heads=2, head_dim=4, block_size=4, itemsize=4)
    assert c.begin(*state([[5, 6], [7, 0]], [6, 3]), **args) is False  # nothing carried yet
    assert c.begin(*state([[5, 6], [7, 0]], [7, 4]), **args) is True  # one token more each
    assert c.begin(*state([[5, 6, 0], [7, 8, 0]], [8, 5]), **args) is True  # row 1 gained block 8
    assert c.begin(*state([[5, 6, 9], [7, 8, 0]], [9, 6]), **args) is True  # row 0 gained block 9
    assert c.begin(*state([[5, 6, 9], [7, 8, 0]], [11, 8]), **args) is False  # two tokens: a step was missed
    assert c.begin(*state([[5, 4, 9], [7, 8, 0]], [12, 9]), **args) is False  # a carried key's block changed
    assert c.begin(*state([[5, 4, 9]], [13]), **args) is False  # rows left
    c.invalidate()
    assert c.begin(*state([[5, 4, 9]], [14]), **args) is False
    assert c.begin(*state([[5, 4, 9, 1, 2]], [15]), **args) is None  # 20 keys > capacity 16: no carry
    small = DecodeCarry(num_layers=2, capacity=16, max_bytes=1000)
    # 128 bytes per key over layers, K and V: the batch's own 4 keys fit (16, for growth, would not)
    assert small.begin(*state([[1]], [1]), **args) is False and small.keys == 4
    assert small.begin(*state([[1]], [2]), **args) is True
    assert small.begin(*state([[1, 2]], [5]), **args) is None  # its 8 keys: 1024 bytes > 1000
    roomy = DecodeCarry(num_layers=2, capacity=64, max_bytes=1 << 20)
    assert roomy.begin(*state([[1, 2]], [5]), **args) is False and roomy.keys == 40  # 8 keys + 8 blocks
    # rows that end within 10 keys: room up to their limit's block, no further (nor less than the tables)
    assert roomy.begin(*state([[1, 2]], [5]), **args, final_keys=10) is False and roomy.keys == 12
    assert roomy.begin(*state([[1, 2]], [5]), **args, final_keys=3) is False and roomy.keys == 8
    assert roomy.begin(*state([[1, 2]], [5]), **args, final_keys=400) is False and roomy.keys == 40
    assert c.steps == {"extended": 3, "gathered": 5}


def test_a_short_rollout_carries_no_room_past_its_rows_limits():
    """Decode rows that end 6 tokens after their prompts: the carried copies hold the longest row's
    limit rounded to a block, not the growth room a long generation gets, with the same tokens."""
    model, cfg = make_model(2)
    eng = engine(model, cfg, True)
    prompts = random_prompts(5, seed=3, lo=5, hi=9)
    short = dataclasses.replace(GREEDY, max_new_tokens=6)
    got = eng.generate(prompts, [short] * 5)
    limit = max(len(p) for p in prompts) + 6
    assert eng.cache.decode_carry.keys == -(-limit // 4) * 4
    ref = engine(make_model(2)[0], cfg, False).generate(prompts, [short] * 5)
    assert [o.output_ids for o in got] == [o.output_ids for o in ref]
    assert [o.output_logprobs for o in got] == [o.output_logprobs for o in ref]


def test_prefill_and_pool_reallocation_drop_the_carry():
    model, cfg = make_model(2)
    eng = engine(model, cfg, True)
    eng.add_request(random_prompts(1, seed=1)[0], GREEDY)
    for _ in range(4):
        eng.step()
    carry = eng.cache.decode_carry
    assert carry.k and carry.steps["extended"] > 0
    eng.add_request(random_prompts(1, seed=2)[0], GREEDY)  # its prefill writes the pool
    eng.step()
    assert not carry.k
    eng.step()
    assert carry.k
    eng.cache.release()
    assert not carry.k


def test_a_long_max_model_len_still_carries_sized_to_the_batch():
    """Copies are sized for the batch's tables, not the longest table the engine allows: with a
    bound that one full-length copy set would exceed, decode still extends, bit-identically."""
    model, cfg = make_model(2)
    config = RolloutEngineConfig(
        block_size=4,
        num_blocks=200,
        max_num_seqs=5,
        max_model_len=cfg.max_position_embeddings,  # the model's whole context
        decode_attention="gather",
    )
    carried = RolloutEngine(model, cfg, config=config, eos_token_ids=())
    dc = carried.cache.decode_carry
    full = 2 * dc.num_layers * carried.cache.num_kv_heads * dc.capacity * carried.cache.head_dim * 4
    carried.cache.decode_carry = DecodeCarry(dc.num_layers, dc.capacity, max_bytes=full - 1)
    prompts = random_prompts(5, seed=1, lo=2, hi=20)
    got = carried.generate(prompts, [GREEDY] * 5)
    ref_engine = RolloutEngine(
        make_model(2)[0], cfg, config=dataclasses.replace(config, cpu_decode_carry=False), eos_token_ids=()
    )
    ref = ref_engine.generate(prompts, [GREEDY] * 5)
    assert [o.output_ids for o in got] == [o.output_ids for o in ref]
    assert [o.output_logprobs for o in got] == [o.output_logprobs for o in ref]
    steps = carried.cache.decode_carry.steps
    assert steps["extended"] > 3 * steps["gathered"] > 0
