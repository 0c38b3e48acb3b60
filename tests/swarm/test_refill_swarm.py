"""A stage whose last peer died is refilled by rebalancing, in a real swarm on loopback: a peer of another stage
moves there within a few rounds (a stage without peers has capacity 0 and is refilled first, ignoring the
cool-down), serves it from freshly initialised blocks (nobody holds the stage, and the swarm saved no checkpoint),
and the trainer, which waited for the stage, completes all its steps."""

from __future__ import annotations

import re
import signal
import time
from typing import Optional

from helpers import FAST, SMALL_GPT, activation, history
from helpers.raw_client import RawClient, wait_until_serving, wire

from lightning_swarm import discovery
from lightning_swarm.discovery import PeerRecord, PeerState
from lightning_swarm.node import SwarmNode
from lightning_swarm.rebalancing import Move, make_plan

PERIOD = 3.0  # seconds between rebalancing rounds of the peers that may move
MOVE = "Rebalancing: moving from stage 0 to stage 1"


def serving_stage(log: str) -> Optional[int]:
    """The stage a peer serves now, by its log (its latest "Serving stage k" line)."""
    found = re.findall(r"Serving stage (\d+) of", log)
    return int(found[-1]) if found else None


def peer_id(peer) -> str:
    return peer.addresses()[0].rsplit("/", 1)[-1]


def measured(node: SwarmNode, run_id: str, stage: int, peers: list[str]) -> bool:
    """Whether every peer of ``peers`` (peer ids) publishes a measured throughput at ``stage``."""
    records = discovery.fetch_stage(node, run_id, stage)
    return all(p in records and records[p].throughput > 0 for p in peers)


def test_a_plan_refills_an_empty_stage_with_a_peer_that_moves():
    """In one process, the records of the swarm below after the kill: the fastest peer of stage 0 does not move
    (its record says so), so the plan refills stage 1 with a peer that does, in every round; records round-trip
    the flag, and a record without it (an older peer's) is one of a peer that moves."""
    records = [PeerRecord("trainer", 0, PeerState.SERVING, 90.0, 0, True, "127.0.0.1:1", movable=False)]
    records += [PeerRecord(p, 0, PeerState.SERVING, 40.0, 0) for p in ("a", "b")]
    for record in records:
        assert PeerRecord.from_value(record.peer_id, 0, record.to_value()) == record
    assert PeerRecord.from_value("x", 0, (1, 1.0, 0, 0)).movable
    assert PeerRecord.from_value("x", 0, (1, 1.0, 0, 0, "", "yes")) is None
    swarm = [{r.peer_id: r for r in records}, {}]
    for round_ in range(20):
        plan = make_plan(swarm, round_)
        assert len(plan.moves) == 1 and plan.moves[0] in (Move("a", 0, 1), Move("b", 0, 1)), plan
    movable = [PeerRecord(r.peer_id, 0, r.state, r.throughput, 0) for r in records]  # as before the fix
    assert make_plan([{r.peer_id: r for r in movable}, {}]).moves == (Move("trainer", 0, 1),)


