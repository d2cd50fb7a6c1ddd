"""TP=2 over gloo (two spawned processes, multi-step decode) generates the same tokens as TP=1."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from areno.launch.scheduler import free_port
from areno.rollout.engine import RolloutEngine, RolloutEngineConfig
from areno.types import SamplingParams
from tests.helpers.rollout import make_model, random_prompts

GREEDY = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=8, ignore_eos=True, seed=3)


def _worker(rank: int, port: int, model_dir: str, new_dir: str, out_dir: str, pack_all: bool) -> None:
    torch.set_num_threads(1)
    if pack_all:  # every weight of the tiny model through oneDNN-packed copies (cpu_packed_gemm), at any rows
        from areno.models import cpu_gemm

        cpu_gemm.MIN_ELEMENTS, cpu_gemm.MIN_ROWS = 1, 1
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from safetensors.torch import load_file

        from areno.rollout.tp import TensorParallelRolloutEngine, load_tp_model

        model, cfg = load_tp_model(model_dir)
        # Multi-step decode on the TP ranks (the TP=1 reference below runs one step per round trip).
        eng = TensorParallelRolloutEngine(
            model, cfg, config=RolloutEngineConfig(block_size=4, decode_steps=4), eos_token_ids=()
        )
        prompts = random_prompts(4, seed=30)
        greedy = eng.generate(prompts, GREEDY)
        seeded = eng.generate(prompts[:2], SEEDED)
        eng.update_weights(load_file(os.path.join(new_dir, "model.safetensors")).items(), version=1)
        after = eng.generate(prompts[:2], GREEDY)
        torch.save(
            {
                "greedy": [o.output_ids for o in greedy],
                "seeded": [o.output_ids for o in seeded],
                "after": [o.output_ids for o in after],
                "kv_heads": eng.cache.num_kv_heads,
                "packs": len(model._cpu_packs),
            },
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned processes: ~15 s idle, ~2 min on the loaded 2-core CI box
@pytest.mark.parametrize("pack_all", [False, True], ids=["linear", "packed"])
def test_tp2_equals_tp1(tmp_path, pack_all):
    """``packed``: the TP ranks' sharded projections (column- and row-parallel, and the output
    projection) through oneDNN-packed copies, the TP=1 reference through ``F.linear``."""
    from areno.models.hf_io import save_model

    model, cfg = make_model(0)
    new_model, _ = make_model(1)
    save_model(model, cfg, tmp_path / "m")
    save_model(new_model, cfg, tmp_path / "n")
    mp.spawn(_worker, args=(free_port(), str(tmp_path / "m"), str(tmp_path / "n"), str(tmp_path), pack_all), nprocs=2)
    prompts = random_prompts(4, seed=30)
    eng = RolloutEngine(model, cfg, config=RolloutEngineConfig(block_size=4), eos_token_ids=())
    greedy = [o.output_ids for o in eng.generate(prompts, GREEDY)]
    seeded = [o.output_ids for o in eng.generate(prompts[:2], SEEDED)]
    eng.update_weights(new_model.state_dict().items(), version=1)
    after = [o.output_ids for o in eng.generate(prompts[:2], GREEDY)]
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert got["greedy"] == greedy and got["seeded"] == seeded and got["after"] == after
        assert got["kv_heads"] == cfg.num_key_value_heads // 2
        assert (got["packs"] > 0) is pack_all
