"""Churn: peers join and leave during a run, with and without rebalancing (after SWARM's section 4.3).

A seeded schedule starts and stops serve-only peers of a 3-stage swarm (unequal peers: each is slowed down by a
throttle drawn from the schedule, so that compute, not the 2 shared cores, sets their speed) while one drive-only
trainer sends microbatches through it. Every two seconds the benchmark reads which peer serves which stage (a peer
moving counts at its new stage) and computes the swarm's throughput, the lowest stage's summed peer speed, as a
fraction of the best allocation of the same peers. A peer's speed here is its nominal one, 1 / throttle: the
peers themselves plan from the throughputs they measure, which the shared cores make noisy. The same schedule
runs twice: with rebalancing, and without (peers stay where they joined; in both runs the initial peers are
spread evenly and a newcomer joins the bottleneck stage). Also reported: the trainer's own throughput.

    python benchmarks/churn.py            # writes the "churn" section of benchmarks/RESULTS.md
    python benchmarks/churn.py --smoke --out /tmp/r.md   # a short check that the script works
"""

from __future__ import annotations

import json
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

from harness import GPT, script_parser  # noqa: E402
from helpers.oracles import best_allocation  # noqa: E402
from report import RESULTS, machine, save_data, table, update_section  # noqa: E402

from lightning_swarm import discovery  # noqa: E402
from lightning_swarm.launch import LocalSwarm  # noqa: E402
from lightning_swarm.node import SwarmNode  # noqa: E402
from lightning_swarm.rebalancing import capacities  # noqa: E402

STAGES = 3
MODEL = ["--d-model", "64", "--n-layer", "3", "--n-head", "2", "--block-size", "32", "--batch-size", "8"]
ENV = {
    "SWARM_NUM_STAGES": str(STAGES),
    "SWARM_COMPRESSION": "8bit",
    "SWARM_TARGET_BATCH_SIZE": "64",
    "SWARM_MATCHMAKING_TIME": "1.0",
    "SWARM_AVERAGING_TIMEOUT": "4.0",
    "SWARM_UPDATE_PERIOD": "2.0",
    "SWARM_REQUEST_TIMEOUT": "20.0",
    "SWARM_BAN_TIMEOUT": "10.0",
    "SWARM_STAGE_WAIT_TIMEOUT": "3600",
    "SWARM_LINGER": "0",
    "OMP_NUM_THREADS": "1",
    "HIVEMIND_LOGLEVEL": "ERROR",
    "HIVEMIND_MEMORY_SHARING_STRATEGY": "file_descriptor",
    "PYTHONWARNINGS": "ignore",
}
THROTTLES = (2.0, 4.0, 8.0)


def schedule(seed: int, initial: int, events: int, every: float, max_peers: int) -> list[tuple[float, str, float]]:
    """(time, action, throttle) for each event: "join" a new peer, or "term" / "kill" a random live one."""
    rng, live, plan = random.Random(seed), initial, []
    for i in range(events):
        joins = live <= STAGES or (live < max_peers and rng.random() < 0.5)
        action = "join" if joins else rng.choice(["term", "kill"])
        live += 1 if joins else -1
        plan.append(((i + 1) * every, action, rng.choice(THROTTLES)))
    return plan


def allocation_quality(node: SwarmNode, run_id: str, speed: dict[str, float]) -> tuple[float, int]:
    """The swarm's throughput over the best allocation's, by the peers' nominal ``speed``; and the peer count."""
    present = discovery.current_records(discovery.fetch_swarm(node, run_id, STAGES))
    stages = {p: r.stage for p, r in present.items() if p in speed}
    if not stages:
        return 0.0, 0
    speeds = {p: speed[p] for p in stages}
    return min(capacities(stages, speeds, STAGES)) / best_allocation(speeds, STAGES), len(stages)