def test_the_stage_of_a_killed_last_peer_is_refilled_by_a_peer_that_moves(swarm, tmp_path):
    """Stage 0: two serve-only peers that may move, throttled to a 24th of their speed, and the trainer (its
    rebalancing off: it never moves), throttled to a quarter; stage 1: one serve-only peer that never moves. Stage 0
    is the bottleneck, so nobody moves before the kill (the peers' throughputs are measured before the trainer
    joins: a peer not measured yet counts as the median one; a throttle of 12 left too little margin on a loaded
    machine, where the stage-1 peer, measured while busy, showed 0.45 of its nominal speed against the movers' one
    quiet measurement, and a mover moved), and the trainer is the fastest peer of stage 0: the
    peer whose move best refills stage 1, were it counted as one that moves (before the fix the plan chose it in
    every round, it never moved, and the trainer waited for stage 1 until stage_wait_timeout). kill -9 of the
    stage-1 peer leaves stage 1 without peers: one of the movers moves there within a few rounds, serves it from
    freshly initialised blocks (nobody holds it and the swarm saved no checkpoint), and the trainer completes all
    its steps."""
    steps = 15
    env = {**FAST, "SWARM_NUM_STAGES": "2", "SWARM_TARGET_BATCH_SIZE": "8", "SWARM_STAGE_WAIT_TIMEOUT": "240"}
    fixed = {**env, "SWARM_REBALANCE_PERIOD": "0"}
    movers = ("a", "b")
    mover_env = {**env, "SWARM_ROLE": "serve", "SWARM_REBALANCE_PERIOD": str(PERIOD), "SWARM_THROTTLE": "24"}
    swarm.start_together(
        {
            "last": (SMALL_GPT, {**fixed, "SWARM_ROLE": "serve", "SWARM_STAGE": "1"}),
            **{name: (SMALL_GPT, {**mover_env, "SWARM_STAGE": "0"}) for name in movers},
        }
    )
    stages = {"last": 1, "a": 0, "b": 0}
    node = SwarmNode(initial_peers=swarm.peers["last"].addresses()).start()
    try:  # a forward each: measured before the trainer joins
        for name, stage in stages.items():
            client = RawClient(node, swarm.peers[name].addresses()[0], swarm.run_id, stage=stage)
            wait_until_serving(client, swarm.peers[name])
            client.call_like_a_router("forward", [wire(activation())])
        deadline = time.monotonic() + 60
        while not all(measured(node, swarm.run_id, k, [peer_id(swarm.peers[n])]) for n, k in stages.items()):
            assert time.monotonic() < deadline, "the peers' throughputs never showed in their records"
            time.sleep(0.2)
    finally:
        node.shutdown()

    record = tmp_path / "trainer.json"
    trainer = swarm.start(
        "trainer",
        [*SMALL_GPT, "--max-steps", str(steps), "--history", str(record)],
        env={**fixed, "SWARM_STAGE": "0", "SWARM_THROTTLE": "4"},
    )
    deadline = time.monotonic() + 120
    while not (record.exists() and history(record)["steps"] >= 5):
        assert time.monotonic() < deadline and trainer.alive(), trainer.log()[-3000:]
        time.sleep(0.2)
    assert not [name for name in movers if "Rebalancing: moving" in swarm.peers[name].log()], "moved before the kill"
    swarm.signal("last", signal.SIGKILL)
    killed_at = time.monotonic()

    # the dead peer's record expires within 2 update periods; a round that starts after that plans the refill
    deadline = killed_at + 10 * PERIOD + 60
    while not (moved := [name for name in movers if MOVE in swarm.peers[name].log()]):
        assert time.monotonic() < deadline, "nobody moved to stage 1:\n" + "\n".join(
            f"---- {name}:\n{swarm.peers[name].log()[-2000:]}" for name in (*movers, "trainer")
        )
        assert trainer.alive(), trainer.log()[-3000:]
        time.sleep(0.2)
    moved_after = time.monotonic() - killed_at
    mover = swarm.peers[moved[0]]
    while serving_stage(mover.log()) != 1:
        assert time.monotonic() < deadline and mover.alive(), mover.log()[-3000:]
        time.sleep(0.2)
    served_after = time.monotonic() - killed_at
    print(f"{moved[0]} moved to stage 1 {moved_after:.1f}s after the kill and served it {served_after:.1f}s after")
    assert "Stage 1 is served by" not in mover.log(), "nobody held stage 1: the mover had no state to download"

    assert swarm.wait("trainer", timeout=240) == 0, trainer.log()[-3000:]
    final = history(record)
    assert final["steps"] == steps and len(final["losses"]) == steps
    assert "Rebalancing" not in trainer.log()  # rebalancing off: the trainer never moved
