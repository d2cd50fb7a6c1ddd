"""A partitioned, asynchronous GLM-4.5 run on CPU (1 training + 1 rollout worker process, gloo): the policy sync
streams the float32 routers and their correction biases in float32 beside a bf16 rollout engine's weights, so
after each sync the engine's routers equal the trainer's bit for bit; routing replay routes every trained token
as the rollout did with the sigmoid router."""

from __future__ import annotations

import pickle

import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer  # noqa: F401 - imported before two threads race to import it

from areno.api.config import load_config
from areno.engine.placement import partitioned_engine
from areno.models import load_model
from tests.helpers.configs import tiny_run_overrides
from tests.helpers.moe import BIAS, glm4_moe_dir

REPLAYED = "train/policy/moe_routing_replayed_fraction"


def test_an_async_bf16_rollout_gets_the_trainers_float32_routers_and_replays_its_routes(tmp_path):
    glm4_moe_dir(tmp_path / "model", seed=0, biased=True)
    given = [o for o in tiny_run_overrides(tmp_path) if not o.startswith("model.init_tiny")]  # the model above
    cfg = load_config(
        None,
        [
            *given,
            "reward.sandbox=false",
            "data.num_eval=0",
            "train.eval_interval=0",
            "cluster.train_devices=[0]",
            "cluster.rollout_devices=[1]",
            "model.rollout_dtype=bfloat16",
            "rollout.max_head_offpolicyness=1",
            "train.moe_routing_replay=true",
        ],
    )
    engine = partitioned_engine(cfg, tmp_path / "run")
    engine.initialize()
    try:
        for step in range(2):
            metrics = engine.step(engine.generate_rollout(step))
            engine.update_weights()
            assert metrics[REPLAYED] == 1.0  # the experts every trained token used are the rollout's
            engine.export_policy(tmp_path / f"policy{step}")
            stored = load_file(tmp_path / f"policy{step}" / "model.safetensors")  # the experts one by one
            trained = load_model(tmp_path / f"policy{step}", dtype=torch.float32)[0].state_dict()  # fused, as live
            (live,) = [pickle.loads(b) for b in engine.rollout.cluster.scheduler.call("rollout", "weight_shards")]
            assert sorted(live) == sorted(trained)
            for name, t in live.items():
                if ".mlp.gate." in name:  # the routers, float32 on the bf16 wire and in the engine
                    assert t.dtype == stored[name].dtype == torch.float32 and torch.equal(t, stored[name]), name
                else:
                    assert t.dtype == torch.bfloat16 and torch.equal(t, trained[name].bfloat16()), name
            router = stored["model.layers.1.mlp.gate.weight"]
            assert not torch.equal(router, router.bfloat16().float())  # a bf16 wire would have rounded it
            assert live[BIAS.format(1)].abs().min() > 0
    finally:
        engine.shutdown()
