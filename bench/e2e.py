"""End-to-end GRPO step time: areno (colocated, and asynchronous on the same GPU) vs TRL's GRPOTrainer.

One process (TRL's runs on CPU excepted), same hardware, same random-init model directory, same batch:
8 prompts x 8 samples, ``--prompt-len``-token prompts, fixed-length completions of ``--completion-len``
tokens (EOS never ends a sequence: areno through ``ignore_eos`` + ``min_new_tokens`` in a workflow
subclass, TRL through ``generation_kwargs={"min_new_tokens": ...}``), one optimizer step per 64
sequences, small lr. ``--min-completion-len`` (areno systems only): each group's completions spread evenly
from that length to ``--completion-len`` (the same lengths every step), as an RL batch's lengths vary.

Systems:
- ``areno``: the real stack, ``Trainer.init(load_config(None, overrides))`` with the ``grpo`` recipe;
  a step is ``Trainer.rollout_token_batch`` + ``Trainer.train`` + ``backend.update_weights``.
- ``areno_async``: the same with ``rollout.max_head_offpolicyness=1``: the everlasting rollout pool
  (its own thread) keeps generating while the trainer trains, one GPU ("areno async (colocated, one GPU)").
- ``areno_async_turns`` / ``areno_async_overlap``: ``areno_async`` with ``rollout.generate_during_train``
  false (the engine takes turns: it generates only while the trainer waits for a batch; the pool still
  admits η versions ahead) / true (it generates beside the trainer); the default ``auto`` is false on
  CUDA, true on CPU.
- ``trl``: ``trl.GRPOTrainer`` with its default ``transformers`` ``generate`` path (no vLLM); a step is
  one optimizer step (timed between ``on_step_end`` callbacks), which generates the 64 completions
  and trains on them with gradient accumulation. On CPU each TRL run has a fresh Python process of its
  own (``--trl-process``): an areno CPU run sets glibc's malloc options for its whole process, which a
  TRL user's process does not have and which made TRL 1.2-1.3x faster when it ran after areno.

Master weights: ``--param-dtype`` (default bfloat16 on CUDA for both systems: TRL's default loads a
bf16 checkpoint as bf16 parameters; areno ``model.dtype=bfloat16``). The rollout engine runs bf16.
``--param-dtype float32`` runs areno's config default instead (fp32 master weights, bf16 compute under
autocast): the path a default one-GPU run takes.

Physical floor (measured in the same run): generation = sum over the decode steps of (the bytes of the weights a
step cannot skip: all but an untied input embedding, of a sparse layer's routed experts the top k + KV bytes of all
sequences at that step) / copy bandwidth (read + write bytes of a large
device-to-device copy over its time); training = the forward and backward FLOPs a step cannot skip
(the layers over each group's prompt once and every completion token, the output layer over the
completion tokens, causal attention; ``physical_floor``) / bf16 matmul rate (8192^3 GEMMs). Both rates are
the best the machine showed in the run: read before the systems run and again after each shape's, since
a shared VM reads low for seconds at a time (``hardware.*_readings`` lists them). ``gap`` = measured step
time / (generation floor + training floor).

    python -m bench.e2e                                   # CUDA: 0.5b,1.5b x areno,areno_async,trl
    python -m bench.e2e --shapes tiny --device cpu        # CPU smoke (seconds per system)
    python -m bench.e2e --shapes 0.5b --systems areno,trl --steps 3 --warmup 2

Step time = timed wall / timed steps (``step_s_mean``; ``areno_async`` times a multiple of η + 1 steps
(``--async-eta``, default 1), ``--steps`` rounded up; the asynchronous pool generates η + 1 batches
together, so consecutive step times cycle and a median would be misleading); ``step_s`` lists each step.

Prints one JSON object: the headline (the first areno system of the first shape against TRL, same run:
``ratio`` = TRL s/step / areno s/step), then ``rows`` (one per system, shape and round) and ``shapes`` (per
shape, each system's figures and its speedup over TRL). Each row also goes to stderr as it finishes, so a run
cut short still shows what it measured.

Rounds: ``--rounds R`` runs the systems list R times in turn (a system named twice in ``--systems`` counts as
two rounds as well), so TRL and areno alternate and a machine whose speed drifts within the run moves both;
the i-th run of a system is its round i (``round`` in its row). With several rounds each speedup is the
median of the rounds' own ratios (TRL's round i over the system's round i; ``speedup_..._rounds`` lists
them), a system's ``step_s`` the median of its rounds' means, and the headline's ratio that median too.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import random
import statistics
import string
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.profiler import record_function

from areno.api.config import load_config
from areno.api.trainer import Trainer
from areno.data.tokenizer import build_char_tokenizer
from areno.models import cpu_gemm
from areno.models.config import ModelConfig
from areno.models.hf_io import init_model_dir
from areno.observe.profile import profiled_step
from areno.types import SamplingParams
from areno.workflows.rlvr import RLVRWorkflow
from bench._common import (
    GEMMA2_2B,
    GEMMA3_1B,
    OLMO2_1B,
    QWEN25_05B,
    QWEN25_15B,
    emit,
    headline,
    keep_work_dir,
    keys_seen,
    layer_windows,
    parser,
    step_weight_params,
    work_dir,
)

# e2e's configs carry no bos/eos token ids: the completion length stays fixed for both systems
E2E_05B = {k: v for k, v in QWEN25_05B.items() if k not in ("bos_token_id", "eos_token_id")}
E2E_15B = {k: v for k, v in QWEN25_15B.items() if k not in ("bos_token_id", "eos_token_id")}
E2E_OLMO2_1B = {k: v for k, v in OLMO2_1B.items() if k not in ("bos_token_id", "eos_token_id", "pad_token_id")}
E2E_GEMMA3_1B = {k: v for k, v in GEMMA3_1B.items() if k not in ("bos_token_id", "eos_token_id", "pad_token_id")}
E2E_GEMMA2_2B = {k: v for k, v in GEMMA2_2B.items() if k not in ("bos_token_id", "eos_token_id", "pad_token_id")}
TINY = {
    **E2E_05B,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": None,
    "max_position_embeddings": 2048,
}
# the CPU shape of issue #33: a 12.6M-parameter Qwen2 (tied embeddings)
CPU12M = {
    **E2E_05B,
    "hidden_size": 384,
    "intermediate_size": 1024,
    "num_hidden_layers": 6,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "vocab_size": 8192,
    "max_position_embeddings": 2048,
}
# AReaL's CPU example size: about 5M parameters (run it 8 x 4, as that example does)
CPU5M = {**CPU12M, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 4}
# the same size in OLMo 2's layout (q/k norms over the projections, post-block norms)
CPU5M_OLMO2 = {**CPU5M, "architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", "attention_bias": False}
# and in Gemma 3's (norms around each block, GeGLU, a 64-token window in three layers of four at their own base)
CPU5M_GEMMA3 = {
    **{k: v for k, v in CPU5M.items() if k != "hidden_act"},
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "head_dim": 64,
    "query_pre_attn_scalar": 64,
    "hidden_activation": "gelu_pytorch_tanh",
    "sliding_window": 64,
    "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "tie_word_embeddings": True,
}
# and in Gemma 2's (Gemma 3's block without q/k norms, a 64-token window in every other layer, one RoPE base,
# attention scores soft-capped at 50 and logits at 30 as the released models)
CPU5M_GEMMA2 = {
    **{k: v for k, v in CPU5M_GEMMA3.items() if k not in ("rope_local_base_freq", "rope_theta")},
    "architectures": ["Gemma2ForCausalLM"],
    "model_type": "gemma2",
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
}
# and in GLM-4's (half of each head turned by adjacent pairs, norms around each block, q/k/v biases)
CPU5M_GLM4 = {
    **CPU5M,
    "architectures": ["Glm4ForCausalLM"],
    "model_type": "glm4",
    "head_dim": 64,
    "partial_rotary_factor": 0.5,
    "attention_bias": True,
}
# and in Granite 3's (Llama's layers; granite-3.x-2b's multipliers: embeddings x 12, the softmax scale 1/64,
# block outputs x 0.22 before each residual add, logits / 8)
CPU5M_GRANITE = {
    **CPU5M,
    "architectures": ["GraniteForCausalLM"],
    "model_type": "granite",
    "head_dim": 64,
    "attention_bias": False,
    "embedding_multiplier": 12.0,
    "attention_multiplier": 0.015625,
    "residual_multiplier": 0.22,
    "logits_scaling": 8.0,
}
# and in Ernie 4.5's (whole heads turned by adjacent pairs in float32; no biases and tied embeddings, as its 0.3B)
CPU5M_ERNIE45 = {
    **CPU5M,
    "architectures": ["Ernie4_5ForCausalLM"],
    "model_type": "ernie4_5",
    "head_dim": 64,
    "use_bias": False,
    "tie_word_embeddings": True,
}
# and in EXAONE 4's (per-head q/k norms, norms after each block, a 64-token window in three layers of four, the
# fourth in full without RoPE)
CPU5M_EXAONE4 = {
    **CPU5M,
    "architectures": ["Exaone4ForCausalLM"],
    "model_type": "exaone4",
    "head_dim": 64,
    "sliding_window": 64,
    "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
}
# and in GLM-4.5's (a dense first layer, then 8 experts of 80 and a shared one: about the dense MLP's size; a sigmoid
# router choosing 2 from the best 2 of 4 groups, scaled by 2.5 as the released models; per-head q/k norms, q/k/v
# biases, half of each head turned by rotate-half RoPE)
CPU5M_GLM4_MOE = {
    **CPU5M,
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "head_dim": 64,
    "partial_rotary_factor": 0.5,
    "attention_bias": True,
    "use_qk_norm": True,
    "first_k_dense_replace": 1,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "moe_intermediate_size": 80,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
}
# and in Qwen2-MoE's (Qwen1.5-MoE-A2.7B's proportions: every layer sparse, top-2 of 8 experts not renormalised, a
# gated shared expert four experts wide; q/k/v biases): each layer's MLP parameters as CPU5M's dense MLP
CPU5M_QWEN2MOE = {
    **CPU5M,
    "architectures": ["Qwen2MoeForCausalLM"],
    "model_type": "qwen2_moe",
    "head_dim": 64,
    "qkv_bias": True,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 256,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": False,
    "use_sliding_window": False,
}
# and in Granite 3 MoE's (cpu5m-granite's multipliers; every layer's MLP as 8 experts a quarter of its width,
# 2 a token: the dense MLP's parameters, a quarter of them active, as granite-3.0-1b-a400m's 8 of 32)
CPU5M_GRANITEMOE = {
    **CPU5M_GRANITE,
    "architectures": ["GraniteMoeForCausalLM"],
    "model_type": "granitemoe",
    "intermediate_size": 96,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
}
# and in OLMoE's (q/k norms over the whole projections, pre-block norms; in place of each dense MLP 8 experts a
# ninth of its width apiece, top 2 not renormalised: the same parameter count, a quarter of the MLP's active a token)
CPU5M_OLMOE = {
    **CPU5M,
    "architectures": ["OlmoeForCausalLM"],
    "model_type": "olmoe",
    "head_dim": 64,
    "intermediate_size": 96,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": False,
    "attention_bias": False,
    "clip_qkv": None,
}
# and in Phi-4-mini's (three quarters of each head turned, by LongRoPE's short factors within 4,096 positions)
_SHORT = [1.0 + 0.05 * i for i in range(24)]
CPU5M_PHI4_MINI = {
    **CPU5M,
    "architectures": ["Phi3ForCausalLM"],
    "model_type": "phi3",
    "head_dim": 64,
    "partial_rotary_factor": 0.75,
    "rope_scaling": {"rope_type": "longrope", "short_factor": _SHORT, "long_factor": [2 * x for x in _SHORT]},
    "original_max_position_embeddings": 4096,
    "max_position_embeddings": 16384,
    "sliding_window": None,
}
# shape -> (HF config dict, default prompt length, default completion length)
SHAPES = {
    "0.5b": (E2E_05B, 64, 512),
    "1.5b": (E2E_15B, 64, 512),
    "olmo2-1b": (E2E_OLMO2_1B, 64, 512),
    "gemma3-1b": (E2E_GEMMA3_1B, 64, 512),
    "gemma2-2b": (E2E_GEMMA2_2B, 64, 512),
    "tiny": (TINY, 16, 32),
    "cpu12m": (CPU12M, 32, 128),
    "cpu5m": (CPU5M, 34, 128),
    "cpu5m-olmo2": (CPU5M_OLMO2, 34, 128),
    "cpu5m-gemma3": (CPU5M_GEMMA3, 34, 128),
    "cpu5m-gemma2": (CPU5M_GEMMA2, 34, 128),
    "cpu5m-glm4": (CPU5M_GLM4, 34, 128),
    "cpu5m-granite": (CPU5M_GRANITE, 34, 128),
    "cpu5m-phi4mini": (CPU5M_PHI4_MINI, 34, 128),
    "cpu5m-ernie45": (CPU5M_ERNIE45, 34, 128),
    "cpu5m-exaone4": (CPU5M_EXAONE4, 34, 128),
    "cpu5m-glm4moe": (CPU5M_GLM4_MOE, 34, 128),
    "cpu5m-qwen2moe": (CPU5M_QWEN2MOE, 34, 128),
    "cpu5m-granitemoe": (CPU5M_GRANITEMOE, 34, 128),
    "cpu5m-olmoe": (CPU5M_OLMOE, 34, 128),
}
SYSTEMS = (
    "areno",
    "areno_async",
    "areno_async_turns",
    "areno_async_overlap",
    "areno_vllm",
    "trl",
)
SYSTEM_OVERRIDES = {
    "areno_async_turns": ["rollout.generate_during_train=false"],
    "areno_async_overlap": ["rollout.generate_during_train=true"],
}
LABELS = {
    "areno": "areno (colocated)",
    "areno_vllm": "areno + a vLLM server (policy by disk export)",
    "areno_async": "areno async (colocated, one GPU)",
    "areno_async_turns": "areno async (colocated, one GPU, taking turns with the trainer)",
    "areno_async_overlap": "areno async (colocated, one GPU, engine generating while training)",
    "trl": "TRL GRPOTrainer (transformers generate)",
}
PROMPT_ALPHABET = string.ascii_letters + string.digits


# ----------------------------------------------------------------------------- reward and workflow
VOWELS = "aeiouAEIOU"


def reward(prompt: str, completion: str, answer=None, **fields) -> float:
    """Cheap deterministic reward: fraction of the completion's characters that are vowels. Counted
    by ``str.count``: a random-init model's 512 tokens decode to ~6,800 characters here, and a
    per-character Python loop over 64 of them took ~40 ms of each step, in both systems."""
    if not completion:
        return 0.0
    return sum(map(completion.count, VOWELS)) / len(completion)


def trl_reward(prompts, completions, **kwargs) -> list[float]:
    """The same reward in TRL's reward-function signature."""
    return [reward(p, c) for p, c in zip(prompts, completions)]


