"""A user's own tokenizer (a byte-level BPE saved from ``PreTrainedTokenizerFast``, in a qwen2 checkpoint)
tokenizes as its tokenizer.json says, is templated even when its ChatML template is the text of areno's
character tokenizer's, and reaches a run's exports as the same files."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from areno.api.config import load_config
from areno.api.pipeline import run_pipeline
from areno.data.datasets import load_rows
from areno.data.messages import completion_text
from areno.data.prompts import render_prompt, uses_template
from areno.data.tokenizer import CHAT_TEMPLATE, build_char_tokenizer, load_pretrained_tokenizer
from areno.engine.api import sft_trajectories
from areno.errors import DataError
from areno.models.hf_io import init_model_dir, tiny_config

TEXT = ["What is 3 plus 4? 7", "What is 10 plus 5? 15", "sort 4193: 1349", "the quick brown fox"] * 50


def _bpe_model(out):
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        TEXT,
        trainers.BpeTrainer(
            vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )  # fmt: skip
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE  # plain ChatML: the same text as the character tokenizer's
    init_model_dir(out, tiny_config(len(fast), hidden_size=32, layers=1, heads=2, kv_heads=1), fast, seed=0)
    return out


def test_a_bpe_tokenizer_is_its_own_and_templated(tmp_path):
    model = _bpe_model(tmp_path / "m")
    tokenizer = load_pretrained_tokenizer(model)
    own = Tokenizer.from_file(str(model / "tokenizer.json"))
    for text in ("What is 3 plus 4?", "the quick brown fox 1349"):
        assert tokenizer.encode(text, add_special_tokens=False) == own.encode(text).ids
    assert uses_template(tokenizer, "auto")
    ids = render_prompt(tokenizer, "What is 3 plus 4?")
    assert tokenizer.decode(ids).startswith("<|im_start|>user\n")


def test_a_runs_exports_keep_the_models_tokenizer_files(tmp_path):
    model = _bpe_model(tmp_path / "m")
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "".join(json.dumps({"prompt": f"What is {i} plus 1?", "answer": str(i + 1)}) + "\n" for i in range(8))
    )
    cfg = load_config(
        None,
        [
            f"run_dir={tmp_path / 'run'}", f"model.path={model}", "data.task=null", f"data.train_path={rows}",
            "data.num_eval=0", "rollout.batch_size=2", "rollout.n_samples=2", "rollout.max_new_tokens=4",
            "train.steps=1", "cluster.device=cpu", "observe.console=false",
        ],
    )  # fmt: skip
    run_pipeline(cfg)
    (export,) = (tmp_path / "run" / "checkpoints").glob("step_*/hf")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (export / name).read_bytes() == (model / name).read_bytes(), name


def test_trl_conversational_completions_are_their_contents():

    row = {"prompt": [{"role": "user", "content": "3+4?"}], "completion": [{"role": "assistant", "content": "7"}]}
    assert completion_text(row["completion"]) == "7" and completion_text(12) == "12"

    tok = build_char_tokenizer()
    (traj,) = sft_trajectories([row], tok, "prompt", "completion", chat_template="always")
    assert tok.decode(traj.completion_ids) == "7<|im_end|>"  # the template's turn of the text, not the repr
    with pytest.raises(DataError, match="a message is not the assistant's"):
        completion_text([{"role": "user", "content": "x"}])


def test_a_bad_completion_list_is_named_with_its_line(tmp_path):

    rows = tmp_path / "d.jsonl"
    rows.write_text(json.dumps({"prompt": "p", "completion": [{"role": "assistant"}]}) + "\n")
    with pytest.raises(DataError, match=r"d\.jsonl line 1: the answer is a message list but message 0"):
        load_rows(rows, prompt_key="prompt", answer_key="completion")
