"""The sparse mixture-of-experts block of the Qwen3-MoE, Mixtral, gpt-oss, GLM-4.5, Qwen2-MoE, GraniteMoE and OLMoE
layouts, plain PyTorch.

Module and parameter names equal transformers 5's in-memory ones (``mlp.gate.weight`` [E, D],
``mlp.experts.gate_up_proj`` [E, 2I, D], ``mlp.experts.down_proj`` [E, D, I]), for every layout;
``hf_io`` maps them to and from the per-expert names checkpoints store on disk (``expert_names``; GraniteMoE's
fused ``block_sparse_moe.input_linear`` / ``output_linear`` and ``router.layer``, renamed whole), and
``gpt_oss`` to gpt-oss's fused, interleaved ones (its router ``mlp.router``; biases on the router and the
experts, a clamped SwiGLU: ``ExpertGLU``). Qwen2-MoE adds a shared expert every token goes through
(``mlp.shared_expert``, a dense SwiGLU MLP the decoder builds and hands in) scaled by
``sigmoid(mlp.shared_expert_gate(x))`` ([1, D], no bias), added to the routed experts' sum.

Routing as transformers does it: softmax over the router logits in fp32, top-k, optionally
renormalised (``norm_topk_prob``; Mixtral, gpt-oss and GraniteMoE always: the latter two's softmax over
the top-k logits is that), cast to the activations' dtype. GLM-4.5's router (``SigmoidRouter``) scores by a
sigmoid and chooses within groups by a bias, its weights left in float32 (``SigmoidRouter.weights_dtype``): each
expert's output times its weight is rounded once, as transformers rounds it; its shared experts
(``mlp.shared_experts``, one dense SwiGLU MLP the decoder builds and hands in) add to the routed output, ungated.
The experts run
grouped (``grouped_experts``): the T·k (token, expert) pairs sorted by expert, then one GEMM per
expert over its contiguous rows, and one scatter-add back, instead of a pass over every token per expert.

Training extras, off unless asked:
- ``output_router_logits`` in the config: each block keeps its router logits of the last training
  forward, and ``take_aux_loss`` returns transformers' load-balancing loss over them (Switch
  Transformer eqs. 4-6, counted over every sparse layer's tokens together) and forgets them.
- ``record_routing(model)``: each block keeps the top-k expert ids of its forwards (``RoutingRecord``),
  to compare the routing of two forwards of the same tokens (``routing_mismatch``);
  ``RoutingMonitor`` does it per sequence for the training backend (old-policy vs training forward).
- ``RouteCapture``: the rollout engine's record of a forward's expert ids, stacked [T, L, K] int16
  (``areno.types.ROUTES_KEY`` on a trajectory's way to the trainer); ``replay_routes(model, routes_TLK)`` makes
  the blocks use those ids instead of their own top-k (routing replay), the gate weights taken from
  their own router softmax at the replayed ids, so the router still gets gradients.

Legend: T = tokens, D = hidden size, E = experts, K = top-k, I = expert width, N = T·K pairs,
L = sparse layers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from areno.models import compiled
from areno.models.config import GPT_OSS, GRANITEMOE, ModelConfig

ExpertDispatch = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(x [T, D], expert ids [T, K], weights [T, K], this rank's gate_up, this rank's down) -> [T, D]:
what a block whose experts are spread over ranks calls in place of its local experts (the training
side's all-to-all dispatch, ``areno.train.expert_parallel``)."""


