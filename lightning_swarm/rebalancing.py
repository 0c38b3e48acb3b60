"""Adaptive rebalancing (SWARM section 3.2): peers move from stages with spare capacity to the bottleneck stage.

The swarm trains as fast as its slowest stage, whose capacity is the summed throughput of its peers. Every
``period`` seconds each serving peer reads the swarm's records and computes the same plan:

1. From the current allocation, repeatedly take the move (one peer to another stage, or two peers of different
   stages swapping) that best raises the stage capacities sorted from lowest to highest (lexicographically: first
   the bottleneck, then the next), until none raises them. A stage with no peer has capacity 0, so it is refilled
   first. Swaps matter between unequal peers: a fast peer and a slow one trading places.
2. The plan is carried out only if its predicted swarm throughput (the lowest stage capacity after all its
   moves) beats the current one by ``margin`` (10% by default): small, noisy differences never move anyone. A
   larger margin would leave swarms further from their best allocation (at worst 1 / (1 + margin) of it).
3. In one round at most one peer leaves each stage: the first planned peer whose stage at the end of the plan
   differs from its stage now. Moves out of the same stage wait for later rounds, planned again from fresh records.
4. Just before it moves, the chosen peer plans the same round again from records read afresh, and moves only if
   that plan still moves it: peers that planned a moment apart may have read throughputs that differ enough to
   choose two different peers of a stage, and the one that moves second then sees the first one gone.
5. Peers that confirmed a moment apart, each before the other's move showed in the records, are caught by a claim:
   the mover announces itself at its new stage, waits for claims made at the same time to arrive, and only the
   first of the peers leaving the same stage (:func:`first_mover`) goes; the others withdraw their claims and stay.

Every peer computes the plan from the same records with the same tie-breaks (peer ids hashed with the round
number), so peers agree on who moves without a coordinator, and only the chosen peers move. A peer that moved,
or joined, does not move for ``cooldown`` seconds. Peers that are joining count at their stage but do not move,
nor do peers whose records say they do not rebalance (rebalancing off, or paused: a trainer that finished): a plan
that chose one would wait for a move that never comes, round after round (a stage without peers stayed empty).
Peers that are leaving do not count. A peer whose throughput is not measured yet counts as the median peer.
"""

from __future__ import annotations

import hashlib
import logging
import random
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

from lightning_swarm.discovery import PeerRecord, PeerState, current_records, fetch_swarm, store_record
from lightning_swarm.node import SwarmNode
from lightning_swarm.periodic import PeriodicThread

log = logging.getLogger(__name__)

DEFAULT_MARGIN = 0.1
JOIN_SETTLE = 1.0  # seconds a newcomer waits after claiming its stage before it checks who else claimed it


@dataclass(frozen=True)
class Move:
    peer_id: str
    from_stage: int
    to_stage: int


@dataclass(frozen=True)
class Plan:
    """A round's moves, and the swarm throughput (samples/s) now and once the whole plan is carried out."""

    moves: tuple[Move, ...]
    current: float
    planned: float
    round: int = 0

    @property
    def gain(self) -> float:
        """Predicted throughput after the plan over the throughput now (infinite for a stage without peers)."""
        return self.planned / self.current if self.current > 0 else float("inf")

    def move_of(self, peer_id: str) -> Optional[Move]:
        return next((m for m in self.moves if m.peer_id == peer_id), None)


def capacities(allocation: dict[str, int], throughput: dict[str, float], num_stages: int) -> list[float]:
    """Each stage's summed throughput."""
    totals = [0.0] * num_stages
    for peer, stage in allocation.items():
        totals[stage] += throughput[peer]
    return totals


