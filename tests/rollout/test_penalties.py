"""min_p and repetition_penalty in areno's own engine: the sampler's filtered distribution against hand
computations, the engine against a full-recompute reference (greedy with a penalty, rows of different
settings in one batch through mixed steps and the decode-loop graph, an interruption that moves the rows
to other slots), and the server, the vLLM / SGLang request bodies and the config carrying them."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from areno.errors import ConfigError
from areno.rollout.presence import PresenceTable, _penalize_dense, _penalize_seen, apply_repetition_penalty
from areno.rollout.sampling import SampleMode, Sampler, SampleRequest, _min_p_rows, _Seen, _truncate
from areno.types import SamplingParams
from tests.helpers.rollout import drive_arrivals, engine, make_model, random_prompts

CPU = torch.device("cpu")


def _sampler() -> Sampler:
    return Sampler(device=CPU, seed=0)


# ---------------------------------------------------------------------------------------------- min_p


def test_min_p_keeps_the_tokens_at_least_min_p_times_the_top_ones_probability():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 3.0]])
    keep = lambda p: torch.isfinite(_truncate(logits / p.temperature, [p]))[0].tolist()
    # T = 1: p_i / p_max = e^(x_i - 3) = 0.37, 0.14, 0.05, 0.02, 1
    assert keep(SamplingParams(min_p=0.3)) == [True, False, False, False, True]
    assert keep(SamplingParams(min_p=0.1)) == [True, True, False, False, True]
    # after the temperature: T = 2 gives e^((x_i - 3) / 2) = 0.61, 0.37, 0.22, 0.14, 1
    assert keep(SamplingParams(min_p=0.3, temperature=2.0)) == [True, True, False, False, True]
    assert keep(SamplingParams(min_p=1.0)) == [False, False, False, False, True]  # the top token always stays
    assert keep(SamplingParams(min_p=0.0)) == [True] * 5


def test_min_p_alone_takes_no_sort_and_keeps_the_same_set():
    # a batch without top-k / top-p rows thresholds against the row maximum; the sorted path must agree
    # bit for bit (a row samples the same way whatever else is in its batch)
    x = torch.randn(16, 3000, generator=torch.Generator().manual_seed(0)) * 3
    min_p = torch.rand(16, generator=torch.Generator().manual_seed(1)) ** 4
    min_p[0] = 0.0
    params = [SamplingParams(min_p=float(m)) for m in min_p]
    assert torch.equal(_min_p_rows(x, min_p), _truncate(x, params))


def test_min_p_comes_before_top_p_as_in_vllm():
    # p = 0.5, 0.3, 0.15, 0.05; min_p 0.2 drops 0.05 (< 0.1), leaving 0.526, 0.316, 0.158 renormalised:
    # top_p 0.82 then stops after two (0.842 >= 0.82). Top-p first (Hugging Face, SGLang) would keep three
    # (0.5 + 0.3 = 0.8 < 0.82).
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    kept = torch.isfinite(_truncate(logits, [SamplingParams(min_p=0.2, top_p=0.82)]))[0].tolist()
    assert kept == [True, True, False, False]
    kept = torch.isfinite(_truncate(logits, [SamplingParams(min_p=0.2, top_k=2)]))[0].tolist()
    assert kept == [True, True, False, False]


def test_sampled_min_p_draws_from_the_filtered_distribution_and_reports_the_whole_ones_logprob():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(4000, 1)
    requests = [SampleRequest(SamplingParams(temperature=1.0, min_p=0.25, seed=i), 0) for i in range(4000)]
    tokens, logprobs = _sampler().sample(logits, requests)
    freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / 4000
    # min_p 0.25: threshold 0.125 keeps 0.5, 0.3, 0.15
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95, atol=0.03)
    for t, lp in zip(tokens[:50], logprobs[:50]):
        assert lp == pytest.approx(math.log(probs[t]), abs=1e-5)  # untruncated, as top-k / top-p


# ------------------------------------------------------------------------------------- repetition penalty


def _seen(ids_per_row: list[list[int]], V: int, penalty: float) -> PresenceTable:
    table = PresenceTable(len(ids_per_row), V, CPU)
    table.sync(
        list(range(len(ids_per_row))), [_Seen(SamplingParams(repetition_penalty=penalty), i) for i in ids_per_row]
    )
    return table


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens_once():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 1.5, 0.0]])
    # prompt 0, 1, 1 (token 1 twice: penalised once) and generated 3
    table = _seen([[0, 1, 1, 3]], 6, 2.0)
    got = apply_repetition_penalty(logits, table.rows(torch.tensor([0])), torch.tensor([2.0]))
    assert got.tolist() == [[1.0, -2.0, 0.5, -1.0, 1.5, 0.0]]
    # penalty 1 leaves every value exactly
    assert torch.equal(apply_repetition_penalty(logits, table.rows(torch.tensor([0])), torch.tensor([1.0])), logits)
    # the CPU form (seen entries only) and the dense one (CUDA, graphs) give the same values
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 500, generator=g) * 4
    seen = torch.rand(8, 500, generator=g) < 0.1
    pen = torch.tensor([1.0, 1.3, 0.7, 2.0, 1e4, 1.0, 1.1, 5.0])
    assert torch.equal(_penalize_seen(x, seen, pen), _penalize_dense(x, seen, pen))


def test_greedy_and_sampled_rows_draw_from_the_penalised_logits_and_report_the_models_logprob():
    logits = torch.tensor([2.0, -1.0, 0.5, -0.5, 1.5, 0.0])
    penalised = torch.tensor([1.0, -2.0, 0.5, -1.0, 1.5, 0.0])
    seen = (0, 1, 1, 3)
    tok, lp = _sampler().sample(
        logits[None], [SampleRequest(SamplingParams(temperature=0, repetition_penalty=2.0), 0, seen_ids=seen)]
    )
    assert tok == [4]  # token 0 (2.0) fell to 1.0
    assert lp[0] == pytest.approx(float(torch.log_softmax(logits, -1)[4]), abs=1e-6)
    n = 4000
    requests = [
        SampleRequest(SamplingParams(temperature=0.8, repetition_penalty=2.0, seed=i), 0, seen_ids=seen)
        for i in range(n)
    ]
    tokens, logprobs = _sampler().sample(logits.repeat(n, 1), requests)
    freq = torch.bincount(torch.tensor(tokens), minlength=6).float() / n
    assert torch.allclose(freq, torch.softmax(penalised / 0.8, -1), atol=0.03)
    want = torch.log_softmax(logits / 0.8, -1)
    assert logprobs[:50] == pytest.approx([float(want[t]) for t in tokens[:50]], abs=1e-5)


# ----------------------------------------------------------------------------------------------- engine


@torch.no_grad()
def naive(model, prompt: list[int], n: int, penalty: float) -> tuple[list[int], list[float]]:
    """Greedy with Hugging Face's repetition penalty by full recompute; log-probs of the raw model."""
    ids, logprobs = list(prompt), []
    dev = next(model.parameters()).device
    for _ in range(n):
        logits = model.logits(model(torch.tensor(ids, device=dev), torch.arange(len(ids), device=dev))[-1:]).float()[0]
        seen = torch.zeros(logits.shape, dtype=torch.bool, device=dev)
        seen[torch.tensor(ids, device=dev)] = True
        tok = int(torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits).argmax())
        logprobs.append(float(torch.log_softmax(logits, -1)[tok]))
        ids.append(tok)
    return ids[len(prompt) :], logprobs


