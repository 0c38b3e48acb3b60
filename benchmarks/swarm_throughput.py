"""The square-cube law on this machine: pipeline efficiency against model size, what delayed updates and
microbatches in flight buy, each stage's compute/communication ratio, the bytes sent per batch against the ideal
2*A*(S-1), and each peer's peak memory against the full model's.

Every configuration trains examples/gpt.py on this machine: plain single-process training, then a 2-stage swarm
(one serve-only peer per stage and a drive-only trainer, 8-bit compression) with synchronous or delayed stage
updates and 1, 4 or "auto" (measured) microbatches in flight. Each process gets one torch thread. Throughput is
measured over the second half of the trainer's steps (after start-up and warm-up). The ideal pipeline throughput is
the slowest stage's: each stage's forward and backward, timed alone in a process of its own in the same run.

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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from harness import (  # noqa: E402
    ONE_THREAD,
    STAGES,
    model_args,
    plain,
    script_parser,
    steady_call_seconds,
    steady_throughput,
    swarm,
)
from report import RESULTS, machine, save_data, table, update_section  # noqa: E402

VARIANTS = [  # (label, delayed updates, microbatches)
    ("synchronous, 1 microbatch", False, 1),
    ("synchronous, 4 microbatches", False, 4),
    ("synchronous, auto microbatches", False, "auto"),
    ("delayed, auto microbatches", True, "auto"),
]


def stages_alone(args: list[str]) -> list[float]:
    """Each stage's training throughput (samples/s of forward and backward) timed alone, one thread, in a fresh
    process: the ideal a pipeline of these stages can reach is the slowest one's."""
    command = [sys.executable, __file__, "--time-stages", *args]
    done = subprocess.run(command, check=True, timeout=900, env={**os.environ, **ONE_THREAD}, capture_output=True)
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


def time_stages(argv: list[str]) -> None:
    """``--time-stages``: print each stage's samples/s as JSON (runs in its own process)."""
    import torch
    from gpt import GPT as Model

    from lightning_swarm import partitioning

    parser = argparse.ArgumentParser()
    for name in ("--d-model", "--n-layer", "--n-head", "--block-size", "--batch-size", "--max-steps"):
        parser.add_argument(name, type=int)
    a = parser.parse_args(argv)
    torch.set_num_threads(1)
    model = Model(96, a.block_size, a.d_model, a.n_layer, a.n_head)
    spans = partitioning.balance_by_parameters(list(model.blocks), STAGES)
    rates = []
    for span in spans:
        stage = partitioning.stage_module(model.blocks, span)
        x = torch.randn(a.batch_size, a.block_size, a.d_model, requires_grad=True)
        grad = torch.randn_like(x)
        timings = []
        for _ in range(max(3, min(10, a.max_steps // 4))):
            start = time.perf_counter()
            torch.autograd.grad(stage(x), [x, *stage.parameters()], grad)
            timings.append(time.perf_counter() - start)
        rates.append(a.batch_size / sorted(timings[1:])[len(timings[1:]) // 2])  # median, after a warm-up
    print(json.dumps(rates))


def main() -> None:
    parser = script_parser(__doc__, "tiny sizes and a few steps, to check the script")
    parser.add_argument("--sizes", type=int, nargs="+", default=[128, 256, 512, 1024], help="hidden sizes (d_model)")
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
            reference = plain(args, work)
            row = {"d_model": d_model, "plain": steady_throughput(reference), "plain_peak_rss": reference["peak_rss"]}
            row["setup"] = {"steps": steps, "batch_size": a.batch_size, "block_size": a.block_size}
            row["stages_alone"] = stages_alone(args)
            ideal = min(row["stages_alone"])
            activation = a.batch_size * a.block_size * d_model * 4  # fp32 bytes at one boundary, per batch
            for label, delayed, microbatches in variants:
                history = swarm(args, work, f"bench{d_model}_{int(delayed)}_{microbatches}", delayed, microbatches)
                row[label] = steady_throughput(history)
                row[f"{label} bytes"] = history["bytes_sent"] / history["steps"] / (2 * activation * (STAGES - 1))
                row[f"{label} call_seconds"] = steady_call_seconds(history)
                row[f"{label} peak_rss"] = [history["peak_rss"], *history["stage_peak_rss"]]
                row[f"{label} recomputed"] = history["recomputed"]
                row[f"{label} failovers"] = history["failovers"]
                print(
                    f"d_model {d_model:4d} | {label:28s} | {row[label]:7.1f} samples/s, efficiency "
                    f"{row[label] / ideal:.3f} (slowest stage alone {ideal:.1f}/s, plain {row['plain']:.1f}/s)",
                    flush=True,
                )
            rows.append(row)
    write(rows, variants, Path(a.out), smoke=a.smoke, steps=steps, batch=a.batch_size, block=a.block_size)
    save_data("swarm_throughput", rows, Path(a.out).parent / "results")


def write(rows: list[dict], variants: list, path: Path, smoke: bool, steps: int, batch: int, block: int) -> None:
    labels = [label for label, *_ in variants]
    sync = labels[0]
    mib = 2**20
    lines = [
        "## Swarm throughput: the square-cube law on this machine",
        "",
        f"`python benchmarks/swarm_throughput.py`{' --smoke' if smoke else ''}, {machine()}; GPT with 4 blocks, "
        f"batch {batch}, block {block}, {steps} steps, 8-bit compression, {STAGES} stages, one torch thread per "
        "process, all processes on this machine (loopback).",
        "",
        "### Pipeline efficiency: swarm throughput / the slowest stage's throughput alone (same run)",
        "",
        *table(
            ["d_model", "stages alone (samples/s)", "plain (samples/s)", *labels],
            [
                [str(row["d_model"]), " / ".join(f"{r:.1f}" for r in row["stages_alone"]), f"{row['plain']:.1f}"]
                + [f"{row[label] / min(row['stages_alone']):.3f} ({row[label]:.1f}/s)" for label in labels]
                for row in rows
            ],
        ),
        "",
        f"### Compute / communication per stage ({sync})",
        "",
        "Compute: the stage's forward and backward for one batch, timed alone. Communication: the trainer's time in "
        "calls to that stage per batch, less that compute (encoding, transfer, queueing, decoding).",
        "",
        *table(
            ["d_model", *(f"stage {k}: compute ms / comm ms (ratio)" for k in range(STAGES))],
            [
                [str(row["d_model"])]
                + [
                    f"{1e3 * batch / rate:.1f} / {1e3 * max(call - batch / rate, 0):.1f} "
                    f"({(batch / rate) / max(call - batch / rate, 1e-9):.2f})"
                    for rate, call in zip(row["stages_alone"], row[f"{sync} call_seconds"])
                ]
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
        "",
        "### Peak memory (RSS, MiB): plain training of the full model against the swarm's peers",
        "",
        "Each process's peak resident memory (VmHWM), imports included; swarm columns: trainer (local parts) / "
        + " / ".join(f"stage {k} peer" for k in range(STAGES))
        + ".",
        "",
        *table(
            ["d_model", "plain (full model)", *labels],
            [
                [str(row["d_model"]), f"{row['plain_peak_rss'] / mib:.0f}"]
                + [" / ".join(f"{rss / mib:.0f}" for rss in row[f"{label} peak_rss"]) for label in labels]
                for row in rows
            ],
        ),
    ]
    update_section("swarm_throughput", lines, path)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--time-stages"]:
        time_stages(sys.argv[2:])
    else:
        main()
