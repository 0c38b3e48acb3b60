"""A flooding trainer's effect on another trainer's throughput (issue 17, "fair share").

One serve-only peer serves the only stage of a small GPT (its queue holds ``--queue`` requests, its kept-activation
budget is 4 MiB). A normal drive-only trainer (a real ``examples/gpt.py`` process) trains ``--steps`` steps alone,
then again while a flooder (a peer process of its own) sends training forwards from ``--threads`` threads at once,
each kept by the server and never followed by its backward, each sent again as soon as it is answered. The flooder
runs at the lowest CPU priority: on a swarm it would compute on its own machine, while here all processes share
this machine's cores (the stage server's work for it is not discounted). Runs take turns (alone, flooded, alone,
...) for ``--pairs`` pairs; the figure is the trainer's steady-state steps per second beside the flooder over alone
(median over pairs; target: at least 0.8). With ``--pin`` the stage server runs on a core of its own, as on its own
machine, and the trainer and the flooder share the other; without it, every process shares every core.

    python benchmarks/flooding.py                 # prints the table; raw figures in benchmarks/results/flooding.json
    python benchmarks/flooding.py --pairs 1 --steps 20   # a short check that the script works
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Iterator, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

from harness import GPT  # noqa: E402
from helpers.raw_client import FloodingPeer, RawClient, wait_until_serving  # noqa: E402
from report import machine, save_data, table  # noqa: E402

from lightning_swarm.launch import LocalSwarm  # noqa: E402
from lightning_swarm.node import SwarmNode  # noqa: E402

MODEL = ["--d-model", "32", "--n-layer", "2", "--n-head", "2", "--block-size", "32", "--batch-size", "8"]
ENV = {
    "SWARM_NUM_STAGES": "1",
    "SWARM_COMPRESSION": "none",
    "SWARM_TARGET_BATCH_SIZE": "100000",  # no optimizer step: the stage's compute is the same in every run
    "SWARM_MAX_ACTIVATION_BYTES": str(4 * 2**20),
    "SWARM_MATCHMAKING_TIME": "1.0",
    "SWARM_AVERAGING_TIMEOUT": "4.0",
    "SWARM_LINGER": "0",
    "OMP_NUM_THREADS": "1",
    "HIVEMIND_LOGLEVEL": "ERROR",
    "HIVEMIND_MEMORY_SHARING_STRATEGY": "file_descriptor",
    "PYTHONWARNINGS": "ignore",
}


def steady_rate(times: list[float], skip: int = 5) -> float:
    """Steps per second after the first ``skip`` steps (start-up)."""
    return (len(times) - 1 - skip) / (times[-1] - times[skip])


@contextmanager
def pinned(cpus: Optional[set[int]]) -> Iterator[None]:
    """Processes started inside run on ``cpus`` only (they inherit this process's affinity); None: anywhere."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def measure(pairs: int, steps: int, threads: int, queue: int, pin: bool, workdir: Path) -> dict:
    env = {**ENV, "SWARM_MAX_QUEUE": str(queue)}
    server_cpus, client_cpus = ({0}, {1}) if pin else (None, None)
    runs: list[dict] = []
    with LocalSwarm([GPT], workdir, run_id="flooding", env=env) as swarm:
        with pinned(server_cpus):
            server = swarm.start("server", MODEL, env={"SWARM_ROLE": "serve", "SWARM_STAGE": "0"})
        node = SwarmNode(initial_peers=server.addresses()).start()
        try:
            wait_until_serving(RawClient(node, server.addresses()[0], "flooding"), server)
        finally:
            node.shutdown()
        for i in range(2 * pairs):
            flooded, name = i % 2 == 1, f"trainer{i}"
            record = workdir / f"{name}.json"
            args = [*MODEL, "--max-steps", str(steps), "--history", str(record)]
            start = time.monotonic()
            flooder = FloodingPeer(server.addresses()[0], "flooding", (4, 32, 32), threads) if flooded else None
            with pinned(client_cpus), flooder or nullcontext():
                swarm.start(name, args, env={"SWARM_ROLE": "drive"})
                code = swarm.wait(name, timeout=600)
            history = json.loads(record.read_text())
            assert code == 0 and history["steps"] == steps, swarm.peers[name].log()[-3000:]
            runs.append(
                dict(
                    flooded=flooded,
                    steps_per_second=steady_rate(history["times"]),
                    recomputed=history["recomputed"],
                    failovers=history["failovers"],
                    flooder=dict(flooder.outcomes, seconds=time.monotonic() - start) if flooded else None,
                )
            )
            print(json.dumps(runs[-1]), flush=True)
    ratios = [b["steps_per_second"] / a["steps_per_second"] for a, b in zip(runs[::2], runs[1::2])]
    return dict(runs=runs, ratios=ratios, median_ratio=statistics.median(ratios))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--threads", type=int, default=16, help="the flooder's requests in flight")
    parser.add_argument("--queue", type=int, default=8, help="the stage server's max_queue")
    parser.add_argument("--pin", action="store_true", help="the server on CPU 0, the trainer and flooder on CPU 1")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = measure(args.pairs, args.steps, args.threads, args.queue, args.pin, Path(tmp))
    rows = []
    for alone, flooded, ratio in zip(result["runs"][::2], result["runs"][1::2], result["ratios"]):
        outcomes = flooded["flooder"]
        rate = (outcomes["served"] + outcomes["busy"]) / outcomes["seconds"]
        rows.append(
            [
                f"{alone['steps_per_second']:.2f}",
                f"{flooded['steps_per_second']:.2f}",
                f"{ratio:.2f}",
                f"{rate:.0f} ({outcomes['busy'] / max(1, outcomes['served'] + outcomes['busy']):.0%} busy)",
                str(flooded["recomputed"]),
            ]
        )
    header = ["alone (steps/s)", "beside the flooder (steps/s)", "ratio", "flooder's requests/s", "recomputed"]
    where = "server on CPU 0, trainer and flooder on CPU 1" if args.pin else "all processes on all cores"
    print(f"\n{machine()}; {args.threads} flooding threads, queue {args.queue}, {args.steps} steps a run; {where}\n")
    print("\n".join(table(header, rows)))
    print(f"\nMedian ratio: {result['median_ratio']:.2f}")
    save_data("flooding_pinned" if args.pin else "flooding", dict(vars(args), machine=machine(), **result))


if __name__ == "__main__":
    main()
