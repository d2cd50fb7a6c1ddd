"""bench/e2e.py: the physical floor by hand, the fixed-length workflow, the headline against TRL, and a tiny
CPU run of areno and TRL (slow)."""

from __future__ import annotations

import json
import tempfile

import pytest

from areno.models.hf_io import tiny_config
from areno.types import SamplingParams
from bench import e2e
from bench._common import step_weight_params


def test_physical_floor_by_hand():
    cfg = tiny_config(100, hidden_size=32, layers=2, heads=4, kv_heads=2)
    params = cfg.num_params()
    # 2 seqs, prompt 3, 2 decode steps, 2-byte elements, 1e6 B/s copy, 1e9 FLOP/s matmul
    kv_per_token = 2 * 2 * 2 * 8 * 2  # layers * (K, V) * kv_heads * head_dim * bytes
    assert not cfg.tie_word_embeddings  # a step reads all weights but the input embedding's 100 x 32 (a lookup)
    read = (params - 100 * 32) * 2
    gen_bytes = (read + 2 * 3 * kv_per_token) + (read + 2 * 4 * kv_per_token)
    floor = e2e.physical_floor(cfg, 2, 3, 2, 2, 1e6, 1e9)
    assert floor["params"] == params
    assert floor["gen_floor_s"] == pytest.approx(gen_bytes / 1e6)
    head = 32 * 100
    layers = params - head - (0 if cfg.tie_word_embeddings else head)
    # the layers over 2 prompts of 3 and 4 completion tokens; the head over the completion tokens; attention
    # over 2 x (1 + 2 + 3) prompt keys and 2 x (4 + 5) completion keys, 12 FLOPs each over 2 layers x 4 heads x 8
    train = 6 * layers * (6 + 4) + 6 * head * 4 + 12 * (2 * 4 * 8) * (12 + 18)
    assert floor["train_floor_s"] == pytest.approx(train / 1e9)
    assert floor["floor_s"] == pytest.approx(floor["gen_floor_s"] + floor["train_floor_s"])
    # walk28: a group's prompt counts once (the step shares it), as the step runs it
    shared = e2e.physical_floor(cfg, 2, 3, 2, 2, 1e6, 1e9, group_size=2)
    one_prompt = 6 * layers * (3 + 4) + 6 * head * 4 + 12 * (2 * 4 * 8) * (6 + 18)
    assert shared["train_floor_s"] == pytest.approx(one_prompt / 1e9)
    assert shared["gen_floor_s"] == floor["gen_floor_s"]


def test_physical_floor_counts_the_experts_a_token_reaches():
    """A mixture of experts trains each token through its top k experts, and decodes reading at least the top k
    (a step's rows may all pick the same ones)."""
    cfg = tiny_config(100, hidden_size=32, layers=2, heads=4, kv_heads=2, arch="qwen3_moe")
    floor = e2e.physical_floor(cfg, 2, 3, 2, 2, 1e6, 1e9)
    assert floor["params"] == cfg.num_params()
    head = 32 * 100
    # 2 layers x (4 experts - top 2) x 3 x 32 x 32 weights a token does not reach
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4, 2, 32)
    layers = cfg.num_params() - head - (0 if cfg.tie_word_embeddings else head) - 2 * 2 * 3 * 32 * 32
    train = 6 * layers * (6 + 4) + 6 * head * 4 + 12 * (2 * 4 * 8) * (12 + 18)  # as test_physical_floor_by_hand
    assert floor["train_floor_s"] == pytest.approx(train / 1e9)
    kv_per_token = 2 * 2 * 2 * 8 * 2
    read = (layers + head) * 2
    assert floor["gen_floor_s"] == pytest.approx((read + 2 * 3 * kv_per_token + read + 2 * 4 * kv_per_token) / 1e6)


