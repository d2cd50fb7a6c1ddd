"""Vision-language (Qwen2.5-VL layout): rollout tokens/s of areno's engine against ``transformers``
``generate``, and a GRPO training step with images through areno's training backend, in one run.

transformers builds a random-init ``Qwen2_5_VLForConditionalGeneration`` of ``--shape`` (``3b``: the
Qwen2.5-VL-3B language shape and vision tower; ``tiny``: the tests' shape) and saves it to a temporary
directory; areno loads that directory. Every prompt is one random-noise image of ``--image`` pixels
square (``3b``: 448, so 1,024 patches and 256 image tokens) and a few text tokens.

- Rollout: ``--groups`` prompts, ``--group-size`` samples each (a GRPO group: the engine runs the vision
  tower once per image and the group's samples share its prefill's KV blocks through the prefix cache),
  ``--new-tokens`` greedy tokens each, EOS ignored. Baseline: ``generate`` of the transformers class
  holding the same weights, all groups x group-size sequences in one batch, the same pixels, greedy.
  Both warm up on another image first. ``ratio``: ``generate`` seconds over engine seconds.
- Training: the rollout's sequences with their images as one GRPO batch (rewards random within each
  group), ``ActorSpecialization``'s forward and loss through ``FSDP2TrainBackend`` (``--backend``),
  one warm-up step then ``--train-steps`` timed: seconds per step and tokens/s (images included).

GPU (one H200):  python -m bench.vlm --shape 3b
CPU:             python -m bench.vlm --shape tiny --device cpu
"""

from __future__ import annotations

import gc
import inspect
import random
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from areno.models.hf_io import load_model
from areno.models.vision import ImageInputs, expand_image_tokens
from areno.rollout.engine import RolloutEngine, RolloutEngineConfig
from areno.specializations.actor import ActorSpecialization
from areno.types import SamplingParams, TokenBatch, Trajectory
from areno.workflows.images import stash_images
from bench._common import emit, headline, parser, ratio
from bench.train import build_backend

SHAPES = {
    "3b": dict(
        text=dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=11008,
            num_hidden_layers=36,
            num_attention_heads=16,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
        ),
        vision=dict(
            depth=32,
            hidden_size=1280,
            intermediate_size=3420,
            num_heads=16,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=112,
            out_hidden_size=2048,
            fullatt_block_indexes=[7, 15, 23, 31],
        ),
        tokens=dict(
            image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653
        ),
        eos=151645,
        image=448,
        groups=16,
        group_size=4,
        new_tokens=128,
    ),
    "tiny": dict(
        text=dict(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]},
        ),
        vision=dict(
            depth=2,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            patch_size=4,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=16,
            out_hidden_size=32,
            fullatt_block_indexes=[1],
        ),
        tokens=dict(image_token_id=60, video_token_id=61, vision_start_token_id=58, vision_end_token_id=59),
        eos=2,
        image=32,
        groups=2,
        group_size=3,
        new_tokens=6,
    ),
}
"""transformers ``Qwen2_5_VLConfig`` parts per shape, and the shape's default workload."""

TEXT_TOKENS = 16
"""Random text tokens around each prompt's image (ids below every special token)."""


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- model and prompts
def text_config_for(text: dict, transformers_version: str) -> dict:
    """A Qwen2.5-VL ``text_config`` written in transformers 5's form (``rope_parameters``), in the form the
    given version reads: 4.x takes ``rope_theta`` and ``rope_scaling: {type: mrope, mrope_section}``."""
    if int(transformers_version.split(".")[0]) >= 5:
        return text
    text = dict(text)
    rope = text.pop("rope_parameters")
    return {
        **text,
        "rope_theta": rope["rope_theta"],
        "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]},
    }


def write_checkpoint(shape: dict, path: Path, device: str, dtype: torch.dtype):
    """A random-init transformers Qwen2.5-VL model of ``shape`` saved to ``path``; returns it (eval)."""
    import transformers  # the baseline's library (seconds to import)

    text = text_config_for(shape["text"], transformers.__version__)
    cfg = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=shape["vision"], **shape["tokens"])
    for name in ("bos_token_id", "eos_token_id"):  # the text model's own, within its vocabulary
        setattr(cfg.text_config, name, shape["eos"])
        setattr(cfg, name, shape["eos"])
    torch.manual_seed(0)
    with torch.device(device):
        hf = transformers.Qwen2_5_VLForConditionalGeneration._from_config(cfg, dtype=dtype)
    hf.save_pretrained(str(path))
    return hf.eval()


