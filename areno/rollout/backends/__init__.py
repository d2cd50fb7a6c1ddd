"""Clients of inference servers of other systems behind ``RolloutClient``: token ids in; token ids,
log-probs of the sampled tokens and per-token policy versions out (``vllm.py``, ``sglang.py``).

Both stream their answers, so that each token is stamped with the policy version the rollout side
serves when the token arrives: a policy sync pauses the server (requests kept), loads the new
weights, bumps the version and resumes, so tokens of a request in flight before the pause carry the
old version and those after it the new one. Errors are those of ``HTTPRolloutClient``
(``RolloutServerError``, ``httpx.TransportError``, ``RolloutRequestTimeout``), so
``MultiServerRolloutClient`` routes around a dead server for them as for ``areno serve``.
``admin.py`` holds the servers' control routes; ``nccl.py`` the trainer's half of vLLM's NCCL
weight transfer (``rollout.weight_transfer=nccl``).
"""

from areno.rollout.backends.base import StreamingServerClient
from areno.rollout.backends.sglang import SGLangRolloutClient
from areno.rollout.backends.vllm import VLLMRolloutClient

__all__ = ["SGLangRolloutClient", "StreamingServerClient", "VLLMRolloutClient"]
