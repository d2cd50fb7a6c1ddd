"""The tiny vision-language model and run the VLM tests share (count coloured squares, on the CPU)."""

from __future__ import annotations

from areno.data.tokenizer import build_char_tokenizer
from areno.models.hf_io import init_model_dir
from areno.models.vision import tiny_vl_config

VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")


def make_vl_dir(path, seed: int = 0):
    tok = build_char_tokenizer("0123456789countsqare: ", extra_tokens=VISION_TOKENS)
    start, pad, end = tok.convert_tokens_to_ids(list(VISION_TOKENS))
    config = tiny_vl_config(len(tok), image_token_id=pad, vision_start_token_id=start, vision_end_token_id=end)
    init_model_dir(path, config, tok, seed=seed)
    return path


def vl_overrides(tmp_path, steps: int, **extra: str) -> list[str]:
    return [
        f"run_dir={tmp_path / 'run'}",
        f"model.path={make_vl_dir(tmp_path / 'model')}",
        "data.task=count_squares",
        "data.num_eval=16",
        "rollout.batch_size=4",
        "rollout.n_samples=8",
        "rollout.max_new_tokens=2",
        "cluster.device=cpu",
        "cluster.cpu_threads=1",
        "observe.console=false",
        "train.seed=0",
        f"train.steps={steps}",
        "train.eval_interval=0",
        "train.save_interval=0",
        *[f"{k}={v}" for k, v in extra.items()],
    ]
