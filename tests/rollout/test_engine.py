import dataclasses

import pytest
import torch

from areno.rollout.engine import RolloutEngine, RolloutEngineConfig, UnknownRequestError, WeightUpdateError
from areno.types import SamplingParams
from tests.helpers.rollout import EOS, VOCAB, make_model, naive_greedy, random_prompts

GREEDY = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)


def engine(model_cfg, **kw) -> RolloutEngine:
    model, cfg = model_cfg
    defaults = dict(block_size=4, num_blocks=128, max_tokens_per_step=64, prefill_chunk_size=8)
    defaults.update(kw)
    return RolloutEngine(model, cfg, config=RolloutEngineConfig(**defaults), eos_token_ids=(EOS,))


def test_continuous_batching_equals_one_at_a_time(tiny):
    model, _ = tiny
    prompts = random_prompts(6, seed=1)
    eng = engine(tiny)
    outs = eng.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        ref_ids, ref_lp = naive_greedy(model, prompt, 10)
        assert out.output_ids == ref_ids
        assert out.output_logprobs == pytest.approx(ref_lp, abs=1e-4)
        assert out.finish_reason == "length" and out.output_versions == [0] * 10


def test_requests_join_midway(tiny):
    model, _ = tiny
    prompts = random_prompts(4, seed=2)
    eng = engine(tiny, max_tokens_per_step=9)
    ids = [eng.add_request(prompts[0], GREEDY)]
    done = {}
    for i in range(1, 4):  # one new request every two steps: they join a running batch
        for _ in range(2):
            done.update({o.request_id: o for o in eng.step()})
        ids.append(eng.add_request(prompts[i], GREEDY))
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step()})
    for rid, prompt in zip(ids, prompts):
        assert done[rid].output_ids == naive_greedy(model, prompt, 10)[0]


def test_prefix_sharing_same_outputs_and_hits(tiny):
    base = random_prompts(1, seed=3, lo=18, hi=19)[0]
    prompts = [base] * 4 + [base + [5, 6, 7]]
    shared = engine(tiny, enable_prefix_sharing=True)
    plain = engine(tiny, enable_prefix_sharing=False)
    out_shared = shared.generate(prompts, GREEDY)
    out_plain = plain.generate(prompts, GREEDY)
    assert [o.output_ids for o in out_shared] == [o.output_ids for o in out_plain]
    assert shared.stats()["prefix_hit_rate"] > 0.5 and plain.stats()["prefix_hit_rate"] == 0
    # A multi-turn continuation after the first turn finished reuses the cached blocks.
    follow = prompts[0] + out_shared[0].output_ids + [9, 10]
    hits_before = shared.allocator.prefix_hit_tokens
    assert shared.generate([follow], GREEDY)[0].output_ids == plain.generate([follow], GREEDY)[0].output_ids
    assert shared.allocator.prefix_hit_tokens - hits_before >= 24


def test_preemption_recomputes_without_changing_tokens(tiny):
    model, _ = tiny
    prompts = random_prompts(8, seed=4, lo=8, hi=16)
    eng = engine(tiny, num_blocks=14)  # 56 tokens for 8 sequences of up to 25 tokens
    outs = eng.generate(prompts, GREEDY)
    assert eng.stats()["num_preemptions"] > 0
    for prompt, out in zip(prompts, outs):
        assert out.output_ids == naive_greedy(model, prompt, 10)[0]
    assert eng.allocator.num_used == 0


def test_same_seed_same_tokens_regardless_of_batch(tiny):
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, max_new_tokens=12, ignore_eos=True, seed=123)
    prompt = random_prompts(1, seed=5)[0]
    alone = engine(tiny).generate([prompt], p)[0]
    others = random_prompts(5, seed=6)
    mixed = engine(tiny).generate(
        others[:2] + [prompt] + others[2:],
        [SamplingParams(temperature=1.0)] * 2 + [p] + [SamplingParams(temperature=0.7)] * 3,
    )[2]
    assert alone.output_ids == mixed.output_ids
    other_seed = engine(tiny).generate(
        [prompt], SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=7)
    )[0]
    assert other_seed.output_ids != alone.output_ids


def test_sampled_logprobs_are_temperature_scaled(tiny):
    model, _ = tiny
    prompt = random_prompts(1, seed=8)[0]
    out = engine(tiny).generate([prompt], SamplingParams(temperature=0.7, max_new_tokens=6, ignore_eos=True, seed=1))[0]
    ids = prompt + out.output_ids
    with torch.no_grad():
        logits = model.logits(model(torch.tensor(ids), torch.arange(len(ids)))).float()
    lp = torch.log_softmax(logits / 0.7, -1)
    expected = [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(out.output_ids)]
    assert out.output_logprobs == pytest.approx(expected, abs=1e-4)


