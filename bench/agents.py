"""Agent-path overhead: multi-turn episodes through the recording OpenAI client vs the same episodes
driven by raw ``RolloutClient.agenerate`` calls, on one engine, measured side by side. Prints JSON.

    python bench/agents.py                                  # CPU: tiny model, 32 episodes x 4 turns
    python bench/agents.py --device cuda --shape qwen0.5b --episodes 256 --turns 4 --new-tokens 64

Both sides generate exactly ``--new-tokens`` per turn (EOS ignored) with the same per-turn seeds, so
they decode the same number of tokens; the recording side also renders the chat template, links
the interaction tree, parses tool calls and exports concatenated trajectories with loss masks.
``overhead_pct`` = extra wall time of the recording side over the raw side (best of ``--repeats``).

Learning check of the shipped agent examples (CPU, a few minutes each): runs
``examples/agent_{name}.yaml`` end to end (warm start, then GRPO) and prints one JSON line per
example with the held-out accuracy and train-reward curves; for the calculator also the share of
greedy held-out replies that call the tool, before and after GRPO. ``--plot`` draws the curves.

    python bench/agents.py --learn calculator,multiturn --plot bench/agents_learning.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.stamp import stamp

QWEN25_05B = {"hidden_size": 896, "intermediate_size": 4864, "layers": 24, "heads": 14, "kv_heads": 2}
TINY = {"hidden_size": 64, "intermediate_size": 192, "layers": 2, "heads": 4, "kv_heads": 2}


def build(args):
    from areno.data.tokenizer import build_char_tokenizer
    from areno.models.decoder import Decoder
    from areno.models.hf_io import tiny_config
    from areno.rollout.client import InProcessRolloutClient
    from areno.rollout.engine import RolloutEngine, RolloutEngineConfig

    shape = QWEN25_05B if args.shape == "qwen0.5b" else TINY
    tok = build_char_tokenizer()
    cfg = tiny_config(
        len(tok),
        hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"],
        layers=shape["layers"],
        heads=shape["heads"],
        kv_heads=shape["kv_heads"],
        max_position_embeddings=8192,
    )
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    torch.manual_seed(0)
    model = Decoder(cfg).to(device=args.device, dtype=dtype).eval()
    max_len = 64 + args.turns * (args.new_tokens + 32) + (1024 if args.tools else 0)  # tools: a long system prompt
    ecfg = RolloutEngineConfig(
        device=args.device, dtype=str(dtype).removeprefix("torch."), max_num_seqs=args.episodes, max_model_len=max_len
    )
    engine = RolloutEngine(model, cfg, config=ecfg, eos_token_ids=(tok.eos_token_id,), tokenizer=tok)
    return InProcessRolloutClient(engine), tok


async def raw_episodes(client, tok, args):
    from areno.types import SamplingParams

    async def episode(i):
        ids = tok.apply_chat_template(
            [{"role": "user", "content": f"question {i}"}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        ntok = 0
        for t in range(args.turns):
            out = await client.agenerate(
                ids, SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True, seed=i * 100 + t)
            )
            ntok += len(out.output_ids)
            ids = (
                ids
                + out.output_ids
                + tok.encode(
                    f"<|im_end|>\n<|im_start|>user\nfeedback {t}<|im_end|>\n<|im_start|>assistant\n",
                    add_special_tokens=False,
                )
            )
        return ntok

    return sum(await asyncio.gather(*(episode(i) for i in range(args.episodes))))


async def recorded_episodes(client, tok, args):
    from areno.types import SamplingParams
    from areno.workflows.openai_client import ArenoAsyncOpenAI
    from areno.workflows.tools import CALCULATOR_SCHEMA

    async def episode(i):
        oai = ArenoAsyncOpenAI(client, tok, default_sampling=SamplingParams(max_new_tokens=args.new_tokens))
        messages = [{"role": "user", "content": f"question {i}"}]
        for t in range(args.turns):
            resp = await oai.chat.completions.create(
                model="m",
                messages=messages,
                seed=i * 100 + t,
                tools=[CALCULATOR_SCHEMA] if args.tools else None,
                extra_body={"ignore_eos": True},
            )
            oai.set_last_reward(1.0)
            messages = messages + [
                {"role": "assistant", "content": resp.choices[0].message.content},
                {"role": "user", "content": f"feedback {t}"},
            ]
        trajs = oai.export("concat", gamma=0.9)
        return sum(sum(t.completion_mask) for t in trajs)

    return sum(await asyncio.gather(*(episode(i) for i in range(args.episodes))))


def timed(fn, client, tok, args, device):
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    ntok = asyncio.run(fn(client, tok, args))
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, ntok


def _greedy_replies(model_dir, prompts: list[str], max_new_tokens: int) -> list[str]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    replies = []
    for prompt in prompts:  # one at a time: no padding questions, and the model is tiny
        ids = torch.tensor([tok.encode(prompt)])
        with torch.no_grad():
            out = model.generate(
                ids,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
        replies.append(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    return replies


def learn(name: str, args) -> dict:
    """Run one shipped agent example end to end; its curves and before/after figures as a dict."""
    import shutil
    from pathlib import Path

    from areno.api.config import load_config
    from areno.api.pipeline import run_pipeline
    from areno.observe.metrics import read_metrics

    root = Path(__file__).resolve().parents[1]
    run_dir = Path(args.run_root) / f"agent_{name}"
    if args.fresh and run_dir.exists():
        shutil.rmtree(run_dir)
    overrides = [
        f"run_dir={run_dir}",
        f"model.path={run_dir / 'init_model'}",
        "observe.console=false",
        f"cluster.cpu_threads={args.threads}",
        *args.set,
    ]
    cfg = load_config(root / "examples" / f"agent_{name}.yaml", overrides)
    if cfg.data.train_path:  # the shipped data sits next to the config
        overrides += [f"data.train_path={root / cfg.data.train_path}", f"data.eval_path={root / cfg.data.eval_path}"]
        cfg = load_config(root / "examples" / f"agent_{name}.yaml", overrides)
    t0 = time.perf_counter()
    summary = run_pipeline(cfg)
    wall_s = time.perf_counter() - t0
    rows = read_metrics(run_dir)
    result = {
        "bench": "agents_learning",
        "example": f"examples/agent_{name}.yaml",
        "overrides": list(args.set),
        "warm_start_steps": cfg.warm_start.steps,
        "grpo_steps": cfg.train.steps,
        "accuracy_before": summary["accuracy_before"],
        "accuracy_after": summary["accuracy_after"],
        "eval_accuracy": [[r["step"], round(r["eval/accuracy"], 4)] for r in rows if "eval/accuracy" in r],
        "train_reward": [round(r["rollout/reward_mean"], 4) for r in rows if "rollout/reward_mean" in r],
        "wall_s": round(wall_s, 1),
    }
    rewards = result["train_reward"]
    k = max(len(rewards) // 4, 1)
    result["train_reward_first_quarter"] = round(sum(rewards[:k]) / k, 4)
    result["train_reward_last_quarter"] = round(sum(rewards[-k:]) / k, 4)
    if name == "calculator":  # why it rises: greedy replies switch from direct answers to tool calls
        from areno.workflows.agent import calculator_reward

        held_out = [json.loads(line) for line in Path(cfg.data.eval_path).read_text().splitlines()]
        final = sorted((run_dir / "checkpoints").glob("step_*"))[-1] / "hf"
        for label, model_dir in (("before", run_dir / "warm_start" / "final_model"), ("after", final)):
            replies = _greedy_replies(model_dir, [r["prompt"] for r in held_out], cfg.rollout.max_new_tokens)
            result[f"tool_call_rate_{label}"] = round(sum("<tool_call>" in t for t in replies) / len(replies), 4)
            result[f"direct_answer_accuracy_{label}"] = round(
                sum(
                    calculator_reward(r["prompt"], t, result=r["result"])
                    for r, t in zip(held_out, replies)
                    if "<tool_call>" not in t
                )
                / max(sum("<tool_call>" not in t for t in replies), 1),
                4,
            )
    return result


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.4), squeeze=False)
    for ax, res in zip(axes[0], results):
        ax.plot(range(1, len(res["train_reward"]) + 1), res["train_reward"], label="train reward (GRPO batch)")
        ax.plot(*zip(*res["eval_accuracy"]), marker="o", label="held-out accuracy (greedy)")
        ax.set_title(res["example"].removeprefix("examples/"), fontsize=10)
        ax.set_xlabel("GRPO step (0 = after the warm start)")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main_learn(args) -> None:
    results = []
    for name in args.learn.split(","):
        if name not in ("calculator", "multiturn"):
            raise SystemExit(f"--learn: unknown example {name!r}; choose calculator and/or multiturn")
        res = {**learn(name, args), **stamp(), "cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 1)}
        print(json.dumps(res), flush=True)
        results.append(res)
    if args.plot:
        plot(results, args.plot)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--learn", default=None, help="comma-separated shipped agent examples to train: calculator,multiturn"
    )
    ap.add_argument("--run-root", default="runs/bench_agents", help="--learn: where the runs go")
    ap.add_argument("--fresh", action="store_true", help="--learn: delete earlier runs (else warm starts are reused)")
    ap.add_argument("--threads", type=int, default=1, help="--learn: cluster.cpu_threads")
    ap.add_argument("--set", action="append", default=[], help="--learn: a config override key=value (repeatable)")
    ap.add_argument("--plot", default=None, help="--learn: write the curves to this PNG")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", default="tiny", choices=["tiny", "qwen0.5b"])
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tools", action="store_true", help="declare a tool (system prompt + call parsing)")
    args = ap.parse_args()
    if args.learn:
        return main_learn(args)
    client, tok = build(args)
    warm = argparse.Namespace(**{**vars(args), "episodes": 2, "turns": 2})
    timed(raw_episodes, client, tok, warm, args.device)  # compile / import / schema-building costs out of the timing
    timed(recorded_episodes, client, tok, warm, args.device)
    raw, rec = [], []
    for _ in range(args.repeats):  # interleaved, so drift in machine load hits both sides
        raw.append(timed(raw_episodes, client, tok, args, args.device))
        rec.append(timed(recorded_episodes, client, tok, args, args.device))
    client.close()
    raw_s, raw_tok = min(raw)
    rec_s, rec_tok = min(rec)
    print(
        json.dumps(
            {
                "bench": "agents",
                "device": args.device,
                "shape": args.shape,
                "episodes": args.episodes,
                "turns": args.turns,
                "new_tokens": args.new_tokens,
                "tools": args.tools,
                "raw_s": round(raw_s, 3),
                "recorded_s": round(rec_s, 3),
                "raw_tokens": raw_tok,
                "recorded_tokens": rec_tok,
                "raw_tok_per_s": round(raw_tok / raw_s, 1),
                "recorded_tok_per_s": round(rec_tok / rec_s, 1),
                "overhead_pct": round(100 * (rec_s / raw_s - 1), 1),
                **stamp(),
                "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
            }
        )
    )


if __name__ == "__main__":
    main()
