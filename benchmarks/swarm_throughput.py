"""Swarm throughput against plain training, side by side in one run, and what delayed updates and microbatches
in flight buy; plus the bytes a trainer sends per microbatch against the ideal 2*A*(S-1).

Every configuration trains examples/gpt.py on this machine: plain single-process training (the ideal), then a
2-stage swarm (one serve-only peer per stage and a drive-only trainer, 8-bit compression) with synchronous or
delayed stage updates and 1 or 4 microbatches in flight. Each process gets one torch thread. Throughput is measured
over the second half of the trainer's steps (after start-up and warm-up).

    python benchmarks/swarm_throughput.py            # writes benchmarks/RESULTS.md
    python benchmarks/swarm_throughput.py --smoke    # seconds-long check that the script works
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPT = str(ROOT / "examples" / "gpt.py")
sys.path.insert(0, str(ROOT / "examples"))

from lightning_swarm.launch import LocalSwarm  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from report import RESULTS, machine, table, update_section  # noqa: E402

ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HIVEMIND_LOGLEVEL": "ERROR", "PYTHONWARNINGS": "ignore"}
STAGES = 2
SWARM = {
    "SWARM_NUM_STAGES": str(STAGES),
    "SWARM_MATCHMAKING_TIME": "1.0",
    "SWARM_AVERAGING_TIMEOUT": "5.0",
    "SWARM_UPDATE_PERIOD": "2.0",
    "SWARM_LINGER": "0",
    "HIVEMIND_MEMORY_SHARING_STRATEGY": "file_descriptor",
}
VARIANTS = [  # (label, delayed updates, microbatches)
    ("synchronous, 1 microbatch", False, 1),
    ("delayed, 1 microbatch", True, 1),
    ("delayed, 4 microbatches", True, 4),
]


def model_args(d_model: int, steps: int, batch: int, block: int) -> list[str]:
    heads = max(1, d_model // 64)
    return [*("--d-model", str(d_model), "--n-layer", "4", "--n-head", str(heads)), "--block-size", str(block)] + [
        *("--batch-size", str(batch), "--max-steps", str(steps))
    ]


def steady_throughput(history: dict) -> float:
    """Samples per second over the second half of the steps."""
    times = history["times"]
    half = len(times) // 2
    return (len(times) - 1 - half) * history["samples"] / len(times) / (times[-1] - times[half])


def plain(args: list[str], work: Path) -> dict:
    out = work / "plain.json"
    command = [sys.executable, GPT, "--single", *args, "--history", str(out)]
    subprocess.run(command, check=True, timeout=900, env={**os.environ, **ONE_THREAD}, capture_output=True)
    return json.loads(out.read_text())


def swarm(args: list[str], work: Path, run_id: str, delayed: bool, microbatches: int) -> dict:
    out = work / f"{run_id}.json"
    env = {**SWARM, "SWARM_DELAYED_UPDATES": str(delayed), "SWARM_MICROBATCHES": str(microbatches)}
    with LocalSwarm([GPT], work / run_id, run_id=run_id, env=ONE_THREAD) as local:
        for stage in range(STAGES):
            local.start(f"stage{stage}", args, env={**env, "SWARM_ROLE": "serve", "SWARM_STAGE": str(stage)})
        local.start("trainer", [*args, "--history", str(out)], env={**env, "SWARM_ROLE": "drive"})
        if local.wait("trainer", timeout=900) != 0:
            raise RuntimeError(local.peers["trainer"].log()[-3000:])
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes and a few steps, to check the script")
    parser.add_argument("--sizes", type=int, nargs="+", default=[128, 256, 512], help="hidden sizes (d_model)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--out", default=str(RESULTS))
    a = parser.parse_args()
    sizes, steps = ([32], 6) if a.smoke else (a.sizes, a.steps)
    variants = VARIANTS[1:2] if a.smoke else VARIANTS

    rows = []
    with tempfile.TemporaryDirectory(prefix="swarm_bench_") as tmp:
        work = Path(tmp)
        for d_model in sizes:
            args = model_args(d_model, steps, a.batch_size, a.block_size)
            ideal = steady_throughput(plain(args, work))
            row = {"d_model": d_model, "plain": ideal}
            for label, delayed, microbatches in variants:
                run_id = f"bench{d_model}_{int(delayed)}_{microbatches}"
                history = swarm(args, work, run_id, delayed, microbatches)
                row[label] = steady_throughput(history)
                activation = a.batch_size * a.block_size * d_model * 4  # fp32 bytes at one boundary, per batch
                row[f"{label} bytes"] = history["bytes_sent"] / history["steps"] / (2 * activation * (STAGES - 1))
                print(
                    f"d_model {d_model:4d} | {label:26s} | {row[label]:7.1f} samples/s "
                    f"(plain {ideal:7.1f}, ratio {row[label] / ideal:.3f})",
                    flush=True,
                )
            rows.append(row)
    write(rows, variants, Path(a.out), smoke=a.smoke, steps=steps, batch=a.batch_size, block=a.block_size)


def write(rows: list[dict], variants: list, path: Path, smoke: bool, steps: int, batch: int, block: int) -> None:
    labels = [label for label, *_ in variants]
    lines = [
        "## Swarm throughput",
        "",
        f"`python benchmarks/swarm_throughput.py`{' --smoke' if smoke else ''}, {machine()}; GPT with 4 blocks, "
        f"batch {batch}, block {block}, {steps} steps, 8-bit compression, {STAGES} stages, one torch thread per "
        "process, all processes on this machine (loopback).",
        "",
        "### Throughput, as a ratio of plain single-process training measured in the same run",
        "",
        *table(
            ["d_model", "plain (samples/s)", *labels],
            [
                [str(row["d_model"]), f"{row['plain']:.1f}"]
                + [f"{row[label] / row['plain']:.3f} ({row[label]:.1f}/s)" for label in labels]
                for row in rows
            ],
        ),
        "",
        "### Bytes the trainer sends per batch, as a multiple of the ideal 2*A*(S-1)",
        "",
        f"A: the fp32 bytes of one boundary's activations for the batch; S = {STAGES} stages.",
        "",
        *table(
            ["d_model", *labels],
            [[str(row["d_model"])] + [f"{row[f'{label} bytes']:.2f}" for label in labels] for row in rows],
        ),
    ]
    update_section("swarm_throughput", lines, path)


if __name__ == "__main__":
    main()
