"""Generation stops on every end-of-sequence id of a checkpoint (config.json, generation_config.json and the
tokenizer), in training rollouts as in ``areno serve`` and transformers' ``generate``: Qwen2.5's
``<|endoftext|>`` and Llama 3's ``<|eom_id|>`` are named by generation_config.json alone."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from areno.api.config import load_config
from areno.data.tokenizer import build_char_tokenizer, load_pretrained_tokenizer
from areno.engine.api import resolve_recipe
from areno.engine.local import LocalRolloutSide
from areno.engine.seams import SideSetup
from areno.errors import ModelDirError
from areno.models.hf_io import init_model_dir, read_config, stop_token_ids, tiny_config
from areno.rollout.server import build_engine
from areno.types import SamplingParams
from areno.workflows.teacher import teacher_engine_client


@pytest.fixture
def rigged_dir(tmp_path):
    """A checkpoint whose tokenizer's EOS is ``<|im_end|>``, whose generation_config.json also lists
    ``<|endoftext|>``, and whose weights always pick ``<|endoftext|>``."""
    tok = build_char_tokenizer(extra_tokens=("<|endoftext|>",))
    tok.eos_token = "<|im_end|>"
    im_end, eot = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    d = tmp_path / "model"
    config = tiny_config(
        len(tok), hidden_size=32, layers=1, heads=2, kv_heads=1, eos_token_id=im_end, tie_word_embeddings=False
    )
    init_model_dir(d, config, tok)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, eot]}))
    sd = load_file(d / "model.safetensors")
    for k in sd:
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            sd[k].zero_()
    sd["model.embed_tokens.weight"][:] = 1.0
    sd["lm_head.weight"].zero_()
    sd["lm_head.weight"][eot] = 1.0
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d, im_end, eot


def test_stop_ids_are_the_union_of_the_config_the_generation_config_and_the_tokenizer(rigged_dir):
    d, im_end, eot = rigged_dir
    tok = load_pretrained_tokenizer(d)
    assert stop_token_ids(d, read_config(d), tok) == (im_end, eot)
    (d / "generation_config.json").write_text("{not json")
    with pytest.raises(ModelDirError, match=r"generation_config.json is not valid JSON .*fix or delete it"):
        stop_token_ids(d, read_config(d), tok)


def test_training_rollouts_teacher_and_serve_stop_on_a_generation_config_eos(rigged_dir, tmp_path):
    d, _, eot = rigged_dir
    tok = load_pretrained_tokenizer(d)
    prompt, params = tok.encode("12+7="), SamplingParams(temperature=0.0, max_new_tokens=6)
    cfg = load_config(
        None,
        [
            f"run_dir={tmp_path / 'run'}",
            f"model.path={d}",
            "data.task=arithmetic",
            "cluster.device=cpu",
            "observe.console=false",
        ],
    )
    side = LocalRolloutSide(cfg, torch.device("cpu"))
    side.start(SideSetup(recipe=resolve_recipe(cfg), model_dir=d, tokenizer=tok))
    try:
        engines = {
            "training": side.engine,
            "teacher": teacher_engine_client(str(d), tok, device="cpu", num_blocks=32).engine,
            "serve": build_engine(str(d), device="cpu", dtype="float32", num_blocks=32)[0],
        }
        for name, engine in engines.items():
            out = engine.generate([prompt], params)[0]
            assert (out.output_ids, out.finish_reason) == ([eot], "stop"), name
    finally:
        side.shutdown()
