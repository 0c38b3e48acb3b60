"""The places where host code waits for the device, or orders work between streams, in one module.

A GPU runs kernels after they were launched, so the host waits only where it needs a result: the finiteness check of
a decoded reply (a reduction read on the host; a stage server's requests are checked later, :func:`all_finite_later`,
read once their compute is done), the device-to-host copy of an encoded tensor
(:func:`~lightning_swarm.compression.encode`), and, to know how long a request computed, a pair of events
(:func:`mark`, :func:`seconds_between`) read once the device passed them, never waited for. A stage server decodes and
encodes on a stream of the decoding thread's own (:func:`side_stream`), ordered after the compute by events
(:func:`wait_for`), so that a reply's copy never waits behind the next request's kernels. A stage optimizer's round
moves its gradients between the device and hivemind's shared host buffers, pinned (:func:`register_pinned`), scaled
on the device on the way out (:func:`copy_scaled`), in one multi-tensor copy on the way back (:func:`copy_waited`),
and waits for those copies: another process reads and writes the buffers next. Each function is looked up
at every call, so that ``benchmarks/gpu_proxy.py`` can put an emulated device in their place (its device time on a
timeline that the processes of a swarm share); the functions themselves are exactly the torch calls they stand for.
On the CPU they wait for nothing: the work is done when the call returns.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional, Sequence

import torch

log = logging.getLogger(__name__)
_streams = threading.local()  # this thread's side stream, per CUDA device


@dataclass(frozen=True)
class Mark:
    """A point in the work queued on ``device``: a CUDA event recorded on its current stream (None on the CPU,
    where the work is done when it is queued) and the host clock when it was recorded."""

    device: torch.device
    event: Any
    host_time: float


def synchronize(device: torch.device) -> None:
    """Wait for all the work queued on ``device`` (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mark(device: torch.device) -> Mark:
    """A mark after the work queued so far on the current stream of ``device``."""
    if device.type != "cuda":
        return Mark(device, None, time.perf_counter())
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return Mark(device, event, time.perf_counter())


def seconds_between(start: Mark, end: Mark) -> Optional[float]:
    """The device's time from ``start`` to ``end``, or None while it has not reached ``end`` (never waits)."""
    if end.event is None:
        return end.host_time - start.host_time
    if not end.event.query():
        return None
    return start.event.elapsed_time(end.event) / 1000.0


@contextlib.contextmanager
def side_stream(device: torch.device) -> Iterator[None]:
    """Queue the enclosed work on a stream of this thread's own on ``device``, beside the compute stream."""
    if device.type != "cuda":
        yield
        return
    streams = _streams.__dict__.setdefault("by_device", {})
    stream = streams.get(device)
    if stream is None:
        stream = streams[device] = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        yield


def wait_for(done: Mark, tensors: Iterable[torch.Tensor] = ()) -> None:
    """Queue the current stream's next work after ``done``; ``tensors``, made on another stream, are marked as used
    on this one, so that their memory is not reused before this stream is done with them."""
    if done.event is None:
        return
    stream = torch.cuda.current_stream(done.device)
    stream.wait_event(done.event)
    for tensor in tensors:
        if tensor.is_cuda:
            tensor.record_stream(stream)


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every value of ``tensor`` is finite (on a GPU, the host waits for the current stream's reduction)."""
    return bool(torch.isfinite(tensor).all())


class Flag:
    """A boolean computed on the device, read on the host only when it is needed (:func:`all_finite_later`)."""

    def __init__(self, value: torch.Tensor, event: Any = None) -> None:
        self._value, self._event = value, event

    def read(self) -> bool:
        """The value, once the device computed it (on a GPU, the host waits for that point of its stream only)."""
        if self._event is not None:
            self._event.synchronize()
        return bool(self._value)


def all_finite_later(tensors: Sequence[torch.Tensor]) -> Flag:
    """Whether every value of ``tensors`` is finite, without waiting: on a GPU the reduction is queued on the current
    stream and its one byte copied into pinned memory behind it (on the CPU it is computed at once)."""
    if not tensors:
        return Flag(torch.tensor(True))
    ok = torch.stack([torch.isfinite(tensor).all() for tensor in tensors]).all()
    if not ok.is_cuda:
        return Flag(ok)
    host = torch.empty((), dtype=torch.bool, pin_memory=True)
    host.copy_(ok, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(ok.device))
    return Flag(host, event)


def to_host(parts: list[torch.Tensor]) -> torch.Tensor:
    """``parts`` (flat uint8 tensors) back to back in one new host buffer: from a GPU, copied into pinned memory on
    the current stream, which the host then waits for (not for the device's other streams); a message's bytes are
    sent from it as they are, with no copy on the host."""
    gpu = next((part.device for part in parts if part.is_cuda), None)
    host = torch.empty(sum(part.numel() for part in parts), dtype=torch.uint8, pin_memory=gpu is not None)
    offset = 0
    for part in parts:
        host[offset : offset + part.numel()].copy_(part, non_blocking=part.is_cuda)
        offset += part.numel()
    if gpu is not None:
        torch.cuda.current_stream(gpu).synchronize()
    return host


SCALED_CHUNK = 16 * 2**20  # elements a scaled copy to the host scales on the device at once (64 MiB of fp32)


def register_pinned(tensors: Iterable[torch.Tensor]) -> list[int]:
    """Page-lock the host memory of ``tensors`` (allocated already: hivemind's shared-memory buffers) for CUDA, so
    that copies between it and a GPU run at the pinned rate; returns the addresses registered, for
    :func:`unregister_pinned`. Without CUDA nothing is registered; memory CUDA refuses stays pageable, and its copies
    go through the driver's staging buffers, as before."""
    if not torch.cuda.is_available():
        return []
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in tensors if not t.is_cuda}
    registered = []
    for address, storage in storages.items():
        if storage.nbytes() == 0 or storage.is_pinned():
            continue
        try:
            torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(address, storage.nbytes(), 0))
        except RuntimeError as e:  # torch.cuda.CudaError among them
            log.debug("Host memory of %d bytes stays pageable: %r", storage.nbytes(), e)
            continue
        registered.append(address)
    return registered


