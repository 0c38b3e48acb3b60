"""Convergence: validation loss of the example GPT trained to a fixed number of samples by a 2-stage swarm (8-bit
compression, delayed updates) against plain single-process training, side by side. Target: the swarm's final
validation loss within 3% of plain training's at the same number of samples.

Every run trains examples/gpt.py from the same initialisation (--seed), validating every few steps on the same
validation windows:

- plain single-process training (batch B);
- a swarm of one serve-only peer per stage and one drive-only trainer (batch B, the same data as plain);
- the same swarm with two drive-only trainers of batch B/2 each, on different data (--data-seed 1 and 0), with
  the swarm's target batch size B: the same samples and the same number of optimizer steps of B samples as plain.
  Its losses are those of the data-seed-0 trainer (examples/gpt.py draws validation windows with the data seed, and
  the first windows drawn do not depend on the batch size: twice the batches of half the size are the same
  windows), placed at the samples both trainers together had trained on by then. That trainer starts last, so as
  to end near the end of the run; a gap is always taken against plain training at the same samples.

Each process gets one torch thread; everything runs on this machine (loopback). --synchronous runs the swarms
without delayed updates (a control for their effect).

    python benchmarks/convergence.py            # writes benchmarks/RESULTS.md and benchmarks/results/convergence.json
    python benchmarks/convergence.py --smoke    # seconds-long check that the script works
"""

from __future__ import annotations

import argparse
import bisect
import sys
import tempfile
from pathlib import Path
from typing import Callable

import numpy

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from harness import STAGES, model_args, plain, script_parser, train_on_swarm  # noqa: E402
from report import RESULTS, machine, save_data, table, update_section  # noqa: E402

TARGET_GAP = 0.03


def curve(history: dict, val_every: int, samples: Callable[[int], int]) -> dict:
    """Validation loss against samples: examples/gpt.py validates every ``val_every`` steps during fit, then once
    more after it (the last point, replacing one during fit at the same step). ``samples(step)``: the samples the
    whole swarm had trained on when this trainer ended step ``step``."""
    *during, final = history["val_losses"]
    steps = history["steps"]
    if len(during) != steps // val_every:
        raise RuntimeError(f"{len(during)} validations during {steps} steps, expected one every {val_every}")
    points = [(samples((i + 1) * val_every), loss) for i, loss in enumerate(during)]
    if steps % val_every == 0:
        points.pop()
    points.append((samples(steps), final))
    return {"samples": [s for s, _ in points], "val_loss": [v for _, v in points]}


def at(points: dict, samples: int) -> float:
    """A curve's validation loss at ``samples``, interpolated linearly between its points."""
    return float(numpy.interp(samples, points["samples"], points["val_loss"]))


def main() -> None:
    parser = script_parser(__doc__, "tiny model and a few steps, to check the script")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps of --batch-size samples")
    parser.add_argument("--batch-size", type=int, default=16, help="samples per step (even: two trainers split it)")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--val-every", type=int, default=25, help="steps between validations")
    parser.add_argument("--val-batches", type=int, default=8, help="validation batches of --batch-size samples")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--synchronous", action="store_true", help="swarm stages step without delayed updates")
    parser.add_argument("--out", default=str(RESULTS), help="results file; the JSON goes to results/ beside it")
    a = parser.parse_args()
    if a.smoke:
        a.d_model, a.steps, a.batch_size, a.block_size, a.val_every, a.val_batches = 32, 6, 8, 32, 3, 2
    if a.batch_size % 2:
        parser.error("--batch-size must be even")
    batch, half = a.batch_size, a.batch_size // 2

    def args(size: int, val_batches: int) -> list[str]:
        """Arguments of examples/gpt.py for batches of ``size`` samples."""
        validation = ["--val-every", str(a.val_every), "--val-batches", str(val_batches)]
        return [*model_args(a.d_model, a.steps, size, a.block_size), "--seed", str(a.seed), *validation]

    def in_steps(step: int) -> int:
        """Samples trained on after ``step`` steps of a lone trainer."""
        return step * batch

    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="convergence_") as tmp:
        work = Path(tmp)
        runs["plain"] = curve(plain(args(batch, a.val_batches), work), a.val_every, in_steps)
        report_progress("plain", runs["plain"])
        env = {"SWARM_TARGET_BATCH_SIZE": str(batch), "SWARM_DELAYED_UPDATES": str(not a.synchronous)}
        (history,), _ = train_on_swarm(args(batch, a.val_batches), work, "conv1", env, [["--data-seed", "0"]])
        runs["swarm, 1 trainer"] = curve(history, a.val_every, in_steps)
        report_progress("swarm, 1 trainer", runs["swarm, 1 trainer"])
        # the data-seed-0 trainer starts last, to end near the end of the run
        trainers = [["--data-seed", "1"], ["--data-seed", "0"]]
        histories, _ = train_on_swarm(args(half, 2 * a.val_batches), work, "conv2", env, trainers)

        def in_swarm(step: int) -> int:
            """Samples both trainers had trained on when the last one ended its step ``step``."""
            when = histories[-1]["times"][step - 1]
            return sum(half * bisect.bisect_right(h["times"], when) for h in histories)

        runs["swarm, 2 trainers"] = curve(histories[-1], a.val_every, in_swarm)
        report_progress("swarm, 2 trainers", runs["swarm, 2 trainers"])
    write(runs, a, Path(a.out))


