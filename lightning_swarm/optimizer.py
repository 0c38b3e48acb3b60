"""The swarm optimizers: the user's optimizer, wrapped in ``hivemind.Optimizer`` (SWARM section 4).

One wraps each served stage and one wraps the trainer's local parameters (embeddings, head). Each accumulates
gradients until the peers sharing it (the peers of that stage, or all trainers) have together processed
``target_batch_size`` samples, then those peers all-reduce their gradients and step.

The target batch size. Given, it is the same fixed number on every peer. Unset, it is the global batch a user of
DDP expects: this peer's batch size times the number of peers that announce they are training (the ``training``
flag of their discovery records, :func:`~lightning_swarm.discovery.training_among`), at least one peer's batch
(:class:`PerTrainerBatch`). Every trainer's batch passes through every stage, so each stage (and the local
parameters) steps about once per round of the trainers' batches, as DDP does: its steps are about one trainer's step
apart, which leaves its all-reduce round a trainer's step to assemble (when that is shorter than a round needs,
:class:`StepPace` says to raise the target). The target used to be one peer's batch: with N trainers a stage stepped
after every ~1/N of a batch, far more often than its rounds could assemble (issue 27: 4 peers, batch 16, 60 steps
each: one peer had finished after 600 s, where a target of 32 took 357 s). ``benchmarks/default_target.py`` measures
the default against a target of N x the batch.

How the count is read: every optimizer's progress tracker (:class:`CountingProgressTracker`) reads the run's
discovery records from the DHT, once when it starts and then as it refreshes the progress (the records are read
without blocking and used at the next refresh, at most every :data:`COUNT_PERIOD` seconds), and sets its
``target_batch_size`` from them: hivemind's ``ProgressTracker`` reads that attribute wherever it decides on a step
(``ready_to_update_epoch``, its progress estimate) and nowhere caches it, and ``hivemind.Optimizer`` leaves the
decision to its tracker. Peers read the same records, so they agree on the target, except for a refresh or so
after a trainer joins, finishes or leaves. The alternative, a target the first peer publishes in the run's meta
record, would be agreed on for good but fixed: that peer does not know how many trainers will come, and the same
script starts every peer. Peers whose batch sizes differ would disagree on the target; give one then.
"""

from __future__ import annotations

import asyncio
import logging
import math
import multiprocessing
import threading
import time
from collections import Counter
from concurrent.futures import Executor, Future, InvalidStateError
from contextlib import contextmanager
from functools import partial
from typing import Any, Awaitable, Callable, Iterable, Iterator, Mapping, Optional

import hivemind
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.dht import DHT
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.progress_tracker import GlobalTrainingProgress, LocalTrainingProgress, ProgressTracker
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.utils import get_dht_time
from hivemind.utils.performance_ema import PerformanceEMA

from lightning_swarm import device_sync, discovery
from lightning_swarm.errors import MID_STEP
from lightning_swarm.logs import RateLimit
from lightning_swarm.node import exit_with_parent

log = logging.getLogger(__name__)


def train_batch_size(trainer: Any) -> Optional[int]:
    """The batch size this peer trains with: its datamodule's ``batch_size``, else its train DataLoader's (the one
    ``fit`` was given, or the datamodule's or LightningModule's ``train_dataloader()``); None if neither says."""
    batch_size = getattr(trainer.datamodule, "batch_size", None)
    if isinstance(batch_size, int):
        return batch_size
    source = getattr(trainer.fit_loop, "_data_source", None)  # where Lightning itself takes the train DataLoader
    if source is None or not source.is_defined():
        return None
    loader = source.dataloader()
    batch_size = getattr(loader, "batch_size", None) or getattr(
        getattr(loader, "batch_sampler", None), "batch_size", None
    )
    return batch_size if isinstance(batch_size, int) else None


def target_batch_size(trainer: Any, given: Optional[int]) -> int:
    """``given``, else this peer's :func:`train_batch_size`, else a ``ValueError`` asking for one."""
    if given is not None:
        return given
    batch_size = train_batch_size(trainer)
    if batch_size is None:
        raise ValueError(
            "Set target_batch_size (or SWARM_TARGET_BATCH_SIZE): the samples, summed over the swarm, after which the "
            "swarm takes an optimizer step (this peer's datamodule and train DataLoader have no batch_size to start "
            "from)"
        )
    return batch_size


COUNT_PERIOD = 1.0  # seconds between two reads of the training peers' records by a progress tracker


class PerTrainerBatch(int):
    """A target batch size of this many samples (one peer's batch) per peer that trains: the number of trainers is
    read from their discovery records under ``keys`` (:func:`~lightning_swarm.discovery.record_keys`). As an int, it
    is one peer's batch."""

    def __new__(cls, batch_size: int, keys: Mapping[str, Optional[int]] = ()) -> PerTrainerBatch:
        target = super().__new__(cls, batch_size)
        target.keys = dict(keys)
        return target

    def __reduce__(self) -> tuple:
        return type(self), (int(self), self.keys)

    def __repr__(self) -> str:
        return f"PerTrainerBatch({int(self)} per trainer)"

    def total(self, trainers: Optional[int]) -> int:
        """The target for ``trainers`` training peers (None or 0: one peer's batch)."""
        return int(self) * max(1, trainers or 0)


class TrainerCount:
    """The number of the run's peers that announce they are training, read from their records in ``dht`` under
    ``keys`` at most every ``period`` seconds, without blocking the caller: :meth:`poll` starts the reads and returns
    the count of the last reads that finished (None before any has)."""

    def __init__(self, dht: Any, keys: Mapping[str, Optional[int]], period: float = COUNT_PERIOD) -> None:
        self.dht, self.keys, self.period = dht, dict(keys), period
        self.count: Optional[int] = None
        self._pending: dict[Optional[int], Any] = {}  # stage -> the DHT's future of its records
        self._next = -float("inf")

    def read(self, timeout: float) -> Optional[int]:
        """Read the records now, waiting up to ``timeout`` seconds for them; the count, or None if they did not come."""
        self._start(time.monotonic())
        deadline = time.monotonic() + timeout
        while not all(f.done() for f in self._pending.values()) and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.poll()

    def poll(self, now: Optional[float] = None) -> Optional[int]:
        now = time.monotonic() if now is None else now
        if self._pending and all(f.done() for f in self._pending.values()):
            pending, self._pending = self._pending, {}
            try:
                found = {stage: _values(future.result()) for stage, future in pending.items()}
                self.count = len(discovery.training_among(found))
            except Exception as e:  # the last count stands; read again next period
                log.debug("Could not read the training peers' records: %r", e)
        if not self._pending and now >= self._next:
            self._start(now)
        return self.count

    def _start(self, now: float) -> None:
        self._next = now + self.period
        try:
            self._pending = {
                stage: self.dht.get(key, latest=True, return_future=True) for key, stage in self.keys.items()
            }
        except Exception as e:  # a DHT shutting down
            log.debug("Could not read the training peers' records: %r", e)
            self._pending = {}


def _values(found: Any) -> dict:
    """The values by subkey of a dictionary record as the DHT returns it (``ValueWithExpiration``), else empty."""
    value = getattr(found, "value", None)
    return {subkey: getattr(item, "value", None) for subkey, item in value.items()} if isinstance(value, dict) else {}


