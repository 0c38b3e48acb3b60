"""The requests waiting for a stage server's worker, kept per caller so that one caller cannot starve the others.

Callers take turns by the samples they were served (start-time fair queuing): each caller's requests carry a
virtual start time that grows by their samples, and the worker takes the waiting request with the earliest one. A
caller that sends little is therefore served next, after at most the request being computed, however many
requests another caller has queued; callers that all send a lot share the stage's samples equally.

The queue holds at most ``maxsize`` requests. A caller alone may fill it; once it is full, a request from a caller
with fewer queued requests takes the place of the newest request of the caller with the most (which the server
answers busy), so that under contention every caller keeps an equal share of the places.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from typing import Any, Callable, Hashable, Optional

_MAX_REMEMBERED = 1024  # callers whose virtual finish time is kept while they have nothing queued


class FairQueue:
    """A bounded queue of ``(caller, item, samples)``, served fairly between callers (see the module docstring)."""

    def __init__(self, maxsize: int) -> None:
        if maxsize < 1:
            raise ValueError(f"maxsize must be at least 1, got {maxsize}")
        self.maxsize = maxsize
        self._waiting: dict[Hashable, deque[tuple[Any, int]]] = {}
        self._start: dict[Hashable, float] = {}  # caller -> virtual start time of its next request
        self._finish: dict[Hashable, float] = {}  # caller with nothing queued -> where its last request ended
        self._clock = 0.0  # virtual start time of the request last handed to the worker
        self._size = 0
        self._closed = False
        self._ready = threading.Condition()

    def qsize(self) -> int:
        return self._size

    def queued(self, caller: Hashable) -> int:
        """How many requests ``caller`` has waiting."""
        return len(self._waiting.get(caller, ()))

    def admits(self, caller: Hashable) -> bool:
        """Whether :meth:`put` would take a request from ``caller`` now (checked before decoding the request)."""
        with self._ready:
            return self._size < self.maxsize or self._victim(caller) is not None

    def put(self, caller: Hashable, item: Any, samples: int) -> Optional[Any]:
        """Queue ``item`` for ``caller``; returns the item it displaced (to answer busy), if any. Raises
        ``queue.Full`` when the queue is full and ``caller`` holds as many places as anyone."""
        with self._ready:
            displaced = None
            if self._closed:
                raise queue.Full
            if self._size >= self.maxsize:
                victim = self._victim(caller)
                if victim is None:
                    raise queue.Full
                displaced = self._pop(victim, newest=True)[0]
            if caller not in self._waiting:
                self._waiting[caller] = deque()
                self._start[caller] = max(self._clock, self._finish.pop(caller, self._clock))
            self._waiting[caller].append((item, samples))
            self._size += 1
            self._ready.notify()
            return displaced

    def get(self, timeout: float) -> Optional[Any]:
        """The next item (by the callers' virtual start times); None once closed and empty; ``queue.Empty`` after
        ``timeout`` seconds without any."""
        items = self.get_many(timeout, lambda taken, item: False)
        return None if items is None else items[0]

    def get_many(self, timeout: float, joins: Callable[[list[Any], Any], bool]) -> Optional[list[Any]]:
        """As :meth:`get`, the next item, followed by the items next in turn for as long as ``joins(taken, item)``
        (the turn order is kept: the first item that does not join ends the list)."""
        with self._ready:
            while self._size == 0 and not self._closed:
                if not self._ready.wait(timeout):
                    raise queue.Empty
            if self._size == 0:
                return None
            taken = [self._take()]
            while self._size:
                caller = min(self._waiting, key=self._start.__getitem__)
                if not joins(taken, self._waiting[caller][0][0]):
                    break
                taken.append(self._take())
            return taken

    def _take(self) -> Any:
        """Hand the next item in turn to the worker (the lock held, something queued)."""
        caller = min(self._waiting, key=self._start.__getitem__)
        self._clock = self._start[caller]
        item, samples = self._pop(caller, newest=False)
        if caller in self._start:
            self._start[caller] += samples
        else:  # it has nothing queued now: its next request starts where this one ends
            self._finish[caller] = self._clock + samples
            if len(self._finish) > _MAX_REMEMBERED:
                self._finish = {c: t for c, t in self._finish.items() if t > self._clock}
        return item

    def close(self) -> list[Any]:
        """Stop taking requests: :meth:`get` returns None once empty. Returns the items still queued (to answer)."""
        with self._ready:
            left = [item for waiting in self._waiting.values() for item, _ in waiting]
            self._waiting.clear()
            self._start.clear()
            self._size, self._closed = 0, True
            self._ready.notify_all()
            return left

    def _victim(self, caller: Hashable) -> Optional[Hashable]:
        """The caller that gives up a place to ``caller`` in a full queue: the one with the most, if it holds more
        than one more than ``caller`` would."""
        most = max(self._waiting, key=lambda c: len(self._waiting[c]), default=None)
        if most is None or len(self._waiting[most]) <= self.queued(caller) + 1:
            return None
        return most

    def _pop(self, caller: Hashable, newest: bool) -> tuple[Any, int]:
        waiting = self._waiting[caller]
        entry = waiting.pop() if newest else waiting.popleft()
        self._size -= 1
        if not waiting:
            del self._waiting[caller]
            self._start.pop(caller)
        return entry
