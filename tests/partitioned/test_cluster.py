"""Device lists, ranks, groups, relays and the memory check of the partitioned topology."""

import pytest
import torch

from areno.engine.cluster import (
    ClusterLayout,
    LayoutError,
    estimate_memory,
    layout_from_config,
    validate_memory,
)
from areno.models.config import ModelConfig
from tests.helpers.configs import cluster_section

GIB = 1 << 30


def test_disjoint_gpu_layout_ranks_groups_and_relays():
    # train TP 2 on devices 0,1; rollout TP 1 x DP 2 on devices 2,3
    lay = ClusterLayout(
        train_devices=(0, 1), rollout_devices=(2, 3), train_tp=2, cuda=True, device_ids=("4", "5", "6", "7")
    )
    assert lay.train_ranks == (0, 1) and lay.rollout_ranks == (2, 3) and lay.world_size == 4
    assert lay.train_mesh_shape == (1, 1, 2) and lay.train_mesh_ranks() == [[[0, 1]]]
    assert lay.sender_ranks == (0,)  # one training DP row
    assert lay.rollout_tp_groups() == [(2,), (3,)] and lay.rollout_dp_groups() == [(2, 3)]
    assert lay.replica_leaders() == [2, 3]
    assert lay.device_of(1) == "cuda:1" and lay.device_of(3) == "cuda:3"
    assert lay.overlapping == () and lay.relays() == [2]
    topo = lay.stream_topology()
    assert topo.train_ranks == (0, 1) and topo.sender_ranks == (0,) and topo.rollout_ranks == (2, 3)


def test_dp_and_rollout_tp_groups():
    lay = ClusterLayout(
        train_devices=(0, 1, 2, 3), rollout_devices=(4, 5, 6, 7), train_dp_replicate=2, rollout_tp=2, cuda=True
    )
    assert lay.train_mesh_shape == (2, 2, 1)
    assert lay.train_mesh_ranks() == [[[0], [1]], [[2], [3]]]
    assert lay.sender_ranks == (0, 1, 2, 3)
    assert lay.rollout_dp == 2 and lay.rollout_tp_groups() == [(4, 5), (6, 7)]
    assert lay.rollout_dp_groups() == [(4, 6), (5, 7)] and lay.replica_leaders() == [4, 6]
    # four rows spread evenly over the four rollout ranks
    assert sorted(lay.relays()) == [4, 5, 6, 7]


def test_overlapping_lists_pick_relays_on_other_devices():
    lay = ClusterLayout(train_devices=(0, 1), rollout_devices=(0, 1), cuda=True)
    assert lay.overlapping == (0, 1)
    # rank 0 (train, cuda:0) relays to the rollout rank on cuda:1 and vice versa
    assert lay.relays() == [3, 2]
    one = ClusterLayout(train_devices=(0,), rollout_devices=(0,), cuda=True)
    with pytest.raises(LayoutError, match="no rollout rank on another device"):
        one.relays()
    # on CPU every process is its own device: the same lists route fine
    assert ClusterLayout(train_devices=(0,), rollout_devices=(0,)).relays() == [1]


def test_bad_lists_are_one_line_errors():
    with pytest.raises(LayoutError, match="repeats a device"):
        ClusterLayout(train_devices=(0, 0), rollout_devices=(1,))
    with pytest.raises(LayoutError, match="cannot form train TP 2"):
        ClusterLayout(train_devices=(0, 1, 2), rollout_devices=(3,), train_tp=2)
    with pytest.raises(LayoutError, match="only 2 are visible"):
        ClusterLayout(train_devices=(0,), rollout_devices=(2,), cuda=True, device_ids=("0", "1"))
    with pytest.raises(LayoutError, match="go together"):
        layout_from_config(cluster_section(train_devices=[0]), num_devices=2, cuda=False)


