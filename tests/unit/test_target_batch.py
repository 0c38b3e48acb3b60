"""The target batch size when none is given: one peer's batch times the peers that announce they are training, read
from their discovery records by each optimizer's progress tracker (issue 27). Deterministic: fake DHT answers whose
arrival the test controls, and records stored in a real DHT node in this process."""

from __future__ import annotations

import copy
import pickle
from concurrent.futures import Future

from hivemind.optim.progress_tracker import LocalTrainingProgress
from hivemind.utils import ValueWithExpiration, get_dht_time

from lightning_swarm import discovery
from lightning_swarm.discovery import PeerRecord, PeerState
from lightning_swarm.node import SwarmNode
from lightning_swarm.optimizer import CountingProgressTracker, PerTrainerBatch, TrainerCount

KEYS = discovery.record_keys("run", 2)


def _record(peer: str, stage, training: bool, state: PeerState = PeerState.SERVING) -> tuple:
    return PeerRecord(peer, stage, state, 1.0, 0, training).to_value()


class _FakeDHT:
    """Answers ``get`` with futures the test completes (``answer``) from ``records``: stage -> {peer: value}."""

    def __init__(self) -> None:
        self.records: dict = {}
        self.futures: list[tuple[str, Future]] = []
        self.fail = False
        self.at_once = False  # answer each read as it starts

    def get(self, key: str, latest: bool, return_future: bool) -> Future:
        assert latest and return_future
        future: Future = Future()
        self.futures.append((key, future))
        if self.at_once:
            self.answer()
        return future

    def answer(self) -> None:
        for key, future in self.futures:
            if self.fail:
                future.set_exception(RuntimeError("the DHT is gone"))
                continue
            values = self.records.get(KEYS[key], {})
            expiration = get_dht_time() + 60
            entry = {peer: ValueWithExpiration(value, expiration) for peer, value in values.items()}
            future.set_result(ValueWithExpiration(entry, expiration) if entry else None)
        self.futures = []


def test_the_trainers_are_the_peers_announcing_training_at_any_stage_or_driving_counted_once():
    dht = _FakeDHT()
    dht.records = {
        0: {"a": _record("a", 0, True), "b": _record("b", 0, False), "m": _record("m", 0, True, PeerState.LEAVING)},
        1: {"c": _record("c", 1, True), "m": _record("m", 1, True, PeerState.JOINING), "x": ("garbage",)},
        None: {"d": _record("d", None, True)},
    }
    count = TrainerCount(dht, KEYS, period=1.0)
    assert count.poll(now=0.0) is None  # reads started, none back yet: nothing to say
    assert len(dht.futures) == 3  # both stages and the drive-only peers
    dht.answer()
    assert count.poll(now=0.1) == 4  # a, c, d and m (moving: one peer); b finished training; x is malformed


def test_the_count_is_read_without_blocking_at_most_once_per_period_and_a_failed_read_keeps_the_last():
    dht = _FakeDHT()
    dht.records = {0: {"a": _record("a", 0, True)}}
    count = TrainerCount(dht, KEYS, period=1.0)
    count.poll(now=0.0)
    dht.answer()
    assert count.poll(now=0.5) == 1 and not dht.futures  # read back; the next read waits for the period
    dht.records[1] = {"b": _record("b", 1, True)}
    assert count.poll(now=1.0) == 1 and len(dht.futures) == 3  # started, not back: the last count stands
    assert count.poll(now=1.5) == 1 and len(dht.futures) == 3  # still pending: no second read on top
    dht.answer()
    assert count.poll(now=1.6) == 2
    count.poll(now=2.6)
    dht.fail = True
    dht.answer()
    assert count.poll(now=2.7) == 2  # the read failed: the last count stands


def test_a_tracker_targets_one_batch_per_trainer_as_it_refreshes_and_never_less_than_one_batch():
    """The tracker's target (what hivemind's ready_to_update_epoch compares the samples with) follows the trainers
    counted at each progress refresh; no trainer counted (none announced yet, or all finished): one peer's batch."""
    dht, node = _FakeDHT(), SwarmNode().start()
    try:
        counter, dht.at_once = TrainerCount(dht, KEYS, period=0.0), True
        tracker = CountingProgressTracker(
            dht=node.dht, prefix="per_trainer", target_batch_size=PerTrainerBatch(16), trainers=counter, start=False
        )
        assert tracker.target_batch_size == 16  # read as it starts: no trainer announced yet
        dht.at_once = False
        for trainers, target in [(4, 64), (0, 16), (3, 48)]:
            before = tracker.target_batch_size
            dht.records = {0: {f"p{i}": _record(f"p{i}", 0, True) for i in range(trainers)}}
            tracker._parse_swarm_progress_data(None)  # a refresh: the read it started earlier is not back yet
            assert tracker.target_batch_size == before
            dht.answer()
            tracker._parse_swarm_progress_data(None)  # the next refresh
            assert tracker.target_batch_size == target
        tracker.local_progress = tracker.local_progress.copy(update=dict(samples_accumulated=47))
        assert not tracker.ready_to_update_epoch
        tracker.local_progress = tracker.local_progress.copy(update=dict(samples_accumulated=48))
        assert tracker.ready_to_update_epoch
    finally:
        node.shutdown()


