"""The rollout engine's parts through their own interfaces: ``RequestTable`` (validation, arrival
order, outputs), ``read_checkpoint`` (whole or nothing), the automatic KV pool's size, the block allocator, and the
engine facade sharing one ``EngineControl`` with its weights and stepper."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from safetensors.torch import save_file

from areno.data.tokenizer import build_char_tokenizer
from areno.errors import ConfigError
from areno.rollout.engine import (
    KV_BLOCKS_HEADROOM,
    RolloutEngine,
    RolloutEngineConfig,
    TornWeightsError,
    automatic_num_blocks,
)
from areno.rollout.errors import WeightUpdateError
from areno.rollout.kv_cache import ROOT_KEY, BlockAllocator, KVCache, OutOfBlocksError
from areno.rollout.requests import RequestTable
from areno.rollout.scheduler import Scheduler
from areno.rollout.weights import read_checkpoint
from areno.types import SamplingParams

GREEDY = SamplingParams(temperature=0, max_new_tokens=4)


def _table(num_blocks: int = 16, block_size: int = 4, max_model_len: int = 32, tokenizer=None) -> RequestTable:
    allocator = BlockAllocator(num_blocks, block_size, enable_prefix_sharing=True)
    scheduler = Scheduler(
        allocator,
        max_num_seqs=4,
        max_tokens_per_step=64,
        prefill_chunk_size=16,
        max_blocks_per_seq=max_model_len // block_size,
    )
    return RequestTable(scheduler, vocab_size=10, max_model_len=max_model_len, eos_token_ids=(2,), tokenizer=tokenizer)


def test_request_table_admits_in_arrival_order_and_rejects_bad_requests():
    table = _table()
    first = table.add([1, 3], GREEDY, "a")
    second = table.add([4], GREEDY)
    assert list(table.inbox) == [first, second] and not table.live
    table.admit()
    assert not table.inbox and list(table.live) == [first, second]
    assert [s.arrival for s in table.scheduler.waiting] == [0, 1]
    with pytest.raises(ValueError, match="'a' is already in use"):
        table.add([5], GREEDY, "a")  # live ids are taken too, not only the inbox's
    with pytest.raises(ValueError, match="empty"):
        table.add([], GREEDY)
    with pytest.raises(ValueError, match="token id 10 outside the vocabulary"):
        table.add([1, 10], GREEDY)
    with pytest.raises(ValueError, match="max_model_len=32"):
        table.add(list(range(1, 10)) * 4, GREEDY)
    with pytest.raises(ValueError, match="exceeds the KV pool of 8 tokens"):
        _table(num_blocks=2).add([1], SamplingParams(max_new_tokens=20))
    seq = table.live[first]
    seq.token_ids += [7, 8]
    out = table.output(seq, "abort")
    assert (out.request_id, out.prompt_ids, out.output_ids, out.finish_reason, out.text) == (
        "a",
        [1, 3],
        [7, 8],
        "abort",
        "",
    )


def test_request_table_outputs_in_order_with_decoded_or_cut_texts():
    """``outputs`` decodes the texts of several finished requests at once; a request a stop string
    ended keeps its text, cut before the string."""
    tok = build_char_tokenizer()
    table = _table(num_blocks=64, tokenizer=tok)
    ids = [table.add([1, 3], GREEDY), table.add([4], GREEDY), table.add([5], GREEDY)]
    table.admit()
    seqs = [table.live[i] for i in ids]
    for seq, text in zip(seqs, ("a b", "z. ", "stop here")):
        seq.token_ids += tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    seqs[2].text = "stop"  # as check_stop leaves it
    outs = table.outputs([(seqs[0], "length"), (seqs[1], "stop"), (seqs[2], "stop")])
    assert [(o.request_id, o.finish_reason, o.text) for o in outs] == [
        (ids[0], "length", "a b"),
        (ids[1], "stop", "z. "),
        (ids[2], "stop", "stop"),
    ]
    assert outs[2].output_ids == tok.encode("stop here", add_special_tokens=False) + [tok.eos_token_id]


def test_read_checkpoint_is_whole_or_nothing(tmp_path):
    save_file({"w": torch.ones(2), "lm_head.weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    assert sorted(n for n, _ in read_checkpoint(str(tmp_path), tied=False, fix="fix it")) == ["lm_head.weight", "w"]
    assert [n for n, _ in read_checkpoint(str(tmp_path), tied=True, fix="fix it")] == ["w"]  # the tied copy
    with pytest.raises(WeightUpdateError, match="no .safetensors file or directory"):
        read_checkpoint(str(tmp_path / "missing"), tied=False, fix="fix it")
    (tmp_path / "model.safetensors.index.json").write_text(
        '{"weight_map": {"w": "model.safetensors", "v": "model.safetensors"}}'
    )
    with pytest.raises(WeightUpdateError, match=r"tensor 'v' is listed .* \(1 such tensors\); fix it"):
        read_checkpoint(str(tmp_path), tied=False, fix="fix it")


def test_an_automatic_kv_pool_holds_no_more_blocks_than_the_engine_can_use(tiny):
    """On an H200 a test's tiny model (1 layer, one 16-wide KV head) got ~10^8 blocks from 80% of free memory,
    and the allocator's Python record per block took 120 s to build: the pool is now at most twice the running
    batch's blocks at max_model_len."""
    model, cfg = tiny
    config = RolloutEngineConfig(block_size=4, max_model_len=64, max_num_seqs=3, cpu_kv_cache_bytes=1 << 30)
    eng = RolloutEngine(model, cfg, config=config)
    assert eng.stats()["kv_blocks_total"] == KV_BLOCKS_HEADROOM * 3 * 16  # 64 tokens in blocks of 4
    c = eng.cache
    per_block = KVCache.bytes_per_block(
        num_layers=c.num_layers, block_size=4, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, dtype=c.dtype
    )
    small = RolloutEngine(model, cfg, config=replace(config, cpu_kv_cache_bytes=40 * per_block))
    assert small.stats()["kv_blocks_total"] == 40  # a budget under the cap still decides
    prompts = [[3, 4, 5], [6, 7], [8]]
    assert [o.output_ids for o in eng.generate(prompts, GREEDY)] == [
        o.output_ids for o in small.generate(prompts, GREEDY)
    ]


