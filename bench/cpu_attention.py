"""CPU bfloat16 training attention: ``CpuExplicitAttention`` against the CPU flash kernel in float32.

Two arms on the same model and batch, alternated ``--rounds`` times in one process (a VM whose speed drifts
moves both): ``explicit`` (the default: padded bf16 q/k/v as two bf16 GEMMs around an fp32 softmax, the
scores and dP in fp32) and ``flash`` (``attention.CPU_EXPLICIT_MAX_SCORES = 0``: every padded batch takes the
flash kernel in float32, what areno ran before). Each arm times, per round:
- ``layer_ms``: one attention call's forward + backward at the shape's shared-prompt layout (``--groups``
  groups of ``--samples`` completions of ``--completion-len`` tokens after a ``--prompt-len``-token prompt);
- ``micro_batch_ms``: a training micro-batch's forward + backward through the real stack (bf16 autocast over
  fp32 master weights, ``train.share_prompts``, the LM head on the completion tokens), the same batch.
The headline is the micro-batch's median over the rounds, ``ratio`` = flash / explicit (>1: explicit faster).
Also: the gradient error of each arm's layer against float64.

    python -m bench.cpu_attention                     # cpu12m shape, 3 groups x 7 samples, 5 rounds
    python -m bench.cpu_attention --shape cpu5m --rounds 3
    python -m bench.cpu_attention --shape cpu5m-gemma2   # Gemma 2's soft-capped scores

With Gemma 2's soft-cap, which the flash kernel has not, the ``flash`` arm is what areno ran before the cap
joined the explicit batches: ``explicit_attention`` per query sequence (float32 scores).

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from areno.engine.host import keep_freed_memory
from areno.models import attention
from areno.models.config import ModelConfig
from areno.models.decoder import Decoder
from areno.models.prefix_sharing import SharedPrefixAttention, plan
from areno.specializations.forward import token_logprobs_T
from areno.types import TokenBatch
from bench._common import check_rounds_and_lengths, emit, headline, parser, ratio
from bench.e2e import CPU5M, CPU5M_GEMMA2, CPU12M

SHAPES = {"cpu12m": CPU12M, "cpu5m": CPU5M, "cpu5m-gemma2": CPU5M_GEMMA2}
ARMS = {"explicit": attention.CPU_EXPLICIT_MAX_SCORES, "flash": 0}


def make_batch(
    groups: int, samples: int, prompt_len: int, completion_len: int, vocab: int, min_completion_len: int | None = None
) -> TokenBatch:
    """``groups`` runs of ``samples`` sequences sharing a random prompt, each with its own completion:
    ``completion_len`` tokens, or a length drawn uniformly from [``min_completion_len``, ``completion_len``]."""
    g = torch.Generator().manual_seed(0)
    ids, cu, mask = [], [0], []
    for _ in range(groups):
        prompt = torch.randint(3, vocab, (prompt_len,), generator=g)
        for _ in range(samples):
            n = completion_len
            if min_completion_len is not None:
                n = int(torch.randint(min_completion_len, completion_len + 1, (1,), generator=g))
            ids.append(torch.cat([prompt, torch.randint(3, vocab, (n,), generator=g)]))
            cu.append(cu[-1] + prompt_len + n)
            mask.append(torch.cat([torch.zeros(prompt_len, dtype=torch.bool), torch.ones(n, dtype=torch.bool)]))
    zeros = torch.zeros(cu[-1])
    return TokenBatch(
        input_ids_T=torch.cat(ids),
        cu_seqlens_B1=torch.tensor(cu),
        loss_mask_T=torch.cat(mask),
        logprobs_T=zeros,
        versions_T=zeros.long(),
        advantages_T=zeros,
        rewards_B=torch.zeros(len(ids)),
    )


def layer_inputs(model: Decoder, batch: TokenBatch) -> tuple[SharedPrefixAttention, list[torch.Tensor]]:
    """The shared-prompt attention of ``batch`` and random bf16 q/k/v [rows, heads, head_dim] for it."""
    sharing = plan(batch.input_ids_T, batch.cu_seqlens_B1, batch.loss_mask_T)
    rows = int(sharing.source_C.numel())
    cfg = model.config
    g = torch.Generator().manual_seed(1)
    qkv = [
        torch.randn(rows, h, cfg.head_dim, generator=g).bfloat16().requires_grad_()
        for h in (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_key_value_heads)
    ]
    return _shared_attention(sharing, cfg), qkv


def _shared_attention(sharing, cfg: ModelConfig) -> SharedPrefixAttention:
    """A fresh full-attention layer's shared-prompt attention, with the model's soft-cap."""
    return SharedPrefixAttention(sharing, softcap=cfg.attn_logit_softcapping)


def time_layer(attn: SharedPrefixAttention, qkv: list[torch.Tensor], reps: int) -> float:
    """Median ms of one forward + backward of ``attn`` over ``qkv``."""
    grad = torch.randn(qkv[0].shape, generator=torch.Generator().manual_seed(2)).bfloat16()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        attn(0, *qkv, softcap=attn.softcap).backward(grad)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def layer_error(attn: SharedPrefixAttention, qkv: list[torch.Tensor]) -> float:
    """Largest error of the output and q/k/v gradients against float64, relative to each one's largest value."""
    grad = torch.randn(qkv[0].shape, generator=torch.Generator().manual_seed(2))
    results = []
    for dtype in (torch.bfloat16, torch.float64):
        inputs = [t.detach().to(dtype).requires_grad_() for t in qkv]
        out = attn(0, *inputs, softcap=attn.softcap)
        out.backward(grad.to(dtype))
        results.append([out.detach().double(), *(t.grad.double() for t in inputs)])
    return max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(*results))