class TopKRouter(nn.Module):
    """The router: ``weight`` [E, D] (HF ``gate.weight``), and ``bias`` [E] where ``expert_bias`` (gpt-oss's
    ``router.bias``)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.bias = nn.Parameter(torch.empty(config.num_experts)) if config.expert_bias else None
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(router logits [T, E], top-k weights [T, K] in x's dtype, top-k expert ids [T, K])."""
        logits_TE = F.linear(x_TD, self.weight, self.bias)
        probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
        weights_TK, experts_TK = torch.topk(probs_TE, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
        return logits_TE, weights_TK.to(x_TD.dtype), experts_TK

    def replayed(
        self, logits_TE: torch.Tensor, experts_TK: torch.Tensor, replay_TK: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, K] in ``dtype``, expert ids [T, K]) routing each token to ``replay_TK``'s experts
        (a row with a negative id keeps its own ``experts_TK``): the router's softmax gathered at
        those ids and renormalised as ``forward`` does, so gradients still reach the router."""
        replay_TK = replay_TK.to(experts_TK.device, torch.long)
        experts_TK = torch.where((replay_TK >= 0).all(-1, keepdim=True), replay_TK, experts_TK)
        weights_TK = torch.softmax(logits_TE, dim=-1, dtype=torch.float32).gather(-1, experts_TK)
        if self.norm_topk_prob:
            weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
        return weights_TK.to(dtype), experts_TK

    @staticmethod
    def weights_dtype(x_dtype: torch.dtype) -> torch.dtype:
        """The activations' dtype: transformers rounds these weights to it before the experts' products."""
        return x_dtype


class SigmoidRouter(nn.Module):
    """GLM-4.5's router (transformers' ``Glm4MoeTopkRouter``, DeepSeek-V3's rule): ``weight`` [E, D] and the
    buffer ``e_score_correction_bias`` [E] (set by the release's load balancing between steps, never by a
    gradient), both kept in float32 as transformers keeps them (``_keep_in_fp32_modules_strict``;
    ``float32_routers``), its logits computed in float32 whatever the model's dtype or autocast.

    Scores are the logits' sigmoid. The choice adds the bias to them, scores each of ``n_group`` groups by the
    sum of its two best, keeps the ``topk_group`` best groups and takes the top-k experts there; the weights
    are the chosen experts' *unbiased* scores, renormalised (``norm_topk_prob``, + 1e-20) and times
    ``routed_scaling_factor``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts, dtype=torch.float32))
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.scale = config.routed_scaling_factor

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(router logits [T, E], top-k weights [T, K], top-k expert ids [T, K]), the first two in float32."""
        with torch.autocast(x_TD.device.type, enabled=False):  # autocast would run the product in bf16
            logits_TE = F.linear(x_TD.float(), self.weight.float())
        scores_TE = logits_TE.sigmoid()
        choice_TE = scores_TE + self.e_score_correction_bias.float()
        T, E = choice_TE.shape
        if self.topk_group < self.n_group:  # only the best groups' experts may be chosen
            choice_TGe = choice_TE.view(T, self.n_group, E // self.n_group)
            group_TG = choice_TGe.topk(2, dim=-1).values.sum(-1)
            best_TG = torch.zeros_like(group_TG).scatter_(1, group_TG.topk(self.topk_group, dim=-1).indices, 1.0)
            choice_TE = choice_TGe.masked_fill(best_TG[..., None] == 0, float("-inf")).view(T, E)
        experts_TK = torch.topk(choice_TE, self.top_k, dim=-1).indices
        return logits_TE, self._weights(scores_TE, experts_TK), experts_TK

    def _weights(self, scores_TE: torch.Tensor, experts_TK: torch.Tensor) -> torch.Tensor:
        """The unbiased scores of ``experts_TK``, renormalised where ``norm_topk_prob``, times the scale (float32)."""
        weights_TK = scores_TE.gather(-1, experts_TK)
        if self.norm_topk_prob:
            weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
        return weights_TK * self.scale

    def replayed(
        self, logits_TE: torch.Tensor, experts_TK: torch.Tensor, replay_TK: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``TopKRouter.replayed`` for this router: the replayed ids' weights from its own sigmoid scores,
        renormalised and scaled as ``forward`` does, so gradients still reach ``weight``."""
        replay_TK = replay_TK.to(experts_TK.device, torch.long)
        experts_TK = torch.where((replay_TK >= 0).all(-1, keepdim=True), replay_TK, experts_TK)
        return self._weights(logits_TE.sigmoid(), experts_TK).to(dtype), experts_TK

    @staticmethod
    def weights_dtype(x_dtype: torch.dtype) -> torch.dtype:
        """float32: transformers multiplies each expert's output by these weights unrounded."""
        return torch.float32


def float32_routers(model: nn.Module) -> list[nn.Module]:
    """The routers of ``model`` whose tensors stay float32 in a 16-bit model (``SigmoidRouter``): FSDP2 gives
    them a float32 group of their own (``Decoder.float32_modules``)."""
    return [m for m in model.modules() if isinstance(m, SigmoidRouter)]


def keep_routers_float32(model: nn.Module) -> None:
    """Back to float32 the ``float32_routers`` a cast of the whole model took along (before their values
    are loaded: a cast and back would round them)."""
    for router in float32_routers(model):
        router.float()


def float32_names(config: ModelConfig) -> set[str]:
    """The state-dict names of the tensors a model of ``config`` keeps in float32 (``float32_routers``'),
    which a save in another dtype leaves in float32."""
    if config.router_scoring != "sigmoid":
        return set()
    return {
        f"model.layers.{i}.mlp.gate.{leaf}"
        for i in range(config.num_hidden_layers)
        if config.is_moe_layer(i)
        for leaf in ("weight", "e_score_correction_bias")
    }


class ExpertGLU:
    """The experts' gated activation of (gate, up): ``silu(gate) * up``, or with ``limit`` gpt-oss's
    clamped form ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, g = ``gate`` clamped to at most
    ``limit`` (transformers' ``GptOssExperts._apply_gate``)."""

    def __init__(self, limit: float | None = None, alpha: float = 1.0) -> None:
        self.limit = limit
        self.alpha = alpha

    @classmethod
    def of(cls, config: ModelConfig) -> ExpertGLU:
        return cls(config.swiglu_limit, config.swiglu_alpha)

    def __call__(self, gate_NI: torch.Tensor, up_NI: torch.Tensor) -> torch.Tensor:
        if self.limit is None:
            return F.silu(gate_NI) * up_NI
        g = gate_NI.clamp(max=self.limit)
        return (up_NI.clamp(-self.limit, self.limit) + 1) * (g * torch.sigmoid(g * self.alpha))