def unregister_pinned(addresses: Iterable[int]) -> None:
    """Undo :func:`register_pinned` (before the memory is freed)."""
    for address in addresses:
        torch.cuda.cudart().cudaHostUnregister(address)


def copy_scaled(destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor], scale: float) -> None:
    """Each of ``destinations`` (host memory) set to its source times ``scale``, done when this returns. From a GPU
    the sources are scaled there, :data:`SCALED_CHUNK` elements at a time (the only extra device memory), and copied
    without blocking (at the pinned rate where :func:`register_pinned` pinned the destinations), then the current
    stream is waited for; on the CPU one copy and one multiply, each a multi-tensor call. Either way each value is
    rounded once, so both give the same bits."""
    if not any(source.is_cuda for source in sources):
        torch._foreach_copy_(list(destinations), list(sources))
        torch._foreach_mul_(list(destinations), scale)
        return
    for chunk in _chunks(destinations, sources, SCALED_CHUNK):
        outs, ins = zip(*chunk)
        torch._foreach_copy_(list(outs), torch._foreach_mul(list(ins), scale), non_blocking=True)
    torch.cuda.current_stream(next(s.device for s in sources if s.is_cuda)).synchronize()


def copy_waited(destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """Each of ``destinations`` set to its source in one multi-tensor copy, done when this returns: one side is host
    memory that another process reads or writes next."""
    torch._foreach_copy_(list(destinations), list(sources), non_blocking=True)
    gpu = next((t.device for t in (*destinations, *sources) if t.is_cuda), None)
    if gpu is not None:
        torch.cuda.current_stream(gpu).synchronize()


def _chunks(
    destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor], limit: int
) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Pairs of flat views of ``destinations`` and ``sources``, grouped so that a group holds at most ``limit``
    elements (a tensor larger than that is cut into pieces)."""
    group, size = [], 0
    for out, source in zip(destinations, sources):
        out, source = out.view(-1), source.reshape(-1)
        for start in range(0, out.numel(), limit):
            piece = (out[start : start + limit], source[start : start + limit])
            if group and size + piece[0].numel() > limit:
                yield group
                group, size = [], 0
            group.append(piece)
            size += piece[0].numel()
    if group:
        yield group
