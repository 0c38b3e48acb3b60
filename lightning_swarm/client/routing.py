"""Stochastic wiring (SWARM section 3): for every microbatch and stage, pick a peer at random, favouring the peers
expected to finish it first.

For each peer of a stage the router estimates how long the microbatch would take there: the samples queued there
(from the peer's DHT record), the samples this process has in flight there and the microbatch itself, divided by
the throughput the peer publishes (what its device sustains for the stage, measured on the requests it served).
A peer is chosen with probability inversely proportional to that time: idle peers share the work in proportion to
their throughput, busy ones get less. A peer that has not published a throughput yet counts as the fastest, so
that newcomers get tried. (Estimates measured on this process's own calls, network included, were tried: one slow
first call, e.g. while a peer warms up, starved that peer of the calls that would have corrected it.)
A failed or timed-out call bans the peer for a while (``ban_timeout``, doubling with each failure in a row up to
``MAX_BAN_FACTOR`` times it) and the work goes to another peer of the same stage; after ``max_retries`` failed
attempts the stage is reported as unavailable. Any failure on the peer's side fails over so
(a crashed worker, a stage not ready, an unexpected server error, or a malformed reply: replies are checked as
requests are, :class:`ReplyCheck`); a peer that answers busy (full queue, out of memory) is tried again after the
others, and only a request the caller got wrong (:data:`~lightning_swarm.errors.CALLERS_FAULT`) raises at once.
A stage with no usable peer at all (none in
the DHT, or all banned) is waited for, with a log line every ``WAIT_LOG_PERIOD`` seconds, for up to
``stage_wait_timeout`` seconds before it is reported as unavailable.
A stage's records are read from the DHT once before its first choice, then again every ``refresh_period`` seconds
on a thread of the router's own while the choices go on with the records at hand: a read takes round trips to
several DHT peers, and no microbatch waits for one.
Calls go to a peer's direct address (:mod:`~lightning_swarm.transport`) when its record has one, and over libp2p
otherwise, or when no direct connection can be made (remembered for ``UNREACHABLE_PERIOD`` seconds).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Callable, Optional, Sequence

import torch
from hivemind.p2p import P2PHandlerError, PeerID
from hivemind.proto import runtime_pb2

from lightning_swarm import chain_wiring, compression, device_sync, discovery, events, protocol
from lightning_swarm.discovery import PeerRecord, PeerState
from lightning_swarm.errors import (
    CALLERS_FAULT,
    ActivationsLostError,
    BadReplyError,
    ChainBrokenError,
    StageBusyError,
    StageUnavailableError,
)
from lightning_swarm.logs import RateLimit
from lightning_swarm.node import SwarmNode
from lightning_swarm.protocol import stage_uid
from lightning_swarm.stage_api import WAIT_LOG_PERIOD, LocalStage, StageService
from lightning_swarm.transport import CONNECT_TIMEOUT, DirectClient, DirectRequest, DirectUnreachable

log = logging.getLogger(__name__)

DEFAULT_THROUGHPUT = 1.0  # samples/s assumed while no peer of the stage has been measured: only ratios matter
# A ban lasts at most this many ban_timeouts. A stage whose peers are all banned waits for one, and that wait counts
# towards stage_wait_timeout: uncapped, the default ban of a peer's sixth failure in a row (480 s) outlasted it.
MAX_BAN_FACTOR = 4
UNREACHABLE_PERIOD = 300.0  # seconds a peer whose direct address could not be reached is called over libp2p
MAX_REPLY_BYTES = 256 * 2**20  # a reply's tensor, decoded: as much as a stage server accepts in a request
Reply = list[runtime_pb2.Tensor]


def ban_seconds(ban_timeout: float, failures: int) -> float:
    """How long a ban after ``failures`` failures in a row lasts: ``ban_timeout``, doubled with each failure after
    the first, up to ``MAX_BAN_FACTOR`` times."""
    return ban_timeout * min(2 ** (failures - 1), MAX_BAN_FACTOR)


@dataclass
class ReplyCheck:
    """What a stage's reply must be: one floating-point tensor of ``batch`` samples; of exactly ``shape`` and
    ``dtype`` when given (a backward's input gradient is shaped like the stage's input); at most ``max_bytes``
    decoded. With ``device`` set, the reply is decoded there, divided by ``divide`` and into ``out`` if given (a
    slice of the tensor that assembles the microbatches; ``decoded`` keeps the last reply that passed), and must be
    finite unless ``finite`` is False (a backward under a loss scale reports an overflow as NaN). Without, only its
    header and framing are checked: a reply relayed to another stage unread is validated by that stage, which
    refuses NaN or Inf with :class:`~lightning_swarm.errors.NonFiniteInputError`."""

    batch: int
    shape: Optional[Sequence[int]] = None
    dtype: Optional[torch.dtype] = None
    finite: bool = True
    max_bytes: int = MAX_REPLY_BYTES
    device: Optional[torch.device] = None
    out: Optional[torch.Tensor] = field(default=None, repr=False)
    divide: float = 1.0
    decoded: Optional[torch.Tensor] = field(default=None, init=False, repr=False)

    def __call__(self, reply: Reply) -> None:
        """Raise :class:`BadReplyError` unless ``reply`` is what was asked for."""
        if len(reply) != 1:
            raise BadReplyError(f"a reply of {len(reply)} tensors, expected 1")
        size = list(reply[0].size)
        if not size or size[0] != self.batch or (self.shape is not None and size != list(self.shape)):
            expected = list(self.shape) if self.shape is not None else f"[{self.batch}, ...]"
            raise BadReplyError(f"a reply of shape {size}, expected {expected}")
        try:
            nbytes, dtype = compression.raw_nbytes(reply[0]), compression.decoded_dtype(reply[0])
            if nbytes > self.max_bytes:
                raise BadReplyError(f"a reply of {nbytes} bytes, above {self.max_bytes}")
            if not dtype.is_floating_point or (self.dtype is not None and dtype != self.dtype):
                raise BadReplyError(f"a reply of dtype {dtype}, expected {self.dtype or 'a floating dtype'}")
            if self.device is None:
                compression.check_framing(reply[0])
                return
            tensor = compression.deserialize(reply[0], self.device, self.out, self.divide)
        except ValueError as e:
            raise BadReplyError(f"an undecodable reply: {e}") from None
        if self.finite and not device_sync.all_finite(tensor):
            raise BadReplyError("a reply with NaN or Inf")
        self.decoded = tensor


@dataclass
class PeerLoad:
    """What this process knows about one peer's load."""

    record: PeerRecord
    in_flight: int = 0
    banned_until: float = 0.0
    failures: int = 0

    def time_to_finish(self, batch: int, throughput: float) -> float:
        """Expected seconds until ``batch`` more samples are done there, at ``throughput`` samples/s."""
        return (self.record.queue + self.in_flight + batch) / max(throughput, 1e-9)


