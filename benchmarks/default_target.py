"""The default target batch size against an explicit one of N x the per-peer batch, side by side (issue 27).

    python benchmarks/default_target.py             # 4 peers, 2 stages, batch 16: defaults, then target 64
    python benchmarks/default_target.py --smoke     # 2 peers, a few steps, the default only

The demo's swarm (examples/gpt.py, its model and settings: matchmaking_time 1 s, averaging_timeout 5 s,
update_period 2 s), once per configuration, one swarm at a time, each for at most ``--seconds`` of wall time or
``--steps`` steps per peer: ``default`` leaves the target batch size unset (one peer's batch per training peer, as
the discovery records say), ``N x batch`` sets it to the peers times the batch, and ``--old`` adds the target the
default used to be (one peer's batch, for the whole swarm). Reported per configuration, over all trainers:

- samples/s while every peer trains (from the first step of the last peer to start to the last step of the first
  peer to stop);
- the training loss at equal samples (each peer's mean over its batches ``k-4..k``, with ``k`` the steps every peer
  of every configuration reached), and at the end of the configuration;
- each stage's optimizer steps, and the samples per step (the samples its peers' stage servers stepped with, as of
  their last report, over the stage's steps then), and the targets its optimizers used;
- gradient rounds (stage and local optimizers), the failed ones (split between the stages' optimizers and the
  trainers' local one) and the share of the peers' time they held up; each failed round is printed with the epoch,
  the partners it expected and the other peers' progress records (epoch, samples) as its peer last read them.

With ``ROUNDS_LOG=<file>`` in the environment every peer appends each of its steps to that file, one JSON line: the
optimizer, the epoch, the partners expected, whether the round failed, the group it averaged with and how long the
step held the peer (what showed which peers missed which rounds, and why).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import save_data, table, update_section  # noqa: E402

from lightning_swarm.launch import LocalSwarm  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL = "--d-model 64 --n-layer 4 --n-head 4 --block-size 64"

# examples/gpt.py, with its stage optimizer's step, the samples it was given (by this peer's stage server) and the
# targets it used added to the history it writes
PEER = f"""
import json, os, sys
sys.path.insert(0, {str(ROOT / "examples")!r})
import gpt
from lightning_swarm.optimizer import SwarmOptimizer
step = SwarmOptimizer.step
def counting(self, *args, batch_size=None, **kwargs):
    self.samples_given = getattr(self, "samples_given", 0) + (batch_size or 0)
    return step(self, *args, batch_size=batch_size, **kwargs)
SwarmOptimizer.step = counting
import time
average = SwarmOptimizer._average_gradients_and_load_into_optimizer
FAILURES = []
NAME = os.path.basename(sys.argv[sys.argv.index("--history") + 1])
def noting(self, control):
    failed, began, sizes = self.failed_rounds, time.time(), dict(self.allreduce_sizes)
    average(self, control)
    done = control is not None and control.done() and not control.cancelled() and control.exception() is None
    entry = dict(
        peer=NAME, me=str(self.dht.peer_id)[-6:], optimizer=self.run_id, epoch=self.local_epoch, at=began,
        held=time.time() - began, expected=self._expected_group, round=control is not None,
        failed=self.failed_rounds > failed, group=[str(p)[-6:] for p in control.result()] if done else None,
        others=sorted((e.epoch, e.samples_accumulated) for e in self.tracker._records),
    )
    if entry["failed"]:
        FAILURES.append(entry)
    if os.environ.get("ROUNDS_LOG"):
        with open(os.environ["ROUNDS_LOG"], "a") as f:
            f.write(json.dumps(entry) + "\\n")
SwarmOptimizer._average_gradients_and_load_into_optimizer = noting
write = gpt.History.write
def with_stage(self, trainer):
    write(self, trainer)
    stage = getattr(trainer.strategy, "_stage", None)
    optimizer = stage.optimizer if stage is not None else None
    if optimizer is None:
        return
    self.targets = sorted(set(getattr(self, "targets", [])) | {{int(optimizer.tracker.target_batch_size)}})
    with open(self.path) as f:
        summary = json.load(f)
    summary.update(
        stage_epoch=optimizer.local_epoch,
        stage_samples=getattr(optimizer, "samples_given", 0),
        stage_targets=self.targets,
        stage_rounds=optimizer.rounds,
        stage_failed_rounds=optimizer.failed_rounds,
        stage_failed_round_seconds=optimizer.failed_round_seconds,
        failures=FAILURES,
    )
    with open(self.path + ".tmp", "w") as f:
        json.dump(summary, f)
    os.replace(self.path + ".tmp", self.path)
