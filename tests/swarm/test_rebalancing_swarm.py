"""Rebalancing and unequal peers in real swarms on loopback: peers move to the bottleneck, serve their new stage
with its current parameters, stay put once balanced, and routers give slow peers a fair share of the work."""

from __future__ import annotations

import math
import time

from helpers import FAST, history
from helpers.oracles import best_allocation
from helpers.raw_client import RawClient, bytes_of, wait_until_serving

from lightning_swarm import discovery
from lightning_swarm.discovery import PeerState
from lightning_swarm.node import SwarmNode
from lightning_swarm.rebalancing import capacities

PERIOD = 8.0  # seconds between rebalancing rounds
THREE_BLOCKS = ["--d-model", "32", "--n-layer", "3", "--n-head", "2", "--block-size", "32", "--batch-size", "8"]


def peer_id(peer) -> str:
    return peer.addresses()[0].rsplit("/", 1)[-1]


def allocation(node: SwarmNode, run_id: str, num_stages: int) -> tuple[dict[str, int], dict[str, float]]:
    """Serving peers' stages and throughputs (a peer not measured yet counts as the median, as planners count it)."""
    records = [r for stage in discovery.fetch_swarm(node, run_id, num_stages) for r in stage.values()]
    serving = {r.peer_id: r for r in records if r.state == PeerState.SERVING}
    measured = sorted(r.throughput for r in serving.values() if r.throughput > 0) or [1.0]
    median = measured[len(measured) // 2]
    return {p: r.stage for p, r in serving.items()}, {p: r.throughput or median for p, r in serving.items()}


def test_skewed_swarm_rebalances_and_movers_serve_their_new_stage_exactly(swarm, tmp_path):
    """Six serve-only peers placed 4/1/1 on 3 stages. The swarm reaches 90% of the best allocation's throughput with
    the fewest moves (two peers, each moving once); then nobody moves again for three rounds; each peer that moved
    serves exactly the state of the peer already serving its new stage (which its own, freshly initialised blocks are
    not). No trainer runs, so no peer has a measured throughput and all count as equal. How many rounds the plan
    takes is tested in test_rebalancing.py, on the plan alone: here a round's moves take as long as the machine
    makes them (a download, a busy DHT), so the test waits for the outcome and counts moves, not seconds. The
    download of a trained state takes the same path as a late joiner's, tested in test_swarm.py."""
    env = {**FAST, "SWARM_NUM_STAGES": "3", "SWARM_COMPRESSION": "none", "SWARM_TARGET_BATCH_SIZE": "8"}
    env.update(SWARM_REBALANCE_PERIOD=str(PERIOD), SWARM_ROLE="serve")
    names = {"e": 1, "f": 2, "a": 0, "b": 0, "c": 0, "d": 0}
    # together, within a newcomer's cool-down: nobody moves before 4/1/1
    swarm.start_together({name: (THREE_BLOCKS, {**env, "SWARM_STAGE": str(stage)}) for name, stage in names.items()})
    ids = {peer_id(swarm.peers[name]): name for name in names}
    node = SwarmNode(initial_peers=swarm.peers["e"].addresses()).start()
    try:
        deadline = time.monotonic() + 120  # the deadlines only stop a test that hangs
        while sorted(allocation(node, swarm.run_id, 3)[0].values()) != [0, 0, 0, 0, 1, 2]:
            assert time.monotonic() < deadline, "the skewed start never showed in the records"
            time.sleep(0.5)
        skewed_at = time.monotonic()
        deadline = skewed_at + 20 * PERIOD
        history_of = {name: [stage] for name, stage in names.items()}
        balanced_round = None  # the rebalancing round (rounds are aligned to the clock) in which it was balanced
        while balanced_round is not None or time.monotonic() < deadline:
            stages, throughput = allocation(node, swarm.run_id, 3)
            for peer, stage in stages.items():
                if history_of[ids[peer]][-1] != stage:
                    history_of[ids[peer]].append(stage)
            ratio = min(capacities(stages, throughput, 3)) / best_allocation(throughput, 3) if len(stages) == 6 else 0
            if ratio >= 0.9 and balanced_round is None:
                balanced_round = int(time.time() // PERIOD)
                took = time.monotonic() - skewed_at
                print(f"balanced after {took:.1f}s: {sorted(stages.values())}, ratio {ratio:.3f}")
            if balanced_round is not None and int(time.time() // PERIOD) > balanced_round + 3:
                break  # three more whole rounds watched
            time.sleep(0.5)
        assert balanced_round is not None, f"never balanced: {history_of}"
        assert ratio >= 0.9, f"left the balanced allocation: {history_of}"
        movers = [name for name, stages in history_of.items() if len(stages) > 1]
        # the fewest moves: one peer of stage 0 to each other stage, each moving once
        assert sorted(history_of[name] for name in movers) == [[0, 1], [0, 2]], f"moves: {history_of}"
        print(f"stage history per peer: {history_of}")

        for name in movers:
            stage = history_of[name][-1]
            on_stage = sorted((len(s), n) for n, s in history_of.items() if s[-1] == stage and n != name)
            elder = on_stage[0][1]  # preferably one that served that stage all along
            clients = [RawClient(node, swarm.peers[n].addresses()[0], swarm.run_id, stage=stage) for n in (elder, name)]
            wait_until_serving(clients[1], swarm.peers[name])
            expected, served = clients[0].state(), clients[1].state()
            assert bytes_of(served) == bytes_of(expected), f"{name} does not serve stage {stage}'s state"
            assert clients[1].info()["epoch"] == clients[0].info()["epoch"]
    finally:
        node.shutdown()


def test_a_throttled_peer_gets_work_in_proportion_to_its_throughput(swarm, tmp_path):
    """Two peers serve stage 0, one throttled to a third of its speed: the routers send it a share of the
    microbatches that matches its share of the stage's throughput (as the peers published it side by side, averaged
    over the run: on a shared machine it moves), within three standard deviations of that many random picks; far from
    the half that picking blindly would give it (the throttle shows in that share: well below half). The calls are
    counted from the first snapshot of the trainer's history written after both peers published a throughput: before
    that, a peer of no published throughput counts as the fastest, and on a loaded machine the first picks were
    blind for seconds."""
    model = ["--d-model", "128", "--n-layer", "4", "--n-head", "4", "--block-size", "64", "--batch-size", "16"]
    env = {**FAST, "SWARM_NUM_STAGES": "2", "SWARM_REBALANCE_PERIOD": "0", "SWARM_TARGET_BATCH_SIZE": "64"}
    env["SWARM_MICROBATCHES"] = "1"  # one pick at a time: concurrent picks see each other's calls in flight
    env["SWARM_ROLE"] = "serve"
    swarm.start("fast", model, env={**env, "SWARM_STAGE": "0"})
    swarm.start("slow", model, env={**env, "SWARM_STAGE": "0", "SWARM_THROTTLE": "3"})
    swarm.start("last", model, env={**env, "SWARM_STAGE": "1"})
    fast, slow = peer_id(swarm.peers["fast"]), peer_id(swarm.peers["slow"])
    node = SwarmNode(initial_peers=swarm.peers["last"].addresses()).start()

    def slow_share() -> float | None:
        """The throttled peer's share of the stage's published throughput; None until both have published one."""
        records = discovery.fetch_stage(node, swarm.run_id, 0)
        if slow in records and fast in records and records[slow].throughput and records[fast].throughput:
            return records[slow].throughput / (records[slow].throughput + records[fast].throughput)
        return None

    record = tmp_path / "trainer.json"
    args = [*model, "--max-steps", "70", "--history", str(record)]
    shares, baseline = [], None  # the calls per peer in the first snapshot taken after both peers published
    try:
        deadline = time.monotonic() + 900  # only stops a test that hangs
        trainer = swarm.start("trainer", args, env={**env, "SWARM_ROLE": "drive"})
        while slow_share() is None:
            assert trainer.alive() and time.monotonic() < deadline, trainer.log()[-3000:]
            time.sleep(0.5)
        published_at_step = history(record)["steps"] if record.exists() else 0
        while trainer.alive():
            assert time.monotonic() < deadline, trainer.log()[-3000:]
            if baseline is None and record.exists() and (snapshot := history(record))["steps"] > published_at_step:
                baseline = snapshot["calls_per_peer"]
            if baseline is not None and (share := slow_share()) is not None:
                shares.append(share)
            time.sleep(1.0)
    finally:
        node.shutdown()
    assert swarm.wait("trainer", timeout=30) == 0, trainer.log()[-3000:]
    assert baseline is not None and shares, "the trainer ended before both peers had published a throughput"
    total = history(record)["calls_per_peer"]
    calls = {peer: total.get(peer, 0) - baseline.get(peer, 0) for peer in (slow, fast)}
    throughput_share = sum(shares) / len(shares)
    work_share = calls[slow] / (calls[slow] + calls[fast])
    print(f"throttled peer: {throughput_share:.3f} of the throughput, {work_share:.3f} of the calls ({calls})")
    # each microbatch's forward is a random choice (its share is binomial around the throughput share), and its
    # backward goes where the forward went: half the calls are picks
    picks = (calls[slow] + calls[fast]) / 2
    spread = 3 * math.sqrt(throughput_share * (1 - throughput_share) / picks)
    assert abs(work_share - throughput_share) <= spread < 0.5 - throughput_share


def test_newcomers_that_took_the_same_stage_end_up_serving_every_stage(swarm, tmp_path):
    """The outcome of two newcomers racing for the same empty stage, forced: three trainers on three stages start
    together, two of them on stage 0, none on stage 2. While they wait for stage 2, the rebalancing plan moves one
    of the two there (a stage without peers is refilled without waiting for the newcomers' cool-down), and all
    three train to the end (before, every peer waited for stage 2 until join_timeout and failed)."""
    env = {**FAST, "SWARM_NUM_STAGES": "3", "SWARM_TARGET_BATCH_SIZE": "8", "SWARM_REBALANCE_PERIOD": "3"}
    names = {"a": 0, "b": 0, "c": 1}
    args = [*THREE_BLOCKS, "--max-steps", "5"]
    swarm.start_together({name: (args, {**env, "SWARM_STAGE": str(stage)}) for name, stage in names.items()})
    started = time.monotonic()
    for name in names:
        assert swarm.wait(name, timeout=float(FAST["SWARM_JOIN_TIMEOUT"]) + 60) == 0, swarm.peers[name].log()[-3000:]
    took = time.monotonic() - started
    moved = [name for name in names if "Rebalancing: moving from stage 0 to stage 2" in swarm.peers[name].log()]
    print(f"two newcomers on stage 0 of 3: {moved} moved to stage 2; all done {took:.0f}s after they joined")
    assert len(moved) == 1
