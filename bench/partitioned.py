"""Partitioned topology, end to end: synchronous (η = 0) vs asynchronous (η = 2, 4) RL through the
real ``Trainer`` → ``ArenoBackend`` → ``ArenoEngine`` with remote sides (training workers on some devices,
rollout workers on others, policy sync over the stream transport). Prints one JSON object.

Every arm is one ``Trainer`` run with the same model, data, recipe (``grpo_async``: the decoupled
PPO objective) and seed; only ``rollout.max_head_offpolicyness`` changes. Completion lengths are
long-tailed per prompt (a fraction ``--long-frac`` of prompts generate ``--long-len`` tokens, the
others ``--short-len``; EOS ignored: ``LongTailWorkflow``), so a synchronous step waits for its
slowest group while the training device idles, and the training step leaves the rollout device idle.

Reported per arm, from the run's own ``metrics.jsonl``: trained tokens/s over the steps after the
first (warm-up), median seconds per step, the reward curve (the learning curve: the reward is the
parity of the number of digits in the completion, learnable by any model), the ``policy_sync_*``
metrics of the real run (bytes, seconds, GB/s, generation-paused seconds), staleness.

    python -m bench.partitioned                                     # CPU smoke: gloo, 1 + 1 processes
    python -m bench.partitioned --device cuda --train-devices 0 --rollout-devices 1 \\
        --hidden 1024 --layers 12 --heads 16 --kv-heads 4 --batch-size 16 --n-samples 8 \\
        --short-len 64 --long-len 512 --steps 10                     # 2 GPUs: train GPU 0, rollout GPU 1
    ... --train-devices 0,1 --rollout-devices 0,1 --etas 2          # overlapping device lists
    ... --etas 0,4 --steps 30 --repeats 3                           # 0,4,0,4,0,4: paired ratios, medians

Prints one JSON object. Its headline: the last eta's trained tokens/s (median over the repeats), the
first eta's as the baseline, ``ratio`` = the median over the repeats of last / first within each repeat.
``summary`` gives, per eta, the trained tokens/s of each repeat and its median, and the ratio to the first
eta's arm of the same repeat (run just before it) with its median. Each arm also goes to stderr as it
finishes, so a run cut short still shows what it measured.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import logging
import os
import random
import signal
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from areno.api.config import load_config
from areno.api.trainer import Trainer
from areno.launch.watchdog import child_pids, dump_hang
from areno.observe.metrics import read_jsonl_records
from areno.workflows.rlvr import RLVRWorkflow
from bench._common import emit, headline, keep_work_dir, parser, work_dir


# ----------------------------------------------------------------------------- the long-tailed workload
class LongTailWorkflow(RLVRWorkflow):
    """RLVR with the completion length fixed per row (``row["len"]`` tokens, EOS ignored)."""

    async def run_episode(self, client, sample):
        # a per-episode copy: episodes run concurrently on one workflow object
        episode = object.__new__(type(self))
        episode.__dict__.update(self.__dict__)
        episode.sampling_params = dataclasses.replace(
            self.sampling_params, max_new_tokens=int(sample["len"]), ignore_eos=True
        )
        return await RLVRWorkflow.run_episode(episode, client, sample)


def parity_reward(prompt: str, completion: str, answer, **fields) -> float:
    """1 when the completion holds an even number of digits: cheap, verifiable, learnable by any model."""
    return float(sum(c.isdigit() for c in completion) % 2 == 0)


def long_tail_rows(*, short_len: int, long_len: int, long_frac: float, seed: int) -> Iterator[dict]:
    """Endless ``{"id", "prompt", "answer", "len"}`` rows; ``long_frac`` of them ``long_len`` long."""
    rng = random.Random(seed)
    i = 0
    while True:
        a, b = rng.randrange(1000), rng.randrange(1000)
        length = long_len if rng.random() < long_frac else short_len
        yield {"id": i, "prompt": f"{a}+{b}=", "answer": a + b, "len": length}
        i += 1


# ----------------------------------------------------------------------------- one arm


def write_rows(path: Path, n: int, args, seed: int) -> None:
    rows = long_tail_rows(short_len=args.short_len, long_len=args.long_len, long_frac=args.long_frac, seed=seed)
    with path.open("w") as f:
        for _, row in zip(range(n), rows):
            f.write(json.dumps(row) + "\n")


def arm_config(eta: int, args, work: Path, repeat: int = 0):
    ints = lambda s: [int(x) for x in s.split(",")]
    overrides = [
        f"run_dir={work / (f'eta{eta}' if repeat == 0 else f'eta{eta}-r{repeat}')}",
        "overwrite=true",  # each arm starts over, also in a reused work directory
        f"model.path={work / 'model'}",
        f"model.init_tiny={{hidden_size: {args.hidden}, layers: {args.layers}, heads: {args.heads}, "
        f"kv_heads: {args.kv_heads}}}",
        f"model.dtype={'bfloat16' if args.device == 'cuda' else 'float32'}",
        "data.task=null",
        f"data.train_path={work / 'train.jsonl'}",
        f"data.eval_path={work / 'eval.jsonl'}",
        "reward.fn=bench.partitioned:parity_reward",
        "reward.sandbox=false",
        "rollout.workflow=bench.partitioned:LongTailWorkflow",
        f"rollout.batch_size={args.batch_size}",
        f"rollout.n_samples={args.n_samples}",
        f"rollout.max_new_tokens={args.long_len}",
        f"rollout.max_head_offpolicyness={eta}",
        f"rollout.max_concurrent={args.max_concurrent}",
        f"optim.lr={args.lr}",
        "optim.grad_clip=1.0",
        f"train.algorithm={args.recipe}",
        f"train.steps={args.steps + args.warmup}",
        "train.eval_interval=0",
        "train.save_interval=0",
        "train.seed=0",
        f"cluster.device={args.device}",
        f"cluster.train_devices={ints(args.train_devices)}",
        f"cluster.rollout_devices={ints(args.rollout_devices)}",
        "observe.console=false",
    ]
    overrides += args.set
    if args.max_tokens_per_mb:
        overrides.append(f"train.max_tokens_per_mb={args.max_tokens_per_mb}")
    if args.device == "cpu":
        overrides.append("cluster.cpu_threads=1")
    return load_config(None, overrides)


class ArmTimeout:
    """``--arm-timeout``: when an arm runs past its deadline, dump the stall (controller stacks, the
    workers' thread states and stacks, ``areno.launch.watchdog.dump_hang``) to stderr, then kill the
    workers so the arm fails with an error and the next arm runs."""

    KILL_EVERY_S = 0.5
    """After the deadline, child processes are killed again this often until the arm returns: a
    worker the launcher starts after the first kill (a slow start-up) would otherwise hold the arm
    in its rendezvous."""

    def __init__(self, seconds: float | None, log_dir: Path) -> None:
        self.fired = False
        self._log_dir = log_dir
        self._done = threading.Event()
        self._timer = threading.Timer(seconds, self._fire) if seconds else None
        if self._timer is not None:
            self._timer.daemon = True
            self._timer.start()

    def _fire(self) -> None:
        self.fired = True
        pids = child_pids(os.getpid())
        dump_hang(pids, log_paths=sorted(str(p) for p in self._log_dir.glob("*.log")))
        while True:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            if self._done.wait(self.KILL_EVERY_S):
                return
            pids = child_pids(os.getpid())

    def cancel(self) -> None:
        self._done.set()
        if self._timer is not None:
            self._timer.cancel()


def run_arm(eta: int, args, work: Path, repeat: int = 0) -> dict:
    config = arm_config(eta, args, work, repeat)
    t0 = time.perf_counter()
    deadline = ArmTimeout(args.arm_timeout, Path(config.run_dir) / "workers")
    try:
        trainer = Trainer.init(config)
        init_s = time.perf_counter() - t0
        try:
            trainer.run()
        finally:
            trainer.shutdown()
    except Exception as e:
        if not deadline.fired:
            raise
        return {
            "eta": eta,
            "repeat": repeat,
            "error": f"stalled: no result within --arm-timeout {args.arm_timeout:g} s ({e})",
        }
    finally:
        deadline.cancel()
    rows = [
        r for r in read_jsonl_records(Path(config.run_dir) / "metrics.jsonl", what="metrics") if "timing/rollout_s" in r
    ]
    # the first steps warm up (allocation, kernels, communicators) and let the asynchronous pool
    # reach its steady state (it starts ahead by the batches generated during start-up)
    timed = rows[args.warmup :]
    step_s = [r["timing/rollout_s"] + r["timing/train_s"] + r["timing/sync_s"] for r in timed]
    tokens = [r["timing/tokens_per_s"] * s for r, s in zip(timed, step_s)]
    sync_keys = sorted({k for r in rows for k in r if k.startswith("policy_sync")})
    sync = {k: statistics.median([r[k] for r in rows if k in r]) for k in sync_keys}
    reward_key = next((k for k in ("rollout/reward_mean", "reward/mean") if k in rows[0]), None)
    return {
        "eta": eta,
        "repeat": repeat,
        "init_s": round(init_s, 2),
        "steps_timed": len(timed),
        "wall_s": round(sum(step_s), 3),
        "trained_tokens_per_s": round(sum(tokens) / sum(step_s), 1),
        "step_s_median": round(statistics.median(step_s), 3),
        "rollout_wait_s_median": round(statistics.median(r["timing/rollout_s"] for r in timed), 3),
        "train_s_median": round(statistics.median(r["timing/train_s"] for r in timed), 3),
        "reward_curve": [round(r[reward_key], 4) for r in rows] if reward_key else None,
        "staleness_mean": round(statistics.mean(r.get("rollout/staleness_mean", 0.0) for r in timed), 3),
        "policy_sync_medians": sync,
        # idle fraction of each worker kind: the training workers are busy only in train + sync
        "train_idle_frac": round(1 - sum(r["timing/train_s"] + r["timing/sync_s"] for r in timed) / sum(step_s), 3),
        "rollout_idle_frac": _median_of(timed, "rollout/engine_busy_frac", lambda v: round(1 - v, 3)),
        "rollout_engine_tokens_per_s": _median_of(
            timed, "rollout/engine_generated_tokens_per_s", lambda v: round(v, 1)
        ),
        "rollout_preemptions": sum(r.get("rollout/engine_preemptions", 0) for r in timed),
        "rollout_prefill_tokens": sum(r.get("rollout/engine_prefill_tokens", 0) for r in timed),
        "rollout_mixed_steps": sum(r.get("rollout/engine_mixed_steps", 0) for r in timed),
        "rollout_steps": sum(r.get("rollout/engine_steps", 0) for r in timed),
        "rollout_round_trips": sum(r.get("rollout/engine_round_trips", 0) for r in timed),
        "rollout_graph_deferred_steps": sum(r.get("rollout/engine_graph_deferred_steps", 0) for r in timed),
        "rollout_graph_captures": sum(r.get("rollout/engine_graph_captures", 0) for r in rows),
        "rollout_graph_capture_s": round(sum(r.get("rollout/engine_graph_capture_s", 0) for r in rows), 2),
    }


def paired_summary(arms: list[dict], etas: list[int]) -> dict:
    """Per eta over the repeats: trained tokens/s (median and each), and its ratio to the first
    eta's arm of the same repeat (arms of one repeat run back to back: the steadier comparison on a
    shared machine), median and each. Arms that failed are left out (a repeat without its first eta's arm
    gives no ratios)."""
    out: dict = {}
    base = {a["repeat"]: a["trained_tokens_per_s"] for a in arms if a["eta"] == etas[0] and "error" not in a}
    for eta in etas:
        ok = [a for a in arms if a["eta"] == eta and "error" not in a]
        rates = [a["trained_tokens_per_s"] for a in ok]
        ratios = [round(a["trained_tokens_per_s"] / base[a["repeat"]], 3) for a in ok if a["repeat"] in base]
        out[str(eta)] = {
            "trained_tokens_per_s": rates,
            "trained_tokens_per_s_median": statistics.median(rates) if rates else None,
            f"ratio_to_eta{etas[0]}": ratios,
            f"ratio_to_eta{etas[0]}_median": statistics.median(ratios) if ratios else None,
        }
    return out


def _median_of(rows: list[dict], key: str, fmt) -> float | None:
    values = [r[key] for r in rows if key in r]
    return fmt(statistics.median(values)) if values else None


def main(argv: list[str] | None = None) -> int:
    p = parser("partitioned", __doc__)
    p.add_argument("--device", default="cpu")
    p.add_argument("--train-devices", default="0")
    p.add_argument("--rollout-devices", default="1")
    p.add_argument("--etas", default="0,2,4")
    p.add_argument("--steps", type=int, default=4, help="timed steps per arm")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run the --etas sequence this many times, interleaved (0,4,0,4,...); the summary gives each "
        "eta's median and its ratio to the first eta within each repeat",
    )
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first, per arm")
    p.add_argument("--batch-size", type=int, default=4, help="prompts per step")
    p.add_argument("--n-samples", type=int, default=4)
    p.add_argument("--short-len", type=int, default=8)
    p.add_argument("--long-len", type=int, default=64)
    p.add_argument("--long-frac", type=float, default=0.15)
    p.add_argument("--max-concurrent", type=int, default=64, help="prompts in flight")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--max-tokens-per-mb", type=int, default=None)
    p.add_argument("--recipe", default="grpo_async")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one more config override for every arm (repeatable), e.g. rollout.decode_steps=1",
    )
    p.add_argument(
        "--work-dir",
        default=None,
        help="keep the arms' run directories (metrics.jsonl) here (default: a temporary directory, removed when the bench ends well)",
    )
    p.add_argument(
        "--arm-timeout",
        type=float,
        default=None,
        metavar="S",
        help="an arm still running after S seconds: dump controller/worker stacks and thread states "
        "to stderr, kill its workers, report it as an error and go on",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if os.environ.get("ARENO_STACKS_AFTER_S"):  # diagnose a stall: the controller's stacks to stderr
        faulthandler.dump_traceback_later(float(os.environ["ARENO_STACKS_AFTER_S"]), repeat=True)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    etas = [int(e) for e in args.etas.split(",")]
    with work_dir(args.work_dir, "areno-bench-partitioned-") as work:
        write_rows(work / "train.jsonl", 4000, args, seed=1)
        write_rows(work / "eval.jsonl", 16, args, seed=2)
        arms = []
        for repeat in range(args.repeats):
            for eta in etas:
                arms.append(run_arm(eta, args, work, repeat))
                if "error" in arms[-1]:
                    keep_work_dir(work, "a failed arm's run directory and worker logs")
                # one line per finished arm, so a run cut short by a time limit still reports what it measured
                print(f"partitioned arm: {json.dumps(arms[-1])}", file=sys.stderr, flush=True)
        for arm in arms:  # against the first eta's arm of the same repeat
            base = next(
                (
                    a["trained_tokens_per_s"]
                    for a in arms
                    if a["repeat"] == arm["repeat"] and a["eta"] == etas[0] and "error" not in a
                ),
                None,
            )
            if base and "error" not in arm:
                arm["speedup_vs_first"] = round(arm["trained_tokens_per_s"] / base, 3)
        if args.device == "cuda":
            hw = f"{torch.cuda.device_count()}x {torch.cuda.get_device_name()}"
        else:
            hw = "cpu (gloo), 1 thread per worker"
        result = {
            "hardware": hw,
            "torch": torch.__version__,
            "config": vars(args),
            "arms": arms,
            "summary": paired_summary(arms, etas),
        }
        record = emit("partitioned", partitioned_headline(result["summary"], etas), result)
        if args.out:
            Path(args.out).write_text(json.dumps(record))
        return 0


def partitioned_headline(summary: dict, etas: list[int]) -> dict:
    """The last eta's trained tokens/s against the first eta's, paired within each repeat."""
    first, last = summary[str(etas[0])], summary[str(etas[-1])]
    return headline(
        f"trained tokens/s, eta {etas[-1]} (median over repeats)",
        last["trained_tokens_per_s_median"],
        f"eta {etas[0]} (synchronous when 0), same model, data and devices, run just before it",
        first["trained_tokens_per_s_median"],
        last[f"ratio_to_eta{etas[0]}_median"],
        f"eta {etas[-1]} / eta {etas[0]} trained tokens/s, median over the repeats' pairs",
    )


if __name__ == "__main__":
    raise SystemExit(main())
