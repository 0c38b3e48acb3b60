"""The stage runtime: the one thread that computes on the stage's device, taking tasks from the task pool
(:mod:`~lightning_swarm.server.task_pool`) and running them on the backend (:mod:`~lightning_swarm.server.backend`).

It never waits for the device per request: each task's kernels are queued after the mark that says its tensors were
decoded (on the decoding thread's stream), its answer is handed back with the mark after its compute, and the next
task is queued at once, so the device always has the next request behind the current one. Only before a backward's
gradients go to the stage optimizer does it read whether the request's tensors were finite (computed before its
compute began: by then the device is at this request), so that a refused gradient is never accumulated. How long a
request computed is read from the two marks once the device passed them (:mod:`~lightning_swarm.device_sync`), for
the throughput the server publishes. A batch of tasks (several callers' inference forwards) runs as one forward and
each caller gets its part. A task that runs out of memory is answered "busy" once what it held is freed; a task the
blocks reject on an input they took on the meta device is the stage's fault (:class:`StageFailedError`)."""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Callable, Iterator

import torch
from hivemind.utils.performance_ema import PerformanceEMA
from torch.utils import _pytree as pytree

from lightning_swarm import device_sync
from lightning_swarm.errors import ActivationsLostError, StageBusyError, StageFailedError, SwarmRequestError
from lightning_swarm.server.backend import StageBackend
from lightning_swarm.server.task_pool import Task, TaskPool

log = logging.getLogger(__name__)


def _side_tensors(calls: list) -> Iterator[torch.Tensor]:
    """The tensors among a task's side inputs, found only when iterated (on a GPU: on the CPU nothing waits)."""
    for leaf in pytree.tree_leaves(calls):
        if isinstance(leaf, torch.Tensor):
            yield leaf


def refuse(future: Future, error: Exception) -> None:
    """Answer a task with ``error``, unless its caller stopped waiting (its handler was cancelled)."""
    if future.set_running_or_notify_cancel():
        future.set_exception(error)


def out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocator running out of memory (the device's, or a backend's without its own type);
    not a server's own "busy" answer to one."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and not isinstance(error, StageBusyError) and "out of memory" in str(error)


class StageRuntime:
    """Runs ``pool``'s tasks on ``backend`` in a thread of its own (see the module docstring).

    Args:
        overloaded: the "busy" answer to a task that ran out of memory, given the kind and the error.
        idle_period: seconds without a task after which the stage optimizer follows the swarm.
        throttle: slow down on purpose by this factor (see :class:`~lightning_swarm.server.stage_server.StageServer`).
    """

    def __init__(
        self,
        backend: StageBackend,
        pool: TaskPool,
        overloaded: Callable[[str, str], StageBusyError],
        idle_period: float = 1.0,
        throttle: float = 1.0,
    ) -> None:
        self.backend, self.pool, self.overloaded = backend, pool, overloaded
        self.idle_period, self.throttle = idle_period, throttle
        self.throughput = PerformanceEMA(alpha=0.1)
        self.backward_samples = 0  # samples whose gradients reached the stage optimizer
        self.skipped_samples = 0  # samples whose gradients were not finite (16-mixed overflow): not accumulated
        self._timings: deque[tuple[device_sync.Mark, device_sync.Mark, int]] = deque()  # computes not yet timed
        self._thread = threading.Thread(target=self._work, name=f"stage{backend.stage}-worker", daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _work(self) -> None:
        while True:
            try:
                tasks = self.pool.get(timeout=self.idle_period)
            except queue.Empty:
                self.backend.kept.expire()
                self._time_computes()
                self.backend.follow_swarm()
                continue
            if tasks is None:
                return
            self._serve(tasks)
            del tasks  # the requests' tensors: not held while the worker waits for the next ones

    def _serve(self, tasks: list[Task]) -> None:
        """Compute tasks (one, or a batch of inference forwards) and answer them with their output and the mark
        after its compute (their tensors are freed once this returns)."""
        self.backend.kept.expire()
        self._time_computes()
        tasks = [task for task in tasks if task.future.set_running_or_notify_cancel()]
        if not tasks:
            return
        first, batch = tasks[0], sum(task.batch for task in tasks)
        for task in tasks:  # decoded on another stream: the compute waits for them, and holds them until it is done
            device_sync.wait_for(task.ready, itertools.chain(task.tensors, _side_tensors(task.calls)))
        tensors = first.tensors if len(tasks) == 1 else [torch.cat([task.tensors[0] for task in tasks])]
        start, error = device_sync.mark(self.backend.device), None
        try:
            output, accumulate = self.backend.compute(
                first.kind, tensors, first.train, first.key, first.loss_scale, first.calls
            )
        except (SwarmRequestError, ActivationsLostError) as e:
            for task in tasks:
                task.future.set_exception(e)
            return
        except Exception as e:
            if not out_of_memory(e):  # on an input the blocks take (on meta), a failing block is the stage's fault
                failed = StageFailedError(f"stage {self.backend.stage} {first.kind} failed: {e!r}")
                for task in tasks:
                    task.future.set_exception(failed)
                return
            error = repr(e)  # handled below, once the failed call's frames (and the tensors they hold) are gone
        if error is not None:
            self._answer_overloaded(tasks, error)
            return
        done = timed = device_sync.mark(self.backend.device)
        if self.throttle > 1:  # the slowdown counts in the throughput the peer publishes, and delays its answers
            device_sync.synchronize(self.backend.device)
            time.sleep((self.throttle - 1) * (time.perf_counter() - start.host_time))
            timed = device_sync.mark(self.backend.device)
        self._timings.append((start, timed, batch))
        self._time_computes()  # on the CPU at once; on a GPU, whatever the device has finished
        if first.kind == "backward" and not first.finite.read():  # refused by its handler: nothing is accumulated
            self.backend.drop_gradients()
            accumulate = False
        elif first.kind == "backward" and not accumulate:
            self.skipped_samples += batch
            stage, scale = self.backend.stage, first.loss_scale
            log.info("Stage %d: gradients not finite under loss scale %s: microbatch skipped", stage, scale)
        self.backward_samples += batch if accumulate else 0
        for task, part in zip(tasks, output.split([task.batch for task in tasks])):
            task.future.set_result((part, done))  # the caller goes on while the stage optimizer takes its turn
        if accumulate:
            self.backend.hand_over_gradients(batch)

    def _answer_overloaded(self, tasks: list[Task], error: str) -> None:
        for task in tasks:
            if task.key is not None:
                self.backend.kept.pop(task.key)  # a forward kept before the failure, or the graph a backward used
            task.tensors.clear()  # the request's inputs, shared with the handler awaiting the answer
        answer = self.overloaded(tasks[0].kind, error)
        for task in tasks:
            task.future.set_exception(answer)

    def _time_computes(self) -> None:
        """Feed the throughput the computes the device has finished (compute time only, not the steps)."""
        while self._timings:
            start, done, batch = self._timings[0]
            seconds = device_sync.seconds_between(start, done)
            if seconds is None:
                return
            self._timings.popleft()
            self.throughput.update(batch, interval=max(seconds, 1e-9))
