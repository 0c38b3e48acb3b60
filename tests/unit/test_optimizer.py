"""The stage optimizer's download of a stage's state and its gradient rounds, on real hivemind DHT nodes and averagers
in this process."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import InvalidStateError, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import AsyncIterator, Iterator

import pytest
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.control import AveragingStage
from hivemind.optim.progress_tracker import LocalTrainingProgress
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils import ValueWithExpiration, get_dht_time

from lightning_swarm import optimizer as optimizer_module
from lightning_swarm.node import SwarmNode
from lightning_swarm.optimizer import (
    BoundedGradientAverager,
    CoalescedSignal,
    CountingProgressTracker,
    PartialGroup,
    StepPace,
    SwarmOptimizer,
    TrainerCount,
    _DeclaresCoalesced,
    _paced,
    cancel_round,
    swarm_optimizer,
)


def _optimizer(
    node: SwarmNode,
    seed: int,
    prefix: str = "download_test",
    target: int = 8,
    averaging_timeout: float = 5.0,
    delayed: bool = False,
    matchmaking_time: float = 1.0,
):
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, swarm_optimizer(
        node.dht, prefix, optimizer, target, matchmaking_time, averaging_timeout, delayed=delayed
    )


@pytest.fixture(params=["fork", "forkserver"])
def default_start_method(request):
    """This process's default multiprocessing start method for one test: fork (Linux up to Python 3.13) or
    forkserver (from 3.14 on), which pickles a process to start it."""
    before = multiprocessing.get_start_method(allow_none=True)
    multiprocessing.set_start_method(request.param, force=True)
    yield request.param
    multiprocessing.set_start_method(before, force=True)


def test_download_says_whether_a_state_came_from_a_peer(default_start_method):
    """A joiner's freshly initialised weights must not pass for downloaded ones: ``downloaded`` is false when no
    peer answered (the epoch, 0 on both sides, cannot tell), and true, with the peer's parameters, when one did.
    The averagers start whatever the default start method."""
    first = SwarmNode().start()
    nodes, optimizers = [first], []
    try:
        owner_model, owner = _optimizer(first, seed=0)
        optimizers.append(owner)
        assert owner.load_state_from_peers()  # alone: "at the swarm's epoch" (0), yet nothing came
        assert not owner.downloaded

        nodes.append(SwarmNode(first.visible_maddrs()).start())
        joiner_model, joiner = _optimizer(nodes[1], seed=1)
        optimizers.append(joiner)
        assert not torch.equal(joiner_model.weight, owner_model.weight)
        joiner.load_state_from_peers()
        assert joiner.downloaded
        assert torch.equal(joiner_model.weight, owner_model.weight)
    finally:
        for optimizer in optimizers:
            optimizer.shutdown()
        for node in reversed(nodes):
            node.shutdown()


ABSENT_PEER = """
import sys, time, torch
from test_optimizer import _optimizer
from lightning_swarm.node import SwarmNode
node = SwarmNode(sys.argv[1:]).start()
model, optimizer = _optimizer(node, 1, "round_test", target=1000, averaging_timeout=10.0)  # never ready itself
for p in model.parameters():
    p.grad = torch.ones_like(p)
optimizer.step(batch_size=4)
print("stepped", flush=True)
time.sleep(600)
"""


@contextmanager
def beside_an_absent_partner(
    delayed: bool, averaging_timeout: float = 10.0
) -> Iterator[tuple[torch.nn.Module, SwarmOptimizer]]:
    """A model and its optimizer whose partner holds 4 samples of the target of 8 but never joins a round (it left,
    or is stuck); the model's gradients are set, for a step of 4 samples. (The partner is a process of its own, as
    hivemind's progress records of one process share a key.)"""
    with beside_a_partner_process(ABSENT_PEER) as (node, absent):
        assert absent.stdout.readline().strip() == "stepped"
        model, optimizer = _optimizer(node, 0, "round_test", averaging_timeout=averaging_timeout, delayed=delayed)
        try:
            deadline = time.monotonic() + 30
            while optimizer.tracker.global_progress.samples_accumulated < 4:
                assert time.monotonic() < deadline, "this peer never saw the other's samples"
                time.sleep(0.1)
            for p in model.parameters():
                p.grad = torch.ones_like(p)
            yield model, optimizer
        finally:
            optimizer.shutdown()


@contextmanager
def beside_a_partner_process(script: str, *args: str) -> Iterator[tuple[SwarmNode, subprocess.Popen]]:
    """This process's DHT node, and a partner peer running ``script`` (its arguments: ``args``, then this node's
    addresses) in a process of its own, as hivemind's progress records of one process share a key; the partner is
    killed with its node's daemons on the way out, before this node shuts down."""
    node = SwarmNode().start()
    partner = subprocess.Popen(
        [sys.executable, "-c", script, *args, *map(str, node.visible_maddrs())],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parent,
        start_new_session=True,
    )
    try:
        yield node, partner
    finally:
        with contextlib.suppress(ProcessLookupError):  # the test may have killed it already
            os.killpg(partner.pid, signal.SIGKILL)
        partner.wait()
        node.shutdown()


MATCHMAKING, GRACE = 1.0, 0.5  # _optimizer's matchmaking time, and one request's timeout (hivemind_tuning)


@pytest.fixture
def rounds(monkeypatch) -> list[dict]:
    """The all-reduce rounds the averagers of this process start, as hivemind's DecentralizedAverager.step gets them
    (after the swarm's bounds): their timeout, and whether they wait for their owner's trigger."""
    started = []
    step = DecentralizedAverager.step

    def recording(self, *args, **kwargs):
        started.append(dict(kind=type(self).__name__, **kwargs))
        return step(self, *args, **kwargs)

    monkeypatch.setattr(DecentralizedAverager, "step", recording)
    return started