SILU_GLU = ExpertGLU()


class Experts(nn.Module):
    """E SwiGLU experts stored as two 3-D tensors: ``gate_up_proj`` [E, 2I, D] (gate rows, then
    up rows) and ``down_proj`` [E, D, I]; with ``expert_bias`` (gpt-oss) their biases
    ``gate_up_proj_bias`` [E, 2I] and ``down_proj_bias`` [E, D], the latter weighted with its expert's
    output by the routing weight, as transformers adds it."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        e, d, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, d))
        self.down_proj = nn.Parameter(torch.empty(e, d, i))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i)) if config.expert_bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(e, d)) if config.expert_bias else None
        self.glu = ExpertGLU.of(config)

    @property
    def biases(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(gate/up bias [E, 2I], down bias [E, D]), or None for experts without biases."""
        return None if self.gate_up_proj_bias is None else (self.gate_up_proj_bias, self.down_proj_bias)

    def forward(self, x_TD: torch.Tensor, experts_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        args = (x_TD, experts_TK, weights_TK, self.gate_up_proj, self.down_proj)
        extra = dict(biases=self.biases, glu=self.glu)
        if _grouped_mm_fits(x_TD, self.down_proj):
            # a GPU with grouped GEMMs (training too: they have a backward): one kernel per projection, no host read
            return grouped_mm_experts(*args, **extra)
        if x_TD.is_cuda and torch.cuda.is_current_stream_capturing():
            # a CUDA graph cannot hold the grouped path's host read of the per-expert counts
            return naive_experts(*args, **extra)
        if torch.compiler.is_compiling():
            # eager inside a compiled layer: its per-expert counts, read on the host, would specialise the layer's
            # graph on every count (a recompile per layer and batch, then eager layers past dynamo's limit)
            return compiled.call(grouped_experts, *args, **extra)
        return grouped_experts(*args, **extra)


def grouped_experts(
    x_TD: torch.Tensor,
    experts_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    gate_up_EnD: torch.Tensor,
    down_EDI: torch.Tensor,
    *,
    first_expert: int = 0,
    biases: tuple[torch.Tensor, torch.Tensor] | None = None,
    glu: ExpertGLU = SILU_GLU,
) -> torch.Tensor:
    """Σ_k weights[t, k] · expert_{experts[t, k]}(x[t]) for every token, experts grouped: the (token,
    expert) pairs are sorted by expert and each expert multiplies its contiguous rows in one GEMM.
    ``gate_up_EnD`` / ``down_EDI`` may hold a slice of the experts starting at ``first_expert``
    (expert parallelism); pairs routed elsewhere contribute nothing. ``biases``: ``Experts.biases`` of
    the same experts; ``glu``: their activation."""
    T, D = x_TD.shape
    n_local = gate_up_EnD.shape[0]
    flat_N = experts_TK.reshape(-1) - first_expert
    order_N = torch.argsort(flat_N, stable=True)
    token_N = order_N // experts_TK.shape[1]
    counts = torch.bincount(flat_N.clamp(-1, n_local).add(1), minlength=n_local + 2).tolist()  # one host read
    x_ND = x_TD[token_N]
    # pieces joined by one cat (a write per expert into one buffer would copy the whole gradient per expert)
    pieces = [x_ND.new_zeros(counts[0], D)]  # pairs of experts below this slice sort first
    # unbind once: indexing expert e's weight E times would build E full-size zero gradients
    gate_ups, downs = gate_up_EnD.unbind(0), down_EDI.unbind(0)
    gate_up_bs, down_bs = (None,) * n_local, (None,) * n_local
    if biases is not None:
        gate_up_bs, down_bs = biases[0].unbind(0), biases[1].unbind(0)
    start = counts[0]
    for e in range(n_local):
        n = counts[e + 1]
        if n:
            gate_NI, up_NI = F.linear(x_ND[start : start + n], gate_ups[e], gate_up_bs[e]).chunk(2, dim=-1)
            pieces.append(F.linear(glu(gate_NI, up_NI), downs[e], down_bs[e]))
        start += n
    pieces.append(x_ND.new_zeros(counts[-1], D))
    out_ND = torch.cat(pieces)
    out_ND = (out_ND * weights_TK.reshape(-1)[order_N, None]).to(x_TD.dtype)
    return x_TD.new_zeros(T, D).index_add_(0, token_N, out_ND)


def grouped_mm_experts(
    x_TD: torch.Tensor,
    experts_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    gate_up_EnD: torch.Tensor,
    down_EDI: torch.Tensor,
    *,
    biases: tuple[torch.Tensor, torch.Tensor] | None = None,
    glu: ExpertGLU = SILU_GLU,
) -> torch.Tensor:
    """``grouped_experts`` through ``torch._grouped_mm``: the pairs sorted by expert, each projection
    one grouped GEMM over per-expert row offsets computed on the device (no host read, so a CUDA
    graph can hold it). Where ``_grouped_mm_fits``; differentiable."""
    T, D = x_TD.shape
    flat_N = experts_TK.reshape(-1)
    order_N = torch.argsort(flat_N, stable=True)
    token_N = order_N // experts_TK.shape[1]
    counts_E = torch.zeros(gate_up_EnD.shape[0], dtype=torch.long, device=x_TD.device)
    offsets_E = counts_E.scatter_add_(0, flat_N, torch.ones_like(flat_N)).cumsum(0).to(torch.int32)
    gate_up_Nn = torch._grouped_mm(x_TD[token_N], gate_up_EnD.transpose(-2, -1), offs=offsets_E)
    if biases is not None:  # each pair's expert's bias, gathered in the sorted order
        expert_N = flat_N[order_N]
        gate_up_Nn = gate_up_Nn + biases[0][expert_N]
    gate_NI, up_NI = gate_up_Nn.chunk(2, dim=-1)
    out_ND = torch._grouped_mm(glu(gate_NI, up_NI).contiguous(), down_EDI.transpose(-2, -1), offs=offsets_E)
    if biases is not None:
        out_ND = out_ND + biases[1][expert_N]
    out_ND = (out_ND * weights_TK.reshape(-1)[order_N, None]).to(x_TD.dtype)
    return x_TD.new_zeros(T, D).index_add_(0, token_N, out_ND)


def _grouped_mm_fits(x_TD: torch.Tensor, down_EDI: torch.Tensor) -> bool:
    """Whether ``grouped_mm_experts`` runs here (``grouped_mm_serves`` for ``x_TD``'s dtype and device)."""
    return grouped_mm_serves(x_TD.dtype, x_TD.device, down_EDI)


def grouped_mm_serves(dtype: torch.dtype, device: torch.device, down_EDI: torch.Tensor) -> bool:
    """Whether ``grouped_mm_experts`` serves activations of ``dtype`` on ``device`` for the experts of
    ``down_EDI``: bf16 on a Hopper-or-newer GPU, rows a multiple of 16 bytes (the kernel's requirements)."""
    _, D, width = down_EDI.shape
    return (
        device.type == "cuda"
        and dtype == torch.bfloat16
        and down_EDI.dtype == torch.bfloat16
        and D % 8 == 0
        and width % 8 == 0
        and torch.cuda.get_device_capability(device)[0] >= 9
    )


def naive_experts(
    x_TD: torch.Tensor,
    experts_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    gate_up_EnD: torch.Tensor,
    down_EDI: torch.Tensor,
    *,
    biases: tuple[torch.Tensor, torch.Tensor] | None = None,
    glu: ExpertGLU = SILU_GLU,
) -> torch.Tensor:
    """The reference the grouped path is measured against: every expert over every token, masked by
    its routing weight (E dense MLPs' worth of work)."""
    out_TD = torch.zeros_like(x_TD)
    for e, (gate_up_nD, down_DI) in enumerate(zip(gate_up_EnD.unbind(0), down_EDI.unbind(0))):
        w_T = (weights_TK * (experts_TK == e)).sum(-1)
        b_gate_up, b_down = (None, None) if biases is None else (biases[0][e], biases[1][e])
        gate_TI, up_TI = F.linear(x_TD, gate_up_nD, b_gate_up).chunk(2, dim=-1)
        out_TD = out_TD + (w_T[:, None] * F.linear(glu(gate_TI, up_TI), down_DI, b_down)).to(x_TD.dtype)
    return out_TD


class RoutingRecord:
    """The top-k expert ids [T, K] of each sparse layer's forwards while recording, in call order:
    the router's own choice (``experts``) and, under routing replay, the experts used (``used``)."""

    def __init__(self) -> None:
        self.experts: dict[int, list[torch.Tensor]] = {}
        self.used: dict[int, list[torch.Tensor]] = {}

    def add(self, layer_idx: int, experts_TK: torch.Tensor, used_TK: torch.Tensor | None = None) -> None:
        self.experts.setdefault(layer_idx, []).append(experts_TK.detach().to("cpu"))
        if used_TK is not None:
            self.used.setdefault(layer_idx, []).append(used_TK.detach().to("cpu"))

    def stacked(self, used: bool = False) -> torch.Tensor:
        """[T, L, K] of one recorded forward (layers in order); ``used``: the experts used."""
        per_layer = self.used if used else self.experts
        return torch.stack([torch.cat(per_layer[i]) for i in sorted(per_layer)], dim=1)

    def per_layer(self) -> dict[int, torch.Tensor]:
        """Layer -> [T_total, K] over the recorded forwards, concatenated."""
        return {layer: torch.cat(parts) for layer, parts in self.experts.items()}


class RouteCapture:
    """The rollout engine's record of its forwards' expert ids: each sparse layer adds its top-k of
    the current forward (on the device, int16), ``take`` stacks them [T, L, K] in layer order."""

    def __init__(self) -> None:
        self._experts: dict[int, torch.Tensor] = {}

    def add(self, layer_idx: int, experts_TK: torch.Tensor, used_TK: torch.Tensor | None = None) -> None:
        self._experts[layer_idx] = experts_TK.to(torch.int16)

    def take(self) -> torch.Tensor:
        """[T, L, K] of the forward since the last ``take``, and forget it."""
        routes_TLK = torch.stack([self._experts[i] for i in sorted(self._experts)], dim=1)
        self._experts = {}
        return routes_TLK


class SparseMoE(nn.Module):
    """The block in place of the dense MLP: ``gate`` (the router), ``experts`` and, where the layout has them,
    ``shared_experts`` (a dense MLP module of x [T, D] -> [T, D]: GLM-4.5's, ungated); with ``shared_expert`` (one:
    Qwen2-MoE's) also that expert on every token, times ``sigmoid(shared_expert_gate(x))``, added to the routed sum
    as transformers' ``Qwen2MoeSparseMoeBlock`` adds it."""

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        *,
        shared_expert: nn.Module | None = None,
        shared_experts: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_experts = config.num_experts
        self.keep_router_logits = config.output_router_logits
        self.aux_loss_coef = config.router_aux_loss_coef
        self.gate = SigmoidRouter(config) if config.router_scoring == "sigmoid" else TopKRouter(config)
        self.experts = Experts(config)
        self.shared_experts = shared_experts
        """GLM-4.5's shared experts (a dense SwiGLU MLP of ``moe_intermediate_size * n_shared_experts``), or None."""
        self.shared_expert = shared_expert
        """Qwen2-MoE's shared expert (a dense SwiGLU MLP of ``shared_expert_intermediate_size``), or None."""
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False) if shared_expert is not None else None
        """The shared expert's scalar gate per token, through a sigmoid (no bias, as transformers builds it)."""
        self.router_logits_TE: torch.Tensor | None = None
        """Router logits of the last training forward (kept when ``output_router_logits``)."""
        self.record: RoutingRecord | RouteCapture | None = None
        """Set by ``record_routing`` (or the rollout engine): where forwards put their expert ids."""
        self.replay_TK: torch.Tensor | None = None
        """Set by ``replay_routes``: the expert ids [T, K] the next forwards use (-1 rows: their own)."""
        self.dispatch: ExpertDispatch | None = None
        """Set under expert parallelism: ``experts`` holds this rank's slice and tokens travel to the others."""

    @torch.no_grad()
    def reset_parameters(self, std: float) -> None:
        for p in (self.gate.weight, self.experts.gate_up_proj, self.experts.down_proj):
            p.normal_(0.0, std)
        if isinstance(self.gate, SigmoidRouter):  # transformers' init: no correction before balancing
            self.gate.e_score_correction_bias.zero_()
        elif self.gate.bias is not None:  # transformers' init of GptOssTopKRouter.bias
            self.gate.bias.normal_(0.0, std)
        for b in self.experts.biases or ():
            b.zero_()

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        logits_TE, weights_TK, experts_TK = self.gate(x_TD)
        # a float32 router's input may be float32 (FSDP2's float32 group casts it), its weights then too
        weights_dtype = self.gate.weights_dtype(x_TD.dtype)
        weights_TK = weights_TK.to(weights_dtype)
        if self.keep_router_logits and self.training and torch.is_grad_enabled():
            self.router_logits_TE = logits_TE
        if self.replay_TK is not None:
            own_TK = experts_TK
            weights_TK, experts_TK = self.gate.replayed(logits_TE, experts_TK, self.replay_TK, weights_dtype)
            if self.record is not None:  # the router's own choice, and the experts the tokens went to
                self._record(own_TK, experts_TK)
        elif self.record is not None:
            self._record(experts_TK)
        if self.dispatch is not None:
            # expert parallelism refuses biased or clamped experts (``areno.train.expert_parallel``)
            out_TD = self.dispatch(x_TD, experts_TK, weights_TK, self.experts.gate_up_proj, self.experts.down_proj)
        else:
            out_TD = self.experts(x_TD, experts_TK, weights_TK)
        if self.shared_experts is not None:
            out_TD = out_TD + self.shared_experts(x_TD)
        if self.shared_expert is not None:  # in the model dtype, as transformers gates and adds it
            out_TD = out_TD + torch.sigmoid(self.shared_expert_gate(x_TD)) * self.shared_expert(x_TD)
        return out_TD

    def _record(self, experts_TK: torch.Tensor, used_TK: torch.Tensor | None = None) -> None:
        if torch.compiler.is_compiling():
            # eager inside a compiled layer: a read of ``layer_idx`` and of the record's contents would specialise
            # the layer's graph on each layer (a recompile per layer, then eager layers past dynamo's limit)
            compiled.call(_record_routes, self, experts_TK, used_TK)
        else:
            _record_routes(self, experts_TK, used_TK)


