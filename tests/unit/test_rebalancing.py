"""The rebalancing plan, in-process: which peers move, when, and whether peers agree without a coordinator."""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers.oracles import best_allocation

from lightning_swarm import rebalancing
from lightning_swarm.discovery import PeerRecord, PeerState
from lightning_swarm.rebalancing import Plan, Rebalancer, bottleneck, capacities, make_plan


def records(allocation: dict[str, int], throughput: dict[str, float], num_stages: int, **states) -> list[dict]:
    swarm = [{} for _ in range(num_stages)]
    for peer, stage in allocation.items():
        swarm[stage][peer] = PeerRecord(peer, stage, states.get(peer, PeerState.SERVING), throughput[peer], 0)
    return swarm


def rebalance(allocation: dict[str, int], throughput: dict[str, float], num_stages: int, rounds: int) -> list[Plan]:
    """Carry out ``rounds`` rounds of plans on ``allocation`` (in place), as the chosen peers would."""
    plans = []
    for round_ in range(rounds):
        plan = make_plan(records(allocation, throughput, num_stages), round_)
        for move in plan.moves:
            assert allocation[move.peer_id] == move.from_stage
            allocation[move.peer_id] = move.to_stage
        plans.append(plan)
    return plans


def swarm_throughput(allocation: dict[str, int], throughput: dict[str, float], num_stages: int) -> float:
    return min(capacities(allocation, throughput, num_stages))


def test_skewed_start_reaches_the_best_allocation_in_two_rounds_and_stays():
    allocation = {"a": 0, "b": 0, "c": 0, "d": 0, "e": 1, "f": 2}
    throughput = dict.fromkeys(allocation, 10.0)
    first, second, *steady = rebalance(allocation, throughput, 3, rounds=6)
    assert len(first.moves) == 1 and first.moves[0].from_stage == 0  # one mover per stage per round
    assert (first.current, first.planned) == (10.0, 20.0) and first.gain == 2.0
    assert len(second.moves) == 1
    assert sorted(allocation.values()) == [0, 0, 1, 1, 2, 2]
    assert all(not plan.moves for plan in steady)


def test_unequal_peers_reach_90_percent_of_the_best_allocation():
    rng = random.Random(0)
    for trial in range(50):
        num_stages = rng.randint(2, 4)
        peers = [f"p{i}" for i in range(rng.randint(num_stages, 9))]
        throughput = {p: rng.choice([1.0, 3.0, 10.0]) * rng.uniform(0.9, 1.1) for p in peers}
        allocation = {p: 0 if rng.random() < 0.6 else rng.randrange(num_stages) for p in peers}  # skewed
        moved = {p: 0 for p in peers}
        for plan in rebalance(allocation, throughput, num_stages, rounds=3 * len(peers)):
            for move in plan.moves:
                moved[move.peer_id] += 1
        best = best_allocation(throughput, num_stages)
        assert swarm_throughput(allocation, throughput, num_stages) >= 0.9 * best - 1e-9, trial
        assert not rebalance(dict(allocation), throughput, num_stages, rounds=1)[0].moves  # settled: no one moves


def test_small_differences_move_nobody():
    allocation = {"a": 0, "b": 0, "c": 1, "d": 1}
    throughput = {"a": 10.0, "b": 10.5, "c": 9.6, "d": 9.8}  # measurement noise, nothing to gain
    assert not make_plan(records(allocation, throughput, 2)).moves
    # a plan whose gain stays under the margin is not carried out either
    allocation = {"a": 0, "b": 0, "c": 1}
    throughput = {"a": 10.0, "b": 1.0, "c": 9.5}  # moving b: from 9.5 to 10, +5%
    assert not make_plan(records(allocation, throughput, 2)).moves
    assert make_plan(records(allocation, throughput, 2), margin=0.01).moves


def test_every_peer_computes_the_same_plan_whatever_order_it_read_the_records_in():
    allocation = {f"p{i}": 0 for i in range(5)} | {"q": 1, "r": 2}
    throughput = dict.fromkeys(allocation, 5.0)
    swarm = records(allocation, throughput, 3)
    plans = set()
    for seed in range(10):
        shuffled = [dict(random.Random(seed).sample(list(stage.items()), len(stage))) for stage in swarm]
        plans.add(make_plan(shuffled, round_=7))
    assert len(plans) == 1
    # another round hashes the ties otherwise, so that the same peer is not always the one sent away
    movers = {make_plan(swarm, round_).moves[0].peer_id for round_ in range(20)}
    assert len(movers) > 1