def test_a_round_whose_partner_never_comes_costs_its_matchmaking_time_not_the_averaging_timeout(rounds, monkeypatch):
    """Two peers of a stage hold samples that together reach the target; one steps, the other does not join its rounds:
    each of the step's two rounds (gradients, then parameters) fails once its matchmaking time and one request's
    timeout are over, not after the averaging timeout (30 s here): the parameter round is given that bound as its
    timeout, and the gradient round (which waits for its trigger) is given up by the optimizer once that long has
    passed since the trigger without a group. The failed gradient round is counted with its time, and the peer steps
    with its own gradients."""
    assembled = []
    assembles = BoundedGradientAverager.assembles
    monkeypatch.setattr(
        BoundedGradientAverager,
        "assembles",
        lambda self, control: assembled.append(assembles(self, control)) or assembled[-1],
    )
    with beside_an_absent_partner(delayed=False, averaging_timeout=30.0) as (model, optimizer):
        before = model.weight.detach().clone()
        started = time.monotonic()
        optimizer.step(batch_size=4)  # 4 + 4 samples: the target of 8
        took = time.monotonic() - started

        assert optimizer.failed_rounds == 1 and not optimizer.allreduce_sizes and assembled == [False]
        gradients = [r for r in rounds if r["kind"] == "BoundedGradientAverager"]
        parameters = [r for r in rounds if r["kind"] == "ConsistentStateAverager"]
        assert gradients and all(r["require_trigger"] for r in gradients), rounds  # the optimizer bounds them
        assert parameters and all(r["timeout"] <= MATCHMAKING + GRACE + 1e-6 for r in parameters), rounds
        # the gradient round was given up at its bound, from its trigger on (monotonic time, measured in the step)
        assert MATCHMAKING + GRACE <= optimizer.failed_round_seconds <= took < 30.0, (
            optimizer.failed_round_seconds,
            took,
        )
        assert optimizer.local_epoch == 1 and not torch.equal(model.weight, before)  # stepped on its own gradients


@pytest.mark.parametrize("waits", [False, True], ids=["trains_on", "waits_at_once"])
def test_a_failed_background_round_costs_only_the_time_a_step_waits_for_it(waits, monkeypatch):
    """With delayed updates a round runs in the background while the peer goes on training: one whose partner never
    comes fails there (counted), but holds up only a step that waits for it. A peer that goes on training until the
    round is over loses no time to it (it was counted from its trigger before, as if the peer had waited); one that
    waits for the background step at once (a checkpoint's state, a download) loses the time until the round fails.
    The round runs on another thread than the step's; it starts looking for its group once the test says so (when
    the peer begins to wait, or at once), so that the order of the wait and the failure is the test's."""
    go, threads = threading.Event(), []
    assembles, average = BoundedGradientAverager.assembles, SwarmOptimizer._average_gradients_and_load_into_optimizer

    def gated(self, control):
        assert go.wait(60), "the test never let the round go on"
        return assembles(self, control)

    def recording(self, control):
        threads.append(threading.get_ident())
        return average(self, control)

    monkeypatch.setattr(BoundedGradientAverager, "assembles", gated)
    monkeypatch.setattr(SwarmOptimizer, "_average_gradients_and_load_into_optimizer", recording)
    with beside_an_absent_partner(delayed=True) as (_, optimizer):
        optimizer.step(batch_size=4)  # 4 + 4 samples: the target of 8; the round runs in the background
        if not waits:
            go.set()
            deadline = time.monotonic() + 60
            while optimizer.failed_rounds == 0:
                assert time.monotonic() < deadline, "the background round never ended"
                time.sleep(0.1)
        started = time.monotonic()
        go.set()
        optimizer.apply_finished_update(wait=True)
        waited = time.monotonic() - started
        assert threads and threading.get_ident() not in threads, "the gradient round ran on the step's thread"
        assert optimizer.rounds == optimizer.failed_rounds == 1
        if waits:
            assert 0 < optimizer.failed_round_seconds <= waited, (optimizer.failed_round_seconds, waited)
        else:
            assert optimizer.failed_round_seconds == 0.0


def test_the_partners_of_a_round_include_those_that_just_left_its_epoch():
    """A peer one epoch behind the swarm counts, as partners of its next round, the peers with samples of its epoch
    and those now one epoch ahead (with delayed updates their round of its epoch is still looking for it); not
    peers without samples in its epoch, nor further ahead. Counting only peers with samples of the swarm's newest
    epoch, it saw nobody and stepped alone while its partner waited for it in vain (most failed rounds of the
    demo). With delayed updates, a peer that counts nobody expects the peers within one epoch of its own, with samples
    or not (theirs may not have been fetched yet)."""
    node = SwarmNode().start()
    tracker = CountingProgressTracker(dht=node.dht, prefix="partners", target_batch_size=8, start=False)
    try:
        tracker.local_progress = tracker.local_progress.copy(update=dict(epoch=3, samples_accumulated=4))

        def peers(*records: tuple[int, int]) -> int:
            metadata = {
                f"peer{i}": ValueWithExpiration(progress(epoch, samples, f"peer{i}").dict(), get_dht_time() + 60)
                for i, (epoch, samples) in enumerate(records)
            }
            return tracker._parse_swarm_progress_data(metadata).num_peers

        assert peers((4, 0)) == 2  # just left epoch 3: its round of epoch 3 may still run
        assert peers((3, 5), (4, 0)) == 3
        assert peers((3, 0)) == 1  # nothing to average
        assert peers((5, 0)) == 1  # two epochs ahead: this peer downloads the state instead

        # with delayed updates, a partner at its epoch whose samples were not seen yet is expected all the same
        assert peers((3, 0)) == 1 and tracker.round_size(unseen=False) == 1 and tracker.round_size(unseen=True) == 2
        assert peers((3, 0), (4, 0), (5, 0)) == 2 and tracker.round_size(unseen=True) == 2  # one counted: as it is
        assert peers((5, 0)) == 1 and tracker.round_size(unseen=True) == 1
        # and a partner one epoch behind: its record may predate its own step into this epoch
        assert peers((2, 5)) == 1 and tracker.round_size(unseen=False) == 1 and tracker.round_size(unseen=True) == 2
        assert peers((1, 5)) == 1 and tracker.round_size(unseen=True) == 1
    finally:
        node.shutdown()