@pytest.fixture(scope="module")
def model_cfg():
    return make_model(0)


def _repeats(prompt: list[int], out: list[int]) -> int:
    """Output tokens already in the prompt or earlier in the output."""
    seen, n = set(prompt), 0
    for t in out:
        n += t in seen
        seen.add(t)
    return n


def test_greedy_with_a_large_penalty_never_repeats_where_the_model_would(model_cfg):
    prompts = random_prompts(4, 1)
    eng = engine(model_cfg, 4)
    plain = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
    free = [o.output_ids for o in eng.generate(prompts, plain)]
    assert all(_repeats(p, o) > 0 for p, o in zip(prompts, free))  # the model loops without the penalty
    outs = eng.generate(prompts, replace(plain, repetition_penalty=1e4))
    for p, o in zip(prompts, outs):
        assert _repeats(p, o.output_ids) == 0
        want_ids, want_lps = naive(model_cfg[0], p, 20, 1e4)
        assert o.output_ids == want_ids
        assert o.output_logprobs == pytest.approx(want_lps, abs=1e-4)


@pytest.mark.parametrize("decode_steps, graphs", [(1, False), (4, False), (4, True)])
def test_rows_of_different_settings_in_one_batch_each_sample_as_alone(model_cfg, decode_steps, graphs):
    greedy = SamplingParams(temperature=0, max_new_tokens=14, ignore_eos=True)
    sampled = SamplingParams(temperature=0.9, max_new_tokens=14, ignore_eos=True)
    params = [
        greedy,
        replace(greedy, repetition_penalty=1.3),
        replace(greedy, repetition_penalty=1e4),
        replace(sampled, repetition_penalty=1.2, min_p=0.05, seed=3),
        replace(sampled, min_p=0.2, seed=4),
        replace(sampled, repetition_penalty=0.7, top_k=9, seed=5),  # < 1 favours repeats
        replace(sampled, seed=6),
    ]
    prompts = random_prompts(len(params), 7)
    eng = engine(model_cfg, decode_steps, graphs=graphs)
    together = drive_arrivals(eng, prompts, params, every=2, per=2)  # mixed steps, rows joining and leaving
    for i, (p, sp) in enumerate(zip(prompts, params)):
        alone = engine(model_cfg, 1).generate([p], sp)[0]
        assert together[i].output_ids == alone.output_ids, i
        assert together[i].output_logprobs == pytest.approx(alone.output_logprobs, abs=1e-5), i
        if sp.temperature == 0:
            assert together[i].output_ids == naive(model_cfg[0], p, 14, sp.repetition_penalty)[0], i
    # the settings change the samples (else this test would pass without them)
    assert together[2].output_ids != together[0].output_ids
    plain = engine(model_cfg, 1).generate([prompts[3], prompts[4]], [replace(sampled, seed=s) for s in (3, 4)])
    assert [o.output_ids for o in plain] != [together[3].output_ids, together[4].output_ids]


