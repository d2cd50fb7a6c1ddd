"""Checkpoint save and resume time of the training backend, against one plain ``torch.save``.

What a run's checkpoint costs (``ArenoEngine.save``): DCP shards of model + AdamW state, trainer
state and RNG (``save_checkpoint`` into the staging directory), the Hugging Face export, then
``checkpoint.commit`` (the ``COMPLETE`` marker and one rename). Resume: a fresh backend loads it
(``load_checkpoint``). The baseline, measured in the same run on the same model and optimizer
state, is ``torch.save({"model": ..., "optim": ...})`` to one file and ``torch.load`` back (not
atomic, no export). The optimizer state exists because one training step ran first.

    python bench/checkpoint.py                                  # CPU, hidden 512, 8 layers
    python bench/checkpoint.py --device cuda --hidden 2048 --layers 24   # GPU, ~1.4B parameters
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from areno.data.tokenizer import build_char_tokenizer
from areno.models.hf_io import init_model_dir, tiny_config
from areno.train import LocalTrainBackend, TrainBackendConfig, checkpoint
from bench.stamp import git_commit


def _backend(model_dir: Path, device: str) -> LocalTrainBackend:
    backend = LocalTrainBackend(TrainBackendConfig(lr=1e-4, device=device))
    backend.initialize(model_dir)
    return backend


def _one_step(backend: LocalTrainBackend) -> None:
    """Populate the AdamW moments: one optimizer step on a random loss over every parameter."""
    params = [p for p in backend.model.parameters() if p.requires_grad]
    loss = sum((p.float() ** 2).mean() for p in params)
    loss.backward()
    backend.optimizer.step()
    backend.optimizer.zero_grad(set_to_none=True)


def _timed(fn) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="areno_ckpt_bench_"))
    try:
        tokenizer = build_char_tokenizer()
        config = tiny_config(
            args.vocab,
            hidden_size=args.hidden,
            layers=args.layers,
            heads=max(args.hidden // 64, 1),
            kv_heads=max(args.hidden // 128, 1),
            intermediate_size=4 * args.hidden,
        )
        model_dir = init_model_dir(work / "model", config, tokenizer)
        backend = _backend(model_dir, args.device)
        _one_step(backend)
        n_params = sum(p.numel() for p in backend.model.parameters())
        rows: dict[str, list[float]] = {
            k: []
            for k in (
                "areno_save_s",
                "areno_export_hf_s",
                "areno_commit_s",
                "areno_resume_load_s",
                "baseline_save_s",
                "baseline_load_s",
            )
        }
        for i in range(args.repeats):
            path = work / "checkpoints" / f"step_{i:08d}"
            tmp = checkpoint.staging_dir(path)
            rows["areno_save_s"].append(_timed(lambda: backend.save_checkpoint(tmp / "policy", extra_state={"i": i})))
            rows["areno_export_hf_s"].append(_timed(lambda: backend.export_hf(tmp / "hf")))
            rows["areno_commit_s"].append(_timed(lambda: checkpoint.commit(tmp, path)))
            fresh = _backend(model_dir, args.device)
            rows["areno_resume_load_s"].append(_timed(lambda: fresh.load_checkpoint(path / "policy")))
            fresh.shutdown()
            plain = work / f"plain_{i}.pt"
            rows["baseline_save_s"].append(
                _timed(
                    lambda: torch.save(
                        {"model": backend.model.state_dict(), "optim": backend.optimizer.state_dict()}, plain
                    )
                )
            )
            rows["baseline_load_s"].append(
                _timed(lambda: torch.load(plain, map_location=args.device, weights_only=True))
            )
        best = {k: min(v) for k, v in rows.items()}
        size = sum(f.stat().st_size for f in (work / "checkpoints" / f"step_{0:08d}").rglob("*") if f.is_file())
        print(
            json.dumps(
                {
                    "bench": "checkpoint",
                    "commit": git_commit(),
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
                },
                indent=1,
            )
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
