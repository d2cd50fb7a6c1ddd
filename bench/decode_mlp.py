"""A decode step's MLP alone: the engine's (``decode_mlp``'s two Triton GEMMs where ``decode_mlp.serves``,
``kernels`` in each case) against what it ran before (cuBLAS gate/up, the SiLU-and-multiply kernel, cuBLAS
down), each followed by the residual add + RMSNorm (which sums the kernels' partials), at a model's MLP
shape for each row count, side by side in one process. Each case replays a
CUDA graph of ``--layers`` MLPs over separate weights (as a decode step does: L2 holds no layer's weights
from the previous one), median of 5 timings of 20 replays; also each arm's largest error against a
float64 MLP of the same inputs.

    python -m bench.decode_mlp                                   # 0.5B MLP (896 -> 4864), 1-64 rows
    python -m bench.decode_mlp --dims 1536 8960 --layers 28      # 1.5B
    python -m bench.decode_mlp --sweep-splits 4 5 8              # also the kernels at other down splits
    python -m bench.decode_mlp --dims 1152 6912 --layers 26 --gelu  # Gemma 3 1B's GeGLU MLP

With ``--gelu`` (GeGLU: the tanh GELU in place of SiLU) the baseline is what the engine ran before its
kernels took GeGLU: cuBLAS gate/up, the eager GELU and multiply, cuBLAS down; ``halves_us`` is also timed
(cuBLAS gate/up, the fused activation kernel over the halves, cuBLAS down: the engine's path above
``MAX_ROWS``).

Prints one JSON object: ``figure`` the mean over row counts of the kernels' us per layer, ``baseline`` the
cuBLAS arm's, ``ratio`` = baseline / figure (> 1: the kernels faster), then per case both. CUDA only.
"""

from __future__ import annotations

import functools
import statistics
import sys

import torch
import torch.nn.functional as F

from areno.models import decode_mlp, fused_linear, fused_ops
from areno.models.eager_ops import eager_glu
from bench._common import emit, graphed_us, headline, parser, ratio


def make_case(rows: int, d: int, i: int, layers: int, seed: int = 0) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev, dt = "cuda", torch.bfloat16
    return {
        "x": torch.randn(rows, d, device=dev, dtype=dt, generator=g),
        "res": torch.randn(rows, d, device=dev, dtype=dt, generator=g),
        "norm": torch.randn(d, device=dev, dtype=dt, generator=g),
        "weights": [
            (
                torch.randn(2 * i, d, device=dev, dtype=dt, generator=g) / d**0.5,
                torch.randn(d, i, device=dev, dtype=dt, generator=g) / i**0.5,
            )
            for _ in range(layers)
        ],
    }