gpt.History.write = with_stage
sys.argv = ["gpt.py", *sys.argv[1:]]
gpt.main()
"""


def read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def run(name: str, target: str, peers: int, stages: int, batch: int, steps: int, seconds: float) -> dict:
    """One swarm with ``target`` ("": unset) as ``SWARM_TARGET_BATCH_SIZE``; its peers' histories and a summary."""
    workdir = Path(tempfile.mkdtemp(prefix="swarm_target_"))
    env = {
        "SWARM_NUM_STAGES": str(stages),
        "SWARM_MATCHMAKING_TIME": "1.0",
        "SWARM_AVERAGING_TIMEOUT": "5.0",
        "SWARM_UPDATE_PERIOD": "2.0",
        "SWARM_REBALANCE_PERIOD": "0",
        "HIVEMIND_LOGLEVEL": "ERROR",
        "HIVEMIND_MEMORY_SHARING_STRATEGY": "file_descriptor",
        "PYTHONWARNINGS": "ignore",
        "SWARM_TARGET_BATCH_SIZE": target,
    }
    if not target:
        del env["SWARM_TARGET_BATCH_SIZE"]
    saved = os.environ.pop("SWARM_TARGET_BATCH_SIZE", None)
    names = [f"peer{i}" for i in range(peers)]
    histories = {n: workdir / f"{n}.json" for n in names}
    began = time.time()
    try:
        with LocalSwarm(
            ["-c", PEER], workdir, run_id="target_" + "".join(c if c.isalnum() else "_" for c in name), env=env
        ) as swarm:
            peers = {}
            for i, n in enumerate(names):
                args = [*MODEL.split(), "--batch-size", str(batch), "--max-steps", str(steps), "--data-seed", str(i)]
                peers[n] = ([*args, "--history", str(histories[n])], {"SWARM_STAGE": str(i % stages)})
            swarm.start_together(peers)  # the first one alone, then the others at once
            deadline = began + seconds
            while any(p.alive() for p in swarm.peers.values()) and time.time() < deadline:
                time.sleep(2)
            cut = any(p.alive() for p in swarm.peers.values())
    finally:
        if saved is not None:
            os.environ["SWARM_TARGET_BATCH_SIZE"] = saved
    runs = [read(histories[n]) for n in names]
    shutil.rmtree(workdir, ignore_errors=True)
    return summarize(name, runs, batch, stages, time.time() - began, cut)


def summarize(name: str, runs: list[dict], batch: int, stages: int, wall: float, cut: bool) -> dict:
    times = [r.get("times", []) for r in runs]
    start, end = max(t[0] for t in times if t), min(t[-1] for t in times if t)
    steady = sum(1 for t in times for x in t if start <= x <= end) * batch / max(end - start, 1e-9)
    samples = sum(r.get("samples", 0) for r in runs)
    stage_steps = [
        max((r.get("stage_epoch", 0) for r in runs if r.get("stage") == k), default=0) for k in range(stages)
    ]
    stage_samples = [sum(r.get("stage_samples", 0) for r in runs if r.get("stage") == k) for k in range(stages)]
    held = sum(r.get("failed_round_seconds", 0.0) for r in runs) / max(sum(r.get("seconds", 0.0) for r in runs), 1e-9)
    return dict(
        name=name,
        wall=wall,
        cut=cut,
        steps=[len(r.get("losses", [])) for r in runs],
        samples=samples,
        samples_per_second=steady,
        stage_steps=stage_steps,
        samples_per_stage_step=[n / s if s else None for n, s in zip(stage_samples, stage_steps)],
        targets=sorted({t for r in runs for t in r.get("stage_targets", [])}),
        rounds=sum(r.get("rounds", 0) for r in runs),
        failed=sum(r.get("failed_rounds", 0) for r in runs),
        stage_rounds=sum(r.get("stage_rounds", 0) for r in runs),
        stage_failed=sum(r.get("stage_failed_rounds", 0) for r in runs),
        failures=[f for r in runs for f in r.get("failures", [])],
        failed_time_share=held,
        losses=[r.get("losses", []) for r in runs],
    )


