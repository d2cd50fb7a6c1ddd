"""Checkpoint save and resume time of the training backend, against one plain ``torch.save``.

What a run's checkpoint costs (``ArenoEngine.save``): DCP shards of model + AdamW state, trainer
state and RNG (``save_checkpoint`` into the staging directory), the Hugging Face export, then
``checkpoint.commit`` (the ``COMPLETE`` marker and one rename). Resume: a fresh backend loads it
(``load_checkpoint``). The baseline, measured in the same run on the same model and optimizer
state, is ``torch.save({"model": ..., "optim": ...})`` to one file and ``torch.load`` back (not
atomic, no export). The optimizer state exists because one training step ran first.

Prints one JSON object: the headline (areno's save, best of ``--repeats``; ``torch.save`` as the baseline;
``ratio`` = baseline / areno), then every step's best time.

    python -m bench.checkpoint                                  # CPU, hidden 512, 8 layers
    python -m bench.checkpoint --device cuda --hidden 2048 --layers 24   # GPU, ~1.4B parameters
    python -m bench.checkpoint --incremental                    # full vs incremental, with and without LoRA
    python -m bench.checkpoint --incremental --device cuda --shape 0.5b --repeats 2   # the same at Qwen2.5-0.5B

``--incremental`` (``train.checkpoint_full_every``): per variant (full fine-tuning; LoRA), a full
checkpoint after one step, then an incremental one after a second step; bytes written and save time
of each (best of ``--repeats``), and the resume time of the incremental one. With AdamW every
trained tensor changes every step: full fine-tuning writes about as much either way; LoRA's frozen
base weights are written only in the full checkpoint. ``default_full_save_s``: a full checkpoint
without the tensor hashes (``checkpoint_full_every=0``), what hashing adds to a full one.
"""

from __future__ import annotations

import platform
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from areno.data.tokenizer import build_char_tokenizer
from areno.models.config import ModelConfig
from areno.models.hf_io import init_model_dir, tiny_config
from areno.train import LocalTrainBackend, LoraConfig, TrainBackendConfig, checkpoint
from bench._common import QWEN25_05B, emit, headline, parser, ratio

STEPS = (
    "areno_save_s",
    "areno_export_hf_s",
    "areno_commit_s",
    "areno_resume_load_s",
    "baseline_save_s",
    "baseline_load_s",
)


def _backend(model_dir: Path, device: str, **kw: object) -> LocalTrainBackend:
    backend = LocalTrainBackend(TrainBackendConfig(lr=1e-4, device=device, **kw))
    backend.initialize(model_dir)
    return backend


def _one_step(backend: LocalTrainBackend) -> None:
    """Populate the AdamW moments: one optimizer step on a random loss over every parameter."""
    params = [p for p in backend.model.parameters() if p.requires_grad]
    loss = sum((p.float() ** 2).mean() for p in params)
    loss.backward()
    backend.optimizer.step()
    backend.optimizer.zero_grad(set_to_none=True)


