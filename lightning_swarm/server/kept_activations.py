"""Activations a stage server keeps between a microbatch's forward and its backward.

Backward is cheapest on the peer that ran the forward: it still holds the autograd graph, so it neither
recomputes the forward nor needs the stage's input sent again. Those graphs hold memory, so they are kept for a
bounded time and up to a bounded number of bytes (what autograd saved, counted as it saves it), the oldest
dropped first. A backward whose graph was dropped falls back to recomputation from the input.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Generator, Hashable, Iterable, Optional

import torch


@dataclass
class Kept:
    """One forward pass: its input (a leaf that requires grad), its output with the graph, and what it costs."""

    inputs: torch.Tensor
    outputs: torch.Tensor
    nbytes: int
    params_version: int
    created: float = field(default_factory=time.monotonic)


class KeptActivations:
    """Forward passes waiting for their backward, bounded by ``max_bytes`` and ``ttl`` seconds."""

    def __init__(self, max_bytes: int, ttl: float) -> None:
        self.max_bytes, self.ttl = max_bytes, ttl
        self.nbytes = 0
        self.dropped = 0  # forward passes dropped before their backward came (time or memory)
        self._entries: OrderedDict[Hashable, Kept] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, key: Hashable, kept: Kept) -> None:
        """Keep ``kept`` under ``key`` (replacing what the key held), dropping the oldest entries past the cap."""
        with self._lock:
            replaced = self._entries.pop(key, None)
            if replaced is not None:
                self.nbytes -= replaced.nbytes
            if kept.nbytes > self.max_bytes:
                self.dropped += 1
                return
            self._entries[key] = kept
            self.nbytes += kept.nbytes
            while self.nbytes > self.max_bytes:
                self._drop_oldest()

    def pop(self, key: Hashable) -> Optional[Kept]:
        with self._lock:
            kept = self._entries.pop(key, None)
            if kept is not None:
                self.nbytes -= kept.nbytes
            return kept

    def expire(self) -> None:
        """Drop the forward passes older than ``ttl``."""
        now = time.monotonic()
        with self._lock:
            while self._entries and now - next(iter(self._entries.values())).created > self.ttl:
                self._drop_oldest()

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.nbytes = 0

    def _drop_oldest(self) -> None:
        _, kept = self._entries.popitem(last=False)
        self.nbytes -= kept.nbytes
        self.dropped += 1


@contextlib.contextmanager
def counting_saved_bytes(exclude: Iterable[torch.Tensor]) -> Generator[list[int], None, None]:
    """Count the bytes of the storages autograd saves inside the block (each storage once), except those of
    ``exclude`` (the parameters, which exist anyway). Yields a one-element list that holds the count."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}
    total = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in skip and storage.data_ptr() not in seen:
            seen[storage.data_ptr()] = storage.nbytes()
            total[0] += storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield total