def report_progress(label: str, points: dict) -> None:
    """One line on a finished run."""
    print(f"{label:18s} | {points['samples'][-1]} samples | validation loss {points['val_loss'][-1]:.4f}", flush=True)


def write(runs: dict[str, dict], a: argparse.Namespace, path: Path) -> None:
    """The results section (final losses and gaps, then the curves) and the raw figures for the plot."""
    base = runs["plain"]
    plain_at = {label: at(base, points["samples"][-1]) for label, points in runs.items()}
    gaps = {label: points["val_loss"][-1] / plain_at[label] - 1 for label, points in runs.items() if label != "plain"}
    described = {
        "plain": f"one process, batch {a.batch_size}",
        "swarm, 1 trainer": f"one drive-only trainer, batch {a.batch_size}",
        "swarm, 2 trainers": f"two drive-only trainers, batch {a.batch_size // 2} each, data seeds 1 and 0",
    }
    finals = [
        [label, described[label], str(points["samples"][-1]), f"{points['val_loss'][-1]:.4f}"]
        + ([f"{plain_at[label]:.4f}", f"{gaps[label]:+.2%}"] if label in gaps else ["", ""])
        for label, points in runs.items()
    ]

    def cell(points: dict, i: int) -> str:
        samples = points["samples"][i]
        return f"{points['val_loss'][i]:.4f}" + ("" if samples == base["samples"][i] else f" (at {samples})")

    curves = [[str(s)] + [cell(points, i) for points in runs.values()] for i, s in enumerate(base["samples"])]
    worst = max(abs(g) for g in gaps.values())
    updates = "synchronous" if a.synchronous else "delayed"
    name = "convergence_synchronous" if a.synchronous else "convergence"  # each mode keeps its own section
    lines = [
        f"## Convergence, {updates} updates",
        "",
        f"`python benchmarks/convergence.py`{' --smoke' if a.smoke else ''}, {machine()}; GPT with 4 blocks, "
        f"d_model {a.d_model}, block {a.block_size}, {a.steps * a.batch_size} samples ({a.steps} optimizer steps of "
        f"{a.batch_size}), seed {a.seed}. The swarms: {STAGES} stages of one serve-only peer each, 8-bit "
        f"compression, {updates} updates, target batch size {a.batch_size}. Validation every {a.val_every} steps on "
        f"the same {a.val_batches * a.batch_size} windows; one torch thread per process, all on this machine "
        "(loopback). The 2-trainer swarm's losses are those of its data-seed-0 trainer, at the samples the whole "
        "swarm had trained on by then.",
        "",
        "### Final validation loss, and its gap to plain training at the same samples",
        "",
        "Plain training's loss at a swarm's final samples is interpolated linearly between its validations.",
        "",
        *table(["run", "trainers", "samples", "validation loss", "plain at these samples", "gap"], finals),
        "",
        f"Target: within {TARGET_GAP:.0%} of plain training: {'met' if worst <= TARGET_GAP else 'missed'} "
        f"(largest gap {worst:.2%}).",
        "",
        "### Validation loss against samples",
        "",
        *table(["samples", *runs], curves),
    ]
    update_section(name, lines, path)
    names = ("d_model", "steps", "batch_size", "block_size", "val_every", "val_batches", "seed", "synchronous")
    settings = {name: getattr(a, name) for name in names}
    data = {**settings, "smoke": a.smoke, "curves": runs, "gap": gaps}
    save_data(name, data, path.parent / "results")


if __name__ == "__main__":
    main()