@pytest.mark.parametrize(
    ("arch", "idle"),
    [
        # every layer sparse, 4 experts top 2 of width 32; the shared expert (32 wide) and its gate row are read
        ("qwen2_moe", 2 * 2 * 3 * 32 * 32),
        # layer 0 dense (first_k_dense_replace = 1), layer 1 8 experts top 2 of width 16 beside one shared expert
        ("glm4_moe", 1 * 6 * 3 * 32 * 16),
        # every layer sparse, 4 experts top 2 of width 32, each with gate/up biases (2 x 32) and a down bias (32)
        ("gpt_oss", 2 * 2 * (3 * 32 * 32 + 2 * 32 + 32)),
    ],
)
def test_decode_floor_reads_the_top_k_experts_of_every_layout(arch, idle):
    cfg = tiny_config(100, hidden_size=32, layers=2, heads=4, kv_heads=2, arch=arch)
    assert not cfg.tie_word_embeddings
    floor = e2e.physical_floor(cfg, 2, 3, 1, 2, 1e6, 1e9)
    kv = 2 * 2 * 2 * 8 * 2 * 2 * 3  # 2 layers x (K, V) x 2 kv heads x 8 x 2 bytes x 2 sequences x 3 positions
    assert floor["gen_floor_s"] == pytest.approx(((cfg.num_params() - 100 * 32 - idle) * 2 + kv) / 1e6)


def test_physical_floor_of_a_sliding_layer_counts_its_window_by_hand():
    """A 2-key window in layer 0, every key in layer 1: 2 sequences, prompts of 3, 2 completion tokens."""
    cfg = tiny_config(100, hidden_size=32, layers=2, heads=4, kv_heads=2, arch="gemma3", sliding_window=2)
    assert [cfg.layer_window(i) for i in range(2)] == [2, None]
    floor = e2e.physical_floor(cfg, 2, 3, 2, 2, 1e6, 1e9)
    reached, head = step_weight_params(cfg), 32 * 100
    # decode step 0 reads 3 cached keys in layer 1 and 1 in layer 0 (its window: itself and one before), step 1
    # reads 4 and 1; a key's K and V: 2 x 2 heads x 8 x 2 bytes
    gen_bytes = sum(reached * 2 + 2 * cached * 2 * 2 * 8 * 2 for cached in (3 + 1, 4 + 1))
    assert floor["gen_floor_s"] == pytest.approx(gen_bytes / 1e6)
    # keys seen: layer 1 as without a window, 2 x (1 + 2 + 3) + 2 x (4 + 5) = 30; layer 0 capped at 2,
    # 2 x (1 + 2 + 2) + 2 x (2 + 2) = 18
    train = 6 * (reached - head) * (6 + 4) + 6 * head * 4 + 12 * (4 * 8) * (30 + 18)
    assert floor["train_floor_s"] == pytest.approx(train / 1e9)


def test_physical_floor_of_varied_lengths_by_hand():
    """Completions of 1 and 3 tokens after 2 prompt tokens: decode step i reads the weights and the KV
    cache of the sequences still generating; training counts their tokens."""
    cfg = tiny_config(100, hidden_size=32, layers=2, heads=4, kv_heads=2)
    params = cfg.num_params()
    kv_per_token = 2 * 2 * 2 * 8 * 2
    read = (params - 100 * 32) * 2  # all but the (untied) input embedding
    gen_bytes = (read + 2 * 2 * kv_per_token) + (read + 3 * kv_per_token) + (read + 4 * kv_per_token)
    floor = e2e.physical_floor(cfg, 2, 2, 3, 2, 1e6, 1e9, lengths=[1, 3])
    assert floor["gen_floor_s"] == pytest.approx(gen_bytes / 1e6)
    head = 32 * 100
    layers = params - head - (0 if cfg.tie_word_embeddings else head)
    train = 6 * layers * (4 + 4) + 6 * head * 4 + 12 * (2 * 4 * 8) * (2 * 3 + (3) + (3 + 4 + 5))
    assert floor["train_floor_s"] == pytest.approx(train / 1e9)
    assert e2e.physical_floor(cfg, 2, 3, 2, 2, 1e6, 1e9, lengths=[2, 2]) == e2e.physical_floor(
        cfg, 2, 3, 2, 2, 1e6, 1e9
    )


