"""Parity of areno's decoder with transformers on tiny random checkpoints (fp32, CPU)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from areno.errors import ModelDirError
from areno.models import (
    Decoder,
    ModelConfig,
    PackedCausalAttention,
    load_model,
    packed_projections,
    save_model,
    tiny_config,
)
from areno.models.logprobs import packed_logprobs

VOCAB = 61
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
# YaRN over a short original context, so positions of a few tokens already sit on its ramp
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
YARN_MSCALE = {**YARN, "mscale": 0.9, "mscale_all_dim": 0.6, "beta_fast": 16, "beta_slow": 2}
CASES = {
    "llama": dict(arch="llama"),
    "llama_tied_bias": dict(
        arch="llama", tie_word_embeddings=True, attention_bias=True, attention_out_bias=True, mlp_bias=True
    ),
    "llama3_rope": dict(arch="llama", rope_scaling=LLAMA3_ROPE, rope_theta=500000.0),
    "qwen2": dict(arch="qwen2"),
    "qwen2_tied": dict(arch="qwen2", tie_word_embeddings=True),
    "qwen3": dict(arch="qwen3", head_dim=24),
    "qwen3_tied": dict(arch="qwen3", tie_word_embeddings=True),
    "mistral_window": dict(arch="mistral", sliding_window=6),
    "mha": dict(arch="qwen2", kv_heads=4),
    # max_position_embeddings = factor x the original length, which transformers 4.x reads as the factor
    "qwen3_yarn": dict(arch="qwen3", rope_scaling=YARN, rope_theta=100.0, max_position_embeddings=32),
    "llama_yarn_mscale": dict(arch="llama", rope_scaling=YARN_MSCALE, rope_theta=100.0, max_position_embeddings=32),
    "llama_yarn_attention_factor": dict(
        arch="llama", rope_scaling={**YARN, "attention_factor": 1.3}, max_position_embeddings=32
    ),
    "phi3": dict(arch="phi3"),
    "phi3_window": dict(arch="phi3", sliding_window=6),
    "smollm3": dict(arch="smollm3", layers=4, tie_word_embeddings=True),  # layer 3 without RoPE
    "smollm3_bias": dict(arch="smollm3", nope_layers=(0,), attention_bias=True, attention_out_bias=True, mlp_bias=True),
    "olmo2": dict(arch="olmo2"),
    "olmo2_tied_bias": dict(arch="olmo2", tie_word_embeddings=True, attention_bias=True, attention_out_bias=True),
}


def _build(case: str, tmp_path) -> tuple[Decoder, ModelConfig, torch.nn.Module]:
    """Our random model, saved and reloaded by transformers (eager attention, fp32)."""
    kw = dict(CASES[case])
    torch.manual_seed(0)
    # A wide init so logits are far from uniform and a mismatch cannot hide in tiny numbers.
    config = tiny_config(VOCAB, initializer_range=0.2, **kw)
    model = Decoder(config)
    save_model(model, config, tmp_path)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager")
    return model.eval(), config, ref.eval()


def _ref_logprobs(ref: torch.nn.Module, ids_T: torch.Tensor) -> torch.Tensor:
    """logprobs_T[t] = log p(ids[t] | ids[:t]) from transformers, 0 at t=0."""
    with torch.no_grad():
        logits = ref(ids_T[None]).logits[0].float()
    lp = torch.log_softmax(logits[:-1], -1).gather(-1, ids_T[1:, None])[:, 0]
    return torch.cat([torch.zeros(1), lp])


def _our_logprobs(model: Decoder, ids_T: torch.Tensor, cu_B1: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logprobs_T, _ = packed_logprobs(model, ids_T, cu_B1, chunk_size=7)
    return logprobs_T


@pytest.mark.parametrize("case", sorted(CASES))
def test_logprob_parity_with_transformers(case, tmp_path):
    model, config, ref = _build(case, tmp_path)
    g = torch.Generator().manual_seed(1)
    lens = [9, 14, 5]
    seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in lens]
    cu_B1 = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    ours = _our_logprobs(model, torch.cat(seqs), cu_B1)
    expected = torch.cat([_ref_logprobs(ref, s) for s in seqs])
    assert expected.abs().max() > 1.0  # meaningful log-probs, not ~log(1/V) everywhere equal
    assert (ours - expected).abs().max().item() <= 1e-4
    # The state dict is the HF state dict (names and shapes), minus the tied duplicate; Phi-3's q/k/v and
    # gate/up are one tensor each in transformers and in its files, two or three here
    ref_sd = {k: v for k, v in ref.state_dict().items() if not (config.tie_word_embeddings and k == "lm_head.weight")}
    ours_sd = packed_projections.to_disk_state(config, model.state_dict())
    assert sorted(ours_sd) == sorted(ref_sd)
    assert all(ours_sd[k].shape == ref_sd[k].shape for k in ours_sd)


@pytest.mark.parametrize("impl", ["sdpa", "sdpa_mask", "sdpa_padded", "auto"])
def test_packed_forward_equals_per_sequence(impl):
    torch.manual_seed(0)
    model = Decoder(tiny_config(VOCAB, arch="qwen3", initializer_range=0.2)).eval()
    lens = [7, 1, 12, 4]
    seqs = [torch.randint(0, VOCAB, (n,)) for n in lens]
    cu_B1 = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    pos_T = torch.cat([torch.arange(n) for n in lens])
    with torch.no_grad():
        packed = model(torch.cat(seqs), pos_T, PackedCausalAttention(cu_B1, impl=impl))
        single = torch.cat(
            [
                model(s, torch.arange(s.numel()), PackedCausalAttention(torch.tensor([0, s.numel()]), impl="sdpa_mask"))
                for s in seqs
            ]
        )
    torch.testing.assert_close(packed, single, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="covers 24 tokens but the batch has 23"):
        model(torch.cat(seqs)[:-1], pos_T[:-1], PackedCausalAttention(cu_B1, impl=impl))


def _padded_bf16_inputs():
    g = torch.Generator().manual_seed(0)
    cu_B1 = torch.tensor([0, 6, 12, 17])
    return cu_B1, [torch.randn(17, h, 8, generator=g).bfloat16().requires_grad_() for h in (4, 2, 2)]


def _float64_packed_attention(cu_B1, q, k, v):
    """Reference: per-sequence causal SDPA in float64 (GQA by repeated heads); output and grads."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = PackedCausalAttention(cu_B1, impl="sdpa")(0, q64, k64, v64)
    return out, q64, k64, v64


