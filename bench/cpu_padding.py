"""CPU padded training attention: query sequences in blocks and in padded batches by length (the default)
against whole sequences in one padded batch.

Three arms on the same model and batch, alternated ``--rounds`` times in one process (a VM whose speed drifts
moves them all):
- ``default``: each query sequence cut into blocks of ``attention.QUERY_BLOCK`` rows, each block seeing the keys
  up to its last row (no scores above a causal diagonal block-wise), and the pieces grouped into right-padded
  batches by length (``attention.length_buckets``: where the padding saved is worth an attention call);
- ``whole``: the same batches by length over whole sequences (``QUERY_BLOCK`` beyond any length);
- ``one_batch``: whole sequences, all padded to the longest in one batch (``PAD_CALL_ENTRIES`` beyond any
  saving), what areno ran before both.
Each arm times, per round, ``layer_ms`` (one attention call's forward + backward at the shape's shared-prompt
layout: ``--groups`` groups of ``--samples`` completions after a ``--prompt-len``-token prompt; ``--completion-len``
tokens, or lengths drawn from [``--min-completion-len``, ``--completion-len``]) and ``micro_batch_ms`` (a training
micro-batch's forward + backward through the real stack, as ``bench.cpu_attention``: bf16 autocast, shared
prompts, the head on the completion tokens). The headline is the micro-batch's median over the rounds,
``ratio`` = one_batch / default (>1: the default faster). Also: each arm's padded batches and layer error
against float64.

    python -m bench.cpu_padding                            # cpu12m, 3 groups x 7 x (32 + 128) tokens
    python -m bench.cpu_padding --min-completion-len 16 --completion-len 256
    python -m bench.cpu_padding --shape cpu5m --groups 6 --samples 4 --prompt-len 34

Prints one JSON object.
"""

from __future__ import annotations

import statistics

import torch

from areno.models import attention
from areno.models.prefix_sharing import SharedPrefixAttention
from bench._common import emit, headline, ratio
from bench.cpu_attention import layer_error, layer_inputs, setup, time_layer, time_micro_batch

BEYOND = 1 << 62
ARMS = {
    "default": (attention.QUERY_BLOCK, attention.PAD_CALL_ENTRIES),
    "whole": (BEYOND, attention.PAD_CALL_ENTRIES),
    "one_batch": (BEYOND, BEYOND),
}
"""Per arm: (``attention.QUERY_BLOCK``, ``attention.PAD_CALL_ENTRIES``)."""


def arm_batches(sharing, q_THD: torch.Tensor) -> dict[str, list[list[int]]]:
    """Each arm's padded batches, ``[sequences, query rows, keys]`` each, for the shared-prompt layout
    ``sharing`` and q's rows, heads, head dim and dtype (what ``main`` times), the default settings
    restored after."""
    out = {}
    try:
        for arm, settings in ARMS.items():
            attention.QUERY_BLOCK, attention.PAD_CALL_ENTRIES = settings
            attn = SharedPrefixAttention(sharing)
            T, heads, head_dim = q_THD.shape
            attn.prepare(T, q_THD.device, head_dim, q_THD.dtype, query_heads=heads)
            out[arm] = [[b.num_seqs, b.len_q, b.len_k] for b in attn.padded.buckets]
    finally:
        attention.QUERY_BLOCK, attention.PAD_CALL_ENTRIES = ARMS["default"]
    return out


def main(argv: list[str] | None = None) -> dict:
    args, model, batch = setup("cpu_padding", __doc__, argv)
    attn, qkv = layer_inputs(model, batch)
    per_arm: dict[str, dict[str, list[float]]] = {arm: {"layer_ms": [], "micro_batch_ms": []} for arm in ARMS}
    errors = {}

    def use(
        arm: str,
    ) -> None:  # read when a layout is built: a fresh layer's on its first call, a model's every forward
        nonlocal attn
        attention.QUERY_BLOCK, attention.PAD_CALL_ENTRIES = ARMS[arm]
        attn = SharedPrefixAttention(attn.sharing)

    try:
        for _ in range(args.rounds):
            for arm in ARMS:
                use(arm)
                time_layer(attn, qkv, 1)
                time_micro_batch(model, batch, 1)  # warm-up of this arm
                per_arm[arm]["layer_ms"].append(time_layer(attn, qkv, args.reps))
                per_arm[arm]["micro_batch_ms"].append(time_micro_batch(model, batch, args.reps))
        for arm in ARMS:
            use(arm)
            errors[arm] = layer_error(attn, qkv)
    finally:
        use("default")
    batches = arm_batches(attn.sharing, qkv[0])
    med = {arm: {k: statistics.median(v) for k, v in d.items()} for arm, d in per_arm.items()}
    new, old = med["default"]["micro_batch_ms"], med["one_batch"]["micro_batch_ms"]
    lengths = (
        f"{args.completion_len}"
        if args.min_completion_len is None
        else f"{args.min_completion_len}-{args.completion_len}"
    )
    head = headline(
        f"ms per training micro-batch forward + backward, {args.shape}, {args.groups} x {args.samples} x "
        f"({args.prompt_len} + {lengths}) tokens, bf16 autocast, shared prompts (median)",
        new,
        "whole query sequences in one padded batch (QUERY_BLOCK and PAD_CALL_ENTRIES beyond any length), same run",
        old,
        ratio(old, new),
        "one_batch ms / default ms (>1: the default faster)",
    )
    details = {
        "shape": args.shape,
        "tokens": batch.num_tokens,
        "layer_ms": {arm: med[arm]["layer_ms"] for arm in ARMS},
        "layer_ratio": round(med["one_batch"]["layer_ms"] / med["default"]["layer_ms"], 3),
        "blocks_ratio": {  # whole / default: what the query blocks alone bring
            k: round(med["whole"][k] / med["default"][k], 3) for k in ("layer_ms", "micro_batch_ms")
        },
        "padded_batches": batches,
        "rounds": per_arm,
        "grad_error_vs_float64": errors,
        "threads": torch.get_num_threads(),
    }
    return emit("cpu_padding", head, details)


if __name__ == "__main__":
    main()
