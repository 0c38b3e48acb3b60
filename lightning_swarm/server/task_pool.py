"""The task pool: the requests a stage server accepted, waiting for its runtime, shared fairly between callers
(:mod:`~lightning_swarm.server.fair_queue`) and handed over in batches.

Requests that need nothing of the stage's state are run together: inference forwards without side inputs, of the
same shape but for the batch and in the same mode, are concatenated into one forward of at most
``max_batch_samples`` samples, so that the small requests of several callers cost the device one pass. The batch
keeps the callers' turns: it is the next request in turn and those right after it, up to the first that cannot
join. Training forwards keep their graph for their own backward and backwards carry their own gradients, so those
run one by one.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Optional

import torch

from lightning_swarm import device_sync
from lightning_swarm.block_calls import Call
from lightning_swarm.server.fair_queue import FairQueue


@dataclass
class Task:
    """One accepted request: its decoded tensors (activation, then gradient), the calls of the stage's blocks, the
    mark after which its tensors are on the device, the future its answer goes to, and whether the tensors it must
    not compute on unless finite are (read once its compute is done: a request with NaN or Inf is refused then)."""

    kind: str
    tensors: list[torch.Tensor]
    train: bool
    batch: int
    key: Optional[tuple[str, str]]  # (caller, key) of a kept forward, or of the kept forward a backward uses
    loss_scale: Optional[float]
    calls: list[Call]
    future: Future
    ready: device_sync.Mark
    finite: device_sync.Flag

    @property
    def stateless(self) -> bool:
        """An inference forward without side inputs: it may run batched with others of its shape."""
        return self.kind == "forward" and self.key is None and all(call == ((), {}) for call in self.calls)


class TaskPool:
    """Accepted requests, at most ``max_queue``, handed to the runtime fairly and in batches of up to
    ``max_batch_samples`` samples (see the module docstring)."""

    def __init__(self, max_queue: int, max_batch_samples: int) -> None:
        self.max_batch_samples = max_batch_samples
        self._queue = FairQueue(max_queue)
        self._lock = threading.Lock()
        self._queued_samples = 0

    @property
    def maxsize(self) -> int:
        return self._queue.maxsize

    @property
    def queued_samples(self) -> int:
        """Samples waiting (published for the routers' load estimates)."""
        return self._queued_samples

    def qsize(self) -> int:
        return self._queue.qsize()

    def admits(self, caller: str) -> bool:
        """Whether :meth:`put` would take a request from ``caller`` now (checked before decoding it)."""
        return self._queue.admits(caller)

    def put(self, caller: str, task: Task) -> Optional[Task]:
        """Queue ``task``; returns the task it displaced (the newest of the caller holding the most places), to be
        answered busy. ``queue.Full`` when the queue is full and ``caller`` holds as many places as anyone."""
        displaced = self._queue.put(caller, task, task.batch)
        self._count(task.batch - (displaced.batch if displaced is not None else 0))
        return displaced

    def get(self, timeout: float) -> Optional[list[Task]]:
        """The next tasks to run, together if more than one; None once closed; ``queue.Empty`` after ``timeout``
        seconds without any."""
        tasks = self._queue.get_many(timeout, self._joins)
        if tasks is not None:
            self._count(-sum(task.batch for task in tasks))
        return tasks

    def close(self) -> list[Task]:
        """Stop taking tasks; returns those still queued (to answer)."""
        left = self._queue.close()
        self._count(-sum(task.batch for task in left))
        return left

    def _joins(self, taken: list[Task], task: Task) -> bool:
        first = taken[0]
        return (
            first.stateless
            and task.stateless
            and task.train == first.train
            and task.tensors[0].shape[1:] == first.tensors[0].shape[1:]
            and task.tensors[0].dtype == first.tensors[0].dtype
            and sum(t.batch for t in taken) + task.batch <= self.max_batch_samples
        )

    def _count(self, samples: int) -> None:
        with self._lock:
            self._queued_samples += samples
