"""Swarm events raised on other threads reach Lightning callbacks in order, and only hooks that exist."""

from __future__ import annotations

from lightning_swarm.callbacks import SwarmCallback, dispatch
from lightning_swarm.events import EventQueue, Failover, PeerJoined, PeerLeft, StageChanged, StageStep


class _Hooks(SwarmCallback):
    def __init__(self) -> None:
        self.seen: list = []

    def on_swarm_peer_joined(self, trainer, pl_module, event) -> None:
        self.seen.append(event)

    def on_swarm_failover(self, trainer, pl_module, event) -> None:
        self.seen.append(event)


class _Trainer:
    lightning_module = object()

    def __init__(self, callbacks) -> None:
        self.callbacks = callbacks


def test_events_raised_on_other_threads_are_dispatched_in_order_and_only_to_hooks_that_exist():
    import threading

    from lightning.pytorch.callbacks import EarlyStopping

    queue = EventQueue()
    raised = [PeerJoined("a", 0), Failover(1, "forward", "a", "b", "boom"), StageStep(0, 1), PeerLeft("a", 0, "x")]
    thread = threading.Thread(target=lambda: [queue.emit(e) for e in raised])
    thread.start()
    thread.join()
    hooks = _Hooks()
    dispatch(_Trainer([EarlyStopping(monitor="x"), hooks, SwarmCallback()]), queue.drain())
    assert hooks.seen == raised[:2]
    assert queue.drain() == []
    small = EventQueue(maxsize=2)
    for i in range(5):
        small.emit(StageChanged(str(i), 0, 1, "test"))
    assert [e.peer_id for e in small.drain()] == ["3", "4"] and small.dropped == 3
