"""Colocated sleep/wake offload: peak device memory and step time, ``cluster.offload=none`` against ``sleep``.

The real colocated GRPO step of ``bench.e2e`` (``Trainer`` on one device, random-init Qwen2.5 shape, 8 prompts
x 8 samples of fixed-length completions, the same KV pool in both arms) run once per setting, each arm in
a fresh process (``--no-isolate``: in this one) so one arm's allocations never count in the other's:

- ``none``: training state (weights, gradients, AdamW moments) and the rollout engine (weights, KV cache)
  stay on the device together;
- ``sleep``: while rolling out, the training state waits in pinned host memory; while training, the
  rollout weights and KV cache do (``engine/residency.py``, ``engine/local.py``).

Per arm: step time (mean over the timed steps, and per phase), the run's peak ``max_memory_allocated`` and
each phase's (the engine's ``system/<phase>_peak_memory_gib``), the seconds each phase switch took, or
``fits: false`` when the arm ran out of device memory. Several ``--shapes`` (0.5b, 1.5b, 3b, 7b, 14b) find the
largest shape that fits with ``sleep`` and not with ``none`` (``largest_fit``). Training state per parameter:
bf16 master weights (the CUDA default here) about 8 bytes, ``--param-dtype float32`` 16; the rollout engine adds
2 (bf16) plus its KV pool. A shape's checkpoint is written once per ``--workdir`` (reuse it across calls).

    python -m bench.offload                                          # CUDA: 0.5b, both settings
    python -m bench.offload --shapes 1.5b,3b,7b --steps 2 --warmup 1   # CUDA: the largest shape that fits
    python -m bench.offload --shapes 7b --param-dtype float32 --steps 2 --warmup 1 --workdir /tmp/offl
    python -m bench.offload --shapes tiny --device cpu --warmup 1 --steps 1   # CPU smoke

Headline: ``figure`` = the run's peak GiB with ``sleep`` on the first shape, ``baseline`` = with ``none``,
``ratio`` = none / sleep (the memory given back). ``step_time_ratio``: sleep s/step over none s/step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from areno.models.config import ModelConfig
from areno.models.hf_io import init_model_dir
from bench import e2e
from bench._common import emit, headline, parser, ratio, work_dir

QWEN25_3B = {**e2e.E2E_15B, "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36}
QWEN25_3B.update(num_attention_heads=16, num_key_value_heads=2)
QWEN25_7B = {**e2e.E2E_15B, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28}
QWEN25_7B.update(num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)
QWEN25_14B = {**QWEN25_7B, "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 48}
QWEN25_14B.update(num_attention_heads=40, num_key_value_heads=8)
# shape -> (HF config dict, default prompt length, default completion length)
SHAPES = {**e2e.SHAPES, "3b": (QWEN25_3B, 64, 512), "7b": (QWEN25_7B, 64, 512), "14b": (QWEN25_14B, 64, 512)}
MODES = ("none", "sleep")


def make_model_dir(shape: str, workdir: Path, device: str = "cpu") -> tuple[Path, ModelConfig]:
    """Random-init checkpoint of ``shape`` with its tokenizer (as ``bench.e2e``), made once per workdir.
    On CUDA it is drawn on the device and stored in bfloat16: half the bytes to write and read at 7B."""
    hf, _, _ = SHAPES[shape]
    tok = e2e.build_tokenizer(hf["vocab_size"])
    hf = {**hf, "vocab_size": len(tok), "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}
    config = ModelConfig.from_hf({**hf, "pad_token_id": tok.pad_token_id})
    path = workdir / shape
    if not (path / "config.json").is_file():
        t0 = time.perf_counter()
        cuda = device == "cuda"
        init_model_dir(path, config, tok, seed=0, device=device, dtype=torch.bfloat16 if cuda else None)
        print(json.dumps({"progress": {"shape": shape, "model_dir_s": time.perf_counter() - t0}}), file=sys.stderr)
    return path, config


def run_arm(args, shape: str, mode: str, workdir: Path) -> dict:
    """One setting on one shape, in this process: ``bench.e2e.run_areno`` with ``cluster.offload=mode``."""
    _, prompt_len, completion_len = SHAPES[shape]
    prompt_len, completion_len = args.prompt_len or prompt_len, args.completion_len or completion_len
    model_dir, _ = make_model_dir(shape, workdir, args.device)
    tok = e2e.build_tokenizer(SHAPES[shape][0]["vocab_size"])
    prompts = e2e.make_prompts(tok, args.prompts * (args.warmup + args.steps + 2), prompt_len)
    data_path = workdir / f"prompts-{shape}-{prompt_len}.jsonl"
    data_path.write_text("".join(json.dumps({"prompt": q, "answer": ""}) + "\n" for q in prompts))
    # e2e's own defaults under this bench's options: an option e2e gains later needs nothing here
    e2e_args = argparse.Namespace(
        **{
            **vars(e2e.build_parser().parse_args([])),
            **vars(args),
            "areno_set": [*args.areno_set, f"cluster.offload={mode}"],
        }
    )
    param_dtype = e2e.default_param_dtype(args)
    try:
        res = e2e.run_areno(
            e2e_args,
            f"{shape}-{mode}",
            model_dir,
            data_path,
            workdir,
            eta=0,
            param_dtype=param_dtype,
            prompt_len=prompt_len,
            completion_len=completion_len,
        )
    except torch.OutOfMemoryError as exc:
        return {"shape": shape, "offload": mode, "fits": False, "error": str(exc).splitlines()[0]}
    return {
        "shape": shape,
        "offload": mode,
        "fits": True,
        "param_dtype": param_dtype,
        "step_s_mean": statistics.fmean(res["step_s"]),
        "step_s": res["step_s"],
        "phases_s_median": res["phases_s"],
        "peak_gpu_gib": res["peak_gib"],
        "phase_peak_gpu_gib": res["phase_peaks_gib"],
        "offload_medians": res["system_medians"],
        "setup_s": res["setup_s"],
    }


def run_isolated(argv: list[str], shape: str, mode: str, workdir: Path) -> dict:
    """``run_arm`` in a fresh process (its own CUDA context and allocator); an out-of-memory death is
    ``fits: false``."""
    cmd = [sys.executable, "-m", "bench.offload", *argv, "--arm", f"{shape}:{mode}", "--workdir", str(workdir)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    sys.stderr.write(proc.stderr[-4000:])
    if proc.returncode == 0 and proc.stdout.strip():
        return json.loads(proc.stdout.strip().splitlines()[-1])
    if "OutOfMemoryError" in proc.stderr or "CUDA out of memory" in proc.stderr:
        return {"shape": shape, "offload": mode, "fits": False, "error": "out of memory (process died)"}
    raise RuntimeError(f"bench.offload arm {shape}:{mode} failed (exit {proc.returncode}); its stderr is above")


def build_parser() -> argparse.ArgumentParser:
    p = parser("offload", __doc__)
    p.add_argument("--shapes", default=None, help=f"comma list of {','.join(SHAPES)} (default: 0.5b; CPU: tiny)")
    p.add_argument("--modes", default=",".join(MODES), help="comma list of cluster.offload settings")
    p.add_argument("--steps", type=int, default=3, help="timed steps per arm")
    p.add_argument("--warmup", type=int, default=2, help="untimed warm-up steps per arm")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--samples", type=int, default=8, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default: 64; tiny 16)")
    p.add_argument("--completion-len", type=int, default=None, help="completion tokens (default: 512; tiny 32)")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--param-dtype", default=None, help="master weights (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument(
        "--areno-mb-tokens", type=int, default=None, help="train.max_tokens_per_mb (default: areno's estimate)"
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--workdir",
        default=None,
        help="where models and runs go (default: a temporary directory, removed when the bench ends well)",
    )
    p.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="each arm in a fresh process (default: on CUDA)",
    )
    p.add_argument("--areno-set", action="append", default=[], metavar="KEY=VALUE", help="one more config override")
    p.add_argument("--arm", default=None, help=argparse.SUPPRESS)  # SHAPE:MODE, run by --isolate's children
    return p


def summarize(rows: list[dict], shapes: list[str], modes: list[str]) -> tuple[dict, dict]:
    """The headline (first shape, sleep against none) and the largest shape that fits per setting."""
    by = {(r["shape"], r["offload"]): r for r in rows}
    first = shapes[0]
    sleep, none = by.get((first, "sleep"), {}), by.get((first, "none"), {})
    head = headline(
        f"peak device memory of a colocated GRPO step, GiB ({first})",
        sleep.get("peak_gpu_gib"),
        "cluster.offload=none",
        none.get("peak_gpu_gib"),
        ratio(none.get("peak_gpu_gib"), sleep.get("peak_gpu_gib")),
        "none / sleep",
    )
    largest = {m: next((s for s in reversed(shapes) if by.get((s, m), {}).get("fits")), None) for m in modes}
    extra = {
        "step_time_ratio": ratio(sleep.get("step_s_mean"), none.get("step_s_mean")),
        "step_time_ratio_is": "sleep s/step / none s/step",
        "largest_fit": largest,
    }
    return head, extra


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    with work_dir(args.workdir, "areno-bench-offload-") as workdir:
        if args.arm is not None:  # a child of --isolate: one arm, one JSON line
            shape, mode = args.arm.split(":")
            print(json.dumps(run_arm(args, shape, mode, workdir)), flush=True)
            return 0
        shapes = (args.shapes or ("0.5b" if args.device == "cuda" else "tiny")).split(",")
        modes = args.modes.split(",")
        for name, allowed, given in (("--shapes", SHAPES, shapes), ("--modes", MODES, modes)):
            if unknown := [x for x in given if x not in allowed]:
                raise ValueError(f"{name}: unknown {unknown}; choose from {list(allowed)}")
        isolate = args.isolate if args.isolate is not None else args.device == "cuda"
        rows = []
        for shape in shapes:
            for mode in modes:
                t0 = time.perf_counter()
                row = run_isolated(argv, shape, mode, workdir) if isolate else run_arm(args, shape, mode, workdir)
                row["arm_wall_s"] = time.perf_counter() - t0
                print(json.dumps({"progress": row}), file=sys.stderr, flush=True)
                rows.append(row)
        head, extra = summarize(rows, shapes, modes)
        hw = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__}
        emit("offload", head, {**extra, "hardware": hw, "rows": rows})
        return 0


if __name__ == "__main__":
    sys.exit(main())