def _record_routes(block: SparseMoE, experts_TK: torch.Tensor, used_TK: torch.Tensor | None) -> None:
    block.record.add(block.layer_idx, experts_TK, used_TK=used_TK)


def sparse_blocks(model: nn.Module) -> list[SparseMoE]:
    """The sparse expert blocks of a decoder (empty for a dense one)."""
    return [m for m in model.modules() if isinstance(m, SparseMoE)]


def load_balancing_loss(logits_TE: list[torch.Tensor], num_experts: int, top_k: int) -> torch.Tensor:
    """transformers' ``load_balancing_loss_func`` without padding: E · Σ_e f_e · P_e, where f_e is the
    share of top-k slots routed to expert e and P_e its mean router probability, both over every
    layer's tokens together."""
    probs_TE = torch.softmax(torch.cat(logits_TE).float(), dim=-1)
    experts_TK = torch.topk(probs_TE, top_k, dim=-1).indices
    f_E = F.one_hot(experts_TK, num_experts).sum(dim=(0, 1)).float() / probs_TE.shape[0]
    return num_experts * torch.sum(f_E * probs_TE.mean(dim=0))


def take_aux_loss(model: nn.Module | list[SparseMoE]) -> torch.Tensor | None:
    """``router_aux_loss_coef`` x the load-balancing loss of the router logits kept by the last
    training forward (``output_router_logits``), and forget them; None when nothing was kept.
    ``model``: the decoder (or wrapper), or its ``sparse_blocks``."""
    blocks = model if isinstance(model, list) else sparse_blocks(model)
    blocks = [b for b in blocks if b.router_logits_TE is not None]
    if not blocks:
        return None
    logits = [b.router_logits_TE for b in blocks]
    for b in blocks:
        b.router_logits_TE = None
    first = blocks[0]
    return first.aux_loss_coef * load_balancing_loss(logits, first.num_experts, first.gate.top_k)


