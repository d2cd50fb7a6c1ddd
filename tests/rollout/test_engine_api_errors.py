"""The rollout engine used from Python (``build_engine``, ``RolloutEngine.generate`` / ``add_request``,
``update_weights_from_disk``): the common input mistakes are one clear error naming the argument and
the form it takes, raised before any request is added; a version that goes backwards is refused as
``areno serve`` refuses it."""

from __future__ import annotations

import pytest

from areno.errors import ConfigError
from areno.models.hf_io import init_model_dir, read_config
from areno.rollout.engine import WeightUpdateError
from areno.rollout.errors import RequestRejected
from areno.rollout.server import build_engine
from areno.types import SamplingParams

GREEDY = SamplingParams(temperature=0, max_new_tokens=3)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    built, _ = build_engine(str(tiny_model_dir), device="cpu", num_blocks=64, block_size=8, max_model_len=64)
    return built


@pytest.mark.parametrize(
    ("prompts", "params", "error", "fragment"),
    [
        (["add 1+2="], GREEDY, TypeError, "prompts[0] is text 'add 1+2=', not token ids: pass tokenizer.encode(text)"),
        ("add 1+2=", GREEDY, TypeError, "prompts must be a list of prompts, each a list of token ids, got str"),
        ([5, 6, 7], GREEDY, TypeError, "prompts is one flat list of token ids [5, 6, 7], but it is a list of prompts"),
        ([[5, "x"]], GREEDY, TypeError, "prompt_ids must be a list of token ids (ints), but holds 'x'"),
        ([[5, 6]], {"temperature": 0}, TypeError, "params must be an areno.types.SamplingParams, got dict"),
        ([[5, 6], [7]], [GREEDY, {"temperature": 0}], TypeError, "params[1] must be an areno.types.SamplingParams"),
    ],
)
def test_generate_names_the_argument_and_its_form(engine, prompts, params, error, fragment):
    with pytest.raises(error) as info:
        engine.generate(prompts, params)
    message = str(info.value)
    assert fragment in message and "\n" not in message, message
    assert not engine.has_unfinished()  # refused before any request was added
    assert [o.output_ids for o in engine.generate([[5, 6, 7]], GREEDY)]  # and the engine still serves


def test_a_dict_of_sampling_params_is_named_with_the_call_that_makes_one(engine):
    with pytest.raises(TypeError, match=r"pass SamplingParams\(\*\*params\)$"):
        engine.add_request([5, 6], {"temperature": 0})
    with pytest.raises(TypeError, match=r"^prompt_ids is text 'abc', not token ids"):
        engine.add_request("abc", GREEDY)


def test_build_engine_names_a_misspelled_or_mistyped_setting(tiny_model_dir):
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'max_num_seq' \(did you mean 'max_num_seqs'\?\)"):
        build_engine(str(tiny_model_dir), device="cpu", max_num_seq=4)
    with pytest.raises(ConfigError, match=r"^build_engine\(max_num_seqs=\.\.\.\): must be an integer, got '4'$"):
        build_engine(str(tiny_model_dir), device="cpu", max_num_seqs="4")


def test_a_weight_version_only_moves_forward(tiny_model_dir, tmp_path, char_tokenizer):
    built, _ = build_engine(str(tiny_model_dir), device="cpu", num_blocks=64, block_size=8, max_model_len=64)
    new_dir = init_model_dir(tmp_path / "new", read_config(tiny_model_dir), char_tokenizer, seed=1)
    built.update_weights_from_disk(str(new_dir), version=2)
    with pytest.raises(WeightUpdateError, match=r"version 1 is older than the served version 2: versions only move"):
        built.update_weights_from_disk(str(tiny_model_dir), version=1)
    assert built.version == 2
    built.update_weights_from_disk(str(new_dir), version=2)  # the same version again is no step back
    with pytest.raises(TypeError, match=r"version must be an integer \(the policy version\), got '3'"):
        built.update_weights_from_disk(str(new_dir), version="3")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": "0"}, "SamplingParams.temperature: must be a number, got '0'"),
        ({"top_p": None}, "SamplingParams.top_p: must be a number, got None"),
        ({"max_new_tokens": 4.0}, "SamplingParams.max_new_tokens: must be an integer, got 4.0"),
        ({"seed": "7"}, "SamplingParams.seed: must be an integer, got '7'"),
        ({"top_k": True}, "SamplingParams.top_k: must be an integer, got True"),
    ],
)
def test_sampling_params_name_a_mistyped_field(kwargs, message):
    with pytest.raises(TypeError) as info:
        SamplingParams(**kwargs)
    assert str(info.value) == message
    SamplingParams(seed=None, top_k=5, temperature=0.5)  # the right types pass


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": float("nan")}, "temperature must be 0 (greedy) or a finite number >= 0.001, got nan"),
        ({"temperature": 1e-38}, "temperature must be 0 (greedy) or a finite number >= 0.001, got 1e-38"),
        ({"temperature": float("inf")}, "temperature must be 0 (greedy) or a finite number >= 0.001, got inf"),
        ({"seed": 2**60}, f"seed must be within +-{2**53 - 1} (2**53 - 1), got {2**60}"),
    ],
)
def test_sampling_params_refuse_what_would_sample_otherwise_than_asked(kwargs, message):
    """walk13: from Python (the server refused them already) a NaN temperature sampled greedily and seeds
    past 2**53 collided in the sampler's float64 table (2**60 and 2**60 + 1 gave the same tokens)."""
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert str(info.value) == message
    SamplingParams(temperature=0.001, seed=-(2**53 - 1))  # the bounds themselves pass


def test_a_stop_token_outside_the_vocabulary_is_refused_alone(engine):
    """walk13: the sampler indexed the logits by stop ids, so one out of range failed the step and with it every
    request in flight; it is now refused when it is added, and the engine goes on serving the others."""
    vocab = engine.model_config.vocab_size
    bad = SamplingParams(temperature=0, max_new_tokens=3, min_new_tokens=1, stop_token_ids=(vocab + 5,))
    with pytest.raises(RequestRejected, match=rf"stop_token_ids holds token id {vocab + 5} outside the vocabulary"):
        engine.generate([[5, 6, 7]], bad)
    assert not engine.has_unfinished()
    assert [o.output_ids for o in engine.generate([[5, 6, 7]], GREEDY)]