def test_torn_weights_stop_steps_and_requests_until_a_commit(tiny):
    """``mark_torn`` (weights) is seen by the requests (refused) and the stepper (no step) at once."""
    model, cfg = tiny
    eng = RolloutEngine(model, cfg, config=RolloutEngineConfig(block_size=4, num_blocks=32, max_model_len=64))
    eng.add_request([3, 4, 5], GREEDY, "kept")
    eng.mark_torn("sync failed")
    with pytest.raises(TornWeightsError, match="sync failed"):
        eng.add_request([3], GREEDY)
    assert eng.step() == [] and eng.stats()["steps"] == 0
    eng.commit_weights(7)
    out = eng.generate([[6, 7]], GREEDY)[0]
    assert eng.version == 7 and out.output_versions == [7] * 4
    assert eng.stats()["generated_tokens"] == 8  # "kept" was kept, and finished beside it


def test_clearing_the_prefix_cache_frees_its_blocks_and_forgets_their_content():
    """After ``clear_prefix_cache`` no prefix matches, evictable blocks are free again, a block still
    held stays held, and a block may register the same content anew."""
    allocator = BlockAllocator(8, 2, enable_prefix_sharing=True)
    held, parked = allocator.allocate(), allocator.allocate()
    key = allocator.register(held, 0, (1, 2))
    allocator.register(parked, key, (3, 4))
    allocator.free(parked)  # registered, unreferenced: evictable
    assert allocator.num_available == 7
    allocator.clear_prefix_cache()
    assert allocator.match_prefix([1, 2, 3, 4], 4)[0] == []
    assert allocator.num_available == 7 and allocator.ref_count(held) == 1
    allocator.free(held)  # unregistered now: straight back to the free list
    assert allocator.num_available == 8
    fresh = allocator.allocate()
    assert allocator.register(fresh, 0, (1, 2)) == key
    allocator.free(fresh)  # registered again: kept as evictable, found by content
    assert allocator.match_prefix([1, 2], 2)[0] == [fresh]


