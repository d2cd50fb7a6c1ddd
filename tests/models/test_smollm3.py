"""SmolLM3 (``SmolLM3ForCausalLM``): Llama's layers, RoPE left out in every fourth. A checkpoint
transformers saved loads and computes its log-probs (the NoPE layers read from ``no_rope_layers``, or
from ``no_rope_layer_interval`` where the file leaves the list out), exports back, and trains under GRPO."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import SmolLM3Config

from areno.models import ModelConfig, load_model, save_model
from areno.models.logprobs import packed_logprobs
from tests.helpers.families import (
    VOCAB,
    grpo_learns_and_exports,
    packed_batch,
    reference_logprobs,
    saved_by_transformers,
)


def _saved_by_transformers(path, **kw):
    return saved_by_transformers(SmolLM3Config, path, num_hidden_layers=4, **kw)


@pytest.mark.parametrize(
    "kw, nope",
    [({}, (3,)), ({"no_rope_layers": [0, 1, 0, 1]}, (0, 2)), ({"no_rope_layer_interval": 2}, (1, 3))],
    ids=["default", "listed", "interval"],
)
def test_a_checkpoint_transformers_saved_computes_its_logprobs(kw, nope, tmp_path):
    ref = _saved_by_transformers(tmp_path / "hf", **kw)
    if "no_rope_layer_interval" in kw:  # the file as one written without the list
        d = json.loads((tmp_path / "hf" / "config.json").read_text())
        del d["no_rope_layers"]
        (tmp_path / "hf" / "config.json").write_text(json.dumps(d))
    model, config = load_model(tmp_path / "hf")
    assert config.nope_layers == nope and config.tie_word_embeddings
    seqs, ids_T, cu_B1 = packed_batch()
    with torch.no_grad():
        ours, _ = packed_logprobs(model.eval(), ids_T, cu_B1, chunk_size=7)
    expected = reference_logprobs(ref, seqs)
    assert (ours - expected).abs().max().item() <= 1e-4
    save_model(model, config, tmp_path / "out")
    assert ModelConfig.from_hf(json.loads((tmp_path / "out" / "config.json").read_text())) == config


def test_nope_layers_only_for_smollm3_and_in_range():
    from areno.models import tiny_config

    with pytest.raises(
        ValueError,
        match="nope_layers .* only expressible for SmolLM3ForCausalLM and Exaone4ForCausalLM, not LlamaForCausalLM",
    ):
        tiny_config(VOCAB, arch="llama", nope_layers=(1,))
    with pytest.raises(ValueError, match=r"nope_layers \[5\] must be layer indices < 2"):
        tiny_config(VOCAB, arch="smollm3", nope_layers=(5,))


def test_grpo_on_a_tiny_smollm3_learns_the_reward(tmp_path):
    grpo_learns_and_exports(tmp_path, "smollm3", ", nope_layers: [1]")