def test_cpu_bfloat16_padded_attention_as_two_gemms_matches_float64(monkeypatch):
    """bfloat16 q/k/v on the CPU (inside bf16 autocast too) attend as two bf16 GEMMs around an fp32
    softmax (``CpuExplicitAttention``): output and gradients within bf16 rounding of a float64
    reference, the gradients in bfloat16; several batch slices give the one slice's values exactly."""
    from areno.models import attention as attn_mod

    cu_B1, (q, k, v) = _padded_bf16_inputs()
    g_out = torch.randn(17, 4, 8)
    ref, q64, k64, v64 = _float64_packed_attention(cu_B1, q, k, v)
    ref.backward(g_out.double())

    def run():
        for t in (q, k, v):
            t.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = PackedCausalAttention(cu_B1, impl="sdpa_padded")(0, q, k, v)
        out.float().backward(g_out)
        return out, q.grad, k.grad, v.grad

    one = run()
    assert one[0].dtype == torch.bfloat16 and all(x.dtype == torch.bfloat16 for x in one[1:])
    for got, want in zip(one, (ref, q64.grad, k64.grad, v64.grad)):
        torch.testing.assert_close(got.double(), want, atol=2e-2 * want.abs().max().item(), rtol=0)
    monkeypatch.setattr(attn_mod, "CPU_SLICE_BYTES", 4 * 4 * 6 * 6)  # one sequence's fp32 scores: three slices
    assert attn_mod._batch_slices(3, 4 * 6 * 6) == [(0, 1), (1, 2), (2, 3)]
    sliced = run()
    assert all(torch.equal(a, b) for a, b in zip(sliced, one))


