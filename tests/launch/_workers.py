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
