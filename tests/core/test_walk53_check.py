"""``areno train --check`` on an expert model: a LoRA target its layers refuse and a vLLM/SGLang rollout of a model
areno refuses to serve there are one line before any weights load, as they are in the run (walk53)."""

from __future__ import annotations

import importlib.util

import pytest
import transformers

from areno.cli import main as areno_main
from areno.data.tokenizer import build_char_tokenizer
from areno.models.hf_io import init_model_dir, tiny_config
from tests.helpers.configs import train_args

TINY_MOE = "{arch: %s, hidden_size: 32, layers: 2, heads: 2, kv_heads: 1, intermediate_size: 64}"


def _check(tmp_path, capsys, *extra: str) -> list[str]:
    """``areno train --check`` of a tiny run with ``extra``: asserts it fails with exit code 2 and writes nothing;
    returns its stderr lines."""
    args = train_args(tmp_path, *extra)
    assert areno_main([args[0], "--check", *args[1:]]) == 2
    assert not (tmp_path / "run").exists()
    return capsys.readouterr().err.strip().splitlines()


def test_check_names_a_lora_target_the_model_lacks_before_it_loads(tmp_path, capsys):
    """Checked on the model built on the meta device: before, --check passed and the run failed after loading."""
    init = f"model.init_tiny={TINY_MOE % 'olmoe'}"
    err = _check(tmp_path, capsys, init, "train.lora.rank=4", "train.lora.target_modules=q_proj,gate_proj")
    assert err == [
        "areno: error: train.lora.target_modules: ['gate_proj'] match no linear layer of the model; "
        "choose from ['k_proj', 'o_proj', 'q_proj', 'v_proj']"
    ]
    assert not (tmp_path / "model").exists()  # init_tiny's model not made


@pytest.mark.skipif(
    int(transformers.__version__.split(".")[0]) < 5, reason="peft maps MLP names to fused experts under transformers 5"
)
def test_a_gate_projection_peft_refuses_on_glm45_is_one_line_not_a_traceback(tmp_path, capsys):
    """GLM-4.5's dense first layer and shared experts have gate_proj / up_proj linear layers, which peft reads as
    its fused experts' under transformers 5 and refuses one without the other: a ValueError traceback before."""
    init = f"model.init_tiny={{{(TINY_MOE % 'glm4_moe')[1:-1]}, first_k_dense_replace: 1}}"
    err = _check(tmp_path, capsys, init, "train.lora.rank=4", "train.lora.target_modules=gate_proj")
    assert len(err) == 1, err
    assert err[0].startswith("areno: error: train.lora.target_modules: ['gate_proj']: peft refuses them (")
    assert "without also targeting up_proj" in err[0]
    assert err[0].endswith("; target the attention projections (q_proj,k_proj,v_proj,o_proj) of an expert model")


def _granite_moe(tmp_path):
    model = tmp_path / "granite_moe"
    tokenizer = build_char_tokenizer()
    init_model_dir(model, tiny_config(len(tokenizer), arch="granitemoe", hidden_size=32, layers=1), tokenizer)
    return model


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_check_refuses_a_server_rollout_of_a_model_areno_serves_alone(tmp_path, capsys, backend):
    """GraniteMoE's fused experts were refused for vLLM/SGLang only once the training side had loaded the model;
    --check passed."""
    model = _granite_moe(tmp_path)
    err = _check(
        tmp_path, capsys, f"model.path={model}", f"rollout.backend={backend}", "rollout.servers=[http://127.0.0.1:9]"
    )
    assert err == [
        f"areno: error: rollout.backend={backend}: {model} is a GraniteMoE checkpoint, whose weight updates into "
        f"{backend} (its fused experts, block_sparse_moe.input_linear / output_linear) areno has not tested: use "
        "rollout.backend=areno"
    ]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_check_names_a_server_package_that_is_not_installed(tmp_path, capsys):
    err = _check(tmp_path, capsys, "rollout.backend=vllm")
    assert len(err) == 1 and err[0].startswith("areno: error: rollout.backend=vllm: vllm is not installed in "), err


def test_model_path_at_a_lora_adapter_names_the_merged_export(tmp_path, capsys):
    """A LoRA run's ``<role>/adapter`` (PEFT's files, no config.json) was "config.json not found"."""
    step = tmp_path / "lora_run" / "checkpoints" / "step_00000002"
    (step / "policy" / "adapter").mkdir(parents=True)
    (step / "policy" / "adapter" / "adapter_config.json").write_text("{}")
    (step / "hf").mkdir()
    (step / "hf" / "config.json").write_text("{}")
    adapter = step / "policy" / "adapter"
    err = _check(tmp_path, capsys, f"model.path={adapter}", "model.init_tiny=null")
    assert err == [
        f"areno: error: model.path: {adapter} is a LoRA adapter, not a model directory: pass its checkpoint's merged "
        f"Hugging Face export, {step / 'hf'}, or the model it adapts with train.lora to train new adapters"
    ]
    assert (adapter / "adapter_config.json").is_file()


def test_a_rows_problem_found_after_loading_is_named_by_its_line_as_load_errors_are(tmp_path, capsys):
    """A message-list prompt with an untemplated tokenizer was "FILE row 1" (0-based, blank lines not counted) where
    the load errors of the same file say "FILE line N": now line 3, as an editor shows it."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        '{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": [{"role": "user", "content": "hi"}], "answer": "2"}\n'
    )
    err = _check(tmp_path, capsys, "data.task=null", f"data.train_path={rows}", f"data.eval_path={rows}")
    assert len(err) == 1 and err[0].startswith(f"areno: error: {rows} line 3: 'prompt' is a message list"), err


@pytest.mark.parametrize(
    "placement, said",
    [
        (["cluster.train_devices=[0,1]", "cluster.rollout_devices=[2]", "cluster.train_tp=2"], "cluster.train_tp=2"),
        (["cluster.allocation_mode='areno:d1+fsdp:d1t2'"], "cluster.allocation_mode='areno:d1+fsdp:d1t2' (t2)"),
    ],
)
def test_lora_under_training_tensor_parallelism_is_refused_before_any_worker_starts(tmp_path, capsys, placement, said):
    """It passed --check and the training workers refused it once they had loaded the model."""
    err = _check(tmp_path, capsys, "train.lora.rank=4", *placement)
    fix = "give the training component t1" if "allocation_mode" in said else "set cluster.train_tp=1"
    assert err == [
        f"areno: error: train.lora with {said}: LoRA does not train under tensor parallelism; set train.lora=null, "
        f"or {fix}"
    ]
