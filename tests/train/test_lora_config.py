"""``train.lora`` from the config to the run: adapters on the trained roles, merged weights in every
policy sync and ``hf/`` export, the adapter in PEFT's layout in every checkpoint."""

import json

import pytest
import torch

from areno.api.config import load_config
from areno.api.trainer import Trainer
from areno.engine.config import build_train_backend_config
from areno.errors import ConfigError
from areno.train.lora import lora_layers
from tests.helpers.configs import run_to_end, tiny_grpo_overrides


def _config(tmp_path, *extra):
    return load_config(
        None,
        [
            *tiny_grpo_overrides(tmp_path),
            "reward.fn=tests.helpers.rewards:sevens",
            "reward.sandbox=false",
            "train.eval_interval=0",
            "train.seed=1",
            *extra,
        ],
    )


def test_lora_keys_reach_the_trained_backends_only(tmp_path):
    cfg = _config(tmp_path, "train.lora.rank=8", "train.lora.target_modules=[q_proj,down_proj]", "train.lora.alpha=4")
    assert (cfg.train.lora.rank, cfg.train.lora.alpha, cfg.train.lora.dropout) == (8, 4.0, 0.0)
    assert build_train_backend_config(cfg, role_name="actor", trainable=True).lora == cfg.train.lora
    assert build_train_backend_config(cfg, role_name="ref", trainable=False).lora is None
    assert _config(tmp_path).train.lora is None


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.lora.rank=0", "train.lora.rank"),
        ("train.lora.alpha=-1", "train.lora.alpha"),
        ("train.lora.dropout=1.0", "train.lora.dropout"),
        ("train.lora.target_modules=[]", "train.lora.target_modules"),
        ("train.lora.ranks=8", "train.lora.ranks"),
    ],
)
def test_bad_lora_value_is_one_line_naming_the_key(tmp_path, override, key):
    with pytest.raises(ConfigError) as err:
        _config(tmp_path, override)
    assert str(err.value).startswith(key) and "\n" not in str(err.value)


def test_unknown_target_module_is_one_line_at_start(tmp_path):
    cfg = _config(tmp_path, "train.steps=1", "train.lora.target_modules=[qkv]")
    with pytest.raises(ConfigError, match=r"^train.lora.target_modules: \['qkv'\] match no linear layer") as err:
        Trainer.init(cfg).shutdown()
    assert "'lm_head'" not in str(err.value) and "'q_proj'" in str(err.value)  # lm_head is no choice


@pytest.mark.parametrize(
    "value, modules",
    [
        ("q_proj", ("q_proj",)),
        ("q_proj,down_proj", ("q_proj", "down_proj")),
        ("[q_proj,down_proj]", ("q_proj", "down_proj")),
    ],
)
def test_target_modules_may_be_a_string(tmp_path, value, modules):
    """A single name (or comma-separated names) is the list of them, not OmegaConf's type error."""
    cfg = _config(tmp_path, "train.lora.rank=4", f"train.lora.target_modules={value}")
    assert cfg.train.lora.target_modules == modules


def test_lm_head_is_refused_before_the_model_loads(tmp_path):
    """The decoder reads ``lm_head.weight`` directly, so an adapter there would never run and step 1 would
    fail with "element 0 of tensors does not require grad"."""
    with pytest.raises(ConfigError) as err:
        _config(tmp_path, "train.lora.rank=4", "train.lora.target_modules=[q_proj,lm_head]")
    message = str(err.value)
    assert message.startswith("train.lora.target_modules: lm_head cannot take an adapter") and "\n" not in message
    assert not (tmp_path / "model").exists()