@contextmanager
def record_routing(model: nn.Module) -> Iterator[RoutingRecord]:
    """Within the block, every sparse layer of ``model`` puts the top-k expert ids of each forward
    into the yielded record."""
    record = RoutingRecord()
    blocks = sparse_blocks(model)
    for b in blocks:
        b.record = record
    try:
        yield record
    finally:
        for b in blocks:
            b.record = None


@contextmanager
def replay_routes(model: nn.Module, routes_TLK: torch.Tensor) -> Iterator[None]:
    """Within the block, the forwards of ``model`` (over the same T tokens) route each token to
    ``routes_TLK``'s experts in each sparse layer (the l-th sparse block takes ``[:, l]``); tokens
    whose row holds -1 keep their own top-k."""
    blocks = sparse_blocks(model)
    assert routes_TLK.shape[1] == len(blocks), "routes of another model"
    for i, b in enumerate(blocks):
        b.replay_TK = routes_TLK[:, i]
    try:
        yield
    finally:
        for b in blocks:
            b.replay_TK = None


def route_mismatch_pairs(a_TLK: torch.Tensor, b_TLK: torch.Tensor, mask_T: torch.Tensor) -> tuple[int, int]:
    """(pairs whose top-k expert set differs, pairs compared) over the (token, sparse layer) pairs of
    the tokens in ``mask_T`` where ``a_TLK`` holds a route (no -1)."""
    b_TLK = b_TLK.to(a_TLK.device)
    keep_TL = (a_TLK >= 0).all(-1) & mask_T.to(a_TLK.device)[:, None]
    differ_TL = (a_TLK.sort(-1).values != b_TLK.to(a_TLK.dtype).sort(-1).values).any(-1)
    return int((differ_TL & keep_TL).sum()), int(keep_TL.sum())