def make_prompts(vc, groups: int, size: int, seed: int) -> list[tuple[list[int], ImageInputs]]:
    """``groups`` prompts: ``TEXT_TOKENS`` random ids around one random-noise image each."""
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(groups):
        image = Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))
        inputs = ImageInputs.from_images([image], vc)
        text = rng.integers(3, vc.vision_start_token_id, TEXT_TOKENS).tolist()
        half = TEXT_TOKENS // 2
        ids = text[:half] + [vc.vision_start_token_id, vc.image_token_id, vc.vision_end_token_id] + text[half:]
        prompts.append((expand_image_tokens(ids, inputs.grid_thw, vc), inputs))
    return prompts


# ----------------------------------------------------------------------------- rollout
def run_engine(model, config, prompts, warm_up, group_size: int, new_tokens: int, device: str, block_size: int):
    """(seconds, outputs per sequence in group order, engine figures) of one timed rollout, after
    one on ``warm_up`` (another image)."""
    seqs = len(prompts) * group_size
    longest = max(len(p) for p, _ in prompts) + new_tokens
    blocks = seqs * -(-longest // block_size) + 64  # room for every sequence with no sharing at all
    ecfg = RolloutEngineConfig(
        device=device, block_size=block_size, num_blocks=blocks, max_num_seqs=seqs, max_model_len=longest + 1
    )
    engine = RolloutEngine(model, config, config=ecfg, eos_token_ids=(config.eos_token_id,))
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)

    def generate(batch, params):
        ids = [engine.add_request(p, params, images=im) for p, im in batch for _ in range(group_size)]
        done = {}
        while len(done) < len(ids):
            done.update((o.request_id, o) for o in engine.step())
        return [done[i] for i in ids]

    generate(warm_up, SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True))
    before = engine.stats()
    runs_before = engine._stepper.vision_runs
    sync(device)
    t0 = time.perf_counter()
    outs = generate(prompts, params)
    sync(device)
    elapsed = time.perf_counter() - t0
    after = engine.stats()
    figures = {
        "vision_runs": engine._stepper.vision_runs - runs_before,
        "prefill_tokens": after["prefill_tokens"] - before["prefill_tokens"],
        "prompt_tokens": sum(len(p) for p, _ in prompts) * group_size,
        "prefix_hit_rate": after["prefix_hit_rate"],
    }
    return elapsed, outs, figures


@torch.no_grad()
def run_hf(hf, prompts, warm_up, group_size: int, new_tokens: int, device: str) -> tuple[float, list[list[int]]]:
    """(seconds, output ids per sequence) of one batched greedy ``generate`` (left padding), after
    one on ``warm_up``."""

    def generate(batch, n: int):
        seqs = [(p, im) for p, im in batch for _ in range(group_size)]
        L = max(len(p) for p, _ in seqs)
        ids = torch.zeros(len(seqs), L, dtype=torch.long)
        mask = torch.zeros(len(seqs), L, dtype=torch.long)
        for i, (p, _) in enumerate(seqs):
            ids[i, L - len(p) :] = torch.tensor(p)
            mask[i, L - len(p) :] = 1
        kw = {}
        if "mm_token_type_ids" in inspect.signature(hf.forward).parameters:  # newer transformers
            kw["mm_token_type_ids"] = (ids == hf.config.image_token_id).int().to(device)
        out = hf.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            pixel_values=torch.cat([im.pixel_values for _, im in seqs]).to(device, hf.dtype),
            image_grid_thw=torch.tensor([g for _, im in seqs for g in im.grid_thw], device=device),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            use_cache=True,
            **kw,
        )
        return out[:, L:].tolist()

    generate(warm_up, 2)
    sync(device)
    t0 = time.perf_counter()
    outs = generate(prompts, new_tokens)
    sync(device)
    return time.perf_counter() - t0, outs


