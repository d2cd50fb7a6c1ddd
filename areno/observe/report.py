"""``areno report RUN_DIR [RUN_DIR ...] [-o out.html]``: one self-contained HTML page of a run.

Plots whichever of these a run logged — reward, held-out accuracy, loss, KL, clip fractions,
staleness, throughput, the rollout/train/sync time split and policy-sync bandwidth — then every
other metric in small multiples, a summary table, and the recorded agent sessions. Several run
directories overlay on the same axes (one colour per run). Images are PNGs inlined as base64, so
the file can be mailed or attached to an issue; ``--png-dir`` also writes them as files.

Matplotlib is driven through its object API on the Agg canvas: no pyplot global state, no display.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areno.errors import DataError, UserError
from areno.observe.metrics import (
    METRICS_FILENAME,
    MODEL_REWARD_KEY,
    POLICY_SYNC_PREFIX,
    REWARD_KEY,
    SCORED_REWARD_KEY,
    read_metrics,
)
from areno.observe.session import format_session, load_sessions
from areno.observe.trace import MERGED_FILENAME, TRACES_DIRNAME, load_trace_events, span_stats

MAX_OTHER_PANELS = 60
MAX_SESSIONS_SHOWN = 100
TIME_SPLIT_EXCLUDE = ("timing/step_s", "timing/total_s")


@dataclass(kw_only=True)
class Run:
    """One run directory's data, as the report needs it."""

    name: str
    """Label in legends (the directory name, made unique)."""
    path: Path
    records: list[dict[str, Any]]
    """metrics.jsonl records, in file order."""
    sessions: list[dict[str, Any]] = field(default_factory=list)
    trace: Path | None = None
    """The merged trace file, or the per-process trace folder when not merged yet."""

    def keys(self) -> set[str]:
        return {k for r in self.records for k in r if k not in ("step", "time")}

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of a metric; several records at one step keep the last value."""
        by_step: dict[int, float] = {}
        for r in self.records:
            value = r.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                by_step[int(r["step"])] = float(value)
        steps = sorted(by_step)
        return steps, [by_step[s] for s in steps]


def load_run(run_dir: Path, name: str | None = None) -> Run:
    run_dir = Path(run_dir)
    if not (run_dir / METRICS_FILENAME).is_file():
        raise DataError(f"{run_dir} has no {METRICS_FILENAME}: pass a run directory")
    trace: Path | None = None
    if (run_dir / MERGED_FILENAME).is_file():
        trace = run_dir / MERGED_FILENAME
    elif (run_dir / TRACES_DIRNAME).is_dir():
        trace = run_dir / TRACES_DIRNAME
    return Run(
        name=name or run_dir.resolve().name,
        path=run_dir,
        records=read_metrics(run_dir),
        sessions=load_sessions(run_dir),
        trace=trace,
    )


def _unique_names(paths: list[Path]) -> list[str]:
    names = [p.resolve().name for p in paths]
    if len(set(names)) == len(names):
        return names
    # same leaf name (runs/a/seed0, runs/b/seed0): use the parent too, then an index
    names = [f"{p.resolve().parent.name}/{p.resolve().name}" for p in paths]
    if len(set(names)) == len(names):
        return names
    return [f"{n} #{i}" for i, n in enumerate(names)]


# ---- which metrics go in which panel ------------------------------------------------------------

Selector = Callable[[set[str]], list[str]]


def _match(predicate: Callable[[str], bool]) -> Selector:
    return lambda keys: sorted(k for k in keys if predicate(k))


def _eval_key(k: str) -> bool:
    """Held-out fractions only (accuracy, pass@k, a role's pair accuracy): a token count or a loss on the
    same axis would flatten the 0-1 curves."""
    leaf = _leaf(k)
    return k.startswith(("eval/", "test/")) and (leaf == "accuracy" or leaf.startswith("pass@"))


def _time_split_key(k: str) -> bool:
    return k.startswith("timing/") and k.endswith("_s") and not k.endswith("_per_s") and k not in TIME_SPLIT_EXCLUDE


@dataclass(frozen=True)
class Panel:
    title: str
    ylabel: str
    select: Selector
    stacked: bool = False
    """Stack the series (a time split); only with a single run."""


def _leaf(k: str) -> str:
    return k.rsplit("/", 1)[-1]


def _loss_key(k: str) -> bool:
    leaf = _leaf(k)
    return k.startswith("train/") and (leaf in ("loss", "nll") or leaf.endswith("_loss"))


def _kl_key(k: str) -> bool:
    words = _leaf(k).split("_")
    return k.startswith("train/") and "kl" in words and "coef" not in words


PANELS: tuple[Panel, ...] = (
    Panel(
        "Reward",
        "reward",
        # the batch's reward means: the sandbox's counters and call times are not rewards
        _match(
            lambda k: (
                k in (SCORED_REWARD_KEY, MODEL_REWARD_KEY, "train/reward_model/score_mean")
                or k.startswith("rollout/reward/")  # the figures a reward function returns beside its score
                or (k.startswith("rollout/") and _leaf(k).startswith("reward") and _leaf(k).endswith("_mean"))
            )
        ),
    ),
    Panel("Held-out accuracy", "accuracy", _match(_eval_key)),
    Panel("Loss", "loss", _match(_loss_key)),
    Panel("KL", "KL", _match(_kl_key)),
    Panel(
        "Clip and mask fractions",
        "fraction of loss tokens",
        # what the loss's clips, the behaviour weight's bounds and the off-policy mask touched (clip_frac,
        # behave_over_cap_frac, off_policy_mask_frac, a critic's value_clip_frac, ...)
        _match(lambda k: k.startswith("train/") and _leaf(k).endswith("_frac")),
    ),
    Panel("Gradient norm", "norm", _match(lambda k: k.startswith("train/") and _leaf(k) == "grad_norm")),
    Panel("Staleness", "versions behind", _match(lambda k: k.startswith("rollout/staleness"))),
    Panel("Throughput", "tokens / s", _match(lambda k: k.endswith("tokens_per_s"))),
    Panel("Time split per step", "seconds", _match(_time_split_key), stacked=True),
    Panel("Policy-sync bandwidth", "GB/s", _match(lambda k: k == "policy_sync_throughput_gbps")),
    Panel("Policy-sync time", "seconds", _match(lambda k: k.startswith(POLICY_SYNC_PREFIX) and k.endswith("_time_s"))),
)


# ---- plotting ------------------------------------------------------------------------------------


def _ema(values: list[float], alpha: float) -> list[float]:
    out, acc = [], None
    for v in values:
        acc = v if acc is None else alpha * acc + (1 - alpha) * v
        out.append(acc)
    return out


def _new_figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
LINESTYLES = ("-", "--", ":", "-.")


def _plot_lines(ax, runs: list[Run], keys_per_run: list[list[str]], smooth: float) -> None:
    multi_run = len(runs) > 1
    all_keys = sorted({k for keys in keys_per_run for k in keys})
    for ri, (run, keys) in enumerate(zip(runs, keys_per_run)):
        for k in keys:
            ki = all_keys.index(k)
            steps, values = run.series(k)
            if not steps:
                continue
            color = COLORS[ri % len(COLORS)] if multi_run else COLORS[ki % len(COLORS)]
            style = LINESTYLES[ki % len(LINESTYLES)] if multi_run else "-"
            label = f"{run.name}: {k}" if multi_run and len(all_keys) > 1 else (run.name if multi_run else k)
            marker = "o" if len(steps) <= 30 else None
            if smooth > 0 and len(steps) > 2:
                ax.plot(steps, values, color=color, alpha=0.25, linestyle=style, linewidth=1)
                ax.plot(steps, _ema(values, smooth), color=color, linestyle=style, label=label)
            else:
                ax.plot(steps, values, color=color, linestyle=style, marker=marker, markersize=3, label=label)


def _plot_stacked(ax, run: Run, keys: list[str]) -> None:
    steps = sorted({s for k in keys for s in run.series(k)[0]})
    stacks = []
    for k in keys:
        by_step = dict(zip(*run.series(k)))
        stacks.append([by_step.get(s, 0.0) for s in steps])
    ax.stackplot(steps, *stacks, labels=keys, colors=COLORS[: len(keys)], alpha=0.8)


def render_panel(panel: Panel, runs: list[Run], *, smooth: float = 0.0) -> bytes | None:
    """PNG bytes of one panel, or None when no run has any of its metrics."""
    keys_per_run = [panel.select(run.keys()) for run in runs]
    if not any(keys_per_run):
        return None
    fig = _new_figure(6.4, 3.4)
    ax = fig.add_subplot()
    with_data = [(r, k) for r, k in zip(runs, keys_per_run) if k]
    if panel.stacked and len(with_data) == 1:
        _plot_stacked(ax, *with_data[0])
    else:
        _plot_lines(ax, runs, keys_per_run, smooth)
    ax.set_title(panel.title)
    ax.set_xlabel("step")
    ax.set_ylabel(panel.ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small", loc="best")
    return _png(fig)


def render_small_multiples(keys: list[str], runs: list[Run], *, smooth: float = 0.0) -> bytes | None:
    """One small plot per metric, all runs overlaid."""
    if not keys:
        return None
    cols = 4
    rows = math.ceil(len(keys) / cols)
    fig = _new_figure(3.2 * cols, 2.3 * rows)
    for i, key in enumerate(keys):
        ax = fig.add_subplot(rows, cols, i + 1)
        _plot_lines(ax, runs, [[key] if key in r.keys() else [] for r in runs], smooth)
        ax.set_title(key, fontsize="small")
        ax.tick_params(labelsize="x-small")
        ax.grid(True, alpha=0.3)
    if len(runs) > 1:
        from matplotlib.lines import Line2D

        handles = [Line2D([], [], color=COLORS[i % len(COLORS)], label=r.name) for i, r in enumerate(runs)]
        fig.legend(handles=handles, loc="outside upper center", ncols=min(len(runs), 6))
    return _png(fig)


# ---- HTML ----------------------------------------------------------------------------------------


def _fmt(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.4g}"
    return html.escape(str(value))


def format_duration(seconds: float) -> str:
    """``H:MM:SS``, with days before it from 24 hours on (``2d 03:04:05``)."""
    days, rem = divmod(int(max(seconds, 0)), 86400)
    hours, rem = divmod(rem, 3600)
    clock = f"{hours:02d}:{rem // 60:02d}:{rem % 60:02d}"
    return f"{days}d {clock}" if days else clock


SUMMARY_NOTE = (
    "elapsed: from the first to the last record of metrics.jsonl, including any time between a stop "
    "and its resume; step time: the steps' logged time split (rollout, train, sync), each step once, "
    "without evaluation, checkpoints and start-up."
)


def summarize(run: Run) -> dict[str, Any]:
    """The numbers in the report's summary table (``SUMMARY_NOTE`` says what its times mean)."""
    steps = [int(r["step"]) for r in run.records]
    times = [r["time"] for r in run.records if isinstance(r.get("time"), (int, float))]
    # per step (the last record of a step, as plotted): never the time between a stop and its resume
    split = [sum(run.series(k)[1]) for k in run.keys() if _time_split_key(k)]

    def last(key: str) -> float | None:
        values = run.series(key)[1]
        return values[-1] if values else None

    def mean(key: str) -> float | None:
        values = run.series(key)[1]
        return sum(values) / len(values) if values else None

    def best(key: str) -> float | None:
        values = run.series(key)[1]
        return max(values) if values else None

    rewards = run.series(MODEL_REWARD_KEY)[1] or run.series(SCORED_REWARD_KEY)[1] or run.series(REWARD_KEY)[1]
    return {
        "run": run.name,
        "steps": max(steps) if steps else 0,
        "elapsed": format_duration(max(times) - min(times)) if times else None,
        "step time": format_duration(sum(split)) if split else None,
        "first reward": rewards[0] if rewards else None,
        "last reward": rewards[-1] if rewards else None,
        "best eval/accuracy": best("eval/accuracy"),
        "last eval/accuracy": last("eval/accuracy"),
        "mean tokens/s": mean("timing/tokens_per_s"),
        "mean sync GB/s": mean("policy_sync_throughput_gbps"),
        "sessions": len(run.sessions),
    }


CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1400px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 1.8em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 0.9em; }
td, th { border: 1px solid #ccc; padding: 3px 8px; text-align: right; }
th { background: #f4f4f4; } td:first-child, th:first-child { text-align: left; }
.grid { display: flex; flex-wrap: wrap; gap: 8px; }
.grid img { width: 640px; max-width: 100%; }
img.wide { max-width: 100%; }
details { margin: 2px 0; } summary { cursor: pointer; font-family: monospace; }
pre { background: #f8f8f8; padding: 8px; overflow-x: auto; font-size: 0.85em; }
.muted { color: #777; font-size: 0.9em; }
"""

SESSION_FILTER_JS = """
function filterSessions(box) {
  const q = box.value.toLowerCase();
  for (const d of document.querySelectorAll('details.session')) {
    d.style.display = d.textContent.toLowerCase().includes(q) ? '' : 'none';
  }
}
"""


def _img(png: bytes, alt: str, cls: str = "") -> str:
    data = base64.b64encode(png).decode("ascii")
    cls_attr = f' class="{cls}"' if cls else ""
    return f'<img{cls_attr} alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _sessions_html(runs: list[Run]) -> str:
    parts = []
    for run in runs:
        if not run.sessions:
            continue
        shown = run.sessions[-MAX_SESSIONS_SHOWN:]
        rewards = [s["reward"] for s in run.sessions if s.get("reward") is not None]
        errors = sum(s.get("status") == "error" for s in run.sessions)
        mean_reward = f"{sum(rewards) / len(rewards):.3g}" if rewards else "–"
        parts.append(
            f"<h3>{html.escape(run.name)}</h3><p class='muted'>{len(run.sessions)} sessions, "
            f"mean reward {mean_reward}, {errors} errors; newest {len(shown)} shown "
            f"(all: <code>areno sessions {html.escape(str(run.path))}</code>)</p>"
        )
        for s in reversed(shown):
            text = format_session(s)
            head, _, body = text.partition("\n")
            parts.append(
                f"<details class='session'><summary>{html.escape(head)}</summary>"
                f"<pre>{html.escape(body)}</pre></details>"
            )
    if not parts:
        return ""
    return (
        "<h2>Agent sessions</h2><input placeholder='filter sessions (text, tool, reward…)' "
        "oninput='filterSessions(this)' size='40'>" + "".join(parts)
    )


def _span_table(run: Run, top: int = 20) -> str:
    rows = span_stats(load_trace_events(run.path))[:top]
    if not rows:
        return ""
    cols = ("cat", "name", "count", "total_ms", "mean_ms", "max_ms")
    return (
        f"<h3>{html.escape(run.name)}: where traced time went (top {len(rows)} spans)</h3>"
        "<table><tr>"
        + "".join(f"<th>{c}</th>" for c in cols)
        + "</tr>"
        + "".join("<tr>" + "".join(f"<td>{_fmt(r[c])}</td>" for c in cols) + "</tr>" for r in rows)
        + "</table>"
    )


def build_report(runs: list[Run], *, smooth: float = 0.0, png_dir: Path | None = None) -> str:
    """The report's HTML for ``runs`` (and PNG files in ``png_dir`` when given)."""
    if not runs:
        raise ValueError("build_report needs at least one run")
    figures: list[tuple[str, bytes]] = []
    used: set[str] = set()
    for panel in PANELS:
        png = render_panel(panel, runs, smooth=smooth)
        for run in runs:
            used.update(panel.select(run.keys()))
        if png is not None:
            figures.append((panel.title, png))
    other_keys = sorted(set().union(*(r.keys() for r in runs)) - used)
    truncated = len(other_keys) > MAX_OTHER_PANELS
    other_png = render_small_multiples(other_keys[:MAX_OTHER_PANELS], runs, smooth=smooth)

    if png_dir is not None:
        png_dir.mkdir(parents=True, exist_ok=True)
        for title, png in figures:
            (png_dir / f"{title.lower().replace(' ', '_').replace('/', '_')}.png").write_bytes(png)
        if other_png is not None:
            (png_dir / "other_metrics.png").write_bytes(other_png)

    summaries = [summarize(r) for r in runs]
    columns = list(summaries[0])
    table = (
        "<table><tr>"
        + "".join(f"<th>{html.escape(c)}</th>" for c in columns)
        + "</tr>"
        + "".join("<tr>" + "".join(f"<td>{_fmt(s[c])}</td>" for c in columns) + "</tr>" for s in summaries)
        + "</table>"
    )
    traces = [
        f"<li>{html.escape(r.name)}: <code>{html.escape(str(r.trace))}</code>"
        + (
            ""
            if r.trace is None or r.trace.name == MERGED_FILENAME
            else f" (merge with <code>areno trace {html.escape(str(r.path))}</code>)"
        )
        + "</li>"
        for r in runs
        if r.trace is not None
    ]
    title = "areno report: " + ", ".join(r.name for r in runs)
    body = [
        f"<h1>{html.escape(title)}</h1>",
        f"<p class='muted'>generated {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())} from "
        + ", ".join(f"<code>{html.escape(str(r.path))}</code>" for r in runs)
        + (f"; EMA smoothing {smooth}" if smooth else "")
        + "</p>",
        "<h2>Summary</h2>",
        table,
        f"<p class='muted'>{html.escape(SUMMARY_NOTE)}</p>",
        "<h2>Training curves</h2>",
        "<div class='grid'>" + "".join(_img(png, t) for t, png in figures) + "</div>"
        if figures
        else "<p>No known metrics in these runs.</p>",
    ]
    if other_png is not None:
        note = f" (first {MAX_OTHER_PANELS} of {len(other_keys)})" if truncated else ""
        body += [f"<h2>Other metrics{note}</h2>", _img(other_png, "other metrics", "wide")]
    body.append(_sessions_html(runs))
    if traces:
        body += [
            "<h2>Performance traces</h2><p>Open in "
            "<a href='https://ui.perfetto.dev'>ui.perfetto.dev</a> or chrome://tracing:</p>",
            "<ul>" + "".join(traces) + "</ul>",
        ]
        body += [_span_table(r) for r in runs if r.trace is not None]
    return (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{CSS}</style>"
        f"<script>{SESSION_FILTER_JS}</script></head><body>" + "\n".join(body) + "</body></html>\n"
    )


def write_report(
    run_dirs: list[Path], out: Path | None = None, *, smooth: float = 0.0, png_dir: Path | None = None
) -> Path:
    """Render ``run_dirs`` into one HTML file; returns its path.

    The default path is ``RUN_DIR/report.html`` for one run and ``./report.html`` for several.
    """
    if not run_dirs:
        raise ValueError("areno report needs at least one run directory")
    if not 0 <= smooth < 1:
        raise UserError(f"--smooth must be in [0, 1), got {smooth}")
    paths = [Path(p) for p in run_dirs]
    runs = [load_run(p, name) for p, name in zip(paths, _unique_names(paths))]
    if out is None:
        out = paths[0] / "report.html" if len(paths) == 1 else Path("report.html")
    # the directories made before the plots are drawn: a path that cannot be written fails first
    _make_dir(out.parent, f"cannot write the report to {out}", "pass --out a file in a writable directory")
    if png_dir is not None:
        _make_dir(png_dir, f"cannot write the plots to {png_dir}", "pass --png-dir a writable directory")
    text = build_report(runs, smooth=smooth, png_dir=png_dir)
    try:
        out.write_text(text, encoding="utf-8")
    except OSError as exc:  # e.g. a directory of /proc, a read-only mount, a name that is a directory
        raise UserError(
            f"cannot write the report to {out} ({exc.strerror or exc}): pass --out a file in a writable directory"
        ) from None
    return out


def _make_dir(path: Path, what: str, fix: str) -> None:
    """``path`` and its parents, or a one-line :class:`UserError` ``"<what> (<reason>): <fix>"``."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError as exc:  # mkdir's word for a file where the directory should be
        raise UserError(f"{what} ({exc.filename} is a file, not a directory): {fix}") from None
    except OSError as exc:
        raise UserError(f"{what} ({exc.strerror or exc}): {fix}") from None


def main(argv: list[str] | None = None) -> int:
    """``areno report RUN_DIR [RUN_DIR ...] [-o out.html]``: plots of one or several runs."""
    parser = argparse.ArgumentParser(prog="areno report", description=main.__doc__)
    parser.add_argument("run_dirs", nargs="+", type=Path, help="run directories (metrics.jsonl)")
    parser.add_argument(
        "-o",
        "--out",
        type=Path,
        default=None,
        help="HTML file (default RUN_DIR/report.html, or ./report.html for several)",
    )
    parser.add_argument("--png-dir", type=Path, default=None, help="also write each plot as PNG")
    parser.add_argument(
        "--smooth", type=float, default=0.0, help="EMA smoothing factor in [0, 1) drawn over the raw curves"
    )
    ns = parser.parse_args(argv)
    out = write_report(ns.run_dirs, ns.out, smooth=ns.smooth, png_dir=ns.png_dir)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
