"""Rollout engine host cost per round trip under continuous arrivals (the asynchronous pool's workload).

An asynchronous run keeps the rollout engine full: about ``--rows`` samples are in flight, and as
groups finish new groups of ``--group`` samples sharing one prompt arrive, so many round trips admit
and prefill new requests while ~256 rows decode. This bench drives the engine that way — a new group
is announced whenever ``--group`` slots are free and arrives 0..``--arrival-jitter`` round trips later
(the pool's turnaround; 0 keeps groups in lockstep), prompts ~``--prompt-len`` tokens, lengths long-tailed
(``--long-frac`` of the groups generate ``--long-len`` tokens, the others ``--short-len``, EOS ignored),
temperature 1 without seeds as in training rollouts — and reports the host CPU time per round trip
(one ``engine.step()``, plus ``add_request``) and per generated token; ``--phases`` splits it by
phase (a process-time clock around each phase's methods), ``--profile N`` lists cProfile's top N.

The fake graphs (the default; ``--no-fake-graph`` for real graphs on CUDA, eager decode on CPU)
decode through the CUDA-graph runner with replays that do no work (the one-step graph leaves fixed
logits, the k-step loop graph only writes how many tokens of each row are real), so what is left of
a pure-decode round trip is the engine's host work. Mixed (prefill + decode) steps run the model
eagerly: ``--forward noop`` (default) replaces it by a no-op (hidden states of zeros), so what is
left there is host work too (attention metadata, input copies) plus the sampling of [B, V] logits,
which is compute on a CPU; ``--forward model`` runs the model (``--layers``, ``--hidden``; on a GPU
an eager forward's kernel launches are host cost as well). Each round trip's CPU time is also
reported by kind: pure decode (the k-step loop only) or mixed. On CUDA the CPU time includes the
host's (spinning) wait for the device at each round trip's copy: compare wall time and tokens/s there.

    python bench/engine_host.py                                  # CPU, fake graphs, no-op forward
    python bench/engine_host.py --phases --profile 25            # + phase split, top functions by own time
    python bench/engine_host.py --compare-mixed-decode           # mixed_decode_min_rows off vs 32, one run
    python bench/engine_host.py --areno-root /tmp/areno_base     # the same workload on another checkout
    python bench/engine_host.py --device cuda --forward model --no-fake-graph --hidden 1024 --layers 12 \\
        --heads 16 --kv-heads 4 --vocab 512 --phases --compare-mixed-decode   # GPU: real graphs, 107M model

Prints one JSON object: per configuration, host CPU ms per round trip and per 1,000 generated tokens,
round trips, mixed round trips, tokens per round trip, and the phase split.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _early_root() -> None:
    """``--areno-root``: import ``areno`` from another checkout (e.g. the parent commit) — must run
    before anything imports areno."""
    if "--areno-root" in sys.argv:
        sys.path.insert(0, os.path.abspath(sys.argv[sys.argv.index("--areno-root") + 1]))
    sys.path.insert(1 if "--areno-root" in sys.argv else 0, ROOT)


_early_root()

import torch  # noqa: E402

from bench.stamp import stamp  # noqa: E402

PHASES = {
    # phase: (object attribute path, method) wrapped with a process-time clock (calls do not nest)
    "admit (add_request, inbox -> scheduler)": [("engine", "add_request"), ("engine", "_admit")],
    "schedule": [("engine.scheduler", "schedule")],
    "plan k + reserve blocks": [("engine", "_plan_decode_steps")],
    "sampling rows (RowParams)": [
        ("sampling.RowParams", "gather"),
        ("sampling.RowParams", "build"),
        ("sampling.RowParams", "shifted"),
    ],
    "graph inputs + replay": [
        ("engine._graphs", "run_loop"),
        ("engine._graphs", "prepare"),
        ("engine._graphs", "replay"),
    ],
    "eager forward (attention metadata + model)": [("engine", "_forward")],
    "eager sampling": [("engine", "_sample_rows")],
    "commit tokens + finish": [("engine", "_commit_tokens")],
}


class PhaseClock:
    """Process CPU seconds spent in each phase's methods (wrapped on the engine instance / class)."""

    def __init__(self, engine) -> None:
        from areno.rollout import sampling

        self.spent = dict.fromkeys(PHASES, 0.0)
        self.wall = dict.fromkeys(PHASES, 0.0)
        self._undo = []
        roots = {"engine": engine, "sampling": sampling}
        for phase, targets in PHASES.items():
            for path, name in targets:
                obj = roots[path.split(".")[0]]
                for part in path.split(".")[1:]:
                    obj = getattr(obj, part, None)
                if obj is None or not hasattr(obj, name):
                    continue
                self._wrap(obj, name, phase)

    def _wrap(self, obj, name: str, phase: str) -> None:
        is_class = isinstance(obj, type)
        original = obj.__dict__[name] if is_class else getattr(obj, name)
        fn = original.__func__ if isinstance(original, classmethod) else original
        spent, wall = self.spent, self.wall

        def timed(*a, **kw):
            t0, w0 = time.process_time(), time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[phase] += time.process_time() - t0
                wall[phase] += time.perf_counter() - w0

        setattr(obj, name, classmethod(timed) if isinstance(original, classmethod) else timed)
        self._undo.append((obj, name, original, is_class))

    def close(self) -> None:
        for obj, name, original, is_class in reversed(self._undo):
            if is_class:
                setattr(obj, name, original)
            else:
                delattr(obj, name)

    def split(self, total_s: float, round_trips: int, wall: bool = False) -> dict[str, float]:
        """ms per round trip of each phase: CPU time, or wall time (``wall``: on CUDA it includes
        waits for the device, e.g. the copy at the end of a round trip, under "other")."""
        spent = self.wall if wall else self.spent
        out = {k: round(1e3 * v / round_trips, 3) for k, v in spent.items()}
        out["other (step glue, bookkeeping)"] = round(1e3 * (total_s - sum(spent.values())) / round_trips, 3)
        out["total"] = round(1e3 * total_s / round_trips, 3)
        return out