@dataclass
class RouterStats:
    """A router's counters of its calls to the stages, since it started."""

    calls: int = 0
    direct_calls: int = 0  # calls answered over a direct connection (transport.py)
    p2p_calls: int = 0  # calls answered over libp2p (the peer has no direct address, or it was unreachable)
    failovers: int = 0
    recomputed: int = 0  # backward passes sent with the input again, because the forward's graph was not kept
    bytes_sent: int = 0  # tensor payloads as sent (compressed)
    bytes_received: int = 0
    raw_bytes_sent: int = 0  # the same tensors uncompressed
    side_bytes_sent: int = 0  # of bytes_sent, the blocks' side inputs (rotary tables, masks...) sent with forwards
    samples_sent: int = 0  # samples sent forward into the pipeline (each microbatch once, whatever its hops)
    chained: int = 0  # microbatch forwards that went stage to stage (chain wiring), not relayed by this process
    # chained forwards that a stage server could not hand on (ChainBrokenError), relayed by this process instead:
    # each also a failover, with no failed call of this process behind it
    chain_breaks: int = 0
    trailing: int = 0  # backwards through the stages (one per pipeline call) left running behind the next forward
    seconds: dict = field(default_factory=dict)  # stage -> seconds spent in successful calls to it
    chosen: dict = field(default_factory=dict)  # peer id -> number of calls sent there
    # peer id -> number of those calls that failed, and of the calls that stage servers handing this process's
    # microbatches on reported as failed (chain wiring): a forward's counted, not banned here (a receipt is the
    # server's word); a backward's peer banned too, as that hop is recomputed on its stage at once
    failed: dict = field(default_factory=dict)

    def add(self, **counts: int) -> None:
        """Add to these counters what the router's callers see (backward passes recomputed, bytes sent before
        compression), rather than writing the fields."""
        for name, value in counts.items():
            setattr(self, name, getattr(self, name) + value)

    @property
    def side_bytes_per_sample(self) -> float:
        """Side-input bytes sent per sample that went through the pipeline (0 before any)."""
        return self.side_bytes_sent / self.samples_sent if self.samples_sent else 0.0

    def copy(self) -> RouterStats:
        """These counters as they are now, dicts included, for a reader on another thread than the router's."""
        return replace(self, seconds=dict(self.seconds), chosen=dict(self.chosen), failed=dict(self.failed))