def test_an_interruption_that_moves_rows_to_other_slots_keeps_their_token_history(model_cfg):
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True, repetition_penalty=1e4)
    prompts = random_prompts(3, 11)
    eng = engine(model_cfg, 4)
    ids = [eng.add_request(p, params) for p in prompts]
    done = {}
    for _ in range(4):
        done.update({o.request_id: o for o in eng.step()})
    before = eng.sampler.presence.rebuilt_rows
    assert before == 3 and not done
    eng.sleep()  # every row preempted: re-admitted to other slots, its K/V recomputed
    eng.wake()
    while len(done) < len(ids):
        done.update({o.request_id: o for o in eng.step()})
    assert eng.sampler.presence.rebuilt_rows > before  # slots changed hands: rows rebuilt from prompt + output
    for rid, p in zip(ids, prompts):
        assert done[rid].output_ids == naive(model_cfg[0], p, 24, 1e4)[0]
        assert _repeats(p, done[rid].output_ids) == 0


# ------------------------------------------------------------------------------------ server, backends, config


def test_areno_server_takes_min_p_and_repetition_penalty(tiny_model_dir):
    from fastapi.testclient import TestClient

    from areno.rollout.server import build_engine, create_app

    eng, tokenizer = build_engine(str(tiny_model_dir), device="cpu", num_blocks=64, block_size=8, max_model_len=64)
    prompt = tokenizer("hello")["input_ids"]
    sp = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    body = {"prompt_ids": prompt, "sampling_params": {**sp, "repetition_penalty": 50.0, "min_p": 0.1}}
    # the engine's own answer before the server drives it (its driver thread would take this request's output)
    want = eng.generate([prompt], SamplingParams(**body["sampling_params"]))[0]
    with TestClient(create_app(eng, tokenizer=tokenizer, model_name="tiny")) as client:
        plain = client.post("/generate", json={"prompt_ids": prompt, "sampling_params": sp}).json()
        r = client.post("/generate", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == want.output_ids and _repeats(prompt, want.output_ids) == 0
        assert plain["output_ids"] != want.output_ids
        r = client.post(
            "/v1/completions",
            json={"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "repetition_penalty": 50.0},
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want.output_ids
        for path, bad, field in [
            ("/v1/completions", {"prompt": "hi", "min_p": 1.5}, "min_p"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "repetition_penalty": 0}, None),
            ("/generate", {"prompt_ids": prompt, "sampling_params": {"min_p": -1}}, "sampling_params"),
        ]:
            r = client.post(path, json=bad)
            assert r.status_code == 400, r.text
            assert ("min_p" if "min_p" in str(bad) else "repetition_penalty") in r.json()["error"]["message"]
            if field is not None:
                assert r.json()["error"]["param"] == field


def test_vllm_and_sglang_request_bodies_carry_both_fields():
    from areno.rollout.backends.sglang import SGLangRolloutClient
    from areno.rollout.backends.vllm import VLLMRolloutClient

    params = SamplingParams(min_p=0.05, repetition_penalty=1.15)
    body = VLLMRolloutClient("http://x", model="m").request_body([1, 2], params, "r")
    assert body["min_p"] == 0.05 and body["repetition_penalty"] == 1.15
    body = SGLangRolloutClient("http://x").request_body([1, 2], params, "r")
    assert body["sampling_params"]["min_p"] == 0.05 and body["sampling_params"]["repetition_penalty"] == 1.15


def test_config_keys_reach_the_rollouts_and_are_validated_in_one_line():
    from areno.api.config import load_config
    from areno.engine.api import rollout_sampling_params

    cfg = load_config(None, ["model.path=/x", "rollout.min_p=0.1", "rollout.repetition_penalty=1.2"])
    params = rollout_sampling_params(cfg)
    assert (params.min_p, params.repetition_penalty) == (0.1, 1.2)
    for override, message in [
        ("rollout.min_p=1.5", "rollout.min_p: must be in [0, 1]"),
        ("rollout.repetition_penalty=0", "rollout.repetition_penalty: must be a finite number > 0"),
        ("rollout.repetition_penalty=nan", "rollout.repetition_penalty: must be a finite number > 0"),
    ]:
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            load_config(None, ["model.path=/x", override])
    # the servers' log-probs are after these: refused with the fix
    for backend, key, value in [
        ("vllm", "min_p", "0.1"),
        ("vllm", "repetition_penalty", "1.2"),
        ("sglang", "repetition_penalty", "1.2"),
    ]:
        with pytest.raises(ConfigError, match=f"rollout.{key}: .*use rollout.{key}="):
            load_config(None, ["model.path=/x", f"rollout.backend={backend}", f"rollout.{key}={value}"])
    sglang = load_config(None, ["model.path=/x", "rollout.backend=sglang", "rollout.min_p=0.1"])
    assert rollout_sampling_params(sglang).min_p == 0.1  # SGLang's log-probs are before its min-p


def test_sampling_params_validate_both_fields():
    for kw, message in [
        ({"min_p": 1.01}, "min_p must be in"),
        ({"min_p": float("nan")}, "min_p must be in"),
        ({"repetition_penalty": -1.0}, "repetition_penalty must be"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty must be"),
    ]:
        with pytest.raises(ValueError, match=message):
            SamplingParams(**kw)
    with pytest.raises(TypeError, match="min_p"):
        SamplingParams(min_p="0.1")


@pytest.mark.gpu
def test_penalised_rows_in_the_captured_loop_graph_match_eager_on_gpu():
    """On CUDA: the k-step loop graph captured with a penalising mode (presence rows read and marked
    inside the graph, padding rows in the scratch slot) gives the tokens and log-probs of the eager
    one-step engine, greedy rows those of the full-recompute reference."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from areno.rollout.engine import RolloutEngine, RolloutEngineConfig

    model, cfg = make_model(0)
    model = model.cuda()
    greedy = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
    params = [
        replace(greedy, repetition_penalty=1e4),
        replace(greedy, repetition_penalty=1.3),
        replace(greedy, temperature=0.9, repetition_penalty=1.2, min_p=0.05, seed=3),
        replace(greedy, temperature=0.9, min_p=0.2, seed=4),
        greedy,
    ]
    prompts = random_prompts(len(params), 7)
    outs, engines = {}, {}
    for name, k, graphs in (("one_step", 1, False), ("k_graph", 8, True)):
        eng = RolloutEngine(
            model,
            cfg,
            config=RolloutEngineConfig(block_size=4, num_blocks=256, decode_steps=k, cuda_graphs=graphs),
            eos_token_ids=(2,),
        )
        outs[name], engines[name] = eng.generate(prompts, params), eng
    assert any(key[4].penalize for key in engines["k_graph"]._graphs._loops), "the penalising loop was never taken"
    for a, b in zip(outs["k_graph"], outs["one_step"]):
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(a.output_logprobs, b.output_logprobs, rtol=0, atol=1e-4)
    for o, p, sp in zip(outs["k_graph"], prompts, params):
        if sp.temperature == 0:
            assert o.output_ids == naive(model, p, 20, sp.repetition_penalty)[0]


def test_a_min_p_only_batch_takes_the_sortless_threshold_in_the_loop_graph_too(model_cfg):
    """Rows with min-p and no top-k / top-p: the decode-loop graph's mode says so (``min_p_only``) and runs the
    threshold, not the vocabulary sort; the tokens and log-probs are the one-step eager engine's."""
    params = [
        SamplingParams(temperature=0.9, max_new_tokens=12, ignore_eos=True, min_p=m, seed=s)
        for m, s in ((0.2, 1), (0.05, 2))
    ]
    prompts = random_prompts(len(params), 7)
    eager = engine(model_cfg, 1).generate(prompts, params)
    looped_engine = engine(model_cfg, 4, graphs=True)
    looped = looped_engine.generate(prompts, params)
    assert {key[4].min_p_only for key in looped_engine._graphs._loops} == {True}
    for a, b in zip(looped, eager):
        assert a.output_ids == b.output_ids
        assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-5)
    assert SampleMode.of(params[0]).min_p_only and not SampleMode.of(replace(params[0], top_p=0.9)).min_p_only
