"""gpt-oss (``GptOssForCausalLM``): attention with a learned sink logit per query head, q/k/v/o biases, a window
in every other layer, YaRN, and an expert block in every layer whose router and experts have biases and whose
SwiGLU is clamped; checkpoints store the experts fused with gate and up interleaved, the released ones in MXFP4.
A checkpoint transformers saved computes its log-probs and gradients; exports load back in transformers; MXFP4
experts dequantize as transformers' own function does; the training attention's sink paths agree; what does
not support sinks is refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GptOssConfig

from areno.models import ModelConfig, load_model, tiny_config
from areno.models.attention import PackedCausalAttention, apply_sinks, explicit_attention
from areno.models.gpt_oss import dequantize_mxfp4, to_disk_state
from areno.models.hf_io import build_model
from areno.models.logprobs import packed_logprobs
from tests.helpers.families import (
    assert_engine_decodes_as_recompute,
    assert_engine_reloads_from_disk,
    assert_export_reads_back,
    assert_server_rollouts_refused,
    grpo_learns_and_exports,
    packed_batch,
    reference_logprobs,
    saved_by_transformers,
)

# windows of 4 keys in layers 0 and 2, YaRN over 4 original positions: the batch's sequences pass both
ROPE = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 16.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 4}  # fmt: skip
SHAPE = dict(
    num_hidden_layers=3,
    head_dim=12,
    max_position_embeddings=64,
    rope_parameters=ROPE,
    sliding_window=4,
    num_local_experts=4,
    num_experts_per_tok=2,
    intermediate_size=40,
)


def _saved(tmp_path):
    """transformers' tiny gpt-oss with sinks, router and expert biases drawn large enough to matter."""
    ref = saved_by_transformers(GptOssConfig, tmp_path / "hf", **SHAPE)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith(("sinks", "bias")):
                p.normal_(0.0, 1.0)
    ref.save_pretrained(tmp_path / "hf")
    return ref


def test_a_checkpoint_transformers_saved_computes_its_logprobs_and_exports(tmp_path):
    ref = _saved(tmp_path)
    model, config = load_model(tmp_path / "hf")
    assert config.architecture == "GptOssForCausalLM" and config.window_layers == (0, 2)
    assert config.attention_sinks and config.expert_bias and config.swiglu_limit == 7.0
    seqs, ids_T, cu_B1 = packed_batch()
    with torch.no_grad():
        ours, _ = packed_logprobs(model.eval(), ids_T, cu_B1, chunk_size=7)
        expected = reference_logprobs(ref, seqs)
        for layer in model.model.layers:  # without the sinks the log-probs move: they are computed
            layer.self_attn.sinks.fill_(-1e4)
        without, _ = packed_logprobs(model, ids_T, cu_B1, chunk_size=7)
    assert (ours - expected).abs().max().item() <= 1e-4
    assert (without - expected).abs().max().item() > 1e-2
    model, _ = load_model(tmp_path / "hf")
    assert_export_reads_back(model, config, seqs, expected, tmp_path / "out")
    theirs, back = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(theirs) == sorted(back)
    for name, t in theirs.items():  # the same tensors under the same names and layouts (gate/up interleaved)
        assert torch.equal(back[name], t), name


def test_gradients_match_transformers(tmp_path):
    ref = _saved(tmp_path)
    model, _ = load_model(tmp_path / "hf")
    seqs, ids_T, cu_B1 = packed_batch()
    ours, _ = packed_logprobs(model, ids_T, cu_B1, chunk_size=7)
    ours.sum().backward()
    reference_logprobs(ref, seqs, grad=True).sum().backward()
    grads = to_disk_state({n: p.grad for n, p in model.named_parameters()})
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    assert sorted(grads) == sorted(ref_grads)
    for name in ("self_attn.sinks", "mlp.router.bias", "mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias",
                 "mlp.experts.down_proj", "mlp.experts.down_proj_bias", "self_attn.o_proj.bias"):  # fmt: skip
        for layer in range(3):
            key = f"model.layers.{layer}.{name}"
            r = ref_grads[key]
            torch.testing.assert_close(grads[key], r, rtol=1e-4, atol=1e-5 * max(1.0, r.abs().max().item()), msg=key)


