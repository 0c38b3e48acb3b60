"""Microbatch tuning: the first count, settling on the fastest one, and fixed counts left alone."""

from __future__ import annotations

from typing import Callable

import pytest

from lightning_swarm.client.microbatch_tuning import MIN_GAIN, MicrobatchTuner, divisors


@pytest.mark.parametrize(
    "batch_size, microbatches, num_stages, count",
    [
        (16, "auto", 2, 4),  # tuning starts at two per stage
        (16, "auto", 4, 8),
        (8, "auto", 1, 2),
        (6, "auto", 2, 3),  # the largest divisor of the batch size not above 2 * num_stages
        (7, "auto", 2, 1),
        (3, "auto", 4, 3),  # never below one sample each
        (1, "auto", 3, 1),
        (16, 3, 2, 2),  # an explicit count wins, as a divisor
        (16, 1, 4, 1),
        (12, 8, 2, 6),
    ],
)
def test_first_microbatch_count(batch_size, microbatches, num_stages, count):
    assert MicrobatchTuner(microbatches, num_stages).count(batch_size) == count


def tune(tuner: MicrobatchTuner, batch_size: int, seconds: Callable[[int], float], batches: int = 60) -> list[int]:
    """Feed ``tuner`` batches whose time is ``seconds(count)``; the counts it chose, batch by batch."""
    counts = []
    for _ in range(batches):
        counts.append(tuner.count(batch_size))
        tuner.record(batch_size, counts[-1], seconds(counts[-1]))
    return counts


def pipeline_seconds(compute: float, per_call: float, stages: int = 2) -> Callable[[int], float]:
    """A batch's time through ``stages`` stages in ``count`` microbatches: (count + stages - 1) slots of
    compute / count plus a fixed cost per call."""
    return lambda count: (count + stages - 1) * (compute / count + per_call)


@pytest.mark.parametrize(
    "compute, per_call, best",
    [
        (6.0, 0.001, 16),  # a large model on a fast link: many small microbatches hide the bubble
        (1.8, 0.01, 8),  # 16 would be 1.5% faster than 8: not measurably
        (0.4, 0.01, 4),  # the optimum sqrt((S-1) * compute / per_call) = 6.3 lies between 4 and 8; 4 is faster
        (0.04, 0.05, 1),  # a small model with costly calls: one microbatch, found by turning back from 8
        (0.2, 0.05, 2),
    ],
)
def test_auto_microbatches_settle_on_the_fastest_count(compute, per_call, best):
    seconds = pipeline_seconds(compute, per_call)
    assert seconds(best) <= (1 + MIN_GAIN) * min(map(seconds, divisors(16)))
    tuner = MicrobatchTuner("auto", num_stages=2)
    counts = tune(tuner, 16, seconds)
    assert counts[0] == 4 and tuner.settled(16) == best and counts[-10:] == [best] * 10
    assert tuner.settled(8) is None and tuner.count(8) == 4  # each batch size is tuned on its own


def tune_overlapping(tuner: MicrobatchTuner, batch_size: int, seconds: Callable[[int], float]) -> list[int]:
    """As ``tune``, where each batch's forward overlaps the backward of the batch before (``overlap_batches``): the
    next count is asked for before the batch before is recorded, and a change of count unsettles the two batches
    after it (here: the first looks twice as fast, the second half as fast, as a slower count's tail hides a faster
    one's start, then holds it up). Every 16th batch follows an optimizer step: it overlapped nothing, and waited."""
    counts: list[int] = []
    trailing = None
    for batch in range(140):
        count = tuner.count(batch_size)
        if trailing is not None:
            tuner.record(batch_size, *trailing)
        run = next((i for i, c in enumerate(reversed(counts)) if c != count), len(counts))
        after_step = batch % 16 == 0
        factor = 3.0 if after_step else {0: 0.5, 1: 1.5}.get(run, 1.0)
        trailing = (count, seconds(count) * factor, not after_step)
        counts.append(count)
    return counts


@pytest.mark.parametrize("compute, per_call, best", [(6.0, 0.001, 16), (0.4, 0.01, 4), (0.04, 0.05, 1), (0.2, 0.05, 2)])
def test_auto_microbatches_with_overlapping_batches_time_runs_of_one_count_once_settled(compute, per_call, best):
    tuner = MicrobatchTuner("auto", num_stages=2)
    counts = tune_overlapping(tuner, 16, pipeline_seconds(compute, per_call))
    assert tuner.settled(16) == best and counts[-10:] == [best] * 10
    assert counts[:19] == [4] * 7 + [8] * 6 + [4] * 6, counts  # in runs, once the first batch showed the overlap


def test_auto_microbatches_keep_a_count_that_is_not_measurably_slower():
    tuner = MicrobatchTuner("auto", num_stages=2)
    counts = tune(tuner, 16, lambda count: 1.0 - 0.01 * count)  # 8 is 4% faster than 4: within the noise
    assert tuner.settled(16) == 4 and set(counts) == {4, 8, 2}


@pytest.mark.parametrize("period", [2, 3, 5, 7])
def test_auto_microbatches_under_a_load_that_comes_and_goes_never_settle_on_a_slower_count(period):
    """Counts are compared side by side, batches alternating: a load that doubles every batch's time for
    ``period`` batches, then goes for as long, must not make a slower count look faster than the start."""
    for compute, per_call in [(6.0, 0.001), (0.4, 0.01), (0.04, 0.05), (0.2, 0.05)]:
        seconds, tuner = pipeline_seconds(compute, per_call), MicrobatchTuner("auto", num_stages=2)
        for batch in range(80):
            count = tuner.count(16)
            tuner.record(16, count, seconds(count) * (2.0 if batch // period % 2 else 1.0))
        assert tuner.settled(16) is not None and seconds(tuner.settled(16)) <= seconds(4), (compute, per_call)


def test_fixed_microbatches_are_never_tuned():
    tuner = MicrobatchTuner(3, num_stages=2)
    assert set(tune(tuner, 12, pipeline_seconds(1.8, 0.01))) == {3} and tuner.settled(12) is None
