"""Microbatch tuning: how many microbatches a batch is split into, chosen by measuring the trainer's own steps.

More microbatches in flight shrink the pipeline's bubble (a batch of ``M`` microbatches through ``S`` stages keeps
each stage busy ``M / (M + S - 1)`` of the time), but every microbatch pays a fixed cost per call (encoding,
transfer start, queueing, the server's dispatch). Which wins depends on the model's compute per sample, the links
and the peers, so no fixed rule is right for both a small model on a slow link and a large one on a fast link. With
``microbatches="auto"`` the trainer starts at ``AUTO_MICROBATCHES_PER_STAGE`` per stage, times a few batches at each
count, and climbs to the neighbouring divisor of the batch size while that is measurably faster, then keeps the
best count for that batch size. The loss and gradients do not depend on the count (see ``remote_pipeline``).
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

log = logging.getLogger(__name__)

Microbatches = Union[int, Literal["auto"]]
AUTO_MICROBATCHES_PER_STAGE = 2  # where tuning starts: one in each stage's compute, one in transfer
MIN_MICROBATCH_SIZE = 1  # samples
WARMUP_BATCHES = 2  # first batches at the starting count, not timed (connections, allocator, caches)
TRIAL_BATCHES = 3  # batches timed per count; their median counts
MIN_GAIN = 0.05  # a neighbouring count must be this much faster to be taken: steps of a swarm are noisy


def check_microbatches(value: Union[int, str]) -> Microbatches:
    """``"auto"`` or a count of at least 1 (from an argument or an environment variable), else a ``ValueError``."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        count = int(value)
    except (TypeError, ValueError):
        count = 0
    if count < 1:
        raise ValueError(f"microbatches must be 'auto' or at least 1, got {value!r}")
    return count


def divisors(batch_size: int) -> list[int]:
    """The microbatch counts that split ``batch_size`` samples into equal microbatches of at least
    ``MIN_MICROBATCH_SIZE``, smallest first."""
    return [d for d in range(1, batch_size + 1) if batch_size % d == 0 and batch_size // d >= MIN_MICROBATCH_SIZE]


def microbatch_count(batch_size: int, microbatches: int) -> int:
    """The largest count of equal microbatches of ``batch_size`` samples not above ``microbatches``."""
    return max([d for d in divisors(batch_size) if d <= microbatches], default=1)


@dataclass
class _Search:
    """The hill climb for one batch size: the count being timed, the direction of the climb (+1: more
    microbatches, -1: fewer, 0: settled), the fastest count so far and the median seconds measured per count."""

    candidates: list[int]
    index: int
    direction: int = 1
    best: Optional[int] = None
    warmup: int = WARMUP_BATCHES
    timings: list[float] = field(default_factory=list)
    measured: dict[int, float] = field(default_factory=dict)

    @property
    def count(self) -> int:
        return self.candidates[self.index]


class MicrobatchTuner:
    """Gives the microbatch count for each batch, and learns the fastest one from the batches' measured times.

    A fixed ``microbatches`` (an int) is used as it is (the largest divisor of the batch size not above it). With
    ``"auto"`` each batch size is tuned on its own: a batch size seen once (a last, smaller batch) costs nothing.
    """

    def __init__(self, microbatches: Microbatches, num_stages: int) -> None:
        self.microbatches, self.num_stages = check_microbatches(microbatches), num_stages
        self._searches: dict[int, _Search] = {}

    def count(self, batch_size: int) -> int:
        """How many microbatches a batch of ``batch_size`` samples is split into now."""
        if self.microbatches != "auto":
            return microbatch_count(batch_size, self.microbatches)
        return self._search(batch_size).count

    def settled(self, batch_size: int) -> Optional[int]:
        """The count tuning chose for ``batch_size``, or None while it is still measuring (or for a fixed count)."""
        search = self._searches.get(batch_size)
        return search.count if search is not None and search.direction == 0 else None

    def record(self, batch_size: int, count: int, seconds: float) -> None:
        """A batch of ``batch_size`` samples split into ``count`` microbatches took ``seconds`` through the stages
        (forward and backward)."""
        search = self._searches.get(batch_size)
        if search is None or search.direction == 0 or count != search.count:
            return
        if search.warmup > 0:
            search.warmup -= 1
            return
        search.timings.append(seconds)
        if len(search.timings) < TRIAL_BATCHES:
            return
        search.measured[search.count] = statistics.median(search.timings)
        search.timings = []
        self._climb(batch_size, search)

    def _search(self, batch_size: int) -> _Search:
        if batch_size not in self._searches:
            candidates = divisors(batch_size)
            start = microbatch_count(batch_size, AUTO_MICROBATCHES_PER_STAGE * self.num_stages)
            index = candidates.index(start)
            direction = 0 if len(candidates) == 1 else -1 if index == len(candidates) - 1 else 1
            self._searches[batch_size] = _Search(candidates, index, direction, best=None if direction else start)
        return self._searches[batch_size]

    def _climb(self, batch_size: int, search: _Search) -> None:
        """After timing ``search.count``: take it if it is measurably faster than the best so far, then step on in
        the climb's direction; turn back once if the first step up was no better; else settle on the best."""
        count = search.count
        if search.best is None or search.measured[count] < (1 - MIN_GAIN) * search.measured[search.best]:
            search.best = count
        elif search.direction == 1 and len(search.measured) == 2:
            search.direction = -1  # the first step up was no better: try fewer microbatches instead
        else:
            return self._settle(batch_size, search)
        following = search.candidates.index(search.best) + search.direction
        if not 0 <= following < len(search.candidates) or search.candidates[following] in search.measured:
            return self._settle(batch_size, search)
        search.index = following

    def _settle(self, batch_size: int, search: _Search) -> None:
        best = search.best
        search.index, search.direction = search.candidates.index(best), 0
        tried = ", ".join(f"{count}: {seconds:.3g}" for count, seconds in sorted(search.measured.items()))
        log.info(
            "Microbatches: %d per batch of %d samples (median seconds per batch by count: %s)", best, batch_size, tried
        )
