"""Per-token log-probs (and entropies) of packed sequences without materialising [T, V] fp32 logits.

Alignment (areno/types.py): ``logprobs_T[t] = log p(input_ids_T[t] | earlier tokens of the same
sequence)`` under the temperature-scaled distribution, and 0 at each sequence's first token; the
same for ``entropy_T[t]`` (the entropy of the distribution that predicts token t).

Logits are computed chunk by chunk from the final hidden states, and the softmax's fp32 passes
run per chunk. What forward keeps for backward depends on the call's size: a small head (all
chunks within ``KEEP_LOGSOFTMAX_MAX_BYTES``, e.g. a CPU model's) keeps its fp32 log-softmax
chunks, and with the entropy also their exponentials (the softmax); on CPU without the entropy,
every chunk goes through the softmax instead (the log-prob of a target taken from it) and a small
head keeps that, so backward builds the gradient without an ``exp`` pass, and takes the weight's
gradient as one GEMM over all chunks; a larger one keeps its
model-dtype logits when they fit ``keep_logits_budget`` (an eighth of a GPU's memory, at most half
of what is free), and the largest keep nothing, so backward recomputes each chunk's logits and
peak memory is one chunk of ``[chunk_size, V]`` logits in both passes. Keeping saves backward's
recomputing matmul; the values are the same either way. The matmul runs in the model dtype and
the softmax in fp32, as ``Decoder.logits(...).float()`` would. A model's map of its logits
(``eager_ops.LogitMap``: Granite's ``logits_scaling``, Gemma 2's ``final_logit_softcapping``) is applied to
each chunk: a divisor alone is folded into the temperature (the same softmax); a soft-capped head caps each
chunk's logits in fp32 first and keeps no log-softmax: backward needs the capped logits for the tanh's
derivative, so it keeps those where they fit and recomputes them otherwise.

Legend: T = packed tokens, D = hidden size, V = vocabulary, B = sequences, C = tokens of a chunk.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from areno.models import cpu_gemm
from areno.models.attention import PackedCausalAttention
from areno.models.decoder import Decoder
from areno.models.eager_ops import LogitMap
from areno.models.fused_ops import thread_flag
from areno.types import repeat_per_sequence

AUTO_CHUNK_MEMORY_SHARE = 16
"""An automatic chunk size (``auto_chunk_size``) lets one chunk add 1/16 of the GPU's memory to the peak."""
AUTO_CHUNK_RANGE = (1024, 8192)
"""Smallest and largest automatic chunk (tokens) of a GPU head."""
CPU_CHUNK = 512
"""A CPU head's automatic chunk: its [C, V] logits stay within a cache-sized block (bench/LOG.md:
the CPU head's packed product)."""
PACKED_HEAD_MAX_ELEMENTS = 1 << 24
"""A CPU head's weight takes a oneDNN-packed copy per call (``_packed_head``) up to this many elements
(a 64 MB fp32 copy); a larger one keeps MKL's product."""

KEEP_LOGSOFTMAX_MAX_BYTES = 512 << 20
"""Largest [T, V] fp32 log-softmax (all chunks of one call) that forward keeps for backward; a
larger one is recomputed from kept or recomputed logits (the GPU heads of real vocabularies)."""
KEEP_LOGITS_MEMORY_SHARE = 8
"""On a GPU, forward keeps a call's model-dtype logits for backward when they take at most 1/8 of
the device's memory and half of what is free at that point (a 0.5B model's 32,768-token
micro-batch on an H200: 10 GB of bf16 logits)."""


def auto_chunk_size(hidden_TD: torch.Tensor, weight_VD: torch.Tensor) -> int:
    """Tokens per chunk when the caller gives none: on a GPU the largest power of two in
    ``AUTO_CHUNK_RANGE`` whose chunk adds at most 1/``AUTO_CHUNK_MEMORY_SHARE`` of the device's
    memory (about three logits' worth of bytes per entry: the logits, their gradient, the softmax's
    fp32 reads), on CPU ``CPU_CHUNK``. Each chunk's backward reads and writes the whole fp32 [V, D]
    weight gradient, so on a GPU fewer, larger chunks are faster (bench/LOG.md: the LM head's chunk
    size)."""
    low, high = AUTO_CHUNK_RANGE
    if hidden_TD.device.type != "cuda":
        return CPU_CHUNK
    budget = _device_memory(hidden_TD.device) // AUTO_CHUNK_MEMORY_SHARE
    per_token = 3 * weight_VD.shape[0] * hidden_TD.element_size()
    chunk = low
    while chunk * 2 <= high and chunk * 2 * per_token <= budget:
        chunk *= 2
    return chunk


def _device_memory(device: torch.device) -> int:
    """Total memory of a CUDA device, in bytes."""
    return torch.cuda.get_device_properties(device).total_memory