class PendingCall:
    """A call to one peer under way (:meth:`StageRouter.start_call`): its reply once, or given up."""

    def __init__(
        self,
        router: StageRouter,
        stage: int,
        peer: str,
        load: Optional[PeerLoad],
        batch: int,
        timeout: float,
        timed: bool = True,
    ) -> None:
        self.stage, self.peer, self.timeout, self.timed = stage, peer, timeout, timed
        self.future: Optional[concurrent.futures.Future] = None  # the request on the RPC event loop, once sent
        self._router, self._load, self._batch = router, load, batch
        self._start = time.perf_counter()
        self._settled = False

    def result(self) -> Reply:
        """The reply, waited for until the call's timeout (the request's, and a failed direct try's) from when it
        was sent."""
        try:
            reply = self.future.result(max(0.0, self._start + self.timeout - time.perf_counter()))
        except concurrent.futures.TimeoutError:
            self.future.cancel()
            raise
        except P2PHandlerError as e:
            raise _remote_error(e) from None
        finally:
            self._settle()
        router, elapsed = self._router, time.perf_counter() - self._start
        with router._lock:
            router.stats.bytes_received += protocol.payload_bytes(reply)
            if self.timed:
                router.stats.seconds[self.stage] = router.stats.seconds.get(self.stage, 0.0) + elapsed
            if self._load is not None:
                self._load.failures = 0
        return reply

    def cancel(self) -> None:
        """Give the call up: the peer's answer, if it comes, is dropped."""
        if self.future is not None:
            self.future.cancel()
        self._settle()

    def _settle(self) -> None:
        with self._router._lock:
            if not self._settled and self._load is not None:
                self._load.in_flight -= self._batch
            self._settled = True


