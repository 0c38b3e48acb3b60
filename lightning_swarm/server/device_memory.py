"""What a stage server's device memory holds, for finding out where it goes (CUDA only; nothing on the CPU).

:func:`usage` is part of the server's ``rpc_info`` answer: bytes allocated and reserved by PyTorch's caching
allocator, now and at their peak. A large gap between reserved and allocated is the allocator's cache
(fragmentation); allocated memory beyond the stage's parameters, gradients, optimizer state and kept activations is
held by something else.

With ``SWARM_MEMORY_SNAPSHOT=<path>`` in its environment, a server records the device's allocations with their
Python stack traces (C++ frames would start addr2line processes at each dump, still running seconds later on an
H200) and writes PyTorch's memory snapshot to ``<path>`` when a request runs out of memory and when the server
stops: open it at https://pytorch.org/memory_viz to see which tensors were alive at the peak.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch

log = logging.getLogger(__name__)

SNAPSHOT_ENV = "SWARM_MEMORY_SNAPSHOT"
SNAPSHOT_ENTRIES = 200_000  # allocation events kept by the recorder (the oldest are forgotten)


def usage(device: torch.device) -> dict[str, int]:
    """Bytes allocated and reserved on ``device`` by this process, now and at their peak ({} off CUDA)."""
    if device.type != "cuda":
        return {}
    return dict(
        allocated=torch.cuda.memory_allocated(device),
        peak_allocated=torch.cuda.max_memory_allocated(device),
        reserved=torch.cuda.memory_reserved(device),
        peak_reserved=torch.cuda.max_memory_reserved(device),
    )


def start_recording(device: torch.device) -> Optional[str]:
    """Record ``device``'s allocations if ``SWARM_MEMORY_SNAPSHOT`` names a file; returns that path (or None)."""
    path = os.environ.get(SNAPSHOT_ENV)
    if not path or device.type != "cuda":
        return None
    torch.cuda.memory._record_memory_history(stacks="python", max_entries=SNAPSHOT_ENTRIES)
    return path


def dump(path: Optional[str]) -> None:
    """Write the memory snapshot to ``path`` (nothing if None); a failure is logged, never raised."""
    if path is None:
        return
    try:
        torch.cuda.memory._dump_snapshot(path)
        log.warning("Device memory snapshot written to %s", path)
    except Exception as e:
        log.warning("Could not write the device memory snapshot to %s: %r", path, e)