def test_a_peer_without_samples_is_awaited_only_if_its_record_was_published():
    """With delayed updates, a peer one epoch behind a partner, with no samples, joins that partner's round with
    zero weight when the round counts on it. It can only if the partner saw its record, and hivemind publishes a
    peer's progress only within one epoch of the last it reported samples in: a newcomer (or a peer idle for epochs)
    is in nobody's count. Such a peer's join failed after the window, and it downloaded the state all the same."""
    node = SwarmNode().start()
    tracker = CountingProgressTracker(dht=node.dht, prefix="published", target_batch_size=8, start=False)
    try:

        def awaited(epoch: int, swarm_epoch: int) -> bool:
            """Whether the peer, at ``epoch`` with no samples, is awaited while the swarm is at ``swarm_epoch``."""
            tracker.local_progress = tracker.local_progress.copy(update=dict(epoch=epoch, samples_accumulated=0))
            tracker.global_progress.epoch = swarm_epoch
            tracker._records = [progress(swarm_epoch, 0, "partner")]
            return tracker.awaited_without_samples()

        assert not tracker.published(3) and not awaited(3, 4)  # a newcomer: never published
        tracker.global_progress.epoch = 2
        tracker.report_local_progress(2, 4)  # samples while the swarm was at epoch 2: published through epoch 3
        assert tracker.published(2) and tracker.published(3) and awaited(3, 4)
        assert not tracker.published(4) and not awaited(4, 5)  # no samples since: hivemind stopped publishing it
        assert not awaited(3, 5)  # two epochs behind: it downloads the state
        tracker._records = [progress(3, 16, "partner")]  # a partner at its epoch showed samples: no round counts on it
        tracker.global_progress.epoch = 4
        assert not tracker.awaited_without_samples()
    finally:
        node.shutdown()


def test_more_samples_within_an_epoch_are_reported_coalesced():
    """hivemind stores a peer's progress in the DHT at every report, one per microbatch: within an epoch, reports of
    more samples are held back to one per period, the latest progress stored when it ends, and so is the entry into a
    new epoch (its first samples follow within a microbatch); the first samples of an epoch and a reset are stored at
    once, and so is shutdown's withdrawal."""
    node = SwarmNode().start()
    tracker = CountingProgressTracker(dht=node.dht, prefix="coalesced", target_batch_size=64, start=False)
    report_signal = tracker.should_report_progress  # each set: one store by hivemind's reporter (not started here)
    try:
        assert isinstance(report_signal, CoalescedSignal) and report_signal.period == tracker.min_refresh_period
        report_signal.period = 60.0  # nothing held is released during the test's first part, however slow the machine

        def reported(epoch: int, samples: int) -> bool:
            report_signal.clear()
            tracker.report_local_progress(epoch, samples)
            return report_signal.is_set()

        assert reported(0, 4)  # the epoch's first samples
        assert not reported(0, 8) and not reported(0, 12)  # more: held back
        assert tracker.local_progress.samples_accumulated == 12  # what the held store will carry
        assert not reported(1, 0)  # a new epoch: held too
        assert tracker.local_progress.epoch == 1
        assert reported(1, 4) and not reported(1, 8)  # its first samples: at once, the new epoch with them
        assert reported(1, 2)  # fewer samples (a reset): at once
        assert not reported(1, 6)
        report_signal.clear()
        tracker.shutdown(timeout=1)  # its reporter never ran: the wait times out
        assert report_signal.is_set()

        report_signal.period = 0.3  # a held report is stored once its period ends
        assert reported(2, 4) and not reported(2, 8)
        assert report_signal.wait(timeout=30) and tracker.local_progress.samples_accumulated == 8
    finally:
        node.shutdown()


def test_held_reports_are_released_by_one_thread_that_leaves_when_idle(monkeypatch):
    """A held report is released a period after the last one by a thread that stays for the next held reports (a
    thread started per held report cost the optimizer step that held it the thread's start), and leaves once
    nothing was held for a while."""
    monkeypatch.setattr(optimizer_module, "RELEASER_IDLE", 0.5)
    report = CoalescedSignal(period=0.05)

    def releasers() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == "swarm-report"}

    before = releasers()
    report.set()  # not coalescing: at once
    report.coalescing = True
    started = []
    for _ in range(3):
        report.clear()
        report.set()  # within the period of the last release: held
        assert not report.is_set()
        assert report.wait(timeout=30)  # released a period later
        started.append(releasers() - before)
    assert len(started[0]) == 1 and started[0] == started[1] == started[2]
    (releaser,) = started[0]
    releaser.join(timeout=30)
    assert not releaser.is_alive()
    report.coalescing = False
    report.set()
    report.clear()
    report.coalescing = True
    report.set()
    assert not report.is_set() and report.wait(timeout=30)  # held again after it left: a new one releases it


def test_an_averager_declares_itself_a_donor_at_most_once_a_period(monkeypatch):
    """hivemind's averager stores a declaration each time its ``_state_updated`` event is set: at every step (a new
    priority) and for every tensor of an all-reduce round. Within a period the sets become one at once and one when
    the period ends."""
    monkeypatch.setattr(optimizer_module, "DECLARE_PERIOD", 0.3)
    averager = object.__new__(_DeclaresCoalesced)  # the event only: no process, no DHT

    async def declarations_after_ten_sets() -> tuple[int, int, int]:
        averager._state_updated = asyncio.Event()  # as hivemind's averager process makes it
        declared = 0

        async def declare_on_each_wake() -> None:  # as hivemind's _declare_for_download_periodically
            nonlocal declared
            while True:
                averager._state_updated.clear()
                await averager._state_updated.wait()
                declared += 1

        declarer = asyncio.create_task(declare_on_each_wake())
        await asyncio.sleep(0)
        for _ in range(10):
            averager._state_updated.set()
            await asyncio.sleep(0)  # the declarer runs if woken
        at_once = declared
        for _ in range(3000):  # the held sets are released once, a period after the first (later on a busy loop)
            if declared > at_once:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3 + 0.05)  # a period after that release, which came before its wake was seen
        held = declared  # and no other
        averager._state_updated.set()  # a period after the last: at once
        await asyncio.sleep(0)
        declarer.cancel()
        return at_once, held, declared

    assert asyncio.run(declarations_after_ten_sets()) == (1, 2, 3)


