"""What ``reward.model`` costs a step: the training phase with the reward model's forward against without it.

One colocated GRPO run (``Trainer``, the sort task, a random-init policy of ``--hidden`` x ``--layers`` with the
character tokenizer) and a reward model of the same shape (transformers' ``AutoModelForSequenceClassification``
over the policy's checkpoint, ``num_labels=1``). One rollout batch is drawn, then the training phase
(``RecipeRunner.step``: the forwards, the reward model's included, and the policy's optimizer step) runs on it
``--rounds`` times with ``reward.model`` and as many without, its rewards drawn at random so that every
sequence trains in both arms, (a second ``RecipeRunner`` over the same policy
backend, its recipe without the frozen role), alternated so that the machine's drift falls on both.

    python -m bench.reward_model --device cpu                 # CPU: hidden 256, 4 layers
    python -m bench.reward_model --device cuda --hidden 896 --layers 24 --samples 8

Headline: ``figure`` = the median training phase with the reward model, ``baseline`` = without,
``ratio`` = with / without (the cost, > 1).
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
from pathlib import Path

import torch

from areno.api.config import load_config
from areno.api.trainer import Trainer
from areno.data.tokenizer import build_char_tokenizer
from areno.models.hf_io import init_model_dir, tiny_config
from areno.recipes.runner import RecipeRunner
from bench._common import emit, headline, parser, ratio, synced_s


def _reward_model_dir(root: Path, shape: dict, seed: int) -> Path:
    from transformers import AutoModelForSequenceClassification

    tok = build_char_tokenizer()
    causal = init_model_dir(root / "rm_causal", tiny_config(len(tok), **shape), tok, seed=seed)
    model = AutoModelForSequenceClassification.from_pretrained(causal, num_labels=1)
    model.config.pad_token_id = None  # unpadded sequences: score the last token
    out = root / "rm"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> dict:
    p = parser("reward_model", __doc__)
    p.add_argument("--device", default="cpu")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    heads = max(args.hidden // 64, 2)
    shape = dict(
        hidden_size=args.hidden,
        layers=args.layers,
        heads=heads,
        kv_heads=max(heads // 2, 1),
        intermediate_size=3 * args.hidden,
    )
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        rm = _reward_model_dir(root, shape, seed=2)
        init = "{" + ", ".join(f"{k}: {v}" for k, v in shape.items()) + "}"
        cfg = load_config(
            None,
            [
                f"run_dir={root / 'run'}",
                f"model.path={root / 'policy'}",
                f"model.init_tiny={init}",
                "data.task=sort",
                "data.num_eval=0",
                f"rollout.batch_size={args.prompts}",
                f"rollout.n_samples={args.samples}",
                f"rollout.max_new_tokens={args.max_new_tokens}",
                f"cluster.device={args.device}",
                "observe.console=false",
                f"reward.model={rm}",
                "reward.fn=[areno.rewards.tasks:exact_match]",
            ],
        )
        trainer = Trainer.init(cfg)
        try:
            batch = trainer.rollout_token_batch(0).batch
            # rewards that vary within every group: both arms train every sequence (a random policy's exact
            # match is 0 everywhere, and a step whose advantages are all 0 skips its forward and backward)
            rewards_B = torch.randn(batch.num_seqs, generator=torch.Generator().manual_seed(0))
            batch = dataclasses.replace(batch, rewards_B=rewards_B)
            with_rm = trainer.backend.engine.training.runner
            recipe = with_rm.config
            plain = dataclasses.replace(
                recipe, roles=tuple(r for r in recipe.roles if r.name != "reward_model"), reward_syncs=()
            )
            without = RecipeRunner(plain, {r.name: with_rm.backends[r.name] for r in plain.roles})
            times: dict[str, list[float]] = {"with": [], "without": []}
            for runner in (with_rm, without):  # warm-up: first forwards, allocator, thread pools
                runner.step(batch)
            for _ in range(args.rounds):
                for name, runner in (("with", with_rm), ("without", without)):
                    times[name].append(synced_s(lambda runner=runner: runner.step(batch), args.device))
        finally:
            trainer.shutdown()
    figure, baseline = statistics.median(times["with"]), statistics.median(times["without"])
    head = headline(
        "training phase s (median), with reward.model",
        figure,
        "the same phase on the same batch without reward.model",
        baseline,
        ratio(figure, baseline),
        "with / without (the reward model's cost, > 1)",
    )
    details = {"times_s": times, "shape": shape, "seqs": batch.num_seqs, "tokens": batch.num_tokens}
    return emit("reward_model", head, {**details, "device": args.device})


if __name__ == "__main__":
    main()
