"""Microbatch tuning: how many microbatches a batch is split into, chosen by measuring the trainer's own steps.

More microbatches in flight shrink the pipeline's bubble (a batch of ``M`` microbatches through ``S`` stages keeps
each stage busy ``M / (M + S - 1)`` of the time), but every microbatch pays a fixed cost per call (encoding,
transfer start, queueing, the server's dispatch). Which wins depends on the model's compute per sample, the links
and the peers, so no fixed rule is right for both a small model on a slow link and a large one on a fast link. With
``microbatches="auto"`` the trainer starts at ``AUTO_MICROBATCHES_PER_STAGE`` per stage and climbs to the
neighbouring divisor of the batch size while that is measurably faster, then keeps the best count for that batch
size. Each step of the climb compares two counts side by side, alternating batches between them, so that a load
that comes and goes on a shared machine weighs on both alike. Where a batch's forward overlaps the backward of the
batch before (``overlap_batches``), a change of count unsettles the pipeline for a few batches and a batch's time is
the gap between two backwards' ends, a long gap often followed by a short one: the counts then take turns
``RUN_BATCHES`` batches at a time, the first ``SETTLING_BATCHES`` of each run and a batch that overlapped nothing (the
first after an optimizer step) are not timed, and the mean of the rest counts. The loss and gradients do not depend
on the count (see ``remote_pipeline``).
"""

from __future__ import annotations

import logging
import statistics
import threading
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

log = logging.getLogger(__name__)