def _config(args) -> ModelConfig:
    """``--shape 0.5b``: Qwen2.5-0.5B's layout (tied embeddings, 151,936-token vocabulary); otherwise
    a Qwen2 model of ``--hidden``/``--layers``/``--vocab``."""
    if args.shape == "0.5b":
        q = QWEN25_05B
        return tiny_config(
            q["vocab_size"],
            hidden_size=q["hidden_size"],
            layers=q["num_hidden_layers"],
            heads=q["num_attention_heads"],
            kv_heads=q["num_key_value_heads"],
            intermediate_size=q["intermediate_size"],
            tie_word_embeddings=q["tie_word_embeddings"],
        )
    return tiny_config(
        args.vocab,
        hidden_size=args.hidden,
        layers=args.layers,
        heads=max(args.hidden // 64, 1),
        kv_heads=max(args.hidden // 128, 1),
        intermediate_size=4 * args.hidden,
    )


def _timed(fn: Callable[[], object]) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = parser("checkpoint", __doc__)
    p.add_argument("--device", default="cpu")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--shape", choices=("custom", "0.5b"), default="custom", help="0.5b: Qwen2.5-0.5B's layout")
    p.add_argument("--incremental", action="store_true", help="full vs incremental checkpoints, with and without LoRA")
    args = p.parse_args(argv)
    if args.incremental:
        return _incremental(args)

    work = Path(tempfile.mkdtemp(prefix="areno_ckpt_bench_"))
    try:
        tokenizer = build_char_tokenizer()
        config = _config(args)
        model_dir = init_model_dir(work / "model", config, tokenizer)
        backend = _backend(model_dir, args.device)
        _one_step(backend)
        n_params = sum(p.numel() for p in backend.model.parameters())
        rows: dict[str, list[float]] = {k: [] for k in STEPS}
        for i in range(args.repeats):
            for key, seconds in _round(backend, model_dir, work, i, args.device).items():
                rows[key].append(seconds)
        best = {k: min(v) for k, v in rows.items()}
        size = sum(f.stat().st_size for f in (work / "checkpoints" / f"step_{0:08d}").rglob("*") if f.is_file())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    head = headline(
        f"s per checkpoint save: DCP shards + trainer state + RNG ({n_params} parameters, {args.device})",
        round(best["areno_save_s"], 4),
        "one torch.save of the model and optimizer state dicts (not atomic, no export)",
        round(best["baseline_save_s"], 4),
        ratio(best["baseline_save_s"], best["areno_save_s"]),
        "torch.save s / areno save s (resume: areno_resume_load_s against baseline_load_s)",
    )
    details = {
        "device": args.device,
        "hardware": torch.cuda.get_device_name()
        if args.device == "cuda"
        else platform.processor() or platform.machine(),
        "params": n_params,
        "checkpoint_bytes": size,
        "repeats": args.repeats,
        "best_of_repeats": best,
        "commit_share_of_save": best["areno_commit_s"]
        / (best["areno_save_s"] + best["areno_export_hf_s"] + best["areno_commit_s"]),
    }
    emit("checkpoint", head, details)
    return 0


def _round(backend: LocalTrainBackend, model_dir: Path, work: Path, i: int, device: str) -> dict[str, float]:
    """One of each: areno's save, export, commit and resume of checkpoint ``i``, then the plain baseline."""
    path = work / "checkpoints" / f"step_{i:08d}"
    tmp = checkpoint.staging_dir(path)
    out = {
        "areno_save_s": _timed(lambda: backend.save_checkpoint(tmp / "policy", extra_state={"i": i})),
        "areno_export_hf_s": _timed(lambda: backend.export_hf(tmp / "hf")),
        "areno_commit_s": _timed(lambda: checkpoint.commit(tmp, path)),
    }
    fresh = _backend(model_dir, device)
    out["areno_resume_load_s"] = _timed(lambda: fresh.load_checkpoint(path / "policy"))
    fresh.shutdown()
    plain = work / f"plain_{i}.pt"
    out["baseline_save_s"] = _timed(
        lambda: torch.save({"model": backend.model.state_dict(), "optim": backend.optimizer.state_dict()}, plain)
    )
    out["baseline_load_s"] = _timed(lambda: torch.load(plain, map_location=device, weights_only=True))
    return out


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _incremental(args) -> int:
    """Full vs incremental checkpoint (``checkpoint_full_every=2``), full fine-tuning and LoRA."""
    work = Path(tempfile.mkdtemp(prefix="areno_ckpt_incr_bench_"))
    variants = {"full_ft": None, "lora": LoraConfig(rank=8)}
    results: dict[str, dict[str, float]] = {}
    try:
        tokenizer = build_char_tokenizer()
        config = _config(args)
        model_dir = init_model_dir(work / "model", config, tokenizer)
        for name, lora in variants.items():
            rows: dict[str, list[float]] = {
                "default_full_save_s": [],
                "full_save_s": [],
                "incremental_save_s": [],
                "incremental_resume_s": [],
            }
            for i in range(args.repeats):
                out = _incremental_round(model_dir, work / f"{name}_{i}" / "checkpoints", args.device, lora)
                for key in rows:
                    rows[key].append(out[key])
            results[name] = {
                **{k: out[k] for k in ("params", "trainable_params")},
                **{k: round(min(v), 4) for k, v in rows.items()},
                "full_bytes": out["full_bytes"],
                "incremental_bytes": out["incremental_bytes"],
                "bytes_ratio": round(out["full_bytes"] / out["incremental_bytes"], 2),
            }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lora_row = results["lora"]
    head = headline(
        f"bytes per incremental checkpoint, LoRA rank 8 ({lora_row['params']} parameters, {args.device})",
        lora_row["incremental_bytes"],
        "bytes of the full checkpoint before it",
        lora_row["full_bytes"],
        lora_row["bytes_ratio"],
        "full bytes / incremental bytes (full fine-tuning: see details)",
    )
    details = {
        "device": args.device,
        "hardware": torch.cuda.get_device_name()
        if args.device == "cuda"
        else platform.processor() or platform.machine(),
        "repeats": args.repeats,
        "variants": results,
    }
    emit("checkpoint_incremental", head, details)
    return 0


def _incremental_round(model_dir: Path, root: Path, device: str, lora: LoraConfig | None) -> dict[str, float]:
    """One full then one incremental checkpoint (a training step before each), and a resume from the latter."""
    backend = _backend(model_dir, device, lora=lora, checkpoint_full_every=2)
    out: dict[str, float] = {}
    paths = []
    for step, key in ((1, "full_save_s"), (2, "incremental_save_s")):
        _one_step(backend)
        final = root / f"step_{step:08d}"
        tmp = checkpoint.staging_dir(final)
        t0 = time.perf_counter()
        backend.save_checkpoint(tmp / "policy", extra_state={"step": step})
        checkpoint.commit(tmp, final)
        out[key] = time.perf_counter() - t0
        paths.append(final)
    assert checkpoint.is_incremental(paths[1] / "policy")
    backend.shutdown()
    fresh = _backend(model_dir, device, lora=lora)  # the default: every checkpoint full, no hashes
    out["incremental_resume_s"] = _timed(lambda: fresh.load_checkpoint(paths[1] / "policy"))
    out["default_full_save_s"] = _timed(lambda: fresh.save_checkpoint(root / "default" / "policy", extra_state={}))
    out["params"] = sum(p.numel() for p in fresh.model.parameters())
    out["trainable_params"] = sum(p.numel() for p in fresh.model.parameters() if p.requires_grad)
    fresh.shutdown()
    out["full_bytes"], out["incremental_bytes"] = _dir_bytes(paths[0]), _dir_bytes(paths[1])
    shutil.rmtree(root.parent)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