def keep_logits_budget(device: torch.device) -> int:
    """Bytes of model-dtype logits (all chunks of one call) that forward may keep for backward: on a
    GPU at most 1/``KEEP_LOGITS_MEMORY_SHARE`` of its memory and half of what is free now (the
    device's free memory and the blocks the caching allocator holds unused), so that a run near its
    memory limit recomputes them as before instead of running out in backward."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return min(total // KEEP_LOGITS_MEMORY_SHARE, (free + cached) // 2)
    return KEEP_LOGSOFTMAX_MAX_BYTES


def _over_vocab(op: Callable[..., torch.Tensor], zraw_CV: torch.Tensor, temperature: float) -> torch.Tensor:
    """``op`` (``torch.log_softmax`` or ``torch.softmax``) in fp32 over [C, V] of a chunk's
    temperature-scaled model-dtype logits, which it leaves as they are (backward may read them again).
    One call instead of a cast and further passes over an fp32 [C, V] copy; on CUDA the kernel reads
    16-bit logits itself (CPU's casts them first)."""
    # outside autocast, which would first cast 16-bit logits to an fp32 copy (both ops are on its fp32 list)
    with torch.autocast(zraw_CV.device.type, enabled=False):
        if temperature == 1.0:
            return op(zraw_CV, dim=-1, dtype=torch.float32)
        z_CV = zraw_CV.float()  # a copy for 16-bit logits, divided in place; fp32 logits themselves stay
        return op(z_CV.div_(temperature) if z_CV is not zraw_CV else z_CV / temperature, dim=-1)


def _log_softmax(zraw_CV: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 log-softmax [C, V] of a chunk's temperature-scaled logits (``_over_vocab``)."""
    return _over_vocab(torch.log_softmax, zraw_CV, temperature)


def _softmax(zraw_CV: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 softmax [C, V] of a chunk's temperature-scaled logits (``_over_vocab``)."""
    return _over_vocab(torch.softmax, zraw_CV, temperature)


CPU_SOFTMAX_FORM = True
"""A CPU head without entropy goes through the softmax (``_ChunkedLogprobs``). An internal switch,
not a setting: False keeps the log-softmax form every other head takes, for tests and benches that
compare the two (``bench.cpu_head``)."""

GRAD_LOGITS_MAX_BYTES = 256 << 20
"""Largest [T, V] logits' gradient (in the GEMM dtype) a CPU softmax-form head holds whole for one
weight-gradient GEMM; a larger one takes a GEMM per chunk."""

TINY_PROB = 1e-30
"""A target probability below this takes its log-prob from the logits (``z - logsumexp(z)``), not
from ``log(p)``: fp32 keeps full relative precision only above its smallest normal value (~1e-38)."""


def _target_logprobs(
    p_CV: torch.Tensor, zraw_CV: torch.Tensor, targets_C: torch.Tensor, temperature: float
) -> torch.Tensor:
    """log p[target] [C] from a chunk's fp32 softmax; rows whose target is nearly impossible are
    recomputed from their logits (rare: a host read, so CPU only)."""
    logp_C = p_CV.gather(-1, targets_C[:, None])[:, 0].log()
    tiny_C = logp_C < math.log(TINY_PROB)
    if bool(tiny_C.any()):
        rows = tiny_C.nonzero()[:, 0]
        with torch.autocast(zraw_CV.device.type, enabled=False):
            z_RV = zraw_CV[rows].float() / temperature
            logp_C[rows] = z_RV.gather(-1, targets_C[rows, None])[:, 0] - torch.logsumexp(z_RV, dim=-1)
    return logp_C


def _fused_forward_stats(
    zraw_CV: torch.Tensor, targets_C: torch.Tensor, inv_tau: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lse_C, logprob_C, entropy_C) of one chunk's model-dtype logits, written for torch.compile
    to fuse into one or two passes over ``zraw_CV`` (no fp32 [C, V] copy is kept)."""
    z_CV = zraw_CV.float() * inv_tau
    m_C = z_CV.amax(dim=-1)
    shifted_CV = z_CV - m_C[:, None]
    exp_CV = torch.exp(shifted_CV)
    a_C = exp_CV.sum(-1)
    lse_C = m_C + torch.log(a_C)
    logp_C = z_CV.gather(-1, targets_C[:, None])[:, 0] - lse_C
    if with_entropy:  # H = log a - sum e (z - m) / a: no cancellation against a large lse
        entropy_C = torch.log(a_C) - (exp_CV * shifted_CV).sum(-1) / a_C
    else:
        entropy_C = lse_C.new_zeros(0)
    return lse_C, logp_C, entropy_C


def _fused_grad_logits(
    zraw_CV: torch.Tensor,
    targets_C: torch.Tensor,
    lse_C: torch.Tensor,
    entropy_C: torch.Tensor,
    g_C: torch.Tensor,
    g_ent_C: torch.Tensor,
    inv_tau: float,
    use_entropy: bool,
    softcap: float | None = None,
    divisor: float = 1.0,
) -> torch.Tensor:
    """dL/d(zraw) [C, V] in the logits' dtype: ``(g [v = target] - p (g + g_H (log p + H))) / tau``,
    one fused pass for torch.compile (the one-hot is a comparison, not a scatter). ``softcap``: ``zraw`` holds
    mapped logits c = cap tanh(z / divisor / cap) (``LogitMap``), and the gradient reaches z through dc/dz =
    (1 - (c / cap)^2) / divisor."""
    logp_CV = zraw_CV.float() * inv_tau - lse_C[:, None]
    p_CV = torch.exp(logp_CV)
    if use_entropy:
        coef_CV = g_C[:, None] + g_ent_C[:, None] * (logp_CV + entropy_C[:, None])
    else:
        coef_CV = g_C[:, None]
    vocab_V = torch.arange(zraw_CV.shape[-1], device=zraw_CV.device)
    onehot_CV = (vocab_V[None, :] == targets_C[:, None]).to(p_CV.dtype)
    grad_CV = (onehot_CV * g_C[:, None] - p_CV * coef_CV) * inv_tau
    if softcap is not None:
        c_CV = zraw_CV.float() / softcap
        grad_CV = grad_CV * ((1.0 - c_CV * c_CV) / divisor)
    return grad_CV.to(zraw_CV.dtype)


def _in_gemm_dtype(weight_VD: torch.Tensor, hidden_TD: torch.Tensor) -> torch.Tensor:
    """``weight_VD`` in the dtype the surrounding autocast runs ``hidden_TD``'s GEMMs in (itself without
    autocast, or when it has that dtype)."""
    dev = hidden_TD.device.type
    if torch.is_autocast_enabled(dev) and torch.get_autocast_dtype(dev) != weight_VD.dtype:
        return weight_VD.to(torch.get_autocast_dtype(dev))
    return weight_VD


@functools.cache
def _out_dtype_addmm(device_type: str) -> bool:
    """Whether ``torch.addmm(..., out_dtype=float32)`` takes 16-bit inputs on this device type (CUDA
    builds of recent torch do; CPU builds do not)."""
    acc = torch.zeros(16, 16, device=device_type)
    x = torch.ones(16, 16, device=device_type, dtype=torch.bfloat16)
    try:
        torch.addmm(acc, x, x, out_dtype=torch.float32, out=acc)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return bool((acc == 16).all())


def _add_weight_grad(grad_w_VD: torch.Tensor, grad_z_CV: torch.Tensor, h_CD: torch.Tensor) -> None:
    """``grad_w_VD`` (fp32) += grad_z_CV^T h_CD, the product in the dtype the surrounding autocast (or
    the inputs) give it. Accumulated inside the GEMM where the device can (beta = 1 into the fp32
    sum): a 16-bit product cast and added per chunk writes and reads the whole [V, D] gradient three
    more times, about a tenth of a 0.5B model's training phase at a 151,936-token vocabulary."""
    dev = grad_w_VD.device
    dtype = torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else grad_z_CV.dtype
    with torch.autocast(dev.type, enabled=False):
        if dtype == grad_w_VD.dtype:
            grad_w_VD.addmm_(grad_z_CV.t().to(dtype), h_CD.to(dtype))
            return
        if dtype in (torch.bfloat16, torch.float16) and _out_dtype_addmm(dev.type):
            torch.addmm(grad_w_VD, grad_z_CV.t().to(dtype), h_CD.to(dtype), out_dtype=grad_w_VD.dtype, out=grad_w_VD)
            return
        grad_w_VD += (grad_z_CV.t().to(dtype) @ h_CD.to(dtype)).float()


@functools.cache
def _out_dtype_mm(device_type: str) -> bool:
    """Whether ``torch.mm(..., out_dtype=float32)`` takes bfloat16 inputs on this device type (CUDA builds of
    recent torch do; CPU builds do not)."""
    x = torch.ones(16, 16, device=device_type, dtype=torch.bfloat16)
    try:
        out = torch.mm(x, x, out_dtype=torch.float32)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return out.dtype == torch.float32 and bool((out == 16).all())


def fp32_logits_weight(weight_mm_VD: torch.Tensor, device_type: str) -> torch.Tensor:
    """The weight ``fp32_product`` reads for the logits: itself where the device multiplies 16-bit operands
    into a float32 result, else its float32 copy (cast once per call, not per chunk)."""
    if weight_mm_VD.dtype == torch.float32 or _out_dtype_mm(device_type):
        return weight_mm_VD
    return weight_mm_VD.float()


def fp32_product(h_CD: torch.Tensor, weight_VD: torch.Tensor) -> torch.Tensor:
    """``h_CD @ weight_VD^T`` as float32 [C, V] logits from the operands' own values (``model.fp32_logits``):
    16-bit operands are multiplied, accumulated and written in float32 (``out_dtype`` where the device has it,
    else both upcast), never rounded to 16 bits on the way out, so that the rollout's sampler and the
    trainer's log-probs read the same logits up to summation order."""
    with torch.autocast(h_CD.device.type, enabled=False):
        if h_CD.dtype == weight_VD.dtype == torch.float32:
            return h_CD @ weight_VD.t()
        if h_CD.dtype == weight_VD.dtype and _out_dtype_mm(h_CD.device.type):
            return torch.mm(h_CD, weight_VD.t(), out_dtype=torch.float32)
        return h_CD.float() @ weight_VD.float().t()


class Fp32HeadCopy:
    """The weight a rollout engine's ``fp32_product`` reads every step: the head's own where the device
    multiplies 16-bit operands into float32, else a float32 copy kept until the weight is written (in place,
    which bumps its version, or through new storage), not cast again at each step."""

    def __init__(self) -> None:
        self._key: tuple[int, int] | None = None
        self._copy: torch.Tensor | None = None

    def __call__(self, weight_VD: torch.Tensor) -> torch.Tensor:
        if weight_VD.dtype == torch.float32 or _out_dtype_mm(weight_VD.device.type):
            return weight_VD
        try:
            key = (weight_VD.data_ptr(), weight_VD._version)
        except RuntimeError:  # an inference-mode tensor keeps no version: no copy can be trusted
            return weight_VD.float()
        if key != self._key:
            self._copy, self._key = weight_VD.float(), key
        return self._copy


@contextmanager
def fp32_logits(enabled: bool = True) -> Iterator[None]:
    """Inside this context (in this thread) the chunked head computes its logits with ``fp32_product``
    (``model.fp32_logits``; the training backends enter it around every forward)."""
    with thread_flag(_FP32_LOGITS, "enabled", enabled):
        yield


_FP32_LOGITS = threading.local()


def fp32_logits_enabled() -> bool:
    """Whether this thread is inside ``fp32_logits()``."""
    return getattr(_FP32_LOGITS, "enabled", False)


def _packed_head(weight_mm_VD: torch.Tensor, hidden_TD: torch.Tensor, chunk_size: int) -> torch.Tensor | None:
    """A oneDNN-packed copy of a CPU head's weight for this call's logits, or None (MKL's ``h @ W^T``):
    MKL lays the [D, V] operand out again at every chunk, which left the forward product of a small
    head ~1.2x slower than the layers' GEMMs. Packed once per call (its weight changes every step);
    only where the hidden states already have the weight's dtype and oneDNN computes ``F.linear``."""
    if (
        hidden_TD.device.type != "cpu"
        or hidden_TD.dtype != weight_mm_VD.dtype
        or weight_mm_VD.numel() > PACKED_HEAD_MAX_ELEMENTS
        or torch.compiler.is_compiling()
    ):
        return None
    dtype = weight_mm_VD.dtype
    if not (cpu_gemm.supported() if dtype == torch.float32 else dtype == torch.bfloat16 and cpu_gemm.supported_bf16()):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight_mm_VD.detach().contiguous(), chunk_size)


def _logits(
    h_CD: torch.Tensor, weight_mm_VD: torch.Tensor, packed: torch.Tensor | None, fp32: bool = False
) -> torch.Tensor:
    """A chunk's [C, V] logits in the GEMM dtype: through ``packed`` (``_packed_head``) where there is one;
    in float32 from the 16-bit product with ``fp32`` (``fp32_product``; ``weight_mm_VD`` from
    ``fp32_logits_weight``)."""
    if fp32:
        return fp32_product(h_CD, weight_mm_VD)
    if packed is None:
        return h_CD @ weight_mm_VD.t()
    return torch.ops.mkldnn._linear_pointwise(h_CD.contiguous(), packed, None, "none", [], "")


def _mapped(z_CV: torch.Tensor, logit_map: LogitMap | None) -> torch.Tensor:
    """A chunk's logits through the model's map (``LogitMap``), or as they are without one."""
    return z_CV if logit_map is None else logit_map(z_CV)


_KERNELS: tuple | None = None
"""The two compiled kernels, built once per process on first use."""
_ACTIVE = threading.local()


@contextmanager
def compiled_logprob_kernels(enabled: bool = True) -> Iterator[None]:
    """Inside this context (in this thread) the element-wise part of every chunk — fp32 cast,
    log-sum-exp, target gather, entropy, and in backward the softmax gradient — runs as
    ``torch.compile``d kernels fused over the model-dtype logits, instead of several eager passes
    over an fp32 [C, V] copy. The matmuls are unchanged. Off by default (the eager path is the
    numerical reference; the fused one agrees to fp32 rounding); the training backend enters it
    around every forward when ``compile=True``. The choice made at forward is kept for backward."""
    global _KERNELS
    if enabled and _KERNELS is None:
        # automatic dynamic shapes: the chunk length becomes symbolic once a second one is seen (a
        # batch's last chunk) and the vocabulary stays a constant, so an element's row and column
        # come from its flat index without a division by a runtime V
        _KERNELS = (torch.compile(_fused_forward_stats), torch.compile(_fused_grad_logits))
    with thread_flag(_ACTIVE, "enabled", enabled):
        yield


class _ChunkedLogprobs(torch.autograd.Function):
    """(hidden_TD, weight_VD, targets_T) -> (logprobs_T, entropy_T), chunked in both passes; ``logit_map``: the
    model's map of its logits (``LogitMap``), applied first."""

    @staticmethod
    def forward(ctx, hidden_TD, weight_VD, targets_T, temperature, chunk_size, with_entropy, logit_map=None):
        if logit_map is not None:  # a divisor alone becomes a temperature factor; what is left caps
            temperature, logit_map = logit_map.temperature_form(temperature)
        T = hidden_TD.shape[0]
        fused = _KERNELS if getattr(_ACTIVE, "enabled", False) else None
        logprobs_T = hidden_TD.new_empty(T, dtype=torch.float32)
        # the log-sum-exp only the compiled kernels' backward reads (the eager one recomputes the log-softmax)
        lse_T = hidden_TD.new_empty(T if fused is not None else 0, dtype=torch.float32)
        entropy_T = hidden_TD.new_empty(T if with_entropy else 0, dtype=torch.float32)
        ctx.fused = fused
        grads = any(ctx.needs_input_grad[:2])
        # a capped head keeps its capped logits instead (kept_z): backward's tanh derivative reads them
        keep = fused is None and grads and T * weight_VD.shape[0] * 4 <= KEEP_LOGSOFTMAX_MAX_BYTES and logit_map is None
        ctx.kept = [] if keep else None
        # with entropy, forward exponentiates the log-softmax anyway: backward reuses it when both fit
        keep_p = keep and with_entropy and 2 * T * weight_VD.shape[0] * 4 <= KEEP_LOGSOFTMAX_MAX_BYTES
        # Without entropy on CPU the chunks go through the softmax, not the log-softmax: backward's
        # gradient is built from it without an exp pass over [C, V] (the host read of a rare tiny
        # target's probability, _target_logprobs, is free there). It is kept instead of the log-softmax.
        ctx.softmax_form = CPU_SOFTMAX_FORM and not with_entropy and hidden_TD.device.type == "cpu"
        if ctx.softmax_form:
            keep_p, ctx.kept = keep, None
        ctx.kept_p = [] if keep_p else None
        ctx.kept_z = None  # the model-dtype logits, where the log-softmax is not kept and they fit
        # the weight in the dtype its GEMMs run in, cast once (autocast caches no cast inside a Function)
        weight_mm_VD = _in_gemm_dtype(weight_VD, hidden_TD)
        # model.fp32_logits: the logits of a 16-bit product leave it in float32 (fp32_product)
        ctx.fp32 = fp32_logits_enabled() and weight_mm_VD.dtype != torch.float32
        if ctx.fp32:
            weight_mm_VD = fp32_logits_weight(weight_mm_VD, hidden_TD.device.type)
        ctx.packed = None if ctx.fp32 else _packed_head(weight_mm_VD, hidden_TD, chunk_size)
        # the softmax-form chunks of an fp32 head go into one [T, V] buffer, which backward turns into
        # the logits' gradient in place for its one weight-gradient GEMM (no copy, no second buffer)
        ctx.p_TV = None
        if ctx.softmax_form and keep and hidden_TD.dtype == torch.float32 and weight_mm_VD.dtype == torch.float32:
            ctx.p_TV = hidden_TD.new_empty(T, weight_VD.shape[0], dtype=torch.float32)
        for s in range(0, T, chunk_size):
            e = min(s + chunk_size, T)
            zraw_CV = _mapped(_logits(hidden_TD[s:e], weight_mm_VD, ctx.packed, ctx.fp32), logit_map)
            if s == 0 and grads and not keep:
                if T * weight_VD.shape[0] * zraw_CV.element_size() <= keep_logits_budget(hidden_TD.device):
                    ctx.kept_z = []
            if ctx.kept_z is not None:
                ctx.kept_z.append(zraw_CV)
            if fused is not None:
                lse_T[s:e], logprobs_T[s:e], ent_C = fused[0](zraw_CV, targets_T[s:e], 1.0 / temperature, with_entropy)
                if with_entropy:
                    entropy_T[s:e] = ent_C
                continue
            if ctx.softmax_form:
                if ctx.p_TV is not None:  # fp32 logits: the softmax written into its rows of the buffer
                    z_CV = zraw_CV if temperature == 1.0 else zraw_CV / temperature
                    p_CV = torch._softmax(z_CV, -1, False, out=ctx.p_TV[s:e])
                else:
                    p_CV = _softmax(zraw_CV, temperature)
                logprobs_T[s:e] = _target_logprobs(p_CV, zraw_CV, targets_T[s:e], temperature)
                if keep_p:
                    ctx.kept_p.append(p_CV)
                continue
            logp_CV = _log_softmax(zraw_CV, temperature)
            logprobs_T[s:e] = logp_CV.gather(-1, targets_T[s:e, None])[:, 0]
            if keep_p:
                p_CV = logp_CV.exp()
                entropy_T[s:e] = -(p_CV * logp_CV).sum(-1)
                ctx.kept_p.append(p_CV)
            elif with_entropy:
                entropy_T[s:e] = -(logp_CV.exp().mul_(logp_CV)).sum(-1)
            if keep:
                ctx.kept.append(logp_CV)
        ctx.save_for_backward(hidden_TD, weight_VD, targets_T, lse_T, entropy_T)
        ctx.temperature, ctx.chunk_size, ctx.with_entropy = temperature, chunk_size, with_entropy
        ctx.logit_map = logit_map
        # Backward runs outside the caller's autocast: record it here so the recomputed logits and
        # the two gradient matmuls run in the dtype forward's did (bf16 under the one-GPU backend's
        # autocast with fp32 weights; without this they ran as fp32 GEMMs, ~2x the step time).
        dev = hidden_TD.device.type
        ctx.autocast = (dev, torch.get_autocast_dtype(dev)) if torch.is_autocast_enabled(dev) else None
        ctx.mark_non_differentiable(lse_T)
        return logprobs_T, entropy_T

    @staticmethod
    def backward(ctx, grad_logprobs_T, grad_entropy_T):
        if ctx.autocast is None:
            return _ChunkedLogprobs._backward(ctx, grad_logprobs_T, grad_entropy_T)
        with torch.autocast(ctx.autocast[0], dtype=ctx.autocast[1]):
            return _ChunkedLogprobs._backward(ctx, grad_logprobs_T, grad_entropy_T)

    @staticmethod
    def _backward(ctx, grad_logprobs_T, grad_entropy_T):
        hidden_TD, weight_VD, targets_T, lse_T, entropy_T = ctx.saved_tensors
        tau, chunk_size = ctx.temperature, ctx.chunk_size
        use_entropy = ctx.with_entropy and grad_entropy_T is not None
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h_TD = torch.empty_like(hidden_TD) if need_h else None
        T = hidden_TD.shape[0]
        fused = ctx.fused
        # forward's log-softmax chunks, used once: backward overwrites them, and a second backward
        # (retain_graph) recomputes
        kept, ctx.kept = ctx.kept, None
        kept_p, ctx.kept_p = ctx.kept_p, None
        kept_z, ctx.kept_z = ctx.kept_z, None
        # the dtype the gradient GEMMs run in (autocast's, else the hidden states'): the logits' gradient
        # and the weight are cast to it once, not by autocast in every GEMM of every chunk
        gemm_dtype = ctx.autocast[1] if ctx.autocast is not None else hidden_TD.dtype
        weight_mm_VD = _in_gemm_dtype(weight_VD, hidden_TD)
        # the recomputed logits as forward's (fp32_product); the gradient GEMMs stay in the GEMM dtype
        weight_z_VD = fp32_logits_weight(weight_mm_VD, hidden_TD.device.type) if ctx.fp32 else weight_mm_VD
        # The CPU softmax form: the logits' gradient of every chunk goes into one [T, V] matrix (where
        # the head is small enough, in the memory its kept fp32 chunks free) and the weight's gradient is
        # one GEMM over it, not a 16-bit product per chunk cast and added into the fp32 [V, D] sum (a
        # CPU GEMM has no 16-bit product with an fp32 result)
        grad_z_TV = None
        V = weight_VD.shape[0]
        p_TV, ctx.p_TV = ctx.p_TV, None
        if ctx.softmax_form and fused is None and need_w and T * V * gemm_dtype.itemsize <= GRAD_LOGITS_MAX_BYTES:
            # forward's softmax buffer where it has the GEMM dtype (its chunks become the gradient in place)
            in_place = p_TV is not None and kept_p is not None and p_TV.dtype == gemm_dtype
            grad_z_TV = p_TV if in_place else hidden_TD.new_empty(T, V, dtype=gemm_dtype)
        grad_w_VD = torch.zeros_like(weight_VD, dtype=torch.float32) if need_w and grad_z_TV is None else None
        for i, s in enumerate(range(0, T, chunk_size)):
            e = min(s + chunk_size, T)
            zraw_CV = None
            if kept_z is not None:
                zraw_CV, kept_z[i] = kept_z[i], None
            # else forward's matmul again, so kept and recomputed logits give the same gradients
            elif kept is None and kept_p is None:
                zraw_CV = _mapped(_logits(hidden_TD[s:e], weight_z_VD, ctx.packed, ctx.fp32), ctx.logit_map)
            if fused is not None:
                g_C = grad_logprobs_T[s:e] if grad_logprobs_T is not None else lse_T.new_zeros(e - s)
                g_ent_C = grad_entropy_T[s:e] if use_entropy else g_C
                grad_z_CV = fused[1](
                    zraw_CV,
                    targets_T[s:e],
                    lse_T[s:e],
                    entropy_T[s:e] if use_entropy else g_C,
                    g_C,
                    g_ent_C,
                    1.0 / tau,
                    use_entropy,
                    *((ctx.logit_map.cap, ctx.logit_map.divisor) if ctx.logit_map is not None else ()),
                )
                del zraw_CV
                if grad_z_CV.dtype != gemm_dtype:  # float32 (or capped) logits give a float32 gradient
                    grad_z_CV = grad_z_CV.to(gemm_dtype)
                if need_h:
                    grad_h_TD[s:e] = grad_z_CV @ weight_mm_VD
                if need_w:
                    _add_weight_grad(grad_w_VD, grad_z_CV, hidden_TD[s:e])
                continue
            logp_CV = None  # the softmax form (no entropy) needs the softmax alone
            if kept_p is not None:
                p_CV, kept_p[i] = kept_p[i], None
            elif ctx.softmax_form:
                p_CV = _softmax(zraw_CV, tau)
            if not ctx.softmax_form:
                if kept is not None:
                    logp_CV, kept[i] = kept[i], None
                else:
                    logp_CV = _log_softmax(zraw_CV, tau)
                if kept_p is None:  # in place where logp is not read again
                    p_CV = logp_CV.exp() if use_entropy else logp_CV.exp_()
            # the map's derivative (1 - (c / cap)^2) / divisor from the capped logits c, before they go
            dcap_CV = None if ctx.logit_map is None else ctx.logit_map.derivative(zraw_CV)
            del zraw_CV  # a kept chunk's memory goes back as backward moves on
            g_C = grad_logprobs_T[s:e] if grad_logprobs_T is not None else lse_T.new_zeros(e - s)
            # d logp[target]/dz_j = onehot_j - p_j;  d H/dz_j = -p_j (logp_j + H)   (H = -sum p logp)
            # so dL/dz_j = g * onehot_j - p_j * (g + g_H * (logp_j + H)), built in place.
            if use_entropy:
                coef_CV = logp_CV.add_(entropy_T[s:e, None]).mul_(grad_entropy_T[s:e, None]).add_(g_C[:, None])
                grad_z_CV = p_CV.mul_(coef_CV).neg_()
            else:
                grad_z_CV = p_CV.mul_(-g_C[:, None])
            grad_z_CV.scatter_add_(-1, targets_T[s:e, None], g_C[:, None])
            if tau != 1.0:
                grad_z_CV /= tau
            if dcap_CV is not None:
                grad_z_CV.mul_(dcap_CV)
                del dcap_CV
            if grad_z_TV is not None:
                if grad_z_CV.data_ptr() != grad_z_TV[s:e].data_ptr():
                    grad_z_CV = grad_z_TV[s:e].copy_(grad_z_CV)
            else:
                grad_z_CV = grad_z_CV.to(gemm_dtype)  # once for both GEMMs (autocast would cast it in each)
            if need_h:
                grad_h_TD[s:e] = grad_z_CV @ weight_mm_VD
            if need_w and grad_z_TV is None:
                _add_weight_grad(grad_w_VD, grad_z_CV, hidden_TD[s:e])
        if grad_z_TV is not None:
            with torch.autocast(hidden_TD.device.type, enabled=False):
                grad_w_VD = grad_z_TV.t() @ hidden_TD.to(gemm_dtype)
        if need_w:
            grad_w_VD = grad_w_VD.to(weight_VD.dtype)
        return grad_h_TD, grad_w_VD, None, None, None, None, None


ShardedLogprobsFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, float, int, bool, LogitMap | None],
    tuple[torch.Tensor, torch.Tensor | None],
]
"""``(hidden_TD, weight_VD, targets_T, temperature, chunk_size, with_entropy, logit_map) -> (logprobs_T,
entropy_T)``."""

