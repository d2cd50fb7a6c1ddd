"""Where the time of one CUDA call goes, for the benches' ``--profile``: wall time against the
summed time of the kernels and copies (``gpu_busy`` = their share of the wall: well below 1 means
the GPU waits on the host), the top kernels by device time and the host-side ops by self CPU time
(syncs such as ``cudaStreamSynchronize`` show up there). CUDA-graph replays are included: the
profiler records the kernels inside them."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def profile_cuda(fn: Callable[[], object], top: int = 25) -> dict:
    """Run ``fn`` once under the profiler and summarise it."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall_ms = 1e3 * (time.perf_counter() - t0)
    events = prof.key_averages()

    def device_us(e) -> float:
        return float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)))

    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    kernel_ms = sum(device_us(e) for e in kernels) / 1e3
    host = [e for e in events if e.device_type == DeviceType.CPU]
    return {
        "wall_ms": round(wall_ms, 1),
        "kernel_ms": round(kernel_ms, 1),
        "gpu_busy": round(kernel_ms / wall_ms, 3),
        "kernel_launches": int(sum(e.count for e in kernels)),
        "top_kernels": [
            {
                "kernel": e.key[:90],
                "calls": e.count,
                "ms": round(device_us(e) / 1e3, 2),
                "share": round(device_us(e) / 1e3 / max(kernel_ms, 1e-9), 3),
            }
            for e in sorted(kernels, key=device_us, reverse=True)[:top]
        ],
        "top_ops_by_device_time": [
            {"op": e.key[:60], "calls": e.count, "device_ms": round(device_us(e) / 1e3, 2)}
            for e in sorted(host, key=device_us, reverse=True)[:top]
        ],
        "top_host_ops": [
            {"op": e.key[:60], "calls": e.count, "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 2)}
            for e in sorted(host, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
        ],
    }