def run(rebalance_period: float, plan: list, initial: list[float], duration: float, seed: int, workdir: Path) -> dict:
    env = {**ENV, "SWARM_REBALANCE_PERIOD": str(rebalance_period)}
    rng = random.Random(seed + 1)
    samples: list[tuple[float, float, int]] = []
    record = workdir / f"trainer_{rebalance_period:g}.json"
    with LocalSwarm([GPT], workdir / f"run_{rebalance_period:g}", f"churn{int(rebalance_period)}", env=env) as swarm:
        names, speed = [], {}

        def join(throttle: float, stage: Optional[int] = None) -> None:
            names.append(f"p{len(names)}")
            peer_env = {"SWARM_ROLE": "serve", "SWARM_THROTTLE": str(throttle)}
            if stage is not None:
                peer_env["SWARM_STAGE"] = str(stage)
            peer = swarm.start(names[-1], MODEL, env=peer_env)
            speed[peer.addresses()[0].rsplit("/", 1)[-1]] = 1.0 / throttle

        for i, throttle in enumerate(initial):
            join(throttle, stage=i % STAGES)
        trainer_args = [*MODEL, "--max-steps", "1000000", "--history", str(record)]
        swarm.start("trainer", trainer_args, env={"SWARM_ROLE": "drive", "SWARM_MICROBATCHES": "4"})
        node = SwarmNode(initial_peers=swarm.initial_peers(), timeout=20).start()
        try:
            start, pending = time.monotonic(), list(plan)
            while (now := time.monotonic() - start) < duration:
                while pending and pending[0][0] <= now:
                    _, action, throttle = pending.pop(0)
                    live = [n for n in names if swarm.peers[n].alive()]
                    if action == "join":
                        join(throttle)
                    else:
                        swarm.signal(rng.choice(live), signal.SIGTERM if action == "term" else signal.SIGKILL)
                try:
                    quality, peers = allocation_quality(node, swarm.run_id, speed)
                    samples.append((round(now, 1), quality, peers))
                except Exception as e:  # a missed sample is not a result
                    print(f"could not read the swarm: {e!r}")
                time.sleep(2.0)
        finally:
            node.shutdown()
        trainer = json.loads(record.read_text()) if record.exists() else {}
    times = trainer.get("times", [])
    steps_per_s = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0
    batch = int(MODEL[MODEL.index("--batch-size") + 1])
    return {"samples": samples, "trainer_samples_per_s": steps_per_s * batch}


def main() -> None:
    parser = script_parser(__doc__, "a short run with rebalancing, to check the script")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results file; the JSON goes to results/ beside it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rebalance-period", type=float, default=15.0)
    args = parser.parse_args()
    if args.smoke and args.out == RESULTS:
        parser.error("--smoke needs --out: smoke figures never replace benchmarks/RESULTS.md")
    if args.smoke:
        initial, events, every, duration = [2.0, 4.0, 2.0], 1, 15.0, 30.0
    else:
        initial, events, every, duration = [2.0, 4.0, 8.0, 2.0, 4.0, 8.0], 8, 20.0, 180.0
    plan = schedule(args.seed, len(initial), events, every, max_peers=8)
    results = {}
    with tempfile.TemporaryDirectory(prefix="churn_") as tmp:
        variants = [("with rebalancing", args.rebalance_period), ("without rebalancing", 0.0)]
        for label, period in variants[:1] if args.smoke else variants:  # the smoke checks the script, once
            print(f"{label}: {len(plan)} events over {duration:.0f}s")
            results[label] = run(period, plan, initial, duration, args.seed, Path(tmp))
            qualities = [q for _, q, _ in results[label]["samples"]]
            print(f"  mean fraction of the best allocation: {sum(qualities) / max(len(qualities), 1):.3f}")
    for label, result in results.items():
        assert result["samples"], f"{label}: no sample of the swarm was taken"

    rows = []
    for label, result in results.items():
        qualities = [q for _, q, _ in result["samples"]]
        settled = [q for t, q, _ in result["samples"] if t >= every]  # after the initial joins
        rows.append(
            [
                label,
                f"{sum(qualities) / len(qualities):.3f}",
                f"{sum(settled) / max(len(settled), 1):.3f}",
                f"{min(qualities):.2f}",
                f"{result['trainer_samples_per_s']:.1f}",
            ]
        )
    events = ", ".join(f"{t:.0f}s {a} (x{th:g})" if a == "join" else f"{t:.0f}s {a}" for t, a, th in plan)
    lines = [
        f"## Churn: peers joining and leaving (`benchmarks/churn.py{' --smoke' if args.smoke else ''}`)",
        "",
        f"{machine()}. 3 stages, serve-only peers slowed by throttles {list(THROTTLES)} (initially {initial}), one",
        f"drive-only trainer with 4 microbatches in flight, {duration:.0f} s per run, rebalancing every "
        f"{args.rebalance_period:g} s. Seeded schedule (seed {args.seed}): {events}.",
        "Quality = the swarm's throughput (the lowest stage's summed nominal peer speed, 1 / throttle, with the",
        "stages read from the peers' records) over the best allocation of the same peers, sampled every 2 s.",
        "Both runs follow the same schedule, one after the other.",
        "",
        *table(
            ["run", "mean quality", f"mean after {every:.0f} s", "lowest", "trainer samples/s"],
            rows,
        ),
        "",
        "The SWARM paper reports about 96% of optimal with rebalancing and about 83% without (its Figure 5 setup:",
        "many more peers and longer runs).",
    ]
    update_section("churn", lines, args.out)
    save_data("churn", {"schedule": plan, "initial": initial, "results": results}, args.out.parent / "results")


if __name__ == "__main__":
    main()
