"""A shipped recipe of each layout of models and roles trains two steps on CUDA with the settings a user
gets there (compilation on, the CUDA rollout engine), which the CPU suite does not take: a critic's value
head (ppo), a reward model's score head, a frozen reference on offline pairs (dpo), a frozen teacher (opd),
the proximal forward of decoupled PPO (grpo_async), offline SFT and plain GRPO. One recipe a layout: each
run compiles its models first (20-120 s on an H100)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from areno.api.config import load_config
from areno.data.tokenizer import build_char_tokenizer
from areno.models.hf_io import init_model_dir, tiny_config
from areno.recipes.registry import TRAINING_CONFIGS
from tests.helpers.configs import TINY, run_to_end, tiny_run_overrides

DEVICE = "cuda"
PREFERENCE = {"dpo", "dpo_distributed", "reward_model"}
TEACHER = {"opd", "dagger", "aggrevate", "mixed_loss_dagger_opd"}
LAYOUTS = ["grpo", "ppo", "grpo_async", "opd", "dpo", "reward_model", "sft"]
SHAPE = {"hidden_size": 32, "layers": 1, "heads": 2, "kv_heads": 1, "intermediate_size": 64}


def _preference_overrides(tmp_path: Path, name: str) -> list[str]:
    pairs = tmp_path / "pairs.jsonl"
    rows = [{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": "9"} for i in range(4)]
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [
        f"run_dir={tmp_path / 'run'}",
        f"model.path={tmp_path / 'model'}",
        TINY,
        f"train.algorithm={name}",
        "data.task=null",
        f"data.train_path={pairs}",
        "rollout.batch_size=2",
        f"cluster.device={DEVICE}",
        "observe.console=false",
    ]


def _overrides(tmp_path: Path, name: str) -> list[str]:
    if name in PREFERENCE:
        return _preference_overrides(tmp_path, name)
    out = [*tiny_run_overrides(tmp_path, num_eval=2), f"cluster.device={DEVICE}", f"train.algorithm={name}"]
    if name == "sft":  # offline: it samples for its held-out evaluation only
        out = [o for o in out if not o.startswith("rollout.n_samples=")]
    if name in TEACHER:
        tok = build_char_tokenizer()
        teacher = init_model_dir(tmp_path / "teacher", tiny_config(len(tok), **SHAPE), tok, seed=7)
        out.append(f"train.algorithm_kwargs.teacher_path={teacher}")
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("name", LAYOUTS)
def test_every_shipped_recipe_trains_on_cuda_with_the_default_settings(tmp_path, name):
    cfg = load_config(None, [*_overrides(tmp_path, name), "train.steps=2", "train.eval_interval=2"])
    assert cfg.train.compile == "auto"  # on, on CUDA
    rows = run_to_end(cfg)
    losses = [v for r in rows for k, v in r.items() if k.startswith("train/") and k.endswith("/loss")]
    assert len(losses) >= 2 and all(math.isfinite(x) for x in losses), rows


def test_the_layouts_are_shipped_recipes():
    assert set(LAYOUTS) <= set(TRAINING_CONFIGS)
