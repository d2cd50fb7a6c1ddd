"""The rollout engine's configuration, defined once.

``RolloutEngineSettings`` holds every engine setting a user tunes; the run's ``rollout`` section
(``areno.engine.config.RolloutSection``) extends it, so each of them is the user's
``rollout.<field>`` with this default and this validation. ``RolloutEngineConfig`` adds what the
engine's owner decides (a run, a server, a bench or a test): where the engine runs, its pool size,
its seed and internal switches. Invalid values raise ``ConfigError`` naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from areno.errors import check_config
from areno.rollout.attention import DECODE_ATTENTION
from areno.rollout.paged_decode import triton_available

STANDALONE_MAX_NUM_SEQS = 256
"""The running batch of an engine whose owner leaves ``max_num_seqs`` at 0 (a run sizes it itself)."""
KV_DTYPES = ("float32", "bfloat16", "float16")
_BOOLEANS = (
    "enable_prefix_sharing",
    "recompute_kv_on_weight_update",
    "cuda_graphs",
    "prefill_cuda_graphs",
    "fused_kernels",
    "fused_projections",
    "cpu_packed_gemm",
    "overlap_round_trips",
)


@dataclass(kw_only=True)
class RolloutEngineSettings:
    """How the rollout engine lays out its KV cache, batches requests and runs its steps."""

    kv_memory_fraction: float = 0.8
    """CUDA: fraction of the device memory free when the engine starts that an automatically sized
    KV pool takes (at most ``KV_BLOCKS_HEADROOM`` times the running batch's blocks at ``max_model_len``)."""
    cpu_kv_cache_bytes: int = 1 << 29
    """CPU: bytes of an automatically sized KV pool (capped as on CUDA)."""
    max_num_seqs: int = 0
    """Most sequences the engine decodes at once (its running batch; CUDA graphs are captured up to
    this size). 0: a run takes its sequences in flight, min(max_concurrent, batch_size x (eta + 1)) x
    n_samples, at least 256 and at most 1024 (an asynchronous run keeps several batches in flight,
    and a decode step of a small model costs about the same for twice the rows); an engine built
    alone takes ``STANDALONE_MAX_NUM_SEQS``."""
    max_tokens_per_step: int = 4096
    """Token budget of one forward pass (decode tokens + prefill chunk tokens)."""
    prefill_chunk_size: int = 1024
    """Most prompt tokens of one sequence prefilled in one step (chunked prefill)."""
    max_model_len: int | None = None
    """Longest sequence (prompt + output); null: the model's ``max_position_embeddings`` (LongRoPE models:
    its ``original_max_position_embeddings``, which areno computes as transformers does)."""
    enable_prefix_sharing: bool = True
    """Share full KV blocks of identical prefixes between requests (GRPO groups, multi-turn)."""
    block_size: int = 16
    """Tokens per KV block: the unit of allocation (``kv_blocks``) and of prefix sharing, which shares
    whole blocks only, so the samples of a group share a prompt shorter than one block not at all
    (the CPU demo's prompts of 9-11 tokens take 8)."""
    recompute_kv_on_weight_update: bool = False
    """After a weight update (a policy sync), recompute the K/V of in-flight requests under the new
    weights (their tokens are kept; every later token is sampled exactly from the new policy). False
    keeps the old K/V: the context of a request interrupted by a sync stays encoded by the previous
    policy, and the decoupled loss's behaviour log-probs record what was sampled either way.
    Synchronous runs (eta = 0) have nothing in flight at a sync; in asynchronous ones recomputing
    costs a large share of the trained tokens/s."""
    cuda_graphs: bool = True
    """CUDA: replay pure-decode steps from captured CUDA graphs (``rollout/cuda_graph.py``); false
    runs every decode step eagerly, which is slower (the host launches every kernel)."""
    prefill_cuda_graphs: bool = True
    """CUDA with ``cuda_graphs``: replay steps with prompt chunks (a rollout's first step; a mixed
    step's decode rows count as one-token chunks) from CUDA graphs too (``rollout/prefill_graph.py``;
    captured per padded token count, key count and batch size, at most 16, their attention one flash
    varlen call per layer over keys gathered from the pool): a small model's prefill step is
    otherwise bound by the host launching its ~20 kernels per layer. Needs torch's varlen attention
    (returning its log-sum-exp for a model with attention sinks, gpt-oss; none for Gemma 2's
    soft-capped scores, which flash does not compute), a 16-bit KV cache, one
    rank (no tensor parallelism) and, for a mixture of experts, grouped GEMMs (bf16 on a Hopper or
    newer GPU); the engine logs why when it cannot. Steps of more than 16,384 keys, and shapes past
    the cap, run eagerly."""
    cuda_graph_max_batch: int | None = None
    """Largest decode batch that uses a CUDA graph (batch sizes are padded to 1, 2, 4, then multiples
    of 8, 32 and 64; ``cuda_graph.padded_batch_size``); larger batches decode eagerly. null:
    ``max_num_seqs``."""
    decode_steps: int = 0
    """Decode steps a pure-decode batch runs back to back on the device per host round trip: tokens
    are sampled, fed back and checked for stop ids / length on the device, and copied to the host
    once at the end (tokens past a request's end are discarded; requests join at the next round
    trip, so with requests waiting for a slot a batch of fewer than ``WAITING_CLAMP_MAX_ROWS`` rows
    caps k by its shortest remaining length). The per-step host cost (scheduling, block tables,
    output bookkeeping) is divided by k. 0: 8 (on CUDA and CPU). 1 returns to the host after every
    token."""
    mixed_decode_min_rows: int | None = 32
    """With ``decode_steps`` k > 2, a mixed step (prefill chunks of newly admitted requests beside
    decoding rows; graph-less) in which at least this many rows sample, every scheduled sequence
    samples (no prompt left half prefilled) and no waiting request could take a free slot, is
    followed in the same round trip by k - 1 decode steps of those rows (a k - 1 step loop graph):
    such a round trip gives each row k tokens, as a pure-decode one does, instead of 1. In an
    asynchronous run requests arrive all the time, so most round trips are mixed; with k tokens per
    round trip either way, rows that end together stay together and their replacements arrive
    together. Tokens are those of the one-step engine for greedy and seeded rows; requests that
    arrive meanwhile join at the next round trip. Smaller batches keep one token per mixed step
    (latency of new requests). null: a mixed step always returns to the host after one token."""
    decode_attention: str = "auto"
    """Decode-step attention: ``gather`` copies each sequence's K/V out of the block pool into a
    dense batch (SDPA on CUDA; two batched matmuls on CPU); ``paged`` reads them straight from the
    pool (a Triton kernel on CUDA, a chunked online-softmax loop elsewhere; ``paged_decode.py``);
    ``auto`` is ``paged`` on CUDA with Triton importable and ``gather`` elsewhere (the faster of the
    two on each). Prefill and mixed steps always gather."""
    fused_kernels: bool = True
    """CUDA with Triton: RMSNorm, RoPE and SiLU-and-multiply in this engine's forwards run as one
    fused kernel each (``areno.models.fused_ops``; same roundings as the eager ops, enabled only after
    a self-check against them at start-up, a mismatch keeps the eager ops and says why) instead of
    2-8 eager kernels, which dominate a small model's decode step. Only this engine's steps and graph
    captures use them (``fused_ops.inference``); no effect on CPU or in training."""
    fused_projections: bool = True
    """Run each layer's q/k/v and gate/up projections as one GEMM each (``Decoder.fuse_projections``:
    the weights become row slices of one tensor per group, under the same names, so weight updates
    and policy syncs still write them in place) instead of five GEMMs: fewer kernels per decode step,
    which bounds a small model's decode. Applied to the engine's model once, at construction, on any
    device (TP engines fuse their local shards); false unfuses a model fused before (the model
    belongs to the engine either way). A model without ``fuse_projections`` is run as given."""
    cpu_packed_gemm: bool = True
    """CPU, fp32 (and bf16 where the CPU has native bf16 dot products): the large inference GEMMs (the
    fused q/k/v and gate/up groups, o_proj, down_proj and the output projection, every weight of
    ``cpu_gemm.MIN_ELEMENTS`` elements or more) multiply with a oneDNN-packed copy of their weight
    (``Decoder.pack_cpu_gemms``) instead of ``F.linear``: faster per decode step, values equal up to
    summation order. The copies are re-packed after every
    weight update and cost the packed weights' memory once more; false keeps ``F.linear`` (and that
    memory). Ignored on GPU."""

    overlap_round_trips: bool = True
    """CUDA, pure-decode batches of ``decode_steps`` > 1: launch the next k-step round trip (its input
    the last tokens, still on the device) before reading this one's tokens, so the host's bookkeeping
    of one round trip (copying the tokens out, the stop checks, the next launch) runs while the device
    decodes the next, instead of leaving the device idle in between. A step chains round trips while
    every row runs on, no request arrives and no caller waits for the engine (a pause, a weight
    update, an abort), then reads the last one: nothing is in flight between steps. A row that ends in
    one round trip has run on in the next; those tokens are discarded. The same tokens either way.
    Ignored on CPU (host and decode share the cores there) and by tensor-parallel engines (their
    ranks must take the same steps)."""

    def __post_init__(self) -> None:
        for key in ("max_tokens_per_step", "prefill_chunk_size", "cpu_kv_cache_bytes", "block_size"):
            check_config(getattr(self, key) > 0, f"rollout.{key}", f"must be > 0, got {getattr(self, key)}")
        check_config(
            0 < self.kv_memory_fraction <= 1,
            "rollout.kv_memory_fraction",
            f"must be in (0, 1], got {self.kv_memory_fraction}",
        )
        check_config(
            self.max_num_seqs >= 0, "rollout.max_num_seqs", f"must be >= 0 (0 = automatic), got {self.max_num_seqs}"
        )
        check_config(
            self.max_model_len is None or self.max_model_len > 1,
            "rollout.max_model_len",
            f"must be > 1 or null, got {self.max_model_len}",
        )
        check_config(
            self.cuda_graph_max_batch is None or self.cuda_graph_max_batch > 0,
            "rollout.cuda_graph_max_batch",
            f"must be > 0 or null, got {self.cuda_graph_max_batch}",
        )
        check_config(
            (self.decode_steps or 0) >= 0,  # callers may pass None for the default too
            "rollout.decode_steps",
            f"must be >= 0 (0 = engine default), got {self.decode_steps}",
        )
        check_config(
            self.mixed_decode_min_rows is None or self.mixed_decode_min_rows >= 1,
            "rollout.mixed_decode_min_rows",
            f"must be >= 1 or null (off), got {self.mixed_decode_min_rows}",
        )
        check_config(
            self.decode_attention in ("auto", *DECODE_ATTENTION),
            "rollout.decode_attention",
            f"must be auto, {', '.join(DECODE_ATTENTION[:-1])} or {DECODE_ATTENTION[-1]}, "
            f"got {self.decode_attention!r}",
        )
        for key in _BOOLEANS:
            value = getattr(self, key)
            check_config(isinstance(value, bool), f"rollout.{key}", f"must be true or false, got {value!r}")


@dataclass(kw_only=True)
class RolloutEngineConfig(RolloutEngineSettings):
    """Everything a ``RolloutEngine`` is built with: the settings a user tunes (``rollout.<key>`` of
    a run) and what the engine's owner decides. ``max_num_seqs`` 0 becomes
    ``STANDALONE_MAX_NUM_SEQS`` here (a run passes its own)."""

    num_blocks: int | None = None
    """KV blocks in the pool. None: sized from ``kv_memory_fraction`` on CUDA, from
    ``cpu_kv_cache_bytes`` on CPU (a run passes ``rollout.kv_blocks`` or its memory budget)."""
    kv_reserved_bytes: int = 0
    """CUDA, pool sized from free memory: bytes of it left to others before ``kv_memory_fraction``
    applies (a colocated run's training side: its gradients, optimizer state and activations to come)."""
    dtype: str | None = None
    """KV cache dtype (``KV_DTYPES``). None: the model's parameter dtype."""
    device: str | None = None
    """Device of the KV cache. None: the model's device."""
    seed: int = 0
    """Seed of the generator shared by requests without their own seed."""
    cast_weights: bool = True
    """``update_weights`` accepts floating tensors of another floating dtype and casts them (a bf16
    engine fed by an fp32 trainer). Non-floating mismatches are always rejected."""
    record_routes: bool = False
    """Mixture-of-experts models: record the top-k expert ids of every sparse layer for each token a
    forward runs over, returned as ``GenerationOutput.routes_TLK`` (a run sets it from
    ``train.moe_rollout_routes`` / ``train.moe_routing_replay``). Turns off prefix sharing (a shared
    prefix's tokens would have no forward of their own) and CUDA graphs. No effect on a dense model."""
    overlap_round_trips_on_cpu: bool = False
    """Chain round trips (``overlap_round_trips``) on CPU as well: nothing overlaps there, so only
    tests set it, to run the chaining logic without a GPU."""
    fp32_logits: bool = False
    """The sampler's logits in float32 straight out of the LM head's product, never rounded to the model's
    16-bit dtype (``logprobs.fp32_product``; a run sets it from ``model.fp32_logits``, which the trainer's
    log-probs follow too). No effect on a float32 model."""
    cpu_decode_carry: bool = True
    """CPU, gathered decode attention, float32 KV cache: pure-decode steps keep each layer's gathered
    K/V and extend it by the new token instead of gathering it from the pool again
    (``attention.DecodeCarry``; bit for bit the same attention, up to ``DECODE_CARRY_MAX_BYTES`` of
    copies). False gathers every step; a bfloat16 cache always does (the carried view is slower there)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.max_num_seqs = self.max_num_seqs or STANDALONE_MAX_NUM_SEQS
        check_config(
            self.num_blocks is None or self.num_blocks > 0,
            "RolloutEngineConfig.num_blocks",
            f"must be > 0 or None, got {self.num_blocks}",
        )
        check_config(
            self.dtype is None or self.dtype in KV_DTYPES,
            "RolloutEngineConfig.dtype",
            f"must be one of {KV_DTYPES} or None, got {self.dtype!r}",
        )
        check_config(
            isinstance(self.cpu_decode_carry, bool),
            "RolloutEngineConfig.cpu_decode_carry",
            f"must be True or False, got {self.cpu_decode_carry!r}",
        )


def resolve_decode_attention(choice: str, device: torch.device) -> str:
    """``"auto"`` -> ``"paged"`` on CUDA when Triton is importable, else ``"gather"``; other values as given."""
    if choice != "auto":
        return choice
    return "paged" if device.type == "cuda" and triton_available() else "gather"