def test_layout_from_config_lists_and_allocation_mode():
    assert layout_from_config(cluster_section(), num_devices=1, cuda=False) is None
    assert layout_from_config(cluster_section(allocation_mode="areno:d1"), num_devices=1, cuda=False) is None
    lay = layout_from_config(cluster_section(train_devices=[0], rollout_devices=[1]), num_devices=0, cuda=False)
    assert lay.train_devices == (0,) and lay.rollout_devices == (1,)
    lay = layout_from_config(
        cluster_section(allocation_mode="areno[rollout]:d2+fsdp[actor]:t2"),
        num_devices=4,
        cuda=True,
        device_ids=("0", "1", "2", "3"),
    )
    assert set(lay.train_devices).isdisjoint(lay.rollout_devices)
    assert lay.train_tp == 2 and lay.rollout_tp == 1 and lay.rollout_dp == 2
    with pytest.raises(LayoutError, match="not both"):
        layout_from_config(
            cluster_section(allocation_mode="areno[rollout]:d1+fsdp[actor]:d1", train_devices=[0], rollout_devices=[1]),
            num_devices=2,
            cuda=False,
        )


def test_train_dp_replicate_reaches_the_layout_and_is_refused_where_it_cannot_run():
    from areno.engine.config import ClusterSection
    from areno.errors import ConfigError

    cluster = ClusterSection(train_devices=[0, 1, 2, 3], rollout_devices=[4], train_dp_replicate=2)
    lay = layout_from_config(cluster, num_devices=0, cuda=False)
    assert lay.train_mesh_shape == (2, 2, 1) and lay.train_mesh_ranks() == [[[0], [1]], [[2], [3]]]
    hsdp = ClusterSection(allocation_mode="areno:d1+fsdp:d4", train_dp_replicate=2)
    assert layout_from_config(hsdp, num_devices=0, cuda=False).train_mesh_shape == (2, 2, 1)
    with pytest.raises(LayoutError, match="cannot form train TP 1 x replicate 3"):
        layout_from_config(
            ClusterSection(train_devices=[0, 1, 2, 3], rollout_devices=[4], train_dp_replicate=3),
            num_devices=0,
            cuda=False,
        )
    with pytest.raises(
        LayoutError, match=r"^cluster.allocation_mode='areno:d1\+fsdp:d4e2': .*set cluster.train_dp_replicate=1$"
    ):
        layout_from_config(
            ClusterSection(allocation_mode="areno:d1+fsdp:d4e2", train_dp_replicate=2), num_devices=0, cuda=False
        )
    with pytest.raises(ConfigError, match="cluster.train_dp_replicate: 2 replicates training .* colocated"):
        ClusterSection(train_dp_replicate=2)
    with pytest.raises(ConfigError, match="cluster.train_dp_replicate: must be >= 1, got 0"):
        ClusterSection(train_devices=[0], rollout_devices=[1], train_dp_replicate=0)


