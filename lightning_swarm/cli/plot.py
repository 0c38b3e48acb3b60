"""``lightning-swarm plot``: a run's loss, per-stage throughput and peers (CSVLogger metrics.csv) as a PNG."""

from __future__ import annotations

import argparse
import csv
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from lightning_swarm.cli.common import CLIError

THROUGHPUT = re.compile(r"^swarm/stage(\d+)_throughput$")
STAGE_PEERS = re.compile(r"^swarm/stage(\d+)_peers$")
TIME_COLUMNS = ("time", "wall_time", "swarm/time", "timestamp")
EVENTS = {  # counter column: (label, colour, line style)
    "swarm/failovers": ("failover", "tab:red", "--"),
    "swarm/rebalances": ("rebalance", "tab:green", ":"),
}


def find_metrics(paths: Sequence[str]) -> list:
    """metrics.csv files: the paths given, and every metrics.csv under the directories given."""
    found = []
    for name in paths:
        path = Path(name)
        if path.is_dir():
            inside = sorted(path.rglob("metrics.csv"))
            if not inside:
                raise CLIError(f"no metrics.csv under {path} (a Lightning CSVLogger writes one per run)")
            found += inside
        elif path.is_file():
            found.append(path)
        else:
            raise CLIError(f"{path}: no such file or directory")
    return found


def load_metrics(path: Path) -> dict:
    """Columns of a CSVLogger metrics.csv as lists of floats (NaN where a row has no value)."""
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise CLIError(f"cannot read {path}: {e}") from None
    if not rows:
        raise CLIError(f"{path}: no rows (is it a metrics.csv written by Lightning's CSVLogger?)")

    def number(text: Optional[str]) -> float:
        try:
            return float(text)
        except (TypeError, ValueError):
            return math.nan

    return {column: [number(row.get(column)) for row in rows] for column in rows[0] if column}


def series(columns: dict, x: list, name: str) -> tuple:
    """The (x, y) points where column ``name`` has a value."""
    pairs = [(a, b) for a, b in zip(x, columns.get(name, [])) if not (math.isnan(a) or math.isnan(b))]
    return [a for a, _ in pairs], [b for _, b in pairs]


def event_points(columns: dict, x: list, name: str) -> list:
    """x where a cumulative counter rises above every value before it."""
    xs, ys = series(columns, x, name)
    points, highest = [], None
    for a, b in zip(xs, ys):
        if highest is not None and b > highest:
            points.append(a)
        highest = b if highest is None else max(highest, b)
    return points


def stage_changes(columns: dict, x: list) -> list:
    """x where this peer's stage (``swarm/stage``) changed: a rebalance, when no rebalance counter was logged."""
    xs, ys = series(columns, x, "swarm/stage")
    return [xs[i] for i in range(1, len(ys)) if ys[i] != ys[i - 1]]


def x_axis(columns: dict, path: Path, mode: str) -> tuple:
    if mode == "step":
        if "step" not in columns:
            raise CLIError(f"{path}: no 'step' column (is it a metrics.csv written by Lightning's CSVLogger?)")
        return columns["step"], "step"
    for name in TIME_COLUMNS:
        values = [v for v in columns.get(name, []) if not math.isnan(v)]
        if values:
            start = min(values)
            return [v - start for v in columns[name]], "seconds"
    raise CLIError(f"{path}: no wall-time column ({', '.join(TIME_COLUMNS)}); use --x step")