def test_a_round_reads_the_declared_averagers_at_most_once_a_period():
    """hivemind's round reads the declared averagers again as soon as a read comes back empty: paced, each read
    after the first waits for the period since the last to end, and returns what the read returned."""
    starts: list[float] = []

    async def lookup(key: str) -> str:
        starts.append(time.monotonic())
        return key

    async def read_five_times() -> list[str]:
        paced = _paced(lookup, 0.2)
        return [await paced(f"k{n}") for n in range(5)]

    assert asyncio.run(read_five_times()) == [f"k{n}" for n in range(5)]
    assert all(later - earlier >= 0.2 for earlier, later in zip(starts, starts[1:])), starts


def test_the_latest_epoch_is_declared_and_gradients_are_not_offered_for_download():
    """Stepping an epoch a call, the state averager's declaration catches up with the last epoch (a held one carries
    the priority as it is when stored); the gradient averager declares nothing, as nobody downloads from it."""
    node = SwarmNode().start()
    model, stepping = _optimizer(node, seed=0, prefix="declared", target=1)
    try:
        for _ in range(12):
            for p in model.parameters():
                p.grad = torch.ones_like(p)
            stepping.step(batch_size=1)
        assert stepping.local_epoch == 12
        deadline = time.monotonic() + 15  # within hivemind's own re-declaration, every 30 s
        while True:
            found = node.dht.get("declared_state_averager.all_averagers", latest=True)
            priorities = [v.value for v in found.value.values()] if found is not None else []
            if priorities == [12.0]:
                break
            assert time.monotonic() < deadline, f"the last epoch was never declared: {priorities}"
            time.sleep(0.1)
        assert node.dht.get("declared_grad_averager.all_averagers", latest=True) is None
    finally:
        stepping.shutdown()
        node.shutdown()


def test_a_round_of_the_trainers_expects_every_trainer():
    """The trainers' local optimizer (``expect_trainers``) expects every peer training in each round, as last read,
    not only the partners whose samples its last progress fetch showed: a round that began with those alone left out
    a trainer that came moments later (97 of 116 failed rounds of the trainers). Never fewer than it counted."""
    node = SwarmNode().start()
    trainers = TrainerCount(node.dht, {})
    with pytest.raises(ValueError, match="trainers"):
        CountingProgressTracker(dht=node.dht, prefix="all", target_batch_size=8, start=False, expect_trainers=True)
    tracker = CountingProgressTracker(
        dht=node.dht, prefix="all", target_batch_size=8, start=False, trainers=trainers, expect_trainers=True
    )
    alone = CountingProgressTracker(dht=node.dht, prefix="all", target_batch_size=8, start=False, trainers=trainers)
    try:
        for t in tracker, alone:
            t.local_progress = t.local_progress.copy(update=dict(epoch=3, samples_accumulated=4))
            t._records = [progress(3, 16, "a"), progress(3, 0, "b")]  # one partner's samples seen, another's not yet
        trainers.count = 4
        assert alone.round_size(unseen=False) == 2
        assert tracker.round_size(unseen=False) == tracker.round_size(unseen=True) == 4
        trainers.count = None  # not read yet: the partners counted
        assert tracker.round_size(unseen=False) == 2
        trainers.count = 1
        assert tracker.round_size(unseen=False) == 2
    finally:
        node.shutdown()


def test_a_trainer_that_finished_withdraws_its_progress_record_at_once():
    """A trainer whose fit ended stays to serve the others (it lingers) with its optimizer up: its progress record,
    showing the samples it gathered after its last round, made a partner's round at that epoch expect it. It
    withdraws the record when training ends (``leave_rounds``), not at shutdown."""
    node = SwarmNode().start()
    model, optimizer = _optimizer(node, 0, "leaving")
    tracker = optimizer.tracker

    def record():  # this peer's progress record as the DHT has it now (None: withdrawn or never stored)
        found = node.dht.get(tracker.training_progress_key, latest=True)
        entry = found.value.get(tracker._local_public_key) if found is not None else None
        return entry.value if entry is not None else None

    try:
        tracker.report_local_progress(optimizer.local_epoch, 4)
        deadline = time.monotonic() + 30
        while (published := record()) is None or published["samples_accumulated"] != 4:
            assert time.monotonic() < deadline, "the record was never published"
            time.sleep(0.1)
        optimizer.leave_rounds()
        while record() is not None:
            assert time.monotonic() < deadline, "the record was not withdrawn"
            time.sleep(0.1)
    finally:
        optimizer.shutdown()  # the tracker again: shutting it down twice is harmless
        node.shutdown()


def test_a_peer_shuts_down_its_optimizer_with_a_round_it_gave_up_on_still_looking():
    """hivemind's contract: a round's cancel can be sent once, a second raises ``InvalidStateError``. hivemind's
    shutdown cancels every round still looking for a group; a round the optimizer had given up on (cancelled while
    running, so not done) may still read so, and a peer leaving with SIGTERM exited 1 on that second cancel. Its
    shutdown now cancels such a round once and leaves it out of hivemind's."""
    node = SwarmNode().start()
    model, optimizer = _optimizer(node, 0, "given_up")
    try:
        first = optimizer.grad_averager.schedule_step()
        first.cancel()
        with pytest.raises(InvalidStateError):
            first.cancel()
        cancel_round(first)  # quiet the second time

        given_up = optimizer.grad_averager.schedule_step()
        given_up.set_running_or_notify_cancel()  # a round running when the optimizer gave up on it: not done after
        cancel_round(given_up)
        given_up.stage = AveragingStage.LOOKING_FOR_GROUP  # as it read at the peer's shutdown in that run
        assert not given_up.done()
        optimizer.scheduled_grads = given_up
    finally:
        optimizer.shutdown()
        node.shutdown()


