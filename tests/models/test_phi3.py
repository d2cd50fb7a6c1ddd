"""Phi-3 / Phi-4 (``Phi3ForCausalLM``): Llama's layers, checkpoints with q/k/v and gate/up packed into
one tensor each. A checkpoint transformers saved loads and computes its log-probs; areno's exports (a
save, a run's checkpoint) store the packed names transformers loads; the rollout engine reloads an
export from disk; a packed tensor that does not split is refused by name. Phi-4-mini's RoPE: partial rotary
embeddings (the first ``rotary_dim`` of each head) and LongRoPE's short factors, within its original context."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Phi3Config

from areno.errors import ModelDirError
from areno.models import ModelConfig, load_model, save_model, tiny_config
from areno.models.logprobs import packed_logprobs
from tests.helpers.configs import grpo_rewards_on_tiny
from tests.helpers.families import (
    assert_engine_decodes_as_recompute,
    assert_export_reads_back,
    assert_gradients_match,
    grpo_learns_and_exports,
    packed_batch,
    reference_logprobs,
    saved_by_transformers,
    saved_names,
)


def _saved_by_transformers(path, **kw):
    return saved_by_transformers(Phi3Config, path, **kw)


def _logprobs(ref, model):
    """(areno's, transformers') log-probs of the shared packed batch."""
    seqs, ids_T, cu_B1 = packed_batch()
    with torch.no_grad():
        ours, _ = packed_logprobs(model.eval(), ids_T, cu_B1, chunk_size=7)
    return ours, reference_logprobs(ref, seqs)


@pytest.mark.parametrize("window", [None, 5])
def test_a_checkpoint_transformers_saved_loads_and_exports_its_packed_names(window, tmp_path):
    ref = _saved_by_transformers(tmp_path / "hf", sliding_window=window)
    model, config = load_model(tmp_path / "hf")
    assert config.sliding_window == window and not config.attention_bias
    assert "model.layers.0.self_attn.q_proj.weight" in model.state_dict()
    ours, expected = _logprobs(ref, model)
    assert expected.abs().max() > 1.0
    assert (ours - expected).abs().max().item() <= 1e-4
    save_model(model, config, tmp_path / "out")
    assert saved_names(tmp_path / "out") == saved_names(tmp_path / "hf")  # qkv_proj and gate_up_proj, as transformers
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32, attn_implementation="eager")
    assert (_logprobs(back.eval(), model)[1] - expected).abs().max().item() <= 1e-5
    assert ModelConfig.from_hf(json.loads((tmp_path / "out" / "config.json").read_text())) == config


def test_the_rollout_engine_reloads_an_export_from_disk(tmp_path):
    from areno.rollout.engine import RolloutEngine, RolloutEngineConfig

    _saved_by_transformers(tmp_path / "a")
    model, config = load_model(tmp_path / "a")
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    save_model(model, config, tmp_path / "b")
    engine_model, _ = load_model(tmp_path / "a")
    engine = RolloutEngine(engine_model, config, config=RolloutEngineConfig(block_size=4, num_blocks=32))
    engine.update_weights_from_disk(str(tmp_path / "b"), version=1)
    got = engine.weight_tensors()
    for name, t in model.state_dict().items():
        assert torch.equal(got[name], t), name


def test_a_packed_tensor_that_does_not_split_is_refused(tmp_path):
    _saved_by_transformers(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.1.self_attn.qkv_proj.weight"
    state[name] = state[name][:-12].contiguous()  # one k/v head's rows short
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        ModelDirError,
        match=rf"tensor '{name}' in .*: a packed tensor of shape \(84, 48\) does not split into rows \[48, 24, 24\]",
    ):
        load_model(tmp_path)


# Phi-4-mini's RoPE at a tiny size: 12 of each head's 16 dimensions turn (partial_rotary_factor 0.75), by
# LongRoPE's short factors (6 of them, one per turned frequency) and its attention factor (a context grown 4x)
SHORT = [1.0, 1.7, 2.9, 1.3, 3.8, 2.2]


def _longrope() -> dict:
    # a fresh dict each time: transformers' config class fills in the one it is given
    return {"rope_type": "longrope", "short_factor": list(SHORT), "long_factor": [x * 2 for x in SHORT]}


def _phi4_mini() -> dict:
    return dict(
        hidden_size=64,
        partial_rotary_factor=0.75,
        rope_scaling=_longrope(),
        original_max_position_embeddings=32,
        max_position_embeddings=128,
    )


def test_partial_rotary_and_longrope_compute_transformers_logprobs_and_gradients(tmp_path):
    ref = _saved_by_transformers(tmp_path / "hf", **_phi4_mini())
    model, config = load_model(tmp_path / "hf")
    assert (config.rotary_dim, config.head_dim, config.max_seq_len) == (12, 16, 32)
    assert config.rope_scaling["rope_type"] == "longrope"
    seqs, ids_T, cu_B1 = packed_batch()
    ours, expected = _logprobs(ref, model)
    assert (ours - expected).abs().max().item() <= 1e-4
    # the short factors and the attention factor both matter at these positions
    for key, value in (("short_factor", [1.0] * 6), ("attention_factor", 1.0)):
        shutil.copytree(tmp_path / "hf", tmp_path / key)
        d = json.loads((tmp_path / key / "config.json").read_text())
        d["rope_parameters"][key] = value
        (tmp_path / key / "config.json").write_text(json.dumps(d))
        other, _ = load_model(tmp_path / key)
        with torch.no_grad():
            assert (packed_logprobs(other.eval(), ids_T, cu_B1, chunk_size=7)[0] - expected).abs().max() > 1e-3
    assert_export_reads_back(model, config, seqs, expected, tmp_path / "out")
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["partial_rotary_factor"] == 0.75
    # transformers 4.x's Phi-3 takes exactly these three keys (the original context at the top level)
    assert set(exported["rope_scaling"]) == {"type", "short_factor", "long_factor"}
    assert exported["original_max_position_embeddings"] == 32
    model.train()
    assert_gradients_match(
        model,
        ref,
        ["model.embed_tokens.weight", "model.layers.0.self_attn.o_proj.weight", "model.layers.1.mlp.down_proj.weight"],
    )


def test_partial_rotary_alone_and_the_old_longrope_names(tmp_path):
    ref = _saved_by_transformers(tmp_path, hidden_size=64, partial_rotary_factor=0.5)
    model, config = load_model(tmp_path)
    assert config.rotary_dim == 8 and config.rope_scaling is None and config.max_seq_len == 4096
    ours, expected = _logprobs(ref, model)
    assert (ours - expected).abs().max().item() <= 1e-4
    d = json.loads((tmp_path / "config.json").read_text())
    d.pop("rope_parameters", None)
    for old in ("su", "yarn"):  # Phi-3's class reads both as LongRoPE
        got = ModelConfig.from_hf(
            {**d, "rope_scaling": {"type": old, "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}}
        )
        assert got.rope_scaling["rope_type"] == "longrope"
        assert got.rope_scaling["original_max_position_embeddings"] == 4096  # the class's default, as transformers


def test_the_rollout_engine_decodes_partial_rotary_and_longrope_within_its_positions(tmp_path):
    from areno.rollout.engine import RolloutEngine, RolloutEngineConfig

    _saved_by_transformers(tmp_path, **_phi4_mini())
    model, config = load_model(tmp_path)
    assert_engine_decodes_as_recompute(model, config, decode_steps=3, max_model_len=32)
    # past LongRoPE's original context transformers turns by the long factors, which areno does not compute
    with pytest.raises(
        ValueError, match="max_model_len=64 exceeds the model's LongRoPE's original_max_position_embeddings=32"
    ):
        RolloutEngine(model, config, config=RolloutEngineConfig(block_size=4, num_blocks=64, max_model_len=64))
    assert RolloutEngine(model, config, config=RolloutEngineConfig(block_size=4, num_blocks=64)).max_model_len == 32
    ids_T = torch.randint(0, 61, (40,))
    with pytest.raises(ValueError, match="a packed sequence has 40 tokens, more than the model's LongRoPE's"):
        packed_logprobs(model, ids_T, torch.tensor([0, 40]))
    # every training forward (sft, preference, reward-model data as well as rollouts) refuses it before running
    from areno.errors import DataError
    from areno.specializations.forward import hidden_states_TD
    from tests.helpers.train import random_batch

    with pytest.raises(
        DataError, match="a training sequence has 40 tokens .* shorten or remove the data rows longer than 32"
    ):
        hidden_states_TD(model, random_batch([20, 40], 61, seed=0))


def test_unsupported_rotary_settings_are_refused(tmp_path):
    _saved_by_transformers(tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    d.pop("rope_parameters", None)
    with pytest.raises(ValueError, match=r"short_factor must list 12 numbers .* got 6"):
        ModelConfig.from_hf({**d, "hidden_size": 96, "rope_scaling": _longrope()})
    with pytest.raises(ValueError, match=r"partial_rotary_factor=0.75 turns 9 of head_dim=12 dimensions"):
        ModelConfig.from_hf({**d, "partial_rotary_factor": 0.75})
    with pytest.raises(ValueError, match="gives partial_rotary_factor .* make them agree"):
        ModelConfig.from_hf(
            {**d, "partial_rotary_factor": 0.5, "rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 1.0}}
        )
    with pytest.raises(ValueError, match="rope_scaling type 'linear' is impossible for Phi3ForCausalLM"):
        ModelConfig.from_hf({**d, "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    llama = tiny_config(61, arch="llama").to_hf()
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5 is not supported for LlamaForCausalLM"):
        ModelConfig.from_hf({**llama, "partial_rotary_factor": 0.5})


def test_grpo_on_a_tiny_phi4_mini_shape_learns(tmp_path):
    exported = grpo_learns_and_exports(tmp_path, "phi3", ", partial_rotary_factor: 0.5")
    assert exported["partial_rotary_factor"] == 0.5


def test_grpo_on_a_tiny_phi3_trains_and_exports_what_transformers_loads(tmp_path):
    rewards = grpo_rewards_on_tiny(
        tmp_path,
        "model.init_tiny={arch: phi3, hidden_size: 32, layers: 2, heads: 2, kv_heads: 1, intermediate_size: 64}",
    )
    assert len(rewards) == 12
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, rewards
    export = tmp_path / "run" / "checkpoints" / "step_00000012" / "hf"
    assert "model.layers.0.mlp.gate_up_proj.weight" in saved_names(export)
    hf = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    assert type(hf).__name__ == "Phi3ForCausalLM"
