"""The CPU LM head without entropy: the softmax form (the default) against the log-softmax form.

Two arms on the same model and batch, alternated ``--rounds`` times in one process (a VM whose speed drifts
moves both): ``softmax`` (``logprobs.CPU_SOFTMAX_FORM``: each chunk's fp32 softmax is kept for backward,
which builds the gradient from it, and a target's log-prob is the log of its probability) and
``log_softmax`` (what areno ran before: the log-softmax kept, exponentiated again in backward). Each arm
times, per round:
- ``head_ms``: the chunked head's forward + backward alone (``logprobs_from_hidden``, bf16 autocast over the
  model's fp32 tied weight) over unit-scale hidden states of the micro-batch's completion tokens;
- ``micro_batch_ms``: a training micro-batch's forward + backward through the real stack (as
  ``bench.cpu_attention``: shared prompts, the head on the completion tokens).
The headline is the head's median over the rounds, ``ratio`` = log_softmax / softmax (>1: softmax faster).
Also: each arm's log-prob error against float64.

    python -m bench.cpu_head                     # cpu12m shape, 3 groups x 7 samples, 5 rounds
    python -m bench.cpu_head --shape cpu5m --groups 6 --samples 4 --prompt-len 34

Prints one JSON object.
"""

from __future__ import annotations

import statistics
import time

import torch

from areno.models import logprobs
from bench._common import emit, headline, ratio
from bench.cpu_attention import setup, time_micro_batch

ARMS = {"softmax": True, "log_softmax": False}
CHUNK = logprobs.AUTO_CHUNK_RANGE[0]
"""Tokens per head chunk: a CPU head's automatic chunk (``logprobs.auto_chunk_size``)."""


def time_head(hidden_TD: torch.Tensor, weight_VD: torch.Tensor, targets_T: torch.Tensor, reps: int) -> float:
    """Median ms of the head's forward + backward."""
    times = []
    for _ in range(reps):
        h = hidden_TD.detach().requires_grad_()
        weight_VD.grad = None
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lp_T, _ = logprobs.logprobs_from_hidden(h, weight_VD, targets_T, 1.0, CHUNK)
        lp_T.sum().backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def logprob_error(hidden_TD: torch.Tensor, weight_VD: torch.Tensor, targets_T: torch.Tensor) -> float:
    """Largest absolute log-prob error against float64 (fp32 head, no autocast)."""
    with torch.no_grad():
        lp_T, _ = logprobs.logprobs_from_hidden(hidden_TD, weight_VD.detach(), targets_T, 1.0, CHUNK)
        ref_TV = torch.log_softmax(hidden_TD.double() @ weight_VD.detach().double().t(), -1)
    return float((lp_T.double() - ref_TV.gather(-1, targets_T[:, None])[:, 0]).abs().max())


def main(argv: list[str] | None = None) -> dict:
    args, model, batch = setup("cpu_head", __doc__, argv)
    weight_VD = model.model.embed_tokens.weight  # tied: the head's weight
    targets_T = batch.input_ids_T[batch.loss_mask_T]
    # an RMSNorm's output has unit scale per feature
    hidden_TD = torch.randn(targets_T.numel(), model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    per_arm: dict[str, dict[str, list[float]]] = {arm: {"head_ms": [], "micro_batch_ms": []} for arm in ARMS}
    errors = {}
    try:
        for _ in range(args.rounds):
            for arm, on in ARMS.items():
                logprobs.CPU_SOFTMAX_FORM = on
                time_head(hidden_TD, weight_VD, targets_T, 1)
                time_micro_batch(model, batch, 1)  # warm-up of this arm
                per_arm[arm]["head_ms"].append(time_head(hidden_TD, weight_VD, targets_T, args.reps))
                per_arm[arm]["micro_batch_ms"].append(time_micro_batch(model, batch, args.reps))
        for arm, on in ARMS.items():
            logprobs.CPU_SOFTMAX_FORM = on
            errors[arm] = logprob_error(hidden_TD, weight_VD, targets_T)
    finally:
        logprobs.CPU_SOFTMAX_FORM = ARMS["softmax"]
    med = {arm: {k: statistics.median(v) for k, v in d.items()} for arm, d in per_arm.items()}
    new, old = med["softmax"]["head_ms"], med["log_softmax"]["head_ms"]
    head = headline(
        f"ms per LM head forward + backward, {args.shape}, {targets_T.numel()} tokens, bf16 autocast (median)",
        new,
        "the log-softmax form (CPU_SOFTMAX_FORM = False), same run",
        old,
        ratio(old, new),
        "log_softmax ms / softmax ms (>1: softmax faster)",
    )
    details = {
        "shape": args.shape,
        "tokens": batch.num_tokens,
        "head_tokens": targets_T.numel(),
        "micro_batch_ms": {arm: med[arm]["micro_batch_ms"] for arm in ARMS},
        "micro_batch_ratio": round(med["log_softmax"]["micro_batch_ms"] / med["softmax"]["micro_batch_ms"], 3),
        "rounds": per_arm,
        "logprob_error_vs_float64": errors,
        "threads": torch.get_num_threads(),
    }
    return emit("cpu_head", head, details)


if __name__ == "__main__":
    main()