Microbatches = Union[int, Literal["auto"]]
AUTO_MICROBATCHES_PER_STAGE = 2  # where tuning starts: one in each stage's compute, one in transfer
MIN_MICROBATCH_SIZE = 1  # samples
WARMUP_BATCHES = 1  # a count's first batches, not timed (connections, threads, allocator, caches)
TRIAL_BATCHES = 3  # batches timed per count and comparison; their median counts
MIN_GAIN = 0.05  # a neighbouring count must be this much faster to be taken: steps of a swarm are noisy
RUN_BATCHES = 6  # where batches overlap: batches of one count in a row, two runs per count and comparison
SETTLING_BATCHES = 2  # where batches overlap: a run's first batches, not timed (gpu_proxy: a run's second batch
# after a change from 8 microbatches to 4 took up to twice the steady time)


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
    """The climb for one batch size: the best count so far, the neighbour it is compared with (None: settled),
    the direction of the climb (+1: more microbatches, -1: fewer), and the seconds timed in this comparison."""

    candidates: list[int]
    best: int
    challenger: Optional[int]
    direction: int
    timings: dict[int, list[float]] = field(default_factory=dict)
    seen: dict[int, int] = field(default_factory=dict)  # batches run at each count, warm-up included
    measured: dict[int, float] = field(default_factory=dict)  # each count's last median (or mean), for the log
    recorded: int = 0  # batches recorded in this comparison, timed or not
    last: Optional[int] = None  # the count of the batch recorded last
    run: int = 0  # batches of that count recorded in a row
    overlapping: bool = False  # batches overlap: the counts take turns in runs

    def next_count(self) -> int:
        """The count whose turn it is: batch by batch, the one of the two with fewer batches timed (the best first);
        where batches overlap, ``RUN_BATCHES`` each in turn (the records lag a batch behind the counts given out:
        the runs keep their length)."""
        if self.challenger is None:
            return self.best
        if self.overlapping:
            return (self.best, self.challenger)[self.recorded // RUN_BATCHES % 2]
        timed = {count: len(self.timings.get(count, ())) for count in (self.best, self.challenger)}
        return self.best if timed[self.best] <= timed[self.challenger] else self.challenger

    def neighbour(self, direction: int) -> Optional[int]:
        index = self.candidates.index(self.best) + direction
        return self.candidates[index] if 0 <= index < len(self.candidates) else None


class MicrobatchTuner:
    """Gives the microbatch count for each batch, and learns the fastest one from the batches' measured times.

    A fixed ``microbatches`` (an int) is used as it is (the largest divisor of the batch size not above it). With
    ``"auto"`` each batch size is tuned on its own: a batch size seen once (a last, smaller batch) costs nothing.
    """

    def __init__(self, microbatches: Microbatches, num_stages: int) -> None:
        self.microbatches, self.num_stages = check_microbatches(microbatches), num_stages
        self._searches: dict[int, _Search] = {}
        self._lock = threading.Lock()  # a trailing backward records its batch while the next batch counts

    def count(self, batch_size: int) -> int:
        """How many microbatches a batch of ``batch_size`` samples is split into now."""
        if self.microbatches != "auto":
            return microbatch_count(batch_size, self.microbatches)
        with self._lock:
            return self._search(batch_size).next_count()

    def settled(self, batch_size: int) -> Optional[int]:
        """The count tuning chose for ``batch_size``, or None while it is still measuring (or for a fixed count)."""
        search = self._searches.get(batch_size)
        return search.best if search is not None and search.challenger is None else None

    def record(self, batch_size: int, count: int, seconds: float, overlapped: bool = False) -> None:
        """A batch of ``batch_size`` samples split into ``count`` microbatches took ``seconds`` of the stages' time
        (forward and backward; where batches overlap, from the end of the batch before). ``overlapped``: its forward
        ran beside the backward of the batch before."""
        with self._lock:
            self._record(batch_size, count, seconds, overlapped)

    def _record(self, batch_size: int, count: int, seconds: float, overlapped: bool) -> None:
        search = self._searches.get(batch_size)
        if search is None or search.challenger is None or count not in (search.best, search.challenger):
            return
        search.seen[count] = search.seen.get(count, 0) + 1
        search.recorded += 1
        search.run = search.run + 1 if count == search.last else 1
        search.last = count
        search.overlapping |= overlapped
        if search.seen[count] <= WARMUP_BATCHES:
            return
        if search.overlapping and (search.run <= SETTLING_BATCHES or not overlapped):
            return
        search.timings.setdefault(count, []).append(seconds)
        trial = 2 * (RUN_BATCHES - SETTLING_BATCHES) if search.overlapping else TRIAL_BATCHES
        if all(len(search.timings.get(c, ())) >= trial for c in (search.best, search.challenger)):
            self._compare(batch_size, search)

    def _search(self, batch_size: int) -> _Search:
        if batch_size not in self._searches:
            candidates = divisors(batch_size)
            start = microbatch_count(batch_size, AUTO_MICROBATCHES_PER_STAGE * self.num_stages)
            search = _Search(candidates, start, None, 1)
            search.challenger = search.neighbour(1)
            if search.challenger is None:
                search.challenger, search.direction = search.neighbour(-1), -1
            self._searches[batch_size] = search
        return self._searches[batch_size]

    def _compare(self, batch_size: int, search: _Search) -> None:
        """Take the challenger if it was measurably faster, and go on in that direction; if the first step up was
        no faster, try one down; else settle on the best."""
        typical = statistics.fmean if search.overlapping else statistics.median
        best, challenger = (typical(search.timings[c]) for c in (search.best, search.challenger))
        search.measured.update({search.best: best, search.challenger: challenger})
        search.timings, search.recorded = {}, 0
        if challenger < (1 - MIN_GAIN) * best:
            search.best = search.challenger
        elif search.direction == 1 and len(search.measured) == 2:
            search.direction = -1
        else:
            search.challenger = None
        if search.challenger is not None:
            following = search.neighbour(search.direction)
            search.challenger = following if following not in search.measured else None
        if search.challenger is None:
            tried = ", ".join(f"{count}: {seconds:.3g}" for count, seconds in sorted(search.measured.items()))
            log.info(
                "Microbatches: %d per batch of %d samples (seconds per batch by count: %s)",
                search.best,
                batch_size,
                tried,
            )