def time_micro_batch(model: Decoder, batch: TokenBatch, reps: int) -> float:
    """Median ms of the micro-batch's forward + backward (log-probs of the completion tokens)."""
    times = []
    for _ in range(reps):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = token_logprobs_T(model, batch, mask_T=batch.loss_mask_T)
        out["logprobs_T"].sum().backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def setup(name: str, doc: str, argv: list[str] | None) -> tuple[argparse.Namespace, Decoder, TokenBatch]:
    """The arguments of a CPU micro-batch A/B (``python -m bench.<name>``: shape, groups, samples,
    lengths, rounds, repetitions) and the model (shared prompts on) and batch they describe."""
    p = parser(name, doc)
    p.add_argument("--shape", choices=list(SHAPES), default="cpu12m")
    p.add_argument("--groups", type=int, default=3, help="prompt groups in the micro-batch")
    p.add_argument("--samples", type=int, default=7, help="completions per prompt")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--completion-len", type=int, default=128)
    p.add_argument(
        "--min-completion-len",
        type=int,
        default=None,
        help="completion lengths drawn uniformly from [this, --completion-len] (default: all --completion-len)",
    )
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=2, help="timed repetitions per arm and round (after one warm-up)")
    args = p.parse_args(argv)
    check_rounds_and_lengths(p, args)
    keep_freed_memory()  # as an areno CPU run does: freed temporaries are not returned to the system
    torch.manual_seed(0)
    hf = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **SHAPES[args.shape]}
    model = Decoder(ModelConfig.from_hf(hf))
    model.share_prompts = True
    batch = make_batch(
        args.groups,
        args.samples,
        args.prompt_len,
        args.completion_len,
        model.config.vocab_size,
        args.min_completion_len,
    )
    return args, model, batch


def main(argv: list[str] | None = None) -> dict:
    args, model, batch = setup("cpu_attention", __doc__, argv)
    attn, qkv = layer_inputs(model, batch)
    per_arm: dict[str, dict[str, list[float]]] = {arm: {"layer_ms": [], "micro_batch_ms": []} for arm in ARMS}
    errors = {}

    def use(bound: int) -> None:  # read when a layout is built: a fresh layer's on its first call
        nonlocal attn
        attention.CPU_EXPLICIT_MAX_SCORES = bound
        attn = _shared_attention(attn.sharing, model.config)

    try:
        for _ in range(args.rounds):
            for arm, bound in ARMS.items():
                use(bound)
                time_layer(attn, qkv, 1)
                time_micro_batch(model, batch, 1)  # warm-up of this arm
                per_arm[arm]["layer_ms"].append(time_layer(attn, qkv, args.reps))
                per_arm[arm]["micro_batch_ms"].append(time_micro_batch(model, batch, args.reps))
        for arm, bound in ARMS.items():
            use(bound)
            errors[arm] = layer_error(attn, qkv)
    finally:
        use(ARMS["explicit"])
    med = {arm: {k: statistics.median(v) for k, v in d.items()} for arm, d in per_arm.items()}
    new, old = med["explicit"]["micro_batch_ms"], med["flash"]["micro_batch_ms"]
    head = headline(
        f"ms per training micro-batch forward + backward, {args.shape}, bf16 autocast, shared prompts (median)",
        new,
        "CPU_EXPLICIT_MAX_SCORES = 0 (the CPU flash kernel in float32; per-sequence explicit_attention where the"
        " scores are capped), same run",
        old,
        ratio(old, new),
        "flash ms / explicit ms (>1: explicit faster)",
    )
    details = {
        "shape": args.shape,
        "tokens": batch.num_tokens,
        "layer_ms": {arm: med[arm]["layer_ms"] for arm in ARMS},
        "layer_ratio": round(med["flash"]["layer_ms"] / med["explicit"]["layer_ms"], 3),
        "rounds": per_arm,
        "grad_error_vs_float64": errors,
        "threads": torch.get_num_threads(),
    }
    return emit("cpu_attention", head, details)


if __name__ == "__main__":
    main()