def test_varied_lengths_spread_over_a_group_and_reach_the_sampling_params():
    assert e2e.completion_lengths(32, None, 4) == [32] * 4
    assert e2e.completion_lengths(32, 8, 4) == [8, 16, 24, 32]
    assert e2e.completion_lengths(32, 8, 1) == [32]
    tok = e2e.build_tokenizer(None)
    wf = e2e.FixedLengthWorkflow(
        tok, e2e.reward, 4, SamplingParams(temperature=1.0, max_new_tokens=32), min_completion_len=8
    )
    params = [wf.token_params(i) for i in range(4)]
    assert [(p.max_new_tokens, p.min_new_tokens) for p in params] == [(8, 8), (16, 16), (24, 24), (32, 32)]
    assert all(p.ignore_eos for p in params)


def test_varied_lengths_are_refused_beside_trl_and_outside_the_length():
    base = ["--shapes", "tiny", "--device", "cpu", "--warmup", "1", "--steps", "1"]
    with pytest.raises(ValueError, match="TRL's completions are fixed-length"):
        e2e.main([*base, "--systems", "areno,trl", "--min-completion-len", "8"])
    with pytest.raises(ValueError, match="between 1 and the completion length 32"):
        e2e.main([*base, "--systems", "areno", "--min-completion-len", "40"])


@pytest.mark.slow
def test_tiny_areno_run_with_varied_lengths(tmp_path, capsys, monkeypatch):
    args = ["--shapes", "tiny", "--device", "cpu", "--systems", "areno", "--warmup", "1", "--steps", "1"]
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # no --workdir: its temporary one, removed at the end
    assert e2e.main([*args, "--min-completion-len", "8"]) == 0
    assert not list(tmp_path.glob("areno-bench-e2e-*"))
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    # 8 groups of 8 completions spread from 8 to 32 tokens after 16 prompt tokens
    completion = 8 * sum(e2e.completion_lengths(32, 8, 8))
    assert row["min_completion_len"] == 8
    assert row["gen_tokens_per_s"] * row["step_s_mean"] == pytest.approx(completion)
    assert row["total_tokens_per_s"] * row["step_s_mean"] == pytest.approx(64 * 16 + completion)


def test_fixed_length_workflow_ignores_eos():
    tok = e2e.build_tokenizer(None)
    wf = e2e.FixedLengthWorkflow(tok, e2e.reward, 2, SamplingParams(temperature=1.0, max_new_tokens=7))
    assert wf.sampling_params.ignore_eos and wf.sampling_params.min_new_tokens == 7
    assert e2e.reward("p", "aab") == pytest.approx(2 / 3)
    assert e2e.trl_reward(["p", "q"], ["", "xy"]) == [0.0, 0.0]


def test_prompts_have_the_token_length():
    tok = e2e.build_tokenizer(None)
    prompts = e2e.make_prompts(tok, 5, 16)
    assert len(prompts) == 5 and all(len(tok(p)["input_ids"]) == 16 for p in prompts)


@pytest.mark.slow
def test_tiny_areno_and_trl_run(tmp_path, capsys):
    args = ["--shapes", "tiny", "--device", "cpu", "--systems", "areno,trl", "--warmup", "1", "--steps", "2"]
    assert e2e.main([*args, "--workdir", str(tmp_path)]) == 0
    (line,) = capsys.readouterr().out.splitlines()  # stdout: one JSON object
    result = json.loads(line)
    rows = [x for x in result["rows"] if x["system"] == "areno"]
    assert len(rows) == 1
    row = rows[0]
    assert row["shape"] == "tiny" and len(row["step_s"]) == 2 and row["step_s_median"] > 0
    # 8 x 8 sequences of 16 prompt + 32 completion tokens per step
    assert row["num_seqs"] == 64
    assert row["total_tokens_per_s"] * row["step_s_mean"] == pytest.approx(64 * 48)
    assert row["gen_tokens_per_s"] * row["step_s_mean"] == pytest.approx(64 * 32)
    assert row["gap_to_floor"] == pytest.approx(row["step_s_mean"] / row["floor_s"])
    assert set(row["phases_s_median"]) == {"rollout", "train", "sync"}
    assert len(row["warmup_step_s"]) == 1 and row["first_train_s"] > 0
    rollout_total = sum(p[0] for p in row["phases_per_step_s"])
    assert row["rollout_engine_idle_s"] == pytest.approx((rollout_total - row["engine"]["busy_s"]) / 2, abs=1e-3)
    trl = next(x for x in result["rows"] if x["system"] == "trl")
    assert result["figure"] == row["step_s_mean"] and result["baseline"] == trl["step_s_mean"]
    assert result["ratio"] == round(trl["step_s_mean"] / row["step_s_mean"], 2)
    assert "speedup_areno_vs_trl" in result["shapes"]["tiny"]