def progress(epoch: int, samples: int, peer: str) -> LocalTrainingProgress:
    """A partner's progress record as a tracker fetches it."""
    return LocalTrainingProgress(
        peer_id=peer.encode(),
        epoch=epoch,
        samples_accumulated=samples,
        samples_per_second=0.0,
        time=get_dht_time(),
        client_mode=False,
    )


@contextmanager
def two_averagers(
    prefix: str,
    parameters: list[torch.nn.Parameter],
    matchmaking: float = MATCHMAKING,
    kinds: tuple[type, type] = (BoundedGradientAverager, BoundedGradientAverager),
    **kwargs,
) -> Iterator[list[BoundedGradientAverager]]:
    """Two gradient averagers (of ``kinds``), one per parameter, on two DHT nodes that know each other; shut down
    after."""
    first = SwarmNode().start()
    nodes = [first, SwarmNode(first.visible_maddrs()).start()]
    averagers = []
    try:
        for parameter, node, kind in zip(parameters, nodes, kinds):
            averagers.append(
                kind(
                    [parameter],
                    dht=node.dht,
                    prefix=prefix,
                    min_matchmaking_time=matchmaking,
                    request_timeout=GRACE,
                    start=True,
                    **kwargs,
                )
            )
        yield averagers
    finally:
        for averager in averagers:
            averager.shutdown()
        for node in nodes:
            node.shutdown()


def test_a_pre_scheduled_round_triggered_late_still_meets_its_partner():
    """hivemind pre-schedules a gradient round when it estimates that the epoch ends within the matchmaking time; here
    one peer's estimate is early: its round is scheduled to start 1 s after it is made, and triggered only once its
    scheduled start and a request's timeout (its bound, counted from the scheduled start) are well over, when its
    partner schedules and triggers its own. Bounded from its scheduled start, the early round failed before the
    epoch ended and its partner found nobody: both stepped alone. Left to the optimizer's bound, which starts at
    the trigger, the early round is still looking for its group then, and both average together."""
    parameters = [torch.nn.Parameter(torch.full((4,), float(i))) for i in range(2)]
    with two_averagers("late_trigger", parameters, target_group_size=2) as averagers:
        early = averagers[0].schedule_step(timeout=60.0)
        late = early.scheduled_time + GRACE + 1.0  # past the bound the round had from its scheduled start
        while get_dht_time() < late:
            time.sleep(0.05)
        assert not early.done(), "the early round gave up before its trigger"
        on_time = averagers[1].schedule_step(timeout=60.0)
        for control in (early, on_time):
            control.allow_allreduce()
        assert [len(control.result(timeout=60.0)) for control in (early, on_time)] == [2, 2]


class _BreaksOffItsReductions(BoundedGradientAverager):
    """A partner whose reducer reduces each part sent to it, then breaks the stream before sending the result."""

    @classmethod
    def _get_handle_name(cls, namespace: str, method_name: str) -> str:  # hivemind names them after the class
        return BoundedGradientAverager._get_handle_name(namespace, method_name)

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        async for message in super().rpc_aggregate_part(stream, context):
            raise ConnectionError(f"the reducer broke off before sending {message.code}")
            yield message  # hivemind's handler is an async generator


def test_a_round_that_lost_part_of_its_all_reduce_says_so():
    """Each peer's reducer breaks off after reducing its part: hivemind keeps a peer's own values for the parts it
    got no result for and returns the group as for a complete round (the peers' gradients then differ there). The
    averager returns such a round as a PartialGroup, so that the optimizer averages the parameters after the step; a
    peer whose parts all came back averaged (all of them its own to reduce: hivemind may give one peer the whole
    tensor) gets its group as before."""
    parameters = [torch.nn.Parameter(torch.zeros(100_000)) for _ in range(2)]
    kinds = (_BreaksOffItsReductions, _BreaksOffItsReductions)
    with two_averagers("partial", parameters, kinds=kinds, target_group_size=2) as averagers:
        for averager, value in zip(averagers, (1.0, 3.0)):
            with averager.get_tensors() as (accumulator,):
                accumulator.fill_(value)
        controls = [averager.schedule_step(timeout=60.0) for averager in averagers]
        for control in controls:
            control.allow_allreduce()
        results = [control.result(timeout=60.0) for control in controls]
        assert [len(r) for r in results] == [2, 2] and any(isinstance(r, PartialGroup) for r in results), results
        for averager, result, own in zip(averagers, results, (1.0, 3.0)):
            with averager.get_tensors() as (averaged,):
                values = set(averaged.tolist())
            if isinstance(result, PartialGroup):
                assert own in values and values <= {own, 2.0}, values  # its own values where no result came
            else:
                assert type(result) is dict and values == {2.0}, (result, values)


IDLE_PEER = """
import sys, time, torch
from test_optimizer import ROUNDS, _optimizer
from lightning_swarm.node import SwarmNode
node = SwarmNode(sys.argv[3:]).start()
model, optimizer = _optimizer(node, 0, "idle_partner", **ROUNDS)
model(torch.randn(4, 8)).square().mean().backward()
optimizer.step(batch_size=4)  # its half of the first epoch
print("ready", flush=True)
while optimizer.local_epoch < 1:  # the stage server's idle loop
    optimizer.follow_swarm()
    time.sleep(0.05)
if sys.argv[2] == "backward":  # no work in this epoch, until a backward once the partner moved on
    while optimizer.tracker.global_epoch < 2:
        time.sleep(0.05)
    model(torch.randn(4, 8)).square().mean().backward()
    optimizer.step(batch_size=4)
while optimizer.local_epoch < 2:
    optimizer.follow_swarm()
    time.sleep(0.05)
optimizer.apply_finished_update(wait=True)
torch.save(dict(state=model.state_dict(), downloaded=optimizer.downloaded, rounds=dict(optimizer.allreduce_sizes)),
           sys.argv[1])
print("done", flush=True)
time.sleep(600)
"""


# the two peers' rounds: a matchmaking window wider than the default test's 1 s, as on a loaded 2-core CI machine a
# round of the first epoch once found no group (its partner, a fresh interpreter, began it over a second later)
ROUNDS = dict(delayed=True, matchmaking_time=3.0, averaging_timeout=10.0)


