"""Preemption and crashes in real swarms on loopback: a peer told to stop leaves within its bound and leaves
nothing behind, and training survives a seeded schedule of kills and restarts."""

from __future__ import annotations

import csv
import os
import random
import signal
import statistics
import threading
import time

import psutil
import pytest
from helpers import EVENT_PEER, FAST, SMALL_GPT, history

from lightning_swarm.launch import LocalSwarm

LEAVE_TIMEOUT = 30.0


def processes_in_group(pgid: int) -> list[int]:
    """Live processes of a peer's process group (LocalSwarm starts each peer in a session of its own)."""
    found = []
    for process in psutil.process_iter(["status"]):
        try:
            if os.getpgid(process.pid) == pgid and process.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(process.pid)
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
    return found


def steps_of(path) -> int:
    try:
        return history(path)["steps"]
    except (OSError, ValueError, KeyError):
        return 0


def wait_for_steps(swarm: LocalSwarm, trainer: str, path, steps: int, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while steps_of(path) < steps:
        assert swarm.peers[trainer].alive(), swarm.peers[trainer].log()[-3000:]
        assert time.monotonic() < deadline, f"{trainer} did not reach step {steps}"
        time.sleep(0.2)


def test_sigterm_mid_training_leaves_in_time_and_loses_no_microbatch(swarm, tmp_path):
    """A stage-1 peer gets SIGTERM while a trainer sends it work: it finishes what it was sent, announces it is
    leaving, exits with code 0 well within leave_timeout, and leaves no process (p2pd included); the trainer
    completes every step."""
    env = {**FAST, "SWARM_NUM_STAGES": "2", "SWARM_TARGET_BATCH_SIZE": "16", "SWARM_LEAVE_TIMEOUT": str(LEAVE_TIMEOUT)}
    env.update(SWARM_ROLE="serve", SWARM_REBALANCE_PERIOD="0")
    record = tmp_path / "trainer.json"
    args = [*SMALL_GPT, "--max-steps", "60", "--history", str(record)]
    _, leaver, _, _ = swarm.start_together(  # the first alone, creating the swarm; the others together
        {
            "s0": (SMALL_GPT, {**env, "SWARM_STAGE": "0"}),
            "s1a": (SMALL_GPT, {**env, "SWARM_STAGE": "1"}),
            "s1b": (SMALL_GPT, {**env, "SWARM_STAGE": "1"}),
            "trainer": (args, {**env, "SWARM_ROLE": "drive"}),
        }
    )
    wait_for_steps(swarm, "trainer", record, 10)

    sent = time.monotonic()
    swarm.signal("s1a", signal.SIGTERM)
    code = swarm.wait("s1a", timeout=LEAVE_TIMEOUT + 10)
    took = time.monotonic() - sent
    assert code == 0, leaver.log()[-3000:]
    assert took < LEAVE_TIMEOUT, f"left after {took:.1f}s"
    deadline = time.monotonic() + 5
    while (left := processes_in_group(leaver.process.pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"the peer left processes behind: {left}"
    assert "Received signal 15" in leaver.log()

    assert swarm.wait("trainer", timeout=240) == 0, swarm.peers["trainer"].log()[-3000:]
    run = history(record)
    assert run["steps"] == 60 and all(loss == loss for loss in run["losses"])  # every step completed, finite
    print(f"SIGTERM to exit: {took:.1f}s; trainer failovers {run['failovers']}, recomputed {run['recomputed']}")


@pytest.mark.timeout(600)
def test_chaos_kills_and_restarts(swarm, tmp_path):
    """While a trainer runs a fixed number of steps, a seeded schedule kills stage peers (SIGKILL and SIGTERM, 6
    times) and starts replacements. A stage keeps at least one live, serving peer (a stage whose last peer died
    would restart from scratch). The run completes every step, the loss falls, peers told to stop leave in time, and
    nothing hangs."""
    rng = random.Random(7)
    env = {**FAST, "SWARM_NUM_STAGES": "2", "SWARM_TARGET_BATCH_SIZE": "16", "SWARM_LEAVE_TIMEOUT": str(LEAVE_TIMEOUT)}
    env.update(SWARM_ROLE="serve", SWARM_REBALANCE_PERIOD="0", SWARM_REQUEST_TIMEOUT="5.0", SWARM_BAN_TIMEOUT="5.0")
    stage_of = {"a0": 0, "b0": 0, "a1": 1, "b1": 1}
    record = tmp_path / "trainer.json"
    max_steps, events = 90, 6  # the last kill at step 60
    # together (the first alone, creating the swarm): started one by one, they took half a minute on 2 busy cores
    swarm.start_together(
        {
            **{name: (SMALL_GPT, {**env, "SWARM_STAGE": str(stage)}) for name, stage in stage_of.items()},
            "trainer": (
                [*SMALL_GPT, "--max-steps", str(max_steps), "--lr", "1e-2", "--history", str(record)],
                {**env, "SWARM_ROLE": "drive"},
            ),
        }
    )
    wait_for_steps(swarm, "trainer", record, 10)

    kills: list[tuple[float, str, str]] = []  # (time, signal, peer)
    exit_codes: dict[str, int] = {}  # of the peers told to leave with SIGTERM
    starting: list[threading.Thread] = []
    for i in range(events):
        wait_for_steps(swarm, "trainer", record, 10 + 10 * i)
        while True:  # a victim whose stage keeps another live, serving peer
            # a replacement may not be launched yet, or may still be downloading its stage (reachable, not serving:
            # killing the last serving peer then leaves the trainer only a dead one to retry, which fails its
            # step); and Popen.poll() says "running" while another thread polls
            killed = {victim for _, _, victim in kills}
            peers = {n: swarm.peers.get(n) for n in stage_of if n not in killed}
            alive = {
                n: stage_of[n]
                for n, p in peers.items()
                if p is not None and p.alive() and f"Serving stage {stage_of[n]}" in p.log()
            }
            victims = [n for n, s in alive.items() if sum(1 for t in alive.values() if t == s) >= 2]
            if victims:
                break
            time.sleep(0.5)
        victim = rng.choice(sorted(victims))
        how = rng.choice(["SIGKILL", "SIGTERM"])
        kills.append((time.time(), how, victim))
        swarm.signal(victim, getattr(signal, how))
        name = f"r{i}"
        stage_of[name] = stage_of[victim]
        thread = threading.Thread(
            target=swarm.start, args=(name, SMALL_GPT, {**env, "SWARM_STAGE": str(stage_of[name])})
        )
        thread.start()
        starting.append(thread)
        if how == "SIGTERM":
            exit_codes[victim] = swarm.wait(victim, timeout=LEAVE_TIMEOUT + 10)
    for thread in starting:
        thread.join(timeout=180)

    assert swarm.wait("trainer", timeout=600) == 0, swarm.peers["trainer"].log()[-3000:]
    run = history(record)
    assert run["steps"] == max_steps  # every step completed (retried where a peer died under it)
    losses = run["losses"]
    assert statistics.mean(losses[-20:]) < statistics.mean(losses[:20]) - 0.3, (losses[:20], losses[-20:])
    assert set(exit_codes.values()) <= {0}, exit_codes  # each peer told to leave left cleanly, in time
    for victim in exit_codes:
        assert not processes_in_group(swarm.peers[victim].process.pid), f"{victim} left processes behind"

    times = run["times"]
    recover = [next((t for t in times if t > at), times[-1]) - at for at, _, _ in kills]
    before = (times[9] - times[0]) / 9
    during = (times[-1] - times[10]) / (len(times) - 11)
    print(
        f"{len(kills)} kills ({sum(h == 'SIGKILL' for _, h, _ in kills)} SIGKILL), failovers {run['failovers']}, "
        f"recomputed {run['recomputed']}; next step after a kill: median {statistics.median(recover):.2f}s, "
        f"max {max(recover):.2f}s; seconds per step before the chaos {before:.3f}, during {during:.3f}; "
        f"exit codes after SIGTERM {exit_codes}"
    )


def test_a_stage_that_lost_all_its_peers_is_restored_from_the_latest_checkpoint(swarm, tmp_path):
    """A trainer saves checkpoints (ModelCheckpoint) while the only peer of stage 1 serves; that peer is killed;
    the peer that serves stage 1 next finds no live peer of it and restores it from the swarm's latest checkpoint,
    so training goes on from there, not from scratch."""
    out = tmp_path / "recorder"
    env = {**FAST, "SWARM_NUM_STAGES": "2", "SWARM_TARGET_BATCH_SIZE": "8", "SWARM_REBALANCE_PERIOD": "0"}
    serve = {**env, "SWARM_ROLE": "serve", "SWARM_STAGE": "1"}
    swarm.start("x", SMALL_GPT, env=serve)
    recorder = swarm.start("r", [str(out)], env={**env, "SWARM_STAGE": "0"}, script=[EVENT_PEER])
    deadline = time.monotonic() + 180
    while len(list((out / "checkpoints").glob("*.ckpt"))) < 2:  # written every 10 steps
        assert recorder.alive() and time.monotonic() < deadline, recorder.log()[-3000:]
        time.sleep(0.5)
    swarm.signal("x", signal.SIGKILL)
    time.sleep(3.0)  # the trainer notices stage 1 is gone and waits for it
    killed_at_step = int((out / "steps").read_text())
    y = swarm.start("y", SMALL_GPT, env=serve)
    deadline = time.monotonic() + 120
    while int((out / "steps").read_text()) < killed_at_step + 10:
        assert recorder.alive() and time.monotonic() < deadline, recorder.log()[-3000:]
        time.sleep(0.5)
    restored = [line for line in y.log().splitlines() if "restored from checkpoint" in line]
    assert restored and "Stage 1 had no live peer" in restored[0], y.log()[-3000:]

    swarm.signal("r", signal.SIGTERM)
    assert swarm.wait("r", timeout=120) == 0, recorder.log()[-3000:]
    (metrics,) = (out / "log").glob("version_*/metrics.csv")
    losses = [float(row["train_loss"]) for row in csv.DictReader(metrics.open()) if row.get("train_loss")]
    after = losses[killed_at_step : killed_at_step + 5]
    print(f"{restored[0]}; loss at the start {losses[:5]}, after the restore {after}")
    assert statistics.mean(after) < statistics.mean(losses[:5]) - 0.3  # not back to the untrained loss