def test_cpu_bfloat16_padded_attention_above_the_bound_runs_flash_in_float32(monkeypatch):
    """Scores beyond ``CPU_EXPLICIT_MAX_SCORES`` (the explicit form keeps its probabilities) take the
    CPU flash kernel in float32 instead: exactly the float32 result, gradients reaching bf16 inputs."""
    from areno.models import attention as attn_mod

    monkeypatch.setattr(attn_mod, "CPU_EXPLICIT_MAX_SCORES", 0)
    cu_B1, (q, k, v) = _padded_bf16_inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = PackedCausalAttention(cu_B1, impl="sdpa_padded")(0, q, k, v)
    ref = PackedCausalAttention(cu_B1, impl="sdpa_padded")(0, q.float(), k.float(), v.float())
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref.bfloat16())
    out.float().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.bfloat16 for t in (q, k, v))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_attention_impls_agree_on_cpu():
    """Per-sequence SDPA, the block-diagonal SDPA mask and the FlexAttention document mask (the
    CUDA default, run eagerly here) agree, with and without a sliding window."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch.manual_seed(0)
    cu_B1 = torch.tensor([0, 5, 6, 19])
    q, k, v = torch.randn(19, 4, 8), torch.randn(19, 2, 8), torch.randn(19, 2, 8)
    for window in (None, 3):
        expected = PackedCausalAttention(cu_B1, sliding_window=window, impl="sdpa_mask")(0, q, k, v)
        per_seq = PackedCausalAttention(cu_B1, sliding_window=window, impl="sdpa")(0, q, k, v)
        torch.testing.assert_close(per_seq, expected, atol=1e-5, rtol=1e-5)
        mask = PackedCausalAttention(cu_B1, sliding_window=window)._flex_mask(19, torch.device("cpu"))
        assert create_block_mask is not None
        got = flex_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], block_mask=mask, enable_gqa=True
        )[0].transpose(0, 1)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_save_load_roundtrip_and_transformers_logits(tmp_path):
    model, config, ref = _build("qwen2_tied", tmp_path)
    loaded, config2 = load_model(tmp_path)
    assert config2 == config
    ids_T = torch.randint(0, VOCAB, (10,))
    with torch.no_grad():
        ours = loaded.logits(loaded(ids_T, torch.arange(10)))
        theirs = ref(ids_T[None]).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    for name, t in model.state_dict().items():
        assert torch.equal(t, loaded.state_dict()[name]), name
    # bf16 load keeps the dtype.
    bf16, _ = load_model(tmp_path, dtype=torch.bfloat16)
    assert bf16.output_weight.dtype == torch.bfloat16


def test_config_roundtrip_all_archs():
    for case, kw in CASES.items():
        config = tiny_config(VOCAB, **kw)
        assert ModelConfig.from_hf(json.loads(json.dumps(config.to_hf()))) == config, case
    n = tiny_config(VOCAB, arch="qwen3", tie_word_embeddings=False)
    assert n.num_params() == sum(p.numel() for p in Decoder(n).parameters())
    t = tiny_config(
        VOCAB, arch="llama", tie_word_embeddings=True, attention_bias=True, attention_out_bias=True, mlp_bias=True
    )
    assert t.num_params() == sum(p.numel() for p in Decoder(t).parameters())


def test_config_reads_transformers5_rope_parameters():
    d = tiny_config(VOCAB, arch="llama").to_hf()
    del d["rope_theta"], d["rope_scaling"]
    d["rope_parameters"] = dict(LLAMA3_ROPE, rope_theta=123.0)
    config = ModelConfig.from_hf(d)
    assert config.rope_theta == 123.0 and config.rope_scaling == LLAMA3_ROPE


def test_load_errors(tmp_path, char_tokenizer):
    with pytest.raises(ModelDirError, match="does not exist"):
        load_model(tmp_path / "nope")
    with pytest.raises(ModelDirError, match="config.json"):
        load_model(tmp_path)
    config = tiny_config(VOCAB)
    save_model(Decoder(config), config, tmp_path / "m")
    bad = config.to_hf() | {"architectures": ["GPT2LMHeadModel"]}
    (tmp_path / "m" / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*Qwen2ForCausalLM"):
        load_model(tmp_path / "m")
    # config says a wider vocabulary than the tensors have: the error names the first tensor.
    (tmp_path / "m" / "config.json").write_text(json.dumps(config.to_hf() | {"vocab_size": VOCAB + 3}))
    with pytest.raises(ValueError, match=r"tensor '(lm_head|model\.embed_tokens)\.weight' .* has shape"):
        load_model(tmp_path / "m")
    # config has one layer more than the checkpoint: a missing tensor is named.
    (tmp_path / "m" / "config.json").write_text(json.dumps(config.to_hf() | {"num_hidden_layers": 3}))
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.2\..*' is missing"):
        load_model(tmp_path / "m")
    # an untied config against a checkpoint without lm_head: missing lm_head named.
    tied = tiny_config(VOCAB, tie_word_embeddings=True)
    save_model(Decoder(tied), tied, tmp_path / "t")
    (tmp_path / "t" / "config.json").write_text(json.dumps(tied.to_hf() | {"tie_word_embeddings": False}))
    with pytest.raises(ValueError, match="lm_head.weight"):
        load_model(tmp_path / "t")


def test_config_validation_errors():
    with pytest.raises(ValueError, match="num_key_value_heads"):
        tiny_config(VOCAB, heads=4, kv_heads=3)
    with pytest.raises(ValueError, match="dynamic"):
        tiny_config(VOCAB, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match=r"lacks \['original_max_position_embeddings'\]"):
        tiny_config(VOCAB, rope_scaling={"rope_type": "yarn", "factor": 2.0})
    # Qwen3's documented YaRN block beside its unchanged 40,960 positions: transformers versions disagree
    qwen3 = tiny_config(VOCAB, arch="qwen3").to_hf() | {"max_position_embeddings": 40960}
    qwen3["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    with pytest.raises(
        ValueError, match="yarn: factor 4.0 but .* = 40960/32768 .*set max_position_embeddings to 131072"
    ):
        ModelConfig.from_hf(qwen3)
    qwen3["max_position_embeddings"] = 131072
    assert ModelConfig.from_hf(qwen3).rope_scaling["factor"] == 4.0
    # no original length: every transformers version takes max_position_embeddings and the factor as given
    qwen3["rope_scaling"] = {"rope_type": "yarn", "factor": 2.0}
    read = ModelConfig.from_hf(qwen3 | {"max_position_embeddings": 64}).rope_scaling
    assert read["factor"] == 2.0 and read["original_max_position_embeddings"] == 64
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig.from_hf(tiny_config(VOCAB).to_hf() | {"hidden_act": "gelu"})
    with pytest.raises(ValueError, match="sliding_window is only supported for .*, not LlamaForCausalLM"):
        tiny_config(VOCAB, arch="llama", sliding_window=16)


def test_init_model_dir_fixture_loads(tiny_model_dir, char_tokenizer):
    model, config = load_model(tiny_model_dir)
    assert config.vocab_size == len(char_tokenizer)
    assert config.eos_token_id == char_tokenizer.eos_token_id
    assert (tiny_model_dir / "tokenizer.json").is_file()
    assert (tiny_model_dir / "generation_config.json").is_file()
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids_T = torch.tensor(char_tokenizer("hello world")["input_ids"])
    with torch.no_grad():
        torch.testing.assert_close(
            model.logits(model(ids_T, torch.arange(ids_T.numel()))), ref(ids_T[None]).logits[0], atol=1e-4, rtol=1e-4
        )


def test_load_sharded_checkpoint_written_by_transformers(tmp_path):
    model, config, ref = _build("llama", tmp_path / "single")
    ref.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    loaded, _ = load_model(tmp_path / "sharded")
    for name, t in model.state_dict().items():
        assert torch.equal(t, loaded.state_dict()[name]), name


def test_init_model_dir_is_seeded(tmp_path, char_tokenizer):
    from areno.models import init_model_dir

    config = tiny_config(len(char_tokenizer), hidden_size=32)
    a, _ = load_model(init_model_dir(tmp_path / "a", config, char_tokenizer, seed=3))
    b, _ = load_model(init_model_dir(tmp_path / "b", config, char_tokenizer, seed=3))
    c, _ = load_model(init_model_dir(tmp_path / "c", config, char_tokenizer, seed=4))
    assert torch.equal(a.output_weight, b.output_weight)
    assert not torch.equal(a.output_weight, c.output_weight)
