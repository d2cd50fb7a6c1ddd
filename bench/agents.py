"""Agent-path overhead: multi-turn episodes through the recording OpenAI client vs the same episodes
driven by raw ``RolloutClient.agenerate`` calls, on one engine, measured side by side. Prints JSON.

    python bench/agents.py                                  # CPU: tiny model, 32 episodes x 4 turns
    python bench/agents.py --device cuda --shape qwen0.5b --episodes 256 --turns 4 --new-tokens 64

Both sides generate exactly ``--new-tokens`` per turn (EOS ignored) with the same per-turn seeds, so
they decode the same number of tokens; the recording side also renders the chat template, links
the interaction tree, parses tool calls and exports concatenated trajectories with loss masks.
``overhead_pct`` = extra wall time of the recording side over the raw side (best of ``--repeats``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import subprocess
import time

import torch

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
    cfg = tiny_config(len(tok), hidden_size=shape["hidden_size"], intermediate_size=shape["intermediate_size"],
                      layers=shape["layers"], heads=shape["heads"], kv_heads=shape["kv_heads"],
                      max_position_embeddings=8192)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    torch.manual_seed(0)
    model = Decoder(cfg).to(device=args.device, dtype=dtype).eval()
    max_len = 64 + args.turns * (args.new_tokens + 32) + (1024 if args.tools else 0)  # tools: a long system prompt
    ecfg = RolloutEngineConfig(device=args.device, dtype=str(dtype).removeprefix("torch."),
                               max_num_seqs=args.episodes, max_model_len=max_len)
    engine = RolloutEngine(model, cfg, config=ecfg, eos_token_ids=(tok.eos_token_id,), tokenizer=tok)
    return InProcessRolloutClient(engine), tok


async def raw_episodes(client, tok, args):
    from areno.api.types import SamplingParams

    async def episode(i):
        ids = tok.apply_chat_template([{"role": "user", "content": f"question {i}"}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        ntok = 0
        for t in range(args.turns):
            out = await client.agenerate(ids, SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True,
                                                             seed=i * 100 + t))
            ntok += len(out.output_ids)
            ids = ids + out.output_ids + tok.encode(f"<|im_end|>\n<|im_start|>user\nfeedback {t}<|im_end|>\n"
                                                    "<|im_start|>assistant\n", add_special_tokens=False)
        return ntok

    return sum(await asyncio.gather(*(episode(i) for i in range(args.episodes))))


async def recorded_episodes(client, tok, args):
    from areno.api.types import SamplingParams
    from areno.workflows.openai_client import ArenoAsyncOpenAI
    from areno.workflows.tools import CALCULATOR_SCHEMA

    async def episode(i):
        oai = ArenoAsyncOpenAI(client, tok, default_sampling=SamplingParams(max_new_tokens=args.new_tokens))
        messages = [{"role": "user", "content": f"question {i}"}]
        for t in range(args.turns):
            resp = await oai.chat.completions.create(model="m", messages=messages, seed=i * 100 + t,
                                                     tools=[CALCULATOR_SCHEMA] if args.tools else None,
                                                     extra_body={"ignore_eos": True})
            oai.set_last_reward(1.0)
            messages = messages + [{"role": "assistant", "content": resp.choices[0].message.content},
                                   {"role": "user", "content": f"feedback {t}"}]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", default="tiny", choices=["tiny", "qwen0.5b"])
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tools", action="store_true", help="declare a tool (system prompt + call parsing)")
    args = ap.parse_args()
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
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(json.dumps({
        "bench": "agents", "device": args.device, "shape": args.shape, "episodes": args.episodes,
        "turns": args.turns, "new_tokens": args.new_tokens, "tools": args.tools,
        "raw_s": round(raw_s, 3), "recorded_s": round(rec_s, 3), "raw_tokens": raw_tok, "recorded_tokens": rec_tok,
        "raw_tok_per_s": round(raw_tok / raw_s, 1), "recorded_tok_per_s": round(rec_tok / rec_s, 1),
        "overhead_pct": round(100 * (rec_s / raw_s - 1), 1), "commit": commit,
        "host": platform.node(), "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
    }))


if __name__ == "__main__":
    main()
