"""The TP plan covers every parameter, and a model split by it computes what the full model does."""

from __future__ import annotations

import threading

import pytest
import torch

from areno.models import Decoder, load_model, save_model, tiny_config
from areno.models.tp_plan import check_tp_size, shard_tensor, tp_plan, tp_style

VOCAB = 40


@pytest.mark.parametrize(
    "kw",
    [
        dict(arch="qwen2"),
        dict(arch="qwen3", tie_word_embeddings=True),
        dict(arch="llama", attention_bias=True, attention_out_bias=True, mlp_bias=True),
        dict(arch="mistral"),
        dict(arch="olmo2", attention_bias=True, attention_out_bias=True),
        dict(arch="olmo3"),
        dict(arch="gemma3"),
        dict(arch="phi3", sliding_window=8),
    ],
)
def test_plan_covers_every_parameter(kw):
    config = tiny_config(VOCAB, **kw)
    plan = tp_plan(config)
    styles = {name: tp_style(plan, name) for name, _ in Decoder(config).named_parameters()}
    assert styles["model.layers.1.self_attn.q_proj.weight"] == "colwise"
    assert styles["model.layers.0.mlp.down_proj.weight"] == "rowwise"
    assert ("lm_head.weight" in styles) == (not config.tie_word_embeddings)
    with pytest.raises(ValueError, match="not covered"):
        tp_style(plan, "model.layers.0.self_attn.rotary.weight")


@pytest.mark.parametrize(
    "kw",
    [
        dict(arch="glm4_moe", first_k_dense_replace=1, n_shared_experts=2),
        dict(arch="glm4_moe", first_k_dense_replace=0, n_shared_experts=1),
        dict(arch="qwen2_moe", layers=3, mlp_only_layers=(1,)),
        dict(arch="granitemoe"),
        dict(arch="olmoe", attention_bias=True, attention_out_bias=True),
        dict(arch="gpt_oss"),
    ],
)
def test_plan_covers_every_tensor_of_an_expert_model(kw):
    """Every state-dict tensor of an expert model has a style (the rollout workers' ``full_meta`` reads one for
    each live tensor): its sparse blocks whole, shared experts and GLM-4.5's correction-bias buffer among them."""
    config = tiny_config(VOCAB, **kw)
    plan = tp_plan(config)
    styles = {name: tp_style(plan, name) for name in Decoder(config).state_dict()}
    block = {
        name: style
        for name, style in styles.items()
        if ".mlp." in name and config.is_moe_layer(int(name.split(".")[2]))
    }
    assert block and set(block.values()) == {"replicate"}
    assert styles["model.layers.0.self_attn.q_proj.weight"] == "colwise"


class _ThreadAllReduce:
    """An in-process stand-in for dist.all_reduce: ``tp`` threads each call it with their partial
    tensor and all get the sum (the real engine passes a torch.distributed all-reduce)."""

    def __init__(self, tp: int) -> None:
        self.parts: list = [None] * tp
        self.barrier = threading.Barrier(tp, timeout=60)  # a dead peer breaks it, no hang

    def for_rank(self, rank: int):
        def reduce(x: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = x
            self.barrier.wait()
            total = sum(self.parts[1:], self.parts[0].clone())
            self.barrier.wait()
            return total

        return reduce


@pytest.mark.parametrize(
    "kw",
    [
        dict(arch="qwen2"),
        dict(arch="qwen3", tie_word_embeddings=True),
        dict(arch="llama", attention_bias=True, attention_out_bias=True, mlp_bias=True),
        dict(arch="phi3"),  # each rank's q/k/v and gate/up rows cut from the packed tensors on disk
        dict(arch="gemma3", sliding_window=4),  # per-head q/k norms, four block norms, a window in layer 0
    ],
)
def test_tp2_shards_loaded_by_plan_equal_full_model(kw, tmp_path):
    """Each rank loads its shards by the plan; with the all-reduce after the row-parallel
    projections and the vocab shards concatenated, the logits equal the full model's."""
    torch.manual_seed(0)
    tp = 2
    config = tiny_config(VOCAB, heads=4, kv_heads=2, initializer_range=0.2, **kw)
    save_model(Decoder(config), config, tmp_path)
    full, _ = load_model(tmp_path)
    ids_T = torch.randint(0, VOCAB, (11,))
    pos_T = torch.arange(11)
    with torch.no_grad():
        expected = full.logits(full(ids_T, pos_T))

    reducer = _ThreadAllReduce(tp)
    results: list = [None] * tp
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            _run(rank)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread, which re-raises it
            errors.append(e)
            reducer.barrier.abort()

    def _run(rank: int) -> None:
        model, _ = load_model(tmp_path, tp_rank=rank, tp_size=tp, tp_reduce=reducer.for_rank(rank))
        assert model.model.layers[0].self_attn.q_proj.weight.shape[0] == 2 * config.head_dim
        plan, full_sd = tp_plan(config), full.state_dict()
        for name, t in model.state_dict().items():  # loader and shard_tensor cut alike
            assert torch.equal(t, shard_tensor(full_sd[name], tp_style(plan, name), rank, tp)), name
        with torch.no_grad():
            results[rank] = model.logits(model(ids_T, pos_T))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    got = results[0] if config.tie_word_embeddings else torch.cat(results, dim=-1)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="tp_reduce"):
        Decoder(config, tp_size=2)


def test_check_tp_size_errors():
    config = tiny_config(VOCAB, heads=4, kv_heads=2)
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        check_tp_size(config, 4)
    with pytest.raises(ValueError, match="vocab_size=41"):
        check_tp_size(tiny_config(41), 2)
    check_tp_size(tiny_config(41, tie_word_embeddings=True), 2)