def test_empty_stage_is_refilled_first_and_newcomers_join_the_bottleneck():
    allocation = {"a": 0, "b": 0, "c": 0, "d": 2}
    throughput = {"a": 10.0, "b": 10.0, "c": 10.0, "d": 1.0}
    plan = make_plan(records(allocation, throughput, 3))
    assert plan.current == 0.0 and plan.gain == float("inf")
    assert [(m.from_stage, m.to_stage) for m in plan.moves] == [(0, 1)]
    assert bottleneck(records(allocation, throughput, 3)) == [1]
    assert bottleneck(records({"a": 0, "b": 1, "c": 1}, dict.fromkeys("abc", 1.0), 2)) == [0]


def test_leaving_and_joining_peers():
    allocation = {"a": 0, "b": 0, "c": 0, "d": 1}
    throughput = dict.fromkeys(allocation, 10.0)
    # b is leaving: it neither counts nor moves; c is joining: it counts but does not move
    swarm = records(allocation, throughput, 2, b=PeerState.LEAVING, c=PeerState.JOINING)
    assert make_plan(swarm).moves == ()  # a+c against d: balanced
    swarm = records(allocation, throughput, 2, a=PeerState.JOINING, c=PeerState.JOINING)
    assert [m.peer_id for m in make_plan(swarm).moves] == ["b"]  # the only serving peer of stage 0
    # a moving peer whose old record outlived its move counts once, at the stage it joins
    swarm = records(allocation, throughput, 2)
    swarm[1]["a"] = PeerRecord("a", 1, PeerState.JOINING, 10.0, 0)
    assert make_plan(swarm).current == 20.0 and bottleneck(swarm) == [0, 1]
    # a peer not measured yet counts as the median peer
    throughput["d"] = 0.0
    assert make_plan(records(allocation, throughput, 2)).current == 10.0


def test_rebalancer_moves_only_the_chosen_peer_and_then_cools_down():
    allocation = {"a": 0, "b": 0, "c": 0, "d": 1}
    swarm = records(allocation, dict.fromkeys(allocation, 10.0), 2)
    chosen = make_plan(swarm, round_=3).moves[0].peer_id
    requested = []
    for peer in allocation:
        rebalancer = Rebalancer(peer, 60.0, lambda: swarm, lambda move, plan: requested.append(move))
        assert rebalancer.tick(3) is None  # it just joined: cooling down
        rebalancer.moved_at -= 121.0
        assert (rebalancer.tick(3) is not None) == (peer == chosen)
    assert [m.peer_id for m in requested] == [chosen]
    rebalancer = Rebalancer(chosen, 60.0, lambda: swarm, lambda move, plan: requested.append(move))
    rebalancer.moved()
    assert rebalancer.tick(3) is None  # cooling down
    rebalancer.moved_at -= 121.0
    rebalancer.paused.set()
    assert rebalancer.tick(3) is None  # paused (e.g. while moving or leaving)
    rebalancer.paused.clear()
    assert rebalancer.tick(3) is not None


def test_two_peers_chosen_from_views_a_moment_apart_do_not_both_leave_their_stage():
    """x and y planned the same round from throughputs read a moment apart, and each found itself the best peer to
    move; x moved first. y plans that round again from fresh records before moving: x is at stage 0, so y stays."""
    allocation = {"r": 0, "x": 1, "y": 1, "z": 1}
    view_of_x = records(allocation, {"r": 9.0, "x": 11.0, "y": 10.0, "z": 10.0}, 2)
    view_of_y = records(allocation, {"r": 9.0, "x": 10.0, "y": 11.0, "z": 10.0}, 2)
    moves = {peer: make_plan(view, round_=5).move_of(peer) for peer, view in (("x", view_of_x), ("y", view_of_y))}
    assert moves["x"] is not None and moves["y"] is not None  # without the check, stage 1 would lose two peers
    y = Rebalancer("y", 60.0, lambda: view_of_y, lambda move, plan: None)
    plan_of_y = make_plan(view_of_y, round_=5)
    assert y.confirms(moves["y"], plan_of_y, view_of_y)  # nothing changed: the move stands
    fresh = records({**allocation, "x": 0}, {"r": 9.0, "x": 10.0, "y": 11.0, "z": 10.0}, 2, x=PeerState.JOINING)
    assert not y.confirms(moves["y"], plan_of_y, fresh)


