"""Load and save time of a vision-language checkpoint's text model (``vl_text``) against the same text model
stored alone.

A random checkpoint of a released vision-language config (transformers' class, ``save_pretrained`` in
bfloat16) and, beside it, its text model saved alone by areno (``save_model`` without the container). Each
round loads both (``load_model``: the vision-language one skips its vision tower) and saves both (the
vision-language save also copies the vision tower and projector from the source), alternating which goes
first. The baseline is the bare text model's time, measured in the same rounds; ``ratio`` = the
vision-language time / the bare one (> 1: what the kept-apart tensors cost).

    python -m bench.vl_text                          # tiny shapes, seconds
    python -m bench.vl_text --shape qwen3-vl-2b      # Qwen3-VL-2B's config (4.3 GB of text weights)
    python -m bench.vl_text --shape gemma3-4b --rounds 2
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from pathlib import Path

import torch

from areno.models import load_model, save_model
from bench._common import emit, headline, parser, ratio, work_dir


def _config(shape: str):
    """The transformers config of ``shape``: the released config.json's keys (their text and vision parts)."""
    from transformers import Gemma3Config, Qwen3VLConfig

    if shape == "qwen3-vl-2b":
        text = dict(
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            max_position_embeddings=262144,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 5e6,
                "mrope_section": [24, 20, 20],
                "mrope_interleaved": True,
            },
        )
        vision = dict(
            depth=24,
            hidden_size=1024,
            intermediate_size=4096,
            num_heads=16,
            out_hidden_size=2048,
            deepstack_visual_indexes=[5, 11, 17],
            patch_size=16,
            num_position_embeddings=2304,
        )
        return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True)
    if shape == "gemma3-4b":
        text = dict(
            hidden_size=2560,
            intermediate_size=10240,
            num_hidden_layers=34,
            sliding_window=1024,
            rope_scaling={"rope_type": "linear", "factor": 8.0},
        )
        vision = dict(
            hidden_size=1152,
            image_size=896,
            intermediate_size=4304,
            num_attention_heads=16,
            num_hidden_layers=27,
            patch_size=14,
            vision_use_head=False,
        )
        return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=256)
    text = dict(
        hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2
    )
    text.update(head_dim=64, vocab_size=4096)
    vision = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, image_size=56)
    return Gemma3Config(text_config=text, vision_config={**vision, "patch_size": 14}, mm_tokens_per_image=4)


def _random_checkpoint(shape: str, out: Path) -> None:
    """``shape``'s vision-language model with random bfloat16 weights, saved by transformers."""
    from transformers import AutoModelForImageTextToText

    config = _config(shape)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty made the tied output projection a tensor of its own
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=g)
    model.save_pretrained(out)


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def main(argv: list[str] | None = None) -> dict:
    p = parser("vl_text", __doc__)
    p.add_argument("--shape", choices=("tiny", "qwen3-vl-2b", "gemma3-4b"), default="tiny")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temporary directory)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    with work_dir(args.workdir, "areno-bench-vl-text-") as workdir:
        vl_dir, text_dir = workdir / "vl", workdir / "text"
        t0 = time.perf_counter()
        _random_checkpoint(args.shape, vl_dir)
        model, config = load_model(vl_dir, dtype=torch.bfloat16)
        save_model(model, config.replace(container=None), text_dir)
        del model
        init_s = time.perf_counter() - t0
        times: dict[str, list[float]] = {k: [] for k in ("vl_load_s", "text_load_s", "vl_save_s", "text_save_s")}
        for r in range(args.rounds):
            order = (("vl", vl_dir), ("text", text_dir))
            for kind, src in order if r % 2 == 0 else order[::-1]:
                t = time.perf_counter()
                model, config = load_model(src, dtype=torch.bfloat16)
                times[f"{kind}_load_s"].append(time.perf_counter() - t)
                out = workdir / f"out-{kind}"
                os.sync()  # the previous writes flushed: each save is timed from a clean page cache
                t = time.perf_counter()
                save_model(model, config, out)
                os.sync()  # the bytes on disk, not in the page cache only
                times[f"{kind}_save_s"].append(time.perf_counter() - t)
                written = _dir_bytes(out)
                shutil.rmtree(out)
                times.setdefault(f"{kind}_saved_GB", [written / 1e9])
                del model
        med = {k: statistics.median(v) for k, v in times.items()}
        details = {
            "shape": args.shape,
            "rounds": args.rounds,
            "init_s": round(init_s, 2),
            "vl_checkpoint_GB": _dir_bytes(vl_dir) / 1e9,
            "load_ratio": ratio(med["vl_load_s"], med["text_load_s"]),
            **{k: [round(x, 3) for x in v] for k, v in times.items()},
        }
        head = headline(
            f"s to save a vision-language checkpoint's text model ({args.shape}; median of {args.rounds})",
            round(med["vl_save_s"], 3),
            "the same text model saved alone, same rounds",
            round(med["text_save_s"], 3),
            ratio(med["vl_save_s"], med["text_save_s"]),
            "vision-language save s / text-only save s (> 1: the vision tower's copy)",
        )
        return emit("vl_text", head, details)


if __name__ == "__main__":
    main()