# ----------------------------------------------------------------------------- training
def grpo_batch(prompts, outs, group_size: int, seed: int) -> TokenBatch:
    """The rollout as one GRPO batch: each sequence with its image, random rewards within a group."""
    rng = random.Random(seed)
    trajectories = []
    for i, out in enumerate(outs):
        prompt_ids, inputs = prompts[i // group_size]
        n = len(out.output_ids)
        trajectories.append(
            Trajectory(
                prompt_ids=prompt_ids,
                completion_ids=out.output_ids,
                logprobs=out.output_logprobs,
                versions=[0] * n,
                reward=float(rng.random() < 0.5),
                group_id=f"g{i // group_size}",
                info={"images": stash_images(inputs, None)},
            )
        )
    return TokenBatch.from_trajectories(trajectories)


def run_training(model_dir: Path, batch: TokenBatch, device: str, kind: str, mb_tokens: int, steps: int) -> dict:
    spec = ActorSpecialization()
    batch = spec.prepare_batch(batch)
    backend = build_backend(model_dir, device, kind, mb_tokens)

    def step():
        return backend.train_step(
            batch, forward_fn=spec.extract_model_output, loss_fn=spec.compute_loss, denominator_fn=spec.denominator
        )

    step()  # warm-up (allocator, kernels)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        metrics = step()
    sync(device)
    elapsed = (time.perf_counter() - t0) / steps
    row = {
        "backend": kind,
        "step_s": elapsed,
        "tokens": batch.num_tokens,
        "image_patches": sum(int(im["pixel_values"].shape[0]) for im in batch.images_B),
        "tokens_per_s": batch.num_tokens / elapsed,
        "max_tokens_per_mb": mb_tokens,
        "loss": float(metrics.get("loss", float("nan"))),
    }
    if device.startswith("cuda"):
        row["peak_memory_GiB"] = torch.cuda.max_memory_allocated() / 2**30
    return row


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    p = parser("vlm", __doc__)
    p.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default: 3b on CUDA, tiny on CPU")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--groups", type=int, default=None, help="prompts (one image each); default: the shape's")
    p.add_argument("--group-size", type=int, default=None, help="samples per prompt; default: the shape's")
    p.add_argument("--new-tokens", type=int, default=None, help="greedy tokens per sample; default: the shape's")
    p.add_argument("--image", type=int, default=None, help="image side in pixels; default: the shape's")
    p.add_argument("--train-steps", type=int, default=2, help="timed training steps (after one warm-up)")
    p.add_argument("--backend", choices=("fsdp2", "local"), default="fsdp2")
    p.add_argument("--mb-tokens", type=int, default=4096, help="training micro-batch token budget")
    p.add_argument("--block-size", type=int, default=16, help="rollout KV block size")
    p.add_argument("--skip-hf", action="store_true", help="leave out the generate baseline")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (CPU runs)")
    args = p.parse_args(argv)
    device = args.device
    shape_name = args.shape or ("3b" if device.startswith("cuda") else "tiny")
    shape = SHAPES[shape_name]
    groups, group_size = args.groups or shape["groups"], args.group_size or shape["group_size"]
    new_tokens, image = args.new_tokens or shape["new_tokens"], args.image or shape["image"]
    if device == "cpu":
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    with tempfile.TemporaryDirectory(prefix="areno-bench-vlm-") as tmp:
        model_dir = Path(tmp) / "model"
        t0 = time.perf_counter()
        hf = write_checkpoint(shape, model_dir, device, dtype)
        model, config = load_model(model_dir, dtype=dtype, device=device)
        build_s = time.perf_counter() - t0
        vc = model.vision_config
        prompts = make_prompts(vc, groups, image, seed=0)
        warm_up = make_prompts(vc, 1, image, seed=1)
        hf_s = hf_outs = None
        if not args.skip_hf:
            hf_s, hf_outs = run_hf(hf, prompts, warm_up, group_size, new_tokens, device)
        del hf
        engine_s, outs, engine = run_engine(
            model, config, prompts, warm_up, group_size, new_tokens, device, args.block_size
        )
        ids = [o.output_ids for o in outs]
        del model
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        batch = grpo_batch(prompts, outs, group_size, seed=0)
        train = run_training(model_dir, batch, device, args.backend, args.mb_tokens, args.train_steps)
    seqs = groups * group_size
    engine_tps = seqs * new_tokens / engine_s
    hf_tps = seqs * new_tokens / hf_s if hf_s else None
    head = headline(
        f"rollout generated tokens/s ({shape_name}, {groups}x{group_size} sequences, one {image}px image each, "
        f"{new_tokens} new tokens, greedy)",
        round(engine_tps, 1), "transformers generate tokens/s", round(hf_tps, 1) if hf_tps else None,
        ratio(engine_tps, hf_tps), "engine tokens/s / generate tokens/s (higher is better)",
    )  # fmt: skip
    details = {
        "device": device,
        "shape": shape_name,
        "dtype": str(dtype).removeprefix("torch."),
        "image_tokens_per_prompt": sum(t == vc.image_token_id for t in prompts[0][0]),
        "prompt_len": len(prompts[0][0]),
        "build_s": round(build_s, 1),
        "engine_s": engine_s,
        "generate_s": hf_s,
        "engine": engine,
        "greedy_identical_frac": (
            sum(a == b for a, b in zip(ids, hf_outs)) / len(ids) if hf_outs is not None else None
        ),
        "train": train,
    }
    emit("vlm", head, details)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