@pytest.mark.parametrize("then", ["idle", "backward"])
def test_an_idle_partner_joins_the_round_that_counts_on_it_and_steps_as_the_others(tmp_path, then):
    """With delayed updates, a peer that holds samples when the epoch ends expects the stage's peers at its epoch
    whether they showed samples or not. A partner the routers left idle has none: it used to download the state
    instead (refused while the step it waited for was running), and the round waited for it in vain and failed (7 of
    11 failed stage rounds in ``benchmarks/default_target.py``); a backward coming then was thrown away for that
    download. It now joins that round, with no weight (idle) or with that backward's gradients: the round succeeds,
    and both step with the same averaged gradients, to the same parameters, with no download."""
    with beside_a_partner_process(IDLE_PEER, str(tmp_path / "idle.pt"), then) as (node, idle):
        assert idle.stdout.readline().strip() == "ready"
        model, optimizer = _optimizer(node, 0, "idle_partner", **ROUNDS)  # the same initial parameters
        try:
            model(torch.randn(4, 8)).square().mean().backward()
            optimizer.step(batch_size=4)  # the other half: the first epoch ends once each sees the other's samples
            deadline = time.monotonic() + 60
            while optimizer.local_epoch < 1:
                assert time.monotonic() < deadline, "the first epoch never ended"
                optimizer.follow_swarm()
                time.sleep(0.05)
            optimizer.apply_finished_update(wait=True)
            while not any(e.epoch == 1 for e in optimizer.tracker._records):  # the partner's new epoch, no samples
                assert time.monotonic() < deadline, "the partner's record of its new epoch never came"
                time.sleep(0.05)
            model(torch.randn(8, 8)).square().mean().backward()
            optimizer.step(batch_size=8)  # the whole second epoch: its round opens in the background
            optimizer.apply_finished_update(wait=True)
            assert idle.stdout.readline().strip() == "done"
            joined = torch.load(tmp_path / "idle.pt")
            assert (dict(optimizer.allreduce_sizes), optimizer.failed_rounds) == ({2: 2}, 0)
            assert joined["rounds"] == {2: 2} and not joined["downloaded"]
            for name, value in model.state_dict().items():
                if then == "idle":  # weights 8 and 0: the average is exactly this peer's gradient, on both sides
                    assert torch.equal(joined["state"][name], value), name
                else:  # hivemind's all-reduce: equal to float rounding
                    assert torch.allclose(joined["state"][name], value, rtol=0, atol=1e-6), name
        finally:
            optimizer.shutdown()


