"""A local demo swarm: several peer processes on this machine train the GPT in examples/gpt.py together.

    python examples/demo.py                    # 4 peers, 2 stages, ~3 minutes on a 2-core CPU
    python examples/demo.py --skewed --slow 1  # 3 peers start on stage 0, one peer at a third of its speed:
                                               # watch the swarm rebalance (the summary lists the moves)

Every peer runs examples/gpt.py, exactly as it would on its own machine; the first one starts the swarm and the
others join through its address. Each serves one stage and trains on its own stream of batches.
"""

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from lightning_swarm.launch import LocalSwarm

GPT = str(Path(__file__).with_name("gpt.py"))


def read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--steps", type=int, default=100, help="training steps of each peer")
    parser.add_argument("--compression", default="8bit", choices=["8bit", "float16", "none"])
    parser.add_argument("--model", default="--d-model 64 --n-layer 4 --n-head 4 --block-size 64 --batch-size 16")
    parser.add_argument("--skewed", action="store_true", help="start every peer but one on stage 0")
    parser.add_argument("--slow", type=int, default=0, help="slow this many peers down to a third of their speed")
    parser.add_argument("--rebalance-period", type=float, default=20.0, help="seconds between rebalancing rounds")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="swarm_demo_"))
    env = {
        "SWARM_NUM_STAGES": str(args.stages),
        "SWARM_COMPRESSION": args.compression,
        # a stage steps once per 128 samples of all trainers: every 2-3 s with 4 peers here, time enough for its
        # peers' all-reduce to assemble (at 32 they stepped every 0.3-1 s and many rounds failed)
        "SWARM_TARGET_BATCH_SIZE": "128",
        "SWARM_MATCHMAKING_TIME": "1.0",
        "SWARM_AVERAGING_TIMEOUT": "5.0",
        "SWARM_UPDATE_PERIOD": "2.0",
        "SWARM_REBALANCE_PERIOD": str(args.rebalance_period),
        "HIVEMIND_LOGLEVEL": "ERROR",
        "HIVEMIND_MEMORY_SHARING_STRATEGY": "file_descriptor",
        "PYTHONWARNINGS": "ignore",
    }
    names = [f"peer{i}" for i in range(args.peers)]
    histories = {name: workdir / f"{name}.json" for name in names}
    print(f"Starting {args.peers} peers serving {args.stages} stages (logs in {workdir})")
    start = time.time()
    with LocalSwarm([GPT], workdir, run_id="demo", env=env) as swarm:
        for i, name in enumerate(names):
            peer_args = [
                *args.model.split(),
                "--max-steps",
                str(args.steps),
                "--data-seed",
                str(i),
                "--history",
                str(histories[name]),
            ]
            stage = (0 if i else args.stages - 1) if args.skewed else i % args.stages
            throttle = "3" if i < args.slow else "1"
            swarm.start(name, peer_args, env={"SWARM_STAGE": str(stage), "SWARM_THROTTLE": throttle})
            slow = ", at a third of its speed" if i < args.slow else ""
            print(f"  {name} joined stage {stage}{slow} as {swarm.peers[name].addresses()[0]}")
        while any(peer.alive() for peer in swarm.peers.values()):
            time.sleep(5)
            runs = [read(histories[name]) for name in names]
            steps = " ".join(f"{r.get('steps', 0):3d}" for r in runs)
            losses = [r["losses"][-1] for r in runs if r.get("losses")]
            latest = f"{sum(losses) / len(losses):.3f}" if losses else "-"
            print(f"[{time.time() - start:5.0f}s] steps per peer: {steps} | latest loss (mean): {latest}", flush=True)
        failed_peers = [name for name, peer in swarm.peers.items() if peer.process.returncode != 0]
        for name in failed_peers:
            print(f"---- {name} exited with {swarm.peers[name].process.returncode}:\n{swarm.peers[name].log()[-2000:]}")
    wall = time.time() - start

    runs = [read(histories[name]) for name in names]
    samples = sum(r.get("samples", 0) for r in runs)
    train_seconds = max(r.get("seconds", 0.0) for r in runs)
    per_stage = [sum(1 for r in runs if r.get("stage") == k) for k in range(args.stages)]
    ends = [sum(r["losses"][-5:]) / len(r["losses"][-5:]) for r in runs if r.get("losses")]
    print("\nSummary")
    print(f"  peers per stage      {per_stage}")
    print(f"  samples trained      {samples} in {train_seconds:.0f}s of training ({wall:.0f}s with start-up)")
    print(f"  throughput           {samples / max(train_seconds, 1e-9):.1f} samples/s (all trainers together)")
    print(f"  loss                 {runs[0]['losses'][0]:.3f} at the start -> {sum(ends) / len(ends):.3f} at the end")
    print(f"  failovers            {sum(r.get('failovers', 0) for r in runs)}")
    lost = sum(r.get("failed_round_seconds", 0.0) for r in runs) / max(sum(r.get("seconds", 0.0) for r in runs), 1e-9)
    failed_rounds, rounds = sum(r.get("failed_rounds", 0) for r in runs), sum(r.get("rounds", 0) for r in runs)
    print(
        f"  failed all-reduces   {failed_rounds} of {rounds} rounds, {100 * lost:.1f}% of the peers' training time "
        "held up by them"
    )
    sent = sum(r.get("bytes_sent", 0) for r in runs)
    print(f"  sent between stages  {sent / max(samples, 1) / 1024:.1f} KiB per sample (tensor payloads)")
    moves = sorted(
        (move["time"], name, move)
        for name, r in zip(names, runs)
        for move in r.get("stage_changes", [])
        if move["predicted_gain"] is not None  # the peer's own moves (others are only seen)
    )
    print(f"  rebalancing moves    {len(moves)}")
    for when, name, move in moves:
        print(
            f"    {when - start:5.0f}s  {name}: stage {move['from_stage']} -> {move['to_stage']}, {move['reason']}, "
            f"predicted gain x{move['predicted_gain']:.2f}"
        )
    shutil.rmtree(workdir, ignore_errors=True)
    # failed all-reduce rounds are part of training (the peer steps alone); only a peer that exited non-zero fails
    sys.exit(1 if failed_peers else 0)


if __name__ == "__main__":
    main()