def make_plan(swarm: list[dict[str, PeerRecord]], round_: int = 0, margin: float = DEFAULT_MARGIN) -> Plan:
    """The plan every peer computes from the same records (see the module docstring)."""
    num_stages = len(swarm)
    records = _present(swarm)
    throughput = _estimated_throughput(records)
    allocation = {r.peer_id: r.stage for r in records}
    movable = sorted(
        (r.peer_id for r in records if r.state == PeerState.SERVING and r.movable),
        key=lambda peer: _tiebreak(peer, round_),
    )
    totals = capacities(allocation, throughput, num_stages)
    current, start = min(totals), dict(allocation)

    planned: list[Move] = []
    for _ in range(2 * len(movable)):
        best: Optional[tuple[list[float], list[Move]]] = None
        for moves in _candidates(movable, allocation, num_stages):
            after = list(totals)
            for move in moves:
                after[move.from_stage] -= throughput[move.peer_id]
                after[move.to_stage] += throughput[move.peer_id]
            if _raises(after, totals) and (best is None or _raises(after, best[0])):
                best = (after, moves)
        if best is None:
            break
        totals, moves = best
        for move in moves:
            allocation[move.peer_id] = move.to_stage
        planned.extend(moves)

    if not planned or (current > 0 and min(totals) < current * (1 + margin)):
        return Plan((), current, current, round_)
    first_out: dict[int, Move] = {}  # net moves (a peer may move twice in the plan), in the order planned
    for peer in dict.fromkeys(move.peer_id for move in planned):
        if allocation[peer] != start[peer]:
            first_out.setdefault(start[peer], Move(peer, start[peer], allocation[peer]))
    return Plan(tuple(first_out.values()), current, min(totals), round_)


def bottleneck(swarm: list[dict[str, PeerRecord]]) -> list[int]:
    """The stages with the lowest capacity (a newcomer joins one of them); stages without peers come first."""
    records = _present(swarm)
    totals = capacities({r.peer_id: r.stage for r in records}, _estimated_throughput(records), len(swarm))
    return [k for k, total in enumerate(totals) if total <= min(totals) * (1 + 1e-9)]


def join_stage(node: SwarmNode, run_id: str, num_stages: int, ttl: float, settle: float = JOIN_SETTLE) -> int:
    """The stage a newcomer serves: a bottleneck stage, claimed at once with a "joining" record (lasting ``ttl``
    seconds, until the peer's announcer takes over) and checked again ``settle`` seconds later. Newcomers that
    chose at the same moment, before seeing each other's claims, see them then and spread over the stages without
    peers (:func:`spread_joiners`) instead of all serving the same one."""
    peer_id = str(node.peer_id)
    stage = random.Random().choice(bottleneck(fetch_swarm(node, run_id, num_stages)))  # OS-seeded
    try:
        store_record(node, run_id, PeerRecord(peer_id, stage, PeerState.JOINING, 0.0, 0), ttl)
    except Exception as e:  # unclaimed, the choice stands; rebalancing refills a stage left empty
        log.warning("Could not claim stage %d: %r", stage, e)
        return stage
    time.sleep(settle)
    chosen = spread_joiners(fetch_swarm(node, run_id, num_stages), peer_id, stage)
    if chosen != stage:
        log.warning("Stage %d was chosen by another newcomer at the same moment: serving stage %d", stage, chosen)
        store_record(node, run_id, PeerRecord(peer_id, chosen, PeerState.JOINING, 0.0, 0), ttl)
        store_record(node, run_id, PeerRecord(peer_id, stage, PeerState.LEAVING, 0.0, 0), ttl)
    return chosen


def spread_joiners(swarm: list[dict[str, PeerRecord]], peer_id: str, stage: int) -> int:
    """The stage ``peer_id`` (joining ``stage``) serves so that no stage stays without a peer while another has
    several: the surplus joining peers of crowded stages, in an order every peer computes alike, take the stages
    without peers, one each."""
    records = current_records(swarm)
    records[peer_id] = PeerRecord(peer_id, stage, PeerState.JOINING, 0.0, 0)  # its claim may not be read back yet
    by_stage: list[list[PeerRecord]] = [[] for _ in swarm]
    for record in records.values():
        if record.stage is not None:
            by_stage[record.stage].append(record)
    empty = [k for k, peers in enumerate(by_stage) if not peers]
    surplus = []
    for peers in by_stage:
        joining = sorted((r.peer_id for r in peers if r.state == PeerState.JOINING), key=lambda p: _tiebreak(p, 0))
        surplus.extend(joining[: len(peers) - 1])  # a crowded stage keeps one peer at least
    return empty[surplus.index(peer_id)] if peer_id in surplus[: len(empty)] else stage


def first_mover(swarm: list[dict[str, PeerRecord]], peer_id: str, from_stage: int) -> bool:
    """Whether ``peer_id``, about to leave ``from_stage``, is the one peer that leaves it now among all that claimed
    a move out of it (still serving there, already joining another stage), in an order every peer computes alike."""
    joining_elsewhere = {
        r.peer_id
        for k, stage in enumerate(swarm)
        if k != from_stage
        for r in stage.values()
        if r.state == PeerState.JOINING
    }
    movers = {p for p, r in swarm[from_stage].items() if r.state == PeerState.SERVING and p in joining_elsewhere}
    return min(movers | {peer_id}, key=lambda p: _tiebreak(p, 0)) == peer_id


