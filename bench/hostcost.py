"""Host-side costs that must not grow with what they need not: each case times a hot-path function at a
small and a large size of the thing it scales with, per unit (a prompt, a token), in one process. Prints one
JSON object: the headline is the worst case's per-unit cost at the large size against its own small size
(``ratio`` = large / small: about 1 for a cost that stays per unit; a cost that grows with the vocabulary,
the output length or the batch shows as a large ratio). No model download, CPU, about a minute.

    python -m bench.hostcost
    python -m bench.hostcost --cases stop_strings,gae --repeats 5

Cases (what the unit's cost must not grow with):
- ``render_prompt``: one prompt under areno's character tokenizer, its vocabulary 100 -> 150k tokens (a check
  that serialized the whole tokenizer per prompt doubled a 0.5B rollout phase);
- ``stop_strings``: what one stop string adds per generated token, 128 -> 1,024 tokens a request (a whole
  decode per token made it quadratic);
- ``gae``: ``gae_T`` per loss token, 16 x 256 -> 64 x 1,024 tokens (a Python loop per token);
- ``wire``: one rollout's token-level fields through ``/generate_many``'s encoding and the client's decoding,
  per token, 1k -> 16k tokens.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

import torch

from bench._common import emit, headline, parser, ratio

Case = Callable[[int], tuple[float, int]]
"""``size -> (seconds, units)`` for one measurement at ``size``."""


def render_prompt_case(vocab_padding: int) -> tuple[float, int]:
    from areno.data.prompts import render_prompt
    from areno.data.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer(vocab_padding=vocab_padding)
    prompts = [f"What is {i} + {i + 1}? Answer with a number." for i in range(64)]
    t0 = time.perf_counter()
    for p in prompts:
        render_prompt(tok, p)
    return time.perf_counter() - t0, len(prompts)


def _stop_engine():
    from areno.data.tokenizer import build_char_tokenizer
    from areno.models.decoder import Decoder
    from areno.models.hf_io import tiny_config
    from areno.rollout.engine import RolloutEngine, RolloutEngineConfig

    tok = build_char_tokenizer()
    cfg = tiny_config(len(tok), hidden_size=32, layers=1, heads=2, kv_heads=1, max_position_embeddings=2048)
    torch.manual_seed(0)
    config = RolloutEngineConfig(block_size=16, num_blocks=2048, max_num_seqs=16, max_model_len=2048)
    return RolloutEngine(Decoder(cfg).eval(), cfg, config=config, tokenizer=tok)


def stop_strings_case(length: int) -> tuple[float, int]:
    from areno.types import SamplingParams

    engine = _stop_engine()
    prompts = [[5, 6, 7, 8]] * 8

    def run(stop: list[str]) -> float:
        params = SamplingParams(temperature=1.0, seed=1, max_new_tokens=length, ignore_eos=True, stop=stop)
        t0 = time.perf_counter()
        engine.generate(prompts, params)
        return time.perf_counter() - t0

    run([])  # warm-up
    plain, stopped = run([]), run(["<never>"])
    return max(stopped - plain, 0.0), len(prompts) * length


def gae_case(tokens_per_seq: int) -> tuple[float, int]:
    from areno.algo.advantages import gae_T

    seqs = max(16, tokens_per_seq // 16)
    lengths = [tokens_per_seq] * seqs
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    total = int(cu[-1])
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(total, dtype=torch.bool)
    values = torch.randn(total, generator=g)
    rewards = torch.randn(seqs, generator=g)
    t0 = time.perf_counter()
    gae_T(rewards, values, cu, mask, gamma=1.0, lam=0.95)
    return time.perf_counter() - t0, total


def wire_case(tokens: int) -> tuple[float, int]:
    import json

    from areno.rollout.client import _output_from_json
    from areno.rollout.server import _json_response, _output_dict
    from areno.types import GenerationOutput

    rng = random.Random(0)
    outs = [
        GenerationOutput(
            request_id=f"r{i}",
            prompt_ids=[rng.randrange(150_000) for _ in range(128)],
            output_ids=[rng.randrange(150_000) for _ in range(tokens)],
            output_logprobs=torch.randn(tokens).tolist(),
            output_versions=[1] * tokens,
            finish_reason="length",
        )
        for i in range(8)
    ]
    t0 = time.perf_counter()
    body = _json_response({"outputs": [_output_dict(o, "base64") for o in outs]}).body
    [_output_from_json(o) for o in json.loads(body)["outputs"]]
    return time.perf_counter() - t0, 8 * tokens


CASES: dict[str, tuple[Case, int, int, str]] = {
    "render_prompt": (render_prompt_case, 0, 150_000, "vocabulary padding"),
    "stop_strings": (stop_strings_case, 128, 1024, "tokens a request"),
    "gae": (gae_case, 256, 1024, "tokens a sequence"),
    "wire": (wire_case, 1024, 16_384, "tokens a rollout"),
}


def measure(case: Case, size: int, repeats: int) -> float:
    """Median seconds per unit at ``size`` over ``repeats`` measurements (after one warm-up)."""
    case(size)
    per_unit = []
    for _ in range(repeats):
        seconds, units = case(size)
        per_unit.append(seconds / units)
    return statistics.median(per_unit)


def main(argv: list[str] | None = None) -> int:
    p = parser("hostcost", __doc__)
    p.add_argument("--cases", default=",".join(CASES), help=f"comma list of {','.join(CASES)}")
    p.add_argument("--repeats", type=int, default=3, help="measurements per size (their median)")
    args = p.parse_args(argv)
    names = args.cases.split(",")
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        p.error(f"unknown case(s) {unknown}: choose from {', '.join(CASES)}")
    torch.set_num_threads(1)  # per-unit host costs, not intra-op parallelism
    results = {}
    for name in names:
        case, small, large, what = CASES[name]
        a, b = measure(case, small, args.repeats), measure(case, large, args.repeats)
        results[name] = {
            "scales_with": what,
            "small": small,
            "large": large,
            "us_per_unit_small": round(a * 1e6, 3),
            "us_per_unit_large": round(b * 1e6, 3),
            "ratio": ratio(b, a),
        }
    worst = max(results, key=lambda n: results[n]["ratio"] or 0.0)
    w = results[worst]
    head = headline(
        metric=f"host cost per unit at the large size ({worst}: {w['scales_with']} {w['large']})",
        figure=w["us_per_unit_large"],
        baseline_name=f"the same case at {w['small']}",
        baseline=w["us_per_unit_small"],
        ratio=w["ratio"],
        ratio_is="large / small per unit (about 1: the cost stays per unit)",
    )
    emit("hostcost", head, {"results": results})
    return 0


if __name__ == "__main__":
    main()
