"""``load_pretrained_tokenizer``: a tiny model's character tokenizer loads as it was saved (spaces and
vocabulary intact, whatever class transformers maps the model type to), as does any tokenizer.json
saved from ``PreTrainedTokenizerFast``; checkpoints naming a model family's class load as
``AutoTokenizer`` loads them."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

import areno.data.tokenizer as tokenizer_module
from areno.data.tokenizer import build_char_tokenizer, is_char_tokenizer, load_pretrained_tokenizer
from areno.models.hf_io import init_model_dir, tiny_config


def _model_dir(tmp_path, tokenizer):
    config = tiny_config(len(tokenizer), hidden_size=16, layers=1, heads=2, kv_heads=1, intermediate_size=32)
    return init_model_dir(tmp_path / "model", config, tokenizer)


def test_a_char_tokenizer_of_a_qwen2_checkpoint_loads_as_saved(tmp_path):
    built = build_char_tokenizer()
    model_dir = _model_dir(tmp_path, built)
    assert is_char_tokenizer(model_dir)
    loaded = load_pretrained_tokenizer(model_dir)
    assert isinstance(loaded, PreTrainedTokenizerFast)
    text = "sort 4193: 1349"
    assert loaded(text)["input_ids"] == built(text)["input_ids"]
    assert loaded.decode(loaded(text)["input_ids"]) == text  # the spaces stay
    assert loaded.get_vocab() == built.get_vocab() and len(loaded) == len(built)
    assert (loaded.eos_token_id, loaded.pad_token_id, loaded.chat_template) == (
        built.eos_token_id,
        built.pad_token_id,
        built.chat_template,
    )


def test_a_tokenizer_json_loads_as_itself_and_a_model_familys_class_as_auto_tokenizer_loads_it(tmp_path):
    import json

    from tokenizers import Tokenizer

    other = build_char_tokenizer()
    other.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # not areno's char tokenizer
    model_dir = _model_dir(tmp_path, other)
    assert not is_char_tokenizer(model_dir)
    # saved from PreTrainedTokenizerFast: its tokenizer.json's own splitting (transformers 5's AutoTokenizer
    # would give this qwen2 checkpoint Qwen2Tokenizer, which splits by its own rules)
    loaded = load_pretrained_tokenizer(model_dir)
    own = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert loaded("a b c", add_special_tokens=False)["input_ids"] == own.encode("a b c").ids
    # a model family's tokenizer class named in tokenizer_config.json: as AutoTokenizer loads it
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "Qwen2Tokenizer"}))
    loaded, auto = load_pretrained_tokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)
    assert type(loaded) is type(auto)
    assert loaded("a b c")["input_ids"] == auto("a b c")["input_ids"]
    assert not is_char_tokenizer(tmp_path / "missing")


def test_a_malformed_tokenizer_file_is_a_value_error_whichever_transformers_reads_it(tmp_path, monkeypatch):
    """transformers 4.x lets the tokenizers library's bare ``Exception`` ("key must be a string at line 1")
    through where 5.x raises a ValueError; the callers name the file for either (preflight, ``areno serve``)."""

    def bare(model_dir):
        raise Exception("key must be a string at line 1 column 2")  # what tokenizers raises

    monkeypatch.setattr(tokenizer_module, "_load_pretrained_tokenizer", bare)
    with pytest.raises(ValueError, match="key must be a string"):
        load_pretrained_tokenizer(tmp_path)

    def other(model_dir):
        raise KeyError("vocab")

    monkeypatch.setattr(tokenizer_module, "_load_pretrained_tokenizer", other)
    with pytest.raises(KeyError):  # anything else as it was raised
        load_pretrained_tokenizer(tmp_path)


def test_a_users_word_level_tokenizer_with_a_plain_chatml_template_is_not_the_char_tokenizer(tmp_path):
    """walk25: a user's word-level tokenizer whose ChatML template was byte-identical to areno's was taken for
    the character tokenizer, so `data.chat_template=auto` left its prompts untemplated."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from areno.data.prompts import uses_template
    from areno.data.tokenizer import CHAT_TEMPLATE, is_char_tokenizer_object

    vocab = {"<pad>": 0, "</s>": 1, "[UNK]": 2, "<|im_start|>": 3, "<|im_end|>": 4, "hello": 5}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    user = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>")
    user.chat_template = CHAT_TEMPLATE
    user.save_pretrained(tmp_path / "user")
    assert not is_char_tokenizer_object(user) and not is_char_tokenizer(tmp_path / "user")
    assert uses_template(user, "auto")
    char = build_char_tokenizer()
    char.save_pretrained(tmp_path / "char")
    assert is_char_tokenizer_object(char) and is_char_tokenizer(tmp_path / "char")


def test_is_char_tokenizer_object_reads_the_pre_tokenizer_not_the_whole_vocabulary():
    """The check ran per prompt and serialized the whole tokenizer: 70 ms a prompt group at a 150k-token
    vocabulary (the e2e bench's 0.5B rollout phase doubled). It now reads the parts it needs; the answers
    match the whole-document check for the char tokenizer, a user's word-level one and a Sequence pre-tokenizer."""
    from tokenizers import pre_tokenizers

    from areno.data.tokenizer import CHAT_TEMPLATE, _is_char_spec, is_char_tokenizer_object

    class NoDump:
        """A backend whose to_str fails: the check must not need the whole document."""

        def __init__(self, inner):
            self._inner = inner

        def __getattr__(self, name):
            if name == "to_str":
                raise AssertionError("serialized the whole tokenizer")
            return getattr(self._inner, name)

    class Wrapped:
        def __init__(self, tok):
            self.chat_template = tok.chat_template
            self.backend_tokenizer = NoDump(tok.backend_tokenizer)

    char = build_char_tokenizer(vocab_padding=4000)
    other = build_char_tokenizer()
    other.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace()])
    other.chat_template = CHAT_TEMPLATE
    for tok, expected in ((char, True), (other, False)):
        whole = _is_char_spec(json.loads(tok.backend_tokenizer.to_str()))
        assert whole is expected
        assert is_char_tokenizer_object(Wrapped(tok)) is expected