class NoOpModel(torch.nn.Module):
    """Stands in for the decoder in eager forwards: zeros for hidden states, a small matmul for logits."""

    def __init__(self, real: torch.nn.Module, hidden: int) -> None:
        super().__init__()
        self.real = real
        self.hidden = hidden
        self.dtype = next(real.parameters()).dtype

    def forward(self, ids_T, pos_T, attn=None):
        return torch.zeros(ids_T.shape[0], self.hidden, device=ids_T.device, dtype=self.dtype)

    def logits(self, hidden_BD):
        return self.real.logits(hidden_BD)


def fake_graph_runner(engine, max_batch: int):
    """The CUDA-graph decode paths with replays that do no model work: the one-step graph leaves
    its (fixed, random) logits, the k-step loop graph writes token 0, log-prob 0 and, as the real
    loop does, ``min(k, room)`` real tokens per row (rows end by length only: EOS is ignored)."""
    from areno.rollout import cuda_graph

    _MAX_NEW, _N_GEN, _LENGTH = 7, 9, 10  # rows of the packed sampling table (sampling.py)

    class _NoReplay:
        def replay(self) -> None:
            pass

    class _LoopReplay:
        def __init__(self, g, k: int, max_len: int) -> None:
            self.g, self.k, self.max_len = g, k, max_len

        def replay(self) -> None:
            r_FB = self.g.rows_FB  # room = min(max_new - n_gen, max_len - length), as RowTensors.room_B
            self.g.keep_B.copy_(
                torch.minimum(r_FB[_MAX_NEW] - r_FB[_N_GEN], self.max_len - r_FB[_LENGTH]).clamp_(1, self.k)
            )

    class FakeRunner(cuda_graph.DecodeGraphRunner):
        def _record(self, fn, generator=None):
            return _NoReplay(), fn()

        def _capture(self, B: int, N: int):
            e = self.engine
            logits_BV = torch.randn(B, e.vocab_size, generator=torch.Generator().manual_seed(B)).to(e.device)
            g = cuda_graph._Graph(
                graph=_NoReplay(),
                ids_ctx_2B=torch.ones(2, B, dtype=torch.long, device=e.device),
                bt_BN=torch.zeros(B, N, dtype=torch.long, device=e.device),
                logits_BV=logits_BV,
            )
            self._graphs[(B, N)] = g
            return g

        def _capture_loop(self, B: int, N: int, k: int, S: int, mode):
            g = super()._capture_loop(B, N, k, S, mode)
            g.tokens_KB.zero_()
            g.logprobs_KB.zero_()
            g.graph = _LoopReplay(g, k, self.engine.max_model_len)
            return g

        def _mode_capturable(self, mode) -> bool:
            return True

    return FakeRunner(engine, max_batch=max_batch)