def routing_mismatch(a: RoutingRecord, b: RoutingRecord) -> float:
    """The fraction of (token, sparse layer) pairs whose top-k expert *set* differs between two
    records of forwards over the same tokens in the same order."""
    la, lb = a.per_layer(), b.per_layer()
    assert la.keys() == lb.keys(), "records of different models"
    differ = total = 0
    for layer, ea_TK in la.items():
        eb_TK = lb[layer]
        assert ea_TK.shape == eb_TK.shape, "records of different tokens"
        differ += int((ea_TK.sort(-1).values != eb_TK.sort(-1).values).any(-1).sum())
        total += ea_TK.shape[0]
    return differ / total if total else 0.0


class RoutingMonitor:
    """Routing mismatch of a decoder's training forwards against its old-policy routing, per step.

    The reference routing of a sequence is its first forward in the step: the no-grad forward a
    step starts with when the recipe runs one (``reference``, e.g. recomputed old or proximal
    log-probs), else its first training forward of the step (the weights the step started from).
    Each later training forward of the sequence (a second pass, a later minibatch after an optimizer
    step) counts the (token, sparse layer) pairs whose top-k expert *set* differs from the reference.
    Sequences are keyed by their token ids (a later pass may reorder them); a step is told apart by
    the policy version its batch carries (``begin_step``).

    Given the rollout engine's routes (``train.moe_rollout_routes``), ``compare`` also counts the
    training forward's routing against the rollout's, and with ``replay`` makes it use them. With one pass, one minibatch and no
    recomputed old log-probs no sequence is forwarded twice and nothing is reported.
    A dense decoder has no sparse blocks and every method does nothing."""

    def __init__(self, model: nn.Module) -> None:
        self.blocks = sparse_blocks(model)
        self._model = model
        self._reference: dict[bytes, dict[int, torch.Tensor]] = {}
        self._version: int | None = None
        self._from_forward = False
        self.replay = False
        """Routing replay (``train.moe_routing_replay``): forwards over a batch carrying the rollout's
        routes use them."""

    def __bool__(self) -> bool:
        return bool(self.blocks)

    @contextmanager
    def reference(self, ids_T: torch.Tensor, cu_B1: torch.Tensor) -> Iterator[None]:
        """Record the wrapped (old-policy, no-grad) forward's routing as the reference of its sequences."""
        if not self.blocks:
            yield
            return
        if not self._from_forward:  # the first forward of a new step: drop the last step's routing
            self._reference, self._from_forward = {}, True
        with record_routing(self._model) as record:
            yield
        self._reference.update(_per_sequence(record, ids_T, cu_B1))

    def begin_step(self, version: int | None) -> None:
        """A training step over a batch of policy ``version`` (None: unknown) begins; a new version
        drops the reference, unless this step's old-policy forward has just recorded it."""
        if self._from_forward or version != self._version:
            if not self._from_forward:
                self._reference = {}
            self._version, self._from_forward = version, False

    @contextmanager
    def replaying(self, routes_TLK: torch.Tensor | None) -> Iterator[None]:
        """The wrapped forward routes as the rollout did (``replay_routes``) when ``self.replay`` is
        set and the batch carries the rollout's routes. Wrap the backward too: a block whose forward
        activation checkpointing recomputes there must route the same way."""
        if not self.replay or routes_TLK is None:
            yield
            return
        with replay_routes(self._model, routes_TLK):
            yield

    @contextmanager
    def compare(
        self,
        ids_T: torch.Tensor,
        cu_B1: torch.Tensor,
        counts: list[int],
        routes_TLK: torch.Tensor | None = None,
        loss_mask_T: torch.Tensor | None = None,
    ) -> Iterator[None]:
        """Add to ``counts`` ([differing pairs, compared pairs] of the old-policy comparison, then the
        same of the rollout comparison, then replayed pairs equal to the rollout's) the wrapped
        training forward's routing against the reference; sequences without one take this forward's
        as theirs (when the step's version is known). With the rollout's ``routes_TLK``: its router's
        own top-k against them, at the positions whose forward predicts a loss token of
        ``loss_mask_T`` (the forwards that produced the behaviour log-probs); under ``replaying``, also
        the pairs whose experts used equal the rollout's."""
        against_rollout = bool(self.blocks) and routes_TLK is not None
        if not against_rollout and (not self.blocks or (self._version is None and not self._reference)):
            yield
            return
        with record_routing(self._model) as record:
            yield
        if against_rollout:
            assert loss_mask_T is not None
            predicts_T = torch.roll(loss_mask_T, -1)  # a sequence's first token is never a loss token
            differ, pairs = route_mismatch_pairs(routes_TLK, record.stacked(), predicts_T)
            counts[2] += differ
            counts[3] += pairs
            if self.replay:
                differ_used, _ = route_mismatch_pairs(routes_TLK, record.stacked(used=True), predicts_T)
                counts[4] += pairs - differ_used
        if self._version is None and not self._reference:
            return
        for key, per_layer in _per_sequence(record, ids_T, cu_B1):
            ref = self._reference.get(key)
            if ref is None:
                if self._version is not None:
                    self._reference[key] = per_layer
                continue
            for layer, experts_TK in per_layer.items():
                counts[0] += int((experts_TK.sort(-1).values != ref[layer].sort(-1).values).any(-1).sum())
                counts[1] += experts_TK.shape[0]


