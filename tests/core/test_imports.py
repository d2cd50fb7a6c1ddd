"""Start-up cost: every areno process (the CLI, each scheduler worker, each test subprocess) imports
the trainer and engines; ``peft`` (it pulls in much of ``transformers``: ~3.5 s of a 7.3 s import
here) loads only when LoRA is used."""

import subprocess
import sys


def test_entry_points_do_not_import_peft():
    code = (
        "import sys, areno.cli, areno.api.trainer, areno.engine.partitioned, areno.launch.worker, areno.train; "
        "print(sorted(m for m in sys.modules if m == 'peft' or m.startswith('peft.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_lora_imports_peft_on_first_use():
    import torch

    from areno.train.config import LoraConfig
    from areno.train.lora import apply_lora, lora_layers

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = torch.nn.Linear(4, 4)

    model = Tiny()
    assert lora_layers(model) == {}
    apply_lora(model, LoraConfig(rank=2, alpha=4, target_modules=["q_proj"]))
    assert list(lora_layers(model)) == ["q_proj"] and "peft" in sys.modules
