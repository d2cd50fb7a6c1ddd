"""The rollout's and the trainer's log-probs of the same sampled tokens, with and without ``model.fp32_logits``.

A random-init checkpoint of a Qwen2.5 shape, its final norm scaled so that the logits reach a trained model's
range (``--logit-std``: a random model's are near 0, where bfloat16 rounds them little). The rollout engine
(bfloat16 weights, as a run's) samples ``--prompts`` x ``--completion-len`` tokens at temperature 1; the
training backend (float32 master weights, bfloat16 autocast, as a run's defaults) scores the same tokens. Both
sides run with ``fp32_logits`` off, then on, alternated ``--rounds`` times, each round on the tokens of its own
rollout. Prints the mean and max |rollout log-prob - trainer log-prob| of each arm (the figure: the mean with
the flag on; the baseline: off, same run), and each side's time.

    python -m bench.logit_precision --shape 0.5b --device cuda
"""

from __future__ import annotations

import statistics
import time

import torch

from areno.models.hf_io import load_model
from areno.rollout.engine import RolloutEngine, RolloutEngineConfig
from areno.specializations.forward import token_logprobs_T
from areno.train import LocalTrainBackend, TrainBackendConfig
from areno.types import SamplingParams, TokenBatch, Trajectory
from bench._common import emit, headline, parser, ratio, work_dir
from bench.e2e import SHAPES, make_model_dir


def _scaled_dir(shape: str, workdir, logit_std: float):
    """``make_model_dir``'s checkpoint with its final norm's weight scaled so that the logits of random tokens
    have the standard deviation ``logit_std`` (saved again)."""
    from areno.models.hf_io import save_model

    model_dir, config, tok = make_model_dir(shape, workdir)
    model = load_model(model_dir, dtype=torch.float32, device="cpu")[0]
    with torch.no_grad():
        ids = torch.randint(3, config.vocab_size, (64,), generator=torch.Generator().manual_seed(1))
        std = float(model.logits(model(ids, torch.arange(64))).std())
        model.model.norm.weight.mul_(logit_std / std)
    save_model(model, config, model_dir, tokenizer=tok)
    return model_dir, config, tok


def _sides(model_dir, device: str, fp32: bool, max_len: int, rows: int):
    engine_model = load_model(model_dir, dtype=torch.bfloat16, device=device)[0]
    blocks = rows * (-(-max_len // 16)) + 64  # both arms' engines share the device: a fixed pool each
    config = RolloutEngineConfig(
        max_num_seqs=rows, max_model_len=max_len, dtype="bfloat16", fp32_logits=fp32, num_blocks=blocks, block_size=16
    )
    engine = RolloutEngine(engine_model, engine_model.config, config=config, eos_token_ids=())
    backend = LocalTrainBackend(
        TrainBackendConfig(device=device, trainable=False, fp32_logits=fp32, max_tokens_per_mb=32768)
    )
    backend.initialize(model_dir)
    return engine, backend


def _round(engine, backend, prompts, completion_len: int, seed: int, device: str) -> dict:
    params = SamplingParams(temperature=1.0, max_new_tokens=completion_len, ignore_eos=True, seed=seed)
    _sync(device)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    _sync(device)
    rollout_s = time.perf_counter() - t0
    trajs = [
        Trajectory(
            prompt_ids=list(p),
            completion_ids=list(o.output_ids),
            logprobs=list(o.output_logprobs),
            versions=[0] * len(o.output_ids),
            reward=0.0,
        )
        for p, o in zip(prompts, outs)
    ]
    batch = TokenBatch.from_trajectories(trajs)
    t0 = time.perf_counter()
    out = backend.forward_only(batch, forward_fn=lambda m, b: token_logprobs_T(m, b, mask_T=b.loss_mask_T))
    _sync(device)
    train_s = time.perf_counter() - t0
    mask = batch.loss_mask_T.bool()
    diff = (batch.logprobs_T[mask].double() - out["logprobs_T"].cpu()[mask].double()).abs()
    return {
        "abs_diff_mean": float(diff.mean()),
        "abs_diff_max": float(diff.max()),
        "rollout_s": rollout_s,
        "trainer_forward_s": train_s,
        "mean_logprob": float(batch.logprobs_T[mask].double().mean()),
    }


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    p = parser("logit_precision", __doc__)
    p.add_argument("--shape", default="0.5b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--completion-len", type=int, default=256)
    p.add_argument("--logit-std", type=float, default=4.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--workdir", default=None)
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    with work_dir(args.workdir, "areno-logit-precision-") as workdir:
        model_dir, config, _ = _scaled_dir(args.shape, workdir, args.logit_std)
        g = torch.Generator().manual_seed(0)
        prompts = [
            torch.randint(3, config.vocab_size, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)
        ]
        max_len = args.prompt_len + args.completion_len + 8
        sides = {fp32: _sides(model_dir, args.device, fp32, max_len, args.prompts) for fp32 in (False, True)}
        for engine, backend in sides.values():  # warm-up: CUDA graphs, kernels
            _round(engine, backend, prompts[:4], 8, 0, args.device)
        rows: dict[bool, list[dict]] = {False: [], True: []}
        for r in range(args.rounds):
            for fp32 in (False, True):
                rows[fp32].append(_round(*sides[fp32], prompts, args.completion_len, 100 + r, args.device))

    def med(fp32: bool, key: str) -> float:
        return statistics.median(row[key] for row in rows[fp32])

    figure, baseline = med(True, "abs_diff_mean"), med(False, "abs_diff_mean")
    head = headline(
        f"mean |rollout - trainer| log-prob, shape {args.shape}, model.fp32_logits=true",
        figure,
        "model.fp32_logits=false (bfloat16 logits on both sides), same run",
        baseline,
        ratio(baseline, figure),
        "baseline / figure (>1: the flag brings the two sides closer)",
    )
    emit(
        "logit_precision",
        head,
        {
            "device": args.device,
            "logit_std": args.logit_std,
            "tokens_per_round": args.prompts * args.completion_len,
            "rounds": {("fp32" if k else "bf16"): v for k, v in rows.items()},
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