class StageRouter:
    """Routes calls to stages of one run, with retries on other peers and temporary bans."""

    def __init__(
        self,
        node: SwarmNode,
        run_id: str,
        num_stages: int,
        request_timeout: float = 60.0,
        max_retries: int = 5,
        ban_timeout: float = 15.0,
        refresh_period: float = 2.0,
        stage_wait_timeout: float = 300.0,
        stop: Optional[threading.Event] = None,
        direct: bool = True,
    ) -> None:
        self.node, self.run_id, self.num_stages = node, run_id, num_stages
        self.direct = direct  # call peers on their direct addresses when they publish one
        self.stage_wait_timeout = stage_wait_timeout
        self.stop = stop  # set when this peer is leaving: waiting for a stage ends at once
        self._wait_logged = RateLimit(WAIT_LOG_PERIOD)  # "no live peer" lines, per stage
        self.request_timeout, self.max_retries, self.ban_timeout = request_timeout, max_retries, ban_timeout
        self.refresh_period = refresh_period
        self.stats = RouterStats()  # read by anyone; counted by this router and, through add(), its pipeline
        self.on_event: Optional[Callable[[events.SwarmEvent], None]] = None  # receives Failover events
        self.local_server: Optional[LocalStage] = None  # this peer's own stage server, called without the network
        self._peers: list[dict[str, PeerLoad]] = [{} for _ in range(num_stages)]
        self._refreshed_at = [0.0] * num_stages
        self._refreshing: set[int] = set()  # stages whose records are being read in the background
        self._refresher = ThreadPoolExecutor(1, "swarm-refresh")
        self._closed = False
        self._lock = threading.Lock()
        self._rng = random.Random()  # seeded by the OS: trainers seeded alike must not choose alike
        self._direct_client: Optional[DirectClient] = None  # created on the RPC event loop at the first direct call
        self._unreachable: dict[str, float] = {}  # peer -> until when its direct address is not tried

    # ---- peer choice ------------------------------------------------------------------------------------------------

    def refresh(self, stage: int, force: bool = False) -> None:
        """Read the records of ``stage`` from the DHT now, unless read within ``refresh_period`` (``force``: now)."""
        if not force and self._fresh(stage):
            return
        try:
            records = discovery.fetch_stage(self.node, self.run_id, stage)
        except Exception as e:  # keep routing with what we know; the next refresh tries again
            # after close() the node is going: calls still waiting read records of a DHT that shut down
            level = logging.DEBUG if self._closed else logging.WARNING
            log.log(level, "Could not read the peers of stage %d: %r", stage, e)
            return
        with self._lock:
            known = self._peers[stage]
            for peer_id in list(known):
                if peer_id not in records:
                    del known[peer_id]
            for peer_id, record in records.items():
                if peer_id in known:
                    known[peer_id].record = record
                else:
                    known[peer_id] = PeerLoad(record)
            self._refreshed_at[stage] = time.monotonic()

    def _fresh(self, stage: int) -> bool:
        return time.monotonic() - self._refreshed_at[stage] < self.refresh_period

    def _refresh_behind(self, stage: int) -> None:
        """Records of ``stage`` to choose from without waiting for the DHT: read now only if never read, else, once
        stale, read again on a thread of their own while the stale ones serve (a DHT read takes round trips to
        several peers: on a slow network, each microbatch that waited for one stalled the pipeline)."""
        if self._fresh(stage):
            return
        if not self._refreshed_at[stage]:
            self.refresh(stage)
            return
        with self._lock:
            if stage in self._refreshing:
                return
            self._refreshing.add(stage)
        try:
            self._refresher.submit(self._refresh_then_release, stage)
        except RuntimeError:  # closed: the router is leaving
            with self._lock:
                self._refreshing.discard(stage)

    def _refresh_then_release(self, stage: int) -> None:
        try:
            self.refresh(stage)
        finally:
            with self._lock:
                self._refreshing.discard(stage)

    def knows(self, stage: int, peer: str) -> bool:
        """Whether ``peer`` serves ``stage`` in the records this router last read."""
        return peer in self._peers[stage]

    def _left(self, stage: int, peer_id: str) -> bool:
        """Whether ``peer_id`` is this peer, which does not serve ``stage`` (any more: the record of the stage it
        moved from outlives the move by up to its time to live, and a call to itself over libp2p fails)."""
        server = self.local_server
        return peer_id == self._own_id and (server is None or server.stage != stage)

    def is_local(self, stage: int, peer: str) -> bool:
        """Whether ``peer`` is this peer, serving ``stage`` itself: called in-process, never over the network."""
        server = self.local_server
        return server is not None and server.stage == stage and peer == self._own_id

    @cached_property
    def _own_id(self) -> Optional[str]:
        return str(self.node.peer_id) if self.node is not None else None

    def choose(self, stage: int, batch: int, exclude: frozenset = frozenset()) -> Optional[str]:
        """A serving, unbanned peer of ``stage`` for ``batch`` more samples (see the module docstring)."""
        self._refresh_behind(stage)
        now = time.monotonic()
        with self._lock:
            usable = [
                (peer_id, load)
                for peer_id, load in self._peers[stage].items()
                if peer_id not in exclude
                and load.banned_until <= now
                and load.record.state == PeerState.SERVING
                and not self._left(stage, peer_id)
            ]
            fastest = max((load.record.throughput for _, load in usable), default=0.0) or DEFAULT_THROUGHPUT
            weights = [1.0 / load.time_to_finish(batch, load.record.throughput or fastest) for _, load in usable]
        return self._rng.choices([peer_id for peer_id, _ in usable], weights)[0] if usable else None

    # ---- calls ------------------------------------------------------------------------------------------------------

    def call(
        self,
        stage: int,
        method: str,
        tensors: list[runtime_pb2.Tensor],
        metadata: dict,
        batch: int,
        prefer: Optional[str] = None,
        check: Optional[Callable[[Reply], None]] = None,
        report: Optional[Callable[[events.Failover], None]] = None,
        wait_timeout: Optional[float] = None,
        deadline: Optional[float] = None,
        sent: Optional[PendingCall] = None,
    ) -> tuple[Reply, str]:
        """Run ``method`` of ``stage`` on some peer, failing over to others; returns the reply and the peer used.

        Peers that fail (``check`` refusing their reply included) count towards ``max_retries``; while the stage has
        no usable peer at all, or its peers answer busy (a full queue, out of memory), this waits for one (up to
        ``wait_timeout`` seconds, by default ``stage_wait_timeout``) instead. What was the caller's fault
        (``CALLERS_FAULT``) raises at once, as does a broken chain of stage-to-stage sends. A failover is reported
        to ``report`` instead of this router's counters and events, if given, and then the failed calls behind it
        are not counted here either: whoever gets the report counts them (it also hears of the last failed call
        when the call fails, as a failover ``retried_on`` no peer: ``""``). With a ``deadline`` (``time.monotonic()``),
        each attempt waits at most what is left of it, and none starts after it (:class:`TimeoutError`). ``sent``:
        the first attempt, sent already (:meth:`start_call`).
        """
        wait_timeout = self.stage_wait_timeout if wait_timeout is None else wait_timeout
        if prefer is not None and (self.is_banned(stage, prefer) or self._left(stage, prefer)):
            prefer = None
        tried: list[str] = []
        last_error: Optional[BaseException] = None
        failures, busy, waiting_since, busy_since, failed_peer = 0, 0, None, None, None
        try:
            while True:
                self._time_left(deadline, stage, last_error)  # waiting for a peer, too, ends at the deadline
                peer = prefer if failures + busy == 0 and waiting_since is None and prefer is not None else None
                peer = sent.peer if sent is not None else peer or self.choose(stage, batch, exclude=frozenset(tried))
                if peer is None:
                    self.refresh(stage, force=True)
                    peer = self.choose(stage, batch, exclude=frozenset(tried))
                if peer is None and tried:
                    # every usable peer was tried: after a pause, those not banned (e.g. busy) may be tried again
                    time.sleep(min(0.5 * 2 ** min(failures + busy - 1, 4), 5.0))
                    tried.clear()
                    peer = self.choose(stage, batch)
                if peer is None:
                    waiting_since = waiting_since or time.monotonic()
                    self._wait_for_peer(stage, waiting_since, last_error, wait_timeout)
                    continue
                # waiting_since is kept: a banned peer retried once its ban expired (a dead one, whose record has not
                # expired yet) must not restart the count towards stage_wait_timeout
                try:
                    timeout, count = self._time_left(deadline, stage, last_error), report is None
                    if sent is not None:
                        attempt, sent = sent, None
                        reply = self.finish(attempt, check, count)
                    else:
                        reply = self.call_peer(stage, peer, method, tensors, metadata, batch, check, count, timeout)
                    if last_error is not None:
                        self.failed_over(stage, method, failed_peer, peer, last_error, report)
                    return reply, peer
                except (*CALLERS_FAULT, ActivationsLostError, ChainBrokenError):
                    raise
                except StageBusyError as e:  # overloaded (queue full, out of memory): the others, then it again, later
                    last_error, failed_peer = e, peer
                    tried.append(peer)
                    busy += 1
                    busy_since = busy_since or time.monotonic()
                    if time.monotonic() - busy_since >= wait_timeout:
                        raise StageUnavailableError(
                            f"Stage {stage} of run {self.run_id!r}: its peers answered busy for "
                            f"{wait_timeout:g}s (stage_wait_timeout; last answer: {e!r})"
                        ) from None
                except Exception as e:
                    last_error, failed_peer = e, peer
                    tried.append(peer)
                    failures += 1
                    if failures > self.max_retries:
                        raise StageUnavailableError(
                            f"Stage {stage} of run {self.run_id!r}: {failures} attempts on its peers failed "
                            f"(peers tried: {tried}; last error: {e!r})"
                        ) from None
        except (StageUnavailableError, TimeoutError):
            if report is not None and failed_peer is not None and not isinstance(last_error, StageBusyError):
                report(events.Failover(stage, method, failed_peer, "", repr(last_error)))  # made up for by no peer
            raise
        finally:
            if sent is not None:  # never waited for (its deadline had passed)
                sent.cancel()

    def failed_over(
        self,
        stage: int,
        method: str,
        failed: str,
        retried_on: str,
        error: BaseException | str,
        report: Optional[Callable[[events.Failover], None]] = None,
    ) -> None:
        """Count a microbatch retried on another peer, and report it to ``on_event``; or, with ``report``, only
        to it (a stage server handing a trainer's microbatch on tells that trainer, whose failover it is)."""
        event = events.Failover(stage, method, failed, retried_on, error if isinstance(error, str) else repr(error))
        if report is not None:
            report(event)
            return
        self.stats.failovers += 1
        if self.on_event is not None:
            self.on_event(event)

    def _time_left(self, deadline: Optional[float], stage: int, last_error: Optional[BaseException]) -> float:
        """Seconds an attempt may wait for its answer: ``request_timeout``, or less if ``deadline`` is nearer;
        :class:`TimeoutError` once it passed."""
        left = self.request_timeout if deadline is None else min(self.request_timeout, deadline - time.monotonic())
        if left <= 0:
            raise TimeoutError(f"the deadline to call stage {stage} passed (last error: {last_error!r})")
        return left

    def _wait_for_peer(
        self, stage: int, since: float, last_error: Optional[BaseException], wait_timeout: Optional[float] = None
    ) -> None:
        """Sleep a little while ``stage`` has no usable peer; raise once it had none for ``wait_timeout`` seconds
        (by default ``stage_wait_timeout``)."""
        wait_timeout = self.stage_wait_timeout if wait_timeout is None else wait_timeout
        now = time.monotonic()
        waited = now - since
        if self.stop is not None and self.stop.is_set():
            raise StageUnavailableError(f"Stage {stage} of run {self.run_id!r} has no live peer; this peer is leaving")
        if waited >= wait_timeout:
            raise StageUnavailableError(
                f"Stage {stage} of run {self.run_id!r} has had no live peer for {waited:.0f}s "
                f"(stage_wait_timeout={wait_timeout:g}s): start a peer that serves stage {stage}, or "
                f"raise stage_wait_timeout (SWARM_STAGE_WAIT_TIMEOUT)"
                + (f"; last error: {last_error!r}" if last_error is not None else "")
            )
        if self._wait_logged(stage):
            log.warning(
                "Stage %d of run %r has no live peer: waiting for one to serve it (%.0fs so far, giving up after %gs)",
                stage,
                self.run_id,
                waited,
                self.stage_wait_timeout,
            )
        time.sleep(min(1.0, max(0.05, wait_timeout - waited)))

    def call_peer(
        self,
        stage: int,
        peer: str,
        method: str,
        tensors: list,
        metadata: dict,
        batch: int,
        check: Optional[Callable[[Reply], None]] = None,
        count: bool = True,
        timeout: Optional[float] = None,
    ) -> Reply:
        """One attempt on one peer; ``check`` vets its reply. A peer that fails (a bad reply included) other than by
        refusing the request, answering busy or having dropped a forward's graph is banned for a while, and its
        failure counted in :attr:`stats` unless ``count`` is False (a stage server handing on a trainer's
        microbatch: the trainer counts it, from the receipt). ``timeout``: seconds to wait for the answer, by default
        ``request_timeout``; a chained request tells the peer, which must answer within it (its ``budget``)."""
        return self.finish(self.start_call(stage, peer, method, tensors, metadata, batch, timeout), check, count)

    def start_call(
        self,
        stage: int,
        peer: str,
        method: str,
        tensors: list,
        metadata: dict,
        batch: int,
        timeout: Optional[float] = None,
        timed: bool = True,
    ) -> PendingCall:
        """:meth:`call_peer`'s request, sent without waiting for its answer: :meth:`finish` waits for it, or
        :meth:`PendingCall.cancel` gives it up (a call whose answer turned out not to be needed). Unless ``timed``,
        its time is not counted as time in calls to the stage (a call that waits beside another one)."""
        if self.direct and peer not in self._peers[stage]:
            # a peer named by someone else (the peer that kept a forward, a backward hand-on's next hop): its
            # record, unless read within the refresh period, gives its direct address (without it: libp2p)
            self.refresh(stage)
        load = self._peers[stage].get(peer)
        with self._lock:
            if load is not None:
                load.in_flight += batch
            self.stats.calls += 1
            self.stats.chosen[peer] = self.stats.chosen.get(peer, 0) + 1
            self.stats.bytes_sent += protocol.payload_bytes(tensors)
            self.stats.raw_bytes_sent += sum(compression.raw_nbytes(t) for t in tensors)
        timeout = timeout or self.request_timeout
        chained = chain_wiring.is_chained(metadata)
        if chained:
            metadata = metadata | {"budget": timeout}
        # a chained request's caller waits within a deadline of its own (the trainer's, up the chain): the direct
        # path's session and connection come out of its budget; any other call's libp2p fallback gets a whole timeout
        slack = 1.0 if chained else 1 + 2 * CONNECT_TIMEOUT
        call = PendingCall(self, stage, peer, load, batch, timeout + slack, timed)
        try:
            call.future = self.node.submit(self._request(stage, peer, method, tensors, metadata, timeout, chained))
            time.sleep(0)  # let the event loop's thread, woken to send it, take the GIL now (a request a device awaits)
        except BaseException:
            call.cancel()
            raise
        return call

    def finish(self, call: PendingCall, check: Optional[Callable[[Reply], None]] = None, count: bool = True) -> Reply:
        """The answer to a call :meth:`start_call` sent, vetted and failed as :meth:`call_peer` says."""
        try:
            reply = call.result()
        except (*CALLERS_FAULT, ActivationsLostError, StageBusyError, ChainBrokenError):
            raise
        except Exception as e:
            self.blame(call.stage, call.peer, repr(e), count)
            raise
        return self.vet(call.stage, call.peer, reply, check, count)

    def vet(
        self, stage: int, peer: str, reply: Reply, check: Optional[Callable[[Reply], None]], count: bool = True
    ) -> Reply:
        """``reply`` of ``peer`` once ``check`` passed it; if it did not, the peer is blamed (:meth:`call_peer`)."""
        if check is not None:
            try:
                check(reply)
            except Exception as e:
                self.blame(stage, peer, repr(e), count)
                raise
        return reply

    def count_failed(self, peer: str) -> None:
        """Count a failed call to ``peer`` (this router's, or one a stage server reported in a receipt)."""
        self.stats.failed[peer] = self.stats.failed.get(peer, 0) + 1

    def blame(self, stage: int, peer: str, why: str, count: bool = True) -> None:
        """Ban ``peer`` (of ``stage``) for a while, and count its failure unless ``count`` is False."""
        if count:
            self.count_failed(peer)
        self._ban(stage, peer)
        log.warning("Stage %d: peer %s failed (%s)", stage, peer, why)

    async def _request(
        self, stage: int, peer: str, method: str, tensors: list, metadata: dict, timeout: float, whole: bool = False
    ) -> list[runtime_pb2.Tensor]:
        """The peer's reply, over its direct address if it has a usable one, else over libp2p; ``whole``: both
        tries together within ``timeout`` (else the libp2p one gets a whole ``timeout`` of its own)."""
        uid, began = stage_uid(self.run_id, stage), time.monotonic()
        if self.is_local(stage, peer):
            request = DirectRequest(uid, list(tensors), protocol.encode_metadata(metadata))
            return await asyncio.wait_for(self.local_server.answer_tensors(method, request), timeout)
        load = self._peers[stage].get(peer)
        address = load.record.address if load is not None and self.direct else ""
        if address and self._unreachable.get(peer, 0.0) <= time.monotonic():
            try:
                client = self._direct_client = self._direct_client or DirectClient(
                    self.node.p2p, self.node.peer_id, self.run_id, getattr(self.node, "policy", None)
                )
                raw_metadata = protocol.encode_metadata(metadata)
                direct = client.call(peer, address, method, uid, tensors, raw_metadata, timeout)
                reply = await (asyncio.wait_for(direct, timeout) if whole else direct)
                self._count_call(direct=True)
                return reply
            except DirectUnreachable as e:
                self._mark_unreachable(peer, e)
        if whole:
            timeout -= time.monotonic() - began
            if timeout <= 0:
                raise TimeoutError(f"no time was left to call {peer} over libp2p")
        stub = StageService.get_stub(self.node.p2p, PeerID.from_base58(peer), namespace=self.run_id)
        metadata, tensors = self._with_token(metadata, peer), [compression.to_message(t) for t in tensors]
        reply, _ = await protocol.call(stub, method, uid, tensors, metadata, timeout)
        self._count_call(direct=False)
        return reply

    def _count_call(self, direct: bool) -> None:
        with self._lock:
            if direct:
                self.stats.direct_calls += 1
            else:
                self.stats.p2p_calls += 1

    def _mark_unreachable(self, peer: str, error: DirectUnreachable) -> None:
        """Call ``peer`` over libp2p for a while; say so once per peer."""
        if peer not in self._unreachable:
            log.warning("Calling peer %s over libp2p: its direct address cannot be used (%s)", peer, error)
        self._unreachable[peer] = time.monotonic() + UNREACHABLE_PERIOD

    def close(self) -> None:
        """Close the direct connections (the router can still call over libp2p afterwards) and stop refreshing
        records in the background."""
        self._closed = True
        self._refresher.shutdown(wait=False, cancel_futures=True)
        client, self._direct_client = self._direct_client, None
        if client is not None:
            try:
                self.node.run(client.close(), timeout=5)
            except Exception as e:  # the node may be stopping; the sockets die with the process
                log.debug("Closing the direct connections failed: %r", e)

    def _with_token(self, metadata: dict, peer: str) -> dict:
        """``metadata`` with the proof that this peer knows the swarm's secret, if the swarm has one."""
        policy = getattr(self.node, "policy", None)
        return metadata if policy is None else policy.sign_metadata(metadata, self.run_id, self.node.peer_id, peer)

    def fetch_state(self, stage: int, optimizer: bool = False) -> dict[str, torch.Tensor]:
        """:meth:`fetch_state_and_step`'s state."""
        return self.fetch_state_and_step(stage, optimizer)[0]

    def fetch_state_and_step(
        self, stage: int, optimizer: bool = False
    ) -> tuple[dict[str, torch.Tensor], Optional[int]]:
        """Download the current state dict of ``stage`` from one of its live peers (waiting up to
        ``stage_wait_timeout`` seconds for one while the stage has none). ``optimizer``: its optimizer's state dict
        instead, as ``{"optimizer": uint8 tensor}`` holding ``torch.save`` bytes. A peer that fails (busy, or
        refusing while it steps) is tried again after the others, with a growing pause, up to ``max_retries``.
        Returns the state and the optimizer step it is at (None if the peer did not say)."""

        async def download(stub, request) -> tuple[list[runtime_pb2.Tensor], dict]:
            return await protocol.receive_stream(await stub.rpc_state(request), self.request_timeout, "rpc_state")

        errors: list[str] = []
        failed: set[str] = set()  # tried since every live peer last failed
        waiting_since = None
        while len(errors) <= self.max_retries:
            peer = self.choose(stage, 1, exclude=frozenset(failed))
            if peer is None:
                self.refresh(stage, force=True)
                peer = self.choose(stage, 1, exclude=frozenset(failed))
            if peer is None and failed:  # every live peer failed once (busy, or mid-step): try them again shortly
                failed.clear()
                time.sleep(min(0.5 * 2 ** len(errors), 5.0))
                continue
            if peer is None:  # no peer serves the stage right now: wait for one, as calls do
                waiting_since = waiting_since or time.monotonic()
                self._wait_for_peer(stage, waiting_since, None)
                continue
            stub = StageService.get_stub(self.node.p2p, PeerID.from_base58(peer), namespace=self.run_id)
            metadata = protocol.encode_metadata(self._with_token({"optimizer": True} if optimizer else {}, peer))
            request = runtime_pb2.ExpertRequest(uid=stage_uid(self.run_id, stage), metadata=metadata)
            try:
                tensors, metadata = self.node.run(download(stub, request), timeout=self.request_timeout)
                step = metadata.get("step")
                state = {k: compression.deserialize(t) for k, t in zip(metadata["keys"], tensors, strict=True)}
                return state, step if isinstance(step, int) else None
            except Exception as e:
                log.warning("Stage %d: could not download state from %s: %r", stage, peer, e)
                errors.append(peer)
                failed.add(peer)
        raise StageUnavailableError(f"Could not download the state of stage {stage}: {len(errors)} attempts failed")

    def is_banned(self, stage: int, peer: str) -> bool:
        """Whether ``peer`` (of ``stage``) failed a call lately and is banned for now."""
        with self._lock:
            load = self._peers[stage].get(peer)
            return load is not None and load.banned_until > time.monotonic()

    def _ban(self, stage: int, peer: str) -> None:
        with self._lock:
            load = self._peers[stage].get(peer)
            if load is not None:
                load.failures += 1
                load.banned_until = time.monotonic() + ban_seconds(self.ban_timeout, load.failures)


def _remote_error(error: P2PHandlerError) -> Exception:
    """Turn a remote handler's error back into the kind the server raised."""
    return protocol.error_from_wire(str(error)) or error