def test_stop_ids_eos_min_and_max_tokens(tiny):
    eng = engine(tiny)
    prompt = random_prompts(1, seed=9)[0]
    free = eng.generate([prompt], GREEDY)[0].output_ids
    stop_tok = free[3]
    first = free.index(stop_tok)
    out = eng.generate([prompt], SamplingParams(temperature=0, max_new_tokens=10, stop_token_ids=(stop_tok,)))[0]
    assert out.output_ids == free[: first + 1] and out.finish_reason == "stop"
    # min_new_tokens suppresses the stop id until enough tokens exist.
    out = eng.generate(
        [prompt], SamplingParams(temperature=0, max_new_tokens=10, min_new_tokens=first + 2, stop_token_ids=(stop_tok,))
    )[0]
    assert stop_tok not in out.output_ids[: first + 2]
    # EOS ends generation unless ignore_eos.
    big_eos = SamplingParams(temperature=0, max_new_tokens=10)
    eos_eng = RolloutEngine(
        tiny[0], tiny[1], config=RolloutEngineConfig(block_size=4, num_blocks=64), eos_token_ids=(stop_tok,)
    )
    assert eos_eng.generate([prompt], big_eos)[0].finish_reason == "stop"
    assert eos_eng.generate([prompt], GREEDY)[0].output_ids == free


def test_stop_strings_cut_text(tiny):
    from areno.data.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer("abcdefghijklmnopqrstuvwxyz")
    model, cfg = tiny
    eng = RolloutEngine(
        model, cfg, config=RolloutEngineConfig(block_size=4, num_blocks=64), eos_token_ids=(EOS,), tokenizer=tok
    )
    prompt = tok.encode("hello")
    free = eng.generate([prompt], SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True))[0]
    text = free.text
    stop = text[3:5]
    out = eng.generate([prompt], SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True, stop=(stop,)))[0]
    assert out.finish_reason == "stop" and out.text == text[: text.find(stop)]
    assert tok.decode(out.output_ids, skip_special_tokens=True).endswith(stop)


def test_requests_ending_in_one_step_each_get_their_own_text(tiny):
    """Requests that end in the same step have their texts decoded together; each equals the
    decode of its own output ids (special tokens skipped)."""
    from areno.data.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()  # ids 0-4 are special tokens, EOS among them
    model, cfg = tiny
    eng = RolloutEngine(
        model, cfg, config=RolloutEngineConfig(block_size=4, num_blocks=256), eos_token_ids=(EOS,), tokenizer=tok
    )
    for seed, prompt in enumerate(random_prompts(6, seed=31)):
        eng.add_request(prompt, SamplingParams(temperature=1.5, max_new_tokens=12, ignore_eos=True, seed=seed))
    outs: list = []
    while not outs:
        outs = eng.step()
    assert len(outs) == 6 and all(len(o.output_ids) == 12 for o in outs)
    assert [o.text for o in outs] == [tok.decode(o.output_ids, skip_special_tokens=True) for o in outs]
    assert len({o.text for o in outs}) == 6


def test_detokenize_false_leaves_text_to_the_caller(tiny):
    """``detokenize=False`` requests (a workflow that decodes its completions itself) come back
    without text beside requests that get theirs, with the same tokens; a stop string's cut text
    is still returned, since the engine decoded it to find the string."""
    from areno.data.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer("abcdefghijklmnopqrstuvwxyz")
    model, cfg = tiny
    eng = RolloutEngine(
        model, cfg, config=RolloutEngineConfig(block_size=4, num_blocks=256), eos_token_ids=(EOS,), tokenizer=tok
    )
    prompt = tok.encode("hello")
    greedy = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
    with_text, without = eng.generate([prompt, prompt], [greedy, dataclasses.replace(greedy, detokenize=False)])
    assert with_text.output_ids == without.output_ids
    assert with_text.text == tok.decode(with_text.output_ids, skip_special_tokens=True) != ""
    assert without.text == ""
    stop = with_text.text[3:5]
    out = eng.generate([prompt], dataclasses.replace(greedy, stop=(stop,), detokenize=False))[0]
    assert out.finish_reason == "stop" and out.text == with_text.text[: with_text.text.find(stop)]


