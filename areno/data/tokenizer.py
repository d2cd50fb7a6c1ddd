"""Tiny local tokenizers for tests, the demo and benchmarks: no download, no training data.

``build_char_tokenizer`` makes a character-level ``PreTrainedTokenizerFast`` (one token per
printable ASCII character plus special tokens and a simple chat template), saved with
``save_pretrained`` next to the model it belongs to. ``load_pretrained_tokenizer`` is how areno
loads any checkpoint's tokenizer: ``AutoTokenizer``'s choice, except for this one.
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from areno.errors import ModelDirError

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, IM_START, IM_END)

# Qwen-style template; the tiny task models are trained on raw prompts, chat is for the server.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_char_tokenizer(
    alphabet: str = string.printable, *, extra_tokens: tuple[str, ...] = (), vocab_padding: int = 0
) -> PreTrainedTokenizerFast:
    """A character-level tokenizer over ``alphabet``.

    Args:
        alphabet: characters that get one token each (order fixes the ids after the specials).
        extra_tokens: additional whole-word tokens (e.g. ``"<tool_call>"``).
        vocab_padding: unused ids appended as ``<unused{i}>`` tokens, to give a model the vocabulary
            size of a real checkpoint in benchmarks.
    """
    vocab: dict[str, int] = {}
    for tok in SPECIAL_TOKENS + tuple(extra_tokens):
        vocab.setdefault(tok, len(vocab))
    for ch in alphabet:
        vocab.setdefault(ch, len(vocab))
    for i in range(vocab_padding):
        vocab.setdefault(f"<unused{i}>", len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    special = list(SPECIAL_TOKENS) + list(extra_tokens)
    tok.add_special_tokens(special)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        additional_special_tokens=[IM_START, IM_END, *extra_tokens],
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def _is_char_spec(spec: dict) -> bool:
    """Whether a ``tokenizer.json`` document is ``build_char_tokenizer``'s: a word-level model over single
    characters (split between every character, unknown ones read as the pad token), which a user's own
    word-level tokenizer with a plain ChatML template (the same text as ours) is not."""
    pre = spec.get("pre_tokenizer") or {}
    return (
        spec["model"]["type"] == "WordLevel"
        and spec["model"].get("unk_token") == PAD
        and pre.get("type") == "Split"
        and pre.get("pattern") == {"String": ""}
    )


def is_char_tokenizer(model_dir: str | Path) -> bool:
    """Whether ``model_dir`` holds a tokenizer ``build_char_tokenizer`` made: the chat template above
    (saved as ``chat_template.jinja`` or in ``tokenizer_config.json``) and its character-level model."""
    model_dir = Path(model_dir)
    try:
        if (model_dir / "chat_template.jinja").is_file():
            template = (model_dir / "chat_template.jinja").read_text()
        else:
            template = json.loads((model_dir / "tokenizer_config.json").read_text()).get("chat_template")
        if template != CHAT_TEMPLATE:
            return False
        return _is_char_spec(json.loads((model_dir / "tokenizer.json").read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def is_char_tokenizer_object(tokenizer: Any) -> bool:
    """``is_char_tokenizer`` of a loaded tokenizer."""
    if getattr(tokenizer, "chat_template", None) != CHAT_TEMPLATE or not hasattr(tokenizer, "backend_tokenizer"):
        return False
    backend = tokenizer.backend_tokenizer
    if not isinstance(backend.model, models.WordLevel):
        return False
    # the parts _is_char_spec reads, not the whole document: prompts ask this once each, and
    # serializing a 150k-token vocabulary took 70 ms a prompt group
    pre = backend.pre_tokenizer
    try:
        pre_spec = json.loads(pre.__getstate__()) if pre is not None else {}
    except (TypeError, ValueError, AttributeError):
        pre_spec = json.loads(backend.to_str()).get("pre_tokenizer") or {}
    return _is_char_spec(
        {"model": {"type": "WordLevel", "unk_token": backend.model.unk_token}, "pre_tokenizer": pre_spec}
    )


def _tokenizers_file_class(model_dir: Path) -> bool:
    """Whether ``model_dir``'s tokenizer is a plain ``tokenizer.json`` (saved from a
    ``PreTrainedTokenizerFast``, or with no class named), not a model family's tokenizer class."""
    try:
        named = json.loads((model_dir / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        named = None
    return (model_dir / "tokenizer.json").is_file() and named in (None, "PreTrainedTokenizerFast", "TokenizersBackend")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""A model directory holding none of these has no tokenizer."""


def check_has_tokenizer(model_dir: Path, key: str | None = None) -> None:
    """A one-line ModelDirError (naming ``key``, the setting that gave the directory) when ``model_dir``
    holds none of ``TOKENIZER_FILES``."""
    if not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        where = f"{key}: " if key else ""
        raise ModelDirError(
            f"{where}{model_dir} has no tokenizer ({' / '.join(TOKENIZER_FILES)}): copy the model's tokenizer files there"
        )


def load_pretrained_tokenizer(model_dir: str | Path) -> Any:
    """The tokenizer of a local checkpoint: ``AutoTokenizer.from_pretrained``, except a character
    tokenizer of ``build_char_tokenizer`` and any ``tokenizer.json`` saved from ``PreTrainedTokenizerFast``
    (``tokenizer_class`` that, ``TokenizersBackend`` or none), which load as saved. transformers 5 gives a
    ``qwen2`` checkpoint's generic fast tokenizer its model type's class (``Qwen2Tokenizer``), whose own
    splitting rules replace the file's (the character tokenizer's ``"sort 4193:"`` read as ``"sort4193:"``,
    with a token the model's vocabulary lacks). That path also skips importing transformers' registry of
    model classes, which ``AutoTokenizer`` needs (about a second). A malformed ``tokenizer.json`` is a
    ``ValueError`` whichever transformers reads it (4.x lets the tokenizers library's bare ``Exception``
    through)."""
    try:
        return _load_pretrained_tokenizer(model_dir)
    except Exception as exc:
        if type(exc) is not Exception:
            raise
        raise ValueError(str(exc)) from exc


def _load_pretrained_tokenizer(model_dir: str | Path) -> Any:
    if is_char_tokenizer(model_dir) or _tokenizers_file_class(Path(model_dir)):
        # transformers 5's AutoTokenizer would give a qwen2 checkpoint Qwen2Tokenizer, whose own splitting
        # rules replace the tokenizer.json's
        return PreTrainedTokenizerFast.from_pretrained(model_dir)
    if Path(model_dir).is_dir():  # transformers would build an empty tokenizer (a vocabulary of one)
        check_has_tokenizer(Path(model_dir))
    from transformers import AutoTokenizer  # the model registry: imported only for real checkpoints

    return AutoTokenizer.from_pretrained(model_dir)
