"""What delayed parameter updates buy where they should: stages of several peers, whose gradient all-reduce and
optimizer step otherwise stop the stage's worker every step.

A 2-stage swarm of two serve-only peers per stage and two drive-only trainers (8-bit compression; each trainer's
batch split into microbatches in flight; the stages step every batch of both trainers together) trains
examples/gpt.py with synchronous and with delayed stage updates, the two taking turns (--repeats pairs). Throughput:
both trainers' samples/s together over the second half of their steps. Each process gets one torch thread; all
run on this machine (loopback).

    python benchmarks/delayed_updates.py            # writes benchmarks/RESULTS.md
    python benchmarks/delayed_updates.py --smoke    # a short check that the script works (one peer per stage)
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from harness import STAGES, SWARM, model_args, script_parser, steady_throughput, train_on_swarm  # noqa: E402
from report import RESULTS, machine, save_data, table, update_section  # noqa: E402

# what each trainer's history says it did, kept with the raw figures
TRAINED = ("steps", "samples", "times", "bytes_sent", "calls_per_peer", "failovers", "recomputed")


def main() -> None:
    parser = script_parser(__doc__, "a tiny model and a few steps, to check the script")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--steps", type=int, default=40, help="steps of each trainer")
    parser.add_argument("--batch-size", type=int, default=16, help="each trainer's batch")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="pairs of runs (synchronous, then delayed)")
    parser.add_argument("--peers-per-stage", type=int, default=2, help="serve-only peers per stage")
    parser.add_argument("--trainers", type=int, default=2, help="drive-only trainers")
    parser.add_argument("--out", default=str(RESULTS))
    a = parser.parse_args()
    if a.smoke:
        a.d_model, a.steps, a.repeats, a.peers_per_stage, a.trainers = 32, 6, 1, 1, 1  # the script's path, cheaply
    args = model_args(a.d_model, a.steps, a.batch_size, 64)
    target = a.trainers * a.batch_size
    env = {
        "SWARM_MICROBATCHES": str(a.microbatches),
        "SWARM_TARGET_BATCH_SIZE": str(target),
        "SWARM_REBALANCE_PERIOD": "0",
    }
    trainers = [["--data-seed", str(i)] for i in range(a.trainers)]
    runs: dict[str, list[float]] = {"synchronous": [], "delayed": []}
    trained: dict[str, list[list[dict]]] = {label: [] for label in runs}  # each run's trainers: what they did
    with tempfile.TemporaryDirectory(prefix="delayed_") as tmp:
        for repeat in range(a.repeats):
            for label in runs:
                run_env = {**env, "SWARM_DELAYED_UPDATES": str(label == "delayed")}
                run_id = f"dpu{repeat}_{label}"
                histories, _ = train_on_swarm(args, Path(tmp), run_id, run_env, trainers, a.peers_per_stage)
                runs[label].append(sum(steady_throughput(h) for h in histories))
                trained[label].append([{k: h[k] for k in TRAINED} for h in histories])
                print(f"{label:12s} run {repeat}: {runs[label][-1]:.1f} samples/s", flush=True)
    ratios = [d / s for s, d in zip(runs["synchronous"], runs["delayed"])]
    lines = [
        "## Delayed updates with two peers per stage",
        "",
        f"`python benchmarks/delayed_updates.py`{' --smoke' if a.smoke else ''}, {machine()}; GPT with 4 blocks, "
        f"d_model {a.d_model}, {STAGES} stages of {a.peers_per_stage} serve-only peers, {a.trainers} drive-only "
        f"trainers of batch {a.batch_size} in {a.microbatches} microbatches, {a.steps} steps each, target batch size "
        f"{target}, 8-bit compression, matchmaking time {SWARM['SWARM_MATCHMAKING_TIME']} s; one torch thread per "
        "process, all on this machine (loopback). Runs take turns: synchronous, delayed, synchronous, ...",
        "",
        *table(
            ["pair", "synchronous (samples/s)", "delayed (samples/s)", "delayed / synchronous"],
            [
                [str(i), f"{s:.1f}", f"{d:.1f}", f"{r:.2f}"]
                for i, (s, d, r) in enumerate(zip(runs["synchronous"], runs["delayed"], ratios))
            ],
        ),
        "",
        f"Median gain of delayed updates: {statistics.median(ratios):.2f}x.",
    ]
    update_section("delayed_updates", lines, Path(a.out))
    setup = dict(d_model=a.d_model, steps=a.steps, batch_size=a.batch_size, block_size=64, microbatches=a.microbatches)
    data = {**runs, "ratios": ratios, "setup": {**setup, "trainers": a.trainers}, "trained": trained}
    save_data("delayed_updates", data, Path(a.out).parent / "results")


if __name__ == "__main__":
    main()