def test_the_policy_sync_takes_its_timeout_and_bucket_size_from_the_cluster_section():
    from areno.api.config import load_config
    from areno.engine.partitioned import _sync_config
    from areno.models import tiny_config

    base = ["model.path=/m", "cluster.train_devices=[0]", "cluster.rollout_devices=[1]", "cluster.device=cpu"]
    model = tiny_config(61)
    default = _sync_config(load_config(None, base), model)
    assert (default.timeout_s, default.bucket_bytes, default.float32_names) == (600.0, 64 << 20, frozenset())
    cfg = load_config(None, [*base, "cluster.sync_timeout_s=42", "cluster.sync_bucket_bytes=8388608"])
    assert (_sync_config(cfg, model).timeout_s, _sync_config(cfg, model).bucket_bytes) == (42.0, 8 << 20)
    # GLM-4.5's routers keep float32 on a bf16 wire
    glm = _sync_config(cfg, tiny_config(61, arch="glm4_moe"))
    assert glm.float32_names == {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias"}


def _group_timeouts(rank: int, world: int, layout: ClusterLayout, out: str) -> None:
    import datetime
    from pathlib import Path

    import torch

    from areno.engine.cluster import build_groups
    from areno.train.fsdp import MESH_DIMS

    groups = build_groups(layout, "cpu", datetime.timedelta(seconds=42))
    pgs = [groups.train_group, groups.rollout_group, groups.rollout_dp_group, groups.rollout_tp_group]
    if groups.train_mesh is not None:
        pgs += [groups.train_mesh.get_group(dim) for dim in MESH_DIMS]
    seconds = {pg._get_backend(torch.device("cpu")).options._timeout.total_seconds() for pg in pgs if pg is not None}
    Path(out, f"rank{rank}").write_text(repr(sorted(seconds)))


def test_every_group_takes_the_collective_timeout(tmp_path):
    """``cluster.collective_timeout_s`` reaches the subgroups and the training mesh's groups (torch
    would give each its backend's default)."""
    from tests.helpers.train import spawn

    layout = layout_from_config(cluster_section(train_devices=[0], rollout_devices=[1]), num_devices=0, cuda=False)
    spawn(_group_timeouts, 2, layout, str(tmp_path), tmp=tmp_path)
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["[42.0]", "[42.0]"]


def _qwen_7b_like() -> ModelConfig:
    return ModelConfig(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        head_dim=128,
        architecture="LlamaForCausalLM",
        model_type="llama",
    )


def test_memory_estimate_hand_computed():
    cfg = ModelConfig(
        vocab_size=100,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        architecture="LlamaForCausalLM",
        model_type="llama",
    )
    # params: attn 8*2*4*2 + 8*1*4*2 = 128 + 64 = 192; mlp 3*8*16 = 384; norms 2*8; embed+head 2*100*8; final norm 8
    p = 192 + 384 + 16 + 1600 + 8
    lay = ClusterLayout(train_devices=(0, 1), rollout_devices=(1,), cuda=True)
    est = estimate_memory(lay, cfg, train_dtype="float32", rollout_dtype="bfloat16", kv_tokens=10, context_bytes=5)
    train = -(-p * (4 + 4 + 8) // 2)
    assert est.per_device[0] == {"train_model_grad_optim": train, "train_context": 5}
    kv = 10 * 2 * 1 * 1 * 4 * 2  # tokens * (K,V) * layers * kv heads * head_dim * bf16
    assert est.per_device[1] == {
        "train_model_grad_optim": train,
        "train_context": 5,
        "rollout_weights": p * 2,
        "rollout_kv": kv,
        "rollout_context": 5,
    }
    assert est.total(1) == train + 5 + p * 2 + kv + 5


def test_memory_check_refuses_an_overlapping_layout_that_cannot_fit():
    model = _qwen_7b_like()
    # 7B on one shared 80 GiB GPU: ~7.6e9 params * 16 bytes of training state alone is > 100 GiB
    lay = ClusterLayout(train_devices=(0,), rollout_devices=(0,), cuda=True)
    est = estimate_memory(lay, model, train_dtype="float32", rollout_dtype="bfloat16", kv_tokens=100_000)
    with pytest.raises(
        LayoutError, match=r"device 0 \(shared by a training and a rollout worker\) needs ~\d+\.\d+ GiB"
    ):
        validate_memory(lay, est, 80 * GIB)
    # eight shared 80 GiB GPUs: training state is sharded 8 ways and fits next to the rollout engine
    lay8 = ClusterLayout(train_devices=tuple(range(8)), rollout_devices=tuple(range(8)), cuda=True)
    est8 = estimate_memory(lay8, model, train_dtype="float32", rollout_dtype="bfloat16", kv_tokens=100_000)
    validate_memory(lay8, est8, 80 * GIB)
    assert max(est8.total(d) for d in range(8)) < 80 * GIB < est.total(0)


def test_worker_process_settings_threads():
    import torch

    from areno.api.config import ConfigError, load_config
    from areno.engine.partitioned import apply_process_settings

    before_threads = torch.get_num_threads()
    try:
        apply_process_settings(load_config(None, ["model.path=m"]))  # defaults: nothing changes
        assert torch.get_num_threads() == before_threads
        apply_process_settings(load_config(None, ["model.path=m", "cluster.cpu_threads=1"]))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before_threads)
    with pytest.raises(ConfigError, match=r"cluster\.switch_interval_s"):  # removed: never measured
        load_config(None, ["model.path=m", "cluster.switch_interval_s=0.001"])


@pytest.mark.parametrize("layout", ["qwen3_moe", "qwen3_moe_unnormed", "mixtral"])
def test_the_memory_estimate_counts_every_expert(tmp_path, layout):
    """walk33: the partitioned layout's memory check counted a dense MLP of intermediate_size in every layer, so a
    Qwen3-30B-A3B was checked as 3.3B parameters (6.2 against 56.9 GiB a device over 8 ranks) and passed layouts
    that then ran out of memory after loading. The count now matches the built model's (its per-head q/k norms
    aside), with Qwen3-MoE's dense layers (mlp_only_layers, decoder_sparse_step) kept dense."""
    from areno.engine.cluster import _param_count
    from areno.models.hf_io import load_model
    from tests.helpers.moe import saved_by_transformers

    saved_by_transformers(layout, tmp_path)
    model, config = load_model(tmp_path, dtype=torch.float32, device="cpu")
    built = sum(p.numel() for p in model.parameters())
    qk_norms = sum(p.numel() for n, p in model.named_parameters() if n.endswith(("q_norm.weight", "k_norm.weight")))
    assert _param_count(config) == built - qk_norms


def test_the_host_memory_check_counts_each_training_process_loading_the_whole_model():
    """walk33: every FSDP rank reads the whole checkpoint into host memory (float32 by default) before sharding
    it, and nothing checked the host: 8 local ranks of a 7B model need ~224 GiB at once, and the kernel's OOM
    killer ended a worker without a message. A local layout that cannot load is now one line at launch."""
    from areno.engine.cluster import validate_host_memory

    model, gib = _qwen_7b_like(), 2**30
    eight = ClusterLayout(train_devices=tuple(range(8)), rollout_devices=(0,), cuda=True)
    with pytest.raises(
        LayoutError, match=r"each of the 8 training processes loads the whole model into host memory"
    ) as info:
        validate_host_memory(eight, model, "float32", 200 * gib)
    assert "~28.37 GiB in float32): ~226.96 GiB at once, against 200.00 GiB available" in str(info.value)
    assert "fewer training devices on this host, model.dtype=bfloat16, or a host with more memory" in str(info.value)
    validate_host_memory(eight, model, "bfloat16", 200 * gib)  # half the bytes fit
    validate_host_memory(eight, model, "float32", None)  # no /proc/meminfo: not checked


def test_the_shared_gpu_kv_estimate_counts_the_sequences_an_engine_runs_at_once():
    """walk33 M2: max_concurrent x n_samples (the default max_concurrent, 16 samples at 8,192 tokens: 34.6M
    tokens) where the run keeps at most eta + 1 batches in flight and the engine runs at most its running
    batch: an 8x overestimate that raised a false LayoutError, or sized a shared GPU's pool past any use."""
    from areno.api.config import load_config
    from areno.engine.api import rollout_max_num_seqs, rollout_sequences_in_flight
    from areno.engine.partitioned import PROMPT_TOKENS_EST, kv_tokens_for

    sizes = ["model.path=/m", "rollout.batch_size=32", "rollout.n_samples=16", "rollout.max_new_tokens=8192"]
    cfg = load_config(None, sizes)
    per_seq = PROMPT_TOKENS_EST + 8192
    assert cfg.rollout.max_concurrent * 16 * per_seq >= 8 * kv_tokens_for(cfg, 2048)  # what it counted before
    assert (
        kv_tokens_for(cfg, 2048)
        == min(rollout_max_num_seqs(cfg), rollout_sequences_in_flight(cfg)) * per_seq
        == 512 * per_seq
    )
    capped = load_config(None, [*sizes, "rollout.max_num_seqs=128"])
    assert kv_tokens_for(capped, 2048) == 128 * per_seq
    fixed = load_config(None, ["model.path=/m", "rollout.kv_blocks=100", "rollout.block_size=16"])
    assert kv_tokens_for(fixed, 2048) == 1600


def test_the_shared_gpu_kv_estimate_holds_at_least_one_sequence_of_the_engines_length():
    """walk38: a small run (1 prompt x 4 samples x 64 new tokens) sized its pool 1,280 tokens, and a 1,300-token
    prompt the engine accepts was then refused at generation time."""
    from areno.api.config import load_config
    from areno.engine.partitioned import kv_tokens_for

    small = ["model.path=/m", "rollout.batch_size=1", "rollout.n_samples=4", "rollout.max_new_tokens=64"]
    assert kv_tokens_for(load_config(None, small), 4096) == 4096  # the model's positions
    assert kv_tokens_for(load_config(None, [*small, "rollout.max_model_len=3000"]), 4096) == 3000