DEAD_HOLDER = """
import sys, time, torch
from test_optimizer import _optimizer
from lightning_swarm.node import SwarmNode
node = SwarmNode(sys.argv[1:]).start()
model, optimizer = _optimizer(node, 1, "refill", target=1)
while optimizer.local_epoch < 3:  # alone: a step each
    model(torch.randn(1, 8)).square().mean().backward()
    optimizer.step(batch_size=1)
# a sample of epoch 3: hivemind stores a record only within an epoch of the last it saw with samples, and its
# reporter, waking after the steps, may have seen none
optimizer.tracker.report_local_progress(3, 1)
print("at epoch 3", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("only_holder", [True, False], ids=["only_holder", "joiner"])
def test_a_peer_that_refills_a_stage_takes_the_epoch_of_its_dead_holder_at_its_first_step(only_holder):
    """The stage's last holder died at epoch 3; its progress record outlives it (``metadata_expiration``). A peer that
    starts serving the stage as its only holder takes epoch 3, and steps on its own gradient to epoch 4. A
    peer not told so (one that joined a stage with live peers) must download first: it tries, and with nobody alive
    to download from, that step fails and drops its gradient, as every step did until the record expired."""
    with beside_a_partner_process(DEAD_HOLDER) as (node, holder):
        assert holder.stdout.readline().strip() == "at epoch 3"
        model, optimizer = _optimizer(node, 0, "refill", target=1, averaging_timeout=2.0)
        try:
            deadline = time.monotonic() + 30
            while optimizer.tracker.global_epoch < 3:
                assert time.monotonic() < deadline, f"the holder's record never came: {optimizer.tracker._records}"
                time.sleep(0.1)
            os.killpg(holder.pid, signal.SIGKILL)
            holder.wait()
            if only_holder:
                optimizer.start_as_only_holder()
            before = copy.deepcopy(model.state_dict())
            model(torch.randn(1, 8)).square().mean().backward()
            optimizer.step(batch_size=1)
            moved = not torch.equal(model.weight, before["weight"])
            assert (optimizer.local_epoch, moved) == ((4, True) if only_holder else (0, False))
            assert not optimizer.downloaded
        finally:
            optimizer.shutdown()


def test_the_first_holder_of_a_stage_takes_no_live_partners_epoch(monkeypatch):
    """A stage's first peer starts as its only holder, with no dead holders' records to take an epoch from. A second
    peer that joined since, and stepped first, shows a newer epoch: that is a live peer's, and the first must download
    its state (its update with it), not take its epoch with its own parameters. (It took it, and the two stayed one
    step apart: seen in a two-peer stage's step logs.)"""
    node = SwarmNode().start()
    model, optimizer = _optimizer(node, 0, "fresh_stage")
    try:
        optimizer.start_as_only_holder()  # a fresh run: nobody's records
        monkeypatch.setattr(type(optimizer.tracker), "global_epoch", property(lambda tracker: 1))
        assert optimizer._should_load_state_from_peers() and optimizer.local_epoch == 0
    finally:
        optimizer.shutdown()
        node.shutdown()


def test_a_state_round_of_peers_an_epoch_apart_leaves_both_at_the_newer_epoch():
    """A parameter round may pair two peers an epoch apart (with delayed updates, one whose last step had no such
    round runs ahead): they leave with equal parameters, and so with one epoch, the newer. (Each kept its own, and
    the two stepped on in lockstep, equal parameters under epochs one apart, until training ended with one step
    more on one of them.)"""
    first = SwarmNode().start()
    second = SwarmNode(first.visible_maddrs()).start()
    (_, behind), (_, ahead) = _optimizer(first, 0, "epochs_apart"), _optimizer(second, 1, "epochs_apart")
    try:
        behind.state_averager.local_epoch, ahead.state_averager.local_epoch = 1, 2
        with ThreadPoolExecutor(2) as pool:
            rounds = [
                pool.submit(o.state_averager.step, averaging_round=True, averaging_opts=dict(timeout=30.0))
                for o in (behind, ahead)
            ]
            for averaged in rounds:
                averaged.result(timeout=60)
        assert (behind.local_epoch, ahead.local_epoch) == (2, 2)
        for mine, theirs in zip(behind.state_averager.main_parameters, ahead.state_averager.main_parameters):
            assert torch.allclose(mine, theirs, rtol=0, atol=1e-6)
    finally:
        for o in (behind, ahead):
            o.shutdown()
        for node in (second, first):
            node.shutdown()


class JoinedWithoutWeight:
    """What the control of a round that this peer joined with no weight reads once it is over: done, two peers."""

    triggered = began_allreduce = True
    weight = 0

    def done(self) -> bool:
        return True

    def cancelled(self) -> bool:
        return False

    def exception(self) -> None:
        return None

    def result(self, timeout: float | None = None) -> dict:
        return {b"a": None, b"b": None}


class Finished(JoinedWithoutWeight):
    """The control of a round this peer joined with its samples, over, with ``result``."""

    weight = 4

    def __init__(self, result: dict) -> None:
        self._result = result

    def result(self, timeout: float | None = None) -> dict:
        return self._result


@pytest.mark.parametrize("partial", [False, True], ids=["complete", "partial"])
def test_a_synchronous_peer_averages_its_parameters_after_a_round_that_lost_parts(partial):
    """A round of the whole expected group whose all-reduce lost parts (a PartialGroup) is followed by a parameter
    round with the partners, as a round that missed a partner is; a complete one is not. Both count as rounds of
    their size."""
    node = SwarmNode().start()
    model, optimizer = _optimizer(node, 0, "partial_round")
    try:
        optimizer._expected_group = optimizer.average_state_every = 2
        group = {b"a": None, b"b": None}
        optimizer._average_gradients_and_load_into_optimizer(Finished(PartialGroup(group) if partial else group))
        assert (optimizer.average_state_every, dict(optimizer.allreduce_sizes)) == (1 if partial else 2, {2: 1})
        assert optimizer.failed_rounds == 0
    finally:
        optimizer.shutdown()
        node.shutdown()


def test_a_round_of_peers_all_without_weight_averages_to_nan_and_a_joiner_then_steps_on_no_gradient():
    """hivemind divides each part's weighted sum by the weights' sum: a group of peers that all came without samples
    (two idle peers that missed the round they meant to join, and met) gets 0 / 0. A peer that joined with no
    weight and got that sets its gradients to zero, counts a failed round, and downloads its partners' state next,
    instead of stepping its parameters to NaN."""
    parameters = [torch.nn.Parameter(torch.zeros(4)) for _ in range(2)]
    with two_averagers("no_weight", parameters, target_group_size=2) as averagers:
        controls = [averager.step(weight=0.0, wait=False) for averager in averagers]
        assert [len(control.result(timeout=30.0)) for control in controls] == [2, 2]
        with averagers[0].get_tensors() as (averaged,):
            assert torch.isnan(averaged).all()

    node = SwarmNode().start()
    model, optimizer = _optimizer(node, 0, "no_weight_joiner", delayed=True)
    try:
        with optimizer.grad_averager.get_tensors() as averaged:
            for tensor in averaged:
                tensor.fill_(float("nan"))
        optimizer._average_gradients_and_load_into_optimizer(JoinedWithoutWeight())
        with optimizer.grad_averager.get_tensors() as averaged:
            assert all(torch.equal(tensor, torch.zeros_like(tensor)) for tensor in averaged)
        assert (optimizer.failed_rounds, dict(optimizer.allreduce_sizes)) == (1, {})
        assert optimizer.progress()["out_of_sync"]  # shown in rpc_info until its download
        assert optimizer._should_load_state_from_peers()
        assert not optimizer.progress()["out_of_sync"]
    finally:
        optimizer.shutdown()
        node.shutdown()


def test_a_swarm_stepping_about_as_often_as_a_round_assembles_is_told_to_raise_its_target():
    """Three steps in a row closer together than two matchmaking times: one warning naming the optimizer, the pace
    and the target batch to raise, then none for a while; steps further apart, or a slow one between, warn nothing."""
    pace = StepPace("run_stage1", matchmaking_time=1.0, target_batch_size=32)
    assert [pace.tick(t) for t in (0.0, 1.5, 3.0)] == [None, None, None]
    warning = pace.tick(4.5)
    assert "run_stage1 steps every 1.5s" in warning and "target_batch_size (now 32)" in warning, warning
    assert pace.tick(6.0) is None  # rate-limited
    slow = StepPace("s", 1.0, 32)
    assert [slow.tick(t) for t in (0.0, 2.5, 5.0, 7.5, 10.0)] == [None] * 5
    interrupted = StepPace("s", 1.0, 32)
    assert [interrupted.tick(t) for t in (0.0, 1.0, 2.0, 5.0, 6.0, 7.0)] == [None] * 6


def test_a_round_expecting_its_partners_begins_as_soon_as_they_are_there():
    """Told the size of its group, a round begins its all-reduce once that many peers joined, without waiting out its
    matchmaking time (60 s here: the results come well within it); hivemind's leader waits it out even when every
    partner is there."""
    parameters = [torch.nn.Parameter(torch.zeros(4)) for _ in range(2)]
    for i, parameter in enumerate(parameters):
        parameter.grad = torch.full((4,), float(i))  # what each averages
    with two_averagers("expected_group", parameters, matchmaking=60.0) as averagers:
        controls = []
        for averager in averagers:
            averager.expect_group(2)
            controls.append(averager.schedule_step(timeout=120.0))
        for control in controls:
            control.allow_allreduce()
        assert [len(control.result(timeout=45.0)) for control in controls] == [2, 2]
        with averagers[0].get_tensors() as (averaged,):
            assert torch.equal(averaged, torch.full((4,), 0.5))


@pytest.mark.parametrize("delayed", [False, True], ids=["synchronous", "delayed"])
def test_a_stage_with_one_peer_steps_exactly_as_plain_training(delayed):
    """Alone, the stage optimizer steps on the mean of the gradients of the backward passes since its last step, as
    plain training with gradient accumulation does (the sum of the microbatches' gradients over their count):
    parameters equal a plain AdamW's, bit for bit, after each of three steps of two microbatches. (hivemind, alone
    and synchronous, stepped on the last backward's gradients.) A synchronous step runs in the caller's thread, a
    delayed one in hivemind's step thread."""
    node = SwarmNode().start()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    plain = copy.deepcopy(model)
    reference = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1)
    user = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    optimizer = swarm_optimizer(node.dht, "alone", user, 8, 1.0, 5.0, delayed=delayed)
    stepping, threads = optimizer.state_averager.optimizer.step, []

    def step_in_thread(*args, **kwargs):
        threads.append(threading.get_ident())
        return stepping(*args, **kwargs)

    optimizer.state_averager.optimizer.step = step_in_thread
    try:
        for step in range(3):
            inputs = [torch.randn(4, 8) for _ in range(2)]
            for x in inputs:
                model(x).square().mean().backward()
                optimizer.step(batch_size=4)
                optimizer.zero_grad()
            optimizer.apply_finished_update(wait=True)
            grads = []
            for x in inputs:
                plain.zero_grad()
                plain(x).square().mean().backward()
                grads.append([p.grad.clone() for p in plain.parameters()])
            for p, *microbatches in zip(plain.parameters(), *grads):
                p.grad = sum(microbatches, torch.zeros_like(p)).mul_(1 / len(microbatches))
            reference.step()
            assert optimizer.local_epoch == step + 1
            for mine, theirs in zip(model.parameters(), plain.parameters()):
                assert torch.equal(mine, theirs), (step, (mine - theirs).abs().max())
        here = threading.get_ident()
        assert len(threads) == 3 and all((thread == here) != delayed for thread in threads), (threads, here)
    finally:
        optimizer.shutdown()
        node.shutdown()


