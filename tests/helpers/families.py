"""The model-family tests' shared pieces: a tiny random checkpoint saved by transformers itself, a packed
batch of three sequences, and transformers' log-probs of them (the reference areno's must equal)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

VOCAB = 61
LENS = [9, 14, 5]


def saved_by_transformers(config_cls, path, *, spread_norms: bool = False, **kw) -> torch.nn.Module:
    """A random model of ``config_cls`` (a transformers config class; ``kw`` over a 2-layer, 48-wide,
    4-head / 2-kv-head shape) saved to ``path`` by transformers and loaded back in float32 with eager
    attention. ``spread_norms``: norm weights drawn from [0.3, 1.7], so that a norm in the wrong place shows."""
    torch.manual_seed(0)
    shape = dict(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = AutoModelForCausalLM.from_config(config_cls(**{**shape, **kw}), attn_implementation="eager")
    if spread_norms:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.uniform_(0.3, 1.7)
    model.save_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def packed_batch() -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Three random sequences of ``LENS`` tokens: (each, packed, cu_seqlens)."""
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in LENS]
    return seqs, torch.cat(seqs), torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()])


def reference_logprobs(ref: torch.nn.Module, seqs: list[torch.Tensor], *, grad: bool = False) -> torch.Tensor:
    """logprobs_T[t] = log p(ids[t] | ids[:t]) under transformers' model, 0 at each sequence's start
    (``grad``: differentiable, for a backward to compare)."""
    out = []
    with torch.set_grad_enabled(grad):
        for s in seqs:
            logits = ref(s[None]).logits[0].float()
            lp = torch.log_softmax(logits[:-1], -1).gather(-1, s[1:, None])[:, 0]
            out.append(torch.cat([lp.new_zeros(1), lp]))
    return torch.cat(out)