def test_a_pool_sized_from_device_memory_leaves_the_reserved_bytes_and_names_the_fix():
    gib, per_block, dev = 2**30, 1 << 20, torch.device("cuda", 0)
    config = RolloutEngineConfig(kv_memory_fraction=0.8)
    assert automatic_num_blocks(config, 70 * gib, per_block, 10**9, dev) == int(70 * gib * 0.8) // per_block
    reserved = replace(config, kv_reserved_bytes=58 * gib)
    assert automatic_num_blocks(reserved, 70 * gib, per_block, 10**9, dev) == int(12 * gib * 0.8) // per_block
    assert automatic_num_blocks(reserved, 70 * gib, per_block, 100, dev) == 100  # what the engine can use
    with pytest.raises(ConfigError, match=r"no room on cuda:0: 57.00 GiB free, of which 58.00 GiB stay for the tr"):
        automatic_num_blocks(reserved, 57 * gib, per_block, 10**9, dev)
    with pytest.raises(ConfigError, match="lower train.max_tokens_per_mb, set cluster.offload=sleep, or rollout.kv"):
        automatic_num_blocks(reserved, 57 * gib, per_block, 10**9, dev)
    with pytest.raises(ConfigError, match=r"0.00 GiB free x rollout.kv_memory_fraction=0.8 holds no KV block"):
        automatic_num_blocks(config, 1000, per_block, 10**9, dev)
    cpu = replace(config, cpu_kv_cache_bytes=5 * per_block)
    assert automatic_num_blocks(cpu, None, per_block, 10**9, torch.device("cpu")) == 5
    with pytest.raises(ConfigError, match=r"rollout.cpu_kv_cache_bytes=1000 holds no KV block of 1048576 bytes: raise"):
        automatic_num_blocks(replace(config, cpu_kv_cache_bytes=1000), None, per_block, 10**9, torch.device("cpu"))


def test_a_large_block_pool_keeps_records_only_of_the_blocks_handed_out():
    """walk33: the allocator built a record and a free-list entry per block up front: 1.1 us and 160 B a block,
    ~2 minutes and 16 GiB at the 10^8 blocks a long-context small model's pool can hold. Blocks are handed out
    in the same order as before: freed ones first (the last freed first), then fresh ones, lowest id first."""
    a = BlockAllocator(10**8, 16, enable_prefix_sharing=True)
    assert a._meta == [] and a._free == [] and a.num_available == 10**8
    assert a.allocate_many(3) == [0, 1, 2] and a.allocate() == 3
    a.free(1)
    a.free(2)
    assert a.allocate() == 2 and a.allocate_many(3) == [1, 4, 5]
    assert a.num_used == 6 and len(a._meta) == 6 and a.ref_count(10**8 - 1) == 0
    small = BlockAllocator(3, 4, enable_prefix_sharing=True)
    blocks = small.allocate_many(3)
    small.register(blocks[0], ROOT_KEY, (1, 2, 3, 4))
    small.free_all(blocks)  # block 0 stays cached (evictable), 1 and 2 are free
    assert small.num_available == 3 and small.allocate_many(3) == [1, 2, 0]  # the cached block last
    with pytest.raises(OutOfBlocksError):
        small.allocate()


def test_an_engine_on_another_cuda_device_than_the_current_one_is_refused(tiny, monkeypatch):
    """walk34: built on cuda:1 from a thread whose current device is cuda:0, the engine recorded its token-copy
    event on cuda:0's stream (its host read could come before the copy landed) and launched its kernels there;
    it is refused with the call that fixes it."""
    model, cfg = tiny
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.raises(
        ValueError,
        match=r"RolloutEngine on cuda:1 while this thread's current CUDA device is cuda:0: "
        r"call torch.cuda.set_device\(1\) first",
    ):
        RolloutEngine(model, cfg, config=RolloutEngineConfig(device="cuda:1", num_blocks=8))


def test_a_pool_smaller_than_one_sequence_is_warned_about(tiny, caplog):
    """walk35: beside a colocated training side a test rollout's pool could come out at a few blocks, and every
    evaluation longer than it was refused, logged only per request; the engine says so when it starts."""
    import logging

    model, cfg = tiny
    config = RolloutEngineConfig(block_size=4, max_model_len=64, max_num_seqs=3)
    per_block = RolloutEngine(model, cfg, config=replace(config, num_blocks=8)).cache
    per_block = KVCache.bytes_per_block(
        num_layers=per_block.num_layers, block_size=4, num_kv_heads=per_block.num_kv_heads,
        head_dim=per_block.head_dim, dtype=per_block.dtype,
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="areno.rollout.engine"):
        RolloutEngine(model, cfg, config=replace(config, cpu_kv_cache_bytes=16 * per_block))
        assert not caplog.records  # 16 blocks of 4: one 64-token sequence fits
        RolloutEngine(model, cfg, config=replace(config, cpu_kv_cache_bytes=5 * per_block))
    (record,) = caplog.records
    assert "its KV pool holds 20 tokens, fewer than one sequence at max_model_len=64" in record.getMessage()