def kernels_arm(
    case: dict, w_gu: torch.Tensor, w_d: torch.Tensor, splits=None, always=False, gelu=False
) -> torch.Tensor:
    """The engine's MLP: the kernels where ``decode_mlp.serves`` (or ``always``), else the cuBLAS arm."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if not (always or decode_mlp.serves(case["x"].shape[0], w_gu.shape[0] // 2, sms)):
        return cublas_arm(case, w_gu, w_d, gelu=gelu)
    parts = decode_mlp.down_parts(decode_mlp.gate_up_glu(case["x"], w_gu, gelu=gelu), w_d, splits)
    return fused_ops.add_parts_rms_norm(case["res"], parts, case["norm"], 1e-6)[0]


def cublas_arm(case: dict, w_gu: torch.Tensor, w_d: torch.Tensor, gelu=False) -> torch.Tensor:
    out = F.linear(fused_linear.glu_halves(F.linear(case["x"], w_gu), gelu=gelu), w_d)
    return fused_ops.add_rms_norm(case["res"], out, case["norm"], 1e-6)[0]


def eager_act_arm(case: dict, w_gu: torch.Tensor, w_d: torch.Tensor, gelu=False) -> torch.Tensor:
    """cuBLAS GEMMs around the eager activation and multiply (GeGLU's path before its kernels)."""
    out = F.linear(eager_glu(*F.linear(case["x"], w_gu).chunk(2, dim=-1), gelu=gelu), w_d)
    return fused_ops.add_rms_norm(case["res"], out, case["norm"], 1e-6)[0]


def time_per_layer(case: dict, arm) -> float:
    """Microseconds per layer: a CUDA graph of one MLP per layer, median of 5 x 20 replays."""

    def step() -> None:
        for w_gu, w_d in case["weights"]:
            arm(case, w_gu, w_d)

    return graphed_us(step, len(case["weights"]))


def error(case: dict, arm, gelu=False) -> float:
    """Largest |arm - float64| of the first layer's residual sum, over the float64 value's largest magnitude."""
    w_gu, w_d = case["weights"][0]
    gate, up = F.linear(case["x"].double(), w_gu.double()).chunk(2, dim=-1)
    ref = case["res"].double() + F.linear(eager_glu(gate, up, gelu=gelu), w_d.double())
    return (arm(case, w_gu, w_d).double() - ref).abs().max().item() / ref.abs().max().item()


def main(argv: list[str] | None = None) -> dict:
    p = parser("decode_mlp", __doc__)
    p.add_argument("--dims", type=int, nargs=2, default=[896, 4864], metavar=("D", "I"))
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64], help="decode rows (at most MAX_ROWS)")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--sweep-splits", type=int, nargs="*", default=[], help="also time the kernels at these down splits")
    p.add_argument("--gelu", action="store_true", help="GeGLU (the tanh GELU, Gemma 3) in place of SwiGLU")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or not fused_ops.available():
        p.error("the decode MLP kernels run on CUDA with triton: run this on a GPU machine")
    if max(args.rows) > decode_mlp.MAX_ROWS:
        p.error(f"--rows above decode_mlp.MAX_ROWS={decode_mlp.MAX_ROWS} keep cuBLAS in the engine: nothing to compare")
    if not (fused_ops.enable() and fused_linear.enable() and decode_mlp.enable()):
        p.error("a fused kernel's self-check failed on this machine (see the warning above)")
    d, i = args.dims
    gelu = args.gelu
    kernels = functools.partial(kernels_arm, gelu=gelu)
    baseline_arm = functools.partial(eager_act_arm if gelu else cublas_arm, gelu=gelu)
    cases = []
    with torch.no_grad():
        for rows in args.rows:
            case = make_case(rows, d, i, args.layers)
            row = {
                "rows": rows,
                "kernels": decode_mlp.serves(rows, i, torch.cuda.get_device_properties(0).multi_processor_count),
                "us": time_per_layer(case, kernels),
                "cublas_us": time_per_layer(case, baseline_arm),
                "rel_error": error(case, kernels, gelu),
                "cublas_rel_error": error(case, baseline_arm, gelu),
            }
            if gelu:
                row["halves_us"] = time_per_layer(case, functools.partial(cublas_arm, gelu=True))
            for splits in args.sweep_splits:  # the kernels whether or not the engine takes them here
                arm = functools.partial(kernels_arm, splits=splits, always=True, gelu=gelu)
                row.setdefault("sweep", {})[f"s{splits}"] = time_per_layer(case, arm)
            print(f"rows {rows}: {row['us']} us ({row['cublas_us']} cuBLAS) {row.get('sweep', '')}", file=sys.stderr)
            cases.append(row)
            del case
    figure = statistics.mean(c["us"] for c in cases)
    baseline = statistics.mean(c["cublas_us"] for c in cases)
    head = headline(
        f"decode MLP ({'GeGLU' if gelu else 'SwiGLU'}) + residual norm, us per layer (D {d}, I {i}, mean over row counts)",
        round(figure, 2),
        (
            "cuBLAS gate/up, the eager GELU and multiply, cuBLAS down, the add + RMSNorm kernel; same process"
            if gelu
            else "cuBLAS gate/up, the SiLU-and-multiply kernel, cuBLAS down, the add + RMSNorm kernel; same process"
        ),
        round(baseline, 2),
        ratio(baseline, figure),
        "baseline us / kernels us (>1: the kernels faster)",
    )
    details = {
        "dims": [d, i],
        "gelu": gelu,
        "layers": args.layers,
        "down_splits": decode_mlp.down_splits(d, torch.cuda.get_device_properties(0).multi_processor_count),
        "cases": cases,
        "device": torch.cuda.get_device_name(0),
    }
    return emit("decode_mlp", head, details)


if __name__ == "__main__":
    main()