def plot_metrics(files: Sequence[Path], out: Path, mode: str = "step") -> list:
    """Draw loss, per-stage throughput and peer counts against step (or time), events marked; returns warnings."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CLIError("plot needs matplotlib: pip install 'lightning_swarm[plot]'") from None

    from matplotlib.ticker import MaxNLocator

    runs = [(path, load_metrics(path)) for path in files]
    labels = _run_labels(files)
    fig, (ax_loss, ax_thr, ax_peers) = plt.subplots(3, 1, figsize=(10, 10), sharex=True)
    drawn = {ax_loss: False, ax_thr: False, ax_peers: False}
    styles = ("-", "--", ":", "-.")  # one per run; swarm-wide series keep one colour per stage across runs
    stage_colour = plt.get_cmap("tab10")
    events: dict = {name: [] for name in EVENTS}
    xlabel = "step"
    for i, ((path, columns), run) in enumerate(zip(runs, labels)):
        x, xlabel = x_axis(columns, path, mode)
        prefix, style = (f"{run}: " if len(runs) > 1 else ""), styles[i % len(styles)]
        for name in sorted(c for c in columns if "loss" in c and not c.startswith("swarm/")):
            xs, ys = series(columns, x, name)
            if xs:
                ax_loss.plot(xs, ys, label=prefix + name, marker="." if len(xs) < 30 else None)
                drawn[ax_loss] = True
        for pattern, ax in ((THROUGHPUT, ax_thr), (STAGE_PEERS, ax_peers)):
            stages = sorted((int(m.group(1)), c) for c in columns if (m := pattern.match(c)))
            for k, name in stages:
                xs, ys = series(columns, x, name)
                if xs:
                    ax.plot(
                        xs,
                        ys,
                        label=f"{prefix}stage {k}",
                        color=stage_colour(k % 10),
                        linestyle=style,
                        drawstyle="steps-post",
                    )
                    drawn[ax] = True
        xs, ys = series(columns, x, "swarm/peers")
        if xs:
            ax_peers.plot(
                xs, ys, label=prefix + "all peers", color="black", linestyle=style, linewidth=1, drawstyle="steps-post"
            )
            drawn[ax_peers] = True
        for name in EVENTS:
            events[name] += event_points(columns, x, name)
        if "swarm/rebalances" not in columns:
            events["swarm/rebalances"] += stage_changes(columns, x)
    for name, points in events.items():  # drawn last, so that their legend entries come last
        label, colour, style = EVENTS[name]
        for j, a in enumerate(sorted(set(points))):
            for ax in (ax_loss, ax_thr, ax_peers):
                ax.axvline(
                    a,
                    color=colour,
                    linestyle=style,
                    linewidth=1,
                    alpha=0.8,
                    label=label if ax is ax_loss and j == 0 else None,
                )
    marked = any(events.values())
    ax_peers.yaxis.set_major_locator(MaxNLocator(integer=True))

    warnings = []
    for ax, title, ylabel in (
        (ax_loss, "loss", "loss"),
        (ax_thr, "throughput per stage", "samples/s"),
        (ax_peers, "peers per stage", "peers"),
    ):
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if drawn[ax] or (ax is ax_loss and marked):
            ax.legend(loc="best", fontsize="small")
        if not drawn[ax]:
            ax.text(0.5, 0.5, "not logged", transform=ax.transAxes, ha="center", va="center", color="grey")
            warnings.append(f"no {title} in the metrics")
    ax_peers.set_xlabel(xlabel)
    fig.suptitle(", ".join(labels) if len(labels) <= 3 else f"{len(labels)} runs")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return warnings


def _run_labels(files: Sequence[Path]) -> list:
    """Short names for runs: each metrics.csv's directory, relative to their common ancestor."""
    parents = [f.resolve().parent for f in files]
    if len(parents) == 1:
        return [parents[0].name or str(parents[0])]
    common = Path(os.path.commonpath(parents))
    return [str(p.relative_to(common)) if p != common else p.name for p in parents]


def cmd_plot(args: argparse.Namespace) -> int:
    files = find_metrics(args.paths)
    out = Path(args.output)
    for warning in plot_metrics(files, out, args.x):
        print(f"lightning-swarm: {warning}", file=sys.stderr)
    print(f"wrote {out} from {len(files)} metrics file(s)")
    return 0


def add_parser(commands: Any) -> None:
    """Add this command to ``lightning-swarm``'s subcommands."""
    plot = commands.add_parser(
        "plot",
        help="draw a run's loss, per-stage throughput and peers (from CSVLogger metrics.csv) to a PNG",
        description="Plot CSVLogger metrics.csv files (one per peer) with failovers and rebalances marked.",
    )
    plot.add_argument("paths", nargs="+", metavar="PATH", help="metrics.csv files, or log directories holding them")
    plot.add_argument("-o", "--output", default="swarm.png", help="the PNG to write (default swarm.png)")
    plot.add_argument("--x", choices=["step", "time"], default="step", help="x axis: step (default) or wall time")
    plot.set_defaults(handler=cmd_plot)
