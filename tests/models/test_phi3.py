"""Phi-3 / Phi-4 (``Phi3ForCausalLM``): Llama's layers, checkpoints with q/k/v and gate/up packed into
one tensor each. A checkpoint transformers saved loads and computes its log-probs; areno's exports (a
save, a run's checkpoint) store the packed names transformers loads; the rollout engine reloads an
export from disk; LongRoPE and partial rotary embeddings, which this decoder does not compute, and a
packed tensor that does not split are refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Phi3Config

from areno.errors import ModelDirError
from areno.models import ModelConfig, load_model, save_model
from areno.models.logprobs import packed_logprobs
from tests.helpers.configs import grpo_rewards_on_tiny
from tests.helpers.families import packed_batch, reference_logprobs, saved_by_transformers


def _saved_by_transformers(path, **kw):
    return saved_by_transformers(Phi3Config, path, **kw)


def _logprobs(ref, model):
    """(areno's, transformers') log-probs of the shared packed batch."""
    seqs, ids_T, cu_B1 = packed_batch()
    with torch.no_grad():
        ours, _ = packed_logprobs(model.eval(), ids_T, cu_B1, chunk_size=7)
    return ours, reference_logprobs(ref, seqs)


def _names(path) -> set[str]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return set(f.keys())


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
    assert _names(tmp_path / "out") == _names(tmp_path / "hf")  # qkv_proj and gate_up_proj, as transformers
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


def test_longrope_partial_rotary_and_a_packed_tensor_that_does_not_split_are_refused(tmp_path):
    _saved_by_transformers(tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    longrope = {"rope_type": "longrope", "short_factor": [1.0] * 6, "long_factor": [2.0] * 6}
    with pytest.raises(ValueError, match="rope_scaling type 'longrope' is not supported"):
        ModelConfig.from_hf({**d, "rope_scaling": longrope, "rope_parameters": None})
    with pytest.raises(ValueError, match="partial_rotary_factor=0.75 is not supported"):
        ModelConfig.from_hf({**d, "partial_rotary_factor": 0.75, "rope_parameters": None})
    state = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.1.self_attn.qkv_proj.weight"
    state[name] = state[name][:-12].contiguous()  # one k/v head's rows short
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        ModelDirError,
        match=rf"tensor '{name}' in .*: a packed tensor of shape \(84, 48\) does not split into rows \[48, 24, 24\]",
    ):
        load_model(tmp_path)


def test_grpo_on_a_tiny_phi3_trains_and_exports_what_transformers_loads(tmp_path):
    rewards = grpo_rewards_on_tiny(
        tmp_path,
        "model.init_tiny={arch: phi3, hidden_size: 32, layers: 2, heads: 2, kv_heads: 1, intermediate_size: 64}",
    )
    assert len(rewards) == 12
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, rewards
    export = tmp_path / "run" / "checkpoints" / "step_00000012" / "hf"
    assert "model.layers.0.mlp.gate_up_proj.weight" in _names(export)
    hf = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    assert type(hf).__name__ == "Phi3ForCausalLM"