def test_a_tracker_reads_the_trainers_from_the_runs_records_in_the_dht_when_it_starts():
    """Records stored as peers announce them (two stages, a drive-only peer, a serving peer that finished training):
    a tracker starting with a per-trainer target counts the three trainers at once; an explicit target stays as
    given."""
    node = SwarmNode().start()
    try:
        for record in [
            PeerRecord("a", 0, PeerState.SERVING, 1.0, 0, True),
            PeerRecord("b", 1, PeerState.SERVING, 1.0, 0, True),
            PeerRecord("c", 1, PeerState.SERVING, 1.0, 0, False),
            PeerRecord("d", None, PeerState.SERVING, 0.0, 0, True),
        ]:
            discovery.store_record(node, "run", record, ttl=60)
        assert discovery.training_peers(node, "run", 2) == {"a", "b", "d"}
        tracker = CountingProgressTracker(
            dht=node.dht, prefix="from_dht", target_batch_size=PerTrainerBatch(16, KEYS), start=False
        )
        assert tracker.target_batch_size == 48
        fixed = CountingProgressTracker(dht=node.dht, prefix="fixed", target_batch_size=32, start=False)
        fixed._parse_swarm_progress_data(None)
        assert fixed.target_batch_size == 32 and fixed.per_trainer is None
    finally:
        node.shutdown()


def test_a_per_trainer_target_is_one_peers_batch_as_an_int_and_survives_copies():
    target = PerTrainerBatch(16, KEYS)
    assert target == 16 and int(target) == 16 and target.total(4) == 64 and target.total(None) == 16
    for copied in (copy.deepcopy(target), pickle.loads(pickle.dumps(target))):
        assert isinstance(copied, PerTrainerBatch) and copied == 16 and copied.keys == KEYS


def test_the_epoch_goes_on_after_a_batch_while_that_batch_from_each_contributor_stays_short_of_the_target():
    """What lets a trainer's backward run on behind its next batch: its own samples now, the others' as last
    fetched, plus one batch from itself and from each other peer with samples of its epoch, stay below the target
    (a peer without samples adds nothing, unless the trainers are counted: then every other trainer adds its batch)."""
    node = SwarmNode().start()
    try:
        tracker = CountingProgressTracker(dht=node.dht, prefix="goes_on", target_batch_size=64, start=False)
        epoch = tracker.local_progress.epoch

        def swarm(mine: int, *others: tuple[int, int]) -> None:
            tracker.local_progress = tracker.local_progress.copy(update=dict(samples_accumulated=mine))
            now = get_dht_time()
            entries = {
                f"p{i}": ValueWithExpiration(
                    LocalTrainingProgress(
                        peer_id=f"peer{i}".encode(),
                        epoch=epoch + at,
                        samples_accumulated=samples,
                        samples_per_second=0.0,
                        time=now,
                        client_mode=False,
                    ).dict(),
                    now + 60,
                )
                for i, (at, samples) in enumerate(others)
            }
            tracker._parse_swarm_progress_data(entries)

        swarm(48)
        assert tracker.epoch_goes_on_after(8)  # 56 < 64
        swarm(56)
        assert not tracker.epoch_goes_on_after(8)  # this batch ends the epoch
        swarm(32, (0, 16))
        assert not tracker.epoch_goes_on_after(8)  # 48, and a batch from each of two trainers: 64
        swarm(24, (0, 16), (0, 0))
        assert tracker.epoch_goes_on_after(8)  # 40 + 16: the peer without samples adds nothing
        tracker.trainers = TrainerCount(_FakeDHT(), KEYS)
        tracker.trainers.count = 3
        swarm(0)
        assert tracker.epoch_goes_on_after(8)  # a batch from each of three trainers: 24
        swarm(40)
        assert not tracker.epoch_goes_on_after(8)  # 40 + 24: the trainers without samples yet count
    finally:
        node.shutdown()
