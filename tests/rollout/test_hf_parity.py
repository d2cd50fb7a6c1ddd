"""The engine against transformers on the same checkpoint: greedy tokens and their log-probs."""

import pytest
import torch

from areno.rollout.server import build_engine
from areno.types import SamplingParams


def test_engine_matches_transformers_generate(tiny_model_dir):
    import transformers

    engine, _ = build_engine(str(tiny_model_dir), device="cpu", num_blocks=64, block_size=4)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    prompts = [[5, 9, 17, 30, 41], [12, 7], [60, 61, 62, 63, 64, 65, 66, 67, 68]]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            res = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=8,
                min_new_tokens=8,
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
