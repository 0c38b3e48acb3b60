"""Swarm events: what happened in the swarm, raised on any thread and delivered to callbacks on the training thread.

Background threads (the swarm watcher, the stage worker, the router's calls) put events in an :class:`EventQueue`;
the strategy drains it between training steps (or while a serve-only peer waits) and calls the matching hook of
every callback that has one (see :class:`~lightning_swarm.callbacks.SwarmCallback`). Lightning's own callbacks
lack these hooks and are left alone.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field
from typing import Optional, Union


@dataclass(frozen=True)
class PeerJoined:
    """A peer appeared at ``stage`` (None: a peer that only drives batches); it may still be downloading the
    stage's state before it serves."""

    peer_id: str
    stage: Optional[int]
    time: float = field(default_factory=time.time)
    hook = "on_swarm_peer_joined"


@dataclass(frozen=True)
class PeerLeft:
    """A peer stopped serving ``stage``: it announced it was leaving, or its record expired (``reason``)."""

    peer_id: str
    stage: Optional[int]
    reason: str
    time: float = field(default_factory=time.time)
    hook = "on_swarm_peer_left"


@dataclass(frozen=True)
class StageChanged:
    """A peer moved from one stage to another (a rebalance).

    ``predicted_gain`` is the swarm throughput the mover predicted after the planned moves over the throughput
    before them (e.g. 1.5: 50% more); None when this peer only saw the move happen.
    """

    peer_id: str
    from_stage: int
    to_stage: int
    reason: str
    predicted_gain: Optional[float] = None
    time: float = field(default_factory=time.time)
    hook = "on_swarm_stage_changed"


@dataclass(frozen=True)
class StageStep:
    """The stage this peer serves took an optimizer step (``epoch`` is the stage's step count after it)."""

    stage: int
    epoch: int
    time: float = field(default_factory=time.time)
    hook = "on_swarm_stage_step"


@dataclass(frozen=True)
class Failover:
    """A call to ``stage`` failed on ``failed_peer`` and the microbatch was retried on ``retried_on``."""

    stage: int
    method: str
    failed_peer: str
    retried_on: str
    error: str
    time: float = field(default_factory=time.time)
    hook = "on_swarm_failover"


SwarmEvent = Union[PeerJoined, PeerLeft, StageChanged, StageStep, Failover]


class EventQueue:
    """A bounded, thread-safe queue of swarm events. When nobody drains it, the oldest events are dropped."""

    def __init__(self, maxsize: int = 10_000) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize)
        self.dropped = 0

    def emit(self, event: SwarmEvent) -> None:
        while True:
            try:
                self._queue.put_nowait(event)
                return
            except queue.Full:
                try:
                    self._queue.get_nowait()
                    self.dropped += 1
                except queue.Empty:
                    pass

    def drain(self) -> list[SwarmEvent]:
        events = []
        while True:
            try:
                events.append(self._queue.get_nowait())
            except queue.Empty:
                return events
