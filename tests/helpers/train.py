"""Shared pieces of the training-backend tests: a token-level NLL loss, random packed batches,
tiny checkpoints and a 2-process gloo launcher.

Legend: B = sequences, T = packed tokens, V = vocabulary.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import traceback
from pathlib import Path

import torch

from areno.models.logprobs import packed_logprobs
from areno.types import TokenBatch, Trajectory


def nll_forward(model, mb: TokenBatch) -> dict[str, torch.Tensor]:
    """Per-token log-probs aligned to their targets, through the chunked packed log-prob path."""
    logprobs_T, _ = packed_logprobs(model, mb.input_ids_T, mb.cu_seqlens_B1, chunk_size=16)
    return {"logprobs_T": logprobs_T}


def nll_loss(output, mb: TokenBatch, reducer):
    loss = reducer(-output["logprobs_T"], mb.loss_mask_T)
    return loss, {"nll_sum_check": reducer(torch.ones_like(output["logprobs_T"]), mb.loss_mask_T).detach()}


def token_denominator(mb: TokenBatch) -> float:
    return float(mb.loss_mask_T.sum())


def random_batch(lengths: list[int], vocab: int, seed: int) -> TokenBatch:
    gen = torch.Generator().manual_seed(seed)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    T = cu[-1]
    loss_mask_T = torch.ones(T, dtype=torch.bool)
    loss_mask_T[torch.tensor(cu[:-1])] = False
    # prompt-like prefix of 2 tokens out of the loss, so masks are not trivial
    loss_mask_T[torch.tensor([c + 1 for c, n in zip(cu[:-1], lengths) if n > 2])] = False
    return TokenBatch(
        input_ids_T=torch.randint(3, vocab, (T,), generator=gen),
        cu_seqlens_B1=torch.tensor(cu, dtype=torch.long),
        loss_mask_T=loss_mask_T,
        logprobs_T=torch.zeros(T),
        versions_T=torch.zeros(T, dtype=torch.long),
        advantages_T=torch.zeros(T),
        rewards_B=torch.zeros(len(lengths)),
    )


def group_batch(groups: list[tuple[int, list[int]]], seed: int = 0) -> TokenBatch:
    """A GRPO-like batch: per group (prompt length, completion lengths), its samples one after another
    (random ids in [3, 50): a different prompt per group)."""
    gen = torch.Generator().manual_seed(seed)
    trajs = []
    for g, (p, comps) in enumerate(groups):
        prompt = torch.randint(3, 50, (p,), generator=gen).tolist()
        trajs += [
            Trajectory(
                prompt_ids=prompt,
                completion_ids=torch.randint(3, 50, (n,), generator=gen).tolist(),
                logprobs=[0.0] * n,
                versions=[0] * n,
                reward=float(i % 2),
                group_id=str(g),
            )
            for i, n in enumerate(comps)
        ]
    return TokenBatch.from_trajectories(trajs)


def make_model_dir(out: Path, *, hidden: int = 32, layers: int = 2, seed: int = 0, **kw) -> Path:
    from areno.data.tokenizer import build_char_tokenizer
    from areno.models.hf_io import init_model_dir, tiny_config

    tok = build_char_tokenizer()
    init_model_dir(out, tiny_config(len(tok), hidden_size=hidden, layers=layers, **kw), tok, seed=seed)
    return out


def _entry(rank: int, world: int, port_path: str, fn, args, err_dir: str) -> None:
    import torch.distributed as dist

    from tests.helpers.rendezvous import HOST, tcp_store

    torch.set_num_threads(1)
    faulthandler.enable()  # an abort in C++ (gloo's threads) prints where each Python thread was
    faulthandler.dump_traceback_later(900, exit=True)  # a collective mismatch fails instead of hanging
    try:
        timeout = dist.default_pg_timeout  # what an env:// rendezvous would give the store and the group
        store = tcp_store(rank, world, port_path, timeout)
        # the rendezvous environment torchrun would set, for code that reads it
        os.environ.update(
            MASTER_ADDR=HOST, MASTER_PORT=str(store.port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
        )
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        fn(rank, world, *args)
        # both ranks done with their collectives before either tears its group down (a rank leaving while
        # its peer's gloo work was in flight once ended in std::terminate)
        dist.barrier()
    except BaseException:
        Path(err_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Skip the interpreter's teardown: a gloo thread may still be releasing the last collective's work, whose
    # tensors need the GIL, and a thread taking the GIL while Python finalizes exits mid-destructor (std::terminate)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn, world: int, *args, tmp: Path) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` gloo processes; re-raise a worker's traceback."""
    import torch.multiprocessing as mp

    from tests.helpers.rendezvous import port_file

    err_dir = tmp / "errors"
    err_dir.mkdir(exist_ok=True)
    try:
        with port_file() as port_path:
            mp.spawn(_entry, args=(world, port_path, fn, args, str(err_dir)), nprocs=world, join=True)
    except Exception as e:
        msgs = [p.read_text() for p in sorted(err_dir.glob("*.err"))]
        raise AssertionError("worker failed:\n" + "\n".join(msgs)) from e