@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_best_allocation_is_exhaustive(num_stages):
    rng = random.Random(num_stages)
    throughput = {f"p{i}": rng.uniform(1, 10) for i in range(6)}
    best = 0.0
    peers = list(throughput)
    for code in range(num_stages ** len(peers)):
        allocation = {p: (code // num_stages**i) % num_stages for i, p in enumerate(peers)}
        best = max(best, swarm_throughput(allocation, throughput, num_stages))
    assert best_allocation(throughput, num_stages) == pytest.approx(best)


class SharedRecords:
    """The DHT records of a swarm, in memory, as one peer's node reads and writes them."""

    def __init__(self, peer_id: str, records: dict, lock: threading.Lock) -> None:
        self.peer_id, self.records, self.lock = peer_id, records, lock

    def dht_get(self, key: str) -> dict:
        with self.lock:
            return dict(self.records.get(key, {}))

    def dht_store(self, key: str, subkey: str, value: object, ttl: float) -> bool:
        with self.lock:
            self.records.setdefault(key, {})[subkey] = value
        return True


class FirstChoice:
    """A random pick that always takes the first option: the worst case for newcomers choosing together."""

    def choice(self, options: list) -> object:
        return options[0]


def test_newcomers_that_choose_the_same_stage_at_once_spread_over_the_stages_without_peers(monkeypatch):
    """Three peers join an empty 3-stage swarm at the same moment: all read the swarm before any claimed a stage,
    and all pick stage 0 (the worst case of a random pick among equal stages). After the settling time each sees
    the others' claims, and they end on three different stages."""
    records, lock = {}, threading.Lock()
    read_together = threading.Barrier(3)
    fetch_swarm = rebalancing.fetch_swarm
    first_reads = set()

    def fetch_together(node, run_id, num_stages):
        if node.peer_id not in first_reads:
            first_reads.add(node.peer_id)
            swarm = fetch_swarm(node, run_id, num_stages)
            read_together.wait(timeout=10)  # nobody claims before everybody read: the race, forced
            return swarm
        return fetch_swarm(node, run_id, num_stages)

    monkeypatch.setattr(rebalancing, "fetch_swarm", fetch_together)
    monkeypatch.setattr(rebalancing.random, "Random", FirstChoice)
    peers = [SharedRecords(f"peer{i}", records, lock) for i in range(3)]
    with ThreadPoolExecutor(3) as pool:
        stages = list(pool.map(lambda node: rebalancing.join_stage(node, "run", 3, ttl=30, settle=0.2), peers))
    assert sorted(stages) == [0, 1, 2]


def test_spread_joiners_leaves_serving_peers_and_full_swarms_alone():
    # a serving peer and a joiner on stage 0, stage 1 empty: the joiner takes stage 1
    swarm = records({"s": 0, "j": 0}, {"s": 10.0, "j": 0.0}, 2, j=PeerState.JOINING)
    assert rebalancing.spread_joiners(swarm, "j", 0) == 1
    # every stage has a peer: nobody moves
    swarm = records({"s": 0, "j": 0, "t": 1}, {"s": 10.0, "j": 0.0, "t": 10.0}, 2, j=PeerState.JOINING)
    assert rebalancing.spread_joiners(swarm, "j", 0) == 0
    # two joiners on stage 0 and two empty stages: both leave stage 0 only if a peer stays; here one stays
    swarm = records({"a": 0, "b": 0}, {"a": 0.0, "b": 0.0}, 3, a=PeerState.JOINING, b=PeerState.JOINING)
    assert sorted(rebalancing.spread_joiners(swarm, p, 0) for p in "ab") == [0, 1]


def test_a_stage_without_peers_is_refilled_without_waiting_for_the_cooldown():
    """Two newcomers took stage 0 of two stages: the one the plan chooses moves in the first round, although both
    just joined (the cooldown keeps peers from moving again soon, never a stage empty)."""
    allocation = {"a": 0, "b": 0}
    swarm = records(allocation, dict.fromkeys(allocation, 0.0), 2)
    moves = [Rebalancer(peer, 60.0, lambda: swarm, lambda move, plan: None).tick(7) for peer in allocation]
    assert [m.to_stage for m in moves if m is not None] == [1]


def test_of_peers_that_claimed_moves_out_of_one_stage_at_once_only_one_goes():
    """x and y both confirmed a move out of stage 0 before either's claim showed in the records (each still serves
    stage 0 and joins stage 2). After settling each sees both claims, and exactly one of them goes, whichever
    peer computes it; a serving peer that claimed nothing, or a claim out of another stage, does not count."""
    swarm = records({"x": 0, "y": 0, "z": 0, "w": 1}, dict.fromkeys("xyzw", 10.0), 3)
    for peer in "xy":
        swarm[2][peer] = PeerRecord(peer, 2, PeerState.JOINING, 0.0, 0)
    swarm[2]["w"] = PeerRecord("w", 2, PeerState.JOINING, 0.0, 0)
    goes = [peer for peer in "xy" if rebalancing.first_mover(swarm, peer, 0)]
    assert len(goes) == 1
    stays = "y" if goes == ["x"] else "x"
    del swarm[2][stays]  # the one that stays withdrew its claim: the other still goes
    assert rebalancing.first_mover(swarm, goes[0], 0)
    assert rebalancing.first_mover(swarm, "w", 1)  # nobody else leaves stage 1