def _per_sequence(
    record: RoutingRecord, ids_T: torch.Tensor, cu_B1: torch.Tensor
) -> Iterator[tuple[bytes, dict[int, torch.Tensor]]]:
    """(the sequence's token ids as bytes, layer -> its [n, K] expert ids) for each sequence of one
    recorded forward over the packed ``ids_T``."""
    per_layer = record.per_layer()
    ids = ids_T.detach().to("cpu")
    cu = cu_B1.tolist()
    for b in range(len(cu) - 1):
        rows = slice(cu[b], cu[b + 1])
        yield ids[rows].numpy().tobytes(), {layer: e[rows] for layer, e in per_layer.items()}


# ------------------------------------------------------------------------------ checkpoint names
def expert_names(config: ModelConfig, layer_idx: int) -> dict[str, list[tuple[str, int, slice]]]:
    """For one sparse layer: in-memory fused name -> [(on-disk per-expert name, expert, rows of the
    fused tensor's dim 1)], as transformers saves them (Qwen3-MoE, OLMoE: ``mlp.experts.{e}.gate_proj``,
    Mixtral: ``block_sparse_moe.experts.{e}.w1`` (gate), ``w3`` (up), ``w2`` (down)); GraniteMoE stores
    them fused as held, renamed (expert -1: the whole tensor): ``block_sparse_moe.input_linear`` [E, 2I, D]
    (its first I rows the gate, as transformers chunks it) and ``output_linear`` [E, D, I]."""
    i = config.moe_intermediate_size
    prefix = f"model.layers.{layer_idx}."
    if config.architecture == GRANITEMOE:
        disk = f"{prefix}block_sparse_moe"
        return {
            f"{prefix}mlp.experts.gate_up_proj": [(f"{disk}.input_linear.weight", -1, slice(None))],
            f"{prefix}mlp.experts.down_proj": [(f"{disk}.output_linear.weight", -1, slice(None))],
        }
    if config.architecture == "MixtralForCausalLM":
        disk, gate, up, down = f"{prefix}block_sparse_moe.experts", "w1", "w3", "w2"
    else:
        disk, gate, up, down = f"{prefix}mlp.experts", "gate_proj", "up_proj", "down_proj"
    full = slice(None)
    return {
        f"{prefix}mlp.experts.gate_up_proj": [
            entry
            for e in range(config.num_experts)
            for entry in (
                (f"{disk}.{e}.{gate}.weight", e, slice(0, i)),
                (f"{disk}.{e}.{up}.weight", e, slice(i, 2 * i)),
            )
        ],
        f"{prefix}mlp.experts.down_proj": [(f"{disk}.{e}.{down}.weight", e, full) for e in range(config.num_experts)],
    }