def test_lora_run_trains_adapters_syncs_merged_and_checkpoints_peft(tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    cfg = _config(
        tmp_path,
        "train.steps=2",
        "optim.lr=0.02",
        "train.lora.rank=4",
        "train.lora.alpha=8",
        "train.lora.target_modules=[q_proj,v_proj,o_proj,down_proj]",
    )
    trainer = Trainer.init(cfg)
    engine = trainer.backend.engine
    policy = engine.training.runner.backends["policy"]
    try:
        assert set(lora_layers(policy.model)) == {
            "model.layers.0.self_attn.q_proj",
            "model.layers.0.self_attn.v_proj",
            "model.layers.0.self_attn.o_proj",
            "model.layers.0.mlp.down_proj",
        }
        before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
        base = {n: t.clone() for n, t in policy.named_weights()}
        trainer.run()
        after = dict(policy.model.named_parameters())
        changed = {n for n in before if not torch.equal(before[n], after[n].detach())}
        assert changed and all(".lora_B." in n or ".lora_A." in n for n in changed), changed
        assert all(after[n].requires_grad == (".lora_" in n) for n in after)
        # the rollout engine holds the merged weights under the base model's names
        merged = dict(policy.named_weights())
        assert merged.keys() == base.keys()
        synced = engine.rollout.engine.weight_tensors()
        assert synced.keys() == merged.keys()
        assert all(torch.equal(t, merged[n]) for n, t in synced.items())
        assert not torch.equal(
            merged["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"]
        )
    finally:
        trainer.shutdown()
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000002"
    assert (ckpt / "COMPLETE").exists()
    hf = load_file(str(ckpt / "hf" / "model.safetensors"))
    assert all(torch.equal(hf[n], merged[n]) for n in hf) and "model.layers.0.self_attn.q_proj.weight" in hf
    adapter_dir = ckpt / "policy" / "adapter"
    assert json.loads((adapter_dir / "adapter_config.json").read_text())["r"] == 4
    # base + adapter through peft equals the merged export through transformers
    exported = AutoModelForCausalLM.from_pretrained(ckpt / "hf")
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "model"), adapter_dir)
    ids = torch.tensor([[3, 5, 7, 9, 11, 2]])
    with torch.no_grad():
        want = exported(ids).logits
        got = with_adapter(ids).logits
        merged_back = with_adapter.merge_and_unload().state_dict()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for name, tensor in exported.state_dict().items():
        torch.testing.assert_close(merged_back[name], tensor, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_demo_task_learns_with_lora(tmp_path):
    """areno/configs/demo.yaml (its supervised warm start trains all weights), then its 120 GRPO steps of 32
    prompts training only rank-8 adapters: held-out accuracy over the demo's 200 prompts rises by at least 5
    points at a fixed seed (seed 0: +11.0, seed 1: +9.0 on the AVX2 VM; at 60 steps seeds 0-2 gave +3.0, +4.5,
    +11.5 there and +9.0, +4.5, +14.0 on the AVX-512 one, too close to the bound; bench/LOG.md)."""
    from areno.api.pipeline import DEMO_CONFIG, run_pipeline

    cfg = load_config(
        DEMO_CONFIG,
        [
            f"run_dir={tmp_path / 'demo'}",
            f"model.path={tmp_path / 'demo' / 'init'}",
            "observe.console=false",
            "train.eval_interval=0",
            "train.seed=0",
            "optim.lr=3e-3",
            "train.lora.rank=8",
            "train.lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]",
        ],
    )
    summary = run_pipeline(cfg)
    assert summary["accuracy_after"] >= summary["accuracy_before"] + 0.05, summary
    assert (tmp_path / "demo" / "checkpoints" / "step_00000120" / "policy" / "adapter" / "adapter_config.json").exists()


def test_lora_bench_arms_count_sync_and_state_bytes(tmp_path):
    """``python -m bench.lora``'s arms: the same merged sync payload, a far smaller training state."""
    from bench.lora import run_arm

    full, lora = (run_arm("demo", arm, 8, 1, 32, 2, tmp_path) for arm in ("full", "lora"))
    assert full["sync_bytes"] == lora["sync_bytes"] == 4 * full["params"]
    assert lora["adapter_bytes"] == 4 * lora["trainable_params"] < full["sync_bytes"] // 10
    assert lora["train_state_bytes"] == 16 * lora["trainable_params"] < full["train_state_bytes"] // 10


MOE_WITH_A_DENSE_LAYER = (
    "model.init_tiny={arch: qwen3_moe, hidden_size: 32, layers: 2, heads: 2, kv_heads: 1, intermediate_size: 64,"
    " moe_intermediate_size: 32, num_experts: 4, num_experts_per_tok: 2, mlp_only_layers: [1]}"
)


def test_mlp_adapters_on_an_expert_model_are_one_line_at_start(tmp_path):
    # peft reads MLP names on an expert model as its fused 3-D expert weights (no merge reaches the rollout
    # engine: the first policy sync failed after a whole step) and skips the dense layer's linear layers
    cfg = _config(tmp_path, MOE_WITH_A_DENSE_LAYER, "train.steps=1", "train.lora.target_modules=[gate_proj,up_proj]")
    with pytest.raises(
        ConfigError,
        match=r"^train.lora.target_modules: \[.gate_proj., .up_proj.\] put adapters on layers that are not linear",
    ) as err:
        Trainer.init(cfg).shutdown()
    assert "model.layers.0.mlp.experts" in str(err.value) and "model.layers.1.mlp.gate_proj" in str(err.value)
    assert "\n" not in str(err.value) and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_attention_adapters_on_an_expert_model_sync_merged(tmp_path):
    cfg = _config(tmp_path, MOE_WITH_A_DENSE_LAYER, "train.steps=1", "train.lora.target_modules=[q_proj,v_proj]")
    trainer = Trainer.init(cfg)
    try:
        trainer.run()
        policy = trainer.backend.engine.training.runner.backends["policy"]
        assert sorted(lora_layers(policy.model)) == [
            f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("q_proj", "v_proj")
        ]
        synced = trainer.backend.engine.rollout.engine.weight_tensors()
        q = lora_layers(policy.model)["model.layers.0.self_attn.q_proj"]
        merged = q.base_layer.weight + (q.lora_B["default"].weight @ q.lora_A["default"].weight) * q.scaling["default"]
        torch.testing.assert_close(synced["model.layers.0.self_attn.q_proj.weight"], merged.detach(), atol=1e-6, rtol=0)
        assert not torch.equal(q.lora_B["default"].weight, torch.zeros_like(q.lora_B["default"].weight))  # it trained
    finally:
        trainer.shutdown()


def test_an_adapter_on_a_vision_towers_convolution_is_one_line_naming_it(tmp_path):
    from tests.helpers.vlm import vl_overrides

    cfg = load_config(None, [*vl_overrides(tmp_path, 1), "train.lora.target_modules=[proj]"])
    with pytest.raises(ConfigError) as err:
        Trainer.init(cfg).shutdown()
    message = str(err.value)
    assert message.startswith("train.lora.target_modules: ['proj'] put adapters on layers that are not linear")
    assert "visual.patch_embed.proj: Conv3d" in message and "expert" not in message and "\n" not in message


PHI3_TINY = "model.init_tiny={arch: phi3, hidden_size: 32, layers: 1, heads: 2, kv_heads: 1, intermediate_size: 64}"


def test_phi3s_adapters_export_onto_its_packed_layers_for_peft(tmp_path):
    # Phi-3's checkpoints hold qkv_proj and gate_up_proj: the q/v and up adapters are written as adapters of
    # those (stacked A, block-diagonal B), which PEFT loads onto transformers' model of the base checkpoint
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = _config(
        tmp_path,
        PHI3_TINY,
        "train.steps=1",
        "optim.lr=0.02",
        "train.lora.rank=4",
        "train.lora.alpha=8",
        "train.lora.target_modules=[q_proj,v_proj,o_proj,up_proj]",
    )
    run_to_end(cfg)
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000001"
    adapter_dir = ckpt / "policy" / "adapter"
    adapter = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert sorted(adapter["target_modules"]) == ["gate_up_proj", "o_proj", "qkv_proj"]
    assert adapter["rank_pattern"] == {"qkv_proj": 8, "gate_up_proj": 4}
    assert adapter["alpha_pattern"] == {"qkv_proj": 16, "gate_up_proj": 8}
    exported = AutoModelForCausalLM.from_pretrained(ckpt / "hf")
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "model"), adapter_dir)
    ids = torch.tensor([[3, 5, 7, 9, 11, 2]])
    with torch.no_grad():
        want, got = exported(ids).logits, with_adapter(ids).logits
    assert not torch.equal(want, AutoModelForCausalLM.from_pretrained(tmp_path / "model")(ids).logits)  # it trained
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