def test_weight_swap_mid_generation_records_versions(tiny):
    model, cfg = make_model(0)
    new_model, _ = make_model(1)
    prompt = random_prompts(1, seed=10)[0]
    eng = RolloutEngine(
        model,
        cfg,
        # decode_steps=1: the swap must land after exactly 5 tokens, one per step
        config=RolloutEngineConfig(block_size=4, num_blocks=64, recompute_kv_on_weight_update=True, decode_steps=1),
        eos_token_ids=(),
    )
    rid = eng.add_request(prompt, GREEDY)
    for _ in range(5):  # prefill + 4 decode steps => 5 tokens at version 0
        eng.step()
    eng.update_weights(new_model.state_dict().items(), version=3)
    out = None
    while out is None:
        outs = eng.step()
        out = outs[0] if outs else None
    assert out.request_id == rid and out.output_versions == [0] * 5 + [3] * 5
    # Tokens after the swap are the new model's greedy continuation of the old tokens.
    cont = naive_greedy(new_model, prompt + out.output_ids[:5], 5)[0]
    assert out.output_ids[5:] == cont
    assert eng.version == 3


def test_weight_swap_keeping_old_kv(tiny):
    model, cfg = make_model(0)
    new_model, _ = make_model(1)
    eng = RolloutEngine(
        model,
        cfg,
        config=RolloutEngineConfig(block_size=4, num_blocks=64, recompute_kv_on_weight_update=False),
        eos_token_ids=(),
    )
    prompt = random_prompts(1, seed=10)[0]
    eng.add_request(prompt, GREEDY)
    eng.step()
    eng.update_weights(new_model.state_dict().items(), version=1)
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert outs[0].output_versions == [0] + [1] * 9 and eng.stats()["num_preemptions"] == 0
    # its K/V mixes both policies, so none of it entered the prefix cache: a continuation recomputes
    hits = eng.allocator.prefix_hit_tokens
    eng.generate([prompt + outs[0].output_ids + [3]], GREEDY)
    assert eng.allocator.prefix_hit_tokens == hits
    # ... while a request run wholly under version 1 publishes its blocks when it finishes
    again = eng.generate([prompt], GREEDY)[0]
    eng.generate([prompt + again.output_ids + [3]], GREEDY)
    assert eng.allocator.prefix_hit_tokens - hits >= 4 * ((len(prompt) + 9) // 4) - 4


@pytest.mark.parametrize("bad", ["name", "shape", "dtype", "duplicate"])
def test_rejected_update_keeps_old_weights(bad):
    model, cfg = make_model(0)
    new_model, _ = make_model(1)
    eng = RolloutEngine(model, cfg, config=RolloutEngineConfig(block_size=4, num_blocks=64), eos_token_ids=())
    prompt = random_prompts(1, seed=11)[0]
    before = eng.generate([prompt], GREEDY)[0].output_ids
    items = list(new_model.state_dict().items())
    name = "model.layers.1.mlp.up_proj.weight"
    idx = [n for n, _ in items].index(name)
    if bad == "name":
        items[idx] = ("model.layers.1.mlp.upp_proj.weight", items[idx][1])
    elif bad == "shape":
        items[idx] = (name, items[idx][1][:-1])
    elif bad == "dtype":
        items[idx] = (name, items[idx][1].to(torch.int32))
    else:
        items.append(items[idx])
    with pytest.raises(WeightUpdateError, match="upp_proj" if bad == "name" else "up_proj"):
        eng.update_weights(items, version=1)
    assert eng.version == 0
    assert eng.generate([prompt], GREEDY)[0].output_ids == before


def test_update_weights_from_disk(tmp_path):
    from safetensors.torch import save_file

    model, cfg = make_model(0)
    new_model, _ = make_model(1)
    save_file({k: v.contiguous() for k, v in new_model.state_dict().items()}, str(tmp_path / "model.safetensors"))
    eng = RolloutEngine(model, cfg, config=RolloutEngineConfig(block_size=4, num_blocks=64), eos_token_ids=())
    eng.update_weights_from_disk(str(tmp_path), version=2)
    prompt = random_prompts(1, seed=12)[0]
    assert eng.generate([prompt], GREEDY)[0].output_ids == naive_greedy(new_model, prompt, 10)[0]
    with pytest.raises(WeightUpdateError, match="no .safetensors"):
        eng.update_weights_from_disk(str(tmp_path / "missing"), version=3)


def test_add_request_does_not_wait_for_a_running_step(tiny):
    """A server's event loop adds requests while the driver thread holds the step lock through a
    whole decode round trip: add_request must return at once, and the request joins at the next step."""
    import threading

    model, _ = tiny
    eng = engine(tiny)
    prompts = random_prompts(3, seed=21)
    first = eng.add_request(prompts[0], GREEDY)
    eng.step()
    held, release = threading.Event(), threading.Event()

    def long_step():
        with eng._lock:  # what a running step holds
            held.set()
            release.wait(10)

    t = threading.Thread(target=long_step)
    t.start()
    held.wait(5)
    added = []
    adder = threading.Thread(target=lambda: added.extend(eng.add_request(p, GREEDY) for p in prompts[1:]))
    adder.start()
    adder.join(2)
    try:
        assert not adder.is_alive() and len(added) == 2, "add_request blocked behind the step lock"
        assert eng.has_unfinished()
    finally:
        release.set()
        t.join()
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request(prompts[1], GREEDY, request_id=added[0])  # still in the inbox: the id is taken
    aborted = eng.abort(added[1])  # from the inbox: nothing generated yet
    assert aborted.finish_reason == "abort" and aborted.output_ids == []
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step()})
    assert sorted(done) == sorted([first, added[0]])
    busy = eng.stats()["busy_s"]
    assert busy > 0 and eng.step() == [] and eng.stats()["busy_s"] == busy  # an empty step is idle time
    assert done[added[0]].output_ids == naive_greedy(model, prompts[1], 10)[0]
    assert eng.allocator.num_used == 0