def test_a_stage_steps_on_the_mean_gradient_per_sample_whatever_the_batches_of_its_backwards():
    """Backwards of unequal batches (trainers of different batch sizes at one stage, a short last batch) step on the
    gradient of the mean loss over all their samples, as plain training on those samples does, whichever batch came
    first. hivemind divided the sum by the count of backwards: 1, 3 and 4 samples in that order stepped on 8/3 of the
    gradient, 4, 3 and 1 on 2/3 of it. Plain SGD, whose step is proportional to the gradient, compares them."""
    node = SwarmNode().start()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    plain = copy.deepcopy(model)
    reference = torch.optim.SGD(plain.parameters(), lr=0.5)
    optimizer = swarm_optimizer(node.dht, "unequal", torch.optim.SGD(model.parameters(), lr=0.5), 8, 1.0, 5.0)
    try:
        for step, sizes in enumerate(([1, 3, 4], [4, 3, 1])):
            inputs = [torch.randn(size, 8) for size in sizes]
            for x in inputs:
                model(x).square().mean().backward()
                optimizer.step(batch_size=len(x))
                optimizer.zero_grad()
            plain.zero_grad()
            plain(torch.cat(inputs)).square().mean().backward()
            reference.step()
            assert optimizer.local_epoch == step + 1
            for mine, theirs in zip(model.parameters(), plain.parameters()):
                torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    finally:
        optimizer.shutdown()
        node.shutdown()


def test_a_step_run_inline_fails_as_in_the_step_thread_and_is_interrupted_at_once():
    """A step run inline hands its error to its future, as hivemind's step thread does; an interrupt is not held
    there (hivemind's step would then wait for an event the interrupted step never set): it goes up at once."""
    background = ThreadPoolExecutor(1)
    executor = optimizer_module._InlineWhenAwaited(background)
    try:

        def fails():
            raise ValueError("step failed")

        def interrupted():
            raise KeyboardInterrupt

        with executor.awaited(True):
            assert executor.submit(threading.get_ident).result() == threading.get_ident()
            with pytest.raises(ValueError, match="step failed"):
                executor.submit(fails).result()
            with pytest.raises(KeyboardInterrupt):
                executor.submit(interrupted)
        assert executor.submit(threading.get_ident).result(timeout=5) != threading.get_ident()
    finally:
        executor.shutdown()


def test_accumulation_weighs_each_backward_by_its_batch_as_hivemind_does():
    """The multi-tensor accumulation keeps hivemind's weights (each backward's gradients times its batch over the
    first backward's batch, since the last reset) and counts, and the reset zeroes the accumulators and the counts."""
    node = SwarmNode().start()
    model, optimizer = _optimizer(node, seed=0, prefix="weights", target=1000)
    try:
        averager = optimizer.grad_averager
        grads = []
        for batch in (4, 2, 6):
            for param in model.parameters():
                param.grad = torch.randn_like(param)
            grads.append(([p.grad.clone() for p in model.parameters()], batch))
            averager.accumulate_grads_(batch)
        expected = [sum(g[i] * (batch / 4) for g, batch in grads) for i in range(2)]
        assert all(torch.allclose(a, e) for a, e in zip(averager._grad_accumulators(), expected))
        assert (averager.local_samples_accumulated, averager.local_times_accumulated) == (12, 3)
        averager.reset_accumulated_grads_()
        assert all(not a.any() for a in averager._grad_accumulators())
        assert (averager.local_samples_accumulated, averager.local_times_accumulated) == (0, 0)
        for param in model.parameters():
            param.grad = torch.ones_like(param)
        averager.accumulate_grads_(2)  # a new first backward: its batch is the new anchor
        assert all(torch.equal(a, torch.ones_like(a)) for a in averager._grad_accumulators())
    finally:
        optimizer.shutdown()
        node.shutdown()
