"""The rollout engine runs the expert layouts: greedy tokens and log-probs equal transformers'
``generate`` on checkpoints transformers saved (paged KV, fused projections, packed CPU GEMMs on)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from areno.rollout.server import build_engine
from areno.types import SamplingParams
from tests.helpers.moe import saved_by_transformers


@pytest.mark.parametrize("layout", ["qwen3_moe", "mixtral"])
def test_engine_greedy_equals_transformers_generate(layout, tmp_path, char_tokenizer):
    saved_by_transformers(layout, tmp_path, vocab=len(char_tokenizer))
    char_tokenizer.save_pretrained(str(tmp_path))  # the engine reads the directory's tokenizer
    engine, _ = build_engine(str(tmp_path), device="cpu", num_blocks=64, block_size=4)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    prompts = [[5, 9, 17, 30, 41], [12, 7], [50, 51, 52, 53, 54, 55, 56, 57, 58]]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            res = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=6,
                min_new_tokens=6,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                eos_token_id=None,
                pad_token_id=0,
            )
        hf_ids = res.sequences[0, len(prompt) :].tolist()
        hf_lp = [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(res.scores, hf_ids)]
        assert out.output_ids == hf_ids
        assert out.output_logprobs == pytest.approx(hf_lp, abs=1e-4)
