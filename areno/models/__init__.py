"""One Llama-family decoder (Llama, Qwen2, Qwen3, Mistral, OLMo 2, OLMo 3, Gemma 3, Phi-3, SmolLM3 and the expert
layouts) shared by training and rollout."""

from areno.models.attention import AttentionBackend, PackedCausalAttention
from areno.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from areno.models.decoder import Decoder
from areno.models.hf_io import init_model_dir, load_model, read_config, save_model, tiny_config
from areno.models.logprobs import logprobs_from_hidden, packed_logprobs
from areno.models.tp_plan import check_tp_size, tp_plan

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "AttentionBackend",
    "Decoder",
    "ModelConfig",
    "PackedCausalAttention",
    "check_tp_size",
    "init_model_dir",
    "load_model",
    "logprobs_from_hidden",
    "packed_logprobs",
    "read_config",
    "save_model",
    "tiny_config",
    "tp_plan",
]
