"""Activations a stage server keeps between a microbatch's forward and its backward.

Backward is cheapest on the peer that ran the forward: it still holds the autograd graph, so it neither
recomputes the forward nor needs the stage's input sent again. Those graphs hold memory, so they are kept for a
bounded time and up to a bounded number of bytes (what autograd saved, counted as it saves it, plus the stage's
input and output). Past the byte cap, a caller gives up its oldest forward first: the one that holds the most bytes
for the share of its recent forwards whose backward came (kept or not by then; a new caller starts with the benefit
of the doubt). So a caller that keeps forwards and never sends their backward (a flood, or a trainer that died)
loses them before a trainer that does, even one that holds more (its backward trailing behind its next batch's
forwards); between callers that send their backwards, the one that holds the most gives up first. The share counts
what the callers did, not what the cap took from them: forwards lost to the cap do not count against a trainer. A
backward whose graph was dropped falls back to recomputation from the input.

The default bound (:func:`default_max_bytes`) is a fraction of the accelerator's free memory when the server
starts, measured after the stage's parameters and optimizer state were allocated; on the CPU it stays 1 GiB.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Generator, Hashable, Iterable, Optional

import torch


@dataclass
class Kept:
    """One forward pass: its input (a leaf that requires grad), its output with the graph, and what it costs."""

    inputs: torch.Tensor
    outputs: torch.Tensor
    nbytes: int
    params_version: int
    calls: Any = None  # the side inputs of the stage's blocks, to recompute it if the parameters changed
    created: float = field(default_factory=time.monotonic)
    owner: Hashable = None  # the caller whose forward it is: the cap is shared fairly between callers


PRIOR_FORWARDS = 8.0  # forwards an owner not seen yet is counted as having sent the backward of
DECAY = 0.99  # the weight of an owner's earlier forwards at each new one: its record spans ~100 forwards
MAX_OWNERS = 1024  # records kept; past it, those of owners holding nothing are forgotten


class KeptActivations:
    """Forward passes waiting for their backward, bounded by ``max_bytes`` and ``ttl`` seconds; past ``max_bytes``,
    the owner holding the most bytes for the share of its forwards whose backward came loses its oldest first."""

    def __init__(self, max_bytes: int, ttl: float) -> None:
        self.max_bytes, self.ttl = max_bytes, ttl
        self.nbytes = 0
        self.dropped = 0  # forward passes dropped before their backward came (time or memory)
        self._entries: OrderedDict[Hashable, Kept] = OrderedDict()
        self._owned: dict[Hashable, int] = {}  # owner -> bytes it holds
        self._record: dict[Hashable, list[float]] = {}  # owner -> [its recent forwards, their backwards that came]
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def owned(self, owner: Hashable) -> int:
        """Bytes the forwards of ``owner`` hold."""
        return self._owned.get(owner, 0)

    def use(self, owner: Hashable) -> float:
        """The share of ``owner``'s recent forwards whose backward came (1.0 for an owner not seen yet)."""
        forwards, backwards = self._record.get(owner, (0.0, 0.0))
        return (backwards + PRIOR_FORWARDS) / (forwards + PRIOR_FORWARDS)

    def put(self, key: Hashable, kept: Kept) -> None:
        """Keep ``kept`` under ``key`` (replacing what the key held); past the cap, drop the oldest entries of the
        owner that holds the most bytes for the share of its forwards whose backward came."""
        with self._lock:
            self._remove(key)
            record = self._record.setdefault(kept.owner, [0.0, 0.0])
            record[0], record[1] = DECAY * record[0] + 1, DECAY * record[1]
            if len(self._record) > MAX_OWNERS:
                self._record = {o: r for o, r in self._record.items() if o in self._owned or o == kept.owner}
            if kept.nbytes > self.max_bytes:
                self.dropped += 1
                return
            self._entries[key] = kept
            self.nbytes += kept.nbytes
            self._owned[kept.owner] = self._owned.get(kept.owner, 0) + kept.nbytes
            while self.nbytes > self.max_bytes:
                greediest = max(self._owned, key=lambda owner: self._owned[owner] / self.use(owner))
                self._remove(next(k for k, e in self._entries.items() if e.owner == greediest))
                self.dropped += 1

    def pop(self, key: Hashable, backward_of: Hashable = None) -> Optional[Kept]:
        """The forward kept under ``key`` (None if there is none, or no more), taken back. ``backward_of``: the
        owner whose backward came for it, counted in its record whether the forward was still kept or not."""
        with self._lock:
            if backward_of in self._record:
                record = self._record[backward_of]
                record[1] = min(record[1] + 1, record[0])
            return self._remove(key)

    def expire(self) -> None:
        """Drop the forward passes older than ``ttl``."""
        now = time.monotonic()
        with self._lock:
            while self._entries and now - next(iter(self._entries.values())).created > self.ttl:
                self._remove(next(iter(self._entries)))
                self.dropped += 1

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._owned.clear()
            self._record.clear()
            self.nbytes = 0

    def _remove(self, key: Hashable) -> Optional[Kept]:
        kept = self._entries.pop(key, None)
        if kept is not None:
            self.nbytes -= kept.nbytes
            self._owned[kept.owner] = self._owned.get(kept.owner, 0) - kept.nbytes
            if not self._owned[kept.owner]:
                del self._owned[kept.owner]
        return kept


DEVICE_MEMORY_FRACTION = 0.5  # of a CUDA device's free memory; the rest: gradients, backward's workspace, decoding
CPU_MAX_BYTES = 2**30


def default_max_bytes(device: torch.device) -> int:
    """The default cap on kept activations: half of ``device``'s free memory now on CUDA, else 1 GiB."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * DEVICE_MEMORY_FRACTION)
    return CPU_MAX_BYTES


class SavedBytes:
    """Bytes of the distinct storages counted so far (each once), except those of ``exclude`` (the parameters,
    which exist anyway)."""

    def __init__(self, exclude: Iterable[torch.Tensor]) -> None:
        self._skip = {t.untyped_storage().data_ptr() for t in exclude}
        self._seen: set[int] = set()
        self.nbytes = 0

    def count(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self._skip and storage.data_ptr() not in self._seen:
            self._seen.add(storage.data_ptr())
            self.nbytes += storage.nbytes()

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        """The saved-tensors hook: count ``tensor`` and save it detached. Saved as it is, an op's saved output would
        hold its own graph in a reference cycle through autograd's C++ nodes, which no garbage collector frees: a
        graph dropped before its backward (over the cap, expired, from before a step) leaked what it saved."""
        self.count(tensor)
        return tensor.detach()


@contextlib.contextmanager
def counting_saved_bytes(exclude: Iterable[torch.Tensor]) -> Generator[SavedBytes, None, None]:
    """Count the storages autograd saves inside the block (each storage once, whole even when a view was saved),
    except those of ``exclude``. Modules that save tensors on their own (checkpointing) count what they keep.
    Gradients through the block stay first-order: what it saved is detached from the graph."""
    saved = SavedBytes(exclude)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda tensor: tensor):
        yield saved
