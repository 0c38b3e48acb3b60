"""A stage that loses its last peer: trainers wait for it (and say so), and give up only after stage_wait_timeout;
failed trainers leave at once; a peer killed by SIGKILL leaves no helper process behind."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from datetime import datetime

import psutil
from helpers import FAST, SMALL_GPT, running

from lightning_swarm.client.routing import WAIT_LOG_PERIOD

WAIT_LINE = re.compile(r"Stage 1 of run '[^']+' has no live peer: waiting for one")
# the time stamp a peer's log line starts with (lightning_swarm.logs: "Nov 23 13:14:05.123 [WARNING] ...")
STAMPED_WAIT_LINE = re.compile(r"^(\w{3} +\d+ \d\d:\d\d:\d\d\.\d{3}) .*" + WAIT_LINE.pattern, re.MULTILINE)


def wait_line_times(log: str) -> list[float]:
    """When the peer logged each wait line (its own clock, as time.time())."""
    year = datetime.now().year
    stamps = [datetime.strptime(f"{year} {s}", "%Y %b %d %H:%M:%S.%f") for s in STAMPED_WAIT_LINE.findall(log)]
    return [stamp.timestamp() for stamp in stamps]


def steps_done(path) -> int:
    try:
        with open(path) as f:
            return json.load(f)["steps"]
    except (OSError, ValueError, KeyError):
        return 0


def start_and_kill_stage1(swarm, tmp_path, env: dict, steps: int, trainers: tuple = ("trainer",)):
    """Trainers (stage 0) and the only stage-1 peer; once every trainer made progress, kill -9 the stage-1 peer
    with its daemons."""
    record = tmp_path / "trainer.json"
    peers = {"stage1": (SMALL_GPT, {**env, "SWARM_ROLE": "serve", "SWARM_STAGE": "1"})}
    for name in trainers:
        args = [*SMALL_GPT, "--max-steps", str(steps), "--history", str(tmp_path / f"{name}.json")]
        peers[name] = (args, {**env, "SWARM_STAGE": "0"})
    swarm.start_together(peers)  # stage1 alone first, creating the swarm; then the trainers together
    deadline = time.monotonic() + 120
    for name in trainers:
        while steps_done(tmp_path / f"{name}.json") < 5:  # History writes every 5 steps
            assert time.monotonic() < deadline and swarm.peers[name].alive(), swarm.peers[name].log()[-3000:]
            time.sleep(0.2)
    os.killpg(swarm.peers["stage1"].process.pid, signal.SIGKILL)  # the peer and its p2pd: a machine lost
    swarm.peers["stage1"].process.wait(timeout=30)
    return record, time.monotonic()


def test_trainer_waits_for_a_stage_with_no_peer_and_resumes(swarm, tmp_path):
    """The only stage-1 peer dies: the trainer waits (logging it at most once every 10 s, as its own log's time
    stamps show), a new stage-1 peer starts once the trainer logged its second wait line, the trainer logs no wait
    line after its first step with the new peer, and finishes all its steps."""
    env = {**FAST, "SWARM_NUM_STAGES": "2", "SWARM_TARGET_BATCH_SIZE": "8", "SWARM_STAGE_WAIT_TIMEOUT": "120"}
    steps = 40
    record, killed_at = start_and_kill_stage1(swarm, tmp_path, env, steps)
    trainer = swarm.peers["trainer"]
    deadline = time.monotonic() + 240  # only stops a test that hangs
    while len(WAIT_LINE.findall(trainer.log())) < 2:  # the second comes after a wait-log period, not every poll
        assert time.monotonic() < deadline and trainer.alive(), trainer.log()[-3000:]
        time.sleep(0.2)
    noticed = time.monotonic() - killed_at
    assert trainer.alive(), trainer.log()[-3000:]
    waited_steps = steps_done(record)

    swarm.start("stage1_new", SMALL_GPT, env={**env, "SWARM_ROLE": "serve", "SWARM_STAGE": "1"})
    restarted_at, restarted_wall = time.monotonic(), time.time()
    assert swarm.wait("trainer", timeout=300) == 0, trainer.log()[-3000:]
    lines = WAIT_LINE.findall(trainer.log())
    with open(record) as f:
        final = json.load(f)
    recovered = min(t for t in final["times"] if t > restarted_wall) - restarted_wall
    print(
        f"stage wait: two wait lines {noticed:.1f}s after the kill, {len(lines)} wait line(s) over "
        f"{restarted_at - killed_at:.0f}s without a stage-1 peer; first step {recovered:.1f}s after the new peer was "
        f"reachable, all steps done {time.monotonic() - restarted_at:.1f}s after"
    )
    assert final["steps"] == steps and waited_steps < steps
    # the trainer logs its wait at most once per period, and waits until the new peer serves: no wait line after its
    # first step with the new peer (both times from the trainer's clock)
    times = wait_line_times(trainer.log())
    assert len(times) == len(lines) >= 2, trainer.log()[-3000:]
    gaps = [later - earlier for earlier, later in zip(times, times[1:])]
    assert min(gaps) >= WAIT_LOG_PERIOD - 0.002, gaps  # stamps are to the millisecond
    assert times[-1] < min(t for t in final["times"] if t > restarted_wall), (times, final["times"])


def test_trainer_gives_up_after_stage_wait_timeout(swarm, tmp_path):
    """With a short stage_wait_timeout, a trainer whose stage 1 has no peer stops with a clear
    StageUnavailableError after about that time."""
    timeout = 6.0
    env = {**FAST, "SWARM_NUM_STAGES": "2", "SWARM_TARGET_BATCH_SIZE": "8", "SWARM_STAGE_WAIT_TIMEOUT": str(timeout)}
    env["SWARM_LINGER"] = "5"
    _, killed_at = start_and_kill_stage1(swarm, tmp_path, env, steps=1000)
    trainer = swarm.peers["trainer"]
    code = swarm.wait("trainer", timeout=120)
    took = time.monotonic() - killed_at
    log = trainer.log()
    print(f"stage wait timeout {timeout:g}s: the trainer exited {took:.1f}s after the kill")
    assert code != 0
    assert WAIT_LINE.search(log), log[-3000:]
    assert re.search(r"StageUnavailableError: Stage 1 of run '[^']+' has had no live peer for \d+s", log), log[-3000:]
    assert "stage_wait_timeout=6s" in log
    assert timeout <= took < timeout + 60


def test_failed_trainers_leave_at_once(swarm, tmp_path):
    """Two trainers lose their only stage-1 peer: each says why as soon as stage_wait_timeout is over, tells the
    swarm it no longer trains, and exits within seconds, instead of lingering (up to ``linger``) for the other
    failed trainer, whose record still said it trained."""
    timeout = 6.0
    env = {**FAST, "SWARM_NUM_STAGES": "2", "SWARM_TARGET_BATCH_SIZE": "8", "SWARM_STAGE_WAIT_TIMEOUT": str(timeout)}
    _, killed_at = start_and_kill_stage1(swarm, tmp_path, env, steps=1000, trainers=("trainer", "trainer2"))
    took = {}
    for name in ("trainer", "trainer2"):
        assert swarm.wait(name, timeout=float(FAST["SWARM_LINGER"]) + 60) != 0
        took[name] = time.monotonic() - killed_at
    print(f"stage wait timeout {timeout:g}s, linger {FAST['SWARM_LINGER']}s: trainers exited after {took}")
    for name in took:
        log = swarm.peers[name].log()
        assert took[name] < timeout + 45, log[-3000:]  # linger is 120 s: never waited out
        assert re.search(r"Training failed, leaving the swarm now: StageUnavailableError: Stage 1", log), log[-3000:]
        assert "Training done: serving on" not in log


def test_a_peer_killed_by_sigkill_leaves_no_helper_process(swarm):
    """The OOM killer or a crash ends a peer with SIGKILL, which runs no cleanup: its DHT process, its averagers and
    its libp2p daemon exit by themselves (before, they lived on as orphans, kept its identity reachable over libp2p,
    so that calls to it waited for their timeout instead of failing at once, and held their memory)."""
    env = {**FAST, "SWARM_ROLE": "serve", "SWARM_NUM_STAGES": "2", "SWARM_STAGE": "1"}
    peer = swarm.start("stage1", SMALL_GPT, env=env)
    deadline, helpers = time.monotonic() + 120, []
    while sum(h.name() == "python" for h in helpers) < 2:  # the DHT process and the stage's averager
        assert time.monotonic() < deadline and peer.alive(), peer.log()[-3000:]
        time.sleep(0.5)
        helpers = [h for h in psutil.Process(peer.process.pid).children(recursive=True) if running(h)]
    assert "p2pd" in [h.name() for h in helpers]
    swarm.signal("stage1", signal.SIGKILL)
    deadline = time.monotonic() + 60
    while left := [f"{h.pid} {h.name()}" for h in helpers if running(h)]:
        assert time.monotonic() < deadline, f"helpers of the killed peer still running after 60 s: {left}"
        time.sleep(0.5)
