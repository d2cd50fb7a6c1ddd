"""Chat templates of model families the tests render with, on areno's character tokenizer."""

from __future__ import annotations

from areno.data.tokenizer import build_char_tokenizer

R1_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}<|User|>{{ m['content'] }}{% else %}"
    "{% set c = m['content'] %}{% if '</think>' in c %}{% set c = c.split('</think>')[-1] %}{% endif %}"
    "<|Assistant|>{{ c }}</s>{% endif %}{% endfor %}{% if add_generation_prompt %}<|Assistant|>{% endif %}"
)
"""DeepSeek-R1's shape: an assistant turn keeps only what follows ``</think>``."""


def r1_tokenizer():
    """A character tokenizer with ``R1_TEMPLATE`` and its special tokens."""
    tok = build_char_tokenizer(extra_tokens=("<|User|>", "<|Assistant|>", "<think>", "</think>"))
    tok.chat_template = R1_TEMPLATE
    return tok
