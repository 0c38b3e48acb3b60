"""Warm starts: how long a local peer takes to join, and how much CPU it spends getting there, forked from a
template (lightning_swarm.prefork) against started as a fresh interpreter.

Each round starts one swarm of --peers serving peers (examples/gpt.py, one stage each) one after another, cold then
warm or warm then cold (alternating), and records each peer's seconds from start() to joined and the CPU seconds its
process had spent by then. The first warm peer of the run also pays for the template's own imports: it is reported
apart, and left out of the warm medians.

    python benchmarks/warm_start.py --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from harness import ONE_THREAD  # noqa: E402

from lightning_swarm import prefork  # noqa: E402
from lightning_swarm.launch import LocalSwarm  # noqa: E402

GPT = str(ROOT / "examples" / "gpt.py")
MODEL = ["--d-model", "32", "--n-layer", "4", "--n-head", "2", "--block-size", "32", "--batch-size", "8"]


def start_peers(warm: bool, peers: int, workdir: Path) -> list[tuple[float, float]]:
    """(seconds to join, CPU seconds of the peer's process by then) of each peer of one swarm."""
    env = {**ONE_THREAD, "SWARM_NUM_STAGES": str(peers), "HIVEMIND_MEMORY_SHARING_STRATEGY": "file_descriptor"}
    figures = []
    with LocalSwarm([GPT], workdir, run_id=f"warm{int(warm)}", env=env, warm_start=warm) as swarm:
        for k in range(peers):
            began = time.monotonic()
            peer = swarm.start(f"peer{k}", MODEL, env={"SWARM_ROLE": "serve", "SWARM_STAGE": str(k)})
            joined = time.monotonic() - began
            cpu = psutil.Process(peer.process.pid).cpu_times()
            figures.append((joined, cpu.user + cpu.system))
            assert isinstance(peer.process, prefork.ForkedProcess) == warm, "the peer did not start as asked"
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="swarms of each kind, alternating which goes first")
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="one round of 2 peers")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "RESULTS.md")
    args = parser.parse_args()
    rounds, peers = (1, 2) if args.smoke else (args.rounds, args.peers)

    work = Path(tempfile.mkdtemp(prefix="warm_start_"))
    results: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    first_warm = None
    for r in range(rounds):
        for warm in (False, True) if r % 2 == 0 else (True, False):
            figures = start_peers(warm, peers, work / f"round{r}_{int(warm)}")
            if warm and first_warm is None:
                first_warm, figures = figures[0], figures[1:]
            results[warm] += figures
    prefork.close_templates()

    def median(warm: bool, i: int) -> float:
        return statistics.median(f[i] for f in results[warm])

    cold_join, warm_join = median(False, 0), median(True, 0)
    cold_cpu, warm_cpu = median(False, 1), median(True, 1)
    lines = [
        f"| fresh interpreter | {len(results[False])} | {cold_join:.2f} | {cold_cpu:.2f} |",
        f"| forked from the template | {len(results[True])} | {warm_join:.2f} | {warm_cpu:.2f} |",
        f"| the first forked peer (template's imports included) | 1 | {first_warm[0]:.2f} | {first_warm[1]:.2f} |",
    ]
    ratio = f"warm / cold: join time {warm_join / cold_join:.2f}, CPU {warm_cpu / cold_cpu:.2f}"
    print("| start | peers | median s to join | median CPU s by then |\n|---|---|---|---|")
    print("\n".join(lines))
    print(ratio)
    command = f"python benchmarks/warm_start.py --rounds {rounds} --peers {peers}"
    section = [
        f"\n## Warm starts ({date.today()})\n",
        f"`{command}`: {rounds} rounds alternating cold and warm swarms of {peers} serving peers started one after "
        "another; each peer's seconds from start() to joined, and its process's CPU seconds by then.\n",
        "| start | peers | median s to join | median CPU s by then |",
        "|---|---|---|---|",
        *lines,
        f"\n{ratio}.\n",
    ]
    with open(args.out, "a") as f:
        f.write("\n".join(section))


if __name__ == "__main__":
    main()
