"""bench/train.py's variant names: each part selects one lever, an unknown name is refused."""

import pytest

from bench.train import parse_variant


def test_variant_parts_select_levers():
    assert parse_variant("eager") == (False, "flex", True, "layers")
    assert parse_variant("compile+varlen") == (True, "varlen", True, "layers")
    assert parse_variant("compilemodel+varlen") == (True, "varlen", True, "model")
    assert parse_variant("compile+nohostopts") == (True, "flex", False, "layers")


@pytest.mark.parametrize("name", ["fast", "compile+sdpa", "compile+varlen+flex"])
def test_unknown_variant_is_refused(name):
    with pytest.raises(ValueError, match="--variants"):
        parse_variant(name)
