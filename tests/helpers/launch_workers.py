"""Worker classes the scheduler tests start in other processes (imported there by path)."""

from __future__ import annotations

import os


def local_gradient(seed: int, rank: int):
    """The gradient of a tiny least-squares model on rank-specific data (deterministic on CPU).

    torch is imported lazily so that workers of the other test classes start fast."""
    import torch

    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    x_BD = torch.randn(8, 4, generator=gen, dtype=torch.float64)
    y_B = torch.randn(8, generator=gen, dtype=torch.float64)
    w_D = torch.linspace(-1.0, 1.0, 4, dtype=torch.float64, requires_grad=True)
    loss = ((x_BD @ w_D - y_B) ** 2).mean()
    loss.backward()
    return w_D.grad.detach()


class GradWorker:
    """Computes a local gradient and all-reduces it over gloo."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.calls = 0

    def init_dist(self) -> tuple[int, int]:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        return dist.get_rank(), dist.get_world_size()

    def allreduced_gradient(self) -> list[float]:
        import torch.distributed as dist

        grad_D = local_gradient(self.seed, dist.get_rank())
        dist.all_reduce(grad_D)
        return grad_D.tolist()

    def count(self) -> int:
        self.calls += 1
        return self.calls

    def env(self, key: str) -> str | None:
        return os.environ.get(key)

    def doubled(self, state: dict) -> dict:
        """``state`` with each tensor doubled: tensors travel both ways (a checkpoint's extra state does)."""
        import torch

        return {k: v * 2 if isinstance(v, torch.Tensor) else v for k, v in state.items()}

    def pid(self) -> int:
        return os.getpid()

    def fail(self, message: str) -> None:
        raise ValueError(message)

    def crash(self) -> None:
        os._exit(3)


class BrokenWorker:
    def __init__(self) -> None:
        raise RuntimeError("constructor refuses")


class EnvWorker:
    """No torch import: starts fast."""

    def env(self, key: str) -> str | None:
        return os.environ.get(key)


class TrainerWorker:
    """Runs a whole areno Trainer (a tiny GRPO) inside a scheduler worker; returns metrics.jsonl rows."""

    def __init__(self, overrides: list[str]) -> None:
        import torch

        from areno.api.config import load_config

        torch.set_num_threads(1)
        self.cfg = load_config(None, overrides)

    def run(self) -> list[dict]:
        import json
        from pathlib import Path

        from areno.api.trainer import Trainer

        trainer = Trainer.init(self.cfg)
        try:
            trainer.run()
        finally:
            trainer.shutdown()
        return [json.loads(line) for line in (Path(self.cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]


def digits(prompt, completion, answer, **row):
    """A dense reward for the tiny GRPO runs: the fraction of digit characters in the completion."""
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)


def runtime_info() -> dict:
    """Thread settings and numerics-relevant env of the calling worker process."""
    import torch

    keys = ("THREAD", "OMP", "MKL", "KMP", "CUDA", "TORCH")
    return {
        "threads": torch.get_num_threads(),
        "interop": torch.get_num_interop_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "env": {k: v for k, v in os.environ.items() if any(w in k for w in keys)},
    }


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs here; a zombie (exited, not yet reaped) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
