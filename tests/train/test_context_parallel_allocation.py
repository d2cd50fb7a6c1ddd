"""``allocation_mode``'s ``c`` dimension (context parallelism): parsing, the combinations that do
not divide or that context parallelism does not cover, and a partitioned CPU run of a tiny model
with ``c2``: the 2 training ranks share each micro-batch, each running the layers on half of it."""

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


def test_c_dimension_parses_and_round_trips():
    alloc = parse_allocation_mode("areno[rollout]:d1+fsdp[actor]:d4c2")
    train = alloc.component("actor")
    assert (train.dp, train.cp, train.world_size) == (4, 2, 4)  # c groups d's ranks, adds no devices
    assert parse_allocation_mode(str(alloc)).groups == alloc.groups


@pytest.mark.parametrize(
    "source, words",
    [
        ("areno:d1+fsdp:d3c2", "c2 must divide the data-parallel size d3"),
        ("areno:d2c2+fsdp:d2", "context parallelism (c2) is reserved: backend 'areno'"),
    ],
)
def test_c_combinations_that_do_not_divide(source, words):
    with pytest.raises(AllocationModeError) as info:
        parse_allocation_mode(source)
    assert words in str(info.value).split("\n")[0]


def test_layout_takes_c_and_refuses_what_context_parallelism_does_not_cover():
    lay = layout_from_config(ClusterSection(allocation_mode="areno:d1+fsdp:d4c2"), num_devices=5, cuda=False)
    assert lay.train_cp == 2 and lay.train_dp_shard == 4
    with pytest.raises(LayoutError, match="c2 must divide the FSDP shard size 2 with t1 and e1"):
        ClusterLayout(train_devices=(0, 1, 2, 3), rollout_devices=(4,), train_tp=2, train_cp=2)


@pytest.mark.slow
def test_partitioned_run_with_c2(tmp_path):
    cfg = load_config(
        None, [*tiny_run_overrides(tmp_path), "cluster.allocation_mode='areno[rollout]:d1+fsdp[actor]:d2c2'"]
    )
    prepare_model_dir(cfg)
    engine = build_engine(cfg, tmp_path / "run")
    assert engine.training.cluster.layout.train_cp == 2
    engine.initialize()
    try:
        for i in range(2):
            metrics = engine.step(engine.generate_rollout(i))
            engine.update_weights()
            assert math.isfinite(metrics["train/policy/loss"])
    finally:
        engine.shutdown()


def test_c_that_does_not_divide_the_heads_fails_before_launch(tmp_path):
    cfg = load_config(
        None, [*tiny_run_overrides(tmp_path), "cluster.allocation_mode='areno[rollout]:d1+fsdp[actor]:d3c3'"]
    )
    prepare_model_dir(cfg)
    engine = build_engine(cfg, tmp_path / "run")
    with pytest.raises(LayoutError, match=r"\(c3\): cp_size=3 must divide the model's attention heads") as info:
        engine.initialize()
    assert "\n" not in str(info.value)
    engine.shutdown()
