"""An emulated GPU, for benchmarks/gpu_proxy.py: the swarm's real code runs end to end in real peer processes, and
only the device is emulated.

The device is one timeline shared by every process of the machine: a small file mapped into each of them
(:class:`Timeline`), its header holding when the device is busy until, then the log of its kernels, appended under a
lock (a thread lock and ``flock``). Everything else a process records goes to a log of its own beside it, under a
lock of its threads only. Clocks are ``time.monotonic()``, one clock for all processes on Linux.

- A kernel (:meth:`EmulatedDevice.kernel`) is enqueued at ``max(now, device busy until, this process's stream)``
  for its calibrated duration, so kernels of all processes run one at a time, in the order launched; launching it
  uses its launch cost of the thread's CPU, as eager PyTorch's launches do, holding the GIL for the share of it that
  PyTorch's Python glue holds it (a block's forward about half, its backward, run by autograd's engine in C++, a
  seventh), and a kernel shorter than its launch cannot finish before the launch does.
- Each process has a default stream (the compute's), and each thread that asks for one
  (``device_sync.side_stream``: a stage server's decoding and encoding) a stream of its own. An asynchronous copy
  (:meth:`EmulatedDevice.copy_async`) occupies its stream, not the device, and later kernels of that stream start
  after it. Kernels run in the order launched, except a codec's or a finiteness check's small kernel on a stream
  other than the one its process computes the blocks on: as a GPU slips it in between the kernels of other streams,
  it runs beside them from the end of the kernel running when it became ready (its stream's earlier work and the
  marks it waits for done), without delaying the kernels queued behind that one. A sync of a stream waits only for
  its own work. Marks (``device_sync.mark``) are the time their stream reaches them; a stream made to wait for one
  starts its next work after it.
- A stream sync (:meth:`EmulatedDevice.synchronize`) sleeps, releasing the GIL, until the current stream's last
  enqueued work is done (the last 0.15 ms yielding instead of sleeping, so that its wake-up is not late by the
  kernel's timer slack); a device sync waits for all the process's streams. A blocking copy (pageable memory) or
  host work that waits between syncs (:meth:`EmulatedDevice.blocking`) first syncs, then waits its calibrated
  time.

Where the real code waits on a device, the emulation is put in its place (:func:`install`):
``lightning_swarm.device_sync``'s functions (marks and their timing, side streams and the waits between streams, the
finiteness check of a decoded tensor (read at once, or later), the device-to-host copy of an encoded one into pinned
memory (not of one made on the host, such as a receipt: that is there already), a whole-device synchronize); the
codec's kernels (8-bit quantize on encoding, and dequantize when decoding onto the device, after the host copy into
a staging buffer and an asynchronous host-to-device copy); and the stage optimizer: gradient accumulation on the
device; alone (or after a failed round) the gradient's copy and scaling on the device, with a round (or delayed
updates) its scaling on the device and its copies into pinned shared host memory and back (``device_sync.copy_scaled``
and ``copy_waited``; for the parameter count of the real model, ``EmulatedDevice.optimizer_numel``); the optimizer's own
step kernel (instead of its real step, on a GPU's resident optimizer) and the accumulators' reset
(:func:`_install_optimizer`). The pipeline's blocks are
:class:`EmulatedBlock`: their parameters are one element each (the real block's names, their real sizes in
``emulated_numel``), a call launches one kernel of the calibrated time for its samples and returns a real tensor of
the real size without computing it. The trainer's local modules (:class:`EmulatedEmbedding`, :class:`EmulatedHead`)
are emulated the same way; the pipeline's output and input gradient reach them decoded on the device.

Everything else is today's code, run for real: routing, transport, codec framing and host-side decoding, kept
activations, the fair queue, hivemind's optimizer logic. :func:`instrument` adds records of what the swarm does
(requests arriving, queued, served and answered; calls and replies; routes; optimizer hand-overs and steps) to the
same timeline, without changing behaviour, so that ``gpu_proxy.py`` can split the device's idle time and the hops.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import glob
import hashlib
import json
import mmap
import os
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Iterator, Optional, Union

import numpy as np
import torch
from torch import nn

RECORD = np.dtype(
    [
        ("t0", "<f8"),
        ("t1", "<f8"),
        ("value", "<f8"),
        ("key", "<u8"),
        ("key2", "<u8"),
        ("proc", "<i2"),
        ("kind", "<i2"),
        ("extra", "<i4"),
    ]
)
HEADER_BYTES = 64  # busy-until (f8, the device's log) at 0, record count (i8) at 8, records dropped past capacity at 16
BESIDE_SCAN = 512  # the latest kernels searched for the one running when a kernel beside it became ready

# record kinds: device kernels (their time is the device's busy time)
BLOCK_FORWARD, BLOCK_BACKWARD, CODEC, FINITE, LOCAL, OPTIMIZER = 1, 2, 3, 4, 5, 6
KERNELS = (BLOCK_FORWARD, BLOCK_BACKWARD, CODEC, FINITE, LOCAL, OPTIMIZER)  # 1..6 in a row: enqueue_beside
BLOCKS = (BLOCK_FORWARD, BLOCK_BACKWARD)
# the device's other records: an asynchronous copy on a stream, a host blocked (extra: HOST_*), a sync's wait
COPY, HOST_WAIT, SYNC = 10, 11, 12
HOST_H2D, HOST_READ, HOST_ADAM = 2, 4, 5  # 1 and 3 were hivemind's host copy and scaling of a round's gradient
# what the swarm did (instrument): on a stage server, then on the trainer
ARRIVE, SUBMIT, SERVE, ANSWER, HANDOVER, STEP = 20, 21, 22, 23, 24, 25
ROUTE, CALL, CHECK, PIPE_FORWARD, PIPE_BACKWARD, BATCH = 30, 31, 32, 33, 34, 35
REQUEST_KINDS = {"forward": 1, "backward": 2}

SPIN = 1.5e-4  # the last seconds of a wait spent yielding rather than sleeping (timer slack is 50 us)
OCCUPY_SLICE = 1e-4  # seconds of CPU per slice of a launch: its GIL-holding part, then its GIL-free part
_RELEASED_WORK = bytes(32768)  # hashed with the GIL released (hashlib releases it above 2 KiB): ~40 us a call here
TRAINER = 2  # the trainer's process number (stage servers: their stage)


@dataclass
class Calibration:
    """The emulated device. Block times are per sample per stage (the H100's, ../shared/gpu/README.md); launch costs
    are host seconds per block call, measured on this CPU (gpu_proxy.measure_launch); the rest are assumptions for an
    H100 host (PCIe 5, HBM3), each one number, in the results beside the figures."""

    forward: float  # seconds per sample per stage, all its blocks
    backward: float
    blocks_per_stage: int = 4
    launch_forward: float = 2e-4  # host seconds to launch one block's forward
    launch_backward: float = 4e-4
    # the share of a block's launch that holds the GIL: eager PyTorch runs an op's Python glue holding it and its C++
    # dispatch without it; autograd's engine runs a backward's ops in C++ (py-spy with and without --gil on
    # examples/gpt.py's Block on this CPU: benchmarks/RESULTS.md, "the launch's GIL")
    gil_forward: float = 0.47
    gil_backward: float = 0.14
    kernel_launch: float = 1e-5  # host seconds to launch a small kernel (codec, check, optimizer)
    kernel_min: float = 5e-6  # the shortest kernel
    hbm: float = 2.5e12  # bytes/s of memory-bound kernels
    pinned: float = 25e9  # bytes/s of copies between pinned host memory and the device (asynchronous)
    pageable: float = 12e9  # bytes/s of copies between pageable host memory and the device (the host blocks)
    copy_latency: float = 1e-5  # seconds each copy costs besides its bytes
    host_adam: float = 5e-9  # seconds per parameter of an AdamW step on one host thread (delayed updates; measured)

    def block_seconds(self, kind: int, samples: int) -> float:
        per_stage = self.forward if kind == BLOCK_FORWARD else self.backward
        return per_stage * samples / self.blocks_per_stage

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls, text: str) -> Calibration:
        return cls(**json.loads(text))


class _Log:
    """Records appended to a file mapped into memory: a header (at 8 the count, at 16 the records dropped past
    capacity; at 0 the shared log keeps the device's busy-until), then the records. Appending is the caller's to
    lock."""

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR)
        self.fd = fd
        self.map = mmap.mmap(fd, os.fstat(fd).st_size)
        self.counts = np.ndarray((2,), "<i8", self.map, 8)
        self.capacity = (len(self.map) - HEADER_BYTES) // RECORD.itemsize
        self.records = np.ndarray((self.capacity,), RECORD, self.map, HEADER_BYTES)

    @staticmethod
    def create(path: str, capacity: int) -> None:
        with open(path, "wb") as f:
            f.truncate(HEADER_BYTES + capacity * RECORD.itemsize)

    def append(
        self,
        t0: float,
        t1: float,
        proc: int,
        kind: int,
        key: int = 0,
        key2: int = 0,
        value: float = 0.0,
        extra: int = 0,
    ) -> None:
        i = int(self.counts[0])
        if i >= self.capacity:
            self.counts[1] += 1
            return
        self.records[i] = (t0, t1, value, key, key2, proc, kind, extra)
        self.counts[0] = i + 1

    def rows(self) -> np.ndarray:
        return self.records[: int(self.counts[0])]


class Timeline:
    """The device's timeline and the log: the device's kernels in a file mapped by every process (``create`` it
    first), appended under a lock they share (a thread lock and ``flock``); everything else a process records (its
    copies, syncs and host waits, what the swarm did) in a file of its own beside it, under a lock of its threads
    only, so that recording never waits for another process (a GPU's launches never wait on one either)."""

    def __init__(self, path: os.PathLike) -> None:
        self.path = str(path)
        self._shared = _Log(self.path)
        self._busy = np.ndarray((1,), "<f8", self._shared.map, 0)
        self._records = self._shared.records
        self.capacity = self._shared.capacity
        self._thread_lock = threading.Lock()
        self.own_lock = threading.Lock()  # this process's own log, and its streams' tails (EmulatedDevice)
        self._own: Optional[_Log] = None  # this process's, made at its first record
        self._own_pid = 0
        self._others: dict[str, _Log] = {}  # the processes' own logs, as read by records()

    @classmethod
    def create(cls, path: os.PathLike, capacity: int = 1 << 20) -> Timeline:
        _Log.create(str(path), capacity)
        return cls(path)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Exclusive use of the device's timeline: other threads of this process and other processes wait."""
        with self._thread_lock:
            fcntl.flock(self._shared.fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._shared.fd, fcntl.LOCK_UN)

    @property
    def busy_until(self) -> float:
        return float(self._busy[0])

    def own_log(self) -> _Log:
        """This process's own log, made at its first record (:attr:`own_lock` held); a forked child gets its own."""
        if self._own is None or self._own_pid != os.getpid():
            own = f"{self.path}.{os.getpid()}"
            _Log.create(own, self.capacity)
            self._own, self._own_pid = _Log(own), os.getpid()
        return self._own

    def record(self, *args: Any, **kwargs: Any) -> None:
        """Add a record that is not a kernel: to this process's own log."""
        with self.own_lock:
            self.own_log().append(*args, **kwargs)

    def enqueue(
        self,
        seconds: float,
        earliest: float,
        after: float,
        proc: int,
        kind: int,
        key: int = 0,
        value: float = 0.0,
        extra: int = 0,
    ) -> float:
        """Put a kernel of ``seconds`` on the device, starting at ``earliest`` at the soonest and after ``after``
        (its stream's last work) and after everything enqueued before it; returns when it ends (the lock held)."""
        start = max(earliest, float(self._busy[0]), after)
        end = start + seconds
        self._busy[0] = end
        self._shared.append(start, end, proc, kind, key, 0, value, extra)
        return end

    def enqueue_beside(
        self, seconds: float, earliest: float, after: float, proc: int, kind: int, key: int = 0, value: float = 0.0
    ) -> float:
        """Put a small kernel of ``seconds`` beside the kernels queued (see the module docstring): from ``earliest``
        and ``after`` (its stream's last work), or from the end of the kernel running then; marked ``key2`` = 1.
        Returns when it ends (the lock held)."""
        ready = max(earliest, after)
        if ready >= float(self._busy[0]):
            return self.enqueue(seconds, earliest, after, proc, kind, key, value)
        count = int(self._shared.counts[0])
        recent = self._records[max(0, count - BESIDE_SCAN) : count]
        t1, kinds = recent["t1"], recent["kind"]  # KERNELS are 1..6: compared (isin sorts: 5x slower)
        running = (recent["t0"] < ready) & (t1 > ready) & (kinds >= BLOCK_FORWARD) & (kinds <= OPTIMIZER)
        running = t1[running & (recent["key2"] == 0)]
        start = float(running.max()) if len(running) else ready
        self._shared.append(start, start + seconds, proc, kind, key, 1, value)
        return start + seconds

    def _logs(self) -> list[_Log]:
        """The device's log and each process's, each mapped once (a reader's maps stay open until it is gone)."""
        for path in sorted(glob.glob(f"{glob.escape(self.path)}.*")):
            if path not in self._others:
                self._others[path] = _Log(path)
        return [self._shared, *self._others.values()]

    def records(self) -> np.ndarray:
        """A copy of the records so far: the device's, then each process's own."""
        with self.locked():
            return np.concatenate([log.rows() for log in self._logs()])

    @property
    def dropped(self) -> int:
        """Records not kept: a log was full."""
        return sum(int(log.counts[1]) for log in self._logs())


class EmulatedDevice:
    """One process's view of the emulated device: its stream, its launches and syncs (see the module docstring)."""

    def __init__(self, timeline: Timeline, proc: int, calibration: Calibration) -> None:
        self.timeline, self.proc, self.cal = timeline, proc, calibration
        self._local = threading.local()  # the thread's stream (None: the compute stream); the request it computes
        self._tails: dict[Optional[int], float] = {}  # per stream (None: the default): when its last work ends
        self._compute_stream: Optional[int] = None  # the stream the blocks were last launched on
        self.optimizer_numel = 0  # the real model's parameter count behind this process's (one) optimizer

    @property
    def tail(self) -> float:
        """When the last work enqueued on the current thread's stream ends."""
        return self._tails.get(getattr(self._local, "stream", None), 0.0)

    @tail.setter
    def tail(self, value: float) -> None:
        self._tails[getattr(self._local, "stream", None)] = value

    # ---- the device ---------------------------------------------------------------------------------------------

    def kernel(
        self,
        seconds: float,
        kind: int,
        launch: Optional[float] = None,
        key: int = 0,
        extra: int = 0,
        gil: float = 1.0,
    ) -> None:
        """Launch a kernel of ``seconds``: enqueued, then the launch's host time spent on this thread's CPU, the share
        ``gil`` of it holding the GIL."""
        launch = self.cal.kernel_launch if launch is None else launch
        seconds = max(seconds, self.cal.kernel_min)
        now, stream = time.monotonic(), getattr(self._local, "stream", None)
        if kind in BLOCKS:
            self._compute_stream = stream
        with self.timeline.own_lock, self.timeline.locked():
            # launched over [now, now + launch]: the kernel cannot end before its launch does
            earliest = now + max(0.0, launch - seconds)
            if kind in (CODEC, FINITE) and stream != self._compute_stream:
                self.tail = self.timeline.enqueue_beside(seconds, earliest, self.tail, self.proc, kind, key, launch)
            else:
                self.tail = self.timeline.enqueue(seconds, earliest, self.tail, self.proc, kind, key, launch, extra)
        _occupy(launch, gil)

    def copy_async(self, nbytes: int) -> None:
        """An asynchronous copy of ``nbytes`` from pinned memory onto this process's stream."""
        seconds = self.cal.copy_latency + nbytes / self.cal.pinned
        with self.timeline.own_lock:  # a stream is this process's: no other process is waited for
            start = max(time.monotonic(), self.tail)
            self.tail = start + seconds
            self.timeline.own_log().append(start, self.tail, self.proc, COPY, value=nbytes)

    def synchronize(self, every_stream: bool = False) -> None:
        """Wait until the work enqueued so far on the current thread's stream (or on all of this process's) is done
        (the GIL released)."""
        self.wait_until(max(self._tails.values(), default=0.0) if every_stream else self.tail)

    def wait_until(self, target: float) -> None:
        """The host waits (the GIL released) until the device reached ``target`` (a time on the timeline)."""
        start = time.monotonic()
        if target <= start:
            return
        spun = _wait_until(target)
        self.timeline.record(start, time.monotonic(), self.proc, SYNC, value=spun)

    def blocking(self, seconds: float, what: int, nbytes: int = 0) -> None:
        """The host blocked after this process's queued work, for ``seconds`` (a copy through pageable memory, or
        host work on the step's buffers); the stream too (a blocking copy is ordered on it)."""
        self.synchronize()
        start = time.monotonic()
        _wait_until(start + seconds)
        end = time.monotonic()
        with self.timeline.own_lock:
            self.tail = max(self.tail, end)
            self.timeline.own_log().append(start, end, self.proc, HOST_WAIT, value=nbytes, extra=what)

    def host_work(self, seconds: float, what: int, nbytes: int = 0) -> None:
        """Host work that needs nothing from the device (the offloaded optimizer's step): a wait of ``seconds``."""
        start = time.monotonic()
        _wait_until(start + seconds)
        self.timeline.record(start, time.monotonic(), self.proc, HOST_WAIT, value=nbytes, extra=what)

    def pageable_copy(self, nbytes: int, what: int) -> None:
        self.blocking(self.cal.copy_latency + nbytes / self.cal.pageable, what, nbytes)

    def memory_kernel(self, nbytes: int, kind: int, launches: int = 1, key: int = 0) -> None:
        """A memory-bound kernel moving ``nbytes`` (``launches`` small kernels' launch time)."""
        self.kernel(nbytes / self.cal.hbm, kind, launches * self.cal.kernel_launch, key)

    # ---- the request a stage server computes ----------------------------------------------------------------------

    def set_request(self, key: int, kind: int) -> None:
        self._local.request = (key, kind)

    def request(self) -> tuple[int, int]:
        return getattr(self._local, "request", (0, 0))

    # ---- lightning_swarm.device_sync in its place -----------------------------------------------------------------

    def sync_device(self, device: torch.device) -> None:
        self.synchronize(every_stream=True)

    def mark(self, device: torch.device) -> Any:
        """An event after the current stream's work so far: the time the stream reaches it."""
        from lightning_swarm.device_sync import Mark

        return Mark(device, max(time.monotonic(), self.tail), time.perf_counter())

    @staticmethod
    def seconds_between(start: Any, end: Any) -> Optional[float]:
        return None if time.monotonic() < end.event else end.event - start.event

    @contextlib.contextmanager
    def side_stream(self, device: torch.device) -> Iterator[None]:
        """The current thread's own stream, with a tail of its own."""
        before = getattr(self._local, "stream", None)
        self._local.stream = threading.get_ident()
        try:
            yield
        finally:
            self._local.stream = before

    def wait_for(self, done: Any, tensors: Any = ()) -> None:
        self.tail = max(self.tail, done.event)

    def all_finite(self, tensor: torch.Tensor) -> bool:
        """The check's reduction, then the host reads its one value (the emulated tensor holds no values to check)."""
        self.memory_kernel(tensor.numel() * tensor.element_size(), FINITE)
        self.pageable_copy(1, HOST_READ)
        return True

    def all_finite_later(self, tensors: list[torch.Tensor]) -> Any:
        """The check's reductions and the copy of its one byte into pinned memory, queued on the current stream; the
        host reads it later, waiting only until the device got there (the emulated tensors hold no values)."""
        from lightning_swarm.device_sync import Flag

        if not tensors:
            return Flag(torch.tensor(True))
        for tensor in tensors:
            self.memory_kernel(tensor.numel() * tensor.element_size(), FINITE)
        self.copy_async(1)
        return Flag(torch.tensor(True), _Reached(self, self.tail))

    def to_host(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """A message's pieces (flat uint8) copied from the device into one pinned buffer on the current stream, which
        the host then waits for: no host work (a GPU's copy engine does it), and the zeros the emulated codec made.
        Pieces made on the host (a receipt) are copied on the host without waiting, as ``device_sync.to_host``
        does."""
        nbytes = sum(part.numel() for part in parts)
        if not any(_on_device(part) for part in parts):
            return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
        self.copy_async(nbytes)
        self.synchronize()
        return _zeros_of(nbytes, torch.uint8)


class _Reached:
    """An event of the emulated device: ``synchronize`` waits until the device reached ``at``."""

    def __init__(self, device: EmulatedDevice, at: float) -> None:
        self.device, self.at = device, at

    def synchronize(self) -> None:
        self.device.wait_until(self.at)


def _occupy(seconds: float, gil: float = 1.0) -> None:
    """Use ``seconds`` of this thread's CPU, as launching kernels does, in slices of ``OCCUPY_SLICE``: the share
    ``gil`` of each holding the GIL (a spin), the rest hashing a buffer, which releases it (the spin's loop and each
    hash call hold it too: about 8% of the released part, measured with py-spy)."""
    now = time.thread_time()
    end = now + seconds
    while now < end:
        held_until = min(end, now + gil * OCCUPY_SLICE)
        while now < held_until:
            now = time.thread_time()
        released_until = min(end, now + (1.0 - gil) * OCCUPY_SLICE)
        while now < released_until:
            hashlib.sha1(_RELEASED_WORK)
            now = time.thread_time()


def _wait_until(target: float) -> float:
    """Sleep until ``target`` (monotonic), yielding the last ``SPIN`` seconds; returns the seconds spent yielding."""
    yielded = 0.0
    while True:
        left = target - time.monotonic()
        if left <= 0:
            return yielded
        if left > SPIN:
            time.sleep(left - SPIN)
        else:
            began = time.monotonic()
            time.sleep(0)
            yielded += time.monotonic() - began


def key_of(key: Any) -> int:
    """A request's key (the hex string the trainer makes, or the server's (caller, key) pair) as 64 bits."""
    if isinstance(key, tuple):
        key = key[1]
    if not isinstance(key, str) or not key:
        return 0
    try:
        return int(key[:16], 16)
    except ValueError:
        return int.from_bytes(key.encode()[:8].ljust(8, b"\0"), "little")


# ---- the emulated model -------------------------------------------------------------------------------------------

DEVICE: Optional[EmulatedDevice] = None  # this process's, once installed


class _BlockCall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, block: EmulatedBlock, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.block, ctx.shapes = block, [p.shape for p in params]
        ctx.samples = x.shape[0] if x.ndim else 1
        if DEVICE is not None and x.device.type != "meta":
            block.launch(BLOCK_FORWARD, ctx.samples)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if DEVICE is not None and grad.device.type != "meta":
            ctx.block.launch(BLOCK_BACKWARD, ctx.samples)
        return (None, torch.empty_like(grad), *(torch.zeros(s, device=grad.device) for s in ctx.shapes))


class EmulatedBlock(nn.Module):
    """Stands for examples/gpt.py's ``Block(d_model, d_model // 64)``: its parameters by name, one element each
    (``emulated_numel``: the real size), and a call that costs the calibrated device time for its samples and returns
    a real tensor of the input's size, not computed."""

    def __init__(self, d_model: int, calibration: Calibration) -> None:
        super().__init__()
        self.cal = calibration
        self.emulated_numel = 0
        for name, numel in real_block_parameters(d_model).items():
            self.register_parameter(name.replace(".", "_"), nn.Parameter(torch.zeros(1)))
            self.emulated_numel += numel

    def launch(self, kind: int, samples: int) -> None:
        key, request = DEVICE.request()
        forward = kind == BLOCK_FORWARD
        hold = self.cal.launch_forward if forward else self.cal.launch_backward
        gil = self.cal.gil_forward if forward else self.cal.gil_backward
        DEVICE.kernel(self.cal.block_seconds(kind, samples), kind, hold, key, request, gil)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _BlockCall.apply(self, x, *self.parameters())


@functools.cache
def real_block_parameters(d_model: int) -> dict[str, int]:
    """examples/gpt.py's Block's parameters: name -> number of elements (built on the meta device)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from gpt import Block

    with torch.device("meta"):
        block = Block(d_model, max(1, d_model // 64))
    return {name: p.numel() for name, p in block.named_parameters()}


class _LocalCall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, module: nn.Module, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.module, ctx.x_shape, ctx.x_dtype = module, x.shape, x.dtype
        return module.emulate_forward(x, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, ctx.module.emulate_backward(grad, ctx.x_shape), torch.zeros_like(ctx.module.weight)


class EmulatedEmbedding(nn.Module):
    """The trainer's token and position embeddings: token ids in, activations of ``d_model`` out, not computed (the
    pipeline's input gradient arrives decoded on the device)."""

    def __init__(self, vocab: int, block: int, d_model: int) -> None:
        super().__init__()
        self.d_model = d_model
        self.weight = nn.Parameter(torch.zeros(1))
        self.emulated_numel = (vocab + block) * d_model

    def emulate_forward(self, idx: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        out = torch.empty(*idx.shape, self.d_model)
        if DEVICE is not None:
            DEVICE.memory_kernel(out.numel() * 4 + idx.numel() * 8, LOCAL, launches=3)
        return out

    def emulate_backward(self, grad: torch.Tensor, shape: torch.Size) -> None:
        if DEVICE is not None:
            DEVICE.memory_kernel(2 * grad.numel() * grad.element_size(), LOCAL, launches=3)
        return None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return _LocalCall.apply(self, idx.float(), self.weight)


class EmulatedHead(nn.Module):
    """The final LayerNorm, the head and the loss: the pipeline's output in (decoded on the device), a real loss
    value out, neither computed; its gradient a real tensor of the output's size."""

    def __init__(self, vocab: int, d_model: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))
        self.emulated_numel = vocab * d_model + 2 * d_model
        self.vocab = vocab

    def emulate_forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if DEVICE is not None:
            DEVICE.memory_kernel(3 * x.numel() * x.element_size(), LOCAL, launches=6)
        return (weight * 0).sum() + 4.5  # a real, finite loss (about ln(96))

    def emulate_backward(self, grad: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        if DEVICE is not None:
            DEVICE.memory_kernel(4 * shape.numel() * 4, LOCAL, launches=8)
        return torch.empty(shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LocalCall.apply(self, x, self.weight)


# ---- the device's place in the real code --------------------------------------------------------------------------

_decoding = threading.local()  # set while a request is decoded onto the device (not on the host)
_zeros: dict[tuple[int, torch.dtype], torch.Tensor] = {}


def _zeros_of(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Shared zeros (read-only use): what the emulated quantize returns, so that the bytes sent decode to zeros. They
    stand for tensors on the device (:func:`_on_device`)."""
    key = (numel, dtype)
    if key not in _zeros:
        if len(_zeros) > 16:
            _zeros.clear()
        _zeros[key] = torch.zeros(numel, dtype=dtype)
    return _zeros[key]


def _staging(nbytes: int) -> torch.Tensor:
    """This thread's staging buffer of ``nbytes``: reused, as the pinned caching allocator reuses its blocks (a fresh
    host allocation of megabytes would be mapped anew and fault on every page, which ``pin_memory`` never does)."""
    buffer = getattr(_decoding, "staging", None)
    if buffer is None or buffer.numel() < nbytes:
        buffer = _decoding.staging = torch.empty(nbytes, dtype=torch.uint8)
    return buffer[:nbytes]


def _on_device(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` stands for one on the emulated device: a view of the codec's outputs (the emulation's
    tensors all live in host memory; what the real code sends that was made on the host never waits for a GPU)."""
    pointer = tensor.untyped_storage().data_ptr()
    return any(pointer == zeros.untyped_storage().data_ptr() for zeros in _zeros.values())


def install(device: EmulatedDevice) -> None:
    """Put ``device`` where this process's code waits on the device or runs kernels (see the module docstring)."""
    global DEVICE
    DEVICE = device
    torch.set_flush_denormal(True)  # tensors not computed hold whatever was in memory: no slow denormals

    from lightning_swarm import compression, device_sync

    device_sync.synchronize = device.sync_device
    device_sync.all_finite = device.all_finite
    device_sync.all_finite_later = device.all_finite_later
    device_sync.to_host = device.to_host
    device_sync.mark = device.mark
    device_sync.seconds_between = device.seconds_between
    device_sync.side_stream = device.side_stream
    device_sync.wait_for = device.wait_for

    blocks = compression.BLOCK_SIZE
    deserialize, dequantize = compression.deserialize, compression._dequantize

    def quantize(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = tensor.numel()
        device.memory_kernel(n * (tensor.element_size() + 1), CODEC, launches=2)
        return _zeros_of(n, torch.uint8).view(tensor.shape), _zeros_of(-(-n // blocks), torch.float32)

    def emulated_dequantize(
        codes: torch.Tensor, absmax: torch.Tensor, dtype: torch.dtype, out: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        if not getattr(_decoding, "device", False):
            return dequantize(codes, absmax, dtype, out)  # on the host: the real thing
        nbytes = codes.numel() + 4 * absmax.numel()
        staging = _staging(nbytes)  # raw.pin_memory(): a host copy into a buffer of the pinned caching allocator
        staging[: codes.numel()].copy_(codes.reshape(-1))
        staging[codes.numel() :].copy_(absmax.reshape(-1).view(torch.uint8))
        device.copy_async(nbytes)
        device.memory_kernel(codes.numel() * (1 + torch.finfo(dtype).bits // 8), CODEC, launches=2)
        return torch.empty(codes.shape, dtype=dtype) if out is None else out

    def emulated_deserialize(message: Any, device: Any = None, out: Any = None, divide: float = 1.0) -> torch.Tensor:
        if device is None and out is None:
            return deserialize(message, divide=divide)
        _decoding.device = True
        try:
            return deserialize(message, device, out, divide)
        finally:
            _decoding.device = False

    compression._quantize = quantize
    compression._dequantize = emulated_dequantize
    compression.deserialize = emulated_deserialize
    _install_optimizer(device)


def _install_optimizer(device: EmulatedDevice) -> None:
    """The stage optimizer on the device: per backward, accumulation into the gradient accumulators; per step:

    - synchronous updates, no round (one peer, or a failed round): the accumulators copied into ``.grad`` and scaled
      there, on the device (``SwarmOptimizer._load_local_gradients_into_optimizer``: one multi-tensor copy and one
      multi-tensor multiply, each reading and writing 4 bytes per element), then the optimizer's step kernel;
    - synchronous updates, a round: the accumulators scaled on the device and copied into the shared host memory,
      pinned (``device_sync.copy_scaled``), averaged, copied back from there (``device_sync.copy_waited``), then the
      step kernel;
    - delayed updates (the optimizer offloaded to the host): the accumulators scaled and copied into the shared host
      memory the same way, the AdamW step on one host thread in hivemind's background thread, the new parameters
      copied back to the device when applied (pageable);

    then the accumulators zeroed. Sizes: the real model's parameters (``device.optimizer_numel``), fp32."""
    from hivemind.optim.state_averager import TrainingStateAverager

    from lightning_swarm import device_sync
    from lightning_swarm.optimizer import BoundedGradientAverager, SwarmOptimizer

    cal = device.cal
    accumulate, reset = BoundedGradientAverager.accumulate_grads_, BoundedGradientAverager.reset_accumulated_grads_
    copy_scaled, copy_waited = device_sync.copy_scaled, device_sync.copy_waited
    state_init = TrainingStateAverager.__init__
    local_into_optimizer = SwarmOptimizer._load_local_gradients_into_optimizer
    apply_parameters = TrainingStateAverager._apply_optimizer_parameters_

    def accumulate_grads_(self, batch_size: int) -> None:
        accumulate(self, batch_size)
        device.memory_kernel(12 * device.optimizer_numel, OPTIMIZER, launches=2)

    def emulated_copy_scaled(destinations: Any, sources: Any, scale: float) -> None:
        device.memory_kernel(8 * device.optimizer_numel, OPTIMIZER)
        device.copy_async(4 * device.optimizer_numel)
        device.synchronize()
        copy_scaled(destinations, sources, scale)

    def emulated_copy_waited(destinations: Any, sources: Any) -> None:
        device.copy_async(4 * device.optimizer_numel)
        device.synchronize()
        copy_waited(destinations, sources)

    def reset_accumulated_grads_(self) -> None:
        reset(self)
        device.memory_kernel(4 * device.optimizer_numel, OPTIMIZER)

    def load_local_into_optimizer(self) -> None:
        local_into_optimizer(self)
        if not self.offload_optimizer:  # delayed updates go through load_accumulators_into_averager_ (charged there)
            device.memory_kernel(16 * device.optimizer_numel, OPTIMIZER, launches=2)

    def init(self, *args: Any, **kwargs: Any) -> None:
        state_init(self, *args, **kwargs)
        if not self.offload_optimizer:
            # AdamW's multi-tensor step on a GPU: its kernels' launches, and parameters, gradients and two moments, 28
            # bytes each, on the device. Not the real step: on the CPU it runs one operation per tensor (torch's
            # multi-tensor path is for CUDA tensors), milliseconds of the GIL for one-element stand-ins whose values
            # nothing reads
            self.optimizer.step = lambda closure=None: device.memory_kernel(
                28 * device.optimizer_numel, OPTIMIZER, launches=4
            )
        else:  # the offloaded optimizer steps host copies of the parameters, on one thread
            self.optimizer.register_step_post_hook(
                lambda *_: device.host_work(cal.host_adam * device.optimizer_numel, HOST_ADAM)
            )

    def apply_optimizer_parameters_(self) -> None:
        device.pageable_copy(4 * device.optimizer_numel, HOST_H2D)
        apply_parameters(self)

    BoundedGradientAverager.accumulate_grads_ = accumulate_grads_
    device_sync.copy_scaled, device_sync.copy_waited = emulated_copy_scaled, emulated_copy_waited
    BoundedGradientAverager.reset_accumulated_grads_ = reset_accumulated_grads_
    SwarmOptimizer._load_local_gradients_into_optimizer = load_local_into_optimizer
    TrainingStateAverager.__init__ = init
    TrainingStateAverager._apply_optimizer_parameters_ = apply_optimizer_parameters_


class HostRecorder:
    """What :func:`instrument` needs of a device, for a real one: the timeline its records go to, this process's
    number, and the request a stage server's worker computes (``benchmarks/gpu.py --trace``)."""

    def __init__(self, timeline: Timeline, proc: int) -> None:
        self.timeline, self.proc = timeline, proc
        self._local = threading.local()

    set_request, request = EmulatedDevice.set_request, EmulatedDevice.request


def instrument(device: Union[EmulatedDevice, HostRecorder]) -> None:
    """Records of what the swarm does, on the timeline (wrappers that call the real methods unchanged)."""
    from lightning_swarm import protocol
    from lightning_swarm.client.remote_pipeline import RemotePipeline
    from lightning_swarm.client.routing import PendingCall, StageRouter
    from lightning_swarm.optimizer import SwarmOptimizer
    from lightning_swarm.server.backend import StageBackend
    from lightning_swarm.server.runtime import StageRuntime
    from lightning_swarm.server.stage_server import StageServer

    timeline, proc, now = device.timeline, device.proc, time.monotonic

    def request_key(metadata: Any, kind: str) -> int:
        try:
            decoded = protocol.decode_metadata(metadata) if isinstance(metadata, (bytes, bytearray)) else metadata
            return key_of(decoded.get("keep" if kind == "forward" else "kept"))
        except Exception:
            return 0

    answer_tensors, submit, serve = StageServer.answer_tensors, StageServer._submit, StageRuntime._serve
    hand_over, update_epoch = StageBackend.hand_over_gradients, SwarmOptimizer._update_global_epoch
    apply_update = SwarmOptimizer.apply_finished_update

    async def answer(self, kind: str, request: Any, caller: str = "this peer") -> Any:
        start, key = now(), request_key(request.metadata, kind)
        timeline.record(start, start, proc, ARRIVE, key, extra=REQUEST_KINDS.get(kind, 0))
        try:
            return await answer_tensors(self, kind, request, caller)
        finally:
            timeline.record(start, now(), proc, ANSWER, key, extra=REQUEST_KINDS.get(kind, 0))

    def submitted(self, caller: str, task: Any, key: Any, owner: str) -> Any:
        t = now()
        timeline.record(t, t, proc, SUBMIT, key_of(key), value=task.batch, extra=REQUEST_KINDS.get(task.kind, 0))
        return submit(self, caller, task, key, owner)

    def served(self, tasks: list) -> Any:
        start, code, key = now(), REQUEST_KINDS.get(tasks[0].kind, 0), tasks[0].key
        device.set_request(key_of(key), code)
        try:
            return serve(self, tasks)
        finally:
            device.set_request(0, 0)
            batch = sum(task.batch for task in tasks)
            timeline.record(start, now(), proc, SERVE, key_of(key), value=batch, extra=code)

    def handed_over(self, batch: int) -> None:
        start, epoch = now(), getattr(self.optimizer, "local_epoch", 0)
        try:
            hand_over(self, batch)
        finally:
            stepped = int(getattr(self.optimizer, "local_epoch", 0) > epoch)
            timeline.record(start, now(), proc, HANDOVER, device.request()[0], value=batch, extra=stepped)

    def updated_epoch(self, grad_scaler: Any) -> None:
        start = now()
        try:
            update_epoch(self, grad_scaler)
        finally:
            timeline.record(start, now(), proc, STEP)

    def applied_update(self, wait: bool = False) -> None:
        if not self.delay_optimizer_step:
            return
        start = now()
        try:
            apply_update(self, wait)
        finally:
            timeline.record(start, now(), proc, STEP, extra=1)

    StageServer.answer_tensors = answer
    StageServer._submit = submitted
    StageRuntime._serve = served
    StageBackend.hand_over_gradients = handed_over
    SwarmOptimizer._update_global_epoch = updated_epoch
    SwarmOptimizer.apply_finished_update = applied_update

    forward_route, run_forward, run_backward = (
        RemotePipeline._forward_route,
        RemotePipeline.run_forward,
        RemotePipeline.run_backward,
    )
    start_call, result, finish = StageRouter.start_call, PendingCall.result, StageRouter.finish

    def routed(self, *args: Any, **kwargs: Any) -> Any:
        decoded, route = forward_route(self, *args, **kwargs)
        keys = [key_of(k) for k in route.keys] + [0, 0]
        t = now()
        timeline.record(t, t, proc, ROUTE, keys[0], keys[1], extra=len(route.keys))
        return decoded, route

    def ran_forward(self, *args: Any, **kwargs: Any) -> Any:
        start = now()
        try:
            return run_forward(self, *args, **kwargs)
        finally:
            timeline.record(start, now(), proc, PIPE_FORWARD)

    def ran_backward(self, *args: Any, **kwargs: Any) -> Any:
        start = now()
        try:
            return run_backward(self, *args, **kwargs)
        finally:
            timeline.record(start, now(), proc, PIPE_BACKWARD)

    def started(self, stage: int, peer: str, method: str, tensors: list, metadata: dict, *args: Any, **kw: Any) -> Any:
        start = now()
        call = start_call(self, stage, peer, method, tensors, metadata, *args, **kw)
        call.stamp = start, request_key(metadata, method), stage, REQUEST_KINDS.get(method, 0)
        return call

    def answered(self) -> Any:
        try:
            return result(self)
        finally:
            start, key, stage, kind = self.stamp
            timeline.record(start, now(), proc, CALL, key, value=stage, extra=kind)

    def checked(self, call: Any, *args: Any, **kw: Any) -> Any:
        try:
            return finish(self, call, *args, **kw)
        finally:
            start, key, stage, kind = call.stamp
            timeline.record(start, now(), proc, CHECK, key, value=stage, extra=kind)

    RemotePipeline._forward_route = routed
    RemotePipeline.run_forward = ran_forward
    RemotePipeline.run_backward = ran_backward
    StageRouter.start_call = started
    PendingCall.result = answered
    StageRouter.finish = checked