def loss_at(result: dict, k: int) -> float:
    """The trainers' mean loss over their batches k-4..k (each peer then trained k batches)."""
    windows = [losses[max(0, k - 5) : k] for losses in result["losses"] if len(losses) >= k]
    return sum(sum(w) / len(w) for w in windows) / len(windows)


HEADER = [
    "target",
    "order",
    "wall s",
    "steps per peer",
    "samples/s (all trainers)",
    "loss at equal samples",
    "stage steps",
    "samples per stage step",
    "targets used",
    "rounds",
    "failed",
    "failed: stage / local rounds",
    "time held by failed rounds",
]


def row(r: dict, k: int) -> list[str]:
    per_step = ", ".join("-" if s is None else f"{s:.0f}" for s in r["samples_per_stage_step"])
    return [
        r["name"],
        str(r["order"]),
        f"{r['wall']:.0f}" + (" (cut)" if r["cut"] else ""),
        "/".join(map(str, r["steps"])),
        f"{r['samples_per_second']:.1f}",
        f"{loss_at(r, k):.3f} at {k} steps",
        "/".join(map(str, r["stage_steps"])),
        per_step,
        ", ".join(map(str, r["targets"])),
        str(r["rounds"]),
        f"{r['failed']} ({100 * r['failed'] / max(r['rounds'], 1):.0f}%)",
        f"{r['stage_failed']} of {r['stage_rounds']} / {r['failed'] - r['stage_failed']} of "
        f"{r['rounds'] - r['stage_rounds']}",
        f"{100 * r['failed_time_share']:.1f}%",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="2 peers, a few steps, the default only")
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=1000, help="steps of each peer, at most")
    parser.add_argument("--seconds", type=float, default=170.0, help="wall time of each swarm, at most")
    parser.add_argument("--repeat", type=int, default=1, help="run the configurations this often, reversing the order")
    parser.add_argument("--old", action="store_true", help="also the old default: one peer's batch for the swarm")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "RESULTS.md")
    args = parser.parse_args()
    peers, steps = (2, 6) if args.smoke else (args.peers, args.steps)
    configs = [("default", "")]
    if not args.smoke:  # the smoke checks the default alone: the explicit target is the same code with a number
        configs.append((f"{peers} x {args.batch}", str(peers * args.batch)))
    if args.old:
        configs.append((f"{args.batch} (old default)", str(args.batch)))
    load = os.getloadavg()
    results = []
    order = [c for rep in range(args.repeat) for c in (configs if rep % 2 == 0 else configs[::-1])]  # ABBA...
    for name, target in order:
        results.append(run(name, target, peers, args.stages, args.batch, steps, args.seconds))
        results[-1]["order"] = len(results)
        print(name, {k: v for k, v in results[-1].items() if k not in ("losses", "failures")}, flush=True)
        for failure in results[-1]["failures"]:
            print("  failed round:", failure, flush=True)
    k = min(n for r in results for n in r["steps"])
    rows = [row(r, k) for r in results]
    for line in table(HEADER, rows):
        print(line)
    after = os.getloadavg()
    save_data("default_target", results, args.out.parent / "results")
    command = " ".join(["python benchmarks/default_target.py", *sys.argv[1:]])
    lines = [
        "## The default target batch size against N x the per-peer batch (`benchmarks/default_target.py`, issue 27)",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, `{command}`, 2-core CPU shared with other work: load "
        f"average {load[0]:.1f} before, {after[0]:.1f} after. The demo's swarm (examples/gpt.py: d_model 64, 4 "
        f"layers, block 64), {peers} peers on {args.stages} stages, batch {args.batch}, matchmaking_time 1 s, "
        f"averaging_timeout 5 s, update_period 2 s, rebalancing off; one swarm at a time, each cut at "
        f"{args.seconds:.0f} s (start-up included) or {steps} steps per peer. The first peer starts the swarm, the "
        "others join it together. Samples/s: all trainers together, while every peer trains.",
        "",
        *table(HEADER, rows),
    ]
    update_section("default_target", lines, args.out)


if __name__ == "__main__":
    main()