ShardedArgmaxFn = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
"""``(hidden_TD, weight_VD, chunk_size) -> argmax_T``."""

_SHARDED_WEIGHT_IMPLS: dict[Callable[[torch.Tensor], bool], ShardedLogprobsFn] = {}
_SHARDED_ARGMAX_IMPLS: dict[Callable[[torch.Tensor], bool], ShardedArgmaxFn] = {}


def register_sharded_weight(
    is_sharded: Callable[[torch.Tensor], bool], logprobs_fn: ShardedLogprobsFn, argmax_fn: ShardedArgmaxFn
) -> None:
    """Route ``logprobs_from_hidden`` / ``argmax_from_hidden`` calls whose output projection
    ``is_sharded`` (a distributed tensor, e.g. a vocabulary-sharded DTensor under tensor
    parallelism) to these functions. The training layer registers its implementation, so this
    module never imports torch.distributed; plain tensors always take the local path."""
    _SHARDED_WEIGHT_IMPLS[is_sharded] = logprobs_fn
    _SHARDED_ARGMAX_IMPLS[is_sharded] = argmax_fn


@torch.no_grad()
def argmax_from_hidden(hidden_TD: torch.Tensor, weight_VD: torch.Tensor, chunk_size: int = 2048) -> torch.Tensor:
    """Greedy token ids (int64 [T]) of ``hidden_TD @ weight_VD.T`` computed chunk by chunk (the first
    maximal id on ties, as ``torch.argmax``); no alignment shift, no gradient."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    for is_sharded, sharded_fn in _SHARDED_ARGMAX_IMPLS.items():
        if is_sharded(weight_VD):
            return sharded_fn(hidden_TD, weight_VD, int(chunk_size))
    parts = [
        (hidden_TD[s : s + chunk_size] @ weight_VD.t()).argmax(-1) for s in range(0, hidden_TD.shape[0], chunk_size)
    ]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=hidden_TD.device)


def logprobs_from_hidden(
    hidden_TD: torch.Tensor,
    weight_VD: torch.Tensor,
    targets_T: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 2048,
    *,
    with_entropy: bool = False,
    logit_map: LogitMap | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Row-wise ``log softmax(hidden_TD[t] @ weight_VD.T / temperature)[targets_T[t]]`` (fp32 [T]),
    and the entropy of each row's distribution when ``with_entropy``. ``logit_map``: the model's map of its
    logits (``LogitMap.of(config)``: Granite's divisor, Gemma 2's cap), applied before the temperature.
    Differentiable w.r.t. hidden and weight; no alignment shift is applied here."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to score log-probs, got {temperature}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    for is_sharded, sharded_fn in _SHARDED_WEIGHT_IMPLS.items():
        if is_sharded(weight_VD):
            return sharded_fn(
                hidden_TD,
                weight_VD,
                targets_T.long(),
                float(temperature),
                int(chunk_size),
                bool(with_entropy),
                logit_map,
            )
    logprobs_T, entropy_T = _ChunkedLogprobs.apply(
        hidden_TD, weight_VD, targets_T.long(), float(temperature), int(chunk_size), bool(with_entropy), logit_map
    )
    return logprobs_T, (entropy_T if with_entropy else None)


def position_ids_from_cu_seqlens(cu_seqlens_B1: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """int64 [T] positions restarting at 0 for each packed sequence, on ``device`` (default:
    cu_seqlens' device). With host ``cu_seqlens_B1`` and a CUDA ``device`` nothing waits on the GPU."""
    device = device if device is not None else cu_seqlens_B1.device
    starts_T = repeat_per_sequence(cu_seqlens_B1[:-1].to(device, non_blocking=True), cu_seqlens_B1)
    return torch.arange(starts_T.numel(), device=device, dtype=torch.long) - starts_T


def packed_logprobs(
    model: Decoder,
    input_ids_T: torch.Tensor,
    cu_seqlens_B1: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 2048,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (fp32 [T]) of every packed token given the earlier tokens of its sequence, 0 at
    each sequence's first token; entropies (fp32 [T], same alignment) when ``with_entropy``.

    Differentiable w.r.t. the model's parameters. Under FSDP the output projection must be
    unsharded when this runs (it is read after ``model(...)`` returns).
    """
    T = input_ids_T.numel()
    # Bounds are checked on a host copy (the backend passes host cu_seqlens: no GPU stall here).
    cu_host_B1 = cu_seqlens_B1.cpu()
    if int(cu_host_B1[-1]) != T or int(cu_host_B1[0]) != 0:
        raise ValueError(f"cu_seqlens_B1 must start at 0 and end at T={T}, got {cu_host_B1.tolist()}")
    max_len = int((cu_host_B1[1:] - cu_host_B1[:-1]).max()) if T else 0
    if max_len > model.config.max_seq_len:
        raise ValueError(
            f"a packed sequence has {max_len} tokens, more than the model's {model.config.positions_source}"
        )
    device = input_ids_T.device
    attn = PackedCausalAttention.for_model(cu_host_B1, model.config)
    position_ids_T = position_ids_from_cu_seqlens(cu_host_B1, device)
    hidden_TD = model(input_ids_T, position_ids_T, attn)
    # hidden[t] predicts token t+1; the prediction across a sequence boundary is zeroed below.
    lp, ent = logprobs_from_hidden(
        hidden_TD[:-1],
        model.output_weight,
        input_ids_T[1:],
        temperature,
        chunk_size,
        with_entropy=with_entropy,
        logit_map=LogitMap.of(model.config),
    )
    zero = lp.new_zeros(1)
    is_first_T = position_ids_T == 0
    logprobs_T = torch.where(is_first_T, 0.0, torch.cat([zero, lp]))
    entropy_T = torch.where(is_first_T, 0.0, torch.cat([zero, ent])) if ent is not None else None
    return logprobs_T, entropy_T