def restrict_to(optimizer: torch.optim.Optimizer, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """A fresh optimizer of the same class with the same per-group hyper-parameters, over ``params`` only."""
    keep = {id(p) for p in params}
    groups = []
    for group in optimizer.param_groups:
        selected = [p for p in group["params"] if id(p) in keep]
        if selected:
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": selected})
    if not groups:
        raise ValueError("None of the given parameters is in the optimizer returned by configure_optimizers")
    return type(optimizer)(groups)


@torch.no_grad()
def create_state(optimizer: torch.optim.Optimizer) -> None:
    """Allocate the optimizer's state as its first step would, without that step's effects.

    hivemind averages optimizer state, so it needs the state tensors up front; left alone it creates them with a
    real step on zero gradients, which applies weight decay and advances the step count (changing Adam's bias
    correction). Here parameters are restored and step counts reset, so the first real step is the one of a fresh
    optimizer.
    """
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved = [(p.detach().clone(), p.grad) for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for p, (value, grad) in zip(params, saved):
        p.copy_(value)
        p.grad = grad
    for state in optimizer.state.values():
        if "step" in state:
            state["step"] = torch.zeros_like(state["step"]) if torch.is_tensor(state["step"]) else 0


RELEASER_IDLE = 10.0  # seconds a CoalescedSignal's releaser waits for another held set before it leaves


class _NoRateEstimate(PerformanceEMA):
    """A throughput estimate that never leaves zero."""

    def update(self, task_size: float, interval: Optional[float] = None) -> float:
        return self.samples_per_second


class CoalescedSignal(threading.Event):
    """The event hivemind's progress reporter waits on: each time it is set, the reporter stores this peer's progress
    as it is then in the DHT. While ``coalescing``, a set within ``period`` seconds of the last one is held back until
    ``period`` after it, and the sets held meanwhile become that one: the reports of one epoch's samples, one per
    microbatch, cost at most one store per period, and the latest progress is always stored. Any other set (a new
    epoch, shutdown) goes at once.

    Held sets are released by one thread that stays while sets keep being held (it leaves after
    :data:`RELEASER_IDLE` seconds with none): a thread started per held set cost the caller, an optimizer step, the
    new thread's start, 0.4-0.9 ms p50 and up to 10 ms on a loaded machine."""

    def __init__(self, period: float) -> None:
        super().__init__()
        self.period = period
        self.coalescing = False
        self._last = -math.inf  # when it was last set
        self._due: Optional[float] = None  # when the sets held now are released
        self._changed = threading.Condition(threading.Lock())
        self._releaser: Optional[threading.Thread] = None

    def set(self) -> None:
        with self._changed:
            now = time.monotonic()
            if not self.coalescing or now >= self._last + self.period:
                self._release(now)
            elif self._due is None:
                self._due = self._last + self.period
                if self._releaser is None:
                    self._releaser = threading.Thread(target=self._release_when_due, name="swarm-report", daemon=True)
                    self._releaser.start()
                else:
                    self._changed.notify()

    def _release_when_due(self) -> None:
        with self._changed:
            idle_since = time.monotonic()
            while True:
                now = time.monotonic()
                if self._due is not None and now >= self._due:
                    self._release(now)
                    idle_since = now
                elif self._due is not None:
                    self._changed.wait(self._due - now)
                elif now - idle_since >= RELEASER_IDLE:
                    self._releaser = None
                    return
                else:
                    self._changed.wait(idle_since + RELEASER_IDLE - now)

    def _release(self, now: float) -> None:
        self._due = None
        self._last = now
        super().set()


class CountingProgressTracker(ProgressTracker):
    """hivemind's progress tracker, made exact for peers that receive work in bursts.

    hivemind extrapolates each peer's samples from its recent rate and steps once the extrapolation reaches the
    target; and it counts every peer with a record as a member of the next all-reduce. A stage server gets work
    whenever a router picks it, so a peer would step on its own microbatch before the others' samples exist, and
    wait for an all-reduce partner (up to the averaging timeout) that has nothing to contribute and never comes.
    Here every peer reports a rate of zero, so the swarm steps on samples actually processed; and the peers of
    an all-reduce are this one, those with samples in its epoch, and those that just left that epoch (their round
    may still be looking for this peer); with delayed updates, when none of those is seen, the peers within one
    epoch of its own (:meth:`round_size`), which join it with their samples or none (:meth:`awaited_without_samples`).
    Peers left out catch up by downloading the state (``SwarmOptimizer.follow_swarm``).

    Given a :class:`PerTrainerBatch` target, its ``target_batch_size`` is that times the peers training (``trainers``,
    by default read from the run's records in its DHT): read once as it starts, then again as it refreshes the
    progress, the last count read standing while a read fails. With ``expect_trainers`` (the trainers' local
    optimizer), every round expects all the peers training (:meth:`round_size`).

    Within an epoch, this peer's reports of more samples are stored at most every ``min_refresh_period`` seconds
    (:class:`CoalescedSignal`), the shortest period at which partners fetch the progress: hivemind stores one per
    call, one per microbatch. So is its entry into a new epoch: its first samples there, which go at once, usually
    follow within a microbatch and store both. A reset goes at once.
    """

    def __init__(
        self,
        dht: DHT,
        prefix: str,
        target_batch_size: int,
        *,
        start: bool,
        trainers: Optional[TrainerCount] = None,
        expect_trainers: bool = False,
        **kwargs: Any,
    ) -> None:
        # set before hivemind's constructor, which fetches the swarm's progress once
        # (epoch, samples of the other peers, how many have samples) as last fetched
        self._others: tuple[Optional[int], int, int] = (None, 0, 0)
        self._records: list[LocalTrainingProgress] = []  # the other peers' progress, as last fetched
        self._sampled_at: set[int] = set()  # the swarm's recent epochs in which this peer reported samples
        self.per_trainer: Optional[PerTrainerBatch] = None  # the target is this times the trainers (unset: fixed)
        self.trainers = trainers
        self.expect_trainers = expect_trainers
        if expect_trainers and trainers is None:
            raise ValueError("expect_trainers needs the trainers' count (trainers=TrainerCount(...))")
        if isinstance(target_batch_size, PerTrainerBatch):
            self.per_trainer = target_batch_size
            self.trainers = trainers or TrainerCount(dht, target_batch_size.keys)
            target_batch_size = target_batch_size.total(self.trainers.read(timeout=5.0))
        super().__init__(dht, prefix, int(target_batch_size), start=False, **kwargs)
        self.performance_ema = _NoRateEstimate()
        self.should_report_progress = CoalescedSignal(self.min_refresh_period)
        if start:
            self.start()

    def report_local_progress(
        self, local_epoch: int, samples_accumulated: int, update_global_samples: bool = True
    ) -> None:
        """hivemind's report, noting the swarm's epoch when it carried samples (for :meth:`published`); more samples
        within an epoch are stored coalesced (see the class docstring)."""
        if samples_accumulated > 0:
            epoch = self.global_epoch
            self._sampled_at = {e for e in self._sampled_at if e >= epoch - 2} | {epoch}
        previous = self.local_progress
        more = local_epoch == previous.epoch and samples_accumulated > previous.samples_accumulated > 0
        entered = local_epoch > previous.epoch and samples_accumulated == 0
        self.should_report_progress.coalescing = more or entered
        try:
            super().report_local_progress(local_epoch, samples_accumulated, update_global_samples)
        finally:
            self.should_report_progress.coalescing = False

    def published(self, epoch: int) -> bool:
        """Whether hivemind published this peer's progress while the swarm was at ``epoch``, so that its partners
        could count it in their rounds of that epoch: its reporter stores a peer's record only within one epoch of the
        last it reported samples in. A peer with no samples since it joined (or moved to this stage) is in no count."""
        return any(epoch - 1 <= e <= epoch for e in self._sampled_at)

    def _parse_swarm_progress_data(self, metadata: Any) -> GlobalTrainingProgress:
        if self.trainers is not None:  # the trainers as last read; the next read starts (at most every period)
            trainers = self.trainers.poll()
            if self.per_trainer is not None:
                self.target_batch_size = self.per_trainer.total(trainers)
        progress = super()._parse_swarm_progress_data(metadata)
        me = self.dht.peer_id.to_bytes()
        entries = [LocalTrainingProgress.parse_obj(e.value) for e in (metadata or {}).values() if e.value is not None]
        others = [e for e in entries if e.peer_id != me]
        contributors = [e for e in others if e.epoch == progress.epoch and e.samples_accumulated]
        self._others = (progress.epoch, sum(e.samples_accumulated for e in contributors), len(contributors))
        self._records = others
        progress.num_peers = self.group_size()
        return progress

    def group_size(self) -> int:
        """The peers of this one's next round, itself included, by its epoch now and the records as last fetched:
        those with samples of its epoch, and, when it is one epoch behind, those that just moved on (with delayed
        updates their round of this epoch is still running; left out, this peer stepped alone while they looked for
        it in vain). Counted at the step, not the fetch: a download since then may have moved this peer's epoch."""
        mine = self.local_progress.epoch
        partners = [e for e in self._records if (e.epoch == mine and e.samples_accumulated) or e.epoch == mine + 1]
        return 1 + len(partners)

    def round_size(self, unseen: bool) -> int:
        """The peers the round at the end of this one's epoch expects, itself included: :meth:`group_size`; with
        ``unseen`` (delayed updates), when none of them showed samples of this epoch, the peers within one epoch of
        this one all the same (:meth:`peers_at_epoch`). Their samples may not have been fetched yet (a refresh is up to
        half a matchmaking time old): stepping alone put them into a round one epoch behind, and one stage step in
        eight was taken so. One seen an epoch behind may have stepped into this epoch since its record: two partners
        ending an epoch together each saw the other behind, and one stepped alone while the other's round waited for
        it. A partner with no samples joins with none (:meth:`awaited_without_samples`).

        With ``expect_trainers``, at least every peer training (as last read): each trainer learns of the epoch's end
        at its next step, after its batch, and the trainers' progress records, fetched every half matchmaking time,
        lag behind their batches. Counting only the partners whose samples it had seen, a round began without a
        trainer that came moments later, and that one found nobody: 97 of 116 failed rounds of the trainers, 0.4 s
        late at the median (``benchmarks/RESULTS.md``). A round that misses a trainer anyway begins at its scheduled
        time, two matchmaking times after it opened, with those that came."""
        size = self.group_size()
        if self.expect_trainers:
            size = max(size, self.trainers.count or 0)
        return self.peers_at_epoch(behind=True) if unseen and size == 1 else size

    def peers_at_epoch(self, behind: bool = False) -> int:
        """The peers at this one's epoch, or one ahead (``behind``: or one behind), with samples or not, itself included
        (as last fetched)."""
        mine = self.local_progress.epoch
        near = (mine - 1, mine, mine + 1) if behind else (mine, mine + 1)
        return 1 + sum(1 for e in self._records if e.epoch in near)

    def awaited_without_samples(self) -> bool:
        """Whether a partner's round of this peer's epoch, still running, counts on this peer though it has no samples:
        a partner is one epoch ahead and none at this epoch showed samples (as last fetched), so that partner's round
        expected every peer at its epoch whose record it saw (:meth:`round_size`), which this one's is only if it was
        :meth:`published`. A newcomer that joined such a round went unexpected: the round closed without it, and its
        own failed after the window; it then downloaded the state all the same."""
        mine = self.local_progress.epoch
        if self.local_progress.samples_accumulated or self.global_epoch != mine + 1 or not self.published(mine):
            return False
        return not any(e.epoch == mine and e.samples_accumulated for e in self._records)

    def _counted(self) -> tuple[int, int]:
        """The samples of this peer's epoch, its own as they are now plus the others' as last fetched, and how many
        other peers have some."""
        epoch, others, contributors = self._others
        if epoch != self.local_progress.epoch:
            others, contributors = 0, 0
        return self.local_progress.samples_accumulated + others, contributors

    @property
    def ready_to_update_epoch(self) -> bool:
        # hivemind adds this peer's new samples to the global count without the lock its fetcher holds, so a fetch
        # finishing just after can drop them and the step comes late; so also count this peer's own samples as
        # they are now, plus the others' as last fetched
        return super().ready_to_update_epoch or self._counted()[0] >= self.target_batch_size

    def epoch_goes_on_after(self, batch_size: int) -> bool:
        """Whether the epoch cannot end with this peer's next batch of ``batch_size`` samples: the samples counted
        (:meth:`_counted`), plus that batch from this peer and from each other peer with samples (or, where the
        trainers are counted, from each other trainer, at the start of an epoch too), stay short of the target."""
        counted, contributors = self._counted()
        if self.trainers is not None:
            contributors = max(contributors, (self.trainers.count or 1) - 1)
        return counted + batch_size * (1 + contributors) < self.target_batch_size


class _StartsByFork(multiprocessing.context.ForkProcess):
    """A process started by fork whatever the default start method: the first base of the swarm's averagers.

    hivemind's averagers are processes that start with the default method and expect a fork (its DHT, a
    ``ForkProcess``, always forks): forkserver, the default on Linux from Python 3.14 on, pickles the process to start
    it, and an averager cannot be pickled. It exits with the peer's process, even one killed by SIGKILL.
    """

    def run(self) -> None:
        exit_with_parent(self._parent_pid)
        super().run()


class _NotesDownloads(DecentralizedAverager):
    """Remembers whether the last download brought a state: ``TrainingStateAverager.load_state_from_peers``, which
    calls this one, returns nothing either way."""

    downloaded = False

    def load_state_from_peers(self, **kwargs: Any) -> Any:
        loaded = super().load_state_from_peers(**kwargs)
        self.downloaded = loaded is not None
        return loaded


DECLARE_PERIOD = 1.0  # seconds: an averager declares itself a state donor at most this often (hivemind: every epoch)


class _CoalescedAsyncEvent(asyncio.Event):
    """An asyncio event set at most once every ``period`` seconds: a set within the period is held until its end, and
    the sets held meanwhile become that one. Set and waited on in one event loop."""

    def __init__(self, period: float) -> None:
        super().__init__()
        self.period = period
        self._last = -math.inf  # when it was last set
        self._held: Optional[asyncio.TimerHandle] = None

    def set(self) -> None:
        wait = self._last + self.period - time.monotonic()
        if wait <= 0:
            self._release()
        elif self._held is None:
            self._held = asyncio.get_running_loop().call_later(wait, self._release)

    def _release(self) -> None:
        self._held = None
        self._last = time.monotonic()
        super().set()


class _DeclaresCoalesced(DecentralizedAverager):
    """An averager that re-declares itself as a donor of its state at most every :data:`DECLARE_PERIOD` seconds.

    hivemind's averager stores its declaration in the DHT each time its ``_state_updated`` event is set: when the
    optimizer sets the donor priority to its epoch (at every step), and for every tensor an all-reduce round
    averages. With a step every batch each peer's averager stored one per batch, and a round of the parameters of a
    small GPT about a hundred, each served by every other peer's DHT. Here that event is set at most once a period
    (:class:`_CoalescedAsyncEvent`). The latest priority is read when the declaration is stored, so a held one goes
    out with the newest epoch, a period late at most; a downloader may then pick a donor an epoch behind another,
    whose state is consistent with the epoch it is labelled with (:class:`ConsistentStateAverager`).
    """

    @property
    def _state_updated(self) -> asyncio.Event:
        return self._coalesced_update

    @_state_updated.setter
    def _state_updated(self, _event: asyncio.Event) -> None:  # hivemind makes the event in its averager's process
        self._coalesced_update = _CoalescedAsyncEvent(DECLARE_PERIOD)


def cancel_round(control: StepControl) -> None:
    """Cancel an averaging round, unless it was cancelled before: hivemind's ``StepControl.cancel`` sends the cancel
    through a future of the averager's that can be set once, and a second call raises ``InvalidStateError`` (a peer
    leaving with SIGTERM exited 1 on it, its shutdown cancelling a round the optimizer had given up on)."""
    try:
        control.cancel()
    except InvalidStateError:
        pass


class PartialGroup(dict):
    """The result of an averaging round whose all-reduce lost some parts: its group's gathered data, as hivemind
    returns it for a complete round."""


class _FlagsPartialRounds(DecentralizedAverager):
    """An averager whose rounds say when their all-reduce lost parts of the tensors.

    When a partner fails to reduce its part (its stream broke, or timed out), hivemind keeps this peer's own values
    for that part, logs "received N% results" and returns the group as for a complete round: the partners' tensors
    then differ where those parts are, and an optimizer that averages the parameters only after a round that missed
    a partner let them stay apart. Here such a round returns a :class:`PartialGroup`.
    """

    async def _aggregate_with_group(self, group_info: Any, *args: Any, **kwargs: Any) -> Any:
        gathered = await super()._aggregate_with_group(group_info, *args, **kwargs)
        running = self._running_groups.get(group_info.group_id)  # registered until the round's step ends
        runner = running.result() if running is not None and running.done() else None
        if runner is not None and runner.tensor_part_container.failed_size:
            return PartialGroup(gathered)
        return gathered


LOOKUP_PERIOD = 0.05  # seconds: a round looking for its group reads the declared averagers at most this often


def _paced(lookup: Callable[..., Awaitable[Any]], period: float) -> Callable[..., Awaitable[Any]]:
    """``lookup``, called at most once every ``period`` seconds: a call within the period first waits for its end."""
    last = -math.inf

    async def paced(*args: Any, **kwargs: Any) -> Any:
        nonlocal last
        wait = last + period - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        last = time.monotonic()
        return await lookup(*args, **kwargs)

    return paced


class _BoundedMatchmaking(DecentralizedAverager):
    """An averager whose rounds stop looking for a group shortly after their scheduled start, and look no more often
    than every :data:`LOOKUP_PERIOD`.

    hivemind's rounds read the averagers declared in the DHT again as soon as the last read came back while no group
    leader is known (``PotentialLeaders.pop_next_leader``): four peers training 20 steps on one machine read them
    3050 times in a minute (1685 paced), each read also served by the other peers' DHTs. A peer reads at once when
    its round starts, and finds the partners declared before it then; pacing delays a group by less than a period.

    hivemind's keep looking (retrying) until the round's timeout, the averaging timeout, or for ever for a gradient
    round that was not pre-scheduled (the optimizer stops waiting for it after the averaging timeout and leaves it
    running): when the partners never come (they stepped without this peer, or left), a failed round cost a
    synchronous peer the whole averaging timeout, twice (gradients, then parameters). Here a round that has no group
    by its scheduled start plus one request's timeout fails; a round that found one runs its all-reduce under
    hivemind's own timeout. With ``owner_bounds_triggered_rounds``, a round that waits for its owner's trigger is
    left to the owner, who bounds it from the trigger on.
    """

    owner_bounds_triggered_rounds = False
    last_round: Any = None  # what the last step returned: its StepControl when it was not waited for

    @property
    def _matchmaking(self) -> Matchmaking:
        return self._paced_matchmaking

    @_matchmaking.setter
    def _matchmaking(self, matchmaking: Matchmaking) -> None:  # hivemind makes it in its averager's process
        keys = matchmaking.group_key_manager
        keys.get_averagers = _paced(keys.get_averagers, LOOKUP_PERIOD)
        self._paced_matchmaking = matchmaking

    def step(
        self,
        *args: Any,
        scheduled_time: Optional[float] = None,
        timeout: Optional[float] = None,
        require_trigger: bool = False,
        **kwargs: Any,
    ):
        if not (require_trigger and self.owner_bounds_triggered_rounds):
            now = get_dht_time()
            start = (
                scheduled_time if scheduled_time is not None else now + self.matchmaking_kwargs["min_matchmaking_time"]
            )
            bound = start + self.grace - now
            timeout = bound if timeout is None else min(timeout, bound)
        self.last_round = super().step(
            *args, scheduled_time=scheduled_time, timeout=timeout, require_trigger=require_trigger, **kwargs
        )
        return self.last_round

    @property
    def grace(self) -> float:
        """How long after its scheduled start a round may still find its group: one request's timeout."""
        return self.matchmaking_kwargs["request_timeout"] or self.matchmaking_kwargs["min_matchmaking_time"]

    def expect_group(self, size: Optional[int]) -> None:
        """Let the next round begin its all-reduce as soon as ``size`` peers (this one included) are in its group,
        instead of waiting out its matchmaking time (None: wait it out, take whoever came). The averager process
        applies it before any round asked for later (its pipe keeps their order)."""
        self._outer_pipe.send(("_expect_group", [], dict(size=size)))

    async def _expect_group(self, size: Optional[int]) -> None:
        self._matchmaking.target_group_size = size
        self._matchmaking.potential_leaders.target_group_size = size


class BoundedGradientAverager(_StartsByFork, GradientAverager, _BoundedMatchmaking, _FlagsPartialRounds):
    """hivemind's gradient averager, started by fork, with :class:`_BoundedMatchmaking`'s rounds; a pre-scheduled
    round keeps looking until the optimizer triggers it, which then bounds it (:meth:`assembles`).

    hivemind pre-schedules a gradient round when it estimates that the epoch ends within the matchmaking time; an
    estimate early by more than a request's timeout made a round bounded from its scheduled start fail before the
    epoch ended, and its partners, arriving on time, then found nobody: both stepped alone.

    It declares no state to download: a newcomer downloads the state averager's, and hivemind resets the gradients
    it accumulates after a download. hivemind's declared one at every step, a DHT store each.

    A round's gradients go from the device into its shared host buffers, pinned for a GPU, scaled there on the way
    (:meth:`load_accumulators_into_averager_`): hivemind copies them through pageable memory and scales them on one
    host thread.
    """

    owner_bounds_triggered_rounds = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{"allow_state_sharing": False, **kwargs})
        on_gpu = any(param.is_cuda for param in self.parameters)
        self._pinned = device_sync.register_pinned(self._averaged_tensors) if on_gpu else []

    @property
    def mean_scale(self) -> float:
        """What turns the accumulators into the mean gradient per sample. Each backward was added times its batch
        over the first backward's (hivemind's weights), so the sum is divided by the samples over that first batch.
        hivemind divides by the count of backwards, the same figure only when every backward had the first one's
        batch; with unequal ones (trainers of different batch sizes at one stage, a short last batch) its step's
        gradient was off by the first batch times the count over the samples, a factor that changed from step to
        step with the order the backwards came in."""
        if not self.local_samples_accumulated:
            return 0.0
        return self._anchor_batch_size / self.local_samples_accumulated  # equal batches: exactly 1 / count

    @torch.no_grad()
    def load_accumulators_into_averager_(self) -> None:
        """hivemind's load of the accumulated gradients, as their mean per sample (:attr:`mean_scale`), into the
        buffers the all-reduce reads: on a GPU scaled on the device and copied into pinned memory
        (``device_sync.copy_scaled``), done before the averager's process may read them."""
        with self.get_tensors() as averaged:
            device_sync.copy_scaled(averaged, list(self._grad_accumulators()), self.mean_scale)

    def shutdown(self) -> None:
        super().shutdown()
        device_sync.unregister_pinned(self._pinned)
        self._pinned = []

    @torch.no_grad()
    def accumulate_grads_(self, batch_size: int) -> None:
        """hivemind's accumulation (the same counts, and each backward weighted by its batch over the first's) in one
        multi-tensor add: on a GPU a few kernel launches per backward, not one per parameter tensor."""
        if self._anchor_batch_size is None:
            self._anchor_batch_size = batch_size
        self.local_samples_accumulated += batch_size
        self.local_times_accumulated += 1
        grads = list(self._grads_from_parameters())
        torch._foreach_add_(list(self._grad_accumulators()), grads, alpha=batch_size / self._anchor_batch_size)

    @torch.no_grad()
    def reset_accumulated_grads_(self) -> None:
        """hivemind's reset, the accumulators zeroed in one multi-tensor call."""
        self._accumulators_used_in_step = False
        self.local_samples_accumulated = self.local_times_accumulated = 0
        self._anchor_batch_size = None
        torch._foreach_zero_(list(self._grad_accumulators()))

    @property
    def window(self) -> float:
        """How long a round opened at the end of an epoch looks for its partners: two matchmaking times. A partner
        notices the end at its next step (a trainer's: after its batch) past a progress refresh; a round whose
        partners all joined begins at once (:meth:`expect_group`), so the window costs only a round that fails."""
        return 2 * self.matchmaking_kwargs["min_matchmaking_time"]

    def schedule_step(self, scheduled_time: Optional[float] = None, **kwargs: Any) -> Any:
        if scheduled_time is None:
            scheduled_time = get_dht_time() + self.window
        return super().schedule_step(scheduled_time=scheduled_time, **kwargs)

    def assembles(self, control: Any) -> bool:
        """Whether the round ``control``, triggered just now, begins its all-reduce within its :attr:`window` and a
        request's timeout; if not, it is cancelled. Partners holding samples see the epoch end within a progress
        refresh and a step of theirs; ones that have not by then are not coming."""
        deadline = time.monotonic() + self.window + self.grace
        while not (control.done() or control.began_allreduce):
            if time.monotonic() >= deadline:
                cancel_round(control)
                return False
            time.sleep(0.01)
        return True


class _InlineWhenAwaited(Executor):
    """hivemind's step executor, except that a step its caller waits for in full runs in the caller's thread.

    hivemind hands every step to its step thread, even a synchronous one that the caller then waits for: two thread
    switches per step, each a wait for the GIL, on the path from one batch to the next. A step is run inline when
    :meth:`awaited` says the caller will wait for all of it and no earlier step is still running (they run one at a
    time, in order); any other goes to the thread, as in hivemind."""

    def __init__(self, background: Executor) -> None:
        self.background = background
        self._caller = threading.local()

    @contextmanager
    def awaited(self, inline: bool) -> Iterator[None]:
        """Steps submitted from this thread meanwhile run inline if ``inline``."""
        self._caller.inline = inline
        try:
            yield
        finally:
            self._caller.inline = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        if not getattr(self._caller, "inline", False):
            return self.background.submit(fn, *args, **kwargs)
        future: Future = Future()
        future.set_running_or_notify_cancel()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as e:  # as the thread's future would hold it; the caller reads it at once
            future.set_exception(e)
        # anything else (KeyboardInterrupt) goes up: held in the future, hivemind's step would wait for an event that
        # the interrupted step never set
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.background.shutdown(wait, cancel_futures=cancel_futures)


class ConsistentStateAverager(
    _StartsByFork,
    TrainingStateAverager,
    _NotesDownloads,
    _BoundedMatchmaking,
    _FlagsPartialRounds,
    _DeclaresCoalesced,
):
    """hivemind's state averager, made to hand out a state that matches the epoch it is labelled with.

    hivemind raises a peer's epoch when it schedules a step, then runs the step in a background thread (all of it
    with delayed updates, the optimizer part otherwise), and serves its state to downloading peers without waiting
    for that step or locking the optimizer: a peer catching up could get the previous step's parameters, or a mix
    of both, labelled with the new epoch, and stay one step apart from the others for good. Here a download waits
    for the pending step briefly (within the downloader's patience) and is refused if it is still running, so the
    downloader asks again later; the state is read under the optimizer's lock. Its rounds are bounded as
    :class:`_BoundedMatchmaking` says; it starts by fork (:class:`_StartsByFork`); it declares itself a donor
    coalesced (:class:`_DeclaresCoalesced`). A round's copies of the state between the device and the shared host
    buffers are multi-tensor calls, through pinned memory on a GPU, waited for before the averager's process uses the
    buffers (hivemind copies tensor by tensor through pageable memory).
    """

    def __init__(self, *args: Any, request_timeout: float = 3.0, **kwargs: Any) -> None:
        super().__init__(*args, request_timeout=request_timeout, **kwargs)
        self.patience = request_timeout / 2  # a downloader waits request_timeout for the first part of the state
        on_gpu = any(tensor.is_cuda for tensor in self._local_tensors())
        self._pinned = device_sync.register_pinned(self._averaged_tensors) if on_gpu else []
        self.step_executor = _InlineWhenAwaited(self.step_executor)

    def step(
        self,
        *,
        delay_optimizer_step: bool = False,
        averaging_round: bool = False,
        delay_averaging: Optional[bool] = None,
        **kwargs: Any,
    ) -> Any:
        """hivemind's step; one that is not delayed in any part runs in this thread (:class:`_InlineWhenAwaited`)."""
        delayed = delay_optimizer_step or (
            averaging_round and (delay_optimizer_step if delay_averaging is None else delay_averaging)
        )
        running = any(not update.done() for update in self.pending_updates)
        with self.step_executor.awaited(not delayed and not running):
            return super().step(
                delay_optimizer_step=delay_optimizer_step,
                averaging_round=averaging_round,
                delay_averaging=delay_averaging,
                **kwargs,
            )

    @torch.no_grad()
    def _load_local_tensors_into_averager_(self) -> None:
        with self.get_tensors() as averaged:
            device_sync.copy_waited(averaged, list(self._local_tensors()))

    @torch.no_grad()
    def _apply_averaging_results_(self) -> None:
        if self.delta_rule_averaging:
            super()._apply_averaging_results_()
            return
        with self.get_tensors() as averaged:
            local = list(self._local_tensors())
            if len(local) != len(averaged):
                raise RuntimeError(f"{len(averaged)} averaged tensors for {len(local)} local ones")
            device_sync.copy_waited(local, averaged)

    def shutdown(self) -> None:
        super().shutdown()
        device_sync.unregister_pinned(self._pinned)
        self._pinned = []

    def get_current_state(self):
        deadline = time.monotonic() + self.patience
        for update in list(self.pending_updates):
            try:
                update.result(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise RuntimeError(MID_STEP) from None
            except BaseException:  # a failed or cancelled step left the state as it was
                pass
        with self.lock_optimizer:
            return super().get_current_state()


STATE_EVERY = 10  # synchronous steps: parameters are averaged at least this often (hivemind: after every step)

PACE_STEPS = 3  # consecutive steps closer together than a round needs, before the warning


class StepPace:
    """Tells when a swarm optimizer steps about as often as an all-reduce round takes to assemble.

    A round needs at least ``matchmaking_time`` to form its group and then runs its all-reduce; when steps come
    closer together than twice that, a peer still in the round of one step misses its partners' round of the next,
    and each steps on its own gradients (a 4-peer demo at a target batch of 32 lost 15% of its training time to such
    rounds). The cure is a larger target batch (or a shorter matchmaking time on a fast network).
    """

    def __init__(self, name: str, matchmaking_time: float, target_batch_size: int, period: float = 600.0) -> None:
        self.name, self.matchmaking_time, self.target_batch_size = name, matchmaking_time, target_batch_size
        self._last: Optional[float] = None
        self._fast = 0  # consecutive intervals shorter than two matchmaking times
        self._due = RateLimit(period)

    def tick(self, now: float) -> Optional[str]:
        """Note a step at ``now`` (monotonic seconds); returns the warning to log, when one is due."""
        interval, self._last = (None if self._last is None else now - self._last), now
        if interval is None:
            return None
        self._fast = self._fast + 1 if interval < 2 * self.matchmaking_time else 0
        if self._fast < PACE_STEPS or not self._due():
            return None
        return (
            f"{self.name} steps every {interval:.1f}s, about as often as an all-reduce round takes to assemble "
            f"(matchmaking_time={self.matchmaking_time:g}s): many rounds will fail, and peers then step on their own "
            f"gradients. Raise target_batch_size (now {self.target_batch_size}) so that steps are at least "
            f"{2 * self.matchmaking_time:g}s apart"
        )


class SwarmOptimizer(hivemind.Optimizer):
    """``hivemind.Optimizer`` that counts samples exactly (see ``CountingProgressTracker``), can follow the swarm
    while it has no work, and counts its steps and gradient all-reduces.

    ``target_batch_size``: a fixed number of samples, or a :class:`PerTrainerBatch` (what the strategy passes when
    none is given): one peer's batch times the peers training, as the run's discovery records say (see the module's
    docstring); ``self.tracker.target_batch_size`` is the target in force.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.steps = 0
        self.allreduce_sizes: Counter[int] = Counter()  # gradient all-reduces that succeeded, by group size
        self.failed_rounds = 0  # gradient all-reduces that failed (no group found, or timed out): stepped alone
        self.failed_round_seconds = 0.0  # the time they held this peer up: waiting for them, not their background
        self._failed_at: Optional[float] = None  # when a background round failed, until the foreground next waits
        self._expected_group = 1  # the peers counted on for the current gradient round, this one included
        self._out_of_sync = False  # its parameters may differ from its partners': it downloads their state next
        self._only_holder_until = -math.inf  # until then, it may take the epoch its stage's dead holders left
        self._dead_holders_epoch: Optional[int] = None  # that epoch (None: none to take)
        self.pace = StepPace(self.run_id, self.matchmaking_time, self.tracker.target_batch_size)

    def _make_progress_tracker(self, target_batch_size: int, **kwargs: Any) -> ProgressTracker:
        return CountingProgressTracker(
            dht=self.dht,
            prefix=self.run_id,
            target_batch_size=target_batch_size,
            client_mode=self.client_mode,
            status_loglevel=self.status_loglevel,
            start=True,
            **kwargs,
        )

    def _make_state_averager(self, **kwargs: Any) -> TrainingStateAverager:
        return ConsistentStateAverager(
            dht=self.dht,
            prefix=f"{self.run_id}_state_averager",
            min_matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout,
            shutdown_timeout=self.shutdown_timeout,
            offload_optimizer=self.offload_optimizer,
            custom_gradients=self.offload_optimizer,
            status_loglevel=self.status_loglevel,
            next_chunk_timeout=self.next_chunk_timeout,
            client_mode=self.client_mode,
            auxiliary=self.auxiliary,
            start=True,
            # a state round may pair peers an epoch apart (one whose last step had no state round runs ahead): both
            # then take the newer epoch, so that equal parameters carry equal epochs
            sync_epoch_when_averaging=True,
            **kwargs,
        )

    def _maybe_schedule_gradient_averaging(self) -> None:
        """No pre-scheduled gradient rounds: a round opens when this peer's epoch ends, expecting its partners
        (:meth:`_begin_averaging_gradients`). hivemind pre-schedules one a matchmaking time ahead of its estimate of
        the epoch's end, which fixes when the group assembles: partners that noticed the end later found it gone."""

    def _maybe_schedule_state_averaging(self) -> None:
        if self.delay_optimizer_step:  # synchronous steps average the state only after a failed round, unscheduled
            super()._maybe_schedule_state_averaging()

    def _begin_averaging_gradients(self, grad_scaler: Any) -> bool:
        # the round's group is complete once the partners counted in this epoch have joined: it begins at once
        if self.scheduled_grads is not None and (self.scheduled_grads.triggered or self.scheduled_grads.done()):
            self.scheduled_grads = None  # the last round's: hivemind would skip this round for it (nothing replaces it)
        self._expected_group = self.tracker.round_size(unseen=self.delay_grad_averaging)
        self.tracker.global_progress.num_peers = self._expected_group
        if self._expected_group > 1:
            self.grad_averager.expect_group(self._expected_group)
            if not self.delay_optimizer_step:  # for a parameter round after this step, if there is one
                self.state_averager.expect_group(self._expected_group)
        began = super()._begin_averaging_gradients(grad_scaler)
        # alone, hivemind loads the accumulated gradients into its host buffers only, and a synchronous step then
        # used the last backward's .grad; "began" sends them through _load_local_gradients_into_optimizer instead
        # (with delayed updates the host buffers are the optimizer's gradients, and are loaded now, as hivemind does)
        return began or (self.scheduled_grads is None and not self.offload_optimizer)

    def _load_local_gradients_into_optimizer(self) -> None:
        """This peer's accumulated gradients, as their mean per sample (``BoundedGradientAverager.mean_scale``), into
        ``.grad`` on the parameters' device. hivemind copies them into the averager's shared host memory, scales them
        there on one thread and copies them back; the host optimizer of delayed updates still reads them there."""
        if self.offload_optimizer:
            super()._load_local_gradients_into_optimizer()
            return
        averager = self.grad_averager
        for param in averager.parameters:
            if param.grad is None:
                param.grad = torch.empty_like(param)
        grads = [param.grad for param in averager.parameters]
        with torch.no_grad():  # multi-tensor calls: a few kernel launches, not two per parameter tensor
            torch._foreach_copy_(grads, list(averager._grad_accumulators()))
            torch._foreach_mul_(grads, averager.mean_scale)
        averager.notify_used_averaged_gradients()

    def _update_global_epoch(self, grad_scaler: Any) -> None:
        if self.delay_optimizer_step:
            self._finish_background_step()  # hivemind waits for it first too: here that wait is timed
        else:  # hivemind averages the parameters after every step; needed only after a round without every partner,
            # and, as a safety net for peers apart since an earlier one, every STATE_EVERY steps
            self.average_state_every = STATE_EVERY  # 1 after a round that missed a partner
            self.state_averager.last_round = None
        super()._update_global_epoch(grad_scaler)
        averaged = self.state_averager.last_round
        if averaged is not None and not self.delay_optimizer_step:
            # parameters are equal again only if every partner came to that averaging round; if not, this peer takes
            # a partner's state at its next step (or idle moment)
            complete = averaged.done() and not averaged.cancelled()
            complete = complete and averaged.exception() is None and len(averaged.result()) >= self._expected_group
            complete = complete and not isinstance(averaged.result(), PartialGroup)
            self._out_of_sync = not complete
        self.steps += 1
        self.pace.target_batch_size = self.tracker.target_batch_size  # it follows the trainers, unless given
        warning = self.pace.tick(time.monotonic())
        if warning is not None:
            log.warning(warning)

    def _average_gradients_and_load_into_optimizer(self, maybe_step_control: Any) -> None:
        control = maybe_step_control
        if control is None:  # no round: hivemind steps on this peer's gradients
            super()._average_gradients_and_load_into_optimizer(control)
            if not self.delay_optimizer_step and self.tracker.peers_at_epoch() > 1:
                # peers at this epoch had no samples when last seen; any that stepped too (peers starting together
                # see nobody) would keep their parameters apart from this one's for good
                self._expected_group = self.tracker.peers_at_epoch()
                self._average_state_with_partners()
            return
        triggered = time.monotonic()
        assembled = self.grad_averager.assembles(control)
        super()._average_gradients_and_load_into_optimizer(control)
        if assembled and control.cancelled():
            return  # cancelled by this peer catching up with the others: not a failed round
        if assembled and control.done() and control.exception() is None and not self._no_weight_in_group(control):
            group = control.result()
            self.allreduce_sizes[len(group)] += 1
            if len(group) < self._expected_group or isinstance(group, PartialGroup):
                # the partners left out stepped alone, or parts of the gradients were averaged with no partner's
                self._average_state_with_partners()
            return
        self._average_state_with_partners()  # this peer steps alone: its parameters leave the others'
        if control.weight == 0:  # it joined with no gradients (_awaited): a partner's state is the right one
            self._out_of_sync = True
        if not control.done():  # hivemind stopped waiting for it (averaging timeout): nobody will use it
            cancel_round(control)
        self.failed_rounds += 1
        if self.delay_grad_averaging:  # a background round: it holds up only a step that waits for it
            self._failed_at = time.monotonic()
        else:  # this peer waited for it, from its trigger
            self.failed_round_seconds += time.monotonic() - triggered

    def _no_weight_in_group(self, control: Any) -> bool:
        """Whether the round ``control``, joined with no weight, found only peers without samples too: hivemind's
        average is then 0 / 0, and its NaNs are set to zero here (this peer then downloads its partners' state)."""
        if control.weight != 0:
            return False
        with self.grad_averager.get_tensors() as averaged:
            if all(bool(torch.isfinite(tensor).all()) for tensor in averaged):
                return False
            for tensor in averaged:
                tensor.zero_()
        return True

    def _average_state_with_partners(self) -> None:
        """Average the parameters (and optimizer state) after this step, in a round that begins once the partners of
        the gradient round have joined."""
        self.average_state_every = 1
        progress = self.tracker.global_progress
        progress.num_peers = max(progress.num_peers, self._expected_group)  # hivemind averages only if above one
        if not self.delay_optimizer_step:
            self.state_averager.expect_group(self._expected_group)

    def _finish_background_step(self) -> None:
        """Wait for the background step of delayed updates and put its result into the parameters. The part of the
        wait before that step's gradient round failed is the time the failed round held this peer up (a round that
        failed while the peer went on training cost it nothing)."""
        began = time.monotonic()
        self.state_averager.step(wait_for_delayed_updates=True)
        failed_at, self._failed_at = self._failed_at, None
        if failed_at is not None:
            self.failed_round_seconds += max(0.0, failed_at - began)

    def leave_rounds(self) -> None:
        """This peer trains no more but stays (it serves the others until they finish): withdraw its progress record
        now, not at :meth:`shutdown`, so that the other peers' rounds stop counting on it. Its record showed the
        samples it gathered after its last round, at its epoch, and a partner's round at that epoch expected it
        until the record expired (in two demo runs, a trainers' round 3 s after a partner's fit ended waited for
        that partner's 64 leftover samples, and failed)."""
        self.tracker.shutdown(self.shutdown_timeout)

    def shutdown(self) -> None:
        # hivemind cancels the rounds still looking for a group; one given up on already (cancelled, or over) may
        # still read so, and a second cancel raises: cancelled here, once, and then left out of hivemind's shutdown
        for name in ("scheduled_grads", "scheduled_state"):
            control = getattr(self, name)
            if control is not None and (control.done() or control.stage == AveragingStage.LOOKING_FOR_GROUP):
                cancel_round(control)
                setattr(self, name, None)
        super().shutdown()

    def _tag_along_with_zero_weight(self, control: Any) -> None:
        if not control.triggered:
            control.weight = 0
            control.allow_allreduce()
        self.grad_averager.assembles(control)
        super()._tag_along_with_zero_weight(control)

    def _load_averaged_gradients_into_optimizer_(self) -> None:
        """The round's averaged gradients into ``.grad``, in one multi-tensor copy (from pinned memory on a GPU),
        done before the averager's process may write the buffers again; hivemind copies them tensor by tensor.
        hivemind also made a missing ``.grad`` (zero_grad sets it to None) a clone of the averaged gradient, on the
        host: a GPU parameter refused it, and the step after an idle peer joined a round failed."""
        if self.offload_optimizer:  # the averaged gradients are the offloaded optimizer's own
            super()._load_averaged_gradients_into_optimizer_()
            return
        params = [param for group in self.state_averager.optimizer.param_groups for param in group["params"]]
        for param in params:
            if param.grad is None:
                param.grad = torch.empty_like(param)
        with torch.no_grad(), self.grad_averager.get_tensors() as averaged:
            if len(averaged) != len(params):
                raise RuntimeError(f"{len(averaged)} averaged gradients for {len(params)} parameters")
            device_sync.copy_waited([param.grad for param in params], averaged)
        self.grad_averager.notify_used_averaged_gradients()

    def load_state_from_peers(self, **kwargs: Any) -> bool:
        """Download the newest state of the peers sharing this optimizer; returns whether this peer is now at the
        swarm's epoch.

        Unlike hivemind's: a download that fails, or brings an older epoch, leaves this peer at its own epoch
        (hivemind labels it with the swarm's epoch anyway, which forks its parameters from the others' for good),
        and a failure is not retried forever: the caller (the idle loop, or the next step) tries again later.
        """
        if self.scheduled_grads is not None and not self.scheduled_grads.done():
            self._tag_along_with_zero_weight(self.scheduled_grads)  # others may count on this peer's round
            self.scheduled_grads = None
        self._finish_background_step()
        with self.tracker.pause_updates():
            try:
                self.state_averager.load_state_from_peers(timeout=self.load_state_timeout, **kwargs)
            except Exception as e:
                log.warning("Could not download the state of %s from its peers: %r", self.run_id, e)
            self.tracker.report_local_progress(local_epoch=self.local_epoch, samples_accumulated=0)
            if not self.client_mode:
                self.state_averager.state_sharing_priority = self.local_epoch
            if self.use_gradient_averaging:
                self.grad_averager.reset_accumulated_grads_()
                if not self.client_mode:
                    self.grad_averager.state_sharing_priority = self.local_epoch
        return self.local_epoch >= self.tracker.global_epoch

    @property
    def downloaded(self) -> bool:
        """Whether the last ``load_state_from_peers`` brought a state from a peer."""
        return self.state_averager.downloaded

    def start_as_only_holder(self) -> None:
        """This peer starts serving a stage that no live peer holds (from its initialisation, or a checkpoint).

        The progress records of the peers that held it and died still show their epoch until they expire
        (``metadata_expiration``); a peer whose epoch is behind downloads the state before stepping, and with nobody
        alive to download from, every step tried, failed and dropped its gradients until then (16 s of a test swarm's
        refill, 2 minutes with the default settings). Until those records expired, this peer takes their epoch once
        instead, with its own state, as hivemind's peers take the swarm's after a download. That epoch is the one the
        records show now: a peer ahead of it later is a live one (it joined since, and stepped without this peer),
        downloaded from as usual. (Taking whatever epoch showed during that time, a stage's first peer took the epoch of
        a second peer that had stepped first, without its update, and stayed one step apart from it.)
        """
        epoch = self.tracker.global_epoch
        self._dead_holders_epoch = epoch if epoch > self.local_epoch else None
        self._only_holder_until = time.monotonic() + self.tracker.metadata_expiration

    def _should_load_state_from_peers(self) -> bool:
        if self._out_of_sync:
            self._out_of_sync = False  # one download: it may fail, or bring an older state (then it is kept)
            return True
        dead_holders_epoch, self._dead_holders_epoch = self._dead_holders_epoch, None  # taken once, if at all
        if dead_holders_epoch is not None and time.monotonic() < self._only_holder_until:
            if self.local_epoch < dead_holders_epoch:
                self.state_averager.local_epoch = dead_holders_epoch
                self.tracker.report_local_progress(self.local_epoch, self.grad_averager.local_samples_accumulated)
        if self.delay_grad_averaging and (self.grad_averager.local_samples_accumulated > 0 or self._awaited()):
            # a peer's new epoch shows as soon as it schedules its step, while that step's all-reduce still
            # assembles in the background: a peer one epoch behind with gradients joins it (hivemind's rule), and so
            # does one without, that the round counts on (its gradients, if a backward brings some now, or none)
            return self.local_epoch < self.tracker.global_epoch - 1
        # synchronous: the others' round is over by the time their new epoch shows; stepping with this peer's own
        # gradients would fork its parameters from theirs
        return self.local_epoch < self.tracker.global_epoch

    def _awaited(self) -> bool:
        """Delayed updates: whether a partner's round of this peer's epoch, still running, counts on this peer, which
        holds no samples (:meth:`CountingProgressTracker.awaited_without_samples`). Downloading the state instead (it
        is refused while that partner's step runs), this peer let the round wait for it in vain and fail; joining it,
        with the gradients of a backward that comes now or with none (zero weight), it steps with its partners'
        gradients, as they do."""
        return self.delay_grad_averaging and self.tracker.awaited_without_samples()

    @property
    def rounds(self) -> int:
        """Gradient all-reduce rounds this peer took part in, failed ones included."""
        return sum(self.allreduce_sizes.values()) + self.failed_rounds

    def progress(self) -> dict:
        """This peer's epoch, steps taken, gradient all-reduces by group size (string keys, for msgpack), and whether
        its parameters may differ from its partners' until it downloads their state (next step or idle moment)."""
        sizes = {str(k): v for k, v in self.allreduce_sizes.items()}
        return dict(
            epoch=self.local_epoch,
            steps=self.steps,
            allreduce_sizes=sizes,
            failed_rounds=self.failed_rounds,
            failed_round_seconds=self.failed_round_seconds,
            out_of_sync=self._out_of_sync,
        )

    def apply_finished_update(self, wait: bool = False) -> None:
        """Delayed updates: put the result of a background step that has finished into the parameters now (``wait``:
        let a step still running finish first, up to the averaging timeout).

        hivemind applies it at the next ``step`` call, after the next backward; a stage server calls this before
        every forward, so that staleness lasts as long as the background step runs, one step at most.
        """
        if not self.delay_optimizer_step:
            return
        if wait:
            self._finish_background_step()
        else:
            self.state_averager.step(wait_for_delayed_updates=False)

    def state_dict(self) -> dict:
        """The optimizer's state, with a delayed step still running finished and applied first."""
        self.apply_finished_update(wait=True)
        with self.state_averager.lock_optimizer:
            return super().state_dict()

    def follow_swarm(self) -> None:
        """Keep an idle peer in step with the others (call it between two ``step`` calls).

        hivemind acts only inside ``step()``, which a stage server calls after a backward. A peer the routers left
        idle would keep serving parameters several steps old, or miss the all-reduce its accumulated samples were
        counted in (its partners waiting for it until they time out). So: download the current state once the
        others have stepped without this peer, or join the epoch transition they are ready for if this peer has
        gradients to contribute, or, with delayed updates, if their round counts on it (:meth:`_awaited`).
        """
        self.apply_finished_update()
        if self._should_load_state_from_peers():
            self.load_state_from_peers()
        elif self.tracker.ready_to_update_epoch and (self.grad_averager.local_samples_accumulated or self._awaited()):
            # what step() does once ready, without new samples (a stale pre-scheduled round would make hivemind
            # skip the gradient all-reduce and step on whatever .grad holds)
            self._maybe_schedule_gradient_averaging()
            self._maybe_schedule_state_averaging()
            self._update_global_epoch(grad_scaler=None)


def swarm_optimizer(
    dht: DHT,
    prefix: str,
    optimizer: torch.optim.Optimizer,
    target_batch_size: int,
    matchmaking_time: float,
    averaging_timeout: float,
    delayed: bool = False,
    trainer_keys: Optional[Mapping[str, Optional[int]]] = None,
) -> SwarmOptimizer:
    """Wrap ``optimizer`` so that it steps once per ``target_batch_size`` samples of all peers under ``prefix``
    (a :class:`PerTrainerBatch`: that many per peer training, as the peers' records say).

    ``delayed``: the all-reduce and the optimizer step run in the background while the parameters keep their
    values; the update lands at the next ``step`` (or ``follow_swarm``) call, so they are at most one step stale.
    hivemind then steps its own copy of the parameters, with an optimizer it builds: the same class and groups.

    ``trainer_keys`` (the trainers' local optimizer): the keys of the run's discovery records
    (:func:`~lightning_swarm.discovery.record_keys`); every round then expects all the peers training
    (:meth:`CountingProgressTracker.round_size`).
    """
    if delayed:
        optimizer_class = type(optimizer)

        def build(param_groups: list[dict]) -> torch.optim.Optimizer:
            built = optimizer_class(param_groups)
            create_state(built)
            return built

        setup = dict(params=[dict(group) for group in optimizer.param_groups], optimizer=build, offload_optimizer=True)
    else:
        create_state(optimizer)
        setup = dict(optimizer=optimizer)
    tuning = hivemind_tuning(matchmaking_time, averaging_timeout)
    if trainer_keys is not None:
        trainers = TrainerCount(dht, trainer_keys)
        tuning["tracker_opts"] = {**tuning["tracker_opts"], "trainers": trainers, "expect_trainers": True}
    return SwarmOptimizer(
        dht=dht,
        run_id=prefix,
        target_batch_size=target_batch_size,
        **setup,
        **tuning,
        delay_state_averaging=delayed,
        delay_optimizer_step=delayed,
        delay_grad_averaging=delayed,
        # given, hivemind 1.1.12 takes the DHT's; left None, its client-mode averagers are asked to share state
        client_mode=bool(dht.kwargs.get("client_mode", False)),
        shutdown_timeout=2,
        verbose=False,
    )


def hivemind_tuning(matchmaking_time: float, averaging_timeout: float) -> dict[str, Any]:
    """``hivemind.Optimizer`` arguments that make its peers find each other within ``matchmaking_time`` and give
    up on an all-reduce (or a state download) after ``averaging_timeout``: the swarm's optimizers and the hivemind
    baseline (benchmarks/baselines.py) use the same."""
    request_timeout = min(1.0, matchmaking_time / 2)  # hivemind: must stay below matchmaking time
    return dict(
        matchmaking_time=matchmaking_time,
        averaging_timeout=averaging_timeout,
        load_state_timeout=averaging_timeout,
        # hivemind 1.1.12 passes averager_opts to the state averager only: the gradient averager's go here
        averager_opts=dict(request_timeout=request_timeout),
        grad_averager_factory=partial(BoundedGradientAverager, request_timeout=request_timeout),
        # with no rate estimates, peers learn of each other's samples only by polling: poll well within matchmaking
        tracker_opts=dict(
            min_refresh_period=0.2,
            max_refresh_period=max(0.5, matchmaking_time / 2),
            default_refresh_period=max(0.5, matchmaking_time / 2),
            metadata_expiration=4 * averaging_timeout,
        ),
    )
