"""Training-side cost of areno's decoder: forward+backward of packed log-probs on one GPU.

Compares, in one run on a random-init model of Qwen2.5-0.5B's shape (or --tiny on CPU):
- attention paths of ``PackedCausalAttention``: sdpa (per sequence), sdpa_mask (block-diagonal
  mask), flex (document block mask, compiled), varlen (flash varlen);
- the same with each decoder layer ``torch.compile``d (``areno.train.parallelize.apply_compile``; GPU);
- chunked ``packed_logprobs`` against the naive full-logits ``log_softmax`` (peak memory), and
  with the compiled element-wise head kernels (``compiled_logprob_kernels``);
- the baseline: ``transformers`` forward+backward on the same sequences, padded into a batch.

Prints one JSON object. Usage:
    python bench/models_train_step.py                 # GPU, Qwen2.5-0.5B shape, bf16
    python bench/models_train_step.py --tiny --steps 2  # CPU smoke run
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time

import torch

from areno.models import Decoder, PackedCausalAttention, save_model, tiny_config
from areno.models.logprobs import (
    compiled_logprob_kernels,
    logprobs_from_hidden,
    packed_logprobs,
    position_ids_from_cu_seqlens,
)
from areno.train.parallelize import apply_compile

QWEN25_05B = dict(
    hidden_size=896,
    layers=24,
    heads=14,
    kv_heads=2,
    intermediate_size=4864,
    head_dim=64,
    tie_word_embeddings=True,
    rope_theta=1_000_000.0,
    max_position_embeddings=32768,
)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timeit(fn, steps: int, device: str) -> tuple[float, float | None]:
    """(seconds per step, peak GiB) after one warm-up step."""
    fn()
    _sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    _sync(device)
    dt = (time.perf_counter() - t0) / steps
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    return dt, peak


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="small model on CPU (smoke test)")
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--seqlen", type=int, default=1024, help="mean sequence length (lengths vary +-50%)")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()

    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    if args.tiny:
        config = tiny_config(1024, hidden_size=64, layers=2)
        args.seqs, args.seqlen = min(args.seqs, 4), min(args.seqlen, 64)
    else:
        config = tiny_config(151936, arch="qwen2", **QWEN25_05B)
    torch.manual_seed(0)
    model = Decoder(config).to(device=device, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(args.seqlen // 2, args.seqlen * 3 // 2 + 1, (args.seqs,), generator=g)
    cu_B1 = torch.zeros(args.seqs + 1, dtype=torch.long)
    cu_B1[1:] = lens.cumsum(0)
    T = int(cu_B1[-1])
    ids_T = torch.randint(0, config.vocab_size, (T,), generator=g).to(device)
    cu_dev = cu_B1.to(device)
    result: dict = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "params": config.num_params(),
        "tokens": T,
        "seqs": args.seqs,
        "dtype": str(dtype),
    }

    # 1. attention paths, full step (forward + backward of chunked packed log-probs), eager and
    # (GPU) with compiled decoder layers plus the compiled head kernels
    compiled_model = None
    if device == "cuda":
        compiled_model = copy.deepcopy(model)
        apply_compile(compiled_model)
    variants = [(impl, False) for impl in ("sdpa", "sdpa_mask", "flex", "varlen")]
    variants += [(impl, True) for impl in ("flex", "varlen")]
    for impl, compiled in variants:
        if device == "cpu" and (compiled or impl not in ("sdpa", "sdpa_mask")):
            continue

        def step(impl=impl, m=compiled_model if compiled else model, compiled=compiled):
            m.zero_grad(set_to_none=True)
            attn = PackedCausalAttention(cu_dev, impl=impl)
            with compiled_logprob_kernels(compiled):
                hidden = m(ids_T, position_ids_from_cu_seqlens(cu_dev), attn)
                lp, _ = logprobs_from_hidden(hidden[:-1], m.output_weight, ids_T[1:], 1.0, 2048)
            lp.sum().backward()

        # A bench records a failing variant and goes on to the next, rather than losing the run.
        name = f"attn_{impl}" + ("_compiled" if compiled else "")
        try:
            t0 = time.perf_counter()
            dt, peak = _timeit(step, args.steps, device)
            result[name] = {
                "step_s": round(dt, 4),
                "tokens_per_s": round(T / dt),
                "peak_gib": None if peak is None else round(peak, 2),
                "first_plus_timed_s": round(time.perf_counter() - t0, 1),
            }
        except Exception as e:  # noqa: BLE001
            result[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    del compiled_model

    # 2. chunked vs naive log-probs (model forward shared, default attention)
    def chunked():
        model.zero_grad(set_to_none=True)
        lp, _ = packed_logprobs(model, ids_T, cu_dev, chunk_size=2048)
        lp.sum().backward()

    def naive():
        model.zero_grad(set_to_none=True)
        hidden = model(ids_T, position_ids_from_cu_seqlens(cu_dev), PackedCausalAttention(cu_dev))
        logp_TV = torch.log_softmax(model.logits(hidden).float(), -1)
        logp_TV[:-1].gather(-1, ids_T[1:, None]).sum().backward()

    def chunked_fused():
        with compiled_logprob_kernels():
            chunked()

    for name, fn in (
        ("logprobs_chunked", chunked),
        ("logprobs_chunked_fused_head", chunked_fused),
        ("logprobs_naive", naive),
    ):
        if device == "cpu" and fn is chunked_fused:
            continue
        try:
            dt, peak = _timeit(fn, args.steps, device)
            result[name] = {
                "step_s": round(dt, 4),
                "tokens_per_s": round(T / dt),
                "peak_gib": None if peak is None else round(peak, 2),
            }
        except Exception as e:  # noqa: BLE001
            result[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}

    # 3. baseline: transformers on the same sequences, padded (sdpa attention)
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        save_model(model, config, tmp)
        ref = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype, attn_implementation="sdpa").to(device)
    del model
    max_len = int(lens.max())
    batch = torch.full((args.seqs, max_len), 0, dtype=torch.long)
    attn_mask = torch.zeros(args.seqs, max_len, dtype=torch.long)
    for b in range(args.seqs):
        n = int(lens[b])
        batch[b, :n] = ids_T[int(cu_B1[b]) : int(cu_B1[b]) + n].cpu()
        attn_mask[b, :n] = 1
    batch, attn_mask = batch.to(device), attn_mask.to(device)

    def hf_step():
        ref.zero_grad(set_to_none=True)
        logits = ref(input_ids=batch, attention_mask=attn_mask).logits.float()
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch[:, 1:, None])[..., 0]
        (logp * attn_mask[:, 1:]).sum().backward()

    try:
        dt, peak = _timeit(hf_step, args.steps, device)
        result["transformers_padded"] = {
            "step_s": round(dt, 4),
            "tokens_per_s": round(T / dt),
            "peak_gib": None if peak is None else round(peak, 2),
        }
    except Exception as e:  # noqa: BLE001
        result["transformers_padded"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