def completion_lengths(completion_len: int, min_completion_len: int | None, samples: int) -> list[int]:
    """Each sample's completion length in a group: ``completion_len``, or spread evenly from
    ``min_completion_len`` to ``completion_len`` over the group's samples."""
    if min_completion_len is None or samples == 1:
        return [completion_len] * samples
    span = completion_len - min_completion_len
    return [min_completion_len + round(i * span / (samples - 1)) for i in range(samples)]


class FixedLengthWorkflow(RLVRWorkflow):
    """RLVR whose completions are exactly ``max_new_tokens`` long (EOS ignored, min_new_tokens = max); with
    ``min_completion_len``, sample i of a group is exactly ``completion_lengths(...)[i]`` long instead (the same
    lengths in every group and step)."""

    def __init__(self, *args, min_completion_len: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        sp = self.sampling_params
        self.sampling_params = dataclasses.replace(sp, ignore_eos=True, min_new_tokens=sp.max_new_tokens)
        self.lengths = completion_lengths(sp.max_new_tokens, min_completion_len, self.n_samples)

    def token_params(self, i: int) -> SamplingParams:
        n = self.lengths[i % len(self.lengths)]
        return dataclasses.replace(super().token_params(i), max_new_tokens=n, min_new_tokens=n)


# ----------------------------------------------------------------------------- setup
def build_tokenizer(vocab_size: int | None):
    """Char tokenizer padded with unused tokens to ``vocab_size`` (None: unpadded)."""
    base = len(build_char_tokenizer())
    if vocab_size is not None and vocab_size < base:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the char tokenizer ({base} tokens)")
    return build_char_tokenizer(vocab_padding=0 if vocab_size is None else vocab_size - base)


def make_prompts(tokenizer, num: int, prompt_len: int, seed: int = 0) -> list[str]:
    """``num`` random alphanumeric prompts, each exactly ``prompt_len`` tokens under ``tokenizer``."""
    rng = random.Random(seed)
    prompts = ["".join(rng.choice(PROMPT_ALPHABET) for _ in range(prompt_len)) for _ in range(num)]
    for p in prompts[:4]:
        n = len(tokenizer(p)["input_ids"])
        if n != prompt_len:
            raise ValueError(f"prompt tokenizes to {n} tokens, expected {prompt_len}: check the tokenizer")
    return prompts


def make_model_dir(shape: str, workdir: Path):
    """Random-init checkpoint of ``shape`` (with its tokenizer) under ``workdir``; returns (dir, ModelConfig)."""
    hf, _, _ = SHAPES[shape]
    tok = build_tokenizer(hf["vocab_size"])
    hf = {
        **hf,
        "vocab_size": len(tok),
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }
    config = ModelConfig.from_hf(hf)
    return init_model_dir(workdir / shape, config, tok, seed=0), config, tok


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def default_param_dtype(args) -> str:
    """``--param-dtype``, else the benches' master weights: bfloat16 on CUDA, float32 elsewhere."""
    return args.param_dtype or ("bfloat16" if args.device == "cuda" else "float32")


def alloc_retries(device: str) -> int:
    """CUDA: how often the caching allocator has freed its cache to retry an allocation (0 elsewhere)."""
    return torch.cuda.memory_stats().get("num_alloc_retries", 0) if device == "cuda" else 0


def peak_gib(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None


# ----------------------------------------------------------------------------- the physical floor
def measure_copy_bandwidth(device: str) -> float:
    """Bytes/s of a large device copy, counting bytes read + written."""
    n = (1 << 30) if device == "cuda" else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    reps = 20 if device == "cuda" else 5
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    seconds = time.perf_counter() - t0
    del src, dst
    return 2 * n * reps / seconds


MIN_TRIAL_S = 0.2
"""Seconds of one timed trial of ``measure_matmul_rate`` on CPU."""


def measure_matmul_rate(device: str, dtype: torch.dtype = torch.bfloat16, trials: int = 5) -> float:
    """FLOP/s of square GEMMs in ``dtype``: 8192^3 on CUDA, 512^3 on CPU; the best of ``trials``
    timed runs (each at least ``MIN_TRIAL_S`` on CPU), so that a moment of contention on a shared
    VM does not lower the floor (five GEMMs timed once, 7 ms in all, gave floors 25-95% apart)."""
    n = 8192 if device == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    reps = 20
    if device != "cuda":  # enough GEMMs for a trial of MIN_TRIAL_S at the first reading's rate
        t0 = time.perf_counter()
        a @ b
        reps = max(reps, int(MIN_TRIAL_S / max(time.perf_counter() - t0, 1e-6)))
    best = 0.0
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        sync(device)
        best = max(best, 2 * n**3 * reps / (time.perf_counter() - t0))
    del a, b
    return best


def physical_floor(
    config,
    num_seqs: int,
    prompt_len: int,
    completion_len: int,
    rollout_elt: int,
    copy_bw: float,
    matmul_rate: float,
    lengths: list[int] | None = None,
    group_size: int = 1,
) -> dict:
    """Lower bounds of one step's seconds: decode (bandwidth-bound) and training (compute-bound).
    ``lengths``: each sequence's completion length (default: all ``completion_len``); decode step i reads
    the weights (``step_weight_params``: of a sparse layer's routed experts the top k, which rows that all pick
    the same experts read; not an untied input embedding, a lookup) and the KV cache of the sequences still
    generating. Training: forward and backward (6
    FLOPs a weight a token; of a sparse layer's experts, the top k) of the work a step cannot skip: the decoder's
    layers over each group's prompt
    once (``group_size`` sequences share it) and every completion token, the output layer over the
    completion tokens (the only ones with a loss), and causal attention's two products (12 FLOPs a head
    dimension a query a key) over the keys each of those tokens sees (in a sliding layer, its window)."""
    lengths = lengths if lengths is not None else [completion_len] * num_seqs
    params = config.num_params()
    # the weights a step reads (and a token multiplies by): not an untied input embedding (a lookup); of a sparse
    # layer's routed experts, the top k (a decode step's rows may all pick the same k; a token reaches k)
    reached = step_weight_params(config)
    weight_bytes = reached * rollout_elt
    windows = layer_windows(config)
    kv_bytes_per_key = 2 * config.num_key_value_heads * config.head_dim * rollout_elt  # a key's K and V, one layer
    gen_bytes = sum(
        weight_bytes
        + sum(n > i for n in lengths) * keys_seen(windows, prompt_len + i + 1, cached=True) * kv_bytes_per_key
        for i in range(max(lengths))
    )
    groups = -(-len(lengths) // group_size)
    completion_tokens = sum(lengths)
    head = config.hidden_size * config.vocab_size
    layer_params = reached - head
    layer_flops = 6 * layer_params * (groups * prompt_len + completion_tokens)
    head_flops = 6 * head * completion_tokens
    keys = groups * sum(keys_seen(windows, p) for p in range(1, prompt_len + 1)) + sum(
        keys_seen(windows, prompt_len + i + 1) for n in lengths for i in range(n)
    )
    attention_flops = 12 * config.num_attention_heads * config.head_dim * keys
    gen_s = gen_bytes / copy_bw
    train_s = (layer_flops + head_flops + attention_flops) / matmul_rate
    return {"params": params, "gen_floor_s": gen_s, "train_floor_s": train_s, "floor_s": gen_s + train_s}


# ----------------------------------------------------------------------------- areno
def timed_steps(args, eta: int) -> int:
    """Timed steps of an areno run: ``--steps``, rounded up to a multiple of η + 1 when asynchronous,
    whose steps cycle between ones that find their batch ready and one that waits for the next
    η + 1 batches generated together (a mean over a partial cycle would over- or under-count one kind)."""
    return args.steps + (-args.steps) % (eta + 1)


def areno_config(*args, **kwargs):
    """The run's config: ``load_config`` over ``areno_overrides``."""
    return load_config(None, areno_overrides(*args, **kwargs))


def areno_overrides(
    args,
    model_dir: Path,
    data_path: Path,
    run_dir: Path,
    *,
    eta: int,
    param_dtype: str,
    prompt_len: int,
    completion_len: int,
    server: str | None = None,
) -> list[str]:
    """The run's ``key=value`` overrides (what ``areno train`` takes on its command line). ``server``: vllm
    to generate with a vLLM server areno starts (``rollout.backend``)."""
    seq_blocks = math.ceil((prompt_len + completion_len + 16) / 16)
    kv_blocks = seq_blocks * args.prompts * args.samples * (eta + 1) + 64  # the batch (and η batches ahead)
    overrides = [
        f"run_dir={run_dir}",
        "overwrite=true",  # each measurement starts over, also in a reused --workdir
        f"model.path={model_dir}",
        f"model.dtype={param_dtype}",
        "data.task=null",
        f"data.train_path={data_path}",
        "data.num_eval=0",
        "reward.fn=bench.e2e:reward",  # in the reward sandbox, a user reward's default (`--areno-set
        # reward.sandbox=false` scores in process, as TRL does)
        "rollout.workflow=bench.e2e:FixedLengthWorkflow",
        *([f"rollout.workflow_kwargs.min_completion_len={args.min_completion_len}"] if args.min_completion_len else []),
        f"rollout.batch_size={args.prompts}",
        f"rollout.n_samples={args.samples}",
        f"rollout.max_new_tokens={completion_len}",
        f"rollout.max_head_offpolicyness={eta}",
        "train.algorithm=grpo",
        f"train.max_tokens_per_mb={args.areno_mb_tokens or 'null'}",
        f"train.steps={args.warmup + timed_steps(args, eta)}",
        "train.eval_interval=0",
        "train.save_interval=0",
        f"optim.lr={args.lr}",
        f"cluster.device={args.device}",
        "observe.console=false",
    ]
    if server is not None:  # vLLM's CPU attention needs head sizes >= 32 (the 0.5b and 1.5b shapes)
        overrides += [f"rollout.backend={server}", "rollout.server_args=[--enforce-eager]"]
    else:  # areno's own engine (a server refuses its settings)
        overrides += [
            f"rollout.decode_steps={args.decode_steps}",
            f"rollout.decode_attention={args.decode_attention}",
            f"rollout.fused_kernels={str(args.fused_kernels).lower()}",
            # the one setting away from areno's defaults: a pool of the batch's need (and η batches ahead), where
            # the automatic one sizes itself from the free memory of the machine at hand
            f"rollout.kv_blocks={kv_blocks}",
        ]
    return overrides + args.areno_set + (args.areno_async_set if eta > 0 else [])


def run_areno(
    args,
    shape: str,
    model_dir: Path,
    data_path: Path,
    workdir: Path,
    *,
    eta: int,
    param_dtype: str,
    prompt_len: int,
    completion_len: int,
    server: str | None = None,
    extra: list[str] = (),
) -> dict:
    """``extra``: more overrides of this system's run (``SYSTEM_OVERRIDES``)."""
    run_dir = workdir / f"run-{shape}-eta{eta}{'-' + server if server else ''}"
    overrides = areno_overrides(
        args,
        model_dir,
        data_path,
        run_dir,
        eta=eta,
        param_dtype=param_dtype,
        prompt_len=prompt_len,
        completion_len=completion_len,
        server=server,
    )
    config = load_config(None, [*overrides, *extra])
    free_memory(args.device)
    t_setup = time.perf_counter()
    trainer = Trainer.init(config)
    setup_s = time.perf_counter() - t_setup
    steps, phases, lengths, num_tokens, system, mbs = [], [], [], [], {}, []
    retries_before = alloc_retries(args.device)
    try:
        sync(args.device)
        last = time.perf_counter()
        engine_before = None
        for rollout_id in range(args.warmup + timed_steps(args, eta)):
            if rollout_id == args.warmup:
                engine_before = engine_counters(trainer)
            with profiled_step(run_dir, rollout_id, args.profile_steps):
                # the phases are named ranges in a profile's trace (--profile-steps)
                t0 = time.perf_counter()
                with record_function("e2e/rollout"):
                    rollout = trainer.rollout_token_batch(rollout_id)
                    sync(args.device)
                t1 = time.perf_counter()
                with record_function("e2e/train"):
                    train_metrics = trainer.train(rollout_id, rollout)
                    sync(args.device)
                t2 = time.perf_counter()
                with record_function("e2e/sync"):
                    trainer.backend.update_weights()
                    sync(args.device)
                t3 = time.perf_counter()
            steps.append(t3 - last)  # between consecutive step ends: nothing outside the loop is missed
            # a profiled step writes its trace after t3: the next step starts after that, not at t3
            last = time.perf_counter() if rollout_id in args.profile_steps else t3
            phases.append((t1 - t0, t2 - t1, t3 - t2))
            lengths.extend(len(t.completion_ids) for t in rollout.trajectories)
            num_tokens.append(rollout.batch.num_tokens)
            mbs.extend(v for k, v in train_metrics.items() if k.endswith("/mbs"))
            for key, value in {**rollout.metrics, **train_metrics}.items():  # per phase (engine/residency.py)
                if key.startswith("system/"):
                    system.setdefault(key[len("system/") :], []).append(value)
        engine_after = engine_counters(trainer)
        phase_peaks = {
            k[: -len("_peak_memory_gib")]: max(v) for k, v in system.items() if k.endswith("_peak_memory_gib")
        }
        # the engine resets the peak statistics at each phase: the run's peak is the largest phase's
        peak = max([peak_gib(args.device) or 0.0, *phase_peaks.values()]) if args.device == "cuda" else None
    finally:
        trainer.shutdown()
    timed = slice(args.warmup, None)
    engine = {k: engine_after[k] - engine_before[k] for k in ENGINE_COUNTERS} if engine_after else None
    expected = set(completion_lengths(completion_len, args.min_completion_len, args.samples))
    if set(lengths) != expected:
        raise RuntimeError(f"areno completions had lengths {sorted(set(lengths))}, not {sorted(expected)}")
    return {
        "step_s": steps[timed],
        "phases_s": {
            name: statistics.median(p[i] for p in phases[timed]) for i, name in enumerate(("rollout", "train", "sync"))
        },
        # each timed step's (rollout, train, sync) seconds: an asynchronous run's steps differ by phase
        "phases_per_step_s": [[round(x, 4) for x in p] for p in phases[timed]],
        "tokens_per_step": statistics.median(num_tokens[timed]),
        "peak_gib": peak,
        "phase_peaks_gib": phase_peaks,
        "system_medians": {k: statistics.median(v) for k, v in system.items() if not k.endswith("peak_memory_gib")},
        "setup_s": setup_s,
        # the untimed warm-up: the first training phase includes compiling (train.compile, cold or warm cache)
        "warmup_step_s": steps[: args.warmup],
        "first_train_s": phases[0][1],
        # the caching allocator's retries (a cudaFree of its whole cache each): memory pressure slows a phase
        "alloc_retries": alloc_retries(args.device) - retries_before,
        "micro_batches": statistics.median(mbs) if mbs else None,
        # the in-process engine over the timed steps: decode steps, busy seconds, steps run eagerly
        "engine": engine,
        "rollout_engine_idle_s": rollout_engine_idle_s(phases[timed], engine, eta),
    }


def rollout_engine_idle_s(phases: list[tuple[float, float, float]], engine: dict | None, eta: int) -> float | None:
    """Seconds per step of the rollout phase in which the in-process engine ran no step: the host work
    around generation (prompts, rewards, packing). Synchronous runs only (an asynchronous engine also
    runs during training); None without an in-process engine."""
    if engine is None or eta > 0 or not phases:
        return None
    return (sum(p[0] for p in phases) - engine["busy_s"]) / len(phases)


ENGINE_COUNTERS = (
    "steps",
    "busy_s",
    "sampling_round_trips",
    "generated_tokens",
    "mixed_steps",
    "cuda_graph_deferred_steps",
    "cuda_graphs_captured",
)


def engine_counters(trainer) -> dict | None:
    """The in-process rollout engine's counters (``RolloutEngine.stats``); None for server backends."""
    engine = getattr(trainer.backend.engine.rollout, "engine", None)
    if engine is None or not hasattr(engine, "stats"):
        return None
    stats = engine.stats()
    return {k: stats[k] for k in ENGINE_COUNTERS}


# ----------------------------------------------------------------------------- TRL
def run_trl(
    args,
    shape: str,
    model_dir: Path,
    prompts: list[str],
    tokenizer,
    workdir: Path,
    *,
    param_dtype: str,
    completion_len: int,
) -> dict:
    from datasets import Dataset
    from transformers import PrinterCallback, ProgressCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    num_seqs = args.prompts * args.samples
    mb = min(args.trl_micro_batch, num_seqs)
    if num_seqs % mb:
        raise ValueError(f"--trl-micro-batch {mb} must divide {num_seqs} sequences per step")
    cuda = args.device == "cuda"

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []
            self.start: float | None = None

        def on_step_begin(self, a, state, control, **kw):
            if self.start is None:
                sync(args.device)
                self.start = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            sync(args.device)
            self.ends.append(time.perf_counter())

    cfg = GRPOConfig(
        output_dir=str(workdir / f"trl-{shape}"),
        per_device_train_batch_size=mb,
        gradient_accumulation_steps=num_seqs // mb,  # one optimizer step = prompts x samples sequences
        num_generations=args.samples,
        max_completion_length=completion_len,
        generation_kwargs={"min_new_tokens": completion_len},  # fixed length: EOS suppressed until the max
        temperature=1.0,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        max_steps=args.warmup + args.steps,
        bf16=cuda,
        use_cpu=not cuda,
        model_init_kwargs={"dtype": getattr(torch, param_dtype)},
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
        gradient_checkpointing=args.trl_gradient_checkpointing == "on",
    )
    free_memory(args.device)
    timer = StepTimer()
    t_setup = time.perf_counter()
    trainer = GRPOTrainer(
        model=str(model_dir),
        reward_funcs=trl_reward,
        args=cfg,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
        callbacks=[timer],
    )
    setup_s = time.perf_counter() - t_setup
    hf_config = trainer.model.config
    if not hasattr(hf_config, "num_experts") and hasattr(hf_config, "num_local_experts"):
        # TRL's balance loss reads config.num_experts, which GraniteMoe's config names num_local_experts: the same
        # count under the name TRL reads, so that its loss is computed as its other expert models' are
        hf_config.num_experts = hf_config.num_local_experts
    for cb in (PrinterCallback, ProgressCallback):  # stdout carries only this script's JSON lines
        trainer.remove_callback(cb)
    trainer.train()
    peak = peak_gib(args.device)
    logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    mean_lengths = [h["completions/mean_length"] for h in logs]
    trl_step_time = [h["step_time"] for h in logs if "step_time" in h]
    del trainer
    free_memory(args.device)
    ends = [timer.start, *timer.ends]
    steps = [b - a for a, b in zip(ends, ends[1:])]
    if mean_lengths and any(abs(m - completion_len) > 1e-6 for m in mean_lengths):
        raise RuntimeError(f"TRL completions were not fixed-length: mean lengths {mean_lengths}")
    return {
        "step_s": steps[args.warmup :],
        "peak_gib": peak,
        "trl_logged_step_time_s": trl_step_time[args.warmup :],
        "trl_gradient_checkpointing": cfg.gradient_checkpointing,
        "setup_s": setup_s,
        "tokens_per_step": num_seqs * (len(tokenizer(prompts[0])["input_ids"]) + completion_len),
    }


def run_trl_fresh(args, shape: str, model_dir: Path, prompts: list[str], workdir: Path, **kwargs) -> dict:
    """``run_trl`` in a new Python process (``--trl-child``): TRL as its users run it. An areno CPU run
    sets glibc's malloc options for its whole process (``cluster.cpu_keep_freed_memory``), and TRL
    measured after it in the same process ran 1.2-1.3x faster than under glibc's defaults (bench/LOG.md)."""
    spec = workdir / f"trl-child-{shape}.json"
    out = workdir / f"trl-child-{shape}-result.json"
    out.unlink(missing_ok=True)
    spec.write_text(
        json.dumps(
            {
                "args": vars(args),
                "shape": shape,
                "model_dir": str(model_dir),
                "prompts": prompts,
                "workdir": str(workdir),
                **kwargs,
            }
        )
    )
    cmd = [sys.executable, "-m", "bench.e2e", "--trl-child", str(spec), str(out)]
    # the child's stdout goes to this process's stderr: stdout carries only this script's JSON
    try:
        to = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a stderr without a file (pytest's capture): relayed after
        to = subprocess.PIPE
    proc = subprocess.run(
        cmd,
        stdout=to,
        stderr=subprocess.STDOUT if to == subprocess.PIPE else None,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    if proc.stdout:
        sys.stderr.write(proc.stdout)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"the TRL process ({' '.join(cmd)}) exited with {proc.returncode}")
    return json.loads(out.read_text())


def trl_child(spec_path: str, out_path: str) -> int:
    """The ``--trl-child`` process: ``run_trl`` as ``run_trl_fresh``'s spec says, its result to ``out_path``."""
    spec = json.loads(Path(spec_path).read_text())
    args = argparse.Namespace(**spec["args"])
    shape = spec["shape"]
    workdir = Path(spec["workdir"])
    tokenizer = build_tokenizer(SHAPES[shape][0]["vocab_size"])
    res = run_trl(
        args,
        shape,
        Path(spec["model_dir"]),
        spec["prompts"],
        tokenizer,
        workdir,
        param_dtype=spec["param_dtype"],
        completion_len=spec["completion_len"],
    )
    Path(out_path).write_text(json.dumps(res))
    return 0


def trl_in_fresh_process(args) -> bool:
    """``--trl-process``: auto runs TRL in a fresh process on CPU (where areno changes the process's malloc)."""
    return args.trl_process == "fresh" or (args.trl_process == "auto" and args.device != "cuda")


# ----------------------------------------------------------------------------- driver
def report(system: str, shape: str, res: dict, floor: dict, gen_tokens: int) -> dict:
    """One system's row; ``gen_tokens``: completion tokens a step."""
    # The mean (timed wall / timed steps) is the headline: with the asynchronous pool, steps whose
    # batch was generated during the previous step return at once and the next one waits, so a
    # median of a few steps would report the fast half only.
    mean = statistics.fmean(res["step_s"])
    out = {
        "system": system,
        "label": LABELS[system],
        "shape": shape,
        "step_s_mean": mean,
        "step_s_median": statistics.median(res["step_s"]),
        "step_s": res["step_s"],
        "gen_tokens_per_s": gen_tokens / mean,
        "total_tokens_per_s": res["tokens_per_step"] / mean,
        "peak_gpu_gib": res["peak_gib"],
        "floor_s": floor["floor_s"],
        "gen_floor_s": floor["gen_floor_s"],
        "train_floor_s": floor["train_floor_s"],
        "gap_to_floor": mean / floor["floor_s"],
    }
    if "phases_s" in res:
        out["phases_s_median"] = res["phases_s"]
        out["phases_per_step_s"] = res["phases_per_step_s"]
    if res.get("phase_peaks_gib"):
        out["phase_peak_gpu_gib"] = res["phase_peaks_gib"]
    keys = (
        "setup_s",
        "warmup_step_s",
        "first_train_s",
        "alloc_retries",
        "micro_batches",
        "engine",
        "rollout_engine_idle_s",
    )
    for key in (*keys, "trl_logged_step_time_s", "trl_gradient_checkpointing"):
        if key in res:
            out[key] = res[key]
    return out


def build_parser() -> argparse.ArgumentParser:
    p = parser("e2e", __doc__)
    p.add_argument(
        "--shapes",
        default=None,
        help=f"comma list of {','.join(SHAPES)} (default: 0.5b,1.5b on CUDA, tiny on CPU)",
    )
    p.add_argument("--systems", default="areno,areno_async,trl", help=f"comma list of {','.join(SYSTEMS)}")
    p.add_argument("--steps", type=int, default=3, help="timed steps per system")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the systems list this many times in turn; speedups are the median of the rounds' ratios",
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed warm-up steps per system")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--samples", type=int, default=8, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default: 64; tiny 16)")
    p.add_argument("--completion-len", type=int, default=None, help="completion tokens (default: 512; tiny 32)")
    p.add_argument(
        "--min-completion-len",
        type=int,
        default=None,
        help="areno systems only: a group's completions spread evenly from this length to --completion-len "
        "(TRL's stay fixed-length)",
    )
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument(
        "--decode-steps", type=int, default=0, help="areno: decode steps per host round trip (0 = engine default)"
    )
    p.add_argument(
        "--decode-attention",
        choices=("auto", "gather", "paged"),
        default="auto",
        help="areno: rollout.decode_attention (auto: paged on CUDA; gather: SDPA over a dense K/V copy; paged: the Triton kernel)",
    )
    p.add_argument(
        "--fused-kernels",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="areno: rollout.fused_kernels (fused RMSNorm/RoPE/SiLU-mul Triton kernels, CUDA)",
    )
    p.add_argument(
        "--param-dtype", default=None, help="master weights of both systems (default: bfloat16 on CUDA, float32 on CPU)"
    )
    p.add_argument("--trl-micro-batch", type=int, default=16, help="TRL per_device_train_batch_size")
    p.add_argument(
        "--trl-process",
        choices=("auto", "fresh", "same"),
        default="auto",
        help="where TRL runs: a fresh Python process per run (auto on CPU: areno's CPU runs set glibc's "
        "malloc options for their process, which TRL's users do not have) or this one (auto on CUDA)",
    )
    p.add_argument("--trl-child", nargs=2, default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--areno-mb-tokens",
        type=int,
        default=None,
        help="areno train.max_tokens_per_mb (default: areno's estimate from free memory)",
    )
    p.add_argument(
        "--trl-gradient-checkpointing",
        choices=("on", "off"),
        default="on",
        help="TRL's activation checkpointing (on: GRPOConfig's default; areno does not checkpoint)",
    )
    p.add_argument(
        "--profile-steps",
        type=int,
        nargs="*",
        default=[],
        metavar="N",
        help="areno: profile these steps (0-based, warm-up included) into <run dir>/profile "
        "(a Chrome trace and an operator table, as observe.profile_steps)",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--workdir",
        default=None,
        help="where models and runs go (default: a temporary directory, removed when the bench ends well)",
    )
    p.add_argument(
        "--areno-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one more config override for both areno systems (repeatable)",
    )
    p.add_argument(
        "--async-eta",
        type=int,
        default=1,
        help="areno_async: rollout.max_head_offpolicyness (eta); eta + 1 batches are generated together "
        "beside the trainer, and the timed steps are a multiple of eta + 1",
    )
    p.add_argument(
        "--areno-async-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one more config override for areno_async only (repeatable), e.g. rollout.max_concurrent=8 "
        "to generate one batch at a time beside the trainer",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.trl_child:
        return trl_child(*args.trl_child)

    shapes = (args.shapes or ("0.5b,1.5b" if args.device == "cuda" else "tiny")).split(",")
    systems = args.systems.split(",")
    for s in shapes:
        if s not in SHAPES:
            raise ValueError(f"--shapes: unknown shape {s!r}; choose from {sorted(SHAPES)}")
    for s in systems:
        if s not in SYSTEMS:
            raise ValueError(f"--systems: unknown system {s!r}; choose from {list(SYSTEMS)}")
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1 (got {args.rounds})")
    systems = systems * args.rounds
    if args.warmup < 1 or args.steps < 1:
        raise ValueError("--warmup and --steps must be >= 1 (the first step allocates and compiles)")
    if args.async_eta < 1:
        raise ValueError(f"--async-eta must be >= 1 (got {args.async_eta}); eta 0 is the colocated system 'areno'")
    if args.min_completion_len is not None and "trl" in systems:
        raise ValueError("--min-completion-len: TRL's completions are fixed-length; run the areno systems only")
    param_dtype = default_param_dtype(args)
    with work_dir(args.workdir, "areno-bench-e2e-") as workdir:
        if args.profile_steps:
            keep_work_dir(workdir, "the profiles of --profile-steps, in each areno run's profile/")
        num_seqs = args.prompts * args.samples

        copy_bw = measure_copy_bandwidth(args.device)
        # the floor counts areno's default compute dtype (``model.compute_dtype=auto``): bf16 on CUDA, and on a
        # CPU where ``cpu_gemm.prefers_bf16`` the shape's width decides
        dtypes = ["bfloat16"] if args.device == "cuda" else ["float32"]
        if args.device != "cuda" and cpu_gemm.native_bf16():
            dtypes.append("bfloat16")
        readings = {d: [measure_matmul_rate(args.device, getattr(torch, d))] for d in dtypes}
        copy_readings = [copy_bw]
        hw = {
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "copy_bw_GBps": copy_bw / 1e9,
            "matmul_TFLOPs": {d: r[0] / 1e12 for d, r in readings.items()},
            "torch": torch.__version__,
            "param_dtype": param_dtype,
        }
        progress(hardware=hw)

        results = []
        for shape in shapes:
            _, default_p, default_c = SHAPES[shape]
            prompt_len, completion_len = args.prompt_len or default_p, args.completion_len or default_c
            t0 = time.perf_counter()
            model_dir, config, tokenizer = make_model_dir(shape, workdir)
            progress(shape=shape, model_init_s=time.perf_counter() - t0)
            # enough distinct prompts for every step, the async pool's look-ahead included
            prompts = make_prompts(
                tokenizer, args.prompts * (args.warmup + args.steps + args.async_eta + 5), prompt_len
            )
            data_path = workdir / f"prompts-{shape}.jsonl"
            data_path.write_text("".join(json.dumps({"prompt": q, "answer": ""}) + "\n" for q in prompts))
            floor_dtype = (
                "bfloat16" if args.device == "cuda" or cpu_gemm.prefers_bf16(config.hidden_size) else "float32"
            )
            elt = 2 if floor_dtype == "bfloat16" else 4
            if args.min_completion_len is not None and not 1 <= args.min_completion_len <= completion_len:
                raise ValueError(f"--min-completion-len must be between 1 and the completion length {completion_len}")
            lengths = completion_lengths(completion_len, args.min_completion_len, args.samples) * args.prompts
            runs: dict[str, int] = {}
            ran = []
            for system in systems:
                if system == "trl" and trl_in_fresh_process(args):
                    res = run_trl_fresh(
                        args, shape, model_dir, prompts, workdir, param_dtype=param_dtype, completion_len=completion_len
                    )
                elif system == "trl":
                    res = run_trl(
                        args,
                        shape,
                        model_dir,
                        prompts,
                        tokenizer,
                        workdir,
                        param_dtype=param_dtype,
                        completion_len=completion_len,
                    )
                else:
                    res = run_areno(
                        args,
                        shape,
                        model_dir,
                        data_path,
                        workdir,
                        eta=args.async_eta if system.startswith("areno_async") else 0,
                        param_dtype=param_dtype,
                        prompt_len=prompt_len,
                        completion_len=completion_len,
                        server="vllm" if system == "areno_vllm" else None,
                        extra=SYSTEM_OVERRIDES.get(system, []),
                    )
                ran.append((system, res))
                progress(shape=shape, system=system, step_s=res.get("step_s"))  # its row once the floor is read
            # the rates read again after the runs: the floor takes the best reading of the run
            for d in dtypes:
                readings[d].append(measure_matmul_rate(args.device, getattr(torch, d)))
            copy_readings.append(measure_copy_bandwidth(args.device))
            hw.update(
                copy_bw_GBps=max(copy_readings) / 1e9,
                matmul_TFLOPs={d: max(r) / 1e12 for d, r in readings.items()},
                copy_bw_GBps_readings=[c / 1e9 for c in copy_readings],
                matmul_TFLOPs_readings={d: [x / 1e12 for x in r] for d, r in readings.items()},
            )
            floor = physical_floor(
                config,
                num_seqs,
                prompt_len,
                completion_len,
                elt,
                max(copy_readings),
                max(readings[floor_dtype]),
                lengths=lengths,
                group_size=args.samples,
            )
            floor["floor_dtype"] = floor_dtype
            for system, res in ran:
                row = report(system, shape, res, floor, sum(lengths))
                if system.startswith("areno_async"):
                    row.update(label=f"{row['label']} eta {args.async_eta}", eta=args.async_eta)
                row.update(
                    round=runs.setdefault(system, 0),
                    prompt_len=prompt_len,
                    completion_len=completion_len,
                    min_completion_len=args.min_completion_len,
                    num_seqs=num_seqs,
                    params=floor["params"],
                    floor_dtype=floor["floor_dtype"],
                )
                runs[system] += 1
                results.append(row)
                progress(row=row)

        emit("e2e", summary_headline(results), {"hardware": hw, "rows": results, "shapes": by_shape(results)})
        return 0


def progress(**fields) -> None:
    """One line of progress on stderr (stdout carries only the result)."""
    print(json.dumps(fields), file=sys.stderr, flush=True)


def by_shape(rows: list[dict]) -> dict:
    """Per shape: each system's step time, generation rate, peak memory and gap to the floor (medians over
    its rounds), and each areno system's speedup over TRL measured in the same run (the median of the
    rounds' ratios; ``speedup_..._rounds`` lists them when there are several)."""
    out: dict = {}
    for shape in dict.fromkeys(r["shape"] for r in rows):
        runs = _rounds(rows, shape)
        entry: dict = {}
        for s, rs in runs.items():
            entry[s] = {
                key: statistics.median(r[field] for r in rs)
                for key, field in (
                    ("step_s", "step_s_mean"),
                    ("gen_tokens_per_s", "gen_tokens_per_s"),
                    ("gap_to_floor", "gap_to_floor"),
                )
            }
            peaks = [r["peak_gpu_gib"] for r in rs if r["peak_gpu_gib"] is not None]
            entry[s]["peak_gpu_gib"] = max(peaks) if peaks else None
            if len(rs) > 1:
                entry[s]["step_s_rounds"] = [r["step_s_mean"] for r in rs]
        if "trl" in runs:
            for s in ("areno", "areno_async"):
                if s in runs:
                    ratios = _round_ratios(runs["trl"], runs[s])
                    entry[f"speedup_{s}_vs_trl"] = statistics.median(ratios)
                    if len(ratios) > 1:
                        entry[f"speedup_{s}_vs_trl_rounds"] = ratios
        out[shape] = entry
    return out


def _rounds(rows: list[dict], shape: str) -> dict[str, list[dict]]:
    """``shape``'s rows per system, in round order."""
    runs: dict[str, list[dict]] = {}
    for r in rows:
        if r["shape"] == shape:
            runs.setdefault(r["system"], []).append(r)
    return runs


def _round_ratios(trl: list[dict], ours: list[dict]) -> list[float]:
    """TRL s/step over the system's in each round both ran (round i with round i)."""
    return [t["step_s_mean"] / o["step_s_mean"] for t, o in zip(trl, ours)]


def summary_headline(rows: list[dict]) -> dict:
    """The first areno system of the first shape against TRL on that shape (None when TRL did not run);
    with several rounds, the medians of its and TRL's step times and of the rounds' ratios."""
    ours = next((r for r in rows if r["system"] != "trl"), None)
    shape = ours["shape"] if ours else rows[0]["shape"]
    runs = _rounds(rows, shape)
    mine = runs[ours["system"]] if ours else []
    trl = runs.get("trl", [])
    figure = statistics.median(r["step_s_mean"] for r in mine) if mine else None
    base = statistics.median(r["step_s_mean"] for r in trl) if trl else None
    rounds = _round_ratios(trl, mine)
    rounds_note = f", median of {len(rounds)} rounds' ratios" if len(rounds) > 1 else ""
    return headline(
        f"s per GRPO step (mean), shape {shape}, {ours['label'] if ours else 'no areno system'}",
        figure,
        "TRL GRPOTrainer (transformers generate), same shape and batch",
        base,
        round(statistics.median(rounds), 2) if rounds else None,
        f"TRL s/step / areno s/step (>1: areno faster){rounds_note}",
    )


if __name__ == "__main__":
    sys.exit(main())
