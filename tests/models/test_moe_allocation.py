"""``allocation_mode``'s ``e`` dimension: parsing (``d4e2``: EP groups of 2 inside 4 ranks), the
combinations that do not divide or that expert parallelism does not cover, and a partitioned CPU run of a tiny expert model with ``e2`` training
with its experts split over the 2 training ranks."""

from __future__ import annotations

import math

import pytest

from areno.api.config import load_config
from areno.engine.api import prepare_model_dir
from areno.engine.cluster import ClusterLayout, LayoutError, layout_from_config
from areno.engine.config import ClusterSection
from areno.engine.placement import build_engine
from areno.launch.allocation import AllocationModeError, parse_allocation_mode
from tests.helpers.configs import tiny_run_overrides
from tests.helpers.moe import MOE_TINY


def test_e_dimension_parses_and_round_trips():
    alloc = parse_allocation_mode("areno[rollout]:d1+fsdp[actor]:d4e2")
    train = alloc.component("actor")
    assert (train.dp, train.ep, train.world_size) == (4, 2, 4)  # e splits d, adds no devices
    assert parse_allocation_mode(str(alloc)).groups == alloc.groups


@pytest.mark.parametrize(
    "source, words",
    [
        ("areno:d1+fsdp:d3e2", "e2 must divide the data-parallel size d3"),
        ("areno:d2e2+fsdp:d2", "expert parallelism (e2) is reserved: backend 'areno'"),
        ("areno:d1|fsdp:d1e2", "e2 must divide the data-parallel size d1"),
    ],
)
def test_e_combinations_that_do_not_divide(source, words):
    with pytest.raises(AllocationModeError) as info:
        parse_allocation_mode(source)
    assert words in str(info.value).split("\n")[0]


def test_layout_takes_e_and_refuses_what_expert_parallelism_does_not_cover():
    lay = layout_from_config(ClusterSection(allocation_mode="areno:d1+fsdp:d2e2"), num_devices=3, cuda=False)
    assert lay.train_ep == 2 and lay.train_dp_shard == 2
    split = layout_from_config(ClusterSection(allocation_mode="areno:d1+fsdp:d4e2"), num_devices=5, cuda=False)
    assert split.train_ep == 2 and split.train_dp_shard == 4  # EP groups of 2 inside the 4 shard ranks
    with pytest.raises(LayoutError, match=r"e2 must divide the FSDP shard size \(got 2\) with t1 \(got t2\)"):
        ClusterLayout(train_devices=(0, 1, 2, 3), rollout_devices=(4,), train_tp=2, train_ep=2)


@pytest.mark.slow
@pytest.mark.parametrize("train", ["d2e2", "d4e2"])  # EP over all training ranks; EP groups of 2 inside 4
def test_partitioned_moe_run_with_e2(tmp_path, train):
    cfg = load_config(
        None,
        [*tiny_run_overrides(tmp_path), MOE_TINY, f"cluster.allocation_mode='areno[rollout]:d1+fsdp[actor]:{train}'"],
    )
    prepare_model_dir(cfg)
    engine = build_engine(cfg, tmp_path / "run")
    assert engine.training.cluster.layout.train_ep == 2
    engine.initialize()
    try:
        for i in range(2):
            metrics = engine.step(engine.generate_rollout(i))
            engine.update_weights()
            assert math.isfinite(metrics["train/policy/loss"]) and metrics["train/policy/router_aux_loss"] > 0
    finally:
        engine.shutdown()