def test_the_rollout_engine_decodes_what_the_model_computes(tmp_path):
    _saved(tmp_path)  # windows of 4 keys: prompts of 6-14 tokens and 10 new ones pass them
    assert_engine_decodes_as_recompute(*load_model(tmp_path / "hf"), decode_steps=3)


def test_the_rollout_engine_reloads_a_checkpoint_from_disk(tmp_path):
    """transformers' own file (fused, interleaved experts; sinks) and areno's export."""
    _saved(tmp_path)
    assert_engine_reloads_from_disk(tmp_path / "hf", tmp_path / "b")


def test_grpo_on_a_tiny_gpt_oss_learns_the_reward(tmp_path):
    exported = grpo_learns_and_exports(tmp_path, "gpt_oss")
    assert exported["swiglu_limit"] == 7.0 and exported["layer_types"][0] == "sliding_attention"


def test_mxfp4_experts_dequantize_as_transformers_does_and_load(tmp_path):
    from transformers.integrations import mxfp4  # in every transformers areno takes (>= 4.56)

    g = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (4, 6, 2, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(120, 132, (4, 6, 2), dtype=torch.uint8, generator=g)
    theirs = mxfp4.convert_moe_packed_tensors(blocks, scales)  # [E, K, N] as transformers holds it
    assert torch.equal(dequantize_mxfp4(blocks, scales).transpose(1, 2), theirs)

    # the released layout: the experts' weights as blocks and scales (widths of 64 and 32: multiples of 32)
    saved_by_transformers(GptOssConfig, tmp_path / "hf", **{**SHAPE, "hidden_size": 64, "intermediate_size": 32})
    state = load_file(tmp_path / "hf" / "model.safetensors")
    quantized = dict(state)
    for layer in range(3):
        for proj, rows, width in (("gate_up_proj", 64, 64), ("down_proj", 64, 32)):
            key = f"model.layers.{layer}.mlp.experts.{proj}"
            b = torch.randint(0, 256, (4, rows, width // 32, 16), dtype=torch.uint8, generator=g)
            s = torch.randint(118, 126, b.shape[:-1], dtype=torch.uint8, generator=g)
            del quantized[key]
            quantized[f"{key}_blocks"], quantized[f"{key}_scales"] = b, s
            state[key] = mxfp4.convert_moe_packed_tensors(b, s).to(state[key].dtype)
    qdir = tmp_path / "q"
    qdir.mkdir()
    save_file(quantized, str(qdir / "model.safetensors"), metadata={"format": "pt"})
    save_file(state, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (qdir / "config.json").write_text(json.dumps(hf))
    from_q, _ = load_model(qdir)
    from_bf16, _ = load_model(tmp_path / "hf")
    for (name, a), (_, b) in zip(from_q.state_dict().items(), from_bf16.state_dict().items()):
        assert torch.equal(a, b), name
    del quantized["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(quantized, str(qdir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="down_proj_blocks' is stored without its other half"):
        load_model(qdir)
    with pytest.raises(ValueError, match="quantization_config"):  # another method stays refused
        ModelConfig.from_hf({**hf, "quantization_config": {"quant_method": "fp8"}})


def test_sink_attention_matches_transformers_eager_form():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(9, 4, 8, generator=g), torch.randn(9, 2, 8, generator=g), torch.randn(9, 2, 8, generator=g)
    sinks = torch.tensor([0.5, -1.0, 3.0, -30.0])
    kk, vv = k.repeat_interleave(2, 1).transpose(0, 1), v.repeat_interleave(2, 1).transpose(0, 1)
    scores = q.transpose(0, 1) @ kk.transpose(1, 2) / 8**0.5
    i = torch.arange(9)
    for window in (None, 3):
        keep = (i[None, :] <= i[:, None]) & ((i[:, None] - i[None, :] < window) if window else True)
        s = scores.masked_fill(~keep, float("-inf"))
        probs = torch.softmax(torch.cat([s, sinks[:, None, None].expand(4, 9, 1)], -1), -1)[..., :-1]
        expected = (probs @ vv).transpose(0, 1)
        torch.testing.assert_close(explicit_attention(q, k, v, sinks, window), expected, rtol=1e-5, atol=1e-6)
    # the last 4 queries of 9 keys (a shared prompt's completion), and the log-sum-exp form
    torch.testing.assert_close(explicit_attention(q[5:], k, v, sinks), explicit_attention(q, k, v, sinks)[5:])
    plain = explicit_attention(q, k, v, torch.full((4,), -1e4))
    lse = torch.logsumexp(scores.masked_fill(i[None, :] > i[:, None], float("-inf")), -1)
    torch.testing.assert_close(
        apply_sinks(plain.transpose(0, 1)[None], lse[None], sinks)[0].transpose(0, 1),
        explicit_attention(q, k, v, sinks),
    )


def test_shared_prompts_compute_the_same_sink_attention_and_gradients():
    from areno.specializations.forward import hidden_states_TD
    from areno.types import TokenBatch, Trajectory

    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 61, (20,), generator=gen).tolist()
    trajs = [
        Trajectory(prompt_ids=prompt, completion_ids=torch.randint(3, 61, (n,), generator=gen).tolist(),
                   logprobs=[0.0] * n, versions=[1] * n, reward=float(n % 2), group_id="g")
        for n in (6, 9, 4)
    ]  # fmt: skip
    batch = TokenBatch.from_trajectories(trajs)
    out, grads = {}, {}
    for share in (False, True):
        torch.manual_seed(0)
        model = build_model(tiny_config(61, arch="gpt_oss", layers=2))  # windows of 16 over 29-token sequences
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 1.0)
        model.share_prompts = share
        out[share] = hidden_states_TD(model, batch)
        (out[share] * torch.linspace(0.5, 1.5, out[share].numel()).view_as(out[share])).sum().backward()
        grads[share] = model.model.layers[0].self_attn.sinks.grad
    torch.testing.assert_close(out[True], out[False], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[True], grads[False], rtol=1e-4, atol=1e-5)


def test_what_has_no_sinks_is_refused():
    cu = torch.tensor([0, 5])
    with pytest.raises(ValueError, match="attention with sinks .* not impl='sdpa_padded'"):
        PackedCausalAttention(cu, sinks=True, impl="sdpa_padded")
    attn = PackedCausalAttention(cu, sinks=True)
    attn._cuda_impl = "varlen"
    with pytest.raises(ValueError, match="train.attention=varlen: attention with sinks"):
        attn.prepare(5, torch.device("cpu"))
    config = tiny_config(61, arch="gpt_oss")
    with pytest.raises(ValueError, match="tensor parallelism of mixture-of-experts"):
        from areno.models.tp_plan import check_tp_size

        check_tp_size(config, 2)
    from areno.train.context_parallel import check_context_parallel

    with pytest.raises(ValueError, match="context parallelism of attention with sinks"):
        check_context_parallel(config, 2)
    with pytest.raises(ValueError, match="GptOssForCausalLM's and all set there"):
        config.replace(attention_sinks=False)
    with pytest.raises(ValueError, match="turns by YaRN"):
        config.replace(rope_scaling=None)


def test_config_defaults_are_transformers_class_defaults():
    bare = ModelConfig.from_hf({"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss"})
    theirs = GptOssConfig()
    assert (bare.hidden_size, bare.num_hidden_layers, bare.num_experts, bare.num_experts_per_tok) == (
        theirs.hidden_size,
        theirs.num_hidden_layers,
        theirs.num_local_experts,
        theirs.num_experts_per_tok,
    )
    assert bare.window_layers == tuple(i for i, t in enumerate(theirs.layer_types) if t == "sliding_attention")
    assert bare.rope_scaling["factor"] == theirs.rope_parameters["factor"] and bare.rope_theta == 150000.0
    assert bare.swiglu_alpha == theirs.swiglu_alpha and bare.sliding_window == theirs.sliding_window
    assert bare.num_params() == sum(p.numel() for p in _meta_model(theirs).parameters())


def _meta_model(config):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_server_rollouts_refuse_it_before_any_server_starts(tmp_path, monkeypatch, backend):
    assert_server_rollouts_refused(
        tmp_path, monkeypatch, backend, "gpt_oss", f"^rollout.backend={backend}: .* is a gpt-oss checkpoint"
    )
