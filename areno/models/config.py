"""``ModelConfig``: the one description of a Llama-family decoder, read from and written to a Hugging
Face ``config.json``.

Supported architectures (``architectures[0]`` in ``config.json``) and what sets them apart:

- ``LlamaForCausalLM``   optional bias on q/k/v/o (``attention_bias``), optional MLP bias, Llama 3
  RoPE scaling (``rope_scaling.rope_type == "llama3"``) or linear scaling.
- ``Qwen2ForCausalLM``   bias on q/k/v (always), none on o_proj.
- ``Qwen3ForCausalLM``   RMSNorm over head_dim on q and k before RoPE (``qk_norm``); optional q/k/v/o bias.
- ``MistralForCausalLM`` no bias; an optional sliding attention window applied in every layer.
- ``Ministral3ForCausalLM`` Mistral's layers whose queries are scaled by their position past the YaRN
  context (``query_position_scale``: transformers' ``llama_4_scaling_beta``).
- ``Qwen3MoeForCausalLM`` Qwen3's attention; a sparse mixture-of-experts block (``areno.models.moe``) in
  place of the MLP in the layers ``decoder_sparse_step`` / ``mlp_only_layers`` select; ``norm_topk_prob``.
- ``MixtralForCausalLM`` Mistral's attention; a sparse mixture-of-experts block in every layer, top-k
  weights always renormalised.
- ``Phi3ForCausalLM``    Llama's layers with no bias and an optional sliding window in every layer; its
  checkpoints store q/k/v and gate/up packed (``packed_projections``). LongRoPE and partial rotary
  embeddings (Phi-3-128k, Phi-3.5, Phi-4-mini) are refused; Phi-3-4k, Phi-3-medium and Phi-4 load.
- ``SmolLM3ForCausalLM`` Llama's layers with no RoPE in every ``no_rope_layer_interval``-th layer
  (``nope_layers``, from config.json's ``no_rope_layers``).
- ``Glm4ForCausalLM``    half of each head turned by adjacent pairs (``rope_interleaved``), norms around each
  block under GLM's names, q/k/v biases, gate/up packed on disk.
- ``Ernie4_5ForCausalLM`` (Ernie 4.5 dense) Llama's layers with a bias on every projection or none
  (``use_bias``) and RoPE turning adjacent pairs over the whole head in float32 (``rope_in_float32``).
- ``Exaone4ForCausalLM`` (EXAONE 4.0) OLMo 2's norms after each block (in the model dtype) with Qwen3's
  per-head q/k norms; where a window is set (``sliding_window``, with ``layer_types`` or
  ``sliding_window_pattern``), only the window layers turn by RoPE, the full ones none (``nope_layers``).
- ``Olmo2ForCausalLM``   RMSNorm over the whole q and k projections (``qk_norm_scope="projection"``) and
  each block's norm on its output, before the residual add (``norm_layout="post"``); optional q/k/v/o bias.
- ``Olmo3ForCausalLM``   OLMo 2's layers with a sliding window in some layers (``window_layers``) and a RoPE
  per layer type (``window_rope``: the long-context scaling on the full-attention layers only).
- ``OlmoeForCausalLM``   (OLMoE) Llama's pre-norm layers (every norm in the model dtype) with OLMo 2's q/k norms
  over the whole projections, q, k and v optionally clamped after them (``clip_qkv``), q/k/v/o biased or not
  together; an expert block in every layer, of ``intermediate_size``-wide experts, top-k weights renormalised
  only with ``norm_topk_prob``; its transformers class computes no router z-loss, nor does areno.
- ``Gemma3ForCausalLM``  (Gemma 3's text model) norms before and after each block (``norm_layout="sandwich"``)
  whose weights are offsets from 1 (``norm_weight_offset``), Qwen3's q/k norms, embeddings scaled by
  sqrt(hidden_size), the tanh GELU, ``query_pre_attn_scalar``, windows in five layers of six with their
  own RoPE base; logit soft-capping and bidirectional attention are refused.
- ``Gemma2ForCausalLM``  (Gemma 2) Gemma 3's layers without q/k norms, a window in every other layer and one
  RoPE for all; attention scores and final logits soft-capped (``attn_logit_softcapping``,
  ``final_logit_softcapping``: ``cap * tanh(x / cap)``).
- ``GraniteForCausalLM`` (IBM Granite 3) Llama's layers and four scalars: embeddings times
  ``embedding_multiplier``, ``attention_multiplier`` as the softmax's scale, each block's output times
  ``residual_multiplier`` before its residual add, and final logits divided by ``logits_scaling``.
- ``Glm4MoeForCausalLM`` (GLM-4.5, GLM-4.5-Air, GLM-4.6) Llama's pre-norm layers with q/k/v biases, optional per-head
  q/k norms (``use_qk_norm``) and half of each head turned by rotate-half RoPE (not GLM-4's adjacent pairs); dense
  MLPs in the first ``first_k_dense_replace`` layers, then expert blocks whose router scores by a sigmoid, chooses
  within the best groups by score + a correction bias (``router_scoring="sigmoid"``: ``moe.SigmoidRouter``, kept in
  float32) and whose shared experts add to the routed ones (``n_shared_experts``); the multi-token-prediction
  layers its checkpoints carry past ``num_hidden_layers`` are skipped on load.
- ``Qwen2MoeForCausalLM`` (Qwen1.5-MoE, Qwen2-57B-A14B) Qwen2's attention (q/k/v bias as ``qkv_bias`` says, no
  window: ``use_sliding_window`` is refused, transformers versions window different layers); Qwen3-MoE's sparse
  blocks, each with a shared SwiGLU expert of ``shared_expert_intermediate_size`` scaled by
  ``sigmoid(shared_expert_gate(x))`` and added to the routed output; dense MLPs in the other layers.
- ``GraniteMoeForCausalLM`` (IBM Granite 3 MoE, granite-3.x-1b-a400m / 3b-a800m) Granite's layers and
  multipliers with a sparse expert block in every layer, its top-k weights a softmax over the top-k logits
  (``norm_topk_prob``); its checkpoints store each layer's experts fused (``moe.expert_names``). The
  shared-expert and Mamba hybrid layouts (``GraniteMoeShared``, Granite 4's ``GraniteMoeHybrid``) are refused
  by name.
- ``GptOssForCausalLM``  (gpt-oss) q/k/v/o bias, a learned sink logit per query head in every softmax
  (``attention_sinks``), a 128-token window in every other layer, YaRN; an expert block in every layer
  whose router and experts have biases (``expert_bias``) and whose SwiGLU is clamped
  (``swiglu_limit``, ``swiglu_alpha``); its MXFP4 experts are dequantized on load.
- ``Gemma3ForConditionalGeneration`` (Gemma 3 4B and larger), ``Mistral3ForConditionalGeneration`` (Mistral
  Small 3.1 / 3.2, Ministral 3), ``Qwen3VLForConditionalGeneration`` and ``Qwen3VLMoeForConditionalGeneration``
  read as their text models (``container``;
  ``vl_text``): text prompts only, the vision tower kept on disk for the saves.

Both the legacy ``rope_theta``/``rope_scaling`` keys and the ``rope_parameters`` dict of
transformers 5 are read; ``to_hf`` writes the legacy keys, which every transformers version and
inference server reads.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

from areno.errors import ConfigError
from areno.models import vl_text

# architecture -> HF model_type
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
    "Ministral3ForCausalLM": "ministral3",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Olmo2ForCausalLM": "olmo2",
    "Olmo3ForCausalLM": "olmo3",
    "Gemma3ForCausalLM": "gemma3_text",
    "Gemma2ForCausalLM": "gemma2",
    "Phi3ForCausalLM": "phi3",
    "SmolLM3ForCausalLM": "smollm3",
    "GptOssForCausalLM": "gpt_oss",
    "Glm4ForCausalLM": "glm4",
    "GraniteForCausalLM": "granite",
    "Ernie4_5ForCausalLM": "ernie4_5",
    "Exaone4ForCausalLM": "exaone4",
    "Glm4MoeForCausalLM": "glm4_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "GraniteMoeForCausalLM": "granitemoe",
    "OlmoeForCausalLM": "olmoe",
}
SEQUENCE_CLASSIFIER_SUFFIX = "ForSequenceClassification"
"""transformers' scalar-head layout (``score.weight`` [num_labels, hidden] on the decoder, no LM
head): read as the causal architecture of the same decoder, the head loaded apart
(``hf_io.read_score_head``)."""


def causal_architecture(arch: str) -> str:
    """``Qwen2ForSequenceClassification`` -> ``Qwen2ForCausalLM``; any other name unchanged."""
    if arch.endswith(SEQUENCE_CLASSIFIER_SUFFIX):
        return arch[: -len(SEQUENCE_CLASSIFIER_SUFFIX)] + "ForCausalLM"
    return arch


GPT_OSS = "GptOssForCausalLM"
GLM4_MOE = "Glm4MoeForCausalLM"
QWEN2_MOE = "Qwen2MoeForCausalLM"
GRANITEMOE = "GraniteMoeForCausalLM"
OLMOE = "OlmoeForCausalLM"
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM", GPT_OSS, GLM4_MOE, QWEN2_MOE, GRANITEMOE, OLMOE)
WINDOWED_ARCHITECTURES = ("MistralForCausalLM", "Ministral3ForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM")
"""The layouts transformers gives one sliding window in every layer (``sliding_window`` in config.json)."""
EXAONE4 = "Exaone4ForCausalLM"
ERNIE4_5 = "Ernie4_5ForCausalLM"
LAYER_TYPE_ARCHITECTURES = (
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Olmo3ForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma2ForCausalLM",
    GPT_OSS,
    EXAONE4,
)
"""The layouts whose transformers class reads a window per layer (``layer_types``, or Qwen's
``use_sliding_window`` + ``max_window_layers``)."""
OLMO_ARCHITECTURES = ("Olmo2ForCausalLM", "Olmo3ForCausalLM")
"""OLMo 2's layout (q/k norms over the projections, norms after each block); OLMo 3 adds windows."""
PROJECTION_QK_NORM_ARCHITECTURES = (*OLMO_ARCHITECTURES, OLMOE)
"""The layouts whose q/k norms read the whole q and k projections (``qk_norm_scope="projection"``)."""
GEMMA3 = "Gemma3ForCausalLM"
GEMMA2 = "Gemma2ForCausalLM"
GEMMA_ARCHITECTURES = (GEMMA2, GEMMA3)
"""Gemma's layout: norms around each block with weights stored as offsets from 1, embeddings scaled by
sqrt(hidden_size), the tanh GELU, ``query_pre_attn_scalar``."""
MINISTRAL3 = "Ministral3ForCausalLM"
ROPE_PER_TYPE_ARCHITECTURES = ("Olmo3ForCausalLM", GEMMA3)
"""The layouts whose transformers class turns the window layers by their own RoPE (``rope_parameters``
per layer type)."""
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "yarn", "longrope")
GLM4 = "Glm4ForCausalLM"
PARTIAL_ROTARY_ARCHITECTURES = ("Phi3ForCausalLM", GLM4, GLM4_MOE)
"""The layouts whose transformers class turns only the first ``partial_rotary_factor`` of each head (Phi-4-mini)."""
GRANITE = "GraniteForCausalLM"
GRANITE_ARCHITECTURES = (GRANITE, GRANITEMOE)
"""Granite 3's layouts, dense and mixture-of-experts: its four multipliers."""
LLAMA_BIAS_ARCHITECTURES = ("LlamaForCausalLM", "SmolLM3ForCausalLM", GRANITE)
"""The layouts whose transformers class reads Llama's ``mlp_bias`` (Ernie 4.5 reads ``use_bias``)."""
QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", *PROJECTION_QK_NORM_ARCHITECTURES, GEMMA3, EXAONE4)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape and flags of a Llama-family decoder. Build it with ``from_hf`` or ``tiny_config``."""

    vocab_size: int
    """Rows of the embedding and of the output projection."""
    hidden_size: int
    """Model width D."""
    intermediate_size: int
    """Width of the SwiGLU MLP."""
    num_hidden_layers: int
    """Number of decoder layers."""
    num_attention_heads: int
    """Query heads Hq."""
    num_key_value_heads: int
    """Key/value heads Hkv (GQA when < Hq); must divide Hq."""
    head_dim: int
    """Per-head width Dh (Qwen3 sets it independently of hidden_size / Hq)."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rope_scaling: dict[str, Any] | None = None
    """None, or a dict with ``rope_type`` in ("default", "llama3", "linear", "yarn", "longrope") and its
    parameters (llama3: factor, low_freq_factor, high_freq_factor, original_max_position_embeddings;
    linear: factor; yarn: original_max_position_embeddings and optionally factor, attention_factor,
    beta_fast, beta_slow, mscale, mscale_all_dim, truncate; longrope: short_factor, long_factor,
    original_max_position_embeddings and optionally factor, attention_factor). LongRoPE's long factors
    apply only past ``original_max_position_embeddings``, which ``max_seq_len`` keeps every sequence within."""
    partial_rotary_factor: float = 1.0
    """The share of each head's dimensions that RoPE turns (``rotary_dim``, the first ones); the rest pass
    unturned (Phi-4-mini: 0.75, GLM-4: 0.5)."""
    rope_interleaved: bool = False
    """RoPE turns adjacent pairs of dimensions (0 with 1, 2 with 3: GLM-4, Ernie 4.5) instead of each half's
    i-th with the other's (transformers' ``rotate_half``)."""
    rope_in_float32: bool = False
    """q and k turn in float32 by float32 cos/sin and are rounded once to their dtype (Ernie 4.5), instead of
    by tables rounded to the model dtype (transformers' Llama)."""
    max_position_embeddings: int = 2048
    """Longest position the model was built for; RoPE tables are sized to it."""
    tie_word_embeddings: bool = False
    """Output projection shares the embedding matrix (no ``lm_head`` tensor)."""
    attention_bias: bool = False
    """Bias on q_proj, k_proj, v_proj (Qwen2 always; Llama/Qwen3 when ``attention_bias``)."""
    attention_out_bias: bool = False
    """Bias on o_proj (Llama/Qwen3 with ``attention_bias``; never Qwen2/Mistral)."""
    mlp_bias: bool = False
    """Bias on gate/up/down projections (Llama ``mlp_bias``)."""
    qk_norm: bool = False
    """RMSNorm on q and k before RoPE (Qwen3, OLMo 2), over ``qk_norm_scope``."""
    qk_norm_scope: str = "head"
    """What the q/k norms normalise: ``head`` (each head's Dh, weights [Dh]: Qwen3) or ``projection`` (the
    whole q and k projections, weights [Hq*Dh] and [Hkv*Dh]: OLMo 2, OLMoE)."""
    clip_qkv: float | None = None
    """OLMoE's clamp of q, k and v to [-clip_qkv, clip_qkv], after the q/k norms and before RoPE; None: none."""
    norm_layout: str = "pre"
    """``pre``: each block reads a normed input (``input_layernorm``, ``post_attention_layernorm``: Llama);
    ``post``: each block's output is normed before its residual add (``post_attention_layernorm``,
    ``post_feedforward_layernorm``; the weight applied in float32: OLMo 2; in the model dtype, as Llama: EXAONE 4,
    ``norms_scale_in_float32``); ``sandwich``: both
    (``input_layernorm`` and ``post_attention_layernorm`` around attention, ``pre_feedforward_layernorm`` and
    ``post_feedforward_layernorm`` around the MLP; in float32: Gemma 3; GLM-4 names them ``input_layernorm``,
    ``post_self_attn_layernorm``, ``post_attention_layernorm`` and ``post_mlp_layernorm`` and scales in the
    model dtype, as Llama)."""
    norm_weight_offset: float = 0.0
    """What every RMSNorm adds to its weight (Gemma 3: 1, its weights stored as offsets from 1 and
    initialised to 0)."""
    hidden_act: str = "silu"
    """The MLP's gate activation: ``silu`` (SwiGLU), or ``gelu_pytorch_tanh`` (Gemma 3's GeGLU)."""
    scale_embeddings: bool = False
    """Multiply the token embeddings by sqrt(hidden_size), rounded to their dtype (Gemma 3)."""
    query_pre_attn_scalar: float | None = None
    """Attention scores are scaled by this to the -1/2 (Gemma 3); None: by head_dim to the -1/2."""
    nope_layers: tuple[int, ...] = ()
    """Layers that apply no RoPE to q and k (SmolLM3's ``no_rope_layers`` entries of 0; EXAONE 4's layers
    without a window, where any layer has one)."""
    sliding_window: int | None = None
    """Sliding attention window (a query sees the last ``sliding_window`` keys) of the ``window_layers``, or None."""
    window_layers: tuple[int, ...] | None = None
    """The layers that take ``sliding_window`` where only some do (``layer_types``: OLMo 3, Mistral; Qwen's
    ``max_window_layers``), the others attending to every earlier key; None: every layer takes it."""
    window_rope: dict[str, Any] | None = None
    """The RoPE of the ``window_layers`` where it differs from the other layers' (OLMo 3 scales only its full
    layers' RoPE): ``{"rope_theta": float, "rope_scaling": dict | None}``; None: one RoPE for every layer."""
    query_position_scale: tuple[float, int] | None = None
    """Ministral 3's query scale by position, ``(beta, period)``: q times 1 + beta * log(1 + floor(position /
    period)) (transformers' ``llama_4_scaling_beta``, over the RoPE's ``original_max_position_embeddings``);
    None: no such scale."""
    initializer_range: float = 0.02
    """Std of the normal init of linear and embedding weights."""
    architecture: str = "Qwen2ForCausalLM"
    """Hugging Face ``architectures[0]``; one of ``SUPPORTED_ARCHITECTURES``."""
    model_type: str = "qwen2"
    """Hugging Face ``model_type`` matching ``architecture``."""
    bos_token_id: int | None = None
    """Beginning-of-sequence token id, if any."""
    eos_token_id: int | tuple[int, ...] | None = None
    """End-of-sequence token id(s) (Llama 3 lists several)."""
    pad_token_id: int | None = None
    """Padding token id, if any."""
    mrope_section: tuple[int, ...] | None = None
    """Qwen2.5-VL's M-RoPE: how many of the Dh/2 frequencies rotate by the time, height and width
    position (sums to Dh/2); None for text-only models."""
    vision: dict[str, Any] | None = None
    """Qwen2.5-VL: the ``vision_config`` and image token ids of config.json (``models/vision.py``
    reads them); None for text-only models."""
    container: dict[str, Any] | None = None
    """The vision-language checkpoint this text model is part of (``vl_text``): ``architecture``, ``config``
    (its whole config.json, which a save writes again), ``text_type`` (its text config's ``model_type``) and
    ``source`` (the directory whose vision tower and projector a save copies beside the text weights); None
    for a model stored alone."""
    num_experts: int = 0
    """Routed experts per sparse layer (HF ``num_experts`` / ``num_local_experts``); 0: a dense model.
    Only the mixture-of-experts architectures (``MOE_ARCHITECTURES``) have experts."""
    num_experts_per_tok: int = 2
    """Top-k: experts each token is routed to."""
    moe_intermediate_size: int = 0
    """Width of each expert's SwiGLU MLP (Mixtral: its ``intermediate_size``)."""
    norm_topk_prob: bool = False
    """Renormalise the top-k routing weights to sum to 1 (Qwen3-MoE's flag; Mixtral always does)."""
    decoder_sparse_step: int = 1
    """Layer i is sparse when ``(i + 1) % decoder_sparse_step == 0`` and i is not in ``mlp_only_layers``."""
    mlp_only_layers: tuple[int, ...] = ()
    """Layers that keep a dense MLP of ``intermediate_size`` (Qwen3-MoE, Qwen2-MoE)."""
    shared_expert_intermediate_size: int = 0
    """Width of the shared SwiGLU expert every sparse block of Qwen2-MoE runs on every token beside the routed
    ones (``mlp.shared_expert``), its output scaled by ``sigmoid(mlp.shared_expert_gate(x))``; 0: none."""
    router_aux_loss_coef: float = 0.001
    """Weight of the router load-balancing loss added to the training loss when ``output_router_logits``."""
    output_router_logits: bool = False
    """Add ``router_aux_loss_coef`` x the load-balancing loss (Switch Transformer's, as transformers
    computes it) to the training loss, as transformers does when its config sets this flag. GLM-4.5's
    class computes no such loss (its router is balanced by ``e_score_correction_bias``): refused there."""
    router_scoring: str = "softmax"
    """How the router turns its logits into expert scores: ``softmax`` (Qwen3-MoE, Mixtral, gpt-oss: the top-k
    of the softmax), or ``sigmoid`` (GLM-4.5's ``Glm4MoeTopkRouter``, ``moe.SigmoidRouter``: each logit's sigmoid,
    the choice made on score + ``e_score_correction_bias`` within the ``topk_group`` best of ``n_group`` groups, the
    weights the chosen experts' unbiased scores, renormalised where ``norm_topk_prob``, times
    ``routed_scaling_factor``; its weight and bias kept in float32, as transformers keeps them)."""
    n_group: int = 1
    """Groups the experts are split into for a ``sigmoid`` router's choice (each group scored by the sum of its
    two best biased scores); 1: no group limit."""
    topk_group: int = 1
    """How many of the ``n_group`` groups a token's experts are chosen from."""
    routed_scaling_factor: float = 1.0
    """What a ``sigmoid`` router's weights are multiplied by (GLM-4.5: 2.5)."""
    n_shared_experts: int = 0
    """Shared experts of each sparse block (GLM-4.5: 1; at least 1 there, 0 elsewhere): one ungated SwiGLU MLP
    ``mlp.shared_experts`` of width ``moe_intermediate_size * n_shared_experts`` that every token passes, added to
    the routed experts' output."""
    first_k_dense_replace: int = 0
    """The first layers that keep a dense MLP of ``intermediate_size`` (GLM-4.5: 3, GLM-4.5-Air: 1)."""
    attention_sinks: bool = False
    """A learned logit per query head joins every softmax's denominator with no value (gpt-oss's
    ``self_attn.sinks``): attention weights sum to less than 1."""
    expert_bias: bool = False
    """The router and every expert's gate/up and down projections have biases (gpt-oss)."""
    swiglu_limit: float | None = None
    """gpt-oss's clamped SwiGLU in the experts: the gate clamped to at most ``swiglu_limit``, the up
    projection to within +-``swiglu_limit``, and ``(up + 1) * gate * sigmoid(swiglu_alpha * gate)``; None:
    ``silu(gate) * up``."""
    swiglu_alpha: float = 1.0
    """The gate's sigmoid scale of the clamped SwiGLU (gpt-oss: 1.702)."""
    attn_logit_softcapping: float | None = None
    """Gemma 2's attention soft-cap: every scaled attention score s becomes ``cap * tanh(s / cap)`` before
    the mask and softmax (50 in its released models); None: scores as they are."""
    final_logit_softcapping: float | None = None
    """Gemma 2's final soft-cap: every logit z of the LM head becomes ``cap * tanh(z / cap)`` (30 in its
    released models), computed in float32 from the head's product; None: logits as they are."""
    embedding_multiplier: float = 1.0
    """Granite's scale of the token embeddings (12 in its released models), applied in their dtype."""
    attention_multiplier: float | None = None
    """Granite's softmax scale of the attention scores in place of head_dim^-1/2 (its released models: 1/64 or
    1/128); None: head_dim^-1/2."""
    residual_multiplier: float = 1.0
    """Granite's scale of each block's output (attention and MLP) before its residual add (0.22 in its
    released models), applied in the model dtype as transformers does."""
    logits_scaling: float = 1.0
    """Granite's divisor of the final logits (8 or 16 in its released models), applied in float32 to the
    head's product, before any temperature."""

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"ModelConfig.num_key_value_heads={self.num_key_value_heads} must divide "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0 or self.initializer_range <= 0:
            raise ValueError("ModelConfig.rms_norm_eps, rope_theta and initializer_range must be > 0")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"ModelConfig.sliding_window must be > 0 or None, got {self.sliding_window}")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(_unknown_arch_message(self.architecture))
        if SUPPORTED_ARCHITECTURES[self.architecture] != self.model_type:
            raise ValueError(
                f"ModelConfig.model_type={self.model_type!r} does not match architecture "
                f"{self.architecture} (expected {SUPPORTED_ARCHITECTURES[self.architecture]!r})"
            )
        self._check_arch_flags()
        self._check_moe()
        self._check_gpt_oss()
        self._check_bounds()
        self._check_multipliers()
        if self.rope_scaling is not None:
            object.__setattr__(self, "rope_scaling", _normalized_scaling(self.rope_scaling))
        self._check_rotary()
        self._check_windows()
        self._check_global_nope()
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        if self.mrope_section is not None:
            object.__setattr__(self, "mrope_section", tuple(self.mrope_section))
            if sum(self.mrope_section) != self.head_dim // 2:
                raise ValueError(f"mrope_section {self.mrope_section} must sum to head_dim/2 = {self.head_dim // 2}")
        if (self.vision is not None) != (self.architecture == "Qwen2_5_VLForConditionalGeneration"):
            raise ValueError(f"vision is set exactly for Qwen2_5_VLForConditionalGeneration, not {self.architecture}")
        if self.query_position_scale is not None:
            beta, period = self.query_position_scale
            object.__setattr__(self, "query_position_scale", (float(beta), int(period)))
            if self.architecture != MINISTRAL3 or period < 1 or self.window_rope is not None:
                raise ValueError(
                    f"query_position_scale={self.query_position_scale} is only expressible for {MINISTRAL3} "
                    "(a period >= 1, one RoPE for every layer)"
                )
        if self.container is not None:
            outer = self.container.get("architecture")
            layout = vl_text.LAYOUTS.get(outer)
            if layout is None or self.architecture not in {arch for arch, _ in layout.text_types.values()}:
                raise ValueError(f"container: {outer!r} holds no {self.architecture} text model")

    def _check_arch_flags(self) -> None:
        """Only flag combinations that transformers' class for ``architecture`` can express."""
        arch = self.architecture
        if arch != GLM4_MOE and self.qk_norm != (arch in QK_NORM_ARCHITECTURES):  # GLM-4.5's use_qk_norm: either
            raise ValueError(
                f"qk_norm={self.qk_norm} is impossible for {arch} (only Qwen3, OLMo, Gemma 3 and EXAONE 4 have q/k "
                "norms)"
            )
        gemma = (1.0, "gelu_pytorch_tanh", True) if arch in GEMMA_ARCHITECTURES else (0.0, "silu", False)
        if (self.norm_weight_offset, self.hidden_act, self.scale_embeddings) != gemma:
            raise ValueError(
                f"{arch} has norm_weight_offset={gemma[0]}, hidden_act={gemma[1]!r} and scale_embeddings={gemma[2]}, "
                f"not {self.norm_weight_offset}, {self.hidden_act!r} and {self.scale_embeddings}"
            )
        if self.query_pre_attn_scalar is not None and (
            arch not in GEMMA_ARCHITECTURES or self.query_pre_attn_scalar <= 0
        ):
            raise ValueError(
                f"query_pre_attn_scalar={self.query_pre_attn_scalar} is only expressible (> 0) for "
                f"{' and '.join(GEMMA_ARCHITECTURES)}"
            )
        layouts = {
            **dict.fromkeys(OLMO_ARCHITECTURES, ("projection", "post")),
            OLMOE: ("projection", "pre"),
            GEMMA2: ("head", "sandwich"),
            GEMMA3: ("head", "sandwich"),
            GLM4: ("head", "sandwich"),
            EXAONE4: ("head", "post"),
        }
        scope, layout = layouts.get(arch, ("head", "pre"))
        if (self.qk_norm_scope, self.norm_layout) != (scope, layout):
            raise ValueError(
                f"{arch} has qk_norm_scope={scope!r} and norm_layout={layout!r}, "
                f"not {self.qk_norm_scope!r} and {self.norm_layout!r}"
            )
        if arch in ("Qwen2ForCausalLM", "Qwen2_5_VLForConditionalGeneration") and (
            not self.attention_bias or self.attention_out_bias
        ):
            raise ValueError(
                "Qwen2ForCausalLM has q/k/v bias and no o_proj bias: set attention_bias=True, attention_out_bias=False"
            )
        if arch == QWEN2_MOE and self.attention_out_bias:
            raise ValueError(f"{arch} has no o_proj bias (attention_bias is its q/k/v's, config.json's qkv_bias)")
        if arch == QWEN2_MOE and self.head_dim * self.num_attention_heads != self.hidden_size:
            # transformers 4.x refuses to build it, vLLM takes head_dim = hidden_size / heads whatever it says
            raise ValueError(
                f"{arch}: head_dim={self.head_dim} x num_attention_heads={self.num_attention_heads} must equal "
                f"hidden_size={self.hidden_size} (transformers 4.x and vLLM build no other): drop head_dim from "
                "config.json"
            )
        if (
            arch
            in (
                "LlamaForCausalLM",
                "Qwen3ForCausalLM",
                "Qwen3MoeForCausalLM",
                *OLMO_ARCHITECTURES,
                "SmolLM3ForCausalLM",
                *GEMMA_ARCHITECTURES,
                GPT_OSS,
                GRANITE,
                ERNIE4_5,
                GRANITEMOE,
                OLMOE,
            )
            and self.attention_bias != self.attention_out_bias
        ):
            raise ValueError(f"{arch} biases q/k/v/o together: attention_bias must equal attention_out_bias")
        if arch in ("MistralForCausalLM", MINISTRAL3, "MixtralForCausalLM", "Phi3ForCausalLM", EXAONE4) and (
            self.attention_bias or self.attention_out_bias
        ):
            raise ValueError(f"{arch} has no attention bias")
        if arch == OLMOE and self.head_dim * self.num_attention_heads != self.hidden_size:
            # transformers 5 sizes q_norm by hidden_size and 4.x derives head_dim from it: no other head_dim builds
            raise ValueError(
                f"{arch} sizes its q norm by hidden_size={self.hidden_size}: head_dim={self.head_dim} x "
                f"num_attention_heads={self.num_attention_heads} must equal it"
            )
        if arch in (GLM4, GLM4_MOE) and self.attention_out_bias:
            raise ValueError(f"{arch} has no o_proj bias (attention_bias is its q/k/v's)")
        if self.rope_interleaved != (arch in (GLM4, ERNIE4_5)):
            raise ValueError(
                f"rope_interleaved={self.rope_interleaved} is impossible for {arch} (GLM-4's and Ernie 4.5's RoPE only)"
            )
        if self.rope_in_float32 != (arch == ERNIE4_5):
            raise ValueError(f"rope_in_float32={self.rope_in_float32} is impossible for {arch} (Ernie 4.5's RoPE only)")
        if self.mlp_bias and arch not in (*LLAMA_BIAS_ARCHITECTURES, ERNIE4_5):
            raise ValueError(
                f"mlp_bias=True is only expressible for {', '.join((*LLAMA_BIAS_ARCHITECTURES, ERNIE4_5))}, not {arch}"
            )
        if arch == ERNIE4_5 and self.mlp_bias != self.attention_bias:
            raise ValueError(
                f"{arch} biases every projection or none (use_bias): attention_bias={self.attention_bias} and "
                f"mlp_bias={self.mlp_bias} must be equal"
            )
        object.__setattr__(self, "nope_layers", tuple(sorted({int(i) for i in self.nope_layers})))
        if self.nope_layers and arch not in ("SmolLM3ForCausalLM", EXAONE4):
            raise ValueError(
                f"nope_layers (layers without RoPE) are only expressible for SmolLM3ForCausalLM and {EXAONE4}, "
                f"not {arch}"
            )
        if any(not 0 <= i < self.num_hidden_layers for i in self.nope_layers):
            raise ValueError(f"nope_layers {list(self.nope_layers)} must be layer indices < {self.num_hidden_layers}")
        windowed = WINDOWED_ARCHITECTURES + LAYER_TYPE_ARCHITECTURES
        if self.sliding_window is not None and arch not in windowed:
            raise ValueError(f"sliding_window is only supported for {', '.join(dict.fromkeys(windowed))}, not {arch}")

    def _check_windows(self) -> None:
        """``window_layers`` sorted, in range and only where transformers reads a window per layer; one
        covering every layer is None; ``window_rope`` only beside full-attention layers."""
        layers = self.window_layers
        if layers is not None:
            layers = tuple(sorted({int(i) for i in layers}))
            if self.sliding_window is None or not layers:
                raise ValueError("ModelConfig.window_layers needs a sliding_window and at least one layer")
            if any(not 0 <= i < self.num_hidden_layers for i in layers):
                raise ValueError(f"window_layers {list(layers)} must be layer indices < {self.num_hidden_layers}")
            if self.architecture not in LAYER_TYPE_ARCHITECTURES:
                raise ValueError(
                    f"window_layers (a window in some layers only) are only expressible for "
                    f"{', '.join(LAYER_TYPE_ARCHITECTURES)}, not {self.architecture}"
                )
            object.__setattr__(self, "window_layers", None if len(layers) == self.num_hidden_layers else layers)
        if self.window_rope is None:
            return
        if self.window_layers is None or self.architecture not in ROPE_PER_TYPE_ARCHITECTURES:
            raise ValueError(
                "ModelConfig.window_rope (another RoPE in the window layers) is only expressible for "
                f"{', '.join(ROPE_PER_TYPE_ARCHITECTURES)} with window_layers, not {self.architecture} with "
                f"window_layers={self.window_layers}"
            )
        rope = dict(self.window_rope)
        unknown = sorted(set(rope) - {"rope_theta", "rope_scaling"})
        theta = rope.get("rope_theta", self.rope_theta)
        if unknown or not isinstance(theta, (int, float)) or theta <= 0:
            raise ValueError(
                f"ModelConfig.window_rope must be {{rope_theta: > 0, rope_scaling}}, got {self.window_rope}"
            )
        scaling = rope.get("rope_scaling")
        rope = {"rope_theta": float(theta), "rope_scaling": _normalized_scaling(scaling) if scaling else None}
        same = rope == {"rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling}
        object.__setattr__(self, "window_rope", None if same else rope)

    def _check_global_nope(self) -> None:
        """EXAONE 4's layers without RoPE are its layers without a window, where any layer has one
        (transformers turns every layer where none does)."""
        if self.architecture != EXAONE4:
            return
        n = self.num_hidden_layers
        full = tuple(i for i in range(n) if self.layer_window(i) is None) if self.sliding_window else ()
        if self.nope_layers != full:
            raise ValueError(
                f"{EXAONE4}: nope_layers {list(self.nope_layers)} must be its full-attention layers {list(full)} "
                "(transformers turns only the window layers by RoPE where a window is set, every layer where none is)"
            )

    def layer_window(self, layer_idx: int) -> int | None:
        """The attention window of layer ``layer_idx`` (None: every earlier key)."""
        if self.window_layers is None or layer_idx in self.window_layers:
            return self.sliding_window
        return None

    def window_rope_config(self) -> ModelConfig | None:
        """This config with the ``window_layers``' RoPE as its own (what their RoPE tables are built
        from), or None where every layer turns alike."""
        if self.window_rope is None:
            return None
        return self.replace(window_rope=None, **self.window_rope)

    def _check_rotary(self) -> None:
        """``partial_rotary_factor`` where transformers' class turns part of each head, to an even width of at
        least 2; LongRoPE's factors one per turned frequency."""
        factor = self.partial_rotary_factor
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not 0 < factor <= 1:
            raise ValueError(f"ModelConfig.partial_rotary_factor must be in (0, 1], got {factor!r}")
        object.__setattr__(self, "partial_rotary_factor", float(factor))
        if factor != 1 and self.architecture not in PARTIAL_ROTARY_ARCHITECTURES:
            raise ValueError(
                f"partial_rotary_factor={factor} is not supported for {self.architecture}: of areno's layouts only "
                f"{', '.join(PARTIAL_ROTARY_ARCHITECTURES)}'s transformers class turns part of each head"
            )
        dim = self.rotary_dim
        if dim < 2 or dim % 2:
            raise ValueError(
                f"partial_rotary_factor={factor} turns {dim} of head_dim={self.head_dim} dimensions: RoPE needs an "
                "even number of at least 2"
            )
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if self.architecture == "Phi3ForCausalLM" and rope_type not in ("default", "longrope"):
            raise ValueError(
                f"rope_scaling type {rope_type!r} is impossible for Phi3ForCausalLM: transformers' class takes "
                "the default RoPE or longrope"
            )
        if (self.mrope_section is not None or self.window_rope is not None) and factor != 1:
            raise ValueError(f"partial_rotary_factor={factor} with M-RoPE or a second RoPE is not supported")
        for c in (self, self.window_rope_config()):
            scaling = (c.rope_scaling if c is not None else None) or {}
            if scaling.get("rope_type") != "longrope":
                continue
            for key in ("short_factor", "long_factor"):
                values = scaling[key]
                if not isinstance(values, (list, tuple)) or len(values) != dim // 2:
                    raise ValueError(
                        f"rope_scaling longrope: {key} must list {dim // 2} numbers (one per turned frequency of "
                        f"{dim} = head_dim x partial_rotary_factor dimensions), got "
                        f"{len(values) if isinstance(values, (list, tuple)) else values!r}"
                    )

    def _check_moe(self) -> None:
        """Expert fields only where the architecture has experts, and in range."""
        arch = self.architecture
        for name in _MOE_INT_FIELDS:  # a float reads as a size far from here (a view's shape, a layer index)
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"ModelConfig.{name} must be an int, got {value!r}")
        if (self.num_experts > 0) != (arch in MOE_ARCHITECTURES):
            raise ValueError(
                f"num_experts={self.num_experts} is impossible for {arch}: "
                f"only {', '.join(MOE_ARCHITECTURES)} have experts (and need num_experts > 0)"
            )
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        shared = self.shared_expert_intermediate_size
        if arch == QWEN2_MOE and shared <= 0:
            raise ValueError(
                f"shared_expert_intermediate_size={shared} is impossible for {arch}: its layers have a shared expert; "
                "set it to the expert's width (> 0)"
            )
        if arch != QWEN2_MOE and shared != 0:
            raise ValueError(
                f"shared_expert_intermediate_size={shared} is impossible for {arch}: only {QWEN2_MOE} has a shared "
                "expert of that width; leave it 0"
            )
        if not self.num_experts:
            return
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"ModelConfig.num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts={self.num_experts}]"
            )
        if self.moe_intermediate_size <= 0 or self.decoder_sparse_step <= 0:
            raise ValueError(
                "ModelConfig.moe_intermediate_size and decoder_sparse_step must be > 0 for an expert model"
            )
        if self.router_aux_loss_coef < 0:
            raise ValueError(f"ModelConfig.router_aux_loss_coef must be >= 0, got {self.router_aux_loss_coef}")
        if arch in ("MixtralForCausalLM", GPT_OSS, GRANITEMOE) and (
            not self.norm_topk_prob or self.decoder_sparse_step != 1 or self.mlp_only_layers
        ):
            raise ValueError(
                f"{arch} renormalises top-k weights in every layer: norm_topk_prob=True, "
                "decoder_sparse_step=1, mlp_only_layers=()"
            )
        if arch == OLMOE and (self.decoder_sparse_step != 1 or self.mlp_only_layers):
            raise ValueError(f"{arch} has experts in every layer: decoder_sparse_step=1, mlp_only_layers=()")
        self._check_sigmoid_router()

    def _check_sigmoid_router(self) -> None:
        """GLM-4.5's fields (the sigmoid router's groups and scale, shared experts, leading dense layers) on
        GLM-4.5 only, in range; its router sets no load-balancing loss."""
        arch, glm = self.architecture, self.architecture == GLM4_MOE
        if self.router_scoring not in ("softmax", "sigmoid") or (self.router_scoring == "sigmoid") != glm:
            raise ValueError(
                f"router_scoring={self.router_scoring!r} is impossible for {arch}: {GLM4_MOE}'s router scores by "
                "'sigmoid', the other expert layouts' by 'softmax'"
            )
        ours = (
            self.n_group,
            self.topk_group,
            self.routed_scaling_factor,
            self.n_shared_experts,
            self.first_k_dense_replace,
        )
        if not glm and ours != (1, 1, 1.0, 0, 0):
            raise ValueError(
                f"n_group, topk_group, routed_scaling_factor, n_shared_experts and first_k_dense_replace are "
                f"{GLM4_MOE}'s (1, 1, 1.0, 0, 0 elsewhere), not {ours} for {arch}"
            )
        if not glm:
            return
        scale = self.routed_scaling_factor
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"ModelConfig.routed_scaling_factor must be a positive float, got {scale!r}")
        object.__setattr__(self, "routed_scaling_factor", float(scale))
        if self.n_group < 1 or self.num_experts % self.n_group or self.num_experts // self.n_group < 2:
            raise ValueError(
                f"ModelConfig.n_group={self.n_group} must divide num_experts={self.num_experts} into groups of at "
                "least 2 experts (each group is scored by its two best)"
            )
        per_group = self.num_experts // self.n_group
        if not 1 <= self.topk_group <= self.n_group or self.num_experts_per_tok > self.topk_group * per_group:
            raise ValueError(
                f"ModelConfig.topk_group={self.topk_group} must be in [1, n_group={self.n_group}] and its groups must "
                f"hold num_experts_per_tok={self.num_experts_per_tok} experts ({per_group} a group)"
            )
        if self.n_shared_experts < 1:
            # transformers builds them 0 wide and saves their empty tensors, which areno's block has no place for
            raise ValueError(
                f"ModelConfig.n_shared_experts={self.n_shared_experts} is not supported for {arch}: transformers "
                "builds its shared experts moe_intermediate_size x n_shared_experts wide, empty tensors areno does "
                "not hold (GLM-4.5, GLM-4.5-Air and GLM-4.6 have 1): set n_shared_experts >= 1"
            )
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ValueError(
                f"ModelConfig.first_k_dense_replace={self.first_k_dense_replace} must be in [0, num_hidden_layers="
                f"{self.num_hidden_layers}]"
            )
        if self.decoder_sparse_step != 1 or self.mlp_only_layers:
            raise ValueError(
                f"{arch} places its dense layers by first_k_dense_replace: decoder_sparse_step=1, mlp_only_layers=()"
            )
        if self.output_router_logits:
            raise ValueError(
                f"output_router_logits=true: {arch}'s transformers class computes no load-balancing loss for it (its "
                "router is balanced by e_score_correction_bias, without an auxiliary loss), so areno has none to "
                "add: set output_router_logits to false"
            )

    def _check_gpt_oss(self) -> None:
        """gpt-oss's own fields (sinks, expert biases, the clamped SwiGLU) on gpt-oss only, all of them."""
        is_oss = self.architecture == GPT_OSS
        if self.swiglu_limit is not None and self.swiglu_limit <= 0:
            raise ValueError(f"ModelConfig.swiglu_limit must be > 0 or None, got {self.swiglu_limit}")
        if is_oss and (self.rope_scaling or {}).get("rope_type") != "yarn":
            raise ValueError(
                f"{GPT_OSS} turns by YaRN (transformers 5 gives it YaRN whatever config.json says): set rope_scaling "
                "to a yarn dict"
            )
        ours = (self.attention_sinks, self.expert_bias, self.swiglu_limit is not None)
        if (ours != (True,) * 3 and is_oss) or (any(ours) and not is_oss) or (self.swiglu_alpha != 1.0 and not is_oss):
            raise ValueError(
                f"attention_sinks, expert_bias and swiglu_limit/swiglu_alpha are {GPT_OSS}'s and all set there, "
                f"not {ours} for {self.architecture}"
            )

    def _check_bounds(self) -> None:
        """The optional bounds, positive floats, each on its family only: the soft-caps are Gemma 2's
        (transformers' Gemma 3 reads them too, but its vision-language class skips the final one, and no released
        Gemma 3 sets them: areno refuses them there), ``clip_qkv`` OLMoE's."""
        for name, (arch, what) in _BOUNDS.items():
            bound = getattr(self, name)
            if bound is None:
                continue
            if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not math.isfinite(bound) or bound <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive float or None, got {bound!r}")
            object.__setattr__(self, name, float(bound))
            if self.architecture != arch:
                raise ValueError(f"{name}={bound} is only expressible for {arch} ({what}), not {self.architecture}")

    def _check_multipliers(self) -> None:
        """Granite's four scalars: positive finite floats, other than their defaults only for Granite."""
        for name in ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling"):
            value = getattr(self, name)
            if value is None and name == "attention_multiplier":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive float, got {value!r}")
            object.__setattr__(self, name, float(value))
            if self.architecture not in GRANITE_ARCHITECTURES and value != (
                None if name == "attention_multiplier" else 1.0
            ):
                raise ValueError(
                    f"{name}={value} is only expressible for {' and '.join(GRANITE_ARCHITECTURES)} (Granite's "
                    f"multipliers), not {self.architecture}"
                )

    @property
    def attention_scale(self) -> float:
        """The softmax scale of the attention scores: Granite's ``attention_multiplier``, Gemma's
        ``query_pre_attn_scalar`` to the -1/2, else head_dim to the -1/2."""
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` holds a sparse expert block (transformers' rule)."""
        return (
            self.num_experts > 0
            and layer_idx >= self.first_k_dense_replace
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    # ------------------------------------------------------------------ derived
    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """All end-of-sequence ids as a tuple (empty when none)."""
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    @property
    def max_seq_len(self) -> int:
        """Longest sequence this decoder computes as transformers does (positions < this): with LongRoPE,
        its ``original_max_position_embeddings``, past which transformers turns every position of a sequence
        by the long factors (its frequencies then depend on the sequence's length) and areno does not."""
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type") == "longrope":
            return min(self.max_position_embeddings, int(scaling["original_max_position_embeddings"]))
        return self.max_position_embeddings

    @property
    def positions_source(self) -> str:
        """Where ``max_seq_len`` comes from, for errors: ``max_position_embeddings=N`` or LongRoPE's bound."""
        if self.max_seq_len == self.max_position_embeddings:
            return f"max_position_embeddings={self.max_position_embeddings}"
        return (
            f"LongRoPE's original_max_position_embeddings={self.max_seq_len} (areno turns by its short factors only; "
            "transformers turns a longer sequence by its long factors)"
        )

    @property
    def sandwich_norm_names(self) -> tuple[str, str, str, str]:
        """The sandwich layout's norms (before attention, after it, before the MLP, after it) under the
        family's names: GLM-4's, else Gemma 3's."""
        if self.architecture == GLM4:
            return ("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm")
        return (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        )

    def check_context(self, length: int | None, key: str, *, where: str = "", fix: str = "it") -> None:
        """A one-line ``ConfigError`` where a context of ``length`` tokens (``key``; ``where``: the config.json it
        was read from) runs past ``max_seq_len``; ``fix``: what to set to at most that."""
        if length and length > self.max_seq_len:
            raise ConfigError(
                f"{key}={length} exceeds the model's {self.positions_source}{where}, beyond which areno cannot "
                f"compute it as transformers does: set {fix} to at most {self.max_seq_len}"
            )

    @property
    def norms_scale_in_float32(self) -> bool:
        """Whether the RMSNorms scale in float32 and round once (OLMo 2's order) rather than round, then scale
        in the model dtype (Llama's; EXAONE 4's norms after each block too). Gemma 3's offsets decide its own."""
        return self.architecture in OLMO_ARCHITECTURES

    @property
    def rotary_dim(self) -> int:
        """How many of each head's first dimensions RoPE turns (transformers' ``int(head_dim * factor)``)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def num_params(self) -> int:
        """Parameter count (the tied output projection counted once)."""
        d, hq, hkv, dh, inter = (
            self.hidden_size,
            self.num_attention_heads,
            self.num_key_value_heads,
            self.head_dim,
            self.intermediate_size,
        )
        attn = d * hq * dh + 2 * d * hkv * dh + hq * dh * d
        if self.attention_bias:
            attn += hq * dh + 2 * hkv * dh
        if self.attention_out_bias:
            attn += d
        if self.qk_norm:
            attn += 2 * dh if self.qk_norm_scope == "head" else (hq + hkv) * dh
        mlp = 3 * d * inter + ((2 * inter + d) if self.mlp_bias else 0)
        moe = self.num_experts * (3 * d * self.moe_intermediate_size + d)  # experts + router row
        moe += self.n_shared_experts * 3 * d * self.moe_intermediate_size  # GLM-4.5's shared experts
        if self.expert_bias:  # the router's and each expert's gate/up and down biases
            moe += self.num_experts * (1 + 2 * self.moe_intermediate_size + d)
        if self.shared_expert_intermediate_size:  # Qwen2-MoE's shared expert and its gate's row
            moe += 3 * d * self.shared_expert_intermediate_size + d
        if self.attention_sinks:
            attn += hq
        sparse = sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))
        layer = attn + (4 if self.norm_layout == "sandwich" else 2) * d
        total = self.vocab_size * d + self.num_hidden_layers * layer + d
        total += sparse * moe + (self.num_hidden_layers - sparse) * mlp
        if not self.tie_word_embeddings:
            total += self.vocab_size * d
        return total

    # ------------------------------------------------------------------ HF conversion
    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from the dict of a Hugging Face ``config.json``.

        Raises ValueError naming the architecture when it is not supported, and for features this
        decoder does not implement (non-SiLU activation, per-layer sliding windows, other RoPE types).
        """
        _refuse_quantized(d)
        archs = d.get("architectures") or []
        if archs and archs[0] in vl_text.LAYOUTS:  # trained as its text model, the rest kept on disk
            text, container = vl_text.split_config(d)
            text = _with_hf_defaults(container["text_type"], text)  # its text config class's defaults
            return cls.from_hf(text).replace(container=container)
        if not archs:
            model_type = d.get("model_type")
            by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
            if model_type not in by_type:
                raise ValueError(
                    f"config.json has no 'architectures' and model_type {model_type!r} is not one of {sorted(by_type)}"
                )
            archs = [by_type[model_type]]
        arch = causal_architecture(archs[0])
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(_unknown_arch_message(arch))
        expected_type = SUPPORTED_ARCHITECTURES[arch]
        if d.get("model_type") not in (None, expected_type):
            # transformers builds the model_type's class; reading the architecture would build another model
            raise ValueError(
                f"config.json: architectures[0] {archs[0]!r} is a {expected_type!r} model but model_type is "
                f"{d['model_type']!r} (transformers builds the model_type's model): make the two agree"
            )
        vision, mrope_section = None, None
        if arch == "Qwen2_5_VLForConditionalGeneration":
            d, vision, mrope_section = _flatten_vl(d)
        else:
            d = _with_hf_defaults(expected_type, d)
        if arch == GEMMA3:
            _check_gemma3(d)
        elif arch == GEMMA2:
            _check_gemma2(d)
        else:
            act = d.get("hidden_act", "silu")
            if act not in ("silu", "swish"):  # transformers' swish is SiLU
                raise ValueError(f"hidden_act={act!r} is not supported (only 'silu')")
        sliding_window, window_layers = _sliding_window(arch, d)
        query_position_scale = None
        if arch == MINISTRAL3:
            d, query_position_scale = _read_query_position_scale(d)
        if arch == "Phi3ForCausalLM":
            d = _phi3_rope_type(d)
        rope_theta, rope_scaling, window_rope = _read_layer_ropes(arch, d, sliding_window, window_layers)
        heads = d["num_attention_heads"]
        attn_bias = bool(d.get("attention_bias", False))
        if arch in ("Qwen2ForCausalLM", "Qwen2_5_VLForConditionalGeneration"):
            qkv_bias, out_bias = True, False
        elif arch in ("MistralForCausalLM", MINISTRAL3, "MixtralForCausalLM", "Phi3ForCausalLM"):
            qkv_bias = out_bias = False
        elif arch in (GLM4, GLM4_MOE):
            qkv_bias, out_bias = attn_bias, False
        elif arch == QWEN2_MOE:  # its class reads qkv_bias (default true), not attention_bias
            qkv_bias, out_bias = bool(d.get("qkv_bias", True)), False
        elif arch == ERNIE4_5:  # one key biases every projection, the MLP's too
            qkv_bias = out_bias = bool(d.get("use_bias", False))
        elif arch == EXAONE4:  # its class builds no bias whatever attention_bias says
            qkv_bias = out_bias = False
        else:
            qkv_bias = out_bias = attn_bias
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            partial_rotary_factor=_read_partial_rotary(d, 0.5 if arch in (GLM4, GLM4_MOE) else 1.0),
            rope_interleaved=arch in (GLM4, ERNIE4_5),
            rope_in_float32=arch == ERNIE4_5,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            attention_out_bias=out_bias,
            mlp_bias=_read_mlp_bias(arch, d),
            nope_layers=_nope_layers(arch, d),
            qk_norm=bool(d.get("use_qk_norm")) if arch == GLM4_MOE else arch in QK_NORM_ARCHITECTURES,
            qk_norm_scope="projection" if arch in PROJECTION_QK_NORM_ARCHITECTURES else "head",
            clip_qkv=d.get("clip_qkv") if arch == OLMOE else None,
            norm_layout=_norm_layout(arch),
            **(_gemma_fields(arch, d) if arch in GEMMA_ARCHITECTURES else {}),
            **(_granite_fields(d) if arch in GRANITE_ARCHITECTURES else {}),
            sliding_window=sliding_window,
            window_layers=window_layers,
            window_rope=window_rope,
            query_position_scale=query_position_scale,
            initializer_range=float(d.get("initializer_range", 0.02)),
            architecture=arch,
            model_type=SUPPORTED_ARCHITECTURES[arch],
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"),
            mrope_section=mrope_section,
            vision=vision,
            **_read_moe(arch, d),
        )

    def to_hf(self) -> dict[str, Any]:
        """The ``config.json`` dict; ``transformers.AutoConfig`` reads it back to the same model."""
        if self.container is not None:
            return self._container_config()
        d: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.initializer_range,
            "attention_dropout": 0.0,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }
        if self.architecture in (
            "LlamaForCausalLM",
            "Qwen3ForCausalLM",
            "Qwen3MoeForCausalLM",
            *OLMO_ARCHITECTURES,
            "SmolLM3ForCausalLM",
            *GEMMA_ARCHITECTURES,
            GPT_OSS,
            GLM4,
            GRANITE,
            GLM4_MOE,
            GRANITEMOE,
            OLMOE,
        ):
            d["attention_bias"] = self.attention_bias
        if self.architecture in LLAMA_BIAS_ARCHITECTURES:
            d["mlp_bias"] = self.mlp_bias
        if self.architecture == ERNIE4_5:
            d["use_bias"] = self.attention_bias
        if self.partial_rotary_factor != 1 or self.architecture in (GLM4, GLM4_MOE):  # GLM's classes default to 0.5
            d["partial_rotary_factor"] = self.partial_rotary_factor
        if self.architecture == "Phi3ForCausalLM":  # its class reads this over the RoPE dict's (default 4096)
            d["original_max_position_embeddings"] = (self.rope_scaling or {}).get(
                "original_max_position_embeddings", HF_CLASS_DEFAULTS["phi3"]["original_max_position_embeddings"]
            )
            if d["rope_scaling"] is not None:  # transformers 4.x's Phi-3 takes {type, short_factor, long_factor}
                rope = {
                    k: v
                    for k, v in d["rope_scaling"].items()
                    if k not in ("rope_type", "original_max_position_embeddings")
                }
                d["rope_scaling"] = {"type": self.rope_scaling["rope_type"], **rope}
        if self.architecture == "SmolLM3ForCausalLM":
            d["no_rope_layers"] = [int(i not in self.nope_layers) for i in range(self.num_hidden_layers)]
            d["use_sliding_window"] = False
            d["sliding_window"] = None
        if self.architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
            d["use_sliding_window"] = self.sliding_window is not None
            d["sliding_window"] = self.sliding_window
            if self.architecture != "Qwen3MoeForCausalLM":
                # every layer from the first windowed one slides, as transformers reads it; layer_types says so too
                d["max_window_layers"] = min(self.window_layers or (0,)) if self.sliding_window else 0
        if self.architecture in (*WINDOWED_ARCHITECTURES, *ROPE_PER_TYPE_ARCHITECTURES, GPT_OSS, GEMMA2, EXAONE4):
            d["sliding_window"] = self.sliding_window
        if self.architecture == EXAONE4:
            # its class reads layer_types over sliding_window_pattern; with no window it needs them (a pattern of 0)
            d["layer_types"] = [
                "full_attention" if self.layer_window(i) is None else "sliding_attention"
                for i in range(self.num_hidden_layers)
            ]
        if self.architecture in LAYER_TYPE_ARCHITECTURES and (
            self.window_layers or self.architecture in (*ROPE_PER_TYPE_ARCHITECTURES, GEMMA2)
        ):
            d["layer_types"] = [
                "full_attention" if self.layer_window(i) is None else "sliding_attention"
                for i in range(self.num_hidden_layers)
            ]
        if self.architecture in ROPE_PER_TYPE_ARCHITECTURES:
            d.update(_rope_per_type(self))
        if self.query_position_scale is not None:  # transformers reads it from the RoPE's keys
            beta, period = self.query_position_scale
            rope = d["rope_scaling"] or {"rope_type": "default"}
            d["rope_scaling"] = {**rope, "llama_4_scaling_beta": beta, "original_max_position_embeddings": period}
        if self.architecture == GEMMA3:
            d.pop("hidden_act")
            d.update(
                hidden_activation=self.hidden_act,
                query_pre_attn_scalar=_int_if_whole(self.query_pre_attn_scalar),
                final_logit_softcapping=None,
                attn_logit_softcapping=None,
                use_bidirectional_attention=False,
                rope_local_base_freq=(self.window_rope_config() or self).rope_theta,
            )
        if self.architecture == GEMMA2:  # its class defaults the caps to 50 and 30: written even when None
            d.pop("hidden_act")
            d.update(
                hidden_activation=self.hidden_act,
                query_pre_attn_scalar=_int_if_whole(self.query_pre_attn_scalar),
                final_logit_softcapping=self.final_logit_softcapping,
                attn_logit_softcapping=self.attn_logit_softcapping,
                use_bidirectional_attention=False,
            )
        if self.architecture in GRANITE_ARCHITECTURES:
            # their classes default attention_multiplier to 1, not head_dim^-1/2: the scale is written out
            d.update(
                embedding_multiplier=self.embedding_multiplier,
                attention_multiplier=self.attention_scale,
                residual_multiplier=self.residual_multiplier,
                logits_scaling=self.logits_scaling,
            )
        if self.architecture in ("Qwen3MoeForCausalLM", QWEN2_MOE):
            d.update(
                num_experts=self.num_experts,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
            )
        if self.architecture == QWEN2_MOE:  # no window (refused in reading), q/k/v biases as qkv_bias
            d.update(
                shared_expert_intermediate_size=self.shared_expert_intermediate_size,
                qkv_bias=self.attention_bias,
                use_sliding_window=False,
                sliding_window=None,
            )
        if self.architecture == "MixtralForCausalLM":
            # Mixtral's experts are intermediate_size wide; areno keeps the dense width apart
            d.update(num_local_experts=self.num_experts, intermediate_size=self.moe_intermediate_size)
            d["router_jitter_noise"] = 0.0
        if self.architecture == GRANITEMOE:  # its experts are intermediate_size wide; it has no dense MLP
            d.update(num_local_experts=self.num_experts, intermediate_size=self.moe_intermediate_size)
        if self.architecture == OLMOE:  # its experts are intermediate_size wide, as Mixtral's
            d.update(
                num_experts=self.num_experts,
                intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                clip_qkv=self.clip_qkv,
            )
        if self.architecture == GPT_OSS:
            d.update(
                num_local_experts=self.num_experts,
                intermediate_size=self.moe_intermediate_size,
                swiglu_limit=self.swiglu_limit,
                swiglu_alpha=self.swiglu_alpha,
            )
        if self.architecture == GLM4_MOE:  # no MTP layers: areno neither trains nor saves them
            d.update(
                use_qk_norm=self.qk_norm,
                n_routed_experts=self.num_experts,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                n_group=self.n_group,
                topk_group=self.topk_group,
                routed_scaling_factor=self.routed_scaling_factor,
                n_shared_experts=self.n_shared_experts,
                first_k_dense_replace=self.first_k_dense_replace,
                num_nextn_predict_layers=0,
            )
        if self.num_experts:
            d.update(num_experts_per_tok=self.num_experts_per_tok, output_router_logits=self.output_router_logits)
            if self.architecture != GLM4_MOE:  # its class has no balance loss to weigh
                d["router_aux_loss_coef"] = self.router_aux_loss_coef
        if self.vision is not None:
            return _nest_vl(d, self)
        return d

    def _container_config(self) -> dict[str, Any]:
        """The vision-language checkpoint's config.json as read, where it still describes this text model."""
        original = self.container["config"]
        if ModelConfig.from_hf(original).replace(container=None) != self.replace(container=None):
            raise ValueError(
                f"this {self.architecture} config differs from the text model of the {self.container['architecture']} "
                "checkpoint it came from, whose config.json a save writes: save it without the container"
            )
        return json.loads(json.dumps(original))

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


_MOE_INT_FIELDS = (
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "decoder_sparse_step",
    "shared_expert_intermediate_size",
    "n_group",
    "topk_group",
    "n_shared_experts",
    "first_k_dense_replace",
)
"""The expert counts and widths of ``ModelConfig``: ints (``_check_moe``)."""

_BOUNDS: dict[str, tuple[str, str]] = {
    "attn_logit_softcapping": (GEMMA2, "Gemma 2's soft-capping"),
    "final_logit_softcapping": (GEMMA2, "Gemma 2's soft-capping"),
    "clip_qkv": (OLMOE, "OLMoE's clamp of q, k and v"),
}
"""The optional positive bounds of ``ModelConfig``: field -> (the one architecture that has it, what it is)."""


def _rope_per_type(config: ModelConfig) -> dict[str, Any]:
    """OLMo 3's and Gemma 3's RoPE keys: ``rope_parameters`` per layer type (transformers 5), beside the
    full layers' theta and scaling in the legacy keys (which transformers 5 applies to those layers only)."""
    window = config.window_rope_config() or config

    def params(c: ModelConfig) -> dict[str, Any]:
        return {"rope_type": "default", **(c.rope_scaling or {}), "rope_theta": c.rope_theta}

    return {"rope_parameters": {"full_attention": params(config), "sliding_attention": params(window)}}


_ARCH_HINTS: dict[str, str] = {
    "GraniteMoeSharedForCausalLM": (
        " (granitemoeshared: GraniteMoE with a shared_mlp beside its experts, which areno's decoder does not compute;"
        " GraniteMoeForCausalLM, without it, is supported)"
    ),
    "GraniteMoeHybridForCausalLM": (
        " (granitemoehybrid: Granite 4, its Mamba layers beside attention, which areno's decoder does not compute;"
        " Granite 3's GraniteForCausalLM and GraniteMoeForCausalLM are supported)"
    ),
}
"""What an unsupported architecture is, where its name is close to a supported one's."""


def _refuse_quantized(d: dict[str, Any]) -> None:
    """A quantized checkpoint (FP8, AWQ, GPTQ, MXFP4, bitsandbytes: ``quantization_config``) refused by its
    method, before its scale and packed tensors read as a checkpoint that does not match config.json."""
    for where in (d, d.get("text_config") if isinstance(d.get("text_config"), dict) else {}):
        q = where.get("quantization_config")
        if q and (d.get("architectures") or [None])[0] == GPT_OSS and isinstance(q, dict):
            if q.get("quant_method") == "mxfp4":  # its experts, dequantized on load (``gpt_oss``)
                continue
        if q:
            method = q.get("quant_method", "unknown method") if isinstance(q, dict) else q
            raise ValueError(
                f"config.json has a quantization_config ({method}): areno trains and generates with the weights "
                "unquantized; point model.path at the model's bf16 (or fp16 / fp32) checkpoint"
            )


def _unknown_arch_message(arch: str) -> str:
    hint = _ARCH_HINTS.get(arch, "")
    supported = [*SUPPORTED_ARCHITECTURES, *(f"{a} (its text model)" for a in vl_text.LAYOUTS)]
    return f"unsupported model architecture {arch!r}{hint}; supported: {', '.join(supported)}"


def _normalized_scaling(rope_scaling: dict[str, Any]) -> dict[str, Any] | None:
    """``rope_scaling`` with its type under ``rope_type`` and its required keys checked; None for the
    default RoPE."""
    scaling = dict(rope_scaling)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    scaling.pop("type", None)
    scaling["rope_type"] = rope_type
    need = {
        "default": (),
        "linear": ("factor",),
        "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
        "yarn": ("original_max_position_embeddings",),
        "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
    }[rope_type]
    missing = [k for k in need if k not in scaling]
    if missing:
        raise ValueError(f"rope_scaling of type {rope_type!r} lacks {missing}")
    scaling.pop("rope_theta", None)  # transformers 5 keeps it inside rope_parameters
    return None if rope_type == "default" else scaling


def _read_moe(arch: str, d: dict[str, Any]) -> dict[str, Any]:
    """The expert fields of a mixture-of-experts ``config.json`` ({} for a dense architecture)."""
    if arch not in MOE_ARCHITECTURES:
        return {}
    common = dict(
        num_experts_per_tok=d.get("num_experts_per_tok", 2),
        router_aux_loss_coef=float(d.get("router_aux_loss_coef", 0.001)),
        output_router_logits=bool(d.get("output_router_logits", False)),
    )
    if arch == GPT_OSS:
        return dict(
            num_experts=d.get("num_local_experts", 128),
            moe_intermediate_size=d["intermediate_size"],
            norm_topk_prob=True,  # a softmax over the top-k logits: the top-k of the softmax, renormalised
            attention_sinks=True,
            expert_bias=True,
            swiglu_limit=float(d.get("swiglu_limit", 7.0)),
            swiglu_alpha=float(d.get("swiglu_alpha", 1.702)),
            **common,
        )
    if arch == GLM4_MOE:
        return dict(
            num_experts=d["n_routed_experts"],
            moe_intermediate_size=d["moe_intermediate_size"],
            norm_topk_prob=bool(d["norm_topk_prob"]),
            router_scoring="sigmoid",
            n_group=d["n_group"],
            topk_group=d["topk_group"],
            routed_scaling_factor=d["routed_scaling_factor"],  # checked (a positive float) and cast by ModelConfig
            n_shared_experts=d["n_shared_experts"],
            first_k_dense_replace=d["first_k_dense_replace"],
            num_experts_per_tok=d["num_experts_per_tok"],
            output_router_logits=bool(d.get("output_router_logits", False)),  # refused when true
        )
    if arch == QWEN2_MOE:
        return dict(
            num_experts=d.get("num_experts", 60),
            moe_intermediate_size=d.get("moe_intermediate_size", 1408),
            shared_expert_intermediate_size=d.get("shared_expert_intermediate_size", 5632),
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
            decoder_sparse_step=d.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
            **common,
        )
    if arch == GRANITEMOE:
        return dict(
            num_experts=d.get("num_local_experts", 8),
            moe_intermediate_size=d["intermediate_size"],
            # GraniteMoeTopKRouter takes the top-k logits, then their softmax: exp(l_i) / sum over the top-k of
            # exp(l_j), which is the softmax's top-k renormalised (the softmax keeps the order of the logits)
            norm_topk_prob=True,
            **common,
        )
    if arch == OLMOE:
        return dict(
            num_experts=d.get("num_experts") or d.get("num_local_experts") or 64,  # its class's default: 64
            moe_intermediate_size=d["intermediate_size"],
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
            **common,
        )
    if arch == "MixtralForCausalLM":
        if d.get("router_jitter_noise"):
            raise ValueError(
                f"router_jitter_noise={d['router_jitter_noise']} is not supported; set it to 0.0 in config.json"
            )
        return dict(
            num_experts=d.get("num_local_experts", 8),
            moe_intermediate_size=d["intermediate_size"],
            norm_topk_prob=True,
            **common,
        )
    # transformers 5 writes Qwen3-MoE's expert count as num_local_experts, earlier versions as num_experts
    return dict(
        num_experts=d.get("num_experts") or d.get("num_local_experts") or 128,
        moe_intermediate_size=d.get("moe_intermediate_size", 768),
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        decoder_sparse_step=d.get("decoder_sparse_step", 1),
        mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
        **common,
    )


_QWEN_WINDOW = {"use_sliding_window": False, "sliding_window": 4096}
_COMMON = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "initializer_range": 0.02}
HF_CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {**_COMMON, "max_position_embeddings": 2048, "attention_bias": False, "mlp_bias": False, "rope_theta": 1e4},
    "qwen2": {**_COMMON, **_QWEN_WINDOW, "num_key_value_heads": 32, "max_position_embeddings": 32768,
              "max_window_layers": 28, "rope_theta": 1e4},
    "qwen3": {**_COMMON, **_QWEN_WINDOW, "num_key_value_heads": 32, "head_dim": 128, "max_position_embeddings": 32768,
              "attention_bias": False, "max_window_layers": 28, "rope_theta": 1e4},
    "mistral": {**_COMMON, "num_key_value_heads": 8, "max_position_embeddings": 131072, "sliding_window": 4096,
                "rope_theta": 1e4},
    "mixtral": {**_COMMON, "rms_norm_eps": 1e-5, "num_key_value_heads": 8, "max_position_embeddings": 131072,
                "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0, "rope_theta": 1e6},
    "qwen3_moe": {**_COMMON, **_QWEN_WINDOW, "num_key_value_heads": 4, "max_position_embeddings": 32768,
                  "attention_bias": False, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                  "norm_topk_prob": False, "decoder_sparse_step": 1, "router_aux_loss_coef": 0.001, "rope_theta": 1e4},
    "qwen2_moe": {**_COMMON, **_QWEN_WINDOW, "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
                  "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
                  "max_position_embeddings": 32768, "max_window_layers": 28, "num_experts": 60,
                  "num_experts_per_tok": 4, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
                  "norm_topk_prob": False, "decoder_sparse_step": 1, "router_aux_loss_coef": 0.001,
                  "output_router_logits": False, "qkv_bias": True, "rope_theta": 1e4},
    "olmo2": {**_COMMON, "rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "attention_bias": False,
              "rope_theta": 1e4},
    "olmo3": {**_COMMON, "rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "attention_bias": False,
              "sliding_window": 4096, "rope_theta": 5e5},
    "gemma3_text": {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                    "num_attention_heads": 8, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
                    "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "initializer_range": 0.02, "head_dim": 256,
                    "num_key_value_heads": 4, "max_position_embeddings": 131072, "attention_bias": False,
                    "sliding_window": 4096, "query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh",
                    "rope_theta": 1e6},
    "gemma2": {"vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
               "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "bos_token_id": 2,
               "eos_token_id": 1, "pad_token_id": 0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
               "initializer_range": 0.02, "max_position_embeddings": 8192, "attention_bias": False,
               "sliding_window": 4096, "query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh",
               "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0, "rope_theta": 1e4},
    "qwen3_vl_text": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
                      "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128, "hidden_act": "silu",
                      "max_position_embeddings": 128000, "initializer_range": 0.02, "rms_norm_eps": 1e-6,
                      "attention_bias": False, "rope_theta": 5e5},
    "ministral3": {**_COMMON, "vocab_size": 131072, "hidden_size": 4096, "intermediate_size": 14336,
                   "num_hidden_layers": 34, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                   "max_position_embeddings": 262144, "rms_norm_eps": 1e-5, "sliding_window": None,
                   "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 11},
    "qwen3_vl_moe_text": {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
                          "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
                          "hidden_act": "silu", "max_position_embeddings": 128000, "initializer_range": 0.02,
                          "rms_norm_eps": 1e-6, "attention_bias": False, "decoder_sparse_step": 1,
                          "moe_intermediate_size": 1408, "num_experts_per_tok": 4, "num_experts": 60,
                          "router_aux_loss_coef": 0.001, "output_router_logits": False, "rope_theta": 5e5},
    "phi3": {**_COMMON, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "sliding_window": None,
             "original_max_position_embeddings": 4096, "rope_theta": 1e4},
    "glm4": {**_COMMON, "rms_norm_eps": 1.5625e-07, "vocab_size": 151552, "hidden_size": 4096,
             "intermediate_size": 13696, "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 2,
             "head_dim": 128, "max_position_embeddings": 131072, "attention_bias": True, "pad_token_id": 151329,
             "rope_theta": 1e4},
    "ernie4_5": {**_COMMON, "rms_norm_eps": 1e-5, "vocab_size": 103424, "hidden_size": 1024,
                 "intermediate_size": 3072, "num_hidden_layers": 18, "num_attention_heads": 16,
                 "num_key_value_heads": 2, "head_dim": 128, "max_position_embeddings": 131072, "pad_token_id": 0,
                 "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": True, "use_bias": False,
                 "rope_theta": 5e5},
    "exaone4": {**_COMMON, "rms_norm_eps": 1e-5, "vocab_size": 102400, "hidden_size": 4096,
                "intermediate_size": 16384, "num_hidden_layers": 32, "num_attention_heads": 32,
                "num_key_value_heads": 32, "max_position_embeddings": 2048, "bos_token_id": 0, "eos_token_id": 2,
                "sliding_window": 4096, "sliding_window_pattern": 4, "rope_theta": 1e4},
    "gpt_oss": {**_COMMON, "rms_norm_eps": 1e-5, "vocab_size": 201088, "hidden_size": 2880,
                "intermediate_size": 2880, "num_hidden_layers": 36, "num_attention_heads": 64, "num_key_value_heads": 8,
                "head_dim": 64, "num_local_experts": 128, "num_experts_per_tok": 4, "sliding_window": 128,
                "max_position_embeddings": 131072, "attention_bias": True, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
                "router_aux_loss_coef": 0.001, "output_router_logits": False,
                "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "truncate": False, "original_max_position_embeddings": 4096},
                "rope_theta": 150000.0},
    "olmoe": {**_COMMON, "rms_norm_eps": 1e-5, "vocab_size": 50304, "hidden_size": 2048, "intermediate_size": 2048,
              "num_hidden_layers": 16, "num_attention_heads": 16, "max_position_embeddings": 4096,
              "attention_bias": False, "pad_token_id": 1, "eos_token_id": 50279, "clip_qkv": None,
              "num_experts_per_tok": 8, "norm_topk_prob": False, "router_aux_loss_coef": 0.01,
              "output_router_logits": False, "rope_theta": 1e4},
    "granite": {**_COMMON, "max_position_embeddings": 2048, "attention_bias": False, "mlp_bias": False,
                "bos_token_id": 1, "eos_token_id": 2, "embedding_multiplier": 1.0, "attention_multiplier": 1.0,
                "residual_multiplier": 1.0, "logits_scaling": 1.0, "rope_theta": 1e4},
    "glm4_moe": {**_COMMON, "rms_norm_eps": 1e-5, "vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 10944,
                 "num_hidden_layers": 46, "num_attention_heads": 96, "num_key_value_heads": 8,
                 "max_position_embeddings": 131072, "attention_bias": False, "use_qk_norm": False,
                 "moe_intermediate_size": 1408, "num_experts_per_tok": 8, "n_shared_experts": 1, "n_routed_experts": 128,
                 "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
                 "norm_topk_prob": True, "rope_theta": 1e4},
    "granitemoe": {**_COMMON, "max_position_embeddings": 2048, "attention_bias": False, "bos_token_id": 1,
                   "eos_token_id": 2, "embedding_multiplier": 1.0, "attention_multiplier": 1.0,
                   "residual_multiplier": 1.0, "logits_scaling": 1.0, "num_local_experts": 8, "num_experts_per_tok": 2,
                   "output_router_logits": False, "router_aux_loss_coef": 0.001, "rope_theta": 1e4},
    "smollm3": {**_COMMON, "tie_word_embeddings": True, "max_position_embeddings": 32768, "attention_bias": False,
                "mlp_bias": False, "use_sliding_window": False, "sliding_window": None, "no_rope_layer_interval": 4,
                "rope_theta": 2e6},
}  # fmt: skip
"""What transformers' config classes give the config.json keys areno reads when a file leaves them out
(their ``__init__`` defaults, ``rope_theta`` their ``default_theta``; checked against transformers in the
tests): Mistral's 4,096-token window, Mixtral's 1e-5 norm epsilon and 1e6 RoPE theta, Qwen3-MoE's 8
experts a token. Written out so that reading a config does not import transformers' model registry
before the first rollout token."""


def _with_hf_defaults(model_type: str, d: dict[str, Any]) -> dict[str, Any]:
    """``d`` with the keys transformers would default filled in (``HF_CLASS_DEFAULTS``): a hand-written
    config.json without them computes what transformers computes; the RoPE theta only where the file
    gives none in any of its keys, its scaling (gpt-oss's YaRN) only where the file gives no RoPE dict."""
    defaults = dict(HF_CLASS_DEFAULTS.get(model_type, {}))
    theta = defaults.pop("rope_theta", None)
    scaling = defaults.pop("rope_scaling", None)
    out = {**defaults, **d}
    if scaling is not None and not any(isinstance(d.get(k), dict) for k in ("rope_parameters", "rope_scaling")):
        out["rope_scaling"] = dict(scaling)
    rope_given = d.get("rope_theta") is not None or any(
        isinstance(d.get(k), dict)
        and ("rope_theta" in d[k] or any(isinstance(v, dict) and "rope_theta" in v for v in d[k].values()))
        for k in ("rope_parameters", "rope_scaling")
    )
    if not rope_given and theta is not None:
        out["rope_theta"] = float(theta)
    return out


def _sliding_window(arch: str, d: dict[str, Any]) -> tuple[int | None, tuple[int, ...] | None]:
    """(the attention window, the layers that take it: None for every layer), as transformers' class for
    ``arch`` reads them: one window in every layer, or per layer from ``layer_types`` (Qwen: from
    ``use_sliding_window`` and ``max_window_layers``)."""
    n = d["num_hidden_layers"]
    types = d.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != n:
            raise ValueError(f"config.json layer_types must be a list of num_hidden_layers={n} entries, got {types!r}")
        unknown = sorted({t for t in types if t not in ("full_attention", "sliding_attention")})
        if unknown:
            raise ValueError(f"config.json layer_types {unknown} are not supported (full_attention, sliding_attention)")
    if arch in WINDOWED_ARCHITECTURES:
        window = d.get("sliding_window")
        if arch != "MistralForCausalLM" or types is None:  # transformers reads layer_types for Mistral only
            return window, None
    elif arch in ("LlamaForCausalLM", "Olmo2ForCausalLM", GLM4, GRANITE, GLM4_MOE, GRANITEMOE):
        return None, None  # transformers gives them no window (and ignores the keys)
    elif arch == QWEN2_MOE:
        if d.get("use_sliding_window") or "sliding_attention" in (types or ()):
            # 4.x windows every layer from max_window_layers on (flash) or every layer (its masks), 5.x the even
            # layers below max_window_layers: no one model to compute; the released checkpoints set it false
            raise ValueError(
                f"config.json: {arch} with use_sliding_window=true or sliding_attention layer_types is not supported "
                "(transformers 4.x and 5.x window different layers): set use_sliding_window to false"
            )
        return None, None
    elif arch == OLMOE:
        if d.get("sliding_window") is not None:  # its class passes it to the attention kernel, not to the mask
            raise ValueError(
                f"config.json sliding_window={d['sliding_window']} is not supported for {arch}: transformers applies "
                "it under flash attention only (its mask and its eager and SDPA attention read none): set it to null"
            )
        return None, None
    elif arch in (GPT_OSS, GEMMA2):
        window = d.get("sliding_window")
        if types is None:  # their config classes' default: every other layer slides, the first among them
            types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    elif arch == EXAONE4:
        window = d.get("sliding_window")
        types = types or _exaone4_layer_types(d)
        if window is None and "sliding_attention" in types:
            raise ValueError(
                f"config.json: {arch} with sliding_attention layers and sliding_window null (transformers cannot "
                "build it): set sliding_window or make every layer full_attention"
            )
        if window is not None and "sliding_attention" not in types:
            # transformers then turns no layer by RoPE, vLLM every layer: the two compute different models
            raise ValueError(
                f"config.json: {arch} with sliding_window={window} and no sliding_attention layer (transformers "
                "turns no layer by RoPE, vLLM every layer): set sliding_window to null"
            )
    elif arch in ROPE_PER_TYPE_ARCHITECTURES:
        window = d.get("sliding_window")
        if types is None:  # the config classes' default: every fourth (OLMo 3) or sixth (Gemma 3) layer full
            every = d.get("sliding_window_pattern", 6) if arch == GEMMA3 else 4
            types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
        if window is None and "sliding_attention" in types:  # such layers would still take their own RoPE
            raise ValueError(
                f"config.json: {arch} with sliding_attention layers and sliding_window null: set sliding_window "
                "(its config class's default is 4096) or make every layer full_attention"
            )
    else:  # the Qwen family: windows only with use_sliding_window, from layer max_window_layers on
        window = d.get("sliding_window") if d.get("use_sliding_window") else None
        if types is None and arch == "Qwen3MoeForCausalLM":  # its config has no max_window_layers: every layer
            types = ["sliding_attention" if window is not None else "full_attention"] * n
        if types is None:
            start = d.get("max_window_layers", 0)
            types = ["sliding_attention" if window is not None and i >= start else "full_attention" for i in range(n)]
        elif window is None and "sliding_attention" in types:
            raise ValueError(
                "config.json layer_types has sliding_attention layers but use_sliding_window is false or "
                "sliding_window is null (transformers cannot build it either): make them agree"
            )
    layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if not layers or window is None:
        return None, None
    return window, None if len(layers) == n else layers


def _exaone4_layer_types(d: dict[str, Any]) -> list[str]:
    """EXAONE 4's attention per layer where config.json gives no ``layer_types``: from ``sliding_window_pattern``,
    an int p (layer i slides unless p divides i + 1, as its config class computes) or a string of L (a window)
    and G (none) repeated from layer 0, the last layer in full (the pattern's documented reading, which
    transformers' class does not compute: it needs layer_types); every layer in full without a window."""
    n, pattern = d["num_hidden_layers"], d.get("sliding_window_pattern")
    if d.get("sliding_window") is None:
        return ["full_attention"] * n
    if isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0:
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    if isinstance(pattern, str) and pattern and set(pattern) <= {"L", "G"}:
        return [
            "sliding_attention" if pattern[i % len(pattern)] == "L" and i < n - 1 else "full_attention"
            for i in range(n)
        ]
    raise ValueError(
        f"config.json sliding_window_pattern={pattern!r} is not a positive int or a string of L and G (and there are "
        "no layer_types): give layer_types, or a pattern such as 4 or 'LLLG'"
    )


def _nope_layers(arch: str, d: dict[str, Any]) -> tuple[int, ...]:
    """SmolLM3's layers without RoPE: the 0 entries of ``no_rope_layers``, or (left out) every
    ``no_rope_layer_interval``-th layer, as transformers fills it in. EXAONE 4's: its full-attention layers
    where a window is set."""
    if arch == EXAONE4:
        if d.get("sliding_window") is None:
            return ()
        types = d.get("layer_types") or _exaone4_layer_types(d)
        return tuple(i for i, t in enumerate(types) if t == "full_attention")
    if arch != "SmolLM3ForCausalLM":
        return ()
    n = d["num_hidden_layers"]
    flags = d.get("no_rope_layers")
    if flags is None:
        interval = d.get("no_rope_layer_interval", 4)
        flags = [int((i + 1) % interval != 0) for i in range(n)]
    if not isinstance(flags, list) or len(flags) != n:
        raise ValueError(f"config.json no_rope_layers must be a list of num_hidden_layers={n} entries, got {flags!r}")
    return tuple(i for i, use_rope in enumerate(flags) if not use_rope)


GEMMA3_LOCAL_THETA = 10000.0
"""Gemma3TextConfig's RoPE base of its sliding-window layers (``rope_local_base_freq``) where a file gives none."""
OLMO3_THETA = 500000.0
"""Olmo3Config's RoPE theta, which transformers 5 gives its sliding-window layers where a file has legacy keys."""


def _read_layer_ropes(
    arch: str, d: dict[str, Any], window: int | None, window_layers: tuple[int, ...] | None
) -> tuple[float, dict[str, Any] | None, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) of the full-attention layers and the window layers' RoPE (None where
    alike): ``rope_parameters`` per layer type (transformers 5 writes OLMo 3's so), or one RoPE for
    every layer, except OLMo 3's legacy keys, whose ``rope_scaling`` transformers applies to its full
    layers only."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        if arch not in ROPE_PER_TYPE_ARCHITECTURES:
            raise ValueError(
                f"config.json rope_parameters per layer type ({sorted(params)}) are not read by {arch}'s class in "
                "transformers (OLMo 3's and Gemma 3's are): give one RoPE (rope_theta, rope_scaling)"
            )
        unknown = sorted(set(params) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(
                f"config.json rope_parameters for layer types {unknown} are not supported (full_attention, "
                "sliding_attention)"
            )
        full, sliding = params.get("full_attention") or {}, params.get("sliding_attention") or {}
        theta, scaling = _read_rope({**d, "rope_parameters": full})
        window = {"max_position_embeddings": d.get("max_position_embeddings", 2048), "rope_parameters": sliding}
        local = d.get("rope_local_base_freq", GEMMA3_LOCAL_THETA) if arch == GEMMA3 else theta
        window_theta, window_scaling = _read_rope({"rope_theta": sliding.get("rope_theta", local), **window})
    elif arch == GEMMA3:  # legacy keys: the window layers turn at rope_local_base_freq, unscaled
        theta, scaling = _read_rope(d)
        window_theta, window_scaling = float(d.get("rope_local_base_freq", GEMMA3_LOCAL_THETA)), None
    else:
        theta, scaling = _read_rope(d)
        if arch != "Olmo3ForCausalLM":
            return theta, scaling, None
        if theta != OLMO3_THETA and window_layers is not None:
            raise ValueError(
                f"config.json: OLMo 3 with rope_theta {theta} in legacy keys (transformers 5 turns the sliding-window "
                f"layers at {OLMO3_THETA:g} whatever it says): give rope_parameters per layer type "
                "(full_attention, sliding_attention)"
            )
        window_theta, window_scaling = theta, None
    if window is None:  # no layer slides
        return theta, scaling, None
    if window_layers is None:  # every layer slides
        return window_theta, window_scaling, None
    return theta, scaling, {"rope_theta": window_theta, "rope_scaling": window_scaling}


def _int_if_whole(x: float | None) -> float | int | None:
    """``x`` as an int where it is whole (transformers 5's strict config fields type some numbers int)."""
    return int(x) if isinstance(x, float) and x.is_integer() else x


MINISTRAL3_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 1000000.0,
    "factor": 16.0,
    "original_max_position_embeddings": 16384,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "llama_4_scaling_beta": 0.1,
}
"""Ministral3Config's RoPE where a file gives none (its YaRN and query scale)."""


def _read_query_position_scale(d: dict[str, Any]) -> tuple[dict[str, Any], tuple[float, int] | None]:
    """Ministral 3's config.json without ``llama_4_scaling_beta`` in its RoPE keys, and ``(beta, period)``
    (None for a beta of 0 or none); the class's RoPE where the file gives none."""
    if not any(isinstance(d.get(k), dict) for k in ("rope_parameters", "rope_scaling")) and "rope_theta" not in d:
        d = {**d, "rope_parameters": dict(MINISTRAL3_ROPE)}
    d, betas, periods = dict(d), set(), set()
    for key in ("rope_parameters", "rope_scaling"):
        if isinstance(d.get(key), dict):
            rope = dict(d[key])
            if rope.get("llama_4_scaling_beta") is not None:
                betas.add(float(rope.pop("llama_4_scaling_beta")))
                periods.add(rope.get("original_max_position_embeddings"))
            rope.pop("max_position_embeddings", None)  # the class's copy of the top-level key
            d[key] = rope
    if len(betas) > 1:
        raise ValueError(f"config.json gives llama_4_scaling_beta {sorted(betas)}: make them agree")
    beta = next(iter(betas), 0.0)
    if not beta:
        return d, None
    period = next(iter(periods))
    if not period:
        raise ValueError(
            "config.json llama_4_scaling_beta needs the RoPE's original_max_position_embeddings (the period of the "
            "query scale)"
        )
    return d, (beta, int(period))


def _check_gemma3(d: dict[str, Any]) -> None:
    """What Gemma 3's config.json may set that areno does not compute, refused by name."""
    act = d.get("hidden_activation") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"config.json hidden_activation={act!r} is not supported for Gemma 3 (gelu_pytorch_tanh)")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if d.get(key) is not None:
            raise ValueError(f"config.json {key}={d[key]} is not supported (Gemma 2's soft-capping): set it to null")
    if d.get("use_bidirectional_attention"):
        raise ValueError("config.json use_bidirectional_attention=true (an encoder) is not supported: areno is causal")


def _check_gemma2(d: dict[str, Any]) -> None:
    """What Gemma 2's config.json may set that areno does not compute, refused by name."""
    act = d.get("hidden_activation") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"config.json hidden_activation={act!r} is not supported for Gemma 2 (gelu_pytorch_tanh)")
    if d.get("use_bidirectional_attention"):
        raise ValueError("config.json use_bidirectional_attention=true (an encoder) is not supported: areno is causal")


def _gemma_fields(arch: str, d: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2's and Gemma 3's ModelConfig fields beside the shared ones (Gemma 2's soft-caps: its class's
    defaults, 50 and 30, where the file leaves them out)."""
    fields: dict[str, Any] = dict(
        norm_weight_offset=1.0,
        hidden_act="gelu_pytorch_tanh",
        scale_embeddings=True,
        query_pre_attn_scalar=float(d.get("query_pre_attn_scalar", 256)),
    )
    if arch == GEMMA2:
        fields.update(
            attn_logit_softcapping=d.get("attn_logit_softcapping"),
            final_logit_softcapping=d.get("final_logit_softcapping"),
        )
    return fields


def _granite_fields(d: dict[str, Any]) -> dict[str, Any]:
    """Granite's four scalars (its class's defaults, all 1, filled in by ``HF_CLASS_DEFAULTS``)."""
    return {k: d[k] for k in ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling")}


def _norm_layout(arch: str) -> str:
    """Where the family's norms sit (``ModelConfig.norm_layout``)."""
    if arch in (*OLMO_ARCHITECTURES, EXAONE4):
        return "post"
    return "sandwich" if arch in (*GEMMA_ARCHITECTURES, GLM4) else "pre"


def _read_mlp_bias(arch: str, d: dict[str, Any]) -> bool:
    """The MLP's bias as the family's class reads it: Llama's, SmolLM3's and Granite's ``mlp_bias``, Ernie 4.5's ``use_bias``."""
    if arch in LLAMA_BIAS_ARCHITECTURES:
        return bool(d.get("mlp_bias", False))
    return arch == ERNIE4_5 and bool(d.get("use_bias", False))


def _read_rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from legacy keys (``rope_theta``, ``rope_scaling``) or transformers 5
    ``rope_parameters``; a file whose keys disagree, per-layer-type parameters and partial rotary
    embeddings are refused."""
    params = d.get("rope_parameters")
    scaling = d.get("rope_scaling")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError(
            f"config.json rope_parameters per layer type ({sorted(params)}) are not supported: areno applies one "
            "RoPE to every layer"
        )
    thetas = {
        key: float(value)
        for key, value in (
            ("rope_theta", d.get("rope_theta")),
            ("rope_parameters.rope_theta", (params or {}).get("rope_theta")),
            ("rope_scaling.rope_theta", (scaling or {}).get("rope_theta")),
        )
        if value is not None
    }
    if len(set(thetas.values())) > 1:
        raise ValueError(
            f"config.json gives RoPE theta {thetas} (transformers versions read different ones): make them agree"
        )
    if params and scaling:
        p_rest = {k: v for k, v in params.items() if k != "rope_theta"}
        s_rest = {k: v for k, v in scaling.items() if k != "rope_theta"}
        p_type = p_rest.pop("rope_type", p_rest.pop("type", "default"))
        s_type = s_rest.pop("rope_type", s_rest.pop("type", "default"))
        if (p_type, p_rest) != (s_type, s_rest):
            raise ValueError(
                f"config.json gives rope_parameters {params} and rope_scaling {scaling} (transformers versions read "
                "different ones): keep one of them"
            )
    if params and not scaling:
        scaling = dict(params)
    theta = next(iter(thetas.values()), 10000.0)
    if scaling:
        scaling = {k: v for k, v in scaling.items() if k not in ("rope_theta", "partial_rotary_factor")}
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type == "default":
            scaling = None
        if rope_type == "yarn":
            _check_yarn_factor(scaling, d.get("max_position_embeddings", 2048))
        if rope_type in ("llama3", "yarn", "longrope"):
            if d.get("original_max_position_embeddings") is not None:
                # transformers 5 takes the top-level key over the RoPE dict's (Phi-3 stores it there)
                scaling["original_max_position_embeddings"] = d["original_max_position_embeddings"]
            elif scaling.get("original_max_position_embeddings") is None:  # transformers' fallback
                scaling["original_max_position_embeddings"] = d.get("max_position_embeddings")
    return float(theta), scaling or None


def _read_partial_rotary(d: dict[str, Any], default: float) -> float:
    """``partial_rotary_factor`` from the top level or a RoPE dict (transformers 5 keeps it in
    ``rope_parameters``); ``default`` (the class's: GLM-4's 0.5) where none gives it. Values that differ are refused: transformers versions read
    different ones."""
    values = {}
    if d.get("partial_rotary_factor") is not None:
        values["partial_rotary_factor"] = d["partial_rotary_factor"]
    for key in ("rope_parameters", "rope_scaling"):
        rope = d.get(key)
        if isinstance(rope, dict) and rope.get("partial_rotary_factor") is not None:
            values[f"{key}.partial_rotary_factor"] = rope["partial_rotary_factor"]
    if len({float(v) for v in values.values()}) > 1:
        raise ValueError(
            f"config.json gives partial_rotary_factor {values} (transformers versions read different ones): make "
            "them agree"
        )
    return float(next(iter(values.values()), default))


def _phi3_rope_type(d: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's RoPE dict as its transformers class reads it: the old names ``su`` and ``yarn`` are LongRoPE."""
    out = dict(d)
    for key in ("rope_parameters", "rope_scaling"):
        rope = out.get(key)
        if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) in ("su", "yarn"):
            out[key] = {**{k: v for k, v in rope.items() if k != "type"}, "rope_type": "longrope"}
    return out


def _check_yarn_factor(scaling: dict[str, Any], max_positions: int) -> None:
    """transformers 4.x scales YaRN by max_position_embeddings / original_max_position_embeddings where the
    file gives the original length, 5.x (and vLLM) by ``factor``: a file where the two differ computes
    another model under each, so it is refused with the fix."""
    factor, original = scaling.get("factor"), scaling.get("original_max_position_embeddings")
    if factor is None or not original or math.isclose(float(factor), max_positions / original):
        return
    raise ValueError(
        f"config.json rope_scaling yarn: factor {factor} but max_position_embeddings / original_max_position_embeddings"
        f" = {max_positions}/{original} (transformers 4.x scales by that ratio, 5.x and vLLM by factor): set "
        f"max_position_embeddings to {round(float(factor) * original)}"
    )


def _flatten_vl(d: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], tuple[int, ...]]:
    """A Qwen2.5-VL config.json as (the text decoder's keys at top level, the vision part,
    mrope_section). transformers 5 nests the text keys under ``text_config``; older files keep
    them at top level with ``rope_scaling: {type: mrope, mrope_section}``."""
    if "vision_config" not in d:
        raise ValueError("Qwen2_5_VLForConditionalGeneration config.json has no 'vision_config'")
    flat = {**d, **(d.get("text_config") or {})}
    # transformers 4.57 writes a config built in Python with `architectures` in text_config only
    flat["architectures"] = d.get("architectures") or ["Qwen2_5_VLForConditionalGeneration"]
    rope = dict(flat.get("rope_parameters") or flat.get("rope_scaling") or {})
    section = rope.pop("mrope_section", None)
    if section is None:
        raise ValueError("Qwen2_5_VLForConditionalGeneration config.json has no rope mrope_section")
    if rope.get("rope_type", rope.get("type")) == "mrope":
        rope["rope_type"] = "default"
        rope.pop("type", None)
    flat.pop("rope_parameters", None)
    flat["rope_scaling"] = rope or None
    if "rope_theta" in rope and "rope_theta" not in flat:
        flat["rope_theta"] = rope["rope_theta"]
    if "tie_word_embeddings" in d:
        flat["tie_word_embeddings"] = d["tie_word_embeddings"]
    vision = {
        k: d[k] for k in ("vision_config", "image_token_id", "vision_start_token_id", "vision_end_token_id") if k in d
    }
    return flat, vision, tuple(section)


def _nest_vl(text: dict[str, Any], config: ModelConfig) -> dict[str, Any]:
    """The transformers 5 layout of a Qwen2.5-VL config.json from the flat text dict."""
    text = dict(text)
    top = {"architectures": text.pop("architectures"), "model_type": "qwen2_5_vl"}
    text["model_type"] = "qwen2_5_vl_text"
    text["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": text.pop("rope_theta"),
        "mrope_section": list(config.mrope_section or ()),
    }
    text.pop("rope_scaling", None)
    top["tie_word_embeddings"] = text.pop("tie_word_embeddings")
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        top[k] = text[k]
    vision = {k: v for k, v in (config.vision or {}).items() if k not in ("min_pixels", "max_pixels")}
    return {**top, "text_config": text, **vision}