def test_pause_resume_abort(tiny):
    model, _ = tiny
    eng = engine(tiny, decode_steps=1)  # two steps => exactly two tokens before the pause
    prompts = random_prompts(2, seed=13)
    a = eng.add_request(prompts[0], GREEDY)
    b = eng.add_request(prompts[1], GREEDY)
    eng.step()
    eng.step()
    eng.pause()
    assert eng.step() == [] and eng.stats()["num_running"] == 2
    partial = eng.abort(a)
    assert partial.finish_reason == "abort" and len(partial.output_ids) == 2
    assert partial.output_ids == naive_greedy(model, prompts[0], 2)[0]
    with pytest.raises(UnknownRequestError, match=a):
        eng.abort(a)
    eng.resume()
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert [o.request_id for o in outs] == [b] and outs[0].output_ids == naive_greedy(model, prompts[1], 10)[0]
    assert eng.allocator.num_used == 0


def test_sleep_wake_frees_and_restores_kv(tiny):
    model, _ = tiny
    eng = engine(tiny)
    prompt = random_prompts(1, seed=14)[0]
    eng.add_request(prompt, GREEDY)
    eng.step()
    eng.step()
    eng.sleep()
    assert not eng.cache.is_allocated and eng.step() == []
    eng.wake()
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert outs[0].output_ids == naive_greedy(model, prompt, 10)[0]


def test_bad_requests_are_rejected(tiny):
    eng = engine(tiny, max_model_len=32, num_blocks=16)
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        eng.add_request([], GREEDY)
    with pytest.raises(ValueError, match="max_model_len=32"):
        eng.add_request([5] * 32, GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.add_request([VOCAB + 3], GREEDY)
    with pytest.raises(ValueError, match="max_new_tokens must be > 0"):
        SamplingParams(max_new_tokens=0)
    eng.add_request([5], GREEDY, request_id="x")
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request([5], GREEDY, request_id="x")
    with pytest.raises(ValueError, match="block_size"):
        RolloutEngineConfig(block_size=0)


def test_context_limit_finishes_with_length(tiny):
    eng = engine(tiny, max_model_len=12)
    out = eng.generate([[5] * 8], SamplingParams(temperature=0, max_new_tokens=50, ignore_eos=True))[0]
    assert len(out.output_ids) == 4 and out.finish_reason == "length"


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral", "olmo2", "olmo3", "phi3", "smollm3"])
def test_other_families(arch):
    # olmo3: a window in layer 0 only (its own attention metadata beside layer 1's full one)
    windowed = ("mistral", "phi3", "olmo3")
    kw = {"sliding_window": 6} if arch in windowed else {"nope_layers": (1,)} if arch == "smollm3" else {}
    model, cfg = make_model(0, arch=arch, **kw)
    prompts = random_prompts(3, seed=15, lo=6, hi=14)
    outs = engine((model, cfg)).generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        assert out.output_ids == naive_greedy(model, prompt, 10)[0]


def test_busy_time_snapshots_never_exceed_their_window(tiny):
    """stats()' busy_s and clock_s are read together and a step's time is counted under the engine
    lock, so busy / elapsed between two snapshots lies in [0, 1] even while another thread steps."""
    import threading

    eng = engine(tiny)
    for i, prompt in enumerate(random_prompts(8, seed=5)):
        eng.add_request(prompt, SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True), request_id=f"r{i}")
    snaps = [eng.stats()]
    stepping = threading.Thread(target=lambda: [eng.step() for _ in range(60)])
    stepping.start()
    while stepping.is_alive():
        snaps.append(eng.stats())
    stepping.join()
    snaps.append(eng.stats())
    assert snaps[-1]["busy_s"] > 0 and len(snaps) > 3
    for a, b in zip(snaps, snaps[1:]):
        assert 0 <= b["busy_s"] - a["busy_s"] <= b["clock_s"] - a["clock_s"]
