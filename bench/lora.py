"""LoRA against full fine-tuning: policy-sync bytes and peak training memory on CPU.

Each arm (``full``, ``lora``) of each shape runs in a fresh process: load a random-init model of the
shape, run ``--steps`` AdamW steps on packed random sequences, and report

- the policy-sync payload: the bytes of ``named_weights()`` (what every sync sends; with LoRA these are
  the merged weights under the base model's names, so the rollout engine is unchanged) and, for LoRA,
  of ``named_adapter_weights()`` (what an engine that applied the adapter itself would receive);
- the training state counted from the tensors after the steps: trainable parameters, gradients and
  AdamW moments;
- the process's peak resident set (``ru_maxrss``) and its growth over the training steps (peak after
  the steps minus the peak after loading): torch's CPU allocator is not visible to ``tracemalloc``.

``ratio``: full fine-tuning's peak-RSS growth over LoRA's on the last shape.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from areno.data.tokenizer import build_char_tokenizer
from areno.models.hf_io import init_model_dir, tiny_config
from areno.train import LocalTrainBackend, LoraConfig, TrainBackendConfig
from bench._common import emit, headline, parser, ratio
from bench.train import _denominator, _nll_forward, _nll_loss, make_batch

SHAPES = {
    "demo": dict(hidden_size=128, layers=4, heads=4, kv_heads=2, intermediate_size=384),
    "tiny25m": dict(hidden_size=512, layers=8, heads=8, kv_heads=4, intermediate_size=1536),
}
"""``demo``: areno/configs/demo.yaml's model; ``tiny25m``: a larger shape on the same tokenizer."""
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def run_arm(shape: str, arm: str, rank: int, steps: int, seq_len: int, seqs: int, workdir: Path) -> dict:
    """One arm in this process (call it in a fresh one: ``ru_maxrss`` only grows)."""
    torch.set_num_threads(1)
    tok = build_char_tokenizer()
    config = tiny_config(len(tok), **SHAPES[shape])
    model_dir = init_model_dir(workdir / shape, config, tok, seed=0)
    lora = LoraConfig(rank=rank, alpha=2.0 * rank, target_modules=ALL_LINEAR) if arm == "lora" else None
    cfg = TrainBackendConfig(lr=1e-4, device="cpu", max_tokens_per_mb=seq_len * seqs, lora=lora)
    backend = LocalTrainBackend(cfg)
    backend.initialize(model_dir)
    batches = [make_batch([seq_len] * seqs, config.vocab_size, s) for s in range(steps)]
    loaded_peak = _peak_rss_bytes()
    t0 = time.perf_counter()
    for batch in batches:
        backend.train_step(batch, forward_fn=_nll_forward, loss_fn=_nll_loss, denominator_fn=_denominator)
    step_s = (time.perf_counter() - t0) / steps
    trained_peak = _peak_rss_bytes()
    params = list(backend.model.parameters())
    trainable = [p for p in params if p.requires_grad]
    moments = [t for s in backend.optimizer.state.values() for t in s.values() if t.dim() > 0]
    out = {
        "shape": shape,
        "arm": arm,
        "params": sum(p.numel() for p in params),
        "trainable_params": sum(p.numel() for p in trainable),
        "sync_bytes": _nbytes(t for _, t in backend.named_weights()),
        "adapter_bytes": _nbytes(t for _, t in backend.named_adapter_weights()) if lora else None,
        # gradients are freed by zero_grad(set_to_none) after the step: counted as one per trainable weight
        "train_state_bytes": _nbytes(trainable) * 2 + _nbytes(moments),
        "peak_rss_bytes": trained_peak,
        "train_rss_growth_bytes": trained_peak - loaded_peak,
        "s_per_step": round(step_s, 4),
    }
    backend.shutdown()
    return out


def main(argv: list[str] | None = None) -> int:
    p = parser("lora", __doc__)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--seqs", type=int, default=2)
    p.add_argument("--arm", choices=("full", "lora"), help="run one arm in this process (the parent starts each)")
    p.add_argument("--workdir", type=Path, default=None)
    args = p.parse_args(argv)
    if args.arm:  # the child: one arm, one JSON line
        print(
            json.dumps(run_arm(args.shapes[0], args.arm, args.rank, args.steps, args.seq_len, args.seqs, args.workdir))
        )
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            for arm in ("full", "lora"):
                cmd = [sys.executable, "-m", "bench.lora", "--shapes", shape, "--arm", arm, "--workdir", tmp]
                cmd += ["--rank", str(args.rank), "--steps", str(args.steps)]
                cmd += ["--seq-len", str(args.seq_len), "--seqs", str(args.seqs)]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                rows.append(json.loads(out.strip().splitlines()[-1]))
                print(json.dumps(rows[-1]), file=sys.stderr)
    full, lora = rows[-2], rows[-1]
    head = headline(
        f"peak-RSS growth over {args.steps} training steps, LoRA rank {args.rank} on all linear layers, "
        f"{full['shape']} shape, {args.seqs} x {args.seq_len} tokens (bytes)",
        lora["train_rss_growth_bytes"],
        "full fine-tuning",
        full["train_rss_growth_bytes"],
        ratio(full["train_rss_growth_bytes"], lora["train_rss_growth_bytes"]),
        "full / lora",
    )
    emit("lora", head, {"rank": args.rank, "runs": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
