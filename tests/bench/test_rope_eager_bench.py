"""``bench/rope_eager.py``: one eager RoPE over the adjacent q and k columns of the fused product gives the
tensors of two calls bit for bit at every shape it times, and it reports both timings."""

import json

from bench import rope_eager


def test_one_call_equals_two_calls_and_is_timed(capsys):
    rope_eager.main(["--threads", "1", "--rounds", "1", "--calls", "3"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result["us_per_layer"]) == set(rope_eager.SHAPES)
    for r in result["us_per_layer"].values():
        assert r["bit_identical"] is True
        assert r["two_calls"] > 0 and r["one_call"] > 0