def test_rollout_engine_idle_is_the_rollout_phase_the_engine_did_not_step_through():
    """The figure that showed a per-prompt host cost (the engine idle 0.9 s of a 1.5 s rollout phase)."""
    phases = [(1.5, 0.3, 0.01), (1.3, 0.3, 0.01)]
    assert e2e.rollout_engine_idle_s(phases, {"busy_s": 1.2}, eta=0) == pytest.approx((2.8 - 1.2) / 2)
    assert e2e.rollout_engine_idle_s(phases, {"busy_s": 1.2}, eta=3) is None  # the engine also runs while training
    assert e2e.rollout_engine_idle_s(phases, None, eta=0) is None  # a server backend


def test_headline_is_the_first_areno_system_against_trl_on_its_shape():
    rows = [
        {"system": "trl", "shape": "0.5b", "label": "TRL", "step_s_mean": 10.0},
        {"system": "areno_async", "shape": "0.5b", "label": "areno async eta 1", "step_s_mean": 2.0},
        {"system": "areno", "shape": "0.5b", "label": "areno (colocated)", "step_s_mean": 4.0},
    ]
    head = e2e.summary_headline(rows)
    assert head["figure"] == 2.0 and head["baseline"] == 10.0 and head["ratio"] == 5.0
    assert "areno async eta 1" in head["metric"]
    no_trl = e2e.summary_headline(rows[1:])
    assert no_trl["figure"] == 2.0 and no_trl["baseline"] is None and no_trl["ratio"] is None


def test_rounds_pair_each_trl_run_with_the_areno_run_of_its_round():
    def row(system, step, r):
        return {"system": system, "shape": "cpu5m", "label": system, "step_s_mean": step, "round": r,
                "gen_tokens_per_s": 100 / step, "gap_to_floor": step / 0.5, "peak_gpu_gib": None}  # fmt: skip

    # the machine slows down between rounds: each round's ratio is 2.5 (3 rounds), medians of the rest
    rows = [row("trl", 5.0, 0), row("areno", 2.0, 0), row("trl", 10.0, 1), row("areno", 4.0, 1)]
    rows += [row("trl", 7.5, 2), row("areno", 3.0, 2)]
    head = e2e.summary_headline(rows)
    assert head["ratio"] == 2.5 and head["figure"] == 3.0 and head["baseline"] == 7.5
    assert "median of 3 rounds' ratios" in head["ratio_is"]
    shape = e2e.by_shape(rows)["cpu5m"]
    assert shape["speedup_areno_vs_trl"] == pytest.approx(2.5)
    assert shape["speedup_areno_vs_trl_rounds"] == pytest.approx([2.5, 2.5, 2.5])
    assert shape["areno"]["step_s"] == 3.0 and shape["areno"]["step_s_rounds"] == [2.0, 4.0, 3.0]
    # one round: the plain ratio, no lists of rounds
    one = e2e.by_shape(rows[:2])["cpu5m"]
    assert one["speedup_areno_vs_trl"] == 2.5 and "speedup_areno_vs_trl_rounds" not in one
    assert "step_s_rounds" not in one["areno"]


def test_trl_runs_in_a_fresh_process_on_cpu_unless_asked():
    parse = e2e.build_parser().parse_args
    assert e2e.trl_in_fresh_process(parse(["--device", "cpu"]))  # areno's malloc options stay in this process
    assert not e2e.trl_in_fresh_process(parse(["--device", "cuda"]))
    assert not e2e.trl_in_fresh_process(parse(["--device", "cpu", "--trl-process", "same"]))
    assert e2e.trl_in_fresh_process(parse(["--device", "cuda", "--trl-process", "fresh"]))