def build_engine(args, extra: dict):
    from areno.models.config import ModelConfig
    from areno.models.decoder import Decoder
    from areno.rollout.engine import RolloutEngine, RolloutEngineConfig

    hf = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": args.hidden,
        "intermediate_size": 2 * args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "vocab_size": args.vocab,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    cfg = ModelConfig.from_hf(hf)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = Decoder(cfg).to(device=args.device, dtype=dtype).eval()
    max_len = args.prompt_len + 16 + args.long_len
    per_seq = -(-max_len // 16) + 1
    ecfg = RolloutEngineConfig(
        block_size=16,
        num_blocks=args.rows * per_seq + 64,
        max_num_seqs=args.rows,
        max_tokens_per_step=args.max_tokens_per_step,
        prefill_chunk_size=1024,
        max_model_len=max_len,
        decode_steps=args.decode_steps,
        cuda_graphs=not args.no_fake_graph or args.device.startswith("cuda"),
        **extra,
    )
    engine = RolloutEngine(model, cfg, config=ecfg, eos_token_ids=(cfg.eos_token_id,))
    if args.fake_graph:
        engine._graphs = fake_graph_runner(engine, args.rows)
    if args.forward == "noop":
        engine.model = NoOpModel(model, args.hidden)
    return engine


def run(args, extra: dict, label: str) -> dict:
    from areno.types import SamplingParams

    engine = build_engine(args, extra)
    rng = random.Random(args.seed)
    sp = {
        n: SamplingParams(temperature=args.temperature, max_new_tokens=n, ignore_eos=True)
        for n in (args.short_len, args.long_len)
    }
    in_flight = 0  # samples added and not finished (queued in the engine or running)
    due: list[int] = []  # round trip at which each announced group arrives
    now = 0

    kind: dict[bool, list[float]] = {False: [], True: []}  # step() CPU seconds of pure-decode / mixed round trips
    kind_wall: dict[bool, list[float]] = {False: [], True: []}
    engine_cpu, engine_wall = (
        [0.0],
        [0.0],
    )  # inside engine calls  # process CPU seconds inside engine calls (step, add_request): not the bench's own

    def top_up() -> None:
        nonlocal in_flight
        # a group is announced as soon as its slots are free and arrives 0..jitter round trips later
        # (the pool's turnaround: rewards, the next prompt, the staleness gate)
        while in_flight + args.group * (len(due) + 1) <= args.rows + args.queue:
            due.append(now + rng.randint(0, args.arrival_jitter))
        due.sort()
        while due and due[0] <= now:
            due.pop(0)
            plen = rng.randint(args.prompt_len - 8, args.prompt_len + 8)
            prompt = [rng.randrange(3, args.vocab) for _ in range(plen)]
            n = args.long_len if rng.random() < args.long_frac else args.short_len
            c0, w0 = time.process_time(), time.perf_counter()
            for _ in range(args.group):
                engine.add_request(prompt, sp[n])
            engine_cpu[0] += time.process_time() - c0
            engine_wall[0] += time.perf_counter() - w0
            in_flight += args.group

    def trip() -> int:
        nonlocal in_flight, now
        c0, w0, m0 = time.process_time(), time.perf_counter(), engine._mixed_steps
        finished = engine.step()
        dt, dw = time.process_time() - c0, time.perf_counter() - w0
        engine_cpu[0] += dt
        engine_wall[0] += dw
        kind[engine._mixed_steps > m0].append(dt)
        kind_wall[engine._mixed_steps > m0].append(dw)
        in_flight -= len(finished)
        now += 1
        top_up()
        return len(finished)

    t_warm = time.perf_counter()
    if args.device.startswith("cuda") and not args.fake_graph:
        # every graph a batch of up to --rows rows can need, before measuring (none captured mid-run)
        engine.warmup_cuda_graphs(list(range(1, args.rows + 1)), engine.max_model_len, params=[sp[args.short_len]])
    top_up()
    while engine.stats()["generated_tokens"] < args.warmup_tokens:  # reach the steady state (graphs captured)
        trip()
    warm_s = time.perf_counter() - t_warm
    s0 = engine.stats()
    prof = cProfile.Profile() if args.profile else None
    clock = PhaseClock(engine) if args.phases else None
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    cpu0, wall0, eng0, wall_eng0 = time.process_time(), time.perf_counter(), engine_cpu[0], engine_wall[0]
    for d in (kind, kind_wall):
        d[False].clear()
        d[True].clear()
    if prof:
        prof.enable()
    finished = 0
    for _ in range(args.round_trips):
        finished += trip()
    if prof:
        prof.disable()
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    cpu, wall = engine_cpu[0] - eng0, time.perf_counter() - wall0
    s1 = engine.stats()
    rt = s1["sampling_round_trips"] - s0["sampling_round_trips"]
    steps = s1["steps"] - s0["steps"]
    # round trips without sampling (a prefill chunk only) are steps too: count every step() that ran
    tokens = s1["generated_tokens"] - s0["generated_tokens"]
    out = {
        "label": label,
        "config": extra,
        "round_trips": args.round_trips,
        "sampling_round_trips": rt,
        "mixed_steps": s1["mixed_steps"] - s0["mixed_steps"],
        "decode_steps_run": steps,
        "generated_tokens": tokens,
        "finished_requests": finished,
        "prefill_tokens": s1["prefill_tokens"] - s0["prefill_tokens"],
        "tokens_per_round_trip": round(tokens / args.round_trips, 1),
        "host_cpu_ms_per_round_trip": round(1e3 * cpu / args.round_trips, 3),
        "host_cpu_ms_per_1k_tokens": round(1e6 * cpu / max(tokens, 1), 3),
        "wall_ms_per_round_trip": round(1e3 * wall / args.round_trips, 3),
        "step_cpu_ms_pure_decode_round_trip": round(1e3 * sum(kind[False]) / max(len(kind[False]), 1), 3),
        "step_cpu_ms_mixed_round_trip": round(1e3 * sum(kind[True]) / max(len(kind[True]), 1), 3),
        "step_wall_ms_pure_decode_round_trip": round(1e3 * sum(kind_wall[False]) / max(len(kind_wall[False]), 1), 3),
        "step_wall_ms_mixed_round_trip": round(1e3 * sum(kind_wall[True]) / max(len(kind_wall[True]), 1), 3),
        "step_wall_ms_max": round(1e3 * max(kind_wall[False] + kind_wall[True]), 3),
        "tokens_per_s_wall": round(tokens / wall, 1),
        "mean_running": round(s1["num_running"], 1),
        "warmup_s": round(warm_s, 2),
    }
    if clock is not None:
        out["phase_ms_per_round_trip"] = clock.split(cpu, args.round_trips)
        out["phase_wall_ms_per_round_trip"] = clock.split(engine_wall[0] - wall_eng0, args.round_trips, wall=True)
        clock.close()
    if args.torch_profile and args.device.startswith("cuda"):
        from bench.profiling import profile_cuda

        out["torch_profile"] = profile_cuda(lambda: [trip() for _ in range(args.torch_profile)], top=20)
        out["torch_profile"]["round_trips"] = args.torch_profile
    if prof:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.profile)
        out["profile_top"] = [line.strip() for line in s.getvalue().splitlines() if line.strip()][-args.profile - 1 :]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rows", type=int, default=256, help="samples in flight (the engine's max_num_seqs)")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt (arrive together)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--short-len", type=int, default=64)
    ap.add_argument("--long-len", type=int, default=384)
    ap.add_argument("--long-frac", type=float, default=0.1)
    ap.add_argument(
        "--arrival-jitter",
        type=int,
        default=4,
        help="a group arrives 0..J round trips after its slots free (0: at once, groups stay in lockstep)",
    )
    ap.add_argument("--queue", type=int, default=0, help="samples queued beyond --rows (waiting in the engine)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--max-tokens-per-step", type=int, default=4096)
    ap.add_argument("--round-trips", type=int, default=300, help="measured engine steps")
    ap.add_argument("--warmup-tokens", type=int, default=60000, help="generated tokens before measuring")
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument(
        "--forward", choices=["noop", "model"], default="noop", help="eager (mixed-step) forwards: no-op or the model"
    )
    ap.add_argument("--no-fake-graph", action="store_true", help="real graphs (CUDA) or eager decode (CPU)")
    ap.add_argument(
        "--compare-mixed-decode",
        action="store_true",
        help="run with RolloutEngineConfig.mixed_decode_min_rows None (off) then 32",
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--phases", action="store_true", help="split the host time by phase (a clock around each)")
    ap.add_argument("--profile", type=int, default=0, help="cProfile: the top N functions by own time")
    ap.add_argument(
        "--torch-profile",
        type=int,
        default=0,
        metavar="N",
        help="CUDA: after measuring, N more round trips under torch.profiler (kernels, host ops, syncs)",
    )
    ap.add_argument("--areno-root", default=None, help="import areno from this checkout (before/after runs)")
    args = ap.parse_args(argv)
    args.fake_graph = not args.no_fake_graph
    torch.set_num_threads(args.threads)
    import areno

    configs = (
        [
            ({"mixed_decode_min_rows": None}, "mixed_decode_min_rows=None"),
            ({"mixed_decode_min_rows": 32}, "mixed_decode_min_rows=32"),
        ]
        if args.compare_mixed_decode
        else [({}, "default")]
    )
    runs = [run(args, extra, label) for extra, label in configs]
    print(
        json.dumps(
            {
                "bench": "engine_host",
                "device": args.device,
                "areno": os.path.dirname(areno.__file__),
                "args": {k: v for k, v in vars(args).items() if k not in ("profile",)},
                "runs": runs,
                **stamp(),
                "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
