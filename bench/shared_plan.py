"""Micro-batches planned around shared prompts (the default where the model shares prompts) against the
token plan: a GRPO training step on one backend.

Where the decoder computes a group's common prompt once (``train.share_prompts``), a group that the token plan
(first-fit-decreasing by length) spreads over several micro-batches computes its prompt once in each.
``packing.plan_micro_batches`` with ``shared_B`` keeps groups whole where that adds no micro-batch, else cuts
consecutive sequences. Two arms on one backend (``LocalTrainBackend``, the shape's default compute dtype),
alternated ``--rounds`` times in one process:
- ``rows``: the backend's plan (``PackedTrainBackend.plan``);
- ``tokens``: ``plan_micro_batches`` without ``shared_B`` (what areno planned before).
The batch: ``--groups`` groups of ``--samples`` samples after a ``--prompt-len``-token prompt (random ids), the
completions ``--completion-len`` tokens or spread evenly from ``--min-completion-len`` (as ``bench.e2e``); the
loss the completion tokens' NLL through ``token_logprobs_T`` (the actor's forward). Each arm's median
``train_step`` seconds over the rounds (``--reps`` steps each, after one warm-up step per arm), its micro-batches
and the rows its shared forwards run. The headline: ``ratio`` = tokens / rows step time (>1: the default faster).

    python -m bench.shared_plan                                      # cpu12m, 8 x 8 x (32 + 16-256)
    python -m bench.shared_plan --prompt-len 256
    python -m bench.shared_plan --shape cpu5m --samples 4 --prompt-len 34 --min-completion-len 128 --completion-len 128

Prints one JSON object.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from areno.data.tokenizer import build_char_tokenizer
from areno.engine.host import keep_freed_memory
from areno.models import cpu_gemm, prefix_sharing
from areno.models.config import ModelConfig
from areno.models.hf_io import init_model_dir
from areno.specializations.forward import token_logprobs_T
from areno.train import LocalTrainBackend, TrainBackendConfig
from areno.train.packing import MicroBatchSpec, plan_micro_batches
from areno.types import TokenBatch, Trajectory
from bench._common import check_rounds_and_lengths, emit, headline, parser, ratio
from bench.e2e import CPU5M, CPU12M, E2E_05B, completion_lengths

SHAPES = {"cpu12m": CPU12M, "cpu5m": CPU5M, "0.5b": E2E_05B}


def make_batch(groups: int, samples: int, prompt_len: int, lengths: list[int], vocab: int) -> TokenBatch:
    """``groups`` groups of ``samples`` trajectories: one random prompt per group, random completions."""
    gen = torch.Generator().manual_seed(0)
    trajs = []
    for g in range(groups):
        prompt = torch.randint(3, vocab, (prompt_len,), generator=gen).tolist()
        for i in range(samples):
            n = lengths[i]
            ids = torch.randint(3, vocab, (n,), generator=gen).tolist()
            trajs.append(
                Trajectory(
                    prompt_ids=prompt,
                    completion_ids=ids,
                    logprobs=[0.0] * n,
                    versions=[0] * n,
                    reward=float(i % 2),
                    group_id=str(g),
                )
            )
    return TokenBatch.from_trajectories(trajs)


def _forward(model, mb):
    return token_logprobs_T(model, mb, mask_T=mb.loss_mask_T)


def _loss(output, mb, reducer):
    return reducer(-output["logprobs_T"], mb.loss_mask_T), {}


def _denominator(mb):
    return float(mb.loss_mask_T.sum())


def main(argv: list[str] | None = None) -> dict:
    p = parser("shared_plan", __doc__)
    p.add_argument("--shape", choices=list(SHAPES), default="cpu12m")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--completion-len", type=int, default=256)
    p.add_argument("--min-completion-len", type=int, default=16)
    p.add_argument("--max-tokens-per-mb", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=2, help="timed steps per arm and round (after one warm-up)")
    args = p.parse_args(argv)
    check_rounds_and_lengths(p, args)
    if args.device == "cpu":
        keep_freed_memory()  # as an areno CPU run does
    hf = {**SHAPES[args.shape], "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
    config = ModelConfig.from_hf(hf)
    lengths = completion_lengths(args.completion_len, args.min_completion_len, args.samples)
    batch = make_batch(args.groups, args.samples, args.prompt_len, lengths, config.vocab_size)
    bf16 = args.device == "cuda" or cpu_gemm.prefers_bf16(config.hidden_size)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = init_model_dir(Path(tmp) / "m", config, build_char_tokenizer(), seed=0)
        backend = LocalTrainBackend(
            TrainBackendConfig(
                lr=1e-7,
                device=args.device,
                max_tokens_per_mb=args.max_tokens_per_mb,
                param_dtype="bfloat16" if bf16 else "float32",
            )
        )
        backend.initialize(model_dir)
    shared = prefix_sharing.shared_prompt_tokens(batch.input_ids_T, batch.cu_seqlens_B1, batch.loss_mask_T)
    plans = {
        "rows": backend.plan(batch),
        "tokens": plan_micro_batches(batch.seqlens_B, MicroBatchSpec(max_tokens_per_mb=args.max_tokens_per_mb)),
    }

    def rows(plan) -> int:
        total = 0
        for mb in plan.per_rank[0]:
            sel = batch.select(mb)
            sh = prefix_sharing.plan(sel.input_ids_T, sel.cu_seqlens_B1, sel.loss_mask_T)
            total += sel.num_tokens if sh is None else int(sh.source_C.numel())
        return total

    def step() -> None:
        backend.train_step(batch, forward_fn=_forward, loss_fn=_loss, denominator_fn=_denominator)
        if args.device == "cuda":
            torch.cuda.synchronize()

    times: dict[str, list[float]] = {arm: [] for arm in plans}
    for _ in range(args.rounds):
        for arm, plan in plans.items():
            backend.plan = lambda _batch, plan=plan: plan
            step()
            t0 = time.perf_counter()
            for _ in range(args.reps):
                step()
            times[arm].append((time.perf_counter() - t0) / args.reps)
    med = {arm: statistics.median(t) for arm, t in times.items()}
    lens = str(args.completion_len)
    if args.min_completion_len not in (None, args.completion_len):
        lens = f"{args.min_completion_len}-{lens}"
    details = {
        "shape": args.shape,
        "device": args.device,
        "batch": f"{args.groups} x {args.samples} x ({args.prompt_len} + {lens})",
        "tokens": batch.num_tokens,
        "ideal_rows": batch.num_tokens - sum(shared),
        "arms": {
            arm: {
                "step_s_median": round(med[arm], 4),
                "step_s": [round(t, 4) for t in times[arm]],
                "micro_batches": len(plans[arm].per_rank[0]),
                "micro_batch_tokens": [sum(batch.seqlens_B[i].item() for i in mb) for mb in plans[arm].per_rank[0]],
                "rows": rows(plans[arm]),
            }
            for arm in plans
        },
    }
    head = headline(
        "step_s",
        med["rows"],
        "token plan",
        med["tokens"],
        ratio(med["tokens"], med["rows"]),
        "token plan / rows plan step time (>1: the default faster)",
    )
    return emit("shared_plan", head, details)


if __name__ == "__main__":
    main()