def test_rounds_must_be_positive():
    with pytest.raises(ValueError, match="--rounds must be >= 1"):
        e2e.main(["--shapes", "tiny", "--device", "cpu", "--rounds", "0"])


def test_async_runs_time_an_even_number_of_steps():
    from argparse import Namespace

    assert [e2e.timed_steps(Namespace(steps=n), eta=1) for n in (1, 2, 3)] == [2, 2, 4]
    assert [e2e.timed_steps(Namespace(steps=n), eta=0) for n in (1, 2, 3)] == [1, 2, 3]


def test_areno_overrides_reach_their_systems(tmp_path):
    args = e2e.build_parser().parse_args(
        ["--device", "cpu", "--areno-set", "optim.lr=3e-6", "--areno-async-set", "rollout.max_concurrent=8"]
    )
    kw = dict(param_dtype="float32", prompt_len=16, completion_len=32)
    sync_cfg = e2e.areno_config(args, tmp_path, tmp_path / "d.jsonl", tmp_path / "r0", eta=0, **kw)
    async_cfg = e2e.areno_config(args, tmp_path, tmp_path / "d.jsonl", tmp_path / "r1", eta=1, **kw)
    assert sync_cfg.optim.lr == async_cfg.optim.lr == 3e-6
    assert async_cfg.rollout.max_concurrent == 8 and sync_cfg.rollout.max_concurrent != 8


def test_async_steps_are_whole_cycles_of_eta_plus_one():
    args = e2e.build_parser().parse_args(["--steps", "3", "--async-eta", "3"])
    assert e2e.timed_steps(args, 0) == 3  # colocated: as asked
    assert e2e.timed_steps(args, 1) == 4 and e2e.timed_steps(args, 3) == 4
    args.steps = 5
    assert e2e.timed_steps(args, 3) == 8 and e2e.timed_steps(args, 4) == 5


def test_async_eta_zero_is_refused_naming_the_colocated_system():
    with pytest.raises(ValueError, match="--async-eta must be >= 1.*'areno'"):
        e2e.main(["--async-eta", "0", "--device", "cpu", "--shapes", "tiny"])


def test_areno_vllm_system_runs_through_a_vllm_server(tmp_path):
    args = e2e.build_parser().parse_args(["--device", "cpu", "--systems", "areno,areno_vllm"])
    kw = dict(param_dtype="float32", prompt_len=16, completion_len=32)
    cfg = e2e.areno_config(args, tmp_path, tmp_path / "d.jsonl", tmp_path / "r", eta=0, server="vllm", **kw)
    assert cfg.rollout.backend == "vllm" and "--enforce-eager" in cfg.rollout.server_args
    assert (
        e2e.areno_config(args, tmp_path, tmp_path / "d.jsonl", tmp_path / "r", eta=0, **kw).rollout.backend == "areno"
    )
    assert "areno_vllm" not in e2e.build_parser().parse_args([]).systems  # it needs areno[vllm]: opt in


def test_reward_is_the_fraction_of_vowels():
    assert e2e.reward("p", "") == 0.0
    assert e2e.reward("p", "abcE") == 0.5  # a and E of four characters
    text = "<unused123>Hello, wOrld" * 7
    assert e2e.reward("p", text) == sum(c in "aeiouAEIOU" for c in text) / len(text)


@pytest.mark.parametrize("shape", sorted(e2e.SHAPES))
def test_every_shape_is_a_config_areno_reads(shape):
    """Each shape's config.json as written reads as the family it names (no weights built)."""
    from areno.models import ModelConfig

    hf, prompt_len, completion_len = e2e.SHAPES[shape]
    config = ModelConfig.from_hf({**hf, "vocab_size": hf["vocab_size"] or 64})
    assert config.architecture == hf.get("architectures", ["Qwen2ForCausalLM"])[0]
    assert prompt_len + completion_len <= config.max_seq_len
