"""Every ``LayoutError`` of ``areno.engine.cluster`` is one line that names the settings that caused it
as the user writes them (``cluster.allocation_mode='...'``, ``cluster.train_devices=[...]``) and the fix."""

import pytest

from areno.engine.cluster import (
    ClusterLayout,
    LayoutError,
    MemoryEstimate,
    layout_from_config,
    scheduler_for,
    validate_memory,
)
from tests.helpers.configs import cluster_section

GIB = 1 << 30


def _from_mode(mode, num_devices=0, cuda=False, **kw):
    return layout_from_config(cluster_section(allocation_mode=mode, **kw), num_devices=num_devices, cuda=cuda)


CASES = {
    "empty list": (
        lambda: ClusterLayout(train_devices=(), rollout_devices=(1,)),
        r"^cluster.train_devices=\[\] is empty: give at least one logical device index \(e.g. "
        r"cluster.train_devices=\[0\]\)$",
    ),
    "negative index": (
        lambda: ClusterLayout(train_devices=(0,), rollout_devices=(-1,)),
        r"^cluster.rollout_devices=\[-1\] has a negative index: use logical device indices >= 0$",
    ),
    "a list past the visible devices": (
        lambda: ClusterLayout(train_devices=(0,), rollout_devices=(2,), cuda=True, device_ids=("4", "5")),
        r"^cluster.rollout_devices=\[2\] names device 2 but only 2 are visible \(CUDA_VISIBLE_DEVICES=4,5\): "
        r"use indices below 2$",
    ),
    "lists past num_devices": (
        lambda: layout_from_config(cluster_section(train_devices=[0], rollout_devices=[3]), num_devices=2, cuda=True),
        r"^cluster.train_devices=\[0\] / cluster.rollout_devices=\[3\] name device 3 but only 2 are visible: "
        r"use logical indices below 2",
    ),
    "train TP x replicate, lists": (
        lambda: ClusterLayout(train_devices=(0, 1, 2), rollout_devices=(3,), train_tp=2),
        r"^cluster.train_devices=\[0, 1, 2\]: 3 training devices cannot form train TP 2 x replicate 1 .*: give "
        r"cluster.train_devices a multiple of 2 devices, or change cluster.train_tp / cluster.train_dp_replicate$",
    ),
    "train replicate, allocation string": (
        lambda: _from_mode("areno:d1+fsdp:d3", train_dp_replicate=2),
        r"^cluster.allocation_mode='areno:d1\+fsdp:d3': 3 training devices cannot form train TP 1 x replicate 2 "
        r"\(cluster.train_dp_replicate=2\): make the fsdp component's d a multiple of 2, or set "
        r"cluster.train_dp_replicate to a divisor of it$",
    ),
    "expert parallelism with replicate, allocation string": (
        lambda: _from_mode("areno:d1+fsdp:d4e4", train_dp_replicate=2),
        r"^cluster.allocation_mode='areno:d1\+fsdp:d4e4': training expert parallelism e4 with "
        r"cluster.train_dp_replicate=2: the experts shard over the whole FSDP group; set cluster.train_dp_replicate=1$",
    ),
    "context parallelism with replicate, allocation string": (
        lambda: _from_mode("areno:d1+fsdp:d4c2", train_dp_replicate=4),
        r"^cluster.allocation_mode='areno:d1\+fsdp:d4c2': training context parallelism c2 must divide the FSDP "
        r"shard size 1 \(of cluster.train_dp_replicate=4 replicas\) with t1 and e1: lower cluster.train_dp_replicate "
        r"or give training more devices$",
    ),
    "rollout TP": (
        lambda: ClusterLayout(train_devices=(0,), rollout_devices=(1, 2, 3), rollout_tp=2),
        r"^cluster.rollout_devices=\[1, 2, 3\]: 3 rollout devices cannot form replicas of rollout TP 2 "
        r"\(cluster.rollout_tp=2\): give cluster.rollout_devices a multiple of 2 devices, or change "
        r"cluster.rollout_tp$",
    ),
    "string and lists": (
        lambda: _from_mode("areno:d1+fsdp:d1", train_devices=[0], rollout_devices=[1]),
        r"^cluster.allocation_mode='areno:d1\+fsdp:d1' and cluster.train_devices/rollout_devices both place the "
        r"workers: set one, not both \(drop cluster.train_devices and cluster.rollout_devices",
    ),
    "string and TP keys": (
        lambda: _from_mode("areno:d1+fsdp:d1", rollout_tp=2),
        r"^cluster.allocation_mode='areno:d1\+fsdp:d1' sets the TP sizes by each component's t .*: drop "
        r"cluster.rollout_tp=2 and write the size into the string$",
    ),
    "string past the visible devices": (
        lambda: _from_mode("areno:d2+fsdp:d2", num_devices=3, cuda=True),
        r"^cluster.allocation_mode='areno:d2\+fsdp:d2' needs 4 devices but only 3 are available "
        r"\(CUDA_VISIBLE_DEVICES\): shrink its d/t counts, or make more devices visible$",
    ),
    "train components of different TP": (
        lambda: _from_mode("areno:d1+fsdp:d1t2+fsdp[critic]:d1"),
        r"^cluster.allocation_mode='areno:d1\+fsdp:d1t2\+fsdp\[critic\]:d1': the train components differ in t "
        r"\(t2 and t1\): give every train component the same t$",
    ),
    "train components of different CP (walk23: the critic's c2 was dropped)": (
        lambda: _from_mode("areno:d1+fsdp:d2|fsdp[critic]:d2c2"),
        r"^cluster.allocation_mode='areno:d1\+fsdp:d2\|fsdp\[critic\]:d2c2': the train components differ in c "
        r"\(c1 and c2\): give every train component the same c$",
    ),
    "train components of different EP": (
        lambda: _from_mode("areno:d1+fsdp:d2e2|fsdp[critic]:d2"),
        r"^cluster.allocation_mode='areno:d1\+fsdp:d2e2\|fsdp\[critic\]:d2': the train components differ in e "
        r"\(e2 and e1\): give every train component the same e$",
    ),
    "colocated string and lists (walk23: the string was ignored)": (
        lambda: _from_mode("areno:d1|fsdp:d1", train_devices=[1], rollout_devices=[0]),
        r"^cluster.allocation_mode='areno:d1\|fsdp:d1' is colocated \(no '\+'\) and cluster.train_devices/"
        r"rollout_devices place the workers apart: set one, not both .*$",
    ),
    "one list without the other": (
        lambda: layout_from_config(cluster_section(rollout_devices=[1]), num_devices=2, cuda=False),
        r"^cluster.rollout_devices=\[1\] without cluster.train_devices: the two lists go together, set "
        r"cluster.train_devices too \(or a '\+' cluster.allocation_mode instead of both\)$",
    ),
    "no route for the policy sync": (
        lambda: ClusterLayout(train_devices=(0,), rollout_devices=(0,), cuda=True).relays(),
        r"^cluster.train_devices=\[0\] / cluster.rollout_devices=\[0\]: policy sync cannot route: .*; here: list a "
        r"device in cluster.rollout_devices that cluster.train_devices does not$",
    ),
    "shared devices under Ray, allocation string": (
        lambda: scheduler_for(
            cluster_section(),
            ClusterLayout(train_devices=(0,), rollout_devices=(0,), cuda=True, allocation_mode="areno:d1|fsdp:d1"),
            log_dir="unused",
        ),
        r"^cluster.scheduler=ray gives each worker GPUs of its own, but train and rollout share devices \[0\] "
        r"\(cluster.allocation_mode='areno:d1\|fsdp:d1'\): use a '\+' between rollout and training in "
        r"cluster.allocation_mode, or cluster.scheduler=local$",
    ),
    "memory": (
        lambda: validate_memory(
            ClusterLayout(train_devices=(0,), rollout_devices=(1,), cuda=True, allocation_mode="areno:d1+fsdp:d1"),
            MemoryEstimate(per_device={0: {"train_model_grad_optim": 2 * GIB}}),
            GIB,
        ),
        r"^device 0 needs ~2.00 GiB \(train_model_grad_optim 2.00 GiB\) but has 1.00 GiB "
        r"\(cluster.allocation_mode='areno:d1\+fsdp:d1'\): .*lower rollout.kv_blocks \(or rollout.max_concurrent\)$",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_layout_errors_name_the_setting_and_the_fix(case):
    make, pattern = CASES[case]
    with pytest.raises(LayoutError, match=pattern) as info:
        make()
    assert "\n" not in str(info.value)


def test_layout_from_an_allocation_string_remembers_it():
    lay = _from_mode("areno:d1+fsdp:d2")
    assert lay.allocation_mode == "areno:d1+fsdp:d2"
    lists = layout_from_config(cluster_section(train_devices=[0], rollout_devices=[1]), num_devices=0, cuda=False)
    assert lists.allocation_mode is None
