"""Tiny mixture-of-experts models the MoE tests share: checkpoints saved by transformers itself, and
GRPO runs through ``Trainer`` on an expert ``model.init_tiny``."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

from areno.api.config import load_config
from areno.api.trainer import Trainer
from areno.models import load_model
from tests.helpers.configs import tiny_grpo_overrides
from tests.helpers.train import make_model_dir

VOCAB = 61
BIAS = "model.layers.{}.mlp.gate.e_score_correction_bias"
"""A GLM-4.5 sparse layer's correction bias (``glm4_moe_dir``'s layers 1 and 2)."""


def hf_config(layout: str, vocab: int):
    common = dict(
        vocab_size=vocab,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        initializer_range=0.2,  # far from uniform logits, so a mismatch cannot hide
        router_aux_loss_coef=0.01,
    )
    if layout == "qwen3_moe":
        return Qwen3MoeConfig(
            intermediate_size=48,
            moe_intermediate_size=16,
            num_hidden_layers=3,
            num_experts=6,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],  # one dense layer between sparse ones
            **common,
        )
    if layout == "qwen3_moe_unnormed":
        return Qwen3MoeConfig(
            intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2, num_experts=4,
            num_experts_per_tok=3, norm_topk_prob=False, decoder_sparse_step=2, **common,
        )  # fmt: skip
    return MixtralConfig(
        intermediate_size=16, num_hidden_layers=2, num_local_experts=5, num_experts_per_tok=2, **common
    )


def saved_by_transformers(layout: str, tmp_path, vocab: int = VOCAB):
    torch.manual_seed(0)
    cls = AutoModelForCausalLM.from_config(hf_config(layout, vocab), attn_implementation="eager")
    cls.save_pretrained(tmp_path)
    return AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager").eval()


MOE_TINY = (
    "model.init_tiny={arch: qwen3_moe, hidden_size: 32, layers: 2, heads: 2, kv_heads: 1, intermediate_size: 64,"
    " moe_intermediate_size: 32, num_experts: 4, num_experts_per_tok: 2, output_router_logits: true,"
    " router_aux_loss_coef: 0.01}"
)


def run_moe(tmp_path, *extra):
    cfg = load_config(None, [*tiny_grpo_overrides(tmp_path), MOE_TINY, "reward.sandbox=false", *extra])
    trainer = Trainer.init(cfg)
    try:
        trainer.run()
    finally:
        trainer.shutdown()
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


def glm4_moe_dir(path: Path, *, seed: int, biased: bool) -> Path:
    """A tiny GLM-4.5 (a dense first layer, two expert layers); ``biased``: nonzero correction biases, which
    move the routers' choice."""
    make_model_dir(path, arch="glm4_moe", layers=3, initializer_range=0.2, seed=seed)
    if biased:
        state = load_file(path / "model.safetensors")
        gen = torch.Generator().manual_seed(seed)
        for i in (1, 2):
            state[BIAS.format(i)] = 0.3 * torch.randn(state[BIAS.format(i)].shape, generator=gen)
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def bf16_blocks(hf_dir: Path, layer: int, experts_implementation: str = "eager"):
    """A checkpoint's sparse block in bf16, areno's and transformers' (with ``experts_implementation``), a bf16
    input x [64, D] and transformers' output for it: what a bit-for-bit rounding test compares."""
    ref = AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.bfloat16, experts_implementation=experts_implementation
    )
    model, config = load_model(hf_dir, dtype=torch.bfloat16)
    block, ref_block = model.model.layers[layer].mlp, ref.model.layers[layer].mlp
    x_TD = torch.randn(64, config.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    with torch.no_grad():
        expected_TD = ref_block(x_TD[None])[0]
    return block, x_TD, expected_TD
