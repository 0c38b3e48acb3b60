"""Draws the benchmark results: one panel per JSON file that the benchmark scripts saved in benchmarks/results/
(report.save_data), skipping those not there; a file this script does not know how to draw is left out, with a note.

    python benchmarks/plot.py                                      # benchmarks/results/*.json -> benchmarks/results.png
    python benchmarks/plot.py --data /tmp/results --out /tmp/x.png
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Callable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import DATA  # noqa: E402

PNG = Path(__file__).resolve().parent / "results.png"


def convergence(ax: Axes, data: dict) -> None:
    """Validation loss against samples, plain training and each swarm."""
    for label, points in data["curves"].items():
        ax.plot(points["samples"], points["val_loss"], marker=".", label=label)
    updates = "synchronous" if data.get("synchronous") else "delayed"
    ax.set(title=f"Convergence, {updates} updates (d_model {data['d_model']})", xlabel="samples", ylabel="loss")


def ratios_to_plain(
    ax: Axes,
    rows: list[dict],
    keys: Callable[[dict], list[str]],
    title: str,
    reference: Callable[[dict], float] = lambda row: row["plain"],
    ylabel: str = "throughput / plain",
) -> None:
    """Throughput of each configuration ``keys(row)`` as a ratio of ``reference(row)`` (plain training's), against
    d_model."""
    labels = list(dict.fromkeys(key for row in rows for key in keys(row)))
    for label in labels:
        points = [(row["d_model"], row[label] / reference(row)) for row in rows if label in row]
        ax.plot(*zip(*points), marker="o", label=label)
    ax.axhline(1.0, color="gray", linestyle=":", linewidth=1)
    sizes = sorted({row["d_model"] for row in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(size) for size in sizes])
    ax.minorticks_off()
    ax.set(title=title, xlabel="d_model", ylabel=ylabel)


def swarm_throughput(ax: Axes, rows: list[dict]) -> None:
    """A configuration's samples/s: a number under a key that neither is d_model nor starts with plain or with the
    key of another figure (as "<label> bytes" and other per-configuration extras do)."""

    def keys(row: dict) -> list[str]:
        def derived(key: str) -> bool:
            return any(key.startswith(other + " ") for other in row if other != key)

        picked = (k for k, v in row.items() if _number(v) and k != "d_model" and not k.startswith("plain"))
        return [k for k in picked if not derived(k)]

    ratios_to_plain(
        ax, rows, keys, "Pipeline efficiency", lambda row: min(row["stages_alone"]), "throughput / slowest stage alone"
    )


def baselines(ax: Axes, rows: list[dict]) -> None:
    """The swarm against GPipe and hivemind data-parallel training."""
    methods = ("gpipe", "hivemind", "swarm")
    ratios_to_plain(ax, rows, lambda row: [k for k in methods if _number(row.get(k))], "Swarm against baselines")


def slow_links(ax: Axes, rows: list[dict]) -> None:
    """Throughput against the same codec's uncapped run, per link setting, at the largest d_model."""
    largest = max(row["d_model"] for row in rows)
    rows = [row for row in rows if row["d_model"] == largest and _number(row.get("to_uncapped"))]
    links = sorted({(row["rate_mbit"], row["latency_ms"]) for row in rows}, key=lambda k: (k[0] or math.inf, k[1]))
    codecs = list(dict.fromkeys(row["codec"] for row in rows))
    width = 0.8 / max(1, len(codecs))
    for i, codec in enumerate(codecs):
        values = {(row["rate_mbit"], row["latency_ms"]): row["to_uncapped"] for row in rows if row["codec"] == codec}
        xs = [x for x, link in enumerate(links) if link in values]
        ax.bar([x + i * width for x in xs], [values[links[x]] for x in xs], width, label=codec)
    names = [f"{rate} Mbit/s" if rate else "uncapped" for rate, _ in links]
    names = [name + (f" + {latency:g} ms" if latency else "") for name, (_, latency) in zip(names, links)]
    ax.set_xticks([x + width * (len(codecs) - 1) / 2 for x in range(len(links))], names, rotation=20, fontsize=8)
    ax.set(title=f"Slow links (d_model {largest})", ylabel="throughput / uncapped")


def codec(ax: Axes, rows: list[dict]) -> None:
    """Encode (solid) and decode (dashed) speed of each codec against the tensor's last dimension."""
    devices = {row["device"] for row in rows}
    for name, device in dict.fromkeys((r["codec"], r["device"]) for r in rows):
        mine = sorted((r for r in rows if (r["codec"], r["device"]) == (name, device)), key=lambda r: r["shape"][-1])
        sizes = [r["shape"][-1] for r in mine]
        label = name if len(devices) == 1 else f"{name} ({device})"
        (encode,) = ax.plot(sizes, [r["encode_mb_s"] for r in mine], marker="o", label=label)
        ax.plot(sizes, [r["decode_mb_s"] for r in mine], marker="o", color=encode.get_color(), linestyle="--")
    ax.set_yscale("log")
    ax.set(title="Codecs: encode (solid), decode (dashed)", xlabel="last dimension", ylabel="MB/s of fp32 input")


def delayed_updates(ax: Axes, data: dict) -> None:
    """Synchronous against delayed stage updates, pair by pair (the runs took turns)."""
    pairs = range(len(data["ratios"]))
    width = 0.4
    ax.bar([x - width / 2 for x in pairs], data["synchronous"], width, label="synchronous")
    ax.bar([x + width / 2 for x in pairs], data["delayed"], width, label="delayed")
    ax.set_xticks(list(pairs), [f"pair {x}: {r:.2f}x" for x, r in zip(pairs, data["ratios"])])
    ax.set(title="Delayed updates, 2 peers per stage", ylabel="samples/s")


PANELS: dict[str, Callable[[Axes, Any], None]] = {
    "convergence": convergence,
    "convergence_synchronous": convergence,
    "swarm_throughput": swarm_throughput,
    "baselines": baselines,
    "slow_links": slow_links,
    "codec": codec,
    "delayed_updates": delayed_updates,
}


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def draw(directory: Path, out: Path) -> list[str]:
    """Draw a panel for each known results file in ``directory`` into ``out``; returns the panels drawn."""
    found = {path.stem: path for path in sorted(directory.glob("*.json"))}
    for name in found.keys() - PANELS.keys():
        print(f"note: no panel for {found[name]}: format not known here")
    names = [name for name in PANELS if name in found]
    if not names:
        raise SystemExit(f"no results to plot in {directory}")
    columns = min(2, len(names))
    rows = math.ceil(len(names) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(6.4 * columns, 4.4 * rows), squeeze=False)
    drawn: list[str] = []
    for name in names:
        ax = axes.flat[len(drawn)]  # a panel left out frees its place for the next one
        try:
            PANELS[name](ax, json.loads(found[name].read_text()))
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
            print(f"note: {found[name]} left out: not the format expected ({e!r})")
            ax.clear()
            continue
        if not ax.get_legend_handles_labels()[0]:
            print(f"note: {found[name]} left out: no figures in it")
            ax.clear()
            continue
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        drawn.append(name)
    for ax in axes.flat[len(drawn) :]:
        ax.remove()
    figure.tight_layout()
    figure.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(figure)
    print(f"wrote {out} ({', '.join(drawn) or 'no panel'})")
    return drawn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DATA, help="directory of the results JSON files")
    parser.add_argument("--out", type=Path, default=PNG, help="the PNG to write")
    a = parser.parse_args()
    draw(a.data, a.out)


if __name__ == "__main__":
    main()