def router_disk_name(config: ModelConfig, layer_idx: int) -> str:
    """The router's on-disk name (Mixtral keeps it under ``block_sparse_moe``, GraniteMoE as
    ``block_sparse_moe.router.layer``)."""
    if config.architecture == GRANITEMOE:
        return f"model.layers.{layer_idx}.block_sparse_moe.router.layer.weight"
    block = "block_sparse_moe" if config.architecture == "MixtralForCausalLM" else "mlp"
    return f"model.layers.{layer_idx}.{block}.gate.weight"


def disk_to_memory(config: ModelConfig) -> dict[str, tuple[str, int, slice]]:
    """On-disk per-expert / router name -> (in-memory name, expert (-1: the whole tensor), rows); empty
    for gpt-oss, whose checkpoints store experts fused (``gpt_oss`` maps them)."""
    out: dict[str, tuple[str, int, slice]] = {}
    if config.architecture == GPT_OSS:
        return out
    for layer in range(config.num_hidden_layers):
        if not config.is_moe_layer(layer):
            continue
        for fused, parts in expert_names(config, layer).items():
            for disk, e, rows in parts:
                out[disk] = (fused, e, rows)
        out[router_disk_name(config, layer)] = (f"model.layers.{layer}.mlp.gate.weight", -1, slice(None))
    return out


def to_disk_state(config: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A decoder state dict with each fused expert tensor split into transformers' per-expert
    on-disk names (GraniteMoE's renamed whole; Mixtral's and GraniteMoE's routers renamed); dense tensors
    unchanged, order kept."""
    mapping = disk_to_memory(config)
    by_memory: dict[str, list[tuple[str, int, slice]]] = {}
    for disk, (mem, e, rows) in mapping.items():
        by_memory.setdefault(mem, []).append((disk, e, rows))
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name not in by_memory:
            out[name] = t
            continue
        for disk, e, rows in by_memory[name]:
            out[disk] = t if e < 0 else t[e, rows].contiguous()
    return out


def to_memory_items(config: ModelConfig, items: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The inverse of ``to_disk_state`` over ``(name, tensor)`` pairs read from a checkpoint: each
    fused expert tensor stacked from its per-expert parts, the router renamed, other tensors as they
    are. A fused tensor with parts missing is left out, so a completeness check names it."""
    mapping = disk_to_memory(config)
    if not mapping:
        return list(items)
    out: list[tuple[str, torch.Tensor]] = []
    parts: dict[str, list[tuple[int, slice, torch.Tensor]]] = {}
    for name, t in items:
        if name not in mapping:
            out.append((name, t))
            continue
        mem, e, rows = mapping[name]
        if e < 0:
            out.append((mem, t))
        else:
            parts.setdefault(mem, []).append((e, rows, t))
    wanted: dict[str, int] = {}
    for mem, e, _ in mapping.values():
        if e >= 0:
            wanted[mem] = wanted.get(mem, 0) + 1
    for mem, got in parts.items():
        if len(got) != wanted[mem]:
            continue
        first = got[0][2]
        num_rows = max(t.shape[0] if rows.stop is None else rows.stop for _, rows, t in got)
        fused = first.new_empty((config.num_experts, num_rows, *first.shape[1:]))
        for e, rows, t in got:
            fused[e, rows] = t
        out.append((mem, fused))
    return out
