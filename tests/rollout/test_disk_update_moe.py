"""The rollout engine's weight update from disk reads a mixture-of-experts checkpoint as ``save_model``
and transformers write it (one tensor per expert, Mixtral's router under ``block_sparse_moe``): the
experts are stacked into the engine's fused tensors (it rejected such a checkpoint before), and a
checkpoint missing one expert is refused naming the fused tensor."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from areno.models.hf_io import load_model, save_model
from areno.rollout import RolloutEngine, RolloutEngineConfig
from areno.rollout.errors import WeightUpdateError
from tests.helpers.moe import saved_by_transformers


@pytest.mark.parametrize("layout", ["qwen3_moe", "mixtral"])
def test_a_per_expert_checkpoint_updates_the_fused_experts(tmp_path, layout):
    saved_by_transformers(layout, tmp_path / "base")
    model, config = load_model(tmp_path / "base", dtype=torch.float32, device="cpu")
    engine = RolloutEngine(model, config, config=RolloutEngineConfig(block_size=4, num_blocks=16))
    new_model, _ = load_model(tmp_path / "base", dtype=torch.float32, device="cpu")
    with torch.no_grad():
        for p in new_model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    save_model(new_model, config, tmp_path / "new")
    engine.update_weights_from_disk(str(tmp_path / "new"), 1)
    served = engine.model.state_dict()
    for name, want in new_model.state_dict().items():
        assert torch.equal(served[name], want), name
    assert any("experts.gate_up_proj" in n for n in served)


def test_a_checkpoint_without_one_expert_is_refused(tmp_path):
    saved_by_transformers("qwen3_moe", tmp_path / "base")
    model, config = load_model(tmp_path / "base", dtype=torch.float32, device="cpu")
    engine = RolloutEngine(model, config, config=RolloutEngineConfig(block_size=4, num_blocks=16))
    save_model(model, config, tmp_path / "new")
    tensors = load_file(tmp_path / "new" / "model.safetensors")
    del tensors["model.layers.0.mlp.experts.3.up_proj.weight"]
    save_file(tensors, str(tmp_path / "new" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightUpdateError, match=r"lacks 1 of the model's .*model.layers.0.mlp.experts.gate_up_proj"):
        engine.update_weights_from_disk(str(tmp_path / "new"), 1)