def _present(swarm: list[dict[str, PeerRecord]]) -> list[PeerRecord]:
    return [r for r in current_records(swarm).values() if r.stage is not None]


def _estimated_throughput(records: list[PeerRecord]) -> dict[str, float]:
    """Each peer's throughput; the median of the measured ones for a peer not measured yet."""
    measured = [r.throughput for r in records if r.throughput > 0]
    median = statistics.median(measured) if measured else 1.0
    return {r.peer_id: r.throughput if r.throughput > 0 else median for r in records}


def _candidates(movable: list[str], allocation: dict[str, int], num_stages: int) -> Iterator[list[Move]]:
    """Single moves of one peer to another stage, then swaps of two peers of different stages."""
    for peer in movable:
        for target in range(num_stages):
            if target != allocation[peer]:
                yield [Move(peer, allocation[peer], target)]
    for i, peer in enumerate(movable):
        for other in movable[i + 1 :]:
            if allocation[peer] != allocation[other]:
                yield [
                    Move(peer, allocation[peer], allocation[other]),
                    Move(other, allocation[other], allocation[peer]),
                ]


def _raises(after: list[float], before: list[float], tolerance: float = 1e-9) -> bool:
    """Whether ``after``'s capacities, sorted from the lowest, beat ``before``'s lexicographically."""
    for a, b in zip(sorted(after), sorted(before)):
        if a > b * (1 + tolerance) + tolerance:
            return True
        if a < b * (1 - tolerance) - tolerance:
            return False
    return False


def _tiebreak(peer_id: str, round_: int) -> str:
    return hashlib.sha256(f"{round_}:{peer_id}".encode()).hexdigest()


class Rebalancer(PeriodicThread):
    """A daemon thread that makes the plan every ``period`` seconds and asks this peer to move when it is chosen.

    Rounds are aligned to the clock (``time.time() // period``) so that peers plan from about the same records;
    each peer plans a little after the round starts (a random fraction of the period), once records settled.

    Args:
        read_swarm: the swarm's latest records, one dict per stage.
        request_move: called with this peer's move and the plan; moving is the caller's job (on its own thread).
    """

    def __init__(
        self,
        peer_id: str,
        period: float,
        read_swarm: Callable[[], Optional[list[dict[str, PeerRecord]]]],
        request_move: Callable[[Move, Plan], None],
        margin: float = DEFAULT_MARGIN,
        cooldown: Optional[float] = None,
    ) -> None:
        super().__init__("swarm-rebalancer")
        self.peer_id, self.period, self.margin = peer_id, period, margin
        self.cooldown = 2 * period if cooldown is None else cooldown
        self.read_swarm, self.request_move = read_swarm, request_move
        self.moved_at = time.monotonic()  # joining counts as a move: a newcomer first lets the swarm settle
        self.paused = threading.Event()  # set while the peer must not move (e.g. it is moving, or leaving)
        self._rng = random.Random()
        self.first_delay = self.delay()

    def moved(self) -> None:
        self.moved_at = time.monotonic()

    def delay(self) -> float:
        """Until a little after the next round starts."""
        return self.period - time.time() % self.period + self._rng.uniform(0.2, 0.4) * self.period

    def tick(self, round_: Optional[int] = None) -> Optional[Move]:
        """Plan one round (by default, the current one); returns (and requests) this peer's move if it is chosen
        and free to move. A failed round is skipped; the next one reads fresh records."""
        round_ = int(time.time() // self.period) if round_ is None else round_
        if self.paused.is_set():
            return None
        swarm = self.read_swarm()
        if not swarm:
            return None
        plan = make_plan(swarm, round_, self.margin)
        if plan.current > 0 and time.monotonic() - self.moved_at < self.cooldown:
            return None  # cooling down, unless a stage has no peer: that one is refilled at once
        move = plan.move_of(self.peer_id)
        if move is not None:
            log.info("Rebalancing: chosen to move from stage %d to stage %d", move.from_stage, move.to_stage)
            self.request_move(move, plan)
        return move

    def confirms(self, move: Move, plan: Plan, swarm: list[dict[str, PeerRecord]]) -> bool:
        """Whether ``plan``'s round, planned again from ``swarm`` (fresh records), still makes this move."""
        return make_plan(swarm, plan.round, self.margin).move_of(self.peer_id) == move
